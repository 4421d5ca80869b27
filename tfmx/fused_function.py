"""``tfmx.function``: a drop-in for ``tf.function`` whose traced graphs are rewritten.

Each input signature is traced by an ordinary ``tf.function`` (same caching, same retracing
rules); the traced graph is rewritten once by :func:`fusion.rewrite` and rebuilt into a
ConcreteFunction with the same signature, captures and control outputs. Calls then go to the
rewritten function. When tfmx is disabled, when a gradient tape watches the call (fused ops
have no gradient), or when the rewrite fails, the stock traced function runs. A call whose
arguments are eager tensors and Python scalars (:func:`call_key`) finds its rewritten function
by their dtypes, shapes and values, without tf.function's per-call lookup, which hashes every
captured tensor; the first call of each key, and every other call, goes through that lookup.

Example:
    >>> import tensorflow as tf, tfmx
    >>> w, b = tf.Variable(tf.ones([3, 2])), tf.Variable(tf.zeros([2]))
    >>> @tfmx.function
    ... def layer(x):
    ...     return tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w), b))
    >>> tfmx.enable(backend="cpu")
    >>> layer(tf.ones([1, 3])).numpy().tolist()
    [[3.0, 3.0]]
    >>> from fusion.graph import op_histogram
    >>> op_histogram(layer.get_concrete_function(tf.TensorSpec([1, 3])).graph.as_graph_def())[
    ...     "_FusedMatMul"]
    1
    >>> tfmx.disable()
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from collections.abc import Callable
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import context, record
from tensorflow.python.framework.ops import EagerTensor
from tensorflow.python.util import tf_decorator

from fusion.graph import op_histogram
from fusion.transaction import abandoned, superseded, without_abandoned
from tfmx import background_trace, guard, staging, state, xla_support
from tfmx.errors import BackendUnavailableError
from tfmx.rebuild import rebuild
from tfmx.reporting import TraceRecord
from tfmx.rewriting import rewrite_traced
from tfmx.verify import FALLBACK, disagreed, verified_call

_SIMPLE = (bool, int, float, str, type(None))
_FAST_CACHE_SIZE = 64


class _Unkeyed(Exception):
    """An argument only tf.function's own lookup can key."""


def _signature(value: Any) -> Any:
    if type(value) is EagerTensor:
        return (value.dtype, tuple(value.shape))
    if type(value) in _SIMPLE:
        return (type(value), value)
    if type(value) in (tuple, list):
        return (type(value), tuple(_signature(v) for v in value))
    if type(value) is dict and all(type(k) is str for k in value):
        return (dict, tuple((k, _signature(value[k])) for k in sorted(value)))
    raise _Unkeyed


def call_key(args: tuple, kwargs: dict) -> tuple | None:
    """A cheap key for a call whose arguments are eager tensors (by dtype and shape), Python
    scalars and strings (by value) in tuples, lists and dicts; None for anything else (a
    variable, a composite tensor, an object, a call inside a graph or a distribution
    strategy), which tf.function's own lookup then keys.

    >>> import tensorflow as tf
    >>> call_key((tf.ones([2, 3]), 1), {}) == call_key((tf.zeros([2, 3]), 1), {})
    True
    >>> call_key((tf.ones([2, 3]), 2), {}) == call_key((tf.ones([2, 3]), 1), {})
    False
    >>> call_key((tf.Variable(1.0),), {}) is None
    True
    """
    if not tf.executing_eagerly() or tf.distribute.has_strategy():
        return None
    try:
        return (context.context().device_name, _signature(args), _signature(kwargs))
    except _Unkeyed:
        return None


