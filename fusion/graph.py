"""A mutable view over one graph body: a GraphDef's nodes or a FunctionDef's body.

Both kinds of body are handled in one form: node inputs are written the GraphDef way
(``"name"``, ``"name:1"``, ``"^name"``). A FunctionDef body is converted on the way in (its
``"node:out_arg:index"`` references become flat ports) and back on the way out, so every pattern
is written once and runs on the main graph and on loop and cond bodies alike.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> g = tf.function(lambda x: tf.nn.relu(x)).get_concrete_function(
    ...     tf.TensorSpec([2], tf.float32)).graph.as_graph_def()
    >>> view = GraphView(g.node)
    >>> [n.op for n in view.consumers("x")]
    ['Relu']
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator, KeysView, Mapping

from tensorflow.core.framework import function_pb2, graph_pb2, node_def_pb2
from tensorflow.python.framework import op_def_registry

NodeDef = node_def_pb2.NodeDef

# Ops that read only the shape of their input, never its values.
SHAPE_ONLY_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})


def parse_input(ref: str) -> tuple[str, int, bool]:
    """Split a GraphDef input string into (node name, output port, is_control).

    >>> parse_input("conv:1")
    ('conv', 1, False)
    >>> parse_input("^init")
    ('init', -1, True)
    """
    if ref.startswith("^"):
        return ref[1:], -1, True
    name, sep, port = ref.rpartition(":")
    if sep and port.isdigit():
        return name, int(port), False
    return ref, 0, False


def tensor_ref(name: str, port: int = 0) -> str:
    """Format a tensor reference the GraphDef way (``name`` for port 0)."""
    return name if port == 0 else f"{name}:{port}"


def output_shape(node: NodeDef, port: int = 0) -> tuple[int | None, ...] | None:
    """Static shape of ``node``'s output from its ``_output_shapes`` attr, None if unknown."""
    shapes = node.attr.get("_output_shapes")
    if shapes is None or port >= len(shapes.list.shape):
        return None
    shape = shapes.list.shape[port]
    if shape.unknown_rank:
        return None
    return tuple(d.size if d.size >= 0 else None for d in shape.dim)


