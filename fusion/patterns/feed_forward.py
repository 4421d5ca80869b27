"""The feed_forward family's GraphDef pass: what the feed_forward stage emitted, observed.

The rewrite happens before differentiation, in the stage ``fusion.stages.feed_forward`` (a
``Dense(activation) -> Dense`` block as one XLA region, where the tuner measured it faster).
This pass finds the stage's regions under their name scope in the traced graph and reports them
as observed; blocks kept as two layers were recorded by the stage itself.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.patterns.feed_forward import find_feed_forward_units
    >>> region = tf.function(lambda x: x * 2.0, jit_compile=True)
    >>> @tf.function
    ... def f(x):
    ...     with tf.name_scope("tfmx_feed_forward_xla"):
    ...         return region(x)
    >>> g = f.get_concrete_function(tf.TensorSpec([2])).graph.as_graph_def()
    >>> find_feed_forward_units(GraphView(g.node))
    [('tfmx_feed_forward_xla/', 'xla')]
"""

from __future__ import annotations

from fusion.graph import GraphView
from fusion.pattern import RewriteContext, register
from fusion.stage import XLA, XLA_CALLS, emitted_units
from fusion.stages.feed_forward import LABELS, SCOPE


def find_feed_forward_units(view: GraphView) -> list[tuple[str, str]]:
    """(scope, form) of every feed-forward region the stage emitted in ``view``."""
    return emitted_units(view, SCOPE, {XLA: XLA_CALLS})


@register(
    "feed_forward",
    "Keras Dense(activation) -> Dense as one XLA region, emitted before differentiation by the "
    "feed_forward stage (fusion.stages.feed_forward) where measured faster: its regions found "
    "and reported as observed",
)
def feed_forward_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Observe the feed-forward regions the stage emitted in ``view``."""
    for _, form in find_feed_forward_units(view):
        ctx.stats.observe(LABELS[form])
