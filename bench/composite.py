"""What tfmx leaves composite in the zoo models, and its share of the training step.

Each zoo model (:mod:`bench.zoo`) names the patterns tfmx leaves to TensorFlow's own ops
(``MODELS[name].composite``: hard-swish, squeeze-excite, rotary embedding, ...). This module
measures how much of a training step those ops take, from TensorFlow's own profiler:

1. The workload ``zoo_<name>`` (:data:`bench.workloads.WORKLOADS`; at ``size="tiny"`` the same
   workload on the zoo's tiny model) is built and compiled as ``tfmx bench`` builds it
   (:func:`bench.workloads.build_model`: same seed, optimizer adam, the workload's batch, its
   random data from :func:`bench.workloads.random_dataset`), once per mode: ``stock`` (tfmx
   off) and ``tfmx`` (``tfmx.enable(guard=False)``: the step tfmx's rewrite makes, not the
   guard's pick between it and stock, which could be stock or XLA itself).
2. The first call (it traces) and ``warmup`` more run with TensorFlow's graph collection on:
   the graphs the runtime executes (after Grappler), node names, op types and inputs. Then
   ``steps`` calls under ``tf.profiler.experimental``; the XSpace it writes holds
   one event per op kernel executed on the host threads (node name with its name scopes, op
   type, start, duration; asynchronous kernels such as an XLA-compiled call as their
   ``ExecutorState::ProcessAsync::Start`` event).
3. An op's self time is its events' time minus that of op events nested inside them on the
   same thread. Ops run concurrently on the inter-op threads, so each moment of the profile
   is divided equally among the ops running at that moment (:func:`attributed_times`): the
   ops' attributed times add up to the time during which any op of the step was running
   (``busy_ms``). A pattern's **share** is its ops' attributed time over that total. The
   summed self time of its ops over all ops' summed self time is kept too
   (``summed_share``), and the wall-clock time of the profiled steps (``wall_ms``).
4. Each op is attributed to at most one pattern, the first of :data:`MATCHERS` (in its order)
   whose rules match the op's node name (function-call prefixes removed) and op type
   (oneDNN's ``_Mkl``/``_MklNative`` prefix removed); forward ops carry their layer's scope,
   gradient ops the same scope under ``gradient_tape/``. Gradient ops a custom gradient
   creates (``tf.nn.silu``'s) sit at the step's root scope: a connected group of such root
   ops takes the pattern of a matched op it reads from or shares an input with
   (:func:`assign_patterns`).

``python -m bench.composite --model zoo --record`` writes one JSON record per model under
``bench/results/composite/`` (:data:`COMPOSITE_DIR`; :func:`bench.records.load_records` reads
only ``bench/results/*.json`` and never these); :func:`format_composite` lays them out for
BENCHMARKS.md.

Example:
    >>> from bench.composite import MATCHERS, pattern_of
    >>> pattern_of("StatefulPartitionedCall/gradient_tape/zoo_llama_tiny_1/llama_backbone_1/"
    ...            "transformer_layer_0_1/self_attention_1/llama_rotary_embedding_1/Neg", "Neg",
    ...            ("rotary embedding", "RMSNorm"))
    'rotary embedding'
    >>> MATCHERS["depthwise convolution"].matches("zoo_x_tiny_1/block1a_dwconv_1/depthwise",
    ...                                           "_MklNativeDepthwiseConv2dNative")
    True
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import glob
import json
import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import zoo
from bench.records import RESULTS_DIR, read_json_records

COMPOSITE_DIR = RESULTS_DIR / "composite"
"""Where ``python -m bench.composite --record`` writes and :func:`load_composite` reads."""

SCHEMA = 1
"""The composite records' layout; a file of another layout is not read."""

MODES = ("stock", "tfmx")
"""The steps profiled: Keras's own (tfmx off) and tfmx's rewritten one."""

