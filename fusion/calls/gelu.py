"""The gelu stage: GELU trained with its derivative in closed form, or as one XLA region.

Keras's GELU (``activation="gelu"``, ``keras.activations.gelu``, ``keras.ops.gelu``) runs on
TensorFlow as ``tf.nn.gelu``: ``0.5 * x * erfc(-x / sqrt(2))`` (exact) or
``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))`` (``approximate=True``). Autodiff of
either builds some ten elementwise ops in the backward pass, each a pass over a tensor as large
as the feed-forward layer's output (``[tokens, 4 * width]`` in a transformer: the largest
activations of the step). In training the contraction family cannot fold the GELU into the
MatMul's ``_FusedMatMul`` (its gradient reads the pre-activation, which the fused op does not
output), so this stage rewrites it before differentiation:

- ``custom``: the forward with the cumulative distribution kept, ``cdf = 0.5 + 0.5 * erf(x /
  sqrt(2))``, ``y = x * cdf``, and the derivative in closed form, ``dy/dx = cdf + x * pdf(x)``
  (``pdf(x) = exp(-x^2 / 2) / sqrt(2 pi)``); ``custom erfc`` the same with TensorFlow's own CDF,
  ``0.5 * erfc(-x / sqrt(2))`` (its forward equals the composite's bit for bit; on some
  CPUs Erfc runs at half Erf's speed); for the tanh approximation
  ``dy/dx = 0.5 * (1 + t) + 0.5 * x * (1 - t^2) * sqrt(2 / pi) * (1 + 3 * 0.044715 * x^2)``.
- ``custom upcast`` (float16 and bfloat16 inputs): the ``custom`` form computed in float32, the
  input cast up and the output (and the gradient) cast back: on a CPU a 16-bit ``Erf`` or
  ``Exp`` converts every element to float32 and back, so there the wider form is faster
  and rounds once instead of at every op;
- ``xla`` (cpu and cuda with ``tfmx.enable(xla=True)``, never metal): the GELU and its
  derivative computed in float32 by one XLA-compiled region, one fused loop that reads the
  input once and writes both, the derivative kept (in the input's dtype) for a backward of
  one multiplication outside XLA. TensorFlow's kernels make a pass over the tensor per op
  some twelve), so on a CPU the region is often the cheaper forward (also against the
  ``custom`` form compiled with its gradient as a second region, and in bfloat16 against
  ``upcast slope kept``).

Which is fastest depends on the machine and the shape, so every call is a tuner decision
(forward and backward at the call's shapes) against the composite, the conservative form.
Without a gradient tape recording (inference) the stage leaves the composite as it is: the
contraction family then fuses it into the MatMul as ``_FusedMatMul`` (``GeluExact``). Declined,
with the reason in the report: inputs that are not float32, float16 or bfloat16.

Example:
    >>> import numpy as np, tensorflow as tf
    >>> from fusion.calls.gelu import gelu_custom
    >>> x = tf.constant(np.linspace(-4.0, 4.0, 9, dtype="float32"))
    >>> with tf.GradientTape() as tape:
    ...     _ = tape.watch(x)
    ...     y = gelu_custom(x, approximate=False)
    >>> dx = tape.gradient(y, x)
    >>> with tf.GradientTape() as tape:
    ...     _ = tape.watch(x)
    ...     expected = tf.nn.gelu(x, approximate=False)
    >>> bool(np.allclose(y, expected, atol=1e-6))
    True
    >>> bool(np.allclose(dx, tape.gradient(expected, x), atol=1e-6))
    True
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import execute

from fusion.family import OBSERVED_AFTER, OBSERVED_ORDER, Family, Form, Forms, conservative, declare
from fusion.kernels.activations import gelu_exact as _exact
from fusion.kernels.activations import gelu_tanh as _tanh
from fusion.stage import (
    XLA,
    XLA_CALLS,
    CallSite,
    Hook,
    StageContext,
    custom_gradient,
    integer_rounding,
    rewrite_call,
    timed_form,
    with_xla,
    xla_region,
)

# -- match: the Keras calls it hooks, and what it finds in them -----------------------------------
FAMILY = "gelu"
SCOPE = "tfmx_gelu"
MATCHES = ("keras.src.backend.tensorflow:nn.gelu",)
"""The Keras call the stage hooks: the TensorFlow backend's ``gelu`` (``activation="gelu"``,
``keras.activations.gelu``, ``keras.ops.gelu``)."""


# -- check: why a call keeps Keras's own form (None: it need not) ---------------------------------
_DTYPES = ("float32", "float16", "bfloat16")


def check(x: Any) -> str | None:
    """Why the stage leaves this GELU to the composite, or None.

    >>> check(tf.zeros([2, 3])), check(tf.zeros([2], tf.float64))
    (None, 'input dtype float64')
    """
    if x.dtype.name not in _DTYPES:
        return f"input dtype {x.dtype.name}"
    if x.shape.rank is None:
        return "input of unknown rank"
    return None


# -- forms: what it emits (CONSERVATIVE: the form Keras runs), and the hook's flow ----------------
_EXACT = frozenset({"AddV2", "Erf", "Exp", "Mul", "Sub"})
_ERFC = _EXACT - {"Erf"} | {"Erfc", "Neg"}
_TANH = frozenset({"AddV2", "Mul", "Square", "Sub", "Tanh"})
_CDF = frozenset({"Erf", "Erfc", "Tanh"})


def _wide(ops: frozenset[str]) -> frozenset[str]:
    """``ops`` computed in float32 whatever the input's dtype (``"Op:float32"``)."""
    return frozenset(f"{op}:float32" for op in ops)


