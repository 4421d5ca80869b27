"""A stage handler's attempt: it commits whole, or leaves nothing that runs.

A stage handler (``fusion.stage``) emits its form into the graph being traced. If it raises
half-way, the ops it made stay in that graph (TensorFlow cannot remove an op), and Keras's own
call is then traced beside them. Ops that compute values nobody reads are pruned when the
function runs; what would still run is a write: a Keras variable assigned (a batch norm's
moving statistics, a dropout's seed state) or a loss added. :class:`Attempt` holds those back
until the handler returns, through Keras's own ``StatelessScope`` (what ``stateless_call``
uses): inside it a Keras variable's ``assign`` records the new value, which later reads inside
the attempt see, and ``add_loss`` collects the loss. :meth:`Attempt.commit` makes the writes
and hands the losses to their layers; an abandoned attempt drops both. What it cannot hold
back (a raw ``tf.Variable`` written directly) is listed by :meth:`Attempt.abandon`.

Example:
    >>> import keras
    >>> v = keras.Variable(1.0)
    >>> with Attempt() as attempt:
    ...     _ = v.assign(5.0)
    ...     seen = float(v.value)  # the attempt reads its own write
    >>> attempt.abandon()  # the handler failed: nothing is written
    []
    >>> seen, float(v.value)
    (5.0, 1.0)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fusion import private_api, trace_state

WRITES = ("Assign", "ResourceApply", "ResourceSparseApply", "ResourceScatter",
          "ResourceStridedSliceAssign")
"""Prefixes of the op types that write a variable."""


def _scope_class() -> type:
    StatelessScope = private_api.get("keras.StatelessScope")

    class Deferred(StatelessScope):
        """Keras's StatelessScope that holds back the writes and losses made in ``graph``
        (and keeps which variable each write was for); a Keras variable created inside is
        initialized when it ends, as Keras's own scope does. A write computed in another graph (a
        scratch graph a handler traces Keras's call into, a loop body) is made at once, as
        without the scope: only the attempt's own graph can make it later."""

        def __init__(self, graph: Any) -> None:
            super().__init__(collect_losses=True)
            self.graph = graph
            self.updates: dict[int, tuple[Any, Any]] = {}

        def _ours(self, value: Any) -> bool:
            return getattr(value, "graph", None) is self.graph

        def add_update(self, update: Any) -> None:
            variable, value = update
            if not self._ours(value):
                variable._direct_assign(value)
                return
            super().add_update(update)
            self.updates[id(variable)] = update

        def add_loss(self, loss: Any) -> None:
            if self._ours(loss):  # a loss of another graph could not be read by the step
                super().add_loss(loss)

    return Deferred


@dataclasses.dataclass
class Attempt:
    """A block whose Keras variable writes and losses are held back: :meth:`commit` makes
    them, :meth:`abandon` drops them (see the module doc). Used as ``with Attempt() as a:``;
    exactly one of the two is called after the block."""

    _scope: Any = None
    _graph: Any = None
    _mark: int = 0

    def __enter__(self) -> Attempt:
        from tensorflow.python.framework import ops

        self._graph = ops.get_default_graph() if ops.inside_function() else None
        self._mark = self._graph.num_operations() if self._graph is not None else 0
        self._scope = _scope_class()(self._graph)
        self._scope.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._scope.__exit__(*exc)

    def commit(self, layer: Any = None) -> None:
        """Make the held-back writes (in the order of their first write) and give each
        collected loss to the layer among ``layer`` and its sublayers that added it."""
        for variable, value in self._scope.updates.values():
            variable.assign(value)
        if not self._scope.losses:
            return
        owners = list(layer._flatten_layers()) if hasattr(layer, "_flatten_layers") else []
        for loss in self._scope.losses:
            for owner in owners:
                ids = getattr(owner, "_loss_ids", set())
                if id(loss) in ids:
                    ids.discard(id(loss))
                    owner._losses.append(loss)
                    break

    def abandon(self) -> list[str]:
        """Drop the held-back writes and losses, and mark the ops the attempt made as
        abandoned in their graph's state (:func:`without_abandoned` takes them out of the
        step); the ops among them that write a variable (none unless it wrote a
        ``tf.Variable`` directly), as ``"<type> <name>"``."""
        if self._graph is None:
            return []
        made = self._graph.get_operations()[self._mark:]
        trace_state.of(self._graph, create=True).abandoned.update(op.name for op in made)
        return [f"{op.type} {op.name}" for op in made if op.type.startswith(WRITES)]


