"""The pointwise pattern: a 1x1 convolution and its two gradients as MatMuls over the pixels (a
tuner decision per node); what is declined and why; each rewritten node within rounding; and a
CNN of 1x1 convolutions trains as stock with the MatMuls in the graph that ran."""

import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_models_within_rounding, fit_stock_and_tfmx, nodes_that_ran

import fusion
import tfmx
from fusion.graph import GraphView
from fusion.graphs.pointwise import SCOPE, find_pointwise
from fusion.pattern import RewriteAlways
from tfmx.rebuild import control_output_names, protected_names
from tfmx.tuner import Tuner

pytestmark = pytest.mark.usefixtures("every_rewrite")


def _conv_and_gradients(x, w):
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y = tf.nn.conv2d(x, w, 1, "SAME")
        loss = tf.reduce_sum(y * y)
    dx, dw = tape.gradient(loss, [x, w])
    return y, dx, dw


@pytest.mark.parametrize("dtype, batch", [("float32", 4), ("float32", None), ("bfloat16", 4)])
def test_a_1x1_convolution_and_both_gradients_become_matmuls(trace, cpu, rng,
                                                              assert_same_numbers, dtype, batch):
    cf, g = trace(_conv_and_gradients, tf.TensorSpec([batch, 5, 6, 7], dtype),
                  tf.TensorSpec([1, 1, 7, 3], dtype))
    convolutions = sorted(n.op for n in g.node if n.op.startswith("Conv2D"))
    assert convolutions == ["Conv2D", "Conv2DBackpropFilter", "Conv2DBackpropInput"]
    res = fusion.rewrite(g, cpu, ["pointwise"], protected=protected_names(cf),
                         control_outputs=control_output_names(cf))
    ops = [n.op for n in res.graph_def.node]
    assert not [op for op in ops if op.startswith("Conv2D")], ops
    products = [n for n in res.graph_def.node if n.name.endswith(f"/{SCOPE}/matmul")]
    assert sorted((n.attr["transpose_a"].b, n.attr["transpose_b"].b) for n in products) == [
        (False, False), (False, True), (True, False)]
    x = tf.cast(rng.standard_normal((4, 5, 6, 7)), dtype)
    w = tf.cast(rng.standard_normal((1, 1, 7, 3)), dtype)
    # a pixel's product sums 7 (or 3) terms; the filter gradient sums 4 * 5 * 6 pixels
    assert_same_numbers(cf, res, x, w, terms=4 * 5 * 6 * 3)


@pytest.mark.parametrize("kernel, strides, dilations, spec, reason", [
    ([1, 1, 7, 3], 2, 1, [4, 6, 6, 7], "strides"),
    ([1, 1, 7, 3], 1, 2, [4, 6, 6, 7], "dilations"),
    ([1, 1, 7, 3], 1, 1, [4, None, 6, 7], "not known statically"),
])
def test_declined_with_reason(trace, cpu, kernel, strides, dilations, spec, reason):
    def conv(x, w):
        return tf.nn.conv2d(x, w, strides, "SAME", dilations=dilations)

    cf, g = trace(conv, tf.TensorSpec(spec), tf.TensorSpec(kernel))
    matches, declined = find_pointwise(GraphView(g.node), cpu, RewriteAlways())
    assert matches == [] and len(declined) == 1 and reason in declined[0], declined


def test_a_3x3_convolution_is_not_a_match(trace, cpu):
    cf, g = trace(_conv_and_gradients, tf.TensorSpec([2, 5, 5, 4]), tf.TensorSpec([3, 3, 4, 2]))
    assert find_pointwise(GraphView(g.node), cpu, RewriteAlways()) == ([], [])


def test_float64_stays_a_convolution(trace, cpu):
    cf, g = trace(lambda x, w: tf.nn.conv2d(x, w, 1, "VALID"),
                  tf.TensorSpec([2, 5, 5, 4], tf.float64), tf.TensorSpec([1, 1, 4, 2], tf.float64))
    matches, declined = find_pointwise(GraphView(g.node), cpu, RewriteAlways())
    assert matches == [] and declined == ["Conv2D (1x1): dtype float64"]


def test_the_tuner_decides_per_node(trace, cpu):
    """A measured decision (on this machine, either form) under each node's signature; with
    tuning off every convolution stays one."""
    cf, g = trace(_conv_and_gradients, tf.TensorSpec([8, 8, 8, 16]),
                  tf.TensorSpec([1, 1, 16, 32]))
    found, declined = find_pointwise(GraphView(g.node), cpu, Tuner("off"))
    assert found == [] and len(declined) == 3
    assert all("left a convolution" in d and "tune=off" in d for d in declined)
    seen = []
    find_pointwise(GraphView(g.node), cpu, Tuner("auto", None, on_decision=seen.append))
    assert sorted(d.signature for d in seen) == [
        "Conv2D float32 8x8x8x16 1x1x16x32", "Conv2DBackpropFilter float32 8x8x8x16 1x1x16x32",
        "Conv2DBackpropInput float32 8x8x8x16 1x1x16x32"]
    assert all(d.source == "measured" and set(d.times_ms) == {"conv", "matmul"} for d in seen)


def _model():
    import keras

    keras.utils.set_random_seed(5)
    inp = keras.Input((6, 6, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="stem")(inp)
    x = keras.layers.Conv2D(12, 1, use_bias=False, activation="relu", name="expand")(x)
    x = keras.layers.Conv2D(6, 1, use_bias=False, name="project")(x)
    out = keras.layers.Dense(3, activation="softmax")(keras.layers.GlobalAveragePooling2D()(x))
    model = keras.Model(inp, out)
    model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
    return model


def test_a_cnn_trains_as_stock_with_its_1x1_convolutions_as_matmuls():
    """The two 1x1 convolutions and their gradients run as the family's MatMuls in the step
    that ran (the 3x3 one stays a convolution), and the weights stay within the rounding of
    stock's."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((32, 6, 6, 3)).astype("float32")
    y = rng.integers(0, 3, 32)
    models, initial = fit_stock_and_tfmx(_model, x, y, ["pointwise"])
    # forward and input gradient of both, the filter gradient of both: 6 (the first 1x1
    # convolution's input gradient feeds the 3x3 one's filter gradient: it is computed too)
    assert tfmx.report().patterns["pointwise"].fused == 6
    ran = nodes_that_ran(models[True].train_function)
    products = [n for n in ran if n.name.endswith(f"/{SCOPE}/matmul")]
    assert len(products) == 6, sorted(n.name for n in ran if SCOPE in n.name)
    convolutions = [n.name for n in ran if n.op.startswith("Conv2D")]  # the 3x3 layer's alone
    assert convolutions and all("/stem" in name and "expand" not in name
                                and "project" not in name for name in convolutions), convolutions
    assert not [n for n in nodes_that_ran(models[False].train_function) if SCOPE in n.name]
    # 8 steps; a filter gradient sums 8 batches x 36 pixels, maybe in another order
    assert_models_within_rounding(models[False], models[True], initial, 8 * 8 * 36 * 2)


def test_inference_is_unchanged():
    """predict with the family on gives stock's outputs within rounding."""
    model = _model()
    x = np.random.default_rng(1).standard_normal((4, 6, 6, 3)).astype("float32")
    want = model.predict(x, verbose=0)
    tfmx.enable(patterns=["pointwise"])
    try:
        got = _model().predict(x, verbose=0)
    finally:
        tfmx.disable()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
