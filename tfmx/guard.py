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

The budget: a trial costs at most ``tfmx.env.BUDGET_SHARE`` (2 %) of the run it serves
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

Before a fit's train step is first traced, the price gate (:func:`price_gate`) runs it as
stock, with no stage and no rewrite, where what this machine measured of the same step says
rewriting it cannot pay within the fit. Switch the guard off with ``tfmx.enable(guard=False)``
or ``TFMX_GUARD=0`` (the price gate is part of it); the XLA duel alone with
``tfmx.enable(xla=False)`` or ``TFMX_XLA=0``.

This module holds the trial (:class:`StepGuard`) and how tfmx makes one (:func:`make_guard`).
Importable from here too: the fit's plan (``tfmx.fit_plan``), first calls and the price gate
(``tfmx.step_price``), the report's record (``tfmx.guard_record``) and what a step tells the
function it is traced into (``tfmx.outer_trace``).

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

import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

from tfmx.env import ENV_XLA, budget_share, enabled_by_env
from tfmx.fit_plan import (
    FitPlan,
    active_plan,
    adopting,
    closing_fit,
    current_plan,
    ending_callbacks,
    fitting,
    plan_fit,
    planning_callbacks,
)
from tfmx.guard_record import GuardRecord
from tfmx.notice import announce, fit_key
from tfmx.outer_trace import Embedded, collecting, embedded, forced_form, forcing, switchable
from tfmx.step_price import (
    GateDecision,
    expected_first_call,
    forget_prices,
    learn_first_call,
    learn_price,
    price_figures,
    price_gate,
)
from tfmx.step_price import _prices as _prices
from tfmx.timing import sign_test, t_test
from tfmx.timing import sync_small as _sync
from tfmx.tuning_cache import Decision

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

_test_delay = {"fused": 0.0, "stock": 0.0, "xla": 0.0}


def set_test_delay(fused: float = 0.0, stock: float = 0.0, xla: float = 0.0) -> None:
    """Test hook: every step of that form a guard runs during its trial sleeps so many seconds
    more (the default, 0, turns it off).

    >>> set_test_delay(fused=0.002)
    >>> set_test_delay()  # off again
    """
    _test_delay.update(fused=float(fused), stock=float(stock), xla=float(xla))


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
    forget_prices()


def make_guard(function: str, opts: Any, ops: Mapping[str, int], signature: str = "",
               cache: Any = None, planned: bool = False, replicas: int = 1) -> StepGuard:
    """The guard for one step under ``opts`` (``tfmx.state.Options``): its challengers, with
    XLA left out where :func:`xla_pruned` says so (``replicas``: the replicas the step runs in;
    the report says why), its budget
    (:func:`budget_share`; ``planned``: the step is a fit's train step, whose plan
    :func:`plan_fit` announces). With the step's ``signature``, what a trial kept for the same
    step before in this process, or on this machine (a ``tfmx.tuning_cache.TuningCache``), is
    kept at once, and a new trial's outcome is stored."""
    challengers = opts.guard_challengers()
    why = xla_pruned(opts.backend.name, ops, replicas) if "xla" in challengers else None
    if why:
        challengers = tuple(c for c in challengers if c != "xla")
    made = StepGuard(function, challengers, notes=(f"XLA not tried: {why}",) if why else (),
                     budget=budget_share(), planned=planned, ops=sum(ops.values()),
                     cache=cache)
    if signature:
        made.remember(cache, f"{function} {signature}")
    if made.kept is None:  # a trial to run: the first measuring of a fit says so once
        announce(fit_key(function), 1 + len(challengers), lambda: sum(
            expected_first_call(f, made.ops, 0.0, made._cache)[0]
            for f in ("stock", *challengers) if f != "fused"))
    return made


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

    def warmed(self, form: str) -> None:
        """``form``'s first call was paid before the trial (the fit ran it first): the trial
        times it from its next call, and counts no first call of it in its cost.

        >>> g = StepGuard("demo", budget=0.02)
        >>> g.warmed("stock")
        >>> g.record(g.next_form(), 0.010)  # fused: timed, paired at once
        >>> g.next_form(), g._cost()
        ('stock', 0.0)
        """
        self._warm.setdefault(form, 0.0)

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
        (``cache``, a ``tfmx.tuning_cache.TuningCache``, may be None); store this trial's outcome
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


__all__ = ["ENV_XLA", "Embedded", "FitPlan", "GateDecision", "GuardRecord", "StepGuard",
           "active_plan", "adopting", "budget_share", "closing_fit", "collecting", "current_plan",
           "embedded", "enabled_by_env", "ending_callbacks", "expected_first_call", "fitting",
           "forced_form", "forcing", "forget", "learn_first_call", "learn_price", "plan_fit",
           "planning_callbacks", "price_figures", "price_gate", "set_test_delay", "switchable",
           "t_test", "xla_pruned"]
