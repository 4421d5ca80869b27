"""The batch_norm stage: a layer's forward graph rewritten before the tape sees it.

Some fusions cannot be made after gradients exist: Keras 3's batch norm backward is ~30 ops
that read the composite forward's intermediates, and the fused kernels have no registered
gradient. So while tfmx traces a step (``fusion.stage.tracing``), each
``BatchNormalization.call`` that a gradient tape records (or that runs in training mode) goes
through :func:`fused_layer_call`:

1. trace the layer's own ``call`` for this input into a scratch ``tf.function`` graph;
2. run the pattern engine on it (``fusion.rewrite(..., patterns=["batch_norm"])``, the same
   pattern, statistics and report as every other pass);
3. import the rewritten nodes into the graph being traced, re-binding the scratch graph's input
   and captured variable handles, and record every imported op on the active gradient tapes with
   its registered gradient, exactly as TensorFlow's generated op wrappers do.

Steps 1 and 2 run once per kind of call in a step: a layer of Keras's class whose
configuration, variables and input match an earlier layer's (:func:`_template_key`) takes that
layer's rewritten forward with its own variables bound in, and the step's graph is the one
tracing each layer would give.

The tape then differentiates ``FusedBatchNormV3`` with TensorFlow's own gradient
(``FusedBatchNormGradV3``). If anything does not fit (nothing fused, an op without a gradient,
captures that are not plain variables, any exception), the layer's stock ``call`` runs instead
and the report says why: training is never broken.

Example:
    >>> import keras, numpy as np, tfmx
    >>> tfmx.enable(backend="cpu")
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
    ...                           keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
    >>> tfmx.report().patterns["batch_norm"].fused_kinds["FusedBatchNormV3(training, float32)"]
    1
    >>> tfmx.disable()
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import execute
from tensorflow.python.framework import importer, ops
from tensorflow.python.ops import resource_variable_ops

from fusion import trace_state
from fusion.family import Family, Form, Forms, conservative, declare
from fusion.kernels.batch_norm import kernel_blocker
from fusion.pattern import PatternStats
from fusion.stage import CallSite, Emitted, Hook, StageContext, rewrite_call

# -- match: the Keras calls it hooks, and what it finds in them -----------------------------------
PATTERN = "batch_norm"
MATCHES = ("keras.src.layers.normalization.batch_normalization:BatchNormalization.call",)
"""The Keras call the stage hooks: a ``BatchNormalization`` layer's, where a gradient tape
records it or it trains."""


# -- check: why a call keeps Keras's own form (None: it need not) ---------------------------------
def _layer_decline(layer: Any, mask: Any) -> str | None:
    """Why this layer's configuration has no fused kernel, or None."""
    if mask is not None:
        return "a mask (masked moments have no fused kernel)"
    if getattr(layer, "synchronized", False):
        return "synchronized=True (cross-replica moments)"
    if getattr(layer, "renorm", False):
        return "renorm=True (batch renormalization)"
    if getattr(layer, "virtual_batch_size", None):
        return "virtual_batch_size (ghost batch norm)"
    return None


def _replica_decline(layer: Any, inputs: Any, ctx: StageContext) -> str | None:
    """Why a layer inside a ``tf.distribute`` strategy cannot take :func:`_replica_call`."""
    rank = inputs.shape.rank
    if rank is None or rank < 2 or layer.axis % rank != rank - 1:
        return ("inside a tf.distribute strategy, channels on an axis other than the last "
                "(per-replica variables: only the channels-last form is emitted there)")
    if inputs.dtype.name not in ("float32", "float16", "bfloat16"):
        return f"inside a tf.distribute strategy, {inputs.dtype.name} inputs"
    return kernel_blocker(ctx.target, "FusedBatchNormV3", "float32", "NHWC", True,
                          int(inputs.shape[-1]), layer.epsilon)


