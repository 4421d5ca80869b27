"""The tuner: where two or more correct forms exist, time them on this machine and keep the faster.

A choice between correct forms (a fused kernel or Keras's composite, oneDNN or Eigen, a loop
shape, 16 or 32 bit) is a fact about the machine it runs on, not about the kernels: a threshold
measured on one processor has made tfmx slower than stock on another. So every such choice goes
through :meth:`Tuner.choose`: the family names the decision (its family, a signature holding
the graph's own shapes and dtypes) and hands over one factory per candidate form; the tuner
times the candidates interleaved within a bounded budget, keeps the faster and records the
figures. Today's constants may seed a decision (the order candidates are tried in); they never
decide alone.

A form other than the conservative one is kept only where it beats the conservative form by
more than the machine's noise: the candidates run in interleaved rounds, and the faster median
must also be the faster in so many rounds that chance alone would give that count with
probability at most :data:`SIGNIFICANCE` (a one-sided sign test, :func:`sign_test`). A
difference of a few microseconds on a call of a few hundred (two equal sums, one kernel or its
twin) is a coin toss, and a coin toss does not change what stock runs. An XLA-compiled region
(a form named ``xla`` or ``<...> xla``, :func:`is_region`) must also beat the fastest form that
is not one by more than noise: a region is one call the step waits on whole, compiled on its
first run, and its fragment's time does not show what the step loses in overlap, so between a
region and a kernel form within noise of each other the kernel form is kept.

A decision costs more than its rounds: each candidate's first call (building, tracing, graph
optimization) is measured too (``Decision.first_ms``). Within a ``fit`` whose plan is known,
a form is kept only where what it saves over the planned steps pays for its first call beyond
the conservative form's (:func:`for_plan`), and the tuner measures for at most a share of the
planned run (``tfmx.env.PLAN_SHARE``); a decision it leaves unmeasured takes the form this
machine's measured decisions of its family keep, where they agree (``tfmx.tuning_prior``),
else the conservative form, and the report says which and why.

Modes (``tfmx.enable(tune=...)`` or the environment variable ``TFMX_TUNE``):

- ``"auto"`` (default): a decision found in the cache is reused; others are measured and
  written to the cache.
- ``"cached"``: only the cache is read; a decision missing from it takes the conservative form.
- ``"off"``: no measurement and no cache; every decision takes its conservative form: the one
  stock TensorFlow would run, exact and never slower than stock.

The decisions are kept per machine in the tuning cache (``tfmx.tuning_cache``): nothing
measured on another processor, TensorFlow, oneDNN state or tfmx is reused.
:func:`export_cache` and :func:`import_cache` carry one machine's file to identical machines
running the same tfmx (preseed a fleet).

This module holds the :class:`Tuner` and what bounds its measuring (its mode, its budget, a
fit's plan: :func:`for_plan`). How forms are timed and told from noise is in ``tfmx.timing``,
the cache in ``tfmx.tuning_cache``; their names are importable from here too.

Example (injected timings: the tuner keeps the faster form and says so):
    >>> from tfmx.tuner import Tuner
    >>> tuner = Tuner(mode="auto", cache=None, timer=lambda runs, budget: {"a": 2.0, "b": 1.0})
    >>> d = tuner.choose("demo", "x", {"a": lambda: None, "b": lambda: None}, conservative="a")
    >>> d.choice, d.source
    ('b', 'measured')
    >>> Tuner(mode="off").choose("demo", "x", {"a": None, "b": None}, conservative="a").choice
    'a'
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable, Mapping

from tfmx import background_trace, fit_plan
from tfmx.env import plan_share, share_from_env
from tfmx.notice import announce, fit_key
from tfmx.timing import (
    MAX_ROUNDS,
    MIN_ROUNDS,
    SIGNIFICANCE,
    OverBudget,
    RunFactory,
    Timer,
    Timings,
    is_region,
    measure,
    sign_test,
    sync,
    within_noise,
)
from tfmx.tuning_cache import (
    CODE_PACKAGES,
    Decision,
    TuningCache,
    cache_dir,
    code_digest,
    export_cache,
    fingerprint,
    import_cache,
)
from tfmx.tuning_prior import Gain, family_gain, family_prior

MODES = ("auto", "cached", "off")
ENV_MODE = "TFMX_TUNE"
ENV_BUDGET = "TFMX_TUNE_BUDGET"

DEFAULT_BUDGET_S = 30.0
"""Seconds one rewrite may spend measuring (``TFMX_TUNE_BUDGET``); what is left unmeasured
takes the conservative form and is measured on a later run. Measured once per machine and
shape (the cache keeps it): the transformer workload's 31 decisions take some tens of seconds
on a 2-core CPU (an attention, layer-norm or feed-forward form a second or two each)."""

DECISION_SECONDS = 0.075
"""Seconds of interleaved rounds per candidate of a decision (after one warm-up call of each):
0.15 s for two forms, 0.45 s for six. A fixed time whatever the candidates would leave a
decision between six forms at its minimum rounds, too few to tell a faster form from noise."""


GAIN_PAYBACK = 0.5
"""Within a planned fit, a decision is measured beyond the fit's share (``tfmx.env.PLAN_SHARE``)
where this share of what it is expected to save over the planned steps covers its measuring:
its family's measured decisions here (``tfmx.tuning_prior.family_gain``, at least 3) saved a
mean share of their conservative form's time, and its conservative form's call, timed first,
says how much time that share is of. A family that rarely wins is measured within the share
alone; one that often wins is measured where the fit is long enough to pay for it."""

GAIN_CAP = 0.10
"""The most of a planned run the tuner spends measuring decisions that pay for themselves
(:data:`GAIN_PAYBACK`); a decision whose conservative form, once timed, shows it cannot pay is
left unmeasured, and such starts are paid from the fit's share alone."""

