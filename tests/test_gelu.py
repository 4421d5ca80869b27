"""The gelu stage: GELU in training with its derivative in closed form."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    TRANSCENDENTAL,
    PickForm,
    StageExample,
    assert_models_within_rounding,
    assert_no_further_from_float32,
    assert_within_rounding,
    fit_float32_reference,
    fit_stock_and_tfmx,
    form_names,
    no_further_terms,
    nodes_that_ran,
    ops_that_ran,
    value_and_gradient,
)

import tfmx
from fusion.calls import gelu as stage
from fusion.stage import XLA, XLA_CALLS

# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")


def _stage_example() -> keras.Model:
    inp = keras.Input((8,))
    return keras.Model(inp, keras.layers.Dense(4)(keras.layers.Dense(16, activation="gelu")(inp)))


STAGE_EXAMPLE = StageExample(_stage_example, lacking="Exp")
"""This family's model in the stage-safety tests (tests/test_stage_safety.py)."""

# Roundings of one GELU and its derivative (erf or tanh, exp, some ten multiplies and adds);
# either side's, so twice.
GELU_TERMS = 2 * (2 * TRANSCENDENTAL + 12)


@pytest.mark.parametrize("form", ["exact", "exact erfc", "approximate"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_value_and_derivative_match_tensorflow(form, dtype):
    approximate = form == "approximate"
    x = tf.cast(tf.constant(np.linspace(-7.0, 7.0, 4001), tf.float32), dtype)
    got = value_and_gradient(
        lambda v: stage.gelu_custom(v, approximate, erfc=form == "exact erfc"), x)
    want = value_and_gradient(lambda v: tf.nn.gelu(v, approximate=approximate), x)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_within_rounding(g, w, GELU_TERMS, dtype=dtype, what=f"output {i}")
    if form == "exact erfc":  # TensorFlow's own forward, bit for bit
        np.testing.assert_array_equal(got[0], want[0])


def test_a_backend_without_erf_gets_the_erfc_form():
    from fusion.pattern import PlainTarget
    from fusion.stage import StageContext
    from tfmx.backends import get_backend

    no_erf = PlainTarget("toy", kernels=frozenset({"Erfc", "Tanh", "Exp", "Mul", "AddV2"}))
    assert form_names(stage._forms(StageContext(get_backend("cpu")), False)) == \
        ["custom", "custom erfc"]
    assert form_names(stage._forms(StageContext(no_erf), False)) == ["custom erfc"]
    assert form_names(stage._forms(StageContext(no_erf), True)) == ["custom"]


UPCAST_FORMS = ["custom upcast", stage.SLOPE_KEPT.name]


@pytest.mark.parametrize("backend", ["cpu", "metal"])
@pytest.mark.parametrize("approximate", [False, True])
def test_a_16_bit_input_also_gets_the_float32_forms_last(backend, approximate):
    from fusion.stage import StageContext
    from tfmx.backends import get_backend

    ctx = StageContext(get_backend(backend))
    plain = form_names(stage._forms(ctx, approximate))
    for dtype in (tf.bfloat16, tf.float16):
        assert form_names(stage._forms(ctx, approximate, dtype)) == [*plain, *UPCAST_FORMS]
    assert form_names(stage._forms(ctx, approximate, tf.float32)) == plain


# Roundings of each float32 form's gradient to the 16-bit dtype: dy (the loss's, float32)
# rounded on the way in and the product on the way out; the kept slope once more (the XLA
# region keeps it too).
GRADIENT_ROUNDINGS = {"custom upcast": 2, stage.SLOPE_KEPT.name: 3, XLA: 3}
# Each form computed in float32 for a 16-bit input, called as fn(x, approximate, erfc)
# (the XLA region computes the CDF with XLA's own Erf whatever the backend's kernels).
WIDE_FORMS = {"custom upcast": stage.gelu_upcast, stage.SLOPE_KEPT.name: stage.gelu_slope_kept,
              XLA: lambda x, approximate=False, erfc=False: stage.gelu_xla_slope(x, approximate)}


@pytest.mark.parametrize("name", sorted(WIDE_FORMS))
@pytest.mark.parametrize("form", ["exact", "exact erfc", "approximate"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_float32_forms_of_a_16_bit_input_round_once_or_twice(name, form, dtype):
    """The upcast forms compute in float32 and round the output to ``dtype`` once (within one
    rounding of ``dtype`` of the float32 GELU at x's 16-bit values) and the gradient two or
    three times (:data:`GRADIENT_ROUNDINGS`); and within the composite's roundings of
    TensorFlow's 16-bit GELU."""
    approximate = form == "approximate"
    fn = WIDE_FORMS[name]
    x = tf.cast(tf.constant(np.linspace(-7.0, 7.0, 4001), tf.float32), dtype)
    got = value_and_gradient(lambda v: fn(v, approximate, erfc=form == "exact erfc"), x)
    assert got[0].dtype == np.float64 and fn(x, approximate).dtype == x.dtype
    wide = value_and_gradient(lambda v: tf.nn.gelu(v, approximate=approximate),
                               tf.cast(x, tf.float32))
    want = value_and_gradient(lambda v: tf.nn.gelu(v, approximate=approximate), x)
    for i, (g, w, s) in enumerate(zip(got, wide, want)):
        terms = 1 if i == 0 else GRADIENT_ROUNDINGS[name]
        assert_within_rounding(g, w, terms, dtype=dtype, what=f"output {i}")
        assert_within_rounding(g, s, GELU_TERMS, dtype=dtype, what=f"output {i}")


@pytest.mark.parametrize("name,dtype", [
    (stage.SLOPE_KEPT.name, "bfloat16"), (stage.SLOPE_KEPT.name, "float16"),
    (XLA, "bfloat16"), (XLA, "float16"), (XLA, "float32")])
def test_the_kept_slope_forms_multiply_once_in_the_backward(name, dtype):
    """What makes the kept-slope forms faster: the gradient adds one Mul in the input's dtype
    to the graph, no Cast and no float32 op; the XLA region is one call in the forward."""
    from collections import Counter

    fn = WIDE_FORMS[name]

    def graph_ops(gradient: bool) -> Counter:
        @tf.function(autograph=False)
        def step(x, dy):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = fn(x)
            return tape.gradient(y, x, output_gradients=dy) if gradient else y

        spec = tf.TensorSpec([4, 8], dtype)
        graph = step.get_concrete_function(spec, spec).graph
        return Counter((op.type, op.outputs[0].dtype.name if op.outputs else None)
                       for op in graph.get_operations() if op.type not in ("Const", "Identity"))

    forward = graph_ops(False)
    assert graph_ops(True) - forward == Counter({("Mul", dtype): 1})
    if name == XLA:
        calls = sum(n for (op, _), n in forward.items() if op in XLA_CALLS)
        assert calls == 1 and not any(op in ("Erf", "Exp") for op, _ in forward), forward


@pytest.mark.parametrize("approximate", [False, True])
def test_the_xla_region_is_the_closed_form_in_float32(approximate):
    """In float32 the region computes the closed form's arithmetic, with XLA's Erf, Exp and
    Tanh in place of TensorFlow's kernels."""
    x = tf.constant(np.linspace(-7.0, 7.0, 4001), tf.float32)
    got = value_and_gradient(lambda v: stage.gelu_xla_slope(v, approximate), x)
    want = value_and_gradient(lambda v: stage.gelu_custom(v, approximate), x)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_within_rounding(g, w, 2 * TRANSCENDENTAL, what=f"output {i}")


def test_declines_what_it_cannot_take():
    assert "float64" in stage.check(tf.zeros([2], tf.float64))
    assert stage.check(tf.zeros([2, 3], tf.bfloat16)) is None


def _model(seed: int = 0) -> keras.Model:
    """Every way Keras reaches its GELU: a Dense activation, an Activation layer, and
    ``keras.ops.gelu`` (approximate by default) in a custom layer."""

    class TanhGelu(keras.layers.Layer):
        def call(self, x):
            return keras.ops.gelu(x)

    keras.utils.set_random_seed(seed)
    inp = keras.Input((8,))
    x = keras.layers.Dense(16, activation="gelu")(inp)
    x = keras.layers.Activation("gelu")(keras.layers.Dense(16)(x))
    x = TanhGelu()(keras.layers.Dense(16)(x))
    out = keras.layers.Dense(3, activation="softmax")(x)
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    return model


def test_fit_matches_stock_with_the_closed_form_in_the_graph_that_ran():

    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 8)).astype("float32") * 2
    y = rng.integers(0, 3, 32)
    models, initial = fit_stock_and_tfmx(_model, x, y, ["gelu"])
    ran, stock = ops_that_ran(models[True].train_function), \
        ops_that_ran(models[False].train_function)
    assert {"Erf", "Tanh"} <= ran and "Erf" not in stock  # stock's exact GELU runs Erfc
    stats = tfmx.report().patterns["gelu"]
    assert stats.fused == 3 and set(stats.fused_kinds) == {stage.FORMS["custom"].label}, stats
    assert stats.observed[stage.FORMS["custom"].label] >= 3
    # the closed-form derivative's ops are named under the gradient tape and the form's scope,
    # as TensorFlow names a registered gradient's (a profile can say whose backward they are)
    backward = {n.op for n in nodes_that_ran(models[True].train_function)
                if n.name.startswith("gradient_tape/") and f"/{stage.SCOPE}_custom/" in n.name}
    assert {"Mul", "Exp"} <= backward, backward
    # 8 steps of three Dense layers of 8-16 terms, their GELUs and derivatives, the softmax
    step = 3 * (8 + 16 + 16 + 16) + 3 * GELU_TERMS + 20
    assert_models_within_rounding(models[False], models[True], initial, 8 * step)


@pytest.mark.parametrize("form", [*UPCAST_FORMS, XLA])
def test_mixed_bfloat16_fit_matches_stock_with_the_float32_form_in_the_graph_that_ran(
        monkeypatch, form):
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, "gelu", strict=True))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 8)).astype("float32") * 2
    y = rng.integers(0, 3, 16)
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        models, initial = fit_stock_and_tfmx(_model, x, y, ["gelu"], epochs=1)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    ran = ops_that_ran(models[True].train_function)
    assert {"Erf", "Tanh"} <= ran
    stats = tfmx.report().patterns["gelu"]
    label = stage.FORMS[form].label
    assert stats.fused == 3 and set(stats.fused_kinds) == {label}, stats
    assert stats.observed[label] >= 3
    # 2 steps; the kept-slope forms round the derivative once more than the float32 one
    reference = fit_float32_reference(_model, x, y, epochs=1)
    assert_no_further_from_float32(reference, models[False], models[True], initial,
                                   no_further_terms(2, extra=int(form != "custom upcast")))


