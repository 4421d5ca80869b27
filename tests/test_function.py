"""tfmx.function in custom training loops: same numbers as tf.function, fused graph."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from helpers import FUSED_MATMULS, assert_within_rounding, needs_onednn

import tfmx
from fusion.graph import op_histogram

# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")



def make_step(decorator):
    tf.random.set_seed(0)
    w1 = tf.Variable(tf.random.normal([4, 8]))
    b1 = tf.Variable(tf.zeros([8]))
    w2 = tf.Variable(tf.random.normal([8, 1]))
    b2 = tf.Variable(tf.zeros([1]))
    variables = [w1, b1, w2, b2]

    @decorator
    def step(x, y):
        with tf.GradientTape() as tape:
            h = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w1), b1))
            pred = tf.nn.bias_add(tf.matmul(h, w2), b2)
            loss = tf.reduce_mean(tf.square(pred - y))
        grads = tape.gradient(loss, variables)
        for v, g in zip(variables, grads):
            v.assign_sub(0.05 * g)
        return loss

    return step, variables


# Roundings of one step of make_step's loop (helpers.float_tolerance), longest path: forward
# 4 + 1 + 8 + 1 (two Dense layers), the loss (a Sub, a Square, the mean over 16); backward 2, 1,
# the weight gradient's 16 terms; the update 2. The onednn family (all families, oneDNN off)
# sums in another order; the others are exact.
STEP_ROUNDINGS = 14 + 18 + 2 + 1 + 16 + 2


def run(decorator, steps=5):
    step, variables = make_step(decorator)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((16, 4), dtype=np.float32))
    y = tf.constant(rng.random((16, 1), dtype=np.float32))
    losses = [float(step(x, y)) for _ in range(steps)]
    return step, losses, [v.numpy() for v in variables], (x, y)


@needs_onednn("either")  # all families: with oneDNN off the onednn family too
def test_custom_loop_matches_tf_function_and_is_fused():
    _, stock_losses, stock_vars, _ = run(tf.function)
    tfmx.enable(backend="cpu")
    step, losses, fused_vars, (x, y) = run(tfmx.function)
    terms = len(losses) * STEP_ROUNDINGS
    assert_within_rounding(losses, stock_losses, terms, what="losses")
    for i, (a, b) in enumerate(zip(stock_vars, fused_vars)):
        assert_within_rounding(b, a, terms, what=f"variable {i}")
    ops = set(op_histogram(step.get_concrete_function(x, y).graph.as_graph_def()))
    assert FUSED_MATMULS & ops
    stock_ops = set(op_histogram(step.stock_concrete_function(x, y).graph.as_graph_def()))
    assert not FUSED_MATMULS & stock_ops


def test_disabled_tfmx_function_is_plain_tf_function():
    step, losses, _, (x, y) = run(tfmx.function)
    ops = set(op_histogram(step.get_concrete_function(x, y).graph.as_graph_def()))
    assert "_FusedMatMul" not in ops


def test_call_under_an_outer_gradient_tape_uses_the_stock_graph():
    tfmx.enable(backend="cpu")
    w = tf.Variable(tf.ones([3, 2]))
    b = tf.Variable(tf.zeros([2]))

    @tfmx.function
    def forward(x):
        return tf.reduce_sum(tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w), b)))

    with tf.GradientTape() as tape:
        out = forward(tf.ones([2, 3]))
    grads = tape.gradient(out, [w, b])
    np.testing.assert_allclose(grads[1].numpy(), [2.0, 2.0])


def test_decorator_with_arguments_and_methods():
    tfmx.enable(backend="cpu")

    class Layer:
        def __init__(self):
            self.w = tf.Variable(tf.ones([3, 2]))
            self.b = tf.Variable(tf.ones([2]))

        @tfmx.function(reduce_retracing=True)
        def __call__(self, x):
            return tf.nn.relu(tf.nn.bias_add(tf.matmul(x, self.w), self.b))

    layer = Layer()
    np.testing.assert_allclose(layer(tf.ones([1, 3])).numpy(), [[4.0, 4.0]])
    np.testing.assert_allclose(layer(tf.ones([5, 3])).numpy(), np.full((5, 2), 4.0))


@needs_onednn("either")  # all families: with oneDNN off the onednn family too
def test_verify_in_a_custom_loop():
    tfmx.enable(backend="cpu", verify=True)
    _, losses, _, _ = run(tfmx.function, steps=3)
    _, stock_losses, _, _ = run(tf.function, steps=3)
    assert_within_rounding(losses, stock_losses, 3 * STEP_ROUNDINGS, what="losses")


def test_repeated_calls_skip_the_lookup_and_new_signatures_still_trace(monkeypatch):
    tfmx.enable(backend="cpu")
    w = tf.Variable(tf.ones([3, 2]))

    @tfmx.function
    def f(x, scale):
        return tf.nn.relu(tf.matmul(x, w)) * scale

    lookups = []
    real = f._staged.get_concrete_function

    def counting(*args, **kwargs):
        lookups.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(f._staged, "get_concrete_function", counting)
    for _ in range(3):
        assert f(tf.ones([1, 3]), 2.0).numpy().tolist() == [[6.0, 6.0]]
    assert len(lookups) == 1  # one lookup, then the call key finds the entry
    assert f(tf.ones([1, 3]), 3.0).numpy().tolist() == [[9.0, 9.0]]  # a Python value: traced
    assert f(tf.ones([2, 3]), 2.0).shape == (2, 2)  # another shape: looked up
    assert len(lookups) == 3
    assert float(f(tf.ones([1, 3]), tf.constant(1.0))[0, 0]) == 3.0
    assert f(tf.Variable(tf.ones([1, 3])), 2.0).shape == (1, 2)  # a variable: no call key
    assert len(lookups) == 5
    f(tf.Variable(tf.ones([1, 3])), 2.0)
    assert len(lookups) == 6
    tfmx.enable(backend="cpu", patterns=["contraction"])  # a new generation: entries rebuilt
    assert f(tf.ones([1, 3]), 2.0).numpy().tolist() == [[6.0, 6.0]]
    assert len(lookups) == 7
