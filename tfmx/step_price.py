"""What a step costs on this machine, and whether rewriting it pays within a fit.

First calls: tracing, rewriting or compiling a form of a step is paid on its first call.
What a form's first call is expected to cost here (``tfmx.first_call``: the ratio of its first
calls to stock's learnt on this machine, times the step's own stock first call) is what the
gate and the whole-step guard weigh before paying it; :func:`learn_price` teaches that ratio
whenever a step's price record holds both first calls. Where the gate runs tfmx on such an
estimate, :func:`expect_first_call` keeps it and :func:`first_call_estimate` pairs it with the
first call measured, for the report (how far the estimate was off).

The price gate: before a fit's train step is first traced, :func:`price_gate` asks whether
rewriting it can pay within this fit: from the fit's plan and what this machine measured of
the same step before (its price record, :func:`price_figures`, keyed by what the step is
before it is traced: the fused and stock first calls, each form's median), it runs the step as
stock, with no stage and no rewrite, where the rewrite's extra first call is more than the
fused step saves over the planned calls, or, where one form's step was never measured, more
than the trial's budget; the report says so with the figures. With nothing measured of the
step yet, stock runs first where the fit's loop can change form mid-fit
(``tfmx.dispatch``): its first calls are timed, and the gate asks again for the calls left
(``traced=True``: stock's first call is then paid), so tfmx's form is traced within the same
fit only if the rest of the fit can pay for it. Elsewhere (no such loop), tfmx runs and the
guard's trial records the figures (:func:`learn_price`).

What is learnt is kept for the process and, given the machine's tuning cache
(``tfmx.tuning_cache.TuningCache``), for this machine.

Example:
    >>> from tfmx.step_price import price_gate
    >>> price_gate({}, 100).run, price_gate({"fused_first_s": 1.0, "fused_ms": 5.0}, None).why
    ('tfmx', "no plan of the fit's length")
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from tfmx.env import BUDGET_SHARE
from tfmx.first_call import (
    FUSED_SEED,
    SEED_S_PER_OP,
    XLA_SEED,
    expected_first_call,
    forget_first_calls,
    learn_first_call,
    learn_first_call_ratio,
    learnt_ratio,
    learnt_stock_first_call,
)
from tfmx.step_gain import learn_gain, pays_on_prior
from tfmx.tuning_cache import Decision

FIRST_CALL_FORMS = ("fused", "xla")
"""The forms whose first call a price record may hold beside stock's (``<form>_first_s``):
each pair of a form's and stock's first call teaches the form's ratio
(``tfmx.first_call.learn_first_call_ratio``)."""

PRICE_FAMILY = "price"
"""The tuner cache's family of price records: per step (before it is traced), what its first
calls and steps cost in each form, as measured here."""

_prices: dict[str, dict[str, float]] = {}  # price key -> figures learnt in this process
_fits: dict[str, tuple[int, int]] = {}  # price key -> (the fit counted, fits of it before)


def price_figures(key: str, cache: Any = None) -> dict[str, float]:
    """What was measured on this machine of the step ``key``: ``fused_first_s`` and
    ``stock_first_s`` (the first call of the fit's loop: tracing, rewriting, graph
    optimization, one step), ``fused_ms``, ``stock_ms`` and ``xla_ms`` (medians of a call),
    ``fused_deferred`` (:func:`provisional`), ``ops``, ``fits`` (:func:`fits_before`).

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
    """Record ``figures`` (see :func:`price_figures`; ``xla_first_s`` too) of the step ``key``
    for this process and, with ``cache`` (a ``tfmx.tuning_cache.TuningCache``), for this
    machine. A first call that is new beside the other form's (a form's and stock's of the
    same step) teaches the form's ratio to stock's (``tfmx.first_call``).

    >>> from tfmx.first_call import learnt_ratio
    >>> learn_price("demo pair", stock_first_s=2.0)
    >>> learn_price("demo pair", fused_first_s=2.5)
    >>> learn_price("demo pair", fused_first_s=2.5, fused_ms=4.0)  # the same first call
    >>> learnt_ratio("fused")
    (1.25, 1)
    >>> forget_prices()
    """
    if not key:
        return
    new = {k: float(v) for k, v in figures.items()
           if v is not None and math.isfinite(float(v))
           # zero: not measured (a first call, a median, ops), but for fused_deferred: every
           # tuner decision measured, a figure that must replace an earlier provisional one
           and (float(v) > 0 or (k == "fused_deferred" and float(v) == 0))}
    if not new:
        return
    known = price_figures(key, cache)
    merged = {**known, **new}
    _prices[key] = merged
    if cache is not None:
        cache.put(Decision(PRICE_FAMILY, key, "figures", (), merged, "measured"))
    for form in FIRST_CALL_FORMS:  # what each form gains over stock, for the priors
        name = f"{form}_ms"
        if (merged.get(name) and merged.get("stock_ms")
                and not (form == "fused" and provisional(merged))
                and any(known.get(k) != new[k] for k in (name, "stock_ms") if k in new)):
            learn_gain(merged[name], merged["stock_ms"], cache, form)
    fresh = {k for k, v in new.items() if k.endswith("_first_s") and known.get(k) != v}
    stock = merged.get("stock_first_s", 0.0)
    for form in FIRST_CALL_FORMS:
        name = f"{form}_first_s"
        if stock and merged.get(name) and fresh & {name, "stock_first_s"}:
            learn_first_call_ratio(form, merged[name], stock, cache)


