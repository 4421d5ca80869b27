"""The squeeze_excite stage: a squeeze-and-excitation block trained as one region, its backward
in closed form or compiled by XLA.

EfficientNet (B0-B7, V2) and MobileNetV3 end most of their blocks with a squeeze-and-excitation:
a global average pool of the block's features ``x`` ([batch, H, W, C]), a 1x1 ``Conv2D`` (or a
``Dense``) reducing the channels with an activation (swish, relu), a second one expanding them
back with a gate (sigmoid; MobileNetV3's hard sigmoid ``relu6(z + 3) * (1 / 6)`` written with
layers; Keras's ``hard_sigmoid``), and the channel scale ``Multiply([x, gate])``. Keras runs it
as some ten layers on [batch, 1, 1, C] tensors, each a few small ops and their autodiff
gradients (Conv2D's backprop kernels on 1x1 images among them). This stage finds the block
where it ends, at the ``Multiply`` layer, in the Keras functional graph it was built in
(``keras.applications``' models and a user's functional block), and emits it from ``x``:

- ``custom``: the pool as a mean (in float32 for a 16-bit ``x``, as Keras's), the 1x1
  convolutions as MatMuls on [batch, channels], the activations as Keras computes them, and
  the backward in closed form from what the forward kept: the gate's gradient
  ``sum_HW(dy * x)``, through the gate (``SigmoidGrad``, ``Relu6Grad``) and the two MatMuls
  (each weight's and bias's gradient one MatMul or one sum), and
  ``dx = dy * gate + (the pooled path's gradient) / (H * W)`` broadcast over H and W: one
  product and one sum over the block's largest tensor;
- ``xla`` (cpu and cuda with ``tfmx.enable(xla=True)``, never metal): the same block as one
  XLA-compiled region, its gradient compiled too.

Which is fastest depends on the machine and the block's shapes, so every block is a tuner
decision (forward and backward at its shapes) against Keras's layers, the conservative form.
Keras's own layers before the ``Multiply`` have run by then; their outputs, read by nobody, are
pruned from the step. Without a gradient tape recording (inference) the stage leaves Keras's
call as it is. Declined, with the reason in the report: a block it cannot see (a subclassed
model's, a layer called twice), one whose parts it does not take (channels_first, a strided
or grouped convolution, another activation, a user's subclass of a layer, a tensor read
outside the block), and inputs of a dtype other than float32, float16 and bfloat16, with a
mask, or with unknown channels. Mixed precision runs in the layers' compute dtype.

Example:
    >>> import keras
    >>> from fusion.calls.squeeze_excite import find_block
    >>> inp = keras.Input((4, 4, 8))
    >>> se = keras.layers.GlobalAveragePooling2D(keepdims=True)(inp)
    >>> se = keras.layers.Conv2D(2, 1, activation="relu")(se)
    >>> se = keras.layers.Conv2D(8, 1, activation="sigmoid")(se)
    >>> scale = keras.layers.Multiply()
    >>> _ = keras.Model(inp, scale([inp, se]))
    >>> block, why = find_block(scale)
    >>> block.activation, block.gate, why
    ('relu', 'sigmoid', None)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import execute

from fusion import private_api
from fusion.family import OBSERVED_AFTER, OBSERVED_ORDER, Family, Form, Forms, conservative, declare
from fusion.platform import Platform
from fusion.stage import (
    XLA,
    XLA_CALLS,
    CallSite,
    Hook,
    StageContext,
    custom_gradient,
    functional_neighbours,
    layer_value,
    rewrite_call,
    timed_form,
    tracing,
    with_xla,
    xla_region,
)

# -- match: the Keras calls it hooks, and what it finds in them -----------------------------------
FAMILY = "squeeze_excite"
SCOPE = "tfmx_squeeze_excite"
MATCHES = ("keras.src.layers.merging.multiply:Multiply.call",)
"""The Keras call the stage hooks: a ``Multiply`` layer's (the channel scale that ends a
squeeze-and-excitation block)."""

ACTIVATIONS = ("relu", "silu")
"""The reduce's activations it takes (``"swish"`` is Keras's ``silu``)."""
GATES = ("sigmoid", "hard_sigmoid")
"""The expand's gates it takes as an activation; MobileNetV3's ``relu6(z + 3) * (1 / 6)``
written with layers is the gate ``"hard_sigmoid_layers"``."""


@dataclasses.dataclass(frozen=True)
class Block:
    """A squeeze-and-excitation block ending in a ``Multiply``: which of its two inputs is the
    features (``features``), Keras's nodes from the pool to the gate in call order
    (``chain``), the ``reduce`` and ``expand`` layers (``Conv2D`` 1x1 or ``Dense``), the
    reduce's ``activation`` (:data:`ACTIVATIONS`) and the ``gate``."""

    features: int
    chain: tuple[Any, ...]
    reduce: Any
    expand: Any
    activation: str
    gate: str

    @property
    def operations(self) -> list[Any]:
        """Every Keras layer and op of the block but the ``Multiply``."""
        return [node.operation for node in self.chain]


