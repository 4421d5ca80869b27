"""The grouped_attention stage: grouped- and multi-query attention without repeated keys and values.

Grouped-query attention (keras_hub's Llama, Mistral, Qwen and Gemma attention layers, Keras's
``GroupQueryAttention``) projects ``kv`` key/value heads for ``kv * g`` query heads and, before
its scores, repeats each key and value head ``g`` times (``keras.ops.repeat(key, g, axis=2)``):
two tensors ``g`` times the size of the projections, written every step, read by the scores'
and the output's contractions, and their gradients summed back over the groups. This stage
remembers every ``keras.ops.repeat`` of the traced step (its input, count and axis, in the
trace's slot, ``fusion.trace_state.slot``), and where a two-operand ``keras.ops.einsum`` or a
``keras.ops.dot_product_attention`` reads a repeated tensor, emits the same contraction over
the un-repeated one: the other operand's head axis split into ``[kv, g]`` (a reshape: repeat
maps head ``v * g + r`` to key/value head ``v``), the contraction over ``[..., kv, g, ...]``
against ``[..., kv, ...]``, and the result's ``[kv, g]`` merged back. Nothing reads the
repeated tensor any more, so it is pruned from the step, and the contraction's own gradient
sums the key's and value's over the groups. Scores, masks (causal, padding, the mask a
keras_hub layer passes), softmax and casts stay Keras's, between the two contractions.

Forms, measured by the tuner per call (forward and backward at its shapes) against Keras's
repeat and contraction, the conservative form:

- ``grouped bmm`` (``sdpa grouped bmm`` for ``dot_product_attention``): the contraction as
  ``Transpose`` + ``BatchMatMulV2`` (the batch and key/value-head axes the MatMul's batch, the
  groups folded into its rows: one MatMul of ``g`` times the rows per key/value head);
- ``grouped einsum`` (``sdpa grouped einsum``): the grouped equation as one ``Einsum``.

Declined, with the reason in the report: an einsum of other than two operands of one floating
dtype, an ellipsis or a label twice in one operand, both operands repeated, a repeated axis
the other operand does not share or whose size is not known when traced, a repeat count that
is not a Python integer, ``flash_attention`` or ``attn_logits_soft_cap``. Calls that read no
repeated tensor are Keras's and not counted.

Example:
    >>> import numpy as np, tensorflow as tf
    >>> from fusion.calls.grouped_attention import grouped_contraction
    >>> q = tf.random.normal([2, 5, 4, 3], seed=1)   # [batch, tokens, 4 query heads, dim]
    >>> k = tf.random.normal([2, 6, 2, 3], seed=2)   # 2 key/value heads
    >>> expected = tf.einsum("bquh,bkuh->buqk", q, tf.repeat(k, 2, axis=2))
    >>> got = grouped_contraction("bquh,bkuh->buqk", (q, k), 1, 2, 2, bmm=True)
    >>> got.shape.as_list(), bool(np.allclose(got, expected, atol=1e-5))
    ([2, 4, 5, 6], True)
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from fusion import private_api, trace_state
from fusion.family import OBSERVED_AFTER, OBSERVED_ORDER, Family, Form, Forms, conservative, declare
from fusion.stage import CallSite, Hook, StageContext, rewrite_call, timed_form

# -- match: the Keras calls it hooks, and what it finds in them -----------------------------------
FAMILY = "grouped_attention"
SCOPE = "tfmx_grouped_attention"
MATCHES = ("keras.src.backend.tensorflow:numpy.repeat",
           "keras.src.backend.tensorflow:numpy.einsum",
           "keras.src.backend.tensorflow:nn.dot_product_attention")
"""The Keras calls the stage hooks: ``keras.ops.repeat`` (remembered, never rewritten),
``keras.ops.einsum`` and ``keras.ops.dot_product_attention`` on TensorFlow."""


@dataclasses.dataclass(frozen=True)
class Repeat:
    """One ``keras.ops.repeat`` of the traced step: its input ``source``, ``repeats`` and
    ``axis`` (normalised to be non-negative)."""

    source: tf.Tensor
    repeats: Any
    axis: Any


def _repeats(graph: Any) -> dict:
    return trace_state.slot(graph, FAMILY)


def repeat_of(tensor: Any) -> Repeat | None:
    """The :class:`Repeat` that made ``tensor`` in the graph being traced, or None."""
    if not tf.is_tensor(tensor) or not hasattr(tensor, "graph"):
        return None
    held = trace_state.held(tensor.graph, FAMILY)
    return None if held is None else held.get(tensor.ref())


def parse(equation: str) -> tuple[list[str], str] | None:
    """An explicit einsum equation's operand labels and output labels, or None where it has
    an ellipsis, no ``->``, or a label twice in one term.

    >>> parse("bquh,bkuh->buqk"), parse("ii->i"), parse("a...,b->ab")
    ((['bquh', 'bkuh'], 'buqk'), None, None)
    """
    equation = equation.replace(" ", "")
    if "->" not in equation or "." in equation:
        return None
    ins, out = equation.split("->")
    terms = ins.split(",")
    if any(len(set(t)) != len(t) or not t.isalpha() for t in [*terms, out] if t):
        return None
    return terms, out


# -- check: why a call keeps Keras's own form (None: it need not) ---------------------------------
def check(equation: str, operands: Sequence[Any], repeated: int, found: Repeat) -> str | None:
    """Why this einsum reading a repeated operand (number ``repeated``) keeps Keras's form, or
    None.

    >>> q, k = tf.zeros([2, 5, 4, 3]), tf.zeros([2, 6, 2, 3])
    >>> check("bquh,bkuh->buqk", (q, k), 1, Repeat(k, 2, 2)) is None
    True
    >>> check("bquh,bkuh->buqk", (q, k), 1, Repeat(k, 2, 1))
    'the other operand has no axis of the repeated one (k)'
    """
    if len(operands) != 2:
        return f"an einsum of {len(operands)} operands"
    if any(not o.dtype.is_floating or o.dtype == tf.float64 for o in operands):
        return f"operand dtypes {', '.join(o.dtype.name for o in operands)}"
    if operands[0].dtype != operands[1].dtype:
        return "operands of different dtypes"
    if repeat_of(operands[1 - repeated]) is not None:
        return "both operands repeated"
    labels = parse(equation)
    if labels is None:
        return f"equation {equation!r} (an ellipsis, an implicit output or a label twice)"
    terms, _ = labels
    if any(len(t) != (o.shape.rank or -1) for t, o in zip(terms, operands)):
        return "an operand of unknown rank or of another rank than its labels"
    if not isinstance(found.repeats, int) or isinstance(found.repeats, bool) or \
            found.repeats < 1 or not isinstance(found.axis, int):
        return "a repeat count or axis that is not a Python integer"
    if found.source.shape.rank != len(terms[repeated]) or found.source.shape[found.axis] is None:
        return "a repeated axis whose size is unknown when traced"
    label = terms[repeated][found.axis]
    if label not in terms[1 - repeated]:
        return f"the other operand has no axis of the repeated one ({label})"
    return None


def check_dot_product(query: Any, key: Any, value: Any, flash: Any, cap: Any) -> str | None:
    """Why this ``dot_product_attention`` keeps Keras's form, or None.

    >>> q = tf.zeros([1, 2, 4, 3])
    >>> check_dot_product(q, tf.zeros([1, 2, 2, 3]), tf.zeros([1, 2, 2, 3]), None, None)
    >>> check_dot_product(q, q, q, True, None)
    'flash_attention'
    """
    if flash:
        return "flash_attention"
    if cap is not None:
        return "attn_logits_soft_cap"
    if len({t.dtype for t in (query, key, value)}) != 1 or \
            query.dtype.name not in ("float32", "float16", "bfloat16"):
        return f"dtypes {', '.join(t.dtype.name for t in (query, key, value))}"
    if any(t.shape.rank != 4 for t in (query, key, value)):
        return "inputs that are not 4-d"
    if query.shape[2] is None or key.shape[2] is None:
        return "a head count unknown when traced"
    return None


# -- forms: what it emits (CONSERVATIVE: the form Keras runs), and the hook's flow ----------------
CONSERVATIVE = conservative("repeated", "Keras's repeated keys and values")
_BMMS = frozenset({"BatchMatMulV2", "BatchMatMulV3"})
_BMM = frozenset({"BatchMatMulV2", "Transpose"})  # and reshapes, which run on every device
_EINSUM = frozenset({"Einsum"})
_SOFTMAX = frozenset({"Softmax:float32"})  # dot_product_attention's, as Keras's, in float32
BMM = Form("grouped bmm", "grouped attention: Transpose + BatchMatMulV2 over key/value heads "
                          "and groups, keys and values not repeated", marks=_BMMS, emits=_BMM)
EINSUM = Form("grouped einsum", "grouped attention: one Einsum over key/value heads and groups, "
                                "keys and values not repeated",
              marks=frozenset({"Einsum"}), emits=_EINSUM)
SDPA_BMM = Form("sdpa grouped bmm", "dot_product_attention: Transpose + BatchMatMulV2 over "
                                    "key/value heads and groups, keys and values not repeated",
                marks=_BMMS, emits=_BMM | _SOFTMAX)
SDPA_EINSUM = Form("sdpa grouped einsum", "dot_product_attention: Einsums over key/value heads "
                                          "and groups, keys and values not repeated",
                   marks=frozenset({"Einsum"}), emits=_EINSUM | _SOFTMAX)
FORMS = Forms(SCOPE, (CONSERVATIVE, BMM, EINSUM, SDPA_BMM, SDPA_EINSUM))
"""Every form, emitted under ``tfmx_grouped_attention_<form>``."""


def _size(x: tf.Tensor, axis: int) -> Any:
    static = x.shape[axis]
    return int(static) if static is not None else tf.shape(x)[axis]


def _product(sizes: list) -> Any:
    out: Any = 1
    for s in sizes:
        out = out * s
    return out


def _arranged(x: tf.Tensor, labels: str, order: list[str]) -> tf.Tensor:
    perm = [labels.index(c) for c in order]
    return x if perm == list(range(len(perm))) else tf.transpose(x, perm)


def _layout(labels: str, batch: list[str], first: list[str],
            second: list[str]) -> tuple[list[str], bool]:
    """An operand's order for the MatMul, ``batch + first + second``, or ``batch + second +
    first`` read adjoint: the one that needs no transpose, else the one that keeps the
    operand's last axis last (a transpose of whole rows), else the first."""
    plain, adjoint = batch + first + second, batch + second + first
    for order, adj in ((plain, False), (adjoint, True)):
        if order == list(labels):
            return order, adj
    if first and second and adjoint[-1] == labels[-1] and plain[-1] != labels[-1]:
        return adjoint, True
    return plain, False


