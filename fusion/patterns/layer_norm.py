"""The layer_norm family's GraphDef pass: what the layer_norm stage emitted, observed.

The rewrite happens before differentiation, in the stage ``fusion.stages.layer_norm``
(Keras ``LayerNormalization`` -> ``FusedBatchNormV3`` on the rows, or a closed-form custom
gradient). This pass finds the stage's units under their name scopes in the traced graph and
reports them as observed (the custom-gradient form by its Rsqrt); layers the stage declined
were recorded by the stage itself.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.patterns.layer_norm import find_layer_norm_units
    >>> @tf.function
    ... def f(x):
    ...     with tf.name_scope("tfmx_layer_norm_custom"):
    ...         return tf.math.rsqrt(x)
    >>> g = f.get_concrete_function(tf.TensorSpec([2])).graph.as_graph_def()
    >>> find_layer_norm_units(GraphView(g.node))
    [('tfmx_layer_norm_custom/', 'custom')]
"""

from __future__ import annotations

from fusion.graph import GraphView
from fusion.pattern import RewriteContext, register
from fusion.stage import XLA_CALLS, emitted_units
from fusion.stages.layer_norm import LABELS, ONEDNN_16, SCOPE, XLA_GRADIENT

_KERNELS = {"fused": frozenset({"FusedBatchNormV3"}), "custom": frozenset({"Rsqrt"}),
            "onednn": frozenset({"_MklLayerNorm"}), ONEDNN_16: frozenset({"_MklLayerNorm"})}
_MARKS = {**_KERNELS, **{name + XLA_GRADIENT: ops for name, ops in _KERNELS.items()},
          "rms custom": frozenset({"Rsqrt"}), "rms custom" + XLA_GRADIENT: frozenset({"Rsqrt"}),
          "xla": XLA_CALLS, "rms xla": XLA_CALLS,
          "residual xla": XLA_CALLS, "rms residual xla": XLA_CALLS}


def find_layer_norm_units(view: GraphView) -> list[tuple[str, str]]:
    """(scope, form) of every layer or RMS norm the stage emitted in ``view`` whose form's op
    is there (``FusedBatchNormV3`` for the fused form, the ``Rsqrt`` of the custom ones, the
    call of an XLA region)."""
    return emitted_units(view, SCOPE, _MARKS)


@register(
    "layer_norm",
    "Keras LayerNormalization, rewritten before differentiation by the layer_norm stage "
    "(fusion.stages.layer_norm): its units found and reported as observed",
)
def layer_norm_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Observe the layer norms the stage rewrote in ``view``."""
    for _, form in find_layer_norm_units(view):
        ctx.stats.observe(LABELS[form])