def check(layer: Any, inputs: Any, mask: Any, training: bool,
          ctx: StageContext) -> str | None:
    """Why this call keeps Keras's composite (its configuration, or inside a
    ``tf.distribute`` strategy what the replica form cannot take), or None.

    >>> import keras
    >>> from fusion.pattern import PlainTarget
    >>> layer, ctx = keras.layers.BatchNormalization(), StageContext(PlainTarget("cpu"))
    >>> check(layer, tf.zeros([2, 3]), None, True, ctx)
    >>> check(layer, tf.zeros([2, 3]), tf.ones([2]), True, ctx)
    'a mask (masked moments have no fused kernel)'
    """
    why = _layer_decline(layer, mask)
    if why is None and tf.distribute.has_strategy():
        why = _replica_decline(layer, inputs, ctx) if training else (
            "inside a tf.distribute strategy, not training (the moving statistics)")
    return why


# -- forms: what it emits (CONSERVATIVE: the form Keras runs), and the hook's flow ----------------
CONSERVATIVE = conservative("composite", "Keras's composite")
"""Keras's composite, differentiated by autodiff."""
_FUSED = frozenset({"Cast", "FusedBatchNormV3:float32", "FusedBatchNormGradV3:float32"})
REPLICA = Form("replica", "FusedBatchNormV3 emitted in a tf.distribute replica's graph",
               emits=_FUSED)
SPLICED = Form("spliced", "the layer's forward rewritten on a scratch graph, spliced into the "
                          "step", emits=_FUSED)
FORMS = Forms("", (CONSERVATIVE, REPLICA, SPLICED))
"""Every form: each emits the input's cast (Keras computes batch norm in float32), the kernel
and its gradient in float32, and reports what it fused itself (no scope of its own: the
spliced nodes keep the names of the layer's forward, and the family's graph pass finds
them)."""
# Ops that may sit in a rewritten forward graph without a registered gradient.
_NO_GRADIENT_NEEDED = frozenset({"Const", "NoOp", "Placeholder", "AssignVariableOp",
                                 "AssignAddVariableOp", "AssignSubVariableOp"})


def _replica_forward(layer: Any, inputs: Any) -> tuple[Any, Any, Any]:
    """Keras's training forward with ``FusedBatchNormV3`` emitted directly in the replica's
    graph (the tape records it with its registered gradient): (outputs, batch mean, biased
    batch variance). Inside a strategy the scratch-graph splice cannot run: the layer's
    variables are per-replica, and assigning them is the strategy's business
    (:func:`_replica_update`)."""
    from keras import ops

    x = ops.cast(inputs, "float32")  # Keras computes batch norm in float32
    channels = int(x.shape[-1])
    x4 = x if x.shape.rank == 4 else tf.reshape(x, [-1, 1, 1, channels])
    gamma = ops.cast(layer.gamma, "float32") if layer.scale else tf.ones([channels])
    beta = ops.cast(layer.beta, "float32") if layer.center else tf.zeros([channels])
    empty = tf.zeros([0], tf.float32)
    y, mean, bessel_variance = tf.raw_ops.FusedBatchNormV3(
        x=x4, scale=gamma, offset=beta, mean=empty, variance=empty, epsilon=layer.epsilon,
        exponential_avg_factor=1.0, data_format="NHWC", is_training=True)[:3]
    # the kernel's variance is Bessel-corrected (times n / (n - 1)); Keras averages the biased
    n = tf.cast(tf.size(x4), tf.float32) / float(channels)
    variance = bessel_variance / (n / (n - 1.0))
    out = y if x.shape.rank == 4 else tf.reshape(y, tf.shape(x))
    return ops.cast(out, layer.compute_dtype), mean, variance


def _replica_update(layer: Any, mean: Any, variance: Any) -> None:
    """The moving statistics, assigned through the layer's own variables by Keras's own
    expressions: the strategy treats them as it treats stock's."""
    from keras import ops

    momentum = layer.momentum
    moving_mean = ops.cast(layer.moving_mean, "float32")
    moving_variance = ops.cast(layer.moving_variance, "float32")
    layer.moving_mean.assign(moving_mean * momentum + mean * (1.0 - momentum))
    layer.moving_variance.assign(moving_variance * momentum + variance * (1.0 - momentum))


