"""Calling Keras's step loop through its traced function, without ``tf.function``'s per-call work.

``model.fit`` calls ``train_function(iterator)`` once per step; inside, Keras calls a
``tf.function`` (``multi_step_on_iterator``) with the data iterator. On every call that
``tf.function`` binds the argument again, builds the call's function type and looks it up in its
cache, hashing every tensor the function captured: every model variable and optimizer slot.
For a model with a few hundred captured handles (the benchmark's MLP) that costs as much as
a small step's whole graph after tfmx's rewrite.
:class:`IteratorDispatch` does the lookup once per iterator type: the first call of each goes
through the ``tf.function`` (tracing, variable creation,
retracing rules all TensorFlow's), later calls go to the ConcreteFunction that call ran. It
steps aside (calls the ``tf.function``) for anything but an eager call with one ``tf.data``
iterator or one distributed iterator of a strategy within this process (MirroredStrategy):
the distributed iterators of several workers, extra arguments,
``tf.config.run_functions_eagerly(True)``, calls inside a graph.

It is also where the whole-step guard (:mod:`tfmx.guard`) runs for ``fit`` and ``evaluate``:
when the traced loop embeds a step tfmx changed, the same loop is traced again with tfmx's step
functions in another form (stock; XLA-compiled), each a twin ``tf.function`` from ``twin``, and
the ConcreteFunctions alternate on the first real steps until the guard keeps one.
With ``steps_per_execution`` > 1 each call runs that many steps: the guard compares calls.

Example:
    >>> import tensorflow as tf
    >>> from tfmx.dispatch import IteratorDispatch
    >>> total = tf.Variable(0.0)
    >>> @tf.function
    ... def step(iterator):
    ...     return total.assign_add(iterator.get_next())
    >>> fast = IteratorDispatch(step)
    >>> it = iter(tf.data.Dataset.from_tensor_slices([1.0, 2.0, 3.0]))
    >>> [float(fast(it)) for _ in range(3)]
    [1.0, 3.0, 6.0]
    >>> step.experimental_get_tracing_count()
    1
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import tensorflow as tf
from tensorflow.python.data.ops import iterator_ops
from tensorflow.python.distribute import input_lib

from tfmx import background_trace, guard, state, xla_support
from tfmx.first_call import learn_first_call_ratio

try:  # TensorFlow's count of a tf.function's calls and traces (its retracing warning)
    from tensorflow.python.eager.polymorphic_function.polymorphic_function import (
        _frequent_tracing_detector_manager as _TRACING_DETECTOR,
    )
except ImportError:  # another TensorFlow: its warning counts what it sees
    _TRACING_DETECTOR = None


def _called_without_tracing(function: Any) -> None:
    """Count a call of the ``tf.function`` ``function`` served without it (its ConcreteFunction
    called directly) as TensorFlow counts a call that did not trace: its warning of frequent
    retracing (5 traces within 10 calls of one Python function) then sees the calls as it
    would without tfmx, and does not take a step loop's traces in a process's successive fits
    for retracing."""
    key = getattr(function, "_key_for_call_stats", None)
    if key is None or _TRACING_DETECTOR is None:
        return
    try:
        _TRACING_DETECTOR.called_without_tracing(key)
    except Exception:  # noqa: BLE001 - a count for a warning never fails a call
        pass


def _dispatchable(iterator: Any) -> bool:
    """A ``tf.data`` iterator, or a distributed iterator of a strategy whose replicas are all
    in this process (MirroredStrategy): one call runs every replica, so this process alone
    picks the form. Not across several workers, which must all run the same step."""
    if isinstance(iterator, iterator_ops.OwnedIterator):
        return True
    return isinstance(iterator, input_lib.DistributedIterator) and not state.multi_worker()


WATCHED_CALLS = 5
"""Calls of a step the price gate ran as stock that are timed (with its first) for its price
record (:func:`tfmx.guard.learn_price`): the gate is then asked again for the calls left of
the fit (and at the start of each later fit), and the next fits decide from them."""


def _tuning_spent() -> float:
    """The seconds this process's tuner spent measuring so far (0 without one)."""
    return float(getattr(state.tuner(), "spent", 0.0) or 0.0)


