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

import re

from fusion.graph import GraphView
from fusion.pattern import RewriteContext, register
from fusion.stages.attention import LABELS, SCOPE

_UNIT = re.compile(r"(?:^|/)" + SCOPE + r"_(?P<form>[a-z_]+?)(?:_\d+)?/")


def find_attention_units(view: GraphView) -> list[tuple[str, str]]:
    """(scope, form) of every attention the stage emitted in ``view`` (with its MatMuls)."""
    units: dict[str, str] = {}
    for node in view.nodes():
        if node.name.startswith(("gradient_tape/", "gradients/")):
            continue
        found = _UNIT.search(node.name)
        form = found.group("form").replace("_", " ") if found else None
        if form in LABELS and node.op in ("BatchMatMulV2", "BatchMatMulV3"):
            units[node.name[: found.end()]] = form
    return sorted(units.items())


@register(
    "attention",
    "Keras MultiHeadAttention, rewritten before differentiation by the attention stage "
    "(fusion.stages.attention): its batched MatMuls found and reported as observed",
)
def attention_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Observe the attention blocks the stage rewrote in ``view``."""
    for _, form in find_attention_units(view):
        ctx.stats.observe(LABELS[form])
