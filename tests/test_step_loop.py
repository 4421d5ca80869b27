"""Several steps a call (tfmx.step_loop): the same training as Keras's one step a call, taken
only where the fit's callbacks and the model's own steps_per_execution allow, named in the
report. The trial's timing is replaced (a test must not depend on this machine's load): the
gate always passes and the trial's choice is injected."""

import warnings

import numpy as np
import pytest

import tfmx
from tfmx import step_loop

STEPS = 10  # an epoch: 80 samples of 8; N = 10 // ceil(10 / 4) = 3, one step left over


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(80, 6)).astype("float32"),
            rng.normal(size=(80, 1)).astype("float32"))


def _model(steps_per_execution=1):
    import keras

    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(12, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"],
                  steps_per_execution=steps_per_execution)
    return model


def _fit(model, callbacks=(), epochs=4):
    x, y = _data()
    vx, vy = _data(1)
    return model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, shuffle=False,
                     validation_data=(vx[:24], vy[:24]), callbacks=list(callbacks))


@pytest.fixture
def chosen(monkeypatch, tmp_path):
    """The loop's trial keeps ``chosen.steps`` (N, or 1) whatever it measures; every fit may
    pay for the trace; at most 4 steps a call; a tuning cache of the test's own."""
    monkeypatch.setenv("TFMX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(step_loop, "MAX_STEPS", 4)
    monkeypatch.setattr(step_loop, "PAYBACK", 0.0)
    monkeypatch.setattr(step_loop, "TIMED", 1)

    class Chosen:
        steps = None  # None: N

    monkeypatch.setattr(step_loop.Trial, "decide",
                        lambda self: self.n if Chosen.steps is None else Chosen.steps)
    tfmx.enable(backend="cpu", guard=False)
    return Chosen


def _calls(model):
    """Count the calls of the model's train function (made before the fit begins)."""
    model.make_train_function()
    inner, counted = model.train_function, []

    def counting(iterator):
        counted.append(1)
        return inner(iterator)

    model.train_function = counting
    return counted


def test_same_weights_history_and_steps_as_stock(chosen):
    tfmx.disable()
    stock = _model()
    stock_history = _fit(stock).history
    tfmx.enable(backend="cpu", guard=False)
    looped = _model()
    calls = _calls(looped)
    looped_history = _fit(looped).history
    record = tfmx.report().loops[-1]
    assert record["steps_per_call"] == 3 and record["n"] == 3, record
    # epoch 1: settle (1 timed call of Keras's loop), trace (3), trial: 1, 3 -> kept; then
    # 3 calls of 3 steps and one step left over an epoch: fewer calls than steps
    assert len(calls) <= STEPS + 3 * 4  # after the first epoch: 3 + 3 + 3 + 1 steps
    assert int(looped.optimizer.iterations) == int(stock.optimizer.iterations) == 4 * STEPS
    for a, b in zip(stock.get_weights(), looped.get_weights()):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    assert sorted(stock_history) == sorted(looped_history)  # validation ran every epoch
    for key, values in stock_history.items():
        np.testing.assert_allclose(values, looped_history[key], rtol=2e-5, atol=2e-6)


def test_a_per_batch_callback_keeps_one_step_a_call_and_sees_every_batch(chosen):
    import keras

    class Batches(keras.callbacks.Callback):
        seen: list = []

        def on_train_batch_end(self, batch, logs=None):
            self.seen.append(batch)

    counter = Batches()
    model = _model()
    _fit(model, [counter], epochs=2)
    assert counter.seen == list(range(STEPS)) * 2
    assert not tfmx.report().loops
    assert any("one step a call: callback(s) Batches" in n for n in tfmx.report().notes)


def test_epoch_level_callbacks_allow_several_steps_a_call(chosen):
    import keras

    epochs = []
    model = _model()
    _fit(model, [keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: epochs.append(e)),
                 keras.callbacks.EarlyStopping(patience=10)], epochs=3)
    assert epochs == [0, 1, 2]
    assert tfmx.report().loops[-1]["steps_per_call"] == 3


def test_the_models_own_steps_per_execution_is_kept(chosen):
    model = _model(steps_per_execution=2)
    calls = _calls(model)
    _fit(model, epochs=2)
    assert len(calls) == STEPS  # 2 epochs of 5 calls of 2 steps: Keras's own
    assert int(model.optimizer.iterations) == 2 * STEPS
    assert not tfmx.report().loops
    assert any("keeps the model's own steps_per_execution=2" in n for n in tfmx.report().notes)


def test_the_report_names_the_choice_and_its_figures(chosen):
    chosen.steps = 1  # the trial found N steps a call no faster
    model = _model()
    _fit(model, epochs=3)
    report = tfmx.report()
    record = report.loops[-1]
    assert record["steps_per_call"] == 1 and record["n"] == 3
    assert record["one_step_ms"] > 0 and record["n_steps_ms"] > 0 and record["trace_s"] > 0
    assert "not 5% faster" in record["why"]
    assert any(n.startswith("step loop: Sequential.train_step ran 1 step(s) a call")
               for n in report.notes)
    assert report.to_dict()["loops"] == report.loops
    # a later fit of the same model keeps the choice without measuring again
    tfmx.report(reset=True)
    _fit(model, epochs=1)
    assert "earlier fit" in tfmx.report().loops[-1]["why"]


