"""The layer_norm stage: Keras ``LayerNormalization`` trained through ``FusedBatchNormV3``.

Keras 3 computes layer norm as a composite (``moments``, ``Rsqrt``, Mul, Add; forward ~10 ops,
its autodiff backward ~25). tf.keras 2 ran it through the batch-norm kernel on a reshaped
tensor, and so does this stage: with the normalized axes the trailing ones, ``x`` of shape
``[d_0, ..., d_k-1 | d_k, ..., d_n]`` is viewed as ``[1, rows, cols, 1]`` in NCHW, every row a
channel, and ``FusedBatchNormV3(is_training=True)`` with unit scale and zero offset gives
``(x - mean) * rsqrt(var + epsilon)`` per row, the layer's ``gamma`` and ``beta`` applied after.
Its registered gradient (``FusedBatchNormGradV3``) is the exact layer-norm gradient. 16-bit
inputs are cast to float32 first, as Keras does, and the result cast back.

A second form, :func:`layer_norm_custom`, keeps the composite forward and gives the gradient
in closed form (``dx = inv * (g - mean(g) - xhat * mean(g * xhat))``): about ten ops where
autodiff of Keras's composite builds some twenty-five. A third, :func:`layer_norm_onednn`,
where the normalized axis is the last one alone and TensorFlow has oneDNN's layer-norm kernel
(``_MklLayerNorm``, registered on x86 CPU builds whatever ``TF_ENABLE_ONEDNN_OPTS`` says; it
has no gradient of its own): the forward one kernel, the same closed-form gradient from
statistics recomputed in the backward. Which is fastest depends on
the machine and the shape (the CPU kernel transposes NCHW to NHWC), so every layer call is a
tuner decision (forward and backward at the call's shapes); the conservative form is Keras's
composite. Declined, with the reason in the
report: ``rms_scaling=True`` (deprecated in Keras; no kernel computes it), normalized axes that
are not the trailing ones, float64, a backend without ``FusedBatchNormV3`` in NCHW, an epsilon
the backend's kernel refuses.

Keras's ``RMSNormalization`` (``x * rsqrt(mean(x^2) + epsilon) * scale``) has no kernel on any
backend (batch norm subtracts a mean); its form besides the composite is
:func:`rms_norm_custom`, the composite forward with a closed-form gradient, again chosen per
call by the tuner. Where XLA may run (cpu, cuda, ``tfmx.enable(xla=True)``), either layer's
composite compiled by XLA as one region (``fusion.stage.xla_region``, its gradient compiled
too) is one more candidate, and so are the closed-form and oneDNN forms with their gradient
alone compiled by XLA (``... xla gradient``): the forward stays TensorFlow's kernels (oneDNN's
layer norm is one kernel), the backward's dozen-odd passes over the tensor (the statistics
recomputed, the two row means, the combination, the weights' column sums) become XLA's few
fused loops (measured faster than the oneDNN form in float32, and in bfloat16 with the 16-bit
kernel).

Example:
    >>> import keras, numpy as np, tensorflow as tf
    >>> from fusion.calls.layer_norm import layer_norm
    >>> x = tf.constant(np.arange(12, dtype="float32").reshape(2, 2, 3))
    >>> composite = keras.layers.LayerNormalization(epsilon=1e-3)
    >>> expected = composite(x).numpy()
    >>> got = layer_norm(x, None, None, 2, 1e-3).numpy()
    >>> bool(np.allclose(got, expected, atol=1e-5))
    True
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import tensorflow as tf

from fusion import private_api
from fusion.family import OBSERVED_AFTER, OBSERVED_ORDER, Family, Form, Forms, conservative, declare
from fusion.kernels.batch_norm import kernel_blocker
from fusion.kernels.layer_norm import (
    ONEDNN_16,
    ONEDNN_OP,
    layer_norm,
    layer_norm_custom,
    layer_norm_onednn,
    layer_norm_onednn_16,
    onednn_backward,
    onednn_layer_norm_registered,
    onednn_layer_norm_runs,
)
from fusion.stage import (
    XLA,
    XLA_CALLS,
    CallSite,
    Hook,
    StageContext,
    custom_gradient,
    functional_neighbours,
    integer_rounding,
    rewrite_call,
    timed_form,
    with_xla,
    xla_region,
)

# -- match: the Keras calls it hooks, and what it finds in them -----------------------------------
FAMILY = "layer_norm"
SCOPE = "tfmx_layer_norm"
MATCHES = ("keras.src.layers.normalization.layer_normalization:LayerNormalization.call",
           "keras.src.layers.normalization.rms_normalization:RMSNormalization.call")
"""The Keras calls the stage hooks: a ``LayerNormalization`` layer's and an
``RMSNormalization`` layer's."""


