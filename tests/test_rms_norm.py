"""The rms_norm stage: RMS norms written with keras.ops (keras_hub's decoders, users' layers),
matched from the traced ops of rsqrt's or reciprocal(sqrt)'s argument."""

from __future__ import annotations

import keras
import numpy as np
import optional
import pytest
import tensorflow as tf
from helpers import (
    TRANSCENDENTAL,
    PickForm,
    StageExample,
    assert_models_within_rounding,
    assert_no_further_from_float32,
    assert_within_rounding,
    failing,
    fit_float32_reference,
    fit_stock_and_tfmx,
    no_further_terms,
    nodes_that_ran,
    ops_that_ran,
)

import tfmx
from fusion import private_api
from fusion.calls import rms_norm as stage
from fusion.stage import XLA

# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")


class UserRMSNorm(keras.layers.Layer):
    """An RMS norm as a user writes it with keras.ops: ``way`` says how it squares and roots,
    ``axis`` and ``keepdims`` what it averages."""

    def __init__(self, way: str = "square rsqrt", axis: int = -1, keepdims: bool = True,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.way, self.axis, self.keepdims = way, axis, keepdims

    def build(self, shape) -> None:
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        squared = {"square": keras.ops.square, "power": lambda v: keras.ops.power(v, 2),
                   "mul": lambda v: v * v}[self.way.split()[0]](x)
        var = keras.ops.mean(squared, axis=self.axis, keepdims=self.keepdims) + 1e-5
        inv = (keras.ops.rsqrt(var) if self.way.endswith("rsqrt")
               else keras.ops.reciprocal(keras.ops.sqrt(var)))
        if not self.keepdims:
            inv = keras.ops.expand_dims(inv, self.axis)
        return x * inv * self.scale


def _stage_example() -> keras.Model:
    inp = keras.Input((6, 8))
    x = UserRMSNorm()(keras.layers.Dense(8)(inp))
    return keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(x)))


STAGE_EXAMPLE = StageExample(_stage_example, lacking="Rsqrt")
"""This family's model in the stage-safety tests (tests/test_stage_safety.py)."""


def _terms(cols: int) -> int:
    """Roundings on the longest path of one normalized value and its gradient: the mean of
    ``cols`` squares and the gradient's sum over them (either side's), the root, a few
    products."""
    return 2 * (2 * cols + TRANSCENDENTAL + 6)


WAYS = ("square rsqrt", "power rsqrt", "mul rsqrt", "square reciprocal")


def _normalized_and_gradient(fn, x: tf.Tensor) -> list[np.ndarray]:
    """``fn(x)`` and the gradient of a loss weighing every element differently (float64),
    traced as a step is."""
    @tf.function(autograph=False)
    def step(x):
        w = tf.sin(tf.reshape(tf.range(tf.size(x), dtype=tf.float32), x.shape))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * w)
        return y, tape.gradient(loss, x)

    return [tf.cast(t, tf.float64).numpy() for t in step(x)]


def _traced(way: str):
    """``run(x, fused)``: ``x * inv`` as UserRMSNorm(way) computes it with keras.ops (no
    scale), its root Keras's or (``fused``) the closed form of the statistic :func:`stage.find`
    reads from the traced ops; and the statistic found."""
    keras_math = private_api.get("keras.backend_math")
    keras_numpy = private_api.get("keras.backend_numpy")

    layer = UserRMSNorm(way)

    def run(x, fused: bool):
        found = {}
        real = {stage.RSQRT: keras_math.rsqrt, stage.RECIPROCAL_SQRT: keras_numpy.reciprocal}

        def hooked(root):
            def call(arg):
                found["it"] = it = stage.find(arg, root)
                return stage.rms_statistic(it.x, it.epsilon, it.dtype) if fused else real[
                    root](arg)
            return call

        keras_math.rsqrt = hooked(stage.RSQRT)
        keras_numpy.reciprocal = hooked(stage.RECIPROCAL_SQRT)
        try:
            layer.scale = tf.ones([x.shape[-1]], x.dtype)
            return layer.call(x), found["it"]
        finally:
            keras_math.rsqrt, keras_numpy.reciprocal = real[stage.RSQRT], real[
                stage.RECIPROCAL_SQRT]

    return run