RETURNING_FITS = 3
"""The most fits after this one a fit's measuring is sized for: what the tuner measures is kept,
a first call is paid in every fit, so a step fitted ``n`` times here before
(``tfmx.step_price.fits_before``) counts its share, cap and savings over its steps x
``1 + min(n, RETURNING_FITS)``: a model refitted reaches its measured step in a few fits."""


def resolve_mode(mode: str | None) -> str:
    """``mode``, else ``$TFMX_TUNE``, else ``"auto"``; ValueError naming the choices otherwise.

    >>> resolve_mode("cached")
    'cached'
    >>> resolve_mode("fast")
    Traceback (most recent call last):
    ...
    ValueError: tune must be one of ('auto', 'cached', 'off'), got 'fast'
    """
    value = mode if mode is not None else os.environ.get(ENV_MODE, "auto").strip().lower()
    if value not in MODES:
        source = "tune" if mode is not None else f"${ENV_MODE}"
        raise ValueError(f"{source} must be one of {MODES}, got {value!r}")
    return value


def budget_seconds() -> float:
    """The measuring budget per rewrite: ``$TFMX_TUNE_BUDGET`` or :data:`DEFAULT_BUDGET_S`."""
    raw = os.environ.get(ENV_BUDGET)
    if not raw:
        return DEFAULT_BUDGET_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${ENV_BUDGET} must be a number of seconds, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"${ENV_BUDGET} must be >= 0, got {raw!r}")
    return value


