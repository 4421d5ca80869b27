"""The layer_norm family's kernels: Keras's LayerNormalization as ``FusedBatchNormV3`` on the rows,
as its composite forward with a closed-form custom gradient, and as oneDNN's ``_MklLayerNorm``
forward with that gradient (where this TensorFlow registers it), each a function of the layer's
input and weights (:mod:`fusion.calls.layer_norm` decides which a call emits).

Example:
    >>> import numpy as np, tensorflow as tf
    >>> from fusion.kernels.layer_norm import layer_norm_custom
    >>> x = tf.constant(np.arange(6, dtype="float32").reshape(2, 3))
    >>> y = layer_norm_custom(x, None, None, 1, 1e-3)
    >>> [round(float(v), 3) for v in y.numpy()[0]]
    [-1.224, 0.0, 1.224]
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from fusion.forms import custom_gradient, widened, xla_region

ONEDNN_OP = "_MklLayerNorm"


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
        # widened: in an XLA region whose bfloat16 edges are the contributed ones
        # (fusion.forms.RegionEdges), the 16-bit inputs are widened that way too; else a Cast
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
    (the contributed ``fusion.forms.RegionEdges``).

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
