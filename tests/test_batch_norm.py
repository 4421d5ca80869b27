"""Batch norm: Keras 3 BatchNormalization trains through FusedBatchNormV3 / FusedBatchNormGradV3.

Parity: a few training steps stock vs tfmx from identical weights (weights, moving statistics and
predictions within the float32 rounding of the run, assert_parity) for every supported
configuration; the graph that ran
has the fused ops and none of the composite ones; declines keep training stock; the Metal plan
uses only kernels of the plugin's list.
"""

from __future__ import annotations

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    TRANSCENDENTAL,
    StageExample,
    assert_within_rounding,
    exact_patterns,
    float_tolerance,
    needs_onednn,
    traced_graphs,
)

import fusion
import tfmx
from fusion.calls import batch_norm as batch_norm_stage
from fusion.graph import GraphView, op_histogram
from fusion.graphs import batch_norm
from fusion.graphs.batch_norm import find_batch_norm, kernel_blocker
from tfmx.backends import get_backend, metal_kernels
from tfmx.rebuild import protected_names

# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")


def _stage_example() -> keras.Model:
    inp = keras.Input((6, 6, 3))
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(keras.layers.Conv2D(4, 3)(inp)))
    return keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(x)))


STAGE_EXAMPLE = StageExample(_stage_example, lacking="FusedBatchNormV3")
"""This family's model in the stage-safety tests (tests/test_stage_safety.py)."""

COMPOSITE = ("StopGradient", "Rsqrt")  # only the composite batch norm emits these


def _moments_ops() -> collections.Counter:
    """The ops the installed TensorFlow's ``tf.nn.moments`` emits (2.21: two Means and a
    SquaredDifference; 2.22: three Means, Square, Sub and a Maximum)."""
    fn = tf.function(lambda x: tf.nn.moments(x, [0]), autograph=False)
    graph = fn.get_concrete_function(tf.TensorSpec([2, 3])).graph.as_graph_def()
    return collections.Counter(n.op for n in graph.node)


MOMENTS = _moments_ops()
VARIANCE_OP = "SquaredDifference" if MOMENTS["SquaredDifference"] else "Maximum"


@pytest.fixture(autouse=True)
def _restore():
    yield
    keras.mixed_precision.set_global_policy("float32")


# -- models -----------------------------------------------------------------------------------
SHAPES = {"conv": (8, 8, 3), "dense": (6,), "channels_first": (4, 5, 5), "sequence": (5, 4),
          "embedding": (5,), "volume": (3, 4, 4, 4)}


def build(kind: str, bn: dict | None = None, policy: str | None = None, frozen: bool = False,
          residual: bool = True) -> keras.Model:
    if policy:
        keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    layer = keras.layers.BatchNormalization(**(bn or {}))
    inp = keras.Input(SHAPES[kind], dtype="int32" if kind == "embedding" else "float32")
    if kind == "conv":
        x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inp)
        y = layer(x)
        x = keras.layers.ReLU()(keras.layers.Add()([y, x]) if residual else y)
        x = keras.layers.GlobalAveragePooling2D()(x)
    elif kind == "dense":
        x = keras.layers.ReLU()(layer(keras.layers.Dense(8)(inp)))
    elif kind == "embedding":
        x = layer(keras.layers.Embedding(10, 4, mask_zero=True)(inp))
        x = keras.layers.GlobalAveragePooling1D()(x)
    else:
        x = keras.layers.Flatten()(layer(inp))
    if frozen:
        layer.trainable = False
    out = keras.layers.Dense(3, dtype="float32")(x)
    model = keras.Model(inp, out)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def data(kind: str, n: int = 32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    if kind == "embedding":
        x = rng.integers(0, 10, (n,) + SHAPES[kind]).astype(np.int32)
    else:
        x = rng.random((n,) + SHAPES[kind], dtype=np.float32) * 3.0 + 1.0
    return x, rng.random((n, 3), dtype=np.float32)


def train_ops(model: keras.Model) -> collections.Counter:
    """Op counts of one traced step: per op, the most any one graph the train step traced
    holds (with its function library). Keras 3.16 calls its one-step function outside a loop
    and traces it again for a last, smaller batch: two graphs of the same step."""
    counts: collections.Counter = collections.Counter()
    for graph in traced_graphs(model.train_function):
        counts |= collections.Counter(
            [n.op for n in graph.node] + [n.op for f in graph.library.function for n in f.node_def])
    return counts


def run(enable: bool, kind: str, **kwargs) -> dict:
    if enable:
        tfmx.enable(backend="cpu", patterns=exact_patterns())
    model = build(kind, **kwargs)
    x, y = data(kind)
    snapshots = [[v.numpy() for v in model.weights]]
    record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: snapshots.append(
        [v.numpy() for v in model.weights]))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[record])
    # per tensor, elementwise: how far the steps moved it in all (the sum of |each step|)
    travel = [sum(np.abs(b - a) for a, b in zip(t, t[1:])) for t in zip(*snapshots)]
    out = {"weights": [v.numpy() for v in model.weights], "names": [v.path for v in model.weights],
           "travel": travel, "kind": kind, "steps": len(snapshots) - 1,
           "predict": model.predict(x, verbose=0), "ops": train_ops(model),
           "report": tfmx.report().to_dict()["patterns"].get("batch_norm") if enable else None}
    tfmx.disable()
    return out


