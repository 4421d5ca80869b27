"""Stages: rewrites made while a step is traced, before differentiation.

Some fusions cannot be made on the finished GraphDef: once the tape has differentiated Keras's
composite batch norm or its LSTM loop, the gradient is ~30 ops or a second ``While`` body that
reads the forward's intermediates. A stage instead routes one Keras method (a layer's ``call``
or ``inner_loop``) through its handler while tfmx traces, and emits the fused form there, whose
gradient TensorFlow knows (a registered gradient or a ``tf.custom_gradient``).

One mechanism for every stage:

- A family (:class:`fusion.family.Family`, the name users pass to
  ``tfmx.enable(patterns=[...])``) declares its :class:`Hook` s: which class's method it
  routes, and the handler.
- :func:`install` patches every registered hook once (``fusion.patches``, :data:`GROUP`);
  a patched method runs its handler only inside :func:`tracing`, whose one
  :class:`StageContext` (target, chooser, families on, where statistics go) tfmx enters
  wherever it traces a step (fit, evaluate, predict, ``tfmx.function``, the outer-tape path).
  Outside it Keras runs untouched.
- A handler returns what the method returns: the fused form, or the original's result after
  recording why it declined. It records what it rewrote through ``ctx.record`` ("rewritten");
  the family's graph pass, or its declared observer (:class:`fusion.family.Observed`), later
  finds the emitted nodes in the traced graph and reports them as "observed".

Example:
    >>> from fusion import stage
    >>> sorted(s.name for s in stage.stages())  # doctest: +NORMALIZE_WHITESPACE
    ['attention', 'batch_norm', 'bias_row', 'einsum_dense', 'feed_forward', 'gelu',
     'layer_norm', 'rnn']
    >>> stage.active() is None
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from fusion import patches
from fusion.family import Family, families
from fusion.pattern import Chooser, PatternStats, Target

GROUP = "tfmx.stages"  # the fusion.patches group the stage hooks are installed under


@dataclasses.dataclass(frozen=True)
class StageContext:
    """What a stage handler knows while tfmx traces: the target, the chooser deciding between
    correct forms (None: the rewritten form), the families switched on (None: all), and where
    its statistics go (``record(family, stats)``)."""

    target: Target
    chooser: Chooser | None = None
    families: tuple[str, ...] | None = None
    record: Callable[[str, PatternStats], None] = lambda family, stats: None
    warn: Callable[[str, str], None] = lambda key, message: None
    xla: bool = False  # a region may be compiled by XLA (cpu, cuda; never metal)
    # The GraphDef passes the step gets, as a function from a timed candidate's traced
    # ConcreteFunction to the one to run (None: the candidate runs as traced): a form whose
    # gradient a pass rewrites in the step (a BiasAddGrad, a MatMul + BiasAdd) is timed so.
    passes: Callable[[Any], Any] | None = None
    # A handler that raises falls back to Keras's call (see :func:`transaction`); strict: the
    # exception reaches the caller instead (tests, ``tfmx.enable(strict=True)``).
    strict: bool = False

    def wants(self, family: str) -> bool:
        return self.families is None or family in self.families


@dataclasses.dataclass(frozen=True)
class Hook:
    """One method a stage routes: ``owner`` names the class as ``"module:Class"`` (imported
    when the hook is installed), ``handler(ctx, original, instance, *args, **kwargs)`` runs in
    its place inside a trace. ``owner`` may name a module instead (``"package:module"``): its
    function ``attribute`` is routed, and the handler gets the function's arguments."""

    owner: str
    attribute: str
    handler: Callable[..., Any]
    # Hooks of several stages on one method run as a chain, each handler's ``original`` the
    # next one's routed method: the highest ``outer`` first (a stage that spans two calls of
    # the method, as feed_forward two Dense layers, sees every call before one that rewrites
    # a single call), then in the order the stages registered.
    outer: int = 0

    def owner_class(self) -> type:
        module, name = self.owner.split(":")
        return getattr(importlib.import_module(module), name)


_local = threading.local()


def stages() -> list[Family]:
    """Every family with stage hooks (:func:`fusion.family.families`), in pipeline order."""
    return [f for f in families() if f.hooks]


_GRAPH_CONTEXT = "_tfmx_stage_context"  # on the graph a tracing() block traces


