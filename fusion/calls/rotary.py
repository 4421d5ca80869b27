"""The rotary stage: keras_hub's rotary position embedding applied with its halves swapped.

keras_hub's ``RotaryEmbedding`` (and its subclasses: Llama's, Mistral's, Qwen's, Gemma's
attention layers use it on every query and key) applies ``x * cos + rotate_half(x) * sin``,
``rotate_half(x) = [-x2, x1]`` for the halves ``x1, x2`` of the feature axis, built as a
``Split``, a ``Neg``, a ``Pack`` and a reshape: six ops forward and, in the gradient, an
``Unpack``, a ``Neg`` and a ``ConcatV2`` besides the products. The tables ``cos`` and ``sin``
are constants where the sequence length is known when traced (Grappler folds them), so what
runs every step is that application. This stage writes it with the sign moved into the table:
``rotate_half(x) * sin = swap(x) * [-sin1, sin2]`` (``swap(x) = [x2, x1]``: a rotation by half
the axis), so the value is ``x * cos + swap(x) * sin'``, the same products and the same sum
(negation is exact: Keras's bits), and its gradient is the rotation's transpose in closed form,
``dy * cos + swap(dy * sin')``, which autodiff derives from the forms:

- ``roll``: ``swap`` as one ``Roll`` by half the feature axis (its gradient a ``Roll`` back);
- ``swap concat``: ``swap`` as a ``ConcatV2`` of the two halves (for a backend without
  ``Roll``, as tensorflow-metal 1.2.0);
- ``xla`` (cpu and cuda where XLA may run): Keras's application as one XLA region.

Each call is a tuner decision (forward and backward at its shapes) against Keras's own
application, the conservative form. Declined, with the reason in the report: a feature axis of
unknown or odd size, inputs that are not float32, float16 or bfloat16.

Example:
    >>> import numpy as np, tensorflow as tf
    >>> from fusion.calls.rotary import rotated
    >>> x = tf.random.normal([2, 5, 3, 8], seed=1)
    >>> angle = tf.random.normal([1, 5, 1, 8], seed=2)
    >>> c, s = tf.cos(angle), tf.sin(angle)
    >>> x1, x2 = tf.split(x, 2, axis=-1)
    >>> keras_hub_way = x * c + tf.concat([-x2, x1], -1) * s
    >>> bool(np.array_equal(rotated(x, c, s, roll=True), keras_hub_way))
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from fusion.family import OBSERVED_AFTER, OBSERVED_ORDER, Family, Form, Forms, conservative, declare
from fusion.stage import (
    XLA,
    XLA_CALLS,
    CallSite,
    Hook,
    StageContext,
    rewrite_call,
    timed_form,
    with_xla,
    xla_region,
)

# -- match: the Keras call it hooks, and what it finds in it --------------------------------------
FAMILY = "rotary"
SCOPE = "tfmx_rotary"
MATCHES = ("keras_hub.src.layers.modeling.rotary_embedding:RotaryEmbedding._apply_rotary_pos_emb",)
"""The keras_hub call the stage hooks: a ``RotaryEmbedding``'s application of its tables."""


# -- check: why a call keeps Keras's own form (None: it need not) ---------------------------------
def check(x: Any, cos: Any, sin: Any) -> str | None:
    """Why this rotary embedding keeps keras_hub's application, or None.

    >>> check(tf.zeros([2, 5, 8]), tf.zeros([1, 5, 8]), tf.zeros([1, 5, 8])) is None
    True
    >>> check(tf.zeros([2, 5, 7]), tf.zeros([1, 5, 7]), tf.zeros([1, 5, 7]))
    'a feature axis of odd or unknown size'
    """
    if any(not tf.is_tensor(t) for t in (x, cos, sin)):
        return "tables that are not tensors"
    if x.dtype.name not in ("float32", "float16", "bfloat16"):
        return f"input dtype {x.dtype.name}"
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        return "tables of another dtype than the input"
    if x.shape.rank is None or x.shape[-1] is None or x.shape[-1] % 2:
        return "a feature axis of odd or unknown size"
    if sin.shape.rank is None or sin.shape[-1] != x.shape[-1]:
        return "a sine table whose last axis is not the feature axis"
    return None


