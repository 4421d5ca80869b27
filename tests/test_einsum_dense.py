"""The einsum_dense stage: Keras EinsumDense contractions as Reshape + MatMul (+ BiasAdd)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    TRANSCENDENTAL,
    StageExample,
    assert_models_within_rounding,
    assert_no_further_from_float32,
    assert_within_rounding,
    fit_float32_reference,
    no_further_terms,
    ops_that_ran,
)

import tfmx
from fusion.calls import einsum_dense as stage

# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")


def _stage_example() -> keras.Model:
    inp = keras.Input((6, 8))
    x = keras.layers.EinsumDense("abc,cd->abd", (None, 16), bias_axes="d")(inp)
    return keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(x)))


STAGE_EXAMPLE = StageExample(_stage_example, lacking="MatMul")
"""This family's model in the stage-safety tests (tests/test_stage_safety.py)."""


@pytest.mark.parametrize("equation,split", [
    ("abc,cde->abde", ("ab", "c", "de")),      # MultiHeadAttention's Q/K/V projections
    ("abcd,cde->abe", ("ab", "cd", "e")),      # its output projection
    ("ab,bc->ac", ("a", "b", "c")),            # a Dense
    ("...b,bc->...c", ("...", "b", "c")),
    ("abc, cd -> abd", ("ab", "c", "d")),
    ("abc,dc->abd", None),                     # the kernel transposed
    ("abc,acd->abd", None),                    # a batch axis shared by both operands
    ("abc,cd->adb", None),                     # kept axes reordered
    ("aab,bc->ac", None),                      # a repeated letter (a diagonal)
    ("abc,cd->abcd", None),                    # nothing contracted
    ("ab,bc", None),
])
def test_split_equation(equation, split):
    assert stage.split_equation(equation) == split


CASES = {  # name: (equation, output shape, bias_axes, activation, input shape)
    "query_projection": ("abc,cde->abde", (5, 2, 3), "de", None, (4, 5, 6)),
    "output_projection": ("abcd,cde->abe", (5, 6), "e", None, (4, 5, 2, 3)),
    "dense_relu": ("ab,bc->ac", (7,), "c", "relu", (4, 6)),
    "ellipsis_gelu": ("...b,bc->...c", (7,), "c", "gelu", (2, 3, 6)),
    "partial_bias": ("abc,cde->abde", (5, 2, 3), "e", None, (4, 5, 6)),
    "leading_bias": ("abc,cde->abde", (5, 2, 3), "d", "tanh", (4, 5, 6)),
    "no_bias_softmax": ("abc,cde->abde", (5, 2, 3), None, "softmax", (4, 5, 6)),
}


def _case(name: str, policy: str = "float32") -> tuple:
    """CASES[name] built under ``policy`` with random weights, and its random input in the
    policy's compute dtype."""
    equation, output_shape, bias_axes, activation, shape = CASES[name]
    rng = np.random.default_rng(0)
    layer = keras.layers.EinsumDense(equation, output_shape, bias_axes=bias_axes,
                                     activation=activation, dtype=policy)
    layer.build(shape)
    for v in layer.weights:
        v.assign(rng.standard_normal(v.shape) * 0.5)
    x = tf.constant(rng.standard_normal(shape), layer.compute_dtype)
    return layer, x


@pytest.mark.parametrize("name", sorted(CASES))
def test_matmul_form_and_its_gradient_match_keras(name):
    equation, _, _, _, shape = CASES[name]
    layer, x = _case(name)

    @tf.function
    def run(fused: bool):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = stage.as_matmul(layer, x) if fused else layer(x)
            loss = tf.reduce_sum(y * tf.sin(y))
        return [y, *tape.gradient(loss, [x, *layer.trainable_variables])]

    ops = {n.op for n in run.get_concrete_function(True).graph.as_graph_def().node}
    assert "MatMul" in ops and "Einsum" not in ops
    contracted = int(np.prod(layer.kernel.shape[: len(stage.split_equation(equation)[1])]))
    rows = int(np.prod(shape)) // contracted
    for i, (got, expected) in enumerate(zip(run(True), run(False))):
        # the products sum over the contracted axes (forward, input gradient) or the rows
        # (kernel gradient); the activation, its gradient and the loss's sin around them
        terms = (contracted if i < 2 else rows) + 3 * TRANSCENDENTAL + 10
        assert_within_rounding(got.numpy(), expected.numpy(), terms, what=f"{name} output {i}")


