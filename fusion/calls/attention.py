"""The attention stage: Keras ``MultiHeadAttention``'s dot-product attention as batched MatMuls.

Keras 3 on TensorFlow computes the attention of projected ``[B, T, N, H]`` heads with two
``Einsum`` ops (``BTNH,BSNH->BNTS`` and back), whose kernel and whose gradients (more Einsums)
transpose their operands on every call. This stage emits the same arithmetic as ``Transpose``
+ ``BatchMatMulV2`` (the key transposed into the MatMul), which TensorFlow's remapper can also
fuse with the score scale where oneDNN is on, in one of the forms the tuner picks per call:

- ``bmm``: Keras's order exactly: logits in the compute dtype, cast to float32, times the scale,
  Keras's own masking (``_apply_masks``: the attention mask and ``use_causal_mask``; a causal
  mask alone added instead of selected, :func:`mask_adder`, which oneDNN's pass fuses with the
  MatMul and the scale into ``_MklFusedBatchMatMulV2``), softmax in float32, cast back, the
  second MatMul;
- ``bmm folded``: the scale folded into the query before the first MatMul (half the
  multiplications at T = S = 2H, and none on the float32 scores forward or backward; one
  rounding moved in float32, one added in 16 bit: the scaled query's);
- ``bmm folded bf16 softmax`` (bfloat16, no mask, on a cpu whose bfloat16 softmax gives the
  bits of Keras's float32 one: oneDNN's, :func:`bfloat16_softmax_exact`): the folded form
  with the softmax read and written in bfloat16, no float32 copies of the scores and the
  probabilities, and its gradient one XLA region from the bfloat16 probabilities (one more
  bfloat16 rounding in the gradient: of the probabilities it reads), which spares the softmax
  forward and backward two float32 passes over the scores.

Where XLA may run (cpu, cuda) and the layer has no dropout, Keras's attention compiled by XLA as
one region (``fusion.stage.xla_region``: scores, mask, softmax and the weighted sum fused, its
gradient compiled too) is one more candidate.

``keras.ops.dot_product_attention`` called by a layer of the user's own goes through the same
forms (its TensorFlow core, ``_dot_product_attention_xla``, is routed: bias, mask, causal mask,
grouped heads and a given scale as Keras computes them; report labels ``dot_product_attention``).

A layer with dropout keeps Keras's other path (query scaled, ``_masked_softmax``, its dropout
layer on the scores) with the Einsums replaced by the same MatMuls and the mask added before
Keras's softmax instead of selected (the masked probabilities zeroed after it as Keras does,
unless the mask is a causal one alone), so the dropout layer draws
its random mask from the same seed stream at the same point: the streams stay the stock ones.
Declined, with the reason in the report: ``return_attention_scores=True``, attention over
other axes than the sequence (``attention_axes``), ``flash_attention``, float64.

Example:
    >>> import numpy as np, tensorflow as tf
    >>> from fusion import private_api
    >>> from fusion.calls.attention import attention
    >>> _dot_product_attention_xla = private_api.get("keras.dot_product_attention_xla")
    >>> q, k, v = (tf.random.normal([2, 5, 3, 4], seed=s) for s in (1, 2, 3))
    >>> expected = _dot_product_attention_xla(q, k, v, None, None, True, 0.5)
    >>> got = attention(q, k, v, None, True, 0.5, folded=False)
    >>> bool(np.allclose(got, expected, atol=1e-6))
    True
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from fusion import private_api
from fusion.family import OBSERVED_AFTER, OBSERVED_ORDER, Family, Form, Forms, conservative, declare
from fusion.stage import (
    XLA,
    XLA_CALLS,
    CallSite,
    Hook,
    StageContext,
    rewrite_call,
    timed_form,
    widened,
    with_xla,
    xla_region,
)

# -- match: the Keras calls it hooks, and what it finds in them -----------------------------------
FAMILY = "attention"
SCOPE = "tfmx_attention"
MATCHES = ("keras.src.layers.attention.multi_head_attention:MultiHeadAttention._compute_attention",
           # keras.ops.dot_product_attention's TensorFlow core, a module function
           "keras.src.backend.tensorflow:nn._dot_product_attention_xla")
"""The Keras calls the stage hooks: a ``MultiHeadAttention``'s attention of its projected
heads, and ``keras.ops.dot_product_attention``'s."""