def _activation(op: Any) -> str:
    return getattr(getattr(op, "activation", None), "__name__", "")


def _is(op: Any, *names: str) -> bool:
    """``op``'s class is one of Keras's own ``names`` (``module:Class``), not a subclass."""
    return any(f"{type(op).__module__}:{type(op).__name__}" == name for name in names)


_CONV = "keras.src.layers.convolutional.conv2d:Conv2D"
_DENSE = "keras.src.layers.core.dense:Dense"
_POOL = "keras.src.layers.pooling.global_average_pooling2d:GlobalAveragePooling2D"
_RESHAPE = "keras.src.layers.reshaping.reshape:Reshape"
_ACT = "keras.src.layers.activations.activation:Activation"
_RELU = "keras.src.layers.activations.relu:ReLU"
_ADD, _MUL = "keras.src.ops.numpy:Add", "keras.src.ops.numpy:Multiply"


def _pointwise(op: Any) -> str | None:
    """Why ``op`` is not a reduce or expand the stage takes (a 1x1 ``Conv2D``, channels last,
    unit strides, no groups; or a ``Dense``), or None."""
    if getattr(op, "quantization_mode", None):
        return f"{op.name} is quantized"
    if _is(op, _DENSE):
        return None
    if not _is(op, _CONV):
        return f"{op.name} ({type(op).__name__}) is neither a Conv2D nor a Dense"
    if op.data_format != "channels_last":
        return f"{op.name} is channels_first"
    if tuple(op.kernel_size) != (1, 1) or tuple(op.strides) != (1, 1) or op.groups != 1 \
            or tuple(op.dilation_rate) != (1, 1):
        return f"{op.name} is not a 1x1 convolution with unit strides and no groups"
    return None


def _relu(op: Any, top: float | None) -> bool:
    return (_is(op, _RELU) and op.max_value == top and not op.negative_slope
            and not op.threshold)


def _constant(node: Any, value: float) -> bool:
    """``node`` is a Keras op of one tensor and the constant ``value`` (``t + 3.0``)."""
    args = node.arguments.args
    return len(args) == 2 and not node.arguments.kwargs and isinstance(args[1], float) and \
        abs(args[1] - value) < 1e-12


def _producer(tensor: Any) -> tuple[Any, Any] | str:
    """(the Keras operation that made ``tensor``, its node) where it is called once, reads one
    tensor and is read by one node alone; else why not."""
    history = getattr(tensor, "_keras_history", None)
    op = getattr(history, "operation", None)
    if op is None:
        return "a tensor of the block is a model input"
    if len(op._inbound_nodes) != 1 or len(op._outbound_nodes) != 1:
        return f"{op.name} is called more than once or read outside the block"
    node = op._inbound_nodes[0]
    if len(node.input_tensors) != 1:
        return f"{op.name} reads more than one tensor"
    return op, node


