"""Fragments: a few nodes cut out of a step graph, to time a pattern's forms at the graph's shapes.

The tuner (``tfmx.tuner``) decides between correct forms by timing them where tfmx runs. A
family hands it a fragment of the real graph (the nodes it matched, in the stock form) and the
same fragment after its rewrite: :func:`cut` copies the nodes and stands in for everything
they read from outside (each outside producer becomes an ``IdentityN`` of the same name, fed by
placeholders, so the family's match records and rewrite functions work on the fragment
unchanged); :func:`variant` applies a rewrite to a copy; :func:`make_inputs` makes random
inputs (variables, for values and for resource handles) for a few copies; :func:`runner`
builds the copies side by side in one function and returns a callable that runs them once.
Unknown dimensions (Keras's batch) take ``unknown_dim``.

Example:
    >>> import tensorflow as tf
    >>> from fusion.fragment import cut, make_inputs, runner
    >>> from fusion.graph import GraphView
    >>> @tf.function
    ... def f(x, w):
    ...     return tf.nn.relu(tf.matmul(x, w))
    >>> g = f.get_concrete_function(tf.TensorSpec([None, 8]),
    ...                             tf.TensorSpec([8, 4])).graph.as_graph_def(add_shapes=True)
    >>> piece = cut(GraphView(g.node), ["MatMul", "Relu"])
    >>> sorted(n.op for n in piece.graph_def.node)
    ['IdentityN', 'IdentityN', 'MatMul', 'Placeholder', 'Placeholder', 'Relu']
    >>> len(runner(piece, make_inputs(piece, copies=2))())  # runs both copies once: 2 outputs
    2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from tensorflow.core.framework import graph_pb2, types_pb2
from tensorflow.python.framework import op_def_registry
from tensorflow.python.framework.tensor_util import make_tensor_proto

from fusion.graph import GraphView, NodeDef, output_shape, parse_input
from fusion.match import CONSTANT_OF_CONSTANTS, const_value
from fusion.pattern import Choice, Chooser

UNKNOWN_DIM = 32
"""What an unknown dimension counts as when nothing better is known: Keras's default batch."""

MIN_COPIES, MAX_COPIES = 2, 8
TARGET_ELEMENTS = 1 << 20
"""Copies of a fragment are added until its inputs and outputs hold about this many elements
(at least :data:`MIN_COPIES`, at most :data:`MAX_COPIES`): a tiny fragment alone times the call
overhead, not the kernels, and a kernel alone may split itself over the thread pool where in
a real step it runs beside others (TensorFlow's CPU Adam kernel: 3x slower alone than beside
others at 512x512)."""


class FragmentError(ValueError):
    """The nodes cannot be cut out and run alone (the tuner then takes the stock form)."""


@dataclasses.dataclass
class Fragment:
    """Nodes cut out of a graph, with stand-ins for what they read from outside."""

    graph_def: graph_pb2.GraphDef
    feeds: dict[str, tuple[int, tuple[int, ...]]]  # placeholder -> (DataType enum, shape)
    resources: dict[str, tuple[int, tuple[int, ...]]]  # placeholder -> variable dtype, shape
    targets: list[str]  # nodes to run: the ones nothing in the fragment reads

    def view(self) -> GraphView:
        """A GraphView over a copy of the fragment's nodes."""
        copy = graph_pb2.GraphDef()
        copy.CopyFrom(self.graph_def)
        return GraphView(copy.node)


def output_dtype(node: NodeDef, port: int) -> int | None:
    """The DataType enum of ``node``'s output ``port`` (None if the op is not known)."""
    op_def = op_def_registry.get(node.op)
    if op_def is None:
        return None
    for arg in op_def.output_arg:
        if arg.type_list_attr:
            types = list(node.attr[arg.type_list_attr].list.type)
        else:
            one = arg.type if arg.type else node.attr[arg.type_attr].type
            types = [one] * (node.attr[arg.number_attr].i if arg.number_attr else 1)
        if port < len(types):
            return types[port]
        port -= len(types)
    return None


def _concrete(shape: tuple[int | None, ...] | None, unknown_dim: int) -> tuple[int, ...] | None:
    if shape is None:
        return None
    return tuple(unknown_dim if d is None else int(d) for d in shape)


_ASSIGNS = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")


Spec = tuple[int | None, tuple[int | None, ...] | None]
"""A tensor's dtype (enum) and static shape, either None where unknown."""


