"""The rnn family's pair form: two stacked LSTM / GRU layers unrolled as one wavefront."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_within_rounding, needs_onednn, nodes_that_ran

import tfmx
from fusion.calls import rnn, rnn_wavefront
from fusion.family import GRADIENT_SCOPES
from fusion.pattern import RewriteAlways
from tests.test_rnn import (
    F_IN,
    KERNEL_TERMS,
    B,
    H,
    T,
    _pair,
    _weights,
    assert_parity,
    fit_both,
    fit_terms,
)

pytestmark = pytest.mark.usefixtures("every_rewrite")

L, G = keras.layers.LSTM, keras.layers.GRU
H_UP = 6  # the upper layer's units differ from the lower layer's
# Two layers deep: each timestep of the upper layer adds the lower one's (H inputs per gate).
PAIR_TERMS = 2 * KERNEL_TERMS


@pytest.mark.parametrize("kind,return_sequences,use_bias,dropout", [
    ("lstm", True, True, False), ("lstm", False, False, True), ("gru", True, False, True),
    ("gru", False, True, False)])
def test_pair_kernels_match_two_keras_loops(kind, return_sequences, use_bias, dropout):
    rng = np.random.default_rng(0)
    layer = L if kind == "lstm" else G
    low = layer(H, return_sequences=True, use_bias=use_bias)
    up = layer(H_UP, return_sequences=return_sequences, use_bias=use_bias)
    low.build((B, T, F_IN))
    up.build((B, T, H))
    for v in low.weights + up.weights:
        v.assign(rng.standard_normal(v.shape) * 0.5)
    x = tf.constant(rng.standard_normal((B, T, F_IN)), tf.float32)
    count = 2 if kind == "lstm" else 1
    s_low = [tf.constant(rng.standard_normal((B, H)), tf.float32) for _ in range(count)]
    s_up = [tf.constant(rng.standard_normal((B, H_UP)), tf.float32) for _ in range(count)]
    variables = low.trainable_variables + up.trainable_variables
    keep = None
    if dropout:  # the upper layer's input dropout: one mask for every step, as Keras's
        up.cell.dropout = 0.5
        keep = tf.constant((rng.random((B, H)) > 0.5) * 2.0, tf.float32)
        up.cell._dropout_mask = keep

    def weights(lay):
        return [v.value for v in lay.trainable_variables] + ([] if use_bias else [None])

    @tf.function
    def run(fused: bool):
        with tf.GradientTape() as tape:
            tape.watch([x, *s_low, *s_up])
            if not fused:
                seq = keras.layers.RNN.inner_loop(low, x, s_low, None)[1]
                last, out, states = keras.layers.RNN.inner_loop(up, seq, s_up, None,
                                                                training=True)
            elif kind == "lstm":
                last, out, states = rnn_wavefront.lstm_pair(x, s_low, weights(low), s_up,
                                                            weights(up), return_sequences, keep)
            else:
                last, out, states = rnn_wavefront.gru_pair(x, s_low[0], weights(low), s_up[0],
                                                           weights(up), return_sequences, keep)
            loss = (tf.reduce_sum(out * tf.sin(out)) + tf.reduce_sum(last ** 2)
                    + sum(tf.reduce_sum(s * 1.7) for s in states))
        return [last, out, *states, *tape.gradient(loss, [x, *s_low, *s_up, *variables])]

    graph = run.get_concrete_function(True).graph.as_graph_def()
    assert not {"While", "StatelessWhile"} & {n.op for n in graph.node}
    for i, (want, got) in enumerate(zip(run(False), run(True))):
        assert want.shape == got.shape
        assert_within_rounding(got.numpy(), want.numpy(), PAIR_TERMS, what=f"tensor {i}")


def _wavefronts(model: keras.Model) -> dict[str, int]:
    """Op counts under the wavefront scopes of the graph the train step traced (the
    forward: its custom gradient's ops are under the gradient tape's scope)."""
    counts: dict[str, int] = {}
    for node in nodes_that_ran(model.train_function):
        if "_" + rnn.WAVEFRONT + "/" in node.name and not node.name.startswith(
                GRADIENT_SCOPES):
            counts[node.op] = counts.get(node.op, 0) + 1
    return counts


@needs_onednn("either")  # all families: with oneDNN off the onednn family too
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_stacked_layers_fit_as_one_wavefront(kind):
    layer = L if kind == "lstm" else G
    stock, fused, _, _ = fit_both(lambda x: layer(H_UP)(layer(H, return_sequences=True)(x)),
                                  epochs=1)
    assert_parity(_weights(stock), _weights(fused), 2 * fit_terms(epochs=1))
    stats = tfmx.report().patterns["rnn"]
    assert stats.fused_kinds[rnn.KIND_FORMS[(kind, rnn.WAVEFRONT)].label] == 1, stats.fused_kinds
    assert stats.observed[rnn.KIND_FORMS[(kind, rnn.WAVEFRONT)].label] == 1, stats.observed
    ran = _wavefronts(fused)
    # every timestep of both layers is its own MatMul (plain, fused or oneDNN's): no loop
    assert sum(n for op, n in ran.items() if "MatMul" in op) >= 2 * T, ran
    assert "While" not in ran and "StatelessWhile" not in ran


class _Layers:
    """A chooser that runs stacked layers one by one (every other decision: the rewrite)."""

    def choose(self, family, signature, candidates, conservative):
        if " pair " in signature:
            assert set(candidates) == {"layers", rnn.WAVEFRONT}, list(candidates)
            return RewriteAlways().choose(family, signature, {conservative: None},
                                          conservative)
        return RewriteAlways().choose(family, signature, candidates, conservative)


@needs_onednn("either")
def test_the_tuner_decides_between_wavefront_and_layers(monkeypatch):
    from tfmx import state

    monkeypatch.setattr(state, "tuner", _Layers)
    stock, fused, _, _ = fit_both(lambda x: L(H_UP)(L(H, return_sequences=True)(x)), epochs=1)
    assert_parity(_weights(stock), _weights(fused), fit_terms(epochs=1))
    stats = tfmx.report().patterns["rnn"]
    assert stats.fused == 2 and not any(rnn.WAVEFRONT in k for k in stats.fused_kinds)
    assert not _wavefronts(fused)


UNPAIRED = {  # stacks the pair form does not take, each with the reason
    "mask": lambda x: L(H_UP)(L(H, return_sequences=True)(keras.layers.Masking(0.0)(x))),
    "backwards_below": lambda x: G(H_UP)(G(H, return_sequences=True, go_backwards=True)(x)),
    "reset_before": lambda x: G(H_UP, reset_after=False)(G(H, return_sequences=True,
                                                             reset_after=False)(x)),
    "different_kinds": lambda x: L(H_UP)(G(H, return_sequences=True)(x)),
}


@needs_onednn("either")
def test_stacks_outside_the_pair_form_run_layer_by_layer():
    stock, fused, _, _ = fit_both(_pair(*UNPAIRED.values()), epochs=1)
    assert_parity(_weights(stock), _weights(fused), fit_terms(epochs=1))
    stats = tfmx.report().patterns["rnn"]
    assert stats.fused == 8 and not stats.declined, tfmx.report()
    assert not any(rnn.WAVEFRONT in k for k in stats.fused_kinds), stats.fused_kinds


@needs_onednn("either")
def test_input_dropout_on_both_layers_fits_like_stock_in_the_wavefront():
    layers_fn = lambda x: G(H_UP, dropout=0.4)(G(H, return_sequences=True, dropout=0.3)(x))  # noqa: E731
    stock, fused, _, _ = fit_both(layers_fn, epochs=1)
    assert_parity(_weights(stock), _weights(fused), 2 * fit_terms(epochs=1))
    stats = tfmx.report().patterns["rnn"]
    assert stats.fused_kinds[rnn.KIND_FORMS[("gru", rnn.WAVEFRONT)].label] == 1, stats.fused_kinds


@needs_onednn("either")
def test_a_lower_output_read_twice_and_three_layers_deep_train_like_stock():
    def layers_fn(x):
        low = L(H, return_sequences=True)(x)
        three = L(H_UP)(L(H, return_sequences=True)(L(H, return_sequences=True)(x)))
        return keras.layers.Concatenate()([L(H_UP)(low), three,
                                           keras.layers.GlobalAveragePooling1D()(low)])

    stock, fused, _, _ = fit_both(layers_fn, epochs=1)
    assert_parity(_weights(stock), _weights(fused), 3 * fit_terms(epochs=1))
    stats = tfmx.report().patterns["rnn"]
    assert stats.fused_kinds[rnn.KIND_FORMS[("lstm", rnn.WAVEFRONT)].label] == 3, stats.fused_kinds


def test_the_pair_form_needs_a_static_length():
    x = keras.Input((None, F_IN))
    z = tf.zeros([1, H])
    weights = (tf.zeros([F_IN, 4 * H]), tf.zeros([H, 4 * H]), None)
    with pytest.raises(ValueError, match="static number of timesteps"):
        tf.function(lambda s: rnn_wavefront.lstm_pair(s, (z, z), weights, (z, z), weights)
                    ).get_concrete_function(tf.TensorSpec(x.shape, tf.float32))
