"""The whole-step guard: on the first real steps, time the fused step against the stock one.

Every speed decision inside a step is measured (:mod:`tfmx.tuner`), but only the whole step says
whether the user's training got faster. So when tfmx changed a step, the first steps of ``fit``
(``evaluate``, ``predict``, a ``tfmx.function`` loop) run the fused and the stock step
alternately on the real batches: both are built from the same Python step function (the stock
one traced with no tfmx stage and no rewrite, as TensorFlow would run it), every step trains as
usual, nothing is computed twice. After each pair the guard compares them; as soon as one is
faster beyond noise (a sign test over the pairs' time ratios) or after :data:`MAX_PAIRS` pairs,
it keeps one form for good: the fused step only if it is faster beyond noise. ``tfmx.report()``
shows which was kept and both medians.

The first call of each form compiles it and is not timed. The stock form is traced only when
the guard first needs it.

Switch it off with ``tfmx.enable(guard=False)`` or ``TFMX_GUARD=0``.

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
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

ENV = "TFMX_GUARD"
MIN_PAIRS = 6
"""Pairs before any decision."""
MAX_PAIRS = 24
"""Pairs after which the guard decides whatever the evidence (stock unless fused is faster)."""
P_EARLY = 0.01
"""Sign-test p-value that ends the trial early in favour of one form."""
P_FINAL = 0.05
"""At :data:`MAX_PAIRS`, the fused step is kept only at this significance."""

_local = threading.local()
_test_delay = {"fused": 0.0, "stock": 0.0}


def enabled_by_env() -> bool:
    """``TFMX_GUARD`` unset or true-ish: the guard's default.

    >>> isinstance(enabled_by_env(), bool)
    True
    """
    value = os.environ.get(ENV, "1").strip().lower()
    if value in ("1", "true", "on", "yes", ""):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"${ENV} must be 1 or 0 (on/off), got {value!r}")


def set_test_delay(fused: float = 0.0, stock: float = 0.0) -> None:
    """Test hook: every step of that form the guard runs sleeps so many seconds more (the
    default, 0, turns it off)."""
    _test_delay.update(fused=float(fused), stock=float(stock))


@contextlib.contextmanager
def forcing_stock() -> Iterator[None]:
    """While a guard traces the stock form of an outer function (Keras's step loop), tfmx's
    step functions traced inside it embed their stock trace."""
    previous = getattr(_local, "force_stock", False)
    _local.force_stock = True
    try:
        yield
    finally:
        _local.force_stock = previous


def stock_forced() -> bool:
    """True inside :func:`forcing_stock`."""
    return getattr(_local, "force_stock", False)


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


def embedded(changed: bool) -> None:
    """A tfmx step function was traced into an outer function; ``changed``: it differs from
    stock (a stage or a pass rewrote it)."""
    collected = getattr(_local, "collected", None)
    if collected is not None:
        collected.append(changed)


def _binomial_tail(k: int, n: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n


@dataclasses.dataclass
class GuardRecord:
    """What one guard measured and kept, for the report."""

    function: str
    kept: str  # "fused", "stock", or "undecided"
    fused_ms: float
    stock_ms: float
    pairs: int
    reason: str
    cost_s: float = 0.0  # what the trial cost: tracing the stock form, steps of the other form

    def describe(self) -> str:
        ratio = self.fused_ms / self.stock_ms if self.stock_ms else float("nan")
        if self.kept == "undecided":
            return (f"{self.function}: trial under way, {self.pairs} pairs so far (fused "
                    f"{self.fused_ms:.2f} ms, stock {self.stock_ms:.2f} ms, ratio {ratio:.3f})")
        return (f"{self.function}: kept {self.kept} (fused {self.fused_ms:.2f} ms, stock "
                f"{self.stock_ms:.2f} ms, ratio {ratio:.3f}, {self.pairs} pairs; {self.reason}; "
                f"the trial cost {self.cost_s:.2f} s)")


class StepGuard:
    """The trial of one step function (see module doc): call :meth:`next_form`, run that form,
    :meth:`record` its time; once :attr:`decided`, :attr:`kept` names the form to run."""

    def __init__(self, function: str, min_pairs: int = MIN_PAIRS,
                 max_pairs: int = MAX_PAIRS) -> None:
        self.function = function
        self.min_pairs, self.max_pairs = min_pairs, max_pairs
        self.kept: str | None = None
        self._reason = ""
        self._times: dict[str, list[float]] = {"fused": [], "stock": []}
        self._warm: dict[str, float] = {"fused": 0.0}  # the first traced call ran the fused form
        self._next = "stock"

    @property
    def decided(self) -> bool:
        return self.kept is not None

    def next_form(self) -> str:
        """The form to run next: alternates during the trial, then the kept one."""
        return self.kept if self.kept is not None else self._next

    def record(self, form: str, seconds: float) -> None:
        """Record one run of ``form`` (its first run only warms it up)."""
        if self.kept is not None:
            return
        if form not in self._warm:
            self._warm[form] = seconds  # tracing and compiling it: the guard's doing for stock
        else:
            self._times[form].append(seconds)
        self._next = "stock" if form == "fused" else "fused"
        self._maybe_decide()

    def _ratios(self) -> list[float]:
        fused, stock = self._times["fused"], self._times["stock"]
        return [f / s for f, s in zip(fused, stock) if s > 0]

    def _maybe_decide(self) -> None:
        ratios = self._ratios()
        n = len(ratios)
        if n < self.min_pairs or len(self._times["fused"]) != len(self._times["stock"]):
            return
        faster = sum(r < 1.0 for r in ratios)
        p_fused = _binomial_tail(faster, n)  # evidence fused is faster
        p_stock = _binomial_tail(n - faster, n)  # evidence stock is faster
        median = statistics.median(ratios)
        if p_fused < P_EARLY and median < 1.0:
            self._decide("fused", f"fused faster in {faster} of {n} pairs (p={p_fused:.3f})")
        elif p_stock < P_EARLY:
            self._decide("stock", f"stock faster in {n - faster} of {n} pairs "
                                  f"(p={p_stock:.3f})")
        elif n >= self.max_pairs:
            if p_fused < P_FINAL and median < 1.0:
                self._decide("fused", f"fused faster in {faster} of {n} pairs "
                                      f"(p={p_fused:.3f})")
            else:
                self._decide("stock", f"fused not faster beyond noise: faster in {faster} of "
                                      f"{n} pairs (p={p_fused:.2f}), median ratio {median:.3f}")

    def _decide(self, form: str, reason: str) -> None:
        self.kept, self._reason = form, reason

    def summary(self) -> GuardRecord:
        """What was measured so far (medians in ms)."""

        def med(values: list[float]) -> float:
            return statistics.median(values) * 1e3 if values else float("nan")

        return GuardRecord(self.function, self.kept or "undecided", med(self._times["fused"]),
                           med(self._times["stock"]), len(self._ratios()), self._reason,
                           self._cost())

    def _cost(self) -> float:
        """Seconds the trial added: the stock form's first call (tracing, compiling), and
        the steps of the form not kept beyond the kept form's median (the extra the trial's
        slower steps took; an undecided trial counts against the faster median so far)."""
        cost = self._warm.get("stock", 0.0)
        times = self._times
        if not times["fused"] or not times["stock"]:
            return cost
        kept = self.kept or min(times, key=lambda f: statistics.median(times[f]))
        other = "stock" if kept == "fused" else "fused"
        base = statistics.median(times[kept])
        return cost + max(0.0, sum(t - base for t in times[other]))

    def run(self, fused: Callable[[], Any], stock: Callable[[], Any]) -> Any:
        """Run the form :meth:`next_form` names, timing it while the trial lasts."""
        form = self.next_form()
        call = fused if form == "fused" else stock
        if self.kept is not None:
            if _test_delay[form]:
                time.sleep(_test_delay[form])
            return call()
        start = time.perf_counter()
        if _test_delay[form]:
            time.sleep(_test_delay[form])
        out = call()
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


__all__ = ["GuardRecord", "StepGuard", "collecting", "embedded", "forcing_stock",
           "set_test_delay", "stock_forced"]