def test_a_fit_too_short_to_pay_for_the_trace_keeps_one_step_a_call(chosen, monkeypatch):
    monkeypatch.setattr(step_loop, "PAYBACK", 1e9)
    model = _model()
    calls = _calls(model)
    _fit(model, epochs=2)
    assert len(calls) == 2 * STEPS
    record = tfmx.report().loops[-1]
    assert record["steps_per_call"] == 1 and "does not cover" in record["why"]


def test_steps_per_call_splits_an_epoch_into_equal_calls():
    assert [step_loop.steps_per_call(s, 4) for s in (2, 4, 5, 10, 12)] == [2, 4, 2, 3, 4]


def test_the_trial_keeps_n_only_when_faster_by_the_margin():
    trial = step_loop.Trial(8)
    trial.add(8, 8 * 0.00098)  # the warm-up call
    for _ in range(step_loop.TIMED):
        trial.add(1, 0.0010)
        trial.add(8, 8 * 0.00098)
    assert trial.done() and trial.decide() == 1
    fast = step_loop.Trial(8)
    fast.add(8, 8 * 0.0009)
    for _ in range(step_loop.TIMED):
        fast.add(1, 0.0010)
        fast.add(8, 8 * 0.0009)
    assert fast.decide() == 8


def test_the_n_step_loops_first_call_after_its_trace_is_not_counted():
    # a fresh N-step loop's first run is slow (its allocations, kernel caches): counted, it
    # would make N steps a call look slower than one a call with three timed calls each
    trial = step_loop.Trial(8)
    assert trial.next_size() == 8  # the warm-up call comes first
    trial.add(8, 8 * 0.050)
    assert trial.next_size() == 8 and not trial.samples
    for _ in range(3):
        trial.add(8, 8 * 0.0007)
        trial.add(1, 0.0010)
    assert trial.warm == [pytest.approx(0.050)]
    assert trial.per_step_ms(8) == pytest.approx(0.7)
    assert not trial.done()  # TIMED timed calls of each, the warm-up not among them
    for _ in range(step_loop.TIMED - 3):
        trial.add(8, 8 * 0.0007)
        trial.add(1, 0.0010)
    assert trial.done() and trial.decide() == 8


def _gated(left, loop_ms=1.0, first_s=1.0, n=32):
    """The gate of a loop whose Keras's loop costs ``loop_ms`` a step, with ``left`` steps
    of the fit left and a one-step loop whose first call took ``first_s``."""
    from types import SimpleNamespace

    dispatch = SimpleNamespace(_slots={"spec": SimpleNamespace(first_s=first_s)},
                               _loop_memory={})
    loop = step_loop.StepLoop("f", _model(), dispatch, n, SimpleNamespace(steps=left))
    loop.loop_s = [loop_ms / 1e3] * step_loop.TIMED
    return loop._gate(), loop


def test_the_gate_is_calibrated_by_other_steps_trials_on_this_machine(chosen, monkeypatch):
    from tfmx import loop_cache, state

    monkeypatch.setattr(step_loop, "PAYBACK", 1.0)
    monkeypatch.setattr(step_loop, "TIMED", 5)
    # N = 32: ~0.969 ms a step estimated (31/32 of Keras's loop) over 800 - 5 x 33 steps left
    # = 0.62 s, short of the 1 s trace
    steps, loop = _gated(800)
    assert steps == 1 and "does not cover" in loop.why and "other steps" not in loop.why
    # another step's trial here: N steps a call saved 2 ms a step where the estimate said
    # ~0.969 (x2.06), and its trace cost its one-step loop's first call (x1)
    cache = state.tuning_cache()
    loop_cache.store(cache, "other|stock|n=32", 32, one_ms=3.0, many_ms=1.0, trace_s=2.0,
                     loop_ms=1.0, first_s=2.0)
    steps, loop = _gated(800)
    assert steps == 32 and loop.phase == "trace"  # ~2 ms x 635 steps = 1.27 s >= 1 s
    # a third trial whose trace cost three times its first call: the median trace ratio is 2
    loop_cache.store(cache, "third|stock|n=32", 32, one_ms=3.0, many_ms=1.0, trace_s=6.0,
                     loop_ms=1.0, first_s=2.0)
    steps, loop = _gated(800)
    assert steps == 1 and "2 trial(s) of other steps" in loop.why and "x2" in loop.why
    # a trial whose N-step loop ran slower scales the saving by no less than 1
    assert loop_cache.calibration(cache)[0] == pytest.approx(2.065, abs=1e-3)
    loop_cache.store(cache, "fourth|stock|n=32", 32, one_ms=1.0, many_ms=3.0, trace_s=2.0,
                     loop_ms=1.0, first_s=2.0)
    loop_cache.store(cache, "fifth|stock|n=32", 32, one_ms=1.0, many_ms=3.0, trace_s=2.0,
                     loop_ms=1.0, first_s=2.0)
    # the median of 2.065, 2.065, 1 and 1 (unfloored, the slower ones would be -2.065)
    assert loop_cache.calibration(cache)[:2] == (pytest.approx(1.532, abs=1e-3), 1.0)


