"""The onednn family: convolutions retargeted to TensorFlow's bundled oneDNN kernels."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import ops_that_ran

import fusion
import tfmx
from fusion.graph import GraphView
from fusion.patterns.onednn import KERNEL_LABEL, RETARGETS, find_onednn
from tfmx.backends import get_backend, onednn_enabled, onednn_kernels_registered
from tfmx.rebuild import protected_names, rebuild

CONVOLUTIONS = {op: new for op, new in RETARGETS.items() if op.startswith("Conv2D")}
RUNS_HERE = pytest.mark.skipif(
    onednn_enabled() or not onednn_kernels_registered(),
    reason="needs oneDNN's kernels registered and oneDNN's own graph pass off",
)


class _Target:
    """A backend that retargets every convolution (the matcher does not need a real one)."""

    name = "test"
    onednn_ops = dict(RETARGETS)


@pytest.fixture(autouse=True)
def _clean():
    tfmx.disable()
    yield
    tfmx.disable()


_ALIVE: list[tf.Variable] = []  # a traced function holds its variables weakly


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
        assert get_backend(name).onednn_ops == {}
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
    for want, got in zip(cf(x), rebuild(cf, res.graph_def)(x)):
        want, got = want.numpy(), got.numpy()
        assert np.max(np.abs(want - got)) <= 1e-5 * np.max(np.abs(want))


@pytest.mark.parametrize(("m", "k", "n", "transpose_b", "to_onednn"), [
    (256, 256, 256, False, True),  # 2^24 multiply-adds: oneDNN measured faster up to here
    (256, 512, 512, False, False),  # 2^26, every dimension >= 128: Eigen measured faster
    (256, 512, 512, True, True),  # transpose_b: oneDNN faster at every size measured
    (3200, 32, 512, False, True),  # tall and thin: oneDNN faster
    (None, 1024, 1024, False, True),  # an unknown batch counts as 32: thin
    (128, 1024, 1024, False, False),
])
def test_large_matmuls_without_transpose_b_stay_on_eigen(m, k, n, transpose_b, to_onednn):
    b_shape = [n, k] if transpose_b else [k, n]
    g = tf.function(lambda a, b: tf.matmul(a, b, transpose_b=transpose_b)).get_concrete_function(
        tf.TensorSpec([m, k]), tf.TensorSpec(b_shape)).graph.as_graph_def(add_shapes=True)
    matches, declined = find_onednn(GraphView(g.node), _Target())
    assert bool(matches) == to_onednn
    if not to_onednn:
        assert declined and "Eigen measured faster" in declined[0]


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
    res = fusion.rewrite(cf.graph.as_graph_def(add_shapes=True), get_backend("cpu"), ["onednn"],
                         protected_names(cf))
    ops = [n.op for n in res.graph_def.node]
    assert ops.count("_MklMatMul") == 3 and "MatMul" not in ops  # forward and both gradients
    x = tf.random.normal([4, 8], seed=4)
    for want, got in zip(cf(x), rebuild(cf, res.graph_def)(x)):
        want, got = want.numpy(), got.numpy()
        assert np.max(np.abs(want - got)) <= 1e-5 * np.max(np.abs(want))


@RUNS_HERE
def test_keras_cnn_trains_like_stock_with_onednn_convolutions():
    def train(fused: bool):
        if fused:
            tfmx.enable(backend="cpu")
        keras.utils.set_random_seed(0)
        inp = keras.Input((12, 12, 3))
        x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inp)
        x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
        x = keras.layers.Conv2D(8, 3, strides=2, padding="same", activation="relu")(x)
        out = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(x))
        model = keras.Model(inp, out)
        model.compile(keras.optimizers.SGD(0.05), "mse")
        rng = np.random.default_rng(0)
        x_data = rng.random((40, 12, 12, 3), dtype=np.float32)
        y_data = rng.random((40, 3), dtype=np.float32)
        model.fit(x_data, y_data, batch_size=8, epochs=1, shuffle=False, verbose=0)
        report = tfmx.report().to_dict()["patterns"]["onednn"] if fused else None
        predictions = model.predict(x_data, verbose=0)
        return ([v.numpy() for v in model.weights] + [predictions],
                ops_that_ran(model.train_function), report)

    stock, _, _ = train(False)
    fused, ran, report = train(True)
    assert {"_MklNativeConv2D", "_MklNativeConv2DBackpropFilter",
            "_MklNativeConv2DBackpropInput", "_MklMatMul", "_MklNativeFusedBatchNormV3",
            "_MklNativeFusedBatchNormGradV3"} <= ran
    assert not {"FusedBatchNormV3", "FusedBatchNormGradV3", "Conv2DBackpropFilter"} & ran
    assert report["fused_kinds"]["Conv2DBackpropFilter -> _MklNativeConv2DBackpropFilter"] == 2
    for a, b in zip(stock, fused):
        assert np.max(np.abs(a - b)) <= 1e-5 * max(np.max(np.abs(a)), 1e-6)


def test_only_x86_64_cpus_retarget(monkeypatch):
    from tfmx import backends

    monkeypatch.setattr(backends.platform, "machine", lambda: "aarch64")
    backends.onednn_kernels_registered.cache_clear()
    try:
        assert not onednn_kernels_registered()
        assert get_backend("cpu").onednn_ops == {}
    finally:
        monkeypatch.undo()
        backends.onednn_kernels_registered.cache_clear()


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
    matches, declined = find_onednn(view, type("T", (), {"onednn_ops": pair})())
    assert sorted(m.op for m in matches) == sorted(pair.values()) and declined == []
    alone = {"FusedBatchNormV3": "_MklNativeFusedBatchNormV3"}  # no gradient kernel
    matches, declined = find_onednn(view, type("T", (), {"onednn_ops": alone})())
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
    res = fusion.rewrite(cf.graph.as_graph_def(add_shapes=True), get_backend("cpu"),
                         ["contraction", "onednn"], protected_names(cf))
    return cf, res


@RUNS_HERE
@pytest.mark.parametrize(("shape", "to_onednn"), [
    ([16, 32, 32, 4], True),  # 16,384 output pixels: oneDNN measured faster
    ([None, 16, 16, 4], True),  # an unknown batch counts as 32: 8,192
    ([2, 8, 8, 4], False),  # 128: Eigen measured faster
])
def test_forward_fused_convolution_goes_to_onednn_where_it_pays(shape, to_onednn):
    cf, res = _conv_bias_relu(shape)
    ops = [n.op for n in res.graph_def.node]
    if not to_onednn:
        assert "_FusedConv2D" in ops
        assert any("output pixels" in why for why in res.stats["onednn"].declined)
        return
    assert "_MklNativeFusedConv2D" in ops and "_FusedConv2D" not in ops
    x = tf.random.normal([shape[0] or 4, *shape[1:]], seed=7)
    want, got = cf(x).numpy(), rebuild(cf, res.graph_def)(x).numpy()
    assert np.max(np.abs(want - got)) <= 1e-5 * np.max(np.abs(want))
