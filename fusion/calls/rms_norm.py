"""The rms_norm stage: RMS normalization as keras_hub's decoders and users write it with
``keras.ops``, matched from the ops it traces, its statistic trained with a closed-form gradient.

keras_hub's decoder LLMs have no Keras layer to hook: each writes its own RMS norm, and so do
users. ``LlamaLayerNorm`` (Mistral's, Mixtral's, Qwen's, Phi-3's, GPT-OSS's and Qwen3's,
its per-head query and key norms included, are the same code) computes
``x * ops.rsqrt(ops.mean(ops.power(x, 2), axis=-1, keepdims=True) + eps)`` in float32, then
``* scale`` and a cast back; Gemma's and Gemma3's ``RMSNormalization`` (their per-head query
and key norms too) ``x * ops.reciprocal(ops.sqrt(ops.mean(ops.square(x), ...) + eps)) *
(1 + scale)``; ``keras.ops.rms_normalization`` (Keras's ``RMSNormalization`` where the
layer_norm family keeps its composite) the same with ``ops.square``. What they share is one
``keras.ops`` call whose argument carries the whole statistic: the TensorFlow backend's
``rsqrt`` (or ``reciprocal`` of a ``sqrt``). This stage hooks those two functions and reads
their argument's producers in the graph being traced: ``AddV2(Mean(Square(x) | Pow(x, 2) |
Mul(x, x), axis=-1, keep_dims=True), eps)`` (and ``Sqrt`` of it under ``reciprocal``; a 16-bit
``x``'s mean computed in float32 between two casts, as Keras 3.15's ``keras.ops.mean`` does, or
a float16 ``x``'s mean as the call of a function of its own compiled by XLA, as Keras 3.16's
does) with ``eps`` a constant. The layer's class is never asked: a user's layer written so is
matched alike, and an ``rsqrt`` of anything else (a group norm's centred variance, an L2 norm)
is left alone unrecorded.

Why the statistic and not the whole normalization: the product ``x * inv`` and the scale are
the layer's own tensor operators, which no hook sees, and a graph pass after differentiation
would have to match autodiff's gradient of them too. The statistic ``inv = rsqrt(mean(x^2) +
eps)`` as a function of ``x`` has the exact gradient ``dx = -dinv * inv^3 * x / n`` (``n`` the
last axis' length): the backward of the product ``x * inv`` (autodiff's ``g * inv`` and
``sum(g * x)``) plus this is the closed form ``inv * (g - xhat * mean(g * xhat))`` of the
layer_norm family's ``rms custom`` form, in the same number of passes over ``x``. Autodiff of
Keras's composite builds ``RsqrtGrad``, the mean's broadcast and division, and the power's
gradient (``Pow(x, 1)``, two products) over the whole tensor. Being the exact gradient of a
function of ``x``, it is correct whatever the layer does with ``inv`` afterwards; the whole-norm
kernels of ``fusion.kernels.layer_norm`` (and the ``rms custom`` form) need the product and the
scale in hand, so they do not fit here. Forms:

- ``custom``: the statistic in float32 (a 16-bit ``x`` cast up, ``inv`` cast back to the
  argument's dtype) with that closed-form gradient;
- ``xla`` (cpu and cuda with ``tfmx.enable(xla=True)``, never metal): Keras's composite of the
  statistic as one XLA-compiled region, its gradient compiled too.

Every call is a tuner decision (``x * inv``, forward and backward at the call's shape) against
Keras's composite, the conservative form. Without a gradient tape recording (inference) the
stage leaves Keras's call. Declined, with the reason in the report: a mean over other axes or
without ``keepdims``, axes not known when traced, an input of unknown rank, float64.

Example:
    >>> import numpy as np, tensorflow as tf
    >>> from fusion.calls.rms_norm import rms_statistic
    >>> x = tf.constant(np.linspace(-2.0, 3.0, 12, dtype="float32").reshape(3, 4))
    >>> with tf.GradientTape(persistent=True) as tape:
    ...     _ = tape.watch(x)
    ...     got = x * rms_statistic(x, 1e-6, tf.float32)
    ...     want = x * tf.math.rsqrt(tf.reduce_mean(tf.pow(x, 2.0), -1, keepdims=True) + 1e-6)
    >>> bool(np.allclose(got, want, rtol=1e-6))
    True
    >>> bool(np.allclose(tape.gradient(got, x), tape.gradient(want, x), atol=1e-6))
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import tensorflow as tf
from tensorflow.python.eager import execute

from fusion.family import OBSERVED_AFTER, OBSERVED_ORDER, Family, Form, Forms, conservative, declare
from fusion.platform import Platform
from fusion.stage import (
    XLA,
    XLA_CALLS,
    CallSite,
    Hook,
    StageContext,
    custom_gradient,
    rewrite_call,
    timed_form,
    with_xla,
    xla_region,
)

# -- match: the Keras calls it hooks, and what it finds in them -----------------------------------
FAMILY = "rms_norm"
SCOPE = "tfmx_rms_norm"
MATCHES = ("keras.src.backend.tensorflow:math.rsqrt",
           "keras.src.backend.tensorflow:numpy.reciprocal")
"""The Keras calls the stage hooks: the TensorFlow backend's ``rsqrt`` (``keras.ops.rsqrt``,
``keras.ops.rms_normalization``) and ``reciprocal`` (``keras.ops.reciprocal``, of a
``keras.ops.sqrt``)."""
RSQRT, RECIPROCAL_SQRT = "rsqrt", "reciprocal of sqrt"
_SQUARES = ("Square", "Pow", "Mul")
_16_BIT = (tf.float16, tf.bfloat16)


class Statistic(NamedTuple):
    """An RMS norm's statistic found in the traced ops: ``x`` (the normalized tensor),
    ``epsilon``, how ``x`` was squared (``"Square"``, ``"Pow"``, ``"Mul"``), whether the mean
    of a 16-bit ``x`` was computed in float32 (``widened``), the root (:data:`RSQRT` or
    :data:`RECIPROCAL_SQRT`), the dtype of the call's argument (its output's), and whether the
    mean was a function of its own compiled by XLA (``compiled``: ``keras.ops.mean`` of a
    float16 tensor in Keras 3.16)."""

    x: tf.Tensor
    epsilon: float
    square: str
    widened: bool
    root: str
    dtype: tf.DType
    compiled: bool = False


def _producer(t: tf.Tensor, *types: str) -> tf.Operation | None:
    """``t``'s op (through ``Identity`` ops) if it is of one of ``types``, else None."""
    op = t.op
    while op.type == "Identity":
        op = op.inputs[0].op
    return op if op.type in types else None