CONSERVATIVE = conservative("composite", "the composite")
"""Keras's composite, differentiated by autodiff."""
CUSTOM = Form("custom", "GELU: closed-form derivative (custom gradient)",
              marks=frozenset({"Erf", "Tanh"}), emits=_EXACT)
CUSTOM_TANH = dataclasses.replace(CUSTOM, emits=_TANH)
"""The closed form of the tanh approximation: the same form, its ops the approximation's."""
CUSTOM_ERFC = Form("custom erfc", "GELU: closed-form derivative (custom gradient), "
                                  "TensorFlow's Erfc CDF",
                   marks=frozenset({"Erfc"}), emits=_ERFC)
UPCAST = Form("custom upcast", "GELU: closed-form derivative (custom gradient), computed in "
                               "float32 for a 16-bit input",
              marks=_CDF, emits=frozenset({"Cast"}))
SLOPE_KEPT = Form("upcast slope kept", "GELU: computed in float32 for a 16-bit input, its "
                                       "derivative computed in the forward and kept in 16 bit "
                                       "(the backward one multiplication)",
                  marks=_CDF, emits=frozenset({"Cast", "Mul"}))
XLA_FORM = Form(XLA, "GELU: its value and derivative computed in one XLA-compiled region, the "
                     "backward one multiplication", marks=XLA_CALLS)
FORMS = Forms(SCOPE, (CONSERVATIVE, CUSTOM, CUSTOM_ERFC, UPCAST, SLOPE_KEPT, XLA_FORM))
"""Every form, emitted under ``tfmx_gelu_<form>``: its report label, the ops that show it in a
traced graph (its Erf or Tanh, or its XLA region's call) and the ops it emits in the input's
dtype (an upcast form's float32 ops: :func:`upcast_forms`)."""


def upcast_forms(approximate: bool, erfc: bool = False) -> tuple[Form, Form]:
    """:data:`UPCAST` and :data:`SLOPE_KEPT` with the float32 ops they emit: the exact GELU's
    (through Erfc where ``erfc``) or the tanh approximation's.

    >>> "Erfc:float32" in upcast_forms(False, erfc=True)[0].emits
    True
    >>> sorted(upcast_forms(True)[1].emits)[:3]
    ['AddV2:float32', 'Cast', 'Mul']
    """
    wide = _wide(_TANH if approximate else _ERFC if erfc else _EXACT)
    return (dataclasses.replace(UPCAST, emits=UPCAST.emits | wide),
            dataclasses.replace(SLOPE_KEPT, emits=SLOPE_KEPT.emits | wide))


