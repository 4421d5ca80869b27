"""Pointwise convolutions: a 1x1 ``Conv2D`` and its two gradients as MatMuls over the pixels.

A convolution whose kernel is 1x1, with unit strides and dilations, multiplies every pixel's
channels by the same ``[Cin, Cout]`` matrix: over the ``N*H*W`` pixels it is one GEMM, and so
are its gradients::

    Conv2D(x, w)                    = reshape(x [P, Cin] @ w [Cin, Cout])
    Conv2DBackpropInput(w, dy)      = reshape(dy [P, Cout] @ w^T)
    Conv2DBackpropFilter(x, dy)     = reshape(x^T @ dy [P, Cout])

EfficientNet's, MobileNet's and ResNet's bottleneck expansions and projections, DenseNet's
transitions and the squeeze-excite projections are such convolutions. TensorFlow runs them
through its convolution kernels, which on a CPU pay for the convolution's generality: Eigen's
input gradient of a 1x1 convolution was measured several times slower than the MatMul computing
it at some of EfficientNetB0's shapes, and about equal at others. Which form is faster depends
on the kernel library, the processor and the shapes, so each node is a tuner decision
(``conv`` the conservative form, ``matmul`` the other), timed as a fragment of the graph. The
product is the same sum (the kernels may add its terms in another order).

Declined, with the reason: a kernel other than 1x1, strides or dilations other than 1, explicit
padding, NCHW, a dtype outside float32, bfloat16 and float16, an image height or width not
known statically, a node with control edges, a target without the kernels. The fused
``_FusedConv2D`` (a 1x1 convolution with its bias and activation, as the contraction family
leaves it) stays as it is.

One rule (:mod:`fusion.rule`), as every family: its match takes a convolution node and its
shapes (a :class:`PointwiseMatch`), its check says why it stays a convolution (the tuner's
answer among the reasons), :func:`rewrite_pointwise` writes the MatMul under the node's name.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.graphs.pointwise import find_pointwise
    >>> from tfmx.backends import get_backend
    >>> @tf.function
    ... def f(x, w):
    ...     return tf.nn.conv2d(x, w, 1, "SAME")
    >>> g = f.get_concrete_function(tf.TensorSpec([None, 4, 4, 3]),
    ...                             tf.TensorSpec([1, 1, 3, 8])).graph.as_graph_def(add_shapes=True)
    >>> matches, declined = find_pointwise(GraphView(g.node), get_backend("cpu"))
    >>> [m.signature for m in matches]
    ['Conv2D float32 ?x4x4x3 1x1x3x8']
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from fusion.family import register
from fusion.fragment import tensor_shape
from fusion.graph import GraphView, NodeDef, output_shape
from fusion.match import const_node, const_value, dtype_name, new_node
from fusion.pattern import Chooser, RewriteContext, Target
from fusion.rule import Rule, RuleContext

FAMILY = "pointwise"
SCOPE = "tfmx_pointwise"
"""The scope of the nodes written for one match: ``<convolution's name>/tfmx_pointwise/``."""

DTYPES = ("float32", "bfloat16", "float16")
STOCK, FUSED = "conv", "matmul"  # the tuner's names for the two forms
OPS = ("Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter")


@dataclasses.dataclass
class PointwiseMatch:
    """A 1x1 convolution node (``op`` one of :data:`OPS`): its image ``[N, H, W, Cin]`` (``N``
    None where unknown) and its ``Cout``; ``why`` the reason it cannot be a MatMul, if any."""

    node: NodeDef
    image: tuple[int | None, ...]
    cout: int
    why: str | None = None

    @property
    def signature(self) -> str:
        n, h, w, cin = self.image
        return (f"{self.node.op} {dtype_name(self.node)} {'?' if n is None else n}x{h}x{w}x{cin} "
                f"1x1x{cin}x{self.cout}")


# -- match ----------------------------------------------------------------------------------
def _filter_shape(view: GraphView, node: NodeDef) -> tuple | None:
    """The convolution's filter shape: its filter input's (the forward, the input gradient) or
    the filter gradient's: its ``filter_sizes`` where a constant, else its own output's."""
    inputs = view.data_inputs(node)
    if node.op == "Conv2DBackpropFilter":
        sizes = const_value(view, inputs[1])
        if sizes is not None:
            return tuple(int(d) for d in np.ravel(sizes))
        return output_shape(node, 0)
    return tensor_shape(view, inputs[1])


def _match(node: NodeDef, ctx: RuleContext) -> PointwiseMatch | None:
    """A convolution node of :data:`OPS` with a 1x1 filter, its shapes; None for any other
    filter (not a pointwise convolution: nothing to say)."""
    shape = _filter_shape(ctx.view, node)
    if shape is None or len(shape) != 4 or tuple(shape[:2]) != (1, 1) or None in shape[2:]:
        return None
    cin, cout = int(shape[2]), int(shape[3])
    inputs = ctx.view.data_inputs(node)
    # the image: the forward's and the filter gradient's input; the input gradient's is its dy's
    ref = inputs[2] if node.op == "Conv2DBackpropInput" else inputs[0]
    image = tensor_shape(ctx.view, ref)
    if image is None or len(image) != 4 or None in image[1:]:
        return PointwiseMatch(node, (None, None, None, cin), cout,
                              "the image's height or width is not known statically")
    n, h, w = image[0], int(image[1]), int(image[2])
    return PointwiseMatch(node, (n, h, w, cin), cout)


