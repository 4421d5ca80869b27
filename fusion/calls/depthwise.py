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
- ``cropped`` (``channels_last``, groups equal to the channels, equal strides), where some taps
  of the kernel read only padding (a late stage's map smaller than its kernel: a 7x7 kernel
  over a 2x2 map, "same", has 9 of its 49 taps on data): TensorFlow's depthwise kernel on the
  taps that read data, the kernel cropped to them and the input padded for them alone; where
  one tap is left, a per-channel multiply. The products are those of the whole kernel's taps
  that read data (the others only add zeros); the kernel's gradient is zero on the taps left
  out, as stock's is;
- ``xla`` (cpu and cuda with ``tfmx.enable(xla=True)``, never metal): Keras's convolution and
  its gradient as one XLA-compiled region (``fusion.stage.xla_region``).

Only the convolution is replaced: the bias and the activation run as Keras runs them (the hook
is the backend's ``depthwise_conv`` and ``BaseConv.convolution_op``). A plain ``Conv2D``
(``groups == 1``) is not this family's and passes untouched. A ``DepthwiseConv2D`` outside a
gradient tape (inference) keeps Keras's op, which the contraction family fuses with its bias.
Declined, with the reason in the report: inputs that are not floating point, not 4-D, of
unknown spatial or channel size; for the native form, ``channels_first`` (TensorFlow's CPU
depthwise kernel takes NHWC), unequal strides, dilation, or groups other than the channels;
for the cropped form the same, dilation aside, and a kernel whose every tap reads data.

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
CROPPED = Form("cropped", "depthwise convolution on the taps that read data: TensorFlow's "
                          "DepthwiseConv2dNative with the kernel cropped to them (one tap: a "
                          "per-channel multiply)",
               marks=frozenset({"DepthwiseConv2dNative", "Mul"}),
               emits=frozenset({"DepthwiseConv2dNative"}))
FORMS = Forms(SCOPE, (CONSERVATIVE, NATIVE, CROPPED, REGION))


def data_window(size: int, kernel: int, stride: int, dilation: int, padding: str
                ) -> tuple[int, int, int, int, int, int, int]:
    """Along one spatial axis of ``size`` as TensorFlow's ``padding`` pads it: the first and last
    taps of ``kernel`` that read data, the input rows ``[begin, end)`` those taps read, the
    padding before and after them, and the output size.

    >>> data_window(2, 7, 1, 1, "same")  # a 7-tap kernel over 2 rows: taps 2 to 4
    (2, 4, 0, 2, 1, 1, 2)
    >>> data_window(9, 3, 2, 1, "valid")  # every tap reads data
    (0, 2, 0, 9, 0, 0, 4)
    """
    span = (kernel - 1) * dilation + 1
    if padding.lower() == "same":
        out = -(-size // stride)
        before = max((out - 1) * stride + span - size, 0) // 2
    else:
        out, before = (size - span) // stride + 1, 0
    taps = [i for i in range(kernel)
            if any(0 <= i * dilation - before + stride * r < size for r in range(out))]
    first = taps[0] * dilation - before  # the row the first tap reads for output row 0
    last = first + (out - 1) * stride + (taps[-1] - taps[0]) * dilation
    return (taps[0], taps[-1], max(first, 0), min(last, size - 1) + 1, max(-first, 0),
            max(last - (size - 1), 0), out)


def check_cropped(x: Any, kernel_size: Sequence[int], groups: int, strides: Any,
                  dilation_rate: Any, padding: str, data_format: str | None) -> str | None:
    """Why a convolution cannot run on the taps that read data alone (the ``cropped`` form),
    or None.

    >>> check_cropped(tf.zeros([2, 2, 2, 6]), (7, 7), 6, 1, 1, "same", "channels_last")
    >>> check_cropped(tf.zeros([2, 8, 8, 6]), (3, 3), 6, 1, 1, "same", "channels_last")
    'every tap of the 3x3 kernel reads data: nothing to crop'
    """
    if not _channels_last(data_format):
        return "channels_first: TensorFlow's CPU depthwise kernel takes NHWC"
    if groups != x.shape[-1]:
        return f"groups {groups} of {x.shape[-1]} channels: not a depthwise convolution"
    strides, dilation = pair(strides), pair(dilation_rate)
    if strides[0] != strides[1]:
        return f"strides {strides}: the depthwise kernel takes equal strides"
    if dilation != (1, 1) and strides != (1, 1):
        return f"dilation {dilation} with strides {strides}"
    if str(padding).lower() not in ("same", "valid"):
        return f"padding {padding!r}"
    sizes = [int(n) for n in x.shape[1:3]]
    if padding.lower() != "same" and any(
            n < (int(k) - 1) * d + 1 for n, k, d in zip(sizes, kernel_size, dilation)):
        return f"a {padding} convolution wider than its {sizes[0]}x{sizes[1]} input"
    windows = [data_window(n, int(k), s, d, padding)
               for n, k, s, d in zip(sizes, kernel_size, strides, dilation)]
    if all(w[:2] == (0, k - 1) for w, k in zip(windows, kernel_size)):
        return (f"every tap of the {kernel_size[0]}x{kernel_size[1]} kernel reads data: "
                "nothing to crop")
    return None


def cropped_depthwise(x: tf.Tensor, kernel: tf.Tensor, strides: Any = 1,
                      padding: str = "valid", dilation_rate: Any = 1) -> tf.Tensor:
    """The depthwise convolution of ``x`` (NHWC, ``C`` channels) by ``kernel``
    (``[kh, kw, C, m]``) on the taps that read data (:func:`data_window`): TensorFlow's
    depthwise kernel with the kernel cropped to them and the input padded for them alone (as
    "same" would pad for the cropped kernel where that is the same padding); one tap left, a
    per-channel multiply of the rows and columns it reads.

    >>> import numpy as np
    >>> x = tf.random.stateless_normal([2, 2, 2, 3], seed=[1, 2])
    >>> k = tf.random.stateless_normal([7, 7, 3, 2], seed=[3, 4])
    >>> want = tf.nn.depthwise_conv2d(x, k, [1, 1, 1, 1], "SAME")
    >>> bool(np.allclose(cropped_depthwise(x, k, 1, "same"), want, atol=1e-5))
    True
    """
    (sh, sw), dilation = pair(strides), pair(dilation_rate)
    n, c = x.shape[0], int(x.shape[-1])
    kh, kw, _, m = (int(d) for d in kernel.shape)
    rows, cols = (data_window(int(size), k, s, d, padding) for size, k, s, d in
                  zip(x.shape[1:3], (kh, kw), (sh, sw), dilation))
    if (rows[2], rows[3], cols[2], cols[3]) != (0, x.shape[1], 0, x.shape[2]):
        x = x[:, rows[2]:rows[3], cols[2]:cols[3], :]
    kernel = kernel[rows[0]:rows[1] + 1, cols[0]:cols[1] + 1]
    pads = (rows[4], rows[5], cols[4], cols[5])
    if any(pads):
        same = [data_window(int(size), int(k), s, d, "same")
                for size, k, s, d in zip(x.shape[1:3], kernel.shape[:2], (sh, sw), dilation)]
        if all(w[:2] == (0, int(k) - 1) and w[4:] == own[4:]
               for w, k, own in zip(same, kernel.shape[:2], (rows, cols))):
            return tf.nn.depthwise_conv2d(x, kernel, [1, sh, sw, 1], "SAME",
                                          dilations=dilation if dilation != (1, 1) else None)
        x = tf.pad(x, [[0, 0], pads[:2], pads[2:], [0, 0]])
    if kernel.shape[0] == kernel.shape[1] == 1:  # one tap: the rows and columns it reads
        x = x[:, ::sh, ::sw, :]
        if m == 1:
            return x * kernel[0, 0, :, 0]
        out = x[..., None] * kernel[0, 0]
        return tf.reshape(out, [n if n is not None else -1, *out.shape[1:3], c * m])
    return tf.nn.depthwise_conv2d(x, kernel, [1, sh, sw, 1], "VALID",
                                  dilations=dilation if dilation != (1, 1) else None)


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
    stride = pair(strides)[0]
    return tf.nn.depthwise_conv2d(x, per_channel_kernel(kernel, x.shape[-1]),
                                  [1, stride, stride, 1], padding.upper())


def per_channel_kernel(kernel: tf.Tensor, channels: int) -> tf.Tensor:
    """A grouped convolution's kernel (``[kh, kw, 1, C * m]``, groups equal to its ``C``
    channels) read as a depthwise kernel ``[kh, kw, C, m]``.

    >>> per_channel_kernel(tf.zeros([3, 3, 1, 8]), 4).shape.as_list()
    [3, 3, 4, 2]
    """
    kh, kw, _, out = kernel.shape
    return tf.reshape(kernel, [kh, kw, channels, out // channels])


def _signature(what: str, x: tf.Tensor, kernel: tf.Tensor, detail: str, training: bool) -> str:
    from fusion.fragment import shape_text

    return (f"{what} input {shape_text(x.shape)} kernel {shape_text(kernel.shape)} "
            f"{x.dtype.name} {detail}{'' if training else ' inference'}")


def convolution_site(ctx: StageContext, family: Family, what: str, keras: Callable[..., Any],
                     operands: Sequence[tf.Tensor],
                     kernels: Sequence[tuple[Form, Callable[..., Any] | None, str | None]],
                     why: str | None, signature: Callable[[], str],
                     backward: bool = True) -> Any:
    """The flow of a convolution family's call (this one's and ``fusion.calls.separable``'s):
    Keras's convolution ``keras(*operands)`` against each of ``kernels`` (a form, the function
    that emits it or None, why it cannot be emitted here or None) and ``family``'s XLA region
    of Keras's convolution where ``ctx`` offers XLA, timed with ``operands`` as inputs
    (forward, and backward where ``backward``).

    >>> callable(convolution_site)
    True
    """
    region = family.forms[XLA]
    emitters = {form.name: fn for form, fn, why_not in kernels
                if fn is not None and why_not is None}
    forms = [form for form, _, _ in kernels if form.name in emitters]
    if ctx.xla:
        forms.append(region)
    if why is None and not forms:
        why_not = next((why_not for _, _, why_not in kernels if why_not), None)
        why = f"{why_not}; no other form here without XLA" if why_not else \
            "no form here without XLA"
    dtype = operands[0].dtype

    def candidates() -> dict:
        shapes = [v.shape for v in operands]
        timed = {family.forms.conservative.name: timed_form(keras, shapes, dtype,
                                                             backward=backward)}
        for name, fn in emitters.items():
            timed[name] = timed_form(fn, shapes, dtype, backward=backward)
        if region in forms:
            timed[XLA] = timed_form(xla_region(keras), shapes, dtype, backward=backward)
        return timed

    def emit(form: Form) -> Any:
        return xla_region(keras)(*operands) if form.name == XLA else \
            emitters[form.name](*operands)

    return rewrite_call(ctx, CallSite(
        family, tuple(f for f in forms if f is not region) or tuple(forms),
        keras=lambda: keras(*operands), emit=emit, what=what, why=why, dtype=dtype,
        candidates=candidates, signature=signature))


def _site(ctx: StageContext, what: str, keras: Callable[[Any, Any], Any], x: tf.Tensor,
          kernel: tf.Tensor, detail: str,
          kernels: Sequence[tuple[Form, Callable[[Any, Any], Any] | None, str | None]],
          why: str | None) -> Any:
    """A depthwise or grouped convolution's call (:func:`convolution_site`): Keras's
    convolution ``keras(x, kernel)`` against ``kernels`` (the native and cropped forms, where
    they are ones) and the XLA region, backward timed where a tape records."""
    training = execute.must_record_gradient()
    return convolution_site(
        ctx, DECLARED, what, keras, (x, kernel), kernels, why,
        lambda: _signature(what, x, kernel, detail, training), backward=training)


def fused_depthwise_conv(ctx: StageContext, original: Callable, inputs: Any, kernel: Any,
                         strides: Any = 1, padding: str = "valid", data_format: str | None = None,
                         dilation_rate: Any = 1) -> Any:
    """Keras's TensorFlow ``depthwise_conv`` while tfmx traces a training step: the cropped
    form or the XLA region where the tuner measures one faster than Keras's op, else Keras's
    op."""
    if not tf.inside_function() or not execute.must_record_gradient():
        return original(inputs, kernel, strides, padding, data_format, dilation_rate)
    x, kernel = tf.convert_to_tensor(inputs), layer_value(kernel)

    def keras(v: Any, k: Any) -> Any:
        return original(v, k, strides, padding, data_format, dilation_rate)

    def cropped(v: Any, k: Any) -> Any:
        return cropped_depthwise(v, k, strides, padding, dilation_rate)

    detail = (f"strides {pair(strides)} {padding} dilation {pair(dilation_rate)} "
              f"{data_format or 'default format'}")
    why = check(x)
    why_cropped = None if why is not None else check_cropped(
        x, kernel.shape[:2], x.shape[-1], strides, dilation_rate, padding, data_format)
    return _site(ctx, "DepthwiseConv2D", keras, x, kernel, detail,
                 [(CROPPED, cropped, why_cropped)], why)


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
    why_cropped = None if why is not None else check_cropped(
        x, kernel.shape[:2], layer.groups, layer.strides, layer.dilation_rate, layer.padding,
        layer.data_format)

    def cropped(v: Any, k: Any) -> Any:
        return cropped_depthwise(v, per_channel_kernel(k, v.shape[-1]), layer.strides,
                                 layer.padding, layer.dilation_rate)

    def native(v: Any, k: Any) -> Any:
        return grouped_as_depthwise(v, k, layer.strides, layer.padding)

    return _site(ctx, f"grouped Conv{layer.rank}D", lambda v, k: original(layer, v, k), x,
                 kernel, detail, [(NATIVE, native, why_native), (CROPPED, cropped, why_cropped)],
                 why)


# -- declaration ----------------------------------------------------------------------------------
DECLARED = declare(Family(
    FAMILY,
    "Keras depthwise and grouped 2D convolutions -> TensorFlow's depthwise kernel (grouped "
    "with groups = channels; on the taps that read data where others read only padding) or one "
    "XLA-compiled region, where measured faster than Keras's op",
    hooks=(Hook.on(MATCHES[0], fused_depthwise_conv),
           Hook.on(MATCHES[1], fused_convolution_op)),
    forms=FORMS,
    after=OBSERVED_AFTER, order=OBSERVED_ORDER,
))