@dataclasses.dataclass
class _Entry:
    stock: Any  # the traced ConcreteFunction (with the pre-differentiation stages)
    fused: Any  # the rewritten ConcreteFunction, or the stock one when not rewritten
    plan_only: bool = False
    record: TraceRecord | None = None
    verify_flag: tf.Variable | None = None
    # verify=True: the function traced with no tfmx stage at all, what the fused step is
    # checked against (the forward stages fuse batch norms and LSTM/GRU before ``stock``).
    # The whole-step guard times the fused step against it.
    reference: Any = None
    staged: bool = False  # a pre-differentiation stage fused something in ``stock``
    guard: guard.StepGuard | None = None  # eager calls: fused vs reference on the first steps
    price_key: str = ""  # the step's price record (tfmx.guard.price_gate), "" where none
    gated: bool = False  # the price gate runs it as stock: no stage, no rewrite
    gated_ops: dict[str, int] = dataclasses.field(default_factory=dict)  # its ops, if gated
    replicas: int | None = None  # the devices its graph places nodes on (see _replicas)
    deferred: int = 0  # the tuner's decisions in it left unmeasured (its budget spent)

    @property
    def signature(self) -> str:
        """A digest of what this step is: its ops before and after the rewrite, the traced
        inputs' shapes; equal for the same script on the same machine, a key for the guard."""
        if self.record is None:
            return ""
        parts = [sorted(self.record.ops_before.items()), sorted(self.record.ops_after.items()),
                 str(self.stock.structured_input_signature), self.staged]
        return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]

    @property
    def stock_ops(self) -> dict[str, int]:
        """The ops of the traced step before the rewrite: op type -> count."""
        return (dict(self.record.ops_before) if self.record is not None
                else dict(self.gated_ops))

    @property
    def changed(self) -> bool:
        """True if what runs differs from what TensorFlow alone would run."""
        return self.staged or self.fused is not self.stock


