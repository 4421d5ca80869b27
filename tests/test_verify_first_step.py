"""verify="first-step" (the cuda and metal default): a wrong fused step warns and runs stock."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmx
from fusion.graphs import contraction


def _wrong_rewrite(monkeypatch):
    original = contraction.rewrite_contraction

    def wrong(view, match):
        fused = original(view, match)
        if [s.decode() for s in fused.attr["fused_ops"].list.s] == ["BiasAdd", "Relu"]:
            del fused.attr["fused_ops"].list.s[:]
            fused.attr["fused_ops"].list.s.extend([b"BiasAdd", b"Elu"])
        return fused

    monkeypatch.setattr(contraction, "rewrite_contraction", wrong)


def _fit(enable):
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    out = keras.layers.Dense(3)(keras.layers.Dense(16, activation="relu")(inp))
    model = keras.Model(inp, out)
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 3, 64)
    enable()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    return model


def test_a_wrong_fused_step_warns_and_training_goes_on_as_stock(monkeypatch, capfd):
    stock = _fit(lambda: None)
    _wrong_rewrite(monkeypatch)
    fused = _fit(lambda: tfmx.enable(backend="cpu", verify="first-step", guard=False,
                                     tune="off"))
    assert "disagreed with the stock step" in capfd.readouterr().err
    for s, f in zip(stock.get_weights(), fused.get_weights()):
        np.testing.assert_allclose(f, s, rtol=1e-5, atol=1e-6)


def test_across_several_workers_a_disagreement_raises_instead(monkeypatch):
    """One worker falling back to stock alone would run other collectives than the others:
    there "first-step" raises on the worker that saw the disagreement."""
    from tfmx import state

    monkeypatch.setattr(state, "multi_worker", lambda: True)
    _wrong_rewrite(monkeypatch)
    with pytest.raises(tfmx.VerificationError):
        _fit(lambda: tfmx.enable(backend="cpu", verify="first-step", guard=False, tune="off"))


def test_eager_calls_warn_once_and_run_stock(monkeypatch):
    _wrong_rewrite(monkeypatch)
    w = tf.Variable(tf.ones([4, 4]))
    b = tf.Variable(tf.zeros([4]))

    @tfmx.function
    def f(x):
        return tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w), b))

    tfmx.enable(backend="cpu", verify="first-step", guard=False, tune="off")
    x = -tf.ones([2, 4])
    with pytest.warns(tfmx.TfmxWarning, match="runs stock from now on"):
        first = f(x)
    np.testing.assert_array_equal(first.numpy(), np.zeros([2, 4]))  # relu, not elu
    np.testing.assert_array_equal(f(x).numpy(), np.zeros([2, 4]))


def test_the_default_checks_only_backends_no_ci_runs():
    tfmx.enable(backend="cpu")
    assert tfmx.state.options().verify is False
    with pytest.raises(ValueError, match="first-step"):
        tfmx.enable(backend="cpu", verify="sometimes")
