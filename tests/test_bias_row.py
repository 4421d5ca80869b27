"""The bias_row stage: a Dense's bias as one more row of its kernel (one MatMul forward, one for
the kernel's and the bias's gradients), and stage hooks chained on one method."""

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
    fit_stock_and_tfmx,
    no_further_terms,
)

import tfmx
from fusion import stage as stage_mechanism
from fusion.calls import bias_row as stage
from fusion.family import Family
from fusion.pattern import PlainTarget, RewriteAlways
from fusion.stage import autocast

# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")


def _stage_example() -> keras.Model:
    inp = keras.Input((8,))
    return keras.Model(inp, keras.layers.Dense(4)(keras.layers.Dense(16, activation="relu")(inp)))


STAGE_EXAMPLE = StageExample(_stage_example, lacking="ConcatV2")
"""This family's model in the stage-safety tests (tests/test_stage_safety.py)."""

CASES = {  # name: (units, activation, input shape)
    "tokens": (12, None, (3, 5, 8)),
    "rows_relu": (7, "relu", (6, 10)),
    "tokens_gelu": (16, "gelu", (2, 4, 6)),
}


def _layer(name: str, policy: str = "float32") -> tuple:
    units, activation, shape = CASES[name]
    rng = np.random.default_rng(0)
    layer = keras.layers.Dense(units, activation=activation, dtype=policy)
    layer.build(shape)
    for v in layer.weights:
        v.assign(rng.standard_normal(v.shape) * 0.5)
    return layer, tf.constant(rng.standard_normal(shape), layer.compute_dtype)


def _run(layer, x, fused: bool):
    @tf.function
    def run():
        with tf.GradientTape() as tape:
            tape.watch(x)
            if fused:
                compute = layer.compute_dtype
                with autocast(None if compute == layer.variable_dtype else compute):
                    y = stage.dense_with_bias_row(layer, x)  # as inside the layer's call
            else:
                y = layer(x)
            y = tf.cast(y, tf.float32)
            loss = tf.reduce_sum(y * tf.sin(y))
        return [y, *tape.gradient(loss, [x, *layer.trainable_variables])]

    return run


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_form_and_its_gradient_match_keras(name):
    layer, x = _layer(name)
    run_fused, run_keras = _run(layer, x, True), _run(layer, x, False)
    graph = run_fused.get_concrete_function().graph.as_graph_def()
    depth = x.shape[-1]
    widened = [n for n in graph.node if n.op == "MatMul" and "BiasAdd" not in n.name]
    assert widened and not [n for n in graph.node if n.op in ("BiasAdd", "AddV2")
                            and "tfmx" in n.name]
    rows = int(np.prod(x.shape[:-1]))
    for i, (got, want) in enumerate(zip(run_fused(), run_keras())):
        # y: the K-term product and the bias; dx: a units-term product; the kernel's and the
        # bias's gradients: sums over the rows; the activation and the loss's sin around them
        terms = (depth + 2, CASES[name][0], rows, rows)[i] + 3 * TRANSCENDENTAL + 10
        assert_within_rounding(got.numpy(), want.numpy(), terms, what=f"{name} output {i}")


@pytest.mark.parametrize("name", ["tokens", "tokens_gelu"])
def test_the_bfloat16_form_matches_keras(name):
    """In a mixed_bfloat16 call both forms contract bfloat16 operands in float32 and round the
    product with its bias once; the gradients round dy and each product once more."""
    layer, x = _layer(name, "mixed_bfloat16")
    fused, keras_form = _run(layer, x, True)(), _run(layer, x, False)()
    act = TRANSCENDENTAL if CASES[name][1] else 0
    for i, (got, want) in enumerate(zip(fused, keras_form)):
        assert_within_rounding(got.numpy(), want.numpy(), 2 + act if i == 0 else 6 + 2 * act,
                               dtype="bfloat16", what=f"{name} output {i}")


def test_declines_with_a_reason_and_passes_sparse_inputs_on():
    x = tf.zeros([2, 3, 4])
    plain = keras.layers.Dense(5)
    plain.build(x.shape)
    assert stage.check(plain, x) is None
    assert "float64" in stage.check(plain, tf.zeros([2, 3, 4], tf.float64))
    quantized = keras.layers.Dense(5)
    quantized.build(x.shape)
    quantized.quantize("int8")
    assert "quantized" in stage.check(quantized, x)
    sparse = tf.sparse.from_dense(tf.eye(2, 4))
    ctx = stage_mechanism.StageContext(PlainTarget("cpu"), RewriteAlways())
    calls = []

    @tf.function
    def run():
        return stage.fused_dense_call(ctx, lambda *a, **k: calls.append(a) or tf.zeros([2, 5]),
                                      plain, sparse)

    run()
    assert len(calls) == 1  # Keras's call, as it is