# Per model kind, the sums of one training step (batch 8): P, the positions the batch norm's
# statistics average over (the mean, the variance, and in the backward the means of dy and of
# dy * x_hat: 4 sums over P on the longest path); G, the positions the first layer's weight
# gradient sums over; F, the forward's other sums (convolution window, pooling, the Dense layers,
# the loss's mean).
SUMS = {
    "conv": dict(P=8 * 8 * 8, G=8 * 8 * 8, F=27 + 64 + 8 + 24),
    "dense": dict(P=8, G=8, F=6 + 8 + 24),
    "channels_first": dict(P=8 * 5 * 5, G=8, F=100 + 24),
    "sequence": dict(P=8 * 5, G=8, F=20 + 24),
    "volume": dict(P=8 * 3 * 4 * 4, G=8, F=192 + 24),
    "embedding": dict(P=8 * 5, G=8, F=5 + 4 + 24),
}
ELEMENTWISE = 50  # one step's elementwise ops on the longest path, forward and backward


def assert_parity(stock: dict, fused: dict, low: str | None = None) -> None:
    """Each weight and moving statistic, and the predictions, within the float32 rounding of
    the run (helpers.float_tolerance): per step 4P + G + F + ELEMENTWISE roundings (SUMS), times
    the steps; predict adds one forward. A Dense bias right before batch norm has a zero
    gradient in exact arithmetic: it moves by rounding alone, of terms on the scale of its
    layer's kernel's steps (their sum of |step|), which is its scale. 16-bit activations
    (``low``): the kernel and the composite round x, y, dy and dx to 16 bit at different points
    (from equal inputs the forward agrees to one ulp: test_half_kernels_...), so each step's
    update may be off by 4 roundings in ``low`` of itself: on the scale of the sum of |step|
    (weights), and the forward's in ``low`` (predict)."""
    sums = SUMS[stock["kind"]]
    steps = stock["steps"]
    per_step = 4 * sums["P"] + sums["G"] + sums["F"] + ELEMENTWISE
    names = stock["names"]
    for i, (name, a, b, travel) in enumerate(zip(names, stock["weights"], fused["weights"],
                                                 stock["travel"])):
        scale, moved = float(np.max(np.abs(a))), float(np.max(travel))
        if stock["kind"] == "dense" and i == 1:  # Dense(8)'s bias, before the batch norm
            scale = moved = float(np.max(stock["travel"][0]))
        tol = float_tolerance("float32", steps * per_step, scale)
        if low:
            tol += float_tolerance(low, 4, moved)
        diff = float(np.max(np.abs(np.asarray(b, np.float64) - a)))
        assert diff <= tol, f"{name}: max diff {diff:.3g} > {tol:.3g}"
    terms = steps * per_step + sums["F"] + ELEMENTWISE
    want = stock["predict"]
    tol = float_tolerance("float32", terms, np.max(np.abs(want)))
    if low:
        tol += float_tolerance(low, 4 + sums["F"], np.max(np.abs(want)))
    diff = float(np.max(np.abs(fused["predict"].astype(np.float64) - want)))
    assert diff <= tol, f"predict: max diff {diff:.3g} > {tol:.3g}"


