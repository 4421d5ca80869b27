"""Where each node of a traced step would run under a Metal backend, and what falling back to
the host costs: a CPU-fallback audit that runs on any machine.

:func:`place` decides, for every node of a GraphDef and of its function library, what
TensorFlow's placer with soft placement would decide on a Mac with that backend's plugin:

- on the GPU if the plugin registers a kernel for the op in the node's dtypes (every type
  attribute its registration constrains: ``T``, ``dtype``, ``Tidx``...; Apple's table names no
  dtypes, so any but float64, which Metal has no type for), or if TensorFlow itself registers a
  kernel for every device (``DEFAULT``: ``ReadVariableOp``, ``AssignVariableOp``, ``Identity``,
  ``NoOp``...) that takes those dtypes: the generic kernel runs on the plugin's device;
- on the host otherwise: no kernel in the table, not in that dtype, or host-only under the
  TensorFlow planned for (:attr:`tfmx.backends.Backend.host_only`);
- colocation: the placer keeps every op that takes a resource (a variable's reads, assigns and
  ``ResourceApply*`` updates) on the variable's device, so one member with no kernel on the GPU
  takes the variable and all its other ops to the host (``colocated``).

Not every node on the host is a fallback. These are not counted, and no edge to or from them
is a crossing: the step's boundary (``_Arg``, ``_Retval``, ``Placeholder``), constants
(``Const``: materialized once, where their consumer wants them), and nodes TensorFlow runs on
the host on any GPU: a kernel (the plugin's or TensorFlow's generic one) whose inputs and
outputs all live in host memory (``Shape``, ``Identity`` of int32, ``BroadcastGradientArgs``),
or an op with no device kernel whose every type attribute is int32 (shape arithmetic: the GPU
kernels of TensorFlow keep int32 tensors in host memory).

Identity and metadata ops (``Identity``, ``Shape``, ``Size``...) follow their input's device,
as the placer's heuristic puts them (``follows``). A *crossing* is a data edge between nodes on
different devices, neither of them the boundary nor host by design (not a resource handle, not
an input the device kernel takes in host memory): a copy every step. Its bytes come from the
producer's ``_output_shapes`` (trace with ``add_shapes=True``) where fully known.

:func:`compare` places a stock step and tfmx's plan of it and checks the rule that tfmx never
moves a node from the device to the host (:class:`Audit`);
:func:`tfmx.placement_audit.audit_model` traces both for a compiled Keras model. Nothing here
runs on a GPU.

Example:
    >>> import tensorflow as tf
    >>> from tfmx.backends import get_backend
    >>> v = tf.Variable(tf.ones([4, 4]))
    >>> @tf.function
    ... def step(x):
    ...     y = tf.nn.relu(tf.matmul(x, v))
    ...     return tf.math.bessel_i0e(y)
    >>> graph = step.get_concrete_function(tf.TensorSpec([2, 4])).graph.as_graph_def(
    ...     add_shapes=True)
    >>> placed = place(graph, get_backend("metal", plugin="tensorflow-metal-plugin",
    ...                                   tensorflow="2.21"))
    >>> placed.device_of("MatMul"), placed.device_of("BesselI0e")
    ('GPU', 'CPU')
    >>> dict(placed.host_ops()), len(placed.crossings), placed.crossing_bytes()
    ({'BesselI0e': 1}, 1, 32)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

from tfmx import metal_plugins
from tfmx.backends import Backend

GPU, CPU = "GPU", "CPU"
BOUNDARY = frozenset({"_Arg", "_Retval", "Placeholder", "Const", "_DeviceArg", "_DeviceRetval"})
# Ops that take a resource without being colocated with it: TensorFlow's registrations
# (input_colocation_exemption_registry: IdentityN and the function calls forward the handle),
# and If / While, which it lowers before placement into their bodies' ops (placed there).
COLOCATION_EXEMPT = frozenset({"IdentityN", "PartitionedCall", "StatefulPartitionedCall", "If",
                               "StatelessIf", "While", "StatelessWhile"})
# What the nodes a fused kernel replaces are, beside its fused_ops list.
_FUSED_BASE = {"_FusedConv2D": "Conv2D", "_FusedMatMul": "MatMul",
               "_FusedDepthwiseConv2dNative": "DepthwiseConv2dNative",
               "_FusedBatchMatMulV2": "BatchMatMulV2", "_FusedBatchNormEx": "FusedBatchNormV3",
               "_FusedBatchNormGradEx": "FusedBatchNormGradV3"}
# The placer puts these with their input (its heuristic for identity and metadata ops).
FOLLOWERS = frozenset({"Identity", "IdentityN", "Snapshot", "Shape", "ShapeN", "Size", "Rank",
                       "StopGradient", "PreventGradient"})
_RESOURCE = 20  # DT_RESOURCE
_INT32 = 3
_FLOAT64 = 2


@dataclasses.dataclass(frozen=True)
class Placed:
    """One node's placement: ``device`` is ``"GPU"`` or ``"CPU"``; ``kind`` is ``"device"``,
    ``"fallback"`` (on the host for want of a GPU kernel, or colocated with a node that has
    none), ``"follows"`` (an identity or metadata op, placed with its input), ``"host by
    design"`` (TensorFlow runs it on the host on any GPU) or ``"boundary"``
    (arguments, results, constants); ``why`` says which rule decided."""

    function: str  # "" for the outer graph, else the library function's name
    name: str
    op: str
    dtype: str  # the node's first type attribute, "" where it has none
    device: str
    kind: str
    why: str
    parts: tuple[str, ...] = ()  # a fused node's: the ops it stands for (else its own op)

    @property
    def fallback(self) -> bool:
        return self.kind == "fallback"


@dataclasses.dataclass(frozen=True)
class Crossing:
    """A data edge between the GPU and a fallback node on the host."""

    function: str
    src: str
    dst: str
    dtype: str
    bytes: int | None  # None where the tensor's shape is not fully known


@dataclasses.dataclass
class Placement:
    """Every node of a step placed for one backend; see :func:`place`."""

    backend: str
    nodes: dict[tuple[str, str], Placed]
    crossings: list[Crossing]

    def device_of(self, op: str) -> str:
        """The device of the first node of op ``op`` (KeyError if there is none)."""
        for p in self.nodes.values():
            if p.op == op:
                return p.device
        raise KeyError(f"no {op} node")

    def fallbacks(self) -> list[Placed]:
        """The nodes on the host for want of a GPU kernel (colocated ones included)."""
        return [p for p in self.nodes.values() if p.fallback]

    def host_ops(self) -> collections.Counter:
        """Op -> how many of its nodes fall back to the host."""
        return collections.Counter(p.op for p in self.fallbacks())

    def crossing_bytes(self) -> int:
        """The bytes the crossings of known shape copy per step (each edge once)."""
        return sum(c.bytes or 0 for c in self.crossings)

    def summary(self) -> str:
        """One line: nodes placed, on the GPU, fallbacks, crossings.

        >>> Placement("metal", {}, []).summary()
        '0 nodes: 0 on the GPU, 0 fallback(s) to the host, 0 crossing(s) (0 bytes known)'
        """
        gpu = sum(p.device == GPU for p in self.nodes.values())
        return (f"{len(self.nodes)} nodes: {gpu} on the GPU, {len(self.fallbacks())} "
                f"fallback(s) to the host, {len(self.crossings)} crossing(s) "
                f"({self.crossing_bytes()} bytes known)")


# -- TensorFlow's own registrations -------------------------------------------------------------
@functools.cache
def _op_def(op: str) -> Any:
    from tensorflow.python.framework import op_def_registry

    return op_def_registry.get(op)


@functools.cache
def _kernels(op: str, device: str) -> tuple[tuple[dict[str, frozenset[int]], frozenset[str]],
                                            ...]:
    """TensorFlow's kernels of ``op`` for ``device`` ("DEFAULT": every device; "GPU"): each as
    (type attribute -> allowed dtype enums, the args it keeps in host memory)."""
    from tensorflow.python.framework import kernels

    try:
        found = kernels.get_registered_kernels_for_op(op).kernel
    except Exception:  # noqa: BLE001 - an op TensorFlow does not know has no kernel here
        return ()
    return tuple(({c.name: frozenset(c.allowed_values.list.type) for c in k.constraint},
                  frozenset(k.host_memory_arg)) for k in found if k.device_type == device)


def _matching(node: Any, device: str) -> frozenset[str] | None:
    """The host-memory args of TensorFlow's ``device`` kernel for ``node``'s dtypes, or None if
    it has none."""
    for constraints, host_args in _kernels(node.op, device):
        if all(a in node.attr and node.attr[a].type in allowed
               for a, allowed in constraints.items()):
            return host_args
    return None


def _type_attrs(node: Any) -> dict[str, int]:
    return {k: v.type for k, v in node.attr.items() if v.WhichOneof("value") == "type"
            and not k.startswith("_")}


def _value_type(types: dict[str, int]) -> int:
    """The dtype a node computes in: ``T`` or ``dtype`` where it has one."""
    for attr in ("T", "dtype", "DstT", "Tout"):
        if attr in types:
            return types[attr]
    return types[sorted(types)[0]]


def _dtype_name(enum: int) -> str:
    from tensorflow.python.framework import dtypes

    try:
        return dtypes.as_dtype(enum).name
    except TypeError:
        return str(enum)


def _args(node: Any, which: str) -> list[tuple[str, int]]:
    """``node``'s flat inputs or outputs as (arg name, dtype enum; 0 where not known)."""
    op_def = _op_def(node.op)
    if op_def is None:
        return []
    flat = []
    for arg in getattr(op_def, which):
        count = node.attr[arg.number_attr].i if arg.number_attr else 1
        if arg.type_list_attr:
            types = list(node.attr[arg.type_list_attr].list.type)
        else:
            dtype = arg.type or (node.attr[arg.type_attr].type if arg.type_attr else 0)
            types = [dtype] * count
        flat += [(arg.name, t) for t in types]
    return flat