def _fit_fresh(epochs=2):
    """A new model of the same architecture (a new train function: nothing in its memory)
    fitted, its calls counted; the report's loop record."""
    tfmx.report(reset=True)
    model = _model()
    calls = _calls(model)
    _fit(model, epochs=epochs)
    return model, calls, tfmx.report().loops[-1]


def test_a_later_fit_of_the_same_step_takes_the_cached_choice_without_a_trial(chosen,
                                                                             monkeypatch):
    tfmx.disable()
    stock = _model()
    _fit(stock, epochs=2)
    tfmx.enable(backend="cpu", guard=False)
    _, _, first = _fit_fresh()
    assert first["steps_per_call"] == 3 and first["source"] == "measured"

    def no_trial(*args):
        raise AssertionError("a trial ran despite the tuning cache")

    monkeypatch.setattr(step_loop.Trial, "add", no_trial)
    monkeypatch.setattr(step_loop.StepLoop, "_gate", no_trial)
    model, calls, later = _fit_fresh()
    assert later["steps_per_call"] == 3 and later["source"] == "tuning cache", later
    assert "tuning cache" in later["why"] and "loop_ms" not in later  # nothing timed
    # each epoch: the trace (3), then 2 calls of 3 and one step left over; no one-step trial
    assert len(calls) == 2 * 4
    assert int(model.optimizer.iterations) == 2 * STEPS
    for a, b in zip(stock.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    # the cached N whose measured saving does not pay for its measured trace: one a call
    monkeypatch.setattr(step_loop, "PAYBACK", 1e9)
    _, calls, short = _fit_fresh()
    assert short["steps_per_call"] == 1 and "does not cover the trace" in short["why"]
    assert len(calls) == 2 * STEPS


def test_a_cached_one_step_a_call_is_kept_without_timing_or_tracing(chosen):
    chosen.steps = 1
    _, _, first = _fit_fresh()
    assert first["steps_per_call"] == 1 and first["trace_s"] > 0  # traced and timed
    chosen.steps = None  # a trial now would keep N: the cache's choice must win
    model, calls, later = _fit_fresh()
    assert later["steps_per_call"] == 1 and later["source"] == "tuning cache", later
    assert "loop_ms" not in later and len(calls) == 2 * STEPS
    assert not any(slot.steps for slot in step_loop._DISPATCHES[model]()._slots.values())


def test_epochs_shorter_than_the_data_run_the_same_batches_as_stock(chosen):
    import tensorflow as tf

    x, y = _data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)  # 10 batches, 7 an epoch

    def fit(model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Keras: the input ran out of data
            model.fit(data, epochs=4, steps_per_epoch=7, verbose=0, shuffle=False)
        return model

    tfmx.disable()
    stock = fit(_model())
    tfmx.enable(backend="cpu", guard=False)
    looped = fit(_model())
    assert tfmx.report().loops[-1]["steps_per_call"] == 3
    # 7, then the data's last 3 (Keras ends the epoch there), 7, 3: as stock
    assert int(stock.optimizer.iterations) == 20
    assert int(looped.optimizer.iterations) == 20
    for a, b in zip(stock.get_weights(), looped.get_weights()):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_a_step_the_price_gate_runs_as_stock_loops_in_its_stock_form(chosen):
    tfmx.disable()
    stock = _model()
    _fit(stock)
    tfmx.enable(backend="cpu", guard=True)  # a first fit of a step: stock, its calls timed
    looped = _model()
    _fit(looped)
    assert tfmx.report().loops[-1]["steps_per_call"] == 3
    assert int(looped.optimizer.iterations) == 4 * STEPS
    for a, b in zip(stock.get_weights(), looped.get_weights()):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_the_form_a_decided_guard_keeps_is_steady_whichever_it_is():
    """The fused step's first calls after the guard's trial are timed (its price), so the loop
    waits for them; a kept stock or XLA step has nothing left to time and loops at once."""
    from types import SimpleNamespace

    from tfmx.dispatch import _Slot

    spec = object()
    iterator = SimpleNamespace(_type_spec=spec)
    for kept in ("stock", "xla", "fused"):
        slot = _Slot({"fused": 1, "stock": 2, "xla": 3},
                     guard=SimpleNamespace(decided=True, kept=kept))
        dispatch = SimpleNamespace(_slots={spec: slot})
        assert step_loop.steady_form(dispatch, iterator) == (None if kept == "fused" else kept)
        slot.followed = None
        assert step_loop.steady_form(dispatch, iterator) == kept
        slot.guard.decided = False
        assert step_loop.steady_form(dispatch, iterator) is None
