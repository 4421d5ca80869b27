"""Walking a model's layers and reading or setting their policies (helpers shared by the rest).

Example:
    >>> import keras
    >>> from policies.layers import iter_layers, policy_name
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> [(layer.name.split("_")[0], policy_name(layer)) for layer in iter_layers(model)]
    [('dense', 'float32')]
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import tfmx.state


class LayerCall(NamedTuple):
    """What a layer was called with when it takes more than one positional input, or keyword
    arguments (``MultiHeadAttention(query, value, attention_mask=...)``): the values, laid out
    as the call was. A single tensor input stays a plain tensor.

    >>> call = LayerCall((1, 2), {"use_causal_mask": True})
    >>> call_layer(lambda *a, **k: (a, k), call, training=True)
    ((1, 2), {'use_causal_mask': True, 'training': True})
    """

    args: tuple
    kwargs: dict


def call_layer(layer: Any, inputs: Any, training: bool) -> Any:
    """``layer`` called on ``inputs`` (a tensor, a structure of them, or a :class:`LayerCall`).

    >>> call_layer(lambda x, training: (x, training), 1, training=False)
    (1, False)
    """
    if isinstance(inputs, LayerCall):
        return layer(*inputs.args, **{**inputs.kwargs, "training": training})
    return layer(inputs, training=training)


def as_tensors(inputs: Any) -> Any:
    """``inputs`` with every array-like value a tensor (Python flags of a call stay as they are).

    >>> import numpy as np
    >>> [type(v).__name__ for v in as_tensors([np.ones(2), True])]
    ['EagerTensor', 'bool']
    """
    import numpy as np
    import tensorflow as tf

    return tf.nest.map_structure(
        lambda v: tf.convert_to_tensor(v) if isinstance(v, (np.ndarray, tf.Tensor)) else v,
        inputs)


def iter_layers(model: Any) -> Iterator[Any]:
    """Every layer inside ``model`` (nested ones too), without Input layers and sub-models.

    >>> import keras
    >>> inner = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="inner_dense")])
    >>> model = keras.Sequential([keras.Input((2,)), inner, keras.layers.Dense(1, name="top")])
    >>> [layer.name for layer in iter_layers(model)]
    ['inner_dense', 'top']
    """
    import keras

    flatten = getattr(model, "_flatten_layers", None)
    layers = flatten(include_self=False, recursive=True) if flatten else list(model.layers)
    for layer in layers:
        if isinstance(layer, keras.layers.InputLayer) or isinstance(layer, keras.Model):
            continue
        yield layer


def policy_name(layer: Any) -> str:
    """The name of the policy ``layer`` computes under ("float32", "mixed_bfloat16", ...).

    >>> import keras
    >>> policy_name(keras.layers.Dense(1, dtype="mixed_bfloat16"))
    'mixed_bfloat16'
    """
    return layer.dtype_policy.name


def set_policy(layer: Any, name: str) -> None:
    """Give ``layer`` policy ``name``; later calls (and traces) compute in it.

    >>> import keras
    >>> layer = keras.layers.Dense(1)
    >>> set_policy(layer, "mixed_float16")
    >>> layer.compute_dtype, layer.variable_dtype
    ('float16', 'float32')
    """
    layer.dtype_policy = name


def is_low_precision(layer: Any) -> bool:
    """True if ``layer`` computes in float16 or bfloat16.

    >>> import keras
    >>> is_low_precision(keras.layers.Dense(1, dtype="mixed_bfloat16"))
    True
    """
    return layer.compute_dtype in ("float16", "bfloat16")


def output_layers(model: Any) -> list[Any]:
    """The layers producing ``model``'s outputs (Functional and Sequential; [] if unknown).

    >>> import keras
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2),
    ...                           keras.layers.Dense(1, name="out")])
    >>> [layer.name for layer in output_layers(model)]
    ['out']
    """
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        return []
    found = []
    for tensor in outputs or []:
        history = getattr(tensor, "_keras_history", None)
        op = history[0] if history else None
        while op is not None and hasattr(op, "outputs") and hasattr(op, "_flatten_layers"):
            # A nested model produces the output: its own last layer is the output layer.
            inner = output_layers(op)
            op = inner[0] if inner else None
            break
        if op is not None and op not in found:
            found.append(op)
    return found


def weighted(layer: Any) -> bool:
    """True if ``layer`` holds trainable weights of its own (Dense, Conv, LSTM...).

    >>> import keras
    >>> dense, relu = keras.layers.Dense(1), keras.layers.ReLU()
    >>> dense.build((None, 2)); relu.build((None, 2))
    >>> weighted(dense), weighted(relu)
    (True, False)
    """
    return bool(layer.trainable_weights)


def layer_step(layer: Any, fused: bool = False) -> Any:
    """A ``tf.function``: one training-mode forward of ``layer`` and the gradient of its summed
    output w.r.t. its weights and floating inputs; returns ``(output, gradients)``. With
    ``fused`` and tfmx enabled, a callable running the same function as tfmx rewrites it (its
    stages and passes, as the training step will run), traced for the first inputs it is
    given and called without the whole-step guard.

    The layer's policy is read when the function is traced (on its first call).

    >>> import keras, numpy as np
    >>> out, grads = layer_step(keras.layers.Dense(2))(np.ones((1, 3), "float32"))
    >>> tuple(out.shape), [tuple(g.shape) for g in grads]  # kernel, bias, input
    ((1, 2), [(3, 2), (2,), (1, 3)])
    """
    import tensorflow as tf

    def step(x: Any) -> Any:
        floats = [t for t in tf.nest.flatten(x)
                  if isinstance(t, tf.Tensor) and t.dtype.is_floating]
        with tf.GradientTape() as tape:
            tape.watch(floats)
            out = call_layer(layer, x, training=True)
            total = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32))
                              for o in tf.nest.flatten(out)])
        grads = tape.gradient(total, [*layer.trainable_variables, *floats])
        return out, [g for g in grads if g is not None]

    options = tfmx.state.options()
    if not fused or options is None or not options.backend.available:
        return tf.function(step)
    step.__name__ = step.__qualname__ = f"policies_check_{layer.name}"
    rewritten = tfmx.function(step)
    traced: dict[str, Any] = {}

    def run(x: Any) -> Any:  # the rewritten ConcreteFunction itself: no guard trial
        if "fn" not in traced:
            traced["fn"] = rewritten.get_concrete_function(x)
        return traced["fn"](x)

    return run
