"""The price of a fit: the price gate's verdict, the tuner's share of a planned run, the report.

Every test here decides from injected figures, timings and plans, never from a timed assertion.
"""

from __future__ import annotations

import contextlib
import threading

import keras
import numpy as np
import pytest

import tfmx
from tfmx import background_trace, dispatch, first_call, guard, step_gain
from tfmx import tuner as tuner_mod
from tfmx.guard import GateDecision, StepGuard, fitting, learn_price, price_figures, price_gate
from tfmx.reporting import Report, TraceRecord
from tfmx.tuner import Decision, Timings, Tuner, TuningCache, for_plan


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.setenv("TFMX_TUNE", "off")
    monkeypatch.delenv("TFMX_GUARD_BUDGET", raising=False)
    monkeypatch.delenv("TFMX_TUNE_SHARE", raising=False)
    guard.forget()
    yield
    guard.forget()


KNOWN = {"fused_first_s": 9.0, "stock_first_s": 3.0, "fused_ms": 40.0, "stock_ms": 60.0,
         "ops": 700.0}


# -- the verdict ------------------------------------------------------------------------------
def test_a_rewrite_that_saves_less_than_its_first_call_costs_runs_stock():
    verdict = price_gate(KNOWN, 48)  # saves 48 x 20 ms = 0.96 s, costs 6 s more
    assert verdict.run == "stock"
    assert "6.00 s more than stock's" in verdict.why and "0.96 s" in verdict.why


def test_a_long_fit_pays_for_the_same_rewrite():
    assert price_gate(KNOWN, 301).run == "tfmx"  # 301 x 20 ms = 6.02 s > 6 s
    assert price_gate(KNOWN, 300).run == "stock"  # 6.00 s: not more than it costs


def test_a_fused_step_slower_than_stock_never_pays():
    slower = {**KNOWN, "fused_ms": 70.0, "fused_first_s": 3.0}
    assert price_gate(slower, 10**6).run == "stock"


def test_nothing_measured_or_no_plan_runs_tfmx():
    assert price_gate({}, 48).run == "tfmx"
    assert "nothing measured" in price_gate({}, 48).why
    assert price_gate(KNOWN, None).run == "tfmx"


def test_nothing_measured_a_loop_that_can_switch_runs_stock_first():
    verdict = price_gate({}, 48, switchable=True)
    assert verdict.run == "stock" and "stock runs first" in verdict.why
    assert price_gate({}, 48, share=None, switchable=True).run == "tfmx"  # no budget: a trial
    assert price_gate({}, None, switchable=True).run == "tfmx"  # no plan


def _no_gain_expected():
    """A machine whose fused steps measured no faster than stock's: the gate's prior expects
    no gain, so a step whose fused form was never measured runs on the trial's budget alone."""
    step_gain.learn_gain(50.0, 50.0)


def test_fused_unmeasured_its_first_call_is_seeded_from_stocks():
    _no_gain_expected()
    stock_only = {"stock_first_s": 2.0, "stock_ms": 40.0}
    # fused's first call expected at FUSED_SEED x 2 s = 3 s: 1 s beyond stock's
    assert price_gate(stock_only, 1249).run == "stock"  # 2% of 1249 x 40 ms < 1 s
    verdict = price_gate(stock_only, 1251)
    assert verdict.run == "tfmx" and "the fused step not measured yet" in verdict.why
    assert "seed: 1.5 x stock's first call" in verdict.why
    # asked mid-fit, stock already traced: tfmx's whole first call (3 s) is the extra
    assert price_gate(stock_only, 1251, traced=True).run == "stock"
    assert price_gate(stock_only, 3751, traced=True).run == "tfmx"
    guard.learn_first_call("fused", 0.7, 700)  # learnt here: 1 ms per op
    assert "learnt" not in price_gate(stock_only, 10, traced=True).why  # ops unknown: a seed
    verdict = price_gate({**stock_only, "ops": 700.0}, 876, traced=True)  # 0.7 s of 35 s
    assert verdict.run == "tfmx" and "measured here" in verdict.why


def test_both_known_asked_mid_fit_the_whole_first_call_is_the_extra():
    assert price_gate(KNOWN, 301).run == "tfmx"  # 6 s more than stock's: 301 x 20 ms > 6 s
    assert price_gate(KNOWN, 301, traced=True).run == "stock"  # 9 s: more than 6.02 s
    assert price_gate(KNOWN, 451, traced=True).run == "tfmx"


