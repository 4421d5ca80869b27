"""Inference Conv2D + BatchNormalization folding: predict/evaluate parity and the fused node."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import ACTIVATION_ROUNDINGS, TRANSCENDENTAL, assert_within_rounding, needs_onednn

import tfmx
from fusion.graph import GraphView
from fusion.graphs.conv_bn_fold import find_conv_bn
from tfmx.backends import get_backend

# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")



def build(activation: str | None) -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, use_bias=False, padding="same")(inp)
    x = keras.layers.BatchNormalization()(x)
    if activation:
        x = keras.layers.Activation(activation)(x)
    x = keras.layers.Conv2D(4, 3, use_bias=False)(x)
    x = keras.layers.BatchNormalization(epsilon=1e-2)(x)
    out = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inp, out)
    model.compile("sgd", "mse")
    return model


ACTIVATIONS = {None: None, "relu": "Relu", "relu6": "Relu6", "elu": "Elu",
               "leaky_relu": "LeakyRelu"}


@needs_onednn("either")  # all families: with oneDNN off the onednn family too
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_predict_and_evaluate_fold_batch_norm_into_the_convolution(activation):
    rng = np.random.default_rng(0)
    x = rng.random((16, 8, 8, 3), dtype=np.float32)
    y = rng.random((16, 4), dtype=np.float32)
    model = build(activation)
    model.fit(x, y, epochs=2, verbose=0)  # moving statistics move away from 0 / 1
    stock_pred, stock_eval = model.predict(x, verbose=0), model.evaluate(x, y, verbose=0)
    tfmx.enable(backend="cpu")
    pred, evaluated = model.predict(x, verbose=0), model.evaluate(x, y, verbose=0)
    # The fold computes the batch norm inside the convolution's kernel: the 3x3x3 window, the
    # batch norm (x - mean, variance + epsilon, rsqrt, two Muls, an Add), the activation, the
    # 3x3x4 window, the second batch norm, pooling over 6x6; evaluate adds the loss's mean over
    # 16 x 4 values.
    bn = 5 + TRANSCENDENTAL
    terms = 27 + bn + ACTIVATION_ROUNDINGS[ACTIVATIONS[activation]] + 36 + bn + 36 + 1
    assert_within_rounding(pred, stock_pred, terms, what="predict")
    assert_within_rounding(evaluated, stock_eval, terms + 64 + 2, what="evaluate")
    kinds = tfmx.report().patterns["conv_bn_fold"].fused_kinds
    expected_act = {k: v for k, v in ACTIVATIONS.items() if k}
    first = "_FusedConv2D(FusedBatchNorm" + (
        f", {expected_act[activation]})" if activation else ")")
    assert kinds[first] >= 1
    predict_trace = next(t for t in tfmx.report().traces if "predict" in t.function)
    assert predict_trace.ops_after["_FusedConv2D"] == 2
    assert predict_trace.ops_after["Rsqrt"] == 0


def test_training_graphs_do_not_fold():
    model = build("relu")
    model.optimizer.build(model.trainable_variables)
    data = (tf.zeros([2, 8, 8, 3]), tf.zeros([2, 4]))
    g = tf.function(model.train_step, autograph=False).get_concrete_function(
        data).graph.as_graph_def(add_shapes=True)
    matches, _ = find_conv_bn(GraphView(g.node), get_backend("cpu"))
    assert matches == []


def test_metal_declines_with_the_reason():
    model = build(None)
    g = tf.function(model.predict_step, autograph=False).get_concrete_function(
        tf.TensorSpec([None, 8, 8, 3])).graph.as_graph_def(add_shapes=True)
    matches, declined = find_conv_bn(GraphView(g.node), get_backend("metal"))
    assert matches == []
    assert declined and "metal runs no fused batch norm" in declined[0]
