"""The attention family's GraphDef pass: what the attention stage emitted, observed.

The rewrite happens before differentiation, in the stage ``fusion.stages.attention`` (Keras
``MultiHeadAttention``'s Einsums -> Transpose + ``BatchMatMulV2``). This pass finds the stage's
units under their name scopes in the traced graph, each holding its batched MatMuls, and reports
them as observed; calls the stage declined were recorded by the stage itself.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.patterns.attention import find_attention_units
    >>> @tf.function
    ... def f(x):
    ...     with tf.name_scope("tfmx_attention_bmm"):
    ...         return tf.matmul(x, x)
    >>> g = f.get_concrete_function(tf.TensorSpec([2, 3, 3])).graph.as_graph_def()
    >>> find_attention_units(GraphView(g.node))
    [('tfmx_attention_bmm/', 'bmm')]
"""

from __future__ import annotations

from fusion.graph import GraphView
from fusion.pattern import RewriteContext, register
from fusion.stage import XLA, XLA_CALLS, emitted_units
from fusion.stages.attention import LABELS, SCOPE

_MATMULS = frozenset({"BatchMatMulV2", "BatchMatMulV3"})


def find_attention_units(view: GraphView) -> list[tuple[str, str]]:
    """(scope, form) of every attention the stage emitted in ``view`` (with its MatMuls, or
    the call of its XLA region)."""
    return emitted_units(view, SCOPE, {**dict.fromkeys(LABELS, _MATMULS), XLA: XLA_CALLS,
                                          "sdpa xla": XLA_CALLS})


@register(
    "attention",
    "Keras MultiHeadAttention, rewritten before differentiation by the attention stage "
    "(fusion.stages.attention): its batched MatMuls found and reported as observed",
)
def attention_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Observe the attention blocks the stage rewrote in ``view``."""
    for _, form in find_attention_units(view):
        ctx.stats.observe(LABELS[form])
