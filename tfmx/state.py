"""The global switch: what ``tfmx.enable()`` set, and a generation counter.

Every enable()/disable() bumps ``generation``; Keras models whose step functions were built
under another generation rebuild them on their next fit/evaluate/predict.

>>> from tfmx import state
>>> isinstance(state.generation(), int)
True
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from typing import Any

from tfmx.backends import Backend
from tfmx.errors import TfmxWarning
from tfmx.reporting import Report


@dataclasses.dataclass(frozen=True)
class Options:
    """What enable() was called with, resolved."""

    backend: Backend
    patterns: tuple[str, ...] | None
    verify: bool | str  # True, False or "first-step" (tfmx.verify.FALLBACK)
    rtol: float = 1e-4
    atol: float = 1e-5
    tune: str = "auto"  # tfmx.tuner.MODES
    guard: bool = True  # the whole-step guard (tfmx.guard)
    xla: bool = True  # the guard tries the XLA-compiled step, stages XLA regions (cpu, cuda)
    strict: bool = False  # a stage that fails raises instead of falling back to Keras's call
    fuse: str = "measured"  # "always": every family's fused form (tfmx.env.FUSE_MODES)

    def xla_allowed(self) -> bool:
        """XLA may compile steps and regions: asked for, and a backend Keras compiles for."""
        return self.xla and self.backend.name in ("cpu", "cuda") and self.backend.available

    def guard_challengers(self) -> tuple[str, ...]:
        """The forms a whole-step guard tries against stock, in order."""
        return ("fused", "xla") if self.xla_allowed() else ("fused",)


ENV_STRICT = "TFMX_STRICT"


def strict_by_env() -> bool:
    """``$TFMX_STRICT``: 1 (on) makes a failing stage raise; unset or 0, off.

    >>> import os
    >>> strict_by_env() == (os.environ.get("TFMX_STRICT", "0").strip().lower() in
    ...                     ("1", "true", "on", "yes"))
    True
    """
    value = os.environ.get(ENV_STRICT, "0").strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no", ""):
        return False
    raise ValueError(f"${ENV_STRICT} must be 1 or 0 (on/off), got {value!r}")


_lock = threading.Lock()
_options: Options | None = None
_generation = 0
_report = Report()
_warned: set[str] = set()
_tuners: dict[tuple[int, str], Any] = {}


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
            _report = Report(backend=opts.backend.name,
                             metal=opts.backend if opts.backend.name == "metal" else None)
            from tfmx.backends import ONEDNN_OFF_ADVICE

            if ONEDNN_OFF_ADVICE in opts.backend.notes:  # the cpu backend, oneDNN's pass off
                _report.note(ONEDNN_OFF_ADVICE)
            _report.fuse = opts.fuse
            if opts.fuse == "always":
                _report.note(FUSE_ALWAYS)


def tuner() -> Any:
    """The :class:`tfmx.tuner.Tuner` of the active options (one per enable(), so a decision
    is measured once per process and recorded in the report once); None when disabled."""
    opts = _options
    if opts is None:
        return None
    several = multi_worker()
    key = (_generation, opts.backend.name, several)
    found = _tuners.get(key)
    if found is None:
        from tfmx.tuner import Tuner, TuningCache

        if several:  # every worker must trace the same step: no timing may pick its form
            found = Tuner("off", None, on_decision=lambda d: _report.add_decision(d),
                          off_reason=MULTI_WORKER, fused=opts.fuse == "always")
            _report.note(f"tuner: {MULTI_WORKER}")
        else:
            cache = None if opts.tune == "off" else TuningCache.for_backend(opts.backend.name)
            found = Tuner(opts.tune, cache, on_decision=lambda d: _report.add_decision(d),
                          fused=opts.fuse == "always")
        _tuners.clear()
        _tuners[key] = found
    return found


FUSE_ALWAYS = ("fuse='always' (TFMX_FUSE=always): every family takes its fused form where it "
               "applies; no price gate, no whole-step trial, the tuner measures within its own "
               "budget whatever the fit's length, and each tuned choice takes a fused form (the "
               "fastest measured, else the first): the fused step runs, untimed against stock")

MULTI_WORKER = ("several workers: each decision takes the form stock TensorFlow runs, measured "
                "nothing, and the whole-step guard is off (timings differ from worker to "
                "worker, and the workers must run the same step)")


def multi_worker() -> bool:
    """True when this process runs collectives with other processes: a
    ``MultiWorkerMirroredStrategy`` (or another cluster) with more than one task configured.

    >>> multi_worker()
    False
    """
    from tensorflow.python.eager import context

    ctx = context.context()
    server_def = getattr(ctx, "_collective_ops_server_def", None) or ctx.get_server_def()
    if server_def is None:
        return False
    return sum(len(job.tasks) for job in server_def.cluster.job) > 1


def tuning_cache() -> Any:
    """The tuner's per-machine cache when it may be used (tune "auto"), else None: where the
    whole-step guard remembers what it kept."""
    found = tuner()
    return getattr(found, "cache", None) if getattr(found, "mode", None) == "auto" else None


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