# -- check: why a call keeps Keras's own form (None: it need not) ---------------------------------
def check(layer: Any, query: Any, return_scores: bool) -> str | None:
    """Why this ``MultiHeadAttention`` call keeps Keras's Einsums, or None if the stage can
    emit its form.

    >>> import keras
    >>> mha = keras.layers.MultiHeadAttention(2, 3)
    >>> _ = mha(tf.zeros([2, 5, 4]), tf.zeros([2, 5, 4]))
    >>> heads = tf.zeros([2, 5, 2, 3])
    >>> check(mha, heads, False) is None, check(mha, heads, True)
    (True, 'return_attention_scores=True (Keras returns the scores it computes)')
    """
    if return_scores:
        return "return_attention_scores=True (Keras returns the scores it computes)"
    if getattr(layer, "_flash_attention", None):
        return "flash_attention=True"
    if len(query.shape) != 4 or tuple(layer._attention_axes) != (1,):  # noqa: SLF001
        return "attention over axes other than the sequence (attention_axes)"
    if query.dtype.name not in ("float32", "float16", "bfloat16"):
        return f"compute dtype {query.dtype.name}"
    return None


def check_dot_product(query: Any) -> str | None:
    """Why this ``dot_product_attention`` call keeps Keras's Einsums, or None.

    >>> check_dot_product(tf.zeros([1, 2, 1, 4])), check_dot_product(tf.zeros([1], tf.float64))
    (None, 'compute dtype float64')
    """
    name = query.dtype.name
    return None if name in ("float32", "float16", "bfloat16") else f"compute dtype {name}"


# -- forms: what it emits (CONSERVATIVE: the form Keras runs), and the hook's flow ----------------
CONSERVATIVE = conservative("einsum", "Keras's Einsums")
_BMMS = frozenset({"BatchMatMulV2", "BatchMatMulV3"})
_BMM = frozenset({"BatchMatMulV2", "Transpose"})
BMM = Form("bmm", "MultiHeadAttention: Transpose + BatchMatMulV2 in place of Einsum",
           marks=_BMMS, emits=_BMM)
BMM_FOLDED = Form("bmm folded", "MultiHeadAttention: Transpose + BatchMatMulV2, scale folded "
                                "into the query", marks=_BMMS, emits=_BMM | {"Mul"})
SOFTMAX_16 = Form(
    "bmm folded bf16 softmax", "MultiHeadAttention: Transpose + BatchMatMulV2, scale folded into "
                               "the query, softmax on the bfloat16 scores (float32 sums: Keras's "
                               "bits), its gradient one XLA-compiled region",
    marks=_BMMS, emits=_BMM | {"Mul", "Softmax"})
"""The folded form, the softmax read and written in bfloat16."""
BMM_DROPOUT = Form("bmm dropout", "MultiHeadAttention (dropout): Transpose + BatchMatMulV2 in "
                                  "place of Einsum, Keras's masked softmax and dropout layer",
                   marks=_BMMS, emits=_BMM | {"Mul", "SelectV2", "Softmax"})
REGION = Form(XLA, "MultiHeadAttention: Keras's attention as one XLA-compiled region (forward "
                   "and gradient)", marks=XLA_CALLS)
SDPA_BMM = Form("sdpa bmm", "dot_product_attention: Transpose + BatchMatMulV2 in place of "
                            "Einsum", marks=_BMMS, emits=BMM.emits)
SDPA_FOLDED = Form("sdpa bmm folded", "dot_product_attention: Transpose + BatchMatMulV2, scale "
                                      "folded into the query",
                   marks=_BMMS, emits=BMM_FOLDED.emits)
SDPA_REGION = Form("sdpa xla", "dot_product_attention: one XLA-compiled region (forward and "
                               "gradient)", marks=XLA_CALLS)
FORMS = Forms(SCOPE, (CONSERVATIVE, BMM, BMM_FOLDED, SOFTMAX_16, BMM_DROPOUT, REGION, SDPA_BMM,
                      SDPA_FOLDED, SDPA_REGION))
"""Every form, emitted under ``tfmx_attention_<form>``: the ops that show its kernel in a
traced graph (its batched MatMuls, or the call of its XLA region) and the ops a batched-MatMul
form emits in the call's dtype (an XLA region emits none a plugin's table names): a backend
without one of them in that dtype keeps Keras's Einsums."""