class FusedFunction:
    """A ``tf.function`` whose every trace runs through the tfmx rewrite (see module doc)."""

    def __init__(
        self,
        python_function: Callable,
        *,
        name: str | None = None,
        input_signature: Any = None,
        autograph: bool = True,
        reduce_retracing: bool = False,
        jit_compile: bool | None = None,
        prepare: Callable[[tuple, dict], None] | None = None,
        price_key: Callable[[tuple, dict], str] | None = None,
    ) -> None:
        self.python_function = python_function
        self.name = name or getattr(python_function, "__name__", "function")
        self._trace_options = {"input_signature": input_signature, "autograph": autograph,
                               "reduce_retracing": reduce_retracing}
        self._jit = bool(jit_compile)
        self._prepare = prepare
        # a fit's train step: what it is before it is traced, the key of its price record
        # (tfmx.guard.price_gate decides from it whether rewriting it pays within the fit)
        self._price_key = price_key
        self._stock = tf.function(self._counted(python_function, "stock"),
                                  jit_compile=jit_compile, **self._trace_options)
        # The same function, traced with the stages on (fusion.stage, tfmx.staging).
        self._staged = tf.function(staging.staged(self._counted(python_function, "stages")),
                                   jit_compile=jit_compile, **self._trace_options)
        # The same, for calls under an outer tape: traced apart, because a call under a tape
        # changes the traced function (TensorFlow adds the outputs its gradient needs), which
        # the rewrite of the plain call must not see.
        self._taped = tf.function(staging.staged(self._counted(python_function, "taped")),
                                  jit_compile=jit_compile, **self._trace_options)
        self._xla_function: Any = None
        self._entries: dict[tuple[int, int], _Entry] = {}
        # call_key -> entry: skips tf.function's per-call lookup, which hashes every captured
        # tensor (about a millisecond per call for a model with a few hundred variables).
        self._fast: dict[tuple, _Entry] | None = {}
        functools.update_wrapper(self, python_function)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        """Bind like a method when used as a decorator inside a class."""
        if instance is None:
            return self
        bound = FusedFunction.__new__(FusedFunction)
        bound.__dict__.update(self.__dict__)
        bound._stock = self._stock.__get__(instance, owner)
        bound._staged = self._staged.__get__(instance, owner)
        bound._taped = self._taped.__get__(instance, owner)
        bound._xla_function = self._xla().__get__(instance, owner)
        bound._entries = self._entries
        bound._fast = None  # the bound object is new per attribute access: no fast path
        return bound

    # -- public ------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        opts = state.options()
        forced = guard.forced_form()  # a whole-step guard traces Keras's loop in another form
        if forced == "xla":
            xla = self._xla()
            if opts is not None and not tf.executing_eagerly():  # traced into Keras's loop:
                # ops XLA cannot take fail here, before the loop has taken a batch
                xla_support.check_compilable(xla.get_concrete_function(*args, **kwargs),
                                             opts.backend.name)
            return xla(*args, **kwargs)
        if forced == "stock":
            if opts is None or self._jit:
                return self._stock(*args, **kwargs)
            entry = self._entry(opts, args, kwargs)
            return self._reference(entry, args, kwargs)(*args, **kwargs)
        if opts is None or self._jit or record.could_possibly_record():
            if opts is not None and self._jit:
                state.report().note(f"{self.name}: jit_compile=True, left to XLA")
            elif opts is not None and opts.backend.available:
                # Under an outer tape: only the stages (batch norm, rnn), whose fused forms
                # have registered gradients, traced as _entry traces them, so the trace is
                # the same whichever path came first.
                staging.commit(self._taped.get_concrete_function(*args, **kwargs).graph)
                return self._taped(*args, **kwargs)
            return self._stock(*args, **kwargs)
        # forced "fused": the loop's dispatcher traces tfmx's form after the step ran as stock
        # (the price gate's first verdict): the gate has been asked again, do not ask it here
        ungated = forced == "fused"
        key = None if self._fast is None or ungated else call_key(args, kwargs)
        if key is not None:
            key = (state.generation(), *key)
        entry = self._fast.get(key) if key is not None else None
        if entry is None:
            entry = self._entry(opts, args, kwargs, ungated=ungated)
            if key is not None:
                if len(self._fast) >= _FAST_CACHE_SIZE:
                    self._fast.clear()
                self._fast[key] = entry
        if entry.plan_only:
            raise BackendUnavailableError(
                f"tfmx rewrote {self.name!r} for backend {opts.backend.name!r}, which this "
                "machine does not have, so it cannot run. Inspect the plan with "
                "tfmx.report() / tfmx.report().export_graphs(logdir), or call "
                "tfmx.enable() without backend= to train on this machine."
            )
        if opts.verify:
            if opts.verify == FALLBACK:  # the guard still judges the (checked) fused step
                guard.embedded(entry.changed, entry.stock_ops, entry.signature)
            out = verified_call(entry, args, kwargs, opts, self.name,
                                self._reference(entry, args, kwargs))
            if opts.verify == FALLBACK and tf.executing_eagerly() and disagreed(entry):
                state.warn_once(f"verify:{self.name}", f"tfmx: the fused {self.name!r} "
                                "disagreed with the stock step on its first call; it runs "
                                "stock from now on")
            return out
        if opts.guard and entry.changed and tf.executing_eagerly() and not state.multi_worker():
            if entry.guard is None:  # called eagerly (a custom loop, predict): a trial
                entry.guard = guard.make_guard(self.name, opts, entry.stock_ops,
                                               entry.signature, state.tuning_cache(),
                                               replicas=_replicas(entry))
                state.report().add_guard(entry.guard)
            functions = {"fused": lambda: entry.fused,  # each form's function, got when needed
                         "stock": lambda: self._reference(entry, args, kwargs),
                         "xla": self._xla}
            if entry.guard.decided:  # the per-call path after the trial
                return functions[entry.guard.kept]()(*args, **kwargs)
            return entry.guard.run({name: lambda get=get: get()(*args, **kwargs)
                                    for name, get in functions.items()})
        guard.embedded(entry.changed, entry.stock_ops, entry.signature, entry.price_key,
                       entry.gated, _replicas(entry), entry.deferred)
        return entry.fused(*args, **kwargs)

    def _xla(self) -> Any:
        """The Python function compiled by XLA (``jit_compile=True``), made on first need:
        the guard's third form."""
        if self._xla_function is None:
            self._xla_function = tf.function(self._counted(self.python_function, "xla"),
                                             jit_compile=True, **self._trace_options)
        return self._xla_function

    def _counted(self, fn: Callable, form: str) -> Callable:
        """``fn``, each trace of it counted in the report as one of ``form``."""

        def traced(*args: Any, **kwargs: Any) -> Any:
            state.report().count_trace(self.name, form)
            return fn(*args, **kwargs)

        return tf_decorator.make_decorator(fn, traced)

    def _reference(self, entry: _Entry, args: tuple, kwargs: dict) -> Any:
        """The function traced with no tfmx stage and no rewrite: the staged trace itself when
        no stage changed it, else traced on first need."""
        if entry.reference is None:
            entry.reference = (entry.stock if not entry.staged
                               else self._stock.get_concrete_function(*args, **kwargs))
        return entry.reference

    def get_concrete_function(self, *args: Any, **kwargs: Any) -> Any:
        """The ConcreteFunction that runs for these arguments (rewritten when tfmx is on)."""
        opts = state.options()
        if opts is None or self._jit:
            return self._stock.get_concrete_function(*args, **kwargs)
        return self._entry(opts, args, kwargs).fused

    def form_function(self, form: str, *args: Any, **kwargs: Any) -> Any:
        """The ConcreteFunction that runs this function in ``form`` (``"fused"``, ``"stock"``,
        ``"xla"``) for these arguments, traced as a call traced into Keras's step loop traces
        it (the price gate asked for tfmx's form unless :func:`tfmx.guard.forcing` asks for
        it; what tfmx made of it said to :func:`tfmx.guard.collecting`), to be called directly
        (:mod:`tfmx.one_step`)."""
        opts = state.options()
        if form == "xla":
            concrete = self._xla().get_concrete_function(*args, **kwargs)
            if opts is not None:  # ops XLA cannot take fail here, before the call runs
                xla_support.check_compilable(concrete, opts.backend.name)
            return concrete
        if opts is None or self._jit:
            return self._stock.get_concrete_function(*args, **kwargs)
        entry = self._entry(opts, args, kwargs, ungated=guard.forced_form() == "fused")
        if form == "stock":
            return self._reference(entry, args, kwargs)
        if entry.plan_only:
            raise BackendUnavailableError(
                f"tfmx rewrote {self.name!r} for backend {opts.backend.name!r}, which this "
                "machine does not have, so it cannot run")
        guard.embedded(entry.changed, entry.stock_ops, entry.signature, entry.price_key,
                       entry.gated, _replicas(entry), entry.deferred)
        return entry.fused

    def gated(self, concrete: Any) -> bool:
        """Whether ``concrete`` (from :meth:`form_function`) is the step the price gate runs as
        stock."""
        return any(e.gated and e.fused is concrete for e in self._entries.values())

    def concrete_functions(self) -> list[Any]:
        """Every ConcreteFunction this function runs: the rewritten ones and, where none was
        rewritten (tfmx off, a trace that could not be rewritten), the traced ones."""
        entries = list(self._entries.values())
        seen = {id(e.stock) for e in entries}
        stock = [c for c in self._stock._list_all_concrete_functions() if id(c) not in seen]
        return [e.fused for e in entries] + stock

    _list_all_concrete_functions = concrete_functions  # what tf.function introspection calls

    def stock_concrete_function(self, *args: Any, **kwargs: Any) -> Any:
        """The ConcreteFunction tf.function traced, before any rewrite."""
        return self._stock.get_concrete_function(*args, **kwargs)

    # -- internals ---------------------------------------------------------------------------
    def _entry(self, opts: state.Options, args: tuple, kwargs: dict,
               ungated: bool = False) -> _Entry:
        with background_trace.waiting():  # a trace of this thread's fit beside it ends first
            return self._traced_entry(opts, args, kwargs, ungated)

    def _traced_entry(self, opts: state.Options, args: tuple, kwargs: dict,
                      ungated: bool) -> _Entry:
        if self._prepare is not None:  # once, before the first trace
            prepare, self._prepare = self._prepare, None
            try:
                prepare(args, kwargs)
            except Exception as exc:  # noqa: BLE001 - the step builds what it needs itself
                state.report().note(f"{self.name}: not prepared before its first trace "
                                    f"({type(exc).__name__}: {exc}); it builds what it needs "
                                    "while traced, as Keras does")
        price_key, verdict = self._gate(opts, args, kwargs, ungated)
        if verdict is not None and verdict.run == "stock":
            return self._gated_entry(opts, price_key, args, kwargs)
        tuner = state.tuner() if opts.backend.available else None
        spent, deferred = getattr(tuner, "spent", 0.0), getattr(tuner, "deferred", 0)
        start = time.perf_counter()
        concrete = self._staged.get_concrete_function(*args, **kwargs)  # stages on
        key = (id(concrete), state.generation())
        entry = self._entries.get(key)
        if entry is None or entry.stock is not concrete:
            traced = time.perf_counter() - start
            staged = staging.commit(concrete.graph) > 0  # what the stages rewrote in it
            entry = build_entry(concrete, opts, self.name)
            entry.staged = staged
            entry.price_key = price_key
            entry.deferred = getattr(tuner, "deferred", 0) - deferred
            if entry.record is not None:  # the price of this trace, as the report shows it
                entry.record.trace_seconds = traced
                entry.record.tune_seconds = getattr(tuner, "spent", 0.0) - spent
            if entry.plan_only and opts.backend.name == "metal" and entry.record is not None:
                try:  # stock, beside the plan: the report's placement audit compares them
                    entry.record.graph_stock = self._reference(
                        entry, args, kwargs).graph.as_graph_def(add_shapes=True)
                except Exception:  # noqa: BLE001 - the audit then takes the traced form
                    pass
            self._entries = {k: v for k, v in self._entries.items() if k[1] == key[1]}
            self._entries[key] = entry
        return entry

    def _gate(self, opts: state.Options, args: tuple, kwargs: dict, ungated: bool = False
              ) -> tuple[str, guard.GateDecision | None]:
        """A fit's train step under the guard: its price key and the price gate's verdict
        (:func:`tfmx.guard.price_gate`), said in the report; ("", None) elsewhere, and where
        the gate was asked already (``ungated``: the loop traces tfmx's form mid-fit)."""
        if self._price_key is None or not opts.guard or not opts.backend.available:
            return "", None
        plan = guard.active_plan()
        if plan is None or not plan.calls:
            return "", None
        key = self._price_key(args, kwargs)
        cache = state.tuning_cache()
        figures = guard.price_figures(key, cache)
        known = [figures[k] / 1e3 for k in ("fused_ms", "stock_ms") if figures.get(k)]
        tuner = state.tuner()
        if tuner is not None and known and plan.steps:  # the tuner's share sizes on it
            step = min(known) * plan.calls / plan.steps
            tuner.step_hint = lambda: step
        fits = guard.fits_before(key, plan.serial, cache)  # this fit counted
        if tuner is not None:  # measuring serves the fits expected after this one too
            tuner.returning = (plan.serial, fits)
        if ungated:
            return key, None
        verdict = guard.price_gate(figures, plan.calls, guard.budget_share(), cache,
                                   switchable=guard.switchable())
        state.report().note(verdict.describe(self.name))
        state.report().gates[self.name] = verdict.headline(plan.calls)
        guard.expect_first_call(key, verdict)  # its error reported once the call is timed
        return key, verdict

    def _gated_entry(self, opts: state.Options, price_key: str, args: tuple,
                     kwargs: dict) -> _Entry:
        """The step as TensorFlow alone traces it (no stage, no rewrite): the price gate's
        verdict where rewriting it would not pay within the fit."""
        concrete = self._stock.get_concrete_function(*args, **kwargs)
        key = (id(concrete), state.generation())
        entry = self._entries.get(key)
        if entry is None or entry.stock is not concrete:
            state.report().add_trace(TraceRecord(function=self.name, backend=opts.backend.name,
                                                 status="stock: price gate"))
            entry = _Entry(stock=concrete, fused=concrete, price_key=price_key, gated=True,
                           gated_ops=op_histogram(concrete.graph.as_graph_def()))
            self._entries[key] = entry
        return entry


