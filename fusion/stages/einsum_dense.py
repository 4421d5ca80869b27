"""The einsum_dense stage: Keras ``EinsumDense`` contractions as one ``MatMul`` (+ ``BiasAdd``).

Keras's ``EinsumDense`` (the Q/K/V and output projections of ``MultiHeadAttention``, and a
layer of its own) computes ``einsum(equation, x, kernel)`` then adds its bias. Most of its
equations contract the trailing axes of ``x`` with the leading axes of the kernel and keep the
rest in order (``abc,cde->abde``, ``abcd,cde->abe``, ``...b,bc->...c``): a ``tensordot``, that
is a ``MatMul`` of ``x`` viewed as ``[rows, contracted]`` and the kernel viewed as
``[contracted, kept]``. This stage emits exactly that (``Reshape``, ``MatMul``, ``BiasAdd``
where the bias covers the kept axes, the activation, ``Reshape``), so the contraction family
fuses the MatMul with its bias (and activation) into ``_FusedMatMul``, the gradient is two
MatMuls instead of two Einsums, and a backend without an ``Einsum`` kernel (the Metal plugin
has none) runs it at all.

Whether the MatMul form is faster than Keras's Einsum depends on the machine and the shapes,
so every call is a tuner decision (forward and backward at the call's shapes); the
conservative form is Keras's Einsum, or the MatMul form on a backend without an ``Einsum``
kernel. Declined, with the reason in the report: other equations (transposed kernels, batch
axes shared by both operands, repeated letters), quantized layers, operands of different
dtypes.

Example:
    >>> import keras, numpy as np, tensorflow as tf
    >>> from fusion.stages.einsum_dense import as_matmul, split_equation
    >>> split_equation("abc,cde->abde")
    ('ab', 'c', 'de')
    >>> layer = keras.layers.EinsumDense("abc,cde->abde", (5, 2, 3), bias_axes="de")
    >>> x = tf.random.normal([2, 5, 4], seed=1)
    >>> expected = layer(x).numpy()
    >>> got = as_matmul(layer, x).numpy()
    >>> bool(np.allclose(got, expected, atol=1e-6))
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from fusion.pattern import PatternStats
from fusion.stage import Hook, Stage, StageContext, register_stage, timed_form

FAMILY = "einsum_dense"
SCOPE = "tfmx_einsum_dense"
LABEL = "EinsumDense: Reshape + MatMul (+ BiasAdd) in place of Einsum"


def split_equation(equation: str) -> tuple[str, str, str] | None:
    """``(kept of x, contracted, kept of the kernel)`` when ``equation`` is ``P C, C K -> P K``
    (the trailing axes of ``x`` contracted with the leading axes of the kernel, every other
    axis kept in order; ``P`` may start with ``...``), else None.

    >>> split_equation("...b,bc->...c"), split_equation("abc,dc->abd")
    (('...', 'b', 'c'), None)
    """
    try:
        inputs, output = equation.replace(" ", "").split("->")
        lhs, rhs = inputs.split(",")
    except ValueError:
        return None
    if "." in rhs:
        return None
    letters = lhs.replace("...", "") + rhs
    if len(set(lhs.replace("...", ""))) != len(lhs.replace("...", "")) or \
            len(set(rhs)) != len(rhs) or not letters.isalpha():
        return None
    contracted = "".join(c for c in rhs if c in lhs and c not in output)
    kept_kernel = rhs[len(contracted):]
    kept_x = lhs[: len(lhs) - len(contracted)]
    if not contracted or rhs != contracted + kept_kernel or lhs != kept_x + contracted:
        return None
    if output != kept_x + kept_kernel or set(kept_x.replace("...", "")) & set(rhs):
        return None
    return kept_x, contracted, kept_kernel


def _tensor(value: Any) -> tf.Tensor:
    """A Keras variable's value (autocast inside the layer's call), a tensor as it is."""
    return value.value if hasattr(value, "value") and hasattr(value, "assign") else \
        tf.convert_to_tensor(value)


def as_matmul(layer: Any, inputs: tf.Tensor) -> tf.Tensor:
    """``layer``'s output (an ``EinsumDense`` whose equation :func:`split_equation` accepts)
    as ``Reshape`` + ``MatMul`` (+ ``BiasAdd``) + activation + ``Reshape``."""
    _, contracted, kept = split_equation(layer.equation)
    kernel = _tensor(layer.kernel)
    shape = kernel.shape.as_list()
    cols = math.prod(shape[: len(contracted)])
    kept_dims = shape[len(contracted):]
    rows = tf.reshape(inputs, [-1, cols])
    y = tf.matmul(rows, tf.reshape(kernel, [cols, math.prod(kept_dims)]))
    bias = None if layer.bias is None else _tensor(layer.bias)
    flat_bias = bias is not None and bias.shape.as_list() == kept_dims
    if flat_bias:
        y = tf.nn.bias_add(y, tf.reshape(bias, [-1]))
    early = layer.activation is not None and (len(kept) == 1 and (flat_bias or bias is None))
    if early:  # on the last axis, which the reshape keeps: the contraction family fuses it
        y = layer.activation(y)
    leading = tf.shape(inputs)[: inputs.shape.rank - len(contracted)]
    y = tf.reshape(y, tf.concat([leading, kept_dims], 0))
    y.set_shape(inputs.shape[: inputs.shape.rank - len(contracted)].concatenate(kept_dims))
    if bias is not None and not flat_bias:
        y = y + bias  # Keras's broadcast add (a bias over some of the kept axes)
    if layer.activation is not None and not early:
        y = layer.activation(y)
    return y


def find_einsum_dense(layer: Any, inputs: Any) -> str | None:
    """Why this call keeps Keras's Einsum, or None if the stage can emit its MatMul form."""
    if getattr(layer, "quantization_mode", None):
        return f"quantized layer ({layer.quantization_mode})"
    if split_equation(layer.equation) is None:
        return (f"equation {layer.equation!r} is not a tensordot (trailing axes of the input "
                "with leading axes of the kernel, the rest kept in order)")
    if inputs.shape.rank is None or None in tuple(layer.kernel.shape):
        return "input of unknown rank or kernel of unknown shape"
    if inputs.dtype.name not in ("float32", "float16", "bfloat16"):
        return f"input dtype {inputs.dtype.name}"
    return None


