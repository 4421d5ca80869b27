"""Does a tfmx.function under an outer tape fuse an LSTM the same way
whichever path traced it first? (The outer-tape path runs only the pre-differentiation stages.)"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmx
from fusion.calls.rnn import SCOPE
from fusion.pattern import RewriteAlways
from tfmx import state


@pytest.fixture(autouse=True)
def _every_rewrite(monkeypatch):
    monkeypatch.setattr(state, "tuner", RewriteAlways)  # every decision: the hoisted form


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6, 3)), keras.layers.LSTM(4), keras.layers.Dense(1)])


def _grads(model, fn, x, outer_first):
    calls = []
    if not outer_first:
        calls.append(fn(x))  # the plain call traces first
    with tf.GradientTape() as tape:
        loss = fn(x)
    grads = tape.gradient(loss, model.trainable_variables)
    if outer_first:
        calls.append(fn(x))
    return grads


@pytest.mark.parametrize("outer_first", [True, False])
def test_the_outer_tape_path_fuses_like_the_plain_path(outer_first):
    x = tf.random.normal([8, 6, 3], seed=2)
    stock_model = _model()
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(stock_model(x, training=True) ** 2)
    want = tape.gradient(loss, stock_model.trainable_variables)

    model = _model()

    @tfmx.function
    def forward(x):
        return tf.reduce_mean(model(x, training=True) ** 2)

    tfmx.enable(backend="cpu", guard=False, tune="off")
    got = _grads(model, forward, x, outer_first)
    traced = forward._taped.get_concrete_function(tf.TensorSpec([8, 6, 3]))
    names = [n.name for n in traced.graph.as_graph_def().node]
    assert any(SCOPE in n for n in names), "the outer-tape trace kept Keras's own loop"
    for w, g in zip(want, got):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-4, atol=1e-6)
