"""Several steps a call where Keras's per-step loop costs more than the step itself.

Keras's ``fit`` runs its Python loop once per call of the train function: the epoch iterator,
the callbacks' ``on_train_batch_begin``/``end`` (each turning the logs into Python numbers),
the call into the traced loop and the ``tf.experimental.Optional`` it returns. For a small
model that loop costs more than the step's math. Keras's own remedy is ``steps_per_execution``:
one call runs N steps in a ``tf.while_loop``. tfmx takes it where it pays and nothing is lost:

- only for a fit whose callbacks need no per-batch call: Keras's ``History`` and
  ``ProgbarLogger``, or callbacks that override none of ``on_train_batch_begin``/``end``,
  ``on_batch_begin``/``end`` (:func:`per_batch_callbacks`); one that does keeps one step a
  call and sees every batch;
- only where the model's ``steps_per_execution`` is 1: a user's own setting is kept;
- only for epochs of a known number of steps: a call never runs past the epoch's end or the
  data's, the epoch's last steps (fewer than N) run one a call, so the batches, their order,
  the number of steps, the epoch ends and validation are Keras's own;
- chosen by measurement on the fit's first steps: once the step's form is settled (the
  whole-step guard decided, or the price gate's stock step measured), the loop's own share of a
  step is timed (a call's time inside the traced loop against the whole iteration of Keras's
  loop); where what N steps a call would save over the fit's steps left (less what the
  trial's one-step calls and the epoch's steps they leave run one a call) pays for tracing the
  N-step loop :data:`PAYBACK` times over (the saving estimated as Keras's loop's share, the
  trace as the one-step loop's first call, both scaled as the trials of other steps on this
  machine measured them, ``tfmx.loop_cache.calibration``), that loop is traced (Keras's own
  ``multi_step_on_iterator`` traced with ``steps_per_execution`` N, the step in the form
  already kept) and timed against one step a call, alternately on the next real steps: the
  N-step loop's first :data:`WARMUP` call(s) after its trace run but are not counted (a fresh
  loop's first run after its trace is slower than its later ones), then :data:`TIMED` calls
  of each; N steps a call is kept only when its median per step is faster by :data:`MARGIN`.

The choice and its figures are in ``tfmx.report()`` (``report.loops`` and a note). It is kept
for the model's later fits of the same epoch length in this process and, with the tuner's
cache in use (``tune="auto"``), in the machine's tuning cache (``tfmx.tuning_cache``) under the
step's signature (the model's layers and weight shapes, optimizer, batch), the step's form and
N: a later fit of the same model on this machine, in any process, takes the cached choice
without a trial; where that is N steps a call, it traces the N-step loop if the measured saving
a step over the fit's steps left pays for the measured trace, else keeps one step a call.
``TFMX_LOOP=0`` turns it off. An exception inside it leaves Keras's one step a call.

Example (injected times: 32 steps a call cost 0.3 ms a step after a slow first call, one
a call 1.2 ms):
    >>> from tfmx.step_loop import Trial
    >>> trial = Trial(32)
    >>> trial.add(32, 32 * 0.05)  # the N-step loop's first call after its trace: not counted
    >>> for _ in range(5):
    ...     trial.add(1, 0.0012)
    ...     trial.add(32, 32 * 0.0003)
    >>> trial.decide(), round(trial.per_step_ms(32), 2), round(trial.per_step_ms(1), 2)
    (32, 0.3, 1.2)
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from tfmx import epoch_data, guard, loop_cache, state
from tfmx.dispatch import WATCHED_CALLS
from tfmx.env import enabled_by_env

ENV_LOOP = "TFMX_LOOP"
MAX_STEPS = 32
"""The most steps one call runs (an epoch's steps are split into equal calls of at most this)."""
TIMED = 5
"""Timed calls of each size (one step, N steps) before the choice (all are real steps of the
fit)."""
WARMUP = 1
"""The N-step loop's calls after its trace that run uncounted: a fresh loop's first run after
its trace is slower than its later ones, often by more than the difference the trial times."""
MARGIN = 0.05
"""N steps a call is kept only if its median per step is at least this share faster."""
PAYBACK = 1.0
"""The saving expected over the fit's steps left must cover the N-step loop's trace this many
times over for the trial to start (or, from the tuning cache, for the N-step loop's trace)."""

_local = threading.local()
_DISPATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its dispatch
_KEEPER = ("keras.src.callbacks.history.History",
           "keras.src.callbacks.progbar_logger.ProgbarLogger")
_EPOCH_STATE = ("steps_per_epoch", "_num_batches", "_current_iterator", "_steps_seen",
                "data_adapter", "_get_iterator", "_interrupted_warning")
"""What :func:`_stepped` reads and writes of Keras 3's epoch iterator."""
_BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin",
                "on_batch_end")


