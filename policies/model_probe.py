"""Running a model's layers on sample inputs and recording what each one is called with.

What :func:`policies.tune` and :func:`policies.audit` both need before they look at a layer
alone: a batch shaped like the model's inputs (:func:`sample_inputs`), which top-level layers
can be run on their own (:func:`runnable_alone`), which layers feed a layer
(:func:`producers`), and each layer's recorded input and output, read from the graph of a
Functional or Sequential model (:func:`probe_layers`) or recorded on one forward pass of a
subclassed one (:func:`record_calls`).

Example:
    >>> import keras
    >>> from policies.model_probe import probe_layers, sample_inputs
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")])
    >>> x = sample_inputs(model, batch_size=4)
    >>> ins, outs = probe_layers(model, model.layers, x)
    >>> tuple(ins[0].shape), tuple(outs[0].shape)
    ((4, 3), (4, 2))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from fusion import patches
from policies.layers import LayerCall


def sample_inputs(model: Any, batch_size: int = 32, seed: int = 0) -> Any:
    """A random batch shaped like ``model``'s inputs (normal floats; zeros for integers).

    Raises ValueError when the inputs are not known (a subclassed model) or not fully shaped.

    >>> import keras
    >>> sample_inputs(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]), 2).shape
    (2, 3)
    """
    try:
        specs = list(model.inputs)
    except (AttributeError, ValueError, TypeError):
        specs = []
    if not specs:
        raise ValueError(f"model {model.name!r} has no known inputs (a subclassed model?): "
                         "pass sample_batch=")
    rng = np.random.default_rng(seed)
    batches = []
    for spec in specs:
        shape = (batch_size, *spec.shape[1:])
        if any(d is None for d in shape):
            raise ValueError(f"input shape {tuple(spec.shape)} of {model.name!r} is not fully "
                             "known: pass sample_batch=")
        dtype = np.dtype(spec.dtype)
        if np.issubdtype(dtype, np.floating):
            batches.append(rng.standard_normal(shape).astype(np.float32))
        else:
            batches.append(np.zeros(shape, dtype=dtype))
    return batches[0] if len(batches) == 1 else batches


def inputs_of(sample_batch: Any) -> Any:
    """The inputs of a batch that may be ``(x, y)`` or ``(x, y, sample_weight)``.

    >>> inputs_of(("x", "y")), inputs_of(("x", "y", "w")), inputs_of("x")
    ('x', 'x', 'x')
    """
    if isinstance(sample_batch, tuple) and len(sample_batch) in (2, 3):
        return sample_batch[0]
    return sample_batch


def producers(layer: Any) -> list[Any]:
    """The layers whose outputs ``layer`` takes as inputs (its first call in the graph).

    >>> import keras
    >>> inp = keras.Input((2,))
    >>> a, b = keras.layers.Dense(2, name="a"), keras.layers.Dense(2, name="b")
    >>> add = keras.layers.Add(name="add")
    >>> _ = keras.Model(inp, add([a(inp), b(inp)]))
    >>> [p.name for p in producers(add)]
    ['a', 'b']
    """
    node = layer._inbound_nodes[0]
    found = []
    for t in node.input_tensors:
        history = getattr(t, "_keras_history", None)
        if history is not None and history[0] not in found:
            found.append(history[0])
    return found


def has_graph(model: Any) -> bool:
    """True for Functional and Sequential models (their layers' inputs are known).

    >>> import keras
    >>> class Sub(keras.Model):
    ...     def call(self, x):
    ...         return x
    >>> has_graph(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])), has_graph(Sub())
    (True, False)
    """
    try:
        return bool(model.inputs)
    except (AttributeError, ValueError, TypeError):
        return False


def runnable_alone(top: list[Any], graph: bool) -> list[Any]:
    """The layers of ``top`` that can be run on their own recorded input: not nested models,
    and in a Functional/Sequential ``graph`` called once (a subclassed model's shared layers
    show up when its calls are recorded).

    >>> import keras
    >>> inp = keras.Input((2,))
    >>> shared = keras.layers.Dense(2, name="shared")
    >>> inner = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)], name="inner")
    >>> once = keras.layers.Dense(2, name="once")
    >>> model = keras.Model(inp, once(inner(shared(shared(inp)))))
    >>> [layer.name for layer in runnable_alone(model.layers[1:], graph=True)]
    ['once']
    """
    import keras

    return [layer for layer in top
            if (len(getattr(layer, "_inbound_nodes", [])) == 1 or not graph)
            and not isinstance(layer, keras.Model)]


def probe_layers(model: Any, layers: list[Any], x: Any) -> tuple[list[Any], list[Any]]:
    """Each of ``layers``' input and output values in float32 for batch ``x`` (a Functional or
    Sequential ``model``, run once in inference mode with every layer computing in float32).

    A layer called with more than one tensor or with keyword arguments gets a
    :class:`~policies.layers.LayerCall` as its input.

    >>> import keras, numpy as np
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d",
    ...                                                             dtype="mixed_bfloat16")])
    >>> ins, outs = probe_layers(model, model.layers, np.ones((1, 3), "float32"))
    >>> keras.backend.standardize_dtype(outs[0].dtype), model.layers[0].compute_dtype
    ('float32', 'bfloat16')
    """
    import keras

    with _in_float32([layer for layer in model._flatten_layers(include_self=False)
                      if not isinstance(layer, keras.layers.InputLayer)]):
        inputs = model.inputs[0] if len(model.inputs) == 1 else model.inputs
        arguments = [layer._inbound_nodes[0].arguments for layer in layers]
        probe = keras.Model(inputs, [[list(a.keras_tensors) for a in arguments],
                                     [layer.output for layer in layers]])
        ins, outs = probe(x, training=False)
        ins = [_filled(a, values) for a, values in zip(arguments, ins)]
    return list(ins), list(outs)


@contextlib.contextmanager
def _in_float32(layers: list[Any]) -> Iterator[None]:
    """Each of ``layers`` computes in float32 inside the block: its ``_dtype_policy`` (what
    Keras's ``dtype_policy`` setter writes) a :func:`fusion.patches.temporarily` swap, the
    layer's own policy object back on the way out.

    >>> import keras
    >>> layer = keras.layers.Dense(2, dtype="mixed_bfloat16")
    >>> with _in_float32([layer]):
    ...     layer.compute_dtype
    'float32'
    >>> layer.compute_dtype
    'bfloat16'
    """
    import keras

    with contextlib.ExitStack() as swaps:
        for layer in layers:
            swaps.enter_context(patches.temporarily(layer, "_dtype_policy",
                                                    keras.dtype_policies.get("float32")))
        yield


def _filled(arguments: Any, values: list[Any]) -> Any:
    """A layer's recorded input: its one tensor, or a :class:`LayerCall` of its arguments."""
    args, kwargs = arguments.fill_in({id(kt): v for kt, v in zip(arguments.keras_tensors,
                                                                 values)})
    if len(args) == 1 and not kwargs:
        return args[0]
    return LayerCall(tuple(args), dict(kwargs))


def record_calls(model: Any, layers: list[Any], x: Any,
                 as_float32: bool = True) -> tuple[dict[int, tuple], list[Any]]:
    """Run ``model`` on ``x`` and record what each of ``layers`` was called with.

    For subclassed models, whose ``call`` is Python code: returns ``{id(layer): (input,
    output)}`` for the layers called exactly once (a layer called twice is shared) and the
    layers whose output is the model's output (the output layers). Every layer computes in
    float32 while recording unless ``as_float32=False`` (then each input arrives in the dtype
    its producer hands it). Layer classes are patched only while the model runs.

    >>> import keras, numpy as np
    >>> class Twice(keras.Model):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.shared, self.head = keras.layers.Dense(3), keras.layers.Dense(2)
    ...     def call(self, x):
    ...         return self.head(self.shared(self.shared(x)))
    >>> model = Twice()
    >>> _ = model(np.ones((1, 3)))  # built: the recorded run is its only call
    >>> once, outputs = record_calls(model, [model.shared, model.head], np.ones((1, 3)))
    >>> list(once) == [id(model.head)], outputs == [model.head]
    (True, True)
    """
    import tensorflow as tf

    wanted = {id(layer) for layer in layers}
    seen: dict[int, list[tuple]] = {}

    def recording(original: Any) -> Any:
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
            out = original(self, *args, **kwargs)
            if id(self) in wanted:  # the input as handed over, before Keras casts it
                seen.setdefault(id(self), []).append(
                    (args[0] if args else kwargs.get("inputs"), out))
            return out

        return __call__

    with contextlib.ExitStack() as swaps:  # each class's __call__, for this run only
        for cls in dict.fromkeys(type(layer) for layer in layers):
            swaps.enter_context(patches.temporarily(cls, "__call__", recording(cls.__call__)))
        if as_float32:
            swaps.enter_context(_in_float32(model._flatten_layers(include_self=False)))
        result = model(x, training=False)
    once = {key: calls[0] for key, calls in seen.items() if len(calls) == 1}
    final = tf.nest.flatten(result)
    outputs = [layer for layer in layers if id(layer) in once and any(
        np.array_equal(np.asarray(o), np.asarray(f))
        for o in tf.nest.flatten(once[id(layer)][1]) for f in final)]
    return once, outputs


def reset_step_functions(model: Any) -> None:
    """Drop ``model``'s traced train/test/predict functions so the next call traces again
    (after its layers' policies changed).

    >>> import keras, numpy as np
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> _ = model.predict(np.ones((1, 2)), verbose=0)
    >>> reset_step_functions(model)
    >>> model.predict_function is None
    True
    """
    for attr in ("train_function", "test_function", "predict_function"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
