"""MatMul layout patterns: a MatMul's transposed operand transposed once, where measured faster.

The gradient of ``y = x @ w`` with respect to ``x`` is ``dy @ w^T``: TensorFlow writes it as
``MatMul(dy, w, transpose_b=True)``, and the kernel reads ``w`` across its rows. How fast a GEMM
reads a transposed operand depends on the kernel and the CPU: with oneDNN, a feed-forward
layer's float32 input gradient, ``[2048, 512] x [128, 512]^T``, can run faster on ``w`` laid out
transposed, the transposition included; in bfloat16 the two may run alike. Writing ``w^T`` out
costs one pass over the weight, small against the product's, so which form runs faster is a
tuner decision per shape and dtype (timed as fragments of the graph), ``transpose_b`` the
conservative form.

The transposition is written as ``Reshape -> Transpose -> Reshape`` through a trailing axis of
one (``[n, k] -> [n, k, 1] -> [k, n, 1] -> [k, n]``): Grappler folds a plain ``Transpose``
feeding a MatMul back into its ``transpose_b`` flag, and not this one. The product is the same
sum (the kernel may add its terms in another order).

Declined, with the reason: a ``transpose_a`` MatMul (both operands transposed), operands whose
static shapes are not known, a dtype outside float32, bfloat16 and float16, a node with control
edges.

One rule (:mod:`fusion.rule`), as every family: its match takes a ``transpose_b`` MatMul and
its operands' shapes (a :class:`LayoutMatch`), its check says why it keeps its flag (the tuner's
answer among the reasons), :func:`rewrite_layout` writes the transposition.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.graphs.matmul_layout import find_layouts
    >>> from tfmx.backends import get_backend
    >>> @tf.function
    ... def f(dy, w):
    ...     return tf.matmul(dy, w, transpose_b=True)
    >>> g = f.get_concrete_function(tf.TensorSpec([8, 6]),
    ...                             tf.TensorSpec([4, 6])).graph.as_graph_def(add_shapes=True)
    >>> matches, declined = find_layouts(GraphView(g.node), get_backend("cpu"))
    >>> [m.signature for m in matches]
    ['MatMul float32 8x6 x (4x6)^T']
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from fusion.family import register
from fusion.fragment import tensor_shape
from fusion.graph import GraphView, NodeDef
from fusion.match import const_node, dtype_name, new_node
from fusion.pattern import Chooser, RewriteContext, Target
from fusion.rule import Rule, RuleContext

FAMILY = "matmul_layout"
SCOPE = "tfmx_transposed"
"""The scope of the nodes written for one match: ``<MatMul's name>/tfmx_transposed/``."""

DTYPES = ("float32", "bfloat16", "float16")
STOCK, FUSED = "transpose_b", "transposed"  # the tuner's names for the two forms


@dataclasses.dataclass
class LayoutMatch:
    """A ``MatMul(a, b, transpose_b=True)`` of ``a`` ``[m, k]`` and ``b`` ``[n, k]``."""

    node: NodeDef
    a_shape: tuple[int, int]
    b_shape: tuple[int, int]

    @property
    def signature(self) -> str:
        (m, k), (n, _) = self.a_shape, self.b_shape
        return f"MatMul {dtype_name(self.node)} {m}x{k} x ({n}x{k})^T"


# -- match ----------------------------------------------------------------------------------
def _match(node: NodeDef, ctx: RuleContext) -> LayoutMatch | None:
    """A ``transpose_b`` MatMul and its operands' static shapes (empty where unknown)."""
    if not node.attr["transpose_b"].b:
        return None
    a, b = (tensor_shape(ctx.view, ref) for ref in ctx.view.data_inputs(node)[:2])
    known = a is not None and b is not None and len(a) == 2 and len(b) == 2 and None not in a + b
    return LayoutMatch(node, a, b) if known else LayoutMatch(node, (), ())


