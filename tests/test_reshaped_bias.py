"""The reshaped_bias pattern: a bias added after a MatMul's reshape (Keras Dense on inputs of
rank > 2) moves ahead of the reshape, so contraction fuses it into the MatMul; what is
declined and why; and a Dense on [batch, tokens, features] trains as stock with the fused
MatMul in the graph that ran."""

import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_models_within_rounding, fit_stock_and_tfmx, ops_that_ran

import tfmx
from fusion.graph import GraphView
from fusion.graphs.reshaped_bias import SUFFIX, find_reshaped_biases

F32 = tf.float32
X = tf.TensorSpec([6, 5], F32)
W = tf.TensorSpec([5, 4], F32)
B = tf.TensorSpec([4], F32)


def _args(rng, *specs):
    return [tf.constant(rng.standard_normal(s.shape.as_list()).astype("float32"))
            for s in specs]


def _dense3d(x, w, b):
    return tf.nn.relu(tf.nn.bias_add(tf.reshape(tf.matmul(x, w), [2, 3, 4]), b))


def test_bias_moves_ahead_and_contraction_fuses_it(trace, fuse, cpu, rng, assert_same_numbers):
    cf, g = trace(_dense3d, X, W, B)
    res = fuse(cf, g, cpu)
    nodes = {n.name: n for n in res.graph_def.node}
    fused = [n for n in nodes.values() if n.op == "_FusedMatMul"]
    assert len(fused) == 1 and fused[0].name == "MatMul" + SUFFIX
    assert [s.decode() for s in fused[0].attr["fused_ops"].list.s] == ["BiasAdd"]
    after = nodes["BiasAdd"]  # the reshape took the bias's name: its consumers are unchanged
    assert after.op == "Reshape" and after.input[0] == fused[0].name
    assert [n.op for n in nodes.values()].count("BiasAdd") == 0
    assert res.stats["reshaped_bias"].fused == 1
    # The same additions on the same elements: bitwise
    assert_same_numbers(cf, res, *_args(rng, X, W, B), terms=0)


def test_shape_reader_of_the_reshape_reads_the_new_one(trace, fuse, cpu, rng,
                                                       assert_same_numbers):
    def f(x, w, b):
        r = tf.reshape(tf.matmul(x, w), [-1, 3, 4])
        return tf.nn.bias_add(r, b), tf.shape(r)

    cf, g = trace(f, tf.TensorSpec([None, 5], F32), W, B)
    res = fuse(cf, g, cpu)
    shape = next(n for n in res.graph_def.node if n.op == "Shape")
    assert list(shape.input) == ["BiasAdd"]
    assert_same_numbers(cf, res, *_args(rng, X, W, B), terms=0)


@pytest.mark.parametrize("fn, reason", [
    (lambda x, w, b: tf.nn.bias_add(tf.reshape(tf.matmul(x, w), [2, 4, 3]), b[:3]),
     "does not keep the last axis"),
    (lambda x, w, b: (lambda r: (tf.nn.bias_add(r, b), r * 2.0))(
        tf.reshape(tf.matmul(x, w), [2, 3, 4])),
     "Reshape output also feeds Mul"),
    (lambda x, w, b: (lambda m: (tf.nn.bias_add(tf.reshape(m, [2, 3, 4]), b), m * 2.0))(
        tf.matmul(x, w)),
     "MatMul output also feeds Mul"),
])
def test_declined_with_reason(trace, fn, reason):
    cf, g = trace(fn, X, W, B)
    matches, declined = find_reshaped_biases(GraphView(g.node))
    assert matches == [] and len(declined) == 1 and reason in declined[0], declined


def test_nchw_bias_declined(trace):
    def f(x, w, b):
        r = tf.reshape(tf.matmul(x, w), [2, 4, 1, 3])
        return tf.nn.bias_add(r, b, data_format="NCHW")

    cf, g = trace(f, tf.TensorSpec([6, 4], F32), tf.TensorSpec([4, 4], F32), B)
    matches, declined = find_reshaped_biases(GraphView(g.node))
    assert matches == [] and "NCHW" in declined[0], declined


def _model():
    import keras

    keras.utils.set_random_seed(3)
    inp = keras.Input((8, 6))
    x = keras.layers.Dense(16, activation="relu")(inp)
    x = keras.layers.Dense(5)(x)
    out = keras.layers.Dense(3, activation="softmax")(keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model(inp, out)
    model.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy")
    return model


def test_dense_on_tokens_trains_as_stock_with_the_bias_fused():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 8, 6)).astype("float32")
    y = rng.integers(0, 3, 32)
    models, initial = fit_stock_and_tfmx(_model, x, y, ["reshaped_bias", "contraction"])
    stats = tfmx.report().patterns
    assert stats["reshaped_bias"].fused == 2 and stats["contraction"].fused >= 2, stats
    assert "_FusedMatMul" in ops_that_ran(models[True].train_function)
    # 8 steps of Dense layers of 6-16 terms, relu, pooling over 8 tokens, softmax: the fused
    # kernel may add the bias in another order than BiasAdd
    step = 2 * (6 + 16 + 5 + 8) + 20
    assert_models_within_rounding(models[False], models[True], initial, 8 * step)
