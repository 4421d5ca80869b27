"""The separable stage: depthwise-separable 2D convolutions (Keras ``SeparableConv2D``,
``keras.ops.separable_conv``: Xception's blocks) with their pointwise projection as a
``MatMul``.

Keras runs a separable convolution as ``tf.nn.separable_conv2d``: TensorFlow's depthwise
convolution, then the pointwise 1x1 projection as a ``Conv2D``. On a CPU the gradients of a 1x1
``Conv2D`` (``Conv2DBackpropInput`` and ``Conv2DBackpropFilter``) are convolution kernels for
what is a plain matrix product over the pixels, and which is faster depends on the machine,
the shapes and on ``TF_ENABLE_ONEDNN_OPTS``, which TensorFlow reads once per process. So each
call is a tuner decision (forward and backward at the call's shapes) between Keras's
convolution, the conservative form, and:

- ``matmul`` (``channels_last``, 2D, no dilation): the same depthwise convolution, then the
  pixels as the rows of one ``MatMul`` by the pointwise kernel read as ``[C * m, filters]``
  (the same products and sums in another kernel; its gradients two ``MatMul`` s);
- ``xla`` (cpu and cuda with ``tfmx.enable(xla=True)``, never metal): Keras's separable
  convolution and its gradient as one XLA-compiled region (``fusion.stage.xla_region``).

Only the convolution is replaced: the bias and the activation run as Keras runs them (the hook
is the backend's ``separable_conv``). A separable convolution outside a gradient tape
(inference) keeps Keras's ops. Declined, with the reason in the report: inputs that are not
floating point, not 4-D (a ``SeparableConv1D``), of unknown spatial or channel size; for the
``matmul`` form, ``channels_first`` or a dilation.

Example:
    >>> import numpy as np, tensorflow as tf
    >>> from fusion.calls.separable import pointwise_as_matmul
    >>> x = tf.random.stateless_normal([2, 6, 6, 4], seed=[1, 2])
    >>> depthwise = tf.random.stateless_normal([3, 3, 4, 2], seed=[3, 4])
    >>> pointwise = tf.random.stateless_normal([1, 1, 8, 5], seed=[5, 6])
    >>> want = tf.nn.separable_conv2d(x, depthwise, pointwise, [1, 1, 1, 1], "SAME")
    >>> got = pointwise_as_matmul(x, depthwise, pointwise, (1, 1), "same")
    >>> bool(np.allclose(got, want, atol=1e-5))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import execute

from fusion import private_api
from fusion.calls import depthwise as depthwise_stage
from fusion.calls.depthwise import pair
from fusion.family import OBSERVED_AFTER, OBSERVED_ORDER, Family, Form, Forms, conservative, declare
from fusion.stage import (
    XLA,
    XLA_CALLS,
    Hook,
    StageContext,
    layer_value,
)

# -- match: the Keras call it hooks, and what it finds in it --------------------------------------
FAMILY = "separable"
SCOPE = "tfmx_separable"
MATCHES = ("keras.src.backend.tensorflow:nn.separable_conv",)
"""The Keras call the stage hooks: the TensorFlow backend's ``separable_conv``
(``SeparableConv2D``, ``SeparableConv1D``, ``keras.ops.separable_conv``): the convolution
alone, not its bias or activation."""


# -- check: why a call keeps Keras's own form (None: it need not) ---------------------------------
def check(x: Any) -> str | None:
    """Why the stage leaves this separable convolution to Keras's ops whatever the form, or None.

    >>> check(tf.zeros([2, 8, 8, 3])) is None
    True
    >>> check(tf.zeros([2, 8, 3])), check(tf.zeros([1, 4, 4, 2], tf.int32))
    ('input of rank 3: only 2D convolutions', 'input dtype int32')
    """
    return depthwise_stage.check(x)  # the same inputs as a depthwise convolution's


def check_matmul(strides: Any, dilation_rate: Any, data_format: str | None) -> str | None:
    """Why a separable convolution cannot take the ``matmul`` form, or None.

    >>> check_matmul(2, 1, "channels_last") is None
    True
    >>> check_matmul(1, 2, "channels_last")
    'dilation (2, 2): not taken by the matmul form'
    >>> check_matmul((1, 2), 1, "channels_last")
    'strides (1, 2): the depthwise kernel takes equal strides'
    """
    standardize = private_api.get("keras.standardize_data_format")
    if standardize(data_format) != "channels_last":
        return "channels_first: the pixels are not the rows of a matrix"
    strides = pair(strides)
    if strides[0] != strides[1]:
        return f"strides {strides}: the depthwise kernel takes equal strides"
    if pair(dilation_rate) != (1, 1):
        return f"dilation {pair(dilation_rate)}: not taken by the matmul form"
    return None


# -- forms: what it emits (CONSERVATIVE: the form Keras runs), and the hook's flow ----------------
CONSERVATIVE = conservative("keras", "Keras's separable convolution")
"""Keras's own separable convolution (DepthwiseConv2dNative, then a 1x1 Conv2D)."""
MATMUL = Form("matmul", "separable convolution -> DepthwiseConv2dNative, the pointwise 1x1 "
                        "projection as one MatMul over the pixels",
              marks=frozenset({"MatMul"}),
              emits=frozenset({"DepthwiseConv2dNative", "MatMul"}))
