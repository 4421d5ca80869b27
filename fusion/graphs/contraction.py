"""Contraction patterns: Conv2D / DepthwiseConv2dNative / MatMul + BiasAdd (+ Add) (+ activation).

One rule (:mod:`fusion.rule`), as TensorFlow's remapper: its match takes a contraction, the
``BiasAdd`` after it and as much of the residual ``Add`` and activation (an expression of
:mod:`fusion.expr` for GELU) as the target runs fused (a :class:`ContractionMatch`, with why the
rest was left), its check says why the chain stays apart, :func:`rewrite_contraction` writes one
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
    >>> from fusion.graphs.contraction import find_contractions
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
from collections.abc import Iterable, Mapping

import tensorflow as tf

from fusion.expr import Any, Match, Near, Op, Pattern, Skip, match
from fusion.family import Family, declare, register
from fusion.fragment import input_shapes
from fusion.graph import GraphView, NodeDef, output_shape, parse_input
from fusion.match import (
    AttrLike,
    blocker,
    dtype_name,
    fused_node,
    rewire_shape_readers,
    same_shape,
    sole_consumer,
)
from fusion.pattern import Chooser, RewriteContext, Target
from fusion.platform import Platform
from fusion.rule import Rule, RuleContext

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
        """What a backend's description prints of it: op -> dtype -> its chains, spelled.

        >>> ContractionKernels({"MatMul": {"float32": _chains(("BiasAdd", "Relu"))}}).describe()
        {'contractions': {'MatMul': {'float32': ['BiasAdd+Relu']}}}
        """
        return {"contractions": {
            op: {dt: sorted("+".join(c) for c in chains) for dt, chains in by_dtype.items()}
            for op, by_dtype in self.chains.items()}}


def supports(target: Target, op: str, dtype: str, fused_ops: tuple[str, ...]) -> bool:
    """True if ``target`` declares ``_Fused<op>`` with ``fused_ops`` in ``dtype``."""
    kernels = target.capability(ContractionKernels)
    return kernels is not None and kernels.runs(op, dtype, fused_ops)


# -- match ----------------------------------------------------------------------------------
# tf.nn.gelu(approximate=True): 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))).
_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_CUBIC = 0.044715
# How far a constant may sit from the formula's: what its dtype can hold (0.797884... is
# 0.796875 in bfloat16). Anything further is someone else's formula, left alone.
_CONST_RTOL = {"float32": 1e-6, "float64": 1e-12, "float16": 2**-10, "bfloat16": 2**-7}


def _const_rtol(x: NodeDef) -> float:
    return _CONST_RTOL.get(dtype_name(x), 0.0) if "T" in x.attr else 1e-6


def _constant(name: str, value: float, rtol: float = 0.0) -> Pattern:
    """A formula's scalar constant, as the graph holds it (a 16-bit graph casts it)."""
    return Skip("Cast", Near(name, value, rtol))


def gelu_exact(rtol: float = 1e-6) -> Pattern:
    """tf.nn.gelu(approximate=False) as TensorFlow writes it: ``0.5 * x * erfc(-x * 0.7071...)``
    (each constant within ``rtol`` of the formula's), matched from its last Mul."""
    scaled = Op("Mul", Op("Neg", Any("x")), _constant("rsqrt2", 0.7071067811865476, rtol))
    return Op("Mul", Op("Erfc", scaled), Op("Mul", Any("x"), _constant("half", 0.5, rtol)))


def gelu_approximate(rtol: float = 1e-6) -> Pattern:
    """tf.nn.gelu(approximate=True) as TensorFlow writes it:
    ``0.5 * x * (1 + tanh(0.7978845608 * (x + 0.044715 * pow(x, 3))))``.

    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.expr import explain
    >>> @tf.function
    ... def f(x):
    ...     return tf.nn.gelu(x, approximate=False)
    >>> g = f.get_concrete_function(tf.TensorSpec([2])).graph.as_graph_def()
    >>> view = GraphView(g.node)
    >>> explain(view, "Gelu/mul_2", gelu_exact()), explain(view, "Gelu/mul_2", gelu_approximate())
    (None, 'Gelu/Erfc is Erfc, not AddV2')
    """
    x = Any("x")
    cube = Op("Pow", x, _constant("three", 3.0))
    inner = Op("AddV2", Op("Mul", cube, _constant("cubic", _GELU_CUBIC, rtol)), x)
    tanh = Op("Tanh", Op("Mul", inner, _constant("sqrt_2_over_pi", _SQRT_2_OVER_PI, rtol)))
    return Op("Mul", Op("AddV2", tanh, _constant("one", 1.0)),
              Op("Mul", x, _constant("half", 0.5, rtol)))


