"""The moe stage: keras_hub's Mixtral experts' gate and up projections as one Einsum; the top-k
routing of Mixtral and QwenMoe kept, the report saying why."""

from __future__ import annotations

import functools

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
    no_further_terms,
    nodes_that_ran,
)

import tfmx
from fusion.calls import moe as stage

pytestmark = pytest.mark.usefixtures("every_rewrite")

HIDDEN, INTERMEDIATE, EXPERTS, TOKENS = 16, 32, 4, 6


class _Experts(keras.layers.Layer):
    """keras_hub's Mixtral expert bank on [batch, tokens, hidden], its experts summed: the bank
    without the block around it (whose load-balancing loss keras_hub 0.32 cannot compute under
    a 16-bit policy: it multiplies a float32 by a 16-bit tensor)."""

    def build(self, shape):
        from keras_hub.src.models.mixtral.mixtral_decoder import MixtralMoeExperts

        self.bank = MixtralMoeExperts(EXPERTS, HIDDEN, INTERMEDIATE, dtype=self.dtype_policy)
        self.bank.build((None, HIDDEN))

    def call(self, x):
        out = keras.ops.sum(self.bank(keras.ops.reshape(x, (-1, HIDDEN))), axis=0)
        return keras.ops.reshape(out, keras.ops.shape(x))


def _block_model(kind: str = "mixtral") -> keras.Model:
    """Tokens -> Dense -> a keras_hub sparse MoE block (4 experts, top 2), or Mixtral's expert
    bank alone ("experts") -> pool -> Dense(4)."""
    inp = keras.Input((TOKENS, HIDDEN))
    if kind == "experts":
        out = _Experts()(keras.layers.Dense(HIDDEN)(inp))
        return keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(out)))
    if kind == "mixtral":
        from keras_hub.src.models.mixtral.mixtral_decoder import MixtralSparseMoeBlock

        block = MixtralSparseMoeBlock(HIDDEN, INTERMEDIATE, EXPERTS, top_k=2)
    else:
        from keras_hub.src.models.qwen_moe.qwen_moe_decoder import QwenSparseMoeBlock

        block = QwenSparseMoeBlock(HIDDEN, INTERMEDIATE // 2, INTERMEDIATE, EXPERTS, top_k=2,
                                   norm_top_k_prob=True)
    out, _ = block(keras.layers.Dense(HIDDEN)(inp))
    return keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(out)))


STAGE_EXAMPLE = StageExample(_block_model, lacking="Split")
"""This family's model in the stage-safety tests (tests/test_stage_safety.py)."""

# per weight, roundings of a step: the experts' products (HIDDEN and INTERMEDIATE terms), the
# silu, the routing's softmax and sums, the head; 2 epochs of 4 steps
FIT = 2 * 4 * (2 * HIDDEN + 2 * INTERMEDIATE + 3 * TRANSCENDENTAL + 2 * EXPERTS + 40)


def _data(n: int = 32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, TOKENS, HIDDEN)).astype("float32"),
            rng.normal(size=(n, 4)).astype("float32"))


def _compiled(kind: str = "mixtral") -> keras.Model:
    keras.utils.set_random_seed(0)
    model = _block_model(kind)
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    return model


def _value_and_gradients(fn, *inputs) -> list[np.ndarray]:
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        y = fn(*inputs)
        w = tf.sin(tf.reshape(tf.range(tf.size(y), dtype=tf.float32), tf.shape(y)))
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * w)
    return [t.numpy() for t in (y, *tape.gradient(loss, inputs))]


def test_the_merged_products_are_keras_hubs_within_rounding():
    """Forward and every gradient (tokens, gate, up and output kernels) of the merged form
    against keras_hub's own ``MixtralMoeExperts.call`` with the same kernels."""
    from keras_hub.src.models.mixtral.mixtral_decoder import MixtralMoeExperts

    layer = MixtralMoeExperts(EXPERTS, HIDDEN, INTERMEDIATE)
    layer.build((None, HIDDEN))
    x = tf.random.normal([12, HIDDEN], seed=1)
    kernels = [tf.convert_to_tensor(v) for v in (
        layer._expert_feedforward_gate_dense, layer._expert_feedforward_intermediate_dense,
        layer._expert_feedforward_output_dense)]

    def keras_hub_way(x, g, u, o):
        layer._expert_feedforward_gate_dense.assign(g)
        layer._expert_feedforward_intermediate_dense.assign(u)
        layer._expert_feedforward_output_dense.assign(o)
        return layer.call(x)

    want = _value_and_gradients(
        lambda x, g, u, o: stage.experts_separate(x, g, u, o, layer.activation, "float32"),
        x, *kernels)
    got = _value_and_gradients(
        lambda x, g, u, o: stage.experts_merged(x, g, u, o, layer.activation, "float32"),
        x, *kernels)
    np.testing.assert_array_equal(layer.call(x).numpy(), want[0])  # Keras's form, as written
    for g, w in zip(got, want):
        assert_within_rounding(g, w, 2 * (HIDDEN + INTERMEDIATE) + TRANSCENDENTAL)


