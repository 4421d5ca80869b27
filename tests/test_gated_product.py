"""The gated_product stage: a gated feed-forward block's act(gate) * up (SwiGLU, GeGLU) with both
gradients in closed form, or as one XLA region, matched from the ops Keras and keras_hub call."""

from __future__ import annotations

import concurrent.futures
import re
from collections import Counter

import keras
import numpy as np
import optional
import pytest
import tensorflow as tf
from helpers import (
    TRANSCENDENTAL,
    InjectedFault,
    PickForm,
    StageExample,
    assert_models_within_rounding,
    assert_no_further_from_float32,
    assert_within_rounding,
    fit_float32_reference,
    fit_stock_and_tfmx,
    no_further_terms,
    nodes_that_ran,
    ops_that_ran,
)

import tfmx
from fusion.calls import gated_product as stage
from fusion.stage import XLA

# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")

FAMILY = stage.FAMILY


class Gated(keras.layers.Layer):
    """A user's gated feed-forward block: ``act(Dense(x)) * Dense(x)``, written as
    ``keras.ops.multiply(keras.ops.silu(g), u)`` (``"ops"``), ``keras.activations.silu(g) * u``
    (``"operator"``) or Gemma's ``keras.activations.gelu(g, approximate=True) * u``
    (``"gemma"``)."""

    def __init__(self, hidden: int = 16, way: str = "ops", **kwargs) -> None:
        super().__init__(**kwargs)
        self.way = way
        dense = dict(use_bias=False, dtype=kwargs.get("dtype"))  # the block's dtype, if given
        self.gate = keras.layers.Dense(hidden, **dense)
        self.up = keras.layers.Dense(hidden, **dense)

    def call(self, x):
        g, u = self.gate(x), self.up(x)
        if self.way == "ops":
            return keras.ops.multiply(keras.ops.silu(g), u)
        if self.way == "operator":
            return keras.activations.silu(g) * u
        return keras.activations.gelu(g, approximate=True) * u


def _stage_example() -> keras.Model:
    inp = keras.Input((8,))
    return keras.Model(inp, keras.layers.Dense(4)(Gated(16, "operator")(inp)))


STAGE_EXAMPLE = StageExample(_stage_example, lacking="Sigmoid")
"""This family's model in the stage-safety tests (tests/test_stage_safety.py)."""

KINDS = {stage.SILU: tf.nn.silu, stage.GELU: lambda v: tf.nn.gelu(v, approximate=False),
         stage.GELU_TANH: lambda v: tf.nn.gelu(v, approximate=True)}
# An activation and its derivative (a transcendental, some eight products and sums), the
# product and its two gradients; either side's, so twice
TERMS = 2 * (TRANSCENDENTAL + 8 + 3)


def _inputs(gate: str, up: str) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    rng = np.random.default_rng(0)
    g = tf.constant(rng.uniform(-6.0, 6.0, (64, 32)), gate)
    u = tf.constant(rng.standard_normal((64, 32)), up)
    dy = tf.constant(rng.standard_normal((64, 32)), up)
    return g, u, dy


def _value_and_gradients(fn, g, u, dy) -> list[np.ndarray]:
    with tf.GradientTape() as tape:
        tape.watch([g, u])
        y = fn(g, u)
    return [t.numpy().astype(np.float64) for t in (y, *tape.gradient(y, [g, u],
                                                                       output_gradients=dy))]


def _stock(kind: str):
    """Keras's product as keras_hub writes it: the activation in the gate's dtype, cast to
    up's, times up."""
    return lambda g, u: tf.cast(KINDS[kind](g), u.dtype) * u


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("gate,up", [("float32", "float32"), ("float32", "bfloat16"),
                                     ("bfloat16", "bfloat16"), ("float16", "float16")])
