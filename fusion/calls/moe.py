"""The moe stage: keras_hub's mixtures of experts, their expert projections merged, their
top-k routing kept with the reason.

keras_hub's Mixtral and QwenMoe blocks route each token to ``top_k`` of ``num_experts``
experts (the router's ``Dense``, ``softmax``, ``top_k``, ``one_hot`` of the chosen experts
times their renormalized probabilities) and dispatch densely: every expert's SwiGLU runs on
every token as batched ``Einsum``s (``th,ehm->etm``, ``eti,eih->eth``), and the routing
weights (zero for the experts not chosen) sum their outputs. What this stage does with each:

- **the experts' gate and up projections** (``MixtralMoeExperts``: two ``th,ehm->etm``
  products of the same tokens by two kernels): the form ``merged gate up`` computes them as
  one ``Einsum`` of the kernels concatenated on their output axis and a ``Split`` (QwenMoe's
  experts hold their kernels so already: nothing left to merge there). Its gradient is one
  ``Einsum`` for the tokens and one for the concatenated kernel instead of two each. The same
  dot products, each over the hidden axis: within the kernels' rounding. Each call is a tuner
  decision (forward and backward at its shapes) against keras_hub's call, the conservative
  form.
- **the routing** (``MixtralSparseMoeBlock``, ``QwenSparseMoeBlock``): kept as keras_hub
  writes it, and said in the report. Its ops are small (``[tokens, experts]``); the cost of
  the dense dispatch is the ``num_experts / top_k`` times the expert products a sparse one
  would compute, and a sparse dispatch gathers each expert's tokens in counts known only when
  the step runs: shapes that change with the data, which no form of this stage takes.

Declined, with the reason in the report: inputs that are not float32, float16 or bfloat16,
tokens that are not a matrix ``[tokens, hidden]``, kernels of another layout.

Example:
    >>> import numpy as np, tensorflow as tf
    >>> from fusion.calls.moe import experts_merged, experts_separate
    >>> x = tf.random.normal([6, 4], seed=1)
    >>> gate, up, out = (tf.random.normal(s, seed=i) for i, s in
    ...                  enumerate([[3, 4, 5], [3, 4, 5], [3, 5, 4]]))
    >>> a = experts_merged(x, gate, up, out, tf.nn.silu, "float32")
    >>> b = experts_separate(x, gate, up, out, tf.nn.silu, "float32")
    >>> a.shape, bool(np.allclose(a, b, rtol=1e-5, atol=1e-5))
    (TensorShape([3, 6, 4]), True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from fusion.family import OBSERVED_AFTER, OBSERVED_ORDER, Family, Form, Forms, conservative, declare
from fusion.stage import CallSite, Hook, StageContext, rewrite_call, timed_form

# -- match: the keras_hub calls it hooks, and what it finds in them --------------------------------
FAMILY = "moe"
SCOPE = "tfmx_moe"
_MIXTRAL = "keras_hub.src.models.mixtral.mixtral_decoder"
_QWEN_MOE = "keras_hub.src.models.qwen_moe.qwen_moe_decoder"
MATCHES = (
    f"{_MIXTRAL}:MixtralMoeExperts.call",
    f"{_MIXTRAL}:MixtralSparseMoeBlock.call",
    f"{_QWEN_MOE}:QwenSparseMoeBlock.call",
)
"""The keras_hub calls the stage hooks: Mixtral's expert bank (its gate and up projections),
and Mixtral's and QwenMoe's blocks (their routing)."""

ROUTING = ("top-k routing kept as keras_hub writes it (router softmax, top_k, one_hot, every "
           "expert's output weighted and summed: dense dispatch, {experts} experts computed "
           "for top-{k}): a sparse dispatch would gather each expert's tokens in counts known "
           "only when the step runs, shapes that change with the data, which no form of tfmx's "
           "takes")
"""The reason the routing stays, as the report says it."""


# -- check: why a call keeps Keras's own form (None: it need not) ---------------------------------
def check(tokens: Any, gate: Any, up: Any) -> str | None:
    """Why this expert bank keeps keras_hub's two gate and up products, or None.

    >>> check(tf.zeros([6, 4]), tf.zeros([3, 4, 5]), tf.zeros([3, 4, 5])) is None
    True
    >>> check(tf.zeros([2, 6, 4]), tf.zeros([3, 4, 5]), tf.zeros([3, 4, 5]))
    'tokens of rank 3, not [tokens, hidden]'
    """
    if not tf.is_tensor(tokens):
        return "tokens that are not a tensor"
    if tokens.dtype.name not in ("float32", "float16", "bfloat16"):
        return f"input dtype {tokens.dtype.name}"
    if tokens.shape.rank != 2:
        return f"tokens of rank {tokens.shape.rank}, not [tokens, hidden]"
    if (gate.shape.rank != 3 or tuple(gate.shape) != tuple(up.shape)
            or gate.shape[1] != tokens.shape[-1]):
        return "gate and up kernels not both [experts, hidden, intermediate]"
    return None


def check_routing(layer: Any) -> str:
    """Why a block's routing keeps keras_hub's form: always (see :data:`ROUTING`).

    >>> class Block:
    ...     num_experts, top_k = 8, 2
    >>> check_routing(Block()).startswith("top-k routing kept")
    True
    """
    return ROUTING.format(experts=getattr(layer, "num_experts", "?"),
                          k=getattr(layer, "top_k", "?"))


# -- forms: what it emits (CONSERVATIVE: the form Keras runs), and the hook's flow ----------------
CONSERVATIVE = conservative("separate", "keras_hub's gate and up products of every expert")
MERGED = Form("merged gate up", "MoE experts: gate and up projections as one Einsum of the "
                                "concatenated kernels and a Split",
              marks=frozenset({"Split"}), emits=frozenset({"ConcatV2", "Einsum", "Split"}))
FORMS = Forms(SCOPE, (CONSERVATIVE, MERGED))
"""Every form, emitted under ``tfmx_moe_<form>``."""


def _silu_in(activation: Callable[[Any], Any], gate: Any, dtype: Any) -> Any:
    # keras_hub's Mixtral: the activation in float32, back to the compute dtype
    from keras import ops

    return ops.cast(activation(ops.cast(gate, "float32")), dtype)


def experts_separate(tokens: Any, gate: Any, up: Any, out: Any,
                     activation: Callable[[Any], Any], dtype: Any) -> Any:
    """keras_hub's ``MixtralMoeExperts.call`` on tensors: ``[experts, tokens, hidden]``."""
    from keras import ops

    g = _silu_in(activation, ops.einsum("th,ehm->etm", tokens, gate), dtype)
    hidden = ops.einsum("th,ehm->etm", tokens, up) * g
    return ops.einsum("eti,eih->eth", hidden, out)