def gelu_custom(x: tf.Tensor, approximate: bool = False, erfc: bool = False) -> tf.Tensor:
    """GELU of ``x`` (as ``tf.nn.gelu``) with its derivative in closed form, computed in
    ``x``'s dtype: the forward keeps what the derivative needs (the normal CDF, or the tanh of
    the approximation), so the backward is ~5 elementwise ops instead of autodiff's ~10.
    The exact CDF is ``0.5 + 0.5 * erf(x / sqrt(2))``, or with ``erfc`` TensorFlow's own
    ``0.5 * erfc(-x / sqrt(2))`` (the forward then equals ``tf.nn.gelu``'s bit for bit; a
    backend may have one kernel and not the other: tensorflow-metal lists Erfc, not Erf)."""

    @custom_gradient
    def gelu(x: tf.Tensor) -> Any:
        y, slope = _tanh(x) if approximate else _exact(x, erfc)
        return y, lambda dy: dy * slope()

    return gelu(x)


def gelu_slope_kept(x: tf.Tensor, approximate: bool = False, erfc: bool = False) -> tf.Tensor:
    """GELU of a 16-bit ``x`` computed in float32 with its derivative computed in the forward
    too and kept in ``x``'s dtype: the backward is one multiplication in 16 bit (no casts,
    no float32 passes), at the price of one more rounding of the derivative (to 16 bit, as
    Keras's own 16-bit GELU rounds at every op).

    >>> import numpy as np, tensorflow as tf
    >>> x = tf.constant([-1.0, 0.0, 2.0], tf.bfloat16)
    >>> with tf.GradientTape() as tape:
    ...     _ = tape.watch(x)
    ...     y = gelu_slope_kept(x)
    >>> [round(float(v), 2) for v in y], [round(float(v), 2) for v in tape.gradient(y, x)]
    ([-0.16, 0.0, 1.95], [-0.08, 0.5, 1.09])
    """
    return _slope_kept(x, lambda v: _value_and_slope(v, approximate, erfc))


def _slope_kept(x: tf.Tensor, compute: Callable[[tf.Tensor], Any]) -> tf.Tensor:
    """``x``'s GELU from ``compute(x) -> (value, derivative)``, its gradient ``dy`` times the
    derivative computed there."""
    @custom_gradient
    def gelu(x: tf.Tensor) -> Any:
        y, kept = compute(x)
        return y, lambda dy: dy * kept

    return gelu(x)


def _value_and_slope(x: tf.Tensor, approximate: bool, erfc: bool) -> tuple[tf.Tensor, tf.Tensor]:
    """GELU of ``x`` and its derivative, both computed in float32 and returned in ``x``'s
    dtype."""
    y, slope = _tanh(tf.cast(x, tf.float32)) if approximate else _exact(
        tf.cast(x, tf.float32), erfc)
    return tf.cast(y, x.dtype), tf.cast(slope(), x.dtype)


def gelu_xla_slope(x: tf.Tensor, approximate: bool = False,
                   bfloat16_bits: bool = False) -> tf.Tensor:
    """GELU of ``x`` and its derivative computed in one XLA-compiled region (float32 inside: one
    fused loop that reads ``x`` once and writes both), the derivative kept in ``x``'s dtype;
    the backward is one multiplication, outside XLA. For a float32 ``x`` the arithmetic is
    :func:`gelu_custom`'s; a 16-bit ``x`` rounds as :func:`gelu_slope_kept` does. With
    ``bfloat16_bits`` a bfloat16 ``x``'s two results are rounded by integer operations in the
    region's loop (the contributed ``fusion.forms.RegionEdges``: the same bits as XLA's convert).

    >>> import tensorflow as tf
    >>> x = tf.constant([-1.0, 0.0, 2.0], tf.bfloat16)
    >>> with tf.GradientTape() as tape:
    ...     _ = tape.watch(x)
    ...     y = gelu_xla_slope(x)
    >>> y.dtype.name, [round(float(v), 2) for v in y]
    ('bfloat16', [-0.16, 0.0, 1.95])
    >>> [round(float(v), 2) for v in tape.gradient(y, x)]
    [-0.08, 0.5, 1.09]
    """
    region = xla_region(lambda v: _value_and_slope(v, approximate, False),
                        bfloat16_bits=bfloat16_bits and x.dtype == tf.bfloat16)
    return _slope_kept(x, region)