SHARE_MEASURE = (
    "each moment of the profiled steps divided equally among the ops running at that moment "
    "on the host's threads; a pattern's share is its ops' time so attributed over all ops' "
    "(forward and gradient ops, optimizer, metrics and the input fetch included)")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One way an op belongs to a pattern: ``scope`` (a regex searched in the op's node name,
    function-call prefixes removed) and ``ops`` (a regex the whole op type must match,
    oneDNN's ``_Mkl``/``_MklNative`` prefix removed); None matches anything.

    >>> Rule(scope=r"layer_scale(_\\d+)*/").matches("zoo_c_tiny_1/b_layer_scale_1/mul", "Mul")
    True
    >>> Rule(scope=r"re_lu", ops="Relu6(Grad)?").matches("m_1/re_lu_2_1/Relu", "Relu")
    False
    """

    scope: str | None = None
    ops: str | None = None

    def matches(self, name: str, op: str) -> bool:
        """Whether the op ``name`` (node name) of type ``op`` satisfies both regexes."""
        if self.scope is not None and not re.search(self.scope, name):
            return False
        return self.ops is None or re.fullmatch(self.ops, _op_type(op)) is not None


@dataclasses.dataclass(frozen=True)
class Matcher:
    """A composite pattern: what it counts (one line, for the docs) and its rules (an op
    belongs to it if any rule matches)."""

    what: str
    rules: tuple[Rule, ...]

    def matches(self, name: str, op: str) -> bool:
        """Whether any rule matches the op ``name`` of type ``op``.

        >>> MATCHERS["concatenate"].matches(
        ...     "gradient_tape/zoo_densenet121_tiny_1/conv2_block1_concat_1/Slice", "Slice")
        True
        """
        return any(rule.matches(name, op) for rule in self.rules)


_MODEL_ROOT = r"(^|/)zoo_\w+_(bench|tiny)(_\d+)?/"  # the zoo model's own scope, no layer

MATCHERS: dict[str, Matcher] = {
    "squeeze-excite": Matcher(
        "the squeeze-excite blocks: global pool, two 1x1 convolutions with their activations "
        "(MobileNetV3's hard-sigmoid: ReLU6, add, multiply), the channel multiply",
        (Rule(scope=r"squeeze_excite"),
         Rule(scope=r"_se_(squeeze|reshape|reduce|expand|excite)(_\d+)*/"),
         Rule(scope=_MODEL_ROOT + r"(Add|Mul)(_\d+)?(/|$)"),  # hard_sigmoid's x + 3, * 1/6
         Rule(scope=r"(^|/)re_lu(_\d+)*/", ops=r"Relu6(Grad)?"))),  # hard_sigmoid's ReLU(6)
    "hard-swish": Matcher(
        "the hard-swish Activation layers: x * relu6(x + 3) / 6",
        (Rule(scope=r"(^|/)activation(_\d+)*/"),)),
    "swish": Matcher(
        "the swish Activation layers (x * sigmoid(x)) and its gradient's ops",
        (Rule(scope=r"(^|/|_)activation(_\d+)*/"),)),
    "depthwise convolution": Matcher(
        "the DepthwiseConv2D layers (ConvNeXt's grouped Conv2D) and their gradients",
        (Rule(ops=r"DepthwiseConv2dNative\w*"),
         Rule(scope=r"(^|/|_)(depthwise|dwconv|depthwise_conv)(_\d+)*/"))),
    "layer scale": Matcher(
        "ConvNeXt's LayerScale: a learned per-channel multiply",
        (Rule(scope=r"layer_scale(_\d+)*/"),)),
    "pre-activation ReLU": Matcher(
        "ResNetV2's ReLU Activation layers after each batch norm (the batch norm fused alone, "
        "its ReLU apart)",
        (Rule(scope=r"(^|/|_)(preact|\d|post)_relu(_\d+)*/"),)),
    "concatenate": Matcher(
        "DenseNet's Concatenate layers (and the slices of their gradient)",
        (Rule(scope=r"_concat(_\d+)*/"),)),
    "embeddings": Matcher(
        "the token, position (and segment) embedding lookups, their sum, and the optimizer's "
        "sum of their sparse gradients",
        (Rule(scope=r"(token|position|segment)_embedding(_\d+)*/"),
         Rule(scope=r"embeddings_add(_\d+)*/"),
         Rule(ops=r"UnsortedSegmentSum"))),
    "dropout": Matcher(
        "the Dropout layers and attention's dropout: the stateless uniform draw, its comparison "
        "with the rate, the kept values' select and scale, and their gradients (the draw is "
        "what sets the masks: a form that kept stock's masks would draw the same numbers)",
        (Rule(ops=r"StatelessRandom\w*"),
         Rule(scope=r"(^|/)(?!tfmx_)\w*dropout(_\d+)*/"))),  # not tfmx's attention forms
    "rotary embedding": Matcher(
        "the rotary position embedding of queries and keys",
        (Rule(scope=r"rotary_embedding(_\d+)*/"),)),
    "RMSNorm": Matcher(
        "Llama's own RMS layer norms",
        (Rule(scope=r"layernorm(_\d+)*/"),)),
    "SwiGLU": Matcher(
        "the SiLU of the gate and its product with the up projection (the three Dense "
        "projections are not counted)",
        (Rule(scope=r"transformer_layer_\d+(_\d+)*/(mul|Mul)(_\d+)?(/|$)"),)),
    "grouped-query attention": Matcher(
        "the attention between the projections: key/value heads repeated, scores, mask, "
        "softmax, weighted sum, transposes (rotary embedding and the Dense projections not "
        "counted)",
        (Rule(scope=r"self_attention(_\d+)*/(?!(query|key|value|attention_output)(_\d+)*/)"),)),
    "multi-query attention": Matcher(
        "Gemma's attention between the projections: one key/value head for every query head, "
        "scores, mask, softmax, weighted sum (rotary embedding and the projections not "
        "counted)",
        (Rule(scope=r"(^|/)attention(_\d+)*/(?!(query|key|value|attention_output|"
                    r"rotary_embedding)(_\d+)*/)"),)),
    "MoE experts": Matcher(
        "a mixture of experts' expert bank: every expert's gate, up and output products on every "
        "token (Einsums), its SiLU and gated product",
        (Rule(scope=r"sparse_moe_block(_\d+)*/experts(_\d+)*/"),)),
    "MoE routing": Matcher(
        "a mixture of experts' routing: the router Dense, softmax, top_k, one_hot, the routing "
        "weights, the weighted sum of the experts' outputs, the load-balancing loss (QwenMoe's "
        "shared expert not counted)",
        (Rule(scope=r"sparse_moe_block(_\d+)*/(?!(experts|shared_expert_dense|"
                    r"shared_expert_gate_dense)(_\d+)*/)"),)),
}
"""One matcher per composite pattern named in :data:`bench.zoo.MODELS`, in the order an op is
tried: the first that matches takes it."""


def _op_type(op: str) -> str:
    """``op`` without oneDNN's prefix.

    >>> _op_type("_MklNativeFusedConv2D"), _op_type("_MklSwish"), _op_type("Mul")
    ('FusedConv2D', 'Swish', 'Mul')
    """
    return re.sub(r"^_Mkl(Native)?", "", op)


_CALL_PREFIX = re.compile(r"^(StatefulPartitionedCall/)+")


def node_name(name: str) -> str:
    """A profiled op's node name without the function-call prefixes the runtime adds.

    >>> node_name("StatefulPartitionedCall/gradient_tape/zoo_m_tiny_1/conv_1/Conv2D")
    'gradient_tape/zoo_m_tiny_1/conv_1/Conv2D'
    """
    return _CALL_PREFIX.sub("", name)


def _order(patterns: Iterable[str]) -> list[str]:
    wanted = set(patterns)
    unknown = wanted - set(MATCHERS)
    if unknown:
        raise ValueError(f"no matcher for composite pattern(s) {sorted(unknown)}; "
                         f"known: {list(MATCHERS)}")
    return [p for p in MATCHERS if p in wanted]


def pattern_of(name: str, op: str, patterns: Iterable[str]) -> str | None:
    """The first of ``patterns`` (in :data:`MATCHERS`'s order) matching op ``name`` of type
    ``op``, or None.

    >>> pattern_of("zoo_m_tiny_1/expanded_conv_squeeze_excite_conv_1/Conv2D", "Conv2D",
    ...            ["depthwise convolution", "squeeze-excite"])
    'squeeze-excite'
    >>> pattern_of("adam/Sub_3", "Sub", ["squeeze-excite"]) is None
    True
    """
    name = node_name(name)
    for pattern in _order(patterns):
        if MATCHERS[pattern].matches(name, op):
            return pattern
    return None


@dataclasses.dataclass(frozen=True)
class Node:
    """One node of an executed graph: its op type and its data inputs (``node:output``)."""

    op: str
    inputs: tuple[str, ...]


def graph_nodes(graphs: Iterable[Any]) -> dict[str, Node]:
    """Node name (:func:`node_name`) -> :class:`Node`, from ``GraphDef`` protos (the partition
    graphs TensorFlow's graph collection keeps); control inputs left out.

    >>> import tensorflow as tf
    >>> g = tf.compat.v1.GraphDef()
    >>> n = g.node.add(name="StatefulPartitionedCall/Sigmoid", op="Sigmoid")
    >>> n.input.extend(["StatefulPartitionedCall/bn/add_1:0", "^StatefulPartitionedCall/x"])
    >>> graph_nodes([g])
    {'Sigmoid': Node(op='Sigmoid', inputs=('bn/add_1:0',))}
    """
    nodes = {}
    for graph in graphs:
        for n in graph.node:
            inputs = tuple(_tensor(i) for i in n.input if not i.startswith("^"))
            nodes[node_name(n.name)] = Node(n.op, inputs)
    return nodes


def _tensor(name: str) -> str:
    """An input's tensor name, ``node:output`` (node name as :func:`node_name`)."""
    node, _, output = name.partition(":")
    return f"{node_name(node)}:{output or 0}"


def _source(tensor: str) -> str:
    return tensor.rpartition(":")[0] or tensor


def _constant(nodes: Mapping[str, Node], name: str) -> bool:
    return name not in nodes or nodes[name].op in ("Const", "HostConst", "_Arg")


def _is_root(name: str) -> bool:
    """A node at the step's root scope (a custom gradient's ops land there)."""
    return "/" not in name


def assign_patterns(nodes: Mapping[str, Node], patterns: Iterable[str]) -> dict[str, str]:
    """Node name -> pattern, for the nodes of ``nodes`` that belong to one of ``patterns``.

    By name first (:func:`pattern_of`). Then the nodes at the step's root scope (no ``/``:
    what a custom gradient such as ``tf.nn.silu``'s creates) that no rule matched, ``AddN``
    (gradient sums) and ``Const`` left out, are grouped by their data edges among each other;
    a group takes the pattern of the matched nodes it reads from or shares an input (not a
    constant) with (the first in :data:`MATCHERS`'s order if several).

    >>> nodes = {"m_tiny_1/top_activation_1/mul": Node("_MklSwish", ("m_tiny_1/bn_1/add:0",)),
    ...          "m_tiny_1/bn_1/add": Node("AddV2", ()),
    ...          "Sigmoid": Node("Sigmoid", ("m_tiny_1/bn_1/add:0",)),
    ...          "sub": Node("Sub", ("Sigmoid:0",)), "Equal": Node("Equal", ("ArgMax:0",)),
    ...          "ArgMax": Node("ArgMax", ("m_tiny_1/head_1/Softmax:0",))}
    >>> sorted(assign_patterns(nodes, ["swish"]).items())
    [('Sigmoid', 'swish'), ('m_tiny_1/top_activation_1/mul', 'swish'), ('sub', 'swish')]
    """
    order = _order(patterns)
    assigned = {name: p for name, node in nodes.items()
                if (p := pattern_of(name, node.op, order)) is not None}
    loose = {name for name, node in nodes.items()
             if _is_root(name) and name not in assigned and node.op not in ("AddN", "Const")}
    consumers: dict[str, list[str]] = collections.defaultdict(list)  # tensor -> nodes
    readers: dict[str, list[str]] = collections.defaultdict(list)  # node -> nodes
    for name, node in nodes.items():
        for tensor in node.inputs:
            consumers[tensor].append(name)
            readers[_source(tensor)].append(name)
    seen: set[str] = set()
    for start in sorted(loose):
        if start in seen:
            continue
        group, stack = [], [start]
        seen.add(start)
        while stack:  # the loose nodes connected to start by data edges
            name = stack.pop()
            group.append(name)
            neighbours = [_source(t) for t in nodes[name].inputs] + readers.get(name, [])
            for other in neighbours:
                if other in loose and other not in seen:
                    seen.add(other)
                    stack.append(other)
        found = set()
        for name in group:
            for tensor in nodes[name].inputs:
                if _constant(nodes, _source(tensor)):  # Grappler shares constants
                    continue
                if _source(tensor) in assigned:  # reads a matched node's output
                    found.add(assigned[_source(tensor)])
                for sibling in consumers.get(tensor, ()):
                    if sibling in assigned and not _is_root(sibling):  # shares that input
                        found.add(assigned[sibling])
        if found:
            pattern = next(p for p in order if p in found)
            assigned.update((name, pattern) for name in group)
    return assigned


# -- the profile ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One op kernel's execution on one host thread (times in picoseconds)."""

    name: str
    op: str
    thread: int
    start: int
    end: int


def read_op_events(path: str | Path) -> list[OpEvent]:
    """The op events of an XSpace file (``*.xplane.pb``, what ``tf.profiler.experimental``
    writes): on the ``/host:CPU`` plane, each event named ``<node name>:<op type>``, and each
    ``ExecutorState::ProcessAsync::Start`` (an asynchronous kernel: an XLA-compiled call, a
    function call) with its ``name`` and ``kernel_type`` stats."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    space.ParseFromString(Path(path).read_bytes())
    events = []
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
        for line in plane.lines:
            if line.name == "python":
                continue
            base = line.timestamp_ns * 1000
            for e in line.events:
                label = plane.event_metadata[e.metadata_id].name
                if label == "ExecutorState::ProcessAsync::Start":
                    stats = {stat_names.get(s.metadata_id): s for s in e.stats}
                    if "name" not in stats or "kernel_type" not in stats:
                        continue
                    name, op = (_stat_text(stats[k], stat_names) for k in ("name", "kernel_type"))
                elif ":" in label and "::" not in label and not label.startswith("end: "):
                    name, _, op = label.rpartition(":")
                else:
                    continue
                start = base + e.offset_ps
                events.append(OpEvent(name, op, line.id, start, start + e.duration_ps))
    return events


def _stat_text(stat: Any, stat_names: Mapping[int, str]) -> str:
    if stat.HasField("ref_value"):
        return stat_names.get(stat.ref_value, "")
    return stat.str_value


def attributed_times(events: Sequence[OpEvent]) -> tuple[dict[str, float], dict[str, float],
                                                           float]:
    """Per node name (:func:`node_name`): self time (events minus the op events nested in
    them on the same thread) and attributed time (each moment divided equally among the ops
    running at that moment, on every thread); and the busy time (any op running). All in
    picoseconds.

    >>> ev = [OpEvent("a", "Mul", 1, 0, 10), OpEvent("b", "Mul", 2, 5, 15),
    ...       OpEvent("c", "Call", 1, 20, 40), OpEvent("d", "Add", 1, 25, 30)]
    >>> own, shared, busy = attributed_times(ev)
    >>> sorted(own.items())
    [('a', 10.0), ('b', 10.0), ('c', 15.0), ('d', 5.0)]
    >>> sorted(shared.items()), busy
    ([('a', 7.5), ('b', 7.5), ('c', 15.0), ('d', 5.0)], 35.0)
    """
    segments: list[tuple[int, int, str]] = []
    by_thread: dict[int, list[OpEvent]] = collections.defaultdict(list)
    for e in events:
        if e.end > e.start:
            by_thread[e.thread].append(e)
    for thread_events in by_thread.values():
        segments.extend(_self_segments(thread_events))
    own: dict[str, float] = collections.defaultdict(float)
    for s, t, name in segments:
        own[name] += t - s
    shared: dict[str, float] = collections.defaultdict(float)
    bounds = sorted([(s, 1, i) for i, (s, _, _) in enumerate(segments)]
                    + [(t, 0, i) for i, (_, t, _) in enumerate(segments)])
    active: set[int] = set()
    busy, last = 0.0, None
    for t, starts, i in bounds:
        if active and last is not None and t > last:
            part = (t - last) / len(active)
            for j in active:
                shared[segments[j][2]] += part
            busy += t - last
        last = t
        if starts:
            active.add(i)
        else:
            active.discard(i)
    return dict(own), dict(shared), busy


def _self_segments(events: list[OpEvent]) -> list[tuple[int, int, str]]:
    """One thread's events as (start, end, node name) pieces: each piece of time belongs to
    the innermost event running then."""
    out: list[tuple[int, int, str]] = []
    stack: list[list[Any]] = []  # [event, end clipped to its parent's, time covered up to]

    def close(until: int) -> None:
        while stack and stack[-1][1] <= until:
            event, end, cursor = stack.pop()
            if end > cursor:
                out.append((cursor, end, node_name(event.name)))
            if stack:
                stack[-1][2] = max(stack[-1][2], end)

    for e in sorted(events, key=lambda e: (e.start, -e.end)):
        close(e.start)
        end = e.end
        if stack:
            parent = stack[-1]
            if e.start > parent[2]:
                out.append((parent[2], e.start, node_name(parent[0].name)))
            end = min(end, parent[1])
            parent[2] = max(parent[2], e.start)  # resumes when this one closes
        stack.append([e, end, e.start])
    close(max((e.end for e in events), default=0) + 1)
    return out


# -- measuring -------------------------------------------------------------------------------------
def zoo_workloads() -> list[str]:
    """The zoo's workload names (``zoo_<name>``), in :data:`bench.zoo.MODELS`'s order.

    >>> zoo_workloads()[:2]
    ['zoo_mobilenet_v3_small', 'zoo_efficientnet_b0']
    """
    return [f"zoo_{name}" for name in zoo.MODELS]


def _zoo_name(workload: str) -> str:
    if workload not in zoo_workloads():
        raise ValueError(f"not a zoo workload: {workload!r}; choose from {zoo_workloads()} "
                         f"or 'zoo'")
    return workload[len("zoo_"):]


def workload_at(workload: str, size: str = "bench") -> Any:
    """The :class:`bench.workloads.Workload` ``workload`` (a zoo one) at ``size``: as
    registered at "bench", else the same workload on the zoo's tiny model and input.

    >>> w = workload_at("zoo_llama", "tiny")
    >>> w.input_shape, w.vocabulary, w.batch_size
    ((8,), 64, 32)
    """
    from bench.workloads import WORKLOADS

    name = _zoo_name(workload)
    base = WORKLOADS[workload]
    if size == "bench":
        return base
    spec = zoo.MODELS[name]
    return dataclasses.replace(base, build=functools.partial(zoo.build, name, size),
                               input_shape=spec.shape(size), vocabulary=spec.vocab(size))


def profile_step(fn: Any, iterator: Any, steps: int, warmup: int = 2) -> dict[str, Any]:
    """Call the compiled step ``fn`` on ``iterator``: once (it traces) and ``warmup`` times
    with TensorFlow's graph collection on (the executed graphs are kept), then ``steps`` times
    under the profiler. Returns ``nodes`` (:func:`graph_nodes`), ``events`` (:func:`read_op_events`)
    and ``wall_s`` (the profiled calls' wall-clock seconds).

    >>> profile_step(model.train_function, iter(data), steps=2)  # doctest: +SKIP
    """
    import tensorflow as tf
    from tensorflow.python.eager import context

    from tfmx.timing import sync

    ctx = context.context()
    ctx.enable_graph_collection()  # through the warm-up: a function instantiated late counts
    try:
        for _ in range(1 + warmup):
            sync(fn(iterator))
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_graph_collection()
    graphs = [g for f in metadata.function_graphs for g in f.partition_graphs]
    graphs += list(metadata.partition_graphs)
    with tempfile.TemporaryDirectory(prefix="tfmx-composite-") as logdir:
        tf.profiler.experimental.start(logdir)
        try:
            t0 = time.perf_counter()
            for _ in range(steps):
                sync(fn(iterator))
            wall = time.perf_counter() - t0
        finally:
            tf.profiler.experimental.stop()
        files = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))
        if not files:
            raise RuntimeError("the profiler wrote no XSpace file")
        events = read_op_events(files[-1])
    return {"nodes": graph_nodes(graphs), "events": events, "wall_s": wall}


def summarize(profile: Mapping[str, Any], patterns: Sequence[str], steps: int,
              top: int = 5) -> dict[str, Any]:
    """The shares of ``patterns`` in one :func:`profile_step` result: per step ``busy_ms``,
    ``op_ms`` (summed self time), ``wall_ms``; per pattern ``share`` (attributed time over
    busy time), ``summed_share``, ``ms`` (attributed, per step), ``ops`` (distinct nodes that
    ran), ``gradient_ops`` (of those, the gradient's: under ``gradient_tape/`` or at the root
    scope), ``root_ops`` (at the root scope: a custom gradient's) and ``top`` (its ``top``
    heaviest nodes).

    >>> prof = {"nodes": {}, "wall_s": 0.1, "events": [
    ...     OpEvent("m_tiny_1/b_layer_scale_1/mul", "Mul", 1, 0, 10**9),
    ...     OpEvent("adam/Sub", "Sub", 1, 10**9, 4 * 10**9)]}
    >>> s = summarize(prof, ["layer scale"], steps=2)
    >>> s["busy_ms"], s["patterns"]["layer scale"]["share"], s["patterns"]["layer scale"]["ops"]
    (2.0, 0.25, 1)
    """
    own, shared, busy = attributed_times(profile["events"])
    nodes = profile["nodes"]
    assigned = assign_patterns(nodes, patterns)
    op_types = {node_name(e.name): e.op for e in profile["events"]}
    total_own = sum(own.values())
    out: dict[str, Any] = {}
    for pattern in _order(patterns):
        names = [n for n in shared
                 if (assigned.get(n) if n in nodes else pattern_of(n, op_types[n], patterns))
                 == pattern]
        attributed = sum(shared[n] for n in names)
        heaviest = sorted(names, key=lambda n: -shared[n])[:top]
        out[pattern] = {
            "share": attributed / busy if busy else 0.0,
            "summed_share": sum(own[n] for n in names) / total_own if total_own else 0.0,
            "ms": attributed / steps / 1e9,
            "ops": len(names),
            "gradient_ops": sum(1 for n in names if "gradient_tape/" in n or _is_root(n)),
            "root_ops": sum(1 for n in names if _is_root(n)),
            "top": [{"node": n, "op": op_types[n], "ms": shared[n] / steps / 1e9}
                    for n in heaviest],
        }
    return {"steps": steps, "busy_ms": busy / steps / 1e9, "op_ms": total_own / steps / 1e9,
            "wall_ms": profile["wall_s"] * 1e3 / steps, "ops": len(shared), "patterns": out}


def measure(workload: str, steps: int = 10, size: str = "bench",
            modes: Sequence[str] = MODES, warmup: int = 3, seed: int = 0,
            tfmx_options: Mapping[str, Any] | None = None,
            batch_size: int | None = None) -> dict[str, Any]:
    """Profile ``workload``'s training step (a zoo workload at ``size``) in each of ``modes``
    and return the shares of its composite patterns (:func:`summarize` per mode), with the
    workload, the environment and how the shares are measured. ``tfmx_options`` go to
    ``tfmx.enable`` (``guard=False`` unless given). tfmx's switch is restored afterwards.

    >>> r = measure("zoo_mobilenet_v3_small", steps=2, size="tiny")  # doctest: +SKIP
    >>> sorted(r["modes"]["stock"]["patterns"])  # doctest: +SKIP
    ['depthwise convolution', 'hard-swish', 'squeeze-excite']
    """
    import tfmx
    from bench.workloads import build_model, random_dataset, tfmx_restored
    from recipes._machine import environment

    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {bad}; choose from {MODES}")
    name = _zoo_name(workload)
    spec = workload_at(workload, size)
    batch = batch_size or spec.batch_size
    patterns = list(zoo.MODELS[name].composite)
    results = {}
    weights = None
    with tfmx_restored():
        for mode in modes:
            if mode == "stock":
                tfmx.disable()
            else:
                tfmx.enable(**{"guard": False, **(tfmx_options or {})})
            model = build_model(spec, mode, seed, weights)
            weights = weights if weights is not None else model.get_weights()
            model.make_train_function()
            iterator = iter(random_dataset(spec, batch, seed))
            profile = profile_step(model.train_function, iterator, steps, warmup)
            results[mode] = summarize(profile, patterns, steps)
    return {
        "schema": SCHEMA,
        "model": workload,
        "zoo": name,
        "size": size,
        "batch_size": batch,
        "optimizer": "adam",
        "steps": steps,
        "warmup": warmup,
        "patterns": patterns,
        "matchers": {p: MATCHERS[p].what for p in _order(patterns)},
        "share_measure": SHARE_MEASURE,
        "tfmx_options": {"guard": False, **(tfmx_options or {})} if "tfmx" in modes else None,
        "env": environment(),
        "modes": results,
    }


# -- records ---------------------------------------------------------------------------------------
def record_name(record: Mapping[str, Any]) -> str:
    """The file name of ``record``: its workload, its size unless "bench", its oneDNN state.

    >>> record_name({"model": "zoo_llama", "size": "bench", "env": {"onednn": True}})
    'zoo_llama-onednn-on.json'
    >>> record_name({"model": "zoo_gpt2", "size": "tiny", "env": {"onednn": False}})
    'zoo_gpt2-tiny-onednn-off.json'
    """
    onednn = (record.get("env") or {}).get("onednn")
    state = "unknown" if onednn is None else ("on" if onednn else "off")
    size = "" if record.get("size", "bench") == "bench" else f"-{record['size']}"
    return f"{record['model']}{size}-onednn-{state}.json"


def reproduce_command(record: Mapping[str, Any]) -> str:
    """The command that measures ``record``'s workload alone, as it was measured.

    >>> reproduce_command({"model": "zoo_bert", "size": "bench", "steps": 10,
    ...                    "modes": {"stock": {}, "tfmx": {}}})
    'python -m bench.composite --model zoo_bert --steps 10 --record'
    >>> reproduce_command({"model": "zoo_bert", "size": "tiny", "steps": 2,
    ...                    "modes": {"stock": {}}})
    'python -m bench.composite --model zoo_bert --steps 2 --size tiny --modes stock --record'
    """
    words = ["python", "-m", "bench.composite", "--model", record["model"],
             "--steps", str(record["steps"])]
    if record.get("size", "bench") != "bench":
        words += ["--size", record["size"]]
    if tuple(record.get("modes", MODES)) != MODES:
        words += ["--modes", *record["modes"]]
    return shlex.join([*words, "--record"])


def write_composite(records: Iterable[Mapping[str, Any]], command: str,
                    directory: str | Path | None = None) -> list[Path]:
    """Write each record (a :func:`measure` result) as JSON into ``directory`` (default
    :data:`COMPOSITE_DIR`, created if missing), with ``command`` (what measured it) and
    ``reproduce`` (:func:`reproduce_command`); a record of the same workload, size and oneDNN
    state is replaced. The paths written."""
    folder = Path(directory) if directory is not None else COMPOSITE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for record in records:
        full = {**record, "command": command, "reproduce": reproduce_command(record)}
        path = folder / record_name(record)
        path.write_text(json.dumps(full, indent=1, default=str) + "\n")
        paths.append(path)
    return paths


def load_composite(directory: str | Path | None = None) -> list[dict[str, Any]]:
    """Every composite record in ``directory`` (default :data:`COMPOSITE_DIR`), in
    :data:`bench.zoo.MODELS`'s order; files of another layout or not JSON are left out; []
    if there is no folder.

    >>> load_composite("/no/such/folder")
    []
    """
    records = read_json_records(directory if directory is not None else COMPOSITE_DIR,
                                lambda r: r.get("schema") == SCHEMA and "modes" in r)
    rank = {w: i for i, w in enumerate(zoo_workloads())}
    return sorted(records, key=lambda r: (rank.get(r.get("model"), len(rank)),
                                          not (r.get("env") or {}).get("onednn")))


def _percent(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f}%"


def format_composite(records: Iterable[Mapping[str, Any]]) -> str:
    """A markdown section for BENCHMARKS.md: what tfmx leaves composite in each zoo model and
    its share of the training step, stock and with tfmx, from composite records
    (:func:`load_composite`); "" without records.

    >>> env = {"date": "2026-01-02 10:00", "tensorflow": "2.21.0", "keras": "3.15.1",
    ...        "python": "3.12.1", "platform": "Linux", "cpu": "CPU", "cpu_count": 2,
    ...        "gpus": 0, "onednn": True}
    >>> rec = {"model": "zoo_llama", "size": "bench", "steps": 10, "env": env,
    ...        "command": "python -m bench.composite --model zoo --record",
    ...        "patterns": ["RMSNorm"], "matchers": {"RMSNorm": "the norms"},
    ...        "modes": {"stock": {"busy_ms": 8.0, "patterns": {"RMSNorm": {"share": 0.125}}},
    ...                  "tfmx": {"busy_ms": 6.0, "patterns": {"RMSNorm": {"share": 0.2}}}}}
    >>> print(format_composite([rec]))  # doctest: +ELLIPSIS
    ## What tfmx leaves composite in the zoo models
    <BLANKLINE>
    ...
    | model | composite pattern | share of the step (stock) | (tfmx) |
    |---|---|---:|---:|
    | zoo_llama | RMSNorm | 12.5% | 20.0% |
    | zoo_llama | the step: ms with an op running | 8.00 | 6.00 |
    ...
    """
    from bench.environment import format_environment

    records = list(records)
    if not records:
        return ""
    states = {(r.get("env") or {}).get("onednn") for r in records}
    commands = sorted({r.get("command") or reproduce_command(r) for r in records})
    steps = sorted({int(r["steps"]) for r in records})
    tfmx_too = any("tfmx" in r.get("modes", {}) for r in records)
    how = "stock and with tfmx, its guard off: the rewritten step" if tfmx_too else "stock"
    lines = [
        "## What tfmx leaves composite in the zoo models",
        "",
        "Each zoo model's training step profiled by TensorFlow's own profiler "
        f"({'/'.join(str(s) for s in steps)} steps after warm-up, {how}), each op's time "
        "attributed to the pattern its node name and op type belong to (forward and gradient "
        "ops); "
        f"{SHARE_MEASURE}. Written by `{'`, `'.join(commands)}` (bench/composite.py).",
        "",
    ]
    envs = []
    for r in records:  # one line per machine (its date aside)
        line = format_environment({**r["env"], "date": str(r["env"].get("date", ""))[:10]})
        if line not in envs:
            envs.append(line)
    lines += envs + [""]
    lines += ["| model | composite pattern | share of the step (stock) | (tfmx) |",
              "|---|---|---:|---:|"]
    described: dict[str, str] = {}
    for r in records:
        label = r["model"] if r.get("size", "bench") == "bench" else f"{r['model']} ({r['size']})"
        if len(states) > 1:
            label += f", oneDNN {'on' if (r.get('env') or {}).get('onednn') else 'off'}"
        modes = r.get("modes", {})
        for pattern in r.get("patterns", []):
            shares = [_percent(((modes.get(m) or {}).get("patterns") or {})
                               .get(pattern, {}).get("share")) for m in MODES]
            lines.append(f"| {label} | {pattern} | {shares[0]} | {shares[1]} |")
            described.setdefault(pattern, (r.get("matchers") or {}).get(pattern, ""))
        totals = [f"{modes[m]['busy_ms']:.2f}" if m in modes else "" for m in MODES]
        lines.append(f"| {label} | the step: ms with an op running | {totals[0]} | {totals[1]} |")
    lines += ["", "What each pattern counts:", ""]
    lines += [f"- {p}: {what}" for p, what in described.items() if what]
    return "\n".join(lines) + "\n"


# -- command line ----------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.composite``: profile the zoo workloads, print the section, and with
    ``--record`` keep one record per workload.

    >>> main(["--model", "mlp"])
    Traceback (most recent call last):
    ...
    SystemExit: not a zoo workload: 'mlp'; choose from ['zoo_mobilenet_v3_small', \
'zoo_efficientnet_b0', 'zoo_convnext_tiny', 'zoo_densenet121', 'zoo_efficientnet_v2_b0', \
'zoo_resnet50_v2', 'zoo_xception', 'zoo_bert', 'zoo_gpt2', 'zoo_llama', 'zoo_mixtral', \
'zoo_qwen_moe', 'zoo_gemma', 'zoo_qwen3'] or 'zoo'
    """
    from bench.workloads import expand_models

    parser = argparse.ArgumentParser(prog="python -m bench.composite", description=(
        "Profile the zoo workloads' training steps and report the share of each pattern tfmx "
        "leaves composite."))
    parser.add_argument("--model", nargs="+", default=["zoo"],
                        help="zoo workloads (zoo_<name>) or 'zoo' for all (default)")
    parser.add_argument("--steps", type=int, default=10, help="profiled steps (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    parser.add_argument("--size", choices=zoo.SIZES, default="bench")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--record", nargs="?", const=str(COMPOSITE_DIR), default=None,
                        metavar="DIR", help=f"write the records (default {COMPOSITE_DIR})")
    args = parser.parse_args(argv)
    models = expand_models(args.model)
    for model in models:
        try:
            _zoo_name(model)
        except ValueError as err:
            raise SystemExit(str(err)) from None
    records = []
    for model in models:
        print(f"profiling {model} ({', '.join(args.modes)}) ...", file=sys.stderr, flush=True)
        records.append(measure(model, steps=args.steps, size=args.size, modes=args.modes,
                               warmup=args.warmup))
    print(format_composite(records))
    if args.record is not None:
        command = shlex.join(["python", "-m", "bench.composite",
                              *(sys.argv[1:] if argv is None else argv)])
        for path in write_composite(records, command, args.record):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