def _walk(gate: Any, features: Any) -> tuple[Block | None, str | None]:
    """The block whose gate is the Keras tensor ``gate`` and whose pool reads ``features``
    (:class:`Block`, its ``features`` index left 0), or (None, why)."""
    chain, stack = [], []
    tensor = gate
    while True:
        found = _producer(tensor)
        if isinstance(found, str):
            return None, found
        op, node = found
        chain.insert(0, node)
        stack.append(op)
        tensor = node.input_tensors[0]
        if _is(op, _POOL):
            break
        if len(chain) > 9:
            return None, "no GlobalAveragePooling2D within nine layers of the gate"
    pool = stack.pop()
    if pool.data_format != "channels_last":
        return None, "the pool is channels_first"
    if tensor is not features:
        return None, "the pool reads another tensor than the one the Multiply scales"
    ops = [op for op in stack if not _is(op, _RESHAPE)]
    channels = getattr(features, "shape", (None,))[-1]
    for op in stack:
        if _is(op, _RESHAPE) and tuple(op.target_shape) not in ((1, 1, channels), (channels,)):
            return None, f"{op.name} reshapes to {tuple(op.target_shape)}"
    # from the gate back: its gate, the expand, the activation, the reduce
    if len(ops) >= 3 and _is(ops[0], _MUL) and _constant(ops[0]._inbound_nodes[0], 1 / 6) \
            and _relu(ops[1], 6.0) and _is(ops[2], _ADD) \
            and _constant(ops[2]._inbound_nodes[0], 3.0):
        gate_kind, rest, linear = "hard_sigmoid_layers", ops[3:], True
    elif ops and _is(ops[0], _ACT) and _activation(ops[0]) in GATES:
        gate_kind, rest, linear = _activation(ops[0]), ops[1:], True
    elif ops and _activation(ops[0]) in GATES:
        gate_kind, rest, linear = _activation(ops[0]), ops, False  # the expand's own
    else:
        return None, "the gate is not a sigmoid or a hard sigmoid"
    if len(rest) == 3 and (_relu(rest[1], None) or (
            _is(rest[1], _ACT) and _activation(rest[1]) in ACTIVATIONS)):
        activation = "relu" if _relu(rest[1], None) else _activation(rest[1])
        expand, reduce = rest[0], rest[2]
    elif len(rest) == 2:
        (expand, reduce), activation = rest, _activation(rest[1])
    else:
        return None, "the block is not pool, reduce, activation, expand, gate"
    for op in (expand, reduce):
        why = _pointwise(op)
        if why is not None:
            return None, why
    # a layer whose activation is a separate layer after it has none of its own
    for op in [expand] * linear + [reduce] * (len(rest) == 3):
        if _activation(op) != "linear":
            return None, f"{op.name} has an activation of its own inside the block"
    if activation not in ACTIVATIONS:
        return None, f"the reduce's activation {activation or '?'} is not relu or swish"
    return Block(0, tuple(chain), reduce, expand, activation, gate_kind), None


def find_block(layer: Any) -> tuple[Block | None, str | None]:
    """The squeeze-and-excitation block that ``layer`` (a ``Multiply``) ends, in the Keras
    functional graph it was built in: (its :class:`Block`, None); else (None, why). A
    subclassed model's layers are traced with no such graph: their blocks are not seen."""
    if functional_neighbours(layer) is None:
        return None, ("not called once in a Keras functional graph (a subclassed model's "
                      "blocks are not seen)")
    inputs = list(layer._inbound_nodes[0].input_tensors)
    if len(inputs) != 2:
        return None, "the Multiply does not scale one tensor by one gate"
    reasons = []
    for features in (0, 1):
        block, why = _walk(inputs[1 - features], inputs[features])
        if block is not None:
            return dataclasses.replace(block, features=features), None
        reasons.append(why)
    return None, reasons[1] if "pool reads another" in reasons[0] else reasons[0]


