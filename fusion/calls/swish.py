"""The swish stage: swish (SiLU) and hard-swish trained with their derivatives in closed form, or
as one XLA region.

Keras's swish (``activation="swish"`` or ``"silu"``, ``keras.activations.silu``,
``keras.ops.silu``) runs on TensorFlow as ``tf.nn.silu``: ``x * sigmoid(x)``, whose own custom
gradient recomputes the sigmoid in the backward (under a control dependency on the incoming
gradient, so that the forward's sigmoid can be freed) and then builds ``dy * s * (1 + x * (1 -
s))`` in some seven elementwise ops, a Sigmoid among them. Keras's hard-swish
(``activation="hard_swish"`` or ``"hard_silu"``, ``keras.ops.hard_silu``) is a composite,
``x * (relu6(x + 3) / 6)``, differentiated by autodiff: two products, a division, a
``Relu6Grad`` and a sum in the backward. EfficientNet's and MobileNetV3's blocks apply them to
their largest activations, so this stage rewrites them before differentiation:

- ``custom`` (swish): the forward keeps its sigmoid ``s`` and output ``y = x * s``, and the
  derivative is the closed form ``s * (1 + x * (1 - s)) = s + y * (1 - s)``: four elementwise
  ops in the backward and no second Sigmoid (what TensorFlow's gradient saves in memory it
  pays in a transcendental pass; this form keeps ``s`` instead);
- ``custom upcast`` (swish, float16 and bfloat16 inputs): the ``custom`` form computed in
  float32, the input cast up and the output (and the gradient) cast back;
- ``hard custom`` (hard-swish): Keras's own forward (the same bits), the derivative in closed
  form from what it kept: 0 where ``x + 3 <= 0``, 1 where ``x + 3 >= 6``, ``x / 3 + 1 / 2``
  between, written ``(relu6(x + 3) + Relu6Grad(x, x + 3)) / 6``: the subgradients at -3 and 3
  are autodiff's of the composite (``Relu6Grad`` passes nothing where its input is exactly 0
  or 6, so the derivative is 0 at -3 and 1 at 3), the mask read from ``x + 3`` as rounded in
  the input's dtype, as Keras's. Three ops and the product with ``dy`` in the backward (the
  16-bit composite has nothing to gain by float32 casts: its ops are exact but for a division
  and a product, so no upcast form);
- ``xla`` and ``hard xla`` (cpu and cuda with ``tfmx.enable(xla=True)``, never metal): the
  value and its derivative computed in float32 by one XLA-compiled region, one loop that
  reads the input once and writes both, the derivative kept in the input's dtype for a
  backward of one multiplication outside XLA.

Which is fastest depends on the machine and the shape, so every call is a tuner decision
(forward and backward at the call's shapes) against Keras's own call, the conservative form.
Without a gradient tape recording (inference) the stage leaves Keras's call as it is.
Declined, with the reason in the report: inputs that are not float32, float16 or bfloat16.

Example:
    >>> import numpy as np, tensorflow as tf
    >>> from fusion.calls.swish import hard_swish_custom, swish_custom
    >>> x = tf.constant(np.linspace(-4.0, 4.0, 17, dtype="float32"))
    >>> with tf.GradientTape(persistent=True) as tape:
    ...     _ = tape.watch(x)
    ...     y, expected = swish_custom(x), tf.nn.silu(x)
    ...     hard, hard_expected = hard_swish_custom(x), x * (tf.nn.relu6(x + 3.0) / 6.0)
    >>> bool(np.allclose(y, expected, atol=1e-6))
    True
    >>> bool(np.allclose(tape.gradient(y, x), tape.gradient(expected, x), atol=1e-6))
    True
    >>> bool(np.array_equal(hard, hard_expected))
    True
    >>> bool(np.allclose(tape.gradient(hard, x), tape.gradient(hard_expected, x), atol=1e-6))
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import execute

from fusion.family import OBSERVED_AFTER, OBSERVED_ORDER, Family, Form, Forms, conservative, declare
from fusion.kernels.activations import silu as _swish
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
FAMILY = "swish"
SCOPE = "tfmx_swish"
MATCHES = ("keras.src.backend.tensorflow:nn.silu", "keras.src.backend.tensorflow:nn.hard_silu")
"""The Keras calls the stage hooks: the TensorFlow backend's ``silu`` (``activation="swish"``
or ``"silu"``, ``keras.activations.silu``, ``keras.ops.silu``) and ``hard_silu``
(``activation="hard_swish"`` or ``"hard_silu"``, ``keras.ops.hard_swish``)."""


# -- check: why a call keeps Keras's own form (None: it need not) ---------------------------------
_DTYPES = ("float32", "float16", "bfloat16")


def check(x: Any) -> str | None:
    """Why the stage leaves this swish to Keras's call, or None.

    >>> check(tf.zeros([2, 3])), check(tf.zeros([2], tf.float64))
    (None, 'input dtype float64')
    """
    if x.dtype.name not in _DTYPES:
        return f"input dtype {x.dtype.name}"
    if x.shape.rank is None:
        return "input of unknown rank"
    return None


# -- forms: what it emits (CONSERVATIVE: the form Keras runs), and the hook's flow ----------------
_SWISH = frozenset({"AddV2", "Mul", "Sigmoid", "Sub"})
_HARD = frozenset({"AddV2", "Mul", "RealDiv", "Relu6", "Relu6Grad"})

CONSERVATIVE = conservative("keras", "Keras's call")
"""Keras's call: ``tf.nn.silu`` with TensorFlow's gradient, or hard-swish's composite
differentiated by autodiff."""
CUSTOM = Form("custom", "swish: closed-form derivative, sigmoid kept (custom gradient)",
              marks=frozenset({"Sigmoid"}), emits=_SWISH)
UPCAST = Form("custom upcast", "swish: closed-form derivative, sigmoid kept (custom gradient), "
                               "computed in float32 for a 16-bit input",
              marks=frozenset({"Sigmoid"}),
              emits=frozenset({"Cast"}) | frozenset(f"{op}:float32" for op in _SWISH))
XLA_FORM = Form(XLA, "swish: its value and derivative computed in one XLA-compiled region, the "
                     "backward one multiplication", marks=XLA_CALLS)
HARD_CUSTOM = Form("hard custom", "hard-swish: closed-form derivative (custom gradient)",
                   marks=frozenset({"Relu6"}), emits=_HARD)
HARD_XLA = Form(f"hard {XLA}", "hard-swish: its value and derivative computed in one "
                               "XLA-compiled region, the backward one multiplication",
                marks=XLA_CALLS)
FORMS = Forms(SCOPE, (CONSERVATIVE, CUSTOM, UPCAST, XLA_FORM, HARD_CUSTOM, HARD_XLA))
"""Every form, emitted under ``tfmx_swish_<form>``: its report label, the ops that show it in a
traced graph (its Sigmoid or Relu6, or its XLA region's call) and the ops it emits in the
input's dtype (the upcast form's float32 ops as ``"Op:float32"``)."""


def _hard_swish(x: tf.Tensor) -> tuple[tf.Tensor, Callable[[], tf.Tensor]]:
    """Hard-swish of ``x`` as Keras computes it (``x * (relu6(x + 3) / 6)``), and a function
    giving its derivative from what the forward kept: ``(relu6(x + 3) + Relu6Grad(x, x + 3)) /
    6``, autodiff's subgradients at -3 and 3."""
    u = x + tf.constant(3.0, x.dtype)
    r = tf.nn.relu6(u)
    y = x * (r / tf.constant(6.0, x.dtype))

    def slope() -> tf.Tensor:
        return (r + tf.raw_ops.Relu6Grad(gradients=x, features=u)) * tf.constant(1 / 6, x.dtype)

    return y, slope


