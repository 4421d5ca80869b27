"""The sibling_projections pattern: products of one input by several kernels merged into one
product (forward and gradients, a tuner decision); what is declined and why; the merged nodes in
the step that ran, and the loss and every gradient within rounding of stock's, on a functional
gated block and on keras_hub's Llama (float32 and mixed_bfloat16); an injected failure leaves
the separate products."""

import keras
import numpy as np
import optional
import pytest
import tensorflow as tf
from helpers import assert_within_rounding, nodes_that_ran

import fusion
import tfmx
from fusion.graph import GraphView
from fusion.graphs import sibling_projections
from fusion.graphs.sibling_projections import FAMILY, SCOPE, find_siblings
from fusion.pattern import RewriteAlways
from tfmx.rebuild import control_output_names, protected_names, rebuild
from tfmx.tuner import Tuner

pytestmark = pytest.mark.usefixtures("every_rewrite")


def _gated_grads(x, w1, w2):
    with tf.GradientTape() as tape:
        tape.watch([x, w1, w2])
        gated = tf.nn.silu(tf.matmul(x, w1)) * tf.matmul(x, w2)[:, :12]
        y = tf.reduce_sum(gated * tf.sin(x[:, :1]))
    return [y, *tape.gradient(y, [x, w1, w2])]


SPECS = [tf.TensorSpec([16, 8]), tf.TensorSpec([8, 12]), tf.TensorSpec([8, 20])]


def test_merged_forward_and_gradients_within_rounding(trace, cpu, rng, assert_same_numbers):
    cf, g = trace(_gated_grads, *SPECS)
    (group,), declined = find_siblings(GraphView(g.node), cpu, RewriteAlways())
    assert declined == [] and group.gradients is not None
    assert group.signature == "MatMul float32 16x8 x [12, 20] (forward and gradients)"
    res = fusion.rewrite(g, cpu, [FAMILY], protected=protected_names(cf),
                         control_outputs=control_output_names(cf))
    assert res.stats[FAMILY].fused == 1 and not res.stats[FAMILY].partial
    ops = {n.name.split(f"{SCOPE}/")[-1]: n.op for n in res.graph_def.node if SCOPE in n.name}
    assert {ops["product"], ops["input_grad"], ops["kernel_grad"]} == {"MatMul"}
    assert ops["split"] == ops["kernel_grad_split"] == "SplitV"
    # the separate input-gradient products and their sum are gone
    assert [n.op for n in res.graph_def.node].count("MatMul") == 3
    args = [tf.constant(rng.standard_normal(s.shape), tf.float32) for s in SPECS]
    assert_same_numbers(cf, res, *args, terms=40)  # dots of at most 32 terms, another order


def _declined(trace, cpu, fn, *specs):
    cf, g = trace(fn, *specs)
    return find_siblings(GraphView(g.node), cpu, RewriteAlways())


@pytest.mark.parametrize("fn, specs, reason", [
    (lambda x, w1, w2: tf.matmul(x, w1, transpose_b=True) + tf.matmul(x, w2, transpose_b=True),
     [tf.TensorSpec([4, 8]), tf.TensorSpec([6, 8]), tf.TensorSpec([6, 8])], "transposed"),
    (lambda x, w1, w2: tf.matmul(x, w1) * tf.matmul(x, w2),
     [tf.TensorSpec([4, 8]), tf.TensorSpec([8, None]), tf.TensorSpec([8, 6])], "not known"),
    (lambda x, w1, w2: tf.reduce_sum(tf.matmul(x, w2 + tf.reduce_sum(tf.matmul(x, w1)))),
     [tf.TensorSpec([4, 8]), tf.TensorSpec([8, 6]), tf.TensorSpec([8, 6])],
     "computed from a sibling's output"),
    (lambda x, w1, w2: tf.matmul(x, w1) * tf.matmul(x, w2),
     [tf.TensorSpec([4, 8], tf.float64), tf.TensorSpec([8, 6], tf.float64),
      tf.TensorSpec([8, 6], tf.float64)], "dtype float64"),
])
def test_declined_with_reason(trace, cpu, fn, specs, reason):
    found, declined = _declined(trace, cpu, fn, *specs)
    assert found == [] and len(declined) == 1 and reason in declined[0], declined


