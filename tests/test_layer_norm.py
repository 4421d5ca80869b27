"""The layer_norm stage: Keras LayerNormalization trained through FusedBatchNormV3."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    TRANSCENDENTAL,
    PickForm,
    StageExample,
    assert_no_further_from_float32,
    assert_within_rounding,
    fit_float32_reference,
    no_further_terms,
    nodes_that_ran,
    xla_functions,
)

import tfmx
from fusion.calls import layer_norm as stage
from fusion.kernels import layer_norm as kernels
from tfmx.backends import get_backend

# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")


def _stage_example() -> keras.Model:
    inp = keras.Input((6, 8))
    x = keras.layers.LayerNormalization()(keras.layers.Dense(8)(inp))
    return keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(x)))


STAGE_EXAMPLE = StageExample(_stage_example, lacking="Mul")
"""This family's model in the stage-safety tests (tests/test_stage_safety.py)."""


def _terms(cols: int) -> int:
    """Roundings on the longest path of one normalized value and its gradient: the mean and
    variance sums over ``cols`` values (twice, forward and backward), rsqrt, the affine."""
    return 4 * cols + 2 * TRANSCENDENTAL + 10


CASES = {  # name: (input shape, layer kwargs)
    "last_axis": ((4, 6, 16), {}),
    "two_trailing_axes": ((3, 5, 4, 8), {"axis": [-2, -1]}),
    "no_center_no_scale": ((4, 16), {"center": False, "scale": False}),
    "epsilon": ((4, 16), {"epsilon": 1e-5}),
}


def _against_keras(layer, shape, form):
    """``layer`` built for ``shape`` with random weights, and ``run(fused)``: its output and
    the gradients of a loss w.r.t. the input and the weights, through ``form(x, first)``
    (fused) or Keras's call; ``first`` the first normalized axis."""
    rng = np.random.default_rng(0)
    layer.build(shape)
    for v in layer.weights:
        v.assign(rng.standard_normal(v.shape) * 0.5 + 1.0)
    x = tf.constant(rng.standard_normal(shape) * 3 + 1, tf.float32)
    first = stage._first_axis(layer, len(shape))

    @tf.function
    def run(fused: bool):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = form(x, first) if fused else layer(x)
            loss = tf.reduce_sum(y * tf.sin(y))
        return [y, *tape.gradient(loss, [x, *layer.trainable_variables])]

    return run, first


def _assert_outputs_within_rounding(run, shape, first) -> None:
    cols = int(np.prod(shape[first:]))
    for i, (got, expected) in enumerate(zip(run(True), run(False))):
        # the weight gradients sum over every row too
        terms = _terms(cols) + (0 if i < 2 else int(np.prod(shape[:first])))
        assert_within_rounding(got.numpy(), expected.numpy(), terms, what=f"output {i}")


