"""A stage's timed candidates run as the step runs them: in a mixed-precision layer's call Keras
casts the layer's float32 weights to its compute dtype, and a candidate timed on the tuner's own
thread (where Keras's per-thread autocast is not on) must read them cast the same way, or a
bfloat16 layer's forms are timed in float32."""

from __future__ import annotations

import concurrent.futures

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmx
from fusion.stage import autocast, autocast_dtype, timed_form

CONTRACTIONS = ("MatMul", "BatchMatMulV2", "Einsum")


def _on_another_thread(fn):
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result()


@pytest.mark.parametrize("compute", [None, "bfloat16", "float16"])
def test_a_candidate_reads_weights_in_the_dtype_of_the_call_it_was_made_in(compute):
    weight = keras.Variable(np.ones((3, 2), "float32"))
    seen = []

    def forward(x):
        w = weight.value  # what a layer's call reads: cast under Keras's autocast
        seen.append(w.dtype.name)
        return tf.matmul(x, w)

    dtype = tf.float32 if compute is None else tf.as_dtype(compute)
    with autocast(compute):
        assert autocast_dtype() == compute
        factory = timed_form(forward, [[None, 3]], dtype, [weight])
    assert autocast_dtype() is None
    _on_another_thread(lambda: factory()())  # the tuner's thread, outside the scope
    assert seen == [compute or "float32"]


def _graph_nodes(run) -> list:
    """Nodes (with the function library's) of the function a timed candidate (``timed_form``'s
    runnable) runs: the ConcreteFunction in the runnable's closure."""
    for cell in run.__closure__ or ():
        fn = cell.cell_contents
        if hasattr(fn, "graph") and hasattr(fn, "structured_outputs"):
            graph = fn.graph.as_graph_def()
            return [*graph.node, *(n for f in graph.library.function for n in f.node_def)]
    raise AssertionError("no ConcreteFunction in the candidate's closure")


def _contraction_dtypes(run) -> set[str]:
    return {tf.as_dtype(n.attr["T"].type).name for n in _graph_nodes(run)
            if n.op in CONTRACTIONS}


def _recording_timer(record, winner: str):
    """A tuner timer that builds and runs each candidate once, hands it to ``record(name,
    run)``, and times ``winner`` fastest."""

    def timer(candidates, seconds):
        for name, factory in candidates.items():
            run = factory()
            run()
            record(name, run)
        return {name: 1.0 if name == winner else 2.0 for name in candidates}

    return timer


def _fit_einsum_dense(monkeypatch, timer, patterns, policy="float32", activation=None):
    """Fit a small model with an EinsumDense under tfmx with ``patterns``, every decision
    measured by ``timer`` through the real tuner (its timer on a thread of its own)."""
    from tfmx import state
    from tfmx.tuner import Tuner

    tuner = Tuner("auto", None, timer)
    monkeypatch.setattr(state, "tuner", lambda: tuner)
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        inp = keras.Input((6, 8))
        x = keras.layers.EinsumDense("abc,cde->abde", (6, 2, 4), bias_axes="de",
                                     activation=activation)(inp)
        out = keras.layers.Dense(2, dtype="float32")(keras.layers.Flatten()(x))
        model = keras.Model(inp, out)
        model.compile(optimizer="sgd", loss="mse")
        tfmx.enable(backend="cpu", patterns=patterns)
        model.fit(np.ones((4, 6, 8), "float32"), np.ones((4, 2), "float32"), epochs=1,
                  verbose=0)
    finally:
        tfmx.disable()
        keras.mixed_precision.set_global_policy("float32")


def test_mixed_bfloat16_einsum_dense_forms_are_timed_in_bfloat16(monkeypatch):
    """Both forms of a mixed_bfloat16 EinsumDense contract in bfloat16, as the step does."""
    timed: dict[str, set[str]] = {}
    timer = _recording_timer(lambda name, run: timed.setdefault(name, _contraction_dtypes(run)),
                             winner="einsum")
    _fit_einsum_dense(monkeypatch, timer, ["einsum_dense"], policy="mixed_bfloat16")
    assert set(timed) == {"einsum", "matmul", "matmul bias row"}, timed
    assert all(dtypes == {"bfloat16"} for dtypes in timed.values()), timed


@pytest.mark.parametrize("passes", [True, False])
def test_a_candidate_runs_through_the_graph_passes_the_step_gets(monkeypatch, passes):
    """The MatMul form of an EinsumDense with a relu is timed as the step runs it: with the
    contraction family on, as one _FusedMatMul(BiasAdd, Relu); without it, unfused."""
    ops: dict[str, set[str]] = {}
    timer = _recording_timer(
        lambda name, run: ops.setdefault(name, {n.op for n in _graph_nodes(run)}),
        winner="matmul")
    patterns = ["einsum_dense", "contraction"] if passes else ["einsum_dense"]
    _fit_einsum_dense(monkeypatch, timer, patterns, activation="relu")
    assert set(ops) >= {"einsum", "matmul"}, ops
    assert ("_FusedMatMul" in ops["matmul"]) is passes, ops["matmul"]
    assert "_FusedMatMul" not in ops["einsum"]