def _model() -> keras.Model:
    """Under the global policy but for the head, float32 as a mixed-precision model's."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 8))
    x = keras.layers.Dense(24, activation="relu")(inp)
    x = keras.layers.Dense(8, use_bias=False)(x)  # not a match: no bias
    x = keras.layers.GlobalAveragePooling1D()(x)
    out = keras.layers.Dense(3, activation="softmax", dtype="float32")(x)
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    return model


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.standard_normal((24, 6, 8)).astype("float32"), rng.integers(0, 3, 24)


def _emitted(report) -> list:
    (trace,) = [t for t in report.traces if t.graph_after is not None][:1]
    return [n for n in trace.graph_after.node if "tfmx_dense_bias_row" in n.name
            and n.op in ("MatMul", "_FusedMatMul") and not n.name.startswith("gradient")]


def test_fit_matches_stock_with_the_widened_matmuls_in_the_graph_that_ran():
    x, y = _data()
    models, initial = fit_stock_and_tfmx(_model, x, y, ["bias_row"])
    stats = tfmx.report().patterns["bias_row"]
    assert stats.fused == 2 and not stats.declined, stats  # the two Dense with a bias
    assert stats.observed[stage.BIAS_ROW.label] >= 2
    emitted = _emitted(tfmx.report())
    assert len(emitted) == 2
    # 6 steps: the Dense (8 + 2 terms), the second (24), pooling (6), the head (8 + 2), the
    # loss; backward about twice that
    step = 3 * (10 + 24 + 6 + 10 + TRANSCENDENTAL + 10)
    assert_models_within_rounding(models[False], models[True], initial, 6 * step)


def test_mixed_bfloat16_fit_is_no_further_from_float32_than_stock():
    x, y = _data()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        models, initial = fit_stock_and_tfmx(_model, x, y, ["bias_row"])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    emitted = _emitted(tfmx.report())
    assert {tf.as_dtype(n.attr["T"].type).name for n in emitted} == {"bfloat16", "float32"}
    reference = fit_float32_reference(_model, x, y)
    assert_no_further_from_float32(reference, models[False], models[True], initial,
                                   no_further_terms(6))


def test_a_feed_forward_block_is_seen_before_bias_row_rewrites_its_layers():
    """Both stages hook ``Dense.call``: feed_forward's hook runs first (``outer``), so it sees
    both layers of a block and emits its region (here, every rewrite taken), the bias-row
    form of the first layer then read by nobody."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 8))
    x = keras.layers.Dense(16, activation="gelu")(inp)
    out = keras.layers.Dense(8)(x)
    model = keras.Model(inp, out)
    model.compile(optimizer="sgd", loss="mse")
    tfmx.enable(backend="cpu", patterns=["feed_forward", "bias_row"], guard=False)
    model.fit(np.ones((8, 6, 8), "float32"), np.ones((8, 6, 8), "float32"), batch_size=8,
              epochs=1, verbose=0)
    assert tfmx.report().patterns["feed_forward"].fused == 1, tfmx.report()


def test_hooks_on_one_method_run_as_a_chain_outer_first():
    seen = []

    class Owner:
        def call(self, x):
            seen.append("method")
            return x

    def handler(name):
        def run(ctx, original, instance, x):
            seen.append(name)
            return original(instance, x)
        return run

    inner = stage_mechanism.Hook("m:Owner", "call", handler("inner"))
    outer = stage_mechanism.Hook("m:Owner", "call", handler("outer"), outer=1)
    chain = [(Family("inner", "", hooks=(inner,)), inner),  # registration order
             (Family("outer", "", hooks=(outer,)), outer)]
    method = stage_mechanism._routed(chain)(Owner.call)  # noqa: SLF001
    x = tf.ones([2])
    method(Owner(), x)
    assert seen == ["method"]  # outside a trace: the method alone
    ctx = stage_mechanism.StageContext(PlainTarget("cpu"), RewriteAlways(),
                                       families=("inner", "outer"))
    seen.clear()
    with stage_mechanism.tracing(ctx):
        method(Owner(), x)
    assert seen == ["outer", "inner", "method"]
    only_inner = stage_mechanism.StageContext(PlainTarget("cpu"), RewriteAlways(),
                                              families=("inner",))
    seen.clear()
    with stage_mechanism.tracing(only_inner):
        method(Owner(), x)
    assert seen == ["inner", "method"]


@pytest.mark.parametrize("form", ["matmul bias row", "shared bias row"])
def test_bias_row_forms_fit_like_stock_with_one_matmul_per_unit(monkeypatch, form):
    """The product this family contributes to einsum_dense (``fusion.forms.AffineForm``):
    the projections (``shared``: the self-attention's three as one) and the EinsumDense with
    their biases as a row of the kernel, one MatMul each, no BiasAdd, in the graph that ran;
    the fit within rounding of stock's."""
    from helpers import PickForm
    from test_einsum_dense import D, T, _model

    from fusion.calls import einsum_dense
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, "einsum_dense"))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((24, T, D)).astype("float32")
    y = rng.integers(0, 3, 24)
    initial = [v.numpy() for v in _model().weights]
    models = {}
    for on in (False, True):
        tfmx.enable(backend="cpu", patterns=["einsum_dense", "contraction"]) if on else \
            tfmx.disable()
        models[on] = _model()
        models[on].fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    stats = tfmx.report().patterns["einsum_dense"]
    label = einsum_dense.FORMS[form].label
    assert stats.fused_kinds[label] >= 1 and stats.observed[label]
    (trace,) = [t for t in tfmx.report().traces if t.graph_after is not None][:1]
    scope = "tfmx_einsum_dense_" + form.replace(" ", "_")
    emitted = [n for n in trace.graph_after.node if scope in n.name
               and not n.name.startswith("gradient")]
    assert {"MatMul", "ConcatV2"} <= {n.op for n in emitted}
    assert not {"BiasAdd", "_FusedMatMul"} & {n.op for n in emitted}
    step = 3 * (3 * (D + 2) + 2 * T + TRANSCENDENTAL + 16 + T + 30)
    assert_models_within_rounding(models[False], models[True], initial, 6 * step)