@pytest.mark.parametrize("way", WAYS)
def test_each_way_is_found_and_its_closed_form_matches_keras(way):
    run = _traced(way)
    x = tf.constant(np.random.default_rng(0).standard_normal((4, 6, 16)) * 3 + 1, tf.float32)
    graph = tf.Graph()
    with graph.as_default():
        stat = run(tf.compat.v1.placeholder(tf.float32, [4, 6, 16]), False)[1]
    assert isinstance(stat, stage.Statistic), stat
    assert stat.square == {"square": "Square", "power": "Pow", "mul": "Mul"}[way.split()[0]]
    assert stat.root == (stage.RSQRT if way.endswith("rsqrt") else stage.RECIPROCAL_SQRT)
    assert not stat.widened and stat.dtype == tf.float32
    got = _normalized_and_gradient(lambda v: run(v, True)[0], x)
    want = _normalized_and_gradient(lambda v: run(v, False)[0], x)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_within_rounding(g, w, _terms(16), what=f"output {i}")


def _keras_mean_ops(dtype: str) -> list[str]:
    """The op types keras.ops.mean of a ``dtype`` tensor traces (its reduction as the installed
    Keras writes it)."""
    graph = tf.Graph()
    with graph.as_default():
        keras.ops.mean(tf.compat.v1.placeholder(dtype, [2, 3]), axis=-1, keepdims=True)
    return [op.type for op in graph.get_operations()]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_input_is_found_as_keras_computes_its_mean(dtype):
    """The statistic of a 16-bit square is found as keras.ops.mean traces it. Where the mean
    sums in float32 between two casts (Keras 3.15): found widened, and the closed form (float32
    inside, the statistic rounded once to ``dtype``) gives ``x * inv`` within two roundings of
    ``dtype`` of the float32 composite at the same 16-bit values, its gradient (whose products
    and sums autodiff of ``x * inv`` computes in ``dtype``) within the gradient's roundings of
    it. Where the mean is a plain 16-bit Mean: found not widened. Where it is the call of a
    function of its own compiled by XLA (Keras 3.16's float16 mean): found compiled, and the
    closed form within two roundings of the float32 composite as where widened (XLA's float16
    mean sums in float32). A found one's closed form is within the gradient's roundings of the
    16-bit composite."""
    run = _traced("power rsqrt")
    x = tf.cast(np.random.default_rng(0).standard_normal((4, 6, 16)) * 3 + 1, dtype)
    graph = tf.Graph()
    with graph.as_default():
        stat = run(tf.compat.v1.placeholder(dtype, [4, 6, 16]), False)[1]
    ops = _keras_mean_ops(dtype)
    compiled = "Mean" not in ops
    assert compiled == ("PartitionedCall" in ops or "StatefulPartitionedCall" in ops), ops
    assert stat.compiled == compiled and stat.dtype == tf.as_dtype(dtype), (ops, stat)
    assert stat.widened == ("Cast" in ops), (ops, stat)
    widened = stat.widened or compiled
    got = _normalized_and_gradient(lambda v: run(v, True)[0], x)
    wide = _normalized_and_gradient(lambda v: run(tf.cast(v, tf.float32), False)[0], x)
    want = _normalized_and_gradient(lambda v: run(v, False)[0], x)
    for i, (g, w, s) in enumerate(zip(got, wide, want)):
        if widened:
            terms = 2 if i == 0 else _terms(16)
            assert_within_rounding(g, w, terms, dtype=dtype, what=f"output {i} (float32)")
        assert_within_rounding(g, s, _terms(16), dtype=dtype, what=f"output {i} ({dtype})")


def _find_in_graph(make, shape=(2, 3, 4), dtype=tf.float32):
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(dtype, shape)
        return make(x)


@pytest.mark.parametrize("make,why", [
    (lambda x: keras.ops.mean(x * x, axis=1, keepdims=True) + 1e-6,
     "normalized axes [1] are not the last axis alone"),
    (lambda x: keras.ops.mean(x * x, axis=-1) + 1e-6, "mean without keepdims"),
    (lambda x: keras.ops.mean(x * x, axis=(1, 2), keepdims=True) + 1e-6,
     "normalized axes [1, 2] are not the last axis alone"),
])
def test_declines_other_axes_and_no_keepdims_with_a_reason(make, why):
    assert why in _find_in_graph(lambda x: stage.find(make(x), stage.RSQRT))