def _first_axis(layer: Any, ndims: int) -> int | None:
    """The first normalized axis when the normalized axes are the trailing ones, else None."""
    axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    axes = sorted(a % ndims for a in axes)
    if axes != list(range(axes[0], ndims)) or axes[0] == 0:
        return None
    return axes[0]


def find_rms_norm(layer: Any, inputs: Any) -> tuple[int | None, str | None]:
    """(first normalized axis, None) for an ``RMSNormalization`` call the stage can rewrite,
    or (None, why): trailing normalized axes of a float input (what both layers' forms need)."""
    ndims = inputs.shape.rank
    if ndims is None:
        return None, "input of unknown rank"
    first = _first_axis(layer, ndims)
    if first is None:
        return None, f"normalized axes {layer.axis} are not the trailing axes of a rank-" \
                     f"{ndims} input"
    if inputs.dtype.name not in ("float32", "float16", "bfloat16"):
        return None, f"input dtype {inputs.dtype.name}"
    return first, None


def find_layer_norm(layer: Any, inputs: Any, target: Any) -> tuple[int | None, str | None]:
    """(first normalized axis, None) for a layer call this stage can fuse, or (None, why)."""
    why = check(layer)
    return (None, why) if why else find_rms_norm(layer, inputs)


def find_residual(layer: Any, inputs: Any) -> tuple[tf.Tensor, tf.Tensor] | None:
    """The two summands of the residual ``keras.layers.Add`` whose output is ``inputs`` and
    feeds ``layer`` alone, or None: the two layers may then run as one region, the sum
    inside it. Known only in a Keras functional graph (each layer called once there, the
    ``Add`` of two inputs read by ``layer`` only, so no other reader needs the sum) for an
    ``AddV2`` of two tensors of the output's shape (no broadcast) traced in this graph.

    >>> import keras
    >>> inp = keras.Input((4, 8))
    >>> norm = keras.layers.LayerNormalization()
    >>> _ = keras.Model(inp, norm(keras.layers.Add()([inp, inp])))
    >>> find_residual(norm, tf.ones([2, 4, 8])) is None  # not an AddV2 of this graph
    True
    """
    Add = private_api.get("keras.Add")

    around = functional_neighbours(layer)
    if around is None or len(around[0]) != 1 or not isinstance(around[0][0], Add):
        return None
    summed = functional_neighbours(around[0][0])
    if summed is None or len(summed[0]) != 2 or summed[1] != [layer]:
        return None
    op = getattr(inputs, "op", None)
    if (op is None or op.type != "AddV2" or op.graph is not tf.compat.v1.get_default_graph()
            or not inputs.shape.is_fully_defined()
            or any(t.shape != inputs.shape for t in op.inputs)):
        return None
    return op.inputs[0], op.inputs[1]


# -- check: why a call keeps Keras's own form (None: it need not) ---------------------------------
def check(layer: Any) -> str | None:
    """Why this ``LayerNormalization`` keeps Keras's composite whatever its input (its axes
    and dtype: :func:`find_rms_norm`), or None.

    >>> import keras
    >>> check(keras.layers.LayerNormalization()) is None
    True
    """
    if getattr(layer, "rms_scaling", False):
        return "rms_scaling=True (scales by the variance, no mean subtracted: no kernel)"
    return None


def fused_blocker(layer: Any, target: Any) -> str | None:
    """Why ``target`` cannot run the ``FusedBatchNormV3`` form of ``layer``, or None."""
    return kernel_blocker(target, "FusedBatchNormV3", "float32", "NCHW", True, None,
                          float(layer.epsilon))


