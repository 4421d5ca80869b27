"""Timing step functions interleaved, and the ratios read from the rounds (the recipes' and
the benchmark's timing).

- :func:`time_step_functions`: warm-up (the first call, tracing or compiling, timed apart),
  then rounds that time every function back to back, in an order rotated each round; per
  function the median ms per call, p25-p75, min and every round's time.
- :func:`median_ratios`: the modes' medians against stock's and XLA's.
- :func:`paired_ratios`: the same ratios taken round by round (:data:`PAIRS`), steadier than a
  ratio of medians when the machine's load drifts.
- :func:`noisy_modes`: the modes whose spread says the machine was busy (:data:`NOISY_SPREAD`).

Example:
    >>> from recipes._timing import median_ratios, time_step_functions
    >>> timing = time_step_functions({"stock": next, "tfmx": next},
    ...                              lambda mode: iter(range(100)), rounds=2, steps=3)
    >>> sorted(median_ratios(timing))
    ['tfmx/stock']
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from tfmx.timing import sync


def _quantile(values: Sequence[float], q: float) -> float:
    return float(np.quantile(np.asarray(values, dtype=np.float64), q))


def time_step_functions(
    fns: Mapping[str, Callable[[Any], Any]],
    iterator_factory: Callable[[str], Iterator],
    rounds: int = 10,
    steps: int = 10,
    warmup: int = 2,
) -> dict[str, dict[str, Any]]:
    """Time step functions interleaved: median ms per call over ``rounds``, warm-up excluded.

    Args:
        fns: mode name (or any key, e.g. (mode, replicas)) -> a step function taking an
            iterator (e.g. ``model.train_function``).
        iterator_factory: called once per mode with the mode name; returns that mode's
            (repeating) iterator, e.g. ``lambda mode: iter(dataset.repeat())``.
        rounds: interleaved rounds; each round times ``steps`` calls of every mode, in an
            order rotated by one each round so no mode always runs first.
        steps: calls per mode per round; the round's time is divided by ``steps``.
        warmup: untimed calls per mode first; the first call (tracing, rewriting, compiling)
            is reported separately as ``first_call_s``.

    Returns:
        mode -> ``{"median_ms", "p25_ms", "p75_ms", "min_ms", "rounds_ms", "first_call_s"}``.

    >>> import itertools
    >>> timing = time_step_functions({"a": next, "b": next},
    ...                              lambda mode: itertools.count(), rounds=3, steps=4)
    >>> sorted(timing), len(timing["a"]["rounds_ms"])
    (['a', 'b'], 3)
    >>> timing["a"]["median_ms"] >= 0.0
    True
    """
    if rounds < 1 or steps < 1:
        raise ValueError(f"rounds and steps must be >= 1, got rounds={rounds} steps={steps}")
    names = list(fns)
    iterators = {name: iterator_factory(name) for name in names}
    first_call: dict[str, float] = {}
    for name in names:
        for i in range(max(warmup, 1)):
            t0 = time.perf_counter()
            sync(fns[name](iterators[name]))
            if i == 0:
                first_call[name] = time.perf_counter() - t0
    per_round: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            fn, it = fns[name], iterators[name]
            out = None
            t0 = time.perf_counter()
            for _ in range(steps):
                out = fn(it)
            sync(out)
            per_round[name].append((time.perf_counter() - t0) * 1000.0 / steps)
    return {
        name: {
            "median_ms": statistics.median(ms),
            "p25_ms": _quantile(ms, 0.25),
            "p75_ms": _quantile(ms, 0.75),
            "min_ms": min(ms),
            "rounds_ms": ms,
            "first_call_s": first_call[name],
        }
        for name, ms in per_round.items()
    }


PAIRS = (("tfmx", "stock"), ("tfmx", "xla"), ("xla", "stock"))
"""The modes compared round by round (:func:`paired_ratios`)."""


def paired_ratios(timing: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[float, ...]]:
    """For each pair of :data:`PAIRS` timed here, the ratio of the two modes' times within
    each round (``a_r / b_r``: the rounds interleave every mode, so both saw the same load):
    (median, p25, p75) of those ratios. On a shared machine whose load drifts between rounds
    this is steadier than the ratio of the two medians, which pairs nothing.

    >>> timing = {"tfmx": {"rounds_ms": [8.0, 16.0, 9.0]},
    ...           "stock": {"rounds_ms": [10.0, 20.0, 10.0]}}
    >>> [round(v, 3) for v in paired_ratios(timing)["tfmx/stock"]]
    [0.8, 0.8, 0.85]
    """
    out = {}
    for a, b in PAIRS:
        if a in timing and b in timing:
            ratios = [x / y for x, y in zip(timing[a]["rounds_ms"], timing[b]["rounds_ms"])]
            out[f"{a}/{b}"] = (statistics.median(ratios), _quantile(ratios, 0.25),
                               _quantile(ratios, 0.75))
    return out


NOISY_SPREAD = 0.10
"""A mode whose p25-p75 spread is over this fraction of its median ran in a noisy spell: the
markdown says so beside the table (:func:`noisy_modes`). A reading aid, not a decision."""


def noisy_modes(timing: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """Each mode whose p25-p75 spread is over :data:`NOISY_SPREAD` of its median, with that
    fraction: on a shared machine a busy neighbour widens it, and a ratio of medians moves
    with the load (the per-round ratios of :func:`paired_ratios` move less).

    >>> noisy_modes({"stock": {"median_ms": 50.0, "p25_ms": 47.0, "p75_ms": 71.0},
    ...              "tfmx": {"median_ms": 30.0, "p25_ms": 29.5, "p75_ms": 30.5}})
    {'stock': 0.48}
    """
    spreads = {mode: (t["p75_ms"] - t["p25_ms"]) / t["median_ms"] for mode, t in timing.items()
               if t.get("median_ms")}
    return {mode: round(f, 3) for mode, f in spreads.items() if f > NOISY_SPREAD}


def median_ratios(timing: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """``m/stock`` for every mode timed beside stock, and ``tfmx/xla``, of the medians.

    >>> median_ratios({"stock": {"median_ms": 10.0}, "tfmx": {"median_ms": 8.0},
    ...                "xla": {"median_ms": 16.0}})
    {'tfmx/stock': 0.8, 'xla/stock': 1.6, 'tfmx/xla': 0.5}
    """
    ratios = {
        f"{m}/stock": timing[m]["median_ms"] / timing["stock"]["median_ms"]
        for m in timing if m != "stock" and "stock" in timing
    }
    if "tfmx" in timing and "xla" in timing:
        ratios["tfmx/xla"] = timing["tfmx"]["median_ms"] / timing["xla"]["median_ms"]
    return ratios