CONFIGS = {
    "conv_nhwc": dict(kind="conv"),
    "dense_2d": dict(kind="dense"),
    "center_false": dict(kind="conv", bn=dict(center=False)),
    "scale_false": dict(kind="dense", bn=dict(scale=False)),
    "no_center_no_scale": dict(kind="dense", bn=dict(center=False, scale=False)),
    "momentum_epsilon": dict(kind="conv", bn=dict(momentum=0.5, epsilon=0.01)),
    "mixed_bfloat16": dict(kind="conv", policy="mixed_bfloat16"),
    "mixed_float16": dict(kind="dense", policy="mixed_float16", bn=dict(momentum=0.5)),
    "channels_first_4d": dict(kind="channels_first", bn=dict(axis=1, momentum=0.0)),
    "sequence_3d": dict(kind="sequence", bn=dict(momentum=0.3)),
    "volume_5d": dict(kind="volume", bn=dict(momentum=0.5)),
}


@needs_onednn("either")  # TensorFlow's own kernels differ with the state
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_training_parity_and_fused_ops_ran(config):
    kwargs = CONFIGS[config]
    stock = run(False, **kwargs)
    fused = run(True, **kwargs)
    policy = kwargs.get("policy")
    assert_parity(stock, fused, low=policy and policy.replace("mixed_", ""))
    ops = fused["ops"]
    assert ops["FusedBatchNormV3"] >= 1 and ops["FusedBatchNormGradV3"] >= 1
    for op in COMPOSITE:
        assert stock["ops"][op] >= 1 and ops[op] == 0, op
    assert stock["ops"][VARIANCE_OP] > ops[VARIANCE_OP]  # the variance's own op gone
    assert stock["ops"]["Mean"] - ops["Mean"] == MOMENTS["Mean"]  # the moments' Means
    dtype = (kwargs.get("policy") or "float32").replace("mixed_", "")
    assert fused["report"]["fused_kinds"][f"FusedBatchNormV3(training, {dtype})"] >= 1
    assert not fused["report"]["errors"]


def _moments_222(x, axes, shift=None, keepdims=False, name=None):
    """TensorFlow 2.22's ``tf.nn.moments``: with ``d = x - stop_gradient(mean)``, the variance
    ``max(mean(d^2) - mean(d)^2, 0)``."""
    mean = tf.reduce_mean(x, axes, keepdims=True)
    d = tf.subtract(x, tf.stop_gradient(mean))
    variance = tf.maximum(tf.reduce_mean(tf.square(d), axes, keepdims=True)
                          - tf.square(tf.reduce_mean(d, axes, keepdims=True)),
                          tf.cast(0, x.dtype))
    if not keepdims:
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
    return mean, variance


@needs_onednn("either")
def test_tensorflow_2_22s_moments_are_fused_too(monkeypatch):
    """TensorFlow 2.22 writes the batch variance in a shifted form (Sub, Square, Mean, Maximum
    where 2.21 has SquaredDifference): Keras's batch norm over it is fused the same way."""
    monkeypatch.setattr(tf.nn, "moments", _moments_222)
    stock = run(False, **CONFIGS["conv_nhwc"])
    fused = run(True, **CONFIGS["conv_nhwc"])
    assert_parity(stock, fused)
    assert stock["ops"]["Maximum"] > fused["ops"]["Maximum"]  # the variance's clamp gone
    assert stock["ops"]["StopGradient"] >= 1 and fused["ops"]["StopGradient"] == 0
    assert fused["ops"]["FusedBatchNormV3"] >= 1 and fused["ops"]["FusedBatchNormGradV3"] >= 1
    assert fused["report"]["fused_kinds"]["FusedBatchNormV3(training, float32)"] >= 1