class GraphView:
    """Nodes by name plus a consumer index, editable in place.

    Edits go through ``add``, ``remove`` and ``replace_input`` so the consumer index stays
    right. ``protected`` names nodes that must survive every rewrite (the function's fetched
    outputs and control outputs). A control output (a node that must run, such as a variable
    update) may be retired in favour of a node that does its work
    (:meth:`retire_control_output`); ``control_renames`` records which, so the function's
    control outputs can be rewritten to match.

    >>> from tensorflow.core.framework.node_def_pb2 import NodeDef
    >>> view = GraphView([NodeDef(name="a", op="AssignVariableOp"),
    ...                   NodeDef(name="b", op="NoOp", input=["^a"])], control_outputs=["a"])
    >>> view.add(NodeDef(name="fused", op="ResourceApplyAdam"))
    >>> view.retire_control_output("a", "fused")
    >>> view.remove("a")
    >>> list(view.node("b").input), view.control_renames
    (['^fused'], {'a': 'fused'})
    """

    def __init__(
        self,
        nodes: Iterable[NodeDef],
        protected: Iterable[str] = (),
        control_outputs: Iterable[str] = (),
        args: Mapping[str, tuple[int, tuple[int | None, ...] | None]] | None = None,
    ) -> None:
        self._nodes: dict[str, NodeDef] = {}
        # a function body's arguments (read by name, no node): dtype enum and static shape
        self.args: dict[str, tuple[int, tuple[int | None, ...] | None]] = dict(args or {})
        self._consumers: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
        self.control_outputs: set[str] = set(control_outputs)
        self._pinned: frozenset[str] = frozenset(protected)
        self.protected: set[str] = set(protected) | self.control_outputs
        self.control_renames: dict[str, str] = {}
        self._retired_into: dict[str, list[str]] = collections.defaultdict(list)
        for node in nodes:
            self.add(node)

    def copy_bookkeeping(self, other: GraphView) -> None:
        """Take ``other``'s protected names and control outputs (used to restore snapshots)."""
        self.protected = set(other.protected)
        self._pinned = other._pinned
        self.control_outputs = set(other.control_outputs)
        self.args = dict(other.args)
        self.control_renames = dict(other.control_renames)
        self._retired_into = collections.defaultdict(
            list, {k: list(v) for k, v in other._retired_into.items()})

    # -- reading -------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[NodeDef]:
        return iter(list(self._nodes.values()))

    def node(self, name_or_ref: str) -> NodeDef | None:
        """The node producing ``name_or_ref`` (a node name or tensor reference), or None."""
        return self._nodes.get(parse_input(name_or_ref)[0])

    def consumer_edges(self, name: str) -> list[tuple[NodeDef, int, int, bool]]:
        """Every edge leaving ``name``: (consumer, input index, output port, is_control)."""
        edges = []
        for consumer_name, index in self._consumers.get(name, ()):
            consumer = self._nodes[consumer_name]
            _, port, control = parse_input(consumer.input[index])
            edges.append((consumer, index, port, control))
        return edges

    def consumers(self, name: str, port: int = 0) -> list[NodeDef]:
        """Data consumers of output ``port`` of node ``name`` (one entry per edge)."""
        return [c for c, _, p, ctl in self.consumer_edges(name) if not ctl and p == port]

    def has_control_edges(self, node: NodeDef) -> bool:
        """True if ``node`` has control inputs or control consumers."""
        if any(i.startswith("^") for i in node.input):
            return True
        return any(ctl for _, _, _, ctl in self.consumer_edges(node.name))

    def retirable(self, name: str) -> bool:
        """True if node ``name`` may be removed: not protected, or a control output that is
        not also fetched (it can be retired into a node doing its work)."""
        if name not in self.protected:
            return True
        return name in self.control_outputs and name not in self._pinned

    def data_inputs(self, node: NodeDef) -> list[str]:
        return [i for i in node.input if not i.startswith("^")]

    # -- editing -------------------------------------------------------------------------
    def add(self, node: NodeDef) -> None:
        if node.name in self._nodes:
            raise ValueError(f"duplicate node name {node.name!r}")
        self._nodes[node.name] = node
        for index, ref in enumerate(node.input):
            self._consumers[parse_input(ref)[0]].append((node.name, index))

    def remove(self, name: str) -> None:
        node = self._nodes.pop(name)
        for index, ref in enumerate(node.input):
            producer = parse_input(ref)[0]
            edges = self._consumers.get(producer)
            if edges is not None:
                edges.remove((name, index))

    def replace(self, old_name: str, new_node: NodeDef) -> None:
        """Swap node ``old_name`` for ``new_node`` (which may keep the same name)."""
        self.remove(old_name)
        self.add(new_node)

    def replace_input(self, consumer: NodeDef, index: int, new_ref: str) -> None:
        old = parse_input(consumer.input[index])[0]
        self._consumers[old].remove((consumer.name, index))
        consumer.input[index] = new_ref
        self._consumers[parse_input(new_ref)[0]].append((consumer.name, index))

    def _drop_control_input(self, consumer: NodeDef, index: int) -> None:
        """Delete control input ``index`` of ``consumer``: the last input takes its place.

        Control inputs come after the data inputs and their order means nothing, so a swap
        keeps the node's meaning and costs two bookkeeping edits, not a re-index of a node
        that may have thousands of control inputs (a train step's final NoOp).
        """
        last = len(consumer.input) - 1
        self._consumers[parse_input(consumer.input[index])[0]].remove((consumer.name, index))
        if index != last:
            moved = consumer.input[last]
            edges = self._consumers[parse_input(moved)[0]]
            edges[edges.index((consumer.name, last))] = (consumer.name, index)
            consumer.input[index] = moved
        del consumer.input[last]

    def redirect_control_edges(self, old: str, new: str) -> None:
        """Make every control consumer of ``old`` depend on ``new`` instead (no duplicates)."""
        for consumer, index, _, control in sorted(
            self.consumer_edges(old), key=lambda edge: -edge[1]
        ):
            if not control:
                continue
            if f"^{new}" in consumer.input or consumer.name == new:
                self._drop_control_input(consumer, index)
            else:
                self.replace_input(consumer, index, f"^{new}")

    def retire_control_output(self, old: str, new: str) -> None:
        """Let node ``new`` stand for control output ``old``, which may then be removed.

        Control edges from ``old`` move to ``new``; ``control_renames`` maps ``old`` (and
        anything earlier retired into it) to ``new``. Raises ValueError if ``old`` is not a
        control output or is a fetched output.
        """
        if old not in self.control_outputs or old in self._pinned:
            raise ValueError(f"{old!r} is not a control output that may be replaced")
        if new not in self._nodes:
            raise ValueError(f"retire {old!r}: replacement {new!r} is not in the graph")
        self.redirect_control_edges(old, new)
        self.control_outputs.discard(old)
        self.control_outputs.add(new)
        self.protected.discard(old)
        self.protected.add(new)
        moved = self._retired_into.pop(old, [])
        for key in moved:
            self.control_renames[key] = new
        self.control_renames[old] = new
        self._retired_into[new].extend([*moved, old])

    def prune(self, candidates: Iterable[str]) -> list[str]:
        """Remove the ``candidates`` nothing consumes, then their inputs likewise.

        Only pure nodes go: protected nodes, control outputs and ops with side effects (or
        of unknown op type, such as function calls by name) stay. Returns what was removed.
        """
        removed = []
        work = [n for n in candidates if n in self._nodes]
        while work:
            name = work.pop()
            node = self._nodes.get(name)
            if node is None or name in self.protected or self._consumers.get(name):
                continue
            op_def = op_def_registry.get(node.op)
            if op_def is None or op_def.is_stateful or node.op == "Placeholder":
                continue
            self.remove(name)
            removed.append(name)
            work.extend(parse_input(ref)[0] for ref in node.input)
        return removed

    def topological_order(self) -> list[str]:
        """Node names, each after every node it reads (data or control); nodes on or behind
        a cycle are left out.

        >>> from tensorflow.core.framework.node_def_pb2 import NodeDef
        >>> GraphView([NodeDef(name="b", op="Neg", input=["a"]), NodeDef(name="a", op="Const")]
        ...           ).topological_order()
        ['a', 'b']
        """
        pending = dict.fromkeys(self._nodes, 0)
        for producer, edges in self._consumers.items():
            if producer in self._nodes:
                for consumer, _ in edges:
                    pending[consumer] += 1
        ready = [name for name, count in pending.items() if count == 0]
        ready.reverse()
        order = []
        while ready:
            name = ready.pop()
            order.append(name)
            for consumer, _ in self._consumers.get(name, ()):
                pending[consumer] -= 1
                if pending[consumer] == 0:
                    ready.append(consumer)
        return order

    def cycle(self) -> list[str]:
        """Names of nodes on or behind a cycle (empty for a DAG; v1 loops count as cycles)."""
        ordered = set(self.topological_order())
        return sorted(name for name in self._nodes if name not in ordered)

    def dangling_inputs(self, external: Iterable[str] = ()) -> list[str]:
        """Input references whose producer is neither a node nor an ``external`` name."""
        known = set(external)
        return [
            f"{consumer} <- {self._nodes[consumer].input[index]}"
            for producer, edges in self._consumers.items()
            if edges and producer not in self._nodes and producer not in known
            for consumer, index in edges
        ]

    def nodes(self) -> list[NodeDef]:
        return list(self._nodes.values())