def se_shaped(tensors: Sequence[Any]) -> int | None:
    """Which of a ``Multiply``'s two inputs holds the features where the other is a gate of
    their channels ([batch, H, W, C] by [batch, 1, 1, C] or [batch, C]), else None.

    >>> se_shaped([tf.zeros([2, 4, 4, 8]), tf.zeros([2, 1, 1, 8])])
    0
    >>> se_shaped([tf.zeros([2, 8]), tf.zeros([2, 4, 4, 8])]), se_shaped([tf.zeros([2, 3])] * 2)
    (1, None)
    >>> se_shaped([tf.zeros([2, 1, 1, 8])] * 2)  # 1x1 features: either, the graph says which
    0
    """
    if len(tensors) != 2:
        return None
    for i in (0, 1):
        x, g = (t.shape for t in (tensors[i], tensors[1 - i]))
        if x.rank == 4 and g.rank in (2, 4) and (g.rank == 2 or list(g[1:3]) == [1, 1]) \
                and x[-1] == g[-1]:
            return i
    return None


# -- check: why a call keeps Keras's own form (None: it need not) ---------------------------------
_DTYPES = ("float32", "float16", "bfloat16")


def check(block: Block, x: Any, gate: Any) -> str | None:
    """Why the stage leaves the block ending at this call to Keras's layers, or None.

    >>> import keras
    >>> block = Block(0, (), None, None, "relu", "sigmoid")
    >>> check(block, tf.zeros([2, 4, 4, 8], tf.float64), tf.zeros([2, 1, 1, 8], tf.float64))
    'input dtype float64'
    """
    get_keras_mask = private_api.get("keras.get_keras_mask")

    if x.dtype.name not in _DTYPES:
        return f"input dtype {x.dtype.name}"
    if gate.dtype != x.dtype:
        return f"the gate is {gate.dtype.name}, the features {x.dtype.name}"
    if x.shape[-1] is None:
        return "unknown channels"
    if get_keras_mask(x) is not None or get_keras_mask(gate) is not None:
        return "a masked input"
    import keras

    dtypes = {op.compute_dtype for op in block.operations if isinstance(op, keras.layers.Layer)}
    if dtypes - {x.dtype.name}:
        return f"its layers compute in {', '.join(sorted(dtypes))}, the features are " \
               f"{x.dtype.name}"
    return None


# -- forms: what it emits (CONSERVATIVE: the form Keras runs), and the hook's flow ----------------
CONSERVATIVE = conservative("keras", "Keras's layers")
"""The block as Keras's layers run it."""
CUSTOM = Form("custom", "squeeze-excite: one region, MatMuls on [batch, channels], closed-form "
                        "backward (custom gradient)",
              marks=frozenset({"MatMul"}),
              emits=frozenset({"Cast", "Mean:float32", "RealDiv:float32", "MatMul", "AddV2",
                               "Mul", "Sub", "Sum", "Relu", "ReluGrad", "Sigmoid",
                               "SigmoidGrad", "Relu6", "Relu6Grad", "RealDiv"}))
"""Emitted under ``tfmx_squeeze_excite_custom``: its MatMuls show it in a traced graph; the
ops it emits in the call's dtype (the pool's mean in float32 as Keras's)."""
XLA_FORM = Form(XLA, "squeeze-excite: one XLA-compiled region (forward and gradient)",
                marks=XLA_CALLS)
FORMS = Forms(SCOPE, (CONSERVATIVE, CUSTOM, XLA_FORM))


@dataclasses.dataclass(frozen=True)
class SqueezeExciteForms:
    """What a backend runs of this family (its ``capability``): the forms' names."""

    forms: tuple[str, ...]