@pytest.mark.parametrize("kind, wrong", [
    ("conv", dict(momentum=0.98)), ("conv", dict(epsilon=2e-3)), ("dense", dict(epsilon=1.1e-3)),
])
def test_parity_tolerance_catches_a_wrong_batch_norm(kind, wrong):
    """The rounding tolerance is not vacuous: a stock run whose batch norm has another momentum
    (0.98 for 0.99) or epsilon (2x, or 10% off) is outside it."""
    with pytest.raises(AssertionError, match="max diff"):
        assert_parity(run(False, kind), run(False, kind, bn=wrong))


def test_frozen_layer_under_the_tape_runs_inference_kernel():
    stock = run(False, kind="dense", frozen=True)
    fused = run(True, kind="dense", frozen=True)
    assert_parity(stock, fused)
    assert fused["ops"]["FusedBatchNormV3"] >= 1 and fused["ops"]["FusedBatchNormGradV3"] >= 1
    assert fused["ops"]["Rsqrt"] == 0
    assert fused["report"]["fused_kinds"]["FusedBatchNormV3(inference, float32)"] >= 1


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
@pytest.mark.parametrize("training", [False, True])
def test_half_kernels_equal_keras_float32_composite_to_one_ulp(dtype, training):
    """What the 16-bit rewrite relies on: T=half/bfloat16 with float32 statistics gives Keras's
    cast-to-float32, normalize, cast-back, up to a rare last-place flip (float32 rounding)."""
    rng = np.random.default_rng(0)
    x = tf.cast(rng.standard_normal((64, 1, 1, 8)) * 3 + 1, dtype)
    xf = tf.cast(x, tf.float32)
    g, b, m = (tf.constant(rng.standard_normal(8), tf.float32) for _ in range(3))
    v = tf.constant(rng.random(8) + 0.5, tf.float32)
    if training:
        m, v = tf.nn.moments(xf, [0, 1, 2])
    expected = tf.cast(tf.nn.batch_normalization(xf, m, v, b, g, 1e-3), dtype)
    empty = tf.zeros([0])
    got = tf.raw_ops.FusedBatchNormV3(x=x, scale=g, offset=b, mean=empty if training else m,
                                      variance=empty if training else v, epsilon=1e-3,
                                      is_training=training)[0]
    got, expected = (tf.cast(t, tf.float32).numpy() for t in (got, expected))
    ulp = 2.0 ** (-10 if dtype == tf.float16 else -7)
    np.testing.assert_allclose(got, expected, rtol=ulp, atol=0)
    assert np.mean(got != expected) < 0.01


def test_moving_statistics_are_keras_biased_ones():
    """momentum=0: after one step the moving statistics are that batch's own (biased) moments."""
    tfmx.enable(backend="cpu", patterns=exact_patterns())
    model = build("dense", bn=dict(momentum=0.0))
    x, y = data("dense", n=8)
    dense, bn = model.layers[1], model.layers[2]
    h = x @ dense.kernel.numpy() + dense.bias.numpy()  # what the step's batch norm sees
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    # h: 6 terms and the bias; the mean: 8 terms and a division; the variance: x - mean,
    # its square, 8 terms and a division, on the squares' scale.
    assert_within_rounding(bn.moving_mean.numpy(), h.mean(0), 7 + 9, scale=np.abs(h).max(),
                           what="mean")
    assert_within_rounding(bn.moving_variance.numpy(), h.var(0), 7 + 9 + 11,  # not ddof=1
                           scale=((h - h.mean(0)) ** 2).max(), what="var")
    assert tfmx.report().fused("batch_norm") >= 1


