"""The batch_norm stage traces one scratch forward per kind of layer call in a step: layers of
Keras's class with the same configuration, variables and input take the plan the first one
made, with their own variables bound in, and train exactly as if each had traced its own."""

from __future__ import annotations

import collections

import keras
import numpy as np
from helpers import exact_patterns

import tfmx
from fusion.calls import batch_norm as batch_norm_stage


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 6, 3))
    x = keras.layers.Conv2D(4, 3, padding="same")(inp)
    for bn in (dict(), dict(), dict(epsilon=0.01)):  # two alike, one with its own epsilon
        x = keras.layers.Conv2D(4, 3, padding="same")(keras.layers.BatchNormalization(**bn)(x))
    out = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(x))
    model = keras.Model(inp, out)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def _train(monkeypatch, reuse: bool) -> tuple[list, list, collections.Counter, dict]:
    traced = []
    trace = batch_norm_stage._traced_plan
    monkeypatch.setattr(batch_norm_stage, "_traced_plan",
                        lambda layer, *a: traced.append(layer.name) or trace(layer, *a))
    if not reuse:
        monkeypatch.setattr(batch_norm_stage, "_template_key", lambda *a: None)
    tfmx.enable(backend="cpu", guard=False, patterns=exact_patterns())
    try:
        model = _model()
        rng = np.random.default_rng(0)
        x, y = rng.random((24, 6, 6, 3), np.float32), rng.random((24, 2), np.float32)
        start = [v.numpy() for v in model.weights]
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        graph = tfmx.report().traces[-1].graph_before
        fused = dict(tfmx.report().patterns["batch_norm"].fused_kinds)
    finally:
        tfmx.disable()
        monkeypatch.undo()
    moved = [v.path for v, a in zip(model.weights, start) if not np.array_equal(v.numpy(), a)]
    return ([v.numpy() for v in model.weights], [traced, moved],
            collections.Counter(n.op for n in graph.node), fused)


def test_layers_alike_share_one_scratch_trace_and_train_as_if_each_traced_its_own(monkeypatch):
    weights, (traced, moved), ops, fused = _train(monkeypatch, reuse=True)
    own_weights, (own_traced, _), own_ops, own_fused = _train(monkeypatch, reuse=False)
    assert len(own_traced) == 3 and len(traced) == 2  # the epsilon=0.01 layer traces its own
    assert fused == own_fused == {"FusedBatchNormV3(training, float32)": 3}
    assert ops == own_ops and ops["FusedBatchNormV3"] == 3 and ops["FusedBatchNormGradV3"] == 3
    # every layer's gamma, beta and moving statistics trained (a plan reused without its
    # variables watched would leave its gamma and beta without a gradient)
    bn_paths = {p for p in moved if "batch_normalization" in p}
    assert len(bn_paths) == 12, sorted(bn_paths)
    for a, b in zip(weights, own_weights):  # the same step, so the same numbers
        np.testing.assert_array_equal(a, b)