# -- the decision per node -------------------------------------------------------------------------
class _Rules:
    """What ``backend`` runs on its GPU, node by node."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.table = None
        if backend.plugin is not None:
            self.table = metal_plugins.plugin_table(*backend.plugin)

    def plugin_runs(self, node: Any) -> str | None:
        """None if the plugin has a kernel for ``node`` in its dtypes, else why not."""
        op = node.op
        if not self.backend.runs_op(op):
            if op in self.backend.host_only:
                return f"host-only: {self.backend.host_only_reason(op)}"
            return f"{op} has no kernel in {self._plugin()}"
        types = _type_attrs(node)
        if self.table is not None and self.table.type_constraints:
            for attr, allowed in self.table.type_constraints.get(op, {}).items():
                if attr in types and allowed and _dtype_name(types[attr]) not in allowed:
                    return (f"{op} in {_dtype_name(types[attr])}: {self._plugin()} registers "
                            f"it for {attr} in {', '.join(sorted(allowed))} only")
        elif _FLOAT64 in types.values():
            return f"{op} in float64: Metal has no 64-bit float"
        return None

    def _plugin(self) -> str:
        return " ".join(self.backend.plugin) if self.backend.plugin else self.backend.name

    def decide(self, node: Any) -> tuple[str, str, str, frozenset[str]]:
        """(device, kind, why, the args its device kernel keeps in host memory)."""
        if node.op in BOUNDARY:
            return CPU, "boundary", "the step's boundary or a constant", frozenset()
        missing = self.plugin_runs(node)
        if missing is None:
            host_args = _matching(node, "GPU") or frozenset()
            return self._on_device(node, "the plugin's kernel", host_args)
        generic = _matching(node, "DEFAULT")
        if generic is not None:
            return self._on_device(node, "TensorFlow's kernel for every device", generic)
        types = _type_attrs(node)
        if types and set(types.values()) == {_INT32}:
            return CPU, "host by design", "int32 shape arithmetic", frozenset()
        return CPU, "fallback", missing, frozenset()

    @staticmethod
    def _on_device(node: Any, source: str, host_args: frozenset[str]
                   ) -> tuple[str, str, str, frozenset[str]]:
        names = {n for n, _ in _args(node, "input_arg")} | {n for n, _ in
                                                           _args(node, "output_arg")}
        if names and names <= host_args:
            return CPU, "host by design", f"{source} keeps every tensor in host memory", host_args
        return GPU, "device", source, host_args


# -- graphs -------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Body:
    function: str
    nodes: list
    args: frozenset[str]  # a function's input arg names (the boundary)


def _bodies(graph_def: Any) -> Iterator[_Body]:
    yield _Body("", list(graph_def.node), frozenset())
    for fdef in graph_def.library.function:
        yield _Body(fdef.signature.name, list(fdef.node_def),
                    frozenset(a.name for a in fdef.signature.input_arg))


def _source(body: _Body, ref: str, by_name: dict) -> tuple[str, int] | None:
    """The producing node and flat output index of input ``ref`` (None: control or boundary)."""
    if ref.startswith("^") or ref in body.args:
        return None
    parts = ref.split(":")
    name = parts[0]
    if name not in by_name:
        return None
    if body.function and len(parts) == 3:  # node:out_arg:index inside a function
        flat = _args(by_name[name], "output_arg")
        names = [n for n, _ in flat]
        if parts[1] not in names:
            return name, 0
        return name, names.index(parts[1]) + int(parts[2])
    return name, int(parts[1]) if len(parts) > 1 else 0


def _size(node: Any, index: int, dtype: int) -> int | None:
    from tensorflow.python.framework import dtypes

    shapes = node.attr["_output_shapes"].list.shape if "_output_shapes" in node.attr else []
    if index >= len(shapes) or shapes[index].unknown_rank or not dtype:
        return None
    dims = [d.size for d in shapes[index].dim]
    if any(d < 0 for d in dims):
        return None
    try:
        item = dtypes.as_dtype(dtype).size
    except TypeError:
        return None
    total = item
    for d in dims:
        total *= d
    return total


class _Groups:
    """Union-find over nodes that take the same resource."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        while self.parent.setdefault(x, x) != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)


