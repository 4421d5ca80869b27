"""What a ``fit`` plans: how many calls of its train function and how many steps, per thread.

Keras's ``fit`` announces its plan when it begins (its callbacks' ``epochs`` and ``steps``, the
model's ``steps_per_execution``: :func:`planning_callbacks`) and ends it when it ends
(:func:`ending_callbacks`, :func:`closing_fit`). While it runs, :func:`active_plan` is that
plan in its thread: the whole-step guard sizes its trial's budget on it, the price gate asks
whether rewriting the step pays within it, and the tuner bounds its measuring by it. Custom
loops and tests announce one with :func:`fitting`; a thread working for the fit's thread takes
its plan with :func:`adopting`.

Example:
    >>> from tfmx.fit_plan import active_plan, fitting
    >>> with fitting(epochs=2, steps=10, steps_per_execution=5):
    ...     active_plan().calls, active_plan().steps
    (4, 20)
    >>> active_plan() is None
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

from tfmx.thread_local import swapped

_local = threading.local()


@dataclasses.dataclass(frozen=True)
class FitPlan:
    """One ``fit``: its number (in this process), how many calls of its train function it
    plans and how many steps (batches) those run (None: unknown, e.g. a dataset of unknown
    length)."""

    serial: int
    calls: int | None
    steps: int | None = None
    verbose: int | None = None  # the fit's verbose (0: tfmx.notice prints nothing either)


_serials = itertools.count(1)


def plan_fit(epochs: int | None, steps: int | None, steps_per_execution: int = 1,
             verbose: int | None = None) -> FitPlan:
    """Announce a ``fit`` of ``epochs`` x ``steps`` batches, ``steps_per_execution`` batches a
    call, in this thread: the train step's guard sizes its budget on it.

    >>> plan_fit(3, 16, 4).calls
    12
    >>> current_plan().calls
    12
    """
    calls = total = None
    if epochs and steps and steps > 0:
        calls = epochs * -(-int(steps) // max(1, int(steps_per_execution or 1)))
        total = int(epochs) * int(steps)
    plan = FitPlan(next(_serials), calls, total, verbose)
    _local.plan = plan
    return plan


def current_plan() -> FitPlan | None:
    """The last ``fit`` announced in this thread (:func:`plan_fit`), None before any."""
    return getattr(_local, "plan", None)


def active_plan() -> FitPlan | None:
    """The plan of the ``fit`` under way in this thread (from its ``on_train_begin`` to its
    ``on_train_end``, see :func:`planning_callbacks`, or inside :func:`fitting`), else None:
    what the tuner's budget and the price gate size themselves on.

    >>> active_plan() is None
    True
    >>> with fitting(3, 16):
    ...     active_plan().steps
    48
    """
    return getattr(_local, "active", None)


@contextlib.contextmanager
def adopting(plan: FitPlan | None) -> Iterator[None]:
    """Make ``plan`` the fit under way in this thread for the block (a thread working for the
    fit's thread, e.g. the tuner's measuring thread).

    >>> with adopting(FitPlan(0, 4, 4)):
    ...     active_plan().calls
    4
    """
    with swapped(_local, "active", plan):
        yield


@contextlib.contextmanager
def fitting(epochs: int | None, steps: int | None,
            steps_per_execution: int = 1) -> Iterator[FitPlan]:
    """Announce a fit (:func:`plan_fit`) that is under way (:func:`active_plan`) for the
    block: what Keras's callbacks do around a ``fit``; tests and custom loops use it.

    >>> with fitting(1, 8) as plan:
    ...     active_plan() is plan
    True
    """
    plan = plan_fit(epochs, steps, steps_per_execution)
    with adopting(plan):
        yield plan


def planning_callbacks(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Keras's ``CallbackList.on_train_begin`` (install with ``fusion.patches``): when a
    fit begins, its callbacks' params (``epochs``, ``steps``) and the model's
    ``steps_per_execution`` announce its plan (:func:`plan_fit`).

    >>> class Callbacks:
    ...     params = {"epochs": 2, "steps": 8}
    >>> begin = planning_callbacks(lambda self, logs=None: active_plan().calls)
    >>> end = ending_callbacks(lambda self, logs=None: "ended")
    >>> begin(Callbacks()), end(Callbacks()), active_plan()
    (16, 'ended', None)
    """

    @functools.wraps(original)
    def on_train_begin(self: Any, logs: Any = None) -> Any:
        params = getattr(self, "params", None) or {}
        model = getattr(self, "model", None)
        try:
            plan = plan_fit(params.get("epochs"), params.get("steps"),
                            getattr(model, "steps_per_execution", 1) or 1,
                            params.get("verbose"))
        except (TypeError, ValueError):
            plan = plan_fit(None, None)
        _local.active = plan
        return original(self, logs)

    return on_train_begin


def ending_callbacks(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Keras's ``CallbackList.on_train_end``: the fit's plan is no longer under way
    (:func:`active_plan`).

    >>> end = ending_callbacks(lambda self, logs=None: "ended")
    >>> with fitting(1, 4):
    ...     end(None), active_plan()
    ('ended', None)
    """

    @functools.wraps(original)
    def on_train_end(self: Any, logs: Any = None) -> Any:
        _local.active = None
        return original(self, logs)

    return on_train_end


def closing_fit(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Keras's ``Trainer.fit``: whatever way the fit ends (``on_train_end``, or an
    exception that skips it), the plan under way before it (:func:`active_plan`, None outside a
    fit) is the one under way after it.

    >>> def fit(self):
    ...     plan_fit(1, 1)
    ...     _local.active = current_plan()
    ...     raise KeyboardInterrupt
    >>> try:
    ...     closing_fit(fit)(None)
    ... except KeyboardInterrupt:
    ...     pass
    >>> active_plan() is None
    True
    """

    @functools.wraps(original)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = getattr(_local, "active", None)
        try:
            return original(self, *args, **kwargs)
        finally:
            _local.active = before

    return fit


__all__ = ["FitPlan", "active_plan", "adopting", "closing_fit", "current_plan",
           "ending_callbacks", "fitting", "plan_fit", "planning_callbacks"]
