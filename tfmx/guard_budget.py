"""What a whole-step guard's trial may spend: a share of the run it serves, and its pauses.

A trial costs at most ``tfmx.env.BUDGET_SHARE`` (2 %) of the run it serves
(``TFMX_GUARD_BUDGET``). Its cost (``tfmx.guard_trial.Trial.cost``) is the first calls of the
forms other than fused (tracing, compiling) and the time every slower step took beyond the best
form's median. The run's time is what Keras's ``fit`` plans (epochs x steps per epoch, from its
callbacks' params: see ``tfmx.fit_plan.plan_fit``) at the best step time measured, or, where no
plan is known (a custom loop, ``evaluate``, ``predict``, a dataset of unknown length), the time
the run has taken so far. Before each run the trial checks that what it is about to pay (a
form's first call, or a slower step) fits in what is left; if not, it pauses and keeps the form
best so far on the evidence, conservatively (``tfmx.guard_trial.Trial.best_so_far``): a
challenger only if faster beyond noise, the fused step when stock was never run (it is the step
already running). A paused trial resumes when a later ``fit`` (or the time run) gives it budget
again.

XLA's compile (its first call) is paid only when the budget covers the compile time expected on
this machine (``tfmx.step_price.expected_first_call``, learnt from the first calls measured
here), and its measured compile time counts against the budget.

Example (a 2 % budget of a 40-step fit of 10 ms steps: stock's 5 s trace does not fit):
    >>> from tfmx.fit_plan import plan_fit
    >>> from tfmx.guard_budget import TrialBudget
    >>> from tfmx.guard_trial import Trial
    >>> trial = Trial()
    >>> budget = TrialBudget(trial, 0.02, planned=True, first_call_s=5.0)
    >>> _ = plan_fit(1, 40)
    >>> _ = trial.record("fused", 0.010)
    >>> budget.affordable("stock"), round(budget.seconds(), 3)
    (False, 0.108)
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from tfmx.fit_plan import FitPlan, current_plan
from tfmx.guard_trial import Trial
from tfmx.step_gain import GAIN_MARGIN, expected_gain
from tfmx.step_price import expected_first_call


class TrialBudget:
    """What ``trial`` may cost (see module doc): ``share`` of the run (None: no budget),
    ``planned``: the step is a fit's train step, whose plan ``tfmx.fit_plan.plan_fit``
    announces; ``first_call_s`` the fused step's first call where the caller timed it; ``ops``
    the stock step's op count and ``cache`` the machine's tuning cache (for the expected cost
    of the other forms' first calls); ``clock`` (seconds) can be injected. While the trial is
    :attr:`paused`, :attr:`why` says why.

    >>> budget = TrialBudget(Trial(), None)
    >>> budget.seconds(), budget.affordable("stock")
    (inf, True)
    """

    def __init__(self, trial: Trial, share: float | None, planned: bool = False,
                 first_call_s: float = 0.0, ops: int = 0, cache: Any = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.trial = trial
        self.share = share
        self.planned = planned
        self.first_call_s = first_call_s
        self.ops = ops
        self.cache: Any = cache  # the machine's tuning cache: learnt first calls
        self.clock = clock
        self.start = clock()
        self.fits: dict[int, int | None] = {}  # fit serial -> its planned calls
        self.paused = False
        self.why = ""  # why the trial paused
        self.serial: int | None = None  # the fit it paused in
        self.resume_at = math.inf
        self.xla_why = ""  # why XLA was compiled, or not
        self.stock_first_s = 0.0  # stock's first call, where the fit ran it before the trial
        self.on_prior = False  # XLA's compile is paid on the gain expected of it
        self.prior_paid = 0.0  # that compile, once paid: outside the trial's share

    def plan(self) -> FitPlan | None:
        """The plan of the fit under way, for a fit's train step (else None)."""
        return current_plan() if self.planned else None

    def expected_first_call(self, form: str) -> tuple[float, str]:
        """Seconds ``form``'s first call is expected to take, and how that was estimated: from
        this step's stock first call where it was timed (in the trial, or before it,
        :attr:`stock_first_s`), else its fused one or its op count
        (``tfmx.step_price.expected_first_call``).

        >>> trial = Trial()
        >>> budget = TrialBudget(trial, 0.02, first_call_s=3.0, ops=100)
        >>> _ = trial.record("stock", 2.0)  # stock's first call, timed in the trial
        >>> budget.expected_first_call("xla")[0]  # the seed: twice stock's
        4.0
        """
        stock = self.trial.warm.get("stock") or self.stock_first_s
        return expected_first_call(form, self.ops, self.first_call_s, self.cache, stock)

    def run_seconds(self) -> float:
        """The run the budget is a share of: the planned fits at the best step time measured,
        or the time run so far, whichever is longer (plus the fused step's first call).

        >>> TrialBudget(Trial(), 0.02, first_call_s=2.0, clock=lambda: 0.0).run_seconds()
        2.0
        """
        elapsed = self.clock() - self.start
        best = self.trial.best_s()
        planned = 0.0
        if self.fits and best is not None and all(c for c in self.fits.values()):
            planned = sum(self.fits.values()) * best
        return self.first_call_s + max(elapsed, planned)

    def seconds(self) -> float:
        """What the trial may cost so far (inf without a budget)."""
        if self.share is None:
            return math.inf
        plan = self.plan()
        if plan is not None and plan.serial not in self.fits:
            self.fits[plan.serial] = plan.calls
        return self.share * self.run_seconds()

    def expense(self, form: str) -> float:
        """What running ``form`` next is expected to cost: its first call, or the time one of
        its steps takes beyond the best form's median."""
        if form not in self.trial.warm:
            return self.expected_first_call(form)[0]
        best = self.trial.best_s()
        runs = self.trial.timed.get(form)
        if best is None or not runs:
            return 0.0
        return max(0.0, statistics.median(runs) - best)

    def spent(self) -> float:
        """What the trial cost against its budget: :meth:`Trial.cost` less an XLA compile
        paid on the gain expected of it (:meth:`xla_pays_on_prior`: the fit's saving pays
        for it, not the trial's share)."""
        return self.trial.cost() - self.prior_paid

    def affordable(self, form: str) -> bool:
        """Whether the budget left covers running ``form`` next, or, for XLA's compile, the
        saving expected of XLA's step over the fit covers it (:meth:`xla_pays_on_prior`)."""
        if self.spent() + self.expense(form) <= self.seconds():
            return True
        return form == "xla" and form not in self.trial.warm and self.xla_pays_on_prior()

    def xla_pays_on_prior(self) -> bool:
        """Whether XLA's step, expected at the ratio of stock's XLA's steps ran at on this
        machine (``tfmx.step_gain.expected_gain``), saves over the fit's calls left more than
        ``tfmx.step_gain.GAIN_MARGIN`` times its expected compile, against the best form so
        far; said in :attr:`xla_why`.

        >>> from tfmx.fit_plan import plan_fit
        >>> from tfmx.step_gain import learn_gain
        >>> trial = Trial()
        >>> budget = TrialBudget(trial, 0.02, planned=True, first_call_s=1.0)
        >>> _ = plan_fit(1, 2000)
        >>> for form in ("fused", "stock") * 3:
        ...     _ = trial.record(form, {"fused": 0.050, "stock": 0.060}[form])
        >>> budget.xla_pays_on_prior()  # no XLA step measured here: no gain expected
        False
        >>> learn_gain(30.0, 60.0, form="xla")  # XLA ran 0.5 x stock's here
        >>> budget.xla_pays_on_prior(), budget.xla_why[:42]
        (True, 'XLA tried on the gain expected of it: 0.50')
        >>> from tfmx.first_call import forget_first_calls
        >>> forget_first_calls()
        """
        plan = self.plan()
        best = self.trial.best_s()
        stock = self.trial.timed.get("stock")
        if plan is None or not plan.calls or best is None or not stock:
            return False
        ratio, how = expected_gain(self.cache, "xla")
        per_call = best - statistics.median(stock) * ratio
        left = plan.calls - sum(len(v) for v in self.trial.timed.values())
        compile_s, compile_how = self.expected_first_call("xla")
        if per_call <= 0 or left * per_call <= GAIN_MARGIN * compile_s:
            return False
        self.on_prior = True
        self.xla_why = (f"XLA tried on the gain expected of it: {ratio:.2f} x stock's step "
                        f"({how}) saves ~{left * per_call:.2f} s over the {left} calls left, "
                        f"more than {GAIN_MARGIN:g} x its compile (~{compile_s:.2f} s "
                        f"expected, {compile_how})")
        return True

    def when_affordable(self, form: str) -> float:
        """The clock time at which the run so far makes a budget covering ``form`` (inf
        without a budget share)."""
        if not self.share:
            return math.inf
        needed = (self.spent() + self.expense(form)) / self.share - self.first_call_s
        return self.start + needed

    def pause(self, form: str) -> None:
        """The budget does not cover running ``form`` next: the trial keeps the best form so
        far, until a new fit or the time run covers ``form``.

        >>> trial = Trial()
        >>> budget = TrialBudget(trial, 0.0, ops=100)
        >>> budget.pause("stock")
        >>> trial.kept, budget.paused, budget.why[:27]
        ('fused', True, 'trial paused, its budget sp')
        """
        trial = self.trial
        kept, why = trial.best_so_far()
        expense = self.expense(form)
        budget = self.seconds()
        what = (f"{form}'s first call (~{expense:.2f} s expected, "
                f"{self.expected_first_call(form)[1]})"
                if form not in trial.warm else f"another {form} step (+{expense * 1e3:.2f} ms)")
        self.why = (f"trial paused, its budget spent: {what} would take it past "
                    f"{budget:.2f} s ({self.share:.0%} of the run's "
                    f"~{self.run_seconds():.1f} s); kept {kept}: {why}")
        if form == "xla" and form not in trial.warm:
            self.xla_why = (f"XLA not tried: its compile, ~{expense:.2f} s expected, is more "
                            f"than the budget left ({max(0.0, budget - self.spent()):.2f} s)")
        trial.kept, self.paused = kept, True
        plan = self.plan()
        self.serial = plan.serial if plan is not None else None
        self.resume_at = self.when_affordable(form)

    def resumes(self) -> bool:
        """Whether a paused trial resumes now: a new fit, or the time run, covers its next
        run (the trial then keeps no form; it runs on from its evidence)."""
        if not self.paused:
            return False
        plan = self.plan()
        new_fit = plan is not None and plan.serial != self.serial
        if not new_fit and self.clock() < self.resume_at:
            return False
        if self.affordable(self.trial.next):
            self.trial.kept, self.paused, self.why = None, False, ""
            return True
        self.serial = plan.serial if plan is not None else None
        self.resume_at = self.when_affordable(self.trial.next)
        return False

    def lift(self) -> None:
        """No budget from now on: a paused trial resumes on the next call.

        >>> budget = TrialBudget(Trial(), 0.02)
        >>> budget.lift()
        >>> budget.share is None
        True
        """
        self.share = None
        if self.paused:
            self.trial.kept, self.paused, self.why = None, False, ""

    def note_xla_expected(self) -> None:
        """XLA's compile is about to be paid: what it was expected to cost, and what was left."""
        if self.on_prior:  # xla_why says what it is expected to save
            return
        expected, how = self.expected_first_call("xla")
        left = self.seconds() - self.spent()
        self.xla_why = (f"expected ~{expected:.2f} s, {how}; budget left {left:.2f} s"
                        if self.share is not None else "no budget")

    def note_xla_compiled(self, seconds: float) -> None:
        """XLA's compile took ``seconds`` (outside the trial's share where it was paid on the
        gain expected of it)."""
        if self.on_prior:
            self.prior_paid = seconds
        self.xla_why = f"XLA tried: compiled in {seconds:.2f} s ({self.xla_why})"

    def xla_note(self) -> str:
        """For the report: why XLA was compiled or not, "" where it says nothing."""
        if self.xla_why or not self.paused or "xla" not in self.trial.forms()[1:]:
            return self.xla_why
        expected, how = self.expected_first_call("xla")
        return (f"XLA not tried: the trial paused before its duel (its compile ~"
                f"{expected:.2f} s expected, {how})")


__all__ = ["TrialBudget"]
