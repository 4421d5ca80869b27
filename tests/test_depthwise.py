"""The depthwise stage: DepthwiseConv2D and grouped Conv2D as an XLA region or TensorFlow's
depthwise kernel, in the graph that ran, each fit equal to stock within the kernels' rounding."""

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
from fusion import private_api
from fusion.calls import depthwise as stage
from fusion.stage import XLA, XLA_CALLS

pytestmark = pytest.mark.usefixtures("every_rewrite")

H, C = 8, 4


def _stage_example() -> keras.Model:
    inp = keras.Input((H, H, C))
    x = keras.layers.Conv2D(C, 3, padding="same", groups=C)(inp)
    return keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(x)))


STAGE_EXAMPLE = StageExample(_stage_example, lacking="DepthwiseConv2dNative")
"""This family's model in the stage-safety tests (tests/test_stage_safety.py): a grouped
Conv2D whose groups are its channels, whose forms are offered only where the backend runs
DepthwiseConv2dNative (the XLA region with them)."""


def _fit(layer: keras.layers.Layer, form: str, monkeypatch, seed: int = 0, side: int = H):
    """A model with ``layer`` (then a ReLU) between two small layers, on ``side`` x ``side``
    maps, trained stock and with ``form`` picked for every call of the family: the models and
    the initial weights."""
    def block(x):
        return keras.layers.Activation("relu")(type(layer).from_config(layer.get_config())(x))

    return fit_conv_block_with_form(stage.FAMILY, form, block, monkeypatch, side, C, seed)


def _units(model: keras.Model, form: str) -> list:
    return form_units(model, stage.FORMS, form)


# 4 steps of: the kernel's gradient (a sum over 8 x 8 x 8 pixels), a 3x3 tap sum, the 1x1
# convolution and the dense layer's sums, with momentum's few operations
STEP = 8 * H * H + 9 * 2 + 2 * C + 2 * 8 * 3 + 10
TERMS = 4 * STEP


@pytest.mark.parametrize("multiplier,strides,padding", [
    (1, 1, "same"), (2, 1, "valid"), (1, 2, "same"), (2, 2, "valid")])
def test_depthwise_conv2d_fit_matches_stock_with_the_xla_region_in_the_graph_that_ran(
        multiplier, strides, padding, monkeypatch):
    layer = keras.layers.DepthwiseConv2D(3, strides=strides, padding=padding,
                                         depth_multiplier=multiplier)
    models, initial = _fit(layer, XLA, monkeypatch)
    stats = tfmx.report().patterns[stage.FAMILY]
    assert stats.fused == 1 and set(stats.fused_kinds) == {stage.REGION.label}, stats.as_dict()
    units = _units(models[True], XLA)
    assert any(n.op in XLA_CALLS for n in units), [n.name for n in units]
    assert xla_functions(models[True].train_function)
    assert_models_within_rounding(models[False], models[True], initial, TERMS)


@pytest.mark.parametrize("form", ["native", XLA])
@pytest.mark.parametrize("filters,strides", [(C, 1), (2 * C, 2)])
def test_grouped_conv2d_fit_matches_stock_with_the_form_in_the_graph_that_ran(
        form, filters, strides, monkeypatch):
    layer = keras.layers.Conv2D(filters, 3, strides=strides, padding="same", groups=C)
    models, initial = _fit(layer, form, monkeypatch)
    stats = tfmx.report().patterns[stage.FAMILY]
    label = stage.FORMS[form].label
    assert stats.fused == 1 and set(stats.fused_kinds) == {label}, stats.as_dict()
    units = {n.op for n in _units(models[True], form)}
    assert units & stage.FORMS[form].marks, units
    if form == XLA:
        assert xla_functions(models[True].train_function)
    assert_models_within_rounding(models[False], models[True], initial, TERMS)


def test_a_grouped_conv2d_of_fewer_groups_gets_the_xla_region_alone(monkeypatch):
    layer = keras.layers.Conv2D(C, 3, padding="same", groups=2)
    models, initial = _fit(layer, XLA, monkeypatch)
    stats = tfmx.report().patterns[stage.FAMILY]
    assert set(stats.fused_kinds) == {stage.REGION.label}, stats.as_dict()
    assert_models_within_rounding(models[False], models[True], initial, TERMS)


def test_without_xla_a_depthwise_conv2d_keeps_keras_op_with_the_reason():
    inp = keras.Input((H, H, C))
    model = keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(
        keras.layers.DepthwiseConv2D(3)(inp))))
    model.compile("sgd", "mse")
    tfmx.enable(backend="cpu", patterns=[stage.FAMILY], guard=False, xla=False)
    model.fit(np.ones((8, H, H, C), "float32"), np.ones((8, 4), "float32"), verbose=0)
    stats = tfmx.report().patterns[stage.FAMILY]
    assert not stats.fused and any("without XLA" in why for why in stats.declined), \
        stats.as_dict()


