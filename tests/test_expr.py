"""fusion.expr: the one matcher (tree patterns over a GraphView), GraphDef-level."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.core.framework.node_def_pb2 import NodeDef

from fusion.expr import Any, Const, Match, Near, OneOf, Op, Skip, Where, explain, match
from fusion.graph import GraphView


def _const(name: str, value: float, dtype=np.float32) -> NodeDef:
    node = NodeDef(name=name, op="Const")
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.array(value, dtype)))
    return node


def _view() -> GraphView:
    # y = (x * 0.5) + cast(0.7071), and r = Rsqrt(x)
    return GraphView([
        NodeDef(name="x", op="Placeholder"),
        _const("half", 0.5), _const("c", 0.70703125),
        NodeDef(name="cast", op="Cast", input=["c"]),
        NodeDef(name="mul", op="Mul", input=["half", "x"]),
        NodeDef(name="y", op="AddV2", input=["mul", "cast"]),
        NodeDef(name="r", op="Rsqrt", input=["x"]),
    ])


def test_commutative_ops_skip_and_near_constants():
    pattern = Op("AddV2", Op("Mul", Any("x"), Const("half")),
                 Skip("Cast", Near("c", 0.7071067811865476, 2**-7)))
    found = match(_view(), "y", pattern)
    assert found is not None and found.refs["x"] == "x" and found.values["half"] == 0.5
    assert found.nodes == {"y", "mul", "cast"}
    # the same constant as a float32 graph holds it is too far for a float32 tolerance
    assert match(_view(), "y", Op("AddV2", Op("Mul", Any("x"), Const("half")),
                                  Skip("Cast", Near("c", 0.7071067811865476, 1e-6)))) is None


def test_alternatives_predicates_and_prebound_names():
    norm = OneOf(Op("Rsqrt", Any("v")), Op("Sqrt", Any("v")))
    assert match(_view(), "r", norm).refs["v"] == "x"
    checked = Where(Op("Rsqrt", Any("v")), lambda view, m: m.refs["v"] != "x", "v must not be x")
    assert match(_view(), "r", checked) is None
    assert explain(_view(), "r", checked) == "v must not be x"
    assert match(_view(), "r", Op("Rsqrt", Any("v")), Match(refs={"v": "half"})) is None


def test_explain_names_the_deepest_piece_that_failed():
    pattern = Op("AddV2", Op("Mul", Any("x"), Near("half", 0.25)), Any("c"))
    assert explain(_view(), "y", pattern) == "half is 0.5, not 0.25"
    assert explain(_view(), "y", Op("Sub", Any("a"), Any("b"))) == "y is AddV2, not Sub"
    assert explain(_view(), "y", Op("AddV2", Any("a"), Any("b"))) is None


def test_skip_many_looks_through_a_chain():
    view = GraphView([
        NodeDef(name="x", op="Placeholder"),
        NodeDef(name="widen", op="Cast", input=["x"]),
        NodeDef(name="i1", op="Identity", input=["widen"]),
        NodeDef(name="i2", op="Identity", input=["i1"]),
        NodeDef(name="narrow", op="Cast", input=["i2"]),
    ])
    inner = Op("Cast", Any("source"), bind="first")
    found = match(view, "narrow", Op("Cast", Skip("Identity", inner, many=True)))
    assert found.refs["first"] == "widen" and found.nodes == {"narrow", "i1", "i2", "widen"}
    assert match(view, "narrow", Op("Cast", Skip("Identity", inner))) is None  # one only
