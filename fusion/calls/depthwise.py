"""The depthwise stage: depthwise and grouped 2D convolutions in forms whose speed does not hang
on oneDNN's process-wide switch.

Keras runs a ``DepthwiseConv2D`` (``keras.ops.depthwise_conv``) as TensorFlow's
``DepthwiseConv2dNative``, and a grouped ``Conv2D`` (``groups > 1``: ConvNeXt's 7x7 depthwise
is a ``Conv2D`` with ``groups`` equal to its channels) as a convolution compiled by XLA
(TensorFlow's CPU ``Conv2D`` kernel has no groups): on a CPU the gradient of that grouped
convolution is one of the slowest kernels of a step. Which kernel is fastest depends on the
machine and on ``TF_ENABLE_ONEDNN_OPTS``, which TensorFlow reads once per process, so each
call is a tuner decision (forward and backward at the call's shapes) between Keras's
convolution, the conservative form, and:

- ``native`` (a grouped ``Conv2D`` whose groups are its input channels, ``channels_last``,
  equal strides, no dilation): the same convolution as ``tf.nn.depthwise_conv2d``, its kernel
  ``[kh, kw, 1, C * m]`` read as ``[kh, kw, C, m]`` (the output channels of a group are the
  depthwise multiplier's, in the same order): TensorFlow's depthwise kernels and their
  gradients (oneDNN's or Eigen's, as the process runs them) instead of XLA's grouped ones;
- ``xla`` (cpu and cuda with ``tfmx.enable(xla=True)``, never metal): Keras's convolution and
  its gradient as one XLA-compiled region (``fusion.stage.xla_region``).

Only the convolution is replaced: the bias and the activation run as Keras runs them (the hook
is the backend's ``depthwise_conv`` and ``BaseConv.convolution_op``). A plain ``Conv2D``
(``groups == 1``) is not this family's and passes untouched. A ``DepthwiseConv2D`` outside a
gradient tape (inference) keeps Keras's op, which the contraction family fuses with its bias.
Declined, with the reason in the report: inputs that are not floating point, not 4-D, of
unknown spatial or channel size; for the native form, ``channels_first`` (TensorFlow's CPU
depthwise kernel takes NHWC), unequal strides, dilation, or groups other than the channels.

Example:
    >>> import numpy as np, tensorflow as tf
    >>> from fusion.calls.depthwise import grouped_as_depthwise
    >>> x = tf.random.stateless_normal([2, 6, 6, 4], seed=[1, 2])
    >>> kernel = tf.random.stateless_normal([3, 3, 1, 8], seed=[3, 4])  # groups 4, 2 per group
    >>> grouped = tf.function(lambda x, k: tf.nn.conv2d(x, k, 1, "SAME"), jit_compile=True)
    >>> got = grouped_as_depthwise(x, kernel, strides=(1, 1), padding="same")
    >>> bool(np.allclose(got, grouped(x, kernel), atol=1e-5))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import execute

from fusion import private_api
from fusion.family import OBSERVED_AFTER, OBSERVED_ORDER, Family, Form, Forms, conservative, declare
from fusion.stage import (
    XLA,
    XLA_CALLS,
    CallSite,
    Hook,
    StageContext,
    layer_value,
    rewrite_call,
    timed_form,
    xla_region,
)

# -- match: the Keras calls it hooks, and what it finds in them -----------------------------------
FAMILY = "depthwise"
SCOPE = "tfmx_depthwise"
MATCHES = ("keras.src.backend.tensorflow:nn.depthwise_conv",
           "keras.src.layers.convolutional.base_conv:BaseConv.convolution_op")
"""The Keras calls the stage hooks: the TensorFlow backend's ``depthwise_conv``
(``DepthwiseConv2D``, ``keras.ops.depthwise_conv``) and the convolution of a ``Conv2D``
(``BaseConv.convolution_op``: only the convolution, not its bias or activation), of which it
takes the grouped ones."""


def pair(value: Any) -> tuple[int, ...]:
    """An int or a sequence of ints as a tuple (``strides``, ``dilation_rate``).

    >>> pair(2), pair([1, 3])
    ((2, 2), (1, 3))
    """
    return (int(value),) * 2 if isinstance(value, int) else tuple(int(v) for v in value)


def _channels_last(data_format: str | None) -> bool:
    standardize = private_api.get("keras.standardize_data_format")
    return standardize(data_format) == "channels_last"


# -- check: why a call keeps Keras's own form (None: it need not) ---------------------------------
def check(x: Any) -> str | None:
    """Why the stage leaves this convolution to Keras's op whatever the form, or None.

    >>> check(tf.zeros([2, 8, 8, 3])) is None
    True
    >>> check(tf.zeros([2, 8, 3])), check(tf.zeros([1, 4, 4, 2], tf.int32))
    ('input of rank 3: only 2D convolutions', 'input dtype int32')
    """
    if not x.dtype.is_floating:
        return f"input dtype {x.dtype.name}"
    if x.shape.rank != 4:
        return f"input of rank {x.shape.rank}: only 2D convolutions"
    if any(d is None for d in x.shape[1:]):
        return "input of unknown spatial or channel size"
    return None


def check_native(x: Any, groups: int, strides: Any, dilation_rate: Any,
                 data_format: str | None) -> str | None:
    """Why a grouped convolution cannot run as TensorFlow's depthwise convolution (the
    ``native`` form), or None.

    >>> check_native(tf.zeros([2, 8, 8, 6]), 6, 1, 1, "channels_last") is None
    True
    >>> check_native(tf.zeros([2, 8, 8, 6]), 3, 1, 1, "channels_last")
    'groups 3 of 6 channels: not a depthwise convolution'
    >>> check_native(tf.zeros([2, 8, 8, 6]), 6, (1, 2), 1, "channels_last")
    'strides (1, 2): the depthwise kernel takes equal strides'
    """
    if not _channels_last(data_format):
        return "channels_first: TensorFlow's CPU depthwise kernel takes NHWC"
    if groups != x.shape[-1]:
        return f"groups {groups} of {x.shape[-1]} channels: not a depthwise convolution"
    strides = pair(strides)
    if strides[0] != strides[1]:
        return f"strides {strides}: the depthwise kernel takes equal strides"
    if pair(dilation_rate) != (1, 1):
        return f"dilation {pair(dilation_rate)}: not taken by the native form"
    return None


# -- forms: what it emits (CONSERVATIVE: the form Keras runs), and the hook's flow ----------------
CONSERVATIVE = conservative("keras", "Keras's convolution")
"""Keras's own convolution (DepthwiseConv2dNative, or the grouped convolution it compiles)."""
NATIVE = Form("native", "grouped Conv2D (groups = channels) -> TensorFlow's "
                        "DepthwiseConv2dNative", marks=frozenset({"DepthwiseConv2dNative"}),
              emits=frozenset({"DepthwiseConv2dNative"}))
