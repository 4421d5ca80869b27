"""The casts family: redundant casts out of GraphDefs, exact numbers, Keras training parity."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import needs_onednn
from policies_fixtures import restore_global_policy  # noqa: F401 (autouse fixture)

import fusion
import tfmx
from fusion.graph import GraphView
from fusion.graphs.casts import find_casts

# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")



def casts(graph_def):
    return [(n.name, n.attr["SrcT"].type, n.attr["DstT"].type)
            for n in graph_def.node if n.op == "Cast"]


def round_trip(x):
    return tf.cast(tf.cast(x, tf.float32), tf.bfloat16) * tf.constant(2.0, tf.bfloat16)


def test_round_trip_removed_with_exact_numbers(trace, fuse, cpu, assert_same_numbers):
    concrete, g = trace(round_trip, tf.TensorSpec([3, 4], tf.bfloat16))
    result = fuse(concrete, g, cpu)
    assert result.stats["casts"].fused == 1
    assert casts(result.graph_def) == []
    x = tf.cast(tf.random.normal([3, 4]), tf.bfloat16)
    assert_same_numbers(concrete, result, x, terms=0)


def test_widening_cast_kept_when_something_else_reads_it(trace, fuse, cpu, assert_same_numbers):
    def f(x):
        wide = tf.cast(x, tf.float32)
        return tf.cast(wide, tf.bfloat16) + x, wide * 3.0

    concrete, g = trace(f, tf.TensorSpec([5], tf.bfloat16))
    result = fuse(concrete, g, cpu)
    assert result.stats["casts"].fused == 1
    assert len(casts(result.graph_def)) == 1  # the widening cast still feeds wide * 3
    assert_same_numbers(concrete, result, tf.cast(tf.range(5.0) / 3.0, tf.bfloat16), terms=0)


def test_lossy_direction_is_never_touched(trace, fuse, cpu):
    def f(x):
        return tf.cast(tf.cast(x, tf.bfloat16), tf.float32) * 2.0

    concrete, g = trace(f, tf.TensorSpec([4]))
    result = fuse(concrete, g, cpu)
    assert result.stats["casts"].matched == 0
    assert len(casts(result.graph_def)) == 2


def test_identity_casts_and_identity_nodes_between(trace, fuse, cpu, assert_same_numbers):
    def f(x):
        wide = tf.identity(tf.identity(tf.cast(x, tf.float32)))
        return tf.cast(wide, tf.float16) * tf.constant(3.0, tf.float16)

    concrete, g = trace(f, tf.TensorSpec([4], tf.float16))
    result = fuse(concrete, g, cpu)
    assert result.stats["casts"].fused_kinds["removed float16->float32->float16 round trip"] == 1
    assert_same_numbers(concrete, result, tf.constant([1.0, 2.5, -3.0, 7.0], tf.float16), terms=0)

    # An identity cast (SrcT == DstT), written as a NodeDef: TensorFlow does not emit one.
    view = GraphView(g.node)
    node = next(n for n in view if n.op == "Cast")
    node.attr["DstT"].type = node.attr["SrcT"].type
    matches, _ = find_casts(view, cpu)
    assert [m.kind for m in matches][:1] == ["identity Cast float16"]


def test_fetched_or_control_edged_casts_are_declined(trace, cpu):
    _, g = trace(round_trip, tf.TensorSpec([2], tf.bfloat16))
    second = [n for n in g.node if n.op == "Cast"][1].name
    matches, declined = find_casts(GraphView(g.node, protected=[second]), cpu)
    assert matches == [] and declined == [
        "bfloat16->float32->bfloat16 round trip: output is fetched by the function"]

    view = GraphView(g.node)
    reader = next(n for n in view if n.op == "Mul")
    view.remove(reader.name)
    reader.input.append(f"^{second}")
    view.add(reader)
    matches, declined = find_casts(view, cpu)
    assert matches == [] and "control edge" in declined[0]


def bf16_linear_bf16(seed: int = 0) -> keras.Model:
    """bfloat16 Dense -> float32 linear Activation (casts up, does nothing) -> bfloat16 Dense."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8,))
    x = keras.layers.Dense(16, activation="relu", dtype="mixed_bfloat16")(inp)
    x = keras.layers.Activation("linear", dtype="float32")(x)
    x = keras.layers.Dense(16, activation="relu", dtype="mixed_bfloat16")(x)
    out = keras.layers.Dense(3, activation="softmax")(x)
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy")
    return model


def test_keras_training_parity_with_round_trips_removed():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 8)).astype("float32"), rng.integers(0, 3, 32)
    results = {}
    for mode in ("stock", "tfmx"):
        if mode == "tfmx":
            tfmx.enable(backend="cpu", patterns=["casts"])
        model = bf16_linear_bf16()
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        results[mode] = (history.history["loss"], [w.numpy() for w in model.weights])
    stats = tfmx.report().patterns["casts"]
    assert stats.fused_kinds["removed bfloat16->float32->bfloat16 round trip"] >= 2  # fwd, bwd
    np.testing.assert_array_equal(results["tfmx"][0], results["stock"][0])
    for a, b in zip(results["tfmx"][1], results["stock"][1]):
        np.testing.assert_array_equal(a, b)


@needs_onednn("either")  # the families: with oneDNN off the onednn family too
def test_contractions_fuse_in_16bit_where_the_backend_runs_them():
    """cpu fuses MatMul in float16 and bfloat16 (where that pays is the tuner's to measure:
    tests/test_tuner.py; here every rewrite is taken), never Conv2D in 16 bit."""
    import warnings

    import policies

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 6, 6, 2)).astype("float32"), rng.integers(0, 2, 8)
    found = {}
    for name in ("mixed_float16", "mixed_bfloat16"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", policies.PolicyWarning)  # float16 on this CPU
            with policies.scope(name):
                inp = keras.Input((6, 6, 2))
                h = keras.layers.Conv2D(4, 3, activation="relu")(inp)
                h = keras.layers.Dense(8, activation="relu")(keras.layers.Flatten()(h))
                model = keras.Model(inp, keras.layers.Dense(2, activation="softmax")(h))
                model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        # every family but bias_row, which would take the Dense layers' biases into their
        # MatMuls: the contractions are this test's
        tfmx.enable(backend="cpu", patterns=[p for p in fusion.available_patterns()
                                             if p != "bias_row"])
        tfmx.report(reset=True)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        found[name] = tfmx.report().patterns["contraction"]
        tfmx.disable()
    fp16, bf16 = found["mixed_float16"], found["mixed_bfloat16"]
    assert fp16.fused_kinds["_FusedMatMul(BiasAdd, Relu)"] >= 1
    assert any("runs no fused Conv2D in float16" in reason for reason in fp16.declined)
    assert bf16.fused_kinds["_FusedMatMul(BiasAdd, Relu)"] >= 1
    assert any("runs no fused Conv2D in bfloat16" in reason for reason in bf16.declined)
