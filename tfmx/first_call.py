"""What a form's first call of a step costs on this machine: learnt, and expected before it is paid.

A first call traces the step, rewrites or compiles it, and runs it once. Two models predict it,
per form (``"fused"``, ``"xla"``): the ratio of its first call to stock's first call of the
same step, whenever both were measured here (:func:`learn_first_call_ratio`, fed by
``tfmx.step_price.learn_price``), times the step's own stock first call; and seconds per op of
the step (:func:`learn_first_call`). Each counts a first call's fixed costs as if they grew with
the step, so each, learnt on smaller steps, expects too much of a larger one: the ratio where
the small steps' stock first calls were mostly fixed costs (a first call of tfmx's form four
times a small model's stock one, 1.3 times a transformer's), seconds per op where their ops
were few. Where both apply the smaller estimate is taken (:func:`expected_first_call`). Before
anything was measured, seeds (:data:`FUSED_SEED`, :data:`XLA_SEED`, :data:`SEED_S_PER_OP`).

Both figures are kept as their last :data:`HISTORY` observations and read as the median of
their logarithms (:func:`robust`): a ratio's errors multiply, so they are symmetric in log
space; the median ignores one outlier among three (a first call slowed by another process, a
cold disk, a tuner measuring inside it) where a mean, or the most ever seen, follows it; and a
small model's high seconds per op does not stand for a large model's. An estimate that falls
short costs at most once per step: the form's measured first call enters the step's price
record, and the whole-step guard's trial stays within its budget.

What is learnt is kept for the process and, given the machine's tuning cache
(``tfmx.tuning_cache.TuningCache``), for this machine, in the file of its figures that another
tfmx version keeps (``tfmx.tuning_cache.figures_cache``).

Example (a step whose stock first call took 2 s, where tfmx's first calls have cost 1.2 times
stock's):
    >>> from tfmx.first_call import expected_first_call, learn_first_call_ratio
    >>> learn_first_call_ratio("fused", 1.2, 1.0)
    >>> expected_first_call("fused", 20000, stock_first_s=2.0)  # doctest: +NORMALIZE_WHITESPACE
    (2.4, "1.20 x stock's first call (2.00 s, measured), the median of 1 ratio(s) measured
    here")
    >>> forget_first_calls()
"""

from __future__ import annotations

import math
from typing import Any

from tfmx.tuning_cache import Decision, figures_cache

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
HISTORY = 25
"""How many of the last observations of each figure are kept (per form): the figure follows
the machine as it is, not as it was."""

RATE_FAMILY = "first-call-s-per-op"
"""The tuning cache's family of seconds per op of a form's first calls (its last
:data:`HISTORY`, as ``times_ms`` ``{"0": ..., "1": ...}``, oldest first)."""
RATIO_FAMILY = "first-call-ratio"
"""The tuning cache's family of ratios of a form's first call to stock's of the same step."""

_learnt: dict[str, dict[str, list[float]]] = {}  # family -> form -> observations


def robust(values: list[float]) -> float:
    """The median of ``values`` in log space (``exp(median(log v))``: the middle value, or the
    geometric mean of the middle two): one outlier among three moves it not at all.

    >>> robust([1.0, 1.2, 40.0]), round(robust([1.0, 4.0]), 6)
    (1.2, 2.0)
    """
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return math.sqrt(ordered[middle - 1] * ordered[middle])


def history(family: str, form: str, cache: Any = None) -> list[float]:
    """The last :data:`HISTORY` observations of ``form`` in ``family`` (oldest first): this
    process's, else the machine's (``cache``).

    >>> observe("demo family", "demo", 2.0)
    >>> history("demo family", "demo")
    [2.0]
    """
    known = _learnt.setdefault(family, {}).get(form)
    cache = figures_cache(cache)
    if known is None and cache is not None:  # another process's measurements
        found = cache.get(f"{family}|{form}")
        if found is not None:
            values = [float(v) for _, v in sorted(found.times_ms.items(),
                                                  key=lambda kv: int(kv[0]))
                      if str(_).isdigit() and float(v) > 0]
            if values:
                known = _learnt[family][form] = values[-HISTORY:]
    return known or []


def observe(family: str, form: str, value: float, cache: Any = None) -> None:
    """Add ``value`` (finite, above 0) to ``form``'s observations in ``family``, for this
    process and, given ``cache``, for this machine (see :func:`history`)."""
    if not (value > 0 and math.isfinite(value)):
        return
    values = [*history(family, form, cache), value][-HISTORY:]
    _learnt.setdefault(family, {})[form] = values
    cache = figures_cache(cache)
    if cache is not None:
        cache.put(Decision(family, form, form, (form,),
                           {str(i): v for i, v in enumerate(values)}, "measured"))


def learn_first_call(form: str, seconds: float, ops: int, cache: Any = None) -> None:
    """Record that ``form``'s first call (tracing, rewriting or compiling, one step) took
    ``seconds`` for a step of ``ops`` ops: the per-op model of :func:`expected_first_call`.

    >>> for seconds in (2.0, 2.0, 90.0):  # one of them slowed by something else
    ...     learn_first_call("demo rate", seconds, 1000)
    >>> expected_first_call("demo rate", 500)  # doctest: +NORMALIZE_WHITESPACE
    (1.0, '2.00 ms per op, the median of 3 first call(s) measured here')
    """
    if ops > 0 and seconds > 0:
        observe(RATE_FAMILY, form, seconds / ops, cache)


