"""oneDNN kernels without oneDNN's graph pass: convolutions, MatMuls, batch norm, softmax...

TensorFlow's Linux x86-64 wheel carries oneDNN's kernels (``_MklNativeConv2D`` and its two
gradients among them), registered under the kernel label ``MklNameChangeOp``. A node runs one
only if it asks for that label in its ``_kernel`` attr, which TensorFlow's own oneDNN graph pass
sets when oneDNN is on (``TF_ENABLE_ONEDNN_OPTS=1``; the 2.21 wheel leaves it off on CPUs
without AVX-512, AMD's included). This family does that one step for the convolutions of a
training graph, where the Eigen kernels are slow (the forward, and above all
``Conv2DBackpropFilter`` / ``Conv2DBackpropInput``), for ``MatMul`` (forward, gradients, the
recurrent MatMul of an LSTM loop), for the forward ``_FusedConv2D`` and ``_FusedMatMul``
(Conv2D / MatMul + BiasAdd [+ activation], as the contraction family leaves them) where they
are large enough to pay, for ``BatchMatMulV2`` (attention's scores and context, forward and
gradients), ``Softmax`` and ``Transpose``, for depthwise convolutions and average pooling
(forward and gradients), for 3-D convolutions (``Conv3D`` and its two gradients) and average
pooling, for ``Einsum``, for ``MaxPool`` with its gradients (together: oneDNN's gradient reads
the positions of the maxima from the forward's workspace, an extra output wired to it), and for
``FusedBatchNormV3`` with its gradient (as a pair only: the gradient reads the forward's
reserve spaces, whose layout is the kernel's own), and
nothing else: same inputs, same outputs, same node names, no layout change (the "Native" ops
take TensorFlow's NHWC tensors).

Whether oneDNN or Eigen is faster depends on the processor and the shapes: on one measured CPU
oneDNN ran most MatMuls faster than Eigen but large ones (every dimension >= 128) slower, and
the forward ``_FusedConv2D`` faster from 8,192 output pixels but slower below 2,048
(BENCHMARKS.md). Such figures are facts about one machine, so every node but the batch-norm pair
is a tuner decision (``tfmx.tuner``): the node alone, at its own shapes (an unknown batch counts
as 32), timed on Eigen and on oneDNN here, and the faster kept; the report lists each decision
with both times. The nodes are decided largest first (:func:`largest_first`: the elements their
inputs hold), so that a tuner whose budget runs out has spent it on the choices that weigh most
(a large convolution's gradients, which Eigen runs several times slower than oneDNN on some
processors), leaving the small ones to Eigen. The batch-norm pair is retargeted as a pair,
untimed; the whole-step guard (``tfmx.guard``) judges it with the step.

Where oneDNN is on, TensorFlow's pass already does this and the backend lists nothing to
retarget; where the kernels are not registered (other platforms), likewise. Results differ
from Eigen's by float32 summation order only (a few 1e-6, relative; the tests check).

One rule (:mod:`fusion.rule`), as every family: its match takes a node the target has a oneDNN
kernel for (a :class:`OneDnnMatch`, a ``MaxPool`` with its gradients), its check says why it
stays on Eigen (the tuner's answer among the reasons), a last look keeps a batch norm only with
its partner, :func:`rewrite_onednn` retargets. A target with nothing to retarget leaves the
graph unread.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.graphs.onednn import find_onednn
    >>> @tf.function
    ... def f(x, w):
    ...     return tf.nn.conv2d(x, w, 1, "SAME")
    >>> g = f.get_concrete_function(tf.TensorSpec([1, 4, 4, 2]),
    ...                             tf.TensorSpec([3, 3, 2, 2])).graph.as_graph_def()
    >>> from fusion.pattern import PlainTarget
    >>> cpu = PlainTarget("cpu", (OneDnnKernels(),))  # oneDNN's kernels there, its pass off
    >>> [m.op for m in find_onednn(GraphView(g.node), cpu)[0]]
    ['_MklNativeConv2D']
"""

from __future__ import annotations

import dataclasses
import functools
import math
import platform
from collections.abc import Mapping

