"""The scaled_rms_norm stage: a whole RMS norm, its statistic, normalized product and scale
joined from the traced calls, trained with both gradients in closed form or as XLA regions."""

from __future__ import annotations

import keras
import numpy as np
import optional
import pytest
import tensorflow as tf
from helpers import (
    TRANSCENDENTAL,
    PickForm,
    assert_models_within_rounding,
    assert_no_further_from_float32,
    assert_within_rounding,
    failing,
    fit_float32_reference,
    fit_stock_and_tfmx,
    no_further_terms,
    nodes_that_ran,
    value_and_gradients,
)
from test_rms_norm import HUB_NORMS, UserRMSNorm, hub_norm_case
from test_rms_norm import STAGE_EXAMPLE as rms_example

import tfmx
from fusion.calls import rms_norm
from fusion.calls import scaled_rms_norm as stage
from fusion.stage import XLA

# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")


STAGE_EXAMPLE = rms_example
"""This family's model in the stage-safety tests (tests/test_stage_safety.py): the rms_norm
family's, a user's RMS norm with its scale."""


def _terms(cols: int) -> int:
    """Roundings on the longest path of one output and its gradients: the mean of ``cols``
    squares and the gradient's mean over them (either side's), the root, a few products."""
    return 2 * (2 * cols + TRANSCENDENTAL + 8)


def _stock(x: tf.Tensor, s: tf.Tensor) -> tf.Tensor:
    return x * tf.math.rsqrt(tf.reduce_mean(tf.pow(x, 2.0), -1, keepdims=True) + 1e-6) * s


@pytest.mark.parametrize("form", ["custom", XLA])
@pytest.mark.parametrize("shape", [(4, 6, 32), (3, 5, 2, 16)])
def test_each_form_matches_autodiff_of_the_composite(form, shape):
    """Value and both gradients, the scale's summed over every axis but the last (a per-head
    norm's four-axis input too), within rounding of autodiff's."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal(shape).astype("float32") * 3)
    s = tf.constant(rng.standard_normal(shape[-1:]).astype("float32"))
    fn = {"custom": stage.scaled_custom, XLA: stage.scaled_xla}[form]
    got = value_and_gradients(lambda a, b: fn(a, b, 1e-6), x, s)
    want = value_and_gradients(_stock, x, s)
    batch = int(np.prod(shape[:-1]))
    for g, w, terms in zip(got, want, (_terms(shape[-1]), _terms(shape[-1]),
                                       _terms(shape[-1]) + batch)):
        assert_within_rounding(g, w, terms)


MODELS = {"llama": (lambda: optional.tiny_decoder("llama"), 5),
          "gemma3": (lambda: optional.tiny_decoder("gemma3"), 9)}
"""Each keras_hub model and its whole norms: Llama's two per layer and the final one; Gemma3's
two per layer (its ``1 + scale``), its per-head query and key norms and the final one."""
FIT_TERMS = 4 * 400  # as the rms_norm stage's fits: 4 steps through 32-wide norms


def _assert_fused(model, form: str, count: int) -> None:
    stats = tfmx.report().patterns[stage.FAMILY]
    label = stage.FORMS[form].label
    assert stats.fused == count and stats.fused_kinds == {label: count}, stats.as_dict()
    assert not stats.declined and stats.observed[label] >= count, stats.as_dict()
    scope = f"/{stage.FORMS.scope_of(stage.FORMS[form])}/"
    nodes = nodes_that_ran(model.train_function)
    assert sum(n.op in stage.FORMS[form].marks and scope in n.name for n in nodes) >= count
    # the statistic's own ops were taken out with the normalized product
    assert not [n for n in nodes if "tfmx_rms_norm" in n.name and n.op != "NoOp"]


@pytest.mark.parametrize("name,form", [("llama", "custom"), ("gemma3", "custom"),
                                       ("llama", XLA)])
def test_fit_matches_stock_with_the_form_in_the_graph_that_ran(monkeypatch, name, form):
    """With the rms_norm stage on too: its statistic is taken into the whole norm, and the
    report says so."""
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, stage.FAMILY, strict=True))
    make, count = MODELS[name]
    build, x, y = make()
    models, initial = fit_stock_and_tfmx(build, x, y, ["rms_norm", stage.FAMILY])
    _assert_fused(models[True], form, count)
    inner = tfmx.report().patterns["rms_norm"]
    assert inner.fused == 0 and sum(inner.declined.values()) == count, inner.as_dict()
    assert all("taken into the whole norm" in reason for reason in inner.declined)
    losses = [models[on].history.history["loss"] for on in (False, True)]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    assert_models_within_rounding(models[False], models[True], initial, FIT_TERMS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_mixed_precision_fit_is_no_further_from_float32_than_stock(monkeypatch, name):
    """keras_hub's norms cast to float32 inside (the whole norm float32 as in a float32 fit,
    its output cast back by the layer) under mixed_bfloat16: taken whole, the fit no further
    from a float32 fit than stock's."""
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm("custom", stage.FAMILY, strict=True))
    make, count = MODELS[name]
    build, x, y = make()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        models, initial = fit_stock_and_tfmx(build, x, y, ["rms_norm", stage.FAMILY])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    _assert_fused(models[True], "custom", count)
    reference = fit_float32_reference(build, x, y)
    assert_no_further_from_float32(reference, models[False], models[True], initial,
                                   no_further_terms(4, extra=2), dtype="bfloat16")