def squeeze_excite_forms(platform: Platform) -> SqueezeExciteForms | None:
    """The forms ``platform`` runs: on cpu and cuda the closed form and the XLA region; on a
    Metal plugin the closed form where it places every op the form emits (in float32 or
    float16), never an XLA region; else none.

    >>> squeeze_excite_forms(Platform("cpu")).forms
    ('custom', 'xla')
    >>> squeeze_excite_forms(Platform("metal", kernels=frozenset({"MatMul"}))).forms
    ()
    """
    if platform.name in ("cpu", "cuda"):
        return SqueezeExciteForms((CUSTOM.name, XLA_FORM.name))
    return SqueezeExciteForms((CUSTOM.name,) if platform.places(CUSTOM.emits,
                                                                  any_dtype=frozenset())
                              else ())


def _pool(x: tf.Tensor) -> tf.Tensor:
    """Keras's global average pool of ``x`` on [batch, C]: the mean in float32, cast back."""
    return tf.cast(tf.reduce_mean(tf.cast(x, tf.float32), axis=[1, 2]), x.dtype)


def _activate(z: tf.Tensor, kind: str) -> tuple[tf.Tensor, Callable[[tf.Tensor], tf.Tensor]]:
    """The reduce's activation of ``z`` as Keras computes it, and its backward from what it
    kept."""
    if kind == "relu":
        a = tf.nn.relu(z)
        return a, lambda da: tf.raw_ops.ReluGrad(gradients=da, features=a)
    s = tf.sigmoid(z)
    a = z * s
    return a, lambda da: da * (s + a * (tf.constant(1.0, z.dtype) - s))


def _gate(z: tf.Tensor, kind: str) -> tuple[tf.Tensor, Callable[[tf.Tensor], tf.Tensor]]:
    """The gate of ``z`` as Keras computes it, and its backward from what it kept: Keras's
    ``hard_sigmoid`` divides ``relu6(z + 3)`` by 6, MobileNetV3's layers multiply it by 1/6."""
    if kind == "sigmoid":
        s = tf.sigmoid(z)
        return s, lambda ds: tf.raw_ops.SigmoidGrad(y=s, dy=ds)
    u = z + tf.constant(3.0, z.dtype)
    if kind == "hard_sigmoid":
        six = tf.constant(6.0, z.dtype)
        return tf.nn.relu6(u) / six, lambda ds: tf.raw_ops.Relu6Grad(gradients=ds / six,
                                                                      features=u)
    sixth = tf.constant(1.0 / 6.0, z.dtype)
    return tf.nn.relu6(u) * sixth, lambda ds: tf.raw_ops.Relu6Grad(gradients=ds * sixth,
                                                                    features=u)


def _affine(v: tf.Tensor, kernel: tf.Tensor, bias: tf.Tensor | None) -> tf.Tensor:
    z = tf.matmul(v, kernel)
    return z if bias is None else z + bias


def _weights(block: Block) -> list[tf.Tensor | None]:
    """The reduce's and expand's kernels on [in, out] and biases (None without one), read as
    their calls read them (autocast to the compute dtype under mixed precision)."""
    found = []
    for layer in (block.reduce, block.expand):
        kernel = layer_value(layer.kernel)
        found += [tf.reshape(kernel, [-1, kernel.shape[-1]]),
                  layer_value(layer.bias) if getattr(layer, "bias", None) is not None else None]
    return found


def _spatial(x: tf.Tensor) -> tf.Tensor:
    """H * W of ``x`` in float32 (from its runtime shape where it is unknown)."""
    if x.shape[1] is not None and x.shape[2] is not None:
        return tf.constant(float(x.shape[1] * x.shape[2]))
    shape = tf.shape(x)
    return tf.cast(shape[1] * shape[2], tf.float32)


