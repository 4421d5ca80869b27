"""oneDNN kernels without oneDNN's graph pass: CPU convolutions, MatMul, batch norm.

TensorFlow's Linux x86-64 wheel carries oneDNN's kernels (``_MklNativeConv2D`` and its two
gradients among them), registered under the kernel label ``MklNameChangeOp``. A node runs one
only if it asks for that label in its ``_kernel`` attr, which TensorFlow's own oneDNN graph pass
sets when oneDNN is on (``TF_ENABLE_ONEDNN_OPTS=1``; the 2.21 wheel leaves it off on CPUs
without AVX-512, AMD's included). This family does that one step for the convolutions of a
training graph, where the Eigen kernels are slow (the forward, and above all
``Conv2DBackpropFilter`` / ``Conv2DBackpropInput``), for ``MatMul`` (forward, gradients, the
recurrent MatMul of an LSTM loop), for the forward ``_FusedConv2D`` (Conv2D + BiasAdd [+
activation], as the contraction family leaves it) where it is large enough to pay, and for
``FusedBatchNormV3`` with its gradient (as a pair only: the gradient reads the forward's
reserve spaces, whose layout is the kernel's own), and nothing else: same inputs, same
outputs, same node names, no layout change (the "Native" ops take TensorFlow's NHWC tensors).

Measured on this project's 2-core AMD EPYC (TF 2.21, oneDNN off), oneDNN / Eigen: a
conv training step (3 convolutions, batch 128, 32x32) 0.76; MatMul [64,128]x[128,512] chained
0.52, [32,64]x[64,64] 0.93, [3200,128]x[128,512] 1.0. A sweep of MatMul shapes (M in 32-512,
K = N in 64-1024, and the LSTM's tall ones; BENCHMARKS.md) found oneDNN faster for every
``transpose_b`` MatMul (0.29-0.96), for any MatMul up to 2^24 multiply-adds (mostly 0.5-0.99)
and for tall or thin ones ([3200,32]x[32,512] 0.79, [32,3200]x[3200,512] 0.94), but slower
for large ones whose three dimensions are all >= 128 (1.08-1.47: 256x512x512, 128x1024x1024,
[128,3200]x[3200,512]). Those stay on Eigen, with that reason (:func:`eigen_is_faster`).
The forward ``_FusedConv2D`` on ``_MklNativeFusedConv2D`` measured 0.81-0.93 of Eigen's time
from 8,192 output pixels (N x H x W) up and 1.04-1.10 below 2,048 (batch 8 at 4x4-16x16):
it moves from :data:`FUSED_CONV_ONEDNN_MIN_PIXELS` (an unknown batch counts as 32).

Where oneDNN is on, TensorFlow's pass already does this and the backend lists nothing to
retarget; where the kernels are not registered (other platforms), likewise. Results differ
from Eigen's by float32 summation order only (a few 1e-6, relative; the tests check).

One shape, as in every family: :class:`OneDnnMatch` records a node, :func:`find_onednn` fills
records (and says why a node stays on Eigen), :func:`rewrite_onednn` retargets.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.patterns.onednn import find_onednn
    >>> @tf.function
    ... def f(x, w):
    ...     return tf.nn.conv2d(x, w, 1, "SAME")
    >>> g = f.get_concrete_function(tf.TensorSpec([1, 4, 4, 2]),
    ...                             tf.TensorSpec([3, 3, 2, 2])).graph.as_graph_def()
    >>> class Target:  # a cpu backend whose oneDNN kernels are registered, oneDNN itself off
    ...     onednn_ops = {"Conv2D": "_MklNativeConv2D"}
    >>> [m.op for m in find_onednn(GraphView(g.node), Target())[0]]
    ['_MklNativeConv2D']
"""

from __future__ import annotations

import dataclasses

from fusion.graph import GraphView, NodeDef, output_shape, parse_input
from fusion.match import dtype_name
from fusion.pattern import RewriteContext, Target, apply_matches, register

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
}
"""TensorFlow op -> the oneDNN op computing the same, with the same inputs and attrs."""


FUSED_CONV_ONEDNN_MIN_PIXELS = 8192
"""Output pixels (N * H * W) from which a forward ``_FusedConv2D`` goes to oneDNN: measured
0.81-0.93 of Eigen's time from 8,192 up, 1.04-1.10 at 128-2,048 (BENCHMARKS.md)."""

FUSED_CONV_ONEDNN_CHAINS = frozenset({
    ("BiasAdd",), ("BiasAdd", "Relu"), ("BiasAdd", "Relu6"), ("BiasAdd", "Elu"),
    ("BiasAdd", "LeakyRelu"),
})
"""The ``fused_ops`` of ``_FusedConv2D`` retargeted (the ones measured against Eigen)."""

MATMUL_ONEDNN_MAX = 1 << 24
"""Multiply-adds (M * K * N) up to which every MatMul goes to oneDNN."""

MATMUL_EIGEN_MIN_DIM = 128
"""Above MATMUL_ONEDNN_MAX, a MatMul without ``transpose_b`` whose M, K and N are all at least
this stays on Eigen."""

UNKNOWN_DIM = 32
"""What an unknown MatMul dimension (the batch, usually) counts as: Keras's default batch size."""