def _heads_first(x: tf.Tensor) -> tf.Tensor:
    return tf.transpose(x, [0, 2, 1, 3])  # [B, T, N, H] -> [B, N, T, H]


def mask_adder(keep: tf.Tensor, large_negative: tf.Tensor) -> tf.Tensor:
    """``0`` where ``keep`` (a boolean mask, as small as it broadcasts: ``[1, 1, T, S]`` for
    :func:`causal_band`) keeps a score and ``large_negative`` where it masks one: added to the
    scores in place of Keras's ``where(mask, scores, large_negative)`` over the full
    ``[B, N, T, S]`` (for which Keras first builds a full boolean tensor). Kept scores are
    unchanged (``s + 0``); a masked one becomes ``large_negative + s``, whose exponential
    after the row's maximum is subtracted is 0 as Keras's is, so the softmax and its gradient
    are the same for every row with a kept score, and oneDNN's graph pass can fuse the add
    into the batched MatMul (``_MklFusedBatchMatMulV2``). A row masked entirely would differ
    in its gradient (an add passes one, Keras's select none): callers use the adder where no
    row can be (a causal mask alone) or zero such rows' probabilities after the softmax, as
    Keras's ``Softmax`` layer does.

    >>> adder = mask_adder(causal_band(3, 3), tf.constant(-1e9))
    >>> adder.shape.as_list(), adder.numpy()[0, 0, 0].tolist()
    ([1, 1, 3, 3], [0.0, -1000000000.0, -1000000000.0])
    """
    return tf.where(keep, tf.zeros([], large_negative.dtype), large_negative)


def causal_band(queries: Any, keys: Any) -> tf.Tensor:
    """Keras's causal mask as ``[1, 1, T, S]`` booleans: query ``t`` sees keys ``s <= t``."""
    band = tf.linalg.band_part(tf.ones(tf.stack([queries, keys]), tf.bool), -1, 0)
    return band[None, None, :, :]


@functools.cache
def bfloat16_softmax_exact() -> bool:
    """Whether this process's softmax of bfloat16 scores gives the bits of Keras's (the scores
    cast to float32, softmax, cast back), probed once on [4, 64, 64] random scores in a
    ``tf.function`` as a step runs it: oneDNN's kernel (``_MklSoftmax``, where TensorFlow's
    oneDNN pass is on) sums in float32 and rounds once, Eigen's rounds every op to bfloat16
    (up to 18 units in the last place apart with oneDNN off).

    >>> isinstance(bfloat16_softmax_exact(), bool)
    True
    """
    with tf.init_scope():
        scores = tf.cast(tf.random.stateless_normal([4, 64, 64], (1, 2)) * 4.0, tf.bfloat16)
        both = tf.function(lambda s: (tf.nn.softmax(s, -1), tf.cast(
            tf.nn.softmax(tf.cast(s, tf.float32), -1), tf.bfloat16)))
        narrow, keras = both(scores)
        return bool(tf.reduce_all(tf.equal(tf.bitcast(narrow, tf.uint16),
                                           tf.bitcast(keras, tf.uint16))))


def _softmax_gradient(dprobs: tf.Tensor, probs: tf.Tensor) -> tf.Tensor:
    """Softmax's gradient ``(dp - sum(dp * p)) * p`` in float32 from bfloat16 ``dprobs`` and
    ``probs``, rounded to bfloat16 (an XLA region's body: inputs widened, output rounded, by
    integer operations where a module contributes them: ``fusion.forms.RegionEdges``)."""
    dp, p = widened(dprobs), widened(probs)
    return tf.cast((dp - tf.reduce_sum(dp * p, -1, keepdims=True)) * p, tf.bfloat16)


def bfloat16_softmax(scores: tf.Tensor) -> tf.Tensor:
    """Softmax over the last axis of bfloat16 ``scores`` read and written in bfloat16: where
    :func:`bfloat16_softmax_exact`, the bits of Keras's float32 softmax cast back, without the
    float32 copies of the scores and probabilities. Its gradient is one XLA region computing
    TensorFlow's softmax gradient in float32 from the bfloat16 probabilities (Keras's reads
    them in float32: one more bfloat16 rounding, of the probabilities, in the gradient)."""
    from fusion.stage import custom_gradient

    region = xla_region(_softmax_gradient, bfloat16_bits=True)

    @custom_gradient
    def softmax(scores: tf.Tensor) -> Any:
        probs = tf.nn.softmax(scores, axis=-1)
        return probs, lambda dprobs: region(dprobs, probs)

    return softmax(scores)


