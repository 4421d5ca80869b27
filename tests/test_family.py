"""A family defined here, in the shape every built-in family has, and nothing else edited.

``double_negation`` is a graph pass: ``Neg(Neg(x))`` -> ``x`` (exact), declared after
``contraction`` with its reason. ``halved`` is a stage: a Keras layer of this file whose
``call`` computes ``x * 0.5`` is routed, while tfmx traces, to a handler that emits
``x / 2`` (the same value, exactly) under its own name scope; the one generic observer
(``fusion.family.Forms``) finds that scope in the traced graph. Each is switched on and off
by name through ``tfmx.enable(patterns=..., exclude=...)``, reported, and in the pipeline at its
declared place.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import fusion
import tfmx
from fusion.family import Family, Forms, declare, families, forget, register
from fusion.graph import GraphView, NodeDef
from fusion.pattern import PatternStats, RewriteContext, apply_matches
from fusion.stage import Hook, StageContext


# -- a graph pass, in one module-sized definition ------------------------------------------
@dataclasses.dataclass
class DoubleNegation:
    outer: NodeDef
    inner: NodeDef


def find_double_negations(view: GraphView) -> tuple[list[DoubleNegation], list[str]]:
    """Every ``Neg(Neg(x))`` whose inner ``Neg`` feeds only the outer one, and why others stay."""
    matches, declined = [], []
    for outer in view.nodes():
        inner = view.node(outer.input[0]) if outer.op == "Neg" else None
        if inner is None or inner.op != "Neg":
            continue
        if len(view.consumers(inner.name)) != 1 or inner.name in view.protected:
            declined.append("Neg(Neg(x)): the inner Neg has other readers")
            continue
        matches.append(DoubleNegation(outer, inner))
    return matches, declined


def rewrite_double_negation(view: GraphView, match: DoubleNegation) -> NodeDef:
    """The outer ``Neg`` becomes an ``Identity`` of ``x`` (its name kept for its readers)."""
    identity = NodeDef(name=match.outer.name, op="Identity", input=[match.inner.input[0]])
    identity.attr["T"].CopyFrom(match.outer.attr["T"])
    view.remove(match.inner.name)
    view.replace(match.outer.name, identity)
    return identity


def _double_negation_pass(view: GraphView, ctx: RewriteContext) -> None:
    apply_matches(view, ctx, find_double_negations(view), rewrite_double_negation,
                  lambda m: "Neg(Neg(x)) -> x")


# -- a stage, in one module-sized definition ----------------------------------------------
class Halve(keras.layers.Layer):
    """x * 0.5."""

    def call(self, x):
        return x * 0.5


SCOPE = "tfmx_halved"


def halved_call(ctx: StageContext, original, layer, x, *args, **kwargs):
    """Emit ``x / 2`` under ``tfmx_halved_divide`` and record it; Keras's call where the input
    is not a float tensor."""
    stats = PatternStats(matched=1)
    if not tf.is_tensor(x) or not x.dtype.is_floating:
        stats.decline("Halve: not a float tensor")
        ctx.record("halved", stats)
        return original(layer, x, *args, **kwargs)
    with tf.name_scope(f"{SCOPE}_divide"):
        out = tf.math.divide(x, tf.constant(2.0, x.dtype))
    stats.fuse("Halve: x / 2")
    ctx.record("halved", stats)
    return out


@pytest.fixture
def new_families():
    """Declare both families for one test; forgotten (and the stage hooks put back) after."""
    register("double_negation", "Neg(Neg(x)) -> x", after=("contraction",),
             order="a test family placed after contraction")(_double_negation_pass)
    declare(Family("halved", "Halve's x * 0.5 -> x / 2, before differentiation",
                   hooks=(Hook(f"{__name__}:Halve", "call", halved_call),),
                   forms=Forms(SCOPE, {"divide": frozenset({"RealDiv"})},
                               {"divide": "Halve: x / 2"})))
    yield
    tfmx.disable()
    forget("double_negation")
    forget("halved")


def _step():
    layer = Halve()

    @tfmx.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(tf.math.negative(tf.math.negative(layer(x))))
        return y, tape.gradient(y, x)

    return step


def _ran(step, x):
    """(the op counts of the graph traced and of the graph that ran, as the report counts
    them; its outputs)."""
    tfmx.report(reset=True)
    out = [v.numpy() for v in step(x)]
    before, after = tfmx.report().op_histogram()
    return before, after, out


def test_the_families_take_their_declared_places():
    with_families = None
    try:
        register("double_negation", "Neg(Neg(x)) -> x", after=("contraction",),
                 order="a test family placed after contraction")(_double_negation_pass)
        with_families = [f.name for f in families()]
    finally:
        forget("double_negation")
    assert with_families.index("contraction") < with_families.index("double_negation")
    assert with_families.index("double_negation") < with_families.index("dedupe")
    assert "double_negation" not in fusion.available_patterns()


def test_a_new_family_is_switched_by_name_reported_and_fused(new_families):
    x = tf.constant(np.arange(6, dtype="float32").reshape(2, 3))
    tfmx.enable(backend="cpu", guard=False, tune="off", exclude=["double_negation", "halved"])
    _, ran, stock = _ran(_step(), x)
    assert ran["Neg"] >= 4 and not ran["RealDiv"]  # two forward, two in the gradient

    tfmx.enable(backend="cpu", guard=False, tune="off", patterns=["double_negation", "halved"])
    traced, ran, fused = _ran(_step(), x)
    rewritten = tfmx.report().patterns["double_negation"].fused
    assert rewritten == 2 and ran["Neg"] == traced["Neg"] - 2 * rewritten  # the graph that ran
    assert ran["RealDiv"] and ran["Identity"] >= traced["Identity"] + 2
    for got, want in zip(fused, stock):
        np.testing.assert_array_equal(got, want)  # exact: x / 2 == x * 0.5, --x == x
    report = tfmx.report()
    assert report.patterns["double_negation"].fused_kinds["Neg(Neg(x)) -> x"] >= 1
    assert report.patterns["halved"].fused_kinds["Halve: x / 2"] >= 1  # the stage's record
    assert report.patterns["halved"].observed["Halve: x / 2"] >= 1  # the generic observer's
    assert "double_negation" in str(report)


def test_excluding_one_leaves_the_other(new_families):
    x = tf.constant(np.ones((2, 3), "float32"))
    tfmx.enable(backend="cpu", guard=False, tune="off", exclude=["halved"])
    traced, ran, _ = _ran(_step(), x)
    assert ran["Neg"] == traced["Neg"] - 4 and not ran["RealDiv"]
    assert "halved" not in tfmx.report().patterns
