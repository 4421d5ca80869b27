"""The attention stage: MultiHeadAttention's Einsums as Transpose + BatchMatMulV2."""

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
    fit_stock_and_tfmx,
    needs_onednn,
    no_further_terms,
    nodes_that_ran,
    ops_that_ran,
    profiled_ops,
)

import tfmx
from fusion import private_api
from fusion.calls import attention as stage


def _stage_example() -> keras.Model:
    inp = keras.Input((6, 8))
    x = keras.layers.MultiHeadAttention(2, 4)(inp, inp)
    return keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(x)))


STAGE_EXAMPLE = StageExample(_stage_example, lacking="BatchMatMulV2")
"""This family's model in the stage-safety tests (tests/test_stage_safety.py)."""

T, D, HEADS, KEY_DIM = 6, 8, 2, 4


def _model(dropout: float = 0.0, causal: bool = False, masked: bool = False,
           key_dim: int = KEY_DIM) -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((T, D))
    x = keras.layers.Masking(0.0)(inp) if masked else inp
    attended = keras.layers.MultiHeadAttention(HEADS, key_dim, dropout=dropout, seed=3)(
        x, x, use_causal_mask=causal)
    return _classifier(inp, x, attended)


def _classifier(inputs, residual, attended) -> keras.Model:
    """The model of ``inputs``: ``residual + attended``, pooled, a softmax Dense; compiled."""
    x = keras.layers.Add()([residual, attended])
    out = keras.layers.Dense(3, activation="softmax")(keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model(inputs, out)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    return model


def _data():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((24, T, D)).astype("float32")
    x[:8, -2:] = 0.0  # padding the Masking layer turns into an attention mask
    return x, rng.integers(0, 3, 24)


def _fused_bmm_ran(fn, form: str) -> bool:
    """Whether a BatchMatMulV2 of ``form``'s scope (``tfmx_attention_<form>``) is in the
    graph that ran (TensorFlow's einsum may lower Keras's own to BatchMatMulV2 too)."""
    scope = f"{stage.SCOPE}_{form.replace(' ', '_')}/"
    return any(n.op == "BatchMatMulV2" and scope in n.name for n in nodes_that_ran(fn))


def _assert_fused_once_as(label: str) -> None:
    """The attention family fused one call, as ``label``, and observed it in the graph."""
    stats = tfmx.report().patterns["attention"]
    assert stats.fused == 1 and set(stats.fused_kinds) == {label}, tfmx.report()
    assert stats.observed[label] >= 1


def _assert_weights_within(models: dict, terms: int) -> None:
    """The stock and tfmx fits' weights within ``terms`` roundings of each other."""
    for a, b in zip(models[False].weights, models[True].weights):
        assert_within_rounding(b.numpy(), a.numpy(), terms, what=a.name)


# A step: the projections (D terms), the scores (KEY_DIM), softmax over T (TRANSCENDENTAL + T),
# the weighted sum (T), the output projection, pooling and the Dense; backward twice that;
# 6 steps (2 epochs of 3 batches).
STEP = 3 * (D + KEY_DIM + TRANSCENDENTAL + 2 * T + HEADS * KEY_DIM + T + 2 * D + 20)
FIT = 6 * STEP


@pytest.mark.parametrize("form,dropout,causal,masked", [
    ("bmm", 0.0, False, False),
    ("bmm", 0.0, True, True),
    ("bmm folded", 0.0, True, False),
    ("bmm dropout", 0.5, True, True),
])
def test_fit_matches_stock_with_batched_matmuls_in_the_graph_that_ran(monkeypatch, form, dropout,
                                                                      causal, masked):
    """Parity of each form, with masks and causal masks; with dropout the random masks must be
    the stock ones (a different stream would move the weights far outside the rounding)."""
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, "attention"))
    x, y = _data()
    models = {}
    for on in (False, True):
        tfmx.enable(backend="cpu", patterns=["attention"]) if on else tfmx.disable()
        model = _model(dropout, causal, masked)
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        models[on] = model
    assert _fused_bmm_ran(models[True].train_function, form)
    _assert_fused_once_as(stage.FORMS[form].label)
    _assert_weights_within(models, FIT)