@pytest.mark.parametrize("form", sorted(f.name for f in stage.LAYER_FORMS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_form_and_its_gradient_match_keras(name, form):
    shape, kwargs = CASES[name]
    layer = keras.layers.LayerNormalization(**kwargs)
    run, first = _against_keras(layer, shape, lambda x, first: stage.FORMS[form].build(
        x, stage._value(layer.gamma), stage._value(layer.beta), first, layer.epsilon))
    onednn = form.startswith("onednn")  # the 16-bit ones are the others on float32
    if onednn and first != len(shape) - 1:  # the kernel normalizes one axis
        assert "last axis alone" in stage.onednn_blocker(first, tf.zeros(shape),
                                                         get_backend("cpu"))
        with pytest.raises(ValueError, match="last axis alone"):
            run.get_concrete_function(True)
        return
    graph = run.get_concrete_function(True).graph.as_graph_def()
    assert any(n.op == "FusedBatchNormV3" for n in graph.node) == (form == "fused")
    assert any(n.op == stage.ONEDNN_OP for n in graph.node) == onednn
    _assert_outputs_within_rounding(run, shape, first)


def test_the_onednn_form_is_offered_where_the_kernel_is():
    x = tf.zeros([2, 3, 4])
    assert stage.onednn_layer_norm_registered()  # every x86 CPU build of TensorFlow here
    assert stage.onednn_layer_norm_registered(tf.bfloat16)
    assert not stage.onednn_layer_norm_registered(tf.float64)
    assert stage.onednn_blocker(2, x, get_backend("cpu")) is None
    assert "metal runs no _MklLayerNorm" in stage.onednn_blocker(2, x, get_backend("metal"))


def test_the_16_bit_kernel_form_is_offered_where_the_kernel_runs_that_dtype(monkeypatch):
    """Registered is not enough: oneDNN builds its primitive when the op first runs and may
    refuse the dtype on this processor (float16 without AVX-512 FP16). Where the probe fails
    the form is not a candidate, so the tuner never measures a form that cannot run (a
    failed measurement would leave Keras's composite for the whole decision)."""
    cpu = get_backend("cpu")
    layer = keras.layers.LayerNormalization()
    layer.build((2, 3, 4))
    names = {dtype: stage.layer_norm_forms(layer, tf.zeros([2, 3, 4], dtype), cpu, 2)
             for dtype in (tf.float32, tf.bfloat16)}
    assert stage.ONEDNN_16_BIT not in names[tf.float32]
    assert (stage.ONEDNN_16_BIT in names[tf.bfloat16]) == stage.onednn_layer_norm_runs("bfloat16")
    assert stage.ONEDNN_16_BIT not in stage.layer_norm_forms(
        layer, tf.zeros([2, 3, 4], tf.bfloat16), get_backend("metal"), 2)

    def refused(*args, **kwargs):
        raise tf.errors.AbortedError(None, None, "could not create a primitive descriptor")

    stage.onednn_layer_norm_runs.cache_clear()
    monkeypatch.setattr(kernels, "mkl_layer_norm", refused)
    try:
        assert not stage.onednn_layer_norm_runs("bfloat16")
        assert stage.ONEDNN_16_BIT not in stage.layer_norm_forms(
            layer, tf.zeros([2, 3, 4], tf.bfloat16), cpu, 2)
    finally:
        stage.onednn_layer_norm_runs.cache_clear()


@pytest.mark.parametrize("make,why", [
    (lambda: keras.layers.LayerNormalization(axis=1), "not the trailing axes"),
    (lambda: keras.layers.LayerNormalization(rms_scaling=True), "rms_scaling=True"),
])
def test_declines_with_a_reason(make, why):
    layer = make()
    x = tf.zeros([2, 3, 4])
    layer.build(x.shape)
    first, reason = stage.find_layer_norm(layer, x, get_backend("cpu"))
    assert first is None and why in reason


def test_cuda_refuses_a_small_epsilon_to_the_kernel_only():
    layer = keras.layers.LayerNormalization(epsilon=1e-6)
    layer.build((2, 4))
    assert "epsilon" in stage.fused_blocker(layer, get_backend("cuda"))
    assert stage.fused_blocker(layer, get_backend("cpu")) is None
    assert stage.find_layer_norm(layer, tf.zeros([2, 4]), get_backend("cuda")) == (1, None)


def _encoder(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inp = keras.Input((6, 8))
    x = keras.layers.Dense(16)(inp)
    x = keras.layers.LayerNormalization()(x)
    y = keras.layers.Dense(16, activation="gelu")(x)
    x = keras.layers.LayerNormalization(center=False)(keras.layers.Add()([x, y]))
    out = keras.layers.Dense(3, activation="softmax")(keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    return model


# 6 steps of a forward over 16 values, the backward and the update
FIT_TERMS = 6 * (3 * (_terms(16) + 16 + 8) + 12)


def _fit_stock_and_fused(build) -> tuple[dict, set, set]:
    """``build()`` trained stock and with the layer_norm family from the same seed: the two
    models (False: stock, True: tfmx) and the ops each step function ran."""
    from tests.test_keras import ops_that_ran

    rng = np.random.default_rng(1)
    x = rng.standard_normal((24, 6, 8)).astype("float32")
    y = rng.integers(0, 3, 24)
    models = {}
    for on in (False, True):
        tfmx.enable(backend="cpu", patterns=["layer_norm"]) if on else tfmx.disable()
        model = build()
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        models[on] = model
    return (models, ops_that_ran(models[True].train_function),
            ops_that_ran(models[False].train_function))


def _assert_gradient_regions(models: dict, form: str) -> None:
    """The tfmx step holds one XLA-compiled gradient per norm layer (two) where ``form`` has
    its gradient compiled by XLA, and none otherwise."""
    compiled = len(xla_functions(models[True].train_function))
    assert compiled == (2 if form.endswith(stage.XLA_GRADIENT) else 0), compiled


def _assert_fused_twice_and_within_rounding(models: dict, label: str) -> None:
    stats = tfmx.report().patterns["layer_norm"]
    assert stats.fused == 2 and set(stats.fused_kinds) == {label} and not stats.declined
    assert stats.observed[label] >= 2
    for a, b in zip(models[False].weights, models[True].weights):
        assert_within_rounding(b.numpy(), a.numpy(), FIT_TERMS, what=a.name)


@pytest.mark.parametrize("form", sorted(
    {f.name for f in stage.LAYER_FORMS} - {stage.ONEDNN_16, stage.ONEDNN_16 + stage.XLA_GRADIENT}))
def test_fit_matches_stock_with_the_form_in_the_graph_that_ran(monkeypatch, form):
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, "layer_norm", strict=True))
    models, ran, stock = _fit_stock_and_fused(_encoder)
    if form == "fused":
        assert {"FusedBatchNormV3", "FusedBatchNormGradV3"} <= ran
        assert "FusedBatchNormV3" not in stock
    else:  # the closed-form gradient: no autodiff of Rsqrt, fewer ops than Keras's
        assert "RsqrtGrad" in stock and "RsqrtGrad" not in ran
    if form.startswith("onednn"):
        assert stage.ONEDNN_OP in ran and stage.ONEDNN_OP not in stock
    # the gradient compiled by XLA: one region per layer, in the step that ran
    _assert_gradient_regions(models, form)
    _assert_fused_twice_and_within_rounding(models, stage.FORMS[form].label)


def _needs_the_bfloat16_kernel() -> None:
    """Skip where oneDNN does not run its layer norm in bfloat16 (no AVX-512: the form is
    not offered there, as the test above checks)."""
    if not stage.onednn_layer_norm_runs("bfloat16"):
        pytest.skip("oneDNN's _MklLayerNorm does not run bfloat16 on this processor")


def test_the_16_bit_onednn_form_matches_keras_within_bfloat16_roundings():
    """The kernel reads bfloat16 and writes it, gamma and beta rounded to bfloat16 (Keras
    computes in float32 and rounds the output): the output within four bfloat16 roundings of
    Keras's (gamma's, beta's, the output's on either side: ``terms=2`` counts both sides);
    the gradient, in float32 from the same bfloat16 ``dy`` (a linear loss), within one
    rounding of Keras's (dx rounded to bfloat16 on the way out) and float32's for gamma's
    and beta's."""
    _needs_the_bfloat16_kernel()
    rng = np.random.default_rng(0)
    layer = keras.layers.LayerNormalization(dtype="mixed_bfloat16")
    layer.build((4, 6, 32))
    for v in layer.weights:
        v.assign(rng.standard_normal(v.shape) * 0.5 + 1.0)
    x = tf.constant(rng.standard_normal((4, 6, 32)) * 3 + 1, tf.bfloat16)
    w = tf.constant(rng.standard_normal((4, 6, 32)), tf.float32)

    @tf.function
    def run(fused: bool):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = stage.layer_norm_onednn_16(x, stage._value(layer.gamma), stage._value(
                layer.beta), 2, layer.epsilon) if fused else layer(x)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * w)
        return [y, *tape.gradient(loss, [x, *layer.trainable_variables])]

    graph = run.get_concrete_function(True).graph.as_graph_def()
    kernels = [n for n in graph.node if n.op == stage.ONEDNN_OP]
    assert kernels and all(n.attr["T"].type == tf.bfloat16.as_datatype_enum for n in kernels)
    got, want = run(True), run(False)
    assert got[0].dtype == tf.bfloat16 and got[1].dtype == tf.bfloat16
    for i, terms, dtype in ((0, 2, "bfloat16"), (1, 1, "bfloat16"),
                            (2, _terms(32) + 24, "float32"), (3, _terms(32) + 24, "float32")):
        assert_within_rounding(tf.cast(got[i], tf.float64).numpy(),
                               tf.cast(want[i], tf.float64).numpy(), terms, dtype=dtype,
                               what=f"output {i}")


@pytest.mark.parametrize("form", [stage.ONEDNN_16, stage.ONEDNN_16 + stage.XLA_GRADIENT])
def test_mixed_bfloat16_fit_matches_stock_with_the_16_bit_kernel_in_the_graph_that_ran(
        monkeypatch, form):
    from tfmx import state

    _needs_the_bfloat16_kernel()
    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, "layer_norm", strict=True))
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        initial = [v.numpy() for v in _encoder().weights]
        models, ran, stock = _fit_stock_and_fused(_encoder)
        graphs = nodes_that_ran(models[True].train_function)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    kernels = [n for n in graphs if n.op == stage.ONEDNN_OP]
    assert kernels and all(n.attr["T"].type == tf.bfloat16.as_datatype_enum for n in kernels)
    assert stage.ONEDNN_OP not in stock
    _assert_gradient_regions(models, form)
    stats = tfmx.report().patterns["layer_norm"]
    label = stage.FORMS[form].label
    assert stats.fused == 2 and set(stats.fused_kinds) == {label} and not stats.declined
    assert stats.observed[label] >= 2
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((24, 6, 8)).astype("float32"), rng.integers(0, 3, 24)
    # 6 steps; the kernel rounds gamma and beta to bfloat16 where Keras keeps them float32
    reference = fit_float32_reference(_encoder, x, y)
    assert_no_further_from_float32(reference, models[False], models[True], initial,
                                   no_further_terms(6, extra=2))