REGION = Form(XLA, "depthwise or grouped convolution: one XLA-compiled region (forward and "
                   "gradient)", marks=XLA_CALLS)
"""Keras's convolution compiled by XLA with its gradient, emitted under ``tfmx_depthwise_xla``:
its region's call shows it in a traced graph; it emits no op a kernel table decides."""
FORMS = Forms(SCOPE, (CONSERVATIVE, NATIVE, REGION))


def grouped_as_depthwise(x: tf.Tensor, kernel: tf.Tensor, strides: Sequence[int],
                         padding: str) -> tf.Tensor:
    """The grouped 2D convolution of ``x`` (NHWC, ``C`` channels) by ``kernel``
    (``[kh, kw, 1, C * m]``: ``C`` groups of one channel) as TensorFlow's depthwise
    convolution: the kernel read as ``[kh, kw, C, m]``, output channel ``c * m + j`` the
    ``j``-th of group ``c`` in both.

    >>> y = grouped_as_depthwise(tf.ones([1, 3, 3, 2]), tf.ones([3, 3, 1, 4]), (1, 1), "valid")
    >>> y.shape.as_list(), y.numpy().ravel().tolist()
    ([1, 1, 1, 4], [9.0, 9.0, 9.0, 9.0])
    """
    kh, kw, _, out = kernel.shape
    channels = x.shape[-1]
    per_channel = tf.reshape(kernel, [kh, kw, channels, out // channels])
    stride = pair(strides)[0]
    return tf.nn.depthwise_conv2d(x, per_channel, [1, stride, stride, 1], padding.upper())


def _signature(what: str, x: tf.Tensor, kernel: tf.Tensor, detail: str, training: bool) -> str:
    from fusion.fragment import shape_text

    return (f"{what} input {shape_text(x.shape)} kernel {shape_text(kernel.shape)} "
            f"{x.dtype.name} {detail}{'' if training else ' inference'}")


def convolution_site(ctx: StageContext, family: Family, what: str, keras: Callable[..., Any],
                     operands: Sequence[tf.Tensor], kernel_form: Form,
                     kernel: Callable[..., Any] | None, why: str | None,
                     why_kernel: str | None, signature: Callable[[], str],
                     backward: bool = True) -> Any:
    """The flow of a convolution family's call (this one's and ``fusion.calls.separable``'s):
    Keras's convolution ``keras(*operands)`` against ``kernel_form`` (emitted by ``kernel``,
    where it is one and ``why_kernel`` is None) and ``family``'s XLA region of Keras's
    convolution where ``ctx`` offers XLA, timed with ``operands`` as inputs (forward, and
    backward where ``backward``).

    >>> callable(convolution_site)
    True
    """
    region = family.forms[XLA]
    forms = [kernel_form] if kernel is not None and why_kernel is None else []
    if ctx.xla:
        forms.append(region)
    if why is None and not forms:
        why = why_kernel or "no form here without XLA"
    dtype = operands[0].dtype

    def candidates() -> dict:
        shapes = [v.shape for v in operands]
        timed = {family.forms.conservative.name: timed_form(keras, shapes, dtype,
                                                             backward=backward)}
        if kernel_form in forms:
            timed[kernel_form.name] = timed_form(kernel, shapes, dtype, backward=backward)
        if region in forms:
            timed[XLA] = timed_form(xla_region(keras), shapes, dtype, backward=backward)
        return timed

    def emit(form: Form) -> Any:
        return xla_region(keras)(*operands) if form.name == XLA else kernel(*operands)

    return rewrite_call(ctx, CallSite(
        family, tuple(f for f in forms if f is not region) or tuple(forms),
        keras=lambda: keras(*operands), emit=emit, what=what, why=why, dtype=dtype,
        candidates=candidates, signature=signature))


def _site(ctx: StageContext, what: str, keras: Callable[[Any, Any], Any], x: tf.Tensor,
          kernel: tf.Tensor, detail: str, native: Callable[[Any, Any], Any] | None,
          why: str | None, why_native: str | None) -> Any:
    """A depthwise or grouped convolution's call (:func:`convolution_site`): Keras's
    convolution ``keras(x, kernel)`` against the native form (``native``, where it is one) and
    the XLA region, backward timed where a tape records."""
    training = execute.must_record_gradient()
    return convolution_site(
        ctx, DECLARED, what, keras, (x, kernel), NATIVE, native, why, why_native,
        lambda: _signature(what, x, kernel, detail, training), backward=training)


def fused_depthwise_conv(ctx: StageContext, original: Callable, inputs: Any, kernel: Any,
                         strides: Any = 1, padding: str = "valid", data_format: str | None = None,
                         dilation_rate: Any = 1) -> Any:
    """Keras's TensorFlow ``depthwise_conv`` while tfmx traces a training step: the XLA
    region where the tuner measures it faster than Keras's op, else Keras's op."""
    if not tf.inside_function() or not execute.must_record_gradient():
        return original(inputs, kernel, strides, padding, data_format, dilation_rate)
    x, kernel = tf.convert_to_tensor(inputs), layer_value(kernel)

    def keras(v: Any, k: Any) -> Any:
        return original(v, k, strides, padding, data_format, dilation_rate)

    detail = (f"strides {pair(strides)} {padding} dilation {pair(dilation_rate)} "
              f"{data_format or 'default format'}")
    return _site(ctx, "DepthwiseConv2D", keras, x, kernel, detail, None,
                 check(x), None)


def fused_convolution_op(ctx: StageContext, original: Callable, layer: Any, inputs: Any,
                         kernel: Any) -> Any:
    """``BaseConv.convolution_op`` while tfmx traces: a grouped 2D convolution as TensorFlow's
    depthwise convolution or as an XLA region where the tuner measures one faster than Keras's
    grouped convolution; any other convolution as Keras runs it."""
    if getattr(layer, "groups", 1) == 1 or not tf.inside_function():
        return original(layer, inputs, kernel)
    x, kernel = tf.convert_to_tensor(inputs), layer_value(kernel)
    why = check(x)
    if why is None and layer.rank != 2:
        why = f"grouped Conv{layer.rank}D: only 2D convolutions"
    why_native = None if why is not None else check_native(
        x, layer.groups, layer.strides, layer.dilation_rate, layer.data_format)
    detail = (f"groups {layer.groups} strides {tuple(layer.strides)} {layer.padding} dilation "
              f"{tuple(layer.dilation_rate)} {layer.data_format}")
    return _site(ctx, f"grouped Conv{layer.rank}D", lambda v, k: original(layer, v, k), x,
                 kernel, detail,
                 lambda v, k: grouped_as_depthwise(v, k, layer.strides, layer.padding), why,
                 why_native)


# -- declaration ----------------------------------------------------------------------------------
DECLARED = declare(Family(
    FAMILY,
    "Keras depthwise and grouped 2D convolutions -> TensorFlow's depthwise kernel (grouped "
    "with groups = channels) or one XLA-compiled region, where measured faster than Keras's op",
    hooks=(Hook.on(MATCHES[0], fused_depthwise_conv),
           Hook.on(MATCHES[1], fused_convolution_op)),
    forms=FORMS,
    after=OBSERVED_AFTER, order=OBSERVED_ORDER,
))
