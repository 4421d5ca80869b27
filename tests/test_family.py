"""A family defined here, in the shape every built-in family has, and nothing else edited.

``double_negation`` is a graph pass: ``Neg(Neg(x))`` -> ``x`` (exact), one rule
(``fusion.rule``: an expression to match, a check giving the reason it declines, the form it
emits), declared after ``contraction`` with its reason. ``halved`` is a stage: a Keras layer of
this file whose ``call`` computes ``x * 0.5`` is routed, while tfmx traces, to a handler that emits
``x / 2`` (the same value, exactly) under its own name scope; the one generic observer
(``fusion.family.Forms``) finds that scope in the traced graph. Each is switched on and off
by name through ``tfmx.enable(patterns=..., exclude=...)``, reported, and in the pipeline at its
declared place.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import fusion
import tfmx
from fusion.expr import Any, Match, Op
from fusion.family import (
    Family,
    Form,
    Forms,
    conservative,
    declare,
    families,
    forget,
    get,
    register,
)
from fusion.graph import GraphView, NodeDef
from fusion.pattern import PatternStats, PlainTarget, RewriteContext
from fusion.rule import Rule, RuleContext
from fusion.stage import CallSite, Hook, StageContext, rewrite_call

# -- a graph pass, in one module-sized definition ------------------------------------------
# match: Neg(Neg(x)), from the outer Neg
DOUBLE_NEGATION = Op("Neg", Op("Neg", Any("x"), bind="inner"), bind="outer")


# check: None to rewrite, else the reason the report records
def check_double_negation(found: Match, ctx: RuleContext) -> str | None:
    inner = found.refs["inner"]
    if len(ctx.view.consumers(inner)) != 1 or inner in ctx.view.protected:
        return "Neg(Neg(x)): the inner Neg has other readers"
    if ctx.overlaps(found.nodes):
        return "Neg(Neg(x)): overlaps another"
    return None


# emit: the outer Neg becomes an Identity of x (its name kept for its readers)
def rewrite_double_negation(view: GraphView, found: Match) -> NodeDef:
    outer = view.node(found.refs["outer"])
    identity = NodeDef(name=outer.name, op="Identity", input=[found.refs["x"]])
    identity.attr["T"].CopyFrom(outer.attr["T"])
    view.remove(found.refs["inner"])
    view.replace(outer.name, identity)
    return identity


# declaration
RULE = Rule(anchors=frozenset({"Neg"}), match=DOUBLE_NEGATION, check=check_double_negation,
            emit=lambda v, m: rewrite_double_negation(v, m), kind=lambda m: "Neg(Neg(x)) -> x",
            claims=lambda m: m.nodes)


def _double_negation_pass(view: GraphView, ctx: RewriteContext) -> None:
    RULE.apply(view, ctx)


# -- a stage, in one module-sized definition ----------------------------------------------
class Halve(keras.layers.Layer):
    """x * 0.5."""

    def call(self, x):
        return x * 0.5


FORMS = Forms("tfmx_halved", (conservative("multiply", "Keras's x * 0.5"),
                              Form("divide", "Halve: x / 2", marks=frozenset({"RealDiv"}))))


def halved_call(ctx: StageContext, original, layer, x, *args, **kwargs):
    """Emit ``x / 2`` under ``tfmx_halved_divide`` and record it; Keras's call where the input
    is not a float tensor."""
    why = None if tf.is_tensor(x) and x.dtype.is_floating else "not a float tensor"
    return rewrite_call(ctx, CallSite(
        get("halved"), (FORMS["divide"],), keras=lambda: original(layer, x, *args, **kwargs),
        emit=lambda form: tf.math.divide(x, tf.constant(2.0, x.dtype)), what="Halve", why=why))


@pytest.fixture
def new_families():
    """Declare both families for one test; forgotten (and the stage hooks put back) after."""
    register("double_negation", "Neg(Neg(x)) -> x", after=("contraction",),
             order="a test family placed after contraction")(_double_negation_pass)
    declare(Family("halved", "Halve's x * 0.5 -> x / 2, before differentiation",
                   hooks=(Hook(f"{__name__}:Halve", "call", halved_call),),
                   forms=FORMS))
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


# -- the rule driver ----------------------------------------------------------------------
def _negations(depth: int, extra_reader: bool = False) -> GraphView:
    """x, then ``depth`` Negs in a chain (n1 = -x, n2 = -n1, ...); an Abs of n1 if asked."""
    nodes = [NodeDef(name="x", op="Placeholder")]
    for i in range(1, depth + 1):
        nodes.append(NodeDef(name=f"n{i}", op="Neg", input=[nodes[-1].name]))
        nodes[-1].attr["T"].type = tf.float32.as_datatype_enum
    if extra_reader:
        nodes.append(NodeDef(name="other", op="Abs", input=["n1"]))
    return GraphView(nodes)


def test_a_rule_records_each_decline_and_emits_what_it_accepted():
    view = _negations(2, extra_reader=True)
    ctx = RewriteContext(PlainTarget("toy"), PatternStats())
    RULE.apply(view, ctx)
    assert ctx.stats.as_dict()["declined"] == {"Neg(Neg(x)): the inner Neg has other readers": 1}
    assert ctx.stats.matched == 1 and ctx.stats.fused == 0
    assert view.node("n2").op == "Neg"  # declined: left as it was


def test_a_rule_finds_on_the_graph_as_it_was_and_claims_what_it_takes():
    view = _negations(3)  # n2 = Neg(Neg(x)) and n3 = Neg(Neg(n1)) overlap at n2
    matches, declined = RULE.find(view, PlainTarget("toy"))
    assert [m.refs["outer"] for m in matches] == ["n2"]
    assert declined == ["Neg(Neg(x)): overlaps another"]
    ctx = RewriteContext(PlainTarget("toy"), PatternStats())
    RULE.apply(view, ctx)
    assert (ctx.stats.fused, view.node("n2").op, list(view.node("n2").input)) == (
        1, "Identity", ["x"])
    assert view.node("n3").op == "Neg" and "n1" not in view


def test_a_rule_may_leave_a_graph_alone_and_take_a_last_look():
    leave = Rule(match=DOUBLE_NEGATION, check=check_double_negation,
                 emit=rewrite_double_negation, kind=str, anchors=frozenset({"Neg"}),
                 begin=lambda ctx: ["not this graph"])
    assert leave.find(_negations(2), PlainTarget("toy")) == ([], ["not this graph"])
    drop_all = Rule(match=DOUBLE_NEGATION, check=check_double_negation,
                    emit=rewrite_double_negation, kind=str, anchors=frozenset({"Neg"}),
                    finish=lambda found, ctx: ([], [f"dropped {len(found)}"]))
    assert drop_all.find(_negations(2), PlainTarget("toy")) == ([], ["dropped 1"])


def test_a_match_function_may_decline_before_it_makes_a_record():
    rule = Rule(match=lambda node, ctx: "no record: a reason" if node.op == "Neg" else None,
                check=lambda record, ctx: None, emit=lambda view, record: None, kind=str)
    assert rule.find(_negations(2), PlainTarget("toy")) == ([], ["no record: a reason"] * 2)


PLAIN_PASSES = {"rnn": "it observes what its stage emitted, rewrites nothing"}
"""The graph modules that are not rules, and why (each says so in its docstring)."""


def test_every_graph_family_is_rules_in_one_shape():
    """Each module of fusion/graphs that declares a rewriting family holds its rule(s) as
    ``RULE`` and reads in the sections match, check, emit, declaration; a module that does not
    rewrite says it is not a rule; a module that declares no family (a capability's data) has
    no sections to keep."""
    import importlib
    import pathlib

    sections = ("match", "check", "emit", "declaration")
    for path in sorted((pathlib.Path(fusion.__file__).parent / "graphs").glob("[!_]*.py")):
        module = importlib.import_module(f"fusion.graphs.{path.stem}")
        source = path.read_text()
        if path.stem in PLAIN_PASSES:
            assert "not a rule" in module.__doc__, path.name
            continue
        if "RULE" not in vars(module):
            assert "@register(" not in source, f"{path.name} declares a family but no RULE"
            continue
        assert isinstance(module.RULE, Rule), path.name
        found = [line.split()[2].rstrip(":") for line in source.splitlines()
                 if line.startswith("# -- ")]
        order = [s for i, s in enumerate(found) if i == 0 or s != found[i - 1]]
        assert order == list(sections), (path.name, found)