def onednn_blocker(first: int, inputs: Any, target: Any) -> str | None:
    """Why the ``_MklLayerNorm`` form is not offered for this call, or None."""
    if first != inputs.shape.rank - 1:
        return "oneDNN's layer norm normalizes the last axis alone"
    if not target.runs_op(ONEDNN_OP) or not onednn_layer_norm_registered():
        return f"{target.name} runs no {ONEDNN_OP}"
    return None


# -- forms: what it emits (CONSERVATIVE: the form Keras runs), and the hook's flow ----------------
CONSERVATIVE = conservative("composite", "Keras's composite")
"""Keras's composite, differentiated by autodiff."""
XLA_GRADIENT = " xla gradient"
"""What a form whose gradient is one XLA-compiled region adds to its name."""
_CAST = frozenset({"Cast"})


def _float32(*ops: str) -> frozenset[str]:
    """The input's casts, and ``ops`` computed in float32 (``"Op:float32"``)."""
    return _CAST | {f"{op}:float32" for op in ops}


def _xla_gradient(form: Form) -> Form:
    """``form`` with its gradient compiled by XLA: its forward's marks and ops."""
    return form.extended(XLA_GRADIENT, form.label + ", the gradient one XLA-compiled region",
                         build=functools.partial(form.build, xla_gradient=True))


def rms_norm_custom(x: tf.Tensor, scale: Any, first_axis: int, epsilon: float,
                    xla_gradient: bool = False) -> tf.Tensor:
    """RMS norm over the axes ``first_axis:`` (``x * rsqrt(mean(x^2) + epsilon) * scale``, as
    Keras's ``RMSNormalization``) with its gradient in closed form:
    ``dx = inv * (g - xhat * mean(g * xhat))``, ``g = dy * scale``, ``xhat = x * inv``.
    No kernel computes RMS norm (batch norm subtracts a mean), so this is the one form besides
    Keras's composite. Computed in float32 for 16-bit inputs, cast back to ``x``'s dtype; with
    ``xla_gradient`` the gradient is one XLA-compiled region.

    >>> import keras, numpy as np
    >>> x = tf.constant(np.arange(1, 13, dtype="float32").reshape(2, 2, 3))
    >>> layer = keras.layers.RMSNormalization(epsilon=1e-6)
    >>> expected = layer(x).numpy()
    >>> got = rms_norm_custom(x, layer.scale.value, 2, 1e-6).numpy()
    >>> bool(np.allclose(got, expected, rtol=1e-6))
    True
    """
    dtype = x.dtype
    x32 = x if dtype == tf.float32 else tf.cast(x, tf.float32)
    axes = list(range(first_axis, x.shape.rank))
    leading = list(range(first_axis))
    args = [] if scale is None else [scale]

    def backward(dy, xhat, inv, *weights):
        g = dy if not weights else dy * tf.cast(weights[0], tf.float32)
        dx = inv * (g - xhat * tf.reduce_mean(g * xhat, axes, keepdims=True))
        if not weights:
            return dx
        return dx, tf.cast(tf.reduce_sum(dy * xhat, leading), weights[0].dtype)

    backward = xla_region(backward) if xla_gradient else backward

    @custom_gradient
    def norm(x32, *weights):
        inv = tf.math.rsqrt(tf.reduce_mean(x32 * x32, axes, keepdims=True) + epsilon)
        xhat = x32 * inv
        y = xhat if not weights else xhat * tf.cast(weights[0], tf.float32)
        return y, lambda dy: backward(dy, xhat, inv, *weights)

    y = norm(x32, *args)
    return y if dtype == tf.float32 else tf.cast(y, dtype)


_ONEDNN_LABEL = ("LayerNormalization: oneDNN's _MklLayerNorm forward + closed-form custom "
                 "gradient")
FUSED = Form("fused", "LayerNormalization: FusedBatchNormV3 on [1, rows, cols, 1] (NCHW) + "
                      "gamma, beta",
             marks=frozenset({"FusedBatchNormV3"}), build=layer_norm,
             emits=_float32("FusedBatchNormV3", "FusedBatchNormGradV3", "Mul", "AddV2", "Sum"))
