"""The pattern matcher's building blocks, shared by every pattern family.

Each answers one question about a :class:`~fusion.graph.GraphView`: who consumes a node, what a
constant holds, and above all :func:`blocker`: may a pattern swallow this intermediate, and if
not, why (the reason goes into the report).

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.match import blocker
    >>> @tf.function
    ... def f(x):
    ...     y = tf.nn.relu(x)
    ...     return tf.nn.relu(y), y * 2.0
    >>> g = f.get_concrete_function(tf.TensorSpec([2])).graph.as_graph_def()
    >>> view = GraphView(g.node)
    >>> relu = next(n for n in view if n.op == "Relu" and n.input[0] == "x")
    >>> blocker(view, relu, inside=set())
    'Relu output also feeds Mul, Relu'
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from fusion.graph import SHAPE_ONLY_OPS, GraphView, NodeDef, parse_input


def dtype_name(node: NodeDef, attr: str = "T") -> str:
    """The dtype attr of ``node`` by name ("float32", "bfloat16", ...)."""
    return tf.dtypes.as_dtype(node.attr[attr].type).name


def const_value(view: GraphView, ref: str) -> np.ndarray | None:
    """The value of a Const feeding ``ref``, or None if it is not a Const."""
    node = view.node(ref)
    if node is None or node.op != "Const":
        return None
    return tf.make_ndarray(node.attr["value"].tensor)


def is_scalar_const(view: GraphView, ref: str, value: float, tol: float = 1e-6) -> bool:
    """True if ``ref`` is a one-element Const equal to ``value`` within ``tol``."""
    arr = const_value(view, ref)
    return arr is not None and arr.size == 1 and abs(float(arr.reshape(())) - value) <= tol


def split_scalar_const(view: GraphView, node: NodeDef) -> tuple[str | None, float | None]:
    """(the non-constant input, the scalar) of a binary ``node`` with one scalar Const input.

    Either is None when absent, e.g. for ``AddV2(variance, epsilon)`` in a batch norm.
    """
    other, scalar = None, None
    for ref in view.data_inputs(node):
        value = const_value(view, ref)
        if value is not None and value.size == 1:
            scalar = float(value.reshape(()))
        else:
            other = ref
    return other, scalar


def outside_consumers(view: GraphView, node: NodeDef, inside: set[str]) -> list[NodeDef]:
    """Data consumers of ``node`` that are not in ``inside`` and read more than its shape."""
    return [
        c
        for c in view.consumers(node.name)
        if c.name not in inside and c.op not in SHAPE_ONLY_OPS
    ]


def blocker(view: GraphView, node: NodeDef, inside: set[str]) -> str | None:
    """Why ``node`` cannot be swallowed by a pattern whose nodes are ``inside``, or None."""
    if node.name in view.protected:
        return f"{node.op} output is fetched by the function"
    if view.has_control_edges(node):
        return f"{node.op} has a control edge"
    others = outside_consumers(view, node, inside)
    if others:
        ops = sorted({c.op for c in others})
        return f"{node.op} output also feeds {', '.join(ops)}"
    if any(p != 0 for _, _, p, ctl in view.consumer_edges(node.name) if not ctl):
        return f"{node.op} has consumers of other outputs"
    return None


def sole_consumer(view: GraphView, node: NodeDef) -> NodeDef | None:
    """The one node reading ``node``'s values (shape-only readers aside), or None."""
    data = [c for c in view.consumers(node.name) if c.op not in SHAPE_ONLY_OPS]
    return data[0] if len(data) == 1 else None


def consumer(view: GraphView, node: NodeDef, op: str) -> NodeDef | None:
    """The one consumer of ``node`` of op type ``op``, or None (none, or several)."""
    found = [c for c in view.consumers(node.name) if c.op == op]
    return found[0] if len(found) == 1 else None


def other_input(view: GraphView, node: NodeDef, known: NodeDef) -> str | None:
    """The input of binary ``node`` that is not produced by ``known``."""
    other = [i for i in view.data_inputs(node) if parse_input(i)[0] != known.name]
    return other[0] if len(other) == 1 else None


def same_shape(a: tuple | None, b: tuple | None) -> bool:
    """True if both static shapes are known, equal and not scalars."""
    return a is not None and b is not None and a == b and len(a) > 0


def set_list_s(attr: attr_value_pb2.AttrValue, values: tuple[str, ...]) -> None:
    """Fill a list(string) attr."""
    attr.list.s.extend(v.encode() for v in values)
