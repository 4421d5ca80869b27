"""Inference Conv2D + BatchNormalization (+ activation) -> one ``_FusedConv2D``.

Keras 3's BatchNormalization in an inference graph is ``tf.nn.batch_normalization`` on the
moving statistics, composite::

    inv  = Rsqrt(AddV2(variance, epsilon)) * gamma
    out  = AddV2(Mul(conv, inv), Sub(beta, Mul(mean, inv)))

One rule (:mod:`fusion.rule`), as every family: its match finds that subgraph after a
``Conv2D`` (the batch_norm family's own expression, :func:`fusion.graphs.batch_norm.affine`)
and the activation after it the target runs fused (a :class:`ConvBatchNormMatch`), its check
says why it stays apart (the target's kernels, the statistics' shapes, readers of its
intermediates), :func:`rewrite_conv_bn` writes ``_FusedConv2D`` with
``fused_ops=["FusedBatchNorm"(, activation)]``, ``num_args=4`` (gamma, beta, mean, variance) and
``epsilon``. Training graphs never match: there the statistics are the batch's own moments.

Example:
    >>> import tensorflow as tf, keras
    >>> from fusion.graph import GraphView
    >>> from fusion.graphs.conv_bn_fold import find_conv_bn
    >>> from tfmx.backends import get_backend
    >>> inp = keras.Input((6, 6, 3))
    >>> out = keras.layers.BatchNormalization()(keras.layers.Conv2D(4, 3, use_bias=False)(inp))
    >>> m = keras.Model(inp, out)
    >>> g = tf.function(m.predict_step, autograph=False).get_concrete_function(
    ...     tf.TensorSpec([None, 6, 6, 3])).graph.as_graph_def(add_shapes=True)
    >>> matches, declined = find_conv_bn(GraphView(g.node), get_backend("cpu"))
    >>> [round(match.epsilon, 4) for match in matches]
    [0.001]
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from fusion.expr import Match, match
from fusion.family import register
from fusion.graph import GraphView, NodeDef, output_shape, parse_input
from fusion.graphs.batch_norm import affine, normalization
from fusion.graphs.contraction import supports
from fusion.match import (
    AttrLike,
    blocker,
    consumer,
    dtype_name,
    fused_node,
)
from fusion.pattern import RewriteContext, Target
from fusion.rule import Rule, RuleContext

ACTIVATIONS = ("Relu", "Relu6", "Elu", "LeakyRelu")


@dataclasses.dataclass
class ConvBatchNormMatch:
    """Conv2D -> composite inference batch norm [-> activation]."""

    conv: NodeDef
    interior: tuple[NodeDef, ...]  # the batch-norm nodes, last is the output AddV2
    gamma: str
    beta: str
    mean: str
    variance: str
    epsilon: float
    activation: NodeDef | None = None

    @property
    def tail(self) -> NodeDef:
        return self.activation or self.interior[-1]

    @property
    def fused_ops(self) -> tuple[str, ...]:
        return ("FusedBatchNorm",) + ((self.activation.op,) if self.activation else ())


# -- match ----------------------------------------------------------------------------------
_PATTERN = affine(normalization(gamma=True))  # batch_norm's own, with gamma
_INTERIOR = ("scale_mul", "add_eps", "rsqrt", "inv", "mean_mul", "shift", "out")


def _match(conv: NodeDef, ctx: RuleContext) -> ConvBatchNormMatch | None:
    """The batch-norm subgraph applied to ``conv``'s output, by structure, with the activation
    after it where the target runs it fused; None if absent."""
    view = ctx.view
    for scale_mul in (c for c in view.consumers(conv.name) if c.op == "Mul"):
        for out in (c for c in view.consumers(scale_mul.name) if c.op == "AddV2"):
            found = match(view, out.name, _PATTERN, Match(refs={"x": conv.name}))
            if found is None or found.refs["scale_mul"] != scale_mul.name or (
                    "beta" not in found.refs):  # (-mean) * inv: no beta to fold
                continue
            record = ConvBatchNormMatch(
                conv=conv, interior=tuple(view.node(found.refs[n]) for n in _INTERIOR),
                gamma=found.refs["gamma"], beta=found.refs["beta"], mean=found.refs["mean"],
                variance=found.refs["var"], epsilon=found.values["epsilon"])
            record.activation = _activation(view, record, ctx.target)
            return record
    return None


def _activation(view: GraphView, match: ConvBatchNormMatch, target: Target) -> NodeDef | None:
    """The activation after the batch norm that the fused kernel may take, or None."""
    conv, out = match.conv, match.interior[-1]
    inside = {n.name for n in (conv, *match.interior)}
    act = consumer(view, out, "Relu") or next(
        (c for c in view.consumers(out.name) if c.op in ACTIVATIONS), None)
    if act is not None and supports(
        target, "Conv2D", dtype_name(conv), ("FusedBatchNorm", act.op)
    ) and blocker(view, out, inside | {act.name}) is None and not view.has_control_edges(act):
        return act
    return None


# -- check ----------------------------------------------------------------------------------
def _check(match: ConvBatchNormMatch, ctx: RuleContext) -> str | None:
    """Why the batch norm stays apart: no fused kernel on the target, statistics that are not
    per-channel vectors of an NHWC convolution, or intermediates read elsewhere."""
    view, target, conv = ctx.view, ctx.target, match.conv
    dtype = dtype_name(conv)
    fmt = conv.attr["data_format"].s.decode()
    channels = (output_shape(conv) or (None,))[-1] if fmt == "NHWC" else None
    if not supports(target, "Conv2D", dtype, ("FusedBatchNorm",)):
        return f"Conv2D+BatchNorm: {target.name} runs no fused batch norm in {dtype}"
    if fmt != "NHWC" or not all(
        _vector(view, r, channels) for r in (match.gamma, match.beta, match.mean, match.variance)
    ):
        return ("Conv2D+BatchNorm: statistics are not per-channel vectors of an NHWC "
                "convolution")
    inside = {n.name for n in (conv, *match.interior)}
    why = blocker(view, conv, inside)
    for node in match.interior[:-1]:
        why = why or blocker(view, node, inside)
    why = why or ("BatchNorm output has a control edge"
                  if view.has_control_edges(match.interior[-1]) else None)
    return None if why is None else f"Conv2D+BatchNorm: {why}"


def _vector(view: GraphView, ref: str, channels: int | None) -> bool:
    node = view.node(ref)
    shape = None if node is None else output_shape(node, parse_input(ref)[1])
    return shape is not None and len(shape) == 1 and (channels is None or shape[0] == channels)


# -- emit -----------------------------------------------------------------------------------
def rewrite_conv_bn(view: GraphView, match: ConvBatchNormMatch) -> NodeDef:
    """Replace the convolution and batch norm with one ``_FusedConv2D`` named like the tail."""
    conv, tail = match.conv, match.tail
    attrs: dict[str, AttrLike] = {
        "num_args": 4,
        "TArgs": [tf.dtypes.as_dtype(conv.attr["T"].type)] * 4,
        "num_host_args": 0,
        "epsilon": match.epsilon,
        "fused_ops": match.fused_ops,
    }
    if match.activation is not None and match.activation.op == "LeakyRelu":
        attrs["leakyrelu_alpha"] = match.activation.attr["alpha"].f
    fused = fused_node(conv, "_FusedConv2D", tail, [conv.input[0], conv.input[1], match.gamma,
                                                    match.beta, match.mean, match.variance],
                       attrs)
    for node in (conv, *match.interior):
        if node is not tail:
            view.remove(node.name)
    view.replace(tail.name, fused)
    return fused


# -- declaration ----------------------------------------------------------------------------
RULE = Rule(anchors=frozenset({"Conv2D"}), match=_match, check=_check,
            emit=lambda v, m: rewrite_conv_bn(v, m),
            kind=lambda m: f"_FusedConv2D({', '.join(m.fused_ops)})")


def find_conv_bn(
    view: GraphView, target: Target
) -> tuple[list[ConvBatchNormMatch], list[str]]:
    """Every Conv2D + inference batch norm in ``view`` that ``target`` can fold, and declines."""
    return RULE.find(view, target)


@register(
    "conv_bn_fold",
    "inference Conv2D + BatchNormalization (+ activation) -> _FusedConv2D(FusedBatchNorm)",
    after=("contraction",),
    order=("it folds the inference batch norm into the Conv2D that contraction left unfused "
           "(no BiasAdd)"),
)
def conv_bn_fold_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Fold every inference batch norm that follows a Conv2D into the convolution."""
    RULE.apply(view, ctx)
