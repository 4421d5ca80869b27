"""Safe defaults on top of Keras's: what stays float32, and loss scaling for float16.

Keras already keeps BatchNormalization, LayerNormalization and GroupNormalization statistics
and the losses in float32. It does NOT keep the model's output layer or a softmax in float32
(the TensorFlow guide tells users to do it by hand), nor RMSNormalization and
UnitNormalization, and it adds loss scaling only when the whole model's policy is
"mixed_float16". :func:`make_safe` and :func:`wrap_optimizer` close those holes; the compile
hook (:mod:`policies.hook`) runs them on every model compiled while policies are in use.

Example:
    >>> import keras, policies
    >>> from policies.safety import make_safe
    >>> with policies.scope("mixed_bfloat16"):
    ...     model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
    ...                               keras.layers.Dense(4, activation="softmax")])
    >>> [change.split(":")[1].strip() for change in make_safe(model)]
    ['output layer (and softmax) in float32']
    >>> [layer.compute_dtype for layer in model.layers]
    ['bfloat16', 'float32']
"""

from __future__ import annotations

from typing import Any

from policies.layers import is_low_precision, iter_layers, output_layers, set_policy

# Normalization layers whose Keras implementation does not upcast to float32 itself.
NORMALIZATION_WITHOUT_UPCAST = ("RMSNormalization", "UnitNormalization")
# Normalization layers Keras already computes in float32 (inputs cast up, outputs cast back).
NORMALIZATION_WITH_UPCAST = ("BatchNormalization", "LayerNormalization", "GroupNormalization")
SOFTMAX_NAMES = ("softmax", "log_softmax")


def _activation_name(layer: Any) -> str | None:
    act = getattr(layer, "activation", None)
    if act is None:
        return None
    return getattr(act, "__name__", None) or type(act).__name__.lower()


def float32_reason(layer: Any, outputs: list[Any]) -> str | None:
    """Why ``layer`` must compute in float32 under a 16-bit policy, or None.

    >>> import keras
    >>> float32_reason(keras.layers.Dense(2, activation="softmax"), outputs=[])
    'softmax in float32'
    >>> float32_reason(keras.layers.Dense(2), outputs=[]) is None
    True
    """
    cls = type(layer).__name__
    if any(layer is o for o in outputs):
        return "output layer (and softmax) in float32" if _activation_name(layer) in \
            SOFTMAX_NAMES else "output layer in float32"
    if cls == "Softmax" or _activation_name(layer) in SOFTMAX_NAMES:
        return "softmax in float32"
    if cls in NORMALIZATION_WITHOUT_UPCAST:
        return "normalization statistics in float32"
    return None


def make_safe(model: Any) -> list[str]:
    """Put the layers that must stay float32 in float32; return what changed ("layer: why").

    Only layers computing in 16 bit are touched; variables are float32 under every mixed
    policy, so nothing is rebuilt. Works on built and unbuilt models.

    >>> import keras
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="out",
    ...                                                             dtype="mixed_bfloat16")])
    >>> make_safe(model)
    ['out: output layer in float32']
    """
    outputs = output_layers(model)
    changed = []
    for layer in iter_layers(model):
        if not is_low_precision(layer):
            continue
        why = float32_reason(layer, outputs)
        if why:
            set_policy(layer, "float32")
            changed.append(f"{layer.name}: {why}")
    return changed


def uses_float16(model: Any) -> bool:
    """True if any layer of ``model`` computes in float16 (loss scaling needed).

    >>> import keras
    >>> uses_float16(keras.Sequential([keras.layers.Dense(2, dtype="mixed_float16")]))
    True
    """
    return any(layer.compute_dtype == "float16" for layer in iter_layers(model)) or \
        getattr(getattr(model, "dtype_policy", None), "compute_dtype", None) == "float16"


def wrap_optimizer(optimizer: Any) -> Any:
    """``optimizer`` (a name, config or instance) inside a dynamic ``LossScaleOptimizer``.

    An optimizer already wrapped is returned as is.

    >>> import keras
    >>> type(wrap_optimizer("adam")).__name__
    'LossScaleOptimizer'
    """
    import keras

    opt = keras.optimizers.get(optimizer)
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        return opt
    return keras.optimizers.LossScaleOptimizer(opt, name="loss_scale_optimizer")


def loss_dtype(loss: Any) -> str | None:
    """The compute dtype of a Keras ``Loss`` object (None for names and plain functions).

    >>> import keras
    >>> loss_dtype(keras.losses.MeanSquaredError()), loss_dtype("mse")
    ('float32', None)
    """
    return getattr(loss, "dtype", None) if hasattr(loss, "call") else None
