"""``policies.audit(model)``: per layer, what it computes and stores in, and where casts sit.

Each layer is traced on its own (forward and gradient, on inputs in the dtype its producers
hand it) and its ``Cast`` ops are counted: the casts of its inputs into its compute dtype, of its
float32 variables into 16 bit, and their gradients. The whole model is traced too, for the total
and for *round trips* (a 16-bit tensor cast up to float32 and straight back), which are free to
remove; tfmx's ``casts`` pattern removes them from training graphs. Which layers run alone and
on what inputs comes from :mod:`policies.model_probe`.

Example:
    >>> import keras, numpy as np, policies
    >>> with policies.scope("mixed_bfloat16"):
    ...     model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="hidden"),
    ...                               keras.layers.Dense(2, name="out", dtype="float32")])
    >>> report = policies.audit(model, np.ones((4, 8), "float32"))
    >>> row = report.layer("hidden")
    >>> row.compute_dtype, row.variable_dtype, row.casts_forward
    ('bfloat16', 'float32', 3)
    >>> report.layer("out").casts_forward  # its bfloat16 input cast up
    1
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from policies.errors import LayerDtypeError
from policies.layers import layer_step, output_layers, policy_name
from policies.model_probe import (
    has_graph,
    inputs_of,
    probe_layers,
    producers,
    record_calls,
    runnable_alone,
    sample_inputs,
)
from policies.state import current, stale_layers

LOSSLESS_WIDENING = frozenset({
    ("bfloat16", "float32"), ("float16", "float32"), ("bfloat16", "float64"),
    ("float16", "float64"), ("float32", "float64"),
})
"""(narrow, wide) pairs where narrow -> wide -> narrow gives back the same values."""


@dataclasses.dataclass
class LayerAudit:
    """One row of the audit."""

    layer: str
    cls: str
    policy: str
    compute_dtype: str
    variable_dtype: str
    output_dtype: str | None
    casts_forward: int
    casts_backward: int
    cast_kinds: dict[str, int]
    note: str = ""

    @property
    def casts(self) -> int:
        return self.casts_forward + self.casts_backward

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "casts": self.casts}


@dataclasses.dataclass
class Audit:
    """What :func:`audit` found; ``print`` it for a table."""

    model: str
    global_policy: str
    layers: list[LayerAudit]
    model_casts: int | None
    round_trips: int | None
    notes: list[str] = dataclasses.field(default_factory=list)
    failures: dict[str, tuple[str, str, BaseException]] = dataclasses.field(
        default_factory=dict, repr=False)

    def layer(self, name: str) -> LayerAudit:
        """The row of layer ``name``."""
        for row in self.layers:
            if row.layer == name:
                return row
        raise KeyError(f"no layer {name!r} in the audit of {self.model!r}; layers: "
                       f"{[r.layer for r in self.layers]}")

    @property
    def layer_casts(self) -> int:
        return sum(r.casts for r in self.layers)

    def to_dict(self) -> dict:
        return {"model": self.model, "global_policy": self.global_policy,
                "model_casts": self.model_casts, "round_trips": self.round_trips,
                "notes": list(self.notes), "layers": [r.as_dict() for r in self.layers]}

    def __str__(self) -> str:
        head = ("layer", "class", "compute", "variables", "output", "casts fwd", "casts bwd",
                "where", "note")
        rows = [(r.layer, r.cls, r.compute_dtype, r.variable_dtype, r.output_dtype or "-",
                 str(r.casts_forward), str(r.casts_backward),
                 ", ".join(f"{k} x{v}" for k, v in sorted(r.cast_kinds.items())) or "-", r.note)
                for r in self.layers]
        widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
        lines = [f"policies.audit: model {self.model!r}, global policy {self.global_policy!r}",
                 ""]
        for row in [head, *rows]:
            lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
        lines.append("")
        total = "-" if self.model_casts is None else str(self.model_casts)
        trips = "-" if self.round_trips is None else str(self.round_trips)
        lines.append(f"casts in the layers' own graphs: {self.layer_casts}; in the whole "
                     f"forward+gradient graph: {total}; 16-bit round trips: {trips}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _dtype(t: int) -> str:
    import tensorflow as tf

    return tf.dtypes.as_dtype(t).name


def cast_nodes(graph_def: Any) -> list[Any]:
    """Every ``Cast`` NodeDef of ``graph_def``, its function library included.

    >>> import tensorflow as tf
    >>> @tf.function
    ... def f(x):
    ...     return tf.cast(x, tf.bfloat16)
    >>> graph_def = f.get_concrete_function(tf.TensorSpec([2])).graph.as_graph_def()
    >>> [tf.dtypes.as_dtype(n.attr["DstT"].type).name for n in cast_nodes(graph_def)]
    ['bfloat16']
    """
    nodes = [n for n in graph_def.node if n.op == "Cast"]
    for fn in graph_def.library.function:
        nodes += [n for n in fn.node_def if n.op == "Cast"]
    return nodes


def count_round_trips(graph_def: Any) -> int:
    """Casts narrow -> wide whose value is cast straight back to narrow (main graph).

    >>> import tensorflow as tf
    >>> @tf.function
    ... def f(x):
    ...     return tf.cast(tf.cast(x, tf.float32), tf.bfloat16) * 2
    >>> count_round_trips(f.get_concrete_function(tf.TensorSpec([2], tf.bfloat16))
    ...                   .graph.as_graph_def())
    1
    """
    by_name = {n.name: n for n in graph_def.node}
    trips = 0
    for n in graph_def.node:
        if n.op != "Cast":
            continue
        src = by_name.get(n.input[0].split(":")[0].lstrip("^"))
        if src is None or src.op != "Cast":
            continue
        narrow, wide = _dtype(src.attr["SrcT"].type), _dtype(src.attr["DstT"].type)
        if (narrow, wide) in LOSSLESS_WIDENING and _dtype(n.attr["DstT"].type) == narrow:
            trips += 1
    return trips


def _step_graph(fn: Any, x: Any) -> Any:
    import tensorflow as tf

    spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), x)
    return fn.get_concrete_function(spec).graph.as_graph_def()


def _layer_graph(layer: Any, x: Any) -> tuple[Any, str | None]:
    import tensorflow as tf

    step = layer_step(layer)
    graph = step.get_concrete_function(
        tf.nest.map_structure(
            lambda t: tf.TensorSpec(t.shape, t.dtype) if isinstance(t, tf.Tensor) else t, x)).graph
    outs = [t for t in tf.nest.flatten(graph.structured_outputs[0]) if hasattr(t, "dtype")]
    return graph.as_graph_def(), (outs[0].dtype.name if outs else None)


def _model_graph(model: Any, x: Any) -> Any:
    import tensorflow as tf

    @tf.function
    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            total = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32))
                              for o in tf.nest.flatten(out)])
        return tape.gradient(total, model.trainable_variables)

    out = model(x, training=False)
    sum_casts = sum(1 for o in tf.nest.flatten(out) if o.dtype != tf.float32)
    return _step_graph(step, x), sum_casts


def _casts_of(graph_def: Any) -> tuple[int, int, dict[str, int]]:
    forward = backward = 0
    kinds: collections.Counter = collections.Counter()
    for n in cast_nodes(graph_def):
        if "gradient_tape/" in n.name or n.name.startswith("gradients"):
            backward += 1
        else:
            forward += 1
        kinds[f"{_dtype(n.attr['SrcT'].type)}->{_dtype(n.attr['DstT'].type)}"] += 1
    # The step's own reduction cast of the output to float32 is not the layer's.
    return forward, backward, dict(kinds)


def _audit_layer(layer: Any, values: dict, graph: bool, outputs: list, stale: set,
                 failures: dict) -> LayerAudit:
    """One layer's row of :func:`audit`: trace it alone on its recorded input and count the
    casts of its forward and backward (a failure goes to ``failures`` and the note)."""
    import tensorflow as tf

    cls = type(layer).__name__
    note = []
    if any(layer is o for o in outputs):
        note.append("output layer")
    if id(layer) in stale:
        note.append("built before the last set_global: keeps its old policy")
    fwd = bwd = 0
    kinds: dict[str, int] = {}
    out_dtype = None
    if id(layer) not in values:
        note.append("not traced alone (shared layer or nested model)")
    else:
        value = typed = values[id(layer)]
        if graph:
            flat = tf.nest.flatten(value)  # tensors, and a call's Python flags
            where = [i for i, t in enumerate(flat) if isinstance(t, tf.Tensor)]
            for p, i in zip(_expand(producers(layer), [flat[i] for i in where]), where):
                if flat[i].dtype.is_floating:
                    flat[i] = tf.cast(flat[i], _producer_dtype(p, flat[i]))
            typed = tf.nest.pack_sequence_as(value, flat)
        state = [v.numpy() for v in layer.non_trainable_variables]
        try:
            graph_def, out_dtype = _layer_graph(layer, typed)
            fwd, bwd, kinds = _casts_of(graph_def)
            if out_dtype != "float32":  # the step's own cast of the output for its sum,
                fwd, bwd = fwd - 1, bwd - 1  # and that cast's gradient, are not the layer's
                kinds = _minus_sum_cast(kinds, out_dtype)
        except Exception as err:  # noqa: BLE001 - reported, see policies.check
            failures[layer.name] = (cls, policy_name(layer), err)
            note.append(str(LayerDtypeError(layer.name, cls, policy_name(layer), err))
                        .splitlines()[0])
        finally:
            for v, s in zip(layer.non_trainable_variables, state):
                v.assign(s)
        if out_dtype and out_dtype != layer.compute_dtype and layer.compute_dtype != "float32":
            note.append(f"returns {out_dtype}, not its compute dtype")
    return LayerAudit(layer.name, cls, policy_name(layer), layer.compute_dtype,
                      layer.variable_dtype, out_dtype, max(fwd, 0), max(bwd, 0), kinds,
                      "; ".join(note))


def audit(model: Any, sample_batch: Any = None, batch_size: int = 8) -> Audit:
    """Per layer: policy, compute and variable dtype, output dtype, and the casts it adds.

    Args:
        model: a built Keras model. A subclassed one needs ``sample_batch``: each layer's
            input is recorded as it arrives on one forward pass.
        sample_batch: inputs (or an ``(x, y)`` batch); default a random batch of
            ``batch_size`` shaped like the model's inputs (Functional and Sequential only).

    A layer that fails under its policy is listed with a note naming the error (use
    :func:`policies.check` to raise it). Nothing in the model changes.

    >>> import keras
    >>> m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")])
    >>> report = audit(m)
    >>> report.layer("d").casts, report.model_casts  # all float32: no casts anywhere
    (0, 0)
    """
    import keras
    import tensorflow as tf

    x = inputs_of(sample_batch) if sample_batch is not None else sample_inputs(model, batch_size)
    top = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    graph = has_graph(model)
    single = runnable_alone(top, graph)
    if graph:
        ins, _ = probe_layers(model, single, x)
        values = {id(layer): v for layer, v in zip(single, ins)}
        outputs = output_layers(model)
    else:  # subclassed: each layer's input as it arrived, in its producer's dtype
        recorded, outputs = record_calls(model, single, x, as_float32=False)
        values = {key: inp for key, (inp, _) in recorded.items()}
    stale = {id(layer) for layer, _ in stale_layers(model)}
    notes: list[str] = []
    failures: dict[str, tuple[str, str, BaseException]] = {}
    rows = [_audit_layer(layer, values, graph, outputs, stale, failures) for layer in top]
    try:
        graph_def, sum_casts = _model_graph(model, tf.nest.map_structure(tf.convert_to_tensor, x))
        model_casts = len(cast_nodes(graph_def)) - sum_casts
        round_trips = count_round_trips(graph_def)
    except Exception as err:  # noqa: BLE001
        model_casts = round_trips = None
        notes.append(f"the whole model did not trace: {type(err).__name__}: "
                     f"{str(err).splitlines()[0] if str(err) else ''}")
    return Audit(model.name, current(), rows, model_casts, round_trips, notes, failures)


def _expand(feeders: list[Any], flat: list[Any]) -> list[Any]:
    if len(feeders) == len(flat):
        return feeders
    return [feeders[0] if feeders else None] * len(flat)


def _producer_dtype(producer: Any, value: Any) -> Any:
    import keras

    if producer is None or isinstance(producer, keras.layers.InputLayer):
        return value.dtype
    return producer.compute_dtype


def _minus_sum_cast(kinds: dict[str, int], out_dtype: str) -> dict[str, int]:
    kinds = dict(kinds)
    for key in (f"{out_dtype}->float32", f"float32->{out_dtype}"):
        kinds[key] = kinds.get(key, 0) - 1
        if kinds[key] <= 0:
            del kinds[key]
    return kinds


def check(model: Any, sample_batch: Any = None, batch_size: int = 8) -> None:
    """Raise :class:`~policies.errors.LayerDtypeError` naming the first layer that fails.

    Runs each top-level layer alone under its own policy (forward and gradient), on inputs in
    the dtype its producers hand it. Returns None when every layer runs.

    >>> import keras, numpy as np, policies
    >>> class AddOne(keras.layers.Layer):
    ...     def call(self, x):
    ...         return x + keras.ops.ones_like(x, dtype="float32")  # breaks in 16 bit
    >>> model = keras.Sequential([keras.Input((4,)), AddOne(name="add_one")])
    >>> policies.check(model)  # float32: fine
    >>> model.layers[0].dtype_policy = "mixed_bfloat16"
    >>> policies.check(model)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    policies.errors.LayerDtypeError: layer 'add_one' (AddOne) fails under ...
    """
    result = audit(model, sample_batch, batch_size)
    for name, (cls, policy, err) in result.failures.items():
        raise LayerDtypeError(name, cls, policy, err) from err