def test_timing_the_dropout_forms_leaves_the_layers_random_stream_where_it_was():
    """The tuner's candidates (Keras's attention and the dropout form, training) draw their
    masks from a fixed seed: timing them never moves the layer's seed generator, so a fit
    whose decision is measured draws the stock fit's masks."""
    tfmx.disable()
    layer = keras.layers.MultiHeadAttention(HEADS, KEY_DIM, dropout=0.5, seed=3)
    layer(np.zeros((2, T, D), "float32"), np.zeros((2, T, D), "float32"))
    shape = [2, T, HEADS, KEY_DIM]
    candidates = stage._candidates(None, layer,
                                   keras.layers.MultiHeadAttention._compute_attention,
                                   [shape] * 3, tf.float32, False, [stage.BMM_DROPOUT])
    seed = layer._dropout_layer.seed_generator
    before = seed.state.numpy()
    assert set(candidates) == {stage.CONSERVATIVE.name, stage.BMM_DROPOUT.name}
    for make in candidates.values():
        run = make()
        run()
        run()
    np.testing.assert_array_equal(seed.state.numpy(), before)
    assert layer._dropout_layer.seed_generator is seed


def test_forms_match_keras_dot_product_attention_and_its_gradient():
    _dot_product_attention_xla = private_api.get("keras.dot_product_attention_xla")

    q, k, v = (tf.random.normal([3, 5, 2, 4], seed=s) for s in (1, 2, 3))
    keep = np.random.default_rng(0).random((3, 1, 5, 5)) > 0.3
    keep[0, 0, 2, :] = False  # a row masked entirely: Keras's softmax of it is uniform
    mask = tf.constant(keep)

    def grads(fn):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = fn()
            loss = tf.reduce_sum(out * tf.sin(out))
        return [out, *tape.gradient(loss, [q, k, v])]

    expected = grads(lambda: _dot_product_attention_xla(q, k, v, None, mask, True, 0.5))
    for folded in (False, True):
        got = grads(lambda folded=folded: stage.attention(q, k, v, mask, True, 0.5,
                                                          folded=folded))
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_within_rounding(g.numpy(), e.numpy(), 4 * (4 + 5 + TRANSCENDENTAL + 5),
                                   what=f"folded={folded} output {i}")


# Roundings between the folded form and Keras's order in bfloat16: the query rounded once
# more after its scale moves each score by up to one rounding of its terms, which the softmax
# and the weighted sum carry to the output and the gradients (measured 0.7-4.2 at H = 32,
# oneDNN on and off).
FOLDED_BF16_TERMS = 6


def _bfloat16_attention(causal: bool, masked: bool) -> dict:
    """Keras's attention and both forms in bfloat16 at H = 32: name -> [output, dq, dk, dv]
    (float64 arrays) under a linear loss."""
    _dot_product_attention_xla = private_api.get("keras.dot_product_attention_xla")

    q, k, v = (tf.cast(tf.random.normal([4, 16, 2, 32], seed=s) * 2, tf.bfloat16)
               for s in (1, 2, 3))
    mask = tf.constant(np.random.default_rng(0).random((4, 1, 16, 16)) > 0.3) if masked \
        else None
    w = tf.random.normal([4, 16, 2, 32], seed=7)
    scale = 1 / np.sqrt(32)

    def grads(fn):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = fn()
            loss = tf.reduce_sum(tf.cast(out, tf.float32) * w)
        return [tf.cast(t, tf.float64).numpy() for t in (out, *tape.gradient(loss, [q, k, v]))]

    return {"keras": grads(lambda: _dot_product_attention_xla(q, k, v, None, mask, causal,
                                                               scale)),
            **{form: grads(lambda form=form: stage.attention(
                q, k, v, mask, causal, scale, folded=form == "bmm folded"))
               for form in ("bmm", "bmm folded")}}


CASES_BF16 = [(True, False), (False, True), (True, True)]


@needs_onednn("on")
@pytest.mark.parametrize("causal,masked", CASES_BF16)
def test_bfloat16_bmm_form_is_keras_bit_for_bit_on_onednn(causal, masked):
    """With oneDNN's kernels (Einsum and BatchMatMul alike) the ``bmm`` form is Keras's
    bfloat16 arithmetic exactly, forward and gradients. (Eigen's bfloat16 Einsum and
    BatchMatMul, oneDNN off, accumulate differently from each other; so does TensorFlow
    where it leaves bfloat16 to Eigen with oneDNN on, on a CPU without AVX-512.)"""
    from tfmx.machine import read_cpuinfo

    if "avx512f" not in read_cpuinfo()[1]:
        pytest.skip("no AVX-512: TensorFlow runs bfloat16 MatMuls on Eigen here")
    got = _bfloat16_attention(causal, masked)
    for i, (g, e) in enumerate(zip(got["bmm"], got["keras"])):
        np.testing.assert_array_equal(g, e, err_msg=f"output {i}")


