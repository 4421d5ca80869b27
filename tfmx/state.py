"""The global switch: what ``tfmx.enable()`` set, and a generation counter.

Every enable()/disable() bumps ``generation``; Keras models whose step functions were built
under another generation rebuild them on their next fit/evaluate/predict.

>>> from tfmx import state
>>> isinstance(state.generation(), int)
True
"""

from __future__ import annotations

import dataclasses
import threading
import warnings

from tfmx.backends import Backend
from tfmx.errors import TfmxWarning
from tfmx.report import Report


@dataclasses.dataclass(frozen=True)
class Options:
    """What enable() was called with, resolved."""

    backend: Backend
    patterns: tuple[str, ...] | None
    verify: bool
    rtol: float = 1e-4
    atol: float = 1e-5


_lock = threading.Lock()
_options: Options | None = None
_generation = 0
_report = Report()
_warned: set[str] = set()


def options() -> Options | None:
    """The active options, or None when tfmx is disabled."""
    return _options


def generation() -> int:
    return _generation


def set_options(opts: Options | None) -> None:
    global _options, _generation, _report
    with _lock:
        _options = opts
        _generation += 1
        if opts is not None:
            _report = Report(backend=opts.backend.name)


def report() -> Report:
    return _report


def reset_report() -> None:
    global _report
    _report = Report(backend=_options.backend.name if _options else "")


def warn_once(key: str, message: str) -> None:
    """Warn (category TfmxWarning) the first time ``key`` is seen in this process."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, TfmxWarning, stacklevel=3)