def _replica_emit(layer: Any, inputs: Any) -> Emitted:
    """The replica form (:func:`_replica_forward`, then :func:`_replica_update`), or Keras's
    call where it raised (nothing assigned yet)."""
    stats = PatternStats(matched=1)
    try:
        out, mean, variance = _replica_forward(layer, inputs)
    except Exception as exc:  # noqa: BLE001 - never break training: nothing assigned yet
        stats.errors.append(f"{layer.name}: replica form: {type(exc).__name__}: {exc}")
        return Emitted(None, stats, kept=True)
    _replica_update(layer, mean, variance)
    stats.fuse("FusedBatchNormV3(training, float32)")
    return Emitted(out, stats)


def _rewrite(layer: Any, original: Callable, inputs: Any, training: Any,
             ctx: StageContext) -> tuple[dict | None, PatternStats]:
    """Trace the layer's forward, rewrite it, check it: (a plan for :func:`_splice`, stats).
    A layer whose forward another layer of the step already had (:func:`_template_key`)
    takes that layer's rewritten forward, its own variables bound in (:func:`_reused`)."""
    inputs = tf.convert_to_tensor(inputs)
    key = _template_key(layer, inputs, training)
    templates = trace_state.slot(ops.get_default_graph(), _TEMPLATES) if key else {}
    if key in templates:
        return _reused(templates[key], layer)
    plan, stats = _traced_plan(layer, original, inputs, training, ctx)
    if plan is not None and key:
        template = _template(plan, stats, layer)
        if template is not None:
            templates[key] = template
    return plan, stats


def _traced_plan(layer: Any, original: Callable, inputs: Any, training: Any,
                 ctx: StageContext) -> tuple[dict | None, PatternStats]:
    """The layer's forward traced on a scratch graph, rewritten and checked: (a plan for
    :func:`_splice`, stats)."""
    from fusion.pipeline import rewrite

    scratch = tf.function(lambda x: original(layer, x, training=training), autograph=False)
    concrete = scratch.get_concrete_function(tf.TensorSpec(inputs.shape, inputs.dtype))
    graph = concrete.graph
    protected = {t.op.name for t in (*graph.inputs, *graph.outputs)}
    result = rewrite(graph.as_graph_def(add_shapes=True), ctx.target, [PATTERN], protected)
    stats = result.stats[PATTERN]
    if not stats.fused:
        if not stats.declined and not stats.errors:
            stats.matched += 1
            stats.decline("BatchNorm: composite not recognised in the layer's forward graph")
        return None, stats
    missing = sorted({n.op for n in result.graph_def.node
                      if n.op not in _NO_GRADIENT_NEEDED and not _has_gradient(n.op)})
    if missing:
        stats.errors.append(f"{layer.name}: no registered gradient for {missing}")
        return None, stats
    captures = [(external, internal.name) for external, internal in graph.captures]
    if any(not hasattr(external, "numpy") for external, _ in captures):
        stats.errors.append(f"{layer.name}: captures that are not eager variables")
        return None, stats
    # Import once into a throwaway graph: the real splice must not fail half-way.
    with tf.Graph().as_default() as probe:
        importer.import_graph_def(result.graph_def, name="")
        for op in probe.get_operations():
            _attr_tuple(op)
    # TensorFlow's unique ids this took, from the scratch graph's key (the id before its
    # input's) to the probe's last tensor: a layer reusing the plan takes as many.
    last = max((t._id for op in probe.get_operations() for t in op.outputs), default=None)
    uids = None if last is None else last - graph.inputs[0]._id + 2
    placeholders = {t.op.name for t in graph.inputs}
    graph_def = tf.compat.v1.GraphDef()
    graph_def.versions.CopyFrom(result.graph_def.versions)
    graph_def.library.CopyFrom(result.graph_def.library)
    graph_def.node.extend(n for n in result.graph_def.node if n.name not in placeholders)
    return dict(graph_def=graph_def, input=graph.inputs[0].name, captures=captures,
                output=graph.outputs[0].name, variables=list(graph.variables),
                name=f"{layer.name}_tfmx", uids=uids), stats


