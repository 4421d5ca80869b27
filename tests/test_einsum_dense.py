"""The einsum_dense stage: Keras EinsumDense contractions as Reshape + MatMul (+ BiasAdd), the
kernel transposed first where its axes are in another order."""

from __future__ import annotations

import keras
import numpy as np
import optional
import pytest
import tensorflow as tf
from helpers import (
    TRANSCENDENTAL,
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
    ("abc,dc->abd", ("ab", "c", "d")),         # the kernel transposed
    ("btd,ndh->btnh", ("bt", "d", "nh")),      # keras_hub Gemma's Q/K/V projections
    ("btd,hdn->btnh", ("bt", "d", "nh")),      # kept axes in another order in the kernel
    ("ibnd,hnd->ibh", ("ib", "nd", "h")),      # keras_hub XLNet's output projection
    ("abc,acd->abd", None),                    # a batch axis shared by both operands
    ("bqnh,bknh->bqkn", None),                 # attention's scores
    ("abc,cd->adb", None),                     # kept axes reordered
    ("abc,bd->acd", None),                     # contracted axis not the input's last
    ("aab,bc->ac", None),                      # a repeated letter (a diagonal)
    ("abc,cd->abcd", None),                    # nothing contracted
    ("ab,bc", None),
])
def test_split_equation(equation, split):
    assert stage.split_equation(equation) == split
    assert (stage.equation_problem(equation) is None) == (split is not None)


@pytest.mark.parametrize("equation,order", [
    ("abc,cde->abde", None), ("btnh,nhd->btd", None), ("abc,dc->abd", (1, 0)),
    ("btd,ndh->btnh", (1, 0, 2)), ("btd,hdn->btnh", (1, 2, 0)), ("ibnd,hnd->ibh", (1, 2, 0)),
])
def test_kernel_order_puts_the_contracted_axes_first_then_the_kept_in_the_outputs_order(
        equation, order):
    assert stage.kernel_order(equation) == order


@pytest.mark.parametrize("equation,why", [
    ("bqnh,bknh->bqkn", "'bn' in the input, the kernel and the output (a batch axis of both "
                        "operands: not a projection)"),
    ("abc,acd->abd", "'a' in the input, the kernel and the output"),
    ("th,ehm->etm", "the output 'etm' is not the input's kept axes in order, then the kernel's"),
    ("abc,bd->acd", "the contracted 'b' are not the input's trailing axes"),
    ("aab,bc->ac", "a letter twice in 'aab'"),
    ("abc,cde->abd", "'e' summed in one operand only"),
    ("ab,c->abc", "nothing contracted"),
    ("ab,...c->a...c", "an ellipsis in the kernel"),
    ("ab,bc", "not 'input,kernel->output'"),
])
def test_declined_equations_say_why(equation, why):
    assert stage.split_equation(equation) is None
    assert why in stage.equation_problem(equation)


