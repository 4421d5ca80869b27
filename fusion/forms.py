"""The forms a stage emits, and how they are timed: a layer's weights as its call reads them, a
tuner candidate of a layer call (forward and backward at the call's shapes), an XLA-compiled
region (its bfloat16 edges by XLA's convert or by integer operations, as measured), a custom
gradient whose backward is named as TensorFlow names a registered gradient's.

Example:
    >>> import tensorflow as tf
    >>> from fusion.forms import xla_region
    >>> xla_region(lambda x: x * 2.0)(tf.constant([1.5])).numpy().tolist()
    [3.0]
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from fusion import bfloat16_bits as bits
from fusion.stage_context import StageContext, active, tracing


def autocast_dtype() -> str | None:
    """The dtype Keras casts float variables to when a layer reads them here and now (a
    mixed-precision layer's ``call``: its compute dtype), or None outside such a call. Keras
    keeps it per thread, and the tuner times its candidates on a thread of its own.

    >>> autocast_dtype() is None
    True
    """
    try:
        from keras.src.backend.common.variables import get_autocast_scope
    except ImportError:  # a Keras without it: variables are read as they are
        return None
    scope = get_autocast_scope()
    return None if scope is None else scope.dtype


@contextlib.contextmanager
def autocast(dtype: str | None) -> Iterator[None]:
    """Keras's autocast of float variables to ``dtype`` inside the block (none if None): a
    timed candidate reads a layer's weights in the dtype the layer's call reads them in."""
    if dtype is None:
        yield
        return
    from keras.src.backend.common.variables import AutocastScope

    with AutocastScope(dtype):
        yield


def layer_value(value: Any) -> Any:
    """A Keras variable's value as a layer's call reads it (autocast to the call's compute
    dtype inside a mixed-precision layer's call), a tensor as it is.

    >>> import keras
    >>> layer_value(keras.Variable([1.0, 2.0])).numpy().tolist()
    [1.0, 2.0]
    """
    import tensorflow as tf

    return value.value if hasattr(value, "value") and hasattr(value, "assign") else \
        tf.convert_to_tensor(value)


def timed_form(forward: Callable[..., Any], shapes: list, dtype: Any, variables: Any = (),
               watch: bool = True, backward: bool = True) -> Callable[[], Callable[[], None]]:
    """A tuner candidate (``fusion.pattern.Chooser``): a factory of a runnable that computes
    ``forward`` on random inputs of ``shapes`` (an unknown dimension: 32) and ``dtype`` and,
    when ``backward``, the gradient of its squared sum w.r.t. ``variables`` and (``watch``) the
    inputs: one form of a layer call, forward and backward at the call's shapes. Where it is
    made inside a mixed-precision layer's call, ``forward`` reads the layer's weights cast as
    that call reads them (:func:`autocast_dtype`), on whichever thread the tuner times it; where
    it is made inside a tfmx trace whose context has ``passes``, the traced candidate is
    rewritten by them, as the step will be (a candidate they cannot rewrite runs as traced).

    >>> import tensorflow as tf
    >>> run = timed_form(lambda x: x * 2.0, [[None, 3]], tf.float32)()
    >>> run()
    """
    cast_to = autocast_dtype()
    ctx = active()
    passes = None if ctx is None else ctx.passes

    def make() -> Callable[[], None]:
        import tensorflow as tf

        known = [[32 if d is None else int(d) for d in shape] for shape in shapes]

        @tf.function(autograph=False)
        def step(*inputs):
            # the candidate exactly as written: no stage rewrites what it calls (a decision
            # timed inside another's candidate would be taken at the wrong moment)
            with tracing(None), autocast(cast_to), tf.GradientTape() as tape:
                if watch:
                    tape.watch(inputs)
                # tf.square, not ** 2: the gradient of a Pow is a Pow (x ** 1), a slow
                # kernel that TensorFlow does not simplify in front of every region and
                # that once added ~6 ms to an XLA region's time at [2048, 512]
                loss = tf.reduce_sum(tf.square(tf.cast(forward(*inputs), tf.float32)))
            if not backward:  # inference: the forward alone
                return [loss]
            return tape.gradient(loss, [*variables, *(inputs if watch else ())])

        args = [tf.random.normal(s, seed=i + 1, dtype=dtype) for i, s in enumerate(known)]
        concrete = step.get_concrete_function(*args)
        if passes is not None:
            try:
                concrete = passes(concrete)
            except Exception:  # noqa: BLE001 - a candidate the passes cannot take runs as is
                pass

        def run() -> None:
            concrete(*args)[0].numpy()

        return run

    return make


XLA = "xla"  # the name of the XLA-compiled form of a region among a decision's candidates
XLA_CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})  # how a region is called


def xla_region(fn: Callable[..., Any], bfloat16_bits: bool = False) -> Callable[..., Any]:
    """``fn`` as one function compiled by XLA (``jit_compile=True``; TensorFlow compiles its
    gradient function too), traced with no stage active: XLA fuses the region itself, and
    the GraphDef passes leave functions XLA must compile as they are. With
    ``bfloat16_bits`` its bfloat16 outputs are rounded by integer operations inside the region
    and read back with a ``Bitcast``, and the bfloat16 inputs its code reads through
    ``fusion.bfloat16_bits.widened`` are widened by integer operations
    (:mod:`fusion.bfloat16_bits`: the same bits, no gradient through them: for regions no
    gradient is taken of).

    >>> import tensorflow as tf
    >>> region = xla_region(lambda x: tf.nn.relu(x) * 2.0)
    >>> region(tf.constant([-1.0, 3.0])).numpy().tolist()
    [0.0, 6.0]
    >>> narrow = xla_region(lambda x: tf.cast(x * 2.0, tf.bfloat16), bfloat16_bits=True)
    >>> y = narrow(tf.constant([-1.0, 3.0]))
    >>> y.dtype.name, y.numpy().tolist()
    ('bfloat16', [-2.0, 6.0])
    """
    import tensorflow as tf

    from fusion import bfloat16_bits as bits

    def body(*args: Any) -> Any:
        with tracing(None), bits.integer_edges(bfloat16_bits):
            out = fn(*args)
        return tf.nest.map_structure(bits.encoded, out) if bfloat16_bits else out

    compiled = tf.function(body, jit_compile=True, autograph=False)
    if not bfloat16_bits:
        return compiled
    return lambda *args: bits.decoded(compiled(*args))


def custom_gradient(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``tf.custom_gradient(fn)`` whose backward ops are named as TensorFlow names the gradient
    of a registered op: under ``gradient_tape/<the forward's name scope>/``. TensorFlow calls a
    custom gradient's function outside any scope, so its ops would otherwise be named ``mul``,
    ``Sum_3``... at the top of the graph: a profile could not say whose backward they are, and
    ``policies.audit`` would count their casts as the forward's.

    >>> import tensorflow as tf
    >>> @custom_gradient
    ... def double(x):
    ...     return 2.0 * x, lambda dy: dy * 2.0
    >>> @tf.function
    ... def step(x):
    ...     with tf.GradientTape() as tape:
    ...         tape.watch(x)
    ...         with tf.name_scope("block"):
    ...             y = double(x)
    ...     return tape.gradient(y, x)
    >>> graph = step.get_concrete_function(tf.TensorSpec([2])).graph
    >>> [op.name for op in graph.get_operations() if op.type == "Mul"][-1]
    'gradient_tape/block/mul'
    """
    import tensorflow as tf

    @functools.wraps(fn)
    def forward(*args: Any) -> Any:
        outputs, gradient = fn(*args)
        scope = tf.get_current_name_scope()

        def named(*dys: Any) -> Any:
            with tf.name_scope(f"gradient_tape/{scope}/" if scope else "gradient_tape/"):
                return gradient(*dys)

        return outputs, named

    return tf.custom_gradient(forward)


def with_xla(ctx: StageContext, candidates: dict, region: Callable[..., Any], shapes: list,
             dtype: Any, variables: Any = ()) -> dict:
    """``candidates`` plus, where ``ctx`` allows XLA, the form ``region`` (a computation
    compiled by XLA: :func:`xla_region`, or a form that calls such regions), timed as the
    others (:func:`timed_form`)."""
    if not ctx.xla:
        return candidates
    return {**candidates, XLA: timed_form(region, shapes, dtype, variables)}


def integer_rounding(ctx: Any, what: str, region: Callable[..., Any], shapes: list,
                     dtype: Any = tf.bfloat16) -> bool:
    """Whether the XLA region computing ``region`` (its bfloat16 outputs narrowed by ``Cast``)
    for inputs of ``shapes`` and ``dtype`` rounds those outputs by integer operations (and
    widens the bfloat16 inputs it reads through :func:`fusion.bfloat16_bits.widened` so):
    ``ctx``'s tuner times the region's forward both ways (a decision of the family
    :data:`fusion.bfloat16_bits.FAMILY`, named by ``what`` and the shapes, cached per machine
    like every other); without a tuner, the
    integer rounding. The region itself is timed, not a stand-in: XLA's convert costs little
    in a loop that only moves memory, and much in one that computes (the GELU's ``Erf``).

    >>> import tensorflow as tf
    >>> from fusion.pattern import PlainTarget, RewriteAlways
    >>> from fusion.stage_context import StageContext
    >>> ctx = StageContext(PlainTarget("cpu"), RewriteAlways())
    >>> integer_rounding(ctx, "scale", lambda x: tf.cast(x * 2.0, tf.bfloat16), [[4]])
    True
    """
    from fusion.fragment import shape_text

    if ctx.chooser is None:
        return True
    signature = (f"{what} XLA region input {' '.join(shape_text(s) for s in shapes)} "
                 f"{tf.as_dtype(dtype).name}: bfloat16 by XLA's convert or by integer "
                 "operations")

    def timed(mode: str) -> Callable[[], Callable[[], None]]:
        compiled = xla_region(region, bfloat16_bits=mode == bits.INTEGER)
        return timed_form(lambda *args: tf.add_n([  # one number of outputs of any dtypes
            tf.reduce_sum(tf.cast(out, tf.float32)) for out in tf.nest.flatten(compiled(*args))]),
            shapes, dtype, backward=False)

    candidates = {mode: timed(mode) for mode in (bits.CONVERT, bits.INTEGER)}
    choice = ctx.chooser.choose(bits.FAMILY, signature, candidates, bits.CONVERT).choice
    return choice == bits.INTEGER