# -- check ----------------------------------------------------------------------------------
def _check(match: LayoutMatch, ctx: RuleContext) -> str | None:
    """Why the MatMul keeps its ``transpose_b``: both operands transposed, its dtype or
    shapes, its edges, the target, or the tuner measuring it faster."""
    why = _blocker(ctx.view, match)
    if why is None:
        from fusion.forms import kernel_missing

        why = kernel_missing(ctx.target, "transposed", {"Transpose"}, dtype_name(match.node))
    if why is not None:
        return f"MatMul (transpose_b): {why}"
    kept = ctx.tuned(FAMILY, match.signature, [match.node.name],
                     lambda v: rewrite_layout(v, match), stock=STOCK, fused=FUSED)
    return None if kept is None else f"{match.signature}: left as it is: {kept}"


def _blocker(view: GraphView, match: LayoutMatch) -> str | None:
    node = match.node
    if node.attr["transpose_a"].b:
        return "transpose_a as well (both operands read transposed)"
    dtype = dtype_name(node)
    if dtype not in DTYPES:
        return f"dtype {dtype}"
    if not match.a_shape:
        return "an operand's static shape is not fully known"
    if view.has_control_edges(node):
        return "it has a control edge"
    return None


# -- emit -----------------------------------------------------------------------------------
def rewrite_layout(view: GraphView, match: LayoutMatch) -> NodeDef:
    """Write ``b`` transposed (``Reshape -> Transpose -> Reshape``, see the module's text) and
    the MatMul reading it without ``transpose_b``, under the MatMul's own name."""
    node = match.node
    n, k = match.b_shape
    dtype = tf.as_dtype(node.attr["T"].type)
    base, device = f"{node.name}/{SCOPE}", node.device
    b_ref = view.data_inputs(node)[1]
    int32 = tf.int32

    def const(name: str, value: np.ndarray) -> str:
        view.add(const_node(f"{base}/{name}", value, device))
        return f"{base}/{name}"

    column = new_node(f"{base}/column", "Reshape",
                      [b_ref, const("column_shape", np.array([n, k, 1], np.int32))],
                      device, T=dtype, Tshape=int32, _output_shapes=tf.TensorShape([n, k, 1]))
    swapped = new_node(f"{base}/transpose", "Transpose",
                       [column.name, const("perm", np.array([1, 0, 2], np.int32))],
                       device, T=dtype, Tperm=int32, _output_shapes=tf.TensorShape([k, n, 1]))
    flat = new_node(f"{base}/matrix", "Reshape",
                    [swapped.name, const("matrix_shape", np.array([k, n], np.int32))],
                    device, T=dtype, Tshape=int32, _output_shapes=tf.TensorShape([k, n]))
    product = NodeDef()
    product.CopyFrom(node)
    product.input[1] = flat.name
    product.attr["transpose_b"].b = False
    for new in (column, swapped, flat):
        view.add(new)
    view.replace(node.name, product)
    return product


# -- declaration ----------------------------------------------------------------------------
RULE = Rule(anchors=frozenset({"MatMul"}), match=_match, check=_check,
            emit=lambda v, m: rewrite_layout(v, m),
            kind=lambda m: "MatMul: its transposed operand transposed once")


def find_layouts(view: GraphView, target: Target, tuner: Chooser | None = None
                 ) -> tuple[list[LayoutMatch], list[str]]:
    """Every ``MatMul`` with ``transpose_b`` in ``view`` that ``tuner`` (if given) measures
    faster with its second operand transposed once on ``target``, and a reason for each one
    left as it is."""
    return RULE.find(view, target, tuner)


@register(
    FAMILY,
    "MatMul(a, b, transpose_b=True) -> MatMul(a, b transposed once), where the tuner measures "
    "it faster (a float32 input gradient dy @ w^T on oneDNN)",
    after=("contraction", "bias_grad", "einsum_dense", "sibling_projections", "pointwise"),
    order=("it reads the MatMuls the families that write MatMuls left; dedupe then shares a "
           "weight's transposition"),
)
def matmul_layout_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Rewrite every ``transpose_b`` MatMul in ``view`` that the tuner measures faster with
    its second operand transposed once."""
    RULE.apply(view, ctx)