# -- FunctionDef bodies -----------------------------------------------------------------
def output_arg_sizes(node: NodeDef) -> list[tuple[str, int]] | None:
    """(output arg name, number of tensors) for each output arg of ``node``'s op."""
    op_def = op_def_registry.get(node.op)
    if op_def is None:
        return None
    sizes = []
    for arg in op_def.output_arg:
        if arg.number_attr:
            count = node.attr[arg.number_attr].i
        elif arg.type_list_attr:
            count = len(node.attr[arg.type_list_attr].list.type)
        else:
            count = 1
        sizes.append((arg.name, count))
    return sizes


def _function_output_sizes(fdef: function_pb2.FunctionDef) -> list[tuple[str, int]]:
    return [(arg.name, 1) for arg in fdef.signature.output_arg]


def output_sizes(
    node: NodeDef, library: dict[str, function_pb2.FunctionDef]
) -> list[tuple[str, int]] | None:
    """Output arg sizes of ``node``, a primitive op or a call of a ``library`` function."""
    fdef = library.get(node.op)
    return _function_output_sizes(fdef) if fdef is not None else output_arg_sizes(node)


def function_def_ref(ref: str, sizes: list[tuple[str, int]] | None) -> str:
    """GraphDef reference ``node:port`` as a FunctionDef one, ``node:out_arg:index``.

    >>> function_def_ref("split:1", [("output", 2)])
    'split:output:1'
    """
    name, port, _ = parse_input(ref)
    if sizes is None:
        raise ValueError(f"cannot express {ref!r} in a FunctionDef: unknown op")
    for arg_name, count in sizes:
        if port < count:
            return f"{name}:{arg_name}:{port}"
        port -= count
    raise ValueError(f"port out of range in {ref!r}")


def _arg_specs(
    fdef: function_pb2.FunctionDef,
) -> dict[str, tuple[int, tuple[int | None, ...] | None]]:
    """Each argument of ``fdef``: its dtype (enum) and static shape (``_output_shapes``; None
    unknown), by name."""
    specs = {}
    for index, arg in enumerate(fdef.signature.input_arg):
        attrs = fdef.arg_attr[index].attr if index in fdef.arg_attr else {}
        shapes = attrs["_output_shapes"].list.shape if "_output_shapes" in attrs else []
        shape = None
        if len(shapes) == 1 and not shapes[0].unknown_rank:
            shape = tuple(d.size if d.size >= 0 else None for d in shapes[0].dim)
        specs[arg.name] = (arg.type, shape)
    return specs