def steps_per_call(steps_per_epoch: int, most: int | None = None) -> int:
    """N: an epoch's steps split into equal calls of at most ``most`` steps (what is left
    over, fewer than the calls, runs one step a call).

    >>> steps_per_call(64), steps_per_call(100), steps_per_call(97), steps_per_call(10)
    (32, 25, 24, 10)
    """
    most = most or MAX_STEPS
    calls = -(-int(steps_per_epoch) // most)
    return max(1, int(steps_per_epoch) // max(1, calls))


def per_batch_callbacks(callbacks: Any) -> list[str]:
    """The callbacks (class names) of a ``CallbackList`` that need a call per batch: any but
    Keras's own ``History`` and ``ProgbarLogger`` that overrides a batch-level hook.

    >>> from keras import callbacks
    >>> class Counter(callbacks.Callback):
    ...     def on_train_batch_end(self, batch, logs=None):
    ...         pass
    >>> listed = callbacks.CallbackList([Counter(), callbacks.EarlyStopping()],
    ...                                 add_history=True, add_progbar=True)
    >>> per_batch_callbacks(listed)
    ['Counter']
    """
    found = []
    for callback in getattr(callbacks, "callbacks", None) or []:
        kind = type(callback)
        if f"{kind.__module__}.{kind.__qualname__}" in _KEEPER:
            continue
        for hook in _BATCH_HOOKS:
            method = getattr(callback, hook, None)
            if method is not None and not getattr(method, "_is_default", False):
                found.append(kind.__name__)
                break
    return found


@dataclasses.dataclass
class Trial:
    """One step a call against ``n`` steps a call: per-step seconds of each, timed on the
    fit's real steps (:meth:`add` takes a call's steps and seconds)."""

    n: int
    samples: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    warm: list[float] = dataclasses.field(default_factory=list)  # uncounted (:data:`WARMUP`)

    def add(self, steps: int, seconds: float) -> None:
        if steps == self.n > 1 and len(self.warm) < WARMUP:
            self.warm.append(seconds / steps)
            return
        self.samples.setdefault(steps, []).append(seconds / steps)

    def done(self) -> bool:
        return all(len(self.samples.get(k, ())) >= TIMED for k in (1, self.n))

    def next_size(self) -> int:
        """The size of the next timed call: the one with fewer samples (N first, its uncounted
        :data:`WARMUP` calls before any)."""
        if len(self.warm) < WARMUP:
            return self.n
        return 1 if len(self.samples.get(1, ())) < len(self.samples.get(self.n, ())) else self.n

    def per_step_ms(self, steps: int) -> float:
        return statistics.median(self.samples[steps]) * 1e3 if self.samples.get(steps) else 0.0

    def decide(self) -> int:
        """``n`` where its median per step beats one step a call's by :data:`MARGIN`, else 1."""
        one, many = self.per_step_ms(1), self.per_step_ms(self.n)
        return self.n if one > 0 and 0 < many <= one * (1 - MARGIN) else 1


class StepLoop:
    """One fit's loop (see module doc): how many steps each call of its train function runs.
    The epoch iterator asks :meth:`chunk` before each call and reports the call's time with
    :meth:`ran`; the train function's dispatch runs the call through :meth:`call`. Its phases:
    ``settle`` (one step a call until the step's form is settled, Keras's loop then timed),
    ``trace`` (the next call traces the N-step loop), ``trial``, ``kept``."""

    def __init__(self, name: str, model: Any, dispatch: Any, n: int, plan: Any) -> None:
        self.name, self.n, self.plan = name, n, plan
        self._model = weakref.ref(model)
        self.dispatch = dispatch
        self.phase = "settle"
        self.pending = 1  # steps of the call about to be made
        self.form: str | None = None  # the step's form the N-step calls embed
        self.kept: int | None = None
        self.trial = Trial(n)
        self.loop_s: list[float] = []  # Keras's loop outside the traced call, a step
        self.trace_s = 0.0
        self.first_s = 0.0  # the one-step loop's first call (the gate's trace estimate)
        self.why = "the step's form was not settled before the fit ended: one step a call"
        self.steps_done = 0
        self._measure = False  # this one-step call is timed inside (the loop's share)
        self._call_s = 0.0
        self._timed = False  # the call just made counts in the trial
        self._recalled: tuple[int, str] | None = None  # kept once traced (the tuning cache's)
        self.source = "measured"  # or "earlier fit", "tuning cache"
        self._spec: Any = None  # the training iterator's type (its dispatch slot)

    # -- the epoch iterator's side ----------------------------------------------------------
    def chunk(self, left: int, iterator: Any) -> int:
        """Steps the next call runs (``left``: steps left in the epoch and the data)."""
        self._measure = False
        if self.phase == "kept":
            size = self.kept or 1
        elif self.phase == "settle":
            size = self._settle(iterator)
        elif self.phase == "trace":
            size = self.n
        else:
            size = self.trial.next_size()
        self.pending = size if size <= left else 1
        return self.pending

    def _settle(self, iterator: Any) -> int:
        form = steady_form(self.dispatch, iterator)
        if form is None:
            return 1
        self.form, self._spec = form, getattr(iterator, "_type_spec", None)
        memory = self.dispatch._loop_memory.get((form, self.n))
        if memory is not None:  # an earlier fit of this loop chose
            self.trial, self.trace_s = memory.trial, memory.trace_s
            self.source = "earlier fit"
            self._keep(memory.kept, memory.why)
            return self.kept or 1
        key = self._cache_key()
        cached = loop_cache.recall(state.tuning_cache(), key, self.n) if key else None
        if cached is not None:  # a fit of this step on this machine chose
            return self._recall(cached)
        if len(self.loop_s) < TIMED:
            self._measure = True
            return 1
        return self._gate()

    def ran(self, steps: int, seconds: float) -> None:
        """A call of ``steps`` steps took ``seconds`` of Keras's loop (callbacks included)."""
        self.steps_done += steps
        if self.phase == "settle" and self._call_s > 0:
            self.loop_s.append(max(0.0, seconds - self._call_s))
            self._call_s = 0.0
        elif self.phase == "trial" and self._timed:
            self.trial.add(steps, seconds)
            if self.trial.done():
                self._keep(self.trial.decide(), "")
                key = self._cache_key()
                if key is not None:  # for this step's later fits on this machine
                    loop_cache.store(state.tuning_cache(), key, self.kept or 1,
                                     self.trial.per_step_ms(1), self.trial.per_step_ms(self.n),
                                     self.trace_s,
                                     statistics.median(self.loop_s or [0.0]) * 1e3,
                                     self.first_s)

    def _gate(self) -> int:
        """Whether N steps a call may pay for its trace over the fit's steps left (the loop's
        share of a step timed on :data:`TIMED` calls; both estimates scaled as the trials of
        other steps on this machine measured them, ``tfmx.loop_cache.calibration``)."""
        self.first_s = max((s.first_s for s in self.dispatch._slots.values()), default=0.0)
        saving = statistics.median(self.loop_s) * (1 - 1 / self.n)
        trace_s, left, how = self.first_s, self._left(), "the one-step loop's first call"
        known = loop_cache.calibration(state.tuning_cache())
        if known is not None:
            saving, trace_s = saving * known[0], trace_s * known[1]
            how += (f"; both as {known[2]} trial(s) of other steps on this machine measured "
                    f"them: the saving x{known[0]:g}, the trace x{known[1]:g}")
        if saving * max(0, left - TIMED * (self.n + 1)) < PAYBACK * trace_s:
            self._keep(1, f"{self.n} steps a call would save ~{saving * 1e3:.3f} ms a step "
                          f"(Keras's loop); over the {left} steps left that does not cover "
                          f"tracing the {self.n}-step loop (~{trace_s:.2f} s, from {how}) "
                          f"{PAYBACK:g} times over: one step a call", remember=False)
            return 1
        self.phase = "trace"
        return self.n

    def _left(self) -> int:
        return max(0, (getattr(self.plan, "steps", None) or 0) - self.steps_done)

    def _cache_key(self) -> str | None:
        model = self._model()
        if model is None or self.form is None or self._spec is None:
            return None
        try:
            return f"{loop_cache.step_signature(model, self._spec)}|{self.form}|n={self.n}"
        except Exception:  # noqa: BLE001 - a model without a signature: no cache, a trial
            return None

    def _recall(self, cached: Any) -> int:
        """Keep what the tuning cache says a trial of this step chose, without a trial: one
        step a call, or N where its measured saving over the fit's steps left pays for its
        measured trace (none where this process traced it already)."""
        n, self.source = self.n, "tuning cache"
        one, many = cached.times_ms["1"], cached.times_ms[str(n)]
        self.trial.samples = {1: [one / 1e3], n: [many / 1e3]}
        slot = self.dispatch._slots.get(self._spec)
        traced = slot is not None and (self.form, n) in slot.steps
        trace_s = 0.0 if traced else cached.first_ms.get(str(n), 0.0) / 1e3
        self.trace_s, left = trace_s, self._left()
        figures = (f"{n} steps a call {many:.3f} ms a step, one a call {one:.3f} ms, tracing "
                   f"the {n}-step loop {trace_s:.2f} s (measured by an earlier fit of this step "
                   "on this machine: the tuning cache)")
        if cached.choice != str(n) or max(0.0, one - many) / 1e3 * left < PAYBACK * trace_s:
            self._keep(1, f"{figures}: one step a call " + (
                f"({n} steps a call not {MARGIN:.0%} faster)" if cached.choice != str(n) else
                f"(over the {left} steps left the saving does not cover the trace {PAYBACK:g} "
                "times over)"), remember=False)
            return 1
        self._recalled = (n, f"{figures}: {n} steps a call")
        if traced:
            self._keep(*self._recalled, remember=False)
        else:
            self.phase = "trace"
        return n

    def _keep(self, steps: int, why: str, remember: bool = True) -> None:
        self.kept, self.phase = steps, "kept"
        if not why:
            one, many = self.trial.per_step_ms(1), self.trial.per_step_ms(self.n)
            why = (f"{self.n} steps a call {many:.3f} ms a step, one a call {one:.3f} ms "
                   f"(medians of {TIMED} calls each; tracing the {self.n}-step loop took "
                   f"{self.trace_s:.2f} s): "
                   + (f"{self.n} steps a call" if steps > 1 else
                      f"one step a call ({self.n} steps a call not {MARGIN:.0%} faster)"))
        self.why = why
        if remember and self.form is not None:
            self.dispatch._loop_memory[(self.form, self.n)] = _Memory(
                steps, f"{why} (chosen in an earlier fit)" if "earlier fit" not in why else why,
                self.trial, self.trace_s)

    # -- the dispatch's side ----------------------------------------------------------------
    def call(self, dispatch: Any, iterator: Any) -> Any:
        """Run the call :meth:`chunk` sized: N steps through the N-step loop, or one step
        through the dispatch (timed inside while Keras's loop's share is measured)."""
        steps, self.pending = self.pending, 1
        if steps > 1:
            return self._call_steps(dispatch, iterator, steps)
        self._timed = self.phase == "trial"
        if not self._measure:
            return dispatch._call(iterator)
        start = time.perf_counter()
        outputs = dispatch._call(iterator)
        guard._sync(outputs)
        self._call_s = time.perf_counter() - start
        return outputs

    def _call_steps(self, dispatch: Any, iterator: Any, steps: int) -> Any:
        slot = dispatch._slots[iterator._type_spec]
        concrete = slot.steps.get((self.form, steps))
        self._timed = concrete is not None
        if concrete is not None:
            return concrete(iterator)
        start = time.perf_counter()
        try:
            concrete = trace_steps(dispatch, self._model(), iterator, self.form, steps)
        except Exception as exc:  # noqa: BLE001 - Keras's one step a call runs on
            self._keep(1, f"the {steps}-step loop could not be traced ({type(exc).__name__}: "
                          f"{exc}): one step a call")
            return _one_by_one(dispatch, iterator, steps)
        slot.steps[(self.form, steps)] = concrete
        outputs = concrete(iterator)
        guard._sync(outputs)
        self.trace_s = time.perf_counter() - start
        if self._recalled is not None:
            self._keep(*self._recalled, remember=False)
        elif self.phase == "trace":
            self.phase = "trial"
        return outputs

    def record(self) -> dict:
        """The choice and its figures (``tfmx.report().loops``)."""
        record: dict[str, Any] = {"function": self.name, "steps_per_call": self.kept or 1,
                                  "n": self.n, "why": self.why, "source": self.source}
        if self.trial.samples:
            record.update(one_step_ms=round(self.trial.per_step_ms(1), 4),
                          n_steps_ms=round(self.trial.per_step_ms(self.n), 4),
                          trace_s=round(self.trace_s, 3))
        if self.loop_s:
            record["loop_ms"] = round(statistics.median(self.loop_s) * 1e3, 4)
        return record


@dataclasses.dataclass(frozen=True)
class _Memory:
    """A loop's choice, for the model's later fits of the same N and form."""

    kept: int
    why: str
    trial: Trial
    trace_s: float


def _one_by_one(dispatch: Any, iterator: Any, steps: int) -> Any:
    """``steps`` steps, one a call of the one-step loop (what a failed N-step trace leaves):
    the last call's outputs, as Keras's N-step loop returns."""
    outputs = None
    for _ in range(steps):
        step = dispatch._call(iterator)
        if not step.has_value():
            break
        outputs = step
    return outputs if outputs is not None else step


def steady_form(dispatch: Any, iterator: Any) -> str | None:
    """The form the dispatch runs every call now for ``iterator``'s type (``"fused"``,
    ``"stock"``, ``"xla"``), None while it is still tracing, trying or timing forms."""
    slot = dispatch._slots.get(getattr(iterator, "_type_spec", None))
    if slot is None:
        return None
    if slot.watch is not None:
        watch, plan = slot.watch, guard.active_plan()
        serial = plan.serial if plan is not None else None
        if len(watch.samples) < WATCHED_CALLS or watch.switch or watch.asked != serial:
            return None
        return "stock"
    if slot.guard is None:
        return "fused"
    if not slot.guard.decided:
        return None
    kept = slot.guard.kept
    if kept == "fused" and slot.followed is not None:  # its calls still timed for the price
        return None
    return kept if kept in slot.forms else None


def trace_steps(dispatch: Any, model: Any, iterator: Any, form: str, steps: int) -> Any:
    """Keras's step loop traced (not run) with ``steps_per_execution`` = ``steps`` and the
    step in ``form``: a ConcreteFunction of the iterator."""
    function = dispatch._twin()
    before = model.steps_per_execution
    model.steps_per_execution = steps
    try:
        with guard.forcing(form), guard.collecting():
            return function.get_concrete_function(iterator)
    finally:
        model.steps_per_execution = before


# -- what Keras's fit calls ------------------------------------------------------------------
def register(model: Any, dispatch: Any) -> None:
    """``dispatch`` (a ``tfmx.dispatch.IteratorDispatch``) is ``model``'s train loop now."""
    _DISPATCHES[model] = weakref.ref(dispatch)  # the model holds it (its train function)


def epoch_iterator_class(base: type) -> type:
    """Keras's ``TFEpochIterator`` whose training iterator of a fit may run several steps a
    call (its loop attached by :func:`looping_callbacks`); any other runs as Keras's. Every
    one's ``tf.data`` iterators are deleted off the fit's thread (``tfmx.epoch_data``)."""

    class SteppedEpochIterator(base):  # type: ignore[misc, valid-type]
        _tfmx_loop: StepLoop | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if getattr(_local, "claim", False):  # the first one a fit makes: its training data
                _local.claim = False
                _local.made = self

        def _get_iterator(self) -> Any:  # its iterators deleted off the fit's thread
            return epoch_data.released(super()._get_iterator())

        def _enumerate_iterator(self) -> Iterator[Any]:
            loop = self._tfmx_loop
            if loop is None or self.steps_per_execution != 1 or not (
                    self.steps_per_epoch or self._num_batches):
                yield from super()._enumerate_iterator()
                return
            yield from _stepped(self, loop)

    SteppedEpochIterator.__name__ = SteppedEpochIterator.__qualname__ = base.__name__
    return SteppedEpochIterator


def _stepped(epochs: Any, loop: StepLoop) -> Iterator[Any]:
    """Keras 3's ``EpochIterator._enumerate_iterator`` for a known number of steps, with each
    call's steps from the loop (never past the epoch's end or the data's)."""
    epochs.data_adapter.on_epoch_begin()
    steps_per_epoch = epochs.steps_per_epoch or epochs._num_batches
    if epochs._current_iterator is None or epochs.steps_per_epoch is None:
        epochs._current_iterator = iter(epochs._get_iterator())
        epochs._steps_seen = 0
    step = 0
    while step < steps_per_epoch:
        if epochs._num_batches and epochs._steps_seen >= epochs._num_batches:
            if epochs.steps_per_epoch:
                epochs._interrupted_warning()
            break
        left = steps_per_epoch - step
        if epochs._num_batches:
            left = min(left, epochs._num_batches - epochs._steps_seen)
        steps = loop.chunk(left, epochs._current_iterator)
        epochs._steps_seen += steps
        start = time.perf_counter()
        yield step, step + steps - 1, epochs._current_iterator
        loop.ran(steps, time.perf_counter() - start)
        step += steps
    if epochs._num_batches and epochs._steps_seen >= epochs._num_batches:
        epochs._current_iterator = iter(epochs._get_iterator())
        epochs._steps_seen = 0
    epochs.data_adapter.on_epoch_end()


def looping_fit(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Keras's ``fit``: its first epoch iterator is claimed as the training one; its loop
    (if any) ends with it and goes to the report."""

    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = (getattr(_local, "claim", False), getattr(_local, "made", None),
                  getattr(_local, "loop", None))
        _local.claim, _local.made, _local.loop = True, None, None
        try:
            return original(self, *args, **kwargs)
        finally:
            loop = _local.loop
            _local.claim, _local.made, _local.loop = before
            if loop is not None:
                _finish(loop)
            epoch_data.note(state.report())

    fit.__wrapped__ = original  # type: ignore[attr-defined]
    return fit


def looping_callbacks(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Keras's ``CallbackList.on_train_begin``: attach a :class:`StepLoop` to the fit's
    training iterator where the fit allows it (the report says why not where not)."""

    def on_train_begin(self: Any, logs: Any = None) -> Any:
        try:
            _attach(self)
        except Exception as exc:  # noqa: BLE001 - Keras's one step a call runs on
            state.report().note(f"step loop: not attached ({type(exc).__name__}: {exc})")
        return original(self, logs)

    on_train_begin.__wrapped__ = original  # type: ignore[attr-defined]
    return on_train_begin


def _attach(callbacks: Any) -> None:
    epochs, _local.made = getattr(_local, "made", None), None
    model = getattr(callbacks, "model", None)
    if epochs is None or model is None or state.options() is None:
        return
    ref = _DISPATCHES.get(model)
    dispatch = ref() if ref is not None else None
    if dispatch is None or not enabled_by_env(ENV_LOOP) or state.multi_worker():
        return
    name = f"{type(model).__name__}.train_step"
    report = state.report()
    spe = getattr(model, "steps_per_execution", 1) or 1
    if spe != 1:
        report.note(f"step loop: {name} keeps the model's own steps_per_execution={spe}")
        return
    needing = per_batch_callbacks(callbacks)
    if needing:
        report.note(f"step loop: {name} runs one step a call: callback(s) "
                    f"{', '.join(dict.fromkeys(needing))} are called per batch")
        return
    missing = [name for name in _EPOCH_STATE if not hasattr(epochs, name)]
    if missing:  # another Keras's epoch iterator: its own loop
        report.note(f"step loop: {name} runs one step a call: Keras's epoch iterator lacks "
                    f"{', '.join(missing)}")
        return
    steps = epochs.steps_per_epoch or epochs._num_batches
    if not steps:
        report.note(f"step loop: {name} runs one step a call: the epoch's number of steps "
                    "is unknown")
        return
    if steps < 2:
        return
    loop = StepLoop(name, model, dispatch, steps_per_call(steps), guard.active_plan())
    epochs._tfmx_loop = loop
    dispatch._loop = loop
    _local.loop = loop


def _finish(loop: StepLoop) -> None:
    if loop.dispatch._loop is loop:
        loop.dispatch._loop = None
    if loop.kept is None and loop.loop_s:
        loop.why = (f"the fit ended before the choice ({len(loop.loop_s)} call(s) of Keras's "
                    "loop timed): one step a call")
    record = loop.record()
    report = state.report()
    loops = report.loops
    if record not in loops:
        loops.append(record)
        report.note(f"step loop: {loop.name} ran {record['steps_per_call']} step(s) a call: "
                    f"{loop.why}")


__all__ = ["ENV_LOOP", "MARGIN", "MAX_STEPS", "TIMED", "WARMUP", "StepLoop", "Trial",
           "epoch_iterator_class", "looping_callbacks", "looping_fit", "per_batch_callbacks",
           "register", "steady_form", "steps_per_call", "trace_steps"]