def gelu_upcast(x: tf.Tensor, approximate: bool = False, erfc: bool = False) -> tf.Tensor:
    """:func:`gelu_custom` of a 16-bit ``x`` computed in float32: ``x`` cast up, the GELU and
    its closed-form derivative in float32, the output cast back to ``x``'s dtype (and the
    gradient with it, through the casts' own gradients).

    >>> import tensorflow as tf
    >>> y = gelu_upcast(tf.constant([-1.0, 0.0, 2.0], tf.bfloat16))
    >>> y.dtype.name, [round(float(v), 2) for v in y]
    ('bfloat16', [-0.16, 0.0, 1.95])
    """
    return tf.cast(gelu_custom(tf.cast(x, tf.float32), approximate, erfc), x.dtype)


def _forms(ctx: StageContext, approximate: bool,
           dtype: tf.DType = tf.float32) -> dict[Form, Callable[[Any], Any]]:
    """The closed forms ``ctx``'s backend runs for inputs of ``dtype``, each with its function
    (the first the one taken without a tuner): the exact GELU's CDF through Erf and through
    Erfc where the backend has each kernel, the tanh approximation's one form; for a 16-bit
    input, the first of those computed in float32 too."""
    if approximate:
        forms = {CUSTOM_TANH: lambda v: gelu_custom(v, True)}
    else:
        forms = {}
        if ctx.target.runs_op("Erf"):
            forms[CUSTOM] = lambda v: gelu_custom(v, False)
        forms[CUSTOM_ERFC] = lambda v: gelu_custom(v, False, erfc=True)
    if dtype in (tf.float16, tf.bfloat16):
        erfc = not approximate and not ctx.target.runs_op("Erf")
        upcast, slope_kept = upcast_forms(approximate, erfc)
        forms[upcast] = lambda v: gelu_upcast(v, approximate, erfc)
        forms[slope_kept] = lambda v: gelu_slope_kept(v, approximate, erfc)
    return forms


def fused_gelu(ctx: StageContext, original: Callable, x: Any, approximate: bool = True) -> Any:
    """Keras's TensorFlow ``gelu`` (``keras.src.backend.tensorflow.nn.gelu``) while tfmx
    traces: the closed-form derivative or an XLA region where the tuner measures it faster than
    the composite and a gradient tape records it; else the composite."""
    if not tf.inside_function() or not execute.must_record_gradient():
        return original(x, approximate)  # inference: contraction fuses it into the MatMul
    from fusion.fragment import shape_text

    x = tf.convert_to_tensor(x)
    approximate = bool(approximate)
    forms = _forms(ctx, approximate, x.dtype)

    @functools.cache
    def rounded() -> bool:  # the region's bfloat16 outputs rounded by integer operations
        return x.dtype == tf.bfloat16 and ctx.xla and integer_rounding(
            ctx, "GELU", lambda v: _value_and_slope(v, approximate, False), [x.shape])

    def candidates() -> dict:
        bits = rounded()  # decided before the forms are timed, not while one is
        timed = {CONSERVATIVE.name: timed_form(lambda v: original(v, approximate), [x.shape],
                                               x.dtype),
                 **{form.name: timed_form(f, [x.shape], x.dtype) for form, f in forms.items()}}
        return with_xla(ctx, timed, lambda v: gelu_xla_slope(v, approximate, bits),
                        [x.shape], x.dtype)

    def emit(form: Form) -> Any:
        if form.name == XLA:
            return gelu_xla_slope(x, approximate, rounded())
        return next(f for known, f in forms.items() if known.name == form.name)(x)

    return rewrite_call(ctx, CallSite(
        DECLARED, tuple(forms), keras=lambda: original(x, approximate), emit=emit, what="GELU",
        why=check(x), dtype=x.dtype, candidates=candidates,
        signature=lambda: f"gelu input {shape_text(x.shape)} {x.dtype.name} "
                          f"approximate={approximate}"))


# -- declaration ----------------------------------------------------------------------------------
DECLARED = declare(Family(
    FAMILY,
    "Keras GELU (exact or tanh) in training -> a closed-form derivative (custom gradient) or "
    "one XLA region, where measured faster than autodiff of the composite",
    hooks=(Hook.on(MATCHES[0], fused_gelu),),
    forms=FORMS,
    after=OBSERVED_AFTER, order=OBSERVED_ORDER,
))
