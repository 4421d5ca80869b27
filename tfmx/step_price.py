"""What a step costs on this machine, and whether rewriting it pays within a fit.

First calls: tracing, rewriting or compiling a form of a step is paid on its first call. What
those first calls took here is learnt per op of the step (:func:`learn_first_call`), the most
per op seen, so the whole-step guard knows what trying a form would cost before it pays
(:func:`expected_first_call`); before anything was measured, seeds stand in
(:data:`SEED_S_PER_OP`, :data:`XLA_SEED`).

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
from tfmx.tuning_cache import Decision

XLA_SEED = 2.0
"""Before any XLA first call was measured on this machine, its compile is expected to cost
this many times stock's first call (a seed: the first measurement replaces it)."""
FUSED_SEED = 1.5
"""Before any fused first call was measured on this machine, tracing a step with tfmx's stages
and rewriting it is expected to cost this many times stock's first call (a seed, as
:data:`XLA_SEED`)."""
SEED_S_PER_OP = 1e-3
"""Before any first call was measured here and with no fused first call to go by, stock's is
expected to cost this many seconds per op of its step (a seed, as :data:`XLA_SEED`)."""

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
        cache.put(Decision("guard-first-call", form, form, (form,),
                           {"ms_per_op": math.exp(most) * 1e3, "n": n + 1}, "measured"))


def expected_first_call(form: str, ops: int, fused_first_s: float = 0.0, cache: Any = None,
                        stock_first_s: float = 0.0) -> tuple[float, str]:
    """Seconds ``form``'s first call is expected to take for a step of ``ops`` ops, and how
    that was estimated: from the first calls measured on this machine (per op), else seeded by
    the fused step's own first call (tracing and rewriting the same step: more than stock's)
    or :data:`SEED_S_PER_OP`, XLA's at :data:`XLA_SEED` times stock's; the fused form's, with
    none measured, at :data:`FUSED_SEED` times stock's (``stock_first_s`` where it was timed).

    >>> expected_first_call("nothing measured", 100, fused_first_s=3.0)[1]
    'seed: the fused first call'
    >>> expected_first_call("fused", 100, stock_first_s=2.0)[0]
    3.0
    """
    if form == "stock" and stock_first_s > 0:
        return stock_first_s, "measured"
    known = _learnt(form, cache)
    if known is not None and ops > 0:
        rate = math.exp(known[0])
        return rate * ops, (f"{rate * 1e3:.2f} ms per op, the most of {known[1]} first "
                            "call(s) measured here")
    if form == "xla":
        stock, how = expected_first_call("stock", ops, fused_first_s, cache, stock_first_s)
        return XLA_SEED * stock, f"seed: {XLA_SEED:g} x stock's first call ({how})"
    if form == "fused" and not fused_first_s:
        stock, how = ((stock_first_s, "measured") if stock_first_s > 0
                      else expected_first_call("stock", ops, 0.0, cache))
        return FUSED_SEED * stock, f"seed: {FUSED_SEED:g} x stock's first call ({how})"
    if fused_first_s > 0:
        return fused_first_s, "seed: the fused first call"
    return SEED_S_PER_OP * max(ops, 1), f"seed: {SEED_S_PER_OP * 1e3:g} ms per op"


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
    with ``cache`` (a ``tfmx.tuning_cache.TuningCache``), for this machine."""
    if not key:
        return
    new = {k: float(v) for k, v in figures.items()
           if v is not None and math.isfinite(float(v)) and float(v) > 0}
    if not new:
        return
    merged = {**price_figures(key, cache), **new}
    _prices[key] = merged
    if cache is not None:
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
               share: float | None = BUDGET_SHARE, cache: Any = None, *,
               switchable: bool = False, traced: bool = False) -> GateDecision:
    """Whether rewriting a step pays within a fit of ``calls`` calls of it, from what this
    machine measured of it (``figures``, :func:`price_figures`):

    - both forms' step times known: tfmx runs if what the fused step saves over the fit
      (``calls`` x (stock - fused)) is more than its first call costs beyond stock's;
    - one form's step time known: tfmx runs if its first call beyond stock's (measured, or
      expected: :func:`expected_first_call`) is within the trial's budget, ``share`` of the
      planned run at the known step time (the guard's budget logic); else stock runs, and its
      figures are measured;
    - nothing known: with ``switchable`` (the fit's loop can trace tfmx's form mid-fit) stock
      runs first and is timed, else tfmx runs (and learns);
    - no plan, or no budget (``share`` None): tfmx runs (the trial decides).

    ``traced``: stock's form of the step is already traced and running (the gate asks again
    after its first calls, for the calls left): tfmx's whole first call is then the extra.

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
    if fused_first and fused_ms:
        fused_how = f"{fused_first:.2f} s"
    else:
        fused_first, fused_how = expected_first_call("fused", ops, 0.0, cache, stock_first)
        fused_how = f"~{fused_first:.2f} s expected, {fused_how}"
    if traced:
        extra, how = fused_first, "stock's is paid"
    else:
        if not stock_first:
            known = _learnt("stock", cache)
            stock_first = math.exp(known[0]) * ops if known is not None and ops > 0 else 0.0
            how = (f"~{stock_first:.2f} s expected, learnt here per op" if stock_first
                   else "not measured")
        else:
            how = f"{stock_first:.2f} s"
        extra = max(0.0, fused_first - stock_first)
    first = f"its first call costs {extra:.2f} s more than stock's ({fused_how}, {how})"
    if stock_ms and fused_ms:
        saved = calls * (stock_ms - fused_ms) / 1e3
        steps = (f"the fit's {calls} calls ({saved:.2f} s: fused {fused_ms:.2f} ms, stock "
                 f"{stock_ms:.2f} ms a call)")
        if saved > extra:
            return GateDecision("tfmx", f"{first}, less than it saves over {steps}")
        return GateDecision("stock", f"{first}, more than it saves over {steps}")
    known_ms = fused_ms or stock_ms
    whose = "stock's step not measured" if fused_ms else "the fused step not measured yet"
    run_s = calls * known_ms / 1e3
    if share is None or extra <= share * run_s:
        return GateDecision("tfmx", f"{first}, within the trial's budget ({share or 0:.0%} of "
                                    f"the planned ~{run_s:.1f} s); {whose}")
    return GateDecision("stock", f"{first}, more than the trial's budget ({share:.0%} of the "
                                 f"planned ~{run_s:.1f} s), and {whose} to show a gain: stock "
                                 "runs and is measured")


def forget_prices() -> None:
    """Drop the first calls and price records this process learnt; the machine's tuning cache
    keeps its copy.

    >>> learn_price("demo step", fused_ms=5.0)
    >>> forget_prices()
    >>> price_figures("demo step")
    {}
    """
    _first_calls.clear()
    _prices.clear()


__all__ = ["FUSED_SEED", "PRICE_FAMILY", "SEED_S_PER_OP", "XLA_SEED", "GateDecision",
           "expected_first_call", "forget_prices", "learn_first_call", "learn_price",
           "price_figures", "price_gate"]
