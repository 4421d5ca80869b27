"""The whole-step guard's price: its budget, early decisions, reused outcomes, XLA's compile.

Every test here runs on injected times and an injected clock (or on what a fit plans), never on
a timed assertion.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tfmx
from tfmx import guard, step_gain
from tfmx.guard import StepGuard, plan_fit
from tfmx.tuner import TuningCache


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.setenv("TFMX_TUNE", "off")
    monkeypatch.delenv("TFMX_GUARD_BUDGET", raising=False)
    guard.forget()
    yield
    guard.forget()


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _run(g: StepGuard, times: dict, clock: Clock | None = None, limit: int = 200,
         first: dict | None = None) -> int:
    """Run ``g`` until it keeps a form; ``times[form]`` a step time or a list cycled through,
    ``first[form]`` its first call's; the clock advances by each step. Returns the steps run."""
    seen: dict[str, int] = {}
    for steps in range(limit):
        if g.decided:
            return steps
        form = g.next_form()
        if g.decided:
            return steps
        t = times[form]
        if first and form in first and form not in g.trial.warm:
            t = first[form]
        elif isinstance(t, list):
            t = t[seen.get(form, 0) % len(t)]
            seen[form] = seen.get(form, 0) + 1
        if clock is not None:
            clock.now += t
        g.record(form, t)
    return limit


def test_a_plain_loser_is_dropped_after_two_pairs():
    g = StepGuard("t")
    _run(g, {"fused": 0.010, "stock": 0.002})
    assert g.kept == "stock" and g.summary().pairs == 2, g.summary().describe()
    assert "t-test" in g.summary().reason
    # XLA 5x slower than the fused step that beat stock: dropped at its second pair
    g = StepGuard("t", ("fused", "xla"))
    steps = _run(g, {"fused": 0.002, "stock": 0.004, "xla": [0.0101, 0.0099]})
    assert g.kept == "fused" and len(g.trial.timed["xla"]) == 2, g.summary().describe()
    assert steps <= 2 + 2 * 2 + 1 + 2 * 2


def test_forms_within_noise_still_take_the_full_trial():
    rng = np.random.default_rng(0)
    noisy = list(1.0 + rng.normal(0, 0.05, 200))
    g = StepGuard("t")
    _run(g, {"fused": noisy, "stock": noisy[::-1]})
    assert g.kept == "stock" and g.summary().pairs >= guard.MIN_PAIRS


def test_stock_is_not_traced_when_its_trace_would_cost_more_than_the_budget():
    """A short fit: 2 % of it does not cover stock's first call, so no trial at all."""
    clock = Clock()
    g = StepGuard("t", budget=0.02, planned=True, first_call_s=2.0, clock=clock)
    plan_fit(3, 16)  # 48 steps of 10 ms after a 2 s first call: a 2.5 s fit, 0.05 s budget
    _run(g, {"fused": 0.010, "stock": 0.008}, clock)
    s = g.summary()
    assert g.kept == "fused" and not s.final and s.cost_s == 0.0, s.describe()
    assert "stock" not in g.trial.warm and "paused" in s.reason and "stock's first call" in s.reason
    assert s.budget_s == pytest.approx(0.02 * s.run_s)


def test_the_budget_stops_a_trial_and_a_longer_fit_resumes_it():
    clock = Clock()
    g = StepGuard("t", budget=0.02, planned=True, first_call_s=0.01, clock=clock)
    plan_fit(1, 80)  # 80 steps of ~10 ms: a ~0.8 s fit, a ~16 ms budget
    # stock's first call 5 ms, then a noisy stock against a steady fused: no quick verdict,
    # every slower step costs
    times = {"fused": 0.010, "stock": [0.014, 0.007, 0.015, 0.006, 0.016, 0.005]}
    _run(g, times, clock, first={"stock": 0.005})
    s = g.summary()
    assert g.decided and not s.final and "paused" in s.reason, s.describe()
    assert s.pairs < guard.MAX_PAIRS
    assert s.cost_s <= s.budget_s  # it stopped before paying what it could not afford
    # conservatively: the fused step is not faster beyond noise, stock is kept for now
    assert g.kept == "stock"
    # a long fit gives it budget again: the trial goes on from its evidence, and ends
    plan_fit(10, 1000)
    assert not g.decided
    _run(g, times, clock, first={"stock": 0.005})
    s = g.summary()
    assert s.final and g.kept in ("fused", "stock") and s.pairs >= guard.MIN_PAIRS
    assert s.cost_s <= s.budget_s