@dataclasses.dataclass
class OneDnnMatch:
    """A node to run on its oneDNN kernel."""

    node: NodeDef
    op: str  # the oneDNN op


def _dim(shape: tuple[int | None, ...] | None, index: int) -> int:
    if shape is None or len(shape) != 2 or shape[index] is None:
        return UNKNOWN_DIM
    return int(shape[index])


def eigen_is_faster(m: int, k: int, n: int, transpose_b: bool) -> bool:
    """True for the MatMul shapes Eigen ran faster than oneDNN on this project's CPU.

    >>> eigen_is_faster(256, 512, 512, False), eigen_is_faster(256, 512, 512, True)
    (True, False)
    >>> eigen_is_faster(3200, 32, 512, False), eigen_is_faster(128, 128, 128, False)
    (False, False)
    """
    return (not transpose_b and m * k * n > MATMUL_ONEDNN_MAX
            and min(m, k, n) >= MATMUL_EIGEN_MIN_DIM)


def _matmul_dims(view: GraphView, node: NodeDef) -> tuple[int, int, int]:
    """M, K, N of a MatMul, unknown dimensions counted as :data:`UNKNOWN_DIM`."""
    out = output_shape(node)
    a = view.node(node.input[0])
    a_shape = None if a is None else output_shape(a, parse_input(node.input[0])[1])
    k = _dim(a_shape, 0 if node.attr["transpose_a"].b else 1)
    return _dim(out, 0), k, _dim(out, 1)


def _fused_conv_blocker(node: NodeDef) -> str | None:
    chain = tuple(op.decode() for op in node.attr["fused_ops"].list.s)
    if chain not in FUSED_CONV_ONEDNN_CHAINS:
        return f"_FusedConv2D({', '.join(chain)}): only BiasAdd chains go to oneDNN"
    shape = output_shape(node)
    if shape is None or len(shape) != 4 or shape[1] is None or shape[2] is None:
        return "_FusedConv2D of unknown output size: left on Eigen"
    pixels = (shape[0] or UNKNOWN_DIM) * shape[1] * shape[2]
    if pixels < FUSED_CONV_ONEDNN_MIN_PIXELS:
        return (f"_FusedConv2D with {pixels} output pixels: Eigen measured faster below "
                f"{FUSED_CONV_ONEDNN_MIN_PIXELS}")
    return None


def _why_not(node: NodeDef, view: GraphView) -> str | None:
    dtype = dtype_name(node)
    if dtype != "float32":
        return f"{node.op} in {dtype}: only float32 goes to oneDNN (measured there)"
    data_format = node.attr["data_format"].s.decode() if "data_format" in node.attr else "NHWC"
    if data_format != "NHWC":
        return f"{node.op} in {data_format}: only NHWC goes to oneDNN"
    if "padding" in node.attr and node.attr["padding"].s == b"EXPLICIT":
        return f"{node.op} with explicit padding: left on Eigen"
    if node.device and "CPU" not in node.device.upper():
        return f"{node.op} placed on {node.device}"
    if node.op == "MatMul":
        m, k, n = _matmul_dims(view, node)
        if eigen_is_faster(m, k, n, node.attr["transpose_b"].b):
            return (f"MatMul {m}x{k}x{n} without transpose_b: Eigen measured faster for large "
                    "MatMuls with every dimension >= 128")
    if node.op == "_FusedConv2D":
        return _fused_conv_blocker(node)
    return None


def find_onednn(view: GraphView, target: Target) -> tuple[list[OneDnnMatch], list[str]]:
    """Every node ``target`` runs on a oneDNN kernel; reasons for the ones left on Eigen."""
    ops = getattr(target, "onednn_ops", {})
    declined: list[str] = []
    candidates: dict[str, OneDnnMatch] = {}
    if not ops:  # cuda, metal, cpu with oneDNN on: no walk over the graph
        return [], declined
    for node in view:
        new = ops.get(node.op)
        if new is None or "_kernel" in node.attr:  # absent, or already labelled for a kernel
            continue
        why = _why_not(node, view)
        if why is None:
            candidates[node.name] = OneDnnMatch(node, new)
        else:
            declined.append(why)
    declined += _unpaired_batch_norms(view, candidates)
    return list(candidates.values()), declined


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


def rewrite_onednn(view: GraphView, match: OneDnnMatch) -> NodeDef:
    """Run ``match.node`` on its oneDNN kernel: same name, inputs and attrs, new op and label."""
    node = NodeDef()
    node.CopyFrom(match.node)
    node.op = match.op
    node.attr["_kernel"].s = KERNEL_LABEL.encode()
    view.replace(match.node.name, node)
    return node


@register(
    "onednn",
    "cpu with oneDNN off: Conv2D, its gradients, MatMul, large _FusedConv2D, FusedBatchNormV3 "
    "and its gradient -> TensorFlow's bundled oneDNN kernels (_MklNativeConv2D*, _MklMatMul, "
    "_MklNativeFusedConv2D, _MklNativeFusedBatchNorm*)",
)
def onednn_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Retarget every convolution, MatMul and batch norm ``ctx.target`` runs on oneDNN."""
    apply_matches(
        view, ctx, find_onednn(view, ctx.target),
        lambda v, m: rewrite_onednn(v, m),
        lambda m: f"{m.node.op} -> {m.op}",
    )
