"""The grouped_attention stage: grouped-query attention without repeated keys and values."""

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
    fit_float32_reference,
    fit_stock_and_tfmx,
    no_further_terms,
    nodes_that_ran,
    profiled_ops,
)

import tfmx
from fusion import private_api
from fusion.calls import grouped_attention as stage

pytestmark = pytest.mark.usefixtures("every_rewrite")

T, D, HEADS, KV, HEAD_DIM = 6, 8, 4, 2, 4


def _stage_example() -> keras.Model:
    inp = keras.Input((T, D))
    x = keras.layers.GroupQueryAttention(HEAD_DIM, HEADS, KV)(inp, inp)
    return keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(x)))


STAGE_EXAMPLE = StageExample(_stage_example, lacking="Softmax")
"""This family's model in the stage-safety tests (tests/test_stage_safety.py)."""


def _gradients(fn, *xs) -> list[np.ndarray]:
    """``fn(*xs)`` and the gradients of ``sum(fn * weights)`` (every element weighed
    differently) w.r.t. each input, as float64 arrays."""
    with tf.GradientTape() as tape:
        tape.watch(xs)
        y = fn(*xs)
        w = tf.sin(tf.reshape(tf.range(tf.size(y), dtype=tf.float32), tf.shape(y)))
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * w)
    return [t.numpy().astype(np.float64) for t in [y, *tape.gradient(loss, xs)]]


@pytest.mark.parametrize("bmm", [False, True])
@pytest.mark.parametrize("equation,shapes,repeated,axis,groups", [
    ("bquh,bkuh->buqk", ([2, 5, 4, 3], [2, 6, 2, 3]), 1, 2, 2),   # keras_hub's scores
    ("buqk,bkuh->bquh", ([2, 4, 5, 6], [2, 6, 2, 3]), 1, 2, 2),   # and weighted sum
    ("bquh,bkuh->buqk", ([2, 5, 4, 3], [2, 6, 1, 3]), 1, 2, 4),   # multi-query
    ("bkuh,bquh->bquk", ([2, 6, 2, 3], [2, 5, 4, 3]), 0, 2, 2),   # the repeat first
    ("bquh,bkuh->bqk", ([2, 5, 6, 3], [2, 7, 3, 3]), 1, 2, 2),    # heads summed
])
def test_the_grouped_contraction_is_the_einsum_of_the_repeat(bmm, equation, shapes, repeated,
                                                            axis, groups):
    """Value and both gradients (the un-repeated operand's summed over its groups by the
    contraction itself) within the contraction's roundings of Keras's repeat and einsum."""
    xs = [tf.random.normal(s, seed=i + 1) for i, s in enumerate(shapes)]

    def stock(*xs):
        xs = list(xs)
        xs[repeated] = tf.repeat(xs[repeated], groups, axis=axis)
        return tf.einsum(equation, *xs)

    got = _gradients(lambda *v: stage.grouped_contraction(equation, v, repeated, axis, groups,
                                                          bmm=bmm), *xs)
    want = _gradients(stock, *xs)
    assert got[0].shape == want[0].shape
    for i, (g, w) in enumerate(zip(got, want)):
        assert_within_rounding(g, w, 2 * 8 * groups, what=f"output {i}")


@pytest.mark.parametrize("equation", ["bik,bjk->bij", "bki,bkj->bji", "ij,jk->ik",
                                      "abcd,aecd->acbe", "abcd,adbe->acbe", "abc,bd->adc"])
def test_batched_matmul_is_the_einsum(equation):
    (la, lb), _ = stage.parse(equation)
    sizes = dict(zip("abcdeijk", (2, 3, 4, 5, 6, 3, 4, 5)))
    a, b = (tf.random.normal([sizes[c] for c in labels], seed=s)
            for s, labels in ((1, la), (2, lb)))
    got = _gradients(lambda x, y: stage.batched_matmul(equation, x, y), a, b)
    want = _gradients(lambda x, y: tf.einsum(equation, x, y), a, b)
    for g, w in zip(got, want):
        assert_within_rounding(g, w, 12)


