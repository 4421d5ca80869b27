"""What tfmx keeps about a traced graph lives in ``fusion.trace_state``'s registry, not on
TensorFlow's graphs: a tfmx-enabled fit leaves no ``_tfmx`` attribute on any graph it traced
while the registry holds what its stages kept (their statistics, committed once; the ops of an
abandoned attempt), and a graph's state goes when the graph is garbage collected."""

from __future__ import annotations

import gc
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import failing
from tensorflow.python.framework.func_graph import FuncGraph

import tfmx
from fusion import trace_state, transaction
from tfmx import staging

pytestmark = pytest.mark.usefixtures("every_rewrite")

L = keras.layers


def _traced_graphs() -> list[FuncGraph]:
    return [o for o in gc.get_objects() if isinstance(o, FuncGraph)]


def _attributes(graph: tf.Graph) -> set[str]:
    """The names of ``graph``'s instance attributes: a ``tf.Graph`` keeps them in a dict that
    neither ``vars`` nor ``dir`` shows."""
    return {name for held in gc.get_referents(graph) if isinstance(held, dict)
            for name in held if isinstance(name, str)}


def _block() -> keras.Model:
    """A transformer block's layer norm and feed-forward layers, on tokens."""
    inp = keras.Input((6, 8))
    x = L.LayerNormalization()(L.Dense(8)(inp))
    x = L.Dense(8)(L.Dense(16, activation="gelu")(x))
    return keras.Model(inp, L.Dense(4)(L.GlobalAveragePooling1D()(x)))


def test_a_fit_keeps_its_trace_state_in_the_registry_and_nothing_on_the_graphs(monkeypatch):
    """The feed-forward stage's first Dense leaves its input for the second (it emits the
    block), the layer norm's stage fails after it emitted its form (its ops are abandoned and
    taken out of the step), the stages' statistics reach the report: all through the
    registry."""
    tfmx.enable(backend="cpu", guard=False, xla=True, strict=False,
                patterns=["bias_row", "feed_forward", "gelu", "layer_norm"])
    keras.utils.set_random_seed(0)
    model = _block()
    model.compile(keras.optimizers.SGD(0.01), "mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 6, 8)), rng.normal(size=(16, 4))
    earlier = _traced_graphs()  # other tests' graphs, still alive: not this fit's
    failing(monkeypatch.setattr, "layer_norm", "emit")
    model.fit(x.astype("float32"), y.astype("float32"), batch_size=8, epochs=1, verbose=0)

    report = tfmx.report()
    assert report.patterns["feed_forward"].fused == 1, report.patterns["feed_forward"].as_dict()
    assert "injected failure" in report.patterns["layer_norm"].errors[0]
    graphs = [g for g in _traced_graphs() if not any(g is e for e in earlier)]
    del earlier
    assert all("_building_function" in _attributes(g) for g in graphs)  # they are seen
    marked = {g.name: sorted(a for a in _attributes(g) if a.startswith("_tfmx")) for g in graphs}
    assert not any(marked.values()), {k: v for k, v in marked.items() if v}
    held = {g: trace_state.of(g) for g in graphs if trace_state.of(g) is not None}
    committed = [s for s in held.values() if s.committed]
    assert committed and all(s.stage_stats for s in committed)
    assert {family for s in committed for family, _ in s.stage_stats} >= {
        "feed_forward", "layer_norm"}
    assert all(s.stage_context is trace_state.UNSET for s in held.values())
    failed = [g for g, s in held.items() if s.abandoned]
    assert failed
    assert all(transaction.abandoned(g) == held[g].abandoned for g in failed)
    assert any("layer_norm" in name for g in failed for name in held[g].abandoned)


def test_a_graphs_state_is_dropped_with_the_graph():
    tfmx.enable(backend="cpu")
    double = tfmx.function(lambda x: x * 2.0)
    assert float(double(tf.constant(1.0))) == 2.0
    graph = double.get_concrete_function(tf.constant(1.0)).graph
    held = trace_state.of(graph)
    assert held is not None and held.committed  # tfmx.function traced and committed it
    assert staging.commit(graph) == 0 and held is trace_state.of(graph)
    gone = weakref.ref(held)
    del double, graph, held
    gc.collect()
    assert gone() is None

    scratch = FuncGraph("scratch")
    gone = weakref.ref(trace_state.of(scratch, create=True))
    del scratch
    gc.collect()
    assert gone() is None