def _price_key(embedded: list[guard.Embedded]) -> str:
    """The price record's key of a loop's step (a step traced twice into it counts once)."""
    return "+".join(dict.fromkeys(e.price_key for e in embedded if e.price_key))


@dataclasses.dataclass
class _Watch:
    """A step the price gate ran as stock: its first call and its next calls, timed; the
    calls of the fit under way (``serial``), and the fit the gate was last asked for."""

    price_key: str
    first_s: float
    ops: int = 0
    serial: int | None = None
    calls: int = 1
    samples: list[float] = dataclasses.field(default_factory=list)
    asked: int | None = None
    switch: bool = False  # the gate said tfmx: its form is traced on the next call
    background: Any = None  # tfmx's form traced beside the stock calls (BackgroundTrace)
    tuned: float = 0.0  # the tuner's seconds spent measuring when that trace started
    beside: list[float] = dataclasses.field(default_factory=list)  # those calls, timed


@dataclasses.dataclass
class _Slot:
    """One iterator type: its traced loop per form ("fused" first), and its guard."""

    forms: dict[str, Any]
    guard: guard.StepGuard | None = None
    watch: _Watch | None = None
    followed: list[float] | None = dataclasses.field(default_factory=list)  # see _followed
    first_s: float = 0.0  # its first call (tracing it), seconds
    steps: dict[tuple[str, int], Any] = dataclasses.field(default_factory=dict)  # tfmx.step_loop