def test_fused_unmeasured_a_long_enough_fit_tries_it_on_the_gain_expected_here():
    stock_only = {"stock_first_s": 2.0, "stock_ms": 40.0}
    # nothing measured in both forms: the seed (0.85 x stock's) saves 6 ms a call; tfmx's
    # whole first call (3 s, traced mid-fit) is paid where 2 x 3 s is saved: from ~1000 calls
    verdict = price_gate(stock_only, 990, traced=True)
    assert verdict.run == "stock" and verdict.pays_from in (1000, 1001)
    assert "expected at 0.85 x stock's (seed" in verdict.why
    verdict = price_gate(stock_only, 1010, traced=True)
    assert verdict.run == "tfmx" and "~6.06 s saved over the fit's 1010 calls" in verdict.why
    # steps measured in both forms here replace the seed: 0.5 x stock's saves 20 ms a call
    learn_price("other step", fused_ms=30.0, stock_ms=60.0)
    learn_price("other step", fused_ms=30.0, fused_first_s=1.0)  # no new pair: learnt once
    assert step_gain.expected_gain() == (0.5, "the median of 1 step(s) measured in both "
                                              "forms here")
    assert price_gate(stock_only, 305, traced=True).run == "tfmx"
    assert price_gate(stock_only, 295, traced=True).pays_from in (300, 301)
    # where they measured no faster, no length of fit tries it on the prior
    for _ in range(2):
        step_gain.learn_gain(61.0, 60.0)
    verdict = price_gate(stock_only, 10**6, traced=False)
    assert verdict.run == "tfmx" and "trial's budget" in verdict.why  # the budget covers it
    verdict = price_gate(stock_only, 3000, traced=True)
    assert verdict.run == "stock" and "no gain expected" in verdict.why


def test_a_fused_step_measured_with_the_tuner_cut_short_is_tried_again_on_the_prior():
    # measured no faster: its forms were Keras's where the tuner's budget ran out
    figures = {**KNOWN, "fused_ms": 60.0, "fused_deferred": 12.0}
    verdict = price_gate(figures, 1000, traced=True)  # 9 s: 2 x 9 s over 9 ms a call: 2001
    assert verdict.run == "stock" and verdict.pays_from in (2000, 2001)
    verdict = price_gate(figures, 2010, traced=True)
    assert verdict.run == "tfmx"
    assert "with 12 of the tuner's decisions left unmeasured" in verdict.why
    assert price_gate({**figures, "fused_deferred": 0.0}, 10**6).run == "stock"  # final
    # a provisional figure teaches no gain; a final one does
    learn_price("step", stock_ms=60.0, fused_ms=58.0, fused_deferred=3.0)
    assert step_gain.expected_gain()[0] == step_gain.GAIN_SEED
    learn_price("step", fused_ms=45.0, fused_deferred=0.0)
    assert price_figures("step")["fused_deferred"] == 0.0
    assert step_gain.expected_gain()[0] == pytest.approx(0.75)


def test_the_gain_expected_round_trips_through_the_machines_cache(tmp_path):
    cache = TuningCache(tmp_path / "t.json", {"backend": "cpu"})
    learn_price("a", cache, stock_ms=60.0)
    learn_price("a", cache, fused_ms=45.0)  # a new pair: 0.75
    guard.forget()  # a new process: the cache file alone
    assert step_gain.expected_gain()[0] == step_gain.GAIN_SEED  # without the cache: the seed
    again = TuningCache(tmp_path / "t.json", {"backend": "cpu"})
    assert step_gain.expected_gain(again)[0] == pytest.approx(0.75)


def test_the_machines_figures_outlive_a_tfmx_version_and_its_decisions_do_not(tmp_path):
    old = TuningCache(tmp_path / "old.json", {"backend": "cpu", "code": "old"})
    learn_price("a", old, stock_ms=60.0, stock_first_s=2.0)
    learn_price("a", old, fused_ms=45.0, fused_first_s=3.0)
    guard.forget()  # a new process running another tfmx: another file for its decisions
    new = TuningCache(tmp_path / "new.json", {"backend": "cpu", "code": "new"})
    assert price_figures("a", new) == {}  # the step's record: measured again
    assert step_gain.expected_gain(new)[0] == pytest.approx(0.75)
    assert first_call.expected_first_call("fused", 100, 0.0, new, 4.0)[0] == pytest.approx(6.0)
    assert new.figures().path == old.figures().path != new.path
    guard.forget()
    other = TuningCache(tmp_path / "t.json", {"backend": "cpu", "code": "new", "onednn": True})
    assert step_gain.expected_gain(other)[0] == step_gain.GAIN_SEED  # another machine state


def test_stock_unmeasured_the_rewrite_runs_within_the_trials_budget():
    fused_only = {"fused_first_s": 0.03, "fused_ms": 40.0}
    # its whole first call (stock's not measured, none learnt): 0.03 s <= 2% of 48 x 40 ms
    assert price_gate(fused_only, 48).run == "tfmx"
    costly = {"fused_first_s": 5.0, "fused_ms": 40.0}
    verdict = price_gate(costly, 48)
    assert verdict.run == "stock" and "stock runs and is measured" in verdict.why
    assert price_gate(costly, 48, share=None).run == "tfmx"  # no budget: the trial decides
    assert price_gate(costly, 10**4).run == "tfmx"  # 2% of 400 s covers it