class Tuner:
    """Decides between correct forms for one backend (see module doc).

    Args:
        mode: ``"auto"``, ``"cached"`` or ``"off"`` (None: ``$TFMX_TUNE`` or ``"auto"``).
        cache: the :class:`TuningCache` to read and write (None: none).
        timer: how candidates are timed (:func:`measure`; tests inject timings).
        budget: seconds this tuner may spend measuring (None: :func:`budget_seconds`).
        on_decision: called with every :class:`Decision` (the report records them).
        off_reason: why mode ``"off"`` measures nothing, as decisions record it.
        fused: every decision takes a form other than the conservative one
            (``tfmx.enable(fuse="always")``, :func:`always_fused`).
    """

    def __init__(self, mode: str | None = None, cache: TuningCache | None = None,
                 timer: Timer | None = None, budget: float | None = None,
                 on_decision: Callable[[Decision], None] | None = None,
                 off_reason: str = "tune=off", fused: bool = False) -> None:
        self.mode = resolve_mode(mode)
        self.fused = fused
        self.off_reason = off_reason
        self.cache = cache
        self.timer = timer or measure
        self.budget = budget_seconds() if budget is None else budget
        self.spent = 0.0
        self.deferred = 0  # decisions left to the conservative form with a budget spent
        self.on_decision = on_decision
        self._memo: dict[str, Decision] = {}
        self.step_hint: Callable[[], float | None] | None = None  # a planned step's known s
        self.returning: tuple[int, int] | None = None  # (a fit's serial, its step's fits before)
        self._plan_serial: int | None = None  # the fit whose measuring is counted below
        self._plan_spent = 0.0  # seconds measured in that fit
        self._plan_step = 0.0  # the conservative forms' medians measured in it (seconds)
        self._plan_decisions = 0
        self._plan_waste = 0.0  # seconds of measuring stopped because it could not pay
        self._depth = 0  # decisions being measured (nested: one inside another's candidates)

    def choose(self, family: str, signature: str, candidates: Mapping[str, RunFactory | None],
               conservative: str) -> Decision:
        """Pick one of ``candidates`` for the decision ``family``/``signature``.

        ``candidates`` maps each form's name to a factory building a runnable of it (see
        :data:`RunFactory`); ``conservative`` names the form stock TensorFlow would run, taken
        when nothing is measured (mode ``"off"``, a cache miss in ``"cached"``, the budget
        spent) or when measuring fails. One decision per key is made per tuner.
        """
        if conservative not in candidates:
            raise ValueError(f"conservative form {conservative!r} is not a candidate "
                             f"({sorted(candidates)})")
        key = f"{family}|{signature}"
        decision = self._memo.get(key)
        if decision is None:
            self._sync_plan()
            decision = self._decide(family, signature, candidates, conservative)
            if conservative in decision.times_ms:  # a lower bound of the planned step's time
                self._plan_step += decision.times_ms[conservative] / 1e3
            decision = (always_fused(decision, conservative) if self.fused
                        else for_plan(decision, conservative, planned_steps()))
            self._memo[key] = decision
            if self.on_decision is not None:
                self.on_decision(decision)
        return decision

    def _decide(self, family: str, signature: str, candidates: Mapping[str, RunFactory | None],
                conservative: str) -> Decision:
        names = tuple(candidates)

        def fallback(why: str) -> Decision:
            return Decision(family, signature, conservative, names, {},
                            f"conservative ({why})")

        if self.mode == "off":
            return fallback(self.off_reason)
        if self.cache is not None:
            cached = self.cache.get(f"{family}|{signature}")
            # a decision made between other forms (a newer tfmx offers more) is made again, and
            # one a fit's allowance left partial is completed where no fit's share bounds it
            if (cached is not None and set(cached.candidates) == set(candidates)
                    and not (is_partial(cached) and self._unbounded())):
                return cached
        if self.mode == "cached":
            return fallback("not in the cache; tune=cached")
        if self.spent >= self.budget:
            spent = f"tuning budget of {self.budget:g} s spent; measured on a later run"
            return self._deferred(family, signature, candidates, conservative, spent)
        left = self.budget - self.spent
        timer, timed = self.timer, candidates
        # fuse='always' is asked for fits known to be long: the tuner's own budget bounds its
        # measuring, not a share of the fit under way
        rounds_s = min(DECISION_SECONDS * len(candidates), max(left, 0.0))
        planned = None if self.fused else self._plan_left(
            self._gain(family, signature, candidates, conservative), rounds_s, len(candidates))
        if planned is not None:
            if not planned.may_try():
                return self._deferred(family, signature, candidates, conservative,
                                      planned.why(0.0))
            if timer is measure:  # conservative form first: its call time sizes the run;
                # XLA regions (the costliest builds) last: left out where the allowance ends
                timer = functools.partial(measure, allowance=planned.allowed, partial=True)
                others = sorted((n for n in candidates if n != conservative), key=is_region)
                timed = {conservative: candidates[conservative],
                         **{n: candidates[n] for n in others}}
        if self._depth == 0:  # the first measuring of a fit says so once (tfmx.notice)
            bound = planned.bound() if planned is not None else math.inf
            announce(fit_key("tuner"), None, min(left, bound), bound=True)
        share_left = planned.share_left(0.0) if planned is not None else math.inf
        start, stopped = time.perf_counter(), False
        self._depth += 1  # a decision made while building another's candidates is nested
        try:
            seconds = _outside_trace(timer, timed, rounds_s)
            times = {n: float(seconds[n]) * 1e3 for n in names if n in seconds}
        except OverBudget as exc:  # the conservative form's call still tells of the step
            stopped = True
            self._plan_step += exc.call_s
            return self._deferred(family, signature, candidates, conservative,
                                  f"{planned.why(exc.call_s)} ({exc})")
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is not chosen
            return fallback(f"measuring failed: {type(exc).__name__}: {exc}"[:200])
        finally:
            self._depth -= 1
            took = time.perf_counter() - start
            if self._depth == 0:  # a nested decision's time is in the outer one's
                self.spent += took
                self._plan_spent += took
                self._plan_waste += took if stopped else 0.0
        self._plan_decisions += 1
        first = {n: float(v) * 1e3 for n, v in getattr(seconds, "first", {}).items()
                 if n in candidates}
        # Ties go to the conservative form; otherwise the fastest median wins, if it won
        # enough of its rounds against the conservative form to be more than noise.
        best = min(times, key=lambda n: (times[n], n != conservative))
        notes = []
        skipped = getattr(seconds, "skipped", [])
        if skipped:
            notes.append(f"not measured: {', '.join(skipped)} (building them would take it past "
                         "this fit's allowance; measured where no fit's share bounds it)")
        kernels = [n for n in times if not is_region(n)]
        if is_region(best) and kernels:
            rival = min(kernels, key=lambda n: (times[n], n != conservative))
            noise = within_noise(seconds, best, rival)
            if noise is not None:
                notes.append(f"{best} faster than {rival} in {noise[0]} of {noise[1]} rounds "
                             f"only: a region must win beyond noise, {rival} kept")
                best = rival
        noise = within_noise(seconds, best, conservative)
        if noise is not None:
            notes.append(f"{best} faster in {noise[0]} of {noise[1]} rounds only: within "
                         f"noise, {conservative} kept")
            best = conservative
        if planned is not None and planned.gain is not None and took > share_left:
            notes.append(f"measured beyond the fit's {planned.share * 100:g}% share: "
                         f"{planned.gain.describe()}")
        note = "; ".join(notes)
        decision = Decision(family, signature, best, names, times, "measured", note, first)
        if self.cache is not None:
            self.cache.put(decision)
        return decision

    def _unbounded(self) -> bool:
        """Whether measuring is bounded by the budget alone: no planned fit's share
        (``tfmx.env.PLAN_SHARE``) applies, or ``fuse="always"``."""
        return self.fused or self._plan_left() is None

    def _cached_decisions(self) -> list[Mapping[str, object]]:
        """The cache's decisions as records (none without a cache or where it cannot be read)."""
        if self.cache is None:
            return []
        try:
            return list(self.cache.contents()["decisions"].values())
        except Exception:  # noqa: BLE001 - a cache it cannot read tells nothing
            return []

    def _gain(self, family: str, signature: str, candidates: Mapping[str, RunFactory | None],
              conservative: str) -> Gain | None:
        """What measuring this decision is expected to save (``tfmx.tuning_prior.family_gain``)."""
        try:
            return family_gain(self._cached_decisions(), family, signature, candidates,
                               conservative)
        except Exception:  # noqa: BLE001 - figures it cannot read leave the share alone
            return None

    def _deferred(self, family: str, signature: str, candidates: Mapping[str, RunFactory | None],
                  conservative: str, why: str) -> Decision:
        """A decision its budget leaves unmeasured (counted in :attr:`deferred`): the form this
        machine's measured decisions of the family keep (``tfmx.tuning_prior``), else the
        conservative one; measured on a later run either way."""
        self.deferred += 1
        names = tuple(candidates)
        try:
            prior = family_prior(self._cached_decisions(), family, signature, names,
                                 conservative)
        except Exception:  # noqa: BLE001 - figures it cannot read leave Keras's form
            prior = None
        if prior is None:
            return Decision(family, signature, conservative, names, {}, f"conservative ({why})")
        return Decision(family, signature, prior.form, names, {}, "prior",
                        f"{prior.describe(conservative)}; not measured: {why}")

    def _sync_plan(self) -> None:
        """Count this fit's measuring and step time afresh when a new fit began."""
        plan = fit_plan.active_plan()
        serial = plan.serial if plan is not None else None
        if serial != self._plan_serial:
            self._plan_serial, self._plan_spent = serial, 0.0
            self._plan_step, self._plan_decisions, self._plan_waste = 0.0, 0, 0.0

    def _plan_left(self, gain: Gain | None = None, rounds_s: float = 0.0,
                   forms: int = 2) -> _FitBudget | None:
        """Within a planned fit (see ``tfmx.env.PLAN_SHARE``): what the fit leaves a decision to
        measure, given what measuring it is expected to save (``gain``, see
        :data:`GAIN_PAYBACK`) and its rounds' seconds; None outside a fit (or without a
        share)."""
        share = plan_share()
        plan = fit_plan.active_plan()
        if share is None or plan is None or not plan.steps:
            return None
        self._sync_plan()
        hint = (self.step_hint() if self.step_hint is not None else None) or 0.0
        return _FitBudget(self, share, plan.steps, hint, gain, rounds_s, forms,
                          1 + self.fits_before(plan.serial))

    def fits_before(self, serial: int) -> int:
        """Fits of the step of the fit ``serial`` run here before it, at most
        :data:`RETURNING_FITS` (0 where the fit did not say, :attr:`returning`).

        >>> tuner = Tuner(mode="off")
        >>> tuner.returning = (7, 5)
        >>> tuner.fits_before(7), tuner.fits_before(8)
        (3, 0)
        """
        if self.returning is None or self.returning[0] != serial:
            return 0
        return max(0, min(int(self.returning[1]), RETURNING_FITS))