CUSTOM = Form("custom", "LayerNormalization: composite forward + closed-form custom gradient",
              marks=frozenset({"Rsqrt"}), build=layer_norm_custom,
              emits=_float32("Rsqrt", "Mean", "Mul", "Sub", "AddV2", "Sum"))
ONEDNN = Form("onednn", _ONEDNN_LABEL, marks=frozenset({"_MklLayerNorm"}),
              build=layer_norm_onednn, emits=_float32("_MklLayerNorm", "Mul", "Sub", "Sum"))
ONEDNN_16_BIT = Form(ONEDNN_16, _ONEDNN_LABEL + ", the kernel in the 16-bit input's dtype "
                                                "(statistics float32)",
                     marks=frozenset({"_MklLayerNorm"}), build=layer_norm_onednn_16,
                     emits=_float32("Mul", "Sub", "Sum") | {"_MklLayerNorm"})
CUSTOM_XLA_GRADIENT, ONEDNN_XLA_GRADIENT, ONEDNN_16_XLA_GRADIENT = (
    _xla_gradient(form) for form in (CUSTOM, ONEDNN, ONEDNN_16_BIT))
RMS_CUSTOM = Form("rms custom", "RMSNormalization: composite forward + closed-form custom "
                                "gradient",
                  marks=frozenset({"Rsqrt"}), build=rms_norm_custom,
                  emits=_float32("Rsqrt", "Mean", "Mul", "Sub", "Sum"))
RMS_CUSTOM_XLA_GRADIENT = _xla_gradient(RMS_CUSTOM)
_REGION = "one XLA-compiled region (forward and gradient)"


class Regions(NamedTuple):
    """A layer's forms as XLA regions: the layer alone, and with the residual ``Add`` before
    it (:func:`find_residual`)."""

    xla: Form
    residual: Form


LAYER_REGIONS = Regions(
    Form(XLA, f"LayerNormalization: {_REGION}", marks=XLA_CALLS),
    Form("residual xla", f"LayerNormalization + the residual Add before it: {_REGION}",
         marks=XLA_CALLS))
RMS_REGIONS = Regions(
    Form("rms xla", f"RMSNormalization: {_REGION}", marks=XLA_CALLS),
    Form("rms residual xla", f"RMSNormalization + the residual Add before it: {_REGION}",
         marks=XLA_CALLS))
LAYER_FORMS = (FUSED, CUSTOM, ONEDNN, ONEDNN_16_BIT, CUSTOM_XLA_GRADIENT, ONEDNN_XLA_GRADIENT,
               ONEDNN_16_XLA_GRADIENT)
"""The forms of ``LayerNormalization`` besides Keras's composite and the XLA regions."""
RMS_FORMS = (RMS_CUSTOM, RMS_CUSTOM_XLA_GRADIENT)
"""The forms of ``RMSNormalization`` besides Keras's composite and the XLA regions."""
FORMS = Forms(SCOPE, (CONSERVATIVE, *LAYER_FORMS, *RMS_FORMS, *LAYER_REGIONS, *RMS_REGIONS))
"""Every form, emitted under ``tfmx_layer_norm_<form>``: its report label, the ops that show it
in a traced graph (FusedBatchNormV3 for the fused form, the Rsqrt of the closed forms, oneDNN's
layer norm, the call of an XLA region), the ops it emits (in the input's dtype its casts, the
oneDNN 16-bit kernel in it, the rest in float32; a form whose gradient XLA compiles emits the
forward's) and its function."""


def _value(variable: Any) -> Any:
    """A Keras variable's tensor (read where the tape records it), None stays None."""
    return None if variable is None else variable.value


