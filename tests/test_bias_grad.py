"""The bias_grad pattern: BiasAddGrad as a MatMul of a row of ones (a tuner decision); what is
declined and why; the rewritten graph sums within rounding; and a Dense model trains as stock
with the MatMul in the graph that ran."""

import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_models_within_rounding, fit_stock_and_tfmx, ops_that_ran

import tfmx
from fusion.graph import GraphView
from fusion.graphs.bias_grad import SCOPE, find_bias_grads
from fusion.pattern import RewriteAlways
from tfmx.tuner import Tuner

pytestmark = pytest.mark.usefixtures("every_rewrite")


def _bias_grad(dy):
    return tf.raw_ops.BiasAddGrad(out_backprop=dy)


@pytest.mark.parametrize("shape", [[6, 4], [2, 3, 4], [2, 2, 3, 5]])
def test_rewritten_to_a_matmul_that_sums_the_same(trace, fuse, cpu, rng, assert_same_numbers,
                                                  shape):
    cf, g = trace(_bias_grad, tf.TensorSpec(shape))
    res = fuse(cf, g, cpu)
    ops = [n.op for n in res.graph_def.node]
    assert "BiasAddGrad" not in ops and "MatMul" in ops, ops
    out = next(n for n in res.graph_def.node if n.name == "BiasAddGrad")  # consumers unchanged
    assert out.op == "Reshape" and out.input[0] == f"BiasAddGrad/{SCOPE}/sum"
    dy = tf.constant(rng.standard_normal(shape).astype("float32"))
    rows = int(np.prod(shape[:-1]))
    assert_same_numbers(cf, res, dy, terms=rows)  # a sum of `rows` terms, another order


@pytest.mark.parametrize("spec, data_format, reason", [
    (tf.TensorSpec([None, 4]), "NHWC", "static shape is not fully known"),
    (tf.TensorSpec([2, 4, 3, 3]), "NCHW", "NCHW"),
    (tf.TensorSpec([6, 4], tf.float64), "NHWC", "dtype float64"),
])
def test_declined_with_reason(trace, cpu, spec, data_format, reason):
    cf, g = trace(lambda dy: tf.raw_ops.BiasAddGrad(out_backprop=dy, data_format=data_format),
                  spec)
    matches, declined = find_bias_grads(GraphView(g.node), cpu, RewriteAlways())
    assert matches == [] and len(declined) == 1 and reason in declined[0], declined


def test_the_tuner_decides(trace, cpu):
    """A measured decision (on this machine, either form) under the shape's signature; with
    tuning off the BiasAddGrad stays."""
    cf, g = trace(_bias_grad, tf.TensorSpec([64, 32]))
    found, declined = find_bias_grads(GraphView(g.node), cpu, Tuner("off"))
    assert found == [] and "left as it is" in declined[0] and "tune=off" in declined[0]
    seen = []
    find_bias_grads(GraphView(g.node), cpu, Tuner("auto", None, on_decision=seen.append))
    (d,) = seen
    assert d.signature == "BiasAddGrad float32 64x32" and d.source == "measured"
    assert set(d.times_ms) == {"BiasAddGrad", "matmul"}


def _model():
    import keras

    keras.utils.set_random_seed(5)
    inp = keras.Input((8, 6))
    x = keras.layers.Dense(16, activation="relu")(inp)
    out = keras.layers.Dense(3, activation="softmax")(keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model(inp, out)
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    return model


def test_dense_trains_as_stock_with_the_matmul_in_the_graph_that_ran():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((32, 8, 6)).astype("float32")
    y = rng.integers(0, 3, 32)
    models, initial = fit_stock_and_tfmx(_model, x, y, ["bias_grad"])
    assert tfmx.report().patterns["bias_grad"].fused == 2
    assert "BiasAddGrad" not in ops_that_ran(models[True].train_function)
    assert "BiasAddGrad" in ops_that_ran(models[False].train_function)
    # 8 steps; the bias gradients sum 8 x 8 = 64 terms in another order
    step = 2 * (6 + 16 + 64 + 8) + 20
    assert_models_within_rounding(models[False], models[True], initial, 8 * step)
