"""The rotary stage: keras_hub's rotary embedding with its halves swapped, the sign in the table."""

from __future__ import annotations

import keras
import numpy as np
import optional
import pytest
import tensorflow as tf
from helpers import (
    PickForm,
    StageExample,
    assert_models_within_rounding,
    fit_stock_and_tfmx,
    nodes_that_ran,
)
from test_grouped_attention import LLAMA_FIT, _llama, _llama_data, mixed_llama_fit

import tfmx
from fusion.calls import rotary as stage

pytestmark = pytest.mark.usefixtures("every_rewrite")


def _stage_example() -> keras.Model:
    keras_hub = optional.keras_hub()

    inp = keras.Input((6, 8))
    x = keras_hub.layers.RotaryEmbedding()(keras.layers.Dense(8)(inp))
    return keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(x)))


STAGE_EXAMPLE = StageExample(_stage_example, lacking="ConcatV2")
"""This family's model in the stage-safety tests (tests/test_stage_safety.py)."""


def _value_and_gradient(fn, x, cos, sin) -> list[np.ndarray]:
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x, cos, sin)
        w = tf.sin(tf.reshape(tf.range(tf.size(y), dtype=tf.float32), tf.shape(y)))
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * w)
    return [t.numpy().astype(np.float64) for t in (y, tape.gradient(loss, x))]


@pytest.mark.parametrize("roll", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [[2, 5, 3, 8], [2, 5, 6]])
def test_the_swapped_form_is_keras_hubs_bit_for_bit(roll, dtype, shape):
    """The same products and sums as keras_hub's application, forward and gradient (the sign
    moved onto the table is exact), at keras_hub's own tables."""
    keras_hub = optional.keras_hub()

    layer = keras_hub.layers.RotaryEmbedding(dtype=dtype)
    x = tf.cast(tf.random.normal(shape, seed=1), dtype)
    cos, sin = layer._compute_cos_sin_embedding(x)  # noqa: SLF001
    got = _value_and_gradient(lambda *a: stage.rotated(*a, roll=roll), x, cos, sin)
    want = _value_and_gradient(layer._apply_rotary_pos_emb, x, cos, sin)  # noqa: SLF001
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_declines_with_a_reason():
    x = tf.zeros([2, 5, 8])
    assert "float64" in stage.check(tf.zeros([2, 5, 8], tf.float64), x, x)
    assert "another dtype" in stage.check(x, tf.zeros([1, 5, 8], tf.bfloat16), x)
    assert "odd" in stage.check(tf.zeros([2, 5, 7]), x, x)


@pytest.mark.parametrize("form", ["roll", "swap concat", "xla"])
def test_llama_fit_matches_stock_with_the_form_in_the_graph_that_ran(monkeypatch, form):
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, stage.FAMILY, strict=True))
    x, y = _llama_data()
    models, initial = fit_stock_and_tfmx(_llama, x, y, [stage.FAMILY])
    stats = tfmx.report().patterns[stage.FAMILY]
    label = stage.FORMS[form].label
    # 2 layers, their queries and keys
    assert stats.fused_kinds == {label: 2 * 2} and not stats.declined, stats.as_dict()
    scope = f"/{stage.FORMS.scope_of(stage.FORMS[form])}/"
    ran = nodes_that_ran(models[True].train_function)
    assert any(n.op in stage.FORMS[form].marks and scope in n.name for n in ran)
    # keras_hub's application (its Split of the halves) no longer in the step
    assert not any(n.op == "Split" and "rotary_embedding" in n.name for n in ran)
    assert any(n.op == "Split" and "rotary_embedding" in n.name
               for n in nodes_that_ran(models[False].train_function))
    assert_models_within_rounding(models[False], models[True], initial, LLAMA_FIT)


def test_mixed_bfloat16_llama_fit_is_no_further_from_float32_than_stock(monkeypatch):
    mixed_llama_fit(monkeypatch, stage.FAMILY, "roll", 4)  # 2 layers, queries and keys


def test_metal_plan_takes_the_concatenation_where_the_plugin_has_no_roll():
    """tensorflow-metal 1.2.0 has no Roll kernel: its plan is the ``swap concat`` form, whose
    ops (forward and gradient) it has in float16; XLA is never offered there. The open plugin
    has both forms' kernels in float16."""
    from fusion.forms import runnable_forms
    from fusion.stage import StageContext
    from tfmx.backends import get_backend, metal_kernels

    metal = get_backend("metal")
    assert not StageContext(metal).xla
    runnable, _ = runnable_forms(metal, [stage.ROLL, stage.SWAP], tf.float16)
    assert [f.name for f in runnable] == ["swap concat"]
    # the open plugin has Roll, in float32 and float16 (no bfloat16 kernels of these ops)
    plugin = get_backend("metal", plugin="tensorflow-metal-plugin", tensorflow="2.21.0")
    for dtype, names in ((tf.float16, ["roll", "swap concat"]), (tf.bfloat16, [])):
        runnable, _ = runnable_forms(plugin, [stage.ROLL, stage.SWAP], dtype)
        assert [f.name for f in runnable] == names

    @tf.function(autograph=False)
    def step(x, cos, sin):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = stage.rotated(x, cos, sin, roll=False)
        return tape.gradient(y, x)

    spec = tf.TensorSpec([2, 5, 3, 8], tf.float16)
    table = tf.TensorSpec([1, 5, 1, 8], tf.float16)
    ops = {op.type for op in step.get_concrete_function(spec, table, table).graph
           .get_operations()}
    unlisted = {op for op in ops if op not in metal_kernels() and len(op) > 3}
    assert not unlisted, unlisted