@pytest.mark.parametrize("name", sorted(HUB_NORMS))
def test_every_keras_hub_rms_norm_is_taken_whole_and_trains_as_stock(name):
    """Each of keras_hub's RMS norm layers (``test_rms_norm.hub_norm_case``): taken whole once
    (T5's ``weight * x`` in that order, Gemma's ``1 + scale``), the fit within rounding of
    stock's."""
    build, x, y = hub_norm_case(name)
    models, initial = fit_stock_and_tfmx(build, x, y, [stage.FAMILY])
    _assert_fused(models[True], "custom", 1)
    assert_models_within_rounding(models[False], models[True], initial, 4 * (_terms(8) + 48))


class _ReadTwice(keras.layers.Layer):
    """An RMS norm whose normalized tensor is read by another product before the scale's."""

    def build(self, shape) -> None:
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        inv = keras.ops.rsqrt(keras.ops.mean(keras.ops.square(x), -1, keepdims=True) + 1e-5)
        normalized = x * inv
        half = normalized * 0.5
        return normalized * self.scale + half


class _HalfScale(keras.layers.Layer):
    """An RMS norm on a 16-bit tensor (no cast to float32 first), under mixed_float16."""

    def build(self, shape) -> None:
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", autocast=True)

    def call(self, x):
        return UserRMSNorm.call(self, x)

    way, axis, keepdims = "square rsqrt", -1, True


