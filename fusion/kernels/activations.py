"""Activations with their derivatives in closed form: the value, and a function giving the
derivative from what computing the value kept (SiLU's sigmoid, GELU's normal CDF or tanh).

The swish and gelu stages train an activation alone with them, the gated_product stage an
activation times another tensor (a SwiGLU or GeGLU feed-forward block); each computes them in
the dtype of the tensor it passes (a 16-bit tensor cast up to float32 first where the form is
a float32 one).

>>> import tensorflow as tf
>>> y, slope = silu(tf.constant([-2.0, 0.0, 2.0]))
>>> [round(float(v), 4) for v in y], [round(float(v), 4) for v in slope()]
([-0.2384, 0.0, 1.7616], [-0.0908, 0.5, 1.0908])
"""

from __future__ import annotations

import math
from collections.abc import Callable

import tensorflow as tf

SQRT_HALF = 1.0 / math.sqrt(2.0)
PDF = 1.0 / math.sqrt(2.0 * math.pi)  # the standard normal density at 0
LOG_PDF_SCALE = math.log(PDF / SQRT_HALF)  # ln(1 / sqrt(pi)): x * pdf(x) in terms of t
TANH_K = math.sqrt(2.0 / math.pi)
TANH_A = 0.044715

Kernel = Callable[[tf.Tensor], tuple[tf.Tensor, Callable[[], tf.Tensor]]]
"""``x -> (value, a function giving the derivative at x)``."""


def silu(x: tf.Tensor) -> tuple[tf.Tensor, Callable[[], tf.Tensor]]:
    """Swish (SiLU) of ``x`` in ``x``'s dtype, and a function giving its derivative from what
    the forward kept: ``s + y * (1 - s)``, which is ``s * (1 + x * (1 - s))``."""
    s = tf.sigmoid(x)
    y = x * s
    return y, lambda: s + y * (tf.constant(1.0, x.dtype) - s)


def gelu_exact(x: tf.Tensor, erfc: bool) -> tuple[tf.Tensor, Callable[[], tf.Tensor]]:
    """The exact GELU of ``x`` in ``x``'s dtype, and a function giving its derivative from
    what the forward kept (``t = x / sqrt(2)`` and the normal CDF); with ``erfc`` the CDF is
    TensorFlow's own ``0.5 * erfc(-t)`` (the forward then equals ``tf.nn.gelu``'s bit for bit).

    >>> y, slope = gelu_exact(tf.constant([-1.0, 0.0, 2.0]), erfc=True)
    >>> [round(float(v), 4) for v in y], [round(float(v), 4) for v in slope()]
    ([-0.1587, 0.0, 1.9545], [-0.0833, 0.5, 1.0852])
    """
    def const(value: float) -> tf.Tensor:
        return tf.constant(value, x.dtype)

    t = x * const(SQRT_HALF)  # x / sqrt(2): the CDF's argument, kept for the density
    if erfc:  # tf.nn.gelu's own expression and order: (0.5 * x) * erfc(-x * c)
        tail = tf.math.erfc(-t)
        y = const(0.5) * x * tail
        cdf = const(0.5) * tail  # for the derivative (in y, halving could lose a bit)
    else:
        cdf = const(0.5) + const(0.5) * tf.math.erf(t)
        y = x * cdf

    def slope() -> tf.Tensor:
        # x * pdf(x) = t * exp(-t^2) / sqrt(pi) = t * exp(ln(1 / sqrt(pi)) - t^2): the constant
        # in the exponent saves a pass over the tensor (the same bits). Not a chain of unary
        # ops (Square, Neg, Exp), which Grappler would run as one _UnaryOpsComposition, slower
        # than the kernels
        return cdf + t * tf.exp(const(LOG_PDF_SCALE) - t * t)

    return y, slope


def gelu_tanh(x: tf.Tensor) -> tuple[tf.Tensor, Callable[[], tf.Tensor]]:
    """The tanh approximation of GELU of ``x`` in ``x``'s dtype, and a function giving its
    derivative from what the forward kept."""
    def const(value: float) -> tf.Tensor:
        return tf.constant(value, x.dtype)

    square = tf.square(x)
    t = tf.tanh(const(TANH_K) * x * (const(1.0) + const(TANH_A) * square))
    half = const(0.5) + const(0.5) * t

    def slope() -> tf.Tensor:
        return half + x * (const(0.5 * TANH_K) * (const(1.0) - t * t) * (
            const(1.0) + const(3.0 * TANH_A) * square))

    return x * half, slope


__all__ = ["Kernel", "gelu_exact", "gelu_tanh", "silu"]