@pytest.mark.parametrize("causal,masked", CASES_BF16)
def test_bfloat16_folded_form_is_within_roundings_of_keras_order(causal, masked):
    """``bmm folded`` rounds the scaled query to bfloat16: within :data:`FOLDED_BF16_TERMS`
    roundings of the ``bmm`` form (Keras's order, on the same kernels)."""
    got = _bfloat16_attention(causal, masked)
    for i, (f, g) in enumerate(zip(got["bmm folded"], got["bmm"])):
        assert_within_rounding(f, g, FOLDED_BF16_TERMS, dtype="bfloat16", what=f"output {i}")


def test_mixed_bfloat16_fit_with_the_folded_form_in_the_graph_that_ran(monkeypatch):
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm("bmm folded", "attention",
                                                          strict=True))
    x, y = _data()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        models, initial = fit_stock_and_tfmx(lambda: _model(causal=True, key_dim=6), x, y,
                                             ["attention"])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert "BatchMatMulV2" in ops_that_ran(models[True].train_function)
    _assert_fused_once_as(stage.FORMS["bmm folded"].label)
    # 6 steps; the folded form rounds the scaled query once more
    reference = fit_float32_reference(lambda: _model(causal=True, key_dim=6), x, y)
    assert_no_further_from_float32(reference, models[False], models[True], initial,
                                   no_further_terms(6, extra=1))


def _needs_exact_bfloat16_softmax() -> None:
    if not stage.bfloat16_softmax_exact():
        pytest.skip("this process's bfloat16 softmax rounds otherwise than Keras's float32 "
                    "one (oneDNN off: Eigen rounds every op): the form is not offered")


@needs_onednn("either")
def test_the_bfloat16_softmax_form_is_offered_where_its_softmax_is_keras(monkeypatch):
    """Offered for unmasked bfloat16 on cpu with XLA where the probe finds the bfloat16
    softmax giving Keras's bits; the probe agrees with a direct comparison at another shape."""
    from fusion.pattern import PlainTarget
    from fusion.stage import StageContext

    scores = tf.cast(tf.random.normal([3, 2, 40, 24], seed=5) * 3.0, tf.bfloat16)
    same = np.array_equal(
        tf.nn.softmax(scores).numpy().view(np.uint16),
        tf.cast(tf.nn.softmax(tf.cast(scores, tf.float32)), tf.bfloat16).numpy().view(np.uint16))
    layer = keras.layers.MultiHeadAttention(HEADS, KEY_DIM)
    cpu = StageContext(PlainTarget("cpu"), xla=True)
    query = tf.zeros([2, T, HEADS, KEY_DIM], tf.bfloat16)
    offered = stage.SOFTMAX_16 in stage._forms(cpu, layer, query, True)  # noqa: SLF001
    assert offered == stage.bfloat16_softmax_exact()
    if stage.bfloat16_softmax_exact():  # eager oneDNN ops: compared where the probe passed
        assert same or not offered
    assert stage.SOFTMAX_16 not in stage._forms(cpu, layer, query, False)  # noqa: SLF001
    assert stage.SOFTMAX_16 not in stage._forms(  # noqa: SLF001
        cpu, layer, tf.zeros([2, T, HEADS, KEY_DIM]), True)
    assert stage.SOFTMAX_16 not in stage._forms(  # noqa: SLF001
        StageContext(PlainTarget("cpu"), xla=False), layer, query, True)
    with pytest.raises(ValueError, match="without a mask"):
        stage.attention(query, query, query, None, True, 0.5, folded=True, narrow_softmax=True)


def test_the_bfloat16_softmax_is_kerass_forward_and_rounds_its_gradient_once_more():
    """Forward: Keras's bits (the float32 softmax cast back). Gradient: TensorFlow's softmax
    gradient in float32 from the bfloat16 probabilities, within two bfloat16 roundings of
    Keras's (its own and the probabilities')."""
    _needs_exact_bfloat16_softmax()
    scores = tf.cast(tf.random.normal([4, 2, 16, 16], seed=1) * 3.0, tf.bfloat16)
    w = tf.random.normal([4, 2, 16, 16], seed=2)

    @tf.function(autograph=False)
    def run(narrow: bool):
        with tf.GradientTape() as tape:
            tape.watch(scores)
            probs = stage.bfloat16_softmax(scores) if narrow else tf.cast(
                tf.nn.softmax(tf.cast(scores, tf.float32)), tf.bfloat16)
            loss = tf.reduce_sum(tf.cast(probs, tf.float32) * w)
        return probs, tape.gradient(loss, scores)

    (p16, g16), (p, g) = run(True), run(False)
    np.testing.assert_array_equal(p16.numpy().view(np.uint16), p.numpy().view(np.uint16))
    scale = float(np.max(np.abs(w.numpy())))  # |dl| <= 2 max |w| p; the sum's terms: 16
    assert_within_rounding(tf.cast(g16, tf.float64).numpy(), tf.cast(g, tf.float64).numpy(),
                           2 + 16, dtype="bfloat16", scale=scale, what="gradient")