def _tensor_spec(view: GraphView, ref: str) -> Spec | None:
    """dtype and static shape of ``ref``, a node's output or a function body's argument; None
    if it is neither."""
    name, port, _ = parse_input(ref)
    node = view.node(name)
    if node is not None:
        return output_dtype(node, port), output_shape(node, port)
    return view.args[name] if name in view.args and port == 0 else None


def tensor_shape(view: GraphView, ref: str) -> tuple[int | None, ...] | None:
    """The static shape of ``ref`` (:func:`_tensor_spec`: a node's output or a function
    body's argument), None where unknown.

    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> g = tf.function(lambda x: x * 2.0).get_concrete_function(
    ...     tf.TensorSpec([3, None])).graph.as_graph_def(add_shapes=True)
    >>> tensor_shape(GraphView(g.node), "x"), tensor_shape(GraphView(g.node), "missing")
    ((3, None), None)
    """
    spec = _tensor_spec(view, ref)
    return None if spec is None else spec[1]


def _variable_spec(view: GraphView, ref: str, unknown_dim: int) -> tuple[int, tuple[int, ...]]:
    """dtype and shape of the variable behind the handle ``ref``, from a read of it or, where
    the body only writes it (an update inside a ``cond`` branch: a loss-scaled step), from
    the value an assignment writes."""
    name, port, _ = parse_input(ref)
    for consumer in view.consumers(name):
        if parse_input(consumer.input[0])[:2] != (name, port):
            continue
        if consumer.op == "ReadVariableOp":
            shape = _concrete(output_shape(consumer), unknown_dim)
        elif consumer.op in _ASSIGNS and len(consumer.input) > 1:
            shape = _concrete(tensor_shape(view, consumer.input[1]), unknown_dim)
        else:
            continue
        if shape is not None:
            return consumer.attr["dtype"].type, shape
    raise FragmentError(f"no read or write of the variable {ref!r} says its shape")


def _shape_value(view: GraphView, src: NodeDef, port: int, unknown_dim: int) -> list[int]:
    """The value of a Shape / ShapeN output: the static shape of what it reads."""
    shape = _concrete(tensor_shape(view, src.input[port if src.op == "ShapeN" else 0]),
                      unknown_dim)
    if shape is None:
        raise FragmentError(f"{src.name} reads a tensor of unknown rank")
    return list(shape)


