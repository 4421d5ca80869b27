"""tfmx.rebuild: both rebuild paths keep signature, captures, outputs and variable updates."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from fusion.graph import op_histogram
from tfmx.rebuild import control_output_names, protected_names, rebuild, rebuild_imported


def _step():
    v = tf.Variable([1.0, 2.0])

    @tf.function
    def step(x):
        v.assign_add(x)
        return {"sum": tf.reduce_sum(v * x), "x": x}

    return v, step.get_concrete_function(tf.TensorSpec([2], tf.float32))


@pytest.mark.parametrize("build", [rebuild, rebuild_imported])
def test_rebuilt_function_runs_updates_and_returns_the_same_structure(build):
    v, concrete = _step()
    fused = build(concrete, concrete.graph.as_graph_def())
    out = fused(tf.constant([1.0, 1.0]))
    np.testing.assert_allclose(v.numpy(), [2.0, 3.0])
    assert set(out) == {"sum", "x"}
    assert float(out["sum"]) == 5.0


def test_fast_rebuild_calls_one_runtime_function_holding_the_body():
    _, concrete = _step()
    fused = rebuild(concrete, concrete.graph.as_graph_def())
    assert {op.type for op in fused.graph.get_operations()} == {
        "Placeholder", "StatefulPartitionedCall"}
    assert op_histogram(fused.graph.as_graph_def())["AssignAddVariableOp"] == 1


def test_imported_rebuild_is_differentiable():
    w = tf.Variable(3.0)
    concrete = tf.function(lambda x: x * w).get_concrete_function(tf.TensorSpec([], tf.float32))
    fused = rebuild_imported(concrete, concrete.graph.as_graph_def())
    with tf.GradientTape() as tape:
        y = fused(tf.constant(2.0))
    assert float(tape.gradient(y, w)) == 2.0


def test_protected_names_and_control_outputs_are_separate():
    _, concrete = _step()
    controls = control_output_names(concrete)
    assert any("AssignAdd" in name for name in controls)
    assert not controls & protected_names(concrete)
