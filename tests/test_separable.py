"""The separable stage: SeparableConv2D with its pointwise projection as a MatMul or as an XLA
region, in the graph that ran, each fit equal to stock within the kernels' rounding."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    StageExample,
    assert_models_within_rounding,
    assert_within_rounding,
    fit_conv_block_with_form,
    form_units,
    nodes_that_ran,
    value_and_gradients,
    xla_functions,
)

import tfmx
from fusion.calls import separable as stage
from fusion.stage import XLA, XLA_CALLS

pytestmark = pytest.mark.usefixtures("every_rewrite")

H, C = 8, 4


def _stage_example() -> keras.Model:
    inp = keras.Input((H, H, C))
    x = keras.layers.SeparableConv2D(6, 3, padding="same")(inp)
    return keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(x)))


STAGE_EXAMPLE = StageExample(_stage_example, lacking="MatMul")
"""This family's model in the stage-safety tests (tests/test_stage_safety.py): a
SeparableConv2D whose ``matmul`` form is offered only where the backend runs MatMul (the XLA
region with it)."""


def _fit(layer: keras.layers.Layer, form: str, monkeypatch, seed: int = 0):
    """A model with ``layer`` (then batch norm and a ReLU, as in Xception) between two small
    layers trained stock and with ``form`` picked for every call of the family: the models and
    the initial weights."""
    def block(x):
        x = type(layer).from_config(layer.get_config())(x)
        return keras.layers.Activation("relu")(keras.layers.BatchNormalization()(x))

    return fit_conv_block_with_form(stage.FAMILY, form, block, monkeypatch, H, C, seed)


def _units(model: keras.Model, form: str) -> list:
    return form_units(model, stage.FORMS, form)


# 4 steps of: the depthwise kernel's gradient (a sum over 8 x 8 x 8 pixels), the pointwise
# kernel's (the same pixels), a 3x3 tap sum and its pointwise sum, the batch norm's
# statistics, the 1x1 convolution and the dense layer's sums, with momentum's few operations
STEP = 2 * 8 * H * H + 9 * 2 + 2 * 8 + 2 * 8 * H * H + 2 * C + 2 * 8 * 3 + 10
TERMS = 4 * STEP


@pytest.mark.parametrize("form", ["matmul", XLA])
@pytest.mark.parametrize("multiplier,strides,padding,bias", [
    (1, 1, "same", True), (2, 1, "valid", False), (1, 2, "same", False), (2, 2, "valid", True)])
def test_separable_conv2d_fit_matches_stock_with_the_form_in_the_graph_that_ran(
        form, multiplier, strides, padding, bias, monkeypatch):
    layer = keras.layers.SeparableConv2D(6, 3, strides=strides, padding=padding,
                                         depth_multiplier=multiplier, use_bias=bias)
    models, initial = _fit(layer, form, monkeypatch)
    stats = tfmx.report().patterns[stage.FAMILY]
    label = stage.FORMS[form].label
    assert stats.fused == 1 and set(stats.fused_kinds) == {label}, stats.as_dict()
    units = {n.op for n in _units(models[True], form)}
    assert units & stage.FORMS[form].marks, units
    if form == XLA:
        assert units & XLA_CALLS and xla_functions(models[True].train_function)
    else:
        assert "Conv2D" not in units and "DepthwiseConv2dNative" in units, units
    assert_models_within_rounding(models[False], models[True], initial, TERMS)


def test_the_matmul_form_replaces_the_pointwise_conv2d_in_the_graph_that_ran(monkeypatch):
    layer = keras.layers.SeparableConv2D(6, 3, padding="same")
    models, _ = _fit(layer, "matmul", monkeypatch)
    ops = [n.op for n in nodes_that_ran(models[True].train_function)]
    stock_ops = [n.op for n in nodes_that_ran(models[False].train_function)]
    # the model's one other convolution (the 1x1 Conv2D before it) is all that is left
    assert ops.count("Conv2D") == stock_ops.count("Conv2D") - 1, (ops, stock_ops)
    assert "Conv2DBackpropFilter" in stock_ops


def test_a_dilated_separable_conv2d_gets_the_xla_region_alone(monkeypatch):
    layer = keras.layers.SeparableConv2D(6, 3, padding="same", dilation_rate=2)
    models, initial = _fit(layer, XLA, monkeypatch)
    stats = tfmx.report().patterns[stage.FAMILY]
    assert set(stats.fused_kinds) == {stage.REGION.label}, stats.as_dict()
    assert_models_within_rounding(models[False], models[True], initial, TERMS)


def test_without_xla_a_dilated_separable_conv2d_keeps_keras_ops_with_the_reason():
    inp = keras.Input((H, H, C))
    model = keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(
        keras.layers.SeparableConv2D(6, 3, dilation_rate=2)(inp))))
    model.compile("sgd", "mse")
    tfmx.enable(backend="cpu", patterns=[stage.FAMILY], guard=False, xla=False)
    model.fit(np.ones((8, H, H, C), "float32"), np.ones((8, 4), "float32"), verbose=0)
    stats = tfmx.report().patterns[stage.FAMILY]
    assert not stats.fused and any("dilation (2, 2)" in why for why in stats.declined), \
        stats.as_dict()


def test_a_separable_conv1d_keeps_keras_ops_with_the_reason():
    inp = keras.Input((H, C))
    model = keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(
        keras.layers.SeparableConv1D(6, 3)(inp))))
    model.compile("sgd", "mse")
    tfmx.enable(backend="cpu", patterns=[stage.FAMILY], guard=False)
    model.fit(np.ones((8, H, C), "float32"), np.ones((8, 4), "float32"), verbose=0)
    stats = tfmx.report().patterns[stage.FAMILY]
    assert not stats.fused and any("rank 3" in why for why in stats.declined), stats.as_dict()


@pytest.mark.parametrize("multiplier,strides,padding", [
    (1, 1, "same"), (2, 2, "valid"), (3, 2, "same")])
def test_pointwise_as_matmul_is_keras_separable_convolution(multiplier, strides, padding):
    """Values and gradients (input and both kernels) of the matmul form equal Keras's
    separable convolution within the rounding of their 3x3 tap sums, their pointwise sums
    and the kernels' gradients, sums over every output pixel."""
    from fusion import private_api

    nn = private_api.get("keras.backend_nn")
    x = tf.random.stateless_normal([2, 9, 9, C], seed=[1, 2])
    depthwise = tf.random.stateless_normal([3, 3, C, multiplier], seed=[3, 4])
    pointwise = tf.random.stateless_normal([1, 1, C * multiplier, 5], seed=[5, 6])
    operands = (x, depthwise, pointwise)
    got = value_and_gradients(lambda v, d, p: stage.pointwise_as_matmul(v, d, p, strides,
                                                                        padding), *operands)
    want = value_and_gradients(lambda v, d, p: nn.separable_conv(v, d, p, strides, padding),
                               *operands)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_within_rounding(g.numpy(), w.numpy(), 9 + C * multiplier + 2 * 9 * 9 * 5,
                               what=f"output {i}")


