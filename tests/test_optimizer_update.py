"""Optimizer-update fusion: Keras 3 optimizers train through one ResourceApply* per variable.

Parity: 20 steps of model.fit stock vs tfmx from identical weights (the exact families only, so
the update kernel is the one thing that rounds differently); every weight and optimizer slot
within the float32 rounding of those 20 updates (helpers.float_tolerance: the roundings of one
update, counted below per optimizer, times the steps, relative to each tensor's largest value).
The Adam-family kernels compute 1 - beta_2 themselves (fusion/graphs/optimizer_update.py,
docs/families.md): no float32 input gives Keras's 0.001 for beta_2=0.999, so the second-moment
slot is off by that constant's relative error (1.3e-5) and each step by half of it; that is added on
top. Optimizers that are declined must match bitwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import exact_patterns, needs_onednn, ops_that_ran
from parity import assert_optimizer_parity

import tfmx
from fusion.graph import GraphView, op_histogram, output_shape, parse_input
from fusion.graphs.optimizer_update import find_updates
from tfmx.backends import get_backend

STEPS = 20


# Every update fused, whatever the tuner would measure here (tests/conftest.py every_rewrite),
# so each test exercises the kernels; the tuner's own choice is tests/test_tuner.py's.
pytestmark = pytest.mark.usefixtures("every_rewrite")


@pytest.fixture(autouse=True)
def _restore():
    yield
    keras.mixed_precision.set_global_policy("float32")


def _model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(4),
    ])


def _data(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(STEPS * 8, 6)).astype("float32"), rng.normal(size=(STEPS * 8, 4))


def _train(make_optimizer, fused: bool, steps: int = STEPS, patterns=None, **fit_kwargs):
    if fused:
        tfmx.enable(backend="cpu", patterns=patterns or exact_patterns())
    model = _model()
    model.compile(make_optimizer(), "mse")
    x, y = _data()
    model.fit(x[: steps * 8], y[: steps * 8], batch_size=8, epochs=1, shuffle=False, verbose=0,
              **fit_kwargs)
    state = [v.numpy() for v in model.weights] + [
        v.numpy() for v in model.optimizer.variables
    ]
    names = [v.path for v in model.weights] + [v.path for v in model.optimizer.variables]
    ran = ops_that_ran(model.train_function)
    report = tfmx.report().to_dict() if fused else None
    tfmx.disable()
    return names, state, ran, report


def _assert_parity(names, stock, fused, kind: str = "", steps: int = STEPS):
    assert_optimizer_parity(names, stock, fused, kind, steps)


def _fused_kinds(report: dict) -> dict:
    return report["patterns"]["optimizer_update"]["fused_kinds"]


def _declined(report: dict) -> dict:
    return report["patterns"]["optimizer_update"]["declined"]


CASES = {
    "sgd": (lambda: keras.optimizers.SGD(0.05), "SGD", "ResourceApplyGradientDescent"),
    "momentum": (lambda: keras.optimizers.SGD(0.05, momentum=0.9), "SGD(momentum)",
                 "ResourceApplyKerasMomentum"),
    "nesterov": (lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
                 "SGD(nesterov=True)", "ResourceApplyKerasMomentum"),
    "adam": (lambda: keras.optimizers.Adam(1e-3), "Adam", "ResourceApplyAdam"),
    "amsgrad": (lambda: keras.optimizers.Adam(1e-3, amsgrad=True), "Adam(amsgrad=True)",
                "ResourceApplyAdamWithAmsgrad"),
    "adamw": (lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.05), "Adam",
              "ResourceApplyAdam"),
    "rmsprop_momentum": (lambda: keras.optimizers.RMSprop(1e-2, momentum=0.9),
                         "RMSprop(momentum)", "ResourceApplyRMSProp"),
    "rmsprop_centered": (lambda: keras.optimizers.RMSprop(1e-2, momentum=0.5, centered=True),
                         "RMSprop(centered, momentum)", "ResourceApplyCenteredRMSProp"),
    "adadelta": (lambda: keras.optimizers.Adadelta(1.0), "Adadelta", "ResourceApplyAdadelta"),
    "adamax": (lambda: keras.optimizers.Adamax(1e-3), "Adamax", "ResourceApplyAdaMax"),
    "schedule": (lambda: keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(
        1e-3, decay_steps=3, decay_rate=0.5)), "Adam", "ResourceApplyAdam"),
    "clipnorm": (lambda: keras.optimizers.Adam(1e-3, clipnorm=0.1), "Adam",
                 "ResourceApplyAdam"),
    "clipvalue": (lambda: keras.optimizers.SGD(0.05, momentum=0.9, clipvalue=0.01),
                  "SGD(momentum)", "ResourceApplyKerasMomentum"),
    "global_clipnorm": (lambda: keras.optimizers.RMSprop(1e-2, momentum=0.9,
                                                         global_clipnorm=0.1),
                        "RMSprop(momentum)", "ResourceApplyRMSProp"),
    "sgd_weight_decay": (lambda: keras.optimizers.SGD(0.05, momentum=0.9, weight_decay=0.1),
                         "SGD(momentum)", "ResourceApplyKerasMomentum"),
    "ema": (lambda: keras.optimizers.Adam(1e-3, use_ema=True, ema_overwrite_frequency=5),
            "Adam", "ResourceApplyAdam"),
    "accumulation": (lambda: keras.optimizers.Adam(1e-3, gradient_accumulation_steps=3),
                     "Adam", "ResourceApplyAdam"),
}


@needs_onednn("either")  # TensorFlow's own kernels differ with the state
@pytest.mark.parametrize("case", sorted(CASES))
def test_optimizer_trains_through_its_kernel_like_stock(case):
    make, kind, kernel = CASES[case]
    names, stock, stock_ran, _ = _train(make, fused=False)
    _, fused, ran, report = _train(make, fused=True)
    _assert_parity(names, stock, fused, kind)
    assert _fused_kinds(report).get(kind, 0) == 4, report["patterns"]["optimizer_update"]
    assert kernel in ran and kernel not in stock_ran


class _StartAtStep1(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.model.optimizer.iterations.assign(1)


WRONG_STEPS = {  # a bug a fused step could have, played by stock Keras: (right, wrong, kind)
    "missing_update": (dict(make=CASES["momentum"][0]),
                       dict(make=CASES["momentum"][0], steps=STEPS - 1), "SGD(momentum)"),
    "off_by_one_step": (dict(make=CASES["adam"][0]),
                        dict(make=CASES["adam"][0], callbacks=[_StartAtStep1()]), "Adam"),
    "wrong_epsilon": (dict(make=CASES["adam"][0]),
                      dict(make=lambda: keras.optimizers.Adam(1e-3, epsilon=1e-6)), "Adam"),
    "wrong_rho": (dict(make=CASES["rmsprop_momentum"][0]),
                  dict(make=lambda: keras.optimizers.RMSprop(1e-2, rho=0.899, momentum=0.9)),
                  "RMSprop(momentum)"),
}


@pytest.mark.parametrize("bug", sorted(WRONG_STEPS))
def test_parity_tolerance_catches_a_wrong_step(bug):
    """The rounding tolerance is not vacuous: the weights of a run with one update missing, the
    step counter off by one, epsilon 1e-6 for 1e-7 or rho 0.899 for 0.9 are outside it."""
    right, wrong, kind = (dict(a) if isinstance(a, dict) else a for a in WRONG_STEPS[bug])
    names, expected, _, _ = _train(right.pop("make"), fused=False, **right)
    _, got, _, _ = _train(wrong.pop("make"), fused=False, **wrong)
    n = len(_model().weights)
    with pytest.raises(AssertionError, match="max diff"):
        _assert_parity(names[:n], expected[:n], got[:n], kind)


DECLINED = {
    "adagrad": (lambda: keras.optimizers.Adagrad(0.1), "epsilon"),
    "rmsprop_plain": (lambda: keras.optimizers.RMSprop(1e-2), "momentum slot"),
    "nadam": (lambda: keras.optimizers.Nadam(1e-2), "Nadam"),
    "lion": (lambda: keras.optimizers.Lion(1e-3), "Lion"),
}


@pytest.mark.parametrize("case", sorted(DECLINED))
def test_optimizer_without_an_exact_kernel_is_declined_by_name_and_trains(case):
    make, words = DECLINED[case]
    names, stock, _, _ = _train(make, fused=False)
    _, fused, ran, report = _train(make, fused=True)
    _assert_parity(names, stock, fused)
    assert not any(op.startswith("ResourceApply") for op in ran)
    reasons = " ".join(_declined(report))
    assert words in reasons, reasons


# Under a 16-bit policy the forward and backward run in 16 bit: a one-ulp difference in a
# weight changes how activations round, so two runs drift apart whatever the update kernel.
# One step (identical weights, identical gradients) isolates the update itself.


def test_loss_scale_optimizer_updates_inside_the_cond_are_fused():
    keras.mixed_precision.set_global_policy("mixed_float16")
    make = lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3))  # noqa: E731
    names, stock, _, _ = _train(make, fused=False, steps=1)
    _, fused, ran, report = _train(make, fused=True, steps=1)
    _assert_parity(names, stock, fused, "Adam", steps=1)
    assert "ResourceApplyAdam" in ran
    assert _fused_kinds(report)["Adam"] == 4


def test_the_tuner_measures_the_updates_inside_a_loss_scaled_steps_cond(monkeypatch):
    """Inside the LossScaleOptimizer's ``cond`` branch the variables and gradients are the
    branch function's arguments, and a variable may only be written there: the fragment of
    each update is cut from them (their ``_output_shapes``, the value an assignment writes),
    built and run, so the tuner measures the update instead of keeping Keras's composite
    because it could not."""
    from tfmx import state
    from tfmx.tuner import Timings, Tuner

    def run_each_once(candidates, seconds):
        for factory in candidates.values():
            factory()()  # built from the cut fragment and run: raises if it cannot be
        return Timings({name: [2.0 if name == "composite" else 1.0] * 9 for name in candidates})

    monkeypatch.setattr(state, "tuner", lambda: Tuner("auto", timer=run_each_once, budget=1e9))
    # no fit plan: over this fit's one planned step no kernel pays for its first call
    # (tfmx.tuner.for_plan), and what is tested here is the measuring inside the cond
    monkeypatch.setattr("tfmx.fit_plan.active_plan", lambda: None)
    keras.mixed_precision.set_global_policy("mixed_float16")
    make = lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3))  # noqa: E731
    names, stock, _, _ = _train(make, fused=False, steps=1)
    _, fused, ran, report = _train(make, fused=True, steps=1, patterns=["optimizer_update"])
    assert not [why for why in _declined(report) if "measuring failed" in why], \
        _declined(report)
    assert _fused_kinds(report)["Adam"] == 4 and "ResourceApplyAdam" in ran
    _assert_parity(names, stock, fused, "Adam", steps=1)


def test_loss_scale_optimizer_skipped_steps_stay_skipped():
    keras.mixed_precision.set_global_policy("mixed_float16")
    make = lambda: keras.optimizers.LossScaleOptimizer(  # noqa: E731
        keras.optimizers.Adam(1e-3), initial_scale=2.0**60)
    names, stock, _, _ = _train(make, fused=False, steps=2)
    _, fused, _, report = _train(make, fused=True, steps=2)
    _assert_parity(names, stock, fused, "Adam", steps=2)
    before = [v.numpy() for v in _model().weights]
    for a, b in zip(before, fused):  # both steps overflowed in float16: weights untouched
        np.testing.assert_array_equal(a, b)
    assert _fused_kinds(report)["Adam"] == 4


def test_mixed_bfloat16_updates_float32_variables_through_the_kernel():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    make = lambda: keras.optimizers.Adam(1e-3)  # noqa: E731
    names, stock, _, _ = _train(make, fused=False, steps=1)
    # Only this family: a bfloat16 _FusedMatMul rounds once where MatMul, BiasAdd round twice.
    _, fused, ran, report = _train(make, fused=True, steps=1, patterns=["optimizer_update"])
    _assert_parity(names, stock, fused, "Adam", steps=1)
    assert "ResourceApplyAdam" in ran
    assert _fused_kinds(report)["Adam"] == 4


def _adam_step_graph():
    model = _model()
    model.compile(keras.optimizers.Adam(), "mse")
    step = tf.function(model.train_step).get_concrete_function(
        (tf.TensorSpec([8, 6]), tf.TensorSpec([8, 4])))
    return step, step.graph.as_graph_def(add_shapes=True)


def test_matcher_finds_one_update_per_variable_whatever_the_node_names():
    step, graph_def = _adam_step_graph()
    for i, node in enumerate(graph_def.node):  # rename every node: matching is structural
        old = node.name
        new = f"n{i}"
        for other in graph_def.node:
            for k, ref in enumerate(other.input):
                base = ref.lstrip("^").split(":")[0]
                if base == old:
                    other.input[k] = ref.replace(old, new, 1)
        node.name = new
    matches, declined = find_updates(GraphView(graph_def.node), get_backend("cpu"))
    assert [m.spec.kernel for m in matches] == ["ResourceApplyAdam"] * 4
    assert declined == []


def test_matcher_declines_when_a_constant_is_not_what_the_kernel_computes():
    _, graph_def = _adam_step_graph()
    view = GraphView(graph_def.node)
    matches, _ = find_updates(view, get_backend("cpu"))
    const = view.node(matches[0].found.refs["one_minus_beta_1"])
    const.attr["value"].tensor.float_val[:] = [0.2]
    matches, declined = find_updates(view, get_backend("cpu"))
    assert len(matches) == 3
    assert any("one_minus_beta_1" in d for d in declined)


def test_matcher_declines_when_a_slot_value_is_used_elsewhere():
    _, graph_def = _adam_step_graph()
    view = GraphView(graph_def.node)
    matches, _ = find_updates(view, get_backend("cpu"))
    read = next(n for n in sorted(matches[0].found.nodes) if view.node(n).op == "ReadVariableOp")
    spy = tf.compat.v1.NodeDef(name="spy", op="Identity", input=[read])
    spy.attr["T"].type = tf.float32.as_datatype_enum
    view.add(spy)
    matches, declined = find_updates(view, get_backend("cpu"))
    assert len(matches) == 3
    assert any("also used outside" in d for d in declined)


def test_metal_plan_uses_only_kernels_the_plugin_has():
    from tfmx.backends import metal_kernels

    step, graph_def = _adam_step_graph()
    matches, declined = find_updates(GraphView(graph_def.node), get_backend("metal"))
    assert {m.spec.kernel for m in matches} <= metal_kernels()
    model = _model()
    model.compile(keras.optimizers.Adamax(), "mse")
    step = tf.function(model.train_step).get_concrete_function(
        (tf.TensorSpec([8, 6]), tf.TensorSpec([8, 4])))
    view = GraphView(step.graph.as_graph_def(add_shapes=True).node)
    matches, declined = find_updates(view, get_backend("metal"))
    assert matches == [] and any("ResourceApplyAdaMax" in d for d in declined)


@pytest.mark.parametrize("optimizer,kind", [("momentum", "SGD(momentum)"), ("adam", "Adam")])
def test_mirrored_strategy_with_two_replicas_fuses_every_replicas_update(optimizer, kind):
    script = Path(__file__).parent / "scripts" / "mirrored_fit.py"
    done = subprocess.run(
        [sys.executable, str(script), optimizer], capture_output=True, text=True, timeout=600,
        cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    _assert_parity(result["names"], [np.array(a) for a in result["stock"]],
                   [np.array(b) for b in result["fused_state"]], kind, steps=result["steps"])
    assert result["fused"] == {kind: 8}  # 4 variables x 2 replicas
    assert "CollectiveReduceV2" in result["ops"] and result["errors"] == []


def test_sparse_embedding_gradients_are_declined_and_dense_layers_still_fused():
    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((5,), dtype="int32"), keras.layers.Embedding(50, 4),
            keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2),
        ])
        model.compile(keras.optimizers.Adam(1e-3), "mse")
        return model

    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 50, (64, 5)), rng.normal(size=(64, 2))
    results = []
    for fused in (False, True):
        if fused:
            tfmx.enable(backend="cpu", patterns=exact_patterns())
        model = build()
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        results.append([v.numpy() for v in model.weights])
        report = tfmx.report().to_dict()
        tfmx.disable()
    _assert_parity([""] * len(results[0]), results[0], results[1], "Adam", steps=len(x) // 8)
    stats = report["patterns"]["optimizer_update"]
    assert stats["fused_kinds"] == {"Adam": 2}
    assert any("sparse gradient" in reason for reason in stats["declined"])


def test_custom_training_loop_through_tfmx_function():
    def run(decorate):
        model = _model()
        opt = keras.optimizers.Adam(1e-3)
        opt.build(model.trainable_variables)
        x, y = _data()

        @decorate
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        for i in range(STEPS):
            step(tf.constant(x[i * 8:(i + 1) * 8]), tf.constant(y[i * 8:(i + 1) * 8], tf.float32))
        variables = list(model.weights) + list(opt.variables)
        return step, [v.path for v in variables], [v.numpy() for v in variables]

    _, names, stock = run(tf.function)
    tfmx.enable(backend="cpu", patterns=exact_patterns())
    step, _, fused = run(tfmx.function)
    _assert_parity(names, stock, fused, "Adam")
    ops = set()
    for concrete in step.concrete_functions():
        ops |= set(op_histogram(concrete.graph.as_graph_def()))
    assert "ResourceApplyAdam" in ops


class _KeepComposite:
    """A chooser (fusion.pattern.Chooser) keeping Keras's composite for one signature."""

    def __init__(self, keep: str):
        self.keep, self.asked = keep, []

    def choose(self, family, signature, candidates, conservative):
        self.asked.append((family, signature, conservative))
        choice = conservative if self.keep in signature else next(
            name for name in candidates if name != conservative)
        return type("Choice", (), {"choice": choice, "why": lambda self: "measured faster"})()