# -- one rewritten forward for the layers that share it ------------------------------------------
_TEMPLATES = "batch_norm.templates"
"""The ``fusion.trace_state`` slot of a traced step's graph that keeps, by
:func:`_template_key`, the rewritten forwards its layers' plans were made from."""


def _template_key(layer: Any, inputs: Any, training: Any) -> tuple | None:
    """What Keras's ``BatchNormalization.call`` reads besides the layer's variables' values,
    for a layer of exactly Keras's class (a subclass may read more; None for it): two layers
    with one key trace the same scratch graph, so its rewrite serves both.

    >>> import keras
    >>> layers = [keras.layers.BatchNormalization(epsilon=e) for e in (1e-3, 1e-3, 1e-5)]
    >>> for layer in layers:
    ...     layer.build((2, 3))
    >>> x = tf.zeros([2, 3])
    >>> [_template_key(layer, x, True) == _template_key(layers[0], x, True) for layer in layers]
    [True, True, False]
    >>> _template_key(layers[0], x, True) == _template_key(layers[0], tf.zeros([4, 3]), True)
    False
    """
    from keras.layers import BatchNormalization  # Keras's own class, as exported

    if type(layer) is not BatchNormalization:
        return None
    return (tuple(inputs.shape), inputs.dtype.name, training, layer.trainable, layer.axis,
            tuple(layer._reduction_axes), layer.epsilon, layer.momentum, layer.center,
            layer.scale, layer.synchronized, layer.renorm, layer.dtype_policy.name,
            tuple((v.name, tuple(v.shape), str(v.dtype)) for v in layer.variables))


def _variable_index(layer: Any) -> dict[int, int]:
    """The position in ``layer.variables`` of each of its TensorFlow variables and their
    handles, by ``id``."""
    index = {}
    for i, variable in enumerate(layer.variables):
        value = getattr(variable, "value", variable)
        index[id(value)] = i
        index[id(getattr(value, "handle", value))] = i
    return index


def _template(plan: dict, stats: PatternStats, layer: Any) -> dict | None:
    """``plan`` with its captures and variables as positions in ``layer.variables`` (None
    where one is not the layer's), for :func:`_reused`."""
    index = _variable_index(layer)
    captures = [(index.get(id(external)), internal) for external, internal in plan["captures"]]
    variables = [index.get(id(variable)) for variable in plan["variables"]]
    if None in [i for i, _ in captures] or None in variables or plan.get("uids") is None:
        return None
    return dict(plan, captures=captures, variables=variables, stats=copy.deepcopy(stats))


def _reused(template: dict, layer: Any) -> tuple[dict, PatternStats]:
    """The plan :func:`_template` kept, ``layer``'s own variables bound in, and a copy of the
    statistics its rewrite reported."""

    def value(i: int) -> Any:
        return getattr(layer.variables[i], "value", layer.variables[i])

    plan = {k: v for k, v in template.items() if k != "stats"}
    plan.update(captures=[(value(i).handle, internal) for i, internal in template["captures"]],
                variables=[value(i) for i in template["variables"]],
                name=f"{layer.name}_tfmx")
    # What the scratch trace did besides its graph: the tapes watch the variables it read
    # before the splice captures them (so the capture is recorded and gradients reach them),
    # and TensorFlow's unique ids advance as far (the names of the step's later captures).
    for variable in plan["variables"]:
        resource_variable_ops.variable_accessed(variable)
    for _ in range(template["uids"]):
        ops.uid()
    return plan, copy.deepcopy(template["stats"])


def _splice(plan: dict, inputs: Any) -> Any:
    """Import the rewritten forward into the graph being traced; record it on the tapes."""
    inputs = tf.convert_to_tensor(inputs)
    outer = ops.get_default_graph()
    input_map = {plan["input"]: inputs}
    for external, internal in plan["captures"]:
        input_map[internal] = outer.capture(external)
    before = len(outer.get_operations())
    (out,) = importer.import_graph_def(plan["graph_def"], input_map=input_map,
                                       return_elements=[plan["output"]], name=plan["name"])
    if execute.must_record_gradient():
        for op in outer.get_operations()[before:]:
            if op.outputs:
                execute.record_gradient(op.type, op.inputs, _attr_tuple(op), op.outputs)
    for variable in plan["variables"]:
        resource_variable_ops.variable_accessed(variable)
    out.set_shape(inputs.shape)
    return out