def _scalar(t: tf.Tensor) -> float | None:
    """The value of a scalar floating-point constant, else None."""
    op = _producer(t, "Const")
    if op is None or t.shape.rank != 0 or not t.dtype.is_floating:
        return None
    return float(tf.get_static_value(t))


def _squared(t: tf.Tensor) -> tuple[tf.Tensor, str] | None:
    """``(x, how)`` where ``t`` is ``x`` squared (``Square``, ``Pow(x, 2)``, ``Mul(x, x)``)."""
    op = _producer(t, *_SQUARES)
    if op is None:
        return None
    if op.type == "Square":
        return op.inputs[0], "Square"
    if op.type == "Pow":
        return (op.inputs[0], "Pow") if _scalar(op.inputs[1]) == 2.0 else None
    return (op.inputs[0], "Mul") if op.inputs[0] is op.inputs[1] else None


class _Mean(NamedTuple):
    """How a mean was traced: its ``Mean`` op, whether it was computed in float32 between
    casts of a 16-bit tensor (``widened``), the tensor averaged (``source``, in the graph being
    traced), and whether the ``Mean`` is a function of its own compiled by XLA
    (``compiled``)."""

    op: tf.Operation
    widened: bool
    source: tf.Tensor
    compiled: bool = False


def _compiled_mean(m: tf.Tensor) -> _Mean | None:
    """``m`` as the call of a function compiled by XLA whose body is one ``Mean`` of its
    argument (``keras.ops.mean`` of a float16 tensor in Keras 3.16), else None."""
    call = _producer(m, "PartitionedCall", "StatefulPartitionedCall")
    if call is None or len(call.inputs) != 1 or len(call.outputs) != 1:
        return None
    try:
        compiled = call.get_attr("_XlaMustCompile")
        body = call.graph._get_function(call.get_attr("f").name).graph
    except (ValueError, AttributeError, TypeError):
        return None
    if not compiled or body is None or len(body.inputs) != 1 or len(body.outputs) != 1:
        return None
    mean = _producer(body.outputs[0], "Mean")
    kinds = sorted(op.type for op in body.get_operations())
    if (mean is None or mean.inputs[0] is not body.inputs[0]
            or kinds != ["Const", "Identity", "Mean", "Placeholder"]):
        return None
    return _Mean(mean, False, call.inputs[0], compiled=True)