def test_a_first_call_beyond_its_expected_cost_leaves_the_fused_step_running():
    """Stock's trace fit the budget as expected, took longer: no timed pair, fused stays."""
    clock = Clock()
    g = StepGuard("t", budget=0.02, planned=True, first_call_s=0.5, clock=clock)
    plan_fit(1, 4000)  # ~40 s: a 0.8 s budget covers the 0.5 s expected
    _run(g, {"fused": 0.010, "stock": 0.009}, clock, first={"stock": 1.0})
    s = g.summary()
    assert "stock" in g.trial.warm and s.pairs <= 1 and g.kept == "fused" and not s.final, \
        s.describe()
    assert s.cost_s == pytest.approx(1.0 + 0.001 * s.pairs)


def test_without_a_plan_the_budget_grows_with_the_time_run():
    """A custom loop: the trial may cost 2 % of the time run so far."""
    clock = Clock()
    g = StepGuard("t", budget=0.02, ops=100, clock=clock)  # stock's trace: 0.1 s (the seed)
    g.record(g.next_form(), 0.010)  # the fused step, timed once
    assert g.next_form() == "fused" and g.decided  # 0.1 s is more than 2 % of 0 s
    clock.now += 4.0
    assert g.decided  # 2 % of 4 s: not yet
    clock.now += 1.1
    assert not g.decided and g.next_form() == "stock"  # 2 % of 5.1 s covers it


def test_xla_compile_time_is_measured_and_counted():
    g = StepGuard("t", ("fused", "xla"))
    g.record("fused", 0.002)
    _run(g, {"fused": 0.002, "stock": 0.004, "xla": 0.003}, limit=3)  # stock's first call
    while "xla" not in g.trial.warm:
        form = g.next_form()
        g.record(form, 3.0 if form == "xla" else {"fused": 0.002, "stock": 0.004}[form])
    _run(g, {"fused": 0.002, "stock": 0.004, "xla": 0.003})
    s = g.summary()
    assert g.kept == "fused" and s.xla_compile_s == 3.0
    assert s.cost_s >= 3.0 and "compiled in 3.00 s" in s.reason, s.describe()


def test_xla_is_not_compiled_when_its_expected_compile_exceeds_the_budget():
    clock = Clock()
    g = StepGuard("t", ("fused", "xla"), budget=0.02, planned=True, first_call_s=0.1,
                  ops=1000, clock=clock)
    plan_fit(1, 4000)  # ~4000 x 2 ms: an 8 s fit, a 0.16 s budget
    _run(g, {"fused": 0.002, "stock": 0.004, "xla": 0.001}, clock, first={"stock": 0.05})
    s = g.summary()
    # stock's first call (50 ms) was measured: XLA's seed is twice that per op, 0.1 s, which
    # fits; a second fit teaches the guard that XLA's first calls take 1 ms per op: 1 s
    assert "xla" in g.trial.warm or not s.final, s.describe()
    guard.forget()
    guard.learn_first_call("xla", 1.0, 1000)
    g = StepGuard("t", ("fused", "xla"), budget=0.02, planned=True, first_call_s=0.1,
                  ops=1000, clock=clock)
    plan_fit(1, 4000)
    _run(g, {"fused": 0.002, "stock": 0.004, "xla": 0.001}, clock, first={"stock": 0.05})
    s = g.summary()
    assert "xla" not in g.trial.warm and g.kept == "fused" and not s.final, s.describe()
    assert "XLA not tried: its compile, ~1.00 s expected" in s.reason


