"""Stages: rewrites made while a step is traced, before differentiation.

Some fusions cannot be made on the finished GraphDef: once the tape has differentiated Keras's
composite batch norm or its LSTM loop, the gradient is ~30 ops or a second ``While`` body that
reads the forward's intermediates. A stage instead routes one Keras method (a layer's ``call``
or ``inner_loop``) through its handler while tfmx traces, and emits the fused form there, whose
gradient TensorFlow knows (a registered gradient or a ``tf.custom_gradient``).

One mechanism for every stage (the context of a trace is :mod:`fusion.stage_context`, the
forms a stage emits and times :mod:`fusion.forms`; both are re-exported here):

- A family (:class:`fusion.family.Family`, the name users pass to
  ``tfmx.enable(patterns=[...])``) declares its :class:`Hook` s: which class's method it
  routes, and the handler.
- :func:`install` patches every registered hook once (``fusion.patches``, :data:`GROUP`);
  a patched method runs its handler only inside :func:`tracing`, whose one
  :class:`StageContext` (target, chooser, families on, where statistics go) tfmx enters
  wherever it traces a step (fit, evaluate, predict, ``tfmx.function``, the outer-tape path).
  Outside it Keras runs untouched.
- A handler returns what the method returns: the fused form, or the original's result after
  recording why it declined. What it found at the call travels in one record,
  :class:`CallSite`, through the flow every stage shares, :func:`rewrite_call` (the reason it
  declines, the tuner's pick among its forms, the form emitted under its scope and recorded
  under its label: "rewritten"); the family's graph pass, or the generic observer of its
  forms (:class:`fusion.family.Forms`, each a :class:`fusion.family.Form` record), later finds
  the emitted nodes in the traced graph and reports them as "observed".

Example:
    >>> from fusion import stage
    >>> names = {s.name for s in stage.stages()}  # each with its hooks
    >>> {"attention", "batch_norm", "gelu", "layer_norm", "rnn"} <= names
    True
    >>> stage.active() is None
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fusion import patches, private_api
from fusion.family import Family, Form, families
from fusion.forms import (
    XLA,
    XLA_CALLS,
    autocast,
    autocast_dtype,
    custom_gradient,
    integer_rounding,
    layer_value,
    runnable_forms,
    timed_form,
    widened,
    with_xla,
    xla_region,
)
from fusion.pattern import PatternStats
from fusion.stage_context import StageContext, active, tracing

GROUP = "tfmx.stages"  # the fusion.patches group the stage hooks are installed under


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
    # Where given, the calls the handler may take: a call for which ``when(*arguments)`` (the
    # method's own, the instance first) is false passes on at once, no transaction made and
    # nothing recorded (a hook on an operator the step calls everywhere, of which the stage
    # takes a few calls).
    when: Callable[..., bool] | None = None

    @classmethod
    def on(cls, call: str, handler: Callable[..., Any], outer: int = 0,
           when: Callable[..., bool] | None = None) -> Hook:
        """The hook of ``call``, spelled ``"module:Class.method"`` (or
        ``"package:module.function"``), run by ``handler``.

        >>> Hook.on("keras.src.layers.core.dense:Dense.call", print).owner
        'keras.src.layers.core.dense:Dense'
        """
        owner, _, attribute = call.rpartition(".")
        return cls(owner, attribute, handler, outer, when)

    def owner_class(self) -> type:
        """The class (or module) ``owner`` names, where the installed Keras holds it
        (:func:`fusion.private_api.locate`)."""
        module, name = private_api.locate(self.owner).split(":")
        return getattr(importlib.import_module(module), name)

    def waiting(self) -> bool:
        """True while the package ``owner`` names is one besides Keras (keras_hub...) that
        the process has not imported: the hook is installed once it is (:func:`install`
        again, as tfmx does before it traces a step), and never imports it itself (a user
        without it pays nothing, and is told nothing).

        >>> Hook.on("keras.src.layers.core.dense:Dense.call", print).waiting()
        False
        >>> Hook.on("not_imported_here.layers:Layer.call", print).waiting()
        True
        """
        package = self.owner.split(".", 1)[0].split(":", 1)[0]
        return package != "keras" and package not in sys.modules


def stages() -> list[Family]:
    """Every family with stage hooks (:func:`fusion.family.families`), in pipeline order."""
    return [f for f in families() if f.hooks]


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


@dataclasses.dataclass
class Emitted:
    """What an ``emit`` of :func:`rewrite_call` returns where the form reports itself: the
    call's output and its statistics (a form that rewrites through the graph passes has their
    labels). ``kept``: the form found it could not run before it changed the graph (its
    reasons and errors in ``stats``); the call is then Keras's."""

    value: Any
    stats: PatternStats
    kept: bool = False