def fits_before(key: str, serial: int, cache: Any = None) -> int:
    """How many fits of the step ``key`` ran on this machine before the fit numbered
    ``serial`` (a ``tfmx.fit_plan.FitPlan``'s ``serial``), which it counts (once, however
    often it is asked): the ``fits`` of its price record. A step fitted before is likely to be
    fitted again, and what the tuner measures in one fit is kept for the next
    (``tfmx.tuner.RETURNING_FITS``).

    >>> fits_before("demo fits", 1), fits_before("demo fits", 1), fits_before("demo fits", 2)
    (0, 0, 1)
    >>> forget_prices()
    """
    counted = _fits.get(key)
    if counted is not None and counted[0] == serial:
        return counted[1]
    before = int(price_figures(key, cache).get("fits", 0))
    _fits[key] = (serial, before)
    learn_price(key, cache, fits=before + 1)
    return before


def provisional(figures: Mapping[str, float]) -> int:
    """How many of the tuner's decisions the fused step measured in ``figures`` left
    unmeasured (``fused_deferred``: its measuring budget spent, each took Keras's form): its
    median is then a provisional figure of what tfmx's form of the step gains, which a later
    trace (the tuner measuring on) may better.

    >>> provisional({"fused_ms": 40.0, "fused_deferred": 3.0}), provisional({"fused_ms": 40.0})
    (3, 0)
    """
    return int(figures.get("fused_deferred", 0.0)) if figures.get("fused_ms") else 0


@dataclasses.dataclass(frozen=True)
class GateDecision:
    """The price gate's verdict on one fit's step: ``run`` is ``"tfmx"`` (traced with the
    stages, rewritten, guarded) or ``"stock"`` (as TensorFlow alone traces it), and why."""

    run: str
    why: str
    expected_s: float = 0.0  # tfmx's first call as estimated (0: measured, or not weighed)
    expected_how: str = ""  # how it was estimated
    extra_s: float = 0.0  # tfmx's first call beyond stock's, as weighed (0: not weighed)
    pays_from: int = 0  # the fit's calls from which the gate would run tfmx (0: unknown)

    def describe(self, function: str) -> str:
        """The report's line: ``price gate: M.train_step ran as stock: <why>``."""
        return f"price gate: {function} ran as {self.run}: {self.why}"

    def headline(self, calls: int) -> str:
        """Why a fit of ``calls`` calls runs stock, and what length would not, in a few words
        (the report's first line).

        >>> print(GateDecision("stock", "why", extra_s=0.9, pays_from=4500).headline(16))
        ... # doctest: +NORMALIZE_WHITESPACE
        a fit of 16 calls cannot pay for tfmx's first call (0.90 s more than stock's); from
        ~4500 calls tfmx's form runs, or tfmx.enable(fuse='always') runs it now
        """
        if self.run != "stock":
            return ""
        now = "tfmx.enable(fuse='always') runs it now"
        if not self.extra_s:
            return f"nothing measured of this step yet; {now}"
        head = (f"a fit of {calls} calls cannot pay for tfmx's first call ({self.extra_s:.2f} s "
                "more than stock's)")
        if self.pays_from:
            return f"{head}; from ~{self.pays_from} calls tfmx's form runs, or {now}"
        return f"{head}; the fused step measured no faster, {now}"