from fusion.family import Family, declare, register
from fusion.fragment import UNKNOWN_DIM, input_shapes, tensor_shape
from fusion.graph import GraphView, NodeDef, parse_input
from fusion.match import const_value, dtype_name
from fusion.pattern import Chooser, RewriteContext, Target
from fusion.platform import Platform
from fusion.rule import Rule, RuleContext

KERNEL_LABEL = "MklNameChangeOp"
"""The kernel label TensorFlow registers oneDNN's renamed ("Native") kernels under."""

RETARGETS = {
    "Conv2D": "_MklNativeConv2D",
    "Conv2DBackpropInput": "_MklNativeConv2DBackpropInput",
    "Conv2DBackpropFilter": "_MklNativeConv2DBackpropFilter",
    "MatMul": "_MklMatMul",
    "FusedBatchNormV3": "_MklNativeFusedBatchNormV3",
    "FusedBatchNormGradV3": "_MklNativeFusedBatchNormGradV3",
    "_FusedConv2D": "_MklNativeFusedConv2D",
    "BatchMatMulV2": "_MklBatchMatMulV2",
    "_FusedMatMul": "_MklNativeFusedMatMul",
    "Softmax": "_MklSoftmax",
    "Transpose": "_MklTranspose",
    "AvgPool": "_MklNativeAvgPool",
    "AvgPoolGrad": "_MklNativeAvgPoolGrad",
    "DepthwiseConv2dNative": "_MklNativeDepthwiseConv2dNative",
    "DepthwiseConv2dNativeBackpropInput": "_MklNativeDepthwiseConv2dNativeBackpropInput",
    "DepthwiseConv2dNativeBackpropFilter": "_MklNativeDepthwiseConv2dNativeBackpropFilter",
    "MaxPool": "_MklNativeMaxPool",
    "MaxPoolGrad": "_MklNativeMaxPoolGrad",
    "Conv3D": "_MklNativeConv3D",
    "Conv3DBackpropInputV2": "_MklNativeConv3DBackpropInputV2",
    "Conv3DBackpropFilterV2": "_MklNativeConv3DBackpropFilterV2",
    "AvgPool3D": "_MklNativeAvgPool3D",
    "AvgPool3DGrad": "_MklNativeAvgPool3DGrad",
    "Einsum": "_MklEinsum",
}
"""TensorFlow op -> the oneDNN op computing the same, with the same inputs and attrs (but
``MaxPoolGrad``, which reads its forward's workspace too: :func:`rewrite_onednn`)."""

