"""What every family's graph pass shares: its statistics, the target it rewrites for, the
chooser between correct forms, the pass context and the body of a pass.

A graph pass has one repeated shape, as in TensorFlow's remapper.cc: rules
(:mod:`fusion.rule`), each a match at an anchor node, a check that gives the reason it
declines, and the form it emits. :func:`apply_matches` counts and emits what a rule found; the
family declares its pass in the one registry, :mod:`fusion.family`.

Example:
    >>> from fusion.pattern import PatternStats
    >>> s = PatternStats()
    >>> s.decline("MatMul: dtype float64 not run by cpu")
    >>> s.as_dict()["declined"]
    {'MatMul: dtype float64 not run by cpu': 1}
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

from fusion.graph import GraphView

REGION_NAME = "tfmx_xla_region"
"""The Python name of every ``fusion.forms.xla_region``'s traced function: its FunctionDef's
name (and its gradient's) holds it, so the graph passes tell tfmx's own XLA forms from the
user's."""

C = TypeVar("C")


class Target(Protocol):
    """What a pattern needs to know of the backend it rewrites for (see ``tfmx.backends``):
    its name, its kernel list, and what it declares for each family that asks, as that
    family's own small dataclass (:meth:`capability`)."""

    name: str

    def runs_op(self, op: str) -> bool:
        """True if the backend has a kernel for ``op``."""
        ...

    def capability(self, kind: type[C]) -> C | None:
        """The backend's declaration of type ``kind`` (a family's dataclass), None: none."""
        ...


@dataclasses.dataclass(frozen=True)
class PlainTarget:
    """A :class:`Target` as plain data (``tfmx.backends.Backend`` is one; tests make others).

    >>> @dataclasses.dataclass(frozen=True)
    ... class Widgets:
    ...     sizes: tuple = (1, 2)
    >>> t = PlainTarget("toy", capabilities=(Widgets(),), kernels=frozenset({"MatMul"}))
    >>> t.capability(Widgets).sizes, t.capability(int), t.runs_op("Conv2D")
    ((1, 2), None, False)
    """

    name: str
    capabilities: tuple = ()
    kernels: frozenset[str] | None = None  # None: every registered TensorFlow op

    def runs_op(self, op: str) -> bool:
        return self.kernels is None or op in self.kernels

    def capability(self, kind: type[C]) -> C | None:
        return next((c for c in self.capabilities if isinstance(c, kind)), None)


class Choice(Protocol):
    """What a chooser returns: the chosen form, and why (for a decline reason)."""

    choice: str

    def why(self) -> str: ...


class Chooser(Protocol):
    """Decides between correct forms of one match (``tfmx.tuner.Tuner`` measures them).

    ``candidates`` maps each form's name to a factory of a runnable of it; ``conservative``
    names the form stock TensorFlow runs.
    """

    def choose(self, family: str, signature: str, candidates: Mapping[str, Callable | None],
               conservative: str) -> Choice: ...


@dataclasses.dataclass(frozen=True)
class _Chosen:
    choice: str
    family: str = ""
    signature: str = ""

    def why(self) -> str:
        return "no tuner: the rewritten form"


class RewriteAlways:
    """The chooser of a bare ``fusion.rewrite()`` call: every decision takes the first
    candidate that is not the conservative one (the family's rewritten form), so the
    patterns' own tests see every rewrite. ``tfmx`` passes its tuner instead.

    >>> RewriteAlways().choose("f", "s", {"stock": None, "fused": None}, "stock").choice
    'fused'
    """

    def choose(self, family: str, signature: str, candidates: Mapping[str, Callable | None],
               conservative: str) -> Choice:
        other = [name for name in candidates if name != conservative]
        return _Chosen(other[0] if other else conservative, family, signature)


@dataclasses.dataclass
class PatternStats:
    """Counts for one pattern: matched, fused, fused only in part, declined (with reasons),
    and ``observed``: what a stage family rewrote before differentiation, as its GraphDef pass
    found it in a traced graph (the stage itself counts it as matched and fused)."""

    matched: int = 0
    fused: int = 0
    partial: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    declined: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fused_kinds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    errors: list[str] = dataclasses.field(default_factory=list)
    observed: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def observe(self, kind: str, partial_reason: str | None = None) -> None:
        self.observed[kind] += 1
        if partial_reason:
            self.partial[partial_reason] += 1

    def decline(self, reason: str) -> None:
        self.declined[reason] += 1

    def fuse(self, kind: str, partial_reason: str | None = None) -> None:
        self.fused += 1
        self.fused_kinds[kind] += 1
        if partial_reason:
            self.partial[partial_reason] += 1

    def taken(self, reason: str) -> None:
        """What these counts have fused, counted declined for ``reason`` instead: the call they
        count was taken into a larger rewrite (another stage's).

        >>> stats = PatternStats(matched=1)
        >>> stats.fuse("closed form")
        >>> stats.taken("taken into its product")
        >>> stats.fused, dict(stats.declined)
        (0, {'closed form: taken into its product': 1})
        """
        for label, count in list(self.fused_kinds.items()):
            self.declined[f"{label}: {reason}"] += count
            self.fused -= count
        self.fused_kinds.clear()

    def merge(self, other: PatternStats) -> None:
        self.matched += other.matched
        self.fused += other.fused
        self.partial.update(other.partial)
        self.declined.update(other.declined)
        self.fused_kinds.update(other.fused_kinds)
        self.errors.extend(other.errors)
        self.observed.update(other.observed)

    def as_dict(self) -> dict:
        return {
            "matched": self.matched,
            "fused": self.fused,
            "fused_kinds": dict(self.fused_kinds),
            "partial": dict(self.partial),
            "declined": dict(self.declined),
            "errors": list(self.errors),
            "observed": dict(self.observed),
        }


@dataclasses.dataclass
class RewriteContext:
    """Passed to every pass: the target backend and the pass's own statistics."""

    target: Target
    stats: PatternStats
    tuner: Chooser = dataclasses.field(default_factory=RewriteAlways)


PassFn = Callable[[GraphView, RewriteContext], None]


def apply_matches(
    view: GraphView,
    ctx: RewriteContext,
    found: tuple[list, list[str]],
    rewrite: Callable[[GraphView, object], object],
    kind: Callable[[object], str],
    partial: Callable[[object], str | None] = lambda match: None,
) -> None:
    """The body every family's pass shares: count matches and declines, rewrite each match.

    ``found`` is what a rule found (``fusion.rule.Rule.find``): (match records, decline
    reasons).
    """
    matches, declined = found
    ctx.stats.matched += len(matches) + len(declined)
    for reason in declined:
        ctx.stats.decline(reason)
    for match in matches:
        rewrite(view, match)
        ctx.stats.fuse(kind(match), partial(match))
