"""Cast patterns: redundant ``Cast`` ops that mixed precision leaves in a graph.

Two kinds, both exact (the values do not change):

- a **round trip**: a 16-bit tensor cast up to a wider float and straight back
  (``bfloat16 -> float32 -> bfloat16``; ``Identity`` nodes between the two casts are looked
  through). It appears where a layer computing in float32 passes a 16-bit tensor on unchanged
  (an ``Activation("linear")``, an ``Identity``) and, mirrored, in the gradient. The consumers of
  the second cast read the original tensor; the casts go when nothing else reads them.
- an **identity cast** (``SrcT == DstT``): its consumers read its input.

The lossy direction (``float32 -> bfloat16 -> float32``) rounds, so it is never touched.

One rule (:mod:`fusion.rule`), as every family: its match takes a ``Cast`` that is an
identity or the second half of a lossless round trip (an expression of :mod:`fusion.expr`,
:data:`CAST_OF_CAST`; a :class:`CastMatch`), its check says why
one stays (fetched, a control edge, an overlap with another), :func:`rewrite_cast` rewires and
removes.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.graphs.casts import find_casts
    >>> from tfmx.backends import get_backend
    >>> @tf.function
    ... def f(x):
    ...     return tf.cast(tf.cast(x, tf.float32), tf.bfloat16) * 2
    >>> g = f.get_concrete_function(tf.TensorSpec([2], tf.bfloat16)).graph.as_graph_def()
    >>> matches, declined = find_casts(GraphView(g.node), get_backend("cpu"))
    >>> [m.kind for m in matches]
    ['bfloat16->float32->bfloat16 round trip']
"""

from __future__ import annotations

import dataclasses

from fusion.expr import Any, Op, Skip, match
from fusion.family import register
from fusion.graph import GraphView, NodeDef, parse_input
from fusion.match import dtype_name
from fusion.pattern import RewriteContext, Target
from fusion.rule import Rule, RuleContext

LOSSLESS_WIDENING = frozenset({
    ("bfloat16", "float32"), ("float16", "float32"), ("bfloat16", "float64"),
    ("float16", "float64"), ("float32", "float64"),
})
"""(narrow, wide): narrow -> wide -> narrow gives back the same values."""


@dataclasses.dataclass
class CastMatch:
    """A redundant cast: consumers of ``cast`` may read ``source`` instead."""

    cast: NodeDef  # the cast whose consumers are rewired (then removed)
    source: str  # the tensor they read instead
    first: NodeDef | None = None  # a round trip's widening cast (removed if nothing reads it)
    kind: str = ""


def _cast_types(node: NodeDef) -> tuple[str, str]:
    return dtype_name(node, "SrcT"), dtype_name(node, "DstT")


# -- match ----------------------------------------------------------------------------------
CAST_OF_CAST = Op("Cast", Skip("Identity", Op("Cast", Any("source"), bind="first"), many=True),
                  bind="cast")
"""A Cast of a Cast, through any Identity nodes between."""


def _match(node: NodeDef, ctx: RuleContext) -> CastMatch | None:
    """``node`` as an identity cast or the narrowing half of a lossless round trip
    (:data:`CAST_OF_CAST` whose casts widen and narrow back), or None."""
    src_t, dst_t = _cast_types(node)
    if src_t == dst_t:
        return CastMatch(node, node.input[0], None, f"identity Cast {src_t}")
    found = match(ctx.view, node.name, CAST_OF_CAST)
    if found is None:
        return None
    first = ctx.view.node(found.refs["first"])
    narrow, wide = _cast_types(first)
    if (narrow, wide) not in LOSSLESS_WIDENING or dst_t != narrow or src_t != wide:
        return None
    return CastMatch(node, first.input[0], first, f"{narrow}->{wide}->{narrow} round trip")


# -- check ----------------------------------------------------------------------------------
def _check(match: CastMatch, ctx: RuleContext) -> str | None:
    """Why the cast stays: fetched, a control edge, or a part of another redundant cast."""
    view, node = ctx.view, match.cast
    why = None
    if node.name in view.protected:
        why = "output is fetched by the function"
    elif view.has_control_edges(node):
        why = "it has a control edge"
    elif parse_input(match.source)[2]:
        why = "its input is a control edge"
    elif node.name in ctx.claimed or (match.first is not None and match.first.name in ctx.claimed
                                      and match.first.name != node.name):
        why = "overlaps another redundant cast"
    return None if why is None else f"{match.kind}: {why}"


# -- emit -----------------------------------------------------------------------------------
def rewrite_cast(view: GraphView, match: CastMatch) -> None:
    """Let the consumers of ``match.cast`` read ``match.source``; drop casts nothing reads."""
    for reader, index, _, control in view.consumer_edges(match.cast.name):
        if not control:
            view.replace_input(reader, index, match.source)
    view.remove(match.cast.name)
    first = match.first
    if (first is not None and first.name in view and not view.consumer_edges(first.name)
            and first.name not in view.protected and not view.has_control_edges(first)):
        view.remove(first.name)


# -- declaration ----------------------------------------------------------------------------
RULE = Rule(anchors=frozenset({"Cast"}), match=_match, check=_check,
            emit=lambda v, m: rewrite_cast(v, m),
            kind=lambda m: f"removed {m.kind}", claims=lambda m: (m.cast.name,))


def find_casts(view: GraphView, target: Target) -> tuple[list[CastMatch], list[str]]:
    """Every redundant cast in ``view``, and a reason for each one left in place."""
    return RULE.find(view, target)


@register(
    "casts",
    "redundant Cast: lossless round trips (bfloat16->float32->bfloat16) and identity casts "
    "-> removed",
    after=("reshaped_bias", "contraction", "conv_bn_fold", "optimizer_update", "batch_norm"),
    order=("it removes casts once the families that write ops have produced their final "
           "dtypes"),
)
def casts_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Remove every redundant cast in ``view`` (exact: values do not change)."""
    RULE.apply(view, ctx)