def test_mixed_bfloat16_fit_with_the_bfloat16_softmax_in_the_graph_that_ran(monkeypatch,
                                                                           tmp_path):
    _needs_exact_bfloat16_softmax()
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(stage.SOFTMAX_16.name, "attention",
                                                          strict=True))
    x, y = _data()
    build = lambda: _model(key_dim=6)  # noqa: E731 - no mask: the form's domain
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        models, initial = fit_stock_and_tfmx(build, x, y, ["attention"])
        fused = models[True]
        ran = profiled_ops(lambda: fused.fit(x, y, batch_size=8, epochs=1, verbose=0,
                                             shuffle=False), tmp_path)
        models[False].fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    scope = f"{stage.FORMS.scope_of(stage.SOFTMAX_16)}/"
    assert any(scope in name and "Softmax" in kernel for name, kernel in ran), sorted(ran)
    stats = tfmx.report().patterns["attention"]  # one call per trace (fit traced twice)
    label = stage.SOFTMAX_16.label
    assert stats.fused >= 1 and set(stats.fused_kinds) == {label}, tfmx.report()
    assert stats.observed[label] >= 1
    # 9 steps (3 epochs of 3 batches); the folded query's rounding and the probabilities'
    # in the gradient
    reference = fit_float32_reference(build, x, y, epochs=3)
    assert_no_further_from_float32(reference, models[False], models[True], initial,
                                   no_further_terms(9, extra=2))


TK, VALUE_DIM = 4, 3  # the context's length and the value heads' width (cross-attention)


def _cross_model(dropout: float = 0.0, causal: bool = False) -> keras.Model:
    """Cross-attention: a query sequence of T steps attends to a context of TK steps (padded
    steps masked by Masking), values of another width than the keys, and an explicit
    ``attention_mask`` [batch, T, TK] besides the padding mask."""
    keras.utils.set_random_seed(0)
    queries, context = keras.Input((T, D)), keras.Input((TK, D + 2))
    allowed = keras.Input((T, TK), dtype="bool")
    keyed = keras.layers.Masking(0.0)(context)
    attended = keras.layers.MultiHeadAttention(HEADS, KEY_DIM, value_dim=VALUE_DIM,
                                               dropout=dropout, seed=3)(
        queries, keyed, keyed, attention_mask=allowed, use_causal_mask=causal)
    return _classifier([queries, context, allowed], queries, attended)


def _cross_data():
    rng = np.random.default_rng(2)
    queries = rng.standard_normal((24, T, D)).astype("float32")
    context = rng.standard_normal((24, TK, D + 2)).astype("float32")
    context[:8, -1:] = 0.0  # a padded context step
    allowed = rng.random((24, T, TK)) > 0.25
    allowed[:, :, 0] = True  # every query sees a step, the one Masking never hides
    return [queries, context, allowed], rng.integers(0, 3, 24)


# A step: the projections (D + 2 terms), the scores (KEY_DIM), softmax over TK, the weighted
# sum (TK), the output projection (HEADS * VALUE_DIM), pooling and the Dense; backward twice
# that; 6 steps.
CROSS_FIT = 6 * 3 * (D + 2 + KEY_DIM + TRANSCENDENTAL + 2 * TK + HEADS * VALUE_DIM + T
                     + 2 * D + 20)


@pytest.mark.parametrize("form,dropout,causal", [
    ("bmm", 0.0, False),
    ("bmm folded", 0.0, True),
    ("bmm dropout", 0.5, False),
])
def test_cross_attention_fit_matches_stock_with_batched_matmuls_in_the_graph_that_ran(
        monkeypatch, form, dropout, causal):
    """Cross-attention (query and context of different lengths, values of another width than
    the keys, an explicit attention mask with the context's padding mask, the causal mask over
    a rectangular score matrix, dropout's random stream) trains as stock does."""
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, "attention", strict=True))
    x, y = _cross_data()
    models, _ = fit_stock_and_tfmx(lambda: _cross_model(dropout, causal), x, y, ["attention"])
    assert _fused_bmm_ran(models[True].train_function, form)
    _assert_fused_once_as(stage.FORMS[form].label)
    _assert_weights_within(models, CROSS_FIT)