RMS_CASES = {  # name: (input shape, layer kwargs)
    "last_axis": ((4, 6, 16), {}),
    "two_trailing_axes": ((3, 5, 4, 8), {"axis": [-2, -1]}),
    "epsilon": ((4, 16), {"epsilon": 1e-3}),
}


@pytest.mark.parametrize("form", sorted(f.name for f in stage.RMS_FORMS))
@pytest.mark.parametrize("name", sorted(RMS_CASES))
def test_rms_form_and_its_gradient_match_keras(name, form):
    shape, kwargs = RMS_CASES[name]
    layer = keras.layers.RMSNormalization(**kwargs)
    run, first = _against_keras(layer, shape, lambda x, first: stage.FORMS[form].build(
        x, stage._value(layer.scale), first, layer.epsilon))
    stock_ops = {n.op for n in run.get_concrete_function(False).graph.as_graph_def().node}
    fused_ops = {n.op for n in run.get_concrete_function(True).graph.as_graph_def().node}
    assert "RsqrtGrad" in stock_ops and "RsqrtGrad" not in fused_ops
    _assert_outputs_within_rounding(run, shape, first)


def test_rms_declines_leading_axes_with_a_reason():
    layer = keras.layers.RMSNormalization(axis=1)
    x = tf.zeros([2, 3, 4])
    layer.build(x.shape)
    first, reason = stage.find_rms_norm(layer, x)
    assert first is None and "not the trailing axes" in reason


def _rms_decoder(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inp = keras.Input((6, 8))
    x = keras.layers.Dense(16)(inp)
    h = keras.layers.RMSNormalization()(x)
    x = keras.layers.Add()([x, keras.layers.Dense(16, activation="gelu")(h)])
    x = keras.layers.RMSNormalization(epsilon=1e-5)(x)
    out = keras.layers.Dense(3, activation="softmax")(keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    return model


@pytest.mark.parametrize("form", ["rms custom", "rms custom" + stage.XLA_GRADIENT])
def test_rms_fit_matches_stock_with_the_form_in_the_graph_that_ran(monkeypatch, form):
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, "layer_norm", strict=True))
    models, ran, stock = _fit_stock_and_fused(_rms_decoder)
    assert "RsqrtGrad" in stock and "RsqrtGrad" not in ran
    _assert_gradient_regions(models, form)
    _assert_fused_twice_and_within_rounding(models, stage.FORMS[form].label)