def _match_gelu(view: GraphView, x: NodeDef, pattern: Pattern) -> tuple[NodeDef, ...] | None:
    """The nodes of ``pattern`` applied to ``x``, its output last, or None. The output is a
    Mul of a Mul of ``x`` (the ``0.5 * x`` half); extra consumers of the interior nodes (a
    gradient) do not stop the match: they keep it from being fused, and the caller says so."""
    for half in view.consumers(x.name):
        for out in (c for c in view.consumers(half.name) if c.op == "Mul"):
            found = match(view, out.name, pattern, Match(refs={"x": x.name}))
            if found is not None:
                inside = [view.node(n) for n in sorted(found.nodes - {out.name})]
                return (*inside, out)
    return None


def _activation_after(
    view: GraphView, tail: NodeDef
) -> tuple[str, tuple[NodeDef, ...]] | None:
    """The activation applied to ``tail`` (its fused_ops name and node(s)), if any."""
    consumers = view.consumers(tail.name)
    if len(consumers) == 1 and consumers[0].op in SIMPLE_ACTIVATIONS:
        return consumers[0].op, (consumers[0],)
    rtol = _const_rtol(tail)
    for name, pattern in (("GeluExact", gelu_exact(rtol)),
                          ("GeluApproximate", gelu_approximate(rtol))):
        gelu = _match_gelu(view, tail, pattern)
        if gelu is not None:
            return name, gelu
    # A simple activation beside other consumers (e.g. its gradient reading the input).
    acts = [c for c in consumers if c.op in SIMPLE_ACTIVATIONS]
    if len(acts) == 1:
        return acts[0].op, (acts[0],)
    return None


def _match(node: NodeDef, ctx: RuleContext) -> ContractionMatch | None:
    """``node``, the ``BiasAdd`` reading it, and what follows that the target runs fused
    (:func:`_extend`); None where no bias follows (a gradient's MatMul, say)."""
    bias = next((c for c in ctx.view.consumers(node.name) if c.op == "BiasAdd"), None)
    if bias is None or parse_input(bias.input[0])[0] != node.name:
        return None
    match = ContractionMatch(contraction=node, bias_add=bias)
    if supports(ctx.target, node.op, dtype_name(node), ("BiasAdd",)):
        _extend(ctx.view, match, ctx.target, node.op, dtype_name(node))
    return match


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


# -- check ----------------------------------------------------------------------------------
def _check(match: ContractionMatch, ctx: RuleContext) -> str | None:
    """Why the chain stays apart: no fused kernel on the target, a layout or attribute the
    fused op lacks, an intermediate read elsewhere, an overlap with a chain taken before, or
    (16-bit chains) the tuner measuring the ops apart faster. A residual Add a chain taken
    before fused (two chains meeting in one Add) is left to that chain: this one keeps its
    BiasAdd only.

    A chain in a 16-bit dtype is fused only where the tuner measures the fused kernel faster
    than the ops apart at the chain's shapes (16-bit fused kernels run unevenly across
    processors, some far slower than the ops apart); float32 chains, which Grappler fuses
    itself where it can, are not timed."""
    view, target, node, bias = ctx.view, ctx.target, match.contraction, match.bias_add
    op, dtype = node.op, dtype_name(node)
    if not supports(target, op, dtype, ("BiasAdd",)):
        return f"{op}: {target.name} runs no fused {op} in {dtype}"
    why = _contraction_blocker(view, node, bias, target)
    if why is None:
        why = blocker(view, node, {bias.name})
    if why is None and view.has_control_edges(bias):
        why = "BiasAdd has a control edge"
    if why is not None:
        return f"{op}+BiasAdd: {why}"
    if ctx.overlaps((node.name, bias.name)):
        return f"{op}+BiasAdd: overlaps another fused chain"
    if ctx.overlaps(n.name for n in match.nodes[2:]):
        # two chains meet in one Add (ResNetV2's convolution shortcut + its last 1x1
        # convolution): the chain taken before fused the Add, and reads this one's BiasAdd
        match.add = match.addend = match.activation = None
        match.activation_nodes = ()
        match.partial = "residual Add left apart: the other addend's chain fused it"
    if dtype == "float32":
        return None
    shapes = input_shapes(view, node)[:2]
    signature = f"{FUSED_OP[op]}({', '.join(match.fused_ops)}) {dtype} {' '.join(shapes)}"
    kept = ctx.tuned("contraction", signature, [n.name for n in match.nodes],
                     lambda v: rewrite_contraction(v, match), stock="unfused", fused="fused")
    return None if kept is None else f"{signature}: left unfused: {kept}"


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


