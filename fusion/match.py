"""The pattern matcher's building blocks, shared by every pattern family.

Each answers one question about a :class:`~fusion.graph.GraphView`: who consumes a node, what a
constant holds, and above all :func:`blocker`: may a pattern swallow this intermediate, and if
not, why (the reason goes into the report). :func:`fused_node` writes the node that replaces a
matched chain.

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

from collections.abc import Mapping, Sequence
from typing import Any, Union

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import op_def_registry

from fusion.graph import SHAPE_ONLY_OPS, GraphView, NodeDef

# What fused_node accepts as an attr value: an AttrValue as is, or a plain value (a list's
# items all of one kind).
AttrLike = Union[
    attr_value_pb2.AttrValue, bool, int, float, str, tf.DType,
    Sequence[int], Sequence[float], Sequence[str], Sequence[tf.DType],
]


def dtype_name(node: NodeDef, attr: str = "T") -> str:
    """The dtype attr of ``node`` by name ("float32", "bfloat16", ...)."""
    return tf.dtypes.as_dtype(node.attr[attr].type).name


CONSTANT_OF_CONSTANTS = {"InvertPermutation": lambda perm: np.argsort(perm).astype(perm.dtype)}
"""Ops whose output is a constant when their inputs are Consts, with how to compute it (a
transpose's gradient permutes by the inverse of the forward's constant permutation)."""


def const_value(view: GraphView, ref: str) -> np.ndarray | None:
    """The value feeding ``ref`` if it is a Const, or an op of :data:`CONSTANT_OF_CONSTANTS`
    reading Consts alone (no control input); None otherwise."""
    node = view.node(ref)
    if node is None:
        return None
    if node.op == "Const":
        return tf.make_ndarray(node.attr["value"].tensor)
    fold = CONSTANT_OF_CONSTANTS.get(node.op)
    if fold is None or any(r.startswith("^") for r in node.input):
        return None
    sources = [view.node(r) for r in node.input]
    if not all(s is not None and s.op == "Const" for s in sources):
        return None
    return fold(*(tf.make_ndarray(s.attr["value"].tensor) for s in sources))




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


def rewire_shape_readers(view: GraphView, name: str, new_ref: str) -> None:
    """Let every reader of only ``name``'s shape (Shape, ShapeN, Size, Rank) read ``new_ref``
    instead: a tensor of the same shape that stands in for it after a rewrite."""
    for reader, index, _, control in view.consumer_edges(name):
        if not control and reader.op in SHAPE_ONLY_OPS:
            view.replace_input(reader, index, new_ref)


def sole_consumer(view: GraphView, node: NodeDef) -> NodeDef | None:
    """The one node reading ``node``'s values (shape-only readers aside), or None."""
    data = [c for c in view.consumers(node.name) if c.op not in SHAPE_ONLY_OPS]
    return data[0] if len(data) == 1 else None


def consumer(view: GraphView, node: NodeDef, op: str) -> NodeDef | None:
    """The one consumer of ``node`` of op type ``op``, or None (none, or several)."""
    found = [c for c in view.consumers(node.name) if c.op == op]
    return found[0] if len(found) == 1 else None




def same_shape(a: tuple | None, b: tuple | None) -> bool:
    """True if both static shapes are known, equal and not scalars."""
    return a is not None and b is not None and a == b and len(a) > 0


def set_list_s(attr: attr_value_pb2.AttrValue, values: tuple[str, ...]) -> None:
    """Fill a list(string) attr."""
    attr.list.s.extend(v.encode() for v in values)


def _set_attr(attr: attr_value_pb2.AttrValue, value: AttrLike) -> None:
    """Fill ``attr`` from a plain value (bool, int, float, str, tf.DType or a list of one)."""
    if isinstance(value, attr_value_pb2.AttrValue):
        attr.CopyFrom(value)
    elif isinstance(value, bool):
        attr.b = value
    elif isinstance(value, int):
        attr.i = value
    elif isinstance(value, float):
        attr.f = value
    elif isinstance(value, str):
        attr.s = value.encode()
    elif isinstance(value, tf.DType):
        attr.type = value.as_datatype_enum
    elif isinstance(value, (list, tuple)):
        attr.list.SetInParent()
        if all(isinstance(v, str) for v in value):
            set_list_s(attr, tuple(value))
        elif all(isinstance(v, tf.DType) for v in value):
            attr.list.type.extend(v.as_datatype_enum for v in value)
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            attr.list.i.extend(value)
        elif all(isinstance(v, float) for v in value):
            attr.list.f.extend(value)
        else:
            raise TypeError(f"attr list must hold one kind of str, int, float or tf.DType, "
                            f"got {value!r}")
    else:
        raise TypeError(f"cannot make an attr of {type(value).__name__} {value!r}; pass an "
                        f"AttrValue or a bool, int, float, str, tf.DType or list of one")