@pytest.mark.parametrize("layer,why,policy", [
    (_ReadTwice, "the normalized tensor is read by another op too", "float32"),
    (_HalfScale, "a float16 normalized input", "mixed_float16"),
])
def test_a_fit_keeps_keras_calls_where_it_declines_with_the_reason_reported(layer, why, policy):
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        inp = keras.Input((6, 8))
        model = keras.Model(inp, keras.layers.Dense(4)(keras.layers.Flatten()(layer()(inp))))
        model.compile(keras.optimizers.SGD(0.05), "mse")
        tfmx.enable(backend="cpu", patterns=[stage.FAMILY], guard=False)
        rng = np.random.default_rng(0)
        model.fit(rng.standard_normal((8, 6, 8)), rng.standard_normal((8, 4)), verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    stats = tfmx.report().patterns[stage.FAMILY]
    assert stats.fused == 0 and any(why in reason for reason in stats.declined), stats.as_dict()
    assert not [n for n in nodes_that_ran(model.train_function) if stage.SCOPE in n.name]


def test_a_failing_stage_on_llama_trains_as_stock_with_the_statistic_kept(monkeypatch):
    """The failure raised after the whole norm was emitted: each of Llama's five norms keeps
    the step's own calls (the rms_norm stage's statistic among them, counted fused), the error
    reported, and nothing the failed stage emitted runs."""
    build, x, y = optional.tiny_decoder("llama")
    failing(monkeypatch.setattr, stage.FAMILY, "emit")
    models = {}
    for on in (False, True):
        tfmx.enable(backend="cpu", patterns=["rms_norm", stage.FAMILY], guard=False,
                    strict=False) if on else tfmx.disable()
        models[on] = build()
        models[on].fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    report = tfmx.report().patterns
    stats = report[stage.FAMILY]
    assert stats.fused == 0 and len(stats.errors) == 5 and "injected failure" in stats.errors[0]
    assert report["rms_norm"].fused == 5, report["rms_norm"].as_dict()
    assert not [n for n in nodes_that_ran(models[True].train_function)
                if stage.SCOPE in n.name and n.op != "NoOp"]
    initial = [w.numpy() for w in build().weights]
    assert_models_within_rounding(models[False], models[True], initial, FIT_TERMS)


def test_the_conservative_timing_runs_the_statistic_as_its_stage_emitted_it():
    """The tuner's conservative candidate is the step as it runs: the rms_norm stage's closed
    form where that stage emitted it (no ``Square``: its own product), Keras's composite where
    it kept it (the ``Square`` Keras traced)."""
    from fusion.pattern import PatternStats

    x = tf.constant(np.linspace(-2.0, 3.0, 8, dtype="float32").reshape(2, 4))
    found = rms_norm.Statistic(x, 1e-6, "Square", False, rms_norm.RSQRT, tf.float32)
    fused, kept = PatternStats(matched=1), PatternStats(matched=1)
    fused.fuse(rms_norm.CUSTOM.label)
    want = tf.math.rsqrt(tf.reduce_mean(tf.square(x), -1, keepdims=True) + 1e-6)
    for stats, squares in ((fused, False), (kept, True)):
        statistic = stage._statistic_as_emitted(stage.NotedStatistic(found, x, (), [stats]))
        graph = tf.function(statistic, autograph=False).get_concrete_function(x).graph
        assert any(op.type == "Square" for op in graph.get_operations()) == squares
        np.testing.assert_allclose(statistic(x), want, rtol=1e-6)


@pytest.mark.parametrize("plugin", ["tensorflow-metal", "tensorflow-metal-plugin"])
def test_the_metal_plan_runs_the_closed_form_on_ops_the_plugin_has(plugin):
    """Under each Metal plugin (a plan: nothing here ran on a Mac) the closed form is offered
    for float32, every op of its forward and gradient has a kernel in that plugin's table, and
    the XLA regions are never offered."""
    from fusion.forms import runnable_forms
    from fusion.stage import StageContext
    from tfmx.backends import get_backend
    from tfmx.placement import FOLLOWERS

    metal = get_backend("metal", plugin=plugin)
    assert metal.capability(stage.ScaledRmsNormForms).forms == ("custom",)
    assert get_backend("cpu").capability(stage.ScaledRmsNormForms).forms == ("custom", XLA)
    assert not StageContext(metal).xla
    assert runnable_forms(metal, [stage.CUSTOM], "float32") == ([stage.CUSTOM], None)

    @tf.function(autograph=False)
    def step(x, s):
        with tf.GradientTape() as tape:
            tape.watch([x, s])
            with tf.name_scope("form"):
                y = stage.scaled_custom(x, s, 1e-6)
        return y, tape.gradient(y, [x, s])

    graph = step.get_concrete_function(tf.TensorSpec([4, 6, 8]), tf.TensorSpec([8])).graph
    ops = {(op.type, op.outputs[0].dtype.name) for op in graph.get_operations()
           if "form/" in op.name and op.outputs and op.type not in FOLLOWERS | {"Const"}}
    assert ("Rsqrt", "float32") in ops and ("Sum", "float32") in ops
    missing = {(op, d) for op, d in ops if not metal.runs_op(op, d)}
    assert not missing, (plugin, missing)


def test_inference_keeps_keras_calls():
    build, x, _ = optional.tiny_decoder("llama")
    model = build()
    want = model(x).numpy()
    tfmx.enable(backend="cpu", patterns=["rms_norm", stage.FAMILY], guard=False)
    np.testing.assert_allclose(model.predict(x, verbose=0), want, rtol=1e-5, atol=1e-6)
    stats = tfmx.report().patterns.get(stage.FAMILY)
    assert stats is None or not stats.fused