def _closed_form(compute: Callable[[tf.Tensor], Any], x: tf.Tensor) -> tf.Tensor:
    """``compute(x) -> (value, derivative function)`` as a custom gradient: the backward
    ``dy`` times the derivative."""
    @custom_gradient
    def activation(x: tf.Tensor) -> Any:
        y, slope = compute(x)
        return y, lambda dy: dy * slope()

    return activation(x)


def swish_custom(x: tf.Tensor) -> tf.Tensor:
    """Swish (SiLU) of ``x`` (as ``tf.nn.silu``) with its derivative in closed form, computed in
    ``x``'s dtype: the forward keeps its sigmoid, so the backward is four elementwise ops and no
    second sigmoid (``tf.nn.silu``'s gradient recomputes it).

    >>> x = tf.constant([-2.0, 0.0, 2.0])
    >>> with tf.GradientTape() as tape:
    ...     _ = tape.watch(x)
    ...     y = swish_custom(x)
    >>> [round(float(v), 4) for v in y], [round(float(v), 4) for v in tape.gradient(y, x)]
    ([-0.2384, 0.0, 1.7616], [-0.0908, 0.5, 1.0908])
    """
    return _closed_form(_swish, x)


def swish_upcast(x: tf.Tensor) -> tf.Tensor:
    """:func:`swish_custom` of a 16-bit ``x`` computed in float32: ``x`` cast up, the swish and
    its closed-form derivative in float32, the output cast back to ``x``'s dtype (and the
    gradient with it, through the casts' own gradients).

    >>> y = swish_upcast(tf.constant([-2.0, 0.0, 2.0], tf.bfloat16))
    >>> y.dtype.name, [round(float(v), 2) for v in y]
    ('bfloat16', [-0.24, 0.0, 1.76])
    """
    return tf.cast(swish_custom(tf.cast(x, tf.float32)), x.dtype)