def _has_gradient(op_type: str) -> bool:
    try:
        ops._gradient_registry.lookup(op_type)  # noqa: SLF001 - TF has no public lookup
    except LookupError:
        return False
    return True


def _attr_tuple(op: tf.Operation) -> tuple:
    """The flat (name, value, ...) attrs that generated op wrappers hand the tape."""
    flat: list[Any] = []
    for name in op.node_def.attr:
        if name.startswith("_"):
            continue
        value = op.get_attr(name)
        if isinstance(value, tf.DType):
            value = value.as_datatype_enum
        elif isinstance(value, list) and value and isinstance(value[0], tf.DType):
            value = [v.as_datatype_enum for v in value]
        flat.extend([name, value])
    return tuple(flat)


def _spliced_emit(ctx: StageContext, layer: Any, original: Callable, inputs: Any,
                  training: Any) -> Emitted:
    """The layer's forward rewritten on a scratch graph (:func:`_rewrite`) and spliced into
    the step (:func:`_splice`), reported as the batch_norm pattern reported it; Keras's call
    where anything did not fit."""
    try:
        plan, stats = _rewrite(layer, original, inputs, training, ctx)
    except Exception as exc:  # noqa: BLE001 - never break training because of tfmx
        stats = PatternStats()
        stats.errors.append(f"{layer.name}: forward stage: {type(exc).__name__}: {exc}")
        ctx.warn(f"forward:{type(exc).__name__}",
                 f"tfmx left batch norm {layer.name!r} unfused ({type(exc).__name__}: "
                 f"{exc}); tfmx.report() has the details.")
        plan = None
    # Once the plan is spliced into the step's graph there is no going back (its variable
    # updates would run twice): everything that can fail was checked on a scratch graph.
    return Emitted(None, stats, kept=True) if plan is None else Emitted(_splice(plan, inputs),
                                                                        stats)


def fused_layer_call(ctx: StageContext, original: Callable, layer: Any, inputs: Any,
                     training: Any = None, mask: Any = None) -> Any:
    """``layer.call`` with its composite batch norm rewritten before differentiation (the
    stage's handler of ``BatchNormalization.call``, :func:`fusion.stage.rewrite_call`): inside
    a ``tf.distribute`` strategy the replica form, else the layer's forward rewritten on a
    scratch graph and spliced in."""

    def stock() -> Any:
        return original(layer, inputs, training=training, mask=mask)

    if not tf.inside_function():
        return stock()
    is_training = training is True and layer.trainable
    if not (is_training or execute.must_record_gradient()):
        return stock()  # inference without a tape: the graph pass fuses it after tracing
    if not isinstance(training, (bool, type(None))):
        return stock()
    replica = _layer_decline(layer, mask) is None and tf.distribute.has_strategy()
    if replica:
        inputs = tf.convert_to_tensor(inputs)
    why = check(layer, inputs, mask, is_training, ctx)

    def emit(form: Form) -> Emitted:
        if form is REPLICA:
            return _replica_emit(layer, inputs)
        return _spliced_emit(ctx, layer, original, inputs, training)

    return rewrite_call(ctx, CallSite(
        DECLARED, (REPLICA if replica else SPLICED,), keras=stock, emit=emit, what="BatchNorm",
        why=why, dtype=getattr(inputs, "dtype", None)))


# -- declaration ----------------------------------------------------------------------------------
DECLARED = declare(Family(
    PATTERN,
    "Keras BatchNormalization in training -> FusedBatchNormV3 (its registered gradient: "
    "FusedBatchNormGradV3), emitted before differentiation",
    hooks=(Hook.on(MATCHES[0], fused_layer_call),),
    forms=FORMS,
))
