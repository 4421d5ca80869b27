"""The record of one whole-step guard's trial, as the report shows it.

Example:
    >>> from tfmx.guard_record import GuardRecord
    >>> record = GuardRecord("M.train_step", "stock", 10.0, 8.0, 6, "")
    >>> print(record.describe())  # doctest: +NORMALIZE_WHITESPACE
    M.train_step: kept stock (fused 10.00 ms, stock 8.00 ms, fused/stock 1.250; 6 pairs;
    the trial cost 0.00 s)
"""

from __future__ import annotations

import dataclasses
import math


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


__all__ = ["GuardRecord"]
