"""tfmx.dispatch: Keras's per-iterator step loop looked up once per iterator type."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_within_rounding, needs_onednn

import tfmx
from tfmx.dispatch import IteratorDispatch

# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")


@pytest.fixture(autouse=True)
def _restore():
    yield
    tf.config.run_functions_eagerly(False)


class Counting:
    """A tf.function whose Python-level calls are counted."""

    def __init__(self, function):
        self.function, self.calls = function, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.function(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.function, name)


def _loop():
    total = tf.Variable(0.0)

    @tf.function
    def step(iterator):
        return total.assign_add(tf.reduce_sum(iterator.get_next()))

    return total, step


def test_one_lookup_per_iterator_type_same_results():
    total, step = _loop()
    counting = Counting(step)
    fast = IteratorDispatch(counting)
    ds = tf.data.Dataset.range(12).map(lambda i: tf.cast(i, tf.float32))
    got = [float(fast(it)) for it in (iter(ds), iter(ds)) for _ in range(4)]
    assert got == [0.0, 1.0, 3.0, 6.0, 6.0, 7.0, 9.0, 12.0]
    assert counting.calls == 1 and step.experimental_get_tracing_count() == 1
    # Another element shape is another iterator type: TensorFlow's function decides (retraces).
    fast(iter(ds.batch(2)))
    assert counting.calls == 2 and step.experimental_get_tracing_count() == 2
    fast(iter(ds.batch(2)))
    assert counting.calls == 2 and float(total.numpy()) == 14.0


def test_calls_it_serves_count_for_tensorflows_retracing_warning(caplog):
    """Each new model's Keras loop is a new tf.function of the same Python function, traced
    once: TensorFlow warns of retracing at 5 traces within 10 calls of that function. The calls
    the dispatch serves without the tf.function count as TensorFlow counts them, so five
    loops called four times each do not warn (as Keras's own calls do not)."""
    def new_loop():
        total = tf.Variable(0.0)

        @tf.function
        def step(iterator):
            return total.assign_add(iterator.get_next())

        return step

    ds = tf.data.Dataset.range(8).map(lambda i: tf.cast(i, tf.float32))
    for _ in range(5):
        step = new_loop()
        fast = IteratorDispatch(step)
        for _ in range(4):
            fast(iter(ds))
        assert step.experimental_get_tracing_count() == 1
    assert not [r for r in caplog.records if "triggered tf.function retracing" in r.getMessage()]


def test_steps_aside_when_functions_run_eagerly_or_for_other_arguments():
    total, step = _loop()
    counting = Counting(step)
    fast = IteratorDispatch(counting)
    ds = tf.data.Dataset.from_tensors(2.0).repeat()
    fast(iter(ds))
    tf.config.run_functions_eagerly(True)
    fast(iter(ds))
    tf.config.run_functions_eagerly(False)
    with pytest.raises(AttributeError, match="get_next"):
        fast([1.0])  # not an iterator: the tf.function's own error
    assert counting.calls == 3 and float(total.numpy()) == 4.0


def _fit(enable: bool):
    if enable:
        tfmx.enable(backend="cpu")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1), "mse", steps_per_execution=2)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype("float32"), rng.normal(size=(32, 2))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    history = model.fit(ds, epochs=3, verbose=0, validation_data=ds)
    return model, history.history


@needs_onednn("either")  # all families: with oneDNN off the onednn family too
def test_keras_fit_goes_through_the_dispatch_and_trains_like_stock():
    stock, h_stock = _fit(False)
    fused, h_fused = _fit(True)
    # One step's roundings, longest path: forward 4 + 1 + 8 + 1, the loss 2 + 8, backward 2 +
    # 2 + 4 (batch 4), the update 2: 34; 3 epochs of 8 steps; an epoch's loss is a mean of 8
    # (9 more). All families: with oneDNN off the onednn family sums in another order.
    terms = 3 * 8 * 34 + 9
    for key in ("loss", "val_loss"):
        assert_within_rounding(h_fused[key], h_stock[key], terms, what=key)
    for kind in ("train_function", "test_function"):
        fn = getattr(fused, kind).__wrapped__
        # Keras's loop's dispatch, and under Keras 3.16 that of its one-step call
        # (tfmx.one_step): one of them served every call, one slot for the one iterator type
        loops = [c.cell_contents for c in fn.__closure__
                 if isinstance(c.cell_contents, IteratorDispatch)]
        served = [len(loop._slots) for loop in loops if loop._slots]
        assert served == [1], kind
    assert any("tfmx.dispatch" in note for note in tfmx.report().notes)