def test_xla_is_compiled_beyond_the_budget_where_its_expected_gain_pays():
    def trial(xla_ratio=None):
        guard.forget()
        guard.learn_first_call("xla", 1.0, 1000)  # 1 s: more than the trial's 0.16 s
        if xla_ratio is not None:  # XLA's steps measured here ran at this ratio of stock's
            step_gain.learn_gain(xla_ratio * 4.0, 4.0, form="xla")
        clock = Clock()
        g = StepGuard("t", ("fused", "xla"), budget=0.02, planned=True, first_call_s=0.1,
                      ops=1000, clock=clock)
        plan_fit(1, 4000)  # an 8 s fit: 0.16 s of budget
        _run(g, {"fused": 0.002, "stock": 0.004, "xla": 0.001}, clock,
             first={"stock": 0.05, "xla": 1.0})
        return g, g.summary()

    g, s = trial()  # nothing known of XLA's gain here: its compile waits for a longer fit
    assert "xla" not in g.trial.warm and "XLA not tried" in s.reason, s.describe()
    g, s = trial(0.9)  # 3.6 ms expected: no better than the fused step's 2 ms
    assert "xla" not in g.trial.warm, s.describe()
    g, s = trial(0.25)  # 1 ms a step: ~4 s saved over the fit, more than 2 x its 1 s compile
    assert "xla" in g.trial.warm and "XLA tried on the gain expected of it" in s.reason
    assert g.kept == "xla" and s.final, s.describe()  # its compile paused nothing


def test_xlas_compile_is_expected_from_the_steps_own_stock_first_call():
    guard.learn_first_call("xla", 30.0, 1000)  # 30 ms per op, measured on a small step
    guard.learn_price("small step", stock_first_s=1.0, xla_first_s=3.0)  # XLA: 3 x stock's
    g = StepGuard("t", ("fused", "xla"), budget=0.02, first_call_s=5.0, ops=20000)
    assert g.budget.expected_first_call("xla")[0] == pytest.approx(600.0)  # per op: no stock
    g.warmed("stock", 2.0)  # the fit ran stock first: its first call took 2 s
    seconds, how = g.budget.expected_first_call("xla")
    assert seconds == pytest.approx(6.0) and how.startswith("3.00 x stock's first call")
    assert g.trial.cost() == 0.0  # stock's first call was the fit's, not the trial's
    fresh = StepGuard("t", ("fused", "xla"), budget=0.02, first_call_s=5.0, ops=20000)
    fresh.record("fused", 0.01)
    fresh.record("stock", 1.5)  # stock's first call, timed in the trial
    assert fresh.budget.expected_first_call("xla")[0] == pytest.approx(4.5)


def test_an_outcome_is_reused_by_a_fresh_guard_from_the_same_cache(tmp_path):
    path = tmp_path / "tuning.json"
    g = StepGuard("t", first_call_s=1.0)
    g.remember(TuningCache(path, {"machine": "m"}), "t sig")
    _run(g, {"fused": 0.010, "stock": [0.5, 0.002]})
    assert g.kept == "stock" and g.summary().final
    cost = g.summary().cost_s
    assert cost >= 0.5
    guard.forget()  # as a new process: only the file remains
    fresh = StepGuard("t")
    fresh.remember(TuningCache(path, {"machine": "m"}), "t sig")
    s = fresh.summary()
    assert fresh.decided and fresh.kept == "stock" and s.pairs == 0 and s.cost_s == 0.0
    assert s.saved_s == pytest.approx(cost) and "saved" in s.describe()
    other = StepGuard("t")
    other.remember(TuningCache(path, {"machine": "another"}), "t sig")
    assert not other.decided  # another machine's outcome is not this one's