def test_stock_unmeasured_its_first_call_is_expected_from_what_was_learnt_per_op():
    guard.learn_first_call("stock", 4.98, 700)  # per op, as learnt here
    verdict = price_gate({"fused_first_s": 5.0, "fused_ms": 40.0, "ops": 700.0}, 48)
    assert verdict.run == "tfmx" and "learnt here per op" in verdict.why


# -- what tfmx's first call is expected to cost --------------------------------------------------
def _small_models_measured(n=25, cache=None):
    """``n`` small steps fitted here before: stock's first call and tfmx's of each, 1.2 times
    stock's, at 12 to 15 ms per op (fixed costs dominate a small step's first call)."""
    for i in range(n):
        ops = 32 + i
        learn_price(f"small {i}", cache, stock_first_s=0.4, ops=float(ops))
        guard.learn_first_call("stock", 0.4, ops, cache)
        learn_price(f"small {i}", cache, fused_first_s=0.48)
        guard.learn_first_call("fused", 0.48, ops, cache)


def test_a_large_steps_first_call_is_its_stock_first_call_times_the_learnt_ratio():
    _small_models_measured()
    _no_gain_expected()
    assert first_call.learnt_ratio("fused") == (pytest.approx(1.2), 25)
    # a large step (20,000 ops) whose stock first call took 2 s: tfmx's is expected at 2.4 s,
    # not at the small models' seconds per op times its ops (~280 s)
    seconds, how = guard.expected_first_call("fused", 20000, stock_first_s=2.0)
    assert seconds == pytest.approx(2.4)
    assert how == "1.20 x stock's first call (2.00 s, measured), the median of 25 ratio(s) " \
                  "measured here"
    big = {"stock_first_s": 2.0, "stock_ms": 100.0, "ops": 20000.0}
    # asked mid-fit, stock traced: 2.4 s within 2% of the calls left x 100 ms from 1200 calls
    verdict = price_gate(big, 1201, traced=True)
    assert verdict.run == "tfmx" and "~2.40 s expected, 1.20 x stock's" in verdict.why
    assert verdict.expected_s == pytest.approx(2.4) and verdict.expected_how == how
    assert price_gate(big, 1199, traced=True).run == "stock"
    # before the first trace: only tfmx's 0.4 s beyond stock's is the extra
    assert price_gate(big, 201).run == "tfmx" and price_gate(big, 199).run == "stock"


def test_the_smaller_of_the_two_models_is_expected_where_both_apply():
    """Small models whose stock first calls are mostly fixed costs teach a ratio of 4.5; their
    seconds per op (1.5 ms) expect a larger step's first call nearer what it costs."""
    for i in range(3):
        ops = 1000 + 500 * i
        learn_price(f"small {i}", stock_first_s=ops * 0.33e-3, ops=float(ops))
        learn_price(f"small {i}", fused_first_s=ops * 1.5e-3)
        guard.learn_first_call("fused", ops * 1.5e-3, ops)
    assert first_call.learnt_ratio("fused")[0] == pytest.approx(1.5 / 0.33)
    seconds, how = guard.expected_first_call("fused", 2300, stock_first_s=3.0)
    assert seconds == pytest.approx(3.45) and how.startswith("1.50 ms per op")
    seconds, how = guard.expected_first_call("fused", 20000, stock_first_s=3.0)  # larger yet
    assert seconds == pytest.approx(3.0 * 1.5 / 0.33) and "x stock's first call" in how


def test_the_ratio_is_robust_to_one_outlier():
    for seconds in (1.2, 1.3, 40.0):  # one first call slowed by something else
        first_call.learn_first_call_ratio("fused", seconds, 1.0)
    assert first_call.learnt_ratio("fused") == (1.3, 3)
    assert guard.expected_first_call("fused", 100, stock_first_s=2.0)[0] == pytest.approx(2.6)
    first_call.learn_first_call_ratio("fused", 1.25, 1.0)  # four: the two middle ones
    assert first_call.learnt_ratio("fused")[0] == pytest.approx((1.25 * 1.3) ** 0.5)


def test_a_ratio_is_learnt_once_per_pair_of_first_calls_measured():
    learn_price("step", stock_first_s=2.0, ops=700.0)
    assert first_call.learnt_ratio("fused") is None  # stock's alone: no pair
    learn_price("step", fused_first_s=3.0, fused_ms=40.0)
    learn_price("step", fused_first_s=3.0, stock_ms=60.0)  # the same first calls again
    learn_price("step", xla_first_s=8.0)
    assert first_call.learnt_ratio("fused") == (1.5, 1)
    assert first_call.learnt_ratio("xla") == (4.0, 1)
    learn_price("step", stock_first_s=2.5)  # stock's measured again: a new pair of each
    assert first_call.learnt_ratio("fused") == (pytest.approx((1.5 * 1.2) ** 0.5), 2)