def _mean(m: tf.Tensor) -> _Mean | None:
    """How ``m`` was averaged: a ``Mean``, one computed in float32 between casts of a 16-bit
    tensor (``keras.ops.mean`` of a 16-bit input in Keras 3.15), or one compiled by XLA in a
    function of its own (:func:`_compiled_mean`)."""
    cast = _producer(m, "Cast")
    if cast is not None:
        mean = _producer(cast.inputs[0], "Mean")
        if mean is None or mean.inputs[0].dtype != tf.float32 or m.dtype not in _16_BIT:
            return None
        widen = _producer(mean.inputs[0], "Cast")
        if widen is None or widen.inputs[0].dtype != m.dtype:
            return None
        return _Mean(mean, True, widen.inputs[0])
    mean = _producer(m, "Mean")
    return _compiled_mean(m) if mean is None else _Mean(mean, False, mean.inputs[0])


def find(argument: Any, root: str) -> Statistic | str | None:
    """The RMS statistic whose ``root`` (:data:`RSQRT`, or :data:`RECIPROCAL_SQRT`: then
    ``argument`` is the ``sqrt``'s output) is taken of ``argument``, read from the ops that
    produced it in the graph being traced; a ``str`` where it is one this stage declines (why);
    None where ``argument`` is not such a statistic.

    >>> import keras
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     x = tf.compat.v1.placeholder(tf.float32, [2, 4])
    ...     found = find(keras.ops.mean(keras.ops.power(x, 2), -1, keepdims=True) + 1e-6, RSQRT)
    ...     declined = find(keras.ops.mean(x * x, 1) + 1e-6, RSQRT)
    ...     other = find(x + 1.0, RSQRT)
    >>> found.square, round(found.epsilon, 9), found.widened, declined, other
    ('Pow', 1e-06, False, 'mean without keepdims', None)
    """
    if not tf.is_tensor(argument) or not hasattr(argument, "op"):
        return None
    if argument.graph is not tf.compat.v1.get_default_graph():
        return None
    if root == RECIPROCAL_SQRT:
        sqrt = _producer(argument, "Sqrt")
        if sqrt is None:
            return None
        argument = sqrt.inputs[0]
    add = _producer(argument, "AddV2", "Add")
    if add is None:
        return None
    (a, b) = add.inputs
    epsilon, summed = (_scalar(b), a) if _scalar(b) is not None else (_scalar(a), b)
    mean = None if epsilon is None else _mean(summed)
    squared = None if mean is None else _squared(mean.source)
    if squared is None:
        return None
    x = squared[0]
    why = check(x, mean.op)
    if why is not None:
        return why
    return Statistic(x, epsilon, squared[1], mean.widened, root, argument.dtype, mean.compiled)


# -- check: why a call keeps Keras's own form (None: it need not) ---------------------------------
def check(x: tf.Tensor, mean: tf.Operation) -> str | None:
    """Why the RMS statistic of ``x`` through ``mean`` (its ``Mean`` op) keeps Keras's
    composite, or None.

    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     x = tf.compat.v1.placeholder(tf.float64, [2, 4])
    ...     why = check(x, tf.reduce_mean(x * x, -1, keepdims=True).op)
    >>> why
    'input dtype float64'
    """
    if x.dtype not in (tf.float32, *_16_BIT):
        return f"input dtype {x.dtype.name}"
    rank = x.shape.rank
    if rank is None:
        return "input of unknown rank"
    if not mean.get_attr("keep_dims"):
        return "mean without keepdims"
    axes = tf.get_static_value(mean.inputs[1])
    if axes is None:
        return "normalized axes not known when traced"
    axes = sorted({int(a) % rank for a in (axes.reshape(-1) if rank else [])})
    if axes != [rank - 1]:
        return f"normalized axes {axes} are not the last axis alone of a rank-{rank} input"
    return None