def squeeze_excite(x: tf.Tensor, weights: Sequence[tf.Tensor | None], activation: str = "relu",
                   gate: str = "sigmoid") -> tf.Tensor:
    """``x * gate(act(mean_HW(x) @ w1 + b1) @ w2 + b2)`` (``weights``: w1, b1, w2, b2, a bias
    None where the layer has none) as autodiff differentiates it: the XLA region's body.

    >>> x, w = tf.ones([1, 2, 2, 2]), [tf.ones([2, 1]), None, tf.zeros([1, 2]), None]
    >>> squeeze_excite(x, w).numpy()[0, 0, 0].tolist()
    [0.5, 0.5]
    """
    w1, b1, w2, b2 = weights
    a, _ = _activate(_affine(_pool(x), w1, b1), activation)
    s, _ = _gate(_affine(a, w2, b2), gate)
    return x * s[:, None, None, :]


def squeeze_excite_custom(x: tf.Tensor, weights: Sequence[tf.Tensor | None],
                          activation: str = "relu", gate: str = "sigmoid") -> tf.Tensor:
    """:func:`squeeze_excite` with its backward in closed form (a custom gradient): the gate's
    gradient ``sum_HW(dy * x)`` through the gate and both MatMuls, and ``dx = dy * gate +
    (the pooled path's gradient) / (H * W)`` broadcast over H and W.

    >>> x = tf.reshape(tf.range(8.0), [1, 2, 2, 2])
    >>> w = [tf.ones([2, 3]), tf.zeros([3]), tf.fill([3, 2], 0.1), tf.zeros([2])]
    >>> with tf.GradientTape(persistent=True) as tape:
    ...     _ = tape.watch(x)
    ...     y, want = squeeze_excite_custom(x, w), squeeze_excite(x, w)
    >>> bool(tf.reduce_all(tf.abs(tape.gradient(y, x) - tape.gradient(want, x)) < 1e-5))
    True
    """
    present = [i for i, w in enumerate(weights) if w is not None]

    @custom_gradient
    def block(x: tf.Tensor, *given: tf.Tensor) -> Any:
        w1, b1, w2, b2 = (given[present.index(i)] if i in present else None for i in range(4))
        p = _pool(x)
        a, act_back = _activate(_affine(p, w1, b1), activation)
        s, gate_back = _gate(_affine(a, w2, b2), gate)
        scale = s[:, None, None, :]

        def backward(dy: tf.Tensor) -> list[tf.Tensor]:
            dz2 = gate_back(tf.reduce_sum(dy * x, axis=[1, 2]))
            dz1 = act_back(tf.matmul(dz2, w2, transpose_b=True))
            dp = tf.matmul(dz1, w1, transpose_b=True)
            spread = tf.cast(tf.cast(dp, tf.float32) / _spatial(x), x.dtype)
            found = [tf.matmul(p, dz1, transpose_a=True), tf.reduce_sum(dz1, axis=0),
                     tf.matmul(a, dz2, transpose_a=True), tf.reduce_sum(dz2, axis=0)]
            return [dy * scale + spread[:, None, None, :], *(found[i] for i in present)]

        return x * scale, backward

    return block(x, *(weights[i] for i in present))


def _forms(ctx: StageContext) -> tuple[tuple[Form, ...], bool]:
    """The closed forms this target runs, and whether the XLA region is offered."""
    declared = ctx.target.capability(SqueezeExciteForms)
    names = declared.forms if declared is not None else (CUSTOM.name,)
    return ((CUSTOM,) if CUSTOM.name in names else ()), bool(ctx.xla and XLA in names)