def new_node(name: str, op: str, inputs: Sequence[str] = (), device: str = "",
             **attrs: Any) -> NodeDef:
    """A NodeDef with plain Python attrs (bool, float, int, bytes, tf.DType, a TensorShape
    for ``_output_shapes``): the one node builder of the families (a fused node that copies
    a matched node's attrs is :func:`fused_node`).

    >>> import tensorflow as tf
    >>> node = new_node("n", "Cast", ["x"], SrcT=tf.int32, DstT=tf.float32, Truncate=False)
    >>> node.attr["DstT"].type == tf.float32.as_datatype_enum, node.attr["Truncate"].b
    (True, False)
    """
    node = NodeDef(name=name, op=op, device=device)
    node.input.extend(inputs)
    for key, value in attrs.items():
        if isinstance(value, bool):
            node.attr[key].b = value
        elif isinstance(value, float):
            node.attr[key].f = value
        elif isinstance(value, int):
            node.attr[key].i = value
        elif isinstance(value, bytes):
            node.attr[key].s = value
        elif isinstance(value, tf.DType):
            node.attr[key].type = value.as_datatype_enum
        elif isinstance(value, tf.TensorShape):
            node.attr[key].list.shape.add().CopyFrom(value.as_proto())
        else:
            raise TypeError(f"attr {key}: {value!r}")
    return node


def const_node(name: str, value: np.ndarray, device: str = "") -> NodeDef:
    """A Const node holding ``value`` (its dtype and shape, ``_output_shapes`` set).

    >>> const_node("half", np.array(0.5, np.float32)).attr["value"].tensor.float_val
    [0.5]
    """
    node = new_node(name, "Const", [], device, dtype=tf.as_dtype(value.dtype),
                    _output_shapes=tf.TensorShape(value.shape))
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))
    return node


def fused_node(
    template: NodeDef,
    op: str,
    tail: NodeDef,
    inputs: Sequence[str],
    attrs: Mapping[str, AttrLike] | None = None,
    device: str | None = None,
) -> NodeDef:
    """A new ``op`` node to stand in for a matched chain from ``template`` to ``tail``.

    The node takes ``tail``'s name, so the chain's consumers need no rewiring, and its
    ``_output_shapes``. Its attrs are, in order: ``template``'s (usually the contraction), then
    ``attrs``, each kept only where ``op``'s OpDef declares it, then the OpDef's defaults for any
    still missing. Values in ``attrs`` may be AttrValues or plain Python values (a str list
    becomes ``list(string)``, a tf.DType list ``list(type)``). ``device`` defaults to
    ``template``'s. Nothing is added to or removed from a view: the caller does that.

    >>> import tensorflow as tf
    >>> from fusion.graph import NodeDef
    >>> from fusion.match import fused_node
    >>> matmul = NodeDef(name="mm", op="MatMul", input=["x", "w"])
    >>> matmul.attr["T"].type = tf.float32.as_datatype_enum
    >>> matmul.attr["transpose_b"].b = True
    >>> bias = NodeDef(name="out", op="BiasAdd", input=["mm", "b"])
    >>> node = fused_node(matmul, "_FusedMatMul", bias, ["x", "w", "b"],
    ...                   {"num_args": 1, "fused_ops": ["BiasAdd"]})
    >>> node.name, list(node.input), node.attr["transpose_b"].b, node.attr["fused_ops"].list.s
    ('out', ['x', 'w', 'b'], True, [b'BiasAdd'])
    >>> sorted(node.attr)  # transpose_a, epsilon, leakyrelu_alpha: the OpDef's defaults
    ['T', 'epsilon', 'fused_ops', 'leakyrelu_alpha', 'num_args', 'transpose_a', 'transpose_b']
    """
    op_def = op_def_registry.get(op)
    if op_def is None:
        raise ValueError(f"no op {op!r} is registered with TensorFlow; check the name")
    declared = {a.name for a in op_def.attr}
    node = NodeDef(name=tail.name, op=op, device=template.device if device is None else device)
    node.input.extend(inputs)
    for key, value in template.attr.items():
        if key in declared:
            node.attr[key].CopyFrom(value)
    for key, value in (attrs or {}).items():
        if key in declared:
            _set_attr(node.attr[key], value)
    for attr in op_def.attr:
        if attr.name not in node.attr and attr.HasField("default_value"):
            node.attr[attr.name].CopyFrom(attr.default_value)
    if "_output_shapes" in tail.attr:
        node.attr["_output_shapes"].CopyFrom(tail.attr["_output_shapes"])
    return node