def active() -> StageContext | None:
    """The context of the tfmx trace in progress on this thread, or None outside one. A thread
    that never entered :func:`tracing` (a ``MirroredStrategy`` replica thread, which traces
    each replica's part of ``strategy.run`` into its caller's graph) sees the context of the
    graph it traces into, or of the graphs that graph is traced in."""
    ctx = getattr(_local, "context", _local)
    if ctx is not _local:
        return ctx
    from tensorflow.python.framework import ops

    graph = ops.get_default_graph()
    while graph is not None:
        if hasattr(graph, _GRAPH_CONTEXT):
            return getattr(graph, _GRAPH_CONTEXT)
        graph = getattr(graph, "outer_graph", None)
    return None


@contextlib.contextmanager
def tracing(ctx: StageContext | None) -> Iterator[None]:
    """Inside this block (on this thread, and on the replica threads of the graph it traces),
    patched methods run their stage's handler."""
    from tensorflow.python.framework import ops

    previous = active()
    # a function's graph only: the process-wide graph of eager code is every thread's
    graph = ops.get_default_graph() if ops.inside_function() else None
    before = getattr(graph, _GRAPH_CONTEXT, _local)
    _local.context = ctx
    if graph is not None:
        setattr(graph, _GRAPH_CONTEXT, ctx)
    try:
        yield
    finally:
        _local.context = previous
        if graph is not None and before is _local:
            delattr(graph, _GRAPH_CONTEXT)
        elif graph is not None:
            setattr(graph, _GRAPH_CONTEXT, before)


def functional_neighbours(layer: Any) -> tuple[list[Any], list[Any]] | None:
    """(the layers whose outputs ``layer`` reads, the layers that read its outputs) in the
    Keras functional graph it was built in, when it is called once there; else None (a
    subclassed model's layers, traced with no such graph, or a layer called twice). Stages that
    span two layers read it to know that nothing else reads a tensor.

    >>> import keras
    >>> inp = keras.Input((4,))
    >>> first, second = keras.layers.Dense(4), keras.layers.Dense(2)
    >>> _ = keras.Model(inp, second(first(inp)))
    >>> [layer is second for layer in functional_neighbours(first)[1]]
    [True]
    >>> functional_neighbours(keras.layers.Dense(2)) is None  # never called
    True
    """
    nodes = getattr(layer, "_inbound_nodes", [])
    if len(nodes) != 1:
        return None
    return ([node.operation for node in nodes[0].parent_nodes],
            [node.operation for node in getattr(layer, "_outbound_nodes", [])])


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


def rewrite_call(ctx: StageContext, family: str, scope: str, labels: dict[str, str], *,
                 what: str, why: str | None, forms: list[str], signature: Callable[[], str],
                 candidates: Callable[[], dict], conservative: str, kept: str,
                 keras: Callable[[], Any], emit: Callable[[str], Any], prefix: str = "") -> Any:
    """The flow every stage hook shares: without a tuner the first of ``forms``; with one, the
    tuner's pick between ``conservative`` and ``candidates()`` (factories by form name, timed
    under ``signature()``); the form emitted by ``emit(form)`` under ``<scope>_<prefix><form>``
    and recorded as fused with its label, or ``keras()`` with the reason recorded (``why``, or
    that ``kept``, the conservative form, measured faster). ``forms`` is empty, or ``why``
    given, where the call cannot be rewritten.

    >>> from fusion.pattern import PlainTarget, RewriteAlways
    >>> seen = []
    >>> ctx = StageContext(PlainTarget("cpu"), RewriteAlways(),
    ...                    record=lambda family, stats: seen.append(dict(stats.fused_kinds)))
    >>> rewrite_call(ctx, "demo", "tfmx_demo", {"fast": "demo: the fast form"}, what="demo",
    ...              why=None, forms=["fast"], signature=lambda: "demo x",
    ...              candidates=lambda: {"slow": None, "fast": None}, conservative="slow",
    ...              kept="the slow form", keras=lambda: "slow", emit=lambda form: form)
    'fast'
    >>> seen
    [{'demo: the fast form': 1}]
    """
    import tensorflow as tf

    stats = PatternStats(matched=1)
    form = forms[0] if forms and why is None else None
    if form is not None and ctx.chooser is not None:
        chosen = signature()
        form = ctx.chooser.choose(family, chosen, candidates(), conservative).choice
        if form == conservative:
            form, why = None, f"{chosen}: {kept} kept: measured faster"
    if form is None:
        stats.decline(f"{what}: {why}")
        ctx.record(family, stats)
        return keras()
    with tf.name_scope(f"{scope}_{(prefix + form).replace(' ', '_')}"):
        out = emit(form)
    stats.fuse(labels[prefix + form])
    ctx.record(family, stats)
    return out


