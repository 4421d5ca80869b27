"""The step loop's choices (``tfmx.step_loop``) in the machine's tuning cache.

A trial of one step a call against N steps a call is a fact about a step on a machine: it is
kept in the tuning cache (``tfmx.tuning_cache``) as a tuner ``Decision`` of the family
:data:`FAMILY` under the step's signature (:func:`step_signature`), the step's form and N, with
each size's median per step and the N-step loop's trace, so that a later fit of the same model
on this machine takes the choice without a trial.

Example:
    >>> import pathlib, tempfile
    >>> from tfmx.loop_cache import recall, store
    >>> from tfmx.tuning_cache import TuningCache
    >>> cache = TuningCache(pathlib.Path(tempfile.mkdtemp()) / "t.json", {"backend": "cpu"})
    >>> store(cache, "abc|stock|n=32", 32, one_ms=2.2, many_ms=1.4, trace_s=3.0)
    >>> found = recall(cache, "abc|stock|n=32", 32)
    >>> found.choice, found.times_ms, found.first_ms
    ('32', {'1': 2.2, '32': 1.4}, {'32': 3000.0})
    >>> recall(cache, "abc|stock|n=16", 16) is None
    True
"""

from __future__ import annotations

import hashlib
from typing import Any

from tfmx.tuning_cache import Decision

FAMILY = "step_loop"
"""The tuning cache's family of the loop's choices (``step_loop|<step>|<form>|n=<N>``)."""


def step_signature(model: Any, spec: Any) -> str:
    """A train step's key in the tuning cache: a hash of the model's class, its layers' classes
    and weights (shapes, dtypes), its optimizer's and loss's classes and the batches' type
    (``spec``). Two models of the same architecture share it; layer names are left out.

    >>> import keras
    >>> def make():
    ...     return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> step_signature(make(), "batch") == step_signature(make(), "batch")
    True
    >>> step_signature(make(), "batch") == step_signature(make(), "other batch")
    False
    """
    layers = [(type(layer).__name__, [(tuple(w.shape), str(w.dtype)) for w in layer.weights])
              for layer in model._flatten_layers(include_self=False)]
    loss = getattr(model, "loss", None)
    parts = (type(model).__name__, layers, type(getattr(model, "optimizer", None)).__name__,
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


def store(cache: Any, key: str, kept: int, one_ms: float, many_ms: float,
          trace_s: float) -> None:
    """Keep a trial's choice (``kept`` steps a call of N in ``key``) and its figures: each
    size's median per step (ms) and the N-step loop's trace (s). Nothing without ``cache``."""
    if cache is None:
        return
    size = key.rsplit("n=", 1)[-1]
    cache.put(Decision(FAMILY, key, str(kept), ("1", size), {"1": one_ms, size: many_ms},
                       first_ms={size: trace_s * 1e3}))


__all__ = ["FAMILY", "recall", "step_signature", "store"]