def attention(query: tf.Tensor, key: tf.Tensor, value: tf.Tensor, mask: Any, causal: bool,
              scale: Any, folded: bool = False, bias: Any = None,
              narrow_softmax: bool = False) -> tf.Tensor:
    """Keras's ``dot_product_attention`` of ``[B, T, N, H]`` heads (mask ``[B, N, T, S]``
    broadcastable, or None; ``bias`` added to the scaled logits, or None), as batched MatMuls;
    ``folded`` scales the query instead of the logits. A causal mask alone is added
    (:func:`mask_adder`), so the scale, bias and mask follow the MatMul as Mul and Add; other
    masks go through Keras's ``_apply_masks`` (a row masked entirely would get a gradient
    through an add, where Keras's select gives it none). ``narrow_softmax`` (folded bfloat16
    scores, no mask, no bias) takes :func:`bfloat16_softmax`."""
    _apply_masks = private_api.get("keras.apply_masks")
    _get_large_negative = private_api.get("keras.get_large_negative")

    dtype = query.dtype
    if folded:
        query = query * tf.cast(scale, dtype)
    logits = tf.matmul(_heads_first(query), _heads_first(key), transpose_b=True)
    if narrow_softmax:
        if not folded or mask is not None or causal or bias is not None or \
                dtype != tf.bfloat16:
            raise ValueError("the bfloat16 softmax takes folded bfloat16 scores without a "
                             "mask or a bias")
        return _heads_first(tf.matmul(bfloat16_softmax(logits), _heads_first(value)))
    logits = tf.cast(logits, tf.float32)  # Keras: logits in at least float32
    if not folded:
        logits = logits * tf.cast(scale, tf.float32)
    if bias is not None:
        logits = logits + tf.cast(bias, logits.dtype)
    if mask is None and causal:
        shape = tf.shape(logits)
        logits = logits + mask_adder(causal_band(shape[2], shape[3]),
                                     _get_large_negative(logits.dtype))
    else:
        logits = _apply_masks(logits, mask, causal)
    probs = tf.cast(tf.nn.softmax(logits, axis=-1), key.dtype)
    return _heads_first(tf.matmul(probs, _heads_first(value)))


def _expanded_mask(layer: Any, mask: Any) -> Any:
    """Keras's dot-product path: the [B, T, S] mask as a boolean [B, 1, T, S] (or None)."""
    if mask is None:
        return None
    axis = -len(layer._attention_axes) * 2 - 1  # noqa: SLF001 - Keras's own rule
    for _ in range(4 - len(mask.shape)):
        mask = tf.expand_dims(mask, axis)
    return tf.cast(mask, tf.bool)


def _with_dropout(layer: Any, query: Any, key: Any, value: Any, mask: Any, training: Any,
                  causal: bool) -> tf.Tensor:
    """Keras's explicit-scores path (a layer with dropout), its Einsums as batched MatMuls."""
    given = mask
    if causal:
        causal_mask = layer._compute_causal_mask(query, value)  # noqa: SLF001
        mask = causal_mask if mask is None else tf.logical_and(tf.cast(mask, tf.bool),
                                                               causal_mask)
    query = query * tf.cast(layer._inverse_sqrt_key_dim, query.dtype)  # noqa: SLF001
    scores = tf.matmul(_heads_first(query), _heads_first(key), transpose_b=True)
    scores = _masked_softmax(layer, scores, mask, causal_only=causal and given is None)
    scores = layer._dropout_layer(scores, training=training)  # noqa: SLF001
    return _heads_first(tf.matmul(scores, _heads_first(value)))