def price_gate(figures: Mapping[str, float], calls: int | None,
               share: float | None = BUDGET_SHARE, cache: Any = None, *,
               switchable: bool = False, traced: bool = False,
               beside: bool = False) -> GateDecision:
    """Whether rewriting a step pays within a fit of ``calls`` calls of it, from what this
    machine measured of it (``figures``, :func:`price_figures`):

    - both forms' step times known: tfmx runs if what the fused step saves over the fit
      (``calls`` x (stock - fused)) is more than its first call costs beyond stock's, or, where
      the fused step was measured with tuner decisions left unmeasured (:func:`provisional`),
      if the gain expected of a tuned step pays (``tfmx.step_gain.pays_on_prior``);
    - one form's step time known: tfmx runs if its first call beyond stock's (measured, or
      expected: :func:`expected_first_call`) is within the trial's budget, ``share`` of the
      planned run at the known step time (the guard's budget logic), or, stock's known,
      if the saving expected of the fused step on this machine's prior covers it
      (``tfmx.step_gain.pays_on_prior``); else stock runs, and its figures are measured;
    - nothing known: with ``switchable`` (the fit's loop can trace tfmx's form mid-fit) stock
      runs first and is timed, else tfmx runs (and learns);
    - no plan, or no budget (``share`` None): tfmx runs (the trial decides).

    ``traced``: stock's form of the step is already traced and running (the gate asks again
    after its first calls, for the calls left): tfmx's whole first call is then the extra, or,
    with ``beside`` (its form is then traced on a thread of its own while stock's steps run,
    ``tfmx.background_trace``), what such a trace was measured to cost a fit here, as a ratio
    of stock's first call (``tfmx.first_call``'s form ``"beside"``), where it was.

    >>> fig = {"fused_first_s": 9.0, "stock_first_s": 3.0, "fused_ms": 40.0, "stock_ms": 60.0}
    >>> price_gate(fig, 48).run, price_gate(fig, 1000).run
    ('stock', 'tfmx')
    >>> price_gate(fig, 48).why  # doctest: +NORMALIZE_WHITESPACE
    "its first call costs 6.00 s more than stock's (9.00 s, 3.00 s), more than it saves over
    the fit's 48 calls (0.96 s: fused 40.00 ms, stock 60.00 ms a call)"
    >>> price_gate({}, 48, switchable=True).run, price_gate({}, 48).run
    ('stock', 'tfmx')
    """
    if not calls:
        return GateDecision("tfmx", "no plan of the fit's length")
    fused_first = figures.get("fused_first_s")
    fused_ms, stock_ms = figures.get("fused_ms"), figures.get("stock_ms")
    stock_first = figures.get("stock_first_s") or 0.0
    ops = int(figures.get("ops", 0))
    if not (fused_first and fused_ms) and not stock_ms:
        if switchable and share is not None:
            return GateDecision("stock", "nothing measured of this step here yet: stock runs "
                                         "first and its first calls are timed; tfmx's form is "
                                         "traced in this fit if the rest of it can pay for it")
        return GateDecision("tfmx", "nothing measured of this step here yet: tfmx runs "
                                    "and measures it")
    expected = (0.0, "")
    if fused_first and fused_ms:
        fused_how = f"{fused_first:.2f} s"
    else:
        expected = expected_first_call("fused", ops, 0.0, cache, stock_first)
        fused_first = expected[0]
        fused_how = f"~{fused_first:.2f} s expected, {expected[1]}"
    if traced:
        extra, how = fused_first, "stock's is paid"
        paid = learnt_ratio("beside", cache) if beside and stock_first else None
        if paid is not None and paid[0] * stock_first < fused_first:
            extra = paid[0] * stock_first
            how = (f"stock's is paid; traced beside its steps, ~{extra:.2f} s paid by the fit: "
                   f"{paid[0]:.2f} x stock's first call, the median of {paid[1]} measured "
                   "here")
    else:
        if not stock_first:
            learnt = learnt_stock_first_call(ops, fused_first, cache)
            stock_first = learnt[0] if learnt is not None else 0.0
            how = (f"~{stock_first:.2f} s expected, {learnt[1]}" if learnt is not None
                   else "not measured")
        else:
            how = f"{stock_first:.2f} s"
        extra = max(0.0, fused_first - stock_first)
    first = f"its first call costs {extra:.2f} s more than stock's ({fused_how}, {how})"

    def verdict(run: str, why: str, per_call_s: float = 0.0) -> GateDecision:
        pays = math.floor(extra / per_call_s) + 1 if run == "stock" and per_call_s > 0 else 0
        return GateDecision(run, why, *expected, extra_s=extra, pays_from=pays)

    def on_prior(outcome: GateDecision, prior: tuple[bool, str, int], why: str) -> GateDecision:
        # tfmx where the gain expected on this machine's prior pays (pays_on_prior), else
        # stock's ``outcome``, told the fit's length from which the prior pays where sooner
        if prior[0]:
            return verdict("tfmx", why)
        if prior[2] and (not outcome.pays_from or prior[2] < outcome.pays_from):
            return dataclasses.replace(outcome, pays_from=prior[2])
        return outcome

    if stock_ms and fused_ms:
        saved = calls * (stock_ms - fused_ms) / 1e3
        steps = (f"the fit's {calls} calls ({saved:.2f} s: fused {fused_ms:.2f} ms, stock "
                 f"{stock_ms:.2f} ms a call)")
        if saved > extra:
            return verdict("tfmx", f"{first}, less than it saves over {steps}")
        outcome = verdict("stock", f"{first}, more than it saves over {steps}",
                          (stock_ms - fused_ms) / 1e3)
        deferred = provisional(figures)
        if not deferred:
            return outcome
        # measured with forms the tuner had no budget left to measure: tried again where
        # the gain expected of a tuned step pays, the tuner measuring on
        prior = pays_on_prior(extra, calls, stock_ms, cache, "a step tuned to its end")
        left = (f"the fused step was measured with {deferred} of the tuner's decisions left "
                "unmeasured")
        return on_prior(outcome, prior, f"{first}; {left}; {prior[1]}")
    known_ms = fused_ms or stock_ms
    whose = "stock's step not measured" if fused_ms else "the fused step not measured yet"
    run_s = calls * known_ms / 1e3
    if share is None or extra <= share * run_s:
        return verdict("tfmx", f"{first}, within the trial's budget ({share or 0:.0%} of "
                               f"the planned ~{run_s:.1f} s); {whose}")
    prior = (pays_on_prior(extra, calls, stock_ms, cache) if stock_ms
             else (False, "", 0))
    outcome = verdict("stock", f"{first}, more than the trial's budget ({share:.0%} of the "
                               f"planned ~{run_s:.1f} s), and {whose} to show a gain"
                               f"{'; ' + prior[1] if prior[1] else ''}: stock runs and is "
                               "measured", share * known_ms / 1e3)
    return on_prior(outcome, prior, f"{first}; {prior[1]}")