def test_products_of_different_inputs_are_no_siblings(trace, cpu):
    """A product of the input and one of its cast (another dtype, another value) are not one
    input's: nothing to merge, nothing declined."""
    found, declined = _declined(
        trace, cpu, lambda x, w1, w2: tf.matmul(x, w1) + tf.cast(
            tf.matmul(tf.cast(x, tf.bfloat16), tf.cast(w2, tf.bfloat16)), tf.float32),
        *[tf.TensorSpec([4, 8]), tf.TensorSpec([8, 6]), tf.TensorSpec([8, 6])])
    assert found == [] and declined == []


def test_kernel_gradients_merge_on_their_own_without_the_inputs(trace, cpu):
    """Without the input's gradient (only the kernels'), the forward merges (the report says
    why its gradient was not merged with it) and the kernels' gradients, products of the
    transposed input, merge as a group of their own."""
    def kernel_grads(x, w1, w2):
        with tf.GradientTape() as tape:
            tape.watch([w1, w2])
            y = tf.reduce_sum(tf.matmul(x, w1) * tf.matmul(x, w2))
        return tape.gradient(y, [w1, w2])

    cf, g = trace(kernel_grads, tf.TensorSpec([4, 8]), tf.TensorSpec([8, 6]),
                  tf.TensorSpec([8, 6]))
    res = fusion.rewrite(g, cpu, [FAMILY], protected=protected_names(cf),
                         control_outputs=control_output_names(cf))
    assert res.stats[FAMILY].fused_kinds == {
        "2 MatMul of one input -> one MatMul of the concatenated kernels": 1,
        "2 MatMul of one transposed input -> one MatMul of the concatenated output gradients": 1}
    (partial,) = res.stats[FAMILY].partial
    assert "forward only: no one input-gradient product per kernel" in partial


def test_the_tuner_decides(trace, cpu):
    """A measured decision (on this machine, either form) under the group's signature; with
    tuning off the products stay separate."""
    cf, g = trace(_gated_grads, *SPECS)
    found, declined = find_siblings(GraphView(g.node), cpu, Tuner("off"))
    assert found == [] and "separate products kept" in declined[0] and "tune=off" in declined[0]
    seen = []
    find_siblings(GraphView(g.node), cpu, Tuner("auto", None, on_decision=seen.append))
    d = seen[0]
    assert d.signature == "MatMul float32 16x8 x [12, 20] (forward and gradients)"
    assert d.source == "measured" and set(d.times_ms) == {"separate", "merged"}
    if d.choice == "separate":  # the kernels' gradients then are a group of their own
        assert seen[1].signature.startswith("MatMul float32 (16x8)^T x [")
        assert seen[1].signature.endswith("(kernel gradients)")


def test_batched_products_merge_with_their_input_gradient_and_are_timed(trace, cpu, rng,
                                                                        assert_same_numbers):
    """Keras's einsum of an EinsumDense: a BatchMatMulV2 of a rank-3 input and a rank-2 kernel,
    whose input gradient TensorFlow sums over axes computed from shapes (none here) and
    reshapes: merged with it, and timed by the tuner (the sums left out of the fragment)."""
    specs = [tf.TensorSpec([2, 8, 16]), tf.TensorSpec([16, 8]), tf.TensorSpec([16, 8])]
    cf, g = trace(_grads_of, *specs)
    seen = []
    find_siblings(GraphView(g.node), cpu, Tuner("auto", None, on_decision=seen.append))
    assert seen[0].signature == "BatchMatMulV2 float32 2x8x16 x [8, 8] (forward and gradients)"
    assert seen[0].source == "measured", seen[0]
    res = fusion.rewrite(g, cpu, [FAMILY], protected=protected_names(cf),
                         control_outputs=control_output_names(cf))
    assert res.stats[FAMILY].fused == 1 and not res.stats[FAMILY].partial
    assert any(n.name.endswith(f"{SCOPE}/input_grad") for n in res.graph_def.node)
    args = [tf.constant(rng.standard_normal(s.shape), tf.float32) for s in specs]
    # the merged input gradient is one 16-term sum of products where stock adds two 8-term
    # sums: its rounding scales with the products' magnitudes, which exceed the result's own
    assert_same_numbers(cf, res, *args, terms=64)