def test_declines_with_a_reason():
    g = tf.zeros([EXPERTS, HIDDEN, INTERMEDIATE])
    assert "float64" in stage.check(tf.zeros([3, HIDDEN], tf.float64), g, g)
    assert "rank 3" in stage.check(tf.zeros([2, 3, HIDDEN]), g, g)
    assert "kernels" in stage.check(tf.zeros([3, HIDDEN]), g, tf.zeros([EXPERTS, HIDDEN, 8]))


def _scope_ops(fn, form) -> set[str]:
    scope = f"/{stage.FORMS.scope_of(form)}/"
    return {n.op for n in nodes_that_ran(fn) if scope in n.name}


def _expert_products(fn) -> int:
    """The forward ``th,ehm->etm`` Einsums (the experts' input products) in the traced step."""
    return sum(1 for n in nodes_that_ran(fn) if n.op == "Einsum"
               and not n.name.startswith("gradient_tape/")
               and n.attr["equation"].s.decode() in ("th,ehm->etm", "ab,cbd->cad"))


def test_mixtral_block_fit_matches_stock_with_the_merged_form_in_the_graph_that_ran(monkeypatch):
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm("merged gate up", stage.FAMILY,
                                                         strict=True))
    x, y = _data()
    models, initial = fit_stock_and_tfmx(_compiled, x, y, [stage.FAMILY])
    stats = tfmx.report().patterns[stage.FAMILY]
    assert stats.fused_kinds == {stage.MERGED.label: 1}, stats.as_dict()
    assert {"Split", "ConcatV2", "Einsum"} <= _scope_ops(models[True].train_function, stage.MERGED)
    # one product of the tokens by the experts' kernels where keras_hub has two
    assert _expert_products(models[False].train_function) == 2
    assert _expert_products(models[True].train_function) == 1
    assert_models_within_rounding(models[False], models[True], initial, FIT)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_a_mixed_precision_fit_is_no_further_from_float32_than_stock(monkeypatch, policy):
    """Under a 16-bit policy the products run in the compute dtype and the gate's silu in
    float32, as keras_hub's: tfmx's fit no further from the float32 fit than stock's."""
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm("merged gate up", stage.FAMILY,
                                                         strict=True))
    x, y = _data()
    build = functools.partial(_compiled, "experts")
    keras.mixed_precision.set_global_policy(policy)
    try:
        models, initial = fit_stock_and_tfmx(build, x, y, [stage.FAMILY])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert tfmx.report().patterns[stage.FAMILY].fused == 1
    assert "Split" in _scope_ops(models[True].train_function, stage.MERGED)
    reference = fit_float32_reference(build, x, y)
    assert_no_further_from_float32(reference, models[False], models[True], initial,
                                   no_further_terms(8), dtype=policy.split("_")[1])


def test_the_conservative_pick_keeps_keras_hubs_products(monkeypatch):
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm("separate", stage.FAMILY))
    tfmx.enable(backend="cpu", patterns=[stage.FAMILY], guard=False)
    model = _compiled()
    x, y = _data(8)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    stats = tfmx.report().patterns[stage.FAMILY]
    assert not stats.fused and any("kept: measured faster" in why for why in stats.declined)
    assert not _scope_ops(model.train_function, stage.MERGED)
    assert _expert_products(model.train_function) == 2


@pytest.mark.parametrize("kind, block", [("mixtral", "MixtralSparseMoeBlock"),
                                         ("qwen_moe", "QwenSparseMoeBlock")])
def test_the_report_says_the_routing_is_kept_and_why(kind, block):
    tfmx.enable(backend="cpu", patterns=[stage.FAMILY], guard=False)
    tfmx.report(reset=True)
    model = _compiled(kind)
    x, y = _data(8)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    report = tfmx.report()
    line = f"{block}: top-k routing kept as keras_hub writes it"
    assert any(why.startswith(line) and "dense dispatch, 4 experts computed for top-2" in why
               and "shapes that change with the data" in why
               for why in report.patterns[stage.FAMILY].declined), report
    assert line in str(report)
    # the routing's ops are keras_hub's: top_k and one_hot in the step, nothing under tfmx_moe
    ran = nodes_that_ran(model.train_function)
    assert {"TopKV2", "OneHot"} <= {n.op for n in ran}
    assert not any(stage.SCOPE in n.name for n in ran if "TopK" in n.op or "OneHot" in n.op)
