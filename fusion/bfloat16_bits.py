"""bfloat16 at the edges of an XLA region handled by integer operations: XLA's bits, faster.

An XLA-compiled region (:func:`fusion.forms.xla_region`) that computes in float32 and returns
bfloat16 ends in XLA's ``convert``. On a CPU that conversion can cost more than the region's
arithmetic where the region computes (a GELU's value and derivative, ``Erf`` and ``Exp``,
measured faster with the rounding written as integer operations, which XLA fuses into the
region's loop like any other; a loop that only scales and narrows gains little). The integer
form is round-to-nearest-even as TensorFlow and XLA round (add ``0x7FFF`` plus the lowest kept
bit, keep the upper 16 bits; a NaN becomes the quiet NaN of its sign, as XLA's convert makes
it), so the two forms give the same bits: which one a region uses is a matter of speed alone, and
the tuner measures it on the region, on the machine (:func:`fusion.forms.integer_rounding`).
One exception on some CPUs: a conversion instruction that treats denormal inputs as zero
(AVX512_BF16's ``VCVTNEPS2BF16``), where XLA emits it, gives 0 for a float32 below 2^-126
that this form rounds to the nearest bfloat16 denormal.

The same region widens its bfloat16 inputs the integer way too, where its code reads them
through :func:`widened`: the 16 bits shifted into the upper half of a float32, which is what
the widening is (exact: no rounding). XLA emits its convert of an input that feeds
reductions as a loop of its own, one thread writing a float32 copy; the shift fuses into the
reductions' loops, which makes a layer-norm gradient faster (the GELU's region, whose convert
fuses with its ``Erf``, runs alike either way).

The region returns the 16 bits as ``uint16`` and the caller reads them as bfloat16 with a
``Bitcast`` (no copy). A gradient does not pass through a ``Bitcast``: the form is for regions
no gradient is taken of (a custom gradient's forward or backward), not for regions TensorFlow
differentiates.

This module contributes the form to the stages through ``fusion.forms``
(:class:`fusion.forms.RegionEdges`, :data:`EDGES`); no stage imports it, and without it every
region's edges are XLA's convert.

Example:
    >>> import numpy as np, tensorflow as tf
    >>> x = tf.constant([1.0, 1.00390625, 1.01171875, -3.3e38, float("nan"), 1e-40])
    >>> bits = tf.function(to_bits, jit_compile=True)(x)
    >>> bool(np.array_equal(from_bits(bits).numpy().view("uint16"),
    ...                     tf.cast(x, tf.bfloat16).numpy().view("uint16")))
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from fusion import forms, trace_state

FAMILY = "bfloat16_bits"  # the tuner's family of the decisions below (a region's own family
# forces its forms by name: this one has its own)
CONVERT = "convert"  # XLA's own float32 -> bfloat16 conversion
INTEGER = "integer rounding"  # the rounding as integer operations (:func:`to_bits`), and the
# widening (:func:`widened`)


def to_bits(x: tf.Tensor) -> tf.Tensor:
    """The bits of ``x`` (float32) rounded to bfloat16 as XLA's convert rounds it (to nearest,
    ties to even; NaN to the quiet NaN of its sign), as ``uint16``: TensorFlow's ``Cast``
    too, but for the sign of a NaN, which its vectorized path drops.

    >>> import tensorflow as tf
    >>> [hex(int(b)) for b in to_bits(tf.constant([1.0, -2.0, float("inf")]))]
    ['0x3f80', '0xc000', '0x7f80']
    """
    u = tf.bitcast(tf.convert_to_tensor(x, tf.float32), tf.uint32)
    lowest_kept = tf.bitwise.bitwise_and(tf.bitwise.right_shift(u, 16), 1)
    rounded = tf.bitwise.right_shift(u + (0x7FFF + lowest_kept), 16)
    quiet_nan = tf.bitwise.bitwise_or(
        tf.bitwise.bitwise_and(tf.bitwise.right_shift(u, 16), 0x8000), 0x7FC0)
    return tf.cast(tf.where(tf.math.is_nan(x), quiet_nan, rounded), tf.uint16)


def widen_bits(x: tf.Tensor) -> tf.Tensor:
    """The float32 value of bfloat16 ``x`` by integer operations: its 16 bits as the upper
    half of a float32 (exact, as every bfloat16 is a float32; NaNs keep their bits).

    >>> import tensorflow as tf
    >>> widen_bits(tf.constant([1.5, -2.0, float("inf")], tf.bfloat16)).numpy().tolist()
    [1.5, -2.0, inf]
    """
    upper = tf.cast(tf.bitcast(x, tf.uint16), tf.uint32)
    return tf.bitcast(tf.bitwise.left_shift(upper, 16), tf.float32)


@contextlib.contextmanager
def integer_edges(on: bool = True) -> Iterator[None]:
    """While a region's function is traced: :func:`widened` widens bfloat16 by integer
    operations in the graph being traced (``on``), or by ``Cast`` (XLA's convert). What
    :func:`fusion.forms.xla_region` sets around the function it compiles."""
    with trace_state.scoped_slot(tf.compat.v1.get_default_graph(), FAMILY, on):
        yield


def widened(x: Any) -> tf.Tensor:
    """``x`` as float32, for code that runs inside an XLA region: a bfloat16 ``x`` by integer
    operations (:func:`widen_bits`) where the graph being traced is a region in that form
    (:func:`integer_edges`), else (and for any other dtype) by ``Cast``. The same values
    either way.

    >>> import tensorflow as tf
    >>> x = tf.constant([0.5, -3.0], tf.bfloat16)
    >>> @tf.function
    ... def region(x):
    ...     with integer_edges():
    ...         return widened(x)
    >>> region(x).numpy().tolist(), widened(x).numpy().tolist()
    ([0.5, -3.0], [0.5, -3.0])
    """
    x = tf.convert_to_tensor(x)
    if x.dtype == tf.bfloat16 and trace_state.held(tf.compat.v1.get_default_graph(), FAMILY):
        return widen_bits(x)
    return tf.cast(x, tf.float32)


def from_bits(bits: tf.Tensor) -> tf.Tensor:
    """``uint16`` bits read as bfloat16 (a ``Bitcast``: no copy, no rounding).

    >>> import tensorflow as tf
    >>> float(from_bits(tf.constant([0x3F80], tf.uint16))[0])
    1.0
    """
    return tf.bitcast(bits, tf.bfloat16)


def encoded(value: tf.Tensor) -> tf.Tensor:
    """A region's output ``value`` as the bits of its bfloat16 rounding: a bfloat16 ``Cast`` of
    a float32 tensor (how the regions narrow their results) is replaced by :func:`to_bits` of
    that tensor; any other bfloat16 tensor is widened first (exact) and rounded back
    unchanged. Other dtypes pass as they are.

    >>> import tensorflow as tf
    >>> @tf.function
    ... def region(x):
    ...     return encoded(tf.cast(x * 3.0, tf.bfloat16)), encoded(x)
    >>> [t.dtype.name for t in region(tf.constant([1.0]))]
    ['uint16', 'float32']
    """
    if value.dtype != tf.bfloat16:
        return value
    op = getattr(value, "op", None)
    if op is not None and op.type == "Cast" and op.inputs[0].dtype == tf.float32:
        return to_bits(op.inputs[0])
    return to_bits(tf.cast(value, tf.float32))


def decoded(value: Any) -> Any:
    """A region's result as the caller reads it: every ``uint16`` tensor (an
    :func:`encoded` output) as bfloat16.

    >>> import tensorflow as tf
    >>> decoded([tf.constant([0x3F80], tf.uint16), tf.constant([2.0])])[0].dtype.name
    'bfloat16'
    """
    return tf.nest.map_structure(
        lambda t: from_bits(t) if getattr(t, "dtype", None) == tf.uint16 else t, value)


EDGES = forms.contribute(forms.RegionEdges(
    FAMILY, INTEGER, CONVERT, edges=integer_edges, widened=widened, encoded=encoded,
    decoded=decoded))
"""The integer edges as the stages ask for them (``fusion.forms.region_edges``)."""