def test_declines_float64_and_an_unknown_rank():
    def stat(x):
        return stage.find(keras.ops.mean(keras.ops.square(x), -1, keepdims=True) + 1e-6,
                          stage.RSQRT)

    assert _find_in_graph(stat, dtype=tf.float64) == "input dtype float64"
    assert _find_in_graph(stat, shape=None) == "input of unknown rank"
    assert isinstance(_find_in_graph(stat, shape=(None, None, 4)), stage.Statistic)


@pytest.mark.parametrize("make", [
    lambda x: tf.nn.moments(x, [-1], keepdims=True)[1] + 1e-3,  # a layer norm's centred variance
    lambda x: tf.reduce_sum(x * x, -1, keepdims=True) + 1e-6,  # an L2 norm
    lambda x: keras.ops.mean(x * x, -1, keepdims=True) + tf.ones([1]),  # eps not a scalar const
    lambda x: keras.ops.mean(keras.ops.power(x, 3), -1, keepdims=True) + 1e-6,
    lambda x: x + 1.0,
])
def test_other_statistics_are_not_rms_norms(make):
    assert _find_in_graph(lambda x: stage.find(make(x), stage.RSQRT)) is None
    assert _find_in_graph(lambda x: stage.find(tf.sqrt(make(x)), stage.RECIPROCAL_SQRT)) is None


# -- keras_hub's decoders and a user's layer, trained ----------------------------------------------
def _hub_model(name: str):
    """A tiny keras_hub backbone on 8 tokens, compiled for MSE (optional.tiny_decoder)."""
    return optional.tiny_decoder(name)


def _user_model():
    def build() -> keras.Model:
        keras.utils.set_random_seed(0)
        inp = keras.Input((6, 8))
        x = keras.layers.Dense(16)(inp)
        x = UserRMSNorm("power rsqrt")(x)
        x = keras.layers.Dense(16, activation="gelu")(x)
        x = UserRMSNorm("square reciprocal")(x)
        x = keras.layers.RMSNormalization()(x)  # keras.ops.rms_normalization's composite
        model = keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(x)))
        model.compile(keras.optimizers.SGD(0.05), "mse")
        return model

    rng = np.random.default_rng(1)
    return build, rng.standard_normal((16, 6, 8)).astype("float32") * 2, rng.standard_normal(
        (16, 4)).astype("float32")


MODELS = {"llama": (lambda: _hub_model("llama"), 5), "gemma3": (lambda: _hub_model("gemma3"), 9),
          "user": (_user_model, 3)}
"""Each model, and its RMS norms: Llama's two per layer (before attention, before the
feed-forward) and the final one; Gemma3's two per layer, its per-head query and key norms and
the final one; the user's two layers and Keras's RMSNormalization."""
# 4 steps of a tiny decoder: every weight's update goes through the 32-wide norms, the
# attention's and the feed-forward's sums, whose roundings the norms' gradients carry
FIT_TERMS = 4 * 400


def _assert_fused(models: dict, form: str, count: int) -> None:
    stats = tfmx.report().patterns["rms_norm"]
    label = stage.FORMS[form].label
    assert stats.fused == count and stats.fused_kinds == {label: count}, stats.as_dict()
    assert not stats.declined and stats.observed[label] >= count, stats.as_dict()
    scope = f"/{stage.FORMS.scope_of(stage.FORMS[form])}/"
    marks = stage.FORMS[form].marks
    nodes = nodes_that_ran(models[True].train_function)
    assert sum(n.op in marks and scope in n.name for n in nodes) >= count, (form, marks)


@pytest.mark.parametrize("name,form", [*((name, "custom") for name in sorted(MODELS)),
                                       ("llama", XLA), ("user", XLA)])
def test_fit_matches_stock_with_the_form_in_the_graph_that_ran(monkeypatch, name, form):
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, "rms_norm", strict=True))
    make, count = MODELS[name]
    build, x, y = make()
    models, initial = fit_stock_and_tfmx(build, x, y, ["rms_norm"])
    _assert_fused(models, form, count)
    if form == "custom" and name == "llama":  # the closed form: no autodiff of Rsqrt left
        assert "RsqrtGrad" in ops_that_ran(models[False].train_function)
        assert "RsqrtGrad" not in ops_that_ran(models[True].train_function)
    losses = [models[on].history.history["loss"] for on in (False, True)]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    assert_models_within_rounding(models[False], models[True], initial, FIT_TERMS)


