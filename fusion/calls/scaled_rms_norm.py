"""The scaled_rms_norm stage: a whole RMS norm, ``x * rsqrt(mean(x^2) + eps) * scale``, as
keras_hub's decoders and users write it with ``keras.ops``, trained with both gradients in
closed form or as two XLA regions.

The rms_norm stage rewrites the statistic alone: the normalized product ``x * inv`` and the
scale are the layer's own tensor operators, and autodiff differentiates each apart
(``dy * scale``, ``sum(dy * xhat)`` for the scale, ``g * inv`` and ``sum(g * x)`` for the
product, the statistic's gradient, their ``AddN``): a pass over ``[tokens, hidden]`` each. This
stage joins the three calls in the graph being traced, as the gated_product stage joins an
activation and its product: the TensorFlow backend's ``rsqrt`` and ``reciprocal`` (the calls the
rms_norm stage hooks) note their output where their argument is an RMS statistic
(:func:`fusion.calls.rms_norm.find`); TensorFlow's ``*`` on tensors (``math_ops._mul_dispatch``)
and the backend's ``multiply`` note the product of that output (or a ``Cast`` or ``Identity``
of it) with the statistic's own ``x``; and the product of that normalized tensor with a vector
of the normalized axis' length (the layer's ``scale``; Gemma's ``1 + scale``; either operand
order, as T5's ``weight * x``) emits the whole norm from ``x`` and that vector:

- ``custom``: ``y = x * inv * scale`` in float32, with ``ds = sum(dy * xhat)`` over every axis
  but the last and ``dx = inv * (dy * scale - xhat * mean(dy * scale * xhat))``, from ``x``,
  ``inv`` and ``xhat`` the forward kept;
- ``xla`` (cpu and cuda with ``tfmx.enable(xla=True)``, never metal): the forward (``y`` and
  ``inv``) as one XLA-compiled region and the closed-form gradient as a second.

The statistic's and the normalized product's ops are taken out of the step (read by nobody
once the whole norm is emitted; ``fusion.transaction.superseded``), and what the rms_norm stage
counted fused there is counted declined, with the reason. Every norm is a tuner decision
(forward and backward at its shapes) against the step's own three calls, the conservative form,
timed with the statistic in the form the rms_norm stage emitted for it. Without a gradient tape
recording (inference) nothing is noted. Declined, with the reason in the report: an ``x`` of a
dtype other than float32 (keras_hub's norms cast to float32 first; a 16-bit ``x`` keeps the
rms_norm stage's statistic), a scale of another dtype, a normalized axis unknown when traced,
a statistic or normalized tensor that another op reads too.

Example:
    >>> import numpy as np, tensorflow as tf
    >>> from fusion.calls.scaled_rms_norm import scaled_custom
    >>> x = tf.constant(np.linspace(-2.0, 3.0, 12, dtype="float32").reshape(3, 4))
    >>> s = tf.constant([0.5, 1.0, 1.5, 2.0])
    >>> with tf.GradientTape(persistent=True) as tape:
    ...     _ = tape.watch([x, s])
    ...     got = scaled_custom(x, s, 1e-6)
    ...     want = x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), -1, keepdims=True) + 1e-6) * s
    >>> bool(np.allclose(got, want, rtol=1e-6))
    True
    >>> all(np.allclose(tape.gradient(got, v), tape.gradient(want, v), atol=1e-5)
    ...     for v in (x, s))
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from fusion import trace_state
from fusion.calls import rms_norm
from fusion.family import OBSERVED_AFTER, OBSERVED_ORDER, Family, Form, Forms, conservative, declare
from fusion.pattern import PatternStats
from fusion.platform import Platform
from fusion.stage import (
    XLA,
    XLA_CALLS,
    CallSite,
    Hook,
    StageContext,
    custom_gradient,
    noted_call,
    noted_through,
    recording,
    rewrite_call,
    timed_form,
    with_xla,
    xla_region,
)

# -- match: the Keras calls it hooks, and what it finds in them -----------------------------------
FAMILY = "scaled_rms_norm"
SCOPE = "tfmx_scaled_rms"
MATCHES = (*rms_norm.MATCHES, "keras.src.backend.tensorflow:numpy.multiply",
           "tensorflow.python.ops:math_ops._mul_dispatch")
"""The calls the stage hooks: the TensorFlow backend's ``rsqrt`` and ``reciprocal`` (noted
where their argument is an RMS statistic), its ``multiply`` (``keras.ops.multiply``) and
TensorFlow's ``*`` operator on tensors, of which the stage takes the products of a noted
statistic and of a noted normalized tensor."""


@dataclasses.dataclass
class NotedStatistic:
    """A root call noted while a step is traced: the statistic found in its argument
    (:class:`fusion.calls.rms_norm.Statistic`), its output ``inv``, the names of the ops that
    computed it (Keras's composite from the square on, and what the call made) and the
    statistics the rms_norm stage recorded for it."""

    found: rms_norm.Statistic
    inv: tf.Tensor
    made: tuple[str, ...]
    stats: list[PatternStats]


@dataclasses.dataclass
class Normalized:
    """The product ``x * inv`` of a noted :class:`NotedStatistic`: its output, the names of the
    ops from the statistic's output to it (casts and the product)."""

    statistic: NotedStatistic
    out: tf.Tensor
    made: tuple[str, ...]


@dataclasses.dataclass
class Scaled:
    """A whole RMS norm found at a multiplication: the :class:`Normalized` tensor, the operand
    the product reads (``read``: that tensor, or a cast of it), the ops between (``between``)
    and the vector it is multiplied by (``scale``, a tensor, or a Keras variable until it is
    read), of ``read``'s dtype."""

    normalized: Normalized
    read: tf.Tensor
    between: tuple[tf.Operation, ...]
    scale: Any


def _graph_tensor(t: Any) -> bool:
    return tf.is_tensor(t) and hasattr(t, "op") and hasattr(t, "graph")


def _statistic_product(a: Any, b: Any) -> tuple[NotedStatistic, tuple[tf.Operation, ...]] | None:
    """``(statistic, casts)`` where ``a * b`` is a noted statistic's ``x`` times its output."""
    for inv, x in ((a, b), (b, a)):
        if not (_graph_tensor(inv) and _graph_tensor(x)):
            continue
        noted = trace_state.held(inv.graph, FAMILY)
        hit = None if not noted else noted_through(inv, noted["statistics"])
        if hit is not None and hit[0].found.x.ref() == x.ref():
            return hit
    return None


def _vector(t: Any) -> tf.TensorShape | None:
    """The static shape of ``t`` where it is a vector (a tensor or a Keras variable)."""
    shape = getattr(t, "shape", None)
    try:
        shape = tf.TensorShape(shape)
    except (TypeError, ValueError):
        return None
    return shape if shape.rank == 1 else None


def find_scaled(a: Any, b: Any, promotes: bool = False) -> Scaled | None:
    """The whole norm ``a * b`` is, where one operand is a noted normalized tensor (or a
    ``Cast`` or ``Identity`` of it, up to two) and the other a vector of its dtype as long as
    its last axis (not known when traced: matched, then declined); else None. With
    ``promotes`` (``keras.ops.multiply``, which casts both operands to their result dtype) a
    16-bit vector of a float32 tensor too. TensorFlow's operator does not promote: it leaves such
    a product to the vector's own (a Keras variable autocast to 16 bits under a mixed policy
    calls ``keras.ops.multiply``), which is taken in turn.

    >>> find_scaled(tf.constant([1.0]), 2.0) is None
    True
    """
    for n, s in ((a, b), (b, a)):
        if not _graph_tensor(n):
            continue
        noted = trace_state.held(n.graph, FAMILY)
        hit = None if not noted else noted_through(n, noted["normalized"])
        shape = _vector(s)
        dtype = _dtype(s)
        promoted = promotes and n.dtype == tf.float32 and dtype in (tf.float16, tf.bfloat16)
        if hit is None or shape is None or (dtype != n.dtype and not promoted):
            continue
        last = n.shape[-1] if n.shape.rank else None
        if shape[0] is None or last is None or shape[0] == last:
            return Scaled(hit[0], n, hit[1], s)
    return None


def _dtype(t: Any) -> tf.DType | None:
    """The dtype of a tensor or a Keras variable (as its product would read it)."""
    try:
        return tf.as_dtype(getattr(t, "dtype", None))
    except TypeError:
        return None


def _wanted(a: Any, b: Any, *rest: Any, promotes: bool = False, **kwargs: Any) -> bool:
    """Whether a multiplication is one the stage takes (its hook's ``when``): never raises."""
    try:
        return _statistic_product(a, b) is not None or find_scaled(a, b, promotes) is not None
    except Exception:  # noqa: BLE001 - an operand of a kind not foreseen: not the stage's
        return False


def _wanted_promoted(a: Any, b: Any, *rest: Any, **kwargs: Any) -> bool:
    """:func:`_wanted` for ``keras.ops.multiply``, which promotes its operands' dtypes."""
    return _wanted(a, b, *rest, promotes=True, **kwargs)


# -- check: why a call keeps Keras's own form (None: it need not) ---------------------------------
def check(scaled: Scaled, scale: tf.Tensor) -> str | None:
    """Why the stage leaves this norm to Keras's calls (``scale``: the vector read as a
    tensor), or None.

    >>> found = rms_norm.Statistic(tf.zeros([2, 4], tf.float16), 1e-6, "Square", False,
    ...                            rms_norm.RSQRT, tf.float16)
    >>> statistic = NotedStatistic(found, tf.zeros([2, 1], tf.float16), (), [])
    >>> n = Normalized(statistic, tf.zeros([2, 4], tf.float16), ())
    >>> check(Scaled(n, n.out, (), None), tf.zeros([4], tf.float16))
    'a float16 normalized input'
    """
    normalized = scaled.normalized
    x = normalized.statistic.found.x
    if x.dtype != tf.float32:
        return f"a {x.dtype.name} normalized input"
    if scale.dtype not in (tf.float32, tf.float16, tf.bfloat16) or scale.dtype != scaled.read.dtype:
        return f"a {scale.dtype.name} scale of a {scaled.read.dtype.name} product"
    if x.shape.rank is None or x.shape[-1] is None or scale.shape[0] != x.shape[-1]:
        return "the normalized axis' length not known when traced"
    made = {*normalized.made, *normalized.statistic.made, *(op.name for op in scaled.between)}
    chain = [("statistic", normalized.statistic.inv), ("normalized tensor", normalized.out),
             *(("normalized tensor", op.outputs[0]) for op in scaled.between)]
    for what, t in chain:
        if any(op.name not in made for op in t.consumers()):
            return f"the {what} is read by another op too"
    return None


# -- forms: what it emits (CONSERVATIVE: the form Keras runs), and the hook's flow ----------------
_OPS = frozenset({"AddV2", "Mean", "Mul", "Rsqrt", "Sub", "Sum"})
CONSERVATIVE = conservative("keras", "the statistic (as its stage emits it) and Keras's two "
                                     "products")
"""The statistic as the rms_norm stage emits it (or Keras's), and the layer's products,
differentiated by autodiff."""
CUSTOM = Form("custom", "whole RMS norm x * rsqrt(mean(x^2) + eps) * scale: both gradients in "
                        "closed form (custom gradient)", marks=frozenset({"Rsqrt"}), emits=_OPS)
XLA_FORM = Form(XLA, "whole RMS norm: the forward and its closed-form gradient as two "
                     "XLA-compiled regions", marks=XLA_CALLS)
FORMS = Forms(SCOPE, (CONSERVATIVE, CUSTOM, XLA_FORM))
"""Every form, emitted under ``tfmx_scaled_rms_<form>``: its report label, the ops that show it in
a traced graph (the closed form's Rsqrt, the regions' calls) and the ops it emits (float32)."""


@dataclasses.dataclass(frozen=True)
class ScaledRmsNormForms:
    """What a backend runs of this family (its ``capability``): the forms' names."""

    forms: tuple[str, ...]


def scaled_rms_norm_forms(platform: Platform) -> ScaledRmsNormForms:
    """The forms ``platform`` runs besides Keras's calls: on cpu and cuda the closed form and
    the XLA regions; on a Metal plugin the closed form where it places every op the form emits
    (in float32), never an XLA region.

    >>> scaled_rms_norm_forms(Platform("cpu")).forms
    ('custom', 'xla')
    >>> scaled_rms_norm_forms(Platform("metal", kernels=frozenset({"Rsqrt"}))).forms
    ()
    """
    if platform.name in ("cpu", "cuda"):
        return ScaledRmsNormForms((CUSTOM.name, XLA_FORM.name))
    return ScaledRmsNormForms((CUSTOM.name,) if platform.places(CUSTOM.emits, "float32") else ())


def _inverse(x: tf.Tensor, epsilon: float) -> tf.Tensor:
    return tf.math.rsqrt(tf.reduce_mean(x * x, -1, keepdims=True) + epsilon)


def _wide(t: tf.Tensor) -> tf.Tensor:
    return t if t.dtype == tf.float32 else tf.cast(t, tf.float32)


def _forward(x: tf.Tensor, scale: tf.Tensor, epsilon: float) -> tuple[tf.Tensor, tf.Tensor]:
    """``(x * inv * scale, inv)``: computed in float32, the output in ``scale``'s dtype."""
    inv = _inverse(x, epsilon)
    y = x * inv * _wide(scale)
    return (y if scale.dtype == y.dtype else tf.cast(y, scale.dtype)), inv


def _gradients(x: tf.Tensor, scale: tf.Tensor, inv: tf.Tensor,
               dy: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """``(dx, dscale)`` of ``x * inv * scale`` (``inv`` the statistic of ``x``) in closed form,
    computed in float32, ``dscale`` given in ``scale``'s dtype."""
    xhat, dy = x * inv, _wide(dy)
    scaled = dy * _wide(scale)
    dscale = tf.reduce_sum(dy * xhat, list(range(x.shape.rank - 1)))
    dx = inv * (scaled - xhat * tf.reduce_mean(scaled * xhat, -1, keepdims=True))
    return dx, (dscale if dscale.dtype == scale.dtype else tf.cast(dscale, scale.dtype))


def scaled_custom(x: tf.Tensor, scale: tf.Tensor, epsilon: float) -> tf.Tensor:
    """``x * rsqrt(mean(x^2, axis=-1, keepdims=True) + epsilon) * scale`` (``x`` float32;
    computed in float32, given in ``scale``'s dtype) with both gradients in closed form:
    ``dscale = sum(dy * xhat)`` over every axis but the last, ``dx = inv * (dy * scale - xhat *
    mean(dy * scale * xhat))``.

    >>> x, s = tf.constant([[3.0, 4.0]]), tf.constant([1.0, 2.0])
    >>> [round(float(v), 4) for v in scaled_custom(x, s, 0.0)[0]]
    [0.8485, 2.2627]
    """
    @custom_gradient
    def norm(x: tf.Tensor, scale: tf.Tensor) -> Any:
        y, inv = _forward(x, scale, epsilon)

        def gradient(dy: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            return _gradients(x, scale, inv, dy)

        return y, gradient

    return norm(x, scale)


def scaled_xla(x: tf.Tensor, scale: tf.Tensor, epsilon: float) -> tf.Tensor:
    """:func:`scaled_custom` with its forward (the output and ``inv``) one XLA-compiled region
    and its gradient a second.

    >>> x, s = tf.constant([[3.0, 4.0]]), tf.constant([1.0, 2.0])
    >>> with tf.GradientTape() as tape:
    ...     _ = tape.watch(s)
    ...     y = scaled_xla(x, s, 0.0)
    >>> [round(float(v), 4) for v in tape.gradient(y, s)]
    [0.8485, 1.1314]
    """
    forward = xla_region(lambda x, scale: _forward(x, scale, epsilon))
    backward = xla_region(_gradients)

    @custom_gradient
    def norm(x: tf.Tensor, scale: tf.Tensor) -> Any:
        y, inv = forward(x, scale)

        def gradient(dy: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            return backward(x, scale, inv, dy)

        return y, gradient

    return norm(x, scale)


def _statistic_as_emitted(noted: NotedStatistic) -> Callable[[tf.Tensor], tf.Tensor]:
    """The statistic of ``x`` in the form the rms_norm stage emitted for this call (its closed
    form, its XLA region) or Keras's composite: the conservative form's, as the step runs it."""
    found = noted.found
    stock = rms_norm.composite(found)
    fused = {label for stats in noted.stats for label in stats.fused_kinds}
    if rms_norm.CUSTOM.label in fused:
        return lambda v: rms_norm.rms_statistic(v, found.epsilon, found.dtype)
    if rms_norm.XLA_FORM.label in fused:
        return xla_region(stock)
    return stock


def _composite_ops(found: rms_norm.Statistic, inv: tf.Tensor) -> tuple[str, ...]:
    """The names of the ops from the square of ``found.x`` to ``inv`` (Keras's composite of the
    statistic, made before the root call)."""
    names, stack, seen = [], [inv.op], set()
    while stack:
        op = stack.pop()
        if op.name in seen or op is found.x.op:
            continue
        seen.add(op.name)
        names.append(op.name)
        stack.extend(t.op for t in op.inputs if t.ref() != found.x.ref() and t.op.type != "Const")
        if len(seen) > 16:  # never the whole graph: the composite is a handful of ops
            return ()
    return tuple(names)


def _noted(ctx: StageContext, original: Callable, argument: Any, root: str) -> Any:
    """A root call while a step is traced with a tape recording: run as it would be (the
    rms_norm stage's, then Keras's), noted in the graph's state where its argument is an RMS
    statistic this stage may take, with the ops that computed it and what its stage recorded."""
    out, made, recorded = noted_call(ctx, lambda: original(argument))
    found = rms_norm.find(argument, root)
    if isinstance(found, rms_norm.Statistic) and _graph_tensor(out):
        slot = trace_state.slot(out.graph, FAMILY, lambda: {"statistics": {}, "normalized": {}})
        slot["statistics"][out.ref()] = NotedStatistic(
            found, out, _composite_ops(found, argument) + made, recorded)
    return out


def noted_rsqrt(ctx: StageContext, original: Callable, x: Any) -> Any:
    """The TensorFlow backend's ``rsqrt`` while tfmx traces: noted (:func:`_noted`)."""
    return _noted(ctx, original, x, rms_norm.RSQRT)


def noted_reciprocal(ctx: StageContext, original: Callable, x: Any) -> Any:
    """The TensorFlow backend's ``reciprocal`` while tfmx traces: noted (:func:`_noted`)."""
    return _noted(ctx, original, x, rms_norm.RECIPROCAL_SQRT)


def _supersede(normalized: Normalized, between: tuple[tf.Operation, ...]) -> None:
    """The statistic's and the normalized product's ops, and the casts between it and the
    scale's product, taken out of the step (read by nobody now:
    ``fusion.transaction.without_abandoned`` keeps any a kept op reads)."""
    held = trace_state.of(normalized.out.graph, create=True).superseded
    held.update(normalized.statistic.made)
    held.update(normalized.made)
    held.update(op.name for op in between)


def fused_product(ctx: StageContext, original: Callable, a: Any, b: Any, *rest: Any,
                  promotes: bool = False, **kwargs: Any) -> Any:
    """A multiplication while tfmx traces (``keras.ops.multiply``, ``*``): a noted statistic's
    ``x`` times its output, noted; a noted normalized tensor times a vector, the whole norm in
    closed form or as XLA regions where the tuner measures it faster than the step's own
    calls; else Keras's call. ``promotes``: the call casts a 16-bit vector to the float32
    tensor's dtype (``keras.ops.multiply``), and so does the whole norm."""
    from fusion.fragment import shape_text

    graph = tf.compat.v1.get_default_graph()
    hit = _statistic_product(a, b)
    if hit is not None:
        out, made, _ = noted_call(ctx, lambda: original(a, b, *rest, **kwargs))
        if _graph_tensor(out):
            statistic, between = hit
            trace_state.slot(graph, FAMILY)["normalized"][out.ref()] = Normalized(
                statistic, out, tuple(op.name for op in between) + made)
        return out
    scaled = find_scaled(a, b, promotes)
    if scaled is None:
        return original(a, b, *rest, **kwargs)
    normalized = scaled.normalized
    trace_state.slot(graph, FAMILY)["normalized"].pop(normalized.out.ref(), None)
    scale = scaled.scale if _graph_tensor(scaled.scale) else tf.convert_to_tensor(scaled.scale)
    if promotes and scale.dtype != scaled.read.dtype:
        scale = tf.cast(scale, scaled.read.dtype)  # as keras.ops.multiply casts it
    found = normalized.statistic.found
    x, epsilon = found.x, found.epsilon
    why = check(scaled, scale)
    shapes = [x.shape, scale.shape]
    statistic = _statistic_as_emitted(normalized.statistic)

    def stock(v: tf.Tensor, s: tf.Tensor) -> tf.Tensor:  # the step's calls, the scale's dtype
        return tf.cast(v * statistic(v), scale.dtype) * s

    def timed(fn: Callable[[tf.Tensor, tf.Tensor], tf.Tensor]) -> Any:
        # inputs made in float32, the scale cast to its own dtype
        return lambda v, s: fn(v, tf.cast(s, scale.dtype))

    def candidates() -> dict:
        forms = {CONSERVATIVE.name: timed_form(timed(stock), shapes, x.dtype),
                 CUSTOM.name: timed_form(timed(lambda v, s: scaled_custom(v, s, epsilon)),
                                         shapes, x.dtype)}
        return with_xla(ctx, forms, timed(lambda v, s: scaled_xla(v, s, epsilon)), shapes,
                        x.dtype, name=XLA_FORM.name)

    def emit(form: Form) -> tf.Tensor:
        fn = scaled_xla if form.name == XLA_FORM.name else scaled_custom
        out = fn(x, scale, epsilon)
        _supersede(normalized, scaled.between)
        taken.append(normalized.statistic)
        return out

    taken: list[NotedStatistic] = []
    out = rewrite_call(ctx, CallSite(
        DECLARED, (CUSTOM,), keras=lambda: original(a, b, *rest, **kwargs), emit=emit,
        what="scaled RMS norm", why=why, dtype=x.dtype, candidates=candidates,
        signature=lambda: (f"scaled RMS norm of {shape_text(x.shape)} {x.dtype.name}, scale "
                           f"{scale.dtype.name}")))
    for noted in taken:
        for stats in noted.stats:
            stats.taken(f"taken into the whole norm with its scale ({FAMILY})")
    return out


def fused_keras_product(ctx: StageContext, original: Callable, a: Any, b: Any, *rest: Any,
                        **kwargs: Any) -> Any:
    """``keras.ops.multiply`` while tfmx traces: :func:`fused_product`, whose operands it
    promotes."""
    return fused_product(ctx, original, a, b, *rest, promotes=True, **kwargs)


# -- declaration ----------------------------------------------------------------------------------
DECLARED = declare(Family(
    FAMILY,
    "a whole RMS norm x * rsqrt(mean(x^2) + eps) * scale written with keras.ops (keras_hub's "
    "Llama, Mistral, Qwen, Gemma norms and their query/key norms, users' layers), matched from "
    "the traced ops of its three calls -> both gradients in closed form or two XLA regions, "
    "where measured faster than the statistic's form and the two products",
    # outer: it notes the root call's output, whatever the rms_norm stage emits for it
    hooks=(Hook.on(MATCHES[0], noted_rsqrt, outer=1, when=recording),
           Hook.on(MATCHES[1], noted_reciprocal, outer=1, when=recording),
           Hook.on(MATCHES[2], fused_keras_product, when=_wanted_promoted),
           Hook.on(MATCHES[3], fused_product, when=_wanted)),
    forms=FORMS,
    capability=scaled_rms_norm_forms,
    after=OBSERVED_AFTER, order=OBSERVED_ORDER,
))