def _summed_alone(x: tf.Tensor, labels: str, others: str) -> tuple[tf.Tensor, str]:
    """``x`` summed over its axes whose labels are nowhere else (``others``), and its labels
    left."""
    alone = [i for i, c in enumerate(labels) if c not in others]
    if not alone:
        return x, labels
    return tf.reduce_sum(x, alone), "".join(c for c in labels if c in others)


def batched_matmul(equation: str, a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """A two-operand einsum without an ellipsis as ``Transpose`` + ``BatchMatMulV2`` +
    ``Reshape``: the labels of both operands and the output are the MatMul's batch axes, those
    of both operands alone are summed, each operand's others are its rows or columns (in the
    output's order where the output then needs no transpose, else in the operand's); the axes
    of one operand alone and not in the output summed first; a transpose only where an
    operand or the result is not in that order.

    >>> import numpy as np
    >>> a, b = tf.random.normal([2, 3, 4], seed=1), tf.random.normal([2, 5, 4], seed=2)
    >>> bool(np.allclose(batched_matmul("bik,bjk->bij", a, b), tf.einsum("bik,bjk->bij", a, b),
    ...                  atol=1e-5))
    True
    """
    (la, lb), lo = parse(equation)
    a, la = _summed_alone(a, la, lb + lo)
    b, lb = _summed_alone(b, lb, la + lo)
    sizes = {c: _size(t, i) for t, labels in ((a, la), (b, lb)) for i, c in enumerate(labels)}
    batch = [c for c in lo if c in la and c in lb]
    summed = [c for c in la if c in lb and c not in lo]
    rows_out = [c for c in lo if c in la and c not in lb]
    cols_out = [c for c in lo if c in lb and c not in la]
    if batch + rows_out + cols_out == list(lo):
        rows, cols = rows_out, cols_out
    else:
        rows = [c for c in la if c in rows_out]
        cols = [c for c in lb if c in cols_out]
    order_a, adj_a = _layout(la, batch, rows, summed)
    order_b, adj_b = _layout(lb, batch, summed, cols)
    a3, b3 = _arranged(a, la, order_a), _arranged(b, lb, order_b)
    lead = [sizes[c] for c in batch]
    m, k, n = (_product([sizes[c] for c in group]) for group in (rows, summed, cols))
    a3 = tf.reshape(a3, lead + ([k, m] if adj_a else [m, k]))
    b3 = tf.reshape(b3, lead + ([n, k] if adj_b else [k, n]))
    out = tf.matmul(a3, b3, adjoint_a=adj_a, adjoint_b=adj_b)
    out = tf.reshape(out, lead + [sizes[c] for c in rows + cols])
    return _arranged(out, "".join(batch + rows + cols), list(lo))


def grouped_contraction(equation: str, operands: Sequence[tf.Tensor], repeated: int, axis: int,
                        groups: int, bmm: bool = False) -> tf.Tensor:
    """``einsum(equation, ...)`` where operand number ``repeated`` would be
    ``repeat(operands[repeated], groups, axis)``, without that repeat: the other operand's
    axis of the same label split into ``[kv, groups]``, contracted against the un-repeated
    operand's ``kv``, merged back in the output (as ``Transpose`` + ``BatchMatMulV2`` with
    ``bmm``, else as one ``Einsum``)."""
    terms, out = parse(equation)
    source, other = operands[repeated], operands[1 - repeated]
    label = terms[repeated][axis]
    free = [c for c in string.ascii_letters if c not in equation]
    kv_label, group_label = free[0], free[1]
    grouped_terms = list(terms)
    grouped_terms[repeated] = terms[repeated].replace(label, kv_label)
    grouped_terms[1 - repeated] = terms[1 - repeated].replace(label, kv_label + group_label)
    grouped_out = out.replace(label, kv_label + group_label)
    kv = int(source.shape[axis])
    at = terms[1 - repeated].index(label)
    dims = [_size(other, i) for i in range(other.shape.rank)]
    other = tf.reshape(other, dims[:at] + [kv, groups] + dims[at + 1:])
    pair = [other, source] if repeated == 1 else [source, other]
    grouped = f"{','.join(grouped_terms)}->{grouped_out}"
    result = batched_matmul(grouped, *pair) if bmm else tf.einsum(grouped, *pair)
    if label not in out:
        return result
    at = out.index(label)
    dims = [_size(result, i) for i in range(result.shape.rank)]
    return tf.reshape(result, dims[:at] + [kv * groups] + dims[at + 2:])


def grouped_dot_product_attention(query: tf.Tensor, key: tf.Tensor, value: tf.Tensor,
                                  bias: Any, mask: Any, is_causal: bool, scale: Any,
                                  groups: int, bmm: bool = False) -> tf.Tensor:
    """Keras's ``dot_product_attention`` core on TensorFlow (``_dot_product_attention_xla``)
    of ``[B, T, kv * groups, H]`` queries against ``[B, S, kv, H]`` keys and values, its two
    einsums as :func:`grouped_contraction` s: logits in at least float32, scale, bias, Keras's
    masks, softmax in float32, cast back."""
    _apply_masks = private_api.get("keras.apply_masks")

    logits = grouped_contraction("btnh,bsnh->bnts", (query, key), 1, 2, groups, bmm)
    logits = tf.cast(logits, tf.float32)
    logits = logits * tf.cast(scale, logits.dtype)
    if bias is not None:
        logits = logits + tf.cast(bias, logits.dtype)
    probs = tf.cast(tf.nn.softmax(_apply_masks(logits, mask, is_causal), axis=-1), key.dtype)
    return grouped_contraction("bnts,bsnh->btnh", (probs, value), 1, 2, groups, bmm)


def remember_repeat(ctx: StageContext, original: Callable, x: Any, repeats: Any,
                    axis: Any = None) -> Any:
    """``keras.ops.repeat`` while tfmx traces: Keras's call, its output remembered with its
    input, count and axis in the trace's slot."""
    out = original(x, repeats, axis)
    if tf.inside_function() and tf.is_tensor(out) and axis is not None and \
            getattr(out, "graph", None) is not None and x.shape.rank is not None:
        x = tf.convert_to_tensor(x)
        axis = axis + x.shape.rank if isinstance(axis, int) and axis < 0 else axis
        _repeats(out.graph)[out.ref()] = Repeat(x, repeats, axis)
    return out


def _signature(what: str, operands: Sequence[Any], groups: int) -> Callable[[], str]:
    def text() -> str:
        from fusion.fragment import shape_text

        shapes = " ".join(shape_text(o.shape) for o in operands)
        return f"{what} {shapes} {operands[0].dtype.name} groups={groups}"

    return text


def fused_einsum(ctx: StageContext, original: Callable, equation: Any, *operands: Any,
                 **kwargs: Any) -> Any:
    """``keras.ops.einsum`` while tfmx traces: where one of two operands is a remembered
    repeat, the grouped contraction (a tuner decision); any other einsum is Keras's, not
    counted."""
    def keras() -> Any:
        return original(equation, *operands, **kwargs)

    found = [(i, repeat_of(o)) for i, o in enumerate(operands)]
    found = [(i, r) for i, r in found if r is not None]
    if not tf.inside_function() or not found or kwargs or not isinstance(equation, str):
        return keras()
    repeated, repeat = found[0]
    why = check(equation, operands, repeated, repeat)
    groups = repeat.repeats
    grouped = list(operands)
    grouped[repeated] = repeat.source

    def form_of(form: Form) -> Callable[..., Any]:
        return lambda *xs: grouped_contraction(equation, xs, repeated, repeat.axis, groups,
                                               bmm=form == BMM)

    def candidates() -> dict:
        def stock(*xs: Any) -> Any:
            xs = list(xs)
            xs[repeated] = tf.repeat(xs[repeated], groups, axis=repeat.axis)
            return original(equation, *xs)

        shapes = [t.shape for t in grouped]
        return {CONSERVATIVE.name: timed_form(stock, shapes, grouped[0].dtype),
                **{f.name: timed_form(form_of(f), shapes, grouped[0].dtype)
                   for f in (BMM, EINSUM)}}

    return rewrite_call(ctx, CallSite(
        DECLARED, () if why else (BMM, EINSUM), keras=keras,
        emit=lambda form: form_of(form)(*grouped), what=f"einsum {equation}", why=why,
        dtype=operands[0].dtype, signature=_signature(f"einsum {equation}", grouped, groups),
        candidates=candidates))


def _grouped_source(query: Any, tensor: Any) -> tuple[Any, int] | None:
    """A key or value of ``dot_product_attention`` as (its un-repeated tensor, groups): a
    remembered repeat over the heads axis, or fewer heads than the query's (Keras then repeats
    them itself, where more than one); None where it is neither."""
    found = repeat_of(tensor)
    if found is not None and found.axis == 2 and isinstance(found.repeats, int) and \
            found.source.shape.rank == 4 and found.source.shape[2] is not None and \
            found.source.dtype == tensor.dtype:
        return found.source, found.repeats
    heads, kv = query.shape[2], tensor.shape[2]
    if heads is not None and kv is not None and heads > kv > 1 and heads % kv == 0:
        return tensor, heads // kv
    return None


def fused_dot_product_attention(ctx: StageContext, original: Callable, query: Any, key: Any,
                                value: Any, bias: Any = None, mask: Any = None,
                                scale: Any = None, is_causal: bool = False,
                                flash_attention: Any = None,
                                attn_logits_soft_cap: Any = None) -> Any:
    """``keras.ops.dot_product_attention`` on TensorFlow while tfmx traces: where its keys and
    values are grouped (:func:`_grouped_source`), the grouped form (a tuner decision); other
    calls are Keras's (the attention family's, where it is on), not counted."""
    def keras() -> Any:
        return original(query, key, value, bias, mask, scale, is_causal, flash_attention,
                        attn_logits_soft_cap)

    if not tf.inside_function() or not all(tf.is_tensor(t) for t in (query, key, value)):
        return keras()
    keys, values = _grouped_source(query, key), _grouped_source(query, value)
    if keys is None or values is None:
        return keras()
    why = check_dot_product(query, keys[0], values[0], flash_attention, attn_logits_soft_cap)
    if why is None and keys[1] != values[1]:
        why = "keys and values repeated differently"
    if why is None and keys[0].shape[2] * keys[1] != query.shape[2]:
        why = "query heads other than key/value heads times groups"
    groups, causal = keys[1], bool(is_causal)
    head_dim = keys[0].shape[-1]
    given = scale

    def form_of(form: Form) -> Callable[..., Any]:
        def run(q: Any, k: Any, v: Any) -> Any:
            s = given if given is not None else \
                1.0 / tf.sqrt(tf.cast(head_dim or tf.shape(k)[-1], tf.float32))
            return grouped_dot_product_attention(q, k, v, bias, mask, causal, s, groups,
                                                 bmm=form == SDPA_BMM)
        return run

    def candidates() -> dict:
        # timed without the call's mask and bias (tensors of the step being traced), the
        # scale a number
        fixed = given if isinstance(given, (int, float)) else 1.0 / float(head_dim or 1) ** 0.5

        def stock(q: Any, k: Any, v: Any) -> Any:
            k, v = (tf.repeat(t, groups, axis=2) for t in (k, v))
            return original(q, k, v, None, None, fixed, causal)

        def timed(form: Form) -> Callable[..., Any]:
            def run(q: Any, k: Any, v: Any) -> Any:
                return grouped_dot_product_attention(q, k, v, None, None, causal, fixed, groups,
                                                     bmm=form == SDPA_BMM)
            return run

        shapes = [t.shape for t in (query, keys[0], values[0])]
        return {CONSERVATIVE.name: timed_form(stock, shapes, query.dtype),
                **{f.name: timed_form(timed(f), shapes, query.dtype)
                   for f in (SDPA_BMM, SDPA_EINSUM)}}

    return rewrite_call(ctx, CallSite(
        DECLARED, () if why else (SDPA_BMM, SDPA_EINSUM), keras=keras,
        emit=lambda form: form_of(form)(query, keys[0], values[0]),
        what="dot_product_attention", why=why, dtype=query.dtype,
        signature=_signature(f"dot_product_attention causal={causal} bias={bias is not None} "
                             f"mask={mask is not None}", (query, keys[0]), groups),
        candidates=candidates))


# -- declaration ----------------------------------------------------------------------------------
DECLARED = declare(Family(
    FAMILY,
    "grouped- and multi-query attention (keras.ops.repeat of keys and values, then einsum or "
    "dot_product_attention) -> the contraction over key/value heads and groups, the repeated "
    "tensors never made; Keras's masks and softmax unchanged",
    hooks=(Hook.on(MATCHES[0], remember_repeat), Hook.on(MATCHES[1], fused_einsum),
           Hook.on(MATCHES[2], fused_dot_product_attention)),
    forms=FORMS,
    after=OBSERVED_AFTER, order=OBSERVED_ORDER,
))