@pytest.mark.parametrize("policy,name,form", [
    *(("mixed_bfloat16", name, "custom") for name in sorted(MODELS)),
    ("mixed_bfloat16", "user", XLA), ("mixed_float16", "user", "custom")])
def test_mixed_precision_fit_is_no_further_from_float32_than_stock(monkeypatch, policy, name,
                                                                   form):
    """keras_hub casts to float32 inside its norms (the statistic float32 as in a float32
    fit); Keras's RMSNormalization under a mixed policy too; the user's layer works on the
    16-bit tensor, its mean summed in float32 by keras.ops.mean (between two casts, or for
    float16 under Keras 3.16 in a function of its own compiled by XLA): found either way, the
    closed form computes the statistic in float32 and rounds it once to the 16-bit dtype (the
    XLA region computes Keras's composite, its mean as keras.ops.mean does)."""
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, "rms_norm", strict=True))
    make, count = MODELS[name]
    build, x, y = make()
    keras.mixed_precision.set_global_policy(policy)
    try:
        models, initial = fit_stock_and_tfmx(build, x, y, ["rms_norm"])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    _assert_fused(models, form, count)
    reference = fit_float32_reference(build, x, y)
    assert_no_further_from_float32(reference, models[False], models[True], initial,
                                   no_further_terms(4, extra=2), dtype=policy.split("_")[1])


HUB_NORMS = {  # keras_hub 0.32's RMS norm layers: module, class, constructor arguments
    "llama": ("llama.llama_layernorm", "LlamaLayerNorm", {}),
    "mistral": ("mistral.mistral_layer_norm", "MistralLayerNormalization", {}),
    "mixtral": ("mixtral.mixtral_layer_norm", "MixtralLayerNormalization", {}),
    "qwen": ("qwen.qwen_layernorm", "QwenLayerNorm", {}),
    "qwen_moe": ("qwen_moe.qwen_moe_layernorm", "QwenMoeLayerNorm", {}),
    "qwen3 per head": ("qwen3.qwen3_layernorm", "Qwen3LayerNorm", {"head_dim": 8}),
    "phi3": ("phi3.phi3_layernorm", "Phi3LayerNorm", {}),
    "gpt_oss": ("gpt_oss.gpt_oss_layer_norm", "GptOssLayerNormalization", {}),
    "t5": ("t5.t5_layer_norm", "T5LayerNorm", {}),
    "gemma": ("gemma.rms_normalization", "RMSNormalization", {}),
    "gemma3 per head": ("gemma3.gemma3_layers", "RMSNormalization", {}),
}


def hub_norm_case(name: str):
    """``(build, x, y)``: one of keras_hub's RMS norm layers (:data:`HUB_NORMS`) between two
    Dense layers, on a per-head tensor [batch, tokens, heads, head dim] (the query and key
    norms' shape; the others normalize the last axis alike); the calling test skipped where
    keras_hub is unavailable."""
    import importlib

    optional.keras_hub()
    module, cls, kwargs = HUB_NORMS[name]
    norm = getattr(importlib.import_module(f"keras_hub.src.models.{module}"), cls)

    def build() -> keras.Model:
        keras.utils.set_random_seed(0)
        inp = keras.Input((3, 2, 8))
        x = norm(**kwargs)(keras.layers.Dense(8)(inp))
        model = keras.Model(inp, keras.layers.Dense(4)(keras.layers.Flatten()(x)))
        model.compile(keras.optimizers.SGD(0.05), "mse")
        return model

    rng = np.random.default_rng(1)
    return build, rng.standard_normal((16, 3, 2, 8)).astype("float32"), rng.standard_normal(
        (16, 4))


@pytest.mark.parametrize("name", sorted(HUB_NORMS))
def test_every_keras_hub_rms_norm_is_found_and_trains_as_stock(monkeypatch, name):
    """Each of keras_hub's own RMS norm layers (:func:`hub_norm_case`): fused once with the
    closed form, the fit within rounding of stock's."""
    build, x, y = hub_norm_case(name)
    models, initial = fit_stock_and_tfmx(build, x, y, ["rms_norm"])
    _assert_fused(models, "custom", 1)
    assert_models_within_rounding(models[False], models[True], initial, 4 * (_terms(8) + 48))


