"""The matmul_layout pattern: a transpose_b MatMul reading its second operand transposed once (a
tuner decision); what is declined and why; the rewritten product within rounding; and a Dense
model trains as stock with the transposition in the graph that ran."""

import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    assert_models_within_rounding,
    fit_stock_and_tfmx,
    nodes_that_ran,
    profiled_ops,
)

import tfmx
from fusion.graph import GraphView
from fusion.graphs.matmul_layout import SCOPE, find_layouts
from fusion.pattern import RewriteAlways
from tfmx.tuner import Tuner

pytestmark = pytest.mark.usefixtures("every_rewrite")


def _input_grad(dy, w):
    return tf.matmul(dy, w, transpose_b=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rewritten_to_a_product_of_the_transposed_operand(trace, fuse, cpu, rng,
                                                         assert_same_numbers, dtype):
    cf, g = trace(_input_grad, tf.TensorSpec([16, 12], dtype), tf.TensorSpec([5, 12], dtype))
    res = fuse(cf, g, cpu)
    product = next(n for n in res.graph_def.node if n.name == "MatMul")  # its name kept
    assert not product.attr["transpose_b"].b
    assert product.input[1] == f"MatMul/{SCOPE}/matrix"
    ops = {n.name: n.op for n in res.graph_def.node}
    assert ops[f"MatMul/{SCOPE}/transpose"] == "Transpose"
    dy = tf.cast(rng.standard_normal((16, 12)), dtype)
    w = tf.cast(rng.standard_normal((5, 12)), dtype)
    assert_same_numbers(cf, res, dy, w, terms=12)  # a dot of 12 terms, maybe another order


@pytest.mark.parametrize("fn, specs, reason", [
    (lambda a, b: tf.matmul(a, b, transpose_a=True, transpose_b=True),
     [tf.TensorSpec([12, 16]), tf.TensorSpec([5, 12])], "transpose_a"),
    (_input_grad, [tf.TensorSpec([None, 12]), tf.TensorSpec([5, 12])], "not fully known"),
    (_input_grad, [tf.TensorSpec([16, 12], tf.float64), tf.TensorSpec([5, 12], tf.float64)],
     "dtype float64"),
])
def test_declined_with_reason(trace, cpu, fn, specs, reason):
    cf, g = trace(fn, *specs)
    matches, declined = find_layouts(GraphView(g.node), cpu, RewriteAlways())
    assert matches == [] and len(declined) == 1 and reason in declined[0], declined


def test_a_matmul_without_transpose_b_is_not_a_match(trace, cpu):
    cf, g = trace(tf.matmul, tf.TensorSpec([16, 12]), tf.TensorSpec([12, 5]))
    assert find_layouts(GraphView(g.node), cpu, RewriteAlways()) == ([], [])


def test_the_tuner_decides(trace, cpu):
    """A measured decision (on this machine, either form) under the shapes' signature; with
    tuning off the MatMul keeps its transpose_b."""
    cf, g = trace(_input_grad, tf.TensorSpec([64, 48]), tf.TensorSpec([32, 48]))
    found, declined = find_layouts(GraphView(g.node), cpu, Tuner("off"))
    assert found == [] and "left as it is" in declined[0] and "tune=off" in declined[0]
    seen = []
    find_layouts(GraphView(g.node), cpu, Tuner("auto", None, on_decision=seen.append))
    (d,) = seen
    assert d.signature == "MatMul float32 64x48 x (32x48)^T" and d.source == "measured"
    assert set(d.times_ms) == {"transpose_b", "transposed"}


def _model():
    import keras

    keras.utils.set_random_seed(7)
    inp = keras.Input((8, 6))
    x = keras.layers.Dense(16, activation="relu")(inp)
    x = keras.layers.Dense(12, activation="relu")(x)
    out = keras.layers.Dense(3, activation="softmax")(keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model(inp, out)
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    return model


def test_dense_trains_as_stock_with_the_transposition_in_the_graph_that_ran(tmp_path):
    """The input gradients of the second and third Dense read their kernels transposed by the
    family's nodes in the step that ran (in a profile: Grappler did not fold them back into
    the MatMul), and the weights stay within the rounding of stock's."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 8, 6)).astype("float32")
    y = rng.integers(0, 3, 32)
    models, initial = fit_stock_and_tfmx(_model, x, y, ["matmul_layout"])
    assert tfmx.report().patterns["matmul_layout"].fused == 2
    ran = nodes_that_ran(models[True].train_function)
    transposes = [n for n in ran if n.name.endswith(f"/{SCOPE}/transpose")]
    assert len(transposes) == 2, sorted(n.name for n in ran if SCOPE in n.name)
    assert not [n for n in nodes_that_ran(models[False].train_function) if SCOPE in n.name]
    # 8 steps; every product a dot of at most 16 terms, maybe summed in another order
    step = 2 * (6 + 16 + 12 + 8) + 20
    assert_models_within_rounding(models[False], models[True], initial, 8 * step)
    # one more epoch, profiled: the graph as the runtime ran it
    ran = profiled_ops(lambda: models[True].fit(x, y, batch_size=8, epochs=1, verbose=0,
                                                shuffle=False), tmp_path)
    executed = sorted(kernel for name, kernel in ran if name.endswith(f"/{SCOPE}/transpose"))
    assert len(executed) == 2 and all("Transpose" in k for k in executed), sorted(
        n for n in ran if "MatMul" in n[1] or SCOPE in n[0])
