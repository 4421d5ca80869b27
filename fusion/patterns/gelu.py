"""The gelu family's GraphDef pass: what the gelu stage emitted, observed.

The rewrite happens before differentiation, in the stage ``fusion.stages.gelu`` (GELU with its
derivative in closed form, or one XLA region). This pass finds the stage's units under their
name scopes in the traced graph and reports them as observed (the closed form by its ``Erf``
or ``Tanh``, the region by its call); the GELUs the stage declined were recorded by the stage.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.patterns.gelu import find_gelu_units
    >>> @tf.function
    ... def f(x):
    ...     with tf.name_scope("tfmx_gelu_custom"):
    ...         return tf.math.erf(x)
    >>> g = f.get_concrete_function(tf.TensorSpec([2])).graph.as_graph_def()
    >>> find_gelu_units(GraphView(g.node))
    [('tfmx_gelu_custom/', 'custom')]
"""

from __future__ import annotations

from fusion.graph import GraphView
from fusion.pattern import RewriteContext, register
from fusion.stage import XLA, XLA_CALLS, emitted_units
from fusion.stages.gelu import LABELS, SCOPE, SLOPE_KEPT

_MARKS = {"custom": frozenset({"Erf", "Tanh"}), "custom erfc": frozenset({"Erfc"}),
          "custom upcast": frozenset({"Erf", "Erfc", "Tanh"}),
          SLOPE_KEPT: frozenset({"Erf", "Erfc", "Tanh"}), XLA: XLA_CALLS}


def find_gelu_units(view: GraphView) -> list[tuple[str, str]]:
    """(scope, form) of every GELU the stage emitted in ``view`` whose form's op is there."""
    return emitted_units(view, SCOPE, _MARKS)


@register(
    "gelu",
    "Keras GELU in training, rewritten before differentiation by the gelu stage "
    "(fusion.stages.gelu): its units found and reported as observed",
)
def gelu_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Observe the GELUs the stage rewrote in ``view``."""
    for _, form in find_gelu_units(view):
        ctx.stats.observe(LABELS[form])