_expected: dict[str, tuple[float, str]] = {}  # price key -> tfmx's first call, as estimated


def expect_first_call(key: str, verdict: GateDecision) -> None:
    """The gate ran tfmx's form of the step ``key`` on ``verdict``: keep its estimate of the
    form's first call (where it had one) for :func:`first_call_estimate`."""
    if key and verdict.run == "tfmx" and verdict.expected_s > 0:
        _expected[key] = (verdict.expected_s, verdict.expected_how)


def first_call_estimate(key: str, seconds: float) -> dict[str, Any] | None:
    """tfmx's first call of the step ``key`` took ``seconds``: the estimate the gate ran it on
    (:func:`expect_first_call`) beside it, as the report keeps it (``predicted_s``,
    ``measured_s``, ``measured/predicted``, ``how``), once; None where there was none.

    >>> expect_first_call("demo step", GateDecision("tfmx", "why", 2.4, "1.20 x stock's"))
    >>> round(first_call_estimate("demo step", 2.1)["measured/predicted"], 3)
    0.875
    >>> first_call_estimate("demo step", 2.1) is None
    True
    """
    known = _expected.pop(key, None) if key else None
    if known is None or seconds <= 0:
        return None
    return {"predicted_s": known[0], "measured_s": seconds,
            "measured/predicted": seconds / known[0], "how": known[1]}


def forget_prices() -> None:
    """Drop the first calls and price records this process learnt; the machine's tuning cache
    keeps its copy.

    >>> learn_price("demo step", fused_ms=5.0)
    >>> forget_prices()
    >>> price_figures("demo step")
    {}
    """
    forget_first_calls()
    _prices.clear()
    _expected.clear()
    _fits.clear()


__all__ = ["FIRST_CALL_FORMS", "FUSED_SEED", "PRICE_FAMILY", "SEED_S_PER_OP", "XLA_SEED",
           "GateDecision", "expect_first_call", "expected_first_call", "first_call_estimate",
           "fits_before", "forget_prices", "learn_first_call", "learn_price", "price_figures",
           "price_gate", "provisional"]