def test_the_closed_form_is_stock_within_rounding_forward_and_both_gradients(kind, gate, up):
    """keras_hub's mixed policy is the float32 gate with a bfloat16 up; a user's 16-bit block
    computes its activation in 16 bit, as the ``custom`` form does."""
    g, u, dy = _inputs(gate, up)
    got = _value_and_gradients(lambda a, b: stage.gated_custom(a, b, kind), g, u, dy)
    want = _value_and_gradients(_stock(kind), g, u, dy)
    for i, (x, w) in enumerate(zip(got, want)):
        assert_within_rounding(x, w, TERMS, dtype=up if i != 1 else gate, what=f"output {i}")
    if kind == stage.SILU or kind == stage.GELU:  # the forward's own ops: the same bits
        np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_float32_forms_are_the_float32_product_rounded_to_the_dtype(kind, dtype):
    """The upcast form and the XLA regions compute in float32: within a few roundings of the
    dtype of the float32 product at the same values (and so of stock's 16-bit product within
    its own roundings)."""
    g, u, dy = _inputs(dtype, dtype)
    wide = _value_and_gradients(_stock(kind), tf.cast(g, tf.float32), tf.cast(u, tf.float32),
                                tf.cast(dy, tf.float32))
    forms = {"xla": lambda a, b: stage.gated_xla(a, b, kind),
             "xla backward": lambda a, b: stage.gated_xla(a, b, kind, backward_region=True)}
    if dtype != "float32":
        forms["upcast"] = lambda a, b: stage.gated_custom(a, b, kind, wide=True)
    for name, fn in forms.items():
        got = _value_and_gradients(fn, g, u, dy)
        assert fn(g, u).dtype == u.dtype
        for i, (x, w) in enumerate(zip(got, wide)):
            terms = 3 if dtype != "float32" else 2 * TRANSCENDENTAL + 8
            assert_within_rounding(x, w, terms, dtype=dtype, what=f"{name} output {i}")


@pytest.mark.parametrize("backward_region", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_region_is_one_call_forward_and_the_backward_two_products_or_a_region(
        backward_region, dtype):
    """What makes the regions fast: one compiled call in the forward (no activation op of
    TensorFlow's outside it); the backward two products in the input's dtype (and the cast
    between), or one more compiled call and no product."""
    @tf.function(autograph=False)
    def step(g, u, dy):
        with tf.GradientTape() as tape:
            tape.watch([g, u])
            y = stage.gated_xla(g, u, stage.SILU, backward_region)
        return tape.gradient(y, [g, u], output_gradients=dy)

    spec = tf.TensorSpec([8, 16], dtype)
    graph = step.get_concrete_function(spec, spec, spec).graph
    ops = Counter(op.type for op in graph.get_operations())
    calls = {op.name: op for op in graph.get_operations()
             if op.type in ("PartitionedCall", "StatefulPartitionedCall")}
    assert len(calls) == 1 + backward_region, ops
    assert all(op.get_attr("_XlaMustCompile") for op in calls.values())
    assert not {"Sigmoid", "SigmoidGrad"} & set(ops), ops
    assert ops["Mul"] == (0 if backward_region else 3), ops


def test_declines_what_it_cannot_take():
    assert _check([2, 3], [2, 3]) is None
    assert _check([None, 3], [None, 3]) is None  # the gradients summed down where need be
    assert _check([2, 3], [1, 3]) == "shapes that broadcast ([2, 3] and [1, 3])"
    assert _check([2, 3], [2, 3], "float64") == "gate dtype float64"
    assert _check([2, 3], [2, 3], "float32", "bfloat16") == (
        "operands of two dtypes (float32 and bfloat16)")


def _check(g_shape, u_shape, dtype="float32", up=None, elsewhere=False):
    """The stage's reason for ``silu(g) * u`` of these shapes and dtypes (``elsewhere``: the
    activation read by another op too), traced."""
    seen = []

    @tf.function(autograph=False)
    def trace(g, u):
        out = tf.nn.silu(g)
        if elsewhere:
            _ = out + 1.0
        seen.append(stage.check(stage.Product(stage.Gate(g, stage.SILU, out, (), []), out, (),
                                              u)))
        return out

    trace.get_concrete_function(tf.TensorSpec(g_shape, dtype), tf.TensorSpec(u_shape, up or dtype))
    return seen[0]


def test_an_activation_read_elsewhere_too_is_declined():
    assert _check([2, 3], [2, 3], elsewhere=True) == (
        "the activation's output is read by another op too")


# -- users' blocks and keras_hub's Llama, trained -------------------------------------------------
def _user_model(ways=("ops", "operator", "gemma"), alone: bool = True):
    """Every way a user writes the block (and Gemma's), on tokens, with a swish alone besides
    (``alone``: a ``Dense(activation="silu")`` whose output no product reads)."""
    def build() -> keras.Model:
        keras.utils.set_random_seed(0)
        inp = keras.Input((6, 8))
        x = inp
        for way in ways:
            x = Gated(16, way)(x)
        if alone:
            x = keras.layers.Dense(8, activation="silu")(x)
        model = keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(x)))
        model.compile(keras.optimizers.SGD(0.01), "mse")
        return model

    rng = np.random.default_rng(1)
    return build, rng.standard_normal((16, 6, 8)).astype("float32"), rng.standard_normal(
        (16, 4)).astype("float32")


