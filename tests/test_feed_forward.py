"""The feed_forward stage: a transformer's feed-forward block as one XLA region (its fits
against stock: tests/test_xla_regions.py), and where a block is found."""

from __future__ import annotations

import keras
import tensorflow as tf
from helpers import StageExample

from fusion.calls import feed_forward

T, D = 6, 8


def _stage_example() -> keras.Model:
    inp = keras.Input((T, D))
    x = keras.layers.Dense(8)(keras.layers.Dense(16, activation="gelu")(inp))
    return keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(x)))


STAGE_EXAMPLE = StageExample(_stage_example, lacking=None)
"""This family's model in the stage-safety tests (tests/test_stage_safety.py): its one form is
an XLA region, with no op a kernel table decides."""


def test_feed_forward_blocks_found_in_a_functional_graph_only():
    """A Dense read by two layers, called twice, or without an activation starts no block;
    neither does a Dense whose reader is not a Dense."""
    inp = keras.Input((T, D))
    shared, up, plain = (keras.layers.Dense(D, activation="relu"),
                         keras.layers.Dense(D, activation="gelu"), keras.layers.Dense(D))
    h = shared(shared(inp))  # called twice
    read_twice = keras.layers.Add()([keras.layers.Dense(D)(up(h)), up.output])
    keras.Model(inp, [plain(read_twice), keras.layers.ReLU()(keras.layers.Dense(
        D, activation="relu")(inp))])
    assert feed_forward.find_feed_forward(shared)[0] is False
    assert feed_forward.find_feed_forward(up)[0] is False
    assert feed_forward.find_feed_forward(plain) == (
        False, "no activation between the two Dense layers")
    into_relu = keras.layers.Dense(D, activation="relu")
    keras.Model(inp, keras.layers.ReLU()(into_relu(inp)))
    assert feed_forward.find_feed_forward(into_relu)[0] is False
    alone = keras.layers.Dense(D, activation="gelu")
    alone(tf.zeros([2, T, D]))  # eager, no functional graph
    assert feed_forward.find_feed_forward(alone)[0] is False