CASES = {  # name: (equation, output shape, bias_axes, activation, input shape)
    "query_projection": ("abc,cde->abde", (5, 2, 3), "de", None, (4, 5, 6)),
    "output_projection": ("abcd,cde->abe", (5, 6), "e", None, (4, 5, 2, 3)),
    "dense_relu": ("ab,bc->ac", (7,), "c", "relu", (4, 6)),
    "ellipsis_gelu": ("...b,bc->...c", (7,), "c", "gelu", (2, 3, 6)),
    "partial_bias": ("abc,cde->abde", (5, 2, 3), "e", None, (4, 5, 6)),
    "leading_bias": ("abc,cde->abde", (5, 2, 3), "d", "tanh", (4, 5, 6)),
    "no_bias_softmax": ("abc,cde->abde", (5, 2, 3), None, "softmax", (4, 5, 6)),
    # kernels whose axes are transposed to [contracted, kept] first
    "gemma_query": ("btd,ndh->btnh", (5, 2, 3), None, None, (4, 5, 6)),
    "gemma_query_bias": ("btd,ndh->btnh", (5, 2, 3), "nh", "relu", (4, 5, 6)),
    "head_bias": ("btd,hdn->btnh", (5, 2, 3), "h", None, (4, 5, 6)),
    "transposed_gelu": ("abc,dc->abd", (5, 7), "d", "gelu", (4, 5, 6)),
    "xlnet_output": ("ibnd,hnd->ibh", (5, 7), "h", None, (4, 5, 2, 3)),
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
    # a kernel in another order is transposed once (and its gradient transposed back)
    assert ("Transpose" in ops) == (stage.kernel_order(equation) is not None)
    contracted = int(np.prod(shape[len(shape) - len(stage.split_equation(equation)[1]):]))
    rows = int(np.prod(shape)) // contracted
    for i, (got, expected) in enumerate(zip(run(True), run(False))):
        # the products sum over the contracted axes (forward, input gradient) or the rows
        # (kernel gradient); the activation, its gradient and the loss's sin around them
        terms = (contracted if i < 2 else rows) + 3 * TRANSCENDENTAL + 10
        assert_within_rounding(got.numpy(), expected.numpy(), terms, what=f"{name} output {i}")


@pytest.mark.parametrize("name,policy", [
    *((name, "mixed_bfloat16") for name in ("query_projection", "output_projection",
                                             "leading_bias", "gemma_query_bias", "head_bias")),
    ("query_projection", "mixed_float16"), ("gemma_query_bias", "mixed_float16")])
def test_16_bit_matmul_form_and_its_gradient_match_keras(name, policy):
    """In a mixed_bfloat16 (mixed_float16) call: both forms contract 16-bit operands with
    float32 sums and round each op's result to 16 bits, so they agree within a few 16-bit
    roundings, not one per product; Keras's kernel gradient adds one per batch row (its
    broadcast BatchMatMulV2's per-row MatMuls, summed in 16 bits). A kernel's Transpose
    moves values without rounding them."""
    from fusion.stage import autocast

    _, _, _, activation, shape = CASES[name]
    layer, x = _case(name, policy)
    dtype = layer.compute_dtype

    @tf.function
    def run(fused: bool):
        with tf.GradientTape() as tape:
            tape.watch(x)
            if fused:
                with autocast(dtype):  # as inside the layer's call
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
        assert_within_rounding(got.numpy(), expected.numpy(), terms, dtype=dtype,
                               what=f"{name} output {i}")


def test_declines_with_a_reason():
    x = tf.zeros([2, 3, 4])
    reordered = keras.layers.EinsumDense("abc,cd->adb", (5, 3))
    reordered.build(x.shape)
    assert "is not one MatMul of the input's trailing axes with the kernel's: the output " \
        "'adb' is not" in stage.find_einsum_dense(reordered, x)
    transposed = keras.layers.EinsumDense("abc,dc->abd", (3, 5))
    transposed.build(x.shape)
    assert stage.find_einsum_dense(transposed, x) is None
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
    models, initial = fit_stock_and_tfmx(_model, x, y, ["einsum_dense", "contraction"])
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
        models, initial = fit_stock_and_tfmx(_model, x, y,
                                             ["einsum_dense", "contraction", "bias_grad"])
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


# -- kernels in another order: Keras's layer and keras_hub's Gemma, trained -----------------------
def _permuted_model() -> keras.Model:
    """Gemma's query projection (``btd,ndh->btnh``: the contracted axis the kernel's middle
    one; here with a bias over the heads and an activation), its output projection (in
    tensordot order) and an ``EinsumDense`` of a transposed kernel (``abc,dc->abd``)."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((T, D))
    x = keras.layers.EinsumDense("btd,ndh->btnh", (T, 2, 4), bias_axes="nh",
                                 activation="relu")(inp)
    x = keras.layers.EinsumDense("btnh,nhd->btd", (T, D))(x)
    x = keras.layers.EinsumDense("abc,dc->abd", (T, 16), bias_axes="d", activation="gelu")(x)
    out = keras.layers.Dense(3, activation="softmax")(keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    return model


def _data() -> tuple:
    rng = np.random.default_rng(3)
    return rng.standard_normal((24, T, D)).astype("float32"), rng.integers(0, 3, 24)


def _matmul_form(model: keras.Model, forward: bool = True) -> list:
    """The nodes of the MatMul form in ``model``'s train step that ran: the forward's, or
    (``forward=False``) the gradient's."""
    from fusion.family import GRADIENT_SCOPES

    scope = stage.FORMS.scope_of(stage.MATMUL)
    return [n for n in nodes_that_ran(model.train_function) if scope in n.name and
            forward != n.name.startswith(GRADIENT_SCOPES)]


def test_fit_of_kernels_in_another_order_matches_stock_with_one_matmul_each():
    x, y = _data()
    models, initial = fit_stock_and_tfmx(_permuted_model, x, y, ["einsum_dense", "contraction"])
    stats = tfmx.report().patterns["einsum_dense"]
    assert stats.fused == 3 and not stats.declined, stats.as_dict()
    assert stats.fused_kinds == {stage.MATMUL.label: 3}
    forward = [n.op for n in _matmul_form(models[True])]
    # one MatMul per layer (fused with its bias and activation); the two kernels in another
    # order transposed once each, their gradients transposed back to the kernels' layout
    assert sum(op in ("MatMul", "_FusedMatMul") for op in forward) == 3, forward
    assert forward.count("Transpose") == 2, forward
    assert [n.op for n in _matmul_form(models[True], False)].count("Transpose") == 2
    # 6 steps: the three contractions (D, 8, D terms), their activations, pooling (T), the
    # Dense (16); backward twice that
    step = 3 * (2 * D + 8 + 2 * TRANSCENDENTAL + T + 16 + 30)
    assert_models_within_rounding(models[False], models[True], initial, 6 * step)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_fit_of_kernels_in_another_order_is_no_further_from_float32(policy):
    x, y = _data()
    dtype = policy.split("_")[1]
    keras.mixed_precision.set_global_policy(policy)
    try:
        models, initial = fit_stock_and_tfmx(_permuted_model, x, y,
                                             ["einsum_dense", "contraction"])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    stats = tfmx.report().patterns["einsum_dense"]
    assert stats.fused == 3 and not stats.declined, stats.as_dict()
    emitted = [n for n in _matmul_form(models[True])
               if n.op in ("MatMul", "_FusedMatMul", "Transpose")]
    assert len(emitted) == 5 and {tf.as_dtype(n.attr["T"].type).name for n in emitted} == {
        dtype}
    reference = fit_float32_reference(_permuted_model, x, y)
    assert_no_further_from_float32(reference, models[False], models[True], initial,
                                   no_further_terms(6), dtype=dtype)


@pytest.mark.parametrize("where", ["handler", "emit"])
def test_a_failing_stage_leaves_keras_einsum(monkeypatch, where):
    """A failure in the stage (as it starts, or after its form was emitted: its ops in the
    graph, unread) keeps each layer's Keras call, the error reported, and the fit is stock's
    bit for bit."""
    x, y = _data()
    failing(monkeypatch.setattr, "einsum_dense", where)
    models, _ = fit_stock_and_tfmx(_permuted_model, x, y, ["einsum_dense"], strict=False)
    stats = tfmx.report().patterns["einsum_dense"]
    assert stats.fused == 0 and len(stats.errors) == 3, stats.as_dict()
    assert "injected failure" in stats.errors[0]
    assert not [n for n in nodes_that_ran(models[True].train_function)
                if "tfmx_einsum_dense" in n.name and n.op != "NoOp"]
    for a, b in zip(models[False].weights, models[True].weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


def test_gemma3_fit_runs_its_projections_as_matmuls_and_matches_stock():
    """keras_hub Gemma3 (tests/optional.py, 2 layers): its query, key and value projections
    (``btd,ndh->btnh``, ``bsd,kdh->bskh``: the kernels transposed), its output projection
    and its feed-forward's three: seven ``EinsumDense`` a layer, each one MatMul."""
    build, x, y = optional.tiny_decoder("gemma3")
    models, initial = fit_stock_and_tfmx(build, x, y, ["einsum_dense"])
    stats = tfmx.report().patterns["einsum_dense"]
    assert stats.fused == 14 and not stats.declined, stats.as_dict()
    forward = [n.op for n in _matmul_form(models[True])]
    assert forward.count("MatMul") == 14 and forward.count("Transpose") == 6, forward
    assert [n.op for n in _matmul_form(models[True], False)].count("Transpose") == 6
    losses = [models[on].history.history["loss"] for on in (False, True)]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    # 4 steps of a decoder 32 wide: the embeddings' scale, the norms, the projections (32
    # terms), the attention (8 tokens, softmax), the GeGLU (64), the head; backward twice that
    step = 3 * (2 * 32 + 8 + 64 + 32 + 6 * TRANSCENDENTAL + 30)
    assert_models_within_rounding(models[False], models[True], initial, 4 * step)


@pytest.mark.parametrize("plugin", ["tensorflow-metal", "tensorflow-metal-plugin"])
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_the_metal_plan_runs_kernels_in_another_order_as_matmuls(plugin, policy):
    """Under each Metal plugin (a plan: nothing here ran on a Mac; no Einsum kernel there)
    every layer is the MatMul form, its kernel's Transpose and MatMul ops the plugin's, every
    node placed on the device as stock's (tests/test_metal_families.py)."""
    from test_metal_families import _check, _plan_graph

    def make() -> keras.Model:
        keras.mixed_precision.set_dtype_policy(policy)
        try:
            return _permuted_model()
        finally:
            keras.mixed_precision.set_dtype_policy("float32")

    x, y = _data()
    _check(make, x[:2], y[:2], plugin)
    plan = [n for n in _plan_graph().node if "tfmx_einsum_dense" in n.name]
    assert "Einsum" not in {n.op for n in _plan_graph().node}
    assert sum(n.op == "Transpose" and "gradient" not in n.name for n in plan) == 2
    assert sum(n.op in ("MatMul", "_FusedMatMul") and "gradient" not in n.name
               for n in plan) == 3