def test_without_stocks_first_call_the_per_op_model_takes_the_median():
    for seconds in (1.0, 1.0, 30.0):  # 1 ms per op, and one outlier at 30 ms per op
        guard.learn_first_call("xla", seconds, 1000)
    seconds, how = guard.expected_first_call("xla", 2000)
    assert seconds == pytest.approx(2.0)
    assert how == "1.00 ms per op, the median of 3 first call(s) measured here"
    first_call.learn_first_call_ratio("xla", 3.0, 1.0)  # a ratio: used where stock's is known
    assert guard.expected_first_call("xla", 2000)[0] == pytest.approx(2.0)
    assert guard.expected_first_call("xla", 2000, stock_first_s=0.5)[0] == pytest.approx(1.5)
    for seconds in (1.0, 1.0, 30.0):  # stock's per op, for the gate where it was not measured
        guard.learn_first_call("stock", seconds, 1000)
    verdict = price_gate({"fused_first_s": 5.0, "fused_ms": 40.0, "ops": 1000.0}, 48)
    assert "~1.00 s expected, learnt here per op (the median of 3)" in verdict.why


def test_the_empty_machine_keeps_its_seeds():
    assert guard.expected_first_call("fused", 100, stock_first_s=2.0) == (
        2.0 * first_call.FUSED_SEED, "seed: 1.5 x stock's first call (measured)")
    assert guard.expected_first_call("xla", 100, stock_first_s=2.0)[0] == 2.0 * first_call.XLA_SEED
    assert guard.expected_first_call("stock", 100) == (0.1, "seed: 1 ms per op")


def test_first_calls_learnt_round_trip_through_the_machines_cache(tmp_path):
    path = tmp_path / "t.json"
    cache = TuningCache(path, {"backend": "cpu"})
    cache.put(Decision("guard-first-call", "fused", "fused", ("fused",),  # another layout
                       {"ms_per_op": 15.65, "n": 25.0}))
    _small_models_measured(first_call.HISTORY + 5, cache)
    guard.forget()  # a new process: the cache file alone
    again = TuningCache(path, {"backend": "cpu"})
    assert first_call.learnt_ratio("fused", again) == (pytest.approx(1.2), first_call.HISTORY)
    assert first_call.learnt_rate("fused", again)[1] == first_call.HISTORY  # the last ones
    assert guard.expected_first_call("fused", 20000, 0.0, again, 2.0)[0] == pytest.approx(2.4)
    guard.forget()
    other_layout = TuningCache(tmp_path / "elsewhere" / "other.json", {"backend": "cpu"})
    other_layout.put(Decision("guard-first-call", "fused", "fused", ("fused",),
                          {"ms_per_op": 15.65, "n": 25.0}))
    assert first_call.learnt_rate("fused", other_layout) is None  # ignored: the seeds stand
    assert guard.expected_first_call("fused", 20000, 0.0, other_layout, 2.0)[0] == 3.0


def test_the_report_line_names_the_function_the_form_and_the_figures():
    line = price_gate(KNOWN, 48).describe("Functional.train_step")
    assert line.startswith("price gate: Functional.train_step ran as stock: ")
    assert "fused 40.00 ms, stock 60.00 ms a call" in line
    assert GateDecision("tfmx", "why").describe("f") == "price gate: f ran as tfmx: why"


# -- what is learnt -----------------------------------------------------------------------------
def test_figures_are_merged_and_kept_in_the_machines_cache(tmp_path):
    cache = TuningCache(tmp_path / "t.json", {"backend": "cpu"})
    learn_price("step", cache, fused_first_s=9.0, fused_ms=40.0, stock_ms=None)
    learn_price("step", cache, stock_ms=60.0, stock_first_s=float("nan"))
    guard.forget()  # a new process: the cache file alone
    again = TuningCache(tmp_path / "t.json", {"backend": "cpu"})
    assert price_figures("step", again) == {"fused_first_s": 9.0, "fused_ms": 40.0,
                                            "stock_ms": 60.0}
    learn_price("", cache, fused_ms=1.0)  # no key: nothing
    assert price_figures("", cache) == {}


def test_a_paused_trial_records_the_fused_steps_price():
    g = StepGuard("demo", budget=0.02, planned=True, first_call_s=5.0, ops=700)
    g.price_key = "demo step"
    with fitting(1, 40):
        g.record(g.next_form(), 0.040)
        assert g.next_form() == "fused" and not g.summary().final  # paused: stock unaffordable
    assert price_figures("demo step") == {"fused_first_s": 5.0, "fused_ms": 40.0, "ops": 700.0,
                                          "fused_deferred": 0.0}  # every decision measured