@dataclasses.dataclass(frozen=True)
class _FitBudget:
    """What a planned fit of ``steps`` steps leaves one decision to measure: ``share`` of the
    run, and beyond it what the decision is expected to save (``gain``, :data:`GAIN_PAYBACK`,
    :data:`GAIN_CAP`). Amounts are functions of the decision's conservative form's time per
    call (0 before it is timed)."""

    tuner: Tuner
    share: float
    steps: int
    hint: float  # a step's time known from a previous fit of it (s), else 0
    gain: Gain | None
    rounds_s: float = 0.0  # the decision's timed rounds, after its candidates are built
    forms: int = 2  # its candidates
    fits: int = 1  # the fits its measuring serves: this one and those expected after it

    @property
    def horizon(self) -> int:
        """The steps measuring is sized for: this fit's x the fits it serves."""
        return self.steps * self.fits

    def step(self, call_s: float) -> float:
        """The planned step's time known so far (s)."""
        return max(self.tuner._plan_step + call_s, self.hint)

    def share_left(self, call_s: float) -> float:
        """Seconds the fit's share leaves (inf while nothing tells the step's time)."""
        if call_s <= 0 and self.step(0.0) <= 0:
            return math.inf  # nothing known yet: the conservative form's call will say
        return self.share * self.horizon * self.step(call_s) - self.tuner._plan_spent

    def paying(self, call_s: float) -> float:
        """Seconds a decision may spend building its candidates because of what it is
        expected to save (its rounds' seconds are spent after)."""
        if self.gain is None:
            return -math.inf
        cap = GAIN_CAP * self.horizon * self.step(call_s) - self.tuner._plan_spent
        rounds = min(self.rounds_s, MAX_ROUNDS * self.forms * call_s)
        return min(GAIN_PAYBACK * self.gain.saving(call_s, self.horizon), cap) - rounds

    def allowed(self, call_s: float) -> float:
        """Seconds this decision may spend measuring (``tfmx.timing.measure``'s allowance),
        none past its conservative form where it cannot pay (:meth:`cannot_pay`)."""
        if self.cannot_pay(call_s):
            return 0.0
        return max(self.share_left(call_s), self.paying(call_s))

    def cannot_pay(self, call_s: float) -> bool:
        """Whether its family's figures say this decision (Keras's form at ``call_s`` a call)
        cannot pay for its measuring (``tfmx.tuning_prior.Gain.cannot_pay``)."""
        return self.gain is not None and self.gain.cannot_pay(call_s, self.horizon,
                                                              self.rounds_s)

    def may_try(self) -> bool:
        """Whether to start measuring: the share is not spent, or the family's figures say the
        decision may pay for itself, the cap is not reached and starts that could not pay have
        not used up the share."""
        if self.share_left(0.0) > 0:
            return True
        if self.gain is None:
            return False
        run = self.horizon * self.step(0.0)
        return (GAIN_CAP * run > self.tuner._plan_spent
                and self.share * run > self.tuner._plan_waste)

    def bound(self) -> float:
        """The most this fit may still spend measuring (for the first-run notice)."""
        run = self.horizon * self.step(0.0)
        cap = GAIN_CAP * run if self.gain is not None else self.share * run
        return max(self.share_left(0.0), cap - self.tuner._plan_spent)

    def why(self, call_s: float) -> str:
        """Why a decision is left unmeasured."""
        gain = self.gain.sized(call_s) if self.gain is not None else None
        if gain is not None and self.cannot_pay(call_s):
            return (f"its {gain.of} measured {gain.family} decisions here of about its size "
                    f"saved {gain.share:.0%} of the conservative form's time on average, and "
                    f"measuring one took ~{gain.build_s + self.rounds_s:.2f} s: at "
                    f"{call_s * 1e3:.3f} ms a call, "
                    f"~{gain.saving(call_s, self.horizon):.2f} s over the {self.horizon} steps "
                    f"it serves, less than its measuring; measured where no fit bounds the "
                    f"tuner")
        step = self.step(call_s)
        how = ("known from a previous fit"
               if self.hint > 0 and self.hint >= self.tuner._plan_step + call_s
               else "the conservative forms measured in this fit")
        fits = (f" x {self.fits} fits (this one and as many after it as fitted before here, "
                f"at most {RETURNING_FITS})" if self.fits > 1 else "")
        text = (f"measuring budget spent: {self.share * 100:g}% of the planned run, {self.steps} "
                f"steps{fits} x {step * 1e3:.1f} ms a step ({how}) = "
                f"{self.share * self.horizon * step:.2f} s")
        if self.gain is not None and call_s > 0:
            text += (f"; {self.gain.describe()}: {self.gain.saving(call_s, self.horizon):.2f} s "
                     f"expected over the run, not enough to pay for measuring it")
        return text + "; measured on a later run"