def test_a_failing_stage_on_llama_trains_as_stock(monkeypatch):
    """The failure raised after the form was emitted (its ops in the graph, unread): each of
    Llama's five norms keeps Keras's ops, the error reported, and the fit is stock's bit for
    bit."""
    build, x, y = _hub_model("llama")
    failing(monkeypatch.setattr, "rms_norm", "emit")
    models = {}
    for on in (False, True):
        tfmx.enable(backend="cpu", patterns=["rms_norm"], guard=False,
                    strict=False) if on else tfmx.disable()
        models[on] = build()
        models[on].fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    stats = tfmx.report().patterns["rms_norm"]
    assert stats.fused == 0 and len(stats.errors) == 5 and "injected failure" in stats.errors[0]
    assert not [n for n in nodes_that_ran(models[True].train_function)
                if "tfmx_rms_norm" in n.name and n.op != "NoOp"]
    for a, b in zip(models[False].weights, models[True].weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


@pytest.mark.parametrize("layer,why", [
    (UserRMSNorm(axis=1), "normalized axes [1] are not the last axis alone of a rank-3 input"),
    (UserRMSNorm(keepdims=False), "mean without keepdims"),
])
def test_a_fit_keeps_keras_ops_where_it_declines_with_the_reason_reported(layer, why):
    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 8))
    model = keras.Model(inp, keras.layers.Dense(4)(keras.layers.Flatten()(layer(inp))))
    model.compile(keras.optimizers.SGD(0.05), "mse")
    tfmx.enable(backend="cpu", patterns=["rms_norm"], guard=False)
    rng = np.random.default_rng(0)
    model.fit(rng.standard_normal((8, 6, 8)), rng.standard_normal((8, 4)), verbose=0)
    stats = tfmx.report().patterns["rms_norm"]
    assert stats.fused == 0 and any(why in reason for reason in stats.declined), stats.as_dict()
    assert not [n for n in nodes_that_ran(model.train_function) if "tfmx_rms_norm" in n.name]


@pytest.mark.parametrize("plugin", ["tensorflow-metal", "tensorflow-metal-plugin"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_metal_plan_runs_the_closed_form_on_ops_the_plugin_has(plugin, dtype):
    """Under each Metal plugin (a plan: nothing here ran on a Mac) the closed form is
    offered for float32 and float16 inputs, every op of its forward and gradient has a kernel
    in that plugin's table in the dtype it runs in, and the XLA region is never offered."""
    from fusion.forms import runnable_forms
    from fusion.stage import StageContext
    from tfmx.backends import get_backend
    from tfmx.placement import FOLLOWERS

    metal = get_backend("metal", plugin=plugin)
    assert metal.capability(stage.RmsNormForms).forms == ("custom",)  # the declared plan
    assert get_backend("cpu").capability(stage.RmsNormForms).forms == ("custom", XLA)
    assert not StageContext(metal).xla
    assert runnable_forms(metal, [stage.CUSTOM], dtype) == ([stage.CUSTOM], None)

    @tf.function(autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            with tf.name_scope("form"):
                inv = stage.rms_statistic(x, 1e-6, x.dtype)
            y = x * inv
        return y, tape.gradient(y, x)

    # the form's ops, forward and gradient (named under its scope); what moves no data
    # (IdentityN: a custom gradient's) follows its input wherever it is
    graph = step.get_concrete_function(tf.TensorSpec([4, 8], dtype)).graph
    ops = {(op.type, op.outputs[0].dtype.name) for op in graph.get_operations()
           if "form/" in op.name and op.outputs and op.type not in FOLLOWERS | {"Const"}}
    assert ("Rsqrt", "float32") in ops
    missing = {(op, d) for op, d in ops if not metal.runs_op(op, d)}
    assert not missing, (plugin, missing)


def test_inference_keeps_keras_call():
    build, x, _ = _user_model()
    model = build()
    want = model(x).numpy()
    tfmx.enable(backend="cpu", patterns=["rms_norm"], guard=False)
    np.testing.assert_allclose(model.predict(x, verbose=0), want, rtol=1e-5, atol=1e-6)
    stats = tfmx.report().patterns.get("rms_norm")
    assert stats is None or not stats.fused