def _llama():
    """A tiny keras_hub Llama (2 layers, hidden 32, intermediate 64) on 8 tokens, compiled for
    MSE (optional.tiny_decoder)."""
    return optional.tiny_decoder("llama")


MODELS = {"user": (_user_model, 3), "llama": (_llama, 2)}
"""Each model and its gated products: the user's three blocks; Llama's one per layer."""
# 4 steps of a tiny decoder: every weight's update goes through the blocks' sums
FIT_TERMS = 4 * 400


def _assert_fused(models: dict, form: str, count: int) -> None:
    stats = tfmx.report().patterns[FAMILY]
    label = stage.FORMS[form].label
    assert stats.fused == count and stats.fused_kinds == {label: count}, stats.as_dict()
    assert not stats.declined and stats.observed[label] == count, stats.as_dict()
    scope = f"/{stage.FORMS.scope_of(stage.FORMS[form])}/"
    marks = stage.FORMS[form].marks
    nodes = nodes_that_ran(models[True].train_function)
    assert sum(n.op in marks and scope in n.name for n in nodes) >= count, (form, marks)
    assert f"  fused     {count:>4} x {label}" in str(tfmx.report())


@pytest.mark.parametrize("name,form", [("user", "custom"), ("llama", "custom"), ("llama", XLA),
                                       ("user", stage.XLA_BACKWARD.name)])
def test_fit_matches_stock_with_the_form_in_the_graph_that_ran(monkeypatch, name, form):
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, FAMILY, strict=True))
    make, count = MODELS[name]
    build, x, y = make()
    models, initial = fit_stock_and_tfmx(build, x, y, [FAMILY])
    _assert_fused(models, form, count)
    if form == "custom":  # the closed form's backward: no second sigmoid
        nodes = nodes_that_ran(models[True].train_function)
        scope = f"/{stage.FORMS.scope_of(stage.CUSTOM)}/"
        backward = {n.op for n in nodes if n.name.startswith("gradient_tape/") and scope in n.name}
        assert "Mul" in backward and "Sigmoid" not in backward, backward
        if name == "llama":  # Keras's SiLU taken out of the step: the form's sigmoids alone
            assert not [n.name for n in nodes if n.op == "Sigmoid" and scope not in n.name]
            assert "Sigmoid" in ops_that_ran(models[False].train_function)
    losses = [models[on].history.history["loss"] for on in (False, True)]
    assert np.all(np.isfinite(losses)), losses
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    assert_models_within_rounding(models[False], models[True], initial, FIT_TERMS)