def _grads_of(x, w1, w2):
    with tf.GradientTape() as tape:
        tape.watch([x, w1, w2])
        y = tf.reduce_sum(tf.matmul(x, w1) * tf.matmul(x, w2) * tf.sin(x[..., :1]))
    return [y, *tape.gradient(y, [x, w1, w2])]


@pytest.mark.parametrize("x_spec, kernel, partial", [
    ([None, 16], [16, 8], None), ([None, None], [None, 8], None),
    ([None, None, 16], [16, 8], "forward only: an input gradient is not read by one sum alone"),
])
def test_unknown_sizes(trace, cpu, x_spec, kernel, partial):
    """Rows, and contracted sizes, unknown when traced: merged (the split needs the widths
    alone); a batched product whose gradient's sums are of unknown rank: forward only."""
    specs = [tf.TensorSpec(x_spec), tf.TensorSpec(kernel), tf.TensorSpec(kernel)]
    cf, g = trace(_grads_of, *specs)
    res = fusion.rewrite(g, cpu, [FAMILY], protected=protected_names(cf),
                         control_outputs=control_output_names(cf))
    stats = res.stats[FAMILY]
    assert stats.fused == 1 and list(stats.partial) == ([partial] if partial else []), stats
    new = rebuild(cf, res.graph_def, res.control_renames)
    args = [tf.random.normal([2, 3, 16][-len(x_spec):], seed=1), tf.random.normal([16, 8]),
            tf.random.normal([16, 8])]
    for got, want in zip(new(*args), cf(*args)):
        assert_within_rounding(got.numpy(), want.numpy(), 40)


@pytest.mark.parametrize("plugin, dtype, runs", [
    ("tensorflow-metal", "float32", True), ("tensorflow-metal", "float16", True),
    ("tensorflow-metal-plugin", "float16", True), ("tensorflow-metal-plugin", "bfloat16", False),
])
def test_metal_plans_merge_where_the_plugin_places_concat_and_split(trace, plugin, dtype, runs):
    """On Metal the merged form's ConcatV2 and SplitV must have the plugin's kernels in the
    dtype (a plan: nothing here ran on a Mac); otherwise the products stay, the op named."""
    from tfmx.backends import get_backend

    metal = get_backend("metal", plugin=plugin, tensorflow="2.21.0")
    cf, g = trace(_gated_grads, *[tf.TensorSpec(s.shape, dtype) for s in SPECS])
    found, declined = find_siblings(GraphView(g.node), metal, RewriteAlways())
    if runs:
        assert [m.gradients is not None for m in found] == [True] and declined == []
    else:
        assert found == [] and "no ConcatV2 kernel in bfloat16" in declined[0], declined


# -- whole steps ---------------------------------------------------------------------------------
def _gated_model(policy: str = "float32"):
    keras.utils.set_random_seed(5)
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        model_input = keras.Input((6, 8))
        inp = keras.layers.Dense(8, name="embed")(model_input)
        gate = keras.layers.Dense(16, name="gate")(inp)
        up = keras.layers.Dense(24, name="up")(inp)
        hidden = keras.layers.Multiply()([keras.layers.Activation("silu")(
            keras.layers.Dense(24, name="gate_wide")(inp)), up])
        out = keras.layers.Dense(4, dtype="float32")(keras.layers.Concatenate()([gate, hidden]))
        model = keras.Model(model_input, out)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    model.compile(keras.optimizers.SGD(1.0), "mse")
    return model


