"""Training ``_FusedBatchNormEx`` + ``_FusedBatchNormGradEx``: the cuda plan, checked on Linux.

No GPU here, so the plan is checked node by node and then run: each fused node is expanded
back into the CPU kernels its documented semantics name (``_FusedBatchNormEx`` = Relu(
FusedBatchNormV3 + side input); ``_FusedBatchNormGradEx`` = FusedBatchNormGradV3 of
ReluGrad(dy, y), side_input_backprop = ReluGrad(dy, y)) and the step must give the stock
step's numbers exactly: every input, output port and consumer of the plan is where it must be.
"""

from __future__ import annotations

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf
from policies_fixtures import restore_global_policy  # noqa: F401 (autouse: keras's policy back)
from tensorflow.core.framework.node_def_pb2 import NodeDef

import fusion
import tfmx
from fusion.graph import GraphView, parse_input, tensor_ref
from tfmx.backends import get_backend
from tfmx.rebuild import protected_names, rebuild

# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")

ENV = "TF_USE_CUDNN_BATCHNORM_SPATIAL_PERSISTENT"



def _step(channels: int = 8):
    w = tf.random.stateless_normal([2, 4, 4, channels], seed=[3, 4])

    @tf.function(autograph=False)
    def step(x, side, scale, offset):
        with tf.GradientTape() as tape:
            tape.watch([x, side, scale, offset])
            y, mean, var = tf.compat.v1.nn.fused_batch_norm(x, scale, offset, epsilon=1e-3,
                                                            is_training=True)
            out = tf.nn.relu(y + side)
            loss = tf.reduce_sum(tf.cast(out, tf.float32) * w)
        return (out, mean, var, *tape.gradient(loss, [x, side, scale, offset]))

    specs = (tf.TensorSpec([2, 4, 4, channels], tf.float16),
             tf.TensorSpec([2, 4, 4, channels], tf.float16),
             tf.TensorSpec([channels]), tf.TensorSpec([channels]))
    return step.get_concrete_function(*specs)


def _plan(concrete):
    g = concrete.graph.as_graph_def(add_shapes=True)
    return fusion.rewrite(g, get_backend("cuda"), ["batch_norm"], protected_names(concrete))


def _expand_for_cpu(graph_def):
    """The plan with each Ex node replaced by the CPU kernels its semantics name."""
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    renames: dict[tuple[str, int], str] = {}
    keep, extra = [], []
    for node in out.node:
        if node.op == "_FusedBatchNormEx":
            bn = NodeDef(name=node.name + "/bn", op="FusedBatchNormV3", device=node.device,
                         input=node.input[:5])
            for key in ("T", "U", "epsilon", "exponential_avg_factor", "data_format",
                        "is_training"):
                bn.attr[key].CopyFrom(node.attr[key])
            add = NodeDef(name=node.name + "/add", op="AddV2", input=[bn.name, node.input[5]])
            relu = NodeDef(name=node.name + "/relu", op="Relu", input=[add.name])
            for n in (add, relu):
                n.attr["T"].CopyFrom(node.attr["T"])
            extra += [bn, add, relu]
            renames[(node.name, 0)] = relu.name
            for port in range(1, 6):
                renames[(node.name, port)] = tensor_ref(bn.name, port)
        elif node.op == "_FusedBatchNormGradEx":
            dy, x, scale, r1, r2, r3, _offset, y = node.input[:8]
            relu_grad = NodeDef(name=node.name + "/relu_grad", op="ReluGrad", input=[dy, y])
            relu_grad.attr["T"].CopyFrom(node.attr["T"])
            grad = NodeDef(name=node.name + "/bn", op="FusedBatchNormGradV3",
                           input=[relu_grad.name, x, scale, r1, r2, r3])
            for key in ("T", "U", "epsilon", "data_format", "is_training"):
                grad.attr[key].CopyFrom(node.attr[key])
            extra += [relu_grad, grad]
            for port in range(5):
                renames[(node.name, port)] = tensor_ref(grad.name, port)
            renames[(node.name, 5)] = relu_grad.name
        else:
            keep.append(node)
    for node in keep + extra:
        for i, ref in enumerate(node.input):
            name, port, control = parse_input(ref)
            if not control and (name, port) in renames:
                node.input[i] = renames[(name, port)]
    del out.node[:]
    out.node.extend(keep + extra)
    return out