def fused_einsum_dense_call(ctx: StageContext, original: Callable, layer: Any, inputs: Any,
                            *args: Any, **kwargs: Any) -> Any:
    """``EinsumDense.call`` while tfmx traces: the MatMul form where it is correct and (by the
    tuner) faster, else Keras's Einsum with the reason recorded."""
    if not tf.inside_function():
        return original(layer, inputs, *args, **kwargs)
    stats = PatternStats(matched=1)
    inputs = tf.convert_to_tensor(inputs)
    why = find_einsum_dense(layer, inputs)
    if why is None and _tensor(layer.kernel).dtype != inputs.dtype:
        why = f"input {inputs.dtype.name} and kernel {_tensor(layer.kernel).dtype.name} differ"
    use = why is None
    if use and ctx.chooser is not None:
        from fusion.fragment import shape_text

        signature = (f"EinsumDense {layer.equation} input {shape_text(inputs.shape)} "
                     f"{inputs.dtype.name} bias={layer.bias is not None} "
                     f"activation={getattr(layer.activation, '__name__', None)}")
        candidates = {
            "einsum": timed_form(lambda x: original(layer, x), [inputs.shape], inputs.dtype,
                                 layer.trainable_variables),
            "matmul": timed_form(lambda x: as_matmul(layer, x), [inputs.shape], inputs.dtype,
                                 layer.trainable_variables),
        }
        conservative = "einsum" if ctx.target.runs_op("Einsum") else "matmul"
        if ctx.chooser.choose(FAMILY, signature, candidates, conservative).choice == "einsum":
            use, why = False, f"{signature}: Keras's Einsum kept: measured faster"
    if not use:
        stats.decline(f"EinsumDense: {why}")
        ctx.record(FAMILY, stats)
        return original(layer, inputs, *args, **kwargs)
    with tf.name_scope(f"{SCOPE}_matmul"):
        out = as_matmul(layer, inputs)
    stats.fuse(LABEL)
    ctx.record(FAMILY, stats)
    return out


STAGE = register_stage(Stage(
    FAMILY,
    "Keras EinsumDense (MultiHeadAttention's projections) -> Reshape + MatMul (+ BiasAdd, "
    "which the contraction family fuses) where the equation is a tensordot and measured faster",
    (Hook("keras.src.layers.core.einsum_dense:EinsumDense", "call", fused_einsum_dense_call),),
))