def test_a_finished_trial_records_both_forms():
    g = StepGuard("demo", budget=None, first_call_s=5.0, ops=700)
    g.price_key = "demo step"
    while not g.decided:
        form = g.next_form()
        g.record(form, 0.010 if form == "fused" else 0.020)
    figures = price_figures("demo step")
    assert figures["fused_ms"] == 10.0 and figures["stock_ms"] == 20.0
    assert figures["stock_first_s"] == 0.020  # stock's first (untimed) call, as recorded


# -- the tuner within a planned fit ---------------------------------------------------------------
def _timings(first):
    return lambda candidates, seconds: Timings(
        {"stock": [0.002] * 8, "fast": [0.001] * 8}, first)


def test_a_form_whose_first_call_does_not_pay_over_the_plan_is_not_taken():
    costly = _timings({"stock": 0.1, "fast": 0.6})  # +0.5 s to save 1 ms a step
    with fitting(1, 48):
        d = Tuner("auto", None, costly).choose("f", "s", {"stock": None, "fast": None}, "stock")
    assert d.choice == "stock" and "first call (+500 ms)" in d.note
    with fitting(10, 100):  # 1000 steps save 1 s
        d = Tuner("auto", None, costly).choose("f", "s", {"stock": None, "fast": None}, "stock")
    assert d.choice == "fast"
    d = Tuner("auto", None, costly).choose("f", "s", {"stock": None, "fast": None}, "stock")
    assert d.choice == "fast" and d.first_ms == {"stock": 100.0, "fast": 600.0}  # no plan


def test_for_plan_leaves_decisions_without_first_calls_as_they_are():
    d = Decision("f", "s", "fast", ("stock", "fast"), {"stock": 2.0, "fast": 1.0})
    assert for_plan(d, "stock", 1) is d


def test_the_tuners_share_of_a_planned_run_bounds_its_measuring():
    tuner = Tuner("auto", None, lambda candidates, seconds: pytest.fail("measured"))
    tuner.step_hint = lambda: 0.001  # a step known from a previous fit: 1 ms
    with fitting(1, 48):  # 2% of 48 x 1 ms: 0.96 ms
        tuner._sync_plan()
        tuner._plan_spent = 0.001  # what this fit measured already, beyond its share
        d = tuner.choose("f", "s", {"stock": None, "fast": None}, "stock")
    assert d.choice == "stock" and d.source.startswith("conservative (measuring budget spent")
    assert "48 steps x 1.0 ms a step (known from a previous fit)" in d.source


def test_the_share_counts_afresh_in_each_fit_and_not_outside_one():
    timer = _timings({})
    tuner = Tuner("auto", None, timer)
    with fitting(1, 48):
        tuner._sync_plan()
        tuner._plan_spent = 10.0
    with fitting(1, 48):  # a new fit: its own share; nothing known of its step, one measured
        assert tuner.choose("f", "a", {"stock": None, "fast": None}, "stock").source == "measured"
    assert tuner.choose("f", "b", {"stock": None, "fast": None}, "stock").source == "measured"


def test_plan_share_reads_its_environment_variable(monkeypatch):
    monkeypatch.setenv("TFMX_TUNE_SHARE", "none")
    assert tuner_mod.plan_share() is None
    monkeypatch.setenv("TFMX_TUNE_SHARE", "0.1")
    assert tuner_mod.plan_share() == 0.1
    monkeypatch.setenv("TFMX_TUNE_SHARE", "lots")
    with pytest.raises(ValueError, match="TFMX_TUNE_SHARE"):
        tuner_mod.plan_share()


# -- the report --------------------------------------------------------------------------------
def test_the_report_shows_each_traces_tracing_and_tuning_seconds():
    report = Report(backend="cpu")
    report.add_trace(TraceRecord("M.train_step", "cpu", "rewritten", seconds=0.25,
                                 trace_seconds=1.5, tune_seconds=0.75))
    text = str(report)
    assert "rewrite s  trace s  tuning s" in text
    assert "0.250    1.500     0.750" in text
    assert report.to_dict()["traces"][0]["tune_seconds"] == 0.75


# -- a fit ---------------------------------------------------------------------------------------
def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(4)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@contextlib.contextmanager
def _gated(monkeypatch, gate):
    """tfmx on with the guard and ``gate`` as the price gate: a new model, its data."""
    _in_the_fits_thread(monkeypatch)
    monkeypatch.setattr(guard, "price_gate", gate)
    x = np.random.default_rng(0).normal(size=(256, 16)).astype("float32")
    tfmx.enable(backend="cpu", guard=True, tune="off", xla=False)
    try:
        yield _model(), x, np.zeros(256, "int32")
    finally:
        tfmx.disable()


