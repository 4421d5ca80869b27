"""The whole-step guard: on the first real steps, time the fused step against the stock one.

Every speed decision inside a step is measured (:mod:`tfmx.tuner`), but only the whole step says
whether the user's training got faster. So when tfmx changed a step, the first steps of ``fit``
(``evaluate``, ``predict``, a ``tfmx.function`` loop) run the fused and the stock step
alternately on the real batches: both are built from the same Python step function (the stock
one traced with no tfmx stage and no rewrite, as TensorFlow would run it), every step trains as
usual, nothing is computed twice. After each pair the guard compares them; as soon as one is
faster beyond noise (a sign test over the pairs' time ratios) or after :data:`MAX_PAIRS` pairs,
it keeps one form for good: the fused step only if it is faster beyond noise. ``tfmx.report()``
shows which was kept and both medians.

On cpu and cuda the winner then meets a third form: the step compiled by XLA (the Python step
with ``jit_compile=True``, as Keras's own ``jit_compile=True`` builds it), kept only if faster
again beyond noise; a challenger plainly slower after 3 pairs (1.25x) is dropped at once, and
one XLA cannot compile loses. XLA was 0.6-0.8x stock on transformer-like and GELU MLP steps of
this project's CPUs and 1.7-2.7x on CNNs: neither choice is right for every model.

The first call of each form compiles it and is not timed (its time counts as the trial's
cost). The other forms are traced only when the guard first needs them.

Switch the guard off with ``tfmx.enable(guard=False)`` or ``TFMX_GUARD=0``; the XLA duel alone
with ``tfmx.enable(xla=False)`` or ``TFMX_XLA=0``.

Example (injected times: the fused step is slower, stock is kept):
    >>> from tfmx.guard import StepGuard
    >>> g = StepGuard("demo")
    >>> while not g.decided:
    ...     form = g.next_form()
    ...     g.record(form, 0.010 if form == "fused" else 0.008)
    >>> g.kept, round(g.summary().fused_ms, 1), round(g.summary().stock_ms, 1)
    ('stock', 10.0, 8.0)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from tfmx.tuner import sign_test

ENV = "TFMX_GUARD"
ENV_XLA = "TFMX_XLA"
MIN_PAIRS = 6
"""Pairs before any decision."""
MAX_PAIRS = 24
"""Pairs after which the guard decides whatever the evidence (stock unless fused is faster)."""
P_EARLY = 0.01
"""Sign-test p-value that ends the trial early in favour of one form."""
P_FINAL = 0.05
"""At :data:`MAX_PAIRS`, the fused step is kept only at this significance."""

_local = threading.local()
_test_delay = {"fused": 0.0, "stock": 0.0, "xla": 0.0}


def enabled_by_env(name: str = ENV) -> bool:
    """The environment switch ``name`` (``TFMX_GUARD``, ``TFMX_XLA``): unset or true-ish is on.

    >>> isinstance(enabled_by_env(), bool)
    True
    """
    value = os.environ.get(name, "1").strip().lower()
    if value in ("1", "true", "on", "yes", ""):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"${name} must be 1 or 0 (on/off), got {value!r}")


def set_test_delay(fused: float = 0.0, stock: float = 0.0, xla: float = 0.0) -> None:
    """Test hook: every step of that form a guard runs during its trial sleeps so many seconds
    more (the default, 0, turns it off)."""
    _test_delay.update(fused=float(fused), stock=float(stock), xla=float(xla))


@contextlib.contextmanager
def forcing(form: str) -> Iterator[None]:
    """While a guard traces another form (``"stock"``, ``"xla"``) of an outer function
    (Keras's step loop), tfmx's step functions traced inside it embed that form."""
    previous = getattr(_local, "forced", None)
    _local.forced = form
    try:
        yield
    finally:
        _local.forced = previous


def forced_form() -> str | None:
    """The form :func:`forcing` asks for, None outside it."""
    return getattr(_local, "forced", None)


@contextlib.contextmanager
def collecting() -> Iterator[list[Any]]:
    """Collect what tfmx's step functions embed while an outer function traces (see
    :func:`embedded`): the caller learns whether tfmx changed anything inside."""
    previous = getattr(_local, "collected", None)
    _local.collected = []
    try:
        yield _local.collected
    finally:
        _local.collected = previous


@dataclasses.dataclass(frozen=True)
class Embedded:
    """What an outer trace learns of a tfmx step traced into it."""

    changed: bool  # it differs from stock (a stage or a pass rewrote it)
    ops: Mapping[str, int] = dataclasses.field(default_factory=dict)  # its stock graph's ops
    signature: str = ""  # what the step is (its ops, shapes, what tfmx made of it): a cache key


def embedded(changed: bool, ops: Mapping[str, int] | None = None, signature: str = "") -> None:
    """A tfmx step function was traced into an outer function (see :class:`Embedded`)."""
    collected = getattr(_local, "collected", None)
    if collected is not None:
        collected.append(Embedded(changed, dict(ops or {}), signature))


CONVOLUTIONS = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative",
                          "Conv2DBackpropInput", "Conv2DBackpropFilter",
                          "DepthwiseConv2dNativeBackpropInput",
                          "DepthwiseConv2dNativeBackpropFilter"})
OTHER_CONTRACTIONS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3",
                                "Einsum"})


def xla_pruned(backend: str, ops: Mapping[str, int]) -> str | None:
    """Why the XLA duel is not worth its compile time here, or None: on cpu, XLA ran every
    convolutional network's step on this project's CPUs 1.6-2.7x slower than stock (Zen 3,
    Zen 4, Zen 5: small CNN, batch-norm ResNet, ResNet-50), so a step whose contractions are
    mostly convolutions does not try it (a pruning seed, not a measurement of this step). A
    step with a few convolutions among many MatMuls (a ViT's patch embedding) is measured.

    >>> xla_pruned("cpu", {"Conv2D": 4, "Conv2DBackpropFilter": 4, "MatMul": 6})[:25]
    'convolutions on cpu (8 of'
    >>> xla_pruned("cpu", {"Conv2D": 1, "Conv2DBackpropFilter": 1, "Einsum": 30}) is None
    True
    >>> xla_pruned("cuda", {"Conv2D": 1}) is None
    True

    A step that reduces across replicas (``tf.distribute``: its collectives) is not tried:
    XLA compiles the step for one device, and under MirroredStrategy it failed on the other
    replicas' variables (one batch of Keras's loop would be lost to each failed trial).

    >>> xla_pruned("cpu", {"CollectiveReduceV2": 2, "MatMul": 6})[:34]
    'the step reduces across replicas ('
    """
    collectives = sorted(op for op in ops if op.startswith(("Collective", "Nccl")))
    if collectives:
        return (f"the step reduces across replicas ({', '.join(collectives)}): XLA compiles "
                "one device's step")
    convolutions = sum(n for op, n in ops.items() if op in CONVOLUTIONS)
    others = sum(n for op, n in ops.items() if op in OTHER_CONTRACTIONS)
    if backend == "cpu" and convolutions and convolutions >= others:
        return (f"convolutions on cpu ({convolutions} of the step's {convolutions + others} "
                "contractions): XLA ran every CNN step 1.6-2.7x stock on this project's CPUs, "
                "not worth its compile time")
    return None


def make_guard(function: str, opts: Any, ops: Mapping[str, int], signature: str = "",
               cache: Any = None) -> StepGuard:
    """The guard for one step under ``opts`` (``tfmx.state.Options``): its challengers, with
    XLA left out where :func:`xla_pruned` says so (the report says why). With a
    ``tfmx.tuner.TuningCache`` and the step's ``signature``, what a trial on this machine kept
    for the same step before is kept at once, and a new trial's outcome is stored."""
    challengers = opts.guard_challengers()
    why = xla_pruned(opts.backend.name, ops) if "xla" in challengers else None
    if why:
        challengers = tuple(c for c in challengers if c != "xla")
    made = StepGuard(function, challengers, notes=(f"XLA not tried: {why}",) if why else ())
    if cache is not None and signature:
        made.remember(cache, f"{function} {signature}")
    return made


