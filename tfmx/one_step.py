"""Keras's one-step call (``steps_per_execution == 1`` under Keras 3.16), guarded as its loop is.

Keras 3.16's train and test functions, for one step a call, read the batch outside any
``tf.function`` (the iterator's ``get_next_as_optional()``) and call the traced step
(``one_step_on_data``) on it: the step's graph runs alone, not inside a loop's ``While``, and
TensorFlow's graph optimizer treats it as it treats a top-level function. A
:class:`OneStepDispatch` does the same: each form of the step (tfmx's, stock, XLA-compiled) is
the step's own ConcreteFunction for the batch's structure (:meth:`FusedFunction.form_function
<tfmx.fused_function.FusedFunction.form_function>`), called on the batch read outside it, so a
step tfmx left as it was runs the very function stock Keras runs. Everything else is
:class:`~tfmx.dispatch.IteratorDispatch`'s: one slot per iterator type, the whole-step guard
choosing between the forms, the price gate's stock step timed and asked again, and tfmx's step
loop (:mod:`tfmx.step_loop`), whose several steps a call trace Keras's own loop.

Another form is traced before it runs (by the guard before its first timed call, or on a thread
of its own while the stock step runs on: :mod:`tfmx.background_trace`) for the structure of the
last batch read, never reading the iterator itself, so a form whose trace fails (an op XLA
cannot compile) takes no batch, and the batches run in their order, one a call.

Example:
    >>> import tensorflow as tf
    >>> from tfmx.fused_function import FusedFunction
    >>> from tfmx.one_step import OneStepDispatch
    >>> step = FusedFunction(lambda data: data * 2.0)
    >>> one = OneStepDispatch(step, loop=None)
    >>> it = iter(tf.data.Dataset.from_tensor_slices([1.0, 2.0]))
    >>> [float(one(it).get_value()) for _ in range(2)], one(it).has_value()
    ([2.0, 4.0], False)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tfmx import guard
from tfmx.dispatch import IteratorDispatch
from tfmx.fused_function import call_key


class Batch(tuple):
    """What one call returns: the step's outputs, or nothing at the end of the data (the
    methods Keras's loop reads of its ``tf.experimental.Optional``, without building one).

    >>> Batch((1,)).get_value(), Batch(()).has_value()
    (1, False)
    """

    def has_value(self) -> bool:
        """Whether the step ran (the data was not at its end)."""
        return bool(self)

    def get_value(self) -> Any:
        """The step's outputs."""
        return self[0]


def _without_optionals(data: Any) -> Any:
    """``data`` with every ``tf.experimental.Optional`` in it as None (what Keras's step wrapper
    passes its step)."""
    leaves = tf.nest.flatten(data)
    if not any(isinstance(leaf, tf.experimental.Optional) for leaf in leaves):
        return data
    return tf.nest.map_structure(
        lambda leaf: None if isinstance(leaf, tf.experimental.Optional) else leaf, data)


class _Form:
    """One form of the step as a function of the iterator: reads the next batch and runs the
    step's ConcreteFunction in that form for the batch's structure (traced on its first
    batch)."""

    def __init__(self, dispatch: OneStepDispatch, form: str, forced: bool = False) -> None:
        self._dispatch, self.form, self._forced = dispatch, form, forced
        self._stock = False  # the price gate ran its first batch as stock: so every batch
        self._concrete: dict[Any, Any] = {}  # the batch's call key -> ConcreteFunction

    def __call__(self, iterator: Any) -> Batch:
        data = self._dispatch._next(iterator)
        if data is None:
            return Batch(())
        return Batch((self.trace(data)(data),))

    def trace(self, data: Any) -> Any:
        """The step's ConcreteFunction in this form for ``data``'s structure (traced once per
        structure where the batch has a call key, as tf.function's own lookup would)."""
        key = call_key((data,), {})
        concrete = self._concrete.get(key) if key is not None else None
        if concrete is None:
            step = self._dispatch._step
            if self._stock:
                concrete = step.stock_concrete_function(data)
            else:
                # a form the guard traces is traced as it asks (tfmx's form: without asking
                # the price gate again); another batch structure (an epoch's last, smaller
                # batch) as the first was, where the gate was asked
                with guard.forcing(self.form) if self._forced else contextlib.nullcontext():
                    concrete = step.form_function(self.form, data)
                if not self._forced:
                    self._forced, self._stock = True, step.gated(concrete)
            if key is not None:
                self._concrete[key] = concrete
        return concrete

    def concrete_functions(self) -> list[Any]:
        """The ConcreteFunctions this form ran."""
        return list(self._concrete.values())


class OneStepDispatch(IteratorDispatch):
    """``function(iterator)``: one step on the iterator's next batch, its traced step called on
    it directly (see the module doc). ``step``: the step's
    :class:`~tfmx.fused_function.FusedFunction`; ``loop``: Keras's step loop
    (``multi_step_on_iterator``'s ``tf.function``, what calls it cannot serve run); ``twin``:
    makes another ``tf.function`` of that loop (tfmx's several steps a call)."""

    def __init__(self, step: Any, loop: Any, twin: Callable[[], Any] | None = None,
                 make_guard: Callable[..., guard.StepGuard | None] | None = None,
                 name: str = "") -> None:
        super().__init__(loop if loop is not None else step, twin=twin,
                         make_guard=make_guard, name=name or getattr(step, "name", "step"))
        self._step = step
        self._forms: list[_Form] = []  # every form's function of the iterator made
        self._last: Any = None  # the last batch read: what another form is traced for

    def _next(self, iterator: Any) -> Any:
        """The next batch (None at the end), read as Keras 3.16 reads it."""
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            return None
        self._last = _without_optionals(optional.get_value())
        return self._last

    def _form(self, form: str) -> _Form:
        made = _Form(self, form)
        self._forms.append(made)
        return made

    def _first_call(self, iterator: Any) -> tuple[Any, Any]:
        fused = self._form("fused")
        return fused(iterator), fused

    def _form_function(self, form: str, iterator: Any) -> Any:
        """``form``'s function of the iterator, traced (not run) for the structure of the last
        batch read; the iterator is not read."""
        made = _Form(self, form, forced=True)
        if self._last is not None:
            made.trace(self._last)
        self._forms.append(made)
        return made

    def _list_all_concrete_functions(self) -> list[Any]:
        """The step's ConcreteFunctions this dispatch ran (tfmx's several steps a call too)."""
        ran = {id(c): c for one in self._forms for c in one.concrete_functions()}
        ran.update((id(c), c) for slot in self._slots.values() for c in slot.steps.values())
        return list(ran.values())


__all__ = ["Batch", "OneStepDispatch"]
