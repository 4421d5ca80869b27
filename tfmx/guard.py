"""The whole-step guard: on the first real steps, time the fused step against the stock one.

Every speed decision inside a step is measured (:mod:`tfmx.tuner`), but only the whole step says
whether the user's training got faster. So when tfmx changed a step, the first steps of ``fit``
(``evaluate``, ``predict``, a ``tfmx.function`` loop) run the fused and the stock step
alternately on the real batches: both are built from the same Python step function (the stock
one traced with no tfmx stage and no rewrite, as TensorFlow would run it), every step trains as
usual, nothing is computed twice. The trial (``tfmx.guard_trial``: a t-test and a sign test on
the pairs' time ratios) keeps the fused step only if it is faster beyond noise.
``tfmx.report()`` shows which was kept, both medians and what the trial cost.

On cpu and cuda the winner then meets a third form: the step compiled by XLA (the Python step
with ``jit_compile=True``, as Keras's own ``jit_compile=True`` builds it), kept only if faster
again beyond noise; one XLA cannot compile loses. Its compile is paid only where the trial's
budget covers the compile time expected on this machine. A step that reduces across replicas
is not tried (:func:`xla_pruned`: a correctness reason).

A trial costs at most ``tfmx.env.BUDGET_SHARE`` (2 %) of the run it serves
(``TFMX_GUARD_BUDGET``, ``tfmx.guard_budget``): where what it is about to pay does not fit, it
pauses, keeping the form best so far, and resumes when a later ``fit`` (or the time run) gives
it budget again. A finished trial's outcome is kept per step signature for the process and in
the tuner's cache on this machine (``tfmx.guard_outcome``): a later ``fit``, a new model of the
same architecture, a new process keep its form at once.

Before a fit's train step is first traced, the price gate (:func:`price_gate`) runs it as
stock, with no stage and no rewrite, where what this machine measured of the same step says
rewriting it cannot pay within the fit. Switch the guard off with ``tfmx.enable(guard=False)``
or ``TFMX_GUARD=0`` (the price gate is part of it); the XLA duel alone with
``tfmx.enable(xla=False)`` or ``TFMX_XLA=0``.

This module holds the trial's coordinator (:class:`StepGuard`: it runs and times the forms, with
the duels of ``tfmx.guard_trial``, the budget of ``tfmx.guard_budget`` and the outcome of
``tfmx.guard_outcome``) and how tfmx makes one (:func:`make_guard`). Importable from here too:
the trial's :data:`MIN_PAIRS` and :data:`MAX_PAIRS`, :func:`forget`, the fit's plan
(``tfmx.fit_plan``), first calls and the price gate (``tfmx.step_price``), the report's record
(``tfmx.guard_record``) and what a step tells the function it is traced into
(``tfmx.outer_trace``).

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
from tfmx.guard_budget import TrialBudget
from tfmx.guard_outcome import Switch, forget, learn_trial_price, recall, store, summarize
from tfmx.guard_record import GuardRecord
from tfmx.guard_trial import MAX_PAIRS, MIN_PAIRS, Trial
from tfmx.notice import announce, fit_key
from tfmx.outer_trace import Embedded, collecting, embedded, forced_form, forcing, switchable
from tfmx.step_price import (
    GateDecision,
    expect_first_call,
    expected_first_call,
    first_call_estimate,
    fits_before,
    learn_first_call,
    learn_price,
    price_figures,
    price_gate,
)
from tfmx.step_price import _prices as _prices
from tfmx.timing import sync_small as _sync
from tfmx.timing import t_test
from tfmx.tuning_cache import Decision


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
            expected_first_call(f, made.ops, 0.0, made.budget.cache)[0]
            for f in ("stock", *challengers) if f != "fused"))
    return made


class StepGuard:
    """The trial of one step function (see module doc): call :meth:`next_form`, run that form,
    :meth:`record` its time; once :attr:`decided`, :attr:`kept` names the form to run.

    It coordinates the trial's duels (:attr:`trial`, a ``tfmx.guard_trial.Trial``: each
    challenger, ``"fused"`` then ``"xla"`` where given, against the form kept so far, kept only
    if faster beyond noise; one whose first call fails, :meth:`failed`, loses), what they may
    spend (:attr:`budget`, a ``tfmx.guard_budget.TrialBudget``: with a ``budget`` share, the
    fused step is timed once first, it runs anyway; then the trial pays for nothing the budget
    does not cover, pausing and resuming) and its outcome (``tfmx.guard_outcome``: stored,
    recalled by :meth:`remember`, reported by :meth:`summary`). ``clock`` (seconds) can be
    injected; ``first_call_s`` is the fused step's first call where the caller timed it;
    ``ops`` the stock step's op count (for the expected cost of the other forms' first calls).

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
        self.trial = Trial(challengers, min_pairs, max_pairs, notes)
        self.budget = TrialBudget(self.trial, budget, planned, first_call_s, ops, cache, clock)
        self._key = ""  # the step's key of stored outcomes ("": none stored)
        self._cached: Decision | None = None  # the outcome recalled
        self._switch: Switch | None = None  # to the form recalled, where it pays
        self.price_key = ""  # the step's price record (see price_gate): what the trial learnt
        self.deferred = 0  # the tuner's decisions its fused form left unmeasured
        if budget is not None and self.trial.challenger in self.trial.warm:
            self.trial.next = self.trial.challenger  # one timed run of the step running first

    @property
    def kept(self) -> str | None:
        """The form kept (for good, for now while paused, or recalled), None while trying."""
        return self.trial.kept

    @property
    def first_call_s(self) -> float:
        """The fused step's first call (seconds), where the caller timed it."""
        return self.budget.first_call_s

    @first_call_s.setter
    def first_call_s(self, seconds: float) -> None:
        self.budget.first_call_s = seconds

    @property
    def ops(self) -> int:
        """The stock step's op count."""
        return self.budget.ops

    @property
    def decided(self) -> bool:
        """True once a form is kept: for good, or while a paused trial waits for budget (then
        it resumes here, on the first call its budget covers again)."""
        if self.kept is None:
            return False
        if self._switch is not None:
            plan = self.budget.plan()
            why = self._switch.pays(lambda form: self.budget.expected_first_call(form)[0],
                                    plan.calls if plan is not None else None)
            if why:
                self.trial.reasons.append(why)
                self.trial.kept, self._switch = self._switch.form, None
            return True
        return not self.budget.resumes()

    def warmed(self, form: str, first_call_s: float = 0.0) -> None:
        """``form``'s first call was paid before the trial (the fit ran it first, its first
        call taking ``first_call_s`` where timed): the trial times it from its next call, and
        counts no first call of it in its cost; stock's first call is what the other forms'
        are expected from (``tfmx.guard_budget.TrialBudget.expected_first_call``).

        >>> g = StepGuard("demo", budget=0.02)
        >>> g.warmed("stock")
        >>> g.record(g.next_form(), 0.010)  # fused: timed, paired at once
        >>> g.next_form(), g.trial.cost()
        ('stock', 0.0)
        """
        self.trial.warm.setdefault(form, 0.0)
        if form == "stock" and first_call_s > 0:
            self.budget.stock_first_s = first_call_s

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
        self.budget.lift()

    def next_form(self) -> str:
        """The form to run next: alternates during the trial (pausing it if the budget does
        not cover what the next run would cost), then the kept one."""
        if self.kept is not None:
            return self.kept
        form = self.trial.next
        if self.budget.share is not None and not self.budget.affordable(form):
            self.budget.pause(form)
            learn_trial_price(self.price_key, self.trial, self.budget, self.deferred)
            return self.kept
        if form == "xla" and form not in self.trial.warm:
            self.budget.note_xla_expected()
        return form

    def record(self, form: str, seconds: float) -> None:
        """Record one run of ``form`` (its first run only warms it up)."""
        if self.kept is not None:
            return
        if form not in self.trial.warm:
            learn_first_call(form, seconds, self.ops, self.budget.cache)
            if form == "xla":
                self.budget.note_xla_compiled(seconds)
        if self.trial.record(form, seconds):
            self._finish()

    def failed(self, form: str, why: str) -> None:
        """``form`` could not run (e.g. XLA could not compile the step): it loses its duel."""
        if self.kept is None and self.trial.failed(form, why):
            self._finish()

    def samples(self, form: str) -> list[float]:
        """Every timed run of ``form`` in the trial (seconds)."""
        return self.trial.samples(form)

    def remember(self, cache: Any, key: str) -> None:
        """Keep what a trial of this step kept before, in this process or on this machine
        (``cache``, a ``tfmx.tuning_cache.TuningCache``, may be None); store this trial's outcome
        there when it ends."""
        self.budget.cache = cache if cache is not None else self.budget.cache
        self._key = key
        known, switch = recall(self.trial, key, cache, self.budget.share is not None)
        if known is not None:
            self._cached, self._switch = known, switch

    def _finish(self) -> None:
        """The last duel ended: what the trial measured is learnt, its outcome stored."""
        learn_trial_price(self.price_key, self.trial, self.budget, self.deferred)
        if self._key:
            store(self._key, self.trial, self.budget.cache)

    def summary(self) -> GuardRecord:
        """What was measured so far (medians in ms; from the cache for a remembered step)."""
        return summarize(self.function, self.trial, self.budget, self._cached, self._switch)

    def run(self, forms: Mapping[str, Callable[[], Any]]) -> Any:
        """Run the form :meth:`next_form` names (``forms``: name -> a call of it), timing it
        while the trial lasts. A challenger whose call raises loses its duel and the form
        kept so far runs instead."""
        form = self.next_form()
        if self.kept is not None:
            return forms[form]()
        start = time.perf_counter()
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


__all__ = ["ENV_XLA", "MAX_PAIRS", "MIN_PAIRS", "Embedded", "FitPlan", "GateDecision",
           "GuardRecord", "StepGuard", "active_plan", "adopting", "budget_share", "closing_fit",
           "collecting", "current_plan", "embedded", "enabled_by_env", "ending_callbacks",
           "expect_first_call", "expected_first_call", "first_call_estimate", "fitting",
           "forced_form", "forcing", "forget",
           "learn_first_call", "learn_price", "make_guard", "plan_fit", "planning_callbacks",
           "fits_before", "price_figures", "price_gate", "switchable", "t_test", "xla_pruned"]