def _routed(chain: list[tuple[Family, Hook]]) -> Callable[[Any], Any]:
    """The patch of one method that ``chain``'s hooks route (in registration order), run
    highest ``outer`` first, then in that order: each handler runs where its stage is on in
    the active trace, with the rest of the chain (then the method itself) as its
    ``original``; a stage that is off passes the call on."""
    ordered = sorted(chain, key=lambda pair: -pair[1].outer)  # stable

    def make(original: Any) -> Any:
        method = original
        for stage, hook in reversed(ordered):
            method = _link(stage, hook, method)
        method.__wrapped__ = original
        method.__doc__ = getattr(original, "__doc__", None)
        method.__name__ = getattr(original, "__name__", ordered[0][1].attribute)
        return method

    return make


def _link(stage: Family, hook: Hook, following: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = active()
        if ctx is None or not ctx.wants(stage.name):
            return following(self, *args, **kwargs)
        return transaction(ctx, stage.name, hook.handler, following, self, args, kwargs)

    return method


def install() -> None:
    """Patch every registered stage's hooks (idempotent; ``uninstall`` puts them back): one
    patch per method, the hooks of several stages on it chained (:class:`Hook`'s ``outer``)."""
    chains: dict[tuple[str, str], list[tuple[Family, Hook]]] = {}
    for stage in stages():
        for hook in stage.hooks:
            chains.setdefault((hook.owner, hook.attribute), []).append((stage, hook))
    for chain in chains.values():
        hook = chain[0][1]
        patches.install(GROUP, hook.owner_class(), hook.attribute, _routed(chain))


def uninstall() -> None:
    """Restore the methods :func:`install` patched."""
    patches.uninstall(GROUP)


# -- transactions ------------------------------------------------------------------------------
FAULT_POINTS = ("handler", "tuner", "emit")
_faults: dict[str, str] = {}  # family -> where a test makes its stage fail


@contextlib.contextmanager
def failing(family: str, where: str = "handler") -> Iterator[None]:
    """Test hook: inside the block, ``family``'s stage raises at ``where``: as its handler
    starts (``"handler"``), when it asks the tuner (``"tuner"``), or after it emitted its
    form (``"emit"``: the form is in the graph and must not run).

    >>> with failing("layer_norm", "emit"):
    ...     _faults["layer_norm"]
    'emit'
    """
    if where not in FAULT_POINTS:
        raise ValueError(f"where must be one of {FAULT_POINTS}, got {where!r}")
    previous = _faults.get(family)
    _faults[family] = where
    try:
        yield
    finally:
        if previous is None:
            _faults.pop(family, None)
        else:
            _faults[family] = previous


class InjectedFault(RuntimeError):
    """The failure :func:`failing` injects."""


class _FailingChooser:
    def choose(self, family: str, *args: Any, **kwargs: Any) -> Any:
        raise InjectedFault(f"{family}: injected failure in the tuner")


def _inject(family: str, where: str) -> None:
    if _faults.get(family) == where:
        raise InjectedFault(f"{family}: injected failure at {where}")


def transaction(ctx: StageContext, family: str, handler: Callable[..., Any],
                following: Callable[..., Any], instance: Any, args: tuple,
                kwargs: dict) -> Any:
    """Run a stage's ``handler`` for one call as a transaction: its statistics, Keras variable
    writes and losses (``fusion.transaction.Attempt``) take effect only if it returns. If it
    raises, the call is ``following``'s (the rest of the chain, then Keras's method), what
    the handler emitted is left unread (pruned when the step runs), and the report records the
    failure with its error, warned once per family and error type; with ``ctx.strict`` the
    exception reaches the caller instead.

    >>> import tensorflow as tf
    >>> from fusion.pattern import PlainTarget
    >>> seen = []
    >>> ctx = StageContext(PlainTarget("cpu"), record=lambda f, s: seen.append(dict(s.declined)))
    >>> def broken(ctx, original, layer, x):
    ...     raise ValueError("a bug")
    >>> class Layer:
    ...     pass
    >>> float(transaction(ctx, "demo", broken, lambda self, x: x + 1.0, Layer(),
    ...                   (tf.constant(1.0),), {}))
    2.0
    >>> seen
    [{"Layer: the demo stage failed (ValueError: a bug); Keras's call kept": 1}]
    """
    from fusion.transaction import Attempt

    unsupported = unsupported_inputs((instance, *args), kwargs)
    if unsupported is not None:
        stats = PatternStats(matched=1)
        stats.decline(f"{_caller(instance)}: {unsupported}: Keras's call kept")
        ctx.record(family, stats)
        return following(instance, *args, **kwargs)
    recorded: list[tuple[str, PatternStats]] = []
    chooser = _FailingChooser() if _faults.get(family) == "tuner" else ctx.chooser
    attempt_ctx = dataclasses.replace(ctx, chooser=chooser,
                                      record=lambda f, stats: recorded.append((f, stats)))
    attempt = Attempt()
    try:
        with tracing(attempt_ctx), attempt:
            _inject(family, "handler")
            out = handler(attempt_ctx, following, instance, *args, **kwargs)
            _inject(family, "emit")
    except Exception as exc:
        if ctx.strict:
            raise
        left = attempt.abandon()
        what = f"{_caller(instance)}: the {family} stage failed"
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        error = error if len(error) <= 200 else error[:197] + "..."
        stats = PatternStats(matched=1)
        stats.decline(f"{what} ({error}); Keras's call kept")
        stats.errors.append(f"{what}: {error}" + (
            f"; its attempt left {len(left)} variable write(s) in the step: {', '.join(left)}"
            if left else ""))
        ctx.record(family, stats)
        ctx.warn(f"stage:{family}:{type(exc).__name__}",
                 f"tfmx: the {family} stage failed on a {_caller(instance)} call "
                 f"({error}); that call runs as Keras wrote it. tfmx.report() has the details; "
                 "tfmx.enable(strict=True) raises instead.")
        return following(instance, *args, **kwargs)
    attempt.commit(instance)
    for f, stats in recorded:
        ctx.record(f, stats)
    return out


def _caller(instance: Any) -> str:
    """What a stage's call is, for the report: the layer's class, or for a hooked module
    function (whose first argument ``instance`` is then a tensor) the word "call"."""
    import tensorflow as tf

    return "call" if tf.is_tensor(instance) else type(instance).__name__


def unsupported_inputs(args: tuple, kwargs: dict) -> str | None:
    """Why no stage handles a call with these arguments (the layer, or a hooked function's
    first argument, then the rest), or None: every stage's handler reads a dense floating-point
    tensor as the call's first tensor, and none takes a sparse or ragged one anywhere.

    >>> import tensorflow as tf
    >>> unsupported_inputs((object(), tf.ones([2, 2])), {}) is None
    True
    >>> unsupported_inputs((object(), tf.sparse.eye(2)), {})
    'a SparseTensor input'
    >>> unsupported_inputs((object(), tf.ones([2], tf.int32)), {})
    'an int32 input'
    >>> unsupported_inputs((object(), {"a": tf.ones([2])}), {})
    'a dict input (nested)'
    """
    import tensorflow as tf

    for value in tf.nest.flatten((args, kwargs), expand_composites=False):
        if isinstance(value, (tf.SparseTensor, tf.RaggedTensor, tf.IndexedSlices)):
            return f"a {type(value).__name__} input"
    rest = list(args if tf.is_tensor(args[0]) else args[1:]) or list(kwargs.values())
    first = rest[0] if rest else None
    if isinstance(first, (dict, list, tuple)):
        return f"a {type(first).__name__} input (nested)"
    if first is None or not tf.is_tensor(first):
        return f"a {type(first).__name__} input, not a tensor"
    dtype = tf.as_dtype(first.dtype)
    if not dtype.is_floating:
        return f"an {dtype.name} input" if dtype.name[0] in "aeiou" else f"a {dtype.name} input"
    return None
