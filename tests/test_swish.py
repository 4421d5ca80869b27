"""The swish stage: swish (SiLU) and hard-swish in training with their derivatives in closed
form."""

from __future__ import annotations

from collections import Counter

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
from fusion import private_api
from fusion.calls import swish as stage
from fusion.stage import XLA, XLA_CALLS

keras_nn = private_api.get("keras.backend_nn")

# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")


def _stage_example() -> keras.Model:
    inp = keras.Input((8,))
    return keras.Model(inp, keras.layers.Dense(4)(keras.layers.Dense(16, activation="swish")(inp)))


STAGE_EXAMPLE = StageExample(_stage_example, lacking="Sigmoid")
"""This family's model in the stage-safety tests (tests/test_stage_safety.py)."""

# Roundings of one swish and its derivative (a sigmoid, some five multiplies and adds), or of
# one hard-swish (exact but for a division, a product and the derivative's three); either
# side's, so twice.
SWISH_TERMS = 2 * (TRANSCENDENTAL + 2 + 6)
HARD_TERMS = 2 * 6
# x over both activations' ranges, with hard-swish's corners and their neighbours in every dtype
_CORNERS = [-3.0, 3.0, -3.0 + 1e-3, 3.0 - 1e-3, -3.0 - 1e-3, 3.0 + 1e-3, 0.0]
_X = np.concatenate([np.linspace(-8.0, 8.0, 4001), _CORNERS])


def _keras_swish(x: tf.Tensor) -> tf.Tensor:
    return keras_nn.silu(x)


def _keras_hard_swish(x: tf.Tensor) -> tf.Tensor:
    return keras_nn.hard_silu(x)