@pytest.mark.parametrize("name", ["query_projection", "output_projection", "leading_bias"])
def test_bfloat16_matmul_form_and_its_gradient_match_keras(name):
    """In a mixed_bfloat16 call: both forms contract bfloat16 operands with float32 sums and
    round each op's result to bfloat16, so they agree within a few bfloat16 roundings, not
    one per product; Keras's kernel gradient adds one per batch row (its broadcast
    BatchMatMulV2's per-row MatMuls, summed in bfloat16)."""
    from fusion.stage import autocast

    _, _, _, activation, shape = CASES[name]
    layer, x = _case(name, "mixed_bfloat16")

    @tf.function
    def run(fused: bool):
        with tf.GradientTape() as tape:
            tape.watch(x)
            if fused:
                with autocast("bfloat16"):  # as inside the layer's call
                    y = stage.as_matmul(layer, x)
            else:
                y = layer(x)
            y = tf.cast(y, tf.float32)
            loss = tf.reduce_sum(y * tf.sin(y))
        return [y, *tape.gradient(loss, [x, *layer.trainable_variables])]

    fused, keras_form = run(True), run(False)
    assert fused[0].dtype == keras_form[0].dtype
    act = TRANSCENDENTAL if activation else 0
    for i, (got, expected) in enumerate(zip(fused, keras_form)):
        # y: the product's rounding, the bias add's, the activation's; a gradient: those of
        # y and of dy (the loss's derivative in float32, cast back), its own product's, and
        # Keras's per-row sum for a kernel's or a bias's
        terms = 2 + act if i == 0 else 6 + 2 * act + (shape[0] if i >= 2 else 0)
        assert_within_rounding(got.numpy(), expected.numpy(), terms, dtype="bfloat16",
                               what=f"{name} output {i}")


def test_declines_with_a_reason():
    x = tf.zeros([2, 3, 4])
    transposed = keras.layers.EinsumDense("abc,dc->abd", (3, 5))
    transposed.build(x.shape)
    assert "not a tensordot" in stage.find_einsum_dense(transposed, x)
    quantized = keras.layers.EinsumDense("abc,cd->abd", (3, 5))
    quantized.build(x.shape)
    quantized.quantize("int8")
    assert "quantized" in stage.find_einsum_dense(quantized, x)
    plain = keras.layers.EinsumDense("abc,cd->abd", (3, 5))
    plain.build(x.shape)
    assert stage.find_einsum_dense(plain, x) is None
    assert "float64" in stage.find_einsum_dense(plain, tf.zeros([2, 3, 4], tf.float64))


