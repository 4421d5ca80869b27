"""The feed_forward stage: a transformer's feed-forward block as one XLA region, where measured.

A Keras ``Dense(d_ff, activation)`` on ``[batch, tokens, features]`` whose output is read by
one ``Dense`` alone (the FFN of a transformer block: ``Dense(512, "gelu")`` then
``Dense(128)``) may run as one function compiled by XLA (``fusion.stage.xla_region``; its
gradient compiled too): both MatMuls, both biases and the activation with its derivative,
XLA fusing the elementwise work into its dots' loops. Whether that is faster than the two
layers as TensorFlow runs them (oneDNN's MatMuls, the gelu stage's GELU) depends on the
machine's XLA dots against its oneDNN ones, so it is a tuner decision per block (forward and
backward at the block's shapes), offered on cpu and cuda with ``tfmx.enable(xla=True)`` and
never on metal; the conservative form is the two layers. Where XLA's CPU dots are slower than
oneDNN's the two layers win (see BENCHMARKS.md).

The first ``Dense`` runs as Keras traces it and leaves its input with its output in the traced
graph's state (``fusion.trace_state``); the second, finding its input there, emits the region
from that input when the tuner picks it, and the first's output, then read by nobody, is pruned
from the step.

Example:
    >>> import keras, numpy as np, tensorflow as tf
    >>> from fusion.calls.feed_forward import find_feed_forward
    >>> inp = keras.Input((4, 8))
    >>> up, down = keras.layers.Dense(16, activation="gelu"), keras.layers.Dense(8)
    >>> model = keras.Model(inp, down(up(inp)))
    >>> find_feed_forward(up)
    (True, None)
    >>> find_feed_forward(down)
    (False, 'no activation between the two Dense layers')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import execute

from fusion import private_api, trace_state
from fusion.family import OBSERVED_AFTER, OBSERVED_ORDER, Family, Form, Forms, conservative, declare
from fusion.stage import (
    XLA,
    XLA_CALLS,
    CallSite,
    Hook,
    StageContext,
    functional_neighbours,
    rewrite_call,
    timed_form,
    tracing,
    xla_region,
)

# -- match: the Keras calls it hooks, and what it finds in them -----------------------------------
FAMILY = "feed_forward"
SCOPE = "tfmx_feed_forward"
MATCHES = ("keras.src.layers.core.dense:Dense.call",)
"""The Keras call the stage hooks: a ``Dense`` layer's (two of them: a feed-forward block)."""


def find_feed_forward(layer: Any) -> tuple[bool, str | None]:
    """(True, None) when ``layer`` is the first ``Dense`` of a feed-forward block: called once
    in a Keras functional graph, with an activation, its output read by one ``Dense`` called
    once; else (False, why). Subclassed models trace their layers with no such graph: their
    blocks are not seen.
    """
    Dense = private_api.get("keras.Dense")

    if getattr(layer, "activation", None) is None or layer.activation.__name__ == "linear":
        return False, "no activation between the two Dense layers"
    around = functional_neighbours(layer)
    readers = around[1] if around is not None else []
    if (len(readers) != 1 or not isinstance(readers[0], Dense)
            or functional_neighbours(readers[0]) is None):
        return False, ("its output is not read by one Dense alone, or a Dense is called more "
                       "than once")
    return True, None


# -- check: why a call keeps Keras's own form (None: it need not) ---------------------------------
def check(layer: Any) -> str | None:
    """Why ``layer`` does not start a feed-forward block the stage can emit as one region
    (:func:`find_feed_forward`), or None.

    >>> import keras
    >>> check(keras.layers.Dense(4))
    'no activation between the two Dense layers'
    """
    return find_feed_forward(layer)[1]


# -- forms: what it emits (CONSERVATIVE: the form Keras runs), and the hook's flow ----------------
CONSERVATIVE = conservative("separate", "the two layers")
"""The two layers as Keras runs them."""
REGION = Form(XLA, "Dense(activation) -> Dense: one XLA-compiled region (forward and gradient)",
              marks=XLA_CALLS)
"""The block as one XLA region, emitted under ``tfmx_feed_forward_xla``: its region's call
shows it in a traced graph; it emits no op a backend's kernel table decides (the region is
XLA's, offered only where the trace allows XLA)."""
FORMS = Forms(SCOPE, (CONSERVATIVE, REGION))


def fused_dense_call(ctx: StageContext, original: Callable, layer: Any, inputs: Any,
                     training: Any = None) -> Any:
    """``Dense.call`` while tfmx traces with XLA allowed: the first Dense of a feed-forward block
    leaves its input in the graph's state; the second emits both layers as one XLA region where
    the tuner measures it faster than the two layers (timed with the gelu stage's closed form
    between them where that stage is on), else runs as Keras runs it."""
    if not ctx.xla or not tf.inside_function() or not execute.must_record_gradient():
        return original(layer, inputs, training=training)
    inputs = tf.convert_to_tensor(inputs)
    # the first Dense calls of blocks: their output's ``ref()`` -> (layer, input)
    pending = trace_state.slot(tf.compat.v1.get_default_graph(), FAMILY)
    first = pending.pop(inputs.ref(), None)
    if first is None:
        out = original(layer, inputs, training=training)
        rank = inputs.shape.rank
        if rank is not None and rank >= 3 and check(layer) is None:
            pending[out.ref()] = (layer, inputs)
        return out
    return _block(ctx, original, first, layer, inputs)


def _block(ctx: StageContext, original: Callable, first: tuple[Any, tf.Tensor], second: Any,
           hidden: tf.Tensor) -> Any:
    from fusion.fragment import shape_text

    up, x = first
    variables = [*up.trainable_variables, *second.trainable_variables]

    def both(v: Any) -> Any:
        return original(second, original(up, v))

    def separate(v: Any) -> Any:  # as the step runs them: the gelu stage's GELU between them
        quiet = dataclasses.replace(ctx, chooser=None, record=lambda family, stats: None,
                                    families=("gelu",) if ctx.wants("gelu") else ())
        with tracing(quiet):
            return both(v)

    def candidates() -> dict:
        return {CONSERVATIVE.name: timed_form(separate, [x.shape], x.dtype, variables),
                REGION.name: timed_form(xla_region(both), [x.shape], x.dtype, variables)}

    activation = up.activation.__name__
    signature = (f"feed-forward input {shape_text(x.shape)} {x.dtype.name}: Dense({up.units}, "
                 f"{activation}) -> Dense({second.units}, {second.activation.__name__})")
    return rewrite_call(ctx, CallSite(
        DECLARED, (REGION,), keras=lambda: original(second, hidden),
        emit=lambda form: xla_region(both)(x), what="feed-forward", dtype=x.dtype,
        signature=lambda: signature, candidates=candidates))


# -- declaration ----------------------------------------------------------------------------------
DECLARED = declare(Family(
    FAMILY,
    "Keras Dense(activation) -> Dense on tokens (a transformer's FFN) -> one XLA-compiled "
    "region (forward and gradient), where measured faster than the two layers",
    # outer: it sees both Dense layers of a block before a stage rewrites either one
    hooks=(Hook.on(MATCHES[0], fused_dense_call, outer=1),),
    forms=FORMS,
    after=OBSERVED_AFTER, order=OBSERVED_ORDER,
))
