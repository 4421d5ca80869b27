"""Bias-gradient patterns: ``BiasAddGrad`` as a MatMul of a row of ones, where measured faster.

The gradient of a bias is the incoming gradient summed over every axis but the last (the
channels). TensorFlow's CPU ``BiasAddGrad`` sums the ``[rows, channels]`` gradient column by
column with Eigen; the same sum is a matrix product, ``ones[1, rows] @ dy[rows, channels]``,
which the CPU's GEMM (oneDNN or Eigen's) runs on both cores with wide vectors. A transformer
step holds one ``BiasAddGrad`` per Dense and projection layer, each over ``[batch * tokens,
width]``. The two are equal sums added in another order, so which runs faster is a tuner
decision per shape and dtype (timed as fragments of the graph), ``BiasAddGrad`` the
conservative form.

Declined, with the reason: ``NCHW`` (the sum is over axis 1, not the last), a gradient whose
static shape is not fully known, a dtype the MatMul does not run in.

One rule (:mod:`fusion.rule`), as every family: its match takes a ``BiasAddGrad`` and its
gradient's shape (a :class:`BiasGradMatch`), its check says why it stays (the tuner's answer
among the reasons), :func:`rewrite_bias_grad` writes the MatMul.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.graphs.bias_grad import find_bias_grads
    >>> @tf.function
    ... def f(dy):
    ...     return tf.raw_ops.BiasAddGrad(out_backprop=dy)
    >>> g = f.get_concrete_function(tf.TensorSpec([2, 3, 4])).graph.as_graph_def(add_shapes=True)
    >>> from tfmx.backends import get_backend
    >>> matches, declined = find_bias_grads(GraphView(g.node), get_backend("cpu"))
    >>> [(m.rows, m.channels) for m in matches]
    [(6, 4)]
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import tensorflow as tf

from fusion.family import register
from fusion.graph import GraphView, NodeDef, output_shape, parse_input
from fusion.match import const_node, dtype_name, new_node
from fusion.pattern import Chooser, RewriteContext, Target
from fusion.rule import Rule, RuleContext

SCOPE = "tfmx_bias_grad"
"""The scope of the nodes written for one match: ``<BiasAddGrad's name>/tfmx_bias_grad/``."""

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass
class BiasGradMatch:
    """A ``BiasAddGrad`` over a gradient of ``rows`` x ``channels`` (rows: every axis but the
    last, multiplied out)."""

    node: NodeDef
    rows: int
    channels: int

    @property
    def signature(self) -> str:
        return f"BiasAddGrad {dtype_name(self.node)} {self.rows}x{self.channels}"


# -- match ----------------------------------------------------------------------------------
def _match(node: NodeDef, ctx: RuleContext) -> BiasGradMatch:
    """A ``BiasAddGrad`` and its gradient's rows and channels (-1, -1: not fully known)."""
    producer = ctx.view.node(node.input[0])
    shape = None if producer is None else output_shape(producer, parse_input(node.input[0])[1])
    if shape is None or len(shape) < 2 or None in shape:
        return BiasGradMatch(node, -1, -1)
    return BiasGradMatch(node, math.prod(shape[:-1]), shape[-1])


# -- check ----------------------------------------------------------------------------------
def _check(match: BiasGradMatch, ctx: RuleContext) -> str | None:
    """Why the ``BiasAddGrad`` stays as it is: its layout, dtype or shape, its edges, the
    target, or the tuner measuring it faster."""
    view, node = ctx.view, match.node
    why = _blocker(view, match)
    if why is None and not ctx.target.runs_op("MatMul"):
        why = f"{ctx.target.name} runs no MatMul"
    if why is not None:
        return f"BiasAddGrad: {why}"
    kept = ctx.tuned("bias_grad", match.signature, [node.name],
                     lambda v: rewrite_bias_grad(v, match), stock="BiasAddGrad", fused="matmul")
    return None if kept is None else f"{match.signature}: left as it is: {kept}"


def _blocker(view: GraphView, match: BiasGradMatch) -> str | None:
    node = match.node
    fmt = node.attr["data_format"].s.decode() if "data_format" in node.attr else "NHWC"
    if fmt != "NHWC":
        return f"data_format {fmt} sums over axis 1, not the last"
    dtype = dtype_name(node)
    if dtype not in DTYPES:
        return f"dtype {dtype}"
    if match.rows < 0:
        return "the gradient's static shape is not fully known"
    if view.has_control_edges(node) or node.name in view.protected:
        return "it has a control edge or is fetched by the function"
    return None


# -- emit -----------------------------------------------------------------------------------
def rewrite_bias_grad(view: GraphView, match: BiasGradMatch) -> NodeDef:
    """Write ``reshape(ones[1, rows] @ reshape(dy, [rows, channels]), [channels])``; the last
    Reshape takes the BiasAddGrad's name, so its consumers need no rewiring."""
    node, rows, channels = match.node, match.rows, match.channels
    dtype = tf.as_dtype(node.attr["T"].type)
    base, device = f"{node.name}/{SCOPE}", node.device
    int32 = tf.int32

    def const(name: str, value: np.ndarray) -> str:
        view.add(const_node(f"{base}/{name}", value, device))
        return f"{base}/{name}"

    flat = new_node(f"{base}/rows", "Reshape",
                    [node.input[0], const("rows_shape", np.array([rows, channels], np.int32))],
                    device, T=dtype, Tshape=int32,
                    _output_shapes=tf.TensorShape([rows, channels]))
    ones = const("ones", np.ones([1, rows], dtype.as_numpy_dtype))
    total = new_node(f"{base}/sum", "MatMul", [ones, flat.name], device, T=dtype,
                     transpose_a=False, transpose_b=False,
                     _output_shapes=tf.TensorShape([1, channels]))
    out = new_node(node.name, "Reshape",
                   [total.name, const("channels", np.array([channels], np.int32))],
                   device, T=dtype, Tshape=int32, _output_shapes=tf.TensorShape([channels]))
    view.add(flat)
    view.add(total)
    view.replace(node.name, out)
    return out


# -- declaration ----------------------------------------------------------------------------
RULE = Rule(anchors=frozenset({"BiasAddGrad"}), match=_match, check=_check,
            emit=lambda v, m: rewrite_bias_grad(v, m),
            kind=lambda m: "BiasAddGrad as a MatMul of ones")


def find_bias_grads(view: GraphView, target: Target, tuner: Chooser | None = None
                    ) -> tuple[list[BiasGradMatch], list[str]]:
    """Every ``BiasAddGrad`` in ``view`` that ``tuner`` (if given) measures faster as a
    MatMul of ones on ``target``, and a reason for each one left as it is."""
    return RULE.find(view, target, tuner)


@register(
    "bias_grad",
    "BiasAddGrad -> a MatMul of a row of ones (the same sum on the GEMM), where the tuner "
    "measures it faster",
    after=("casts",),
    order=("it reads the bias gradients in their final dtypes; dedupe then shares its rows "
           "of ones"),
)
def bias_grad_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Rewrite every ``BiasAddGrad`` in ``view`` that the tuner measures faster as a MatMul."""
    RULE.apply(view, ctx)