class _RunsEveryCandidate:
    """A chooser that builds and runs every candidate of the family's decisions once, on a
    thread of its own (as the tuner times them), then takes the rewrite."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    def choose(self, family, signature, candidates, conservative):
        from fusion.pattern import RewriteAlways

        if family == FAMILY:
            with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
                for name, make in candidates.items():
                    pool.submit(lambda make=make: make()()).result()
                    self.ran.append(name)
        return RewriteAlways().choose(family, signature, candidates, conservative)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_every_candidate_the_tuner_times_runs(monkeypatch, policy):
    """Keras's form (the swish stage's SiLU and the product), the closed form and both regions,
    built and run as the tuner times them, for each of Llama's blocks."""
    from tfmx import state

    chooser = _RunsEveryCandidate()
    monkeypatch.setattr(state, "tuner", lambda: chooser)
    build, x, y = _llama()
    keras.mixed_precision.set_global_policy(policy)
    try:
        tfmx.enable(backend="cpu", patterns=[FAMILY, "swish"], guard=False)
        build().fit(x, y, batch_size=8, epochs=1, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    stats = tfmx.report().patterns[FAMILY]
    assert not stats.errors and stats.fused == 2, stats.as_dict()
    assert chooser.ran == 2 * ["keras", "custom", XLA, stage.XLA_BACKWARD.name], chooser.ran


def test_the_product_wins_over_the_activation_stages_and_an_activation_alone_keeps_its_own():
    """With the swish and gelu stages on too: each block's activation call runs nowhere (its
    stage counts it declined, with the reason), the swish alone stays the swish stage's."""
    build, x, y = _user_model()
    models, initial = fit_stock_and_tfmx(build, x, y, [FAMILY, "swish", "gelu"])
    _assert_fused(models, "custom", 3)
    swish, gelu = (tfmx.report().patterns[name] for name in ("swish", "gelu"))
    label = "swish: closed-form derivative, sigmoid kept (custom gradient)"
    assert swish.fused_kinds == {label: 1} and swish.observed[label] == 1, swish.as_dict()
    taken = f"{label}: taken into its product with up (gated_product)"
    assert swish.declined == {taken: 2}, swish.as_dict()
    assert gelu.fused == 0 and not gelu.observed and sum(gelu.declined.values()) == 1, (
        gelu.as_dict())
    nodes = nodes_that_ran(models[True].train_function)
    swish_units = {n.name.split("/tfmx_swish_custom")[0] for n in nodes
                   if n.op == "Sigmoid" and "/tfmx_swish_custom" in n.name}
    assert len(swish_units) == 1, swish_units  # the block's activations taken out
    assert_models_within_rounding(models[False], models[True], initial, FIT_TERMS)


def test_an_activation_taken_into_its_product_is_held_apart_from_failed_attempts(monkeypatch):
    """The block's activation (the swish stage's form), taken out of the step once its product
    is emitted, is held as taken over, not among the ops of failed stage attempts (none failed
    here), and none of it runs."""
    from fusion import transaction
    from tfmx import fused_function

    traced = []
    build_entry = fused_function.build_entry

    def spied(concrete, *args, **kwargs):
        traced.append(concrete.graph)
        return build_entry(concrete, *args, **kwargs)

    monkeypatch.setattr(fused_function, "build_entry", spied)
    build, x, y = _user_model(ways=("operator",), alone=False)
    models, _ = fit_stock_and_tfmx(build, x, y, [FAMILY, "swish"])
    assert tfmx.report().patterns[FAMILY].fused == 1
    taken = {name for graph in traced for name in transaction.superseded(graph)}
    assert taken and not {name for graph in traced for name in transaction.abandoned(graph)}
    ran = {n.name: n.op for n in nodes_that_ran(models[True].train_function)}
    assert any("tfmx_swish" in name and ran.get(name) == "NoOp" for name in taken), taken
    assert not {ran[name] for name in taken if name in ran} - {"NoOp"}


@pytest.mark.parametrize("policy,name,form", [
    ("mixed_bfloat16", "llama", "custom"), ("mixed_bfloat16", "llama", XLA),
    ("mixed_bfloat16", "llama", stage.XLA_BACKWARD.name),
    ("mixed_bfloat16", "user", "custom upcast"), ("mixed_float16", "user", "custom")])
def test_mixed_precision_fit_is_no_further_from_float32_than_stock(monkeypatch, policy, name,
                                                                   form):
    """keras_hub's SiLU in float32 between casts, the product in the compute dtype; the user's
    blocks in 16 bit (their activation in float32 with ``custom upcast``)."""
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, FAMILY, strict=True))
    make, count = MODELS[name]
    build, x, y = make()
    keras.mixed_precision.set_global_policy(policy)
    try:
        models, initial = fit_stock_and_tfmx(build, x, y, [FAMILY])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    _assert_fused(models, form, count)
    reference = fit_float32_reference(build, x, y)
    assert_no_further_from_float32(reference, models[False], models[True], initial,
                                   no_further_terms(4, extra=2), dtype=policy.split("_")[1])


