"""Tracing a step's tfmx form on a thread of its own while the fit's stock step runs on.

Where the price gate decides mid-fit that tfmx's form of a train step pays for itself, that
form is traced with tfmx's stages and rewritten: seconds of Python, during which, traced in the
fit's own thread, no step runs. :class:`BackgroundTrace` does that work on a worker thread
instead while the fit's thread keeps calling the stock step (which runs in TensorFlow's
runtime, mostly without Python's lock); the fit switches to tfmx's form at its first call after
the trace is done, paying on its critical path only that form's first run and what the trace
took from the steps beside it.

Two things stay in order while a trace runs beside the fit:

- the tuner's measurements (``tfmx.tuner``: timed runs of candidate forms) never overlap a
  step of the fit (:func:`measuring` and :func:`stepping` wait for each other), so neither
  times the other;
- anything else the fit's thread traces (e.g. its evaluation step) waits for the trace under
  way (:func:`waiting`): tfmx's tuner and report are not shared by two traces at once.

Example:
    >>> from tfmx.background_trace import BackgroundTrace
    >>> trace = BackgroundTrace(lambda: 6 * 7).start()
    >>> trace.take()
    42
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from fusion import private_api
from tfmx import fit_plan

T = TypeVar("T")

_condition = threading.Condition()
# the tuner's measurements under way, and the fit's steps under way beside a trace
_under_way = {"measuring": 0, "stepping": 0}
_active: dict[int, BackgroundTrace] = {}  # the fit's thread -> its trace under way

EXIT_WAIT_S = 120.0
"""How long the interpreter's exit waits for a trace under way (a trace cut by the exit can
leave TensorFlow's runtime mid-way)."""


def why_not() -> str:
    """Why this thread's step cannot be traced on another thread ("" where it can): what
    TensorFlow and Keras keep per thread and a worker would not see (a distribution
    strategy's scope, a device scope) or that tfmx cannot hand it (Keras's global state).

    >>> why_not()
    ''
    """
    import tensorflow as tf

    if tf.distribute.has_strategy():
        return "a distribution strategy's scope is the fit's thread's"
    if tf.executing_eagerly() and _device_name():
        return "a device scope is the fit's thread's"
    try:
        private_api.get("keras.global_state")
    except private_api.MissingPrivateName as exc:
        return str(exc)
    return ""


def _device_name() -> str:
    from tensorflow.python.eager import context

    return context.context().device_name or ""


@contextlib.contextmanager
def _inheriting(plan: Any, keras_state: list[tuple[Any, dict[str, Any]]]) -> Iterator[None]:
    """The worker thread takes the fit's plan and Keras's per-thread global state (its dtype
    policy, its settings) as the fit's thread holds them."""
    for tracker, values in keras_state:
        tracker.__dict__.update(values)
    with fit_plan.adopting(plan):
        yield


def _keras_state() -> list[tuple[Any, dict[str, Any]]]:
    module = private_api.get("keras.global_state")
    trackers = [getattr(module, name, None) for name in ("GLOBAL_STATE_TRACKER",
                                                         "GLOBAL_SETTINGS_TRACKER")]
    return [(t, dict(t.__dict__)) for t in trackers if t is not None]


class BackgroundTrace(Generic[T]):
    """``work()`` (a trace) run on a worker thread that inherits the calling thread's fit
    (``tfmx.fit_plan.active_plan``) and Keras's global state (to be used where
    :func:`why_not` says nothing); :meth:`ready` says whether it is done, :meth:`take`
    returns its result (or raises its exception). ``seconds``: how long it ran."""

    def __init__(self, work: Callable[[], T], name: str = "tfmx-trace") -> None:
        self._work = work
        self._inherit = functools.partial(_inheriting, fit_plan.active_plan(), _keras_state())
        self._owner = threading.get_ident()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._result: T | None = None
        self._error: BaseException | None = None
        self.seconds = 0.0

    def start(self) -> BackgroundTrace[T]:
        """Start the work; the owner thread's other traces wait for it (:func:`waiting`)."""
        _active[self._owner] = self
        self._thread.start()
        return self

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            with self._inherit():
                self._result = self._work()
        except BaseException as exc:  # noqa: BLE001 - handed to the fit's thread by take()
            self._error = exc
        finally:
            self.seconds = time.perf_counter() - start
            if _active.get(self._owner) is self:
                del _active[self._owner]

    def ready(self) -> bool:
        """Whether the work is done (its result, or its exception, waits in :meth:`take`)."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the work is done (at most ``timeout`` seconds)."""
        self._thread.join(timeout)

    def take(self) -> T:
        """The work's result, once done (waiting for it); its exception, raised here."""
        self.wait()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Before this thread traces: wait for the trace it started beside itself, if one runs
    (the worker thread itself, and other threads, go on at once).

    >>> with waiting():
    ...     pass
    """
    pending = _active.get(threading.get_ident())
    if pending is not None:
        pending.wait()
    yield


def running() -> bool:
    """Whether a trace runs beside a fit in this process.

    >>> running()
    False
    """
    return bool(_active)


@contextlib.contextmanager
def _taking_turns(mine: str, other: str) -> Iterator[None]:
    """A block of kind ``mine`` starts once none of kind ``other`` runs; those wait for it."""
    with _condition:
        _condition.wait_for(lambda: _under_way[other] == 0)
        _under_way[mine] += 1
    try:
        yield
    finally:
        with _condition:
            _under_way[mine] -= 1
            _condition.notify_all()


def measuring() -> contextlib.AbstractContextManager[None]:
    """The tuner times candidates in this block: it starts once no step of a fit beside a
    trace runs, and such steps wait for it to end (nested measurements count once each).

    >>> with measuring():
    ...     pass
    """
    return _taking_turns("measuring", "stepping")


def stepping() -> contextlib.AbstractContextManager[None]:
    """A step of the fit runs in this block while a trace runs beside it: it starts once no
    measurement of the tuner runs, and measurements wait for it to end.

    >>> with stepping():
    ...     pass
    """
    return _taking_turns("stepping", "measuring")


@atexit.register
def _finish_at_exit() -> None:
    for trace in list(_active.values()):
        trace.wait(EXIT_WAIT_S)


__all__ = ["EXIT_WAIT_S", "BackgroundTrace", "measuring", "running", "stepping", "waiting",
           "why_not"]