def test_declines_with_a_reason():
    layer = keras.layers.MultiHeadAttention(2, 4, attention_axes=(1, 2))
    q = tf.zeros([2, 3, 3, 2, 4])
    assert "attention_axes" in stage.check(layer, q, False)
    assert "return_attention_scores" in stage.check(layer, tf.zeros([2, 3, 2, 4]),
                                                              True)


def test_metal_plan_runs_attention_on_ops_the_plugin_has():
    """Einsum is not among tensorflow-metal 1.2.0's kernels; every op the stage emits, forward
    and gradient, is (names of three letters or fewer cannot appear in its strings-based list)."""
    from tfmx.backends import metal_kernels

    x, y = _data()
    tfmx.enable(backend="metal", patterns=["attention"])
    model = _model(causal=True, masked=True)
    with pytest.raises(tfmx.BackendUnavailableError):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    (trace,) = tfmx.report().traces
    emitted = {n.op for n in trace.graph_after.node if "tfmx_attention" in n.name}
    assert "BatchMatMulV2" in emitted and "Einsum" not in emitted
    assert "Einsum" not in metal_kernels()
    unlisted = {op for op in emitted if op not in metal_kernels() and len(op) > 3}
    # TensorFlow's core registers ExpandDims (a shape op) for every device type
    assert unlisted <= {"Placeholder", "ExpandDims"}, unlisted


class _SelfAttention(keras.layers.Layer):
    """A user's layer calling keras.ops.dot_product_attention (grouped heads, a bias)."""

    def __init__(self, causal: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.causal = causal

    def build(self, shape):
        self.q = self.add_weight(shape=(D, 2 * HEADS * KEY_DIM), initializer="glorot_uniform")
        self.kv = self.add_weight(shape=(D, 2 * HEADS * KEY_DIM), initializer="glorot_uniform")
        self.bias = self.add_weight(shape=(1, 2 * HEADS, T, T), initializer="random_normal")

    def call(self, x):
        batch = keras.ops.shape(x)[0]
        q = keras.ops.reshape(keras.ops.matmul(x, self.q), (batch, T, 2 * HEADS, KEY_DIM))
        kv = keras.ops.reshape(keras.ops.matmul(x, self.kv), (batch, T, HEADS, 2 * KEY_DIM))
        k, v = kv[..., :KEY_DIM], kv[..., KEY_DIM:]  # two query heads per key/value head
        out = keras.ops.dot_product_attention(q, k, v, bias=self.bias, is_causal=self.causal)
        return keras.ops.reshape(out, (batch, T, 2 * HEADS * KEY_DIM))


@pytest.mark.parametrize("form", ["bmm", "bmm folded"])
@pytest.mark.parametrize("causal", [False, True])
def test_ops_dot_product_attention_matches_stock(monkeypatch, form, causal):
    from tests.test_keras import ops_that_ran
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(f"sdpa {form}", "attention"))
    x, y = _data()
    models = {}
    for on in (False, True):
        tfmx.enable(backend="cpu", patterns=["attention"], guard=False) if on else \
            tfmx.disable()
        keras.utils.set_random_seed(0)
        inp = keras.Input((T, D))
        h = _SelfAttention(causal)(inp)
        out = keras.layers.Dense(3, activation="softmax")(
            keras.layers.GlobalAveragePooling1D()(h))
        model = keras.Model(inp, out)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        models[on] = model
    assert "BatchMatMulV2" in ops_that_ran(models[True].train_function)
    assert "Einsum" not in ops_that_ran(models[True].train_function)
    label = stage.FORMS[f"sdpa {form}"].label
    _assert_fused_once_as(label)
    _assert_weights_within(models, FIT)


@needs_onednn("on")
def test_onednn_fuses_the_added_causal_mask_into_the_batched_matmul(tmp_path):
    """The mask is added (``mask_adder``), not selected: TensorFlow's oneDNN pass then runs the
    scores' MatMul, scale and mask as one ``_MklFusedBatchMatMulV2`` (seen in a profile: the
    fusion happens when the graph runs, after tracing)."""
    q, k, v = (tf.random.normal([2, 6, 2, 4], seed=s) for s in (1, 2, 3))
    run = tf.function(lambda q, k, v: stage.attention(q, k, v, None, True, 0.5))
    run(q, k, v)
    kernels = {kernel for _, kernel in profiled_ops(lambda: run(q, k, v), tmp_path)}
    assert "_MklFusedBatchMatMulV2" in kernels, sorted(kernels)