def cut(view: GraphView, names: Iterable[str], unknown_dim: int = UNKNOWN_DIM) -> Fragment:
    """The nodes ``names`` of ``view`` (Const producers pulled in, and ops of
    ``fusion.match.CONSTANT_OF_CONSTANTS`` on Consts with them) with stand-ins for the rest.

    Outside shapes (``Shape``/``ShapeN`` outputs, as a convolution's gradient reads) become
    constants of the static shape. A function body's arguments (``view.args``: a ``cond``
    branch's variables and gradients) get stand-ins as outside nodes do. Raises
    :class:`FragmentError` for what cannot be made up: other integer or string inputs
    (indices), outputs of unknown dtype or shape.
    """
    inside = {n for n in names if view.node(n) is not None}
    for name in list(inside):
        for ref in view.node(name).input:
            src = view.node(parse_input(ref)[0])
            if src is None or parse_input(ref)[2]:
                continue
            if src.op == "Const":
                inside.add(src.name)
            elif src.op in CONSTANT_OF_CONSTANTS and const_value(view, src.name) is not None:
                inside.update([src.name, *src.input])  # its Consts (no control input)
    out = graph_pb2.GraphDef()
    feeds: dict[str, tuple[int, tuple[int, ...]]] = {}
    resources: dict[str, tuple[int, tuple[int, ...]]] = {}
    consts: dict[str, tuple[int, list[int]]] = {}  # stand-ins for shapes: known values
    standins: dict[str, dict[int, str]] = {}  # outside node -> port -> placeholder
    read_inside: set[str] = set()
    for name in sorted(inside):
        node = out.node.add()
        node.CopyFrom(view.node(name))
        kept = []
        for ref in node.input:
            src_name, port, control = parse_input(ref)
            if control:
                if src_name in inside:
                    kept.append(ref)
                continue
            kept.append(ref)
            if src_name in inside:
                read_inside.add(src_name)
                continue
            spec = _tensor_spec(view, ref)  # a node's output or a function body's argument
            if spec is None:
                raise FragmentError(f"{name} reads {ref!r}, which is not in the graph")
            dtype, shape = spec
            src = view.node(src_name)
            placeholder = f"tfmx_fragment_in/{src_name}/{port}"
            standins.setdefault(src_name, {})[port] = placeholder
            if dtype == types_pb2.DT_RESOURCE:
                resources[placeholder] = _variable_spec(view, ref, unknown_dim)
            elif dtype in (types_pb2.DT_FLOAT, types_pb2.DT_HALF, types_pb2.DT_BFLOAT16,
                           types_pb2.DT_DOUBLE):
                shape = _concrete(shape, unknown_dim)
                if shape is None:
                    raise FragmentError(f"{name} reads {ref!r} of unknown shape")
                feeds[placeholder] = (dtype, shape)
            elif dtype in (types_pb2.DT_INT32, types_pb2.DT_INT64) and src is not None \
                    and src.op in ("Shape", "ShapeN"):
                consts[placeholder] = (dtype, _shape_value(view, src, port, unknown_dim))
            else:
                raise FragmentError(f"{name} reads {ref!r} ({dtype=}): not a float, a "
                                    "variable or a known shape, cannot be made up")
        del node.input[:]
        node.input.extend(kept)
    unused = "tfmx_fragment_in/unused"  # what a stand-in passes on ports nothing here reads
    if any(len(ports) <= max(ports) for ports in standins.values()):
        filler = out.node.add(name=unused, op="Const")
        filler.attr["dtype"].type = types_pb2.DT_FLOAT
        filler.attr["value"].tensor.CopyFrom(make_tensor_proto(np.float32(0)))
    for src_name, ports in standins.items():
        types, refs = [], []
        for port in range(max(ports) + 1):
            placeholder = ports.get(port)
            if placeholder is None:
                types.append(types_pb2.DT_FLOAT)
                refs.append(unused)
                continue
            if placeholder in consts:
                dtype, value = consts[placeholder]
                ph = out.node.add(name=placeholder, op="Const")
                ph.attr["value"].tensor.CopyFrom(
                    make_tensor_proto(np.array(value, types_pb2.DataType.Name(dtype)[3:]
                                               .lower())))
            else:
                spec = resources.get(placeholder)
                dtype = types_pb2.DT_RESOURCE if spec else feeds[placeholder][0]
                ph = out.node.add(name=placeholder, op="Placeholder")
            ph.attr["dtype"].type = dtype
            types.append(dtype)
            refs.append(placeholder)
        stand = out.node.add(name=src_name, op="IdentityN")
        stand.input.extend(refs)
        stand.attr["T"].list.type.extend(types)
    targets = [n for n in sorted(inside) if n not in read_inside]
    return Fragment(out, feeds, resources, targets)


def variant(fragment: Fragment, rewrite: Callable[[GraphView], object]) -> Fragment:
    """``fragment`` after ``rewrite`` (a family's rewrite of its match, run on a copy)."""
    view = fragment.view()
    rewrite(view)
    out = graph_pb2.GraphDef()
    out.node.extend(view.nodes())
    present = {n.name for n in out.node}
    consumed = {parse_input(i)[0] for n in out.node for i in n.input}
    stand_ins = {n.name for n in out.node if n.op in ("IdentityN", "Placeholder")
                 or n.name.startswith("tfmx_fragment_in/")}
    targets = [n for n in sorted(present - consumed - stand_ins)]
    return Fragment(out, dict(fragment.feeds), dict(fragment.resources), targets)