def fused_multiply_call(ctx: StageContext, original: Callable, layer: Any, inputs: Any,
                        **kwargs: Any) -> Any:
    """``Multiply.call`` while tfmx traces: the squeeze-and-excitation block it ends
    (:func:`find_block`) as one region where the tuner measures it faster than Keras's layers
    and a gradient tape records it; else Keras's call (a product that is no such block, with
    nothing reported)."""
    tensors = list(inputs) if isinstance(inputs, (list, tuple)) else []
    index = se_shaped(tensors)
    if index is None or not tf.inside_function() or not execute.must_record_gradient():
        return original(layer, inputs, **kwargs)
    from fusion.fragment import shape_text

    block, why = find_block(layer)
    index = index if block is None else block.features
    x, gate = (tf.convert_to_tensor(t) for t in (tensors[index], tensors[1 - index]))
    if block is not None:
        why = check(block, x, gate) if se_shaped([x, gate]) is not None else \
            "its gate does not scale the features' channels"
    forms, region = _forms(ctx)
    if block is None or why is not None:
        forms = (CUSTOM,)
    what = "squeeze-excite"

    def xla(v: Any) -> Any:
        return xla_region(lambda u, *w: squeeze_excite(u, w, block.activation, block.gate))(
            v, *_present(block))

    def emit(form: Form) -> Any:
        if form.name == XLA:
            return xla(x)
        return squeeze_excite_custom(x, _weights(block), block.activation, block.gate)

    def candidates() -> dict:
        variables = [*block.reduce.trainable_variables, *block.expand.trainable_variables]

        def keras_layers(v: Any) -> Any:
            quiet = dataclasses.replace(ctx, chooser=None, record=lambda family, stats: None,
                                        families=("swish",) if ctx.wants("swish") else ())
            with tracing(quiet):
                return _replay(original, layer, block, v)

        timed = {CONSERVATIVE.name: timed_form(keras_layers, [x.shape], x.dtype, variables),
                 CUSTOM.name: timed_form(lambda v: squeeze_excite_custom(
                     v, _weights(block), block.activation, block.gate), [x.shape], x.dtype,
                     variables)}
        if not region:
            return timed
        return with_xla(ctx, timed, xla, [x.shape], x.dtype, variables)

    def signature() -> str:
        kinds = [type(op).__name__ for op in (block.reduce, block.expand)]
        return (f"{what} input {shape_text(x.shape)} {x.dtype.name}: {kinds[0]}"
                f"({block.expand.kernel.shape[-2]}, {block.activation}) -> {kinds[1]}"
                f"({block.expand.kernel.shape[-1]}, {block.gate})")

    if not forms and why is None:
        why = "the target runs no form of it"
    return rewrite_call(ctx, CallSite(
        DECLARED, forms, keras=lambda: original(layer, inputs, **kwargs), emit=emit,
        what=what, why=why, dtype=x.dtype, signature=signature, candidates=candidates))


def _present(block: Block) -> list[tf.Tensor]:
    """The block's weights (:func:`_weights`) for the XLA region: a bias it lacks is zeros."""
    weights = _weights(block)
    for i in (1, 3):
        if weights[i] is None:
            weights[i] = tf.zeros([weights[i - 1].shape[-1]], weights[i - 1].dtype)
    return weights


def _replay(original: Callable, layer: Any, block: Block, x: Any) -> Any:
    """The block as Keras's layers compute it from ``x``: each node of its chain called as the
    functional model calls it, then the ``Multiply``."""
    values = {id(block.chain[0].input_tensors[0]): x}
    for node in block.chain:
        args, kwargs = node.arguments.fill_in(values)
        values[id(node.outputs[0])] = node.operation(*args, **kwargs)
    gate = values[id(block.chain[-1].outputs[0])]
    return original(layer, [x, gate] if block.features == 0 else [gate, x])


# -- declaration ----------------------------------------------------------------------------------
DECLARED = declare(Family(
    FAMILY,
    "Keras squeeze-and-excitation blocks (pool, 1x1 reduce, 1x1 expand, gate, Multiply) in "
    "training -> one region with a closed-form backward (custom gradient) or one XLA region, "
    "where measured faster than Keras's layers",
    hooks=(Hook.on(MATCHES[0], fused_multiply_call),),
    forms=FORMS,
    after=OBSERVED_AFTER, order=OBSERVED_ORDER,
    capability=squeeze_excite_forms,
))