def experts_merged(tokens: Any, gate: Any, up: Any, out: Any,
                   activation: Callable[[Any], Any], dtype: Any) -> Any:
    """The same experts, the gate and up products as one ``Einsum`` of the kernels
    concatenated on their output axis, split after."""
    from keras import ops

    both = ops.einsum("th,ehm->etm", tokens, ops.concatenate([gate, up], axis=-1))
    g, u = ops.split(both, 2, axis=-1)
    return ops.einsum("eti,eih->eth", u * _silu_in(activation, g, dtype), out)


def _kernels(layer: Any) -> tuple[Any, Any, Any]:
    from keras import ops

    # read inside the layer's call: a mixed-precision policy's cast applies
    return tuple(ops.convert_to_tensor(v) for v in (
        layer._expert_feedforward_gate_dense,  # noqa: SLF001
        layer._expert_feedforward_intermediate_dense,  # noqa: SLF001
        layer._expert_feedforward_output_dense))  # noqa: SLF001


def fused_experts(ctx: StageContext, original: Callable, layer: Any, hidden_states: Any) -> Any:
    """``MixtralMoeExperts.call`` while tfmx traces (the stage's handler)."""
    def keras() -> Any:
        return original(layer, hidden_states)

    if not tf.inside_function():
        return keras()
    tokens = tf.convert_to_tensor(hidden_states)
    gate, up, out = _kernels(layer)
    why = check(tokens, gate, up)
    dtype = tokens.dtype

    def emit(form: Form) -> Any:
        return experts_merged(tokens, gate, up, out, layer.activation, dtype)

    def signature() -> str:
        from fusion.fragment import shape_text

        return (f"Mixtral experts tokens {shape_text(tokens.shape)} gate/up "
                f"{shape_text(gate.shape)} {dtype.name}")

    def candidates() -> dict:
        shapes = [t.shape for t in (tokens, gate, up, out)]

        def timed(fn: Callable[..., Any]) -> Any:
            return timed_form(lambda x, g, u, o: fn(x, g, u, o, layer.activation, dtype),
                              shapes, dtype)

        return {CONSERVATIVE.name: timed(experts_separate), MERGED.name: timed(experts_merged)}

    return rewrite_call(ctx, CallSite(
        DECLARED, () if why else (MERGED,), keras=keras, emit=emit, what="MoE experts",
        why=why, dtype=dtype, signature=signature, candidates=candidates))


def routed_block(ctx: StageContext, original: Callable, layer: Any, *args: Any,
                 **kwargs: Any) -> Any:
    """A sparse MoE block's ``call`` while tfmx traces: keras_hub's, its routing reported as
    kept (:func:`check_routing`); its expert bank's call is this stage's too."""
    def keras() -> Any:
        return original(layer, *args, **kwargs)

    if not tf.inside_function():
        return keras()
    return rewrite_call(ctx, CallSite(
        DECLARED, (), keras=keras, emit=lambda form: keras(), what=type(layer).__name__,
        why=check_routing(layer)))


# -- declaration ----------------------------------------------------------------------------------
DECLARED = declare(Family(
    FAMILY,
    "keras_hub mixtures of experts: Mixtral's expert gate and up projections as one Einsum of "
    "the concatenated kernels; the top-k routing (dense dispatch) kept, with the reason",
    hooks=(Hook.on(MATCHES[0], fused_experts), Hook.on(MATCHES[1], routed_block),
           Hook.on(MATCHES[2], routed_block)),
    forms=FORMS,
    after=OBSERVED_AFTER, order=OBSERVED_ORDER,
))