def test_a_plain_conv2d_is_not_the_familys():
    inp = keras.Input((H, H, C))
    model = keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(
        keras.layers.Conv2D(C, 3)(inp))))
    model.compile("sgd", "mse")
    tfmx.enable(backend="cpu", patterns=[stage.FAMILY], guard=False)
    model.fit(np.ones((8, H, H, C), "float32"), np.ones((8, 4), "float32"), verbose=0)
    stats = tfmx.report().patterns.get(stage.FAMILY)
    assert stats is None or not stats.matched, stats.as_dict()


@pytest.mark.parametrize("multiplier,strides,padding", [
    (1, 1, "same"), (2, 2, "valid"), (3, 2, "same")])
def test_grouped_as_depthwise_is_keras_grouped_convolution(multiplier, strides, padding):
    """Values and gradients (input and kernel) of the native form equal Keras's grouped
    convolution (compiled by XLA) within the rounding of their 3x3 tap sums and of the
    kernel's gradient, a sum over every output pixel."""
    nn = private_api.get("keras.backend_nn")

    x = tf.random.stateless_normal([2, 9, 9, C], seed=[1, 2])
    kernel = tf.random.stateless_normal([3, 3, 1, C * multiplier], seed=[3, 4])

    got = value_and_gradients(lambda v, k: stage.grouped_as_depthwise(v, k, (strides,) * 2,
                                                                      padding), x, kernel)
    want = value_and_gradients(lambda v, k: nn.conv(v, k, strides, padding), x, kernel)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_within_rounding(g.numpy(), w.numpy(), 9 + 2 * 9 * 9, what=f"output {i}")


def test_declines_what_it_cannot_take():
    assert stage.check(tf.zeros([2, 4, 4, 2], tf.int32)) == "input dtype int32"
    assert "rank 3" in stage.check(tf.zeros([2, 4, 2]))
    x = tf.zeros([2, 4, 4, 4])
    assert "channels_first" in stage.check_native(x, 4, 1, 1, "channels_first")
    assert "dilation" in stage.check_native(x, 4, 1, 2, "channels_last")
    assert "equal strides" in stage.check_native(x, 4, (2, 1), 1, "channels_last")
    assert "groups 2" in stage.check_native(x, 2, 1, 1, "channels_last")


def _small_map_fit(layer: keras.layers.Layer, side: int, monkeypatch, xla: bool = True):
    """``layer`` (then a ReLU) on ``side`` x ``side`` maps, trained stock and with the cropped
    form picked for every call of the family (:func:`_fit`)."""
    if not xla:
        monkeypatch.setenv("TFMX_XLA", "0")
    return _fit(layer, stage.CROPPED.name, monkeypatch, side=side)


@pytest.mark.parametrize("layer,side,op", [
    (keras.layers.DepthwiseConv2D(5, padding="same"), 2, "DepthwiseConv2dNative"),
    (keras.layers.DepthwiseConv2D(7, strides=2, padding="same", depth_multiplier=2), 3,
     "DepthwiseConv2dNative"),
    (keras.layers.DepthwiseConv2D(5, padding="same", dilation_rate=2), 4, "DepthwiseConv2dNative"),
    (keras.layers.Conv2D(2 * C, 7, padding="same", groups=C), 2, "DepthwiseConv2dNative"),
    (keras.layers.Conv2D(C, 7, padding="same", groups=C), 1, "Mul"),
    (keras.layers.DepthwiseConv2D(3, padding="same", depth_multiplier=2), 1, "Mul"),
], ids=["depthwise-5x5-on-2x2", "depthwise-7x7-stride-2-on-3x3", "dilated-5x5-on-4x4",
        "grouped-7x7-on-2x2", "grouped-7x7-on-1x1", "depthwise-3x3-on-1x1"])
def test_the_cropped_form_fit_matches_stock_with_its_kernel_in_the_graph_that_ran(
        layer, side, op, monkeypatch):
    models, initial = _small_map_fit(layer, side, monkeypatch)
    stats = tfmx.report().patterns[stage.FAMILY]
    assert stats.fused == 1 and set(stats.fused_kinds) == {stage.CROPPED.label}, stats.as_dict()
    units = _units(models[True], stage.CROPPED.name)
    assert op in {n.op for n in units}, [(n.name, n.op) for n in units]
    if op == "Mul":  # one tap: no convolution left at all
        assert not any("Depthwise" in n.op for n in nodes_that_ran(models[True].train_function))
    assert_models_within_rounding(models[False], models[True], initial, TERMS)


def test_without_xla_the_cropped_form_is_still_offered(monkeypatch):
    layer = keras.layers.DepthwiseConv2D(5, padding="same")
    models, initial = _small_map_fit(layer, 2, monkeypatch, xla=False)
    stats = tfmx.report().patterns[stage.FAMILY]
    assert set(stats.fused_kinds) == {stage.CROPPED.label}, stats.as_dict()
    assert not xla_functions(models[True].train_function)
    assert_models_within_rounding(models[False], models[True], initial, TERMS)


