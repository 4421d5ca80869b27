"""XLA's form of a step is checked while traced: ops XLA has no kernel for drop the form
before Keras's loop takes a batch, so every batch trains."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmx
from tfmx import guard, xla_support


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.setenv("TFMX_TUNE", "off")
    monkeypatch.setenv("TFMX_GUARD_BUDGET", "none")  # the trial runs to XLA's duel
    guard.forget()
    yield
    guard.forget()
    tfmx.disable()


def test_ops_without_an_xla_kernel_are_named_and_function_bodies_are_read():
    inner = tf.function(lambda x: tf.strings.as_string(x))

    @tf.function
    def outer(x):
        return tf.strings.length(inner(x * 2.0))

    concrete = outer.get_concrete_function(tf.TensorSpec([3]))
    assert xla_support.missing_kernels(concrete) == ["AsString", "StringLength"]
    with pytest.raises(xla_support.XlaUnsupportedError, match="AsString, StringLength"):
        xla_support.check_compilable(concrete, "cpu")
    xla_support.check_compilable(concrete, "metal")  # not an XLA backend: nothing checked
    dense = tf.function(lambda x: tf.nn.relu(x @ tf.ones([3, 2])))
    assert xla_support.missing_kernels(dense.get_concrete_function(tf.TensorSpec([4, 3]))) == []


class _Tagged(keras.layers.Layer):
    """Adds nothing, through string ops XLA cannot compile."""

    def call(self, x):
        width = tf.strings.length(tf.strings.as_string(tf.reduce_sum(x)))
        return x + 0.0 * tf.stop_gradient(tf.cast(width, x.dtype))


def _fit(enable):
    keras.utils.set_random_seed(0)
    inp = keras.Input((16,))
    h = _Tagged()(keras.layers.Dense(32, activation="relu")(inp))
    model = keras.Model(inp, keras.layers.Dense(4)(h))
    model.compile(keras.optimizers.SGD(0.05), keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(640, 16)).astype("float32")
    y = rng.integers(0, 4, 640)
    if enable:
        tfmx.enable(backend="cpu", guard=True, tune="off", xla=True)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    return model


def test_a_step_xla_cannot_take_loses_its_duel_before_any_batch_is_taken(slow_forms):
    stock = _fit(False)
    slow_forms(stock=0.004)  # fused wins its duel at once; XLA's comes next
    fused = _fit(True)
    (g,) = [g.summary() for g in tfmx.report().guards if g.function.endswith("train_step")]
    assert "xla could not run (XLA has no XLA_CPU_JIT kernel for AsString" in g.reason
    assert "found while tracing, before any batch ran" in g.reason
    assert int(fused.optimizer.iterations) == int(stock.optimizer.iterations) == 80
    # every batch trained: the weights are stock's within the fused kernels' rounding
    for s, f in zip(stock.get_weights(), fused.get_weights(), strict=True):
        np.testing.assert_allclose(f, s, rtol=1e-4, atol=1e-5)