@dataclasses.dataclass(frozen=True)
class CallSite:
    """What a stage found at one Keras call and what rewriting it needs, in one record (the
    stage-side counterpart of a graph rule's match, ``fusion.rule``): the ``family``, the
    ``forms`` that may replace Keras's call here (the one taken without a tuner first),
    ``keras`` (Keras's own call), ``emit`` (emits a form: its output, or :class:`Emitted`
    where the form reports itself), ``what`` (names the call in the report's reasons),
    ``why`` (why the call keeps Keras's form: None where it need not). For the tuner:
    ``signature`` (its key for the call) and ``candidates`` (factories of the timed forms by
    form name, Keras's among them), ``keeps`` (the form that is Keras's call here: the
    family's conservative one unless given) and ``default`` (the form the tuner takes where it
    cannot measure: ``keeps`` unless given). ``dtype``: the call's compute dtype, where the
    forms' ops (``Form.emits``) are checked against the target's kernels in it. ``then``:
    applied to the emitted form's output, outside its scope.

    >>> from fusion.family import Form, Forms, conservative
    >>> demo = Family("demo", "", forms=Forms("tfmx_demo", (
    ...     conservative("slow", "the slow form"), Form("fast", "demo: the fast form"))))
    >>> site = CallSite(demo, (demo.forms["fast"],), keras=lambda: "slow",
    ...                 emit=lambda form: form.name, what="demo")
    >>> site.keeps_form.name
    'slow'
    """

    family: Family
    forms: Sequence[Form]
    keras: Callable[[], Any]
    emit: Callable[[Form], Any]
    what: str = ""
    why: str | None = None
    signature: Callable[[], str] | None = None
    candidates: Callable[[], Mapping[str, Any]] | None = None
    keeps: Form | None = None
    default: Form | None = None
    dtype: Any = None
    then: Callable[[Any], Any] | None = None

    @property
    def keeps_form(self) -> Form:
        """The form that is Keras's call here."""
        return self.keeps if self.keeps is not None else self.family.forms.conservative