def hard_swish_custom(x: tf.Tensor) -> tf.Tensor:
    """Hard-swish of ``x`` as Keras computes it (the same bits) with its derivative in closed
    form: 0 up to -3, 1 from 3, ``x / 3 + 1 / 2`` between (autodiff's subgradients of Keras's
    composite at -3 and 3).

    >>> x = tf.constant([-4.0, -3.0, 0.0, 1.5, 3.0, 4.0])
    >>> with tf.GradientTape() as tape:
    ...     _ = tape.watch(x)
    ...     y = hard_swish_custom(x)
    >>> [round(float(v), 3) for v in y]
    [-0.0, -0.0, 0.0, 1.125, 3.0, 4.0]
    >>> [round(float(v), 3) for v in tape.gradient(y, x)]
    [0.0, 0.0, 0.5, 1.0, 1.0, 1.0]
    """
    return _closed_form(_hard_swish, x)


def _value_and_slope(x: tf.Tensor, hard: bool) -> tuple[tf.Tensor, tf.Tensor]:
    """Swish (``hard``: hard-swish) of ``x`` and its derivative computed in float32, both
    returned in ``x``'s dtype."""
    y, slope = (_hard_swish if hard else _swish)(tf.cast(x, tf.float32))
    return tf.cast(y, x.dtype), tf.cast(slope(), x.dtype)


def _slope_kept(x: tf.Tensor, compute: Callable[[tf.Tensor], Any]) -> tf.Tensor:
    """``compute(x) -> (value, derivative)`` as a custom gradient: the backward ``dy`` times the
    derivative computed in the forward."""
    @custom_gradient
    def activation(x: tf.Tensor) -> Any:
        y, kept = compute(x)
        return y, lambda dy: dy * kept

    return activation(x)