def _llama(policy: str = "float32"):
    keras_hub = optional.keras_hub()

    keras.utils.set_random_seed(1)
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        ids = keras.Input((8,), dtype="int32")
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=64, num_layers=2, num_query_heads=2, num_key_value_heads=1,
            hidden_dim=32, intermediate_dim=64)
        hidden = backbone({"token_ids": ids, "padding_mask": keras.ops.ones_like(ids)})
        out = keras.layers.Dense(10, dtype="float32")(hidden[:, -1])
        model = keras.Model(ids, out)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    model.compile(keras.optimizers.SGD(1.0),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _one_step(build, x, y, patterns):
    """The loss and every gradient (one SGD step of rate 1 from the same weights: the change
    of each variable) of stock's step and tfmx's with ``patterns``, and tfmx's model."""
    out = {}
    for on in (False, True):
        tfmx.enable(backend="cpu", patterns=patterns, guard=False) if on else tfmx.disable()
        model = build()
        before = [v.numpy() for v in model.trainable_variables]
        loss = model.fit(x, y, batch_size=len(x), epochs=1, verbose=0, shuffle=False)
        grads = [b - v.numpy() for v, b in zip(model.trainable_variables, before)]
        out[on] = (loss.history["loss"][0], grads, model)
    return out


def _assert_parity(out, terms, dtype="float32"):
    (loss, grads, model), (stock_loss, stock_grads, _) = out[True], out[False]
    assert_within_rounding(loss, stock_loss, terms, dtype, what="loss")
    for v, got, want in zip(model.trainable_variables, grads, stock_grads):
        assert_within_rounding(got, want, terms, dtype, scale=float(np.max(np.abs(want))),
                               what=v.path)


def _merged_nodes(model) -> set[str]:
    return {n.name.split(f"{SCOPE}/")[1] for n in nodes_that_ran(model.train_function)
            if f"{SCOPE}/" in n.name}


@pytest.mark.parametrize("patterns", [[FAMILY], [FAMILY, "contraction", "reshaped_bias"]])
def test_a_functional_gated_block_merges_and_trains_as_stock(patterns):
    """Three Dense on one input (two with a bias and no activation, as contraction leaves
    them fused with it or not): one product, its input gradient and its kernels' gradient in
    the step that ran, the loss and every gradient within rounding of stock's."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 6, 8)).astype("float32")
    y = rng.standard_normal((8, 6, 4)).astype("float32")
    out = _one_step(_gated_model, x, y, patterns)
    stats = tfmx.report().patterns[FAMILY]
    assert stats.fused == 1 and not stats.partial, stats
    (kind,) = stats.fused_kinds
    assert kind.startswith("3 ") and "concatenated kernels" in kind
    assert {"product", "split", "input_grad", "kernel_grad", "kernel_grad_split"} <= \
        _merged_nodes(out[True][2])
    assert not _merged_nodes(out[False][2])
    _assert_parity(out, terms=64)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_llama_merges_its_projections_and_trains_as_stock(policy):
    """keras_hub's LlamaBackbone (2 layers): per layer, the gate and up projections (Dense,
    MatMul) and the query, key and value projections (EinsumDense, a batched product) merged
    with their gradients; the loss and every gradient within the rounding of stock's."""
    optional.keras_hub()
    rng = np.random.default_rng(2)
    x = rng.integers(0, 64, (4, 8)).astype("int32")
    y = rng.integers(0, 10, (4,)).astype("int32")
    out = _one_step(lambda: _llama(policy), x, y, [FAMILY])
    stats = tfmx.report().patterns[FAMILY]
    assert stats.fused == 4 and not stats.partial, stats
    assert sorted(stats.fused_kinds.values()) == [2, 2]
    assert any(k.startswith("3 BatchMatMulV2") for k in stats.fused_kinds)
    assert {"product", "input_grad", "kernel_grad"} <= _merged_nodes(out[True][2])
    # a gradient sums 32 to 64 products per element through two layers: rounding of its sums
    _assert_parity(out, terms=256, dtype="float32" if policy == "float32" else "bfloat16")


def test_an_injected_failure_leaves_the_separate_products(monkeypatch):
    def broken(view, group):
        raise RuntimeError("injected")

    monkeypatch.setattr(sibling_projections, "rewrite_siblings", broken)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 6, 8)).astype("float32")
    y = rng.standard_normal((8, 6, 4)).astype("float32")
    out = _one_step(_gated_model, x, y, [FAMILY])
    stats = tfmx.report().patterns[FAMILY]
    assert stats.fused == 0 and any("injected" in e for e in stats.errors), stats
    assert not _merged_nodes(out[True][2])
    _assert_parity(out, terms=0)  # the step as stock's, bit for bit
