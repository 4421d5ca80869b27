"""The whole-step guard: keeps stock when the fused step is slower, fused when it is faster."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmx
from tfmx import guard
from tfmx.guard import StepGuard


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.setenv("TFMX_TUNE", "off")
    # the trial's logic, run to its end; the budget has its own tests (tests/test_guard_budget.py)
    monkeypatch.setenv("TFMX_GUARD_BUDGET", "none")
    guard.forget()  # each test's trials start afresh in this process
    yield
    guard.forget()


def test_decisions_from_timings():
    for fused, stock, kept in ((1.0, 2.0, "fused"), (2.0, 1.0, "stock"), (1.0, 1.0, "stock")):
        g = StepGuard("t")
        steps = 0
        while not g.decided:
            form = g.next_form()
            g.record(form, fused if form == "fused" else stock)
            steps += 1
        assert g.kept == kept
        assert steps <= 2 * guard.MAX_PAIRS + 2
        assert g.next_form() == kept


def test_noise_without_a_difference_keeps_stock():
    rng = np.random.default_rng(0)
    g = StepGuard("t")
    while not g.decided:
        form = g.next_form()
        g.record(form, 1.0 + rng.normal(0, 0.05))
    assert g.kept == "stock"


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((16,))
    h = keras.layers.Dense(32, activation="relu")(inp)
    h = keras.layers.Dense(32, activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(4)(h))
    return model


def _fit(enable, steps_per_execution=1, epochs=2, xla=False, tune="off"):
    model = _model()
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=steps_per_execution)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(640, 16)).astype("float32")
    y = rng.integers(0, 4, 640)
    if enable:
        tfmx.enable(backend="cpu", guard=True, tune=tune, xla=xla)
    model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, shuffle=False,
              validation_data=(x[:64], y[:64]))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)  # a second fit
    return model


@pytest.mark.parametrize("slow,kept", [("fused", "stock"), ("stock", "fused")])
@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_fit_keeps_the_faster_step_and_trains_like_stock(slow, kept, steps_per_execution,
                                                         slow_forms):
    stock = _fit(False, steps_per_execution=steps_per_execution)
    # 4 ms more a step, whatever the steps a call (a call of 4 steps 16 ms more): the fit's
    # 15 pairs of 4-step calls then decide on a loaded machine too, whose pauses reach ~10 ms
    slow_forms(**{slow: 0.004 * steps_per_execution})
    fused = _fit(True, steps_per_execution)
    report = tfmx.report()
    train = [g.summary() for g in report.guards if g.function.endswith("train_step")]
    assert [g.kept for g in train] == [kept], [g.describe() for g in train]
    assert train[0].pairs >= 2  # a plainly slower challenger is dropped after 2-3 pairs
    assert "whole-step guard" in str(report) and f"kept {kept}" in str(report)
    assert report.to_dict()["guards"][0]["kept"] == kept
    # Stock and fused steps alternated, then one form ran: the weights are stock's, within
    # float32 rounding of the fused kernels (sums of at most 32 terms, a few hundred steps).
    for s, f in zip(stock.get_weights(), fused.get_weights()):
        np.testing.assert_allclose(f, s, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("slow,kept", [(("fused", "stock"), "xla"), (("xla",), "fused")])
def test_fit_keeps_the_xla_step_only_where_it_is_faster(slow, kept, slow_forms):
    stock = _fit(False, epochs=3)
    delays = {form: 0.004 for form in slow}
    if kept == "fused":
        delays["stock"] = 0.004  # fused beats stock first, then meets a slowed XLA
    slow_forms(**delays)
    fused = _fit(True, xla=True, epochs=3)
    train = [g.summary() for g in tfmx.report().guards if g.function.endswith("train_step")]
    assert [g.kept for g in train] == [kept], [g.describe() for g in train]
    assert not np.isnan(train[0].xla_ms)
    # XLA fuses and reorders float32 arithmetic: equal to stock within its rounding
    for s, f in zip(stock.get_weights(), fused.get_weights()):
        np.testing.assert_allclose(f, s, rtol=1e-4, atol=1e-5)


def test_a_step_xla_cannot_compile_loses_its_duel():
    g = StepGuard("t", ("fused", "xla"))
    calls = []

    def broken():
        raise RuntimeError("XLA: unsupported op")

    forms = {"fused": lambda: calls.append("fused") or 1.0, "stock": lambda: 2.0,
             "xla": broken}
    while not g.decided:
        g.run(forms)
    assert g.kept in ("fused", "stock") and "xla could not run" in g.summary().reason


def test_a_second_run_keeps_what_the_first_trial_kept(tmp_path, monkeypatch, slow_forms):
    """The guard's outcome is cached per machine with the tuner's decisions (tune="auto")."""
    monkeypatch.setenv("TFMX_CACHE_DIR", str(tmp_path))
    slow_forms(fused=0.004)
    _fit(True, tune="auto")
    (first,) = [g.summary() for g in tfmx.report().guards if g.function.endswith("train_step")]
    assert first.kept == "stock" and first.pairs >= 2
    tfmx.disable()
    slow_forms()
    _fit(True, tune="auto")  # a new model, the same step: no trial, and no rewrite to pay for
    report = tfmx.report()
    assert not [g for g in report.guards if g.function.endswith("train_step")]
    assert [t.status for t in report.traces if t.function.endswith("train_step")] == [
        "stock: price gate"]
    line = [n for n in report.notes if n.startswith("price gate")][0]  # before its trace
    assert "ran as stock" in line and f"fused {first.fused_ms:.2f} ms" in line


def test_guard_off_runs_fused_and_never_traces_stock():
    model = _model()
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    tfmx.enable(backend="cpu", guard=False, tune="off")
    x = np.ones((64, 16), "float32")
    model.fit(x, np.zeros(64, "int32"), batch_size=16, epochs=2, verbose=0)
    assert tfmx.report().guards == []


def test_a_tfmx_function_loop_is_guarded_too(slow_forms):
    w = tf.Variable(tf.random.normal([16, 16], seed=3))
    b = tf.Variable(tf.zeros([16]))

    @tfmx.function
    def step(x):
        y = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w), b))
        w.assign_sub(0.01 * tf.matmul(x, y, transpose_a=True))
        return tf.reduce_sum(y)

    tfmx.enable(backend="cpu", guard=True, tune="off", xla=False)
    slow_forms(fused=0.004)
    x = tf.random.normal([8, 16], seed=4)
    for _ in range(2 * guard.MAX_PAIRS + 4):
        step(x)
    (g,) = tfmx.report().guards
    assert g.kept == "stock"

def test_a_bad_guard_switch_names_the_variable(monkeypatch):
    monkeypatch.setenv("TFMX_GUARD", "maybe")  # restored after: the suite runs with it 0
    with pytest.raises(ValueError, match="TFMX_GUARD"):
        guard.enabled_by_env()


def test_the_stock_side_of_an_rnn_step_is_keras_own_loop():
    """The rnn stage rewrites while tracing: the guard's stock step must be traced without it."""
    from fusion.calls.rnn import SCOPE

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6, 3)), keras.layers.LSTM(4), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.01)

    @tfmx.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x, training=True) ** 2)
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    from fusion.pattern import RewriteAlways

    tfmx.enable(backend="cpu", guard=True, tune="off")
    # every decision takes the hoisted form (tune="off" would keep Keras's loop)
    from tfmx import state

    original = state.tuner
    state.tuner = RewriteAlways
    try:
        x = tf.random.normal([8, 6, 3], seed=5)
        for _ in range(4):
            step(x)
    finally:
        state.tuner = original
    (entry,) = step._entries.values()
    fused_names = [n.name for n in entry.stock.graph.as_graph_def().node]
    stock_names = [n.name for n in entry.reference.graph.as_graph_def().node]
    assert entry.staged and any(SCOPE in n for n in fused_names)
    assert not any(SCOPE in n for n in stock_names)
