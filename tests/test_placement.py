"""tfmx.placement: each rule of the placement audit on graphs small enough to read, and the
stock-against-tfmx rule on a Keras step for both Metal plugins. Nothing here ran on a Mac: the
placements are what TensorFlow's placer would decide from the plugins' tables."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tfmx.backends import get_backend
from tfmx.metal_plugins import APPLE, OPEN
from tfmx.placement import CPU, GPU, compare, parts_of, place
from tfmx.placement_audit import audit_model

OPEN_21 = get_backend("metal", plugin=OPEN, tensorflow="2.21")
OPEN_22 = get_backend("metal", plugin=OPEN, tensorflow="2.22")
APPLE_BACKEND = get_backend("metal", plugin=APPLE)


def _graph(fn, *specs) -> graph_pb2.GraphDef:
    return tf.function(fn).get_concrete_function(*specs).graph.as_graph_def(add_shapes=True)


def _by_op(placement, op):
    return [p for p in placement.nodes.values() if p.op == op]


# -- the rules, one by one ------------------------------------------------------------------------
def test_a_kernel_in_another_dtype_falls_back_with_the_dtype_said():
    graph = _graph(lambda a, b: tf.matmul(a, b), tf.TensorSpec([2, 2], tf.bfloat16),
                   tf.TensorSpec([2, 2], tf.bfloat16))
    (node,) = _by_op(place(graph, OPEN_21), "MatMul")
    assert node.device == CPU and node.fallback and node.dtype == "bfloat16"
    assert "float16, float32 only" in node.why
    graph16 = _graph(lambda a, b: tf.matmul(a, b), tf.TensorSpec([2, 2], tf.float16),
                     tf.TensorSpec([2, 2], tf.float16))
    (node,) = _by_op(place(graph16, OPEN_21), "MatMul")
    assert node.device == GPU and node.kind == "device"
    # Apple's table names no dtypes: any but float64, which Metal has no type for.
    (node,) = _by_op(place(graph, APPLE_BACKEND), "MatMul")
    assert node.device == GPU
    graph64 = _graph(lambda a: tf.matmul(a, a), tf.TensorSpec([2, 2], tf.float64))
    (node,) = _by_op(place(graph64, APPLE_BACKEND), "MatMul")
    assert node.fallback and "float64" in node.why


def test_tensorflows_kernels_for_every_device_stay_on_the_device():
    """AssignVariableOp is host-only for the open plugin under 2.21 (no kernel of its own),
    but TensorFlow registers a kernel of it for every device: the placer keeps it there."""
    v = tf.Variable(tf.ones([3]))
    graph = _graph(lambda x: v.assign(x * 2.0).read_value(), tf.TensorSpec([3]))
    assert "AssignVariableOp" in OPEN_21.host_only
    placed = place(graph, OPEN_21)
    for op in ("AssignVariableOp", "ReadVariableOp", "Mul"):
        assert {p.device for p in _by_op(placed, op)} == {GPU}, op
    assert placed.fallbacks() == [] and placed.crossings == []


def test_a_host_only_update_takes_its_variable_and_every_read_of_it_to_the_host():
    v = tf.Variable(tf.ones([4, 4]))
    m, s = tf.Variable(tf.zeros([4, 4])), tf.Variable(tf.zeros([4, 4]))
    w = tf.Variable(tf.ones([4, 4]))  # another variable, read alone

    def step(x):
        y = tf.matmul(x, v) + tf.matmul(x, w)
        grad = tf.reduce_sum(y) * tf.ones([4, 4])
        tf.raw_ops.ResourceApplyAdam(var=v.handle, m=m.handle, v=s.handle, beta1_power=0.9,
                                     beta2_power=0.99, lr=0.1, beta1=0.9, beta2=0.99,
                                     epsilon=1e-7, grad=grad)
        return y

    graph = _graph(step, tf.TensorSpec([2, 4]))
    placed = place(graph, OPEN_21)
    (update,) = _by_op(placed, "ResourceApplyAdam")
    assert update.fallback and "tensorflow/tensorflow#126374" in update.why
    reads = {p.name: p for p in _by_op(placed, "ReadVariableOp")}
    colocated = [p for p in reads.values() if p.device == CPU]
    assert len(colocated) == 1 and "colocated with ResourceApplyAdam" in colocated[0].why
    assert sum(p.device == GPU for p in reads.values()) == 1  # w's read stays on the device
    # The host read feeds a MatMul on the device; the update takes its gradient from there.
    crossings = {(c.src, c.dst) for c in placed.crossings}
    assert any(dst == update.name for _, dst in crossings)
    assert any(src == colocated[0].name for src, _ in crossings)
    assert placed.crossing_bytes() >= 2 * 4 * 4 * 4
    # Under 2.22 the plugin registers the update: nothing leaves the device.
    assert place(graph, OPEN_22).fallbacks() == []


def test_what_runs_on_the_host_anyway_is_no_fallback_and_no_crossing():
    def step(x):
        n = tf.shape(x)[0] * 2  # int32 shape arithmetic
        return tf.reshape(tf.tile(x, [n // 2, 1]), [-1]), tf.identity(n)

    placed = place(_graph(step, tf.TensorSpec([None, 3])), OPEN_21)
    kinds = {p.op: p.kind for p in placed.nodes.values()}
    assert kinds["Const"] == kinds["Placeholder"] == "boundary"
    assert kinds["StridedSlice"] == kinds["Mul"] == "host by design"
    assert placed.fallbacks() == [] and placed.crossings == []
    assert {p.op for p in placed.nodes.values() if p.device == GPU} >= {"Tile", "Reshape"}


def test_identity_follows_its_input_and_crossing_bytes_need_known_shapes():
    def step(x):
        return tf.identity(tf.math.lgamma(tf.nn.relu(x)))

    placed = place(_graph(step, tf.TensorSpec([None, 5])), OPEN_21)
    (lgamma,) = _by_op(placed, "Lgamma")
    assert lgamma.fallback
    identity = next(p for p in _by_op(placed, "Identity") if p.kind == "follows")
    assert identity.device == CPU and not identity.fallback
    (crossing,) = placed.crossings
    assert (crossing.dst, crossing.dtype, crossing.bytes) == (lgamma.name, "float32", None)
    known = place(_graph(step, tf.TensorSpec([2, 5])), OPEN_21)
    assert [c.bytes for c in known.crossings] == [2 * 5 * 4]


def test_function_bodies_are_placed_too():
    def step(x):
        return tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, tf.math.lgamma(y)),
                             (0, x))[1]

    placed = place(_graph(step, tf.TensorSpec([2])), OPEN_21)
    inner = [p for p in placed.nodes.values() if p.function]
    assert inner and any(p.op == "Lgamma" and p.fallback for p in inner)


# -- stock against tfmx ---------------------------------------------------------------------------
def _fused(dtype: str, chain: tuple[str, ...]) -> graph_pb2.GraphDef:
    """One _FusedMatMul of ``dtype`` behind a placeholder: the node tfmx would emit."""
    graph = graph_pb2.GraphDef()
    enum = tf.as_dtype(dtype).as_datatype_enum
    for name in ("a", "b", "bias"):
        node = graph.node.add(name=name, op="Placeholder")
        node.attr["dtype"].type = enum
    node = graph.node.add(name="dense/Relu", op="_FusedMatMul", input=["a", "b", "bias"])
    node.attr["T"].type = enum
    node.attr["num_args"].i = 1
    node.attr["fused_ops"].list.s.extend(s.encode() for s in chain)
    return graph


def test_fused_nodes_count_as_their_parts():
    def stock(dtype):
        spec = tf.TensorSpec([2, 2], dtype)
        return _graph(lambda a, b, c: tf.nn.relu(tf.nn.bias_add(tf.matmul(a, b), c)),
                      spec, spec, tf.TensorSpec([2], dtype))

    assert parts_of(_fused("float32", ("BiasAdd", "Relu")).node[-1]) == (
        "MatMul", "BiasAdd", "Relu")
    ok = compare(stock(tf.float32), _fused("float32", ("BiasAdd", "Relu")), OPEN_21)
    assert ok.ok and ok.tfmx.device_of("_FusedMatMul") == GPU
    # A bfloat16 _FusedMatMul has no kernel in the open plugin: on the host, and its parts
    # (MatMul, BiasAdd, Relu in bfloat16) are on the host in stock too: not moved.
    same = compare(stock(tf.bfloat16), _fused("bfloat16", ("BiasAdd", "Relu")), OPEN_21)
    assert same.tfmx.device_of("_FusedMatMul") == CPU and same.ok
    assert compare(stock(tf.float32), _fused("float32", ("BiasAdd", "Relu")),
                   APPLE_BACKEND).ok
    # A node tfmx emits that lands on the host where stock ran its work on the device: moved.
    lost = compare(stock(tf.float32), _graph(lambda a: tf.math.lgamma(a),
                                             tf.TensorSpec([2, 2])), OPEN_21)
    assert [p.op for p in lost.moved] == ["Lgamma"]
    assert "moved from the device to the host by tfmx: 1" in str(lost)


def test_a_renamed_node_is_compared_by_name_where_stock_has_it():
    graph = _graph(lambda x: tf.math.lgamma(x), tf.TensorSpec([2]))
    audit = compare(graph, graph, OPEN_21)
    assert audit.ok and audit.stock.host_ops() == audit.tfmx.host_ops() == {"Lgamma": 1}


def _adam_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6, 6, 2)),
                              keras.layers.Conv2D(3, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    return model


@pytest.mark.usefixtures("every_rewrite")
def test_the_open_plugins_optimizer_plan_and_why_it_emits_no_resource_apply():
    """Under 2.21 the optimizer family declines ResourceApplyAdam for the open plugin. The
    placement shows why: the same step with Apple's plan (one ResourceApplyAdam per variable)
    placed for the open plugin under 2.21 puts every variable, its reads and its slots on the
    host, crossing at every read; stock's composite update stays on the device."""
    x, y = np.zeros((4, 6, 6, 2), np.float32), np.zeros((4, 2), np.float32)
    audit = audit_model(_adam_model(), x, y, plugin=OPEN, tensorflow="2.21")
    assert audit.ok, str(audit)
    assert not any(op.startswith("ResourceApply") for op in
                   (p.op for p in audit.tfmx.nodes.values()))
    apple = audit_model(_adam_model(), x, y, plugin=APPLE)
    assert apple.ok, str(apple)
    emitted = [p for p in apple.tfmx.nodes.values() if p.op == "ResourceApplyAdam"]
    assert len(emitted) == 6 and all(p.device == GPU for p in emitted)
    # Apple's plan, were it run by the open plugin under 2.21:
    from tfmx import state

    plan = next(t for t in reversed(state.report().traces)
                if t.function.endswith("train_step")).graph_after
    there = place(plan, OPEN_21)
    assert there.host_ops()["ResourceApplyAdam"] == 6
    colocated = [p for p in there.fallbacks() if "colocated with ResourceApplyAdam" in p.why]
    assert {p.op for p in colocated} >= {"ReadVariableOp"}
    assert len(there.crossings) > len(audit.stock.crossings) + 6
    assert not compare(audit_stock_graph(), plan, OPEN_21).ok
    assert compare(audit_stock_graph(), plan, OPEN_22).ok


