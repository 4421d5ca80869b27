"""Duplicate values: the same variable read, or the same pure computation, done more than once.

Keras 3 builds each optimizer update on its own: for every variable it reads the step counter
and the learning rate again, and computes ``beta_1 ** step``, ``beta_2 ** step`` and the bias
corrections again. A 31-layer MLP trained with Adam runs 64 copies of that scalar chain (about
ten ops each) per step, and Grappler cannot share them: ``ReadVariableOp`` is stateful, so its
common-subexpression pass never merges two reads, and nothing downstream of them is identical.

This family is that pass with the one fact Grappler lacks. Two reads of one variable that have
the same control inputs run at the same point of the step's order (a write before one is before
the other; a write after one comes after both, as TensorFlow's automatic control dependencies
order every access of a resource), so they read the same value. They become one read (a read
that is a control output of the function is retired into the kept one); then,
in topological order, every pure node whose op, attributes, device, inputs and control inputs
equal an earlier node's becomes that node. Values do not change: the result is exact.

Left alone: stateful ops other than ``ReadVariableOp`` (a random op, an assignment), ops that
call functions (If, While, PartitionedCall), placeholders, fetched outputs, and graphs with
TensorFlow 1 control flow (its frames make equal-looking nodes differ).

One rule (:mod:`fusion.rule`), as every family: it walks the graph in topological order, its
match pairs a node with the earlier one it equals (a :class:`DuplicateMatch`; what it has seen
is the rule's memo), it declines a graph with TensorFlow 1 control flow as a whole (nothing
is declined node by node), :func:`rewrite_duplicate` rewires the node's readers and removes
it.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.graphs.dedupe import find_duplicates
    >>> v = tf.Variable(2.0)
    >>> @tf.function
    ... def f():
    ...     return tf.sqrt(v.read_value() + 1.0) + tf.sqrt(v.read_value() + 1.0)
    >>> g = f.get_concrete_function().graph.as_graph_def()
    >>> sorted({m.node.op for m in find_duplicates(GraphView(g.node))[0]})
    ['AddV2', 'Const', 'Identity', 'ReadVariableOp', 'Sqrt']
"""

from __future__ import annotations

import dataclasses
import functools

from tensorflow.python.framework import op_def_registry

from fusion.family import register
from fusion.graph import GraphView, NodeDef, parse_input, tensor_ref
from fusion.pattern import PlainTarget, RewriteContext
from fusion.rule import Rule, RuleContext

V1_CONTROL_FLOW = frozenset({
    "Enter", "RefEnter", "Exit", "RefExit", "NextIteration", "RefNextIteration", "Switch",
    "RefSwitch", "Merge", "RefMerge", "LoopCond",
})
"""Ops of TensorFlow 1 control flow: a graph holding one is left as it is."""

STATEFUL_BUT_SHAREABLE = frozenset({"ReadVariableOp"})
"""Stateful ops two of which with equal inputs and control inputs give equal values."""

NEVER_SHARED = frozenset({"Placeholder", "PlaceholderWithDefault", "NoOp", "_Arg", "_Retval"})

_IGNORED_ATTRS = frozenset({"_output_shapes"})


@dataclasses.dataclass
class DuplicateMatch:
    """``node`` computes what ``keep`` computes: its readers may read ``keep`` instead."""

    node: NodeDef
    keep: str


@functools.cache
def _shareable(op: str) -> bool:
    """True if two nodes of ``op`` with equal attributes and inputs compute the same value."""
    if op in NEVER_SHARED or "Inplace" in op:
        return False
    op_def = op_def_registry.get(op)
    if op_def is None:  # a function called by name
        return False
    if op_def.is_stateful and op not in STATEFUL_BUT_SHAREABLE:
        return False
    if any(arg.is_ref for arg in op_def.input_arg):
        return False
    return not any(attr.type in ("func", "list(func)") for attr in op_def.attr)


def _attrs(node: NodeDef) -> bytes:
    return b"".join(
        key.encode() + b"\0" + node.attr[key].SerializeToString(deterministic=True)
        for key in sorted(node.attr) if key not in _IGNORED_ATTRS
    )


# -- match ----------------------------------------------------------------------------------
def _topological(view: GraphView) -> list[NodeDef]:
    return [node for name in view.topological_order() if (node := view.node(name)) is not None]


def _match(node: NodeDef, ctx: RuleContext) -> DuplicateMatch | None:
    """``node`` and the earlier node it equals (op, device, attributes, inputs and control
    inputs, each input read through the duplicates already found), or None."""
    if not _shareable(node.op):
        return None
    canonical: dict[str, str] = ctx.memo.setdefault("canonical", {})
    seen: dict[tuple, str] = ctx.memo.setdefault("seen", {})
    data, control = [], set()
    for ref in node.input:
        producer, port, is_control = parse_input(ref)
        producer = canonical.get(producer, producer)
        if is_control:
            control.add(producer)
        else:
            data.append(tensor_ref(producer, port))
    key = (node.op, node.device, tuple(data), frozenset(control), _attrs(node))
    keep = seen.setdefault(key, node.name)
    if keep == node.name or not ctx.view.retirable(node.name):  # a fetched output stays
        return None
    canonical[node.name] = keep
    return DuplicateMatch(node, keep)


# -- check ----------------------------------------------------------------------------------
def _v1_control_flow(ctx: RuleContext) -> list[str] | None:
    """The reason a graph with TensorFlow 1 control flow is left as it is, or None."""
    v1 = sorted({n.op for n in ctx.view if n.op in V1_CONTROL_FLOW})
    if v1:
        return [f"graph with TensorFlow 1 control flow ({', '.join(v1)}): left as it is"]
    return None


def _check(match: DuplicateMatch, ctx: RuleContext) -> str | None:
    """Every duplicate found is computed once: nothing to decline node by node."""
    return None


# -- emit -----------------------------------------------------------------------------------
def rewrite_duplicate(view: GraphView, match: DuplicateMatch) -> None:
    """Let every reader of ``match.node`` read ``match.keep``; remove ``match.node``."""
    name = match.node.name
    for reader, index, port, control in view.consumer_edges(name):
        if not control:
            view.replace_input(reader, index, tensor_ref(match.keep, port))
    if name in view.control_outputs:  # a read that must run: the kept read does its work
        view.retire_control_output(name, match.keep)
    else:
        view.redirect_control_edges(name, match.keep)
    view.remove(name)


# -- declaration ----------------------------------------------------------------------------
RULE = Rule(match=_match, check=_check, emit=lambda v, m: rewrite_duplicate(v, m),
            kind=lambda m: f"{m.node.op} computed once", walk=_topological,
            begin=_v1_control_flow)


def find_duplicates(view: GraphView) -> tuple[list[DuplicateMatch], list[str]]:
    """Every node in ``view`` equal to an earlier one, in topological order (so each record's
    ``keep`` is itself kept); a reason when the graph is left alone."""
    return RULE.find(view, PlainTarget("any"))


@register(
    "dedupe",
    "duplicate reads of a variable (same control inputs) and the equal pure computations on "
    "them, such as Keras's per-variable step count, learning rate and bias corrections -> "
    "computed once",
    after=("*",),
    order=("what the fused graph still computes twice is computed once after every family "
           "that removes or adds nodes"),
)
def dedupe_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Compute every duplicated value in ``view`` once (exact: values do not change)."""
    RULE.apply(view, ctx)
