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
- ``Skip("Cast", inner)``: ``inner``, possibly behind a node of that op (Cast, Identity);
  ``many=True``: behind any number of them (a chain of Identity nodes).
- ``Near("half", 0.5, rtol)``: a scalar Const within ``rtol`` (relative) of a value: a formula's
  constant as a 16-bit graph holds it.
- ``OneOf(a, b, ...)``: the first alternative that matches.
- ``Where(inner, check, "why")``: ``inner``, and then ``check(view, match)`` must hold.

:func:`explain` gives the reason a pattern did not match (the deepest piece that failed), for a
decline reason a user can act on.

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
from collections.abc import Callable

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
    many: bool = False


@dataclasses.dataclass(frozen=True)
class Near(Pattern):
    name: str
    value: float
    rtol: float = 0.0


@dataclasses.dataclass(frozen=True)
class OneOf(Pattern):
    options: tuple[Pattern, ...]

    def __init__(self, *options: Pattern):
        object.__setattr__(self, "options", tuple(options))


@dataclasses.dataclass(frozen=True)
class Where(Pattern):
    inner: Pattern
    check: Callable[[GraphView, Match], bool]
    why: str


@dataclasses.dataclass
class Match:
    """What a pattern bound: tensor references, constant values, covered node names."""

    refs: dict[str, str] = dataclasses.field(default_factory=dict)
    values: dict[str, float] = dataclasses.field(default_factory=dict)
    nodes: set[str] = dataclasses.field(default_factory=set)
    reads_after: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    # (depth, why) of every piece that failed; shared by a match and its copies
    failures: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    def copy(self) -> Match:
        return Match(dict(self.refs), dict(self.values), set(self.nodes), list(self.reads_after),
                     self.failures)

    def fail(self, depth: int, why: str) -> None:
        self.failures.append((depth, why))

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


def _match(view: GraphView, ref: str, pattern: Pattern, found: Match,
           depth: int = 0) -> Match | None:
    if isinstance(pattern, Any):
        if _bind_ref(found, pattern.name, ref):
            return found
        found.fail(depth, f"{ref} is not the {pattern.name} seen before")
        return None
    if isinstance(pattern, (Const, Near)):
        value = _scalar(view, ref)
        if value is None:
            found.fail(depth, f"{ref} is not a scalar constant")
            return None
        if isinstance(pattern, Near):
            scale = max(abs(pattern.value), 1e-30)
            if abs(value - pattern.value) > pattern.rtol * scale:
                found.fail(depth, f"{ref} is {value:g}, not {pattern.value:g}")
                return None
        if found.values.setdefault(pattern.name, value) != value:
            found.fail(depth, f"{ref} differs from the {pattern.name} seen before")
            return None
        found.refs.setdefault(pattern.name, norm_ref(ref))
        return found
    if isinstance(pattern, OneOf):
        for option in pattern.options:
            got = _match(view, ref, option, found.copy(), depth)
            if got is not None:
                return got
        return None
    if isinstance(pattern, Where):
        got = _match(view, ref, pattern.inner, found, depth)
        if got is not None and not pattern.check(view, got):
            found.fail(depth, pattern.why)
            return None
        return got
    if isinstance(pattern, Skip):
        node = view.node(ref)
        if node is not None and node.op == pattern.op and parse_input(ref)[1] == 0:
            behind = pattern if pattern.many else pattern.inner
            inner = _match(view, view.data_inputs(node)[0], behind, found.copy(), depth + 1)
            if inner is not None:
                inner.nodes.add(node.name)
                return inner
        return _match(view, ref, pattern.inner, found, depth)
    node = view.node(ref)
    if node is None or parse_input(ref)[1] != 0:
        found.fail(depth, f"{ref} is not a node's first output")
        return None
    if isinstance(pattern, Read):
        if node.op != "ReadVariableOp" or not _bind_ref(found, pattern.handle, node.input[0]):
            found.fail(depth, f"{node.name} is not a read of {pattern.handle}")
            return None
        if pattern.after is not None:
            found.reads_after.append((node.name, pattern.after))
        if pattern.bind is not None and not _bind_ref(found, pattern.bind, node.name):
            return None
        found.nodes.add(node.name)
        return found
    assert isinstance(pattern, Op)
    if node.op not in pattern.ops:
        found.fail(depth, f"{node.name} is {node.op}, not {'/'.join(pattern.ops)}")
        return None
    inputs = view.data_inputs(node)
    if len(inputs) != len(pattern.args):
        found.fail(depth, f"{node.name} has {len(inputs)} inputs, not {len(pattern.args)}")
        return None
    orders = [inputs]
    if node.op in COMMUTATIVE and len(inputs) == 2:
        orders.append(inputs[::-1])
    for order in orders:
        attempt: Match | None = found.copy()
        for child_ref, child in zip(order, pattern.args):
            attempt = _match(view, child_ref, child, attempt, depth + 1)
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
    start = found.copy() if found is not None else Match()
    start.failures = []
    return _match(view, ref, pattern, start)


def explain(view: GraphView, ref: str, pattern: Pattern) -> str | None:
    """Why ``pattern`` does not match at ``ref``, or None: the deepest piece that failed (of
    several at that depth, the last one tried: a commutative op's second order).

    >>> from tensorflow.core.framework.node_def_pb2 import NodeDef
    >>> view = GraphView([NodeDef(name="x", op="Placeholder"),
    ...                   NodeDef(name="y", op="Sqrt", input=["x"])])
    >>> explain(view, "y", Op("Rsqrt", Any("x")))
    'y is Sqrt, not Rsqrt'
    """
    start = Match()
    if _match(view, ref, pattern, start) is not None:
        return None
    if not start.failures:
        return "no match"
    deepest = max(depth for depth, _ in start.failures)  # of those, the last tried
    return [why for depth, why in start.failures if depth == deepest][-1]
