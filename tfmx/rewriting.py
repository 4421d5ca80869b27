"""The GraphDef rewrite of one traced function under tfmx's options.

:func:`rewrite_traced` is what a traced step is rewritten with (``tfmx.fused_function``) and
what a stage's timed candidate is run through (``tfmx.staging.fragment_passes``): both import
it from here.

Example:
    >>> import tensorflow as tf, tfmx
    >>> from fusion.graph import op_histogram
    >>> from tfmx import state
    >>> w, b = tf.Variable(tf.ones([3, 2])), tf.Variable(tf.zeros([2]))
    >>> @tf.function
    ... def layer(x):
    ...     return tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w), b))
    >>> tfmx.enable(backend="cpu")
    >>> result = rewrite_traced(layer.get_concrete_function(tf.TensorSpec([1, 3])),
    ...                         state.options())
    >>> result.changed, op_histogram(result.graph_def)["_FusedMatMul"]
    (True, 1)
    >>> tfmx.disable()
"""

from __future__ import annotations

from typing import Any

from fusion.pipeline import RewriteResult, rewrite
from tfmx import state
from tfmx.rebuild import control_output_names, protected_names


def rewrite_traced(concrete: Any, opts: state.Options, graph_def: Any = None) -> RewriteResult:
    """:func:`fusion.rewrite` of one traced function under ``opts`` (a
    ``fusion.pipeline.RewriteResult``): its graph (``graph_def`` where already taken, with
    shapes), its protected names and control outputs, the tuner's choices.

    >>> import tensorflow as tf, tfmx
    >>> from tfmx import state
    >>> concrete = tf.function(lambda x: x * 2.0).get_concrete_function(tf.TensorSpec([2]))
    >>> tfmx.enable(backend="cpu")
    >>> rewrite_traced(concrete, state.options()).changed  # nothing to fuse
    False
    >>> tfmx.disable()
    """
    return rewrite(
        graph_def or concrete.graph.as_graph_def(add_shapes=True),
        opts.backend,
        opts.patterns,
        protected_names(concrete),
        control_output_names(concrete),
        # a plan for a backend this machine lacks cannot be measured: every rewrite shown
        tuner=state.tuner() if opts.backend.available else None,
    )


__all__ = ["rewrite_traced"]
