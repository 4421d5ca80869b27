"""The bias_row family's GraphDef pass: what the bias_row stage emitted, observed.

The rewrite happens before differentiation, in the stage ``fusion.stages.bias_row`` (a Keras
``Dense``'s bias as one more row of its kernel: one MatMul forward, one for the kernel's and
the bias's gradients, where the tuner measured it faster). This pass finds the stage's MatMuls
under their name scope in the traced graph and reports them as observed; calls the stage
declined were recorded by the stage itself.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.patterns.bias_row import find_bias_row_units
    >>> @tf.function
    ... def f(x):
    ...     with tf.name_scope("tfmx_dense_bias_row"):
    ...         return tf.matmul(x, x)
    >>> g = f.get_concrete_function(tf.TensorSpec([2, 2])).graph.as_graph_def()
    >>> find_bias_row_units(GraphView(g.node))
    [('tfmx_dense_bias_row/', 'bias row')]
"""

from __future__ import annotations

from fusion.graph import GraphView
from fusion.pattern import RewriteContext, register
from fusion.stage import emitted_units
from fusion.stages.bias_row import FORM, LABEL, SCOPE

_MARKS = {FORM: frozenset({"MatMul", "_FusedMatMul"})}


def find_bias_row_units(view: GraphView) -> list[tuple[str, str]]:
    """(scope, form) of every Dense the stage emitted in ``view`` whose MatMul is there."""
    return emitted_units(view, SCOPE, _MARKS)


@register(
    "bias_row",
    "Keras Dense with a bias as one MatMul of the input widened by a column of ones, the bias "
    "a row of the kernel, emitted before differentiation by the bias_row stage "
    "(fusion.stages.bias_row) where measured faster: its MatMuls found and reported as observed",
)
def bias_row_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Observe the Dense calls the stage rewrote in ``view``."""
    for _ in find_bias_row_units(view):
        ctx.stats.observe(LABEL)