def place(graph_def: Any, backend: Backend) -> Placement:
    """Each node of ``graph_def`` (its function library included) placed for ``backend`` (a
    metal backend from :func:`tfmx.backends.get_backend`), with the crossings it costs: see the
    module docstring for the rules.

    >>> import tensorflow as tf
    >>> from tfmx.backends import get_backend
    >>> graph = tf.function(lambda x: tf.shape(x) * 2).get_concrete_function(
    ...     tf.TensorSpec([3])).graph.as_graph_def()
    >>> placed = place(graph, get_backend("metal"))
    >>> sorted({p.kind for p in placed.nodes.values()}), placed.fallbacks()
    (['boundary', 'host by design'], [])
    """
    rules = _Rules(backend)
    nodes: dict[tuple[str, str], Placed] = {}
    crossings: list[Crossing] = []
    for body in _bodies(graph_def):
        by_name = {n.name: n for n in body.nodes}
        decided = {n.name: rules.decide(n) for n in body.nodes}
        groups = _Groups()
        for node in body.nodes:
            if node.op in COLOCATION_EXEMPT or decided[node.name][1] == "boundary":
                continue
            for ref in node.input:
                src = _source(body, ref, by_name)
                if src is None:
                    continue
                outputs = _args(by_name[src[0]], "output_arg")
                is_handle = src[1] < len(outputs) and outputs[src[1]][1] == _RESOURCE
                if is_handle:
                    groups.union(node.name, src[0])
        members: dict[str, list[str]] = collections.defaultdict(list)
        for name in groups.parent:
            members[groups.find(name)].append(name)
        for names in members.values():
            blockers = [n for n in names if decided[n][1] == "fallback"]
            if not blockers:
                continue
            first = by_name[blockers[0]]
            for n in names:
                device, kind, why, host_args = decided[n]
                if kind in ("device", "host by design") and device == GPU:
                    decided[n] = (CPU, "fallback", f"colocated with {first.op} {first.name!r} "
                                  f"on the same resource ({decided[first.name][2]})", host_args)
        _follow(body, by_name, decided)
        for node in body.nodes:
            device, kind, why, _ = decided[node.name]
            types = _type_attrs(node)
            dtype = _dtype_name(_value_type(types)) if types else ""
            nodes[(body.function, node.name)] = Placed(body.function, node.name, node.op, dtype,
                                                       device, kind, why, parts_of(node))
        crossings += _crossings(body, by_name, decided)
    return Placement(backend=backend.description, nodes=nodes, crossings=crossings)


