"""Calling Keras's step loop through its traced function, without ``tf.function``'s per-call work.

``model.fit`` calls ``train_function(iterator)`` once per step; inside, Keras calls a
``tf.function`` (``multi_step_on_iterator``) with the data iterator. On every call that
``tf.function`` binds the argument again, builds the call's function type and looks it up in its
cache, hashing every tensor the function captured: every model variable and optimizer slot.
For the benchmark MLP (200 captured handles) that is 1-1.5 ms a step, as long as the step's
whole graph after tfmx's rewrite. :class:`IteratorDispatch` does the lookup once per iterator
type: the first call of each goes through the ``tf.function`` (tracing, variable creation,
retracing rules all TensorFlow's), later calls go to the ConcreteFunction that call ran. It
steps aside (calls the ``tf.function``) for anything but an eager call with one ``tf.data``
iterator: distributed iterators, extra arguments, ``tf.config.run_functions_eagerly(True)``,
calls inside a graph.

Example:
    >>> import tensorflow as tf
    >>> from tfmx.dispatch import IteratorDispatch
    >>> total = tf.Variable(0.0)
    >>> @tf.function
    ... def step(iterator):
    ...     return total.assign_add(iterator.get_next())
    >>> fast = IteratorDispatch(step)
    >>> it = iter(tf.data.Dataset.from_tensor_slices([1.0, 2.0, 3.0]))
    >>> [float(fast(it)) for _ in range(3)]
    [1.0, 3.0, 6.0]
    >>> step.experimental_get_tracing_count()
    1
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.python.data.ops import iterator_ops


class IteratorDispatch:
    """``function(iterator)`` for a ``tf.function`` of one ``tf.data`` iterator, looked up once
    per iterator type (see the module doc). Other attributes are the wrapped function's."""

    def __init__(self, function: Any) -> None:
        self._function = function
        self._concrete: dict[Any, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._function, name)

    def __call__(self, iterator: Any, *args: Any, **kwargs: Any) -> Any:
        if (args or kwargs or not isinstance(iterator, iterator_ops.OwnedIterator)
                or not tf.executing_eagerly() or tf.config.functions_run_eagerly()):
            return self._function(iterator, *args, **kwargs)
        spec = iterator._type_spec
        concrete = self._concrete.get(spec)
        if concrete is None:
            outputs = self._function(iterator)  # traces (or retraces) as TensorFlow decides
            self._concrete[spec] = self._function.get_concrete_function(iterator)
            return outputs
        return concrete(iterator)


__all__ = ["IteratorDispatch"]
