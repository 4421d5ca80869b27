"""A whole-step guard's outcome: the form kept, reused by later runs, and the report's record.

A finished trial's outcome is kept per step signature for the process and in the tuner's cache
on this machine (``tune="auto"``): a later ``fit``, a new model of the same architecture, a new
process keep its form at once (:func:`recall`), and the report says what the trial had cost
(what the reuse saved). Where that form is not the fused step and the trial has a budget, the
fused step runs until switching pays for the other form's first call (:class:`Switch`). What a
trial measured of the step's price is learnt for the price gate (:func:`learn_trial_price`);
:func:`summarize` makes the report's record (``tfmx.guard_record.GuardRecord``) of a trial.

Example (a trial's outcome stored, then recalled by a new trial of the same step):
    >>> from tfmx.guard_outcome import forget, recall, store
    >>> from tfmx.guard_trial import Trial
    >>> done = Trial()
    >>> done.kept = "stock"
    >>> store("demo step", done, None)
    >>> again = Trial()
    >>> recall(again, "demo step", None, budgeted=False)[0].choice, again.kept
    ('stock', 'stock')
    >>> forget()
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from typing import Any

from tfmx.guard_budget import TrialBudget
from tfmx.guard_record import GuardRecord
from tfmx.guard_trial import Trial
from tfmx.step_price import forget_prices, learn_price
from tfmx.tuning_cache import Decision

_decided: dict[str, Decision] = {}  # step key -> the tuner Decision a trial stored, this process


def forget() -> None:
    """Drop what this process learnt (trials' outcomes, first calls measured); the machine's
    tuning cache keeps its copy.

    >>> forget()
    """
    _decided.clear()
    forget_prices()


def store(key: str, trial: Trial, cache: Any) -> None:
    """Keep the outcome of ``trial`` (ended) of the step ``key``: its form, each form's median
    and what the trial cost, for this process and, with ``cache`` (a
    ``tfmx.tuning_cache.TuningCache``), for this machine."""
    times = trial.medians_ms()
    forms = tuple(times)
    times["trial_s"] = trial.cost()
    decision = Decision("guard", key, trial.kept, forms, times, "measured")
    _decided[key] = decision
    if cache is not None:
        cache.put(decision)


@dataclasses.dataclass
class Switch:
    """A recalled outcome's ``form``, other than the fused step that runs meanwhile: it saves
    ``gain`` seconds a call, and its first call (traced or compiled afresh) costs ``cost``
    (expected, nan until first asked). :attr:`why` says why the fused step still runs.

    >>> switch = Switch("stock", gain=0.002)
    >>> switch.pays(lambda form: 1.0, planned_calls=48) is None, switch.why[:21]
    (True, 'the fused form runs: ')
    >>> switch.pays(lambda form: 1.0, planned_calls=5000)[:19]
    'switched to stock: '
    """

    form: str
    gain: float
    cost: float = math.nan
    calls: int = 0  # calls asked about, for a run without a plan
    why: str = ""

    def pays(self, expected: Callable[[str], float], planned_calls: int | None) -> str | None:
        """Whether switching pays for the form's first call (``expected(form)``, seconds): over
        a fit's ``planned_calls``, or, without a plan, once the calls run in the fused form
        have lost as much as that first call costs. The report's reason where it does, else
        None (:attr:`why` then says why not)."""
        if math.isnan(self.cost):
            self.cost = expected(self.form)
        self.calls += 1
        form, gain, cost = self.form, self.gain, self.cost
        calls = planned_calls or self.calls
        if gain <= 0:
            self.why = (f"the fused form runs: {form}'s median was not below it, so its first "
                        f"call (~{cost:.2f} s expected) would not pay")
            return None
        if calls * gain < cost:
            self.why = (f"the fused form runs: {form}'s first call (~{cost:.2f} s expected) "
                        f"costs more than it saves over {calls} calls ({gain * 1e3:.2f} ms "
                        "each)")
            return None
        self.why = ""
        return (f"switched to {form}: its first call (~{cost:.2f} s expected) pays off over "
                f"{calls} calls ({gain * 1e3:.2f} ms each)")


def recall(trial: Trial, key: str, cache: Any, budgeted: bool
           ) -> tuple[Decision | None, Switch | None]:
    """Keep in ``trial`` what a trial of the step ``key`` kept before, in this process or on
    this machine (``cache``, a ``tfmx.tuning_cache.TuningCache``, may be None), if it is one
    of its forms: that outcome, and (``budgeted``: the trial has a budget) the
    :class:`Switch` to its form where that is not the fused step (kept meanwhile)."""
    known = _decided.get(key)
    if known is None and cache is not None:
        known = cache.get(f"guard|{key}")
    forms = trial.forms()
    if known is None or known.choice not in forms:
        return None, None
    trial.kept = known.choice
    where = "in this process" if key in _decided else "on this machine"
    times = {f: t for f, t in known.times_ms.items() if f in forms}
    trial.reasons.append(f"kept as a trial {where} decided before (cached: "
                         + ", ".join(f"{f} {t:.2f} ms" for f, t in times.items()) + ")")
    gain = (times.get("fused", math.nan) - times.get(known.choice, math.nan)) / 1e3
    if budgeted and known.choice != "fused" and not math.isnan(gain):
        trial.kept = "fused"  # until what the kept form saves covers its first call
        return known, Switch(known.choice, gain)
    return known, None


def learn_trial_price(key: str, trial: Trial, budget: TrialBudget, deferred: int = 0) -> None:
    """What ``trial`` measured of the price of the step ``key``
    (``tfmx.step_price.learn_price``): the forms' first calls and both forms' medians, and
    how many of the tuner's decisions the fused form left unmeasured (``deferred``)."""
    med = trial.medians_ms()
    learn_price(key, budget.cache, fused_first_s=budget.first_call_s,
                stock_first_s=trial.warm.get("stock"), xla_first_s=trial.warm.get("xla"),
                fused_ms=med.get("fused"), stock_ms=med.get("stock"), xla_ms=med.get("xla"),
                ops=budget.ops,
                fused_deferred=float(deferred) if med.get("fused") else None)


def summarize(function: str, trial: Trial, budget: TrialBudget, cached: Decision | None,
              switch: Switch | None) -> GuardRecord:
    """The report's record of the trial of ``function``: what was measured so far (medians in
    ms; from ``cached``, the outcome recalled, for a step kept from it), why, what it cost.

    >>> trial = Trial()
    >>> summarize("M.step", trial, TrialBudget(trial, None), None, None).kept
    'undecided'
    """

    def med(form: str) -> float:
        values = trial.timed.get(form)
        if not values and cached is not None and form in cached.times_ms:
            return cached.times_ms[form]
        return statistics.median(values) * 1e3 if values else float("nan")

    pairs = sum(len(v) for v in trial.timed.values()) // 2
    notes = (budget.xla_note(), budget.why, switch.why if switch is not None else "")
    reasons = [*trial.reasons, *(note for note in notes if note)]
    saved = float(cached.times_ms.get("trial_s", 0.0)) if cached is not None else 0.0
    spent = math.nan if budget.share is None or cached is not None else budget.seconds()
    return GuardRecord(function, trial.kept or "undecided", med("fused"), med("stock"), pairs,
                       "; ".join(reasons), trial.cost(), med("xla"),
                       final=not budget.paused and switch is None, budget_s=spent,
                       run_s=0.0 if cached is not None else budget.run_seconds(),
                       xla_compile_s=trial.warm.get("xla", math.nan), saved_s=saved)


__all__ = ["Switch", "forget", "learn_trial_price", "recall", "store", "summarize"]
