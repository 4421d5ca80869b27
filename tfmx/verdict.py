"""The first line of ``tfmx.report()``: which step runs, how fast, and what measuring cost.

:func:`verdict` reads a report (``tfmx.reporting.Report``) and says in one line what a user
wants first: the step kept for the model's training (the fused step, the stock step or the
XLA-compiled one, as the whole-step guard decided), its median time, and the seconds tfmx spent
measuring (the tuner's forms while tracing, the guard's trial). Empty while nothing was traced.

Example:
    >>> from tfmx.verdict import verdict
    >>> from tfmx.guard_record import GuardRecord
    >>> class Guard:
    ...     def summary(self):
    ...         return GuardRecord("Functional.train_step", "fused", 8.0, 10.0, 12, "faster",
    ...                            cost_s=0.4)
    >>> class Trace:
    ...     function, status, tune_seconds = "Functional.train_step", "rewritten", 1.6
    >>> class Report:
    ...     traces, guards = [Trace()], [Guard()]
    >>> print(verdict(Report()))  # doctest: +NORMALIZE_WHITESPACE
    tfmx: Functional.train_step runs the fused step, 8.00 ms a step (stock 10.00 ms, 0.80x);
    2.0 s spent measuring
"""

from __future__ import annotations

import math
from typing import Any

FORMS = {"fused": "the fused step", "stock": "the stock step", "xla": "the XLA-compiled step"}


def _main(items: list[Any], name: Any) -> Any:
    """The train step's entry of ``items`` if there is one, else the first (None if empty)."""
    for item in items:
        if "train" in str(name(item)):
            return item
    return items[0] if items else None


def _ms(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f} ms"


def verdict(report: Any) -> str:
    """One line: the step kept for the train function (else the first traced one), its
    median ms, stock's beside it, and the seconds spent measuring; "" before any trace. Never
    raises: a report it cannot read gives a line saying so.

    >>> class Empty:
    ...     traces, guards = [], []
    >>> verdict(Empty())
    ''
    >>> class Trace:
    ...     function, status, tune_seconds = "M.train_step", "stock: no pattern matched", 0.0
    >>> class Unguarded:
    ...     traces, guards = [Trace()], []
    >>> print(verdict(Unguarded()))
    tfmx: M.train_step runs the stock step (no pattern matched); 0.0 s spent measuring
    >>> from tfmx.guard_record import GuardRecord
    >>> class Gated:
    ...     function, status, tune_seconds = "M.train_step", "stock: price gate", 0.0
    >>> class TestGuard:
    ...     def summary(self):
    ...         return GuardRecord("M.test_step", "fused", 8.0, 10.0, 12, "faster")
    >>> class Both:
    ...     traces, guards, gates = [Gated()], [TestGuard()], {"M.train_step": "too short"}
    >>> print(verdict(Both()))
    tfmx: M.train_step runs the stock step (price gate: too short); 0.0 s spent measuring
    """
    try:
        return _verdict(report)
    except Exception as exc:  # noqa: BLE001 - the report prints whatever this line fails on
        return f"tfmx: no verdict ({type(exc).__name__}: {exc})"[:200]


def _verdict(report: Any) -> str:
    traces = list(getattr(report, "traces", []) or [])
    summaries = [g.summary() for g in getattr(report, "guards", []) or []]
    if not traces and not summaries:
        return ""
    spent = sum(float(getattr(t, "tune_seconds", 0.0) or 0.0) for t in traces)
    spent += sum(float(s.cost_s or 0.0) for s in summaries)
    tail = f"; {spent:.1f} s spent measuring"
    guard = _main(summaries, lambda s: s.function)
    trace = _main(traces, lambda t: t.function)
    if guard is not None and "train" not in guard.function and "train" in str(
            getattr(trace, "function", "")):
        guard = None  # the train step ran unguarded (the price gate, the guard off): it first
    if guard is None:
        status = str(trace.status)
        if status.startswith("stock"):
            why = status.partition(":")[2].strip()
            gate = (getattr(report, "gates", None) or {}).get(trace.function)
            why = f"{why}: {gate}" if why == "price gate" and gate else why
            return (f"tfmx: {trace.function} runs the stock step"
                    f"{f' ({why})' if why else ''}{tail}")
        if status == "rewritten":
            off = ("fuse='always'" if getattr(report, "fuse", "") == "always"
                   else "guard off")
            return f"tfmx: {trace.function} runs the fused step (not timed: {off}){tail}"
        return f"tfmx: {trace.function}: {status}{tail}"
    if guard.kept not in FORMS:
        return (f"tfmx: {guard.function}: trial under way, {guard.pairs} pairs so far "
                f"(fused {_ms(guard.fused_ms)}, stock {_ms(guard.stock_ms)}){tail}")
    kept_ms = {"fused": guard.fused_ms, "stock": guard.stock_ms, "xla": guard.xla_ms}[guard.kept]
    versus = ""
    if guard.kept != "stock" and not math.isnan(guard.stock_ms) and not math.isnan(kept_ms):
        versus = f" (stock {_ms(guard.stock_ms)}, {kept_ms / guard.stock_ms:.2f}x)"
    if not guard.final and not guard.pairs:  # no timed pair: its figure is a first call's
        return (f"tfmx: {guard.function} runs {FORMS[guard.kept]}, for now (trial paused "
                f"before a timed pair){tail}")
    paused = "" if guard.final else ", for now (trial paused)"
    return (f"tfmx: {guard.function} runs {FORMS[guard.kept]}{paused}, {_ms(kept_ms)} a step"
            f"{versus}{tail}")