def audit_stock_graph() -> graph_pb2.GraphDef:
    model = _adam_model()
    specs = (tf.TensorSpec([4, 6, 6, 2]), tf.TensorSpec([4, 2]))
    return tf.function(model.train_step).get_concrete_function(specs).graph.as_graph_def(
        add_shapes=True)


def test_audit_model_puts_tfmx_back_as_it_was():
    import tfmx
    from tfmx import state

    x, y = np.zeros((2, 6, 6, 2), np.float32), np.zeros((2, 2), np.float32)
    assert not tfmx.enabled()
    audit_model(_adam_model(), x, y, plugin=OPEN)
    assert not tfmx.enabled()
    tfmx.enable(backend="cpu")
    try:
        before = state.options()
        audit_model(_adam_model(), x, y, plugin=APPLE)
        assert state.options() == before
    finally:
        tfmx.disable()


@pytest.mark.usefixtures("every_rewrite")
def test_the_report_has_a_placement_section_on_metal_only():
    import tfmx

    x, y = np.zeros((2, 6, 6, 2), np.float32), np.zeros((2, 2), np.float32)
    tfmx.enable(backend="metal", plugin=OPEN)
    try:
        with pytest.raises(tfmx.BackendUnavailableError):
            _adam_model().fit(x, y, batch_size=2, epochs=1, verbose=0)
        report = tfmx.report()
        text = str(report)
        assert "placement on tensorflow-metal-plugin 0.4.1" in text
        assert "  stock: " in text and "  tfmx: " in text  # stock traced beside the plan
        assert "moved from the device to the host by tfmx: 0" in text
        (entry,) = [e for e in report.to_dict()["placement"]
                    if e["function"].endswith("train_step")]
        assert entry["stock"] == "stock" and entry["moved_to_host"] == []
        assert entry["tfmx"]["host_ops"]["DivNoNan"] == 5
        assert entry["before"]["crossings"] >= entry["tfmx"]["crossings"] > 0
    finally:
        tfmx.disable()
    tfmx.enable(backend="cpu")
    try:
        _adam_model().fit(x, y, batch_size=2, epochs=1, verbose=0)
        assert tfmx.report().placement() == [] and "placement on" not in str(tfmx.report())
    finally:
        tfmx.disable()
