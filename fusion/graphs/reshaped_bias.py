"""Reshaped-bias patterns: a bias added after the reshape that follows a MatMul, moved ahead of it.

Keras's ``Dense`` on an input of rank > 2 (every transformer's feed-forward and projection
layers, ``[batch, tokens, features]``) runs on TensorFlow as ``tf.tensordot``: ``Reshape`` to
2-D, ``MatMul``, ``Reshape`` back, then ``BiasAdd``. The reshape between MatMul and BiasAdd
keeps Grappler's remapper (and the contraction family) from fusing the bias into the MatMul,
so the bias is a pass of its own over the layer's output. Adding the bias to the 2-D product
and reshaping after gives the same values, element for element: the reshape keeps the last
axis (the bias's), so every element meets the same bias entry. The contraction family then
fuses ``MatMul + BiasAdd`` into ``_FusedMatMul``.

Only the forward changes: the gradient of ``BiasAdd`` (``BiasAddGrad``) reads the incoming
gradient alone, and the MatMul's gradient reads the MatMul's inputs, so a training graph may be
rewritten after differentiation as it stands.

One rule (:mod:`fusion.rule`), as every family: its match walks from a
``MatMul`` to the ``Reshape`` and ``BiasAdd`` after it (a :class:`ReshapedBiasMatch`),
its check says why a bias stays where it is, :func:`rewrite_reshaped_bias`
moves it.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.graphs.reshaped_bias import find_reshaped_biases
    >>> @tf.function
    ... def f(x, w, b):
    ...     return tf.nn.bias_add(tf.reshape(tf.matmul(x, w), [2, 3, 4]), b)
    >>> g = f.get_concrete_function(tf.TensorSpec([6, 5]), tf.TensorSpec([5, 4]),
    ...                             tf.TensorSpec([4])).graph.as_graph_def(add_shapes=True)
    >>> matches, declined = find_reshaped_biases(GraphView(g.node))
    >>> [(m.matmul.op, m.reshape.op, m.bias_add.op) for m in matches]
    [('MatMul', 'Reshape', 'BiasAdd')]
"""

from __future__ import annotations

import dataclasses

from fusion.family import register
from fusion.graph import GraphView, NodeDef, output_shape, parse_input
from fusion.match import blocker, fused_node, rewire_shape_readers
from fusion.pattern import PlainTarget, RewriteContext
from fusion.rule import Rule, RuleContext

SUFFIX = "/tfmx_bias_first"
"""The name of the moved BiasAdd: the MatMul's name and this suffix."""


@dataclasses.dataclass
class ReshapedBiasMatch:
    """``MatMul -> Reshape -> BiasAdd``: the bias may be added to the MatMul's output."""

    matmul: NodeDef
    reshape: NodeDef
    bias_add: NodeDef


# -- match ----------------------------------------------------------------------------------
def _match(matmul: NodeDef, ctx: RuleContext) -> ReshapedBiasMatch | None:
    """The first ``Reshape`` of ``matmul``'s output and the first ``BiasAdd`` reading that
    reshape, or None."""
    view = ctx.view
    reshape = next((c for c in view.consumers(matmul.name) if c.op == "Reshape"
                    and parse_input(c.input[0]) == (matmul.name, 0, False)), None)
    bias = reshape and next((c for c in view.consumers(reshape.name) if c.op == "BiasAdd"), None)
    return None if bias is None else ReshapedBiasMatch(matmul, reshape, bias)


# -- check ----------------------------------------------------------------------------------
def _check(match: ReshapedBiasMatch, ctx: RuleContext) -> str | None:
    """Why the bias stays after the reshape, or None."""
    why = _blocker(ctx.view, match.matmul, match.reshape, match.bias_add)
    return None if why is None else f"MatMul -> Reshape -> BiasAdd: {why}"


def _blocker(view: GraphView, matmul: NodeDef, reshape: NodeDef, bias: NodeDef) -> str | None:
    if parse_input(bias.input[0])[0] != reshape.name:
        return "BiasAdd reads the reshape as its bias"
    fmt = bias.attr["data_format"].s.decode() if "data_format" in bias.attr else "NHWC"
    if fmt != "NHWC":
        return f"BiasAdd in {fmt} adds along axis 1, not the last"
    product, reshaped = output_shape(matmul), output_shape(reshape)
    if product is None or reshaped is None or len(product) != 2 or not reshaped:
        return "static shapes unknown"
    if product[1] is None or reshaped[-1] != product[1]:
        return (f"the reshape {product} -> {reshaped} does not keep the last axis, so the "
                "bias would meet other elements")
    for node, inside in ((matmul, {reshape.name}), (reshape, {bias.name})):
        why = blocker(view, node, inside)
        if why is not None:
            return why
    if view.has_control_edges(bias):
        return "BiasAdd has a control edge"
    return None


# -- emit -----------------------------------------------------------------------------------
def rewrite_reshaped_bias(view: GraphView, match: ReshapedBiasMatch) -> NodeDef:
    """Write ``MatMul -> BiasAdd -> Reshape``: the BiasAdd (named after the MatMul, with
    :data:`SUFFIX`) reads the MatMul; the Reshape takes the old BiasAdd's name, so the old
    consumers need no rewiring. Returns the moved BiasAdd."""
    matmul, reshape, bias = match.matmul, match.reshape, match.bias_add
    moved = fused_node(bias, "BiasAdd", bias, [matmul.name, bias.input[1]])
    moved.name = matmul.name + SUFFIX
    moved.attr["_output_shapes"].CopyFrom(matmul.attr["_output_shapes"])
    after = fused_node(reshape, "Reshape", bias, [moved.name, reshape.input[1]])
    rewire_shape_readers(view, reshape.name, bias.name)  # the new reshape: the same shape
    view.remove(reshape.name)
    view.add(moved)
    view.replace(bias.name, after)
    return moved


# -- declaration ----------------------------------------------------------------------------
RULE = Rule(
    anchors=frozenset({"MatMul"}), match=_match, check=_check,
    emit=lambda v, m: rewrite_reshaped_bias(v, m),
    kind=lambda m: "BiasAdd moved ahead of the Reshape after MatMul",
)


def find_reshaped_biases(view: GraphView) -> tuple[list[ReshapedBiasMatch], list[str]]:
    """Every ``MatMul -> Reshape -> BiasAdd`` in ``view`` whose bias may move ahead of the
    reshape, and a reason for each one that may not (the rule reads no target)."""
    return RULE.find(view, PlainTarget("any"))


@register(
    "reshaped_bias",
    "MatMul -> Reshape -> BiasAdd (Keras Dense on inputs of rank > 2) -> MatMul -> BiasAdd -> "
    "Reshape, so the contraction family fuses the bias into the MatMul",
)
def reshaped_bias_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Move every bias that follows a MatMul's reshape ahead of the reshape (exact)."""
    RULE.apply(view, ctx)