def abandoned(graph: Any) -> frozenset[str]:
    """The names of the ops that failed attempts made in ``graph`` (a FuncGraph), kept in its
    state (``fusion.trace_state``) for as long as the graph lives.

    >>> import tensorflow as tf
    >>> @tf.function
    ... def step(x):
    ...     with Attempt() as attempt:
    ...         _ = tf.square(x, name="tried")
    ...     attempt.abandon()
    ...     return x + 1.0
    >>> sorted(abandoned(step.get_concrete_function(tf.constant(1.0)).graph))
    ['tried']
    >>> abandoned(tf.Graph())
    frozenset()
    """
    held = trace_state.of(graph)
    return frozenset(held.abandoned) if held is not None else frozenset()


def superseded(graph: Any) -> frozenset[str]:
    """The names of the ops in ``graph`` (a FuncGraph) that a stage took over from an earlier
    call (its ``superseded`` set in ``fusion.trace_state.TraceState``), kept apart from the
    failed attempts' (:func:`abandoned`); :func:`without_abandoned` takes both out of the step.

    >>> import tensorflow as tf
    >>> from fusion import trace_state
    >>> graph = tf.Graph()
    >>> trace_state.of(graph, create=True).superseded.add("taken over")
    >>> superseded(graph), abandoned(graph)
    (frozenset({'taken over'}), frozenset())
    """
    held = trace_state.of(graph)
    return frozenset(held.superseded) if held is not None else frozenset()


def without_abandoned(graph_def: Any, names: frozenset[str]) -> tuple[Any, int]:
    """``graph_def`` with the abandoned ops ``names`` taken out, and how many were: each
    becomes a ``NoOp`` of its name (a control edge or control output that names it stays
    valid, and it computes nothing), except one whose output a kept op reads (then it stays);
    the library functions only they called go too.

    >>> from tensorflow.core.framework.graph_pb2 import GraphDef
    >>> g = GraphDef()
    >>> _ = g.node.add(name="x", op="Placeholder")
    >>> _ = g.node.add(name="dead", op="MatMul", input=["x", "x"])
    >>> _ = g.node.add(name="dead2", op="Relu", input=["dead"])
    >>> _ = g.node.add(name="y", op="Identity", input=["x", "^dead2"])
    >>> out, n = without_abandoned(g, frozenset({"dead", "dead2"}))
    >>> n, [(node.name, node.op) for node in out.node]
    (2, [('x', 'Placeholder'), ('dead', 'NoOp'), ('dead2', 'NoOp'), ('y', 'Identity')])
    >>> list(out.node[3].input)  # the control edge stays valid
    ['x', '^dead2']
    """
    from tensorflow.core.framework.graph_pb2 import GraphDef

    droppable = {n.name for n in graph_def.node} & set(names)
    changed = True
    while changed:  # a kept op that reads an output keeps its producer
        changed = False
        for node in graph_def.node:
            if node.name in droppable:
                continue
            for ref in node.input:
                producer = ref.split(":")[0]
                if not ref.startswith("^") and producer in droppable:
                    droppable.discard(producer)
                    changed = True
    if not droppable:
        return graph_def, 0
    out = GraphDef()
    out.CopyFrom(graph_def)
    library = {f.signature.name: f for f in graph_def.library.function}
    dropped_calls = _called({n.name: n for n in graph_def.node if n.name in droppable}.values(),
                            library)
    for node in out.node:
        if node.name in droppable:
            name, device = node.name, node.device
            node.Clear()
            node.name, node.op, node.device = name, "NoOp", device
    kept_calls = _called(out.node, library) | {g.function_name for g in out.library.gradient}
    unused = dropped_calls - kept_calls
    if unused:  # the bodies only the dropped ops called (a loop's, a region's)
        functions = [f for f in out.library.function if f.signature.name not in unused]
        del out.library.function[:]
        out.library.function.extend(functions)
    return out, len(droppable)


def _called(nodes: Any, library: dict[str, Any]) -> set[str]:
    """The library functions ``nodes`` call (through any function-valued attribute), and
    those they call in turn."""
    found: set[str] = set()
    pending = list(nodes)
    while pending:
        node = pending.pop()
        for value in node.attr.values():
            names = [value.func.name] if value.HasField("func") else [
                f.name for f in value.list.func]
            for name in names:
                if name and name not in found:
                    found.add(name)
                    if name in library:
                        pending.extend(library[name].node_def)
    return found


__all__ = ["WRITES", "Attempt", "abandoned", "superseded", "without_abandoned"]
