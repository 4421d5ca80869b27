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
fused loops (a float32 [2048, 128] layer norm and its gradient on a Zen 4: 0.69 against
1.04 ms for the oneDNN form; bfloat16 with the 16-bit kernel 0.79 against 1.27).

Example:
    >>> import keras, numpy as np, tensorflow as tf
    >>> from fusion.stages.layer_norm import layer_norm
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
from typing import Any

import tensorflow as tf

from fusion.bfloat16_bits import widened
from fusion.family import OBSERVED_AFTER, OBSERVED_ORDER, Family, Observed, declare
from fusion.stage import (
    XLA,
    XLA_CALLS,
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

FAMILY = "layer_norm"
SCOPE = "tfmx_layer_norm"
LABEL = "LayerNormalization: FusedBatchNormV3 on [1, rows, cols, 1] (NCHW) + gamma, beta"
CUSTOM_LABEL = "LayerNormalization: composite forward + closed-form custom gradient"
ONEDNN_LABEL = ("LayerNormalization: oneDNN's _MklLayerNorm forward + closed-form custom "
                "gradient")
ONEDNN_OP = "_MklLayerNorm"
RMS_LABEL = "RMSNormalization: composite forward + closed-form custom gradient"


def layer_norm(x: tf.Tensor, gamma: Any, beta: Any, first_axis: int,
               epsilon: float) -> tf.Tensor:
    """Layer norm over the axes ``first_axis:`` of ``x`` through ``FusedBatchNormV3``."""
    dtype = x.dtype
    x32 = x if dtype == tf.float32 else tf.cast(x, tf.float32)
    shape = tf.shape(x32)
    rows = tf.reduce_prod(shape[:first_axis])
    cols = tf.reduce_prod(shape[first_axis:])
    flat = tf.reshape(x32, tf.stack([1, rows, cols, 1]))
    channels = tf.reshape(rows, [1])
    empty = tf.zeros([0], tf.float32)
    normed = tf.raw_ops.FusedBatchNormV3(
        x=flat, scale=tf.ones(channels, tf.float32), offset=tf.zeros(channels, tf.float32),
        mean=empty, variance=empty, epsilon=epsilon, exponential_avg_factor=1.0,
        data_format="NCHW", is_training=True)[0]
    y = tf.reshape(normed, shape)
    if gamma is not None:
        y = y * tf.cast(gamma, tf.float32)
    if beta is not None:
        y = y + tf.cast(beta, tf.float32)
    y.set_shape(x.shape)
    return y if dtype == tf.float32 else tf.cast(y, dtype)


def _normalized(x32: tf.Tensor, axes: list[int], epsilon: float) -> tuple[tf.Tensor, tf.Tensor]:
    """``(xhat, inv)``: ``x32`` normalized over ``axes``, and ``rsqrt(var + epsilon)``."""
    centered = x32 - tf.reduce_mean(x32, axes, keepdims=True)
    inv = tf.math.rsqrt(tf.reduce_mean(centered * centered, axes, keepdims=True) + epsilon)
    return centered * inv, inv


def _closed_form_grad(dy: tf.Tensor, xhat: tf.Tensor, inv: tf.Tensor, g32: Any,
                      axes: list[int], leading: list[int], weights: tuple,
                      has_beta: bool) -> tuple:
    """The layer-norm gradient in closed form: ``dx = inv * (g - mean(g) - xhat * mean(g *
    xhat))``, ``g = dy * gamma`` (``g32``; None: no gamma), then the gradients of ``weights``
    (gamma's if ``g32``, beta's if ``has_beta``: sums over the ``leading`` axes)."""
    g = dy if g32 is None else dy * g32
    dx = inv * (g - tf.reduce_mean(g, axes, keepdims=True)
                - xhat * tf.reduce_mean(g * xhat, axes, keepdims=True))
    dweights = []
    if g32 is not None:
        dweights.append(tf.cast(tf.reduce_sum(dy * xhat, leading), weights[0].dtype))
    if has_beta:
        dweights.append(tf.cast(tf.reduce_sum(dy, leading), weights[-1].dtype))
    return (dx, *dweights)


def layer_norm_custom(x: tf.Tensor, gamma: Any, beta: Any, first_axis: int,
                      epsilon: float, xla_gradient: bool = False) -> tf.Tensor:
    """Layer norm over the axes ``first_axis:`` with its gradient in closed form:
    ``dx = inv * (g - mean(g) - xhat * mean(g * xhat))``, ``g = dy * gamma`` (about ten ops
    where autodiff of Keras's composite builds some twenty-five); with ``xla_gradient`` that
    gradient is one XLA-compiled region."""
    dtype = x.dtype
    x32 = x if dtype == tf.float32 else tf.cast(x, tf.float32)
    axes = list(range(first_axis, x.shape.rank))
    leading = list(range(first_axis))
    args = [a for a in (gamma, beta) if a is not None]

    def backward(dy, xhat, inv, *weights):
        g32 = None if gamma is None else tf.cast(weights[0], tf.float32)
        return _closed_form_grad(dy, xhat, inv, g32, axes, leading, weights, beta is not None)

    backward = xla_region(backward) if xla_gradient else backward

    @custom_gradient
    def norm(x32, *weights):
        xhat, inv = _normalized(x32, axes, epsilon)
        y = xhat
        if gamma is not None:
            y = y * tf.cast(weights[0], tf.float32)
        if beta is not None:
            y = y + tf.cast(weights[-1], tf.float32)
        return y, lambda dy: backward(dy, xhat, inv, *weights)

    y = norm(x32, *args)
    return y if dtype == tf.float32 else tf.cast(y, dtype)


def mkl_layer_norm(x: tf.Tensor, scale: tf.Tensor, offset: tf.Tensor,
                   epsilon: float) -> tf.Tensor:
    """oneDNN's layer-norm kernel (``_MklLayerNorm``: ``x`` normalized over its last axis,
    times ``scale``, plus ``offset``; forward only, no registered gradient), eagerly or in a
    graph. The op's name starts with an underscore, so ``tf.raw_ops`` does not list it."""
    if tf.executing_eagerly():  # in a function: eager dispatch of it asks for a kernel label
        return tf.function(mkl_layer_norm, autograph=False)(x, scale, offset, epsilon)
    from tensorflow.python.framework import op_def_library

    _, _, op, _ = op_def_library._apply_op_helper(  # noqa: SLF001 - what tf.raw_ops calls
        ONEDNN_OP, x=x, scale=scale, offset=offset, epsilon=float(epsilon), name="MklLayerNorm")
    return op.outputs[0]


def onednn_layer_norm_registered(dtype: tf.DType = tf.float32) -> bool:
    """True if this TensorFlow has a CPU kernel of oneDNN's ``_MklLayerNorm`` for ``dtype``."""
    from tensorflow.python.framework import kernels

    try:
        found = kernels.get_registered_kernels_for_op(ONEDNN_OP).kernel
    except Exception:  # noqa: BLE001 - an op this build does not know
        return False
    return any(k.device_type == "CPU"
               and all(dtype.as_datatype_enum in c.allowed_values.list.type
                       for c in k.constraint if c.name == "T")
               for k in found)


@functools.cache
def onednn_layer_norm_runs(dtype_name: str) -> bool:
    """True if oneDNN's ``_MklLayerNorm`` has a CPU kernel for this dtype and runs it on this
    processor: registered is not enough (oneDNN builds its primitive when the op first runs,
    and refuses float16 on a CPU without AVX-512 FP16 support and bfloat16 on one without
    AVX-512), so a two-row probe runs once per process and dtype.

    >>> onednn_layer_norm_runs("float32")
    True
    """
    dtype = tf.as_dtype(dtype_name)
    if not onednn_layer_norm_registered(dtype):
        return False
    try:
        with tf.init_scope():  # eagerly, also when asked while a function is traced
            probe = mkl_layer_norm(tf.zeros([2, 8], dtype), tf.ones([8], dtype),
                                   tf.zeros([8], dtype), 1e-3)
            probe.numpy()
    except Exception:  # noqa: BLE001 - any refusal of the kernel means: not offered
        return False
    return True


def onednn_backward(epsilon: float, has_gamma: bool,
                    has_beta: bool) -> Callable[..., tuple]:
    """The backward of :func:`layer_norm_onednn` as a function of ``(flat, dy, *weights)``:
    the row statistics recomputed from ``flat`` (the kernel returns only its output), then the
    closed form; ``dx`` in ``flat``'s dtype, the weights' gradients in theirs.

    >>> import numpy as np
    >>> dx, dgamma, dbeta = onednn_backward(1e-3, True, True)(
    ...     tf.constant([[1.0, 2.0, 4.0]]), tf.ones([1, 3]), tf.ones([3]), tf.zeros([3]))
    >>> bool(np.allclose(dx, 0.0, atol=1e-6)), dbeta.numpy().tolist()
    (True, [1.0, 1.0, 1.0])
    """

    def backward(flat: tf.Tensor, dy: tf.Tensor, *weights: Any) -> tuple:
        # widened: in an XLA region rounding bfloat16 by integer operations, the 16-bit
        # inputs are widened that way too (fusion.bfloat16_bits); elsewhere a Cast
        xhat, inv = _normalized(widened(flat), [1], epsilon)
        g32 = tf.cast(weights[0], tf.float32) if has_gamma else None
        dx, *dweights = _closed_form_grad(widened(dy), xhat, inv, g32, [1], [0],
                                          weights, has_beta)
        return (tf.cast(dx, flat.dtype), *dweights)

    return backward


def layer_norm_onednn(x: tf.Tensor, gamma: Any, beta: Any, first_axis: int,
                      epsilon: float, in_dtype: bool = False,
                      xla_gradient: bool = False, bfloat16_bits: bool = False) -> tf.Tensor:
    """Layer norm over the last axis of ``x`` (``first_axis`` must be it) through oneDNN's
    ``_MklLayerNorm`` on ``x`` viewed ``[rows, cols]``, with the closed-form gradient of
    :func:`layer_norm_custom` from the row statistics recomputed in the backward (the kernel
    returns only its output). Computed in float32 for 16-bit inputs, cast back; with
    ``in_dtype`` the kernel reads a 16-bit ``x`` as it is (its statistics are float32 inside
    oneDNN) with ``gamma`` and ``beta`` cast to ``x``'s dtype, and writes the output in it:
    no cast of the activations on the way in or out (the output may differ from the float32
    form's by one rounding of gamma and beta), the gradient still computed in float32. With
    ``xla_gradient`` the backward (statistics and closed form) is one XLA-compiled region,
    which with ``bfloat16_bits`` rounds a bfloat16 gradient by integer operations
    (:mod:`fusion.bfloat16_bits`).

    >>> import keras, numpy as np
    >>> x = tf.constant(np.arange(24, dtype="float32").reshape(2, 3, 4) ** 1.5)
    >>> layer = keras.layers.LayerNormalization(epsilon=1e-3)
    >>> expected = layer(x).numpy()
    >>> got = layer_norm_onednn(x, layer.gamma.value, layer.beta.value, 2, 1e-3).numpy()
    >>> bool(np.allclose(got, expected, atol=1e-5))
    True
    """
    if first_axis != x.shape.rank - 1:
        raise ValueError(f"_MklLayerNorm normalizes the last axis alone; axis {first_axis} of "
                         f"a rank-{x.shape.rank} input asks for more")
    dtype = x.dtype
    kernel_dtype = dtype if in_dtype else tf.float32
    cols = x.shape[-1]
    flat = tf.reshape(tf.cast(x, kernel_dtype), [-1, cols])
    args = [a for a in (gamma, beta) if a is not None]

    backward = onednn_backward(epsilon, gamma is not None, beta is not None)
    if xla_gradient:
        backward = xla_region(backward, bfloat16_bits=bfloat16_bits)

    @custom_gradient
    def norm(flat, *weights):
        g32 = tf.cast(weights[0], tf.float32) if gamma is not None else None
        b32 = tf.cast(weights[-1], tf.float32) if beta is not None else None
        y = mkl_layer_norm(flat, tf.cast(tf.ones([cols]) if g32 is None else g32, flat.dtype),
                           tf.cast(tf.zeros([cols]) if b32 is None else b32, flat.dtype),
                           epsilon)
        return y, lambda dy: backward(flat, dy, *weights)

    y = tf.reshape(norm(flat, *args), tf.shape(x))
    y.set_shape(x.shape)
    return tf.cast(y, dtype)


def layer_norm_onednn_16(x: tf.Tensor, gamma: Any, beta: Any, first_axis: int,
                         epsilon: float, xla_gradient: bool = False,
                         bfloat16_bits: bool = False) -> tf.Tensor:
    """:func:`layer_norm_onednn` with the kernel in a 16-bit ``x``'s own dtype
    (``in_dtype=True``).

    >>> import keras, numpy as np
    >>> x = tf.cast(np.arange(24, dtype="float32").reshape(2, 3, 4) ** 1.5, tf.bfloat16)
    >>> layer = keras.layers.LayerNormalization(epsilon=1e-3)
    >>> expected = layer(tf.cast(x, tf.float32)).numpy()
    >>> if onednn_layer_norm_runs("bfloat16"):  # oneDNN builds it on AVX-512 CPUs only
    ...     got = layer_norm_onednn_16(x, layer.gamma.value, layer.beta.value, 2, 1e-3)
    ...     assert got.dtype == tf.bfloat16
    ...     assert np.allclose(got.numpy().astype("float32"), expected, atol=1e-2)
    """
    return layer_norm_onednn(x, gamma, beta, first_axis, epsilon, in_dtype=True,
                             xla_gradient=xla_gradient, bfloat16_bits=bfloat16_bits)


ONEDNN_16 = "onednn 16 bit"
XLA_GRADIENT = " xla gradient"
"""The suffix of a form's name whose gradient is one XLA-compiled region."""


def _xla_gradient_form(form: tuple[Callable, str]) -> tuple[Callable, str]:
    """``form`` (function, report label) with its gradient compiled by XLA."""
    fn, label = form
    return (functools.partial(fn, xla_gradient=True),
            label + ", the gradient one XLA-compiled region")


_PLAIN_FORMS = {
    "fused": (layer_norm, LABEL), "custom": (layer_norm_custom, CUSTOM_LABEL),
    "onednn": (layer_norm_onednn, ONEDNN_LABEL),
    ONEDNN_16: (layer_norm_onednn_16, ONEDNN_LABEL + ", the kernel in the 16-bit input's dtype "
                                                     "(statistics float32)")}
FORMS = {**_PLAIN_FORMS, **{name + XLA_GRADIENT: _xla_gradient_form(_PLAIN_FORMS[name])
                            for name in ("custom", "onednn", ONEDNN_16)}}
"""The correct forms besides Keras's composite: name -> (function, report label)."""


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


RMS_FORMS = {"rms custom": (rms_norm_custom, RMS_LABEL),
             "rms custom" + XLA_GRADIENT: _xla_gradient_form((rms_norm_custom, RMS_LABEL))}
"""The correct form of ``RMSNormalization`` besides Keras's composite."""


def _value(variable: Any) -> Any:
    """A Keras variable's tensor (read where the tape records it), None stays None."""
    return None if variable is None else variable.value


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
    from keras.src.layers.merging.add import Add

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


def find_layer_norm(layer: Any, inputs: Any, target: Any) -> tuple[int | None, str | None]:
    """(first normalized axis, None) for a layer call this stage can fuse, or (None, why)."""
    if getattr(layer, "rms_scaling", False):
        return None, "rms_scaling=True (scales by the variance, no mean subtracted: no kernel)"
    return find_rms_norm(layer, inputs)


def fused_blocker(layer: Any, target: Any) -> str | None:
    """Why ``target`` cannot run the ``FusedBatchNormV3`` form of ``layer``, or None."""
    from fusion.patterns.batch_norm_kernels import (
        kernel_blocker,  # (the patterns import the stages)
    )

    return kernel_blocker(target, "FusedBatchNormV3", "float32", "NCHW", True, None,
                          float(layer.epsilon))


def onednn_blocker(first: int, inputs: Any, target: Any) -> str | None:
    """Why the ``_MklLayerNorm`` form is not offered for this call, or None."""
    if first != inputs.shape.rank - 1:
        return "oneDNN's layer norm normalizes the last axis alone"
    if not target.runs_op(ONEDNN_OP) or not onednn_layer_norm_registered():
        return f"{target.name} runs no {ONEDNN_OP}"
    return None


RESIDUAL = "residual xla"  # the layer and the residual Add before it as one XLA region
XLA_LABELS = {"xla": "LayerNormalization: one XLA-compiled region (forward and gradient)",
              "rms xla": "RMSNormalization: one XLA-compiled region (forward and gradient)",
              RESIDUAL: "LayerNormalization + the residual Add before it: one XLA-compiled "
                        "region (forward and gradient)",
              f"rms {RESIDUAL}": "RMSNormalization + the residual Add before it: one "
                                 "XLA-compiled region (forward and gradient)"}
LABELS = {**{f: label for f, (_, label) in FORMS.items()},
          **{f: label for f, (_, label) in RMS_FORMS.items()}, **XLA_LABELS}
"""Every form's report label, by its name in the stage's scopes (``tfmx_layer_norm_<form>``)."""


def _rewrite(ctx: StageContext, original: Callable, layer: Any, inputs: tf.Tensor,
             first: int | None, why: str | None, forms: dict[str, Callable], prefix: str,
             signature: str) -> Any:
    """The one flow of both hooks: ``forms`` (name -> ``emit(x)``, the first the form taken
    without a tuner) against Keras's composite and, where XLA may run, the composite compiled
    as one region, and after a residual ``Add`` read by this layer alone
    (:func:`find_residual`) the sum and the composite as one region (every form then timed
    from the two summands); the tuner's pick emitted under ``tfmx_layer_norm_<prefix><form>``,
    or Keras's composite with the reason recorded."""
    residual = find_residual(layer, inputs) if ctx.xla and first is not None else None
    variables = layer.trainable_variables

    def keras_form(x: Any) -> Any:
        return original(layer, x)

    def summed(form: Callable) -> Callable:
        return lambda a, b: form(a + b)

    def candidates() -> dict:
        every = {"composite": keras_form, **forms}
        if residual is None:
            timed = {name: timed_form(f, [inputs.shape], inputs.dtype, variables)
                     for name, f in every.items()}
            return with_xla(ctx, timed, xla_region(keras_form), [inputs.shape], inputs.dtype,
                            variables)
        shapes = [t.shape for t in residual]
        every[XLA] = xla_region(keras_form)
        timed = {name: timed_form(summed(f), shapes, inputs.dtype, variables)
                 for name, f in every.items()}
        timed[RESIDUAL] = timed_form(xla_region(summed(keras_form)), shapes, inputs.dtype,
                                     variables)
        return timed

    def emit(form: str) -> Any:
        if form == RESIDUAL:
            return xla_region(summed(keras_form))(*residual)
        return (xla_region(keras_form) if form == XLA else forms[form])(inputs)

    if residual is not None:
        signature += " after a residual Add"
    return rewrite_call(ctx, FAMILY, SCOPE, LABELS, what=signature.split(" ", 1)[0],
                        why=why, forms=list(forms) if first is not None else [],
                        signature=lambda: signature, candidates=candidates,
                        conservative="composite", kept="Keras's composite",
                        keras=lambda: original(layer, inputs), emit=emit, prefix=prefix)


def layer_norm_forms(layer: Any, inputs: Any, target: Any, first: int | None,
                     xla: bool = False) -> list[str]:
    """The forms of :data:`FORMS` ``target`` runs for this call, the one taken without a
    tuner first: the fused one where the backend's batch-norm kernel takes the epsilon, the
    closed form, and oneDNN's kernel where it normalizes the axis, in float32 and, for a
    16-bit input, in the input's dtype where the kernel runs it
    (:func:`onednn_layer_norm_runs`); where XLA may run (``xla``), the closed-form and oneDNN
    forms with their gradient compiled by XLA too.

    >>> import keras
    >>> from tfmx.backends import get_backend
    >>> layer = keras.layers.LayerNormalization()
    >>> layer_norm_forms(layer, tf.zeros([2, 3, 4]), get_backend("metal"), 2)
    ['fused', 'custom']
    >>> layer_norm_forms(layer, tf.zeros([2, 3, 4]), get_backend("cpu"), 2, xla=True)
    ['fused', 'custom', 'onednn', 'custom xla gradient', 'onednn xla gradient']
    """
    names = ["custom"] if fused_blocker(layer, target) else ["fused", "custom"]
    if first is not None and onednn_blocker(first, inputs, target) is None:
        names.append("onednn")
        if inputs.dtype in (tf.float16, tf.bfloat16) and onednn_layer_norm_runs(
                inputs.dtype.name):
            names.append(ONEDNN_16)
    if xla:
        names += [name + XLA_GRADIENT for name in names if name != "fused"]
    return names


def _rounded_gradient(ctx: StageContext, layer: Any, inputs: tf.Tensor) -> bool:
    """Whether the gradient region of the 16-bit oneDNN form rounds a bfloat16 ``dx`` by
    integer operations (:func:`fusion.bfloat16_bits.integer_rounding`, timed on that region at
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
    names = layer_norm_forms(layer, inputs, ctx.target, first, ctx.xla)

    # the 16-bit oneDNN form's gradient region rounds bfloat16 as the tuner measures faster,
    # decided before the forms are timed (not while one is)
    rounded = ONEDNN_16 + XLA_GRADIENT in names and why is None and _rounded_gradient(
        ctx, layer, inputs)

    def emit(name: str) -> Callable[[Any], Any]:
        extra = {"bfloat16_bits": True} if rounded and name == ONEDNN_16 + XLA_GRADIENT else {}

        def form(x: Any) -> Any:
            out = FORMS[name][0](x, _value(layer.gamma), _value(layer.beta), first,
                                 layer.epsilon, **extra)
            return tf.cast(out, layer.compute_dtype)

        return form

    signature = (f"LayerNormalization input {shape_text(inputs.shape)} {inputs.dtype.name} "
                 f"axes {first}: center={layer.center} scale={layer.scale}")
    return _rewrite(ctx, original, layer, inputs, first, why, {n: emit(n) for n in names}, "",
                    signature)


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

    def emit(name: str) -> Callable[[Any], Any]:
        def form(x: Any) -> Any:
            return RMS_FORMS[f"rms {name}"][0](x, _value(layer.scale), first, layer.epsilon)

        return form

    names = ["custom"] + (["custom" + XLA_GRADIENT] if ctx.xla else [])

    signature = f"RMSNormalization input {shape_text(inputs.shape)} {inputs.dtype.name} " \
                f"axes {first}"
    return _rewrite(ctx, original, layer, inputs, first, why, {n: emit(n) for n in names}, "rms ",
                    signature)


_KERNELS = {"fused": frozenset({"FusedBatchNormV3"}), "custom": frozenset({"Rsqrt"}),
            "onednn": frozenset({"_MklLayerNorm"}), ONEDNN_16: frozenset({"_MklLayerNorm"})}
MARKS = {**_KERNELS, **{name + XLA_GRADIENT: ops for name, ops in _KERNELS.items()},
         "rms custom": frozenset({"Rsqrt"}), "rms custom" + XLA_GRADIENT: frozenset({"Rsqrt"}),
         "xla": XLA_CALLS, "rms xla": XLA_CALLS,
         "residual xla": XLA_CALLS, "rms residual xla": XLA_CALLS}
"""Per form, the ops that show it in a traced graph: FusedBatchNormV3 for the fused form, the
Rsqrt of the custom ones, oneDNN's layer norm, the call of an XLA region."""


DECLARED = declare(Family(
    FAMILY,
    "Keras LayerNormalization -> FusedBatchNormV3 on the rows (its registered gradient: "
    "FusedBatchNormGradV3) + gamma, beta, or a closed-form gradient; RMSNormalization -> a "
    "closed-form gradient; emitted before differentiation where measured faster",
    hooks=(Hook("keras.src.layers.normalization.layer_normalization:LayerNormalization", "call",
                fused_layer_call),
           Hook("keras.src.layers.normalization.rms_normalization:RMSNormalization", "call",
                fused_rms_call)),
    observed=Observed(SCOPE, MARKS, LABELS),
    after=OBSERVED_AFTER, order=OBSERVED_ORDER,
))