def test_a_gated_fit_runs_stock_untraced_by_tfmx_and_learns_stocks_price(monkeypatch):
    seen = []

    def gate(figures, calls, share=None, cache=None, switchable=False, traced=False, beside=False):
        seen.append((calls, switchable, traced))
        return GateDecision("stock", "injected")

    with _gated(monkeypatch, gate) as (model, x, y):
        model.fit(x, y, batch_size=32, epochs=2, verbose=0)
        report = tfmx.report()
        # asked before the first trace, then after 1 + WATCHED_CALLS calls for the 10 left
        assert seen == [(16, True, False), (10, False, True)]
        assert [t.status for t in report.traces] == ["stock: price gate"]
        assert "price gate: Sequential.train_step ran as stock: injected" in report.notes
        assert not [g for g in report.guards if g.function.endswith("train_step")]
        assert report.python_traces[("Sequential.train_step", "stages")] == 0
        (key,) = guard._prices
        assert key.startswith("Sequential.train_step ")
        assert set(guard._prices[key]) == {"stock_first_s", "stock_ms", "ops", "fits"}
        assert guard._prices[key]["fits"] == 1  # one fit of two epochs
        assert guard.active_plan() is None  # the fit ended


def test_each_fit_of_a_step_is_counted_once_and_its_tuner_told(monkeypatch):
    """Three fits of one step (the same model built again, as a user refitting it does): the
    step's price record counts them, each fit once however often the gate is asked within it,
    and the tuner hears, for the fit under way, how many fits of its step ran here before
    (what its measuring share is sized for)."""
    from tfmx import state

    seen = []

    def gate(figures, calls, share=None, cache=None, switchable=False, traced=False, beside=False):
        seen.append(state.tuner().returning)
        return GateDecision("stock", "injected")

    with _gated(monkeypatch, gate) as (model, x, y):
        for _ in range(3):
            model.fit(x, y, batch_size=32, epochs=2, verbose=0)
            model = _model()
        (key,) = guard._prices
        assert guard._prices[key]["fits"] == 3
    serials = [s for s, _ in seen]
    assert [n for _, n in seen] == [0, 0, 1, 1, 2, 2]  # asked twice a fit
    assert serials[0] == serials[1] < serials[2] == serials[3] < serials[4] == serials[5]


def test_a_fit_without_the_guard_is_not_gated(monkeypatch):
    monkeypatch.setattr(guard, "price_gate", lambda *a, **k: pytest.fail("gated"))
    x = np.random.default_rng(0).normal(size=(64, 16)).astype("float32")
    tfmx.enable(backend="cpu", guard=False, tune="off")
    try:
        _model().fit(x, np.zeros(64, "int32"), batch_size=32, epochs=1, verbose=0)
        assert tfmx.report().traces[0].status != "stock: price gate"
    finally:
        tfmx.disable()


def test_decisions_made_while_measuring_another_are_made_for_the_same_fit():
    tuner = Tuner("auto", None)
    seen = []

    def timer(candidates, seconds):  # on the measuring thread
        seen.append(guard.active_plan())
        if len(seen) == 1:  # the outer decision's candidates make one of their own
            seen.append(tuner.choose("g", "inner", {"stock": None, "fast": None}, "stock"))
        return Timings({"stock": [0.002] * 8, "fast": [0.001] * 8})

    tuner.timer = timer
    with fitting(1, 48) as plan:
        outer = tuner.choose("f", "outer", {"stock": None, "fast": None}, "stock")
    assert seen[0] is plan and seen[1] is plan  # the outer's thread, the inner's thread
    assert seen[2].source == "measured" and outer.source == "measured"


def test_a_fused_step_kept_after_one_timed_call_is_timed_on_for_its_price(monkeypatch):
    monkeypatch.setattr(guard, "price_gate", lambda *a, **k: GateDecision("tfmx", "injected"))
    learnt = []
    real = guard.learn_price
    monkeypatch.setattr(guard, "learn_price", lambda key, cache=None, **figures: (
        learnt.append(sorted(k for k, v in figures.items() if v)), real(key, cache, **figures)))
    x = np.random.default_rng(0).normal(size=(512, 16)).astype("float32")
    tfmx.enable(backend="cpu", guard=True, tune="off", xla=False)
    try:
        _model().fit(x, np.zeros(512, "int32"), batch_size=32, epochs=3, verbose=0)
        (g,) = [g for g in tfmx.report().guards if g.function.endswith("train_step")]
        assert g.kept == "fused" and len(g.samples("fused")) < 5  # paused: stock unaffordable
        assert learnt[-1] == ["fused_ms"]  # the median of the trial's and the next calls
        (figures,) = guard._prices.values()
        assert figures["fused_ms"] > 0 and "stock_ms" not in figures
    finally:
        tfmx.disable()