def test_declines_what_it_cannot_take():
    assert stage.check(tf.zeros([2, 4, 4, 2], tf.int32)) == "input dtype int32"
    assert "rank 3" in stage.check(tf.zeros([2, 4, 2]))
    assert "channels_first" in stage.check_matmul(1, 1, "channels_first")
    assert "dilation" in stage.check_matmul(1, 2, "channels_last")
    assert "equal strides" in stage.check_matmul((2, 1), 1, "channels_last")


@pytest.mark.parametrize("plugin", ["tensorflow-metal", "tensorflow-metal-plugin"])
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_the_metal_plan_places_every_node_with_the_matmul_form_and_never_xla(plugin, policy):
    """Each Metal plugin's plan of a SeparableConv2D step (float32 and float16 compute): the
    ``matmul`` form's MatMul in the plan, every node placed, nothing stock ran on the GPU
    moved to the host, and no XLA region offered."""
    from fusion.stage import StageContext
    from tfmx import state
    from tfmx.backends import get_backend
    from tfmx.metal_plugins import plugin_table
    from tfmx.placement_audit import audit_model

    tensorflow = tf.__version__ if plugin_table(plugin).loads_into(tf.__version__) else None
    assert not StageContext(get_backend("metal", plugin=plugin, tensorflow=tensorflow)).xla
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        model = _stage_example()
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    model.compile("adam", "mse")
    x, y = np.ones((2, H, H, C), "float32"), np.ones((2, 4), "float32")
    audit = audit_model(model, x, y, plugin=plugin, tensorflow=tensorflow)
    assert audit.ok, str(audit)
    trace = next(t for t in reversed(state.report().traces) if t.function.endswith("train_step"))
    scope = f"/{stage.FORMS.scope_of(stage.MATMUL)}/"
    nodes = [*trace.graph_after.node,
             *(n for f in trace.graph_after.library.function for n in f.node_def)]
    assert any(n.op == "MatMul" and scope in n.name for n in nodes), sorted(
        {n.name for n in nodes if stage.SCOPE in n.name})
    assert not any(n.op == "Conv2D" for n in nodes)