# -- forms: what it emits (CONSERVATIVE: the form Keras runs), and the hook's flow ----------------
CONSERVATIVE = conservative("composite", "Keras's composite")
"""Keras's composite of the statistic, differentiated by autodiff."""
CUSTOM = Form("custom", "RMS norm statistic rsqrt(mean(x^2) + eps): float32, closed-form "
                        "custom gradient",
              marks=frozenset({"Rsqrt"}),
              emits=frozenset({"Cast"}) | {f"{op}:float32" for op in ("Rsqrt", "Mean", "Mul",
                                                                      "AddV2")})
XLA_FORM = Form(XLA, "RMS norm statistic: Keras's composite as one XLA-compiled region "
                     "(forward and gradient)", marks=XLA_CALLS)
FORMS = Forms(SCOPE, (CONSERVATIVE, CUSTOM, XLA_FORM))
"""Every form, emitted under ``tfmx_rms_norm_<form>``: its report label, the ops that show it in
a traced graph (the closed form's Rsqrt, the region's call) and the ops it emits (its casts in
the input's dtype, the rest in float32)."""


@dataclasses.dataclass(frozen=True)
class RmsNormForms:
    """What a backend runs of this family (its ``capability``): the forms' names."""

    forms: tuple[str, ...]


def rms_norm_forms(platform: Platform) -> RmsNormForms:
    """The forms ``platform`` runs besides Keras's composite: on cpu and cuda the closed form
    and the XLA region; on a Metal plugin the closed form where it places every op the form
    emits (in float32), never an XLA region.

    >>> rms_norm_forms(Platform("cpu")).forms
    ('custom', 'xla')
    >>> rms_norm_forms(Platform("metal", kernels=frozenset({"Rsqrt"}))).forms
    ()
    """
    if platform.name in ("cpu", "cuda"):
        return RmsNormForms((CUSTOM.name, XLA_FORM.name))
    return RmsNormForms((CUSTOM.name,) if platform.places(CUSTOM.emits, "float32") else ())


def rms_statistic(x: tf.Tensor, epsilon: float, dtype: tf.DType) -> tf.Tensor:
    """``rsqrt(mean(x^2, axis=-1, keepdims=True) + epsilon)`` computed in float32 (a 16-bit
    ``x`` cast up), in ``dtype``, with its gradient in closed form:
    ``dx = -dinv * inv^3 * x / n``, ``n`` the last axis' length.

    >>> x = tf.constant([[3.0, 4.0]])
    >>> with tf.GradientTape() as tape:
    ...     _ = tape.watch(x)
    ...     inv = rms_statistic(x, 0.0, tf.float32)
    >>> round(float(inv[0, 0]) ** -2, 4), [round(float(v), 5) for v in tape.gradient(inv, x)[0]]
    (12.5, [-0.03394, -0.04525])
    """
    x32 = x if x.dtype == tf.float32 else tf.cast(x, tf.float32)

    @custom_gradient
    def statistic(x32: tf.Tensor) -> Any:
        inv = tf.math.rsqrt(tf.reduce_mean(x32 * x32, -1, keepdims=True) + epsilon)

        def backward(dinv: tf.Tensor) -> tf.Tensor:
            n = x32.shape[-1]  # known where traced, but for a dynamic last axis
            per = (tf.constant(-1.0 / n) if n is not None
                   else -1.0 / tf.cast(tf.shape(x32)[-1], tf.float32))
            return (dinv * (inv * inv * inv) * per) * x32

        return inv, backward

    inv = statistic(x32)
    return inv if dtype == tf.float32 else tf.cast(inv, dtype)


def _mean_of(v: tf.Tensor) -> tf.Tensor:
    return tf.reduce_mean(v, -1, keepdims=True)