@pytest.mark.parametrize("form", UPCAST_FORMS)
@pytest.mark.parametrize("approximate", [False, True])
def test_the_float32_forms_on_metal_run_on_ops_the_plugin_has(approximate, form):
    """A float16 GELU's float32 form on metal goes through the CDF kernel the plugin has (Erf
    where it lists one, else Erfc), and every op of it, forward and gradient, is among
    tensorflow-metal 1.2.0's kernels."""
    from fusion.stage import StageContext
    from tfmx.backends import get_backend, metal_kernels

    form = {f.name: fn for f, fn in stage._forms(StageContext(get_backend("metal")),
                                                  approximate, tf.float16).items()}[form]

    @tf.function(autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = form(x)
        return y, tape.gradient(y, x)

    graph = step.get_concrete_function(tf.TensorSpec([4, 8], tf.float16)).graph
    ops = {op.type for op in graph.get_operations()}
    cdf = "Erf" if get_backend("metal").runs_op("Erf") else "Erfc"
    assert "Cast" in ops and ("Tanh" if approximate else cdf) in ops, ops
    y, dx = step(tf.constant(np.linspace(-3.0, 3.0, 32).reshape(4, 8), tf.float16))
    assert y.dtype == tf.float16 and dx.dtype == tf.float16
    unlisted = {op for op in ops if op not in metal_kernels() and len(op) > 3}
    assert not unlisted, unlisted


def test_inference_keeps_the_composite_for_the_matmul_fusion():
    """Without a tape the stage leaves GELU alone: contraction folds it into _FusedMatMul."""
    tfmx.enable(backend="cpu", patterns=["gelu", "contraction"], guard=False)
    model = _model()
    x = np.random.default_rng(0).standard_normal((4, 8)).astype("float32")
    want = model(x).numpy()
    np.testing.assert_allclose(model.predict(x, verbose=0), want, atol=1e-5)
    assert "gelu" not in tfmx.report().patterns or not tfmx.report().patterns["gelu"].fused
