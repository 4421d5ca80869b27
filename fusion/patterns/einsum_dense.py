"""The einsum_dense family's GraphDef pass: what the einsum_dense stage emitted, observed.

The rewrite happens before differentiation, in the stage ``fusion.stages.einsum_dense``
(Keras ``EinsumDense`` -> ``Reshape`` + ``MatMul`` + ``BiasAdd``; a self-attention's three
projections -> one ``MatMul``). This pass finds the stage's
units under their name scope in the traced graph, the MatMul plain or already fused with its
bias by the contraction family, and reports them as observed; calls the stage declined were
recorded by the stage itself.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.patterns.einsum_dense import find_einsum_dense_units
    >>> @tf.function
    ... def f(x):
    ...     with tf.name_scope("tfmx_einsum_dense_matmul"):
    ...         return tf.matmul(x, x)
    >>> g = f.get_concrete_function(tf.TensorSpec([2, 2])).graph.as_graph_def()
    >>> find_einsum_dense_units(GraphView(g.node))
    [('tfmx_einsum_dense_matmul/', 'matmul')]
"""

from __future__ import annotations

from fusion.graph import GraphView
from fusion.pattern import RewriteContext, register
from fusion.stage import emitted_units
from fusion.stages.einsum_dense import LABELS, SCOPE

_MATMULS = frozenset({"MatMul", "_FusedMatMul"})
_MARKS = {form: _MATMULS for form in LABELS}


def find_einsum_dense_units(view: GraphView) -> list[tuple[str, str]]:
    """(scope, form) of every EinsumDense (``matmul``) or set of attention projections
    (``shared``; either with its bias as a row of the kernel: ``... bias row``) the stage
    emitted in ``view`` whose MatMul (plain or fused) is there."""
    return emitted_units(view, SCOPE, _MARKS)


@register(
    "einsum_dense",
    "Keras EinsumDense, rewritten before differentiation by the einsum_dense stage "
    "(fusion.stages.einsum_dense): its units found and reported as observed",
)
def einsum_dense_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Observe the EinsumDense calls the stage rewrote in ``view``."""
    for _, form in find_einsum_dense_units(view):
        ctx.stats.observe(LABELS[form])