def test_each_update_is_a_decision_of_its_own_at_its_shape():
    """The kernel or the composite is decided per variable, by kernel, dtype and shape."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64), keras.layers.Dense(2)])
    model.compile(keras.optimizers.Adam(), "mse")
    step = tf.function(model.train_step).get_concrete_function(
        (tf.TensorSpec([8, 64]), tf.TensorSpec([8, 2])))
    view = GraphView(step.graph.as_graph_def(add_shapes=True).node)
    chooser = _KeepComposite("4096-8191 elements")
    matches, declined = find_updates(view, get_backend("cpu"), chooser)

    def size(ref):
        return int(np.prod(output_shape(view.node(ref), parse_input(ref)[1])))
    assert sorted(size(m.found.refs["grad"]) for m in matches) == [2, 64, 128]
    assert declined == ["Adam: ResourceApplyAdam float32 [64, 64] keeps Keras's composite: "
                        "measured faster"]
    assert sorted(sig for _, sig, _ in chooser.asked) == [  # a decision per size class
        "ResourceApplyAdam float32 128-255 elements", "ResourceApplyAdam float32 2-3 elements",
        "ResourceApplyAdam float32 4096-8191 elements", "ResourceApplyAdam float32 64-127 elements"]
    assert {(family, stock) for family, _, stock in chooser.asked} == {
        ("optimizer_update", "composite")}
    assert len(find_updates(view, get_backend("cpu"))[0]) == 4  # no chooser: every update