def test_predict_and_evaluate_use_the_inference_kernel():
    model = build("dense")
    x, y = data("dense")
    stock = model.predict(x, verbose=0), model.evaluate(x, y, verbose=0)
    tfmx.enable(backend="cpu", patterns=exact_patterns())
    fused = model.predict(x, verbose=0), model.evaluate(x, y, verbose=0)
    # the Dense (6 terms), the batch norm on the moving statistics, the Dense (8 terms) and
    # the elementwise ops; evaluate adds the loss's mean over 32 x 3 values
    forward = SUMS["dense"]["F"] + ELEMENTWISE
    assert_within_rounding(fused[0], stock[0], forward, what="predict")
    assert_within_rounding(fused[1], stock[1], forward + 96, what="evaluate")
    traces = {t.function: t for t in tfmx.report().traces}
    after = traces["Functional.predict_step"].ops_after
    assert after["FusedBatchNormV3"] == 1 and after["Rsqrt"] == 0


# -- declines ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, bn, reason", [
    ("embedding", {}, "a mask"),
    ("dense", {"synchronized": True}, "synchronized=True"),
    ("dense", {"renorm": True}, "renorm=True"),
    ("conv", {"axis": 2}, "channel axis 2 of a rank-4 input"),
])
def test_declines_keep_training_stock(kind, bn, reason):
    stock = run(False, kind, bn=bn)
    fused = run(True, kind, bn=bn)
    assert_parity(stock, fused)
    assert fused["ops"]["FusedBatchNormV3"] == 0
    assert any(reason in why for why in fused["report"]["declined"]), fused["report"]


def test_virtual_batch_size_is_declined():
    """Keras 3 has no ghost batch norm; a layer that carries tf.keras's attribute is declined."""
    tfmx.enable(backend="cpu", patterns=exact_patterns())
    model = build("dense")
    model.layers[2].virtual_batch_size = 4
    model.fit(*data("dense"), batch_size=8, epochs=1, verbose=0)
    assert train_ops(model)["FusedBatchNormV3"] == 0
    assert any("virtual_batch_size" in why
               for why in tfmx.report().patterns["batch_norm"].declined)


@pytest.mark.filterwarnings("ignore::tfmx.errors.TfmxWarning")
def test_a_failing_forward_stage_falls_back_to_stock(monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("forward stage exploded")

    monkeypatch.setattr(batch_norm_stage, "_rewrite", boom)
    stock = run(False, "conv")
    fused = run(True, "conv")
    assert_parity(stock, fused)
    assert fused["ops"]["FusedBatchNormV3"] == 0 and fused["ops"]["StopGradient"] >= 1
    assert any("forward stage exploded" in e for e in fused["report"]["errors"])


@pytest.mark.parametrize("wrong", [False, True])
def test_verify_checks_the_forward_stage_against_keras(monkeypatch, wrong):
    """verify=True compares with Keras's own composite, not with the batch-norm forward stage
    (only batch_norm runs: the graph rewrite itself changes nothing here)."""
    original = batch_norm.rewrite_batch_norm

    def off_epsilon(view, match):
        fused = original(view, match)
        fused.attr["epsilon"].f *= 1000.0
        return fused

    if wrong:
        monkeypatch.setattr(batch_norm, "rewrite_batch_norm", off_epsilon)
    tfmx.enable(backend="cpu", patterns=["batch_norm"], verify=True)
    model = build("conv", residual=False)
    model.optimizer.build(model.trainable_variables)
    before = [v.numpy() for v in model.weights]
    x, y = data("conv")
    if not wrong:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        assert train_ops(model)["FusedBatchNormV3"] >= 1
        return
    with pytest.raises(tfmx.VerificationError, match="largest difference"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.weights))


def test_patterns_without_batch_norm_leave_it_alone():
    tfmx.enable(backend="cpu", patterns=["contraction"])
    model = build("conv")
    model.fit(*data("conv"), batch_size=8, epochs=1, verbose=0)
    assert train_ops(model)["FusedBatchNormV3"] == 0