def _follow(body: _Body, by_name: dict, decided: dict) -> None:
    """Identity and metadata ops on their input's device (``follows``), chains included."""
    for _ in range(8):
        changed = False
        for node in body.nodes:
            if node.op not in FOLLOWERS or decided[node.name][1] not in ("device", "follows"):
                continue
            data = [r for r in node.input if not r.startswith("^")]
            src = _source(body, data[0], by_name) if data else None
            if src is None or decided[src[0]][1] in ("boundary", "host by design"):
                continue
            device, host_args = decided[src[0]][0], decided[node.name][3]
            new = (device, "follows", f"placed with its input {src[0]!r}", host_args)
            if decided[node.name] != new:
                decided[node.name], changed = new, True
        if not changed:
            return


def _crossings(body: _Body, by_name: dict, decided: dict) -> list[Crossing]:
    found = []
    for node in body.nodes:
        dst_device, dst_kind, _, host_args = decided[node.name]
        inputs = _args(node, "input_arg")
        for i, ref in enumerate(r for r in node.input if not r.startswith("^")):
            src = _source(body, ref, by_name)
            if src is None:
                continue
            src_device, src_kind, _, _ = decided[src[0]]
            if src_kind == "boundary" or dst_kind == "boundary":
                continue
            if src_device == dst_device or "host by design" in (src_kind, dst_kind):
                continue
            outputs = _args(by_name[src[0]], "output_arg")
            dtype = outputs[src[1]][1] if src[1] < len(outputs) else 0
            arg = inputs[i][0] if i < len(inputs) else ""
            if dtype == _RESOURCE or (dst_device == GPU and arg in host_args):
                continue
            found.append(Crossing(body.function, src[0], node.name, _dtype_name(dtype) if dtype
                                  else "", _size(by_name[src[0]], src[1], dtype)))
    return found


