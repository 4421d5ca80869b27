"""Timing correct forms against each other, and telling a difference from noise.

:func:`measure` builds each candidate form, times its first call apart, then runs the
candidates in interleaved rounds and returns every round's samples (:class:`Timings`). The
tests that decide whether one form is faster beyond the machine's noise live here too: the sign
test on rounds won (:func:`sign_test`, :func:`within_noise`) and the one-sided t-test on paired
time ratios (:func:`t_test`) that the whole-step guard runs.

Example:
    >>> from tfmx.timing import Timings, within_noise
    >>> t = Timings({"a": [1.0] * 8, "b": [0.5] * 8})
    >>> t["b"], within_noise(t, "b", "a") is None  # b won every round: beyond noise
    (0.5, True)
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

MIN_ROUNDS, MAX_ROUNDS = 8, 30
"""Rounds of one decision: at least 8, so a form that wins every round is told from chance
(:data:`SIGNIFICANCE`: 8 of 8 by chance has probability 0.004, 7 of 8 0.035)."""

SIGNIFICANCE = 0.05
"""The largest probability that chance alone wins a form as many rounds as it won against the
conservative form (:func:`sign_test`) at which it is still kept."""

RunFactory = Callable[[], Callable[[], Any]]
"""Builds one candidate (graphs, inputs) and returns a callable that runs it once, synchronously."""

Timer = Callable[[Mapping[str, RunFactory], float], Mapping[str, float]]
"""(candidates, seconds) -> median seconds per candidate name (a :class:`Timings` also holds
every round's samples, which the choice is tested with)."""

NOISE_FLOOR = 0.01
"""The least standard deviation of a pair's log time ratio the t-test assumes (1 %): two
timings that agree better than that are not taken for proof."""

# one-sided Student t quantiles for 1..30 degrees of freedom, at p = 0.01 and 0.05
_T_CRIT = {
    0.01: (31.82, 6.965, 4.541, 3.747, 3.365, 3.143, 2.998, 2.896, 2.821, 2.764, 2.718, 2.681,
           2.650, 2.624, 2.602, 2.583, 2.567, 2.552, 2.539, 2.528, 2.518, 2.508, 2.500, 2.492,
           2.485, 2.479, 2.473, 2.467, 2.462, 2.457),
    0.05: (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782,
           1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711,
           1.708, 1.706, 1.703, 1.701, 1.699, 1.697),
}
_T_LIMIT = {0.01: 2.326, 0.05: 1.645}


def sync(outputs: Any) -> None:
    """Block until ``outputs`` (a structure of tensors) are computed: every timing here ends
    with it.

    >>> import tensorflow as tf
    >>> sync({"loss": tf.constant(1.0), "n": 3})
    """
    import tensorflow as tf

    for t in tf.nest.flatten(outputs):
        if hasattr(t, "numpy"):
            t.numpy()


def sync_small(outputs: Any) -> None:
    """Eager function calls return when their kernels are done, except on asynchronous
    devices: read one scalar-sized output back to be sure (cheap).

    >>> import tensorflow as tf
    >>> sync_small({"loss": tf.constant(1.0), "grads": tf.zeros([64, 64])})
    """
    import tensorflow as tf

    for t in tf.nest.flatten(outputs, expand_composites=True):
        if hasattr(t, "_numpy") and t.dtype != tf.variant and t.dtype != tf.resource:
            if t.shape.num_elements() is not None and t.shape.num_elements() <= 16:
                t._numpy()
                return


class Timings(dict):
    """Median seconds per candidate (the dict), and every round's sample of each
    (``samples[name][i]``: round ``i``, the rounds of all candidates aligned), so that a choice
    can be tested against the noise (:func:`sign_test`); ``first``: each candidate's first
    call in seconds (building it and running it once), where measured; ``skipped``: the
    candidates left out for the allowance (:func:`measure`'s ``partial``)."""

    def __init__(self, samples: Mapping[str, list[float]],
                 first: Mapping[str, float] | None = None,
                 skipped: list[str] | None = None) -> None:
        super().__init__({name: statistics.median(s) for name, s in samples.items()})
        self.samples = {name: list(s) for name, s in samples.items()}
        self.first = dict(first or {})
        self.skipped = list(skipped or [])


def sign_test(wins: int, rounds: int) -> float:
    """The probability that chance alone (a fair coin per round) wins at least ``wins`` of
    ``rounds``: the one-sided p-value of the sign test.

    >>> round(sign_test(8, 8), 4), round(sign_test(7, 8), 4), sign_test(4, 8) > 0.5
    (0.0039, 0.0352, True)
    """
    return sum(math.comb(rounds, k) for k in range(wins, rounds + 1)) / 2 ** rounds


def is_region(form: str) -> bool:
    """Whether the candidate named ``form`` is an XLA-compiled region (named ``xla``, or ends
    in `` xla``: ``residual xla``).

    >>> is_region("xla"), is_region("residual xla"), is_region("onednn")
    (True, True, False)
    """
    return form == "xla" or form.endswith(" xla")


def within_noise(timings: Mapping[str, float], best: str, conservative: str
                 ) -> tuple[int, int] | None:
    """(rounds ``best`` won against ``conservative``, rounds) where ``timings`` holds samples
    (:class:`Timings`) and that count is within chance (:data:`SIGNIFICANCE`); else None.

    >>> t = Timings({"a": [1.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0],
    ...              "b": [1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.0]})
    >>> within_noise(t, "b", "a")
    (4, 8)
    """
    samples = getattr(timings, "samples", None)
    if not samples or best == conservative:
        return None
    pairs = list(zip(samples[best], samples[conservative]))
    wins = sum(b < c for b, c in pairs)
    return (wins, len(pairs)) if sign_test(wins, len(pairs)) > SIGNIFICANCE else None



def t_test(ratios: list[float], p: float) -> int:
    """A one-sided t-test on the log of the pairs' time ratios (challenger / incumbent): -1 if
    the challenger is faster at significance ``p``, 1 if slower, 0 if neither. The standard
    deviation is taken as at least :data:`NOISE_FLOOR`.

    >>> t_test([5.1, 4.9], 0.01), t_test([1.02, 0.97, 1.01], 0.01), t_test([0.5] * 3, 0.01)
    (1, 0, -1)
    """
    n = len(ratios)
    if n < 2 or p not in _T_CRIT:
        return 0
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    sd = max(statistics.stdev(logs), NOISE_FLOOR)
    table = _T_CRIT[p]
    critical = table[n - 2] if n - 1 <= len(table) else _T_LIMIT[p]
    t = mean / (sd / math.sqrt(n))
    return -1 if t < -critical else 1 if t > critical else 0



class OverBudget(Exception):
    """Measuring a decision would take it past its allowance (:func:`measure`); ``call_s``:
    the first candidate's time per call, as measured before it stopped."""

    def __init__(self, message: str, call_s: float = 0.0) -> None:
        super().__init__(message)
        self.call_s = call_s


def measure(candidates: Mapping[str, RunFactory], seconds: float,
            allowance: Callable[[float], float] | None = None,
            partial: bool = False) -> Timings:
    """Median seconds per candidate, with every round's samples (:class:`Timings`): each is
    built and run once (graph optimization, first-run allocation: its first call, timed apart
    in ``first``), then the candidates run interleaved (order rotated every round) for
    ``seconds``, at least :data:`MIN_ROUNDS` and at most :data:`MAX_ROUNDS` rounds.

    ``allowance`` bounds what building the candidates may take: called with the first
    candidate's time per call (timed once more after its first call), it returns the seconds
    the decision may spend; a candidate whose build (expected to take as long as the longest
    so far) would take it past them is not built, and :class:`OverBudget` is raised; with
    ``partial``, once two candidates are built the others that would take it past them are
    left out instead (``Timings.skipped``, in ``candidates``' order: put the costliest last).

    >>> import time
    >>> t = measure({"fast": lambda: (lambda: None), "slow": lambda: (lambda: time.sleep(0.002))},
    ...             0.01)
    >>> t["fast"] < t["slow"]
    True
    >>> measure({"a": lambda: (lambda: time.sleep(0.01)), "b": lambda: (lambda: None)}, 0.01,
    ...         allowance=lambda call_s: 0.0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tfmx.timing.OverBudget: building the candidates would take ~0.0... s, over the 0.00 s allowed
    """
    runs, first, skipped = {}, {}, []
    start = time.perf_counter()
    limit, call_s = math.inf, 0.0
    for name, factory in candidates.items():
        spent = time.perf_counter() - start
        expected = spent + max(first.values(), default=0.0)
        if first and expected > limit:
            if partial and len(first) >= 2:
                skipped = [n for n in candidates if n not in first]
                break
            raise OverBudget(f"building the candidates would take ~{expected:.2f} s, over the "
                             f"{max(limit, 0.0):.2f} s allowed", call_s)
        t0 = time.perf_counter()
        runs[name] = factory()
        runs[name]()
        first[name] = time.perf_counter() - t0
        if allowance is not None and len(first) == 1:
            t0 = time.perf_counter()
            runs[name]()
            call_s = time.perf_counter() - t0
            limit = allowance(call_s)
    samples: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    start = time.perf_counter()
    rounds = 0
    while rounds < MIN_ROUNDS or (rounds < MAX_ROUNDS and time.perf_counter() - start < seconds):
        for name in order[rounds % len(order):] + order[:rounds % len(order)]:
            t0 = time.perf_counter()
            runs[name]()
            samples[name].append(time.perf_counter() - t0)
        rounds += 1
    return Timings(samples, first, skipped)


__all__ = ["MAX_ROUNDS", "MIN_ROUNDS", "NOISE_FLOOR", "SIGNIFICANCE", "OverBudget", "RunFactory",
           "Timer", "Timings", "is_region", "measure", "sign_test", "sync", "sync_small", "t_test",
           "within_noise"]