def _copies(fragment: Fragment) -> int:
    # what the copy reads counts with what it computes: a MatMul reducing over 2,048 rows has
    # a small output and large inputs
    elements = sum(int(np.prod(shape)) for _, shape in
                   (*fragment.feeds.values(), *fragment.resources.values()))
    for node in fragment.graph_def.node:
        shape = output_shape(node)
        if node.name not in fragment.feeds and shape is not None and None not in shape:
            elements += int(np.prod(shape)) if shape else 1
    return int(max(MIN_COPIES, min(MAX_COPIES, TARGET_ELEMENTS // max(elements, 1))))


Inputs = list[dict[str, Any]]
"""Per copy, each stand-in's variable (inputs are variables read in the graph: constants would
be folded away)."""


def make_inputs(fragment: Fragment, copies: int | None = None, seed: int = 0) -> Inputs:
    """Variables with random values in [0.5, 1) for ``copies`` of ``fragment`` (default: as
    many as :data:`TARGET_ELEMENTS` asks); a fragment and its :func:`variant` share them."""
    import tensorflow as tf

    copies = _copies(fragment) if copies is None else copies
    inputs: Inputs = []
    for i in range(copies):
        made = {}
        for name, (dtype, shape) in {**fragment.resources, **fragment.feeds}.items():
            value = tf.random.stateless_uniform(shape, (seed, i), 0.5, 1.0)
            made[name] = tf.Variable(tf.cast(value, tf.as_dtype(dtype)))
        inputs.append(made)
    return inputs


def runner(fragment: Fragment, inputs: Inputs | None = None) -> Callable[[], list[Any]]:
    """Build one copy of ``fragment`` per entry of ``inputs`` (default :func:`make_inputs`)
    side by side in one function; return a callable that runs them all once, waits, and
    returns what the copies' targets output (their tensors, copy by copy).

    The targets' outputs are the function's outputs: an op whose only reader is a control
    dependency is turned into a ``NoOp`` by Grappler's dependency optimizer, and a stateless
    fragment would then time nothing but the call. Stateful targets without an output (a
    variable update) run through control dependencies, which are kept.

    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> @tf.function
    ... def f(a, b):
    ...     return tf.matmul(a, b)
    >>> g = f.get_concrete_function(tf.TensorSpec([2, 3]), tf.TensorSpec([3, 4])
    ...                             ).graph.as_graph_def(add_shapes=True)
    >>> piece = cut(GraphView(g.node), ["MatMul"])
    >>> [tuple(t.shape) for t in runner(piece, make_inputs(piece, copies=2))()]
    [(2, 4), (2, 4)]
    """
    import tensorflow as tf

    inputs = make_inputs(fragment) if inputs is None else inputs

    @tf.function(autograph=False)
    def run_all() -> Any:
        ops, outputs = [], []
        for i, made in enumerate(inputs):
            input_map = {f"{name}:0": tf.identity(v.handle) if name in fragment.resources
                         else v.read_value() for name, v in made.items()}
            tf.graph_util.import_graph_def(fragment.graph_def, input_map=input_map,
                                           name=f"copy{i}")
            graph = tf.compat.v1.get_default_graph()
            for target in fragment.targets:
                op = graph.get_operation_by_name(f"copy{i}/{target}")
                ops.append(op)
                outputs += [t for t in op.outputs if t.dtype != tf.resource]
        with tf.control_dependencies(ops):
            return [tf.constant(0)] + [tf.identity(t) for t in outputs]

    concrete = run_all.get_concrete_function()

    def run() -> list[Any]:
        done = concrete()
        done[0].numpy()
        return done[1:]

    return run


def shape_text(shape: Iterable[int | None] | None) -> str:
    """A shape as decision signatures write it: ``32x?x3``; ``?`` for an unknown rank.

    >>> shape_text((32, None, 3)), shape_text(None), shape_text(())
    ('32x?x3', '?', '')
    """
    if shape is None:
        return "?"
    return "x".join("?" if d is None else str(d) for d in shape)


def input_shapes(view: GraphView, node: NodeDef) -> list[str]:
    """:func:`shape_text` of each data input of ``node`` (from its producers' shapes)."""
    shapes = []
    for ref in node.input:
        name, port, control = parse_input(ref)
        src = view.node(name)
        if not control:
            shapes.append(shape_text(None if src is None else output_shape(src, port)))
    return shapes


def choose_rewrite(tuner: Chooser, family: str, signature: str, view: GraphView,
                   nodes: Iterable[str], rewrite: Callable[[GraphView], object],
                   stock: str = "stock", fused: str = "fused",
                   unknown_dim: int = UNKNOWN_DIM) -> Choice:
    """Ask ``tuner`` whether ``nodes`` of ``view`` run faster as they are (``stock``) or after
    ``rewrite`` (``fused``): each candidate is the fragment of those nodes (:func:`cut`), built
    and timed only if the tuner measures."""
    names = list(nodes)

    shared: dict[str, Any] = {}

    def factory(rewritten: bool) -> Callable[[], Callable[[], Any]]:
        def make() -> Callable[[], Any]:
            if "piece" not in shared:
                shared["piece"] = cut(view, names, unknown_dim)
                shared["inputs"] = make_inputs(shared["piece"])
            piece = shared["piece"]
            return runner(variant(piece, rewrite) if rewritten else piece, shared["inputs"])

        return make

    return tuner.choose(family, signature, {stock: factory(False), fused: factory(True)},
                        conservative=stock)


__all__ = ["Fragment", "FragmentError", "choose_rewrite", "cut", "input_shapes", "make_inputs",
           "output_dtype", "runner", "shape_text", "tensor_shape", "variant"]