def test_training_plan_wires_the_ex_pair_like_the_remapper(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    concrete = _step()
    result = _plan(concrete)
    ops = collections.Counter(n.op for n in result.graph_def.node)
    assert ops["_FusedBatchNormEx"] == 1 and ops["_FusedBatchNormGradEx"] == 1
    for op in ("FusedBatchNormV3", "FusedBatchNormGradV3", "Relu", "ReluGrad"):
        assert ops[op] == 0, op
    view = GraphView(result.graph_def.node)
    ex = next(n for n in view if n.op == "_FusedBatchNormEx")
    gx = next(n for n in view if n.op == "_FusedBatchNormGradEx")
    assert ex.attr["is_training"].b and ex.attr["activation_mode"].s == b"Relu"
    assert ex.attr["num_side_inputs"].i == 1 and gx.attr["num_side_inputs"].i == 1
    assert list(gx.input[1:6]) == [ex.input[0], ex.input[1], f"{ex.name}:3", f"{ex.name}:4",
                                   f"{ex.name}:5"]
    assert gx.input[6] == ex.input[2]  # offset
    assert view.node(gx.input[7]).op == "Identity"  # y: the activation, as the Relu was
    assert view.consumers(gx.name, 5)  # the side input's gradient
    stats = result.stats["batch_norm"]
    assert stats.fused_kinds["_FusedBatchNormEx(side input, Relu) + _FusedBatchNormGradEx "
                             "(training)"] == 1
    assert not result.errors


def test_training_plan_computes_the_stock_step(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    concrete = _step()
    result = _plan(concrete)
    fn = rebuild(concrete, _expand_for_cpu(result.graph_def))
    args = (tf.cast(tf.random.stateless_normal([2, 4, 4, 8], seed=[1, 2]), tf.float16),
            tf.cast(tf.random.stateless_normal([2, 4, 4, 8], seed=[5, 6]), tf.float16),
            tf.random.stateless_uniform([8], seed=[7, 8]) + 0.5,
            tf.random.stateless_normal([8], seed=[9, 10]))
    for want, got in zip(concrete(*args), fn(*args)):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


@pytest.mark.parametrize("env, channels, why", [
    ("", 8, ENV),
    ("1", 6, "channels % 4"),
])
def test_training_ex_declined_with_the_reason(monkeypatch, env, channels, why):
    monkeypatch.setenv(ENV, env)
    result = _plan(_step(channels))
    ops = collections.Counter(n.op for n in result.graph_def.node)
    assert ops["_FusedBatchNormEx"] == 0 and ops["FusedBatchNormGradV3"] == 1
    assert any(why in d for d in result.stats["batch_norm"].declined)


def test_keras_mixed_float16_resnet_block_plan(monkeypatch):
    """Keras: the forward stage's Identity (ordering the moving averages) is folded in and its
    control inputs stay on the activation."""
    monkeypatch.setenv(ENV, "1")
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inp = keras.Input((4, 4, 8))
    h = keras.layers.Conv2D(8, 3, padding="same")(inp)
    out = keras.layers.ReLU()(keras.layers.Add()([keras.layers.BatchNormalization()(h), h]))
    out = keras.layers.Dense(2, dtype="float32")(keras.layers.GlobalAveragePooling2D()(out))
    model = keras.Model(inp, out)
    model.compile("sgd", "mse")
    tfmx.enable(backend="cuda")
    x, y = np.ones((8, 4, 4, 8), "float32"), np.ones((8, 2), "float32")
    with pytest.raises(tfmx.BackendUnavailableError):
        model.fit(x, y, batch_size=8, verbose=0)
    trace = next(t for t in tfmx.report().traces if t.function.endswith("train_step"))
    plan = GraphView(trace.graph_after.node)
    ops = collections.Counter(n.op for n in plan)
    assert ops["_FusedBatchNormEx"] == 1 and ops["_FusedBatchNormGradEx"] == 1
    assert ops["FusedBatchNormV3"] == 0 and ops["FusedBatchNormGradV3"] == 0
    ex = next(n for n in plan if n.op == "_FusedBatchNormEx")
    activation = next(c for c in plan.consumers(ex.name) if c.op == "Identity")
    assert any(i.startswith("^") for i in activation.input)  # the moving-average updates
    assert not plan.cycle()


@pytest.mark.parametrize("backend, why", [
    ("cpu", "cpu: no _FusedBatchNormEx in training"),
    ("cuda", "no residual Add: left to Grappler's remapper"),
])
def test_a_batch_norm_and_its_relu_alone_are_declined_with_the_reason(monkeypatch, backend, why):
    """BN-ReLU with no residual Add (DenseNet's pre-activation order): the family fuses
    _FusedBatchNormEx with a side input only; it says why this one stays apart."""
    monkeypatch.setenv(ENV, "1")

    @tf.function(autograph=False)
    def f(x, scale, offset):
        y, *_ = tf.raw_ops.FusedBatchNormV3(x=x, scale=scale, offset=offset,
                                            mean=tf.zeros([0]), variance=tf.zeros([0]),
                                            is_training=True)
        return tf.nn.relu(y)

    concrete = f.get_concrete_function(tf.TensorSpec([2, 4, 4, 8], tf.float16),
                                       tf.TensorSpec([8]), tf.TensorSpec([8]))
    result = fusion.rewrite(concrete.graph.as_graph_def(add_shapes=True), get_backend(backend),
                            ["batch_norm"], protected_names(concrete))
    declined = result.stats["batch_norm"].declined
    assert [d for d in declined if d.startswith("FusedBatchNormV3+Relu: ") and why in d], declined
    assert not any(n.op == "_FusedBatchNormEx" for n in result.graph_def.node)