def _replicas(entry: _Entry) -> int:
    """The replicas a traced step runs in: the devices its graph places nodes on (a step that
    runs ``strategy.run``, as Keras's do under a ``tf.distribute`` strategy), at least 1;
    counted once per entry."""
    if entry.replicas is None:
        graph_def = (entry.record.graph_before if entry.record is not None
                     and entry.record.graph_before is not None
                     else entry.stock.graph.as_graph_def())
        devices = {tf.DeviceSpec.from_string(n.device).replace(job=None, replica=None, task=None)
                   .to_string() for n in graph_def.node if n.device}
        entry.replicas = max(1, len(devices))
    return entry.replicas


def build_entry(concrete: Any, opts: state.Options, name: str) -> _Entry:
    """Rewrite one traced function for ``opts``; never raises for a failed rewrite."""
    start = time.perf_counter()
    graph_def = concrete.graph.as_graph_def(add_shapes=True)
    rec = TraceRecord(function=name, backend=opts.backend.name, status="unchanged",
                      nodes_before=len(graph_def.node), graph_before=graph_def)
    rec.ops_before = op_histogram(graph_def)
    stats = None
    entry = _Entry(stock=concrete, fused=concrete, record=rec)
    # what stages that failed while tracing emitted, and the ops a stage took over from an
    # earlier call: taken out, so that none of it runs
    graph_def, dropped = without_abandoned(
        graph_def, abandoned(concrete.graph) | superseded(concrete.graph))
    try:
        result = rewrite_traced(concrete, opts, graph_def)
        stats = result.stats
        rec.errors.extend(result.errors)
        for fname, why in result.skipped_functions.items():
            rec.errors.append(f"function {fname} left as it was: {why}")
        rec.graph_after = result.graph_def
        rec.ops_after = op_histogram(result.graph_def)
        rec.nodes_after = len(result.graph_def.node)
        if not opts.backend.available:
            entry.plan_only = True
            rec.status = "plan only"
        elif result.changed or dropped:
            entry.fused = rebuild(concrete, result.graph_def, result.control_renames)
            rec.status = "rewritten"
    except Exception as exc:  # noqa: BLE001 - never break training because of tfmx
        rec.status = "stock: rewrite failed"
        rec.errors.append(f"{type(exc).__name__}: {exc}")
        rec.graph_after = graph_def
        rec.ops_after = rec.ops_before
        rec.nodes_after = rec.nodes_before
        entry.fused = concrete
        state.warn_once(
            f"rebuild:{name}:{type(exc).__name__}",
            f"tfmx could not rewrite {name!r} ({type(exc).__name__}: {exc}); it runs unfused. "
            "tfmx.report() has the details.",
        )
    for err in rec.errors if entry.fused is not concrete or rec.status == "unchanged" else ():
        state.warn_once(f"err:{err}", f"tfmx left part of {name!r} unfused: {err}")
    if rec.status == "unchanged":
        rec.ops_after, rec.nodes_after = rec.ops_before, rec.nodes_before
        rec.graph_after = rec.graph_after or graph_def
    rec.seconds = time.perf_counter() - start
    state.report().add_trace(rec, stats)
    return entry


