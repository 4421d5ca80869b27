"""``tfmx.enable(fuse="always")``: every family takes its fused form where it applies.

A short fit (the README's example) runs the fused step with the switch (no price gate, no
whole-step trial, every tuned choice a fused form), the report says so and shows the fused
nodes, and the fit trains like stock within rounding. Without the switch, the README's example
prints why a fit that short runs stock and what length pays.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest
from parity import assert_optimizer_parity

import tfmx
from tfmx import state
from tfmx.env import resolve_fuse
from tfmx.tuner import Tuner, always_fused
from tfmx.tuning_cache import Decision

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2 * 256 // 32  # the README's fit: 2 epochs of 256 samples, batch 32


def _readme_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    return model


def _fit(model: keras.Model) -> keras.Model:
    rng = np.random.default_rng(0)
    x, y = rng.random((256, 16)), rng.random((256, 1))
    model.fit(x, y, epochs=2, verbose=0, shuffle=False)
    return model


def test_a_short_fit_runs_the_fused_step_and_trains_like_stock(monkeypatch):
    monkeypatch.delenv("TFMX_GUARD", raising=False)  # the guard's default: on
    tfmx.disable()
    stock = _fit(_readme_model())
    tfmx.enable(backend="cpu", fuse="always")
    try:
        assert state.options().fuse == "always" and not state.options().guard
        fused = _fit(_readme_model())
        report = tfmx.report()
    finally:
        tfmx.disable()
    text = str(report)
    first = text.splitlines()[0]
    assert "runs the fused step (not timed: fuse='always')" in first, first
    assert "fuse='always'" in "\n".join(report.notes)
    assert not report.guards and not any(n.startswith("price gate") for n in report.notes)
    train = [t for t in report.traces if t.function.endswith("train_step")]
    assert train and train[0].status == "rewritten"
    assert train[0].nodes_after < train[0].nodes_before
    assert report.fused("optimizer_update") == 4  # Adam's composite: one kernel per variable
    assert train[0].ops_after["ResourceApplyAdam"] == 4
    # every tuned choice took a fused form, whatever the tuner could measure in 16 steps
    assert report.decisions and all(d.choice not in ("stock", "composite", "layers")
                                    for d in report.decisions)
    names = [v.path for v in stock.weights + stock.optimizer.variables]
    assert_optimizer_parity(names, [v.numpy() for v in stock.weights + stock.optimizer.variables],
                            [v.numpy() for v in fused.weights + fused.optimizer.variables],
                            "Adam", steps=STEPS)


def test_the_tuner_takes_a_fused_form_measured_or_not():
    slow_fused = Tuner("auto", None, fused=True,
                       timer=lambda runs, budget: {"stock": 1.0, "a": 3.0, "b": 2.0})
    assert slow_fused.choose("demo", "x", {"stock": None, "a": None, "b": None},
                             conservative="stock").choice == "b"  # the fastest fused form
    off = Tuner("off", fused=True).choose("demo", "x", {"stock": None, "xla": None, "a": None},
                                          conservative="stock")
    assert off.choice == "a" and off.source == "fuse='always' (not measured: tune=off)"
    assert Tuner("off").choose("demo", "x", {"stock": None, "a": None},
                               conservative="stock").choice == "stock"
    only = Decision("f", "s", "stock", ("stock",), {}, "conservative (tune=off)")
    assert always_fused(only, "stock") is only


def test_the_tuner_measures_past_a_short_fits_share_when_always_fused():
    """A fit this short leaves the tuner no share to measure a second decision in; under
    fuse='always' the tuner's own budget bounds it instead, so every fused form is measured
    and the fastest kept (not the first one unmeasured)."""
    from tfmx.fit_plan import fitting

    def timer(runs, budget):
        time.sleep(0.01)  # the measuring takes time: the fit's share is spent after one
        return {"stock": 1e-3, "a": 3e-3, "b": 2e-3}

    choices = {}
    for fused in (False, True):
        tuner = Tuner("auto", None, fused=fused, timer=timer)
        tuner.step_hint = lambda: 1e-6  # a microsecond a step: 2% of 2 steps is nothing
        with fitting(1, 2):
            choices[fused] = [tuner.choose("demo", sig, {"stock": None, "a": None, "b": None},
                                           conservative="stock") for sig in ("x", "y")]
    plain, fused = choices[False], choices[True]
    assert plain[1].source.startswith("conservative (measuring budget spent")
    assert [d.choice for d in fused] == ["b", "b"]
    assert all(d.source == "measured" for d in fused)


def test_the_switch_is_named_and_checked(monkeypatch):
    monkeypatch.setenv("TFMX_FUSE", "always")
    assert resolve_fuse(None) == "always" and resolve_fuse("measured") == "measured"
    monkeypatch.setenv("TFMX_FUSE", "on")
    with pytest.raises(ValueError, match=r"\$TFMX_FUSE must be one of"):
        resolve_fuse(None)
    monkeypatch.delenv("TFMX_FUSE")
    assert resolve_fuse(None) == "measured"
    with pytest.raises(ValueError, match="guard=True keeps stock"):
        tfmx.enable(backend="cpu", fuse="always", guard=True)
    with pytest.raises(ValueError, match="fuse must be one of"):
        tfmx.enable(backend="cpu", fuse=True)
    tfmx.disable()


def _readme_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## The one call"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_readme_example_prints_what_tfmx_did(tmp_path):
    """As a user runs it (guard on, a fresh tuning cache): the first report's first line says
    which step ran and, where it is stock, why and what length pays; the report with
    ``fuse="always"`` shows the fused step and its fused nodes."""
    script = tmp_path / "readme.py"
    script.write_text(_readme_block())
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFMX_")}
    env.update(TFMX_CACHE_DIR=str(tmp_path / "cache"), TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    verdicts = [line for line in done.stdout.splitlines()
                if line.startswith("tfmx: ") and " runs the " in line]  # each report's first
    assert len(verdicts) == 2, done.stdout
    default, always = verdicts
    kept = (r"runs the (fused|stock|XLA-compiled) step(, for now \(trial paused\))?, [\d.]+ ms"
            r"|runs the (fused|stock|XLA-compiled) step, for now \(trial paused before a timed")
    gated = r"runs the stock step \(price gate: .*(from ~\d+ calls|nothing measured).*fuse="
    # the step kept with its figures (the guard's trial ran), or the gate's reason in a line
    assert re.search(kept, default) or re.search(gated, default), default
    assert "runs the fused step (not timed: fuse='always')" in always, always
    assert "ResourceApplyAdam" in done.stdout.split(always, 1)[1]


@pytest.mark.parametrize("figures", [
    {"fused_first_s": 9.0, "stock_first_s": 3.0, "fused_ms": 40.0, "stock_ms": 60.0},
    {"fused_first_s": 2.5, "stock_first_s": 1.0, "stock_ms": 0.8},  # the fused step unmeasured
])
def test_the_gate_says_from_how_many_calls_tfmx_runs(figures):
    from tfmx.step_price import price_gate

    short = price_gate(figures, 16)
    assert short.run == "stock" and short.pays_from > 16
    assert price_gate(figures, short.pays_from).run == "tfmx"
    assert price_gate(figures, short.pays_from - 2).run == "stock"
    line = short.headline(16)
    assert f"from ~{short.pays_from} calls" in line and "fuse='always'" in line