REGION = Form(XLA, "separable convolution: one XLA-compiled region (forward and gradient)",
              marks=XLA_CALLS)
"""Keras's separable convolution compiled by XLA with its gradient, emitted under
``tfmx_separable_xla``: its region's call shows it in a traced graph; it emits no op a kernel
table decides."""
FORMS = Forms(SCOPE, (CONSERVATIVE, MATMUL, REGION))


def pointwise_as_matmul(x: tf.Tensor, depthwise_kernel: tf.Tensor, pointwise_kernel: tf.Tensor,
                        strides: Sequence[int] | int, padding: str) -> tf.Tensor:
    """The separable 2D convolution of ``x`` (NHWC) as TensorFlow's depthwise convolution by
    ``depthwise_kernel`` (``[kh, kw, C, m]``), then the pixels times ``pointwise_kernel``
    (``[1, 1, C * m, filters]`` read as ``[C * m, filters]``) as one ``MatMul``.

    >>> y = pointwise_as_matmul(tf.ones([1, 3, 3, 2]), tf.ones([3, 3, 2, 1]),
    ...                         tf.ones([1, 1, 2, 3]), 1, "valid")
    >>> y.shape.as_list(), y.numpy().ravel().tolist()
    ([1, 1, 1, 3], [18.0, 18.0, 18.0])
    """
    stride = pair(strides)[0]
    y = tf.nn.depthwise_conv2d(x, depthwise_kernel, [1, stride, stride, 1], padding.upper())
    depth, filters = pointwise_kernel.shape[2], pointwise_kernel.shape[3]
    rows = tf.matmul(tf.reshape(y, [-1, depth]), tf.reshape(pointwise_kernel, [depth, filters]))
    return tf.reshape(rows, tf.concat([tf.shape(y)[:3], [filters]], 0))


def _signature(x: tf.Tensor, depthwise: tf.Tensor, pointwise: tf.Tensor, detail: str) -> str:
    from fusion.fragment import shape_text

    return (f"SeparableConv2D input {shape_text(x.shape)} depthwise "
            f"{shape_text(depthwise.shape)} pointwise {shape_text(pointwise.shape)} "
            f"{x.dtype.name} {detail}")


def fused_separable_conv(ctx: StageContext, original: Callable, inputs: Any,
                         depthwise_kernel: Any, pointwise_kernel: Any, strides: Any = 1,
                         padding: str = "valid", data_format: str | None = None,
                         dilation_rate: Any = 1) -> Any:
    """Keras's TensorFlow ``separable_conv`` while tfmx traces a training step: the ``matmul``
    form or the XLA region where the tuner measures one faster than Keras's ops, else Keras's
    ops."""
    if not tf.inside_function() or not execute.must_record_gradient():
        return original(inputs, depthwise_kernel, pointwise_kernel, strides, padding,
                        data_format, dilation_rate)
    x = tf.convert_to_tensor(inputs)
    depthwise, pointwise = layer_value(depthwise_kernel), layer_value(pointwise_kernel)

    def keras(v: Any, d: Any, p: Any) -> Any:
        return original(v, d, p, strides, padding, data_format, dilation_rate)

    def matmul(v: Any, d: Any, p: Any) -> Any:
        return pointwise_as_matmul(v, d, p, strides, padding)

    why = check(x)
    why_matmul = None if why is not None else check_matmul(strides, dilation_rate, data_format)
    detail = (f"strides {pair(strides)} {padding} dilation {pair(dilation_rate)} "
              f"{data_format or 'default format'}")
    return depthwise_stage.convolution_site(
        ctx, DECLARED, "SeparableConv2D", keras, (x, depthwise, pointwise),
        [(MATMUL, matmul, why_matmul)], why, lambda: _signature(x, depthwise, pointwise, detail))


# -- declaration ----------------------------------------------------------------------------------
DECLARED = declare(Family(
    FAMILY,
    "Keras separable 2D convolutions -> the depthwise convolution and the pointwise projection "
    "as one MatMul, or one XLA-compiled region, where measured faster than Keras's ops",
    hooks=(Hook.on(MATCHES[0], fused_separable_conv),),
    forms=FORMS,
    after=OBSERVED_AFTER, order=OBSERVED_ORDER,
))
