"""The whole-step guard: on the first real steps, time the fused step against the stock one.

Every speed decision inside a step is measured (:mod:`tfmx.tuner`), but only the whole step says
whether the user's training got faster. So when tfmx changed a step, the first steps of ``fit``
(``evaluate``, ``predict``, a ``tfmx.function`` loop) run the fused and the stock step
alternately on the real batches: both are built from the same Python step function (the stock
one traced with no tfmx stage and no rewrite, as TensorFlow would run it), every step trains as
usual, nothing is computed twice. After each pair the guard compares them: a sequential t-test
on the pairs' log time ratios (from 2 pairs, at p < :data:`P_EARLY` per look; a form slower
by a wide margin is dropped after 2-3 pairs, see also :data:`PLAIN`) and a sign test (from
:data:`MIN_PAIRS` pairs);
after :data:`MAX_PAIRS` pairs it keeps the fused step only if it is faster beyond noise.
``tfmx.report()`` shows which was kept, both medians and what the trial cost.

On cpu and cuda the winner then meets a third form: the step compiled by XLA (the Python step
with ``jit_compile=True``, as Keras's own ``jit_compile=True`` builds it), kept only if faster
again beyond noise; one XLA cannot compile loses. Whether XLA is tried is measured too: its
compile (its first call) is paid only when the trial's budget covers the compile time expected
on this machine (:func:`expected_first_call`, learnt from the first calls measured here), and
its measured compile time counts against the budget. A step that reduces across replicas is
not tried (:func:`xla_pruned`: a correctness reason).

The budget: a trial costs at most :data:`BUDGET_SHARE` (2 %) of the run it serves
(``TFMX_GUARD_BUDGET``). Its cost is the first calls of the forms other than fused (tracing,
compiling) and the time every slower step took beyond the best form's median. The run's time is
what Keras's ``fit`` plans (epochs x steps per epoch, from its callbacks' params: see
:func:`plan_fit`) at the best step time measured, or, where no plan is known (a custom loop,
``evaluate``, ``predict``, a dataset of unknown length), the time the run has taken so far.
Before each run the guard checks that what it is about to pay (a form's first call, or a slower
step) fits in what is left; if not, the trial pauses and keeps the form best so far on the
evidence, conservatively: a challenger only if faster beyond noise (p < :data:`P_FINAL`), the
fused step when stock was never run (it is the step already running). A paused trial resumes
when a later ``fit`` (or the time run) gives it budget again.

A finished trial's outcome is kept per step signature for the process and in the tuner's cache
on this machine (``tune="auto"``): a later ``fit``, a new model of the same architecture, a new
process run it at once, and the report says what the trial had cost (what the reuse saved).

Before a fit's train step is first traced, the price gate (:func:`price_gate`) asks whether
rewriting it can pay within this fit: from the fit's plan and what this machine measured of
the same step before (its price record, :func:`price_figures`, keyed by what the step is
before it is traced: the fused and stock first calls, each form's median), it runs the step as
stock, with no stage and no rewrite, where the rewrite's extra first call is more than the
fused step saves over the planned calls, or, where stock's step was never measured, more than
the trial's budget; the report says so with the figures. A step so run is timed on its first
calls, so the next fit decides from both forms. With nothing measured yet, tfmx runs and the
guard's trial records the figures.

Switch the guard off with ``tfmx.enable(guard=False)`` or ``TFMX_GUARD=0``; the XLA duel alone
with ``tfmx.enable(xla=False)`` or ``TFMX_XLA=0``. The price gate is part of the guard.

Example (injected times: the fused step is slower, stock is kept):
    >>> from tfmx.guard import StepGuard
    >>> g = StepGuard("demo")
    >>> while not g.decided:
    ...     form = g.next_form()
    ...     g.record(form, 0.010 if form == "fused" else 0.008)
    >>> g.kept, round(g.summary().fused_ms, 1), round(g.summary().stock_ms, 1)
    ('stock', 10.0, 8.0)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from tfmx.tuner import share_from_env, sign_test

ENV = "TFMX_GUARD"
ENV_XLA = "TFMX_XLA"
ENV_BUDGET = "TFMX_GUARD_BUDGET"
MIN_PAIRS = 6
"""Pairs before the sign test may decide (the t-test may decide from 2)."""
MAX_PAIRS = 24
"""Pairs after which the guard decides whatever the evidence (stock unless fused is faster)."""
P_EARLY = 0.01
"""p-value that ends a duel early in favour of one form."""
P_FINAL = 0.05
"""At :data:`MAX_PAIRS`, or when the budget runs out, a challenger is kept only at this
significance."""
PLAIN = (1.1, 1.25)
"""A challenger slower in each of its first 3 pairs by at least the first, and by the second in
their median, is dropped then, however noisy (its t-test may not yet be)."""
BUDGET_SHARE = 0.02
"""The share of the run a trial may cost (``TFMX_GUARD_BUDGET``: a fraction, or ``none``)."""
NOISE_FLOOR = 0.01
"""The least standard deviation of a pair's log time ratio the t-test assumes (1 %): two
timings that agree better than that are not taken for proof."""
XLA_SEED = 2.0
"""Before any XLA first call was measured on this machine, its compile is expected to cost
this many times stock's first call (a seed: the first measurement replaces it)."""
SEED_S_PER_OP = 1e-3
"""Before any first call was measured here and with no fused first call to go by, stock's is
expected to cost this many seconds per op of its step (a seed, as :data:`XLA_SEED`)."""

# one-sided Student t quantiles for 1..30 degrees of freedom, at p = 0.01 and 0.05
_T_CRIT = {
    0.01: (31.82, 6.965, 4.541, 3.747, 3.365, 3.143, 2.998, 2.896, 2.821, 2.764, 2.718, 2.681,
           2.650, 2.624, 2.602, 2.583, 2.567, 2.552, 2.539, 2.528, 2.518, 2.508, 2.500, 2.492,
           2.485, 2.479, 2.473, 2.467, 2.462, 2.457),
    0.05: (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782,
           1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711,
           1.708, 1.706, 1.703, 1.701, 1.699, 1.697),
}
_T_LIMIT = {0.01: 2.326, 0.05: 1.645}