def layer_norm_forms(layer: Any, inputs: Any, target: Any, first: int | None,
                     xla: bool = False) -> list[Form]:
    """The forms of ``LayerNormalization`` ``target`` runs for this call, the one taken
    without a tuner first: the fused one where the backend's batch-norm kernel takes the
    epsilon, the closed form, and oneDNN's kernel where it normalizes the axis, in float32
    and, for a 16-bit input, in the input's dtype where the kernel runs it
    (:func:`onednn_layer_norm_runs`); where XLA may run (``xla``), the closed-form and oneDNN
    forms with their gradient compiled by XLA too.

    >>> import keras
    >>> from tfmx.backends import get_backend
    >>> layer = keras.layers.LayerNormalization()
    >>> [f.name for f in layer_norm_forms(layer, tf.zeros([2, 3, 4]), get_backend("metal"), 2)]
    ['fused', 'custom']
    >>> [f.name for f in layer_norm_forms(layer, tf.zeros([2, 3, 4]), get_backend("cpu"), 2,
    ...                                   xla=True)]
    ['fused', 'custom', 'onednn', 'custom xla gradient', 'onednn xla gradient']
    """
    forms = [CUSTOM] if fused_blocker(layer, target) else [FUSED, CUSTOM]
    if first is not None and onednn_blocker(first, inputs, target) is None:
        forms.append(ONEDNN)
        if inputs.dtype in (tf.float16, tf.bfloat16) and onednn_layer_norm_runs(
                inputs.dtype.name):
            forms.append(ONEDNN_16_BIT)
    if xla:
        gradient = {CUSTOM: CUSTOM_XLA_GRADIENT, ONEDNN: ONEDNN_XLA_GRADIENT,
                    ONEDNN_16_BIT: ONEDNN_16_XLA_GRADIENT}
        forms += [gradient[form] for form in forms if form in gradient]
    return forms


def _rounded_gradient(ctx: StageContext, layer: Any, inputs: tf.Tensor) -> bool:
    """Whether the gradient region of the 16-bit oneDNN form rounds a bfloat16 ``dx`` by
    integer operations (:func:`fusion.forms.integer_rounding`, timed on that region at
    the call's rows and columns)."""
    if inputs.dtype != tf.bfloat16 or not ctx.xla:
        return False
    cols = int(inputs.shape[-1])
    known = inputs.shape[:-1]
    rows = math.prod(known) if known.is_fully_defined() else None
    count = sum(w is not None for w in (layer.gamma, layer.beta))
    backward = onednn_backward(layer.epsilon, layer.gamma is not None, layer.beta is not None)

    def region(flat: tf.Tensor, dy: tf.Tensor) -> tuple:  # weights made in the timed graph
        return backward(flat, dy, *[tf.ones([cols]) for _ in range(count)])

    return integer_rounding(ctx, "LayerNormalization gradient", region,
                            [[rows, cols], [rows, cols]])


def _rewrite(ctx: StageContext, original: Callable, layer: Any, inputs: tf.Tensor,
             first: int | None, why: str | None, forms: dict[Form, Callable], regions: Regions,
             signature: str) -> Any:
    """The one flow of both hooks: ``forms`` (each with its ``emit(x)``, the first the form
    taken without a tuner) against Keras's composite and, where XLA may run, the composite
    compiled as one region (``regions.xla``), and after a residual ``Add`` read by this layer
    alone (:func:`find_residual`) the sum and the composite as one region
    (``regions.residual``; every form then timed from the two summands); the tuner's pick
    emitted under its scope, or Keras's composite with the reason recorded."""
    residual = find_residual(layer, inputs) if ctx.xla and first is not None else None
    variables = layer.trainable_variables

    def keras_form(x: Any) -> Any:
        return original(layer, x)

    def summed(form: Callable) -> Callable:
        return lambda a, b: form(a + b)

    def candidates() -> dict:
        every = {CONSERVATIVE.name: keras_form, **{f.name: emit for f, emit in forms.items()}}
        if residual is None:
            timed = {name: timed_form(f, [inputs.shape], inputs.dtype, variables)
                     for name, f in every.items()}
            return with_xla(ctx, timed, xla_region(keras_form), [inputs.shape], inputs.dtype,
                            variables, name=regions.xla.name)
        shapes = [t.shape for t in residual]
        every[regions.xla.name] = xla_region(keras_form)
        timed = {name: timed_form(summed(f), shapes, inputs.dtype, variables)
                 for name, f in every.items()}
        timed[regions.residual.name] = timed_form(xla_region(summed(keras_form)), shapes,
                                                  inputs.dtype, variables)
        return timed

    def emit(form: Form) -> Any:
        if form == regions.residual:
            return xla_region(summed(keras_form))(*residual)
        return (xla_region(keras_form) if form == regions.xla else forms[form])(inputs)

    if residual is not None:
        signature += " after a residual Add"
    return rewrite_call(ctx, CallSite(
        DECLARED, tuple(forms) if first is not None else (),
        keras=lambda: original(layer, inputs), emit=emit, what=signature.split(" ", 1)[0],
        why=why, dtype=inputs.dtype, signature=lambda: signature, candidates=candidates))