def rewrite_call(ctx: StageContext, site: CallSite) -> Any:
    """The flow every stage hook shares, for one call (``site``): without a tuner (or
    ``site.candidates``) the first of ``site.forms``; with one, the tuner's pick among
    ``site.candidates()`` (timed under ``site.signature()``; its default ``site.default``);
    Keras's own form (``site.keeps_form``) picked: ``site.keras()`` with the reason that it
    measured faster. Else the form emitted by ``site.emit(form)`` under its scope
    (:meth:`fusion.family.Forms.scope_of`; none where the family has no scope) and recorded
    as fused with its label, or with the statistics the emit returns (:class:`Emitted`), then
    passed to ``site.then`` outside that scope. No forms, or ``site.why`` given: the call
    cannot be rewritten, ``site.keras()`` with the reason recorded (after ``what: ``). With
    ``site.dtype``, a form whose ops the target has no kernel for in that dtype is neither
    emitted nor timed (:func:`fusion.forms.runnable_forms`); where none is left, the reason
    names the op.

    >>> from fusion.family import Form, Forms, conservative
    >>> from fusion.pattern import PlainTarget, RewriteAlways
    >>> demo = Family("demo", "", forms=Forms("tfmx_demo", (
    ...     conservative("slow", "the slow form"), Form("fast", "demo: the fast form"))))
    >>> seen = []
    >>> ctx = StageContext(PlainTarget("cpu"), RewriteAlways(),
    ...                    record=lambda family, stats: seen.append(dict(stats.fused_kinds)))
    >>> rewrite_call(ctx, CallSite(
    ...     demo, (demo.forms["fast"],), keras=lambda: "slow", emit=lambda form: form.name,
    ...     what="demo", signature=lambda: "demo x",
    ...     candidates=lambda: {"slow": None, "fast": None}))
    'fast'
    >>> seen
    [{'demo: the fast form': 1}]
    """
    import tensorflow as tf

    forms = site.family.forms
    keeps = site.keeps_form
    stats = PatternStats(matched=1)
    allowed, why, candidates = list(site.forms), site.why, site.candidates
    if site.dtype is not None and why is None and allowed:
        runnable, why = runnable_forms(ctx.target, allowed, site.dtype)
        refused = {f.name for f in allowed} - {f.name for f in runnable}
        allowed, why = runnable, None if runnable else why
        if candidates is not None and refused:
            every = candidates

            def candidates() -> dict:
                return {f: make for f, make in every().items() if f not in refused}
    form = allowed[0] if allowed and why is None else None
    if form is not None and ctx.chooser is not None and candidates is not None:
        signature = site.signature() if site.signature is not None else site.what
        default = site.default if site.default is not None else keeps
        choice = ctx.chooser.choose(site.family.name, signature, candidates(),
                                    default.name).choice
        if choice == keeps.name:
            form = None
            why = f"{signature}: {keeps.label} kept: measured faster"
        else:
            form = next((f for f in allowed if f.name == choice), None) or forms[choice]
    if form is None:
        stats.decline(f"{site.what}: {why}" if site.what else why)
        ctx.record(site.family.name, stats)
        return site.keras()
    scope = forms.scope_of(form)
    with tf.name_scope(scope) if scope else contextlib.nullcontext():
        out = site.emit(form)
    if isinstance(out, Emitted):
        ctx.record(site.family.name, out.stats)
        if out.kept:
            return site.keras()
        out = out.value
    else:
        stats.fuse(form.label)
        ctx.record(site.family.name, stats)
    return out if site.then is None else site.then(out)


def noted_call(ctx: StageContext, call: Callable[[], Any]) -> tuple[Any, tuple[str, ...],
                                                                    list[PatternStats]]:
    """``call()`` run inside ``ctx`` as it would be (the stages beneath a hook's handler, then
    Keras's), for a stage that notes a call another stage may rewrite: its output, the names
    of the ops it made in the default graph, and the statistics the stages it ran recorded
    (recorded in ``ctx`` too; a stage that takes the call into a larger rewrite moves their
    counts to its declines, :meth:`fusion.pattern.PatternStats.taken`).

    >>> import tensorflow as tf
    >>> from fusion.pattern import PlainTarget
    >>> ctx = StageContext(PlainTarget("cpu"), record=lambda family, stats: None)
    >>> with tf.Graph().as_default():
    ...     x = tf.constant(1.0)
    ...     out, made, stats = noted_call(ctx, lambda: tf.sqrt(x))
    >>> made, stats
    (('Sqrt',), [])
    """
    import tensorflow as tf

    graph = tf.compat.v1.get_default_graph()
    mark = graph.num_operations()
    recorded: list[PatternStats] = []

    def record(family: str, stats: PatternStats) -> None:
        recorded.append(stats)
        ctx.record(family, stats)

    with tracing(dataclasses.replace(ctx, record=record)):
        out = call()
    return out, tuple(op.name for op in graph.get_operations()[mark:]), recorded