def _masked_softmax(layer: Any, scores: tf.Tensor, mask: Any, causal_only: bool) -> tf.Tensor:
    """Keras's ``layer._masked_softmax`` (its ``Softmax`` layer with the mask) with the mask
    added (:func:`mask_adder`, Keras's ``Softmax`` large negative) instead of selected. Keras
    then zeroes the masked probabilities (a row masked entirely would be uniform); a causal
    mask alone masks no row entirely, and its masked probabilities are already 0, so that
    select is left out there."""
    _large_negative_number = private_api.get("keras.large_negative_number")

    if mask is None:
        return layer._masked_softmax(scores, None)  # noqa: SLF001
    for _ in range(len(scores.shape) - len(mask.shape)):  # Keras's expansion, heads axis
        mask = tf.expand_dims(mask, -len(layer._attention_axes) * 2 - 1)  # noqa: SLF001
    keep = mask if mask.dtype == tf.bool else mask > tf.cast(0.5, mask.dtype)
    large_negative = tf.constant(_large_negative_number(scores.dtype), scores.dtype)
    probs = layer._softmax(scores + mask_adder(keep, large_negative))  # noqa: SLF001
    return probs if causal_only else tf.where(keep, probs, tf.zeros([], probs.dtype))


def _forms(ctx: StageContext, layer: Any, query: Any, unmasked: bool) -> list[Form]:
    """The forms of this call: with dropout, Keras's path with MatMuls; else the batched
    MatMuls, scale folded or not, and, for unmasked bfloat16 on a cpu whose bfloat16 softmax
    gives Keras's bits and where XLA may run (its gradient's region), the folded form with the
    softmax in bfloat16 (:data:`SOFTMAX_16`)."""
    if layer._dropout > 0.0:  # noqa: SLF001
        return [BMM_DROPOUT]
    narrow = unmasked and query.dtype == tf.bfloat16 and ctx.xla and \
        ctx.target.name == "cpu" and bfloat16_softmax_exact()
    return [BMM, BMM_FOLDED, *([SOFTMAX_16] if narrow else [])]


def _emit(form: Form, layer: Any, query: Any, key: Any, value: Any, mask: Any, training: Any,
          causal: bool) -> tf.Tensor:
    if form == BMM_DROPOUT:
        return _with_dropout(layer, query, key, value, mask, training, causal)
    return attention(query, key, value, _expanded_mask(layer, mask), causal,
                     layer._inverse_sqrt_key_dim,  # noqa: SLF001
                     folded=form in (BMM_FOLDED, SOFTMAX_16), narrow_softmax=form == SOFTMAX_16)


def _candidates(ctx: StageContext, layer: Any, original: Callable, shapes: list,
                dtype: tf.DType, causal: bool, forms: list[Form]) -> dict:
    """Keras's attention and ``forms``, forward + backward at the call's shapes (no mask);
    without dropout (whose random stream XLA would not reproduce), Keras's attention compiled
    by XLA as one region where XLA may run."""

    def forward(form: Form | None) -> Callable[..., Any]:
        def run(q: Any, k: Any, v: Any) -> Any:
            with _stand_in_seed(layer):
                if form is None:
                    return original(layer, q, k, v, None, True, False, causal)[0]
                return _emit(form, layer, q, k, v, None, True, causal)

        return run

    timed = {name: timed_form(forward(form), shapes, dtype)
             for name, form in ((CONSERVATIVE.name, None), *((f.name, f) for f in forms))}
    if BMM_DROPOUT in forms:
        return timed
    return with_xla(ctx, timed, xla_region(forward(None)), shapes, dtype)


@contextlib.contextmanager
def _stand_in_seed(layer: Any) -> Iterator[None]:
    """While a tuner candidate is traced in a function of its own: the layer's dropout draws
    its mask from a fixed seed (the same kernels), never from the layer's seed generator, whose
    state each timed run would move on (the training's random stream would no longer be the
    stock one). A :func:`fusion.patches.temporarily` swap, undone on the way out."""
    from fusion import patches

    dropout = getattr(layer, "_dropout_layer", None)
    if dropout is None or not hasattr(dropout, "seed_generator"):
        yield
        return
    with patches.temporarily(dropout, "seed_generator", 1):
        yield


def _xla(layer: Any, original: Callable, query: Any, key: Any, value: Any, mask: Any,
         training: Any, causal: bool) -> tf.Tensor:
    """Keras's attention (no dropout) as one XLA-compiled region."""

    def region(q: Any, k: Any, v: Any, *m: Any) -> Any:
        return original(layer, q, k, v, m[0] if m else None, training, False, causal)[0]

    masks = () if mask is None else (mask,)
    return xla_region(region)(query, key, value, *masks)