@dataclasses.dataclass
class GuardRecord:
    """What one guard measured and kept, for the report."""

    function: str
    kept: str  # "fused", "stock", "xla", or "undecided"
    fused_ms: float
    stock_ms: float
    pairs: int
    reason: str
    cost_s: float = 0.0  # what the trial cost: the other forms' first calls and slower steps
    xla_ms: float = float("nan")  # nan: not tried

    def describe(self) -> str:
        ratio = self.fused_ms / self.stock_ms if self.stock_ms else float("nan")
        xla = "" if math.isnan(self.xla_ms) else f", XLA {self.xla_ms:.2f} ms"
        if self.kept == "undecided":
            return (f"{self.function}: trial under way, {self.pairs} pairs so far (fused "
                    f"{self.fused_ms:.2f} ms, stock {self.stock_ms:.2f} ms{xla}, ratio "
                    f"{ratio:.3f})")
        return (f"{self.function}: kept {self.kept} (fused {self.fused_ms:.2f} ms, stock "
                f"{self.stock_ms:.2f} ms{xla}, fused/stock {ratio:.3f}, {self.pairs} pairs; "
                f"{self.reason}; the trial cost {self.cost_s:.2f} s)")


class StepGuard:
    """The trial of one step function (see module doc): call :meth:`next_form`, run that form,
    :meth:`record` its time; once :attr:`decided`, :attr:`kept` names the form to run.

    The trial is a sequence of duels: each challenger (``"fused"``, then ``"xla"`` where
    given) against the form kept so far (``"stock"`` at first); a challenger is kept only if
    faster beyond noise. A challenger whose first call fails (:meth:`failed`) loses its duel.
    """

    def __init__(self, function: str, challengers: tuple[str, ...] = ("fused",),
                 min_pairs: int = MIN_PAIRS, max_pairs: int = MAX_PAIRS,
                 notes: tuple[str, ...] = ()) -> None:
        self.function = function
        self.min_pairs, self.max_pairs = min_pairs, max_pairs
        self.kept: str | None = None
        self._queue = list(challengers)
        self.incumbent = "stock"
        self.challenger = self._queue.pop(0)
        self._reasons: list[str] = list(notes)
        self._all: dict[str, list[float]] = {}  # every timed run, per form, for the report
        self._pair: dict[str, list[float]] = {self.challenger: [], self.incumbent: []}
        self._warm: dict[str, float] = {"fused": 0.0}  # the first traced call ran the fused form
        self._next = self.incumbent if self.challenger in self._warm else self.challenger
        self._cache: Any = None  # see remember()
        self._key = ""
        self._cached: Any = None

    @property
    def decided(self) -> bool:
        return self.kept is not None

    def next_form(self) -> str:
        """The form to run next: alternates during the trial, then the kept one."""
        return self.kept if self.kept is not None else self._next

    def record(self, form: str, seconds: float) -> None:
        """Record one run of ``form`` (its first run only warms it up)."""
        if self.kept is not None:
            return
        if form not in self._warm:
            self._warm[form] = seconds  # tracing and compiling it: the guard's doing
        else:
            self._pair.setdefault(form, []).append(seconds)
            self._all.setdefault(form, []).append(seconds)
        self._next = self.incumbent if form == self.challenger else self.challenger
        self._maybe_decide()

    def failed(self, form: str, why: str) -> None:
        """``form`` could not run (e.g. XLA could not compile the step): it loses its duel."""
        if self.kept is None and form == self.challenger:
            self._end_duel(self.incumbent, f"{form} could not run ({why[:120]})")

    def _ratios(self) -> list[float]:
        mine, theirs = self._pair[self.challenger], self._pair[self.incumbent]
        return [c / i for c, i in zip(mine, theirs) if i > 0]

    def _maybe_decide(self) -> None:
        challenger, incumbent = self.challenger, self.incumbent
        ratios = self._ratios()
        n = len(ratios)
        if len(self._pair[challenger]) != len(self._pair[incumbent]) or n < 3:
            return
        median = statistics.median(ratios)
        if n == 3 and min(ratios) > 1.1 and median > 1.25:  # plainly slower: stop paying
            self._end_duel(incumbent, f"{challenger} {median:.2f}x {incumbent} in 3 pairs")
            return
        if n < self.min_pairs:
            return
        faster = sum(r < 1.0 for r in ratios)
        p_new = sign_test(faster, n)  # evidence the challenger is faster
        p_old = sign_test(n - faster, n)  # evidence the incumbent is faster
        if p_new < P_EARLY and median < 1.0:
            self._end_duel(challenger, f"{challenger} faster than {incumbent} in {faster} of "
                                       f"{n} pairs (p={p_new:.3f})")
        elif p_old < P_EARLY:
            self._end_duel(incumbent, f"{incumbent} faster than {challenger} in {n - faster} "
                                      f"of {n} pairs (p={p_old:.3f})")
        elif n >= self.max_pairs:
            if p_new < P_FINAL and median < 1.0:
                self._end_duel(challenger, f"{challenger} faster than {incumbent} in {faster} "
                                           f"of {n} pairs (p={p_new:.3f})")
            else:
                self._end_duel(incumbent, f"{challenger} not faster than {incumbent} beyond "
                                          f"noise: faster in {faster} of {n} pairs "
                                          f"(p={p_new:.2f}), median ratio {median:.3f}")

    def remember(self, cache: Any, key: str) -> None:
        """Keep what ``cache`` (a ``tfmx.tuner.TuningCache``) says a trial of this step kept
        here before; store this trial's outcome there when it ends."""
        self._cache, self._key = cache, key
        known = cache.get(f"guard|{key}")
        forms = ("stock", self.challenger, *self._queue)
        if known is not None and known.choice in forms:
            self.kept = known.choice
            self._cached = known
            self._reasons.append("kept as a trial on this machine decided before (cached: "
                                 + ", ".join(f"{f} {t:.2f} ms" for f, t in
                                             known.times_ms.items()) + ")")

    def _end_duel(self, winner: str, reason: str) -> None:
        self._reasons.append(reason)
        if not self._queue:
            self.kept = winner
            self._store()
            return
        self.incumbent, self.challenger = winner, self._queue.pop(0)
        self._pair = {self.challenger: [], self.incumbent: []}
        self._next = self.challenger

    def _store(self) -> None:
        if self._cache is None:
            return
        from tfmx.tuner import Decision

        times = {f: statistics.median(v) * 1e3 for f, v in self._all.items() if v}
        self._cache.put(Decision("guard", self._key, self.kept, tuple(times), times,
                                 "measured"))

    def summary(self) -> GuardRecord:
        """What was measured so far (medians in ms; from the cache for a remembered step)."""
        cached = self._cached

        def med(form: str) -> float:
            values = self._all.get(form)
            if not values and cached is not None and form in cached.times_ms:
                return cached.times_ms[form]
            return statistics.median(values) * 1e3 if values else float("nan")

        pairs = sum(len(v) for v in self._all.values()) // 2
        return GuardRecord(self.function, self.kept or "undecided", med("fused"),
                           med("stock"), pairs, "; ".join(self._reasons), self._cost(),
                           med("xla"))

    def _cost(self) -> float:
        """Seconds the trial added: the first calls of the forms other than fused (tracing,
        compiling), and every timed step beyond the median of the form kept (or of the fastest
        so far, while undecided)."""
        cost = sum(t for form, t in self._warm.items() if form != "fused")
        timed = {f: v for f, v in self._all.items() if v}
        if not timed:
            return cost
        kept = self.kept if self.kept in timed else min(
            timed, key=lambda f: statistics.median(timed[f]))
        base = statistics.median(timed[kept])
        return cost + max(0.0, sum(t - base for f, v in timed.items() if f != kept
                                   for t in v))

    def run(self, forms: Mapping[str, Callable[[], Any]]) -> Any:
        """Run the form :meth:`next_form` names (``forms``: name -> a call of it), timing it
        while the trial lasts. A challenger whose call raises loses its duel and the form
        kept so far runs instead."""
        form = self.next_form()
        if self.kept is not None:
            return forms[form]()
        delay = _test_delay.get(form, 0.0)
        start = time.perf_counter()
        if delay:
            time.sleep(delay)
        try:
            out = forms[form]()
        except Exception as exc:  # noqa: BLE001 - e.g. XLA cannot compile this step
            if form in ("fused", "stock"):
                raise
            self.failed(form, f"{type(exc).__name__}: {exc}")
            return self.run(forms)
        _sync(out)
        self.record(form, time.perf_counter() - start)
        return out


def _sync(outputs: Any) -> None:
    """Eager function calls return when their kernels are done, except on asynchronous
    devices: read one scalar-sized output back to be sure (cheap)."""
    import tensorflow as tf

    for t in tf.nest.flatten(outputs, expand_composites=True):
        if hasattr(t, "_numpy") and t.dtype != tf.variant and t.dtype != tf.resource:
            if t.shape.num_elements() is not None and t.shape.num_elements() <= 16:
                t._numpy()
                return


__all__ = ["Embedded", "GuardRecord", "StepGuard", "collecting", "embedded", "forced_form",
           "forcing", "xla_pruned",
           "set_test_delay"]