def test_custom_training_loop_with_tfmx_function():
    model = build("conv")
    x, y = data("conv", n=8)
    opt = keras.optimizers.SGD(0.1)

    @tfmx.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    tfmx.enable(backend="cpu", patterns=exact_patterns())
    step(x, y)
    ops = set(op_histogram(step.get_concrete_function(x, y).graph.as_graph_def()))
    assert "FusedBatchNormGradV3" in ops and "StopGradient" not in ops


def test_tfmx_function_under_an_outer_tape_gets_the_forward_stage():
    model = build("conv")
    x, y = data("conv", n=8)
    forward_fn = tfmx.function(lambda x: model(x, training=True))
    with tf.GradientTape() as tape:
        stock_loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
    stock_grads = tape.gradient(stock_loss, model.trainable_variables)
    # (gradients in training mode do not depend on the moving statistics just updated)
    tfmx.enable(backend="cpu", patterns=exact_patterns())
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((forward_fn(x) - y) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    sums = SUMS["conv"]  # one step's gradients (assert_parity)
    for i, (a, b) in enumerate(zip(stock_grads, grads)):
        assert_within_rounding(b, a, 4 * sums["P"] + sums["G"] + sums["F"] + ELEMENTWISE,
                               what=f"gradient {i}")
    assert tfmx.report().fused("batch_norm") >= 1


def test_post_gradient_training_composite_is_declined_with_the_reason():
    model = build("dense")
    model.optimizer.build(model.trainable_variables)
    concrete = tf.function(model.train_step, autograph=False).get_concrete_function(
        tuple(tf.constant(a[:8]) for a in data("dense")))
    g = concrete.graph.as_graph_def(add_shapes=True)
    matches, declined = find_batch_norm(GraphView(g.node, protected_names(concrete)),
                                        get_backend("cpu"))
    assert not matches
    assert any("fused before differentiation" in d for d in declined), declined


# -- _FusedBatchNormEx and the Metal plan -------------------------------------------------------
def _inference_graph(policy: str, channels: int = 8):
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    inp = keras.Input((4, 4, channels))
    y = keras.layers.BatchNormalization()(inp)
    out = keras.layers.ReLU()(keras.layers.Add()([y, inp]))
    model = keras.Model(inp, out)
    dtype = keras.mixed_precision.global_policy().compute_dtype
    concrete = tf.function(lambda x: model(x, training=False), autograph=False) \
        .get_concrete_function(tf.TensorSpec([None, 4, 4, channels], dtype))
    return concrete, concrete.graph.as_graph_def(add_shapes=True)


@pytest.mark.parametrize("backend, policy, expect", [
    ("metal", "mixed_float16", None),
    ("cuda", "float32", None),
    ("metal", "float32", "takes float16"),
    ("cpu", "float32", "produces no output"),
])
def test_batch_norm_add_relu_becomes_fused_batch_norm_ex_where_it_runs(backend, policy, expect):
    concrete, g = _inference_graph(policy)
    result = fusion.rewrite(g, get_backend(backend), ["batch_norm"], protected_names(concrete))
    ops = collections.Counter(n.op for n in result.graph_def.node)
    stats = result.stats["batch_norm"]
    if expect is None:
        assert ops["_FusedBatchNormEx"] == 1 and ops["Relu"] == 0 and ops["FusedBatchNormV3"] == 0
        ex = next(n for n in result.graph_def.node if n.op == "_FusedBatchNormEx")
        assert ex.attr["activation_mode"].s == b"Relu" and ex.attr["num_side_inputs"].i == 1
        assert not ex.attr["is_training"].b
    else:
        assert ops["_FusedBatchNormEx"] == 0 and ops["FusedBatchNormV3"] == 1
        assert any(expect in why for why in stats.declined), stats.declined
    assert not result.errors


def test_batch_norm_ex_numbers_match_on_cpu_with_the_inference_kernel():
    """The CPU runs no _FusedBatchNormEx; the FusedBatchNormV3 it gets instead is exact."""
    concrete, g = _inference_graph("float32")
    result = fusion.rewrite(g, get_backend("cpu"), ["batch_norm"], protected_names(concrete))
    x = tf.random.stateless_normal([2, 4, 4, 8], seed=[1, 2])
    from tfmx.rebuild import rebuild

    # Keras's composite (x - mean) * rsqrt(variance + epsilon) * gamma + beta (rsqrt: a few
    # ulps) against the kernel, then the Add
    assert_within_rounding(rebuild(concrete, result.graph_def)(x), concrete(x),
                           5 + TRANSCENDENTAL + 1)


def test_metal_training_plan_uses_only_plugin_kernels():
    stock_model = build("conv")
    stock_model.fit(*data("conv", n=8), batch_size=8, verbose=0)
    stock_ops = set(train_ops(stock_model))
    tfmx.enable(backend="metal")
    model = build("conv", bn=dict(momentum=0.5))
    with pytest.raises(tfmx.BackendUnavailableError):
        model.fit(*data("conv", n=8), batch_size=8, verbose=0)
    trace = next(t for t in tfmx.report().traces if t.function.endswith("train_step"))
    plan = trace.graph_after
    ops = collections.Counter(n.op for n in plan.node)
    for fdef in plan.library.function:
        ops.update(n.op for n in fdef.node_def)
    assert ops["FusedBatchNormV3"] == 1 and ops["FusedBatchNormGradV3"] == 1
    assert not any(ops[op] for op in COMPOSITE)
    kernels = metal_kernels()
    new_ops = set(ops) - stock_ops
    assert new_ops and new_ops <= kernels, new_ops - kernels
    declined = tfmx.report().patterns["batch_norm"].declined
    assert any("_FusedBatchNormGradEx" in why for why in declined), declined


def test_backend_batch_norm_tables():
    kernels = metal_kernels()
    for op in ("FusedBatchNormV3", "FusedBatchNormGradV3", "_FusedBatchNormEx"):
        assert op in kernels
    cpu, metal = get_backend("cpu"), get_backend("metal")
    assert kernel_blocker(cpu, "FusedBatchNormV3", "bfloat16", "NCHW") is None
    assert "no FusedBatchNormV3 kernel for float64" in kernel_blocker(
        cpu, "FusedBatchNormV3", "float64", "NHWC")
    assert kernel_blocker(metal, "_FusedBatchNormEx", "float16", "NHWC", False, 8) is None
    assert "channels % 4" in kernel_blocker(metal, "_FusedBatchNormEx", "float16", "NHWC",
                                            False, 6)
    assert "epsilon" in kernel_blocker(get_backend("cuda"), "FusedBatchNormV3", "float32",
                                       "NHWC", epsilon=1e-6)


def test_cpu_fused_batch_norm_ex_really_has_no_working_kernel():
    """Keeps the cpu table honest: the op is registered, its CPU kernel yields nothing."""
    concrete, g = _inference_graph("float32")
    result = fusion.rewrite(g, get_backend("cuda"), ["batch_norm"], protected_names(concrete))
    from tfmx.rebuild import rebuild

    fn = rebuild(concrete, result.graph_def)
    with pytest.raises((tf.errors.InternalError, tf.errors.InvalidArgumentError)):
        fn(tf.ones([2, 4, 4, 8]))


@pytest.mark.parametrize("layer, shape", [
    (lambda: keras.layers.LayerNormalization(), (None, 6, 8)),
    (lambda: keras.layers.LayerNormalization(axis=[1, 2]), (None, 6, 8)),
    (lambda: keras.layers.GroupNormalization(groups=2), (None, 4, 4, 8)),
    (lambda: keras.layers.UnitNormalization(), (None, 8)),
])
@pytest.mark.parametrize("training", [True, False])
def test_other_normalizations_are_not_mistaken_for_batch_norm(layer, shape, training):
    layer = layer()
    layer.build(shape)
    g = tf.function(lambda x: layer(x, training=training), autograph=False) \
        .get_concrete_function(tf.TensorSpec(shape)).graph.as_graph_def(add_shapes=True)
    assert find_batch_norm(GraphView(g.node), get_backend("cpu")) == ([], [])