def _gradient(fn, x: tf.Tensor) -> np.ndarray:
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
    return tape.gradient(y, x).numpy().astype(np.float64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_swish_value_and_derivative_match_tensorflow(dtype):
    x = tf.cast(tf.constant(_X, tf.float32), dtype)
    got = value_and_gradient(stage.swish_custom, x)
    want = value_and_gradient(_keras_swish, x)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_within_rounding(g, w, SWISH_TERMS, dtype=dtype, what=f"output {i}")
    np.testing.assert_array_equal(got[0], want[0])  # tf.nn.silu's forward, bit for bit


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_hard_swish_value_and_derivative_match_keras_at_the_corners_too(dtype):
    """Keras's forward bit for bit; the derivative within rounding everywhere, and at -3 and 3
    (and wherever ``x + 3`` rounds to 0 or 6 in ``dtype``) autodiff's subgradient exactly:
    0 and 1."""
    x = tf.cast(tf.constant(_X, tf.float32), dtype)
    got = value_and_gradient(stage.hard_swish_custom, x)
    want = value_and_gradient(_keras_hard_swish, x)
    np.testing.assert_array_equal(got[0], want[0])
    assert_within_rounding(got[1], want[1], HARD_TERMS, dtype=dtype, what="gradient")
    slope, stock = _gradient(stage.hard_swish_custom, x), _gradient(_keras_hard_swish, x)
    u = (x + tf.constant(3.0, x.dtype)).numpy().astype(np.float64)
    flat = (u <= 0) | (u >= 6)
    np.testing.assert_array_equal(slope[flat], stock[flat])
    corners = tf.constant([-3.0, 3.0], dtype)
    assert _gradient(stage.hard_swish_custom, corners).tolist() == [0.0, 1.0]
    assert _gradient(_keras_hard_swish, corners).tolist() == [0.0, 1.0]


def test_the_closed_form_keeps_the_sigmoid_where_tensorflow_recomputes_it():
    """tf.nn.silu's gradient computes a second Sigmoid in the backward (under a control
    dependency on dy); the ``custom`` form's backward has none."""
    def sigmoids(fn) -> tuple[int, int]:
        def count(gradient: bool) -> int:
            @tf.function(autograph=False)
            def step(x):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = fn(x)
                return tape.gradient(y, x) if gradient else y

            graph = step.get_concrete_function(tf.TensorSpec([4, 8])).graph
            return sum(op.type == "Sigmoid" for op in graph.get_operations())

        return count(False), count(True)

    assert sigmoids(tf.nn.silu) == (1, 2)
    assert sigmoids(stage.swish_custom) == (1, 1)


# Each form computed in float32 for a 16-bit input, and its gradient's roundings to the 16-bit
# dtype: dy (the loss's, float32) rounded on the way in and the product on the way out; the kept
# slope once more.
WIDE_FORMS = {"custom upcast": (stage.swish_upcast, 2),
              XLA: (lambda x: stage.swish_xla_slope(x), 3)}


@pytest.mark.parametrize("name", sorted(WIDE_FORMS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_float32_swish_forms_of_a_16_bit_input_round_once_or_thrice(name, dtype):
    """Within one rounding of ``dtype`` (the gradient two or three) of the float32 swish at x's
    16-bit values; and within the composite's roundings of Keras's 16-bit swish."""
    fn, roundings = WIDE_FORMS[name]
    x = tf.cast(tf.constant(_X, tf.float32), dtype)
    got = value_and_gradient(fn, x)
    assert fn(x).dtype == x.dtype
    wide = value_and_gradient(_keras_swish, tf.cast(x, tf.float32))
    want = value_and_gradient(_keras_swish, x)
    for i, (g, w, s) in enumerate(zip(got, wide, want)):
        assert_within_rounding(g, w, 1 if i == 0 else roundings, dtype=dtype, what=f"output {i}")
        assert_within_rounding(g, s, SWISH_TERMS, dtype=dtype, what=f"output {i}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_hard_swish_region_is_keras_in_float32_with_its_subgradients(dtype):
    """The region computes Keras's hard-swish in float32 at x's values: the value within one
    rounding of ``dtype``, the gradient three, autodiff's subgradients exactly where ``x + 3``
    is 0 or 6 or beyond (-3 and 3 among them); and within the composite's roundings of Keras's
    own call in ``dtype``."""
    x = tf.cast(tf.constant(_X, tf.float32), dtype)
    region = lambda v: stage.swish_xla_slope(v, hard=True)  # noqa: E731
    got = value_and_gradient(region, x)
    wide = value_and_gradient(_keras_hard_swish, tf.cast(x, tf.float32))
    want = value_and_gradient(_keras_hard_swish, x)
    for i, (g, w, s) in enumerate(zip(got, wide, want)):
        assert_within_rounding(g, w, 1 if i == 0 else 3, dtype=dtype, what=f"output {i}")
        assert_within_rounding(g, s, HARD_TERMS, dtype=dtype, what=f"output {i}")
    u = x.numpy().astype(np.float64) + 3.0
    flat = (u <= 0) | (u >= 6)
    slope = _gradient(region, x)
    np.testing.assert_array_equal(slope[flat], _gradient(_keras_hard_swish,
                                                         tf.cast(x, tf.float32))[flat])
    assert _gradient(region, tf.constant([-3.0, 3.0], dtype)).tolist() == [0.0, 1.0]


def test_the_swish_region_is_the_closed_form_in_float32():
    x = tf.constant(_X, tf.float32)
    got = value_and_gradient(stage.swish_xla_slope, x)
    want = value_and_gradient(stage.swish_custom, x)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_within_rounding(g, w, 2 * TRANSCENDENTAL, what=f"output {i}")


@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_regions_multiply_once_in_the_backward(hard, dtype):
    """What makes the regions faster: one call in the forward, and the gradient adds one Mul in
    the input's dtype to the graph, no Cast and no float32 op."""
    def graph_ops(gradient: bool) -> Counter:
        @tf.function(autograph=False)
        def step(x, dy):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = stage.swish_xla_slope(x, hard)
            return tape.gradient(y, x, output_gradients=dy) if gradient else y

        spec = tf.TensorSpec([4, 8], dtype)
        graph = step.get_concrete_function(spec, spec).graph
        return Counter((op.type, op.outputs[0].dtype.name if op.outputs else None)
                       for op in graph.get_operations() if op.type not in ("Const", "Identity"))

    forward = graph_ops(False)
    assert graph_ops(True) - forward == Counter({("Mul", dtype): 1})
    assert sum(n for (op, _), n in forward.items() if op in XLA_CALLS) == 1, forward
    assert not any(op in ("Sigmoid", "Relu6") for op, _ in forward), forward


def test_a_16_bit_swish_also_gets_the_float32_form_last():
    assert form_names(stage._forms(tf.zeros([2]), hard=False)) == ["custom"]
    for dtype in (tf.bfloat16, tf.float16):
        assert form_names(stage._forms(tf.zeros([2], dtype), hard=False)) == ["custom",
                                                                          "custom upcast"]
        assert form_names(stage._forms(tf.zeros([2], dtype), hard=True)) == ["hard custom"]


def test_declines_what_it_cannot_take():
    assert "float64" in stage.check(tf.zeros([2], tf.float64))
    assert stage.check(tf.zeros([2, 3], tf.bfloat16)) is None


class _HardSwish(keras.layers.Layer):
    def call(self, x):
        return keras.ops.hard_swish(x)


class _Silu(keras.layers.Layer):
    def call(self, x):
        return keras.ops.silu(x)


def _model(seed: int = 0, kinds: tuple[str, ...] = ("swish", "hard")) -> keras.Model:
    """Every way Keras reaches its swish and hard-swish: Dense and Conv activations, Activation
    layers, and ``keras.ops`` in a custom layer, on 4-d (EfficientNet's, MobileNetV3's) and
    2-d tensors."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((6, 6, 3))
    x = inp
    if "swish" in kinds:
        x = keras.layers.Conv2D(8, 3, padding="same", activation="swish")(x)
        x = keras.layers.Activation("silu")(keras.layers.Conv2D(8, 1)(x))
    if "hard" in kinds:
        x = keras.layers.Activation("hard_swish")(keras.layers.Conv2D(8, 3, padding="same")(x))
        x = _HardSwish()(keras.layers.Conv2D(8, 1)(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    if "swish" in kinds:
        x = _Silu()(keras.layers.Dense(16)(x))
    if "hard" in kinds:
        x = keras.layers.Dense(16, activation="hard_silu")(x)
    out = keras.layers.Dense(3, activation="softmax")(x)
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    return model


def _data(n: int = 32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return (rng.standard_normal((n, 6, 6, 3)).astype("float32") * 2,
            rng.integers(0, 3, n))


def test_fit_matches_stock_with_the_closed_forms_in_the_graph_that_ran():
    x, y = _data()
    models, initial = fit_stock_and_tfmx(_model, x, y, ["swish"])
    stats = tfmx.report().patterns["swish"]
    labels = {stage.CUSTOM.label, stage.HARD_CUSTOM.label}
    assert stats.fused == 6 and stats.fused_kinds == {label: 3 for label in labels}, stats
    assert all(stats.observed[label] >= 3 for label in labels), stats.observed
    nodes = nodes_that_ran(models[True].train_function)
    for form, mark in ((stage.CUSTOM, "Sigmoid"), (stage.HARD_CUSTOM, "Relu6")):
        scope = f"/{stage.FORMS.scope_of(form)}/"
        assert any(n.op == mark and scope in n.name for n in nodes), (form.name, mark)
        # the closed-form derivative's ops, named under the gradient tape and the form's scope
        backward = {n.op for n in nodes if n.name.startswith("gradient_tape/") and scope in n.name}
        assert "Mul" in backward and "Sigmoid" not in backward, (form.name, backward)
    assert "Relu6Grad" in {n.op for n in nodes if "hard_custom/" in n.name}
    assert "Sigmoid" in ops_that_ran(models[False].train_function)
    # 8 steps of the convolutions' 27- and 72-term sums, the Dense layers', the activations'
    step = 2 * 72 + 27 + 8 + 16 + 16 + 6 * SWISH_TERMS + 20
    assert_models_within_rounding(models[False], models[True], initial, 8 * step)


@pytest.mark.parametrize("form,kind", [("custom upcast", "swish"), (XLA, "swish"),
                                       (stage.HARD_XLA.name, "hard"),
                                       (stage.HARD_CUSTOM.name, "hard")])
def test_mixed_bfloat16_fit_matches_stock_with_the_form_in_the_graph_that_ran(
        monkeypatch, form, kind):
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, "swish", strict=True))
    x, y = _data(16)

    def build() -> keras.Model:
        return _model(kinds=(kind,))

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        models, initial = fit_stock_and_tfmx(build, x, y, ["swish"], epochs=1)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    stats = tfmx.report().patterns["swish"]
    label = stage.FORMS[form].label
    assert stats.fused == 3 and stats.fused_kinds == {label: 3}, stats
    assert stats.observed[label] >= 3
    scope = f"/{stage.FORMS.scope_of(stage.FORMS[form])}/"
    marks = stage.FORMS[form].marks
    assert any(n.op in marks and scope in n.name
               for n in nodes_that_ran(models[True].train_function)), (form, marks)
    # 2 steps; the kept-slope regions round the derivative once more than the float32 one
    reference = fit_float32_reference(build, x, y, epochs=1)
    assert_no_further_from_float32(reference, models[False], models[True], initial,
                                   no_further_terms(2, extra=int(form != "custom upcast")))


@pytest.mark.parametrize("hard", [False, True])
def test_the_forms_on_metal_run_on_ops_the_plugin_has(hard):
    """Every op of every closed form a float16 call gets on metal, forward and gradient, is
    among tensorflow-metal 1.2.0's kernels, and the XLA regions are never offered there."""
    from fusion.stage import StageContext
    from tfmx.backends import get_backend, metal_kernels

    metal = get_backend("metal")
    assert not StageContext(metal).xla
    forms = stage._forms(tf.zeros([2], tf.float16), hard)
    assert forms
    for form, fn in forms.items():
        @tf.function(autograph=False)
        def step(x, fn=fn):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = fn(x)
            return y, tape.gradient(y, x)

        graph = step.get_concrete_function(tf.TensorSpec([4, 8], tf.float16)).graph
        ops = {op.type for op in graph.get_operations()}
        assert form.marks & ops, (form.name, ops)
        y, dx = step(tf.constant(np.linspace(-4.0, 4.0, 32).reshape(4, 8), tf.float16))
        assert y.dtype == tf.float16 and dx.dtype == tf.float16
        unlisted = {op for op in ops if op not in metal_kernels() and len(op) > 3}
        assert not unlisted, (form.name, unlisted)
        assert all(metal.runs_op(op.partition(":")[0], op.partition(":")[2] or "float16")
                   for op in form.emits), form.name


def test_inference_keeps_keras_call():
    """Without a tape the stage leaves swish and hard-swish to Keras."""
    tfmx.enable(backend="cpu", patterns=["swish"], guard=False)
    model = _model()
    x = _data(4)[0]
    want = model(x).numpy()
    np.testing.assert_allclose(model.predict(x, verbose=0), want, atol=1e-5)
    assert "swish" not in tfmx.report().patterns or not tfmx.report().patterns["swish"].fused