def learn_first_call_ratio(form: str, seconds: float, stock_seconds: float,
                           cache: Any = None) -> None:
    """Record that ``form``'s first call of a step took ``seconds`` where stock's first call
    of the same step took ``stock_seconds`` (both measured on this machine).

    >>> learn_first_call_ratio("demo", 3.0, 2.0)
    >>> learnt_ratio("demo")
    (1.5, 1)
    """
    if seconds > 0 and stock_seconds > 0:
        observe(RATIO_FAMILY, form, seconds / stock_seconds, cache)


def learnt_ratio(form: str, cache: Any = None) -> tuple[float, int] | None:
    """The robust ratio of ``form``'s first calls to stock's measured here (:func:`robust`),
    and how many were measured; None where none was."""
    values = history(RATIO_FAMILY, form, cache)
    return (robust(values), len(values)) if values else None


def learnt_rate(form: str, cache: Any = None) -> tuple[float, int] | None:
    """The robust seconds per op of ``form``'s first calls measured here, and how many were;
    None where none was."""
    values = history(RATE_FAMILY, form, cache)
    return (robust(values), len(values)) if values else None


def learnt_stock_first_call(ops: int, fused_first_s: float = 0.0,
                            cache: Any = None) -> tuple[float, str] | None:
    """Stock's first call of a step, expected from what was learnt here alone (no seed): the
    step's own fused first call over the fused ratio, else seconds per op; None without either.

    >>> learnt_stock_first_call(100) is None
    True
    """
    ratio = learnt_ratio("fused", cache)
    if ratio is not None and fused_first_s > 0:
        return fused_first_s / ratio[0], (f"the fused first call / {ratio[0]:.2f}, the "
                                          f"median of {ratio[1]} ratio(s) measured here")
    rate = learnt_rate("stock", cache)
    if rate is not None and ops > 0:
        return rate[0] * ops, f"learnt here per op (the median of {rate[1]})"
    return None


def expected_first_call(form: str, ops: int, fused_first_s: float = 0.0, cache: Any = None,
                        stock_first_s: float = 0.0) -> tuple[float, str]:
    """Seconds ``form``'s first call is expected to take for a step of ``ops`` ops, and how
    that was estimated (``fused_first_s``, ``stock_first_s``: the step's first calls where they
    were timed):

    - stock's: measured, else :func:`learnt_stock_first_call`, else seeded by the fused first
      call (tracing and rewriting the same step: more than stock's) or :data:`SEED_S_PER_OP`;
    - fused's and XLA's: the ratio learnt here times the step's stock first call where that
      was measured, or seconds per op learnt here times its ops where that is less (a step's
      first call is fixed costs and costs that grow with it: a model learnt on smaller steps
      expects too much of a larger one, the ratio where small steps' stock first calls are
      mostly fixed costs, seconds per op where their ops are few); else seconds per op; else
      the ratio learnt (or the seed, :data:`FUSED_SEED`, :data:`XLA_SEED`) times stock's first
      call as expected above.

    >>> expected_first_call("nothing measured", 100, fused_first_s=3.0)[1]
    'seed: the fused first call'
    >>> expected_first_call("fused", 100, stock_first_s=2.0)[0]
    3.0
    """
    if form == "stock":
        if stock_first_s > 0:
            return stock_first_s, "measured"
        learnt = learnt_stock_first_call(ops, fused_first_s, cache)
        if learnt is not None:
            return learnt
    ratio = learnt_ratio(form, cache) if form != "stock" else None
    rate = learnt_rate(form, cache) if form != "stock" else None
    per_op = (rate[0] * ops, f"{rate[0] * 1e3:.2f} ms per op, the median of {rate[1]} first "
                             "call(s) measured here") if rate is not None and ops > 0 else None
    if ratio is not None and stock_first_s > 0:
        scaled = (ratio[0] * stock_first_s, f"{ratio[0]:.2f} x stock's first call "
                                            f"({stock_first_s:.2f} s, measured), the median of "
                                            f"{ratio[1]} ratio(s) measured here")
        # each model counts fixed costs (tracing's, a compile's) as if they grew with the step:
        # learnt on smaller steps, both expect too much of a larger one; the smaller is kept
        return min(scaled, per_op) if per_op is not None else scaled
    if per_op is not None:
        return per_op
    if form == "xla" or (form == "fused" and not fused_first_s):
        stock, how = expected_first_call("stock", ops, fused_first_s if form == "xla" else 0.0,
                                         cache, stock_first_s)
        if ratio is not None:
            return ratio[0] * stock, (f"{ratio[0]:.2f} x stock's first call ({how}), the "
                                      f"median of {ratio[1]} ratio(s) measured here")
        seed = XLA_SEED if form == "xla" else FUSED_SEED
        return seed * stock, f"seed: {seed:g} x stock's first call ({how})"
    if fused_first_s > 0:
        return fused_first_s, "seed: the fused first call"
    return SEED_S_PER_OP * max(ops, 1), f"seed: {SEED_S_PER_OP * 1e3:g} ms per op"


def forget_first_calls() -> None:
    """Drop the first calls this process learnt; the machine's tuning cache keeps its copy.

    >>> learn_first_call_ratio("demo", 3.0, 2.0)
    >>> forget_first_calls()
    >>> learnt_ratio("demo") is None
    True
    """
    for known in _learnt.values():
        known.clear()


__all__ = ["FUSED_SEED", "HISTORY", "RATE_FAMILY", "RATIO_FAMILY", "SEED_S_PER_OP", "XLA_SEED",
           "expected_first_call", "forget_first_calls", "history", "learn_first_call",
           "learn_first_call_ratio", "learnt_ratio", "learnt_rate", "learnt_stock_first_call",
           "observe", "robust"]