CORE = ("Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "MatMul")
"""The ops whose oneDNN kernels must be registered for the family to act at all."""


@dataclasses.dataclass(frozen=True)
class OneDnnKernels:
    """What a backend declares for this family: it has oneDNN's renamed CPU kernels (registered
    under :data:`KERNEL_LABEL`) while TensorFlow's own oneDNN pass is off, so the ops of
    ``ops`` (TensorFlow op -> oneDNN op, default: the entries of :data:`RETARGETS` this build
    registers, :func:`registered_retargets`) may be retargeted."""

    ops: Mapping[str, str] = dataclasses.field(default_factory=lambda: registered_retargets())


@functools.cache
def _registered(op: str) -> bool:
    """True if ``op`` has a CPU kernel registered under :data:`KERNEL_LABEL` in this build."""
    from tensorflow.python.framework import kernels

    try:
        found = kernels.get_registered_kernels_for_op(op).kernel
    except Exception:  # noqa: BLE001 - an op this build does not know
        return False
    return any(k.device_type == "CPU" and k.label == KERNEL_LABEL for k in found)


@functools.cache
def kernels_registered() -> bool:
    """True if this TensorFlow has oneDNN's renamed CPU kernels (the Linux x86-64 wheels do),
    whether or not oneDNN's graph pass is on: at least those of :data:`CORE`. Only x86-64
    counts: that is where they were measured (aarch64 builds route oneDNN through ACL, not
    measured).

    >>> isinstance(kernels_registered(), bool)
    True
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return all(_registered(RETARGETS[op]) for op in CORE)


def registered_retargets() -> dict[str, str]:
    """The entries of :data:`RETARGETS` whose oneDNN kernel this build registers (none where
    :func:`kernels_registered` is False).

    >>> set(registered_retargets()) <= set(RETARGETS)
    True
    """
    if not kernels_registered():
        return {}
    return {op: new for op, new in RETARGETS.items() if _registered(new)}


FUSED_CONV_ONEDNN_CHAINS = frozenset({
    ("BiasAdd",), ("BiasAdd", "Relu"), ("BiasAdd", "Relu6"), ("BiasAdd", "Elu"),
    ("BiasAdd", "LeakyRelu"),
})
"""The ``fused_ops`` of ``_FusedConv2D`` retargeted (the ones measured against Eigen)."""

FUSED_MATMUL_ONEDNN_CHAINS = frozenset({
    ("BiasAdd",), ("BiasAdd", "Relu"), ("BiasAdd", "Relu6"), ("BiasAdd", "Elu"),
    ("BiasAdd", "LeakyRelu"), ("BiasAdd", "Tanh"), ("BiasAdd", "Sigmoid"),
})
"""The ``fused_ops`` of ``_FusedMatMul`` retargeted: every chain the Eigen kernel runs (the
contraction family emits no other with oneDNN's pass off); tests/test_onednn.py runs each on
both kernels."""


@dataclasses.dataclass
class OneDnnMatch:
    """A node to run on its oneDNN kernel (a ``MaxPool`` with the ``MaxPoolGrad`` nodes that
    read it: ``gradients``, retargeted with it)."""

    node: NodeDef
    op: str  # the oneDNN op
    gradients: tuple[NodeDef, ...] = ()

    @property
    def with_gradients(self) -> str:
        """What its decision and report label add for a forward moved with its gradients."""
        return " with its gradient" if self.gradients else ""


def _fused_chain_blocker(node: NodeDef) -> str | None:
    chain = tuple(op.decode() for op in node.attr["fused_ops"].list.s)
    chains = FUSED_CONV_ONEDNN_CHAINS if node.op == "_FusedConv2D" else FUSED_MATMUL_ONEDNN_CHAINS
    if chain not in chains:
        return f"{node.op}({', '.join(chain)}): only BiasAdd chains go to oneDNN"
    return None


def signature(view: GraphView, node: NodeDef) -> str:
    """What the oneDNN-or-Eigen decision for ``node`` depends on: op, input shapes, attrs.

    >>> from fusion.graph import GraphView
    >>> node = NodeDef(name="m", op="MatMul", input=["a", "b"])
    >>> node.attr["transpose_b"].b = True
    >>> signature(GraphView([NodeDef(name="a", op="Placeholder"),
    ...                      NodeDef(name="b", op="Placeholder"), node]), node)
    'MatMul ? ? transpose_b=True'
    """
    shapes = input_shapes(view, node)
    attrs = [f"{k}={node.attr[k].b}" for k in ("transpose_a", "transpose_b", "adj_x", "adj_y")
             if k in node.attr]
    if node.op == "Transpose":
        perm = const_value(view, node.input[1])  # a gradient's: an InvertPermutation, folded
        attrs.append("perm=" + ("?" if perm is None else ",".join(str(int(i)) for i in perm)))
    if "ksize" in node.attr:
        attrs.append("ksize=" + ",".join(str(i) for i in node.attr["ksize"].list.i))
    if "strides" in node.attr:
        attrs.append("strides=" + ",".join(str(i) for i in node.attr["strides"].list.i))
    if "padding" in node.attr:
        attrs.append("padding=" + node.attr["padding"].s.decode())
    if "fused_ops" in node.attr:
        attrs.append("+".join(op.decode() for op in node.attr["fused_ops"].list.s))
    if "equation" in node.attr:
        attrs.append(node.attr["equation"].s.decode())
    return " ".join([node.op, *shapes, *attrs])


def _why_not(node: NodeDef, view: GraphView) -> str | None:
    dtype = dtype_name(node)
    if dtype != "float32":
        return f"{node.op} in {dtype}: only float32 goes to oneDNN (measured there)"
    data_format = node.attr["data_format"].s.decode() if "data_format" in node.attr else "NHWC"
    if data_format not in ("NHWC", "NDHWC"):
        return f"{node.op} in {data_format}: only NHWC goes to oneDNN (NDHWC in 3-D)"
    if "padding" in node.attr and node.attr["padding"].s == b"EXPLICIT":
        return f"{node.op} with explicit padding: left on Eigen"
    if node.device and "CPU" not in node.device.upper():
        return f"{node.op} placed on {node.device}"
    if node.op in ("_FusedConv2D", "_FusedMatMul"):
        return _fused_chain_blocker(node)
    if node.op == "Einsum" and len(view.data_inputs(node)) != 2:
        return f"Einsum of {len(view.data_inputs(node))} operands: only two go to oneDNN"
    return None


# Measured as a pair (the gradient reads the forward's reserve spaces): left to the guard.
_UNTUNED = frozenset({"FusedBatchNormV3", "FusedBatchNormGradV3"})

_POOL_ATTRS = ("T", "ksize", "strides", "padding", "data_format")


def max_pool_gradients(view: GraphView, node: NodeDef) -> tuple[list[NodeDef], str | None]:
    """The ``MaxPoolGrad`` nodes that read the ``MaxPool`` ``node`` (its output as their
    ``orig_output``, its input as their ``orig_input``, its attrs), and why the pair cannot
    move, or None. oneDNN's gradient reads the positions of the maxima from the forward's
    workspace (an output Eigen's ``MaxPool`` has not), so a forward and its gradients move
    together: a gradient that reads the forward some other way keeps both on Eigen.

    >>> from fusion.graph import GraphView
    >>> pool = NodeDef(name="p", op="MaxPool", input=["x"])
    >>> grad = NodeDef(name="g", op="MaxPoolGrad", input=["x", "p", "dy"])
    >>> [g.name for g in max_pool_gradients(GraphView([pool, grad]), pool)[0]]
    ['g']
    """
    gradients = []
    for consumer, index, port, control in view.consumer_edges(node.name):
        if control or consumer.op != "MaxPoolGrad" or index != 1:
            continue  # a plain reader of the output (another pool's orig_input, say)
        same = (port == 0 and consumer.input[0] == node.input[0]
                and all(consumer.attr[a] == node.attr[a] for a in _POOL_ATTRS))
        if not same:
            return [], (f"MaxPool: the gradient {consumer.name} reads it other than as its own "
                        "forward")
        gradients.append(consumer)
    return gradients, None


# -- match ----------------------------------------------------------------------------------
def _ops(ctx: RuleContext) -> Mapping[str, str]:
    """TensorFlow op -> oneDNN op, as the target declares them (none: nothing to retarget)."""
    if "ops" not in ctx.memo:
        kernels = ctx.target.capability(OneDnnKernels)
        ctx.memo["ops"] = {} if kernels is None else kernels.ops
    return ctx.memo["ops"]


def _nothing_to_retarget(ctx: RuleContext) -> list[str] | None:
    """cuda, metal, cpu with oneDNN on: the graph is not walked (no reasons)."""
    return None if _ops(ctx) else []


def _match(node: NodeDef, ctx: RuleContext) -> OneDnnMatch | None:
    """``node`` with its oneDNN op (a ``MaxPool`` with the gradients that read it), or None:
    no oneDNN kernel, already labelled for a kernel, or a ``MaxPoolGrad`` (moved with its
    forward)."""
    new = _ops(ctx).get(node.op)
    if new is None or "_kernel" in node.attr or node.op == "MaxPoolGrad":
        return None
    gradients = max_pool_gradients(ctx.view, node)[0] if node.op == "MaxPool" else []
    return OneDnnMatch(node, new, tuple(gradients))


# -- check ----------------------------------------------------------------------------------
def _check(match: OneDnnMatch, ctx: RuleContext) -> str | None:
    """Why the node stays on Eigen: its dtype, layout, padding, device or fused chain, a
    MaxPool gradient that cannot move with it, or the tuner measuring Eigen faster."""
    view, node = ctx.view, match.node
    why = _why_not(node, view)
    if why is None and node.op == "MaxPool":
        gradients, why = max_pool_gradients(view, node)
        if gradients and "MaxPoolGrad" not in _ops(ctx):
            why = "MaxPool: this build has no oneDNN kernel of its gradient"
    if why is None and node.op not in _UNTUNED:
        sig = signature(view, node) + match.with_gradients
        kept = ctx.tuned("onednn", sig, [node.name, *(g.name for g in match.gradients)],
                         lambda v: rewrite_onednn(v, match), stock="eigen", fused="onednn")
        why = None if kept is None else f"{sig}: left on Eigen: {kept}"
    return why


def _pairs(matches: list[OneDnnMatch], ctx: RuleContext) -> tuple[list[OneDnnMatch], list[str]]:
    """The matches kept once every batch norm without its partner is dropped, and why those
    are."""
    candidates = {m.node.name: m for m in matches}
    reasons = _unpaired_batch_norms(ctx.view, candidates)
    return list(candidates.values()), reasons


def _unpaired_batch_norms(view: GraphView, candidates: dict[str, OneDnnMatch]) -> list[str]:
    """Drop from ``candidates`` every batch norm whose forward/gradient partner stays on Eigen
    (the gradient reads the forward's reserve spaces); the reasons."""
    reasons = []
    changed = True
    while changed:
        changed = False
        for name, m in list(candidates.items()):
            if m.node.op == "FusedBatchNormGradV3":
                forward = parse_input(m.node.input[3])[0]
                paired = forward in candidates
            elif m.node.op == "FusedBatchNormV3":
                # The tape's ZerosLike of an unused output reads no values: not a reader.
                readers = [c for c, _, port, ctl in view.consumer_edges(name)
                           if not ctl and port >= 3 and c.op != "ZerosLike"]
                paired = all(c.name in candidates and c.op == "FusedBatchNormGradV3"
                             for c in readers)
            else:
                continue
            if not paired:
                del candidates[name]
                reasons.append(f"{m.node.op}: its forward/gradient partner stays on Eigen")
                changed = True
    return reasons


# -- emit -----------------------------------------------------------------------------------
def _retarget(view: GraphView, old: NodeDef, op: str) -> NodeDef:
    node = NodeDef()
    node.CopyFrom(old)
    node.op = op
    node.attr["_kernel"].s = KERNEL_LABEL.encode()
    view.replace(old.name, node)
    return node


def rewrite_onednn(view: GraphView, match: OneDnnMatch) -> NodeDef:
    """Run ``match.node`` on its oneDNN kernel: same name, inputs and attrs, new op and label.
    A ``MaxPool`` moves with its gradients: the forward's workspace (its second output, the
    positions of the maxima) becomes their fourth input, as TensorFlow's oneDNN pass wires it;
    a forward alone computes none."""
    node = _retarget(view, view.node(match.node.name), match.op)
    if node.op == RETARGETS["MaxPool"]:
        node.attr["workspace_enabled"].b = bool(match.gradients)
        shapes = node.attr["_output_shapes"].list.shape if "_output_shapes" in node.attr else None
        if shapes is not None and len(shapes) == 1:  # the workspace: a second output
            shapes.add().unknown_rank = True
    for gradient in match.gradients:
        new = _retarget(view, view.node(gradient.name), RETARGETS["MaxPoolGrad"])
        new.attr["workspace_enabled"].b = True
        data = [ref for ref in new.input if not parse_input(ref)[2]]
        control = [ref for ref in new.input if parse_input(ref)[2]]
        del new.input[:]
        new.input.extend([*data, f"{node.name}:1", *control])
    return node


# -- declaration ----------------------------------------------------------------------------
def volume(view: GraphView, node: NodeDef) -> int:
    """The elements ``node``'s data inputs hold (an unknown dimension counts as
    ``fusion.fragment.UNKNOWN_DIM``, an unknown rank as one element): what its kernel reads, a
    measure of what its choice between Eigen and oneDNN weighs in the step.

    >>> from fusion.graph import GraphView
    >>> x = NodeDef(name="x", op="Placeholder")
    >>> x.attr["_output_shapes"].list.shape.add().dim.extend([])
    >>> view = GraphView([x, NodeDef(name="m", op="MatMul", input=["x", "x"])])
    >>> volume(view, view.node("m"))
    2
    """
    return sum(math.prod(UNKNOWN_DIM if d is None else d for d in tensor_shape(view, ref) or ())
               for ref in view.data_inputs(node) if view.node(parse_input(ref)[0]) is not None)


def largest_first(view: GraphView) -> list[NodeDef]:
    """The graph's nodes, those with a oneDNN kernel largest first (:func:`volume`), the rest
    after: the tuner's budget goes first to the choices that weigh most in the step (a large
    convolution's gradients), not to the first nodes of the graph.

    >>> from fusion.graph import GraphView
    >>> def node(name, op, *dims):
    ...     n = NodeDef(name=name, op=op)
    ...     n.attr["_output_shapes"].list.shape.add().dim.extend([])
    ...     for d in dims:
    ...         n.attr["_output_shapes"].list.shape[0].dim.add().size = d
    ...     return n
    >>> small, big = node("small", "Placeholder", 4), node("big", "Placeholder", 64)
    >>> a = NodeDef(name="a", op="Softmax", input=["small"])
    >>> b = NodeDef(name="b", op="Softmax", input=["big"])
    >>> [n.name for n in largest_first(GraphView([small, big, a, b]))]
    ['b', 'a', 'small', 'big']
    """
    nodes = view.nodes()
    ranked = [n for n in nodes if n.op in RETARGETS]
    ranked.sort(key=lambda n: -volume(view, n))
    return ranked + [n for n in nodes if n.op not in RETARGETS]


RULE = Rule(match=_match, check=_check, emit=lambda v, m: rewrite_onednn(v, m),
            kind=lambda m: f"{m.node.op} -> {m.op}{m.with_gradients}",
            walk=largest_first, begin=_nothing_to_retarget, finish=_pairs)


def find_onednn(view: GraphView, target: Target, tuner: Chooser | None = None,
                ) -> tuple[list[OneDnnMatch], list[str]]:
    """Every node ``target`` runs on a oneDNN kernel; reasons for the ones left on Eigen.

    Convolutions and MatMuls go to oneDNN where ``tuner`` measures it faster than Eigen at
    the node's own shapes (None: always)."""
    return RULE.find(view, target, tuner)


@register(
    "onednn",
    "cpu with oneDNN off: Conv2D, Conv3D, DepthwiseConv2dNative and their gradients, MatMul, "
    "BatchMatMulV2, Einsum, _FusedConv2D, _FusedMatMul, Softmax, Transpose, AvgPool, AvgPool3D, "
    "MaxPool and their gradients, FusedBatchNormV3 and its gradient -> TensorFlow's bundled "
    "oneDNN kernels (_MklNativeConv2D*, _MklNativeConv3D*, _MklNativeDepthwiseConv2dNative*, "
    "_MklMatMul, _MklBatchMatMulV2, _MklEinsum, _MklNativeFusedConv2D, _MklNativeFusedMatMul, "
    "_MklSoftmax, _MklTranspose, _MklNativeAvgPool*, _MklNativeMaxPool*, "
    "_MklNativeFusedBatchNorm*), where measured faster",
    after=("dedupe",),
    order=("last: what is still a plain convolution, MatMul or batch norm goes to oneDNN's "
           "kernel, the fused nodes of the others among its inputs"),
)
def onednn_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Retarget every convolution, MatMul and batch norm ``ctx.target`` runs on oneDNN."""
    RULE.apply(view, ctx)


def onednn_kernels(target_platform: Platform) -> OneDnnKernels | None:
    """What the family may retarget on ``target_platform`` (its ``capability``): the cpu with
    oneDNN's kernels registered and its pass off; None elsewhere.

    >>> onednn_kernels(Platform("cpu", onednn=True)) is None  # TensorFlow's pass retargets
    True
    >>> onednn_kernels(Platform("cuda")) is None
    True
    """
    # With oneDNN on, TensorFlow's own pass retargets them.
    if target_platform.name != "cpu" or target_platform.onednn or not kernels_registered():
        return None
    return OneDnnKernels()


declare(Family("onednn", "", capability=onednn_kernels))