def test_the_price_record_says_how_many_decisions_the_tuner_left_unmeasured(monkeypatch):
    monkeypatch.setattr(guard, "price_gate", lambda *a, **k: GateDecision("tfmx", "injected"))
    monkeypatch.setenv("TFMX_TUNE_BUDGET", "0")  # every decision: Keras's form, unmeasured
    x = np.random.default_rng(0).normal(size=(512, 16)).astype("float32")
    tfmx.enable(backend="cpu", guard=True, tune="auto", xla=False)
    try:
        _model().fit(x, np.zeros(512, "int32"), batch_size=32, epochs=3, verbose=0)
        deferred = [d for d in tfmx.report().decisions if "budget" in d.source]
        (figures,) = guard._prices.values()
        assert deferred and figures["fused_deferred"] == len(deferred)
    finally:
        tfmx.disable()


def _in_the_fits_thread(monkeypatch):
    """tfmx's form traced mid-fit in the fit's own thread, as where a worker cannot be used."""
    monkeypatch.setattr(background_trace, "why_not", lambda: "injected: the fit's thread")


def _beside_one_call(monkeypatch):
    """tfmx's form traced on a thread of its own, done after one stock call beside it."""
    asked = []

    def ready(self):
        asked.append(self)
        if len(asked) == 1:
            return False
        self.wait()
        return True

    monkeypatch.setattr(background_trace.BackgroundTrace, "ready", ready)


def test_the_tuners_measuring_is_left_out_of_the_first_call_a_price_record_keeps(monkeypatch):
    monkeypatch.setattr(guard, "price_gate", lambda *a, **k: GateDecision("tfmx", "injected"))
    spent = iter(range(0, 10**6, 1000))  # every look at the tuner: 1000 s more measured
    monkeypatch.setattr(dispatch, "_tuning_spent", lambda: float(next(spent)))
    x = np.random.default_rng(0).normal(size=(256, 16)).astype("float32")
    tfmx.enable(backend="cpu", guard=True, tune="off", xla=False)
    try:
        _model().fit(x, np.zeros(256, "int32"), batch_size=32, epochs=2, verbose=0)
        (figures,) = guard._prices.values()
        assert "fused_first_s" not in figures  # all of it was the tuner's: nothing left
        assert figures["fused_ms"] > 0
    finally:
        tfmx.disable()


def _fit_both(monkeypatch, gate, epochs=2, beside=False):
    """A stock fit and a tfmx fit (guard on, ``gate`` injected; tfmx's form traced mid-fit
    beside the stock calls where ``beside``, else in the fit's thread) of the same model and
    data: the tfmx report, its model's final weights and the stock model's."""
    (_beside_one_call if beside else _in_the_fits_thread)(monkeypatch)
    monkeypatch.setattr(guard, "price_gate", gate)
    x = np.random.default_rng(0).normal(size=(256, 16)).astype("float32")
    y = np.random.default_rng(1).integers(0, 4, size=256).astype("int32")
    stock = _model()
    stock.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    tfmx.enable(backend="cpu", guard=True, tune="off", xla=False)
    try:
        model = _model()
        model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
        return tfmx.report(), model.get_weights(), stock.get_weights()
    finally:
        tfmx.disable()