def _padding(batch: int, keys: int) -> tf.Tensor:
    keep = np.ones((batch, 1, 1, keys), bool)
    keep[0, ..., -2:] = False
    return tf.constant(keep)


@pytest.mark.parametrize("bmm", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("masks", ["none", "causal", "padding", "padding causal bias"])
def test_grouped_dot_product_attention_is_kerass(bmm, dtype, masks):
    dot_product_attention = private_api.get("keras.backend_nn").dot_product_attention

    q = tf.cast(tf.random.normal([2, 5, 4, 3], seed=1), dtype)
    k, v = (tf.cast(tf.random.normal([2, 5, 2, 3], seed=s), dtype) for s in (2, 3))
    mask = _padding(2, 5) if "padding" in masks else None
    bias = tf.random.normal([1, 4, 5, 5], seed=4) if "bias" in masks else None
    causal = "causal" in masks

    def grouped(q, k, v):
        return stage.grouped_dot_product_attention(q, k, v, bias, mask, causal, 0.5, 2, bmm)

    def stock(q, k, v):  # Keras repeats the two key/value heads itself
        return dot_product_attention(q, k, v, bias=bias, mask=mask, scale=0.5,
                                     is_causal=causal)

    got, want = _gradients(grouped, q, k, v), _gradients(stock, q, k, v)
    for i, (g, w) in enumerate(zip(got, want)):
        # the scores' and the sum's terms, the softmax's, each rounded in the dtype
        assert_within_rounding(g, w, 2 * (3 + 5 + TRANSCENDENTAL + 4), dtype=dtype,
                               what=f"output {i}")


# -- keras_hub's Llama: 2 layers, 4 query heads on 2 key/value heads, a padding mask ----------
VOCAB, TOKENS = 64, 8


def _llama() -> keras.Model:
    keras_hub = optional.keras_hub()

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=32, intermediate_dim=64)
    inputs = {"token_ids": keras.Input((TOKENS,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((TOKENS,), dtype="int32", name="padding_mask")}
    model = keras.Model(inputs, keras.layers.Dense(VOCAB)(backbone(inputs)))
    model.compile(keras.optimizers.SGD(0.05),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _llama_data(n: int = 16) -> tuple[dict, np.ndarray]:
    rng = np.random.default_rng(0)
    padding = np.ones((n, TOKENS), "int32")
    padding[: n // 2, -3:] = 0
    return ({"token_ids": rng.integers(0, VOCAB, (n, TOKENS)).astype("int32"),
             "padding_mask": padding}, rng.integers(0, VOCAB, (n, TOKENS)))


# A step: projections and feed-forward sums (32 and 64 terms), scores and the weighted sum (8
# each), softmax, norms and the logits' softmax, forward and backward; 4 steps.
LLAMA_FIT = 4 * 3 * (2 * 64 + 2 * 32 + 2 * TOKENS + 3 * TRANSCENDENTAL + VOCAB + 40)


def _scope_ran(fn, form: stage.Form) -> set[str]:
    scope = f"/{stage.FORMS.scope_of(form)}/"
    return {n.op for n in nodes_that_ran(fn) if scope in n.name}


def _repeat_gradients(fn) -> list[str]:
    """Nodes of the repeats' gradients in the traced step."""
    return [n.name for n in nodes_that_ran(fn)
            if n.name.startswith("gradient_tape/") and "/Repeat/" in n.name]


@pytest.mark.parametrize("form", ["grouped bmm", "grouped einsum"])
def test_llama_fit_matches_stock_with_the_grouped_contraction_in_the_graph_that_ran(
        monkeypatch, form):
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, stage.FAMILY, strict=True))
    x, y = _llama_data()
    models, initial = fit_stock_and_tfmx(_llama, x, y, [stage.FAMILY])
    stats = tfmx.report().patterns[stage.FAMILY]
    label = stage.FORMS[form].label
    assert stats.fused_kinds == {label: 4} and not stats.declined, stats.as_dict()  # 2 layers
    assert stats.observed[label] >= 4
    assert stage.FORMS[form].marks & _scope_ran(models[True].train_function, stage.FORMS[form])
    # nothing differentiates the repeats: their outputs are read by nobody
    assert _repeat_gradients(models[False].train_function)
    assert not _repeat_gradients(models[True].train_function)
    assert_models_within_rounding(models[False], models[True], initial, LLAMA_FIT)


def test_the_repeats_do_not_run_in_the_fused_step(tmp_path):
    """Under the profiler, one step of stock runs the repeats' kernels; tfmx's runs none
    (pruned: nothing reads them)."""
    x, y = _llama_data(8)
    ran = {}
    for on in (False, True):
        tfmx.enable(backend="cpu", patterns=[stage.FAMILY], guard=False) if on else \
            tfmx.disable()
        model = _llama()
        model.train_on_batch(x, y)
        ran[on] = {name for name, _ in profiled_ops(lambda m=model: m.train_on_batch(x, y),
                                                     tmp_path / str(on))}
    assert tfmx.report().patterns[stage.FAMILY].fused == 4
    assert any("/Repeat/" in name for name in ran[False])
    assert not any("/Repeat/" in name for name in ran[True]), sorted(
        n for n in ran[True] if "/Repeat/" in n)


def mixed_llama_fit(monkeypatch, family: str, form: str, fused: int) -> None:
    """The tiny Llama trained under mixed_bfloat16, stock and with ``family`` taking ``form``:
    ``fused`` calls fused, and tfmx's fit no further from the float32 fit than stock's."""
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, family, strict=True))
    x, y = _llama_data()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        models, initial = fit_stock_and_tfmx(_llama, x, y, [family])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert tfmx.report().patterns[family].fused == fused
    reference = fit_float32_reference(_llama, x, y)
    assert_no_further_from_float32(reference, models[False], models[True], initial,
                                   no_further_terms(4))