T, D = 6, 8


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((T, D))
    attended = keras.layers.MultiHeadAttention(2, 4)(inp, inp, use_causal_mask=True)
    x = keras.layers.Add()([inp, attended])
    x = keras.layers.EinsumDense("abc,cd->abd", (T, 16), bias_axes="d", activation="relu")(x)
    out = keras.layers.Dense(3, activation="softmax")(keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    return model


def test_fit_matches_stock_with_fused_matmuls_in_the_graph_that_ran():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((24, T, D)).astype("float32")
    y = rng.integers(0, 3, 24)
    models = {}
    initial = [v.numpy() for v in _model().weights]
    for on in (False, True):
        tfmx.enable(backend="cpu", patterns=["einsum_dense", "contraction"]) if on else \
            tfmx.disable()
        model = _model()
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        models[on] = model
    ran = ops_that_ran(models[True].train_function)
    assert "_FusedMatMul" in ran  # the projections' MatMul + BiasAdd (+ Relu), fused
    # Einsum is left only in the attention itself (its own stage is off here): 2 forward
    (trace,) = [t for t in tfmx.report().traces if t.graph_after is not None][:1]
    projections = [n for n in trace.graph_after.node
                   if n.op == "Einsum" and "tfmx_einsum_dense" in n.name]
    assert not projections
    stats = tfmx.report().patterns["einsum_dense"]
    # the self-attention's Q/K/V as one MatMul, its output projection, the EinsumDense
    assert stats.fused == 3 and not stats.declined, stats
    assert stats.fused_kinds == {stage.SHARED.label: 1, stage.MATMUL.label: 2}
    assert stats.observed[stage.MATMUL.label] >= 2 and stats.observed[stage.SHARED.label] >= 1
    shared = [n for n in trace.graph_after.node if "tfmx_einsum_dense_shared" in n.name
              and n.op in ("MatMul", "_FusedMatMul") and not n.name.startswith("gradient")]
    assert len(shared) == 1
    # 6 steps: projections (D terms), attention (T, softmax), output projection, the
    # EinsumDense (D), pooling, the Dense; backward twice that
    step = 3 * (3 * D + 2 * T + TRANSCENDENTAL + 16 + T + 30)
    assert_models_within_rounding(models[False], models[True], initial, 6 * step)


def test_mixed_bfloat16_fit_matches_stock_with_bfloat16_matmuls():
    """Under mixed_bfloat16 (where the tuner may take the MatMul form) the
    MatMul form trains like Keras's Einsum within bfloat16 rounding, its MatMuls in bfloat16
    in the graph that ran."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((24, T, D)).astype("float32")
    y = rng.integers(0, 3, 24)
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        initial = [v.numpy() for v in _model().weights]
        models = {}
        for on in (False, True):
            tfmx.enable(backend="cpu", patterns=["einsum_dense", "contraction",
                                                 "bias_grad"]) if on else tfmx.disable()
            model = _model()
            model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
            models[on] = model
    finally:
        keras.mixed_precision.set_global_policy("float32")
    stats = tfmx.report().patterns["einsum_dense"]
    assert stats.fused == 3 and not stats.declined, stats
    (trace,) = [t for t in tfmx.report().traces if t.graph_after is not None][:1]
    emitted = [n for n in trace.graph_after.node if "tfmx_einsum_dense" in n.name
               and n.op in ("MatMul", "_FusedMatMul")]
    assert emitted and {tf.as_dtype(n.attr["T"].type).name for n in emitted} == {"bfloat16"}
    # 6 steps; the MatMul form rounds less than the Einsum (no per-row sum in bfloat16)
    reference = fit_float32_reference(_model, x, y)
    assert_no_further_from_float32(reference, models[False], models[True], initial,
                                   no_further_terms(6))


def test_metal_runs_the_matmul_form_without_tuning():
    """The Metal plugin has no Einsum kernel: with tuning off the conservative form there is
    the MatMul one, whose ops the plugin all has."""
    from tfmx.backends import metal_kernels

    tfmx.enable(backend="metal", patterns=["einsum_dense"], tune="off")
    model = _model()
    x = np.zeros((8, T, D), "float32")
    with pytest.raises(tfmx.BackendUnavailableError):
        model.fit(x, np.zeros(8, "int32"), batch_size=8, epochs=1, verbose=0)
    (trace,) = tfmx.report().traces
    emitted = {n.op for n in trace.graph_after.node if "tfmx_einsum_dense" in n.name}
    assert "MatMul" in emitted and "Einsum" not in emitted
    unlisted = {op for op in emitted if op not in metal_kernels() and len(op) > 3}
    assert unlisted <= {"Placeholder", "ExpandDims"}, unlisted


def test_shared_projection_matches_keras_and_declines_cross_attention():
    mha = keras.layers.MultiHeadAttention(3, 4, value_dim=5)
    x = tf.random.normal([2, T, D], seed=3)
    other = tf.random.normal([2, T + 1, D], seed=4)
    mha(x, x)
    assert stage.check_projections(mha, x, x, None) is None
    assert "cross-attention" in stage.check_projections(mha, x, other, None)
    assert "cross-attention" in stage.check_projections(mha, x, x, other)

    seen = []

    @tf.function
    def casts(x):  # a mixed-precision policy casts query and value one by one
        a, b, c = tf.cast(x, tf.float16), tf.cast(x, tf.float16), tf.cast(x, tf.bfloat16)
        seen.extend([stage._same_tensor(a, b), stage._same_tensor(a, c),
                     stage._same_tensor(a, x)])
        return a

    casts.get_concrete_function(tf.TensorSpec([2, T, D]))
    assert seen == [True, False, False]
    with tf.GradientTape() as tape:
        got = stage.shared_projection(mha, x)
        loss = tf.add_n([tf.reduce_sum(g * tf.sin(g)) for g in got])
    grads = tape.gradient(loss, mha.trainable_variables[:6])
    with tf.GradientTape() as tape:
        want = [mha._query_dense(x), mha._key_dense(x), mha._value_dense(x)]
        loss = tf.add_n([tf.reduce_sum(w * tf.sin(w)) for w in want])
    expected = tape.gradient(loss, mha.trainable_variables[:6])
    for g, w in zip(got + grads, want + expected):
        assert g.shape == w.shape
        assert_within_rounding(g.numpy(), w.numpy(), 4 * (2 * T * D + TRANSCENDENTAL))