def is_partial(decision: Decision) -> bool:
    """Whether ``decision`` was measured between some of its candidates only (a fit's
    allowance left the others out).

    >>> is_partial(Decision("f", "s", "a", ("a", "b", "xla"), {"a": 1.0, "b": 0.9}))
    True
    >>> is_partial(Decision("f", "s", "a", ("a", "b"), {}, "conservative (tune=off)"))
    False
    """
    return bool(decision.times_ms) and not set(decision.candidates) <= set(decision.times_ms)


def planned_steps() -> int | None:
    """The steps the ``fit`` under way plans (``tfmx.fit_plan.active_plan``), None outside one.

    >>> planned_steps() is None
    True
    """
    plan = fit_plan.active_plan()
    return plan.steps if plan is not None else None


def for_plan(decision: Decision, conservative: str, steps: int | None) -> Decision:
    """``decision`` for a run of ``steps`` steps: a form other than the conservative one is
    kept only where what it saves over those steps (its median against the conservative
    form's) is more than what its first call costs beyond the conservative form's (building,
    tracing, graph optimization: ``first_ms``). Unchanged without a plan or first calls.

    >>> d = Decision("f", "s", "fast", ("stock", "fast"), {"stock": 2.0, "fast": 1.0}, "measured",
    ...              first_ms={"stock": 100.0, "fast": 600.0})
    >>> for_plan(d, "stock", 1000).choice, for_plan(d, "stock", 48).choice
    ('fast', 'stock')
    >>> print(for_plan(d, "stock", 48).note)  # doctest: +NORMALIZE_WHITESPACE
    fast's first call (+500 ms) is more than it saves over the planned 48 steps (48 ms):
    stock kept
    """
    choice, first, times = decision.choice, decision.first_ms, decision.times_ms
    if (not steps or choice == conservative or choice not in first
            or conservative not in first or choice not in times
            or conservative not in times):
        return decision
    extra = first[choice] - first[conservative]
    saved = steps * (times[conservative] - times[choice])
    if saved > extra:
        return decision
    note = (f"{choice}'s first call (+{extra:.0f} ms) is more than it saves over the planned "
            f"{steps} steps ({saved:.0f} ms): {conservative} kept")
    return dataclasses.replace(decision, choice=conservative,
                               note="; ".join(filter(None, (decision.note, note))))


