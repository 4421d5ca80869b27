"""The bias_row stage: a Dense layer's bias as one more row of its kernel, where measured faster.

``Dense(units)`` computes ``x @ kernel + bias``. TensorFlow fuses the two into one
``_FusedMatMul``, whose bias costs far more than its arithmetic on CPUs (the fused MatMul
measured a third slower than the MatMul alone in bfloat16, a fifth in float32); its gradient
reduces the output gradient's columns once more (the bias gradient: a MatMul of ones beside
the kernel gradient's MatMul). This stage's form puts the bias in the product itself:

    [x, 1, 0] @ [[kernel], [bias], [0]]

the input widened by a column of ones (and one of zeros, so the contracted depth stays even for
the 16-bit kernels that pair it), the kernel by the bias as a row (and a row of zeros). The
forward is one plain MatMul. Its gradient, a custom
one, is the input gradient ``dy @ kernel^T`` (the narrow kernel, as Keras's) and one MatMul
``[x, 1, 0]^T @ dy`` whose rows are the kernel's gradient, then the bias's (the column sums
of ``dy``), then the zero row's, which nobody reads: in bfloat16 measured faster than the kernel
gradient and the bias's MatMul of ones. The sums are the same sums: the bias is added
into the products' float32 accumulator and rounded once, as the fused kernel adds it; the bias
gradient is a sum over the rows, as TensorFlow's.

Where the contraction is deep and the output narrow (``[2048, 512] x [512, 128]``) the widened
products cost more than they save, so every call is a tuner decision (forward and backward of
the affine part, at the call's shapes and dtype, as the step's passes leave them); the
conservative form is Keras's. The activation follows the product as Keras applies it (the
gelu stage's form where that stage is on).

Example:
    >>> import keras, numpy as np, tensorflow as tf
    >>> layer = keras.layers.Dense(3)
    >>> x = tf.constant(np.arange(8, dtype="float32").reshape(4, 2))
    >>> _ = layer(x)
    >>> bool(np.allclose(dense_with_bias_row(layer, x), layer(x), atol=1e-5))
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from fusion import forms
from fusion.family import OBSERVED_AFTER, OBSERVED_ORDER, Family, Form, Forms, conservative, declare
from fusion.stage import (
    CallSite,
    Hook,
    StageContext,
    custom_gradient,
    layer_value,
    rewrite_call,
    timed_form,
)

# -- match: the Keras calls it hooks, and what it finds in them -----------------------------------
FAMILY = "bias_row"
SCOPE = "tfmx_dense"
MATCHES = ("keras.src.layers.core.dense:Dense.call",)
"""The Keras calls the stage hooks: a ``Dense`` layer's (one with a bias)."""


# -- check: why a call keeps Keras's own form (None: it need not) ---------------------------------
def check(layer: Any, inputs: Any) -> str | None:
    """Why this ``Dense`` call keeps Keras's form (None: the bias-row form applies). A layer
    without a bias is not a match (the caller passes it on without a reason).

    >>> import keras
    >>> layer = keras.layers.Dense(3)
    >>> layer.build((None, 2))
    >>> check(layer, tf.zeros([4, 2])), check(layer, tf.zeros([4, 2], tf.float64))
    (None, 'input dtype float64')
    """
    if getattr(layer, "quantization_mode", None):
        return f"quantized layer ({layer.quantization_mode})"
    if inputs.dtype.name not in ("float32", "float16", "bfloat16"):
        return f"input dtype {inputs.dtype.name}"
    if inputs.shape.rank is None or inputs.shape.rank < 2 or inputs.shape[-1] is None:
        return "input of unknown rank or features"
    kernel = layer_value(layer.kernel)
    if kernel.shape.rank != 2 or None in kernel.shape:
        return "kernel of unknown shape"
    if kernel.dtype != inputs.dtype:
        return f"input {inputs.dtype.name} and kernel {kernel.dtype.name} differ"
    return None


# -- forms: what it emits (CONSERVATIVE: the form Keras runs), and the hook's flow ----------------
CONSERVATIVE = conservative("keras", "Keras's MatMul and bias")
BIAS_ROW = Form(
    "bias row", "Dense: the bias as a row of the kernel (one MatMul forward, one for both "
                "gradients)",
    marks=frozenset({"MatMul", "_FusedMatMul"}),
    emits=frozenset({"ConcatV2", "MatMul", "OnesLike", "StridedSlice", "ZerosLike"}))
"""The form, emitted under ``tfmx_dense_bias_row``: its MatMul (plain, or fused by
contraction) shows it in a traced graph; it emits its widened input and kernel, the product
and its gradient's rows in the call's dtype (a backend without one of them in that dtype keeps
Keras's form)."""
FORMS = Forms(SCOPE, (CONSERVATIVE, BIAS_ROW))