def fused_attention(ctx: StageContext, original: Callable, layer: Any, query: Any, key: Any,
                    value: Any, attention_mask: Any = None, training: Any = None,
                    return_attention_scores: bool = False, use_causal_mask: bool = False) -> Any:
    """``MultiHeadAttention._compute_attention`` while tfmx traces (the stage's handler)."""
    causal = bool(use_causal_mask)

    def keras() -> Any:
        return original(layer, query, key, value, attention_mask, training,
                        return_attention_scores, use_causal_mask)

    if not tf.inside_function():
        return keras()
    why = check(layer, query, return_attention_scores)

    def signature() -> str:
        from fusion.fragment import shape_text

        return (f"attention q {shape_text(query.shape)} kv {shape_text(key.shape)} "
                f"{query.dtype.name} causal={causal} "
                f"dropout={layer._dropout > 0.0}")  # noqa: SLF001

    def emit(form: Form) -> Any:
        if form == REGION:
            return _xla(layer, original, query, key, value, attention_mask, training,
                        causal), None
        return _emit(form, layer, query, key, value, attention_mask, training, causal), None

    forms = [] if why else _forms(ctx, layer, query, attention_mask is None and not causal)
    return rewrite_call(ctx, CallSite(
        DECLARED, tuple(forms), keras=keras, emit=emit, what="MultiHeadAttention", why=why,
        dtype=query.dtype, signature=signature, candidates=lambda: _candidates(
            ctx, layer, original, [t.shape for t in (query, key, value)], query.dtype, causal,
            forms)))


def fused_dot_product_attention(ctx: StageContext, original: Callable, query: Any, key: Any,
                                value: Any, bias: Any, mask: Any, is_causal: bool,
                                scale: Any) -> Any:
    """``keras.ops.dot_product_attention``'s core on TensorFlow (``_dot_product_attention_xla``
    of ``keras.src.backend.tensorflow.nn``, called with ``[B, T, N, H]`` heads of one dtype,
    grouped heads already repeated, the scale resolved) while tfmx traces: the batched-MatMul
    forms (or one XLA region) where the tuner measures them faster than its Einsums."""

    def keras(*args: Any) -> Any:
        q, k, v = args or (query, key, value)
        return original(q, k, v, bias, mask, is_causal, scale)

    if not tf.inside_function():
        return keras()
    why = check_dot_product(query)
    forms = () if why else (SDPA_BMM, SDPA_FOLDED)

    def form_of(form: Form) -> Callable[..., Any]:
        if form == SDPA_REGION:
            return xla_region(keras)
        return lambda q, k, v: attention(q, k, v, mask, bool(is_causal), scale,
                                         folded=form == SDPA_FOLDED, bias=bias)

    def signature() -> str:
        from fusion.fragment import shape_text

        return (f"dot_product_attention q {shape_text(query.shape)} kv "
                f"{shape_text(key.shape)} {query.dtype.name} causal={bool(is_causal)} "
                f"bias={bias is not None} mask={mask is not None}")

    def candidates() -> dict:
        shapes = [t.shape for t in (query, key, value)]
        timed = {CONSERVATIVE.name: timed_form(keras, shapes, query.dtype),
                 **{f.name: timed_form(form_of(f), shapes, query.dtype) for f in forms}}
        return with_xla(ctx, timed, xla_region(keras), shapes, query.dtype,
                        name=SDPA_REGION.name)

    return rewrite_call(ctx, CallSite(
        DECLARED, forms, keras=keras, emit=lambda form: form_of(form)(query, key, value),
        what="dot_product_attention", why=why, dtype=query.dtype, signature=signature,
        candidates=candidates))


# -- declaration ----------------------------------------------------------------------------------
DECLARED = declare(Family(
    FAMILY,
    "Keras MultiHeadAttention's dot-product attention and keras.ops.dot_product_attention -> "
    "Transpose + BatchMatMulV2 (scale folded, or one XLA region, where measured faster), "
    "Keras's masks, softmax and dropout stream unchanged",
    hooks=(Hook.on(MATCHES[0], fused_attention),
           Hook.on(MATCHES[1], fused_dot_product_attention)),
    forms=FORMS,
    after=OBSERVED_AFTER, order=OBSERVED_ORDER,
))