# -- check ----------------------------------------------------------------------------------
def _blocker(view: GraphView, match: PointwiseMatch) -> str | None:
    node = match.node
    if match.why is not None:
        return match.why
    if node.attr["data_format"].s not in (b"", b"NHWC"):
        return f"data format {node.attr['data_format'].s.decode()}"
    if any(s != 1 for s in node.attr["strides"].list.i):
        return f"strides {list(node.attr['strides'].list.i)}"
    if any(d != 1 for d in node.attr["dilations"].list.i):
        return f"dilations {list(node.attr['dilations'].list.i)}"
    if node.attr["padding"].s == b"EXPLICIT":
        return "explicit padding"
    dtype = dtype_name(node)
    if dtype not in DTYPES:
        return f"dtype {dtype}"
    if view.has_control_edges(node):
        return "it has a control edge"
    return None


def _check(match: PointwiseMatch, ctx: RuleContext) -> str | None:
    """Why the 1x1 convolution stays one: its attrs, dtype, shapes or edges, the target, or
    the tuner measuring it faster."""
    why = _blocker(ctx.view, match)
    if why is None:
        from fusion.forms import kernel_missing

        why = kernel_missing(ctx.target, FUSED, {"MatMul", "Reshape"}, dtype_name(match.node))
    if why is not None:
        return f"{match.node.op} (1x1): {why}"
    kept = ctx.tuned(FAMILY, match.signature, [match.node.name],
                     lambda v: rewrite_pointwise(v, match), stock=STOCK, fused=FUSED)
    return None if kept is None else f"{match.signature}: left a convolution: {kept}"


# -- emit -----------------------------------------------------------------------------------
def rewrite_pointwise(view: GraphView, match: PointwiseMatch) -> NodeDef:
    """Write the convolution ``match.node`` as a MatMul over the pixels between two Reshapes,
    the last under the node's own name (its readers unchanged)."""
    node = match.node
    _, h, w, cin = match.image
    cout = match.cout
    dtype = tf.as_dtype(node.attr["T"].type)
    base, device = f"{node.name}/{SCOPE}", node.device
    inputs = view.data_inputs(node)
    int32 = tf.int32
    added: list[NodeDef] = []

    def const(name: str, value: list[int]) -> str:
        view.add(const_node(f"{base}/{name}", np.array(value, np.int32), device))
        return f"{base}/{name}"

    def matrix(name: str, ref: str, columns: int) -> str:
        added.append(new_node(f"{base}/{name}", "Reshape",
                              [ref, const(f"{name}_shape", [-1, columns])], device, T=dtype,
                              Tshape=int32, _output_shapes=tf.TensorShape([None, columns])))
        return added[-1].name

    def weights(ref: str) -> str:
        added.append(new_node(f"{base}/weights", "Reshape",
                              [ref, const("weights_shape", [cin, cout])], device, T=dtype,
                              Tshape=int32, _output_shapes=tf.TensorShape([cin, cout])))
        return added[-1].name

    if node.op == "Conv2D":  # pixels @ w
        a, b, transpose, out = matrix("pixels", inputs[0], cin), weights(inputs[1]), "", cout
    elif node.op == "Conv2DBackpropInput":  # dy @ w^T
        a, b, transpose, out = matrix("gradient", inputs[2], cout), weights(inputs[1]), "b", cin
    else:  # Conv2DBackpropFilter: pixels^T @ dy
        a, b = matrix("pixels", inputs[0], cin), matrix("gradient", inputs[2], cout)
        transpose, out = "a", None
    product = new_node(f"{base}/matmul", "MatMul", [a, b], device, T=dtype,
                       transpose_a=transpose == "a", transpose_b=transpose == "b",
                       _output_shapes=tf.TensorShape([cin, cout] if out is None else [None, out]))
    shape = [1, 1, cin, cout] if out is None else [-1, h, w, out]
    result = new_node(node.name, "Reshape", [product.name, const("shape", shape)], device,
                      T=dtype, Tshape=int32)
    if "_output_shapes" in node.attr:
        result.attr["_output_shapes"].CopyFrom(node.attr["_output_shapes"])
    for new in (*added, product):
        view.add(new)
    view.replace(node.name, result)
    return result


# -- declaration ----------------------------------------------------------------------------
RULE = Rule(anchors=frozenset(OPS), match=_match, check=_check,
            emit=lambda v, m: rewrite_pointwise(v, m),
            kind=lambda m: f"{m.node.op} (1x1) -> MatMul over the pixels")


def find_pointwise(view: GraphView, target: Target, tuner: Chooser | None = None
                   ) -> tuple[list[PointwiseMatch], list[str]]:
    """Every 1x1 ``Conv2D``, ``Conv2DBackpropInput`` and ``Conv2DBackpropFilter`` in ``view``
    that ``tuner`` (if given) measures faster as a MatMul on ``target``, and a reason for each
    one left a convolution."""
    return RULE.find(view, target, tuner)


@register(
    FAMILY,
    "1x1 Conv2D, Conv2DBackpropInput, Conv2DBackpropFilter (unit strides and dilations) -> "
    "a MatMul over the pixels, where the tuner measures it faster",
    after=("contraction", "conv_bn_fold"),
    order=("it reads the convolutions the contraction family leaves unfused (no bias, no "
           "activation); matmul_layout and onednn then see its MatMuls"),
)
def pointwise_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Rewrite every 1x1 convolution in ``view`` that the tuner measures faster as a MatMul."""
    RULE.apply(view, ctx)