def parts_of(node: Any) -> tuple[str, ...]:
    """The ops a node stands for: a fused node's base op and its ``fused_ops``, else its op.

    >>> from tensorflow.core.framework import node_def_pb2
    >>> node = node_def_pb2.NodeDef(op="_FusedMatMul")
    >>> node.attr["fused_ops"].list.s.extend([b"BiasAdd", b"Relu"])
    >>> parts_of(node)
    ('MatMul', 'BiasAdd', 'Relu')
    """
    base = _FUSED_BASE.get(node.op)
    if base is None:
        return (node.op,)
    fused = [s.decode() for s in node.attr["fused_ops"].list.s] if "fused_ops" in node.attr \
        else []
    if "activation_mode" in node.attr and node.attr["activation_mode"].s not in (b"", b"Identity"):
        fused.append(node.attr["activation_mode"].s.decode())
    return (base, *fused)


# -- stock against tfmx --------------------------------------------------------------------------
@dataclasses.dataclass
class Audit:
    """A step placed as stock traced it and as tfmx planned it; :attr:`moved` lists the nodes
    tfmx put on the host that stock ran on the device (the rule: none).

    A tfmx node on the host is *moved* if its stock counterpart (same function, same name, same
    op and dtype) was on the device. A node with no counterpart (one tfmx emitted, a fused one
    among them) is moved if stock has no fallback of one of its parts in its dtype, unless every
    stock node tfmx replaced in its layer's scope was on the host already."""

    backend: str
    stock: Placement
    tfmx: Placement
    moved: list[Placed]

    @property
    def ok(self) -> bool:
        """True if tfmx moved no node from the device to the host."""
        return not self.moved

    def lines(self, stock_label: str = "stock") -> list[str]:
        """The audit as report lines (see :func:`compare` for an example)."""
        out = [f"placement on {self.backend} (a plan: nothing ran on a GPU)"]
        for label, placed in ((stock_label, self.stock), ("tfmx", self.tfmx)):
            host = ", ".join(f"{op} x{n}" for op, n in sorted(placed.host_ops().items()))
            out.append(f"  {label}: {placed.summary()}")
            out.append(f"    on the host: {host or '-'}")
        out.append(f"  moved from the device to the host by tfmx: {len(self.moved)}")
        out += [f"    {p.op} {p.name!r}: {p.why}" for p in self.moved[:20]]
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _scope(name: str) -> str:
    """A node's layer scope: its name without the last part and tfmx's own sub-scopes."""
    return "/".join(part for part in name.split("/")[:-1] if not part.startswith("tfmx_"))