def recording(*args: Any, **kwargs: Any) -> bool:
    """Whether a call is traced with a gradient tape recording (a hook's ``when`` for a stage
    that notes calls only in training steps); takes and ignores the call's arguments.

    >>> recording(1.0)
    False
    """
    import tensorflow as tf
    from tensorflow.python.eager import execute

    return tf.inside_function() and execute.must_record_gradient()


THROUGH = ("Cast", "Identity")  # ops a noted output may pass through before a product reads it


def noted_through(t: Any, noted: Mapping[Any, Any]) -> tuple[Any, tuple[Any, ...]] | None:
    """``(entry, between)`` where the graph tensor ``t`` is a noted output (``noted``: entries
    by ``tensor.ref()``) or a ``Cast`` or ``Identity`` of one, up to two: the entry and the ops
    from the noted output to ``t``; else None.

    >>> import tensorflow as tf
    >>> with tf.Graph().as_default():
    ...     x = tf.constant(1.0)
    ...     y = tf.identity(tf.cast(x, tf.float16))
    ...     entry, between = noted_through(y, {x.ref(): "noted"})
    >>> entry, [op.type for op in between]
    ('noted', ['Cast', 'Identity'])
    """
    between: list[Any] = []
    for _ in range(3):
        entry = noted.get(t.ref())
        if entry is not None:
            return entry, tuple(reversed(between))
        if t.op.type not in THROUGH:
            return None
        between.append(t.op)
        t = t.op.inputs[0]
    return None


def _routed(chain: list[tuple[Family, Hook]]) -> Callable[[Any], Any]:
    """The patch of one method that ``chain``'s hooks route (in registration order), run
    highest ``outer`` first, then in that order: each handler runs where its stage is on in
    the active trace, with the rest of the chain (then the method itself) as its
    ``original``; a stage that is off passes the call on."""
    ordered = sorted(chain, key=lambda pair: -pair[1].outer)  # stable

    def make(original: Any) -> Any:
        method, first = original, _first_parameter(original)
        for stage, hook in reversed(ordered):
            method = _link(stage, hook, method, first)
        method.__wrapped__ = original
        method.__doc__ = getattr(original, "__doc__", None)
        method.__name__ = getattr(original, "__name__", ordered[0][1].attribute)
        return method

    return make


def _first_parameter(function: Any) -> str | None:
    """The name of ``function``'s first parameter where a caller may pass it by keyword (a
    module function's, as ``query`` of ``nn.dot_product_attention``), else None.

    >>> _first_parameter(lambda query, key: None)
    'query'
    >>> _first_parameter(lambda *args: None) is None
    True
    """
    import inspect

    try:
        first = next(iter(inspect.signature(function).parameters.values()), None)
    except (TypeError, ValueError):
        return None
    either = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return first.name if first is not None and first.kind == either else None


def _link(stage: Family, hook: Hook, following: Callable[..., Any],
          first: str | None = None) -> Callable[..., Any]:
    """One hook of a chain: ``following`` called with the instance (or a routed function's
    first argument, ``first`` by name, also when the caller passes it by keyword) first."""
    def method(*args: Any, **kwargs: Any) -> Any:
        if not args and first is not None and first in kwargs:
            args = (kwargs.pop(first),)
        if not args:  # no first argument: the method's own error
            return following(**kwargs)
        self, args = args[0], args[1:]
        ctx = active()
        if ctx is None or not ctx.wants(stage.name) or (
                hook.when is not None and not hook.when(self, *args, **kwargs)):
            return following(self, *args, **kwargs)
        return transaction(ctx, stage.name, hook.handler, following, self, args, kwargs)

    return method