_local = threading.local()
_test_delay = {"fused": 0.0, "stock": 0.0, "xla": 0.0}


def enabled_by_env(name: str = ENV) -> bool:
    """The environment switch ``name`` (``TFMX_GUARD``, ``TFMX_XLA``): unset or true-ish is on.

    >>> isinstance(enabled_by_env(), bool)
    True
    """
    value = os.environ.get(name, "1").strip().lower()
    if value in ("1", "true", "on", "yes", ""):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"${name} must be 1 or 0 (on/off), got {value!r}")


def set_test_delay(fused: float = 0.0, stock: float = 0.0, xla: float = 0.0) -> None:
    """Test hook: every step of that form a guard runs during its trial sleeps so many seconds
    more (the default, 0, turns it off)."""
    _test_delay.update(fused=float(fused), stock=float(stock), xla=float(xla))


@contextlib.contextmanager
def forcing(form: str) -> Iterator[None]:
    """While a guard traces another form (``"stock"``, ``"xla"``) of an outer function
    (Keras's step loop), tfmx's step functions traced inside it embed that form."""
    with _swapped("forced", form):
        yield


@contextlib.contextmanager
def _swapped(attr: str, value: Any) -> Iterator[None]:
    """This thread's ``attr`` (of the guard's thread-local state) is ``value`` for the block."""
    previous = getattr(_local, attr, None)
    setattr(_local, attr, value)
    try:
        yield
    finally:
        setattr(_local, attr, previous)


def forced_form() -> str | None:
    """The form :func:`forcing` asks for, None outside it."""
    return getattr(_local, "forced", None)


@contextlib.contextmanager
def collecting() -> Iterator[list[Any]]:
    """Collect what tfmx's step functions embed while an outer function traces (see
    :func:`embedded`): the caller learns whether tfmx changed anything inside."""
    previous = getattr(_local, "collected", None)
    _local.collected = []
    try:
        yield _local.collected
    finally:
        _local.collected = previous


@dataclasses.dataclass(frozen=True)
class Embedded:
    """What an outer trace learns of a tfmx step traced into it."""

    changed: bool  # it differs from stock (a stage or a pass rewrote it)
    ops: Mapping[str, int] = dataclasses.field(default_factory=dict)  # its stock graph's ops
    signature: str = ""  # what the step is (its ops, shapes, what tfmx made of it): a cache key
    price_key: str = ""  # what the step is before it is traced: its price record's key
    gated: bool = False  # the price gate ran it as stock (see :func:`price_gate`)
    replicas: int = 1  # the replicas it runs in (``tf.distribute``): one trace each


def embedded(changed: bool, ops: Mapping[str, int] | None = None, signature: str = "",
             price_key: str = "", gated: bool = False, replicas: int = 1) -> None:
    """A tfmx step function was traced into an outer function (see :class:`Embedded`)."""
    collected = getattr(_local, "collected", None)
    if collected is not None:
        collected.append(Embedded(changed, dict(ops or {}), signature, price_key, gated,
                                  replicas))


def budget_share() -> float | None:
    """The share of a run a trial may cost: ``$TFMX_GUARD_BUDGET`` or :data:`BUDGET_SHARE`;
    None (``none``, ``off``) lets a trial run to its end whatever it costs.

    >>> budget_share()
    0.02
    """
    return share_from_env(ENV_BUDGET, BUDGET_SHARE)


def t_test(ratios: list[float], p: float) -> int:
    """A one-sided t-test on the log of the pairs' time ratios (challenger / incumbent): -1 if
    the challenger is faster at significance ``p``, 1 if slower, 0 if neither. The standard
    deviation is taken as at least :data:`NOISE_FLOOR`.

    >>> t_test([5.1, 4.9], 0.01), t_test([1.02, 0.97, 1.01], 0.01), t_test([0.5] * 3, 0.01)
    (1, 0, -1)
    """
    n = len(ratios)
    if n < 2 or p not in _T_CRIT:
        return 0
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    sd = max(statistics.stdev(logs), NOISE_FLOOR)
    table = _T_CRIT[p]
    critical = table[n - 2] if n - 1 <= len(table) else _T_LIMIT[p]
    t = mean / (sd / math.sqrt(n))
    return -1 if t < -critical else 1 if t > critical else 0


# -- what a fit plans --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FitPlan:
    """One ``fit``: its number (in this process), how many calls of its train function it
    plans and how many steps (batches) those run (None: unknown, e.g. a dataset of unknown
    length)."""

    serial: int
    calls: int | None
    steps: int | None = None


_serials = itertools.count(1)