# -- forms: what it emits (CONSERVATIVE: the form Keras runs), and the hook's flow ----------------
CONSERVATIVE = conservative("rotate half", "keras_hub's rotate_half application")
ROLL = Form("roll", "RotaryEmbedding: x * cos + Roll(x) * sin with the sign in the table",
            marks=frozenset({"Roll"}),
            emits=frozenset({"Roll", "Mul", "AddV2", "ConcatV2", "Neg", "StridedSlice"}))
SWAP = Form("swap concat", "RotaryEmbedding: x * cos + swapped halves * sin with the sign in "
                           "the table", marks=frozenset({"ConcatV2"}),
            emits=frozenset({"ConcatV2", "Mul", "AddV2", "Neg", "StridedSlice"}))
REGION = Form(XLA, "RotaryEmbedding: keras_hub's application as one XLA-compiled region "
                   "(forward and gradient)", marks=XLA_CALLS)
FORMS = Forms(SCOPE, (CONSERVATIVE, ROLL, SWAP, REGION))
"""Every form, emitted under ``tfmx_rotary_<form>``."""


def _swap(x: tf.Tensor, roll: bool) -> tf.Tensor:
    half = x.shape[-1] // 2
    if roll:
        return tf.roll(x, half, axis=-1)
    return tf.concat([x[..., half:], x[..., :half]], axis=-1)


def rotated(x: tf.Tensor, cos: tf.Tensor, sin: tf.Tensor, roll: bool = True) -> tf.Tensor:
    """``x * cos + rotate_half(x) * sin`` as ``x * cos + swap(x) * [-sin1, sin2]``: the same
    products and sum (the sign moved onto the table, exactly), ``swap`` a ``Roll`` by half the
    feature axis (``roll``) or a concatenation of the halves."""
    half = x.shape[-1] // 2
    signed = tf.concat([-sin[..., :half], sin[..., half:]], axis=-1)
    return x * cos + _swap(x, roll) * signed


def fused_rotary(ctx: StageContext, original: Callable, layer: Any, tensor: Any, cos_emb: Any,
                 sin_emb: Any) -> Any:
    """``RotaryEmbedding._apply_rotary_pos_emb`` while tfmx traces (the stage's handler)."""
    def keras() -> Any:
        return original(layer, tensor, cos_emb, sin_emb)

    if not tf.inside_function():
        return keras()
    why = check(tensor, cos_emb, sin_emb)
    forms = [] if why else [ROLL, SWAP]

    def stock(x: Any, c: Any, s: Any) -> Any:
        return original(layer, x, c, s)

    def emit(form: Form) -> Any:
        if form == REGION:
            return xla_region(stock)(tensor, cos_emb, sin_emb)
        return rotated(tensor, cos_emb, sin_emb, roll=form == ROLL)

    def signature() -> str:
        from fusion.fragment import shape_text

        return (f"rotary x {shape_text(tensor.shape)} tables {shape_text(cos_emb.shape)} "
                f"{tensor.dtype.name}")

    def candidates() -> dict:
        # the tables as inputs the gradient does not reach (the step's are constants)
        def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
            return lambda x, c, s: fn(x, tf.stop_gradient(c), tf.stop_gradient(s))

        shapes = [t.shape for t in (tensor, cos_emb, sin_emb)]
        found = {CONSERVATIVE.name: timed_form(timed(stock), shapes, tensor.dtype),
                 **{f.name: timed_form(timed(lambda x, c, s, f=f: rotated(x, c, s, f == ROLL)),
                                       shapes, tensor.dtype) for f in forms}}
        return with_xla(ctx, found, timed(xla_region(stock)), shapes, tensor.dtype)

    return rewrite_call(ctx, CallSite(
        DECLARED, tuple(forms), keras=keras, emit=emit, what="RotaryEmbedding", why=why,
        dtype=tensor.dtype, signature=signature, candidates=candidates))


# -- declaration ----------------------------------------------------------------------------------
DECLARED = declare(Family(
    FAMILY,
    "keras_hub RotaryEmbedding's x * cos + rotate_half(x) * sin -> x * cos + swap(x) * sin' "
    "(a Roll or a concatenation of the halves, the sign in the table; or one XLA region)",
    hooks=(Hook.on(MATCHES[0], fused_rotary),),
    forms=FORMS,
    after=OBSERVED_AFTER, order=OBSERVED_ORDER,
))
