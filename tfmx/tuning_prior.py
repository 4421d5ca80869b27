"""The machine's prior: what a family's measured decisions say of one not measured yet.

The tuner measures a decision once per machine and shape, within a budget: a fit measures for
at most a share of its planned run (``tfmx.env.PLAN_SHARE``), so a model of many decisions
fitted for a minute leaves most of them unmeasured, and each took Keras's form. Where the
same family has been measured here at other shapes and one form won almost every time, that
form is the better guess for the shapes not measured yet: the prior is this machine's own
figures, never a constant. :func:`family_prior` reads it from the tuning cache:

- the cache's measured decisions of the same family and kind (a signature's first word: the op
  or layer it decides for, e.g. ``MatMul`` or ``BatchMatMulV2`` in the oneDNN family, where
  one kind's kernels win and another's lose on the same machine), between the same
  candidates, and of the same dtypes (the dtype words of their signatures: ``float32``,
  ``bfloat16``...);
- at least :data:`PRIOR_MIN` of them, the same form (not the conservative one) kept in at
  least :data:`PRIOR_AGREEMENT` of them, and faster than the conservative form in the median
  of their ratios;
- never an XLA region (``tfmx.timing.is_region``): its compile is paid in the step's first
  call, which a figure of a kernel form's time does not show.

A decision taken on the prior is not measured: the tuner counts it among those it left for a
later run (the guard's figures of that step stay provisional, ``tfmx.step_price``), does not
write it to the cache, and measures it where a later fit's share allows. Forms are correct
within rounding whatever the choice; the prior changes which one runs, not what it computes.

Example:
    >>> from tfmx.tuning_prior import family_prior
    >>> measured = [{"family": "swish", "signature": f"float32 {n}", "choice": "custom",
    ...              "candidates": ["keras", "custom"], "source": "measured",
    ...              "times_ms": {"keras": 1.0, "custom": 0.8}} for n in (64, 128, 256)]
    >>> prior = family_prior(measured, "swish", "float32 512", ("keras", "custom"), "keras")
    >>> prior.form, prior.won, prior.of, round(prior.ratio, 2)
    ('custom', 3, 3, 0.8)
    >>> print(prior.describe("keras"))  # doctest: +NORMALIZE_WHITESPACE
    custom on this machine's prior: kept over keras in 3 of 3 measured swish decisions here
    (median 0.80 x keras's time)
    >>> family_prior(measured[:2], "swish", "float32 512", ("keras", "custom"), "keras") is None
    True
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from tfmx.timing import is_region

PRIOR_MIN = 3
"""Measured decisions of a family (same candidates, same dtypes) before its prior is used."""

PRIOR_AGREEMENT = 0.75
"""The share of those decisions that must have kept the prior's form."""

SIZE_FACTOR = 4.0
"""Decisions of a family are of a decision's size where their conservative form's time is
within this factor of its own (:meth:`Gain.sized`)."""

DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "half", "float", "int32",
                    "int64", "mixed_float16", "mixed_bfloat16"})


@dataclasses.dataclass(frozen=True)
class Prior:
    """A family's form on this machine's figures: kept in ``won`` of ``of`` measured decisions,
    ``ratio`` the median of its time over the conservative form's."""

    form: str
    won: int
    of: int
    ratio: float
    family: str = ""

    def describe(self, conservative: str) -> str:
        """One line for the report: the form, and the figures it rests on."""
        return (f"{self.form} on this machine's prior: kept over {conservative} in {self.won} "
                f"of {self.of} measured {self.family} decisions here (median {self.ratio:.2f} "
                f"x {conservative}'s time)")


def dtype_words(signature: str) -> frozenset[str]:
    """The dtype names a decision's signature holds.

    >>> sorted(dtype_words("MatMul bfloat16 8x4 x [6, 6] (forward)"))
    ['bfloat16']
    """
    words = signature.replace(",", " ").replace("(", " ").replace(")", " ").split()
    return frozenset(w for w in words if w in DTYPES)


def family_prior(decisions: Iterable[Mapping[str, Any]], family: str, signature: str,
                 candidates: Iterable[str], conservative: str) -> Prior | None:
    """The prior for decision ``family``/``signature`` between ``candidates`` from the
    measured ``decisions`` (the tuning cache's records), or None where they say nothing firm
    (see module doc)."""
    names = frozenset(candidates)
    alike = _alike(decisions, family, signature, names)
    if len(alike) < PRIOR_MIN:
        return None
    form, won = Counter(str(d.get("choice")) for d in alike).most_common(1)[0]
    if form == conservative or form not in names or is_region(form):
        return None
    if won < PRIOR_AGREEMENT * len(alike):
        return None
    ratios = []
    for d in alike:
        times = d.get("times_ms") or {}
        mine, theirs = times.get(form), times.get(conservative)
        if _number(mine) and _number(theirs) and theirs > 0:
            ratios.append(math.log(max(float(mine), 1e-9) / float(theirs)))
    if not ratios:
        return None
    ratio = math.exp(statistics.median(ratios))
    if ratio >= 1.0:
        return None
    return Prior(form, won, len(alike), ratio, family)