def fused_layer_call(ctx: StageContext, original: Callable, layer: Any, inputs: Any,
                     *args: Any, **kwargs: Any) -> Any:
    """``LayerNormalization.call`` while tfmx traces: the fused, closed-form or XLA form
    where it is correct and (by the tuner) faster, else Keras's composite with the reason
    recorded."""
    if not tf.inside_function() or args or kwargs:
        return original(layer, inputs, *args, **kwargs)
    from fusion.fragment import shape_text

    inputs = tf.convert_to_tensor(inputs)
    first, why = find_layer_norm(layer, inputs, ctx.target)
    forms = layer_norm_forms(layer, inputs, ctx.target, first, ctx.xla)
    # the 16-bit oneDNN form's gradient region rounds bfloat16 as the tuner measures faster,
    # decided before the forms are timed (not while one is)
    rounded = ONEDNN_16_XLA_GRADIENT in forms and why is None and _rounded_gradient(
        ctx, layer, inputs)

    def emit(form: Form) -> Callable[[Any], Any]:
        extra = {"bfloat16_bits": True} if rounded and form == ONEDNN_16_XLA_GRADIENT else {}

        def run(x: Any) -> Any:
            out = form.build(x, _value(layer.gamma), _value(layer.beta), first, layer.epsilon,
                             **extra)
            return tf.cast(out, layer.compute_dtype)

        return run

    signature = (f"LayerNormalization input {shape_text(inputs.shape)} {inputs.dtype.name} "
                 f"axes {first}: center={layer.center} scale={layer.scale}")
    return _rewrite(ctx, original, layer, inputs, first, why, {f: emit(f) for f in forms},
                    LAYER_REGIONS, signature)


def fused_rms_call(ctx: StageContext, original: Callable, layer: Any, inputs: Any,
                   *args: Any, **kwargs: Any) -> Any:
    """``RMSNormalization.call`` while tfmx traces: the closed-form gradient or the XLA
    region where the tuner measures it faster than Keras's composite, else the composite with
    the reason recorded."""
    if not tf.inside_function() or args or kwargs:
        return original(layer, inputs, *args, **kwargs)
    from fusion.fragment import shape_text

    inputs = tf.convert_to_tensor(inputs)
    first, why = find_rms_norm(layer, inputs)

    def emit(form: Form) -> Callable[[Any], Any]:
        def run(x: Any) -> Any:
            return form.build(x, _value(layer.scale), first, layer.epsilon)

        return run

    forms = [RMS_CUSTOM] + ([RMS_CUSTOM_XLA_GRADIENT] if ctx.xla else [])
    signature = f"RMSNormalization input {shape_text(inputs.shape)} {inputs.dtype.name} " \
                f"axes {first}"
    return _rewrite(ctx, original, layer, inputs, first, why, {f: emit(f) for f in forms},
                    RMS_REGIONS, signature)


# -- declaration ----------------------------------------------------------------------------------
DECLARED = declare(Family(
    FAMILY,
    "Keras LayerNormalization -> FusedBatchNormV3 on the rows (its registered gradient: "
    "FusedBatchNormGradV3) + gamma, beta, or a closed-form gradient; RMSNormalization -> a "
    "closed-form gradient; emitted before differentiation where measured faster",
    hooks=(Hook.on(MATCHES[0], fused_layer_call), Hook.on(MATCHES[1], fused_rms_call)),
    forms=FORMS,
    after=OBSERVED_AFTER, order=OBSERVED_ORDER,
))
