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


def _fit(layer: keras.layers.Layer, form: str, monkeypatch, seed: int = 0):
    """A model with ``layer`` (then a ReLU) between two small layers trained stock and with
    ``form`` picked for every call of the family: the models and the initial weights."""
    def block(x):
        return keras.layers.Activation("relu")(type(layer).from_config(layer.get_config())(x))

    return fit_conv_block_with_form(stage.FAMILY, form, block, monkeypatch, H, C, seed)


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

    def value_and_gradients(fn):
        with tf.GradientTape() as tape:
            tape.watch([x, kernel])
            y = fn(x, kernel)
            loss = tf.reduce_sum(y * tf.sin(y))
        return [y, *tape.gradient(loss, [x, kernel])]

    got = value_and_gradients(lambda v, k: stage.grouped_as_depthwise(v, k, (strides,) * 2,
                                                                      padding))
    want = value_and_gradients(lambda v, k: nn.conv(v, k, strides, padding))
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
