"""Contraction patterns: Conv2D / DepthwiseConv2dNative / MatMul + BiasAdd (+ Add) (+ activation).

One shape, as in TensorFlow's remapper: :class:`ContractionMatch` records what was matched,
:func:`find_contractions` fills records, :func:`rewrite_contraction` writes one
``_FusedConv2D`` / ``_FusedDepthwiseConv2dNative`` / ``_FusedMatMul`` node that takes the name of
the chain's last node, so its consumers need no rewiring.

Rules (the same as Grappler's, plus one relaxation):
- an intermediate is swallowed only if every data consumer is the next node of the chain; a
  consumer that reads only its shape (Shape, ShapeN, Size, Rank) is rewired to the fused output,
  which has the same shape;
- no node of the chain may carry a control edge, or be a fetched output of the function;
- the target backend must run the fused op with that ``fused_ops`` list and dtype. Where it runs
  only a prefix (``BiasAdd`` but not ``BiasAdd, Add``), the longest prefix it runs is fused and the
  report says why the rest was left.

In a training graph, ReluGrad / EluGrad / TanhGrad / SigmoidGrad read the activation's output, so
the chain fuses whole; Relu6Grad, LeakyReluGrad and GELU's gradient read the pre-activation, so
there the activation stays apart (recorded) and Conv/MatMul+BiasAdd still fuse. Inference graphs
fuse whole chains, composite GELU (exact and tanh-approximate) included.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.patterns.contraction import find_contractions
    >>> from tfmx.backends import get_backend
    >>> @tf.function
    ... def f(x, w, b):
    ...     return tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w), b))
    >>> g = f.get_concrete_function(tf.TensorSpec([2, 3]), tf.TensorSpec([3, 4]),
    ...                             tf.TensorSpec([4])).graph.as_graph_def()
    >>> matches, declined = find_contractions(GraphView(g.node), get_backend("cpu"))
    >>> matches[0].fused_ops
    ('BiasAdd', 'Relu')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import tensorflow as tf

from fusion.fragment import choose_rewrite, input_shapes
from fusion.graph import SHAPE_ONLY_OPS, GraphView, NodeDef, output_shape, parse_input
from fusion.match import (
    AttrLike,
    blocker,
    consumer,
    dtype_name,
    fused_node,
    joining_consumer,
    same_shape,
    scalar_value,
    scaled_consumer,
    sole_consumer,
)
from fusion.pattern import Chooser, RewriteContext, Target, apply_matches, register

FUSED_OP = {
    "Conv2D": "_FusedConv2D",
    "DepthwiseConv2dNative": "_FusedDepthwiseConv2dNative",
    "MatMul": "_FusedMatMul",
}
SIMPLE_ACTIVATIONS = ("Relu", "Relu6", "Elu", "LeakyRelu", "Tanh", "Sigmoid")
ADD_OPS = ("AddV2", "Add")


@dataclasses.dataclass
class ContractionMatch:
    """A contraction chain: contraction -> BiasAdd [-> Add] [-> activation]."""

    contraction: NodeDef
    bias_add: NodeDef
    add: NodeDef | None = None
    addend: str | None = None
    activation: str | None = None  # fused_ops name of the activation, e.g. "Relu", "GeluExact"
    activation_nodes: tuple[NodeDef, ...] = ()  # its node(s); the last is the chain's tail
    partial: str | None = None  # why part of the chain was left unfused

    @property
    def fused_ops(self) -> tuple[str, ...]:
        ops = ["BiasAdd"]
        if self.add is not None:
            ops.append("Add")
        if self.activation:
            ops.append(self.activation)
        return tuple(ops)

    @property
    def nodes(self) -> list[NodeDef]:
        chain = [self.contraction, self.bias_add]
        if self.add is not None:
            chain.append(self.add)
        return chain + list(self.activation_nodes)

    @property
    def tail(self) -> NodeDef:
        return self.nodes[-1]


# tf.nn.gelu(approximate=True): 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))).
_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_CUBIC = 0.044715
# How far a constant may sit from the formula's: what its dtype can hold (0.797884... is
# 0.796875 in bfloat16). Anything further is someone else's formula, left alone.
_CONST_RTOL = {"float32": 1e-6, "float64": 1e-12, "float16": 2**-10, "bfloat16": 2**-7}


def _const_rtol(x: NodeDef) -> float:
    return _CONST_RTOL.get(dtype_name(x), 0.0) if "T" in x.attr else 1e-6


def _match_gelu_exact(view: GraphView, x: NodeDef) -> tuple[NodeDef, ...] | None:
    """tf.nn.gelu(approximate=False): 0.5 * x * erfc(-x * 0.70710678), found by structure.

    Extra consumers of the interior nodes (a gradient) do not stop the match; they are what
    keeps it from being fused, and the caller says so.
    """
    rtol = _const_rtol(x)
    neg, half = consumer(view, x, "Neg"), scaled_consumer(view, x, "Mul", 0.5, rtol)
    scale = None if neg is None else scaled_consumer(view, neg, "Mul", 0.7071067811865476, rtol)
    erfc = None if scale is None else consumer(view, scale, "Erfc")
    out = None if erfc is None or half is None else joining_consumer(view, erfc, half, "Mul")
    if out is None:
        return None
    return (neg, scale, erfc, half, out)


def _match_gelu_approximate(view: GraphView, x: NodeDef) -> tuple[NodeDef, ...] | None:
    """tf.nn.gelu(approximate=True) as TensorFlow writes it out, found by structure.

    ``0.5 * x * (1 + tanh(0.7978845608 * (x + 0.044715 * pow(x, 3))))``: Mul, Pow, Mul, AddV2,
    Mul, Tanh, AddV2, Mul, with each constant the formula's within what its dtype holds (a
    16-bit graph casts 0.044715 from float32). As for the exact form, extra consumers of the
    interior nodes do not stop the match; the caller says why they keep it apart.
    """
    rtol = _const_rtol(x)
    half = scaled_consumer(view, x, "Mul", 0.5, rtol)
    cube = next((c for c in view.consumers(x.name) if c.op == "Pow"
                 and scalar_value(view, c.input[1]) == 3.0
                 and parse_input(c.input[0])[0] == x.name), None)
    if half is None or cube is None:
        return None
    scaled_cube = scaled_consumer(view, cube, "Mul", _GELU_CUBIC, rtol)
    inner = None if scaled_cube is None else joining_consumer(view, scaled_cube, x, "AddV2")
    scaled = None if inner is None else scaled_consumer(view, inner, "Mul", _SQRT_2_OVER_PI, rtol)
    tanh = None if scaled is None else consumer(view, scaled, "Tanh")
    one_plus = None if tanh is None else scaled_consumer(view, tanh, "AddV2", 1.0, 0.0)
    out = None if one_plus is None else joining_consumer(view, one_plus, half, "Mul")
    if out is None:
        return None
    return (half, cube, scaled_cube, inner, scaled, tanh, one_plus, out)


def _activation_after(
    view: GraphView, tail: NodeDef
) -> tuple[str, tuple[NodeDef, ...]] | None:
    """The activation applied to ``tail`` (its fused_ops name and node(s)), if any."""
    consumers = view.consumers(tail.name)
    if len(consumers) == 1 and consumers[0].op in SIMPLE_ACTIVATIONS:
        return consumers[0].op, (consumers[0],)
    gelu = _match_gelu_exact(view, tail)
    if gelu is not None:
        return "GeluExact", gelu
    gelu = _match_gelu_approximate(view, tail)
    if gelu is not None:
        return "GeluApproximate", gelu
    # A simple activation beside other consumers (e.g. its gradient reading the input).
    acts = [c for c in consumers if c.op in SIMPLE_ACTIVATIONS]
    if len(acts) == 1:
        return acts[0].op, (acts[0],)
    return None


Chains = frozenset[tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class ContractionKernels:
    """What a backend declares for this family: the ``fused_ops`` lists it runs per op and
    dtype, and the data formats of its fused convolutions.

    >>> k = ContractionKernels({"MatMul": {"float32": frozenset({("BiasAdd",)})}})
    >>> k.runs("MatMul", "float32", ("BiasAdd",)), k.runs("MatMul", "float32", ("BiasAdd", "Relu"))
    (True, False)
    """

    chains: Mapping[str, Mapping[str, Chains]]  # op -> dtype -> fused_ops lists
    data_formats: Mapping[str, frozenset[str]] = dataclasses.field(default_factory=dict)

    def runs(self, op: str, dtype: str, fused_ops: tuple[str, ...]) -> bool:
        """True if ``_Fused<op>`` with ``fused_ops`` runs in ``dtype``."""
        return tuple(fused_ops) in self.chains.get(op, {}).get(dtype, frozenset())

    def runs_format(self, op: str, data_format: str) -> bool:
        """True if the fused form of ``op`` runs in ``data_format`` (NHWC, NCHW)."""
        return data_format in self.data_formats.get(op, frozenset())

    def describe(self) -> dict:
        return {op: {dt: sorted("+".join(c) for c in chains) for dt, chains in by_dtype.items()}
                for op, by_dtype in self.chains.items()}


def supports(target: Target, op: str, dtype: str, fused_ops: tuple[str, ...]) -> bool:
    """True if ``target`` declares ``_Fused<op>`` with ``fused_ops`` in ``dtype``."""
    kernels = target.capability(ContractionKernels)
    return kernels is not None and kernels.runs(op, dtype, fused_ops)





def find_contractions(
    view: GraphView, target: Target, tuner: Chooser | None = None,
) -> tuple[list[ContractionMatch], list[str]]:
    """Every fusable contraction chain in ``view``, and a reason for each declined one.

    A chain in a 16-bit dtype is fused only where ``tuner`` measures the fused kernel faster
    than the ops apart at the chain's shapes (16-bit fused kernels run unevenly across
    processors: TensorFlow's bfloat16 ``_FusedMatMul`` ran 25x slower than MatMul + BiasAdd on
    one CPU); float32 chains, which Grappler fuses itself where it can, are not timed."""
    matches: list[ContractionMatch] = []
    declined: list[str] = []
    claimed: set[str] = set()
    for node in view.nodes():
        if node.op not in FUSED_OP:
            continue
        consumers = view.consumers(node.name)
        bias = next((c for c in consumers if c.op == "BiasAdd"), None)
        if bias is None or parse_input(bias.input[0])[0] != node.name:
            continue  # not a candidate: no bias follows (e.g. a gradient matmul)
        op, dtype = node.op, dtype_name(node)
        if not supports(target, op, dtype, ("BiasAdd",)):
            declined.append(f"{op}: {target.name} runs no fused {op} in {dtype}")
            continue
        why = _contraction_blocker(view, node, bias, target)
        if why is None:
            why = blocker(view, node, {bias.name})
        if why is None and view.has_control_edges(bias):
            why = "BiasAdd has a control edge"
        if why is not None:
            declined.append(f"{op}+BiasAdd: {why}")
            continue
        if node.name in claimed or bias.name in claimed:
            declined.append(f"{op}+BiasAdd: overlaps another fused chain")
            continue
        match = ContractionMatch(contraction=node, bias_add=bias)
        _extend(view, match, target, op, dtype)
        if tuner is not None and dtype != "float32":
            why = _tuned_blocker(view, match, dtype, tuner)
            if why is not None:
                declined.append(why)
                continue
        claimed.update(n.name for n in match.nodes)
        matches.append(match)
    return matches, declined


def _tuned_blocker(view: GraphView, match: ContractionMatch, dtype: str,
                   tuner: Chooser) -> str | None:
    """Why ``match`` stays apart (the ops measured faster unfused here), or None."""
    c = match.contraction
    shapes = input_shapes(view, c)[:2]
    kind = f"{FUSED_OP[c.op]}({', '.join(match.fused_ops)})"
    signature = f"{kind} {dtype} {' '.join(shapes)}"
    choice = choose_rewrite(tuner, "contraction", signature, view,
                            [n.name for n in match.nodes],
                            lambda v: rewrite_contraction(v, match),
                            stock="unfused", fused="fused")
    if choice.choice == "unfused":
        return f"{signature}: left unfused: {choice.why()}"
    return None


def _contraction_blocker(
    view: GraphView, node: NodeDef, bias: NodeDef, target: Target
) -> str | None:
    if node.op == "MatMul" and node.attr["transpose_a"].b:
        return "MatMul with transpose_a is not fused"
    if node.op != "MatMul":
        fmt = node.attr["data_format"].s.decode() if "data_format" in node.attr else "NHWC"
        bias_fmt = bias.attr["data_format"].s.decode() if "data_format" in bias.attr else "NHWC"
        if fmt != bias_fmt:
            return f"data_format {fmt} with BiasAdd in {bias_fmt}"
        kernels = target.capability(ContractionKernels)
        if kernels is None or not kernels.runs_format(node.op, fmt):
            return f"{target.name} runs fused {node.op} in NHWC only, not {fmt}"
        if node.op == "DepthwiseConv2dNative" and node.attr["padding"].s == b"EXPLICIT":
            return "explicit padding is not an attribute of _FusedDepthwiseConv2dNative"
    if parse_input(bias.input[0])[0] != node.name:
        return "BiasAdd reads the contraction as its bias"
    return None


def _extend(
    view: GraphView, match: ContractionMatch, target: Target, op: str, dtype: str
) -> None:
    """Grow ``match`` past BiasAdd with a residual Add and an activation where allowed."""
    inside = {n.name for n in match.nodes}
    tail = match.bias_add
    nxt = sole_consumer(view, tail)
    if nxt is not None and nxt.op in ADD_OPS:
        inputs = view.data_inputs(nxt)
        others = [i for i in inputs if parse_input(i)[0] != tail.name]
        if len(inputs) == 2 and len(others) == 1:
            addend = others[0]
            producer = view.node(addend)
            shape_ok = producer is not None and same_shape(
                output_shape(producer, parse_input(addend)[1]), output_shape(tail)
            )
            why = blocker(view, tail, inside | {nxt.name})
            if not shape_ok:
                match.partial = "residual Add left apart: addend shape differs or is unknown"
            elif why is not None:
                match.partial = f"residual Add left apart: {why}"
            elif view.has_control_edges(nxt):
                match.partial = "residual Add left apart: Add has a control edge"
            elif not supports(target, op, dtype, ("BiasAdd", "Add")):
                match.partial = f"residual Add left apart: {target.name} runs no fused {op}+Add"
            else:
                match.add, match.addend = nxt, addend
                inside.add(nxt.name)
                tail = nxt
    found = _activation_after(view, tail)
    if found is None:
        return
    act, act_nodes = found
    candidate = (*match.fused_ops, act)
    if not supports(target, op, dtype, candidate):
        match.partial = match.partial or (
            f"{act} left apart: {target.name} runs no fused {op} with {', '.join(candidate)}"
        )
        return
    why = blocker(view, tail, inside | {n.name for n in act_nodes})
    if why is None:
        for interior in act_nodes[:-1]:
            why = blocker(view, interior, inside | {n.name for n in act_nodes})
            if why:
                break
    if why is not None:
        match.partial = match.partial or f"{act} left apart: {why}"
        return
    if view.has_control_edges(act_nodes[-1]):
        match.partial = match.partial or f"{act} left apart: it has a control edge"
        return
    match.activation, match.activation_nodes = act, act_nodes


def rewrite_contraction(view: GraphView, match: ContractionMatch) -> NodeDef:
    """Replace the chain in ``match`` with one fused node named like the chain's tail."""
    c, tail = match.contraction, match.tail
    args = [match.bias_add.input[1]] + ([match.addend] if match.addend else [])
    attrs: dict[str, AttrLike] = {
        "num_args": len(args),
        "fused_ops": match.fused_ops,
        "TArgs": [tf.dtypes.as_dtype(c.attr["T"].type)] * len(args),  # _FusedConv2D only
        "num_host_args": 0,  # _FusedConv2D only
    }
    if match.activation == "LeakyRelu":
        attrs["leakyrelu_alpha"] = match.activation_nodes[-1].attr["alpha"].f
    fused = fused_node(c, FUSED_OP[c.op], tail, [c.input[0], c.input[1], *args], attrs,
                       device=c.device or tail.device)

    inner = [n for n in match.nodes if n is not tail]
    for node in inner:  # shape-only readers of an intermediate read the fused output instead
        for reader, index, _, control in view.consumer_edges(node.name):
            if not control and reader.op in SHAPE_ONLY_OPS:
                view.replace_input(reader, index, tail.name)
    fed = {parse_input(ref)[0] for node in inner for ref in node.input}
    for node in inner:
        view.remove(node.name)
    view.replace(tail.name, fused)
    view.prune(fed)  # an activation's constants (GELU's 0.5, 3, ...) now feed nothing
    return fused


@register(
    "contraction",
    "Conv2D / DepthwiseConv2dNative / MatMul + BiasAdd (+ residual Add) (+ activation) "
    "-> _FusedConv2D / _FusedDepthwiseConv2dNative / _FusedMatMul",
)
def contraction_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Find every contraction chain in ``view`` and fuse it for ``ctx.target``."""
    apply_matches(
        view, ctx, find_contractions(view, ctx.target, ctx.tuner),
        lambda v, m: rewrite_contraction(v, m),
        lambda m: f"{FUSED_OP[m.contraction.op]}({', '.join(m.fused_ops)})",
        lambda m: m.partial,
    )