def bias_row_product(x: tf.Tensor, kernel: tf.Tensor, bias: tf.Tensor) -> tf.Tensor:
    """``x @ kernel + bias`` (``x`` ``[rows, k]``) as ``[x, 1, 0] @ [[kernel], [bias], [0]]``,
    with the gradient of the module doc: ``dy @ kernel^T`` for ``x``, one MatMul for the
    kernel's and the bias's.

    >>> x = tf.constant([[1.0, 2.0]])
    >>> bias_row_product(x, tf.constant([[1.0], [1.0]]), tf.constant([0.5])).numpy().tolist()
    [[3.5]]
    """
    depth = int(kernel.shape[0])

    @custom_gradient
    def product(x: tf.Tensor, kernel: tf.Tensor, bias: tf.Tensor) -> Any:
        column = tf.ones_like(x[:, :1])
        widened = tf.concat([x, column, tf.zeros_like(column)], 1)
        rows = tf.concat([kernel, bias[None], tf.zeros_like(bias[None])], 0)

        def backward(dy: tf.Tensor) -> tuple:
            both = tf.matmul(widened, dy, transpose_a=True)
            return tf.matmul(dy, kernel, transpose_b=True), both[:depth], both[depth]

        return tf.matmul(widened, rows), backward

    return product(x, kernel, bias)


def dense_with_bias_row(layer: Any, inputs: tf.Tensor, activation: bool = True) -> tf.Tensor:
    """``layer(inputs)`` (a ``Dense`` with a bias) through :func:`bias_row_product` on
    ``inputs`` viewed as rows, then (``activation``) the layer's activation."""
    kernel, bias = layer_value(layer.kernel), layer_value(layer.bias)
    depth, units = (int(d) for d in kernel.shape)
    rows = bias_row_product(tf.reshape(inputs, [-1, depth]), kernel, tf.cast(bias, kernel.dtype))
    y = tf.reshape(rows, tf.concat([tf.shape(inputs)[:-1], [units]], 0))
    y.set_shape(inputs.shape[:-1].concatenate([units]))
    if activation and layer.activation is not None:
        y = layer.activation(y)
    return y


def _keras_affine(layer: Any, inputs: tf.Tensor) -> tf.Tensor:
    """What Keras's ``Dense.call`` computes before its activation (the timed stock form)."""
    from keras import ops

    return ops.add(ops.matmul(inputs, layer.kernel), layer.bias)


def fused_dense_call(ctx: StageContext, original: Callable, layer: Any, inputs: Any,
                     training: Any = None) -> Any:
    """``Dense.call`` while tfmx traces: the bias-row form where the tuner measures it faster
    than Keras's (or without a tuner), else Keras's with the reason recorded
    (:func:`fusion.stage.rewrite_call`)."""
    if getattr(layer, "bias", None) is None or not tf.inside_function() or \
            isinstance(inputs, (tf.SparseTensor, tf.RaggedTensor)):
        return original(layer, inputs, training=training)
    inputs = tf.convert_to_tensor(inputs)

    def signature() -> str:
        from fusion.fragment import shape_text

        return (f"Dense input {shape_text(inputs.shape)} x "
                f"{shape_text(layer_value(layer.kernel).shape)} {inputs.dtype.name} + bias")

    def candidates() -> dict:  # the layer without its activation, the same in both forms
        variables = layer.trainable_variables
        return {CONSERVATIVE.name: timed_form(lambda x: _keras_affine(layer, x),
                                              [inputs.shape], inputs.dtype, variables),
                BIAS_ROW.name: timed_form(lambda x: dense_with_bias_row(layer, x, activation=False),
                                 [inputs.shape], inputs.dtype, variables)}

    return rewrite_call(ctx, CallSite(
        DECLARED, (BIAS_ROW,), keras=lambda: original(layer, inputs, training=training),
        emit=lambda form: dense_with_bias_row(layer, inputs), what="Dense",
        why=check(layer, inputs), dtype=inputs.dtype, signature=signature,
        candidates=candidates))


# -- declaration ----------------------------------------------------------------------------------
DECLARED = declare(Family(
    FAMILY,
    "Keras Dense with a bias -> one MatMul of the input widened by a column of ones and the "
    "kernel by the bias as a row (its gradient one MatMul for kernel and bias), where measured "
    "faster than MatMul + BiasAdd",
    hooks=(Hook.on(MATCHES[0], fused_dense_call),),
    forms=FORMS,
    after=OBSERVED_AFTER, order=OBSERVED_ORDER,
))
AFFINE = forms.contribute(forms.AffineForm(
    FAMILY, " " + BIAS_ROW.name, bias_row_product,
    {"einsum_dense": {
        "matmul": "EinsumDense: Reshape + one MatMul, the bias a row of the kernel, in place of "
                  "Einsum",
        "shared": "MultiHeadAttention: query, key and value projections as one MatMul, the "
                  "biases a row of the kernels"}},
    emits=BIAS_ROW.emits))
"""The product offered to the stages whose forms end in ``x @ kernel + bias``
(``fusion.forms.AffineForm``: ``einsum_dense``'s ``matmul`` and ``shared`` forms each gain a
``... bias row`` form, with the label given here); they ask ``fusion.forms``, never this
module."""