def test_mixed_bfloat16_llama_fit_is_no_further_from_float32_than_stock(monkeypatch):
    mixed_llama_fit(monkeypatch, stage.FAMILY, "grouped bmm", 4)


# -- Keras's GroupQueryAttention ------------------------------------------------------------
def _gqa(causal: bool, dropout: float = 0.0) -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((T, D))
    x = keras.layers.Masking(0.0)(inp)
    attended = keras.layers.GroupQueryAttention(HEAD_DIM, HEADS, KV, dropout=dropout, seed=3)(
        x, x, use_causal_mask=causal)
    out = keras.layers.Dense(3, activation="softmax")(
        keras.layers.GlobalAveragePooling1D()(keras.layers.Add()([x, attended])))
    model = keras.Model(inp, out)
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "sparse_categorical_crossentropy")
    return model


def _gqa_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((24, T, D)).astype("float32")
    x[:8, -2:] = 0.0  # padding the Masking layer turns into an attention mask
    return x, rng.integers(0, 3, 24)


GQA_FIT = 6 * 3 * (D + HEAD_DIM + TRANSCENDENTAL + 2 * T + HEADS * HEAD_DIM + 2 * D + 20)


@pytest.mark.parametrize("form,causal,dropout", [
    ("sdpa grouped bmm", False, 0.0), ("sdpa grouped bmm", True, 0.0),
    ("sdpa grouped einsum", True, 0.0), ("grouped bmm", True, 0.5)])
def test_grouped_query_attention_fit_matches_stock(monkeypatch, form, causal, dropout):
    """Keras's layer without dropout reaches dot_product_attention, with dropout its einsums
    (the dropout stream unchanged: the scores' dropout layer is Keras's)."""
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, stage.FAMILY, strict=True))
    x, y = _gqa_data()
    models, initial = fit_stock_and_tfmx(lambda: _gqa(causal, dropout), x, y, [stage.FAMILY])
    stats = tfmx.report().patterns[stage.FAMILY]
    label = stage.FORMS[form].label
    assert stats.fused_kinds == {label: 2 if dropout else 1}, stats.as_dict()
    assert stage.FORMS[form].marks & _scope_ran(models[True].train_function, stage.FORMS[form])
    assert not _repeat_gradients(models[True].train_function)
    assert_models_within_rounding(models[False], models[True], initial, GQA_FIT)