def always_fused(decision: Decision, conservative: str) -> Decision:
    """``decision`` under ``tfmx.enable(fuse="always")``: where it kept the ``conservative``
    form, the fastest other form it measured takes its place, else (nothing measured) the first
    other candidate that is not an XLA region (:func:`is_region`), else the first other one. A
    decision with no other candidate stays as it is; its figures stay as measured (the cache
    keeps the measured choice).

    >>> d = Decision("f", "s", "stock", ("stock", "fast", "faster"),
    ...              {"stock": 1.0, "fast": 3.0, "faster": 2.0}, "measured")
    >>> always_fused(d, "stock").choice
    'faster'
    >>> off = Decision("f", "s", "stock", ("stock", "xla", "fused"), {}, "conservative (tune=off)")
    >>> picked = always_fused(off, "stock")
    >>> picked.choice, picked.source
    ('fused', "fuse='always' (not measured: tune=off)")
    """
    others = [n for n in decision.candidates if n != conservative]
    if decision.choice != conservative or not others:
        return decision
    measured = [n for n in others if n in decision.times_ms]
    if measured:
        choice = min(measured, key=lambda n: decision.times_ms[n])
        note = f"fuse='always': {choice}, the fastest fused form measured, over {conservative}"
        return dataclasses.replace(decision, choice=choice,
                                   note="; ".join(filter(None, (decision.note, note))))
    kernels = [n for n in others if not is_region(n)]
    return dataclasses.replace(decision, choice=(kernels or others)[0],
                               source=f"fuse='always' (not measured: {decision.why()})")


