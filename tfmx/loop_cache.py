"""The step loop's choices (``tfmx.step_loop``) in the machine's tuning cache.

A trial of one step a call against N steps a call is a fact about a step on a machine: it is
kept in the tuning cache (``tfmx.tuning_cache``) as a tuner ``Decision`` of the family
:data:`FAMILY` under the step's signature (:func:`step_signature`), the step's form and N, with
each size's median per step and the N-step loop's trace, so that a later fit of the same model
on this machine takes the choice without a trial. The trials of other steps on the machine
calibrate the estimate that decides whether a new step's trial may pay (:func:`calibration`):
what N steps a call saved against Keras's loop's share of a step timed before, and what
tracing the N-step loop cost against the one-step loop's first call.

Example:
    >>> import pathlib, tempfile
    >>> from tfmx.loop_cache import recall, store
    >>> from tfmx.tuning_cache import TuningCache
    >>> cache = TuningCache(pathlib.Path(tempfile.mkdtemp()) / "t.json", {"backend": "cpu"})
    >>> store(cache, "abc|stock|n=32", 32, one_ms=2.2, many_ms=1.4, trace_s=3.0,
    ...       loop_ms=0.4, first_s=2.0)
    >>> found = recall(cache, "abc|stock|n=32", 32)
    >>> found.choice, found.times_ms, found.first_ms
    ('32', {'1': 2.2, '32': 1.4, 'loop': 0.4}, {'32': 3000.0, '1': 2000.0})
    >>> calibration(cache)  # saved 0.8 ms a step where Keras's loop's 31/32 was 0.3875 ms
    (2.065, 1.5, 1)
    >>> recall(cache, "abc|stock|n=16", 16) is None
    True
"""

from __future__ import annotations

import hashlib
import statistics
from typing import Any

from tfmx.tuning_cache import Decision

FAMILY = "step_loop"
"""The tuning cache's family of the loop's choices (``step_loop|<step>|<form>|n=<N>``)."""


def step_signature(model: Any, spec: Any) -> str:
    """A train step's key in the tuning cache: a hash of the model's class, its layers' classes,
    its weights (shapes, dtypes), its optimizer's and loss's classes and the batches' type
    (``spec``). Two models of the same architecture share it; layer names are left out.

    >>> import keras
    >>> def make():
    ...     return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> step_signature(make(), "batch") == step_signature(make(), "batch")
    True
    >>> step_signature(make(), "batch") == step_signature(make(), "other batch")
    False
    """
    layers = [type(layer).__name__ for layer in getattr(model, "layers", ())]
    weights = [(tuple(w.shape), str(w.dtype)) for w in model.weights]
    loss = getattr(model, "loss", None)
    parts = (type(model).__name__, layers, weights,
             type(getattr(model, "optimizer", None)).__name__,
             loss if isinstance(loss, str) else type(loss).__name__, str(spec))
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


def recall(cache: Any, key: str, n: int) -> Decision | None:
    """The choice a trial of the step ``key`` (signature, form, N) made on this machine, with
    its figures; None without one (or ``cache`` None).

    >>> recall(None, "abc|stock|n=32", 32) is None
    True
    """
    found = cache.get(f"{FAMILY}|{key}") if cache is not None else None
    size = str(n)
    if found is None or found.choice not in ("1", size) or not {"1", size} <= set(
            found.times_ms):
        return None
    return found


def store(cache: Any, key: str, kept: int, one_ms: float, many_ms: float, trace_s: float,
          loop_ms: float, first_s: float) -> None:
    """Keep a trial's choice (``kept`` steps a call of N in ``key``) and its figures: each
    size's median per step (ms), Keras's loop's share of a step (ms), the N-step loop's trace
    and the one-step loop's first call (s). Nothing without ``cache``."""
    if cache is None:
        return
    size = key.rsplit("n=", 1)[-1]
    cache.put(Decision(FAMILY, key, str(kept), ("1", size),
                       {"1": one_ms, size: many_ms, "loop": loop_ms},
                       first_ms={size: trace_s * 1e3, "1": first_s * 1e3}))


def calibration(cache: Any) -> tuple[float, float, int] | None:
    """What the step loops' trials on this machine measured against the gate's estimates:
    the median of (the saving a step measured, floored at the estimate) / (the estimate:
    Keras's loop's share of a step times (N - 1) / N), the median of the N-step loop's trace /
    the one-step loop's first call, and how many trials; None without any. The saving's ratio
    is at least 1: the estimate is what N steps a call takes off Keras's Python loop alone, and
    a step whose N-step loop ran slower says so of that step, not of the machine.

    >>> calibration(None) is None
    True
    """
    if cache is None:
        return None
    savings, traces = [], []
    for raw in cache.contents().get("decisions", {}).values():
        try:
            if raw.get("family") != FAMILY:
                continue
            size = raw["candidates"][1]
            times, first = raw["times_ms"], raw["first_ms"]
            estimate = times["loop"] * (1 - 1 / int(size))
            if estimate > 0 and first["1"] > 0:
                savings.append(max(1.0, (times["1"] - times[size]) / estimate))
                traces.append(first[size] / first["1"])
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):
            continue
    if not savings:
        return None
    return (round(statistics.median(savings), 3), round(statistics.median(traces), 3),
            len(savings))


__all__ = ["FAMILY", "calibration", "recall", "step_signature", "store"]