# -- emit -----------------------------------------------------------------------------------
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
        rewire_shape_readers(view, node.name, tail.name)
    fed = {parse_input(ref)[0] for node in inner for ref in node.input}
    for node in inner:
        view.remove(node.name)
    view.replace(tail.name, fused)
    view.prune(fed)  # an activation's constants (GELU's 0.5, 3, ...) now feed nothing
    return fused


# -- declaration ----------------------------------------------------------------------------
RULE = Rule(
    anchors=frozenset(FUSED_OP), match=_match, check=_check,
    emit=lambda v, m: rewrite_contraction(v, m),
    kind=lambda m: f"{FUSED_OP[m.contraction.op]}({', '.join(m.fused_ops)})",
    partial=lambda m: m.partial, claims=lambda m: [n.name for n in m.nodes],
)


def find_contractions(
    view: GraphView, target: Target, tuner: Chooser | None = None,
) -> tuple[list[ContractionMatch], list[str]]:
    """Every fusable contraction chain in ``view``, and a reason for each declined one (a
    16-bit chain timed by ``tuner`` if given: see the rule's check)."""
    return RULE.find(view, target, tuner)


@register(
    "contraction",
    "Conv2D / DepthwiseConv2dNative / MatMul + BiasAdd (+ residual Add) (+ activation) "
    "-> _FusedConv2D / _FusedDepthwiseConv2dNative / _FusedMatMul",
    anchors=frozenset(FUSED_OP),
    after=("reshaped_bias",),
    order=("reshaped_bias makes the MatMul + BiasAdd chains it fuses"),
)
def contraction_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Find every contraction chain in ``view`` and fuse it for ``ctx.target``."""
    RULE.apply(view, ctx)


def _chains(*chains: Iterable[str]) -> frozenset[tuple[str, ...]]:
    return frozenset(tuple(c) for c in chains)


def _with_acts(prefix: tuple[str, ...], acts: Iterable[str]) -> list[tuple[str, ...]]:
    return [prefix] + [(*prefix, a) for a in acts]


_ACTS_BASIC = ("Relu", "Relu6", "Elu", "LeakyRelu")
# Read from tensorflow-metal-plugin 0.4.1's source: its convolutions (fused ones included) take
# data_format NHWC or NCHW and SAME/VALID padding, never EXPLICIT, as their unfused forms do
# (metal_kernel_util.mm, ReadSpatialParams).
_OPEN_FORMATS = frozenset({"NHWC", "NCHW"})


def contraction_kernels(platform: Platform) -> ContractionKernels:
    """The fused contractions ``platform`` runs (the family's ``capability``).

    >>> cuda = contraction_kernels(Platform("cuda"))
    >>> cuda.runs("MatMul", "float16", ("BiasAdd", "GeluExact")), cuda.runs_format("Conv2D", "NCHW")
    (True, True)
    >>> contraction_kernels(Platform("cpu", onednn=False)).runs(
    ...     "DepthwiseConv2dNative", "float32", ("BiasAdd",))
    False
    """
    if platform.name == "cpu":
        return _cpu(platform.onednn)
    if platform.name == "cuda":
        return _cuda()
    if platform.apple_metal:
        return _apple_metal()
    return _open_metal(platform)


def _cpu(onednn: bool) -> ContractionKernels:
    # Read off the kernels (TF 2.21, x86-64) by running every fused_ops list in every dtype
    # against the composite ops; tests/test_backends.py runs each entry again.
    conv = _chains(
        *_with_acts(("BiasAdd",), _ACTS_BASIC), *_with_acts(("FusedBatchNorm",), _ACTS_BASIC)
    )
    matmul = _chains(*_with_acts(("BiasAdd",), (*_ACTS_BASIC, "Tanh", "Sigmoid")))
    contractions = {
        "Conv2D": {"float32": conv},
        # 16-bit chains are tuner decisions (the rule's check): the bfloat16
        # _FusedMatMul can run many times slower than MatMul + BiasAdd + Relu.
        "MatMul": {"float32": matmul, "float16": matmul, "bfloat16": matmul},
    }
    if onednn:
        contractions["Conv2D"]["float32"] = conv | _chains(
            *_with_acts(("BiasAdd", "Add"), _ACTS_BASIC)
        )
        contractions["MatMul"]["float32"] = matmul | _chains(
            ("BiasAdd", "GeluExact"), ("BiasAdd", "GeluApproximate"), ("BiasAdd", "Add")
        )
        # _FusedDepthwiseConv2dNative has a CPU kernel only through oneDNN.
        contractions["DepthwiseConv2dNative"] = {
            "float32": _chains(*_with_acts(("BiasAdd",), ("Relu", "Relu6", "Elu")))
        }
    return ContractionKernels(contractions, {"Conv2D": frozenset({"NHWC"}),
                                             "DepthwiseConv2dNative": frozenset({"NHWC"})})


def _cuda() -> ContractionKernels:
    # tensorflow/core/kernels/conv_ops_fused_impl.h, matmul_op_fused.cc: no
    # _FusedDepthwiseConv2dNative GPU kernel; Tanh/Sigmoid/GELU after MatMul are cuBLASLt
    # epilogues in 16-bit only.
    conv = _chains(*_with_acts(("BiasAdd",), _ACTS_BASIC))
    matmul32 = _chains(*_with_acts(("BiasAdd",), ("Relu",)))
    matmul16 = _chains(*_with_acts(("BiasAdd",), ("Relu", "Tanh", "Sigmoid",
                                                  "GeluApproximate", "GeluExact")))
    return ContractionKernels({
        "Conv2D": {"float32": conv, "float16": conv},
        "MatMul": {"float32": matmul32, "float16": matmul16, "bfloat16": matmul16},
    }, {"Conv2D": frozenset({"NHWC", "NCHW"})})


def _apple_metal() -> ContractionKernels:
    # The conv fused computations Apple's tensorflow-metal 1.2.0 names in its error text
    # (biasAdd, biasAddWith{Relu,Relu6,Elu,LeakyRelu}; no residual Add, no
    # _FusedDepthwiseConv2dNative kernel), assumed the same for _FusedMatMul.
    chains = _chains(*_with_acts(("BiasAdd",), _ACTS_BASIC))
    by_dtype = {dt: chains for dt in ("float32", "float16", "bfloat16")}
    return ContractionKernels({"Conv2D": by_dtype, "MatMul": dict(by_dtype)},
                              {"Conv2D": frozenset({"NHWC", "NCHW"})})


def _open_metal(platform: Platform) -> ContractionKernels:
    # From the plugin's table: the fused_ops lists of each _Fused<op> it registers, in the
    # dtypes both the op and its fused form take.
    assert platform.table is not None
    contractions = {}
    for op in ("Conv2D", "MatMul", "DepthwiseConv2dNative"):
        chains = platform.table.fused_ops.get(f"_Fused{op}", frozenset())
        dtypes = platform.dtypes(op, f"_Fused{op}")
        if chains and dtypes:
            contractions[op] = {dt: chains for dt in sorted(dtypes)}
    return ContractionKernels(
        contractions, {op: _OPEN_FORMATS for op in contractions if op != "MatMul"})


declare(Family("contraction", "", capability=contraction_kernels))