def function(
    func: Callable | None = None,
    *,
    input_signature: Any = None,
    autograph: bool = True,
    reduce_retracing: bool = False,
    jit_compile: bool | None = None,
) -> Any:
    """Drop-in for ``tf.function``: the traced graph gets the tfmx rewrite when enabled.

    Usable bare (``@tfmx.function``) or with arguments (``@tfmx.function(reduce_retracing=True)``).
    ``jit_compile=True`` is passed to XLA untouched (tfmx does not rewrite XLA clusters).

    Args:
        func: the Python function to trace; None (called with arguments only) returns a
            decorator.
        input_signature: as ``tf.function``'s: the ``tf.TensorSpec`` of each argument, which
            fixes the one trace (and so the one rewrite) every call uses.
        autograph: as ``tf.function``'s: Python control flow on tensors becomes graph ops.
        reduce_retracing: as ``tf.function``'s: generalize shapes to trace (and rewrite) less.
        jit_compile: as ``tf.function``'s; True leaves the function to XLA, unrewritten.

    Returns:
        A :class:`FusedFunction`, or a decorator making one when ``func`` is None.

    >>> import tensorflow as tf, tfmx
    >>> @tfmx.function(reduce_retracing=True)
    ... def double(x):
    ...     return x * 2.0
    >>> float(double(tf.constant(2.0)))
    4.0
    """

    def wrap(fn: Callable) -> FusedFunction:
        return FusedFunction(
            fn,
            input_signature=input_signature,
            autograph=autograph,
            reduce_retracing=reduce_retracing,
            jit_compile=jit_compile,
        )

    return wrap(func) if func is not None else wrap