def _moved(stock: Placement, planned: Placement) -> list[Placed]:
    stock_host = {(p.op, p.dtype) for p in stock.fallbacks()}
    # What tfmx replaced, by scope: the stock nodes its plan no longer has.
    replaced: dict[tuple[str, str], list[Placed]] = collections.defaultdict(list)
    for key, q in stock.nodes.items():
        if key not in planned.nodes and q.kind in ("device", "fallback"):
            replaced[(q.function, _scope(q.name))].append(q)
    moved = []
    for p in planned.fallbacks():
        twin = stock.nodes.get((p.function, p.name))
        # a twin is the same node: same op in the same dtype (tfmx's trace may give a name to
        # another node than stock's did, a gradient's AddN of another dtype among them)
        if twin is not None and twin.op == p.op and twin.dtype == p.dtype:
            if twin.device == GPU:
                moved.append(p)
            continue
        # A node tfmx emitted: moved if stock had no such fallback and what it replaced in
        # its layer's scope (if anything) ran there on the plugin's kernel.
        region = replaced.get((p.function, _scope(p.name)))
        device_work = not region or any(q.device == GPU and q.why == "the plugin's kernel"
                                        for q in region)
        if device_work and any((part, p.dtype) not in stock_host for part in p.parts):
            moved.append(p)
    return moved


def compare(stock_graph: Any, tfmx_graph: Any, backend: Backend) -> Audit:
    """Place both GraphDefs for ``backend`` and check that tfmx moved nothing to the host.

    >>> import tensorflow as tf
    >>> from tfmx.backends import get_backend
    >>> def graph(fn):
    ...     return tf.function(fn).get_concrete_function(tf.TensorSpec([2, 2])).graph.as_graph_def()
    >>> backend = get_backend("metal", plugin="tensorflow-metal-plugin", tensorflow="2.21")
    >>> audit = compare(graph(lambda x: tf.nn.relu(x)), graph(lambda x: tf.math.lgamma(x)),
    ...                 backend)
    >>> audit.ok, [p.op for p in audit.moved]
    (False, ['Lgamma'])
    >>> compare(graph(lambda x: tf.nn.relu(x)), graph(lambda x: tf.nn.relu(x)), backend).ok
    True
    """
    stock, planned = place(stock_graph, backend), place(tfmx_graph, backend)
    return Audit(backend.description, stock, planned, _moved(stock, planned))