@pytest.mark.parametrize("size,kernel,stride,dilation,padding,multiplier", [
    (1, 3, 1, 1, "same", 1), (1, 3, 2, 1, "same", 2), (2, 5, 1, 1, "same", 1),
    (2, 4, 1, 1, "same", 1), (2, 6, 1, 1, "same", 3), (3, 7, 2, 1, "same", 1),
    (4, 7, 2, 1, "same", 2), (2, 3, 1, 2, "same", 1), (3, 5, 1, 3, "same", 2),
    (4, 5, 1, 2, "same", 1), (2, 7, 3, 1, "same", 1)])
def test_cropped_depthwise_is_tensorflows_depthwise_convolution(size, kernel, stride, dilation,
                                                                padding, multiplier):
    """Values and gradients (input and kernel) of the cropped form equal TensorFlow's depthwise
    convolution within the rounding of their tap sums and of the kernel's gradient (a sum over
    every output pixel); the taps left out get a zero gradient."""
    x = tf.random.stateless_normal([3, size, size + 1, C], seed=[1, 2])
    k = tf.random.stateless_normal([kernel, kernel, C, multiplier], seed=[3, 4])
    args = dict(strides=stride, padding=padding, dilation_rate=dilation)
    assert stage.check_cropped(x, k.shape[:2], C, stride, dilation, padding,
                               "channels_last") is None

    got = value_and_gradients(lambda v, w: stage.cropped_depthwise(v, w, **args), x, k)
    want = value_and_gradients(lambda v, w: tf.nn.depthwise_conv2d(
        v, w, [1, stride, stride, 1], padding.upper(),
        dilations=None if dilation == 1 else [dilation, dilation]), x, k)
    assert got[0].shape == want[0].shape
    for i, (g, w) in enumerate(zip(got, want)):
        assert_within_rounding(g.numpy(), w.numpy(), kernel * kernel + 3 * size * (size + 1),
                               what=f"output {i}")
    rows = stage.data_window(size, kernel, stride, dilation, padding)
    outside = np.delete(got[2].numpy(), range(rows[0], rows[1] + 1), axis=0)
    assert not outside.any()  # the taps that read only padding: no gradient, as stock's


def test_the_cropped_form_declines_what_it_cannot_take():
    x = tf.zeros([2, 2, 2, 4])
    assert "channels_first" in stage.check_cropped(x, (5, 5), 4, 1, 1, "same", "channels_first")
    assert "groups 2" in stage.check_cropped(x, (5, 5), 2, 1, 1, "same", "channels_last")
    assert "equal strides" in stage.check_cropped(x, (5, 5), 4, (2, 1), 1, "same",
                                                  "channels_last")
    assert "dilation" in stage.check_cropped(x, (5, 5), 4, 2, 2, "same", "channels_last")
    assert "nothing to crop" in stage.check_cropped(tf.zeros([2, 4, 4, 4]), (3, 3), 4, 1, 1,
                                                    "valid", "channels_last")
    assert "wider than its 2x2 input" in stage.check_cropped(x, (3, 3), 4, 1, 1, "valid",
                                                             "channels_last")
    assert "nothing to crop" in stage.check_cropped(tf.zeros([2, 8, 8, 4]), (3, 3), 4, 1, 1,
                                                    "same", "channels_last")


@pytest.mark.parametrize("plugin", ["tensorflow-metal", "tensorflow-metal-plugin"])
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_the_metal_plan_places_every_node_with_the_cropped_form_and_never_xla(plugin, policy):
    """Each Metal plugin's plan of a step with a 5x5 DepthwiseConv2D over 2x2 maps (float32
    and float16 compute): the cropped form's 3x3 DepthwiseConv2dNative in the plan, every node
    placed, nothing stock ran on the GPU moved to the host, and no XLA region offered."""
    from fusion.stage import StageContext
    from tfmx import state
    from tfmx.backends import get_backend
    from tfmx.metal_plugins import plugin_table
    from tfmx.placement_audit import audit_model

    tensorflow = tf.__version__ if plugin_table(plugin).loads_into(tf.__version__) else None
    assert not StageContext(get_backend("metal", plugin=plugin, tensorflow=tensorflow)).xla
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        inp = keras.Input((2, 2, C))
        x = keras.layers.DepthwiseConv2D(5, padding="same")(inp)
        model = keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(x)))
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    model.compile("adam", "mse")
    x, y = np.ones((2, 2, 2, C), "float32"), np.ones((2, 4), "float32")
    audit = audit_model(model, x, y, plugin=plugin, tensorflow=tensorflow)
    assert audit.ok, str(audit)
    trace = next(t for t in reversed(state.report().traces) if t.function.endswith("train_step"))
    scope = f"/{stage.FORMS.scope_of(stage.CROPPED)}/"
    nodes = [*trace.graph_after.node,
             *(n for f in trace.graph_after.library.function for n in f.node_def)]
    convs = [n for n in nodes if n.op == "DepthwiseConv2dNative" and scope in n.name]
    assert convs, sorted({n.name for n in nodes if stage.SCOPE in n.name})
    assert not any(n.op in XLA_CALLS and stage.SCOPE in n.name for n in nodes)