@dataclasses.dataclass(frozen=True)
class Gain:
    """What measuring a family's decisions has saved on this machine: ``share``, the mean over
    ``of`` measured decisions of the share of the conservative form's time their kept form
    saved (0 where the conservative form was kept); ``samples``, per decision, its
    conservative form's milliseconds, that share and the seconds building and first running
    its candidates took (where the cache says)."""

    share: float
    of: int
    family: str = ""
    samples: tuple[tuple[float, float, float], ...] = ()

    def sized(self, call_s: float) -> Gain | None:
        """The same figures from the decisions of about this size only: those whose
        conservative form took within :data:`SIZE_FACTOR` x ``call_s`` a call and whose builds
        the cache holds (at least :data:`PRIOR_MIN`), else None. A family's large decisions
        save another share than its small ones (a large MatMul's oneDNN kernel wins where a
        small one's does not), and cost about the same to build.

        >>> gain = Gain(0.1, 4, "f", ((2.0, 0.0, 0.5), (2.5, 0.02, 0.4), (1.5, 0.01, 0.6),
        ...                           (40.0, 0.4, 0.5)))
        >>> sized = gain.sized(0.002)
        >>> sized.of, round(sized.share, 3), round(sized.build_s, 2)
        (3, 0.01, 0.5)
        >>> gain.sized(0.040) is None
        True
        """
        near = [(base, share, build) for base, share, build in self.samples
                if build > 0 and call_s > 0
                and 1 / SIZE_FACTOR <= base / (call_s * 1e3) <= SIZE_FACTOR]
        if len(near) < PRIOR_MIN:
            return None
        return Gain(statistics.fmean(s for _, s, _ in near), len(near), self.family,
                    tuple(near))

    @property
    def build_s(self) -> float:
        """The mean seconds building a decision's candidates took (0 where none is known)."""
        builds = [b for _, _, b in self.samples if b > 0]
        return statistics.fmean(builds) if builds else 0.0

    def cannot_pay(self, call_s: float, steps: int, rounds_s: float = 0.0) -> bool:
        """Whether a decision whose conservative form takes ``call_s`` a call cannot pay for
        its measuring over ``steps`` steps, on the figures of the family's decisions of its
        size (:meth:`sized`): the share they saved of that call over the steps is less than
        what measuring one of them cost (their builds, ``rounds_s`` of timed rounds). Unknown
        (False) before its call is timed, or with too few decisions of its size.

        >>> se = Gain(0.05, 3, "se", ((2.0, 0.05, 4.5),) * 3)
        >>> se.cannot_pay(0.002, 900), se.cannot_pay(0.0, 900), se.cannot_pay(0.2, 900)
        (True, False, False)
        """
        sized = self.sized(call_s)
        return sized is not None and sized.saving(call_s, steps) < sized.build_s + rounds_s

    def saving(self, call_s: float, steps: int) -> float:
        """Seconds a decision whose conservative form takes ``call_s`` a call is expected to
        save over ``steps`` steps once measured."""
        return self.share * max(call_s, 0.0) * max(steps, 0)

    def describe(self) -> str:
        """One line for the report: the figures the expectation rests on."""
        return (f"its {self.of} measured {self.family} decisions here saved "
                f"{self.share:.0%} of the conservative form's time on average")


def family_gain(decisions: Iterable[Mapping[str, Any]], family: str, signature: str,
                candidates: Iterable[str], conservative: str) -> Gain | None:
    """What measuring decision ``family``/``signature`` is expected to save, from the family's
    measured ``decisions`` here (same candidates and dtypes, at least :data:`PRIOR_MIN`): the
    tuner measures beyond its share of a fit where that pays (``tfmx.tuner``), and leaves one
    that cannot pay for its measuring (:meth:`Gain.cannot_pay`). None where too few were
    measured.

    >>> measured = [{"family": "adam", "signature": f"float32 {n}", "choice": c,
    ...              "candidates": ["keras", "kernel"], "source": "measured",
    ...              "times_ms": {"keras": 1.0, "kernel": k}}
    ...             for n, c, k in ((8, "kernel", 0.6), (16, "keras", 1.2), (32, "kernel", 0.8))]
    >>> gain = family_gain(measured, "adam", "float32 64", ("keras", "kernel"), "keras")
    >>> round(gain.share, 2), gain.of
    (0.2, 3)
    >>> round(gain.saving(call_s=0.002, steps=1000), 3)
    0.4
    """
    alike = _alike(decisions, family, signature, frozenset(candidates))
    samples = []
    for d in alike:
        times = d.get("times_ms") or {}
        kept, base = times.get(d.get("choice")), times.get(conservative)
        if not (_number(kept) and _number(base)) or base <= 0:
            continue
        first = [float(v) for v in (d.get("first_ms") or {}).values() if _number(v)]
        samples.append((float(base), max(0.0, 1.0 - float(kept) / float(base)),
                        sum(first) / 1e3))
    if len(samples) < PRIOR_MIN:
        return None
    return Gain(statistics.fmean(s for _, s, _ in samples), len(samples), family, tuple(samples))


def kind(signature: str) -> str:
    """A decision's kind: its signature's first word (the op or layer it decides for).

    >>> kind("BatchMatMulV2 32x4x64x32 32x4x32x64 adj_x=False"), kind("float32 64"), kind("")
    ('BatchMatMulV2', 'float32', '')
    """
    words = signature.split(maxsplit=1)
    return words[0] if words else ""


def _alike(decisions: Iterable[Mapping[str, Any]], family: str, signature: str,
           names: frozenset[str]) -> list[Mapping[str, Any]]:
    """The measured decisions of ``family`` and ``signature``'s kind between ``names`` with
    ``signature``'s dtypes, other than ``signature`` itself."""
    dtypes, mine = dtype_words(signature), kind(signature)
    return [d for d in decisions
            if d.get("family") == family and d.get("source", "measured") == "measured"
            and frozenset(d.get("candidates") or ()) == names
            and d.get("signature") != signature
            and kind(str(d.get("signature", ""))) == mine
            and dtype_words(str(d.get("signature", ""))) == dtypes]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


__all__ = ["PRIOR_AGREEMENT", "PRIOR_MIN", "SIZE_FACTOR", "Gain", "Prior", "dtype_words",
           "family_gain", "family_prior", "kind"]
