"""The onednn family: convolutions, MatMuls, batch norm and softmax retargeted to TensorFlow's
bundled oneDNN kernels."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    ACTIVATION_ROUNDINGS,
    TRANSCENDENTAL,
    assert_within_rounding,
    needs_onednn,
    ops_that_ran,
)

import fusion
import tfmx
from fusion.graph import GraphView
from fusion.graphs import onednn
from fusion.graphs.onednn import KERNEL_LABEL, RETARGETS, OneDnnKernels, find_onednn
from fusion.graphs.onednn import kernels_registered as onednn_kernels_registered
from fusion.pattern import PlainTarget
from tfmx.backends import get_backend
from tfmx.rebuild import protected_names, rebuild

CONVOLUTIONS = {op: new for op, new in RETARGETS.items() if op.startswith("Conv2D")}
REGISTERED = pytest.mark.skipif(
    not onednn_kernels_registered(),
    reason="needs oneDNN's kernels, which TensorFlow's Linux x86-64 wheel registers")


def RUNS_HERE(test):  # noqa: N802 - a decorator, like pytest's marks
    """With oneDNN's graph pass off (otherwise stock already runs these kernels and there is
    nothing to retarget), on a TensorFlow that registers them."""
    return REGISTERED(needs_onednn("off")(test))


# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")


def _Target():  # noqa: N802 - stands for a backend class
    """A backend that retargets every convolution (the matcher does not need a real one)."""
    return PlainTarget("test", (OneDnnKernels(),))



_ALIVE: list[tf.Variable] = []  # a traced function holds its variables weakly


def _on_cpu(cf, families=("onednn",)):
    """``cf``'s graph rewritten by ``families`` for this process's cpu backend."""
    return fusion.rewrite(cf.graph.as_graph_def(add_shapes=True), get_backend("cpu"),
                          list(families), protected_names(cf))


def _conv_step(dtype=tf.float32, data_format="NHWC", padding="SAME"):
    shape = [2, 6, 6, 3] if data_format == "NHWC" else [2, 3, 6, 6]
    w = tf.Variable(tf.random.normal([3, 3, 3, 4], seed=1, dtype=tf.float32))
    _ALIVE.append(w)

    @tf.function(autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            pad = [[0, 0], [1, 1], [1, 1], [0, 0]] if padding == "EXPLICIT" else padding
            if data_format == "NCHW" and padding == "EXPLICIT":
                pad = [[0, 0], [0, 0], [1, 1], [1, 1]]
            y = tf.nn.conv2d(x, tf.cast(w, dtype), 1, pad, data_format=data_format)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) ** 2)
        return tape.gradient(loss, [x, w])

    return step.get_concrete_function(tf.TensorSpec(shape, dtype))


def test_convolution_and_both_gradients_are_found():
    cf = _conv_step()
    view = GraphView(cf.graph.as_graph_def(add_shapes=True).node)
    matches, declined = find_onednn(view, _Target())
    assert sorted((m.node.op, m.op) for m in matches) == sorted(CONVOLUTIONS.items())
    assert declined == []


@pytest.mark.parametrize("dtype,data_format,padding,why", [
    (tf.float16, "NHWC", "SAME", "in float16: only float32 goes to oneDNN"),
    (tf.float32, "NCHW", "SAME", "in NCHW: only NHWC goes to oneDNN"),
    (tf.float32, "NHWC", "EXPLICIT", "with explicit padding: left on Eigen"),
])
def test_declines_say_why(dtype, data_format, padding, why):
    cf = _conv_step(dtype, data_format, padding)
    view = GraphView(cf.graph.as_graph_def(add_shapes=True).node)
    matches, declined = find_onednn(view, _Target())
    assert matches == []
    assert len(declined) == 3 and all(why in d for d in declined)


def test_backends_without_the_kernels_or_with_onednn_on_retarget_nothing():
    cf = _conv_step()
    g = cf.graph.as_graph_def(add_shapes=True)
    for name in ("cuda", "metal"):
        assert get_backend(name).capability(OneDnnKernels) is None
        res = fusion.rewrite(g, get_backend(name), ["onednn"], protected_names(cf))
        assert res.stats["onednn"].matched == 0 and not res.changed


@RUNS_HERE
def test_rewritten_step_runs_on_onednn_and_matches_eigen():
    cf = _conv_step()
    g = cf.graph.as_graph_def(add_shapes=True)
    res = fusion.rewrite(g, get_backend("cpu"), ["onednn"], protected_names(cf))
    retargeted = [n for n in res.graph_def.node if n.op in CONVOLUTIONS.values()]
    assert len(retargeted) == 3
    assert all(n.attr["_kernel"].s.decode() == KERNEL_LABEL for n in retargeted)
    before = {n.name: n.op for n in g.node if n.op in CONVOLUTIONS}
    assert {n.name: RETARGETS[before[n.name]] for n in retargeted} == {
        n.name: n.op for n in retargeted}  # same node names: consumers need no rewiring
    x = tf.random.normal([2, 6, 6, 3], seed=2)
    # y = conv(x, w): 3x3x3 = 27 terms; dloss/dy = 2y (1); dx: 3x3x4 = 36 terms of it; dw:
    # 2x6x6 = 72 terms of it. Each gradient within those roundings of its largest value.
    want_x, want_w = cf(x)
    got_x, got_w = rebuild(cf, res.graph_def)(x)
    assert_within_rounding(got_x.numpy(), want_x.numpy(), 27 + 1 + 36, what="dx")
    assert_within_rounding(got_w.numpy(), want_w.numpy(), 27 + 1 + 72, what="dw")


class _Chooser:
    """A chooser (fusion.pattern.Chooser) keeping Eigen for one signature; records requests."""

    def __init__(self, keep_eigen: str = ""):
        self.keep, self.asked = keep_eigen, []

    def choose(self, family, signature, candidates, conservative):
        self.asked.append((family, signature, conservative, sorted(candidates)))
        choice = "eigen" if self.keep and self.keep in signature else "onednn"
        return type("Choice", (), {"choice": choice, "why": lambda self: "measured faster"})()


@pytest.mark.parametrize(("m", "k", "n", "transpose_b"), [
    (256, 512, 512, False), (256, 512, 512, True), (3200, 32, 512, False),
    (None, 1024, 1024, False),
])
def test_every_matmul_is_a_decision_at_its_own_shapes(m, k, n, transpose_b):
    """Eigen or oneDNN is the tuner's to measure, per MatMul, by its shapes (no threshold
    measured on one processor decides); without a tuner every MatMul goes."""
    b_shape = [n, k] if transpose_b else [k, n]
    g = tf.function(lambda a, b: tf.matmul(a, b, transpose_b=transpose_b)).get_concrete_function(
        tf.TensorSpec([m, k]), tf.TensorSpec(b_shape)).graph.as_graph_def(add_shapes=True)
    view = GraphView(g.node)
    assert len(find_onednn(view, _Target())[0]) == 1
    sig = (f"MatMul {m or '?'}x{k} {b_shape[0]}x{b_shape[1]} transpose_a=False "
           f"transpose_b={transpose_b}")
    chooser = _Chooser()
    matches, declined = find_onednn(view, _Target(), chooser)
    assert len(matches) == 1 and declined == []
    assert chooser.asked == [("onednn", sig, "eigen", ["eigen", "onednn"])]
    matches, declined = find_onednn(view, _Target(), _Chooser(keep_eigen="MatMul"))
    assert matches == [] and declined == [f"{sig}: left on Eigen: measured faster"]


def test_the_largest_nodes_are_decided_first():
    """A tuner whose budget runs out spends it on the choices that weigh most: a small MatMul
    met first in the graph is asked after a large one."""
    g = tf.function(lambda a, b, c, d: (tf.matmul(a, b), tf.matmul(c, d))).get_concrete_function(
        tf.TensorSpec([8, 16]), tf.TensorSpec([16, 8]), tf.TensorSpec([512, 256]),
        tf.TensorSpec([256, 512])).graph.as_graph_def(add_shapes=True)
    view = GraphView(g.node)
    chooser = _Chooser()
    matches, _ = find_onednn(view, _Target(), chooser)
    asked = [sig.split()[1] for _, sig, _, _ in chooser.asked]
    assert asked == ["512x256", "8x16"] and len(matches) == 2
    graph_order = [n.name for n in view.nodes() if n.op == "MatMul"]
    assert [m.node.name for m in matches] == graph_order[::-1]


@RUNS_HERE
def test_matmul_and_its_gradients_run_on_onednn_and_match_eigen():
    w = tf.Variable(tf.random.normal([8, 16], seed=3))
    _ALIVE.append(w)

    @tf.function(autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.tanh(tf.matmul(x, w)) ** 2)
        return tape.gradient(loss, [x, w])

    cf = step.get_concrete_function(tf.TensorSpec([4, 8]))
    res = _on_cpu(cf)
    ops = [n.op for n in res.graph_def.node]
    assert ops.count("_MklMatMul") == 3 and "MatMul" not in ops  # forward and both gradients
    x = tf.random.normal([4, 8], seed=4)
    # z = x w: 8 terms; t = tanh z (transcendental); 2 t (1 - t^2) (4); dx = dz w^T: 16 terms,
    # dw = x^T dz: 4 terms.
    forward = 8 + TRANSCENDENTAL + 4
    (want_x, want_w), (got_x, got_w) = cf(x), rebuild(cf, res.graph_def)(x)
    assert_within_rounding(got_x.numpy(), want_x.numpy(), forward + 16, what="dx")
    assert_within_rounding(got_w.numpy(), want_w.numpy(), forward + 4, what="dw")


CNN_STEPS = 5


@RUNS_HERE
def test_keras_cnn_trains_like_stock_with_onednn_convolutions():
    def train(fused: bool):
        if fused:
            tfmx.enable(backend="cpu")
        keras.utils.set_random_seed(0)
        inp = keras.Input((12, 12, 3))
        x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inp)
        x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
        x = keras.layers.MaxPooling2D(2, strides=1, padding="same")(x)
        x = keras.layers.Conv2D(8, 3, strides=2, padding="same", activation="relu")(x)
        out = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(x))
        model = keras.Model(inp, out)
        model.compile(keras.optimizers.SGD(0.05), "mse")
        rng = np.random.default_rng(0)
        x_data = rng.random((CNN_STEPS * 8, 12, 12, 3), dtype=np.float32)
        y_data = rng.random((CNN_STEPS * 8, 3), dtype=np.float32)
        model.fit(x_data, y_data, batch_size=8, epochs=1, shuffle=False, verbose=0)
        report = tfmx.report().to_dict()["patterns"]["onednn"] if fused else None
        predictions = model.predict(x_data, verbose=0)
        return ([v.numpy() for v in model.weights] + [predictions],
                ops_that_ran(model.train_function), report)

    stock, _, _ = train(False)
    fused, ran, report = train(True)
    assert {"_MklNativeConv2D", "_MklNativeConv2DBackpropFilter",
            "_MklNativeConv2DBackpropInput", "_MklMatMul", "_MklNativeFusedBatchNormV3",
            "_MklNativeFusedBatchNormGradV3", "_MklNativeMaxPool", "_MklNativeMaxPoolGrad"} <= ran
    assert not {"FusedBatchNormV3", "FusedBatchNormGradV3", "Conv2DBackpropFilter", "MaxPool",
                "MaxPoolGrad"} & ran
    assert report["fused_kinds"]["Conv2DBackpropFilter -> _MklNativeConv2DBackpropFilter"] == 2
    # One step's roundings, longest path: five sums over the batch's 8 x 12 x 12 = 1,152
    # positions (the batch norm's mean and variance, the two means of its gradient, the first
    # kernel's gradient; as tests/test_batch_norm.py counts them), and the rest (windows of 27
    # and 72 terms, pooling 36, the Dense 9, the loss 24, the input gradient 72, some 30
    # elementwise ops): 300. The max pool's overlapping windows (2 x 2, stride 1) add up to 4
    # incoming gradients per position: 4 more. The steps add up; predict runs the forward
    # (the rest) once more.
    per_step = 5 * 8 * 12 * 12 + 300 + 4
    for i, (a, b) in enumerate(zip(stock, fused)):
        terms = CNN_STEPS * per_step + (300 if i == len(stock) - 1 else 0)
        assert_within_rounding(b, a, terms, what=f"tensor {i}")


def test_only_x86_64_cpus_retarget(monkeypatch):
    monkeypatch.setattr(onednn.platform, "machine", lambda: "aarch64")
    onednn_kernels_registered.cache_clear()
    try:
        assert not onednn_kernels_registered()
        assert get_backend("cpu").capability(OneDnnKernels) is None
    finally:
        monkeypatch.undo()
        onednn_kernels_registered.cache_clear()


def test_batch_norm_goes_to_onednn_only_with_its_gradient():
    """The gradient reads the forward's reserve spaces: a pair moves together or stays."""
    scale, offset = tf.ones([3]), tf.zeros([3])

    @tf.function(autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y, *_ = tf.compat.v1.nn.fused_batch_norm(x, scale, offset, is_training=True)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, x)

    cf = step.get_concrete_function(tf.TensorSpec([2, 4, 4, 3]))
    view = GraphView(cf.graph.as_graph_def(add_shapes=True).node)
    pair = {"FusedBatchNormV3": "_MklNativeFusedBatchNormV3",
            "FusedBatchNormGradV3": "_MklNativeFusedBatchNormGradV3"}
    matches, declined = find_onednn(view, PlainTarget("cpu", (OneDnnKernels(pair),)))
    assert sorted(m.op for m in matches) == sorted(pair.values()) and declined == []
    alone = {"FusedBatchNormV3": "_MklNativeFusedBatchNormV3"}  # no gradient kernel
    matches, declined = find_onednn(view, PlainTarget("cpu", (OneDnnKernels(alone),)))
    assert matches == []
    assert declined == ["FusedBatchNormV3: its forward/gradient partner stays on Eigen"]


