"""The dedupe family: one read per variable and point in the step, equal computations once."""

from __future__ import annotations

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import ops_that_ran
from parity import assert_optimizer_parity
from tensorflow.core.framework.node_def_pb2 import NodeDef

import tfmx
from fusion.graph import GraphView
from fusion.graphs.dedupe import _shareable, find_duplicates
from tfmx.rebuild import protected_names, rebuild

# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")



def ops(graph_def) -> collections.Counter:
    return collections.Counter(n.op for n in graph_def.node)


def test_two_reads_and_the_math_on_them_become_one(trace, fuse, cpu, assert_same_numbers):
    v = tf.Variable([4.0, 9.0])

    def f(x):
        return tf.sqrt(v.read_value() + 1.0) * x + tf.sqrt(v.read_value() + 1.0)

    concrete, g = trace(f, tf.TensorSpec([2]))
    assert ops(g)["ReadVariableOp"] == 2 and ops(g)["Sqrt"] == 2
    result = fuse(concrete, g, cpu)
    after = ops(result.graph_def)
    assert after["ReadVariableOp"] == 1 and after["Sqrt"] == 1 and after["AddV2"] == 2
    kinds = result.stats["dedupe"].fused_kinds
    assert kinds["ReadVariableOp computed once"] == 1 and kinds["Sqrt computed once"] == 1
    assert_same_numbers(concrete, result, tf.constant([2.0, 3.0]), terms=0)


def test_a_read_after_a_write_stays_its_own_read(trace, fuse, cpu):
    v = tf.Variable(2.0)

    def f():
        before = v.read_value()
        v.assign_add(1.0)
        return before + v.read_value()

    concrete, g = trace(f)
    result = fuse(concrete, g, cpu)
    assert ops(result.graph_def)["ReadVariableOp"] == 2
    new = rebuild(concrete, result.graph_def, result.control_renames)
    v.assign(2.0)
    assert float(new()) == 5.0 and float(v.numpy()) == 3.0


def test_side_effects_are_never_merged(trace, fuse, cpu):
    v = tf.Variable(0.0)

    def f():
        v.assign_add(1.0)
        v.assign_add(1.0)
        return tf.random.uniform([3]) - tf.random.uniform([3])

    concrete, g = trace(f)
    result = fuse(concrete, g, cpu)
    after = ops(result.graph_def)
    assert after["AssignAddVariableOp"] == 2 and after["RandomUniform"] == 2
    new = rebuild(concrete, result.graph_def, result.control_renames)
    v.assign(0.0)
    assert np.any(new().numpy() != 0.0)  # two draws, not one
    assert float(v.numpy()) == 2.0


def test_fetched_outputs_keep_their_nodes(trace, fuse, cpu, assert_same_numbers):
    def f(x):
        return tf.identity(tf.sqrt(x)), tf.identity(tf.sqrt(x))

    concrete, g = trace(f, tf.TensorSpec([3]))
    result = fuse(concrete, g, cpu)
    after = ops(result.graph_def)
    assert after["Sqrt"] == 1
    names = {n.name for n in result.graph_def.node}
    assert protected_names(concrete) <= names  # each fetched output keeps its own node
    assert after["Identity"] == ops(g)["Identity"] - 1  # the inner tf.identity is shared
    assert_same_numbers(concrete, result, tf.constant([1.0, 4.0, 9.0]), terms=0)


def test_which_ops_may_be_shared():
    assert _shareable("ReadVariableOp") and _shareable("Pow") and _shareable("Const")
    for op in ("AssignAddVariableOp", "RandomUniform", "Placeholder", "PartitionedCall", "If",
               "While", "NoOp", "InplaceUpdate", "no_such_function"):
        assert not _shareable(op), op


def test_tensorflow_1_control_flow_is_left_alone():
    nodes = [NodeDef(name="p", op="Placeholder"), NodeDef(name="c", op="Const"),
             NodeDef(name="c2", op="Const"),
             NodeDef(name="s", op="Switch", input=["p", "c"])]
    matches, declined = find_duplicates(GraphView(nodes))
    assert matches == [] and "control flow" in declined[0]


def _adam_model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,))] + [keras.layers.Dense(8, activation="relu")
                                                   for _ in range(4)] + [keras.layers.Dense(3)])
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    return model


def _fit(enable: bool, patterns: list[str]) -> tuple[keras.Model, list[np.ndarray]]:
    if enable:
        tfmx.enable(backend="cpu", patterns=patterns)
    model = _adam_model()
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(40, 6)).astype("float32"), rng.normal(size=(40, 3))
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    state = [v.numpy() for v in model.weights + model.optimizer.variables]
    return model, state


@pytest.mark.parametrize("patterns", [["dedupe"], ["optimizer_update", "dedupe"]])
def test_keras_adam_step_computes_its_schedule_once_and_trains_like_stock(patterns):
    stock, expected = _fit(False, patterns)
    fused, got = _fit(True, patterns)
    names = [v.path for v in stock.weights + stock.optimizer.variables]
    for e, g in zip(expected, got):
        if patterns == ["dedupe"]:
            np.testing.assert_array_equal(g, e)  # exact: the same values, computed once
    if patterns != ["dedupe"]:  # ResourceApplyAdam's own rounding (tests/parity.py)
        assert_optimizer_parity(names, expected, got, "Adam", steps=2 * 40 // 8)
    rep = tfmx.report()
    assert rep.fused("dedupe") > 0
    graphs = [t.graph_after for t in rep.traces if t.status == "rewritten"]
    step = max(graphs, key=lambda gd: len(gd.node))
    # Keras computes beta_1 ** t and beta_2 ** t once per variable (10 variables); now once.
    assert ops(step)["Pow"] == 2
    def reads(graph_def):
        return collections.Counter(n.input[0] for n in graph_def.node
                                   if n.op == "ReadVariableOp").most_common(1)[0][1]

    before = max((t.graph_before for t in rep.traces), key=lambda gd: len(gd.node))
    # The step counter and learning rate were read once per variable; now each variable is
    # read at most twice (a slot: before its update and after it, for the weight's update).
    assert reads(before) >= 10 and reads(step) <= 2
    assert "Pow" in ops_that_ran(fused.train_function)