def install() -> list[str]:
    """Patch every registered stage's hooks (idempotent; ``uninstall`` puts them back): one
    patch per method, the hooks of several stages on it chained (:class:`Hook`'s ``outer``).
    A method the installed Keras does not have where a hook names it (another Keras version)
    is left alone: the families hooking it run Keras's calls. Returns those, as
    ``"family: module:Class.method"``. Hooks of a package besides Keras that the process has
    not imported wait for it (:meth:`Hook.waiting`): called again once it is, this installs
    them (the hooks already in place stay as they are).

    >>> install()  # every built-in hook's method is in this Keras
    []
    >>> uninstall()
    """
    chains: dict[tuple[str, str], list[tuple[Family, Hook]]] = {}
    for stage in stages():
        for hook in stage.hooks:
            chains.setdefault((hook.owner, hook.attribute), []).append((stage, hook))
    missing = []
    for (owner, attribute), chain in chains.items():
        if chain[0][1].waiting():
            continue
        try:
            cls = chain[0][1].owner_class()
            getattr(cls, attribute)
        except (ImportError, AttributeError, ValueError):
            missing += [f"{stage.name}: {owner}.{attribute}" for stage, _ in chain]
            continue
        patches.install(GROUP, cls, attribute, _routed(chain))
    return missing


def uninstall() -> None:
    """Restore the methods :func:`install` patched."""
    patches.uninstall(GROUP)


# -- transactions ------------------------------------------------------------------------------
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
    attempt_ctx = dataclasses.replace(ctx, record=lambda f, stats: recorded.append((f, stats)))
    attempt = Attempt()
    try:
        with tracing(attempt_ctx), attempt:
            out = handler(attempt_ctx, following, instance, *args, **kwargs)
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
    tensor as the call's first tensor (a merge layer's first input, where the call takes a flat
    list of tensors), and none takes a sparse or ragged one anywhere.

    >>> import tensorflow as tf
    >>> unsupported_inputs((object(), tf.ones([2, 2])), {}) is None
    True
    >>> unsupported_inputs((object(), tf.sparse.eye(2)), {})
    'a SparseTensor input'
    >>> unsupported_inputs((object(), tf.ones([2], tf.int32)), {})
    'an int32 input'
    >>> unsupported_inputs((object(), {"a": tf.ones([2])}), {})
    'a dict input (nested)'
    >>> unsupported_inputs((object(), [tf.ones([2]), tf.ones([2])]), {}) is None  # a Multiply's
    True
    >>> unsupported_inputs((object(), [tf.ones([2]), [tf.ones([2])]]), {})
    'a list input (nested)'
    """
    import tensorflow as tf

    for value in tf.nest.flatten((args, kwargs), expand_composites=False):
        if isinstance(value, (tf.SparseTensor, tf.RaggedTensor, tf.IndexedSlices)):
            return f"a {type(value).__name__} input"
    rest = list(args if tf.is_tensor(args[0]) else args[1:]) or list(kwargs.values())
    first = rest[0] if rest else None
    if isinstance(first, (list, tuple)) and first and all(tf.is_tensor(v) for v in first):
        first = first[0]  # a merge layer's inputs: a flat list of tensors
    if isinstance(first, (dict, list, tuple)):
        return f"a {type(first).__name__} input (nested)"
    if first is None or not tf.is_tensor(first):
        return f"a {type(first).__name__} input, not a tensor"
    dtype = tf.as_dtype(first.dtype)
    if not dtype.is_floating:
        return f"an {dtype.name} input" if dtype.name[0] in "aeiou" else f"a {dtype.name} input"
    return None


__all__ = [  # the stage API: hooks and their flow here, the context and the forms re-exported
    "GROUP", "XLA", "XLA_CALLS", "CallSite", "Emitted", "Hook", "StageContext", "active",
    "autocast", "autocast_dtype", "custom_gradient",
    "THROUGH", "functional_neighbours", "install", "integer_rounding", "layer_value",
    "noted_call", "noted_through", "recording", "rewrite_call",
    "stages", "timed_form", "tracing", "transaction", "uninstall", "unsupported_inputs",
    "widened", "with_xla", "xla_region",
]