def _conv_bias_relu(shape):
    w = tf.Variable(tf.random.normal([3, 3, shape[-1], 8], seed=5, stddev=0.2))
    b = tf.Variable(tf.random.normal([8], seed=6))
    _ALIVE.extend([w, b])

    @tf.function(autograph=False)
    def f(x):
        return tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, w, 1, "SAME"), b))

    cf = f.get_concrete_function(tf.TensorSpec(shape))
    res = _on_cpu(cf, ["contraction", "onednn"])
    return cf, res


@RUNS_HERE
@pytest.mark.parametrize("shape", [[16, 32, 32, 4], [None, 16, 16, 4], [2, 8, 8, 4]])
def test_forward_fused_convolution_runs_on_onednn_and_matches_eigen(shape):
    cf, res = _conv_bias_relu(shape)
    ops = [n.op for n in res.graph_def.node]
    assert "_MklNativeFusedConv2D" in ops and "_FusedConv2D" not in ops
    x = tf.random.normal([shape[0] or 4, *shape[1:]], seed=7)
    want, got = cf(x).numpy(), rebuild(cf, res.graph_def)(x).numpy()
    assert_within_rounding(got, want, 3 * 3 * 4 + 1, what="conv")  # the window, the bias


def _attention_step(shape=(2, 4, 16, 8)):
    """Scores, softmax and context, as an attention block's core, and their gradients."""

    @tf.function(autograph=False)
    def step(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            scores = tf.matmul(q, k, transpose_b=True)  # BatchMatMulV2, adj_y
            context = tf.matmul(tf.nn.softmax(scores), v)
            loss = tf.reduce_sum(context * context)
        return tape.gradient(loss, [q, k, v])

    spec = tf.TensorSpec(shape)
    return step.get_concrete_function(spec, spec, spec)


def test_attention_batch_matmuls_and_softmax_are_found():
    cf = _attention_step()
    view = GraphView(cf.graph.as_graph_def(add_shapes=True).node)
    matches, declined = find_onednn(view, _Target())
    found = sorted((m.node.op, m.op) for m in matches)
    # scores and context, each with two gradient BatchMatMulV2s; one softmax
    assert found == sorted([("BatchMatMulV2", "_MklBatchMatMulV2")] * 6
                           + [("Softmax", "_MklSoftmax")])
    assert declined == []
    chooser = _Chooser(keep_eigen="Softmax")
    matches, declined = find_onednn(view, _Target(), chooser)
    assert len(matches) == 6
    assert declined == ["Softmax 2x4x16x16: left on Eigen: measured faster"]
    assert ("onednn", "BatchMatMulV2 2x4x16x8 2x4x16x8 adj_x=False adj_y=True", "eigen",
            ["eigen", "onednn"]) in chooser.asked


@RUNS_HERE
def test_attention_core_and_its_gradients_run_on_onednn_and_match_eigen():
    cf = _attention_step()
    res = _on_cpu(cf)
    ops = [n.op for n in res.graph_def.node]
    assert ops.count("_MklBatchMatMulV2") == 6 and ops.count("_MklSoftmax") == 1
    assert not {"BatchMatMulV2", "Softmax"} & set(ops)
    q, k, v = (tf.random.normal([2, 4, 16, 8], seed=s) for s in (11, 12, 13))
    # scores: 8 terms; softmax: exp, a 16-term sum, a division (TRANSCENDENTAL + 16 + 1);
    # context: 16 terms; the loss's 2 c (1). The gradients go back through the context (16
    # terms), softmax's (p * (g - sum(p g)): 16 + 3) and the scores (16 terms for dq and dk).
    forward = 8 + TRANSCENDENTAL + 17 + 16 + 1
    back = 16 + 19 + 16
    for want, got, name in zip(cf(q, k, v), rebuild(cf, res.graph_def)(q, k, v), "qkv"):
        assert_within_rounding(got.numpy(), want.numpy(), forward + back, what=f"d{name}")


@RUNS_HERE
@pytest.mark.parametrize("chain", sorted(onednn.FUSED_MATMUL_ONEDNN_CHAINS))
def test_every_fused_matmul_chain_runs_on_onednn_and_matches_eigen(chain):
    w = tf.Variable(tf.random.normal([24, 16], seed=8, stddev=0.3))
    b = tf.Variable(tf.random.normal([16], seed=9))
    _ALIVE.extend([w, b])
    activation = {"Relu": tf.nn.relu, "Relu6": tf.nn.relu6, "Elu": tf.nn.elu,
                  "LeakyRelu": lambda t: tf.nn.leaky_relu(t, 0.3), "Tanh": tf.tanh,
                  "Sigmoid": tf.sigmoid}.get(chain[-1], tf.identity)

    @tf.function(autograph=False)
    def f(x):
        return activation(tf.nn.bias_add(tf.matmul(x, w), b))

    cf = f.get_concrete_function(tf.TensorSpec([None, 24]))
    res = _on_cpu(cf, ["contraction", "onednn"])
    fused = [n for n in res.graph_def.node if n.op == "_MklNativeFusedMatMul"]
    assert len(fused) == 1 and "_FusedMatMul" not in [n.op for n in res.graph_def.node]
    assert tuple(s.decode() for s in fused[0].attr["fused_ops"].list.s) == chain
    x = tf.random.normal([32, 24], seed=10)
    want, got = cf(x).numpy(), rebuild(cf, res.graph_def)(x).numpy()
    terms = 24 + 1 + ACTIVATION_ROUNDINGS[chain[-1] if len(chain) > 1 else None]
    assert_within_rounding(got, want, terms, what="+".join(chain))


def _depthwise_pool_step():
    """A depthwise convolution, average pooling and a transpose, and the input's and the
    filter's gradients."""
    w = tf.Variable(tf.random.normal([3, 3, 4, 2], seed=14, stddev=0.3))
    _ALIVE.append(w)

    @tf.function(autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.nn.depthwise_conv2d(x, w, [1, 1, 1, 1], "SAME")  # 8 channels
            y = tf.nn.avg_pool2d(y, 2, 2, "VALID")
            y = tf.transpose(y, [0, 3, 1, 2])
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [x, w])

    return step.get_concrete_function(tf.TensorSpec([2, 8, 8, 4]))


DEPTHWISE_POOL = {"DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput",
                  "DepthwiseConv2dNativeBackpropFilter", "AvgPool", "AvgPoolGrad", "Transpose"}


def test_depthwise_pooling_and_transposes_are_found_with_their_shapes():
    cf = _depthwise_pool_step()
    view = GraphView(cf.graph.as_graph_def(add_shapes=True).node)
    matches, declined = find_onednn(view, _Target())
    # the forward transpose and its gradient's (the inverse permutation)
    assert sorted(m.node.op for m in matches) == sorted([*DEPTHWISE_POOL, "Transpose"])
    assert all(m.op == RETARGETS[m.node.op] for m in matches) and declined == []
    chooser = _Chooser(keep_eigen="Transpose")
    find_onednn(view, _Target(), chooser)
    signatures = sorted(sig for _, sig, _, _ in chooser.asked)
    assert "Transpose 2x4x4x8 4 perm=0,3,1,2" in signatures
    # the gradient's: the inverse of the forward's, read through its InvertPermutation
    assert "Transpose 2x8x4x4 4 perm=0,2,3,1" in signatures
    assert "AvgPool 2x8x8x8 ksize=1,2,2,1 strides=1,2,2,1 padding=VALID" in signatures


@RUNS_HERE
def test_depthwise_pooling_and_transposes_run_on_onednn_and_match_eigen():
    cf = _depthwise_pool_step()
    res = _on_cpu(cf)
    ops = [n.op for n in res.graph_def.node]
    assert not DEPTHWISE_POOL & set(ops)
    assert {RETARGETS[op] for op in DEPTHWISE_POOL} <= set(ops)
    x = tf.random.normal([2, 8, 8, 4], seed=15)
    # y: 9-term windows; the pool's 4-term mean (+ the division); the loss's 2 y (1). dx: the
    # pool's gradient (1), 9 terms back through the depthwise filter; dw: 2 x 8 x 8 = 128
    # terms.
    forward = 9 + 5 + 1
    (want_x, want_w), (got_x, got_w) = cf(x), rebuild(cf, res.graph_def)(x)
    assert_within_rounding(got_x.numpy(), want_x.numpy(), forward + 1 + 9, what="dx")
    assert_within_rounding(got_w.numpy(), want_w.numpy(), forward + 1 + 128, what="dw")


def _max_pool_step():
    """Two max pools (the second reads the first's output, overlapping windows) and the input's
    gradient; and the same forward without a tape."""

    def forward(x):
        y = tf.nn.max_pool2d(x, 2, 2, "VALID")
        return y, tf.nn.max_pool2d(y, 3, 1, "SAME")

    @tf.function(autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            _, z = forward(x)
            loss = tf.reduce_sum(z * z)
        return tape.gradient(loss, x)

    spec = tf.TensorSpec([2, 8, 8, 4])
    return (step.get_concrete_function(spec),
            tf.function(forward, autograph=False).get_concrete_function(spec))


def test_max_pool_moves_with_its_gradient_or_stays():
    """oneDNN's gradient reads the forward's workspace: each MaxPool is one match with the
    MaxPoolGrad that reads it as its forward (not the one that reads its output as its own
    input), a decision at its shapes with that gradient; a forward alone is a match too."""
    step, forward = _max_pool_step()
    view = GraphView(step.graph.as_graph_def(add_shapes=True).node)
    matches, declined = find_onednn(view, _Target())
    assert declined == [] and sorted(m.node.op for m in matches) == ["MaxPool", "MaxPool"]
    for m in matches:
        (gradient,) = m.gradients
        assert gradient.op == "MaxPoolGrad" and gradient.input[1] == m.node.name
    chooser = _Chooser()
    find_onednn(view, _Target(), chooser)
    assert sorted(sig for _, sig, _, _ in chooser.asked) == [
        "MaxPool 2x4x4x4 ksize=1,3,3,1 strides=1,1,1,1 padding=SAME with its gradient",
        "MaxPool 2x8x8x4 ksize=1,2,2,1 strides=1,2,2,1 padding=VALID with its gradient"]
    alone, _ = find_onednn(GraphView(forward.graph.as_graph_def(add_shapes=True).node),
                           _Target())
    assert [m.gradients for m in alone] == [(), ()]
    no_gradient_kernel = PlainTarget("cpu", (OneDnnKernels({"MaxPool": "_MklNativeMaxPool"}),))
    matches, declined = find_onednn(view, no_gradient_kernel)
    assert matches == [] and declined == [
        "MaxPool: this build has no oneDNN kernel of its gradient"] * 2


@RUNS_HERE
def test_max_pool_runs_on_onednn_with_its_workspace_and_matches_eigen():
    step, forward = _max_pool_step()
    res = _on_cpu(step)
    nodes = {n.name: n for n in res.graph_def.node}
    pools = [n for n in nodes.values() if n.op == "_MklNativeMaxPool"]
    grads = [n for n in nodes.values() if n.op == "_MklNativeMaxPoolGrad"]
    assert len(pools) == 2 and len(grads) == 2
    assert not {"MaxPool", "MaxPoolGrad"} & {n.op for n in nodes.values()}
    for g in grads:  # the forward's workspace as the fourth input
        forward_name = g.input[1].split(":")[0]
        assert g.input[3] == f"{forward_name}:1" and g.attr["workspace_enabled"].b
        assert nodes[forward_name].attr["workspace_enabled"].b
    x = tf.random.normal([2, 8, 8, 4], seed=16)
    want, got = step(x), rebuild(step, res.graph_def)(x)
    # each input's gradient: the sum of the 2 z dy of the (up to 9) overlapping windows whose
    # maximum it is, in either kernel's order
    assert_within_rounding(got.numpy(), want.numpy(), 9 + 1, what="dx")
    res = _on_cpu(forward)  # no gradient: no workspace
    (pool, _) = [n for n in res.graph_def.node if n.op == "_MklNativeMaxPool"]
    assert not pool.attr["workspace_enabled"].b
    for a, b in zip(forward(x), rebuild(forward, res.graph_def)(x)):
        np.testing.assert_array_equal(b.numpy(), a.numpy())  # a selection: exact


@REGISTERED
def test_a_max_pool_pair_is_timed_as_one_fragment_with_its_workspace():
    """The tuner times a MaxPool with its gradient: the pair cut as one fragment, rewritten
    (the workspace a second output, declared in its output shapes) and run on both kernels."""
    from fusion.fragment import cut, make_inputs, runner, variant
    from fusion.graphs.onednn import rewrite_onednn

    step, _ = _max_pool_step()
    view = GraphView(step.graph.as_graph_def(add_shapes=True).node)
    matches, _ = find_onednn(view, _Target())
    for match in matches:
        names = [match.node.name, *(g.name for g in match.gradients)]
        piece = cut(view, names)
        moved = variant(piece, lambda v, m=match: rewrite_onednn(v, m))
        pool = next(n for n in moved.graph_def.node if n.op == "_MklNativeMaxPool")
        assert len(pool.attr["_output_shapes"].list.shape) == 2
        inputs = make_inputs(piece, copies=2)
        for a, b in zip(runner(piece, inputs)(), runner(moved, inputs)()):
            # a gradient sums the incoming gradients of up to 9 overlapping windows
            assert_within_rounding(b.numpy(), a.numpy(), 9, what=match.node.name)


def _volume_einsum_step():
    """A 3-D convolution, 3-D average pooling and an attention-like Einsum, with the input's
    and the filter's gradients (the Einsum's are Einsums too)."""
    w = tf.Variable(tf.random.normal([3, 3, 3, 2, 4], seed=17, stddev=0.3))
    _ALIVE.append(w)

    @tf.function(autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.nn.conv3d(x, w, [1, 1, 1, 1, 1], "SAME")  # [2, 4, 6, 6, 4]
            y = tf.nn.avg_pool3d(y, 2, 2, "VALID")  # [2, 2, 3, 3, 4]
            y = tf.reshape(y, [2, 2, 9, 4])
            y = tf.einsum("btnh,bsnh->bnts", y, y * 0.5)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [x, w])

    return step.get_concrete_function(tf.TensorSpec([2, 4, 6, 6, 2]))


VOLUME_EINSUM = {"Conv3D", "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2", "AvgPool3D",
                 "AvgPool3DGrad", "Einsum"}


def test_volume_convolution_pooling_and_einsum_are_found_with_their_shapes():
    cf = _volume_einsum_step()
    view = GraphView(cf.graph.as_graph_def(add_shapes=True).node)
    matches, declined = find_onednn(view, _Target())
    assert {m.node.op for m in matches} == VOLUME_EINSUM and declined == []
    assert all(m.op == RETARGETS[m.node.op] for m in matches)
    chooser = _Chooser()
    find_onednn(view, _Target(), chooser)
    signatures = {sig for _, sig, _, _ in chooser.asked}
    assert "Conv3D 2x4x6x6x2 3x3x3x2x4 strides=1,1,1,1,1 padding=SAME" in signatures
    assert "AvgPool3D 2x4x6x6x4 ksize=1,2,2,2,1 strides=1,2,2,2,1 padding=VALID" in signatures
    # each Einsum's equation is part of what its decision depends on
    assert "Einsum 2x2x9x4 2x2x9x4 btnh,bsnh->bnts" in signatures
    assert sum(sig.startswith("Einsum") for sig in signatures) >= 2  # and its gradients'


def test_an_einsum_of_one_or_three_operands_stays_on_eigen():
    """(tf.einsum splits a longer one into pairs; a GraphDef may still hold one.)"""
    from tensorflow.core.framework.node_def_pb2 import NodeDef

    nodes = [NodeDef(name=n, op="Placeholder") for n in "abc"]
    for name, equation, inputs in (("one", "ij->ji", ["a"]),
                                   ("three", "ij,jk,kl->il", ["a", "b", "c"])):
        node = NodeDef(name=name, op="Einsum", input=inputs)
        node.attr["equation"].s = equation.encode()
        node.attr["N"].i = len(inputs)
        node.attr["T"].type = tf.float32.as_datatype_enum
        nodes.append(node)
    matches, declined = find_onednn(GraphView(nodes), _Target())
    assert matches == [] and sorted(declined) == [
        "Einsum of 1 operands: only two go to oneDNN",
        "Einsum of 3 operands: only two go to oneDNN"]


@RUNS_HERE
def test_volume_convolution_pooling_and_einsum_run_on_onednn_and_match_eigen():
    cf = _volume_einsum_step()
    res = _on_cpu(cf)
    ops = {n.op for n in res.graph_def.node}
    assert not VOLUME_EINSUM & ops and {RETARGETS[op] for op in VOLUME_EINSUM} <= ops
    x = tf.random.normal([2, 4, 6, 6, 2], seed=18)
    # y: 27 x 2 = 54-term windows, the pool's 8-term mean (+ the division), the Einsum's 4
    # terms, the loss's 2 y (1). dx: back through the Einsum (9 + 9 terms, both operands),
    # the pool's gradient (1), 54 terms back through the filter; dw: 2 x 4 x 6 x 6 = 288.
    forward = 54 + 9 + 4 + 1
    (want_x, want_w), (got_x, got_w) = cf(x), rebuild(cf, res.graph_def)(x)
    assert_within_rounding(got_x.numpy(), want_x.numpy(), forward + 18 + 1 + 54, what="dx")
    assert_within_rounding(got_w.numpy(), want_w.numpy(), forward + 18 + 1 + 288, what="dw")


@RUNS_HERE
def test_max_pool_gradient_on_onednn_is_exact_at_a_larger_shape():
    """Non-overlapping windows: each input's gradient is its window's one incoming gradient or
    0 on either kernel, bit for bit (oneDNN's 3-D max pool gradient is not, at such a size:
    MaxPool3D is not retargeted)."""

    @tf.function(autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.nn.max_pool2d(x, 2, 2, "VALID")
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, x)

    cf = step.get_concrete_function(tf.TensorSpec([8, 32, 32, 16]))
    res = _on_cpu(cf)
    assert "_MklNativeMaxPoolGrad" in {n.op for n in res.graph_def.node}
    x = tf.random.normal([8, 32, 32, 16], seed=19)
    np.testing.assert_array_equal(rebuild(cf, res.graph_def)(x).numpy(), cf(x).numpy())