def plan_fit(epochs: int | None, steps: int | None, steps_per_execution: int = 1) -> FitPlan:
    """Announce a ``fit`` of ``epochs`` x ``steps`` batches, ``steps_per_execution`` batches a
    call, in this thread: the train step's guard sizes its budget on it.

    >>> plan_fit(3, 16, 4).calls
    12
    >>> current_plan().calls
    12
    """
    calls = total = None
    if epochs and steps and steps > 0:
        calls = epochs * -(-int(steps) // max(1, int(steps_per_execution or 1)))
        total = int(epochs) * int(steps)
    plan = FitPlan(next(_serials), calls, total)
    _local.plan = plan
    return plan


def current_plan() -> FitPlan | None:
    """The last ``fit`` announced in this thread (:func:`plan_fit`), None before any."""
    return getattr(_local, "plan", None)


def active_plan() -> FitPlan | None:
    """The plan of the ``fit`` under way in this thread (from its ``on_train_begin`` to its
    ``on_train_end``, see :func:`planning_callbacks`, or inside :func:`fitting`), else None:
    what the tuner's budget and the price gate size themselves on.

    >>> active_plan() is None
    True
    >>> with fitting(3, 16):
    ...     active_plan().steps
    48
    """
    return getattr(_local, "active", None)


@contextlib.contextmanager
def adopting(plan: FitPlan | None) -> Iterator[None]:
    """Make ``plan`` the fit under way in this thread for the block (a thread working for the
    fit's thread, e.g. the tuner's measuring thread).

    >>> with adopting(FitPlan(0, 4, 4)):
    ...     active_plan().calls
    4
    """
    with _swapped("active", plan):
        yield


@contextlib.contextmanager
def fitting(epochs: int | None, steps: int | None,
            steps_per_execution: int = 1) -> Iterator[FitPlan]:
    """Announce a fit (:func:`plan_fit`) that is under way (:func:`active_plan`) for the
    block: what Keras's callbacks do around a ``fit``; tests and custom loops use it."""
    plan = plan_fit(epochs, steps, steps_per_execution)
    with _swapped("active", plan):
        yield plan


def planning_callbacks(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Keras's ``CallbackList.on_train_begin`` (install with ``fusion.patches``): when a
    fit begins, its callbacks' params (``epochs``, ``steps``) and the model's
    ``steps_per_execution`` announce its plan (:func:`plan_fit`)."""

    @functools.wraps(original)
    def on_train_begin(self: Any, logs: Any = None) -> Any:
        params = getattr(self, "params", None) or {}
        model = getattr(self, "model", None)
        try:
            plan = plan_fit(params.get("epochs"), params.get("steps"),
                            getattr(model, "steps_per_execution", 1) or 1)
        except (TypeError, ValueError):
            plan = plan_fit(None, None)
        _local.active = plan
        return original(self, logs)

    return on_train_begin


def ending_callbacks(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Keras's ``CallbackList.on_train_end``: the fit's plan is no longer under way
    (:func:`active_plan`)."""

    @functools.wraps(original)
    def on_train_end(self: Any, logs: Any = None) -> Any:
        _local.active = None
        return original(self, logs)

    return on_train_end


def closing_fit(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Keras's ``Trainer.fit``: whatever way the fit ends (``on_train_end``, or an
    exception that skips it), the plan under way before it (:func:`active_plan`, None outside a
    fit) is the one under way after it.

    >>> def fit(self):
    ...     plan_fit(1, 1)
    ...     _local.active = current_plan()
    ...     raise KeyboardInterrupt
    >>> try:
    ...     closing_fit(fit)(None)
    ... except KeyboardInterrupt:
    ...     pass
    >>> active_plan() is None
    True
    """

    @functools.wraps(original)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = getattr(_local, "active", None)
        try:
            return original(self, *args, **kwargs)
        finally:
            _local.active = before

    return fit


# -- first calls: what tracing or compiling a form costs on this machine ----------------------
_first_calls: dict[str, tuple[float, int]] = {}  # form -> (max log s/op, observations)


def _learnt(form: str, cache: Any) -> tuple[float, int] | None:
    known = _first_calls.get(form)
    if known is None and cache is not None:  # another process's measurements
        d = cache.get(f"guard-first-call|{form}")
        if d is not None and d.times_ms.get("ms_per_op", 0) > 0:
            known = (math.log(d.times_ms["ms_per_op"] / 1e3), int(d.times_ms.get("n", 1)))
            _first_calls[form] = known
    return known


def learn_first_call(form: str, seconds: float, ops: int, cache: Any = None) -> None:
    """Record that ``form``'s first call (tracing, compiling, one step) took ``seconds`` for a
    step of ``ops`` ops: :func:`expected_first_call` goes by the most per op measured here (a
    budget is a bound: the slowest first call seen, not a typical one).

    >>> learn_first_call("demo", 2.0, 1000)
    >>> round(expected_first_call("demo", 500)[0], 3)
    1.0
    """
    if ops <= 0 or seconds <= 0:
        return
    most, n = _learnt(form, cache) or (-math.inf, 0)
    most = max(most, math.log(seconds / ops))
    _first_calls[form] = (most, n + 1)
    if cache is not None:
        from tfmx.tuner import Decision

        cache.put(Decision("guard-first-call", form, form, (form,),
                           {"ms_per_op": math.exp(most) * 1e3, "n": n + 1}, "measured"))


def expected_first_call(form: str, ops: int, fused_first_s: float = 0.0, cache: Any = None
                        ) -> tuple[float, str]:
    """Seconds ``form``'s first call is expected to take for a step of ``ops`` ops, and how
    that was estimated: from the first calls measured on this machine (per op), else seeded by
    the fused step's own first call (tracing and rewriting the same step: more than stock's)
    or :data:`SEED_S_PER_OP`, XLA's at :data:`XLA_SEED` times stock's.

    >>> expected_first_call("nothing measured", 100, fused_first_s=3.0)[1]
    'seed: the fused first call'
    """
    known = _learnt(form, cache)
    if known is not None and ops > 0:
        rate = math.exp(known[0])
        return rate * ops, (f"{rate * 1e3:.2f} ms per op, the most of {known[1]} first "
                            "call(s) measured here")
    if form == "xla":
        stock, how = expected_first_call("stock", ops, fused_first_s, cache)
        return XLA_SEED * stock, f"seed: {XLA_SEED:g} x stock's first call ({how})"
    if fused_first_s > 0:
        return fused_first_s, "seed: the fused first call"
    return SEED_S_PER_OP * max(ops, 1), f"seed: {SEED_S_PER_OP * 1e3:g} ms per op"


def xla_pruned(backend: str, ops: Mapping[str, int], replicas: int = 1) -> str | None:
    """Why XLA's form cannot be tried for this step, or None. Speed is not a reason here (the
    guard measures it within its budget). A step that runs in several replicas
    (``tf.distribute``) or reduces across them (its collectives) is not tried: XLA compiles
    the step for one device, under MirroredStrategy it fails on the other replicas' variables,
    and a trial that fails after Keras's loop took its batch would lose that batch.

    >>> xla_pruned("cpu", {"CollectiveReduceV2": 2, "MatMul": 6})[:34]
    'the step reduces across replicas ('
    >>> xla_pruned("cpu", {"MatMul": 6}, replicas=2)
    "the step runs in 2 replicas (tf.distribute): XLA compiles one device's step"
    >>> xla_pruned("cpu", {"Conv2D": 4, "DepthwiseConv2dNative": 4}) is None
    True
    """
    collectives = sorted(op for op in ops if op.startswith(("Collective", "Nccl")))
    if collectives:
        return (f"the step reduces across replicas ({', '.join(collectives)}): XLA compiles "
                "one device's step")
    if replicas > 1:
        return (f"the step runs in {replicas} replicas (tf.distribute): XLA compiles one "
                "device's step")
    return None


_decided: dict[str, Any] = {}  # step key -> the tuner Decision a trial stored, this process


def forget() -> None:
    """Drop what this process learnt (trials' outcomes, first calls measured); the machine's
    tuning cache keeps its copy.

    >>> forget()
    """
    _decided.clear()
    _first_calls.clear()
    _prices.clear()


# -- the price gate: does rewriting a fit's step pay within that fit? -------------------------
PRICE_FAMILY = "price"
"""The tuner cache's family of price records: per step (before it is traced), what its first
calls and steps cost in each form, as measured here."""

_prices: dict[str, dict[str, float]] = {}  # price key -> figures learnt in this process


def price_figures(key: str, cache: Any = None) -> dict[str, float]:
    """What was measured on this machine of the step ``key``: ``fused_first_s`` and
    ``stock_first_s`` (the first call of the fit's loop: tracing, rewriting, graph
    optimization, one step), ``fused_ms`` and ``stock_ms`` (medians of a call), ``ops``.

    >>> learn_price("demo step", fused_ms=5.0)
    >>> price_figures("demo step")["fused_ms"]
    5.0
    """
    known: dict[str, float] = {}
    if cache is not None and key:
        found = cache.get(f"{PRICE_FAMILY}|{key}")
        if found is not None:
            known.update(found.times_ms)
    known.update(_prices.get(key, {}))
    return known


def learn_price(key: str, cache: Any = None, **figures: float | None) -> None:
    """Record ``figures`` (see :func:`price_figures`) of the step ``key`` for this process and,
    with ``cache`` (a ``tfmx.tuner.TuningCache``), for this machine."""
    if not key:
        return
    new = {k: float(v) for k, v in figures.items()
           if v is not None and math.isfinite(float(v)) and float(v) > 0}
    if not new:
        return
    merged = {**price_figures(key, cache), **new}
    _prices[key] = merged
    if cache is not None:
        from tfmx.tuner import Decision

        cache.put(Decision(PRICE_FAMILY, key, "figures", (), merged, "measured"))


@dataclasses.dataclass(frozen=True)
class GateDecision:
    """The price gate's verdict on one fit's step: ``run`` is ``"tfmx"`` (traced with the
    stages, rewritten, guarded) or ``"stock"`` (as TensorFlow alone traces it), and why."""

    run: str
    why: str

    def describe(self, function: str) -> str:
        """The report's line: ``price gate: M.train_step ran as stock: <why>``."""
        return f"price gate: {function} ran as {self.run}: {self.why}"


def price_gate(figures: Mapping[str, float], calls: int | None,
               share: float | None = BUDGET_SHARE, cache: Any = None) -> GateDecision:
    """Whether rewriting a step pays within a fit of ``calls`` calls of it, from what this
    machine measured of it (``figures``, :func:`price_figures`):

    - both forms' step times known: tfmx runs if what the fused step saves over the fit
      (``calls`` x (stock - fused)) is more than its first call costs beyond stock's;
    - only the fused step's known (the trial never ran stock): tfmx runs if its first call
      beyond stock's expected one (:func:`expected_first_call`, learnt here, else nothing) is
      within the trial's budget, ``share`` of the planned run (the guard's budget logic);
      else stock runs, and its figures are measured for the next fit;
    - nothing known, or no plan: tfmx runs (and learns).

    >>> fig = {"fused_first_s": 9.0, "stock_first_s": 3.0, "fused_ms": 40.0, "stock_ms": 60.0}
    >>> price_gate(fig, 48).run, price_gate(fig, 1000).run
    ('stock', 'tfmx')
    >>> price_gate(fig, 48).why  # doctest: +NORMALIZE_WHITESPACE
    "its first call costs 6.00 s more than stock's (9.00 s, 3.00 s), more than it saves over
    the fit's 48 calls (0.96 s: fused 40.00 ms, stock 60.00 ms a call)"
    """
    if not calls:
        return GateDecision("tfmx", "no plan of the fit's length")
    fused_first = figures.get("fused_first_s")
    fused_ms = figures.get("fused_ms")
    if not fused_first or not fused_ms:
        return GateDecision("tfmx", "nothing measured of this step's price here yet: tfmx runs "
                                    "and measures it")
    stock_first = figures.get("stock_first_s")
    how = f"{stock_first:.2f} s" if stock_first else ""
    if not stock_first:
        ops = int(figures.get("ops", 0))
        known = _learnt("stock", cache)
        stock_first = math.exp(known[0]) * ops if known is not None and ops > 0 else 0.0
        how = (f"~{stock_first:.2f} s expected, learnt here per op" if stock_first
               else "not measured")
    extra = max(0.0, fused_first - stock_first)
    first = (f"its first call costs {extra:.2f} s more than stock's ({fused_first:.2f} s, "
             f"{how})")
    stock_ms = figures.get("stock_ms")
    if stock_ms:
        saved = calls * (stock_ms - fused_ms) / 1e3
        steps = (f"the fit's {calls} calls ({saved:.2f} s: fused {fused_ms:.2f} ms, stock "
                 f"{stock_ms:.2f} ms a call)")
        if saved > extra:
            return GateDecision("tfmx", f"{first}, less than it saves over {steps}")
        return GateDecision("stock", f"{first}, more than it saves over {steps}")
    run_s = calls * fused_ms / 1e3
    if share is None or extra <= share * run_s:
        return GateDecision("tfmx", f"{first}, within the trial's budget ({share or 0:.0%} of "
                                    f"the planned ~{run_s:.1f} s); stock's step not measured")
    return GateDecision("stock", f"{first}, more than the trial's budget ({share:.0%} of the "
                                 f"planned ~{run_s:.1f} s), and stock's step was never measured "
                                 "to show a gain: stock runs and is measured for the next fit")


def make_guard(function: str, opts: Any, ops: Mapping[str, int], signature: str = "",
               cache: Any = None, planned: bool = False, replicas: int = 1) -> StepGuard:
    """The guard for one step under ``opts`` (``tfmx.state.Options``): its challengers, with
    XLA left out where :func:`xla_pruned` says so (``replicas``: the replicas the step runs in;
    the report says why), its budget
    (:func:`budget_share`; ``planned``: the step is a fit's train step, whose plan
    :func:`plan_fit` announces). With the step's ``signature``, what a trial kept for the same
    step before in this process, or on this machine (a ``tfmx.tuner.TuningCache``), is kept at
    once, and a new trial's outcome is stored."""
    challengers = opts.guard_challengers()
    why = xla_pruned(opts.backend.name, ops, replicas) if "xla" in challengers else None
    if why:
        challengers = tuple(c for c in challengers if c != "xla")
    made = StepGuard(function, challengers, notes=(f"XLA not tried: {why}",) if why else (),
                     budget=budget_share(), planned=planned, ops=sum(ops.values()),
                     cache=cache)
    if signature:
        made.remember(cache, f"{function} {signature}")
    return made


@dataclasses.dataclass
class GuardRecord:
    """What one guard measured and kept, for the report."""

    function: str
    kept: str  # "fused", "stock", "xla", or "undecided"
    fused_ms: float
    stock_ms: float
    pairs: int
    reason: str
    cost_s: float = 0.0  # what the trial cost: the other forms' first calls and slower steps
    xla_ms: float = float("nan")  # nan: not tried
    final: bool = True  # False: kept while the trial is paused (its budget spent)
    budget_s: float = float("nan")  # what the trial may cost so far (nan: no budget)
    run_s: float = 0.0  # the run the budget is a share of: the fits' planned time, or so far
    xla_compile_s: float = float("nan")  # XLA's first call, measured (nan: not compiled)
    saved_s: float = 0.0  # a cached outcome: what its trial had cost

    def describe(self) -> str:
        """One line: what was kept, each form's median, the pairs, why, what it cost."""
        times = ", ".join(f"{name} {ms:.2f} ms" for name, ms in (
            ("fused", self.fused_ms), ("stock", self.stock_ms), ("XLA", self.xla_ms))
            if not math.isnan(ms))
        ratio = self.fused_ms / self.stock_ms if self.stock_ms else math.nan
        if not math.isnan(ratio):
            times += f", fused/stock {ratio:.3f}"
        share = (f"{self.cost_s / self.run_s:.1%} of the run's ~{self.run_s:.1f} s"
                 if self.run_s > 0 else "")
        budget = "" if math.isnan(self.budget_s) else f", budget {self.budget_s:.2f} s"
        cost = f"the trial cost {self.cost_s:.2f} s" + (f" ({share}{budget})" if share else "")
        if self.saved_s:
            cost = f"no trial: {self.saved_s:.2f} s saved, what the trial had cost"
        reason = f"; {self.reason}" if self.reason else ""
        if self.kept == "undecided":
            return (f"{self.function}: trial under way, {self.pairs} pairs so far ({times})"
                    f"{reason}; {cost}")
        kept = f"kept {self.kept}" + ("" if self.final else " for now")
        return f"{self.function}: {kept} ({times}; {self.pairs} pairs{reason}; {cost})"


class StepGuard:
    """The trial of one step function (see module doc): call :meth:`next_form`, run that form,
    :meth:`record` its time; once :attr:`decided`, :attr:`kept` names the form to run.

    The trial is a sequence of duels: each challenger (``"fused"``, then ``"xla"`` where
    given) against the form kept so far (``"stock"`` at first); a challenger is kept only if
    faster beyond noise. A challenger whose first call fails (:meth:`failed`) loses its duel.

    With a ``budget`` (a share of the run, see module doc) the trial first times the fused
    step once (it runs anyway), then pays for nothing the budget does not cover: it pauses,
    keeping the best form so far (see module doc), and resumes when a new fit's plan or the time
    run allow. ``clock`` (seconds) can be injected; ``first_call_s`` is the fused step's first
    call where the caller timed it; ``ops`` the stock step's op count (for the expected cost of
    the other forms' first calls).

    Example (a 2 % budget of a 40-step fit of 10 ms steps: stock's 5 s trace does not fit, the
    fused step is kept for now, untried):
        >>> g = StepGuard("demo", budget=0.02, planned=True, first_call_s=5.0)
        >>> _ = plan_fit(1, 40)
        >>> g.record(g.next_form(), 0.010)
        >>> g.next_form(), g.decided, g.summary().final
        ('fused', True, False)
    """

    def __init__(self, function: str, challengers: tuple[str, ...] = ("fused",),
                 min_pairs: int = MIN_PAIRS, max_pairs: int = MAX_PAIRS,
                 notes: tuple[str, ...] = (), budget: float | None = None,
                 planned: bool = False, first_call_s: float = 0.0, ops: int = 0,
                 cache: Any = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.function = function
        self.min_pairs, self.max_pairs = min_pairs, max_pairs
        self.kept: str | None = None
        self._queue = list(challengers)
        self.incumbent = "stock"
        self.challenger = self._queue.pop(0)
        self._reasons: list[str] = list(notes)
        self._all: dict[str, list[float]] = {}  # every timed run, per form, for the report
        self._pair: dict[str, list[float]] = {self.challenger: [], self.incumbent: []}
        self._warm: dict[str, float] = {"fused": 0.0}  # the first traced call ran the fused form
        self._next = self.incumbent if self.challenger in self._warm else self.challenger
        self._cache: Any = cache  # the machine's tuning cache: learnt first calls, outcomes
        self._key = ""
        self._cached: Any = None
        # the budget (see module doc)
        self.budget = budget
        self.planned = planned
        self.first_call_s = first_call_s
        self.ops = ops
        self._clock = clock
        self._start = clock()
        self._fits: dict[int, int | None] = {}  # fit serial -> its planned calls
        self._paused = False
        self._pause_why = ""
        self._pause_serial: int | None = None
        self._resume_at = math.inf
        self._xla_why = ""  # why XLA was not compiled (when its duel was paused)
        self._switch: tuple[str, float, float] | None = None  # see _switch_worth_it
        self._calls = 0
        self.price_key = ""  # the step's price record (see price_gate): what the trial learnt
        if budget is not None and self.challenger in self._warm:
            self._next = self.challenger  # one timed run of the step already running first

    @property
    def decided(self) -> bool:
        """True once a form is kept: for good, or while a paused trial waits for budget (then
        it resumes here, on the first call its budget covers again)."""
        if self.kept is None:
            return False
        if self._switch is not None:
            self._switch_worth_it()
            return True
        if not self._paused:
            return True
        plan = current_plan() if self.planned else None
        new_fit = plan is not None and plan.serial != self._pause_serial
        if not new_fit and self._clock() < self._resume_at:
            return True
        if self._affordable(self._next):
            self.kept, self._paused, self._pause_why = None, False, ""
            return False
        self._pause_serial = plan.serial if plan is not None else None
        self._resume_at = self._when_affordable(self._next)
        return True

    def lift_budget(self) -> None:
        """Let the trial run to its end whatever it costs (a benchmark of the steady state):
        a paused trial resumes on the next call.

        >>> g = StepGuard("demo", budget=0.0)
        >>> g.record(g.next_form(), 0.01)
        >>> g.next_form(), g.decided
        ('fused', True)
        >>> g.lift_budget()
        >>> g.decided, g.next_form()
        (False, 'stock')
        """
        self.budget = None
        if self._paused:
            self.kept, self._paused, self._pause_why = None, False, ""

    def next_form(self) -> str:
        """The form to run next: alternates during the trial (pausing it if the budget does
        not cover what the next run would cost), then the kept one."""
        if self.kept is not None:
            return self.kept
        form = self._next
        if self.budget is not None and not self._affordable(form):
            self._pause(form)
            return self.kept
        if form == "xla" and form not in self._warm:
            expected, how = expected_first_call(form, self.ops, self.first_call_s, self._cache)
            left = self.budget_seconds() - self._cost()
            self._xla_why = (f"expected ~{expected:.2f} s, {how}; budget left {left:.2f} s"
                             if self.budget is not None else "no budget")
        return form

    def record(self, form: str, seconds: float) -> None:
        """Record one run of ``form`` (its first run only warms it up)."""
        if self.kept is not None:
            return
        if form not in self._warm:
            self._warm[form] = seconds  # tracing and compiling it: the guard's doing
            learn_first_call(form, seconds, self.ops, self._cache)
            if form == "xla":
                self._xla_why = f"XLA tried: compiled in {seconds:.2f} s ({self._xla_why})"
        else:
            self._all.setdefault(form, []).append(seconds)
            if self.incumbent in self._warm and self.challenger in self._warm:
                self._pair.setdefault(form, []).append(seconds)  # the duel has begun
        self._next = self.incumbent if form == self.challenger else self.challenger
        self._maybe_decide()

    def failed(self, form: str, why: str) -> None:
        """``form`` could not run (e.g. XLA could not compile the step): it loses its duel."""
        if self.kept is None and form == self.challenger:
            self._end_duel(self.incumbent, f"{form} could not run ({why[:120]})")

    def _ratios(self) -> list[float]:
        mine, theirs = self._pair[self.challenger], self._pair[self.incumbent]
        return [c / i for c, i in zip(mine, theirs) if i > 0 and c > 0]

    def _maybe_decide(self) -> None:
        challenger, incumbent = self.challenger, self.incumbent
        if len(self._pair[challenger]) != len(self._pair[incumbent]):
            return
        ratios = self._ratios()
        n = len(ratios)
        if n < 2:
            return
        median = statistics.median(ratios)
        verdict = t_test(ratios, P_EARLY)
        if verdict < 0 and median < 1.0:
            self._end_duel(challenger, f"{challenger} {median:.2f}x {incumbent}, faster in "
                                       f"{n} pairs (t-test, p<{P_EARLY})")
            return
        if verdict > 0:
            self._end_duel(incumbent, f"{challenger} {median:.2f}x {incumbent}, slower in {n} "
                                      f"pairs (t-test, p<{P_EARLY})")
            return
        if n == 3 and min(ratios) > PLAIN[0] and median > PLAIN[1]:  # slower in every pair
            self._end_duel(incumbent, f"{challenger} {median:.2f}x {incumbent}, slower in "
                                      "each of 3 pairs")
            return
        if n < self.min_pairs:
            return
        faster = sum(r < 1.0 for r in ratios)
        p_new = sign_test(faster, n)  # evidence the challenger is faster
        p_old = sign_test(n - faster, n)  # evidence the incumbent is faster
        if p_new < P_EARLY and median < 1.0:
            self._end_duel(challenger, f"{challenger} faster than {incumbent} in {faster} of "
                                       f"{n} pairs (p={p_new:.3f})")
        elif p_old < P_EARLY:
            self._end_duel(incumbent, f"{incumbent} faster than {challenger} in {n - faster} "
                                      f"of {n} pairs (p={p_old:.3f})")
        elif n >= self.max_pairs:
            if self._significantly_faster():
                self._end_duel(challenger, f"{challenger} faster than {incumbent} in {faster} "
                                           f"of {n} pairs (p<{P_FINAL})")
            else:
                self._end_duel(incumbent, f"{challenger} not faster than {incumbent} beyond "
                                          f"noise: faster in {faster} of {n} pairs "
                                          f"(p={p_new:.2f}), median ratio {median:.3f}")

    def _significantly_faster(self) -> bool:
        """The challenger is faster at :data:`P_FINAL` (the t-test or the sign test)."""
        ratios = self._ratios()
        if not ratios or statistics.median(ratios) >= 1.0:
            return False
        faster = sum(r < 1.0 for r in ratios)
        return t_test(ratios, P_FINAL) < 0 or sign_test(faster, len(ratios)) < P_FINAL

    # -- the budget ----------------------------------------------------------------------------
    def _observe_plan(self) -> None:
        plan = current_plan() if self.planned else None
        if plan is not None and plan.serial not in self._fits:
            self._fits[plan.serial] = plan.calls

    def _best_ms(self) -> float | None:
        timed = [statistics.median(v) for v in self._all.values() if v]
        return min(timed) if timed else None

    def run_seconds(self) -> float:
        """The run the budget is a share of: the planned fits at the best step time measured,
        or the time run so far, whichever is longer (plus the fused step's first call)."""
        elapsed = self._clock() - self._start
        best = self._best_ms()
        planned = 0.0
        if self._fits and best is not None and all(c for c in self._fits.values()):
            planned = sum(self._fits.values()) * best
        return self.first_call_s + max(elapsed, planned)

    def budget_seconds(self) -> float:
        """What the trial may cost so far (inf without a budget)."""
        if self.budget is None:
            return math.inf
        self._observe_plan()
        return self.budget * self.run_seconds()

    def _expense(self, form: str) -> float:
        """What running ``form`` next is expected to cost: its first call, or the time one of
        its steps takes beyond the best form's median."""
        if form not in self._warm:
            return expected_first_call(form, self.ops, self.first_call_s, self._cache)[0]
        best = self._best_ms()
        runs = self._all.get(form)
        if best is None or not runs:
            return 0.0
        return max(0.0, statistics.median(runs) - best)

    def _affordable(self, form: str) -> bool:
        return self._cost() + self._expense(form) <= self.budget_seconds()

    def _when_affordable(self, form: str) -> float:
        """The clock time at which the run so far makes a budget covering ``form`` (inf
        without a budget share)."""
        if not self.budget:
            return math.inf
        needed = (self._cost() + self._expense(form)) / self.budget - self.first_call_s
        return self._start + needed

    def _pause(self, form: str) -> None:
        """The budget does not cover running ``form`` next: keep the best form so far."""
        challenger, incumbent = self.challenger, self.incumbent
        if not self._ratios():  # no timed pair: the step that ran before the duel stays
            kept = challenger if challenger == "fused" and incumbent == "stock" else incumbent
            why = "it ran before this duel, which has no timed pair"
        else:
            kept = challenger if self._significantly_faster() else incumbent
            why = "the best so far (a challenger only if faster beyond noise)"
        expense = self._expense(form)
        budget = self.budget_seconds()
        what = (f"{form}'s first call (~{expense:.2f} s expected, "
                f"{expected_first_call(form, self.ops, self.first_call_s, self._cache)[1]})"
                if form not in self._warm else f"another {form} step (+{expense * 1e3:.2f} ms)")
        self._pause_why = (f"trial paused, its budget spent: {what} would take it past "
                           f"{budget:.2f} s ({self.budget:.0%} of the run's "
                           f"~{self.run_seconds():.1f} s); kept {kept}: {why}")
        if form == "xla" and form not in self._warm:
            self._xla_why = (f"XLA not tried: its compile, ~{expense:.2f} s expected, is more "
                             f"than the budget left ({max(0.0, budget - self._cost()):.2f} s)")
        self.kept, self._paused = kept, True
        self._learn_price()
        plan = current_plan() if self.planned else None
        self._pause_serial = plan.serial if plan is not None else None
        self._resume_at = self._when_affordable(form)

    # -- outcomes ------------------------------------------------------------------------------
    def remember(self, cache: Any, key: str) -> None:
        """Keep what a trial of this step kept before, in this process or on this machine
        (``cache``, a ``tfmx.tuner.TuningCache``, may be None); store this trial's outcome
        there when it ends."""
        self._cache = cache if cache is not None else self._cache
        self._key = key
        known = _decided.get(key)
        if known is None and cache is not None:
            known = cache.get(f"guard|{key}")
        forms = ("stock", self.challenger, *self._queue)
        if known is not None and known.choice in forms:
            self.kept = known.choice
            self._cached = known
            where = "in this process" if key in _decided else "on this machine"
            times = {f: t for f, t in known.times_ms.items() if f in forms}
            self._reasons.append(f"kept as a trial {where} decided before (cached: "
                                 + ", ".join(f"{f} {t:.2f} ms" for f, t in times.items()) + ")")
            gain = (times.get("fused", math.nan) - times.get(known.choice, math.nan)) / 1e3
            if self.budget is not None and known.choice != "fused" and not math.isnan(gain):
                self.kept = "fused"  # until what the kept form saves covers its first call
                self._switch = (known.choice, gain, math.nan)

    def _switch_worth_it(self) -> bool:
        """Whether switching to the form a cached outcome kept pays for its first call (it is
        traced or compiled afresh): over a fit's planned calls, or, without a plan, once the
        calls run in the fused form have lost as much as that first call costs."""
        form, gain, cost = self._switch
        if math.isnan(cost):
            cost = expected_first_call(form, self.ops, self.first_call_s, self._cache)[0]
            self._switch = (form, gain, cost)
        plan = current_plan() if self.planned else None
        self._calls += 1
        calls = plan.calls if plan is not None and plan.calls else self._calls
        if gain <= 0:
            self._pause_why = (f"the fused form runs: {form}'s median was not below it, so "
                               f"its first call (~{cost:.2f} s expected) would not pay")
            return False
        if calls * gain < cost:
            self._pause_why = (f"the fused form runs: {form}'s first call (~{cost:.2f} s "
                               f"expected) costs more than it saves over {calls} calls "
                               f"({gain * 1e3:.2f} ms each)")
            return False
        self._reasons.append(f"switched to {form}: its first call (~{cost:.2f} s expected) "
                             f"pays off over {calls} calls ({gain * 1e3:.2f} ms each)")
        self.kept, self._switch, self._pause_why = form, None, ""
        return True

    def _end_duel(self, winner: str, reason: str) -> None:
        self._reasons.append(reason)
        if not self._queue:
            self.kept = winner
            self._store()
            return
        self.incumbent, self.challenger = winner, self._queue.pop(0)
        self._pair = {self.challenger: [], self.incumbent: []}
        self._next = self.challenger

    def samples(self, form: str) -> list[float]:
        """Every timed run of ``form`` in the trial (seconds)."""
        return list(self._all.get(form, ()))

    def _learn_price(self) -> None:
        """What the trial measured of the step's price (:func:`learn_price`)."""
        med = {f: statistics.median(v) * 1e3 for f, v in self._all.items() if v}
        learn_price(self.price_key, self._cache, fused_first_s=self.first_call_s,
                    stock_first_s=self._warm.get("stock"), fused_ms=med.get("fused"),
                    stock_ms=med.get("stock"), ops=self.ops)

    def _store(self) -> None:
        self._learn_price()
        if not self._key:
            return
        from tfmx.tuner import Decision

        times = {f: statistics.median(v) * 1e3 for f, v in self._all.items() if v}
        forms = tuple(times)
        times["trial_s"] = self._cost()
        decision = Decision("guard", self._key, self.kept, forms, times, "measured")
        _decided[self._key] = decision
        if self._cache is not None:
            self._cache.put(decision)

    def summary(self) -> GuardRecord:
        """What was measured so far (medians in ms; from the cache for a remembered step)."""
        cached = self._cached

        def med(form: str) -> float:
            values = self._all.get(form)
            if not values and cached is not None and form in cached.times_ms:
                return cached.times_ms[form]
            return statistics.median(values) * 1e3 if values else float("nan")

        pairs = sum(len(v) for v in self._all.values()) // 2
        xla_why = self._xla_why
        if not xla_why and self._paused and "xla" in (self.challenger, *self._queue):
            expected, how = expected_first_call("xla", self.ops, self.first_call_s, self._cache)
            xla_why = (f"XLA not tried: the trial paused before its duel (its compile ~"
                       f"{expected:.2f} s expected, {how})")
        reasons = [*self._reasons, *([xla_why] if xla_why else []),
                   *([self._pause_why] if self._pause_why else [])]
        saved = float(cached.times_ms.get("trial_s", 0.0)) if cached is not None else 0.0
        budget = math.nan if self.budget is None or cached is not None else self.budget_seconds()
        return GuardRecord(self.function, self.kept or "undecided", med("fused"),
                           med("stock"), pairs, "; ".join(reasons), self._cost(),
                           med("xla"), final=not self._paused and self._switch is None,
                           budget_s=budget,
                           run_s=0.0 if cached is not None else self.run_seconds(),
                           xla_compile_s=self._warm.get("xla", math.nan), saved_s=saved)

    def _cost(self) -> float:
        """Seconds the trial added: the first calls of the forms other than fused (tracing,
        compiling), and every timed step beyond the median of the form kept (or of the fastest
        so far, while undecided)."""
        cost = sum(t for form, t in self._warm.items() if form != "fused")
        timed = {f: v for f, v in self._all.items() if v}
        if not timed:
            return cost
        kept = self.kept if self.kept in timed else min(
            timed, key=lambda f: statistics.median(timed[f]))
        base = statistics.median(timed[kept])
        return cost + max(0.0, sum(t - base for f, v in timed.items() if f != kept
                                   for t in v))

    def run(self, forms: Mapping[str, Callable[[], Any]]) -> Any:
        """Run the form :meth:`next_form` names (``forms``: name -> a call of it), timing it
        while the trial lasts. A challenger whose call raises loses its duel and the form
        kept so far runs instead."""
        form = self.next_form()
        if self.kept is not None:
            return forms[form]()
        delay = _test_delay.get(form, 0.0)
        start = time.perf_counter()
        if delay:
            time.sleep(delay)
        try:
            out = forms[form]()
        except Exception as exc:  # noqa: BLE001 - e.g. XLA cannot compile this step
            if form in ("fused", "stock"):
                raise
            self.failed(form, f"{type(exc).__name__}: {exc}")
            return self.run(forms)
        _sync(out)
        self.record(form, time.perf_counter() - start)
        return out


def _sync(outputs: Any) -> None:
    """Eager function calls return when their kernels are done, except on asynchronous
    devices: read one scalar-sized output back to be sure (cheap)."""
    import tensorflow as tf

    for t in tf.nest.flatten(outputs, expand_composites=True):
        if hasattr(t, "_numpy") and t.dtype != tf.variant and t.dtype != tf.resource:
            if t.shape.num_elements() is not None and t.shape.num_elements() <= 16:
                t._numpy()
                return


__all__ = ["Embedded", "FitPlan", "GateDecision", "GuardRecord", "StepGuard", "active_plan",
           "adopting", "budget_share", "closing_fit", "collecting", "current_plan", "embedded",
           "ending_callbacks", "expected_first_call", "fitting", "forced_form", "forcing",
           "forget", "learn_first_call", "learn_price", "plan_fit", "planning_callbacks",
           "price_figures", "price_gate", "set_test_delay", "t_test", "xla_pruned"]
