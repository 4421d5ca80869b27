"""The layer_norm family's GraphDef pass: what the layer_norm stage emitted, observed.

The rewrite happens before differentiation, in the stage ``fusion.stages.layer_norm``
(Keras ``LayerNormalization`` -> ``FusedBatchNormV3`` on the rows). This pass finds the stage's
``FusedBatchNormV3`` nodes under its name scope in the traced graph (and their gradients) and
reports them as observed; layers the stage declined were recorded by the stage itself.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.patterns.layer_norm import find_layer_norm_nodes
    >>> @tf.function
    ... def f(x):
    ...     with tf.name_scope("tfmx_layer_norm"):
    ...         return tf.nn.relu(x)
    >>> g = f.get_concrete_function(tf.TensorSpec([2])).graph.as_graph_def()
    >>> find_layer_norm_nodes(GraphView(g.node))
    []
"""

from __future__ import annotations

import re

from fusion.graph import GraphView
from fusion.pattern import RewriteContext, register
from fusion.stages.layer_norm import LABEL, SCOPE

_IN_SCOPE = re.compile(r"(^|/)" + SCOPE + r"(_\d+)?/")


def find_layer_norm_nodes(view: GraphView) -> list[str]:
    """Names of the ``FusedBatchNormV3`` nodes the layer_norm stage emitted in ``view``."""
    return [n.name for n in view.nodes()
            if n.op == "FusedBatchNormV3" and _IN_SCOPE.search(n.name)
            and not n.name.startswith(("gradient_tape/", "gradients/"))]


@register(
    "layer_norm",
    "Keras LayerNormalization, rewritten before differentiation by the layer_norm stage "
    "(fusion.stages.layer_norm): its FusedBatchNormV3 nodes found and reported as observed",
)
def layer_norm_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Observe the layer norms the stage fused in ``view``."""
    for _ in find_layer_norm_nodes(view):
        ctx.stats.observe(LABEL)
