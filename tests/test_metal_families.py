"""Every family under both Metal plugins: for each ``tfmx bench`` workload (bench.workloads,
the zoo's keras_hub models aside) and each recipe's model, tfmx's plan of one training step
for each plugin places every node, moves no node stock ran on the device to the host
(tfmx.placement), and emits fused nodes only of ops, dtypes and ``fused_ops`` lists that
plugin's table has. Batches of two; nothing here ran on a Mac."""

from __future__ import annotations

import importlib
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from bench.workloads import WORKLOADS
from tfmx import state
from tfmx.metal_plugins import APPLE, OPEN, plugin_table
from tfmx.placement_audit import audit_model

pytestmark = pytest.mark.usefixtures("every_rewrite")

PLUGINS = (APPLE, OPEN)
BENCH = [pytest.param(n, marks=pytest.mark.slow) if n == "resnet50" else n
         for n in sorted(WORKLOADS) if not n.startswith("zoo_")]
# Metal's policy where tfmx picks one (policies.hardware_choice): float16 compute.
HALF = ("small_cnn", "bn_resnet", "lstm", "transformer")
RECIPES = ("small_cnn", "bn_resnet", "mixed_precision", "recurrent", "transformer",
           "custom_loop")
# Ops a family emits as one kernel in place of several (checked against the plugin's table).
KERNEL_PREFIXES = ("_Fused", "ResourceApply", "CudnnRNN", "FusedBatchNorm")


def _workload(name: str, policy: str = "float32"):
    w = WORKLOADS[name]

    def make() -> keras.Model:
        keras.utils.set_random_seed(0)
        keras.mixed_precision.set_dtype_policy(policy)
        try:
            model = w.build()
        finally:
            keras.mixed_precision.set_dtype_policy("float32")
        model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy")
        return model

    rng = np.random.default_rng(0)
    if w.vocabulary:
        x = rng.integers(0, w.vocabulary, (2, *w.input_shape)).astype(np.int32)
    else:
        x = rng.standard_normal((2, *w.input_shape)).astype(np.float32)
    return make, x, np.zeros((2,), np.int32)


def _recipe(name: str, monkeypatch):
    from recipes._flags import parse
    from recipes._train import default_compile

    monkeypatch.setenv("TFMX_RECIPES_OFFLINE", "1")
    recipe = importlib.import_module(f"recipes.{name}").RECIPE
    args = parse(recipe, ["--quick", "--out", tempfile.mkdtemp(prefix="tfmx-test-")])
    data = recipe.load(args)

    def make() -> keras.Model:
        keras.utils.set_random_seed(0)
        model = recipe.build(args, data)
        (recipe.compile or default_compile)(model, args, 10)
        return model

    return make, data.x_train[:2], data.y_train[:2]


def _plan_graph():
    trace = next(t for t in reversed(state.report().traces) if t.function.endswith("train_step"))
    return trace.graph_after


def _nodes(graph_def):
    yield from graph_def.node
    for fdef in graph_def.library.function:
        yield from fdef.node_def


def _check(make, x, y, plugin: str) -> None:
    table = plugin_table(plugin)
    tensorflow = tf.__version__ if table.loads_into(tf.__version__) else None
    audit = audit_model(make(), x, y, plugin=plugin, tensorflow=tensorflow)
    plan = _plan_graph()
    nodes = list(_nodes(plan))
    # Every node placed, and every op one TensorFlow registers (the placer knows it).
    assert len(audit.tfmx.nodes) == len(nodes)
    assert [n.op for n in nodes if op_def_registry.get(n.op) is None] == []
    assert audit.ok, str(audit)
    for placed in audit.tfmx.nodes.values():
        if not placed.op.startswith(KERNEL_PREFIXES):
            continue
        assert table.runs(placed.op, placed.dtype, tensorflow), (placed.op, placed.dtype)
        if placed.op in table.fused_ops:
            assert placed.parts[1:] in table.fused_ops[placed.op], (placed.name, placed.parts)
        assert placed.device == "GPU", placed


@pytest.mark.parametrize("plugin", PLUGINS)
@pytest.mark.parametrize("name", BENCH)
def test_bench_workload_plans(name, plugin):
    _check(*_workload(name), plugin)


@pytest.mark.parametrize("plugin", PLUGINS)
@pytest.mark.parametrize("name", HALF)
def test_mixed_float16_plans(name, plugin):
    _check(*_workload(name, "mixed_float16"), plugin)


def test_mixed_bfloat16_plan_for_the_open_plugin():
    _check(*_workload("transformer", "mixed_bfloat16"), OPEN)


@pytest.mark.parametrize("plugin", PLUGINS)
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_model_plans(name, plugin, monkeypatch):
    _check(*_recipe(name, monkeypatch), plugin)


def test_every_recipe_with_a_model_is_covered():
    from tfmx.cli import recipe_summaries

    with_models = [n for n in recipe_summaries()
                   if getattr(importlib.import_module(f"recipes.{n}"), "RECIPE", None)
                   is not None and importlib.import_module(f"recipes.{n}").RECIPE.build]
    assert sorted(with_models) == sorted(RECIPES)
