"""Tree patterns over a GraphView: write the composite a library emits as an expression.

A pattern is built from a few pieces and matched against the tensor a node consumes:

- ``Op("Mul", a, b)``: a node of that op type (or one of several: ``Op(("Add", "AddV2"), ...)``)
  whose data inputs match ``a`` and ``b``; commutative ops (Mul, AddV2, Maximum...) match
  in either order. ``bind="name"`` binds the node's output reference.
- ``Any("name")``: any tensor, bound to ``name``. Binding the same name twice requires the
  same tensor, so ``Op("Sub", Any("g"), ...)`` and ``Op("Square", Any("g"))`` must see one
  gradient.
- ``Const("name")``: a scalar Const, its value bound to ``name``.
- ``Read("m")``: a ReadVariableOp of the resource bound to ``m`` (a handle reference).
  ``after="update"`` also requires a control edge from the node bound to ``update`` (the read
  sees the value that update wrote); :meth:`Match.order_holds` checks it once all is bound.
- ``Skip("Cast", inner)``: ``inner``, possibly behind a node of that op (Cast, Identity).

:func:`match` returns a :class:`Match` (bindings and the names of the nodes the pattern
covered) or None.

Example:
    >>> from tensorflow.core.framework.node_def_pb2 import NodeDef
    >>> from fusion.graph import GraphView
    >>> view = GraphView([NodeDef(name="g", op="Placeholder"), NodeDef(name="h", op="Placeholder"),
    ...                   NodeDef(name="m", op="ReadVariableOp", input=["h"]),
    ...                   NodeDef(name="sub", op="Sub", input=["g", "m"])])
    >>> found = match(view, "sub", Op("Sub", Any("grad"), Read("slot")))
    >>> found.refs["grad"], found.refs["slot"], sorted(found.nodes)
    ('g', 'h', ['m', 'sub'])
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from fusion.graph import GraphView, parse_input

COMMUTATIVE = frozenset({"Mul", "Add", "AddV2", "Maximum", "Minimum"})


class Pattern:
    """Base class of the pieces below."""


@dataclasses.dataclass(frozen=True)
class Op(Pattern):
    ops: str | tuple[str, ...]
    args: tuple[Pattern, ...] = ()
    bind: str | None = None

    def __init__(self, ops: str | tuple[str, ...], *args: Pattern, bind: str | None = None):
        object.__setattr__(self, "ops", (ops,) if isinstance(ops, str) else tuple(ops))
        object.__setattr__(self, "args", tuple(args))
        object.__setattr__(self, "bind", bind)


@dataclasses.dataclass(frozen=True)
class Any(Pattern):
    name: str


@dataclasses.dataclass(frozen=True)
class Const(Pattern):
    name: str


@dataclasses.dataclass(frozen=True)
class Read(Pattern):
    handle: str
    after: str | None = None
    bind: str | None = None


@dataclasses.dataclass(frozen=True)
class Skip(Pattern):
    op: str
    inner: Pattern


@dataclasses.dataclass
class Match:
    """What a pattern bound: tensor references, constant values, covered node names."""

    refs: dict[str, str] = dataclasses.field(default_factory=dict)
    values: dict[str, float] = dataclasses.field(default_factory=dict)
    nodes: set[str] = dataclasses.field(default_factory=set)
    reads_after: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def copy(self) -> Match:
        return Match(dict(self.refs), dict(self.values), set(self.nodes), list(self.reads_after))

    def order_holds(self, view: GraphView) -> bool:
        """Every ``Read(after=...)`` has a control edge from the node bound to ``after``."""
        for read, writer in self.reads_after:
            bound = self.refs.get(writer)
            if bound is None or f"^{bound}" not in view.node(read).input:
                return False
        return True


def norm_ref(ref: str) -> str:
    """A data reference in one spelling: ``node`` for port 0, ``node:port`` otherwise."""
    name, port, _ = parse_input(ref)
    return name if port == 0 else f"{name}:{port}"


def _bind_ref(found: Match, name: str, ref: str) -> bool:
    ref = norm_ref(ref)
    if found.refs.setdefault(name, ref) != ref:
        return False
    return True


def _scalar(view: GraphView, ref: str) -> float | None:
    node = view.node(ref)
    if node is None or node.op != "Const" or parse_input(ref)[1] != 0:
        return None
    value = tf.make_ndarray(node.attr["value"].tensor)
    return float(np.reshape(value, ())) if value.size == 1 else None


def _match(view: GraphView, ref: str, pattern: Pattern, found: Match) -> Match | None:
    if isinstance(pattern, Any):
        return found if _bind_ref(found, pattern.name, ref) else None
    if isinstance(pattern, Const):
        value = _scalar(view, ref)
        if value is None or found.values.setdefault(pattern.name, value) != value:
            return None
        found.refs.setdefault(pattern.name, norm_ref(ref))
        return found
    if isinstance(pattern, Skip):
        node = view.node(ref)
        if node is not None and node.op == pattern.op and parse_input(ref)[1] == 0:
            inner = _match(view, view.data_inputs(node)[0], pattern.inner, found.copy())
            if inner is not None:
                inner.nodes.add(node.name)
                return inner
        return _match(view, ref, pattern.inner, found)
    node = view.node(ref)
    if node is None or parse_input(ref)[1] != 0:
        return None
    if isinstance(pattern, Read):
        if node.op != "ReadVariableOp" or not _bind_ref(found, pattern.handle, node.input[0]):
            return None
        if pattern.after is not None:
            found.reads_after.append((node.name, pattern.after))
        if pattern.bind is not None and not _bind_ref(found, pattern.bind, node.name):
            return None
        found.nodes.add(node.name)
        return found
    assert isinstance(pattern, Op)
    if node.op not in pattern.ops:
        return None
    inputs = view.data_inputs(node)
    if len(inputs) != len(pattern.args):
        return None
    orders = [inputs]
    if node.op in COMMUTATIVE and len(inputs) == 2:
        orders.append(inputs[::-1])
    for order in orders:
        attempt: Match | None = found.copy()
        for child_ref, child in zip(order, pattern.args):
            attempt = _match(view, child_ref, child, attempt)
            if attempt is None:
                break
        if attempt is not None and (
            pattern.bind is None or _bind_ref(attempt, pattern.bind, node.name)
        ):
            attempt.nodes.add(node.name)
            return attempt
    return None


def match(view: GraphView, ref: str, pattern: Pattern, found: Match | None = None) -> Match | None:
    """Match ``pattern`` against the tensor ``ref``, extending ``found``'s bindings."""
    return _match(view, ref, pattern, found.copy() if found is not None else Match())