def _outside_trace(timer: Timer, candidates: Mapping[str, RunFactory],
                   seconds: float) -> Mapping[str, float]:
    """Run ``timer`` on a thread of its own: a rewrite runs while TensorFlow traces a step
    (inside a graph, under Keras's gradient tape), and the candidates must be built and timed
    eagerly with no tape recording; TensorFlow keeps both per thread. The fit under way
    (``tfmx.fit_plan.active_plan``) is the thread's too: decisions its candidates make are made
    for it."""
    plan = fit_plan.active_plan()

    def timed() -> Mapping[str, float]:
        # never beside a fit's step while tfmx's form of it is traced on a thread of its own
        with fit_plan.adopting(plan), background_trace.measuring():
            return timer(candidates, seconds)

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(timed).result()


__all__ = ["CODE_PACKAGES", "DECISION_SECONDS", "Decision", "GAIN_CAP", "GAIN_PAYBACK",
           "MIN_ROUNDS", "MODES", "OverBudget", "RETURNING_FITS", "SIGNIFICANCE", "Timings",
           "Tuner", "TuningCache", "always_fused", "budget_seconds",
           "cache_dir", "code_digest", "export_cache", "fingerprint", "for_plan", "import_cache",
           "is_partial", "is_region", "measure", "plan_share", "planned_steps", "resolve_mode",
           "share_from_env", "sign_test", "sync", "within_noise"]