def test_a_fit_that_ran_stock_first_traces_tfmx_mid_fit_where_the_rest_pays(monkeypatch):
    def gate(figures, calls, share=None, cache=None, switchable=False, traced=False, beside=False):
        if traced:  # asked again, stock's price measured: tfmx pays for the calls left
            assert figures["stock_ms"] > 0 and figures["stock_first_s"] > 0
            return GateDecision("tfmx", "injected: pays")
        return GateDecision("stock" if switchable else "tfmx", "injected: nothing known")

    report, weights, stock_weights = _fit_both(monkeypatch, gate)
    assert [t.status for t in report.traces] == ["stock: price gate", "rewritten"]
    assert report.traces[1].ops_after.get("_FusedMatMul", 0) >= 1  # in the form that ran
    assert report.python_traces[("Sequential.train_step", "stock")] == 1
    assert report.python_traces[("Sequential.train_step", "stages")] == 1
    assert any(n.startswith("price gate, after 6 call(s) as stock: Sequential.train_step ran "
                            "as tfmx: injected: pays (the 10 calls left)") for n in report.notes)
    (g,) = [g for g in report.guards if g.function.endswith("train_step")]
    assert g.summary().pairs >= 1
    assert g.trial.cost() < 0.5  # stock's first call was the fit's, not the trial's
    for got, want in zip(weights, stock_weights, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_tfmxs_form_traced_beside_the_stock_calls_takes_over_once_traced(monkeypatch):
    seen = []

    def gate(figures, calls, share=None, cache=None, switchable=False, traced=False,
             beside=False):
        seen.append(beside)
        return GateDecision("tfmx" if traced else "stock", "injected")

    threads = []
    real = dispatch.IteratorDispatch._traced_twin
    monkeypatch.setattr(dispatch.IteratorDispatch, "_traced_twin", lambda self, *a: (
        threads.append(threading.current_thread()), real(self, *a))[1])
    report, weights, stock_weights = _fit_both(monkeypatch, gate, beside=True)
    assert seen == [False, True]  # asked before the first trace, then mid-fit: beside
    assert threads and threads[0] is not threading.main_thread()
    assert [t.status for t in report.traces] == ["stock: price gate", "rewritten"]
    (note,) = [n for n in report.notes if "traced beside 1 stock call(s)" in n]
    assert "the fit paid" in note and "its first run" in note
    assert first_call.learnt_ratio("beside")[1] == 1  # what the fit paid, against stock's
    for got, want in zip(weights, stock_weights, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_the_gate_weighs_what_a_trace_beside_the_steps_cost_here():
    stock_only = {"stock_first_s": 2.0, "stock_ms": 40.0}  # tfmx's first call: ~3 s (seed)
    first_call.learn_first_call_ratio("beside", 0.5, 1.0)  # such a trace cost the fit 0.5 x
    verdict = price_gate(stock_only, 2000, traced=True, beside=True)
    assert "traced beside its steps, ~1.00 s paid by the fit" in verdict.why
    assert verdict.extra_s == pytest.approx(1.0)
    assert price_gate(stock_only, 2000, traced=True).extra_s == pytest.approx(3.0)  # in-thread


def test_the_gates_estimate_of_tfmxs_first_call_is_reported_beside_the_call(monkeypatch):
    def gate(figures, calls, share=None, cache=None, switchable=False, traced=False, beside=False):
        if traced:
            return GateDecision("tfmx", "injected: pays", 2.4, "1.20 x stock's first call")
        return GateDecision("stock", "injected: nothing known")

    report, _, _ = _fit_both(monkeypatch, gate)
    (estimate,) = report.first_calls
    assert estimate["function"] == "Sequential.train_step" and estimate["form"] == "fused"
    assert estimate["predicted_s"] == 2.4 and estimate["measured_s"] > 0
    assert estimate["measured/predicted"] == pytest.approx(estimate["measured_s"] / 2.4)
    assert report.to_dict()["first_calls"] == [estimate]
    assert any(n.startswith("price gate's estimate of tfmx's first call of "
                            "Sequential.train_step: ~2.40 s (1.20 x stock's first call), "
                            "measured ") for n in report.notes)


def test_a_fit_that_ran_stock_first_stays_stock_where_the_rest_cannot_pay(monkeypatch):
    report, weights, stock_weights = _fit_both(monkeypatch, guard.price_gate)  # the real gate
    assert [t.status for t in report.traces] == ["stock: price gate"]
    assert report.python_traces[("Sequential.train_step", "stages")] == 0
    assert any("stock runs first" in n for n in report.notes)
    assert any(n.startswith("price gate, after 6 call(s) as stock: Sequential.train_step ran "
                            "as stock: its first call") for n in report.notes)
    for got, want in zip(weights, stock_weights, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_form_that_fails_mid_fit_leaves_stock_running(monkeypatch):

    def gate(figures, calls, share=None, cache=None, switchable=False, traced=False, beside=False):
        return GateDecision("tfmx" if traced else "stock", "injected")

    def broken(self, *args, **kwargs):
        raise RuntimeError("injected trace failure")

    monkeypatch.setattr(dispatch.IteratorDispatch, "_traced_twin", broken)
    report, weights, stock_weights = _fit_both(monkeypatch, gate)
    assert any("tfmx's form could not be traced mid-fit (RuntimeError: injected trace "
               "failure); stock runs on" in n for n in report.notes)
    for got, want in zip(weights, stock_weights, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_later_fit_asks_the_gate_again_for_its_own_calls(monkeypatch):
    seen = []

    def gate(figures, calls, share=None, cache=None, switchable=False, traced=False, beside=False):
        seen.append((calls, traced))
        return GateDecision("tfmx" if traced and len(seen) > 2 else "stock", "injected")

    with _gated(monkeypatch, gate) as (model, x, y):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # 8 calls: stock throughout
        assert [t.status for t in tfmx.report().traces] == ["stock: price gate"]
        model.fit(x, y, batch_size=32, epochs=3, verbose=0)  # 24 calls: asked at its first
        # before the first trace (8 calls), after 6 calls as stock (2 left), then the second
        # fit's first call (23 left): tfmx's form traced on its next call
        assert seen == [(8, False), (2, True), (23, True)]
        assert [t.status for t in tfmx.report().traces] == ["stock: price gate", "rewritten"]
        assert tfmx.report().python_traces[("Sequential.train_step", "stages")] == 1