def test_a_cached_form_is_switched_to_only_where_it_pays_for_its_first_call():
    g = StepGuard("t")
    g.remember(None, "t sig")
    _run(g, {"fused": 0.004, "stock": 0.002})  # stock kept: 2 ms a step faster
    assert g.kept == "stock"
    guard.learn_first_call("stock", 1.0, 1000)  # and its first call takes 1 s here
    for calls, kept in ((48, "fused"), (5000, "stock")):
        plan_fit(1, calls)
        again = StepGuard("t", budget=0.02, planned=True, ops=1000)
        again.remember(None, "t sig")
        assert again.decided and again.next_form() == kept
        s = again.summary()
        assert s.saved_s > 0 and s.final == (kept == "stock"), s.describe()
    # without a plan (a custom loop): fused until the time it lost covers stock's first call
    loop = StepGuard("t", budget=0.02, ops=1000)
    loop.remember(None, "t sig")
    calls = 0
    while loop.decided and loop.next_form() == "fused":
        calls += 1
    assert 495 <= calls <= 505 and loop.kept == "stock"  # 1 s / 2 ms


def test_an_outcome_is_reused_in_the_process_without_a_cache():
    g = StepGuard("t")
    g.remember(None, "t sig")
    _run(g, {"fused": 0.002, "stock": 0.004})
    again = StepGuard("t")
    again.remember(None, "t sig")
    assert again.kept == "fused" and "in this process" in again.summary().reason


def _model():
    keras.utils.set_random_seed(0)
    inp = keras.Input((16,))
    h = keras.layers.Dense(32, activation="relu")(inp)
    model = keras.Model(inp, keras.layers.Dense(4)(h))
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _train_guards():
    return [g for g in tfmx.report().guards if g.function.endswith("train_step")]


def test_a_short_fit_announces_its_plan_and_pays_no_trial():
    x = np.random.default_rng(0).normal(size=(512, 16)).astype("float32")
    y = np.zeros(512, "int32")
    tfmx.enable(backend="cpu", guard=True, tune="off", xla=False)
    model = _model()
    model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    assert guard.current_plan().calls == 48
    # nothing known of the step: stock ran first, and tfmx's first call could not pay in the
    # 42 calls left, so no trial ran and nothing of tfmx's was traced
    assert _train_guards() == []
    notes = [n for n in tfmx.report().notes if n.startswith("price gate")]
    assert "stock runs first" in notes[0]
    assert notes[1].startswith("price gate, after 6 call(s) as stock: ")
    assert "ran as stock" in notes[1] and "(the 42 calls left)" in notes[1]
    assert tfmx.report().python_traces[("Sequential.train_step", "stages")] == 0
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=4)
    model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    assert guard.current_plan().calls == 12


def test_a_fit_that_raises_leaves_no_plan_under_way():
    """A fit interrupted after ``on_train_begin`` (its ``on_train_end`` never runs) ends its
    plan too: later measurements outside a fit are not sized on it."""

    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise KeyboardInterrupt

    x = np.random.default_rng(0).normal(size=(64, 16)).astype("float32")
    tfmx.enable(backend="cpu", guard=True, tune="off", xla=False)
    with pytest.raises(KeyboardInterrupt):
        _model().fit(x, np.zeros(64, "int32"), batch_size=32, epochs=1, verbose=0,
                     callbacks=[Interrupt()])
    assert guard.current_plan().calls == 2 and guard.active_plan() is None


def test_a_second_fit_and_a_second_model_reuse_the_decision(monkeypatch, slow_forms):
    monkeypatch.setenv("TFMX_GUARD_BUDGET", "none")  # the first trial runs to its end
    x = np.random.default_rng(0).normal(size=(640, 16)).astype("float32")
    y = np.zeros(640, "int32")
    tfmx.enable(backend="cpu", guard=True, tune="off", xla=False)
    slow_forms(fused=0.004)
    model = _model()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    (first,) = _train_guards()
    assert first.kept == "stock" and first.summary().final
    pairs = first.summary().pairs
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # the same guard: no new pair
    assert _train_guards() == [first] and first.summary().pairs == pairs
    _model().fit(x, y, batch_size=16, epochs=1, verbose=0)  # same architecture, new model
    # the price gate: the fused step was slower, so rewriting it cannot pay: stock, untraced
    assert _train_guards() == [first]
    assert tfmx.report().traces[-1].status == "stock: price gate"