class IteratorDispatch:
    """``function(iterator)`` for a ``tf.function`` of one ``tf.data`` iterator, looked up once
    per iterator type (see the module doc). Other attributes are the wrapped function's."""

    def __init__(self, function: Any, twin: Callable[[], Any] | None = None,
                 make_guard: Callable[[Any, str, int], guard.StepGuard | None] | None = None,
                 name: str = "") -> None:
        self._function = function
        self._name = name or getattr(function, "__name__", "step")
        self._twin = twin
        self._make_guard = make_guard
        self._twins: dict[str, Any] = {}  # form -> its tf.function
        self._slots: dict[Any, _Slot] = {}
        self._loop: Any = None  # a fit's tfmx.step_loop.StepLoop while it runs
        self._loop_memory: dict[tuple[str, int], Any] = {}  # what the step loops chose

    def __getattr__(self, name: str) -> Any:
        return getattr(self._function, name)

    def __call__(self, iterator: Any, *args: Any, **kwargs: Any) -> Any:
        if (args or kwargs or not _dispatchable(iterator)
                or not tf.executing_eagerly() or tf.config.functions_run_eagerly()):
            return self._function(iterator, *args, **kwargs)
        if iterator._type_spec in self._slots:  # not through the tf.function: counted as if
            _called_without_tracing(self._function)
        if self._loop is not None:  # several steps a call, where a fit's loop chose it
            return self._loop.call(self, iterator)
        return self._call(iterator)

    def _call(self, iterator: Any) -> Any:
        """One call of the loop for a dispatchable ``iterator`` (see the module doc)."""
        spec = iterator._type_spec
        slot = self._slots.get(spec)
        if slot is None:
            start, tuned = time.perf_counter(), _tuning_spent()
            switchable = self._twin is not None and self._make_guard is not None
            with guard.collecting(switchable) as embedded:
                outputs, fused = self._first_call(iterator)
            slot = _Slot({"fused": fused})
            if any(e.changed for e in embedded) and self._twin is not None and self._make_guard:
                slot.guard = self._make_guard(sum((collections.Counter(e.ops) for e in embedded),
                                                  collections.Counter()),
                                              "+".join(e.signature for e in embedded),
                                              max(e.replicas for e in embedded))
                if slot.guard is not None:  # what tracing it cost: a seed of the other forms'
                    # (not the tuner's measuring: once per machine, its decisions now cached)
                    slot.guard.first_call_s = max(0.0, time.perf_counter() - start
                                                  - (_tuning_spent() - tuned))
                    slot.guard.price_key = _price_key(embedded)
                    slot.guard.deferred = sum(e.deferred for e in embedded)
                    guard.learn_first_call("fused", slot.guard.first_call_s, slot.guard.ops,
                                           state.tuning_cache())
                    self._estimated(slot.guard.price_key, slot.guard.first_call_s)
            elif embedded and all(e.gated for e in embedded):  # stock by the price gate
                plan = guard.active_plan()
                slot.watch = _Watch(_price_key(embedded), time.perf_counter() - start,
                                    sum(sum(e.ops.values()) for e in embedded),
                                    plan.serial if plan is not None else None)
            slot.first_s = time.perf_counter() - start
            self._slots[spec] = slot
            return outputs
        if slot.watch is not None:
            return self._watched(slot, iterator)
        if slot.guard is None:
            return slot.forms["fused"](iterator)
        if slot.guard.decided:  # the per-step path after the trial: one lookup
            form = slot.guard.kept
            if form in slot.forms:
                if form == "fused" and slot.followed is not None:
                    return self._followed(slot, iterator)
                return slot.forms[form](iterator)
            return self._trace_form(slot, form, iterator)  # e.g. a form a cached decision kept
        form = slot.guard.next_form()
        if form not in slot.forms:  # its first call
            return self._trace_form(slot, form, iterator)
        return slot.guard.run({name: functools.partial(concrete, iterator)
                               for name, concrete in slot.forms.items()})

    def _watched(self, slot: _Slot, iterator: Any) -> Any:
        """A call of a step the price gate ran as stock: timed until :data:`WATCHED_CALLS`
        are, then its price learnt and the gate asked again for the calls left of the fit
        (at the start of each later fit too); where it says tfmx, tfmx's form is traced on
        the next call (:meth:`_switch`)."""
        watch = slot.watch
        plan = guard.active_plan()
        serial = plan.serial if plan is not None else None
        if serial != watch.serial:  # a new fit: its calls counted afresh
            watch.serial, watch.calls = serial, 0
        watch.calls += 1
        if watch.switch:
            if watch.background is not None and not watch.background.ready():
                return self._beside(watch, slot.forms["fused"], iterator)
            return self._switch(slot, iterator)
        if len(watch.samples) >= WATCHED_CALLS:
            if watch.asked != serial:
                self._ask(watch, plan, iterator)
            return slot.forms["fused"](iterator)
        start = time.perf_counter()
        outputs = slot.forms["fused"](iterator)
        guard._sync(outputs)
        watch.samples.append(time.perf_counter() - start)
        if len(watch.samples) >= WATCHED_CALLS:
            cache = state.tuning_cache()
            guard.learn_price(watch.price_key, cache, stock_first_s=watch.first_s,
                              stock_ms=statistics.median(watch.samples) * 1e3,
                              ops=watch.ops or None)
            ops = int(guard.price_figures(watch.price_key, cache).get("ops", 0))
            if ops:  # the stock first call per op, as the guard learns it
                guard.learn_first_call("stock", watch.first_s, ops, cache)
            self._ask(watch, plan, iterator)
        return outputs

    def _ask(self, watch: _Watch, plan: Any, iterator: Any) -> None:
        """Ask the price gate again, stock's form traced and timed, whether tfmx's form pays
        for itself over the calls left of the fit (``plan``); said in the report. Where it
        does, tfmx's form is traced on a thread of its own while the stock calls go on
        (``tfmx.background_trace``), where the fit's thread holds nothing a worker would not
        see; else on the next call."""
        watch.asked = plan.serial if plan is not None else None
        if plan is None or not plan.calls or self._twin is None or self._make_guard is None:
            return
        left = plan.calls - watch.calls
        if left <= 0:
            return
        cache = state.tuning_cache()
        why_not = background_trace.why_not()
        verdict = guard.price_gate(guard.price_figures(watch.price_key, cache), left,
                                   guard.budget_share(), cache, traced=True,
                                   beside=not why_not)
        state.report().note(f"price gate, after {watch.calls} call(s) as stock: {self._name} "
                            f"ran as {verdict.run}: {verdict.why} (the {left} calls left)")
        state.report().gates[self._name] = verdict.headline(plan.calls)
        watch.switch = verdict.run == "tfmx"
        guard.expect_first_call(watch.price_key, verdict)
        if watch.switch and not why_not:
            watch.tuned = _tuning_spent()
            watch.background = background_trace.BackgroundTrace(
                functools.partial(self._traced_twin, "fused", iterator)).start()
        elif watch.switch:
            state.report().note(f"{self._name}: tfmx's form traced in the fit's thread "
                                f"({why_not})")

    def _beside(self, watch: _Watch, stock: Any, iterator: Any) -> Any:
        """A stock call while tfmx's form is traced beside it: timed (what the trace takes
        from the fit's steps is part of the price of trying it), never beside the tuner's
        measuring."""
        start = time.perf_counter()
        with background_trace.stepping():
            outputs = stock(iterator)
            guard._sync(outputs)
        watch.beside.append(time.perf_counter() - start)
        return outputs

    def _switch(self, slot: _Slot, iterator: Any) -> Any:
        """Trace Keras's loop with tfmx's step in its form, run it on this call, and let the
        guard's trial compare it with the stock form already running (its first call paid).
        Anything that fails leaves stock running (the report says why)."""
        watch, slot.watch = slot.watch, None
        background = watch.background if watch is not None else None
        stock = slot.forms["fused"]
        start = time.perf_counter()
        tuned = watch.tuned if background is not None else _tuning_spent()
        try:
            if background is not None:  # traced beside the stock calls: done by now
                concrete, embedded = background.take()
            else:
                concrete, embedded = self._traced_twin("fused", iterator)
        except Exception as exc:  # noqa: BLE001 - stock runs on
            state.report().note(f"{self._name}: tfmx's form could not be traced mid-fit "
                                f"({type(exc).__name__}: {exc}); stock runs on")
            return stock(iterator)
        if not any(e.changed for e in embedded):
            state.report().note(f"{self._name}: tfmx changed nothing in the step; stock runs "
                                "on")
            return stock(iterator)
        made = self._make_guard(sum((collections.Counter(e.ops) for e in embedded),
                                    collections.Counter()),
                                "+".join(e.signature for e in embedded),
                                max(e.replicas for e in embedded))
        try:
            outputs = concrete(iterator)
            guard._sync(outputs)
        except Exception as exc:  # noqa: BLE001 - a form that fails is not kept
            if made is not None:
                made.failed("fused", f"{type(exc).__name__}: {exc}")
            state.report().note(f"{self._name}: tfmx's form failed on its first call mid-fit "
                                f"({type(exc).__name__}: {exc}); stock runs on (one batch may "
                                "have been skipped)")
            return stock(iterator)
        slot.forms = {"fused": concrete, "stock": stock}
        slot.guard = made
        if made is not None:
            cache = state.tuning_cache()
            made.first_call_s = time.perf_counter() - start
            made.price_key = _price_key(embedded)
            made.deferred = sum(e.deferred for e in embedded)
            stock_first = guard.price_figures(made.price_key, cache).get("stock_first_s", 0.0)
            made.warmed("stock", stock_first)  # it ran first: the trial pays no first call
            # the tuner's measuring is paid once per machine (its decisions now cached): left
            # out of what this first call teaches of the next ones
            tuning = _tuning_spent() - tuned
            if background is not None:
                self._traced_beside(watch, made.first_call_s, stock_first, cache, tuning)
                made.first_call_s += background.seconds  # the whole first call, as in-thread
            made.first_call_s = max(0.0, made.first_call_s - tuning)
            guard.learn_first_call("fused", made.first_call_s, made.ops, cache)
            self._estimated(made.price_key, made.first_call_s)
        return outputs

    def _traced_beside(self, watch: _Watch, first_run_s: float, stock_first_s: float,
                       cache: Any, tuning_s: float = 0.0) -> None:
        """tfmx's form was traced beside ``watch``'s stock calls and ran its first call in
        ``first_run_s``: what the fit paid for it (that first run, and what the stock calls
        beside the trace took beyond stock's median, less the tuner's measuring ``tuning_s``,
        which those calls waited for and a later trace does not repeat) is learnt against
        stock's first call (``tfmx.first_call``, form ``"beside"``) and said in the report."""
        median = statistics.median(watch.samples) if watch.samples else 0.0
        excess = max(0.0, sum(max(0.0, t - median) for t in watch.beside) - tuning_s)
        paid = first_run_s + excess
        learn_first_call_ratio("beside", paid, stock_first_s, cache)
        state.report().note(
            f"{self._name}: tfmx's form traced beside {len(watch.beside)} stock call(s) in "
            f"{watch.background.seconds:.2f} s; the fit paid {paid:.2f} s for it (its first "
            f"run {first_run_s:.2f} s, the calls beside it {excess:.2f} s beyond stock's "
            f"median and the tuner's {tuning_s:.2f} s of measuring)")

    def _estimated(self, price_key: str, seconds: float) -> None:
        """tfmx's first call of the step took ``seconds``: where the price gate ran it on an
        estimate (``tfmx.step_price.first_call_estimate``), the report keeps both."""
        estimate = guard.first_call_estimate(price_key, seconds)
        if estimate is None:
            return
        report = state.report()
        report.first_calls.append({"function": self._name, "form": "fused", **estimate})
        report.note(f"price gate's estimate of tfmx's first call of {self._name}: "
                    f"~{estimate['predicted_s']:.2f} s ({estimate['how']}), measured "
                    f"{seconds:.2f} s (measured/predicted {estimate['measured/predicted']:.3f})")

    def _followed(self, slot: _Slot, iterator: Any) -> Any:
        """A call of the fused step after its trial (ended or paused): timed until the trial's
        and these samples make :data:`WATCHED_CALLS`, then the fused step's median is learnt
        for its price record (a trial paused after one timed call says little of it)."""
        timed = slot.guard.samples("fused")
        if not slot.guard.price_key or len(timed) >= WATCHED_CALLS:
            slot.followed = None
            return slot.forms["fused"](iterator)
        start = time.perf_counter()
        outputs = slot.forms["fused"](iterator)
        guard._sync(outputs)
        slot.followed.append(time.perf_counter() - start)
        if len(timed) + len(slot.followed) >= WATCHED_CALLS:
            guard.learn_price(slot.guard.price_key, state.tuning_cache(),
                              fused_ms=statistics.median(timed + slot.followed) * 1e3,
                              fused_deferred=float(slot.guard.deferred))
            slot.followed = None
        return outputs

    def _first_call(self, iterator: Any) -> tuple[Any, Any]:
        """The first call for ``iterator``'s type: its outputs, and what runs it from then on
        (the loop's ConcreteFunction of the iterator)."""
        outputs = self._function(iterator)  # traces (or retraces) as TensorFlow decides
        return outputs, self._function.get_concrete_function(iterator)

    def _form_function(self, form: str, iterator: Any) -> Any:
        """The loop traced (not run) with tfmx's steps in ``form``: a ConcreteFunction of the
        iterator."""
        if form not in self._twins:
            self._twins[form] = self._twin()
        with guard.forcing(form):
            return self._twins[form].get_concrete_function(iterator)

    def _traced_twin(self, form: str, iterator: Any) -> tuple[Any, list[guard.Embedded]]:
        """The loop traced (not run) with tfmx's steps in ``form``, and what they embedded."""
        with guard.collecting() as embedded:
            concrete = self._form_function(form, iterator)
        return concrete, embedded

    def _trace_form(self, slot: _Slot, form: str, iterator: Any) -> Any:
        """Trace and run the loop with tfmx's steps in ``form`` (the guard's first, untimed,
        call of it). A form other than stock that fails loses its duel. XLA's form is checked
        while traced (:mod:`tfmx.xla_support`: every op has an XLA kernel), before the loop
        takes a batch; one that fails when it runs, after the loop took its batch, skips that
        one batch (the report says so)."""
        start = time.perf_counter()
        try:
            # traced, then called: the same ConcreteFunction a call would trace and run, and a
            # form of the loop is not a retrace of it (TensorFlow's warning of frequent
            # retracing counts calls that trace)
            concrete = self._form_function(form, iterator)
            outputs = concrete(iterator)
            slot.forms[form] = concrete
        except xla_support.XlaUnsupportedError as exc:  # found while tracing: no batch taken
            slot.guard.failed(form, f"{exc} (found while tracing, before any batch ran)")
            return self(iterator)
        except Exception as exc:  # noqa: BLE001 - e.g. XLA cannot compile this step
            if form == "stock":
                raise
            slot.guard.failed(form, f"{type(exc).__name__}: {exc} (one batch may have been "
                                    "skipped)")
            return self(iterator)
        slot.guard.record(form, time.perf_counter() - start)
        return outputs


__all__ = ["IteratorDispatch"]