def swish_xla_slope(x: tf.Tensor, hard: bool = False) -> tf.Tensor:
    """Swish (or with ``hard`` hard-swish) of ``x`` and its derivative computed in one
    XLA-compiled region (float32 inside: one loop that reads ``x`` once and writes both), the
    derivative kept in ``x``'s dtype; the backward is one multiplication, outside XLA. For a
    16-bit ``x`` hard-swish's derivative is the float32 composite's at ``x``: where ``x + 3``
    rounds to 6 in 16 bit (``x`` just below 3), Keras's 16-bit composite gives 1, the region
    ``x / 3 + 1 / 2``.

    >>> x = tf.constant([-3.0, 0.0, 2.0], tf.bfloat16)
    >>> with tf.GradientTape() as tape:
    ...     _ = tape.watch(x)
    ...     y = swish_xla_slope(x, hard=True)
    >>> y.dtype.name, [round(float(v), 2) for v in y]
    ('bfloat16', [-0.0, 0.0, 1.66])
    >>> [round(float(v), 2) for v in tape.gradient(y, x)]
    [0.0, 0.5, 1.16]
    """
    return _slope_kept(x, xla_region(lambda v: _value_and_slope(v, hard)))


def _forms(x: tf.Tensor, hard: bool) -> dict[Form, Callable[[Any], Any]]:
    """The closed forms for an input like ``x``, each with its function (the first the one
    taken without a tuner): hard-swish's one; swish's, and for a 16-bit input swish's computed
    in float32 too (hard-swish's ops are exact but for a division and a product: it has
    nothing to gain by the casts)."""
    if hard:
        return {HARD_CUSTOM: hard_swish_custom}
    forms = {CUSTOM: swish_custom}
    if x.dtype in (tf.float16, tf.bfloat16):
        forms[UPCAST] = swish_upcast
    return forms


def _fused(ctx: StageContext, original: Callable, x: Any, hard: bool) -> Any:
    """Keras's TensorFlow ``silu`` (``hard``: ``hard_silu``) while tfmx traces: a closed-form
    derivative or an XLA region where the tuner measures it faster than Keras's call and a
    gradient tape records it; else Keras's call."""
    if not tf.inside_function() or not execute.must_record_gradient():
        return original(x)  # inference: nothing to save
    from fusion.fragment import shape_text

    x = tf.convert_to_tensor(x)
    forms = _forms(x, hard)
    region = HARD_XLA if hard else XLA_FORM  # offered by the tuner where ctx.xla
    what = "hard-swish" if hard else "swish"

    def candidates() -> dict:
        timed = {CONSERVATIVE.name: timed_form(original, [x.shape], x.dtype),
                 **{form.name: timed_form(f, [x.shape], x.dtype) for form, f in forms.items()}}
        return with_xla(ctx, timed, lambda v: swish_xla_slope(v, hard), [x.shape], x.dtype,
                        name=region.name)

    def emit(form: Form) -> Any:
        if form.name == region.name:
            return swish_xla_slope(x, hard)
        return next(f for known, f in forms.items() if known.name == form.name)(x)

    return rewrite_call(ctx, CallSite(
        DECLARED, tuple(forms), keras=lambda: original(x),
        emit=emit, what=what, why=check(x), dtype=x.dtype, candidates=candidates,
        signature=lambda: f"{what} input {shape_text(x.shape)} {x.dtype.name}"))


def fused_silu(ctx: StageContext, original: Callable, x: Any) -> Any:
    """Keras's TensorFlow ``silu`` (``keras.src.backend.tensorflow.nn.silu``) while tfmx traces
    (:func:`_fused`)."""
    return _fused(ctx, original, x, hard=False)


def fused_hard_silu(ctx: StageContext, original: Callable, x: Any) -> Any:
    """Keras's TensorFlow ``hard_silu`` (``keras.src.backend.tensorflow.nn.hard_silu``) while
    tfmx traces (:func:`_fused`)."""
    return _fused(ctx, original, x, hard=True)


# -- declaration ----------------------------------------------------------------------------------
DECLARED = declare(Family(
    FAMILY,
    "Keras swish (SiLU) and hard-swish in training -> a closed-form derivative (custom "
    "gradient) or one XLA region, where measured faster than Keras's call",
    hooks=(Hook.on(MATCHES[0], fused_silu), Hook.on(MATCHES[1], fused_hard_silu)),
    forms=FORMS,
    after=OBSERVED_AFTER, order=OBSERVED_ORDER,
))