def composite(found: Statistic) -> Callable[[tf.Tensor], tf.Tensor]:
    """Keras's composite of the statistic ``found`` as a function of ``x``: what the layer
    traced (how it squared, the mean widened or not, the root), for the tuner and the XLA
    region."""
    # a mean compiled by XLA in a function of its own, as keras.ops.mean of float16 traces it
    mean = tf.function(_mean_of, jit_compile=True, autograph=False) if found.compiled else _mean_of

    def statistic(x: tf.Tensor) -> tf.Tensor:
        squared = {"Square": tf.square, "Pow": lambda v: tf.pow(v, tf.constant(2.0, v.dtype)),
                   "Mul": lambda v: v * v}[found.square](x)
        if found.widened:
            squared = tf.cast(squared, tf.float32)
        var = tf.cast(mean(squared), found.dtype)
        var = var + tf.constant(found.epsilon, found.dtype)
        return tf.math.rsqrt(var) if found.root == RSQRT else tf.math.reciprocal(tf.sqrt(var))

    return statistic


def _fused(ctx: StageContext, original: Callable, argument: Any, root: str) -> Any:
    """Keras's TensorFlow ``rsqrt`` (``root``: :data:`RSQRT`) or ``reciprocal`` while tfmx
    traces: where its argument is an RMS statistic (:func:`find`) and a gradient tape
    records, the tuner's pick of the closed form, the XLA region or Keras's composite."""
    if not tf.inside_function() or not execute.must_record_gradient():
        return original(argument)
    found = find(argument, root)
    if found is None:
        return original(argument)  # not an RMS norm: nothing to record
    from fusion.fragment import shape_text

    x = found.x if isinstance(found, Statistic) else None
    why = found if isinstance(found, str) else None
    stock = composite(found) if x is not None else None

    def normalized(statistic: Callable[[tf.Tensor], tf.Tensor]) -> Callable:
        return lambda v: v * tf.cast(statistic(v), v.dtype)

    def candidates() -> dict:
        timed = {CONSERVATIVE.name: timed_form(normalized(stock), [x.shape], x.dtype),
                 CUSTOM.name: timed_form(normalized(lambda v: rms_statistic(
                     v, found.epsilon, found.dtype)), [x.shape], x.dtype)}
        return with_xla(ctx, timed, normalized(xla_region(stock)), [x.shape], x.dtype,
                        name=XLA_FORM.name)

    def emit(form: Form) -> tf.Tensor:
        if form.name == XLA_FORM.name:
            out = xla_region(stock)(x)
        else:
            out = rms_statistic(x, found.epsilon, found.dtype)
        out.set_shape(argument.shape)
        return out

    def signature() -> str:
        widened = (", mean in float32" if found.widened
                   else ", mean compiled by XLA" if found.compiled else "")
        return (f"RMS norm {found.root} of {found.square} input {shape_text(x.shape)} "
                f"{x.dtype.name}{widened}")

    return rewrite_call(ctx, CallSite(
        DECLARED, (CUSTOM,), keras=lambda: original(argument), emit=emit, what="RMS norm",
        why=why, dtype=None if x is None else x.dtype, signature=signature,
        candidates=candidates))


def fused_rsqrt(ctx: StageContext, original: Callable, x: Any) -> Any:
    """Keras's TensorFlow ``rsqrt`` (``keras.src.backend.tensorflow.math.rsqrt``) while tfmx
    traces (:func:`_fused`)."""
    return _fused(ctx, original, x, RSQRT)


def fused_reciprocal(ctx: StageContext, original: Callable, x: Any) -> Any:
    """Keras's TensorFlow ``reciprocal`` (``keras.src.backend.tensorflow.numpy.reciprocal``)
    while tfmx traces: of a ``sqrt``, :func:`_fused`."""
    return _fused(ctx, original, x, RECIPROCAL_SQRT)


# -- declaration ----------------------------------------------------------------------------------
DECLARED = declare(Family(
    FAMILY,
    "RMS norms written with keras.ops (keras_hub's Llama, Mistral, Qwen, Gemma norms and their "
    "query/key norms, users' layers), matched from the traced ops of rsqrt's (or "
    "reciprocal(sqrt)'s) argument -> the statistic with a closed-form gradient or one XLA "
    "region, where measured faster than Keras's composite",
    hooks=(Hook.on(MATCHES[0], fused_rsqrt), Hook.on(MATCHES[1], fused_reciprocal)),
    forms=FORMS,
    capability=rms_norm_forms,
    after=OBSERVED_AFTER, order=OBSERVED_ORDER,
))