class FunctionBody:
    """A FunctionDef body converted to GraphDef-style inputs, and back.

    Example:
        >>> import tensorflow as tf
        >>> from fusion.graph import FunctionBody
        >>> f = tf.function(lambda x: tf.nn.relu(x)).get_concrete_function(
        ...     tf.TensorSpec([2], tf.float32)).function_def
        >>> body = FunctionBody(f, {})
        >>> sorted(n.op for n in body.nodes)
        ['Identity', 'Relu']
    """

    def __init__(
        self,
        fdef: function_pb2.FunctionDef,
        library: dict[str, function_pb2.FunctionDef],
    ) -> None:
        self.fdef = fdef
        self.arg_specs = _arg_specs(fdef)
        """Each argument's dtype (enum) and static shape (``_output_shapes``; None unknown)."""
        self._sizes: dict[str, list[tuple[str, int]] | None] = {}
        self.nodes = []
        for original in fdef.node_def:
            self._sizes[original.name] = output_sizes(original, library)
        for original in fdef.node_def:
            node = NodeDef()
            node.CopyFrom(original)
            del node.input[:]
            node.input.extend(self._to_flat(ref) for ref in original.input)
            self.nodes.append(node)
        self.ret = {k: self._to_flat(v) for k, v in fdef.ret.items()}

    @property
    def args(self) -> KeysView[str]:
        """The arguments' names."""
        return self.arg_specs.keys()

    @property
    def protected(self) -> set[str]:
        """Nodes whose outputs the function returns."""
        return {parse_input(v)[0] for v in self.ret.values()}

    @property
    def control_outputs(self) -> set[str]:
        """Nodes that must run (the FunctionDef's control_ret)."""
        return set(self.fdef.control_ret.values())

    def _to_flat(self, ref: str) -> str:
        if ref.startswith("^"):
            return ref
        parts = ref.split(":")
        if len(parts) == 1:  # a function argument
            return ref
        if len(parts) != 3:
            raise ValueError(f"unexpected FunctionDef input {ref!r}")
        name, arg, index = parts[0], parts[1], int(parts[2])
        sizes = self._sizes.get(name)
        if sizes is None:
            raise ValueError(f"cannot resolve output {ref!r}: unknown op")
        port = 0
        for arg_name, count in sizes:
            if arg_name == arg:
                return tensor_ref(name, port + index)
            port += count
        raise ValueError(f"output arg {arg!r} not found for {ref!r}")

    def _to_nested(self, ref: str, sizes_of: dict[str, list[tuple[str, int]] | None]) -> str:
        if ref.startswith("^"):
            return ref
        name = parse_input(ref)[0]
        if name in self.args and ":" not in ref:
            return ref
        return function_def_ref(ref, sizes_of.get(name))

    def to_function_def(
        self,
        nodes: list[NodeDef],
        library: dict[str, function_pb2.FunctionDef],
        control_renames: dict[str, str] | None = None,
    ) -> function_pb2.FunctionDef:
        """A FunctionDef with this body's signature and ``nodes`` as its body.

        ``control_renames`` maps control outputs that a rewrite replaced to their replacement.
        """
        sizes_of = {n.name: output_sizes(n, library) for n in nodes}
        out = function_pb2.FunctionDef()
        out.CopyFrom(self.fdef)
        del out.node_def[:]
        for node in nodes:
            copy = out.node_def.add()
            copy.CopyFrom(node)
            del copy.input[:]
            copy.input.extend(self._to_nested(ref, sizes_of) for ref in node.input)
        for key, ref in self.ret.items():
            out.ret[key] = self._to_nested(ref, sizes_of)
        for key, node_name in self.fdef.control_ret.items():
            out.control_ret[key] = (control_renames or {}).get(node_name, node_name)
        return out


def op_histogram(graph_def: graph_pb2.GraphDef) -> collections.Counter[str]:
    """Count op types over the main graph and every function body of ``graph_def``.

    >>> import tensorflow as tf
    >>> g = tf.function(lambda x: tf.nn.relu(x)).get_concrete_function(
    ...     tf.TensorSpec([2], tf.float32)).graph.as_graph_def()
    >>> op_histogram(g)["Relu"]
    1
    """
    counts: collections.Counter[str] = collections.Counter(n.op for n in graph_def.node)
    for fdef in graph_def.library.function:
        counts.update(n.op for n in fdef.node_def)
    return counts