@pytest.mark.parametrize("causal", [False, True])
def test_mixed_bfloat16_grouped_query_attention_fit(monkeypatch, causal):
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm("sdpa grouped bmm", stage.FAMILY))
    x, y = _gqa_data()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        models, initial = fit_stock_and_tfmx(lambda: _gqa(causal), x, y, [stage.FAMILY])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert tfmx.report().patterns[stage.FAMILY].fused == 1
    reference = fit_float32_reference(lambda: _gqa(causal), x, y)
    assert_no_further_from_float32(reference, models[False], models[True], initial,
                                   no_further_terms(6))


def test_declines_with_a_reason():
    q, k = tf.zeros([2, 5, 4, 3]), tf.zeros([2, 6, 2, 3])
    found = stage.Repeat(k, 2, 2)
    assert "ellipsis" in stage.check("...uh,bkuh->buqk", (q, k), 1, found)
    assert "3 operands" in stage.check("bquh,bkuh,bkuh->buqk", (q, k, k), 1, found)
    assert "Python integer" in stage.check("bquh,bkuh->buqk", (q, k), 1,
                                           stage.Repeat(k, tf.constant(2), 2))
    assert "float64" in stage.check("bquh,bkuh->buqk", (tf.cast(q, tf.float64), k), 1, found)
    assert stage.check_dot_product(q, k, k, None, 30.0) == "attn_logits_soft_cap"


def test_other_einsums_are_kerass_and_not_counted():
    """An einsum that reads no repeat is not a match (EinsumDense, MultiHeadAttention)."""
    tfmx.enable(backend="cpu", patterns=[stage.FAMILY], guard=False)
    inp = keras.Input((T, D))
    x = keras.layers.MultiHeadAttention(2, 4)(inp, inp)
    model = keras.Model(inp, keras.layers.EinsumDense("btd,dk->btk", (T, 3))(x))
    model.compile("sgd", "mse")
    model.fit(np.ones((4, T, D)), np.ones((4, T, 3)), verbose=0)
    stats = tfmx.report().patterns.get(stage.FAMILY)
    assert stats is None or not stats.matched, stats.as_dict()


@pytest.mark.parametrize("plugin,dtype,forms", [
    ("tensorflow-metal", "float16", ["grouped bmm", "sdpa grouped bmm"]),
    ("tensorflow-metal", "bfloat16", ["grouped bmm", "sdpa grouped bmm"]),
    ("tensorflow-metal-plugin", "float16", ["grouped bmm", "sdpa grouped bmm"]),
    ("tensorflow-metal-plugin", "bfloat16", []),
])
def test_metal_plan_per_plugin(plugin, dtype, forms):
    """Neither plugin has an Einsum kernel: the batched-MatMul forms are the plan, where the
    plugin has BatchMatMulV2 in the dtype (the open plugin has none in bfloat16)."""
    from fusion.forms import runnable_forms
    from tfmx.backends import get_backend

    metal = get_backend("metal", plugin=plugin, tensorflow="2.21.0")
    every = [stage.BMM, stage.EINSUM, stage.SDPA_BMM, stage.SDPA_EINSUM]
    assert [f.name for f in runnable_forms(metal, every, tf.as_dtype(dtype))[0]] == forms


def test_metal_plan_runs_grouped_attention_on_ops_the_plugin_has():
    """On tensorflow-metal 1.2.0 the step's fused attention emits, forward and gradient, only
    ops the plugin has a kernel for."""
    from tfmx.backends import metal_kernels

    x, y = _gqa_data()
    tfmx.enable(backend="metal", patterns=[stage.FAMILY])
    with pytest.raises(tfmx.BackendUnavailableError):
        _gqa(True).fit(x, y, batch_size=8, epochs=1, verbose=0)
    stats = tfmx.report().patterns[stage.FAMILY]
    assert stats.fused_kinds == {stage.SDPA_BMM.label: 1}, stats.as_dict()
    (trace,) = tfmx.report().traces
    emitted = {n.op for n in trace.graph_after.node if stage.SCOPE in n.name}
    assert "BatchMatMulV2" in emitted and "Einsum" not in emitted
    unlisted = {op for op in emitted if op not in metal_kernels() and len(op) > 3}
    assert unlisted <= {"Placeholder", "ExpandDims"}, unlisted
