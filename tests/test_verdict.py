"""tfmx.report()'s first line: the step kept, its time, the seconds spent measuring."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest

import tfmx
from tfmx import guard
from tfmx.guard_record import GuardRecord
from tfmx.reporting import Report, TraceRecord
from tfmx.verdict import verdict


class _Guard:
    def __init__(self, record: GuardRecord) -> None:
        self.record = record

    def summary(self) -> GuardRecord:
        return self.record


def _report(*guards: GuardRecord, status: str = "rewritten", tune_s: float = 1.0) -> Report:
    report = Report(backend="cpu")
    report.add_trace(TraceRecord("M.test_step", "cpu", "rewritten", tune_seconds=0.5))
    report.add_trace(TraceRecord("M.train_step", "cpu", status, tune_seconds=tune_s))
    for g in guards:
        report.add_guard(_Guard(g))
    return report


def test_the_train_steps_guard_decides_the_line():
    report = _report(GuardRecord("M.test_step", "stock", 3.0, 2.0, 6, "", cost_s=0.1),
                     GuardRecord("M.train_step", "xla", 9.0, 10.0, 12, "", cost_s=0.4,
                                 xla_ms=5.0))
    assert verdict(report) == ("tfmx: M.train_step runs the XLA-compiled step, 5.00 ms a step "
                               "(stock 10.00 ms, 0.50x); 2.0 s spent measuring")
    assert str(report).splitlines()[0] == verdict(report)
    assert str(report).splitlines()[1].startswith("tfmx report (backend cpu)")


def test_stock_kept_paused_and_undecided_trials():
    kept_stock = _report(GuardRecord("M.train_step", "stock", 11.0, 10.0, 24, ""))
    assert verdict(kept_stock).startswith("tfmx: M.train_step runs the stock step, 10.00 ms")
    paused = _report(GuardRecord("M.train_step", "fused", 8.0, math.nan, 0, "", final=False))
    assert "runs the fused step, for now (trial paused), 8.00 ms a step;" not in verdict(paused)
    assert "runs the fused step, for now (trial paused before a timed pair);" in verdict(paused)
    paired = _report(GuardRecord("M.train_step", "fused", 8.0, 9.0, 3, "", final=False))
    assert "runs the fused step, for now (trial paused), 8.00 ms a step" in verdict(paired)
    running = _report(GuardRecord("M.train_step", "undecided", 8.0, 9.0, 2, ""))
    assert "trial under way, 2 pairs so far (fused 8.00 ms, stock 9.00 ms)" in verdict(running)


def test_without_a_guard_the_trace_says_what_runs():
    assert verdict(_report(status="stock: price gate")) == (
        "tfmx: M.train_step runs the stock step (price gate); 1.5 s spent measuring")
    assert "runs the fused step (not timed: guard off)" in verdict(_report())
    assert verdict(Report(backend="cpu")) == ""
    assert str(Report(backend="cpu")).startswith("tfmx report (backend cpu)")


def test_an_unreadable_report_gives_a_line_not_an_exception():
    class Broken:
        traces = [object()]
        guards = ()

    assert verdict(Broken()).startswith("tfmx: no verdict (AttributeError")


@pytest.fixture
def _guarded(monkeypatch):
    monkeypatch.setenv("TFMX_GUARD_BUDGET", "none")
    guard.forget()
    yield
    guard.forget()
    tfmx.disable()


def test_a_real_fit_opens_its_report_with_the_verdict(_guarded, slow_forms):
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Dense(16, "relu")(inp)))
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(512, 8)).astype("float32"), rng.integers(0, 3, 512)
    tfmx.enable(backend="cpu", guard=True, tune="off", xla=False, verbose=0)
    slow_forms(fused=0.003)  # the fused step plainly slower: stock is kept
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    first = str(tfmx.report()).splitlines()[0]
    assert first.startswith("tfmx: Functional.train_step runs the stock step, "), first
    assert first.endswith(" s spent measuring")