def test_a_failing_stage_on_llama_trains_as_stock(monkeypatch):
    """The failure raised after the form was emitted and the activation's ops were marked for
    removal (its ops in the graph, unread): Llama's blocks keep Keras's ops, the activations
    included, the error reported, and the fit is stock's bit for bit."""
    build, x, y = _llama()
    supersede = stage._supersede

    def broken(product):
        supersede(product)
        raise InjectedFault("gated_product: injected failure at emit")

    monkeypatch.setattr(stage, "_supersede", broken)
    models = {}
    for on in (False, True):
        tfmx.enable(backend="cpu", patterns=[FAMILY], guard=False,
                    strict=False) if on else tfmx.disable()
        models[on] = build()
        models[on].fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    stats = tfmx.report().patterns[FAMILY]
    assert stats.fused == 0 and len(stats.errors) == 2, stats.as_dict()
    assert "injected failure" in stats.errors[0]
    assert not [n for n in nodes_that_ran(models[True].train_function)
                if "tfmx_gated" in n.name and n.op != "NoOp"]
    for a, b in zip(models[False].weights, models[True].weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


def test_a_product_failing_after_its_activation_was_taken_leaves_the_activations_count(
        monkeypatch):
    """The failure raised once the activation's ops were marked for removal: the activation
    stays in the step, read by Keras's product, and the swish stage counts its form fused and
    observed, not taken into a product."""
    build, x, y = _user_model(ways=("operator",), alone=False)
    supersede = stage._supersede

    def broken(product):
        supersede(product)
        raise InjectedFault("gated_product: injected failure at emit")

    monkeypatch.setattr(stage, "_supersede", broken)
    models, initial = fit_stock_and_tfmx(build, x, y, [FAMILY, "swish"], strict=False)
    gated, swish = (tfmx.report().patterns[name] for name in (FAMILY, "swish"))
    assert gated.fused == 0 and "injected failure" in gated.errors[0], gated.as_dict()
    label = "swish: closed-form derivative, sigmoid kept (custom gradient)"
    assert swish.fused_kinds == {label: 1} and not swish.declined, swish.as_dict()
    assert swish.observed[label] == 1, swish.as_dict()
    assert_models_within_rounding(models[False], models[True], initial, FIT_TERMS)


class _Broadcast(Gated):
    """``up`` averaged over the tokens: one row per example, broadcast over them."""

    def call(self, x):
        up = keras.ops.mean(self.up(x), axis=1, keepdims=True)
        return keras.activations.silu(self.gate(x)) * up


class _Float64(Gated):
    def __init__(self) -> None:
        super().__init__(16, "ops", dtype="float64")


@pytest.mark.parametrize("layer,why", [
    # the batch is unknown where Keras traces its loop, known where it traces one step (3.16)
    (_Broadcast, r"shapes that broadcast \(\[(None|8), 6, 16\] and \[(None|8), 1, 16\]\)"),
    (_Float64, "gate dtype float64")])
def test_a_fit_keeps_keras_ops_where_it_declines_with_the_reason_reported(layer, why):
    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 8))
    model = keras.Model(inp, keras.layers.Dense(4)(keras.layers.Flatten()(layer()(inp))))
    model.compile(keras.optimizers.SGD(0.05), "mse")
    tfmx.enable(backend="cpu", patterns=[FAMILY], guard=False)
    rng = np.random.default_rng(0)
    model.fit(rng.standard_normal((8, 6, 8)), rng.standard_normal((8, 4)), verbose=0)
    stats = tfmx.report().patterns[FAMILY]
    assert stats.fused == 0 and any(re.search(why, r) for r in stats.declined), stats.as_dict()
    assert not [n for n in nodes_that_ran(model.train_function) if "tfmx_gated" in n.name]


@pytest.mark.parametrize("plugin", ["tensorflow-metal", "tensorflow-metal-plugin"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_metal_plan_runs_the_closed_forms_on_ops_the_plugin_has(plugin, kind):
    """Under each Metal plugin (a plan: nothing here ran on a Mac) the closed forms are offered
    for float32 and float16 blocks and keras_hub's float32 gate with a float16 up, every op of
    their forward and gradient has a kernel in that plugin's table in the dtype it runs in, and
    the XLA region is never offered."""
    from fusion.forms import runnable_forms
    from fusion.stage import StageContext
    from tfmx.backends import get_backend
    from tfmx.placement import FOLLOWERS

    metal = get_backend("metal", plugin=plugin)
    assert not StageContext(metal).xla
    seen = {}
    for gate, up in (("float32", "float32"), ("float16", "float16"), ("float32", "float16")):

        @tf.function(autograph=False)
        def step(g, u):
            with tf.GradientTape() as tape:
                tape.watch([g, u])
                out = keras.activations.silu(g)
                product = stage.Product(stage.Gate(g, kind, out, (), []), out, (), u)
                seen["forms"] = stage.forms_for(product, metal)
                with tf.name_scope("form"):
                    y = next(iter(seen["forms"].values()))(g, u)
            return y, tape.gradient(y, [g, u])

        graph = step.get_concrete_function(tf.TensorSpec([4, 8], gate),
                                           tf.TensorSpec([4, 8], up)).graph
        forms = list(seen["forms"])
        assert runnable_forms(metal, forms, up) == (forms, None), (plugin, gate, up)
        ops = {(op.type, op.outputs[0].dtype.name) for op in graph.get_operations()
               if "form/" in op.name and op.outputs and op.type not in FOLLOWERS | {"Const"}}
        missing = {(op, d) for op, d in ops if not metal.runs_op(op, d)}
        assert not missing, (plugin, gate, up, missing)
        declared = {(o.partition(":")[0], o.partition(":")[2] or up) for o in forms[0].emits}
        assert {(op, d) for op, d in ops if op != "Cast"} <= declared | {("Mul", gate)}, (
            sorted(ops), sorted(declared))


def test_inference_keeps_keras_calls():
    build, x, _ = _user_model()
    model = build()
    want = model(x).numpy()
    tfmx.enable(backend="cpu", patterns=[FAMILY], guard=False)
    np.testing.assert_allclose(model.predict(x, verbose=0), want, rtol=1e-5, atol=1e-6)
    stats = tfmx.report().patterns.get(FAMILY)
    assert stats is None or not stats.fused
