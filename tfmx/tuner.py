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
planned run (:data:`PLAN_SHARE`); the decisions it leaves unmeasured take the conservative
form, and the report says why.

Modes (``tfmx.enable(tune=...)`` or the environment variable ``TFMX_TUNE``):

- ``"auto"`` (default): a decision found in the cache is reused; others are measured and
  written to the cache.
- ``"cached"``: only the cache is read; a decision missing from it takes the conservative form.
- ``"off"``: no measurement and no cache; every decision takes its conservative form: the one
  stock TensorFlow would run, exact and never slower than stock.

The cache is one JSON file per machine under :func:`cache_dir` (``$TFMX_CACHE_DIR``, else
``$XDG_CACHE_HOME/tfmx``, else ``~/.cache/tfmx``), named by a hash of the machine's
:func:`fingerprint`: the CPU model, family and relevant flags, the TensorFlow version, the
oneDNN state, the backend and tfmx's own code (:func:`code_digest`). A new TensorFlow, oneDNN
switched the other way, another processor or another tfmx reads another file, so nothing
measured elsewhere is reused, and a form reimplemented under the same name is measured again.
:func:`export_cache` and :func:`import_cache` carry a file to identical machines running the
same tfmx (preseed a fleet).

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
import hashlib
import importlib.util
import json
import math
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

MODES = ("auto", "cached", "off")
ENV_MODE = "TFMX_TUNE"
ENV_DIR = "TFMX_CACHE_DIR"
ENV_BUDGET = "TFMX_TUNE_BUDGET"
ENV_SHARE = "TFMX_TUNE_SHARE"

DEFAULT_BUDGET_S = 30.0
"""Seconds one rewrite may spend measuring (``TFMX_TUNE_BUDGET``); what is left unmeasured
takes the conservative form and is measured on a later run. Measured once per machine and
shape (the cache keeps it): the transformer workload's 31 decisions took 21 s on a 2-core
Zen 3 (its attention, layer-norm and feed-forward forms 1-2.5 s each, a MatMul 0.3-1.2 s)."""

DECISION_SECONDS = 0.075
"""Seconds of interleaved rounds per candidate of a decision (after one warm-up call of each):
0.15 s for two forms, 0.45 s for six. A fixed time whatever the candidates would leave a
decision between six forms at its minimum rounds, too few to tell a faster form from noise."""

MIN_ROUNDS, MAX_ROUNDS = 8, 30
"""Rounds of one decision: at least 8, so a form that wins every round is told from chance
(:data:`SIGNIFICANCE`: 8 of 8 by chance has probability 0.004, 7 of 8 0.035)."""

PLAN_SHARE = 0.02
"""In a ``fit`` whose plan is known (``tfmx.guard.active_plan``), the share of the planned run
the tuner may spend measuring (``TFMX_TUNE_SHARE``: a fraction, or ``none``). The run's time
is the planned steps at the step time known for it: the sum of the conservative forms'
medians measured in this fit so far (a lower bound of the step), or the time a previous fit
of the same step measured (``Tuner.step_hint``); with neither known, the fit's first decision
is measured, which seeds it. What the share does not cover takes the conservative form and is
measured on a later run."""

SIGNIFICANCE = 0.05
"""The largest probability that chance alone wins a form as many rounds as it won against the
conservative form (:func:`sign_test`) at which it is still kept."""

RunFactory = Callable[[], Callable[[], Any]]
"""Builds one candidate (graphs, inputs) and returns a callable that runs it once, synchronously."""

Timer = Callable[[Mapping[str, RunFactory], float], Mapping[str, float]]
"""(candidates, seconds) -> median seconds per candidate name (a :class:`Timings` also holds
every round's samples, which the choice is tested with)."""



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


def share_from_env(name: str, default: float) -> float | None:
    """A share of a run from the environment variable ``name``: a fraction, ``none`` (None:
    unbounded), or ``default`` where unset; ValueError naming the variable otherwise.

    >>> share_from_env("TFMX_NO_SUCH_SHARE", 0.02)
    0.02
    """
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("none", "off", "inf"):
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${name} must be a fraction of the run (0.02) or none, "
                         f"got {raw!r}") from None
    if value < 0:
        raise ValueError(f"${name} must be >= 0, got {raw!r}")
    return value


def plan_share() -> float | None:
    """The share of a planned run the tuner may spend measuring: ``$TFMX_TUNE_SHARE`` or
    :data:`PLAN_SHARE`; None (``none``) bounds it by :func:`budget_seconds` alone.

    >>> plan_share()
    0.02
    """
    return share_from_env(ENV_SHARE, PLAN_SHARE)


def cache_dir() -> Path:
    """Where tuning results live: ``$TFMX_CACHE_DIR``, ``$XDG_CACHE_HOME/tfmx`` or
    ``~/.cache/tfmx``.

    >>> cache_dir().name in ("tfmx",) or "TFMX_CACHE_DIR" in __import__("os").environ
    True
    """
    explicit = os.environ.get(ENV_DIR)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tfmx"


CODE_PACKAGES = ("tfmx", "fusion", "policies")
"""The packages whose source decides what a form is (:func:`code_digest`)."""


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A hash of tfmx's own source (every ``.py`` file of :data:`CODE_PACKAGES`).

    A candidate's name says which form it is, not how that form is built: a form rebuilt under
    its old name (the GELU's ``xla`` region became one loop computing value and derivative)
    would otherwise keep the choice measured of its predecessor. With the code in the
    fingerprint, another tfmx measures again.

    >>> len(code_digest()), code_digest() == code_digest()
    (16, True)
    """
    digest = hashlib.sha1()
    for package in CODE_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            continue
        root = Path(spec.origin).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(path.relative_to(root.parent).as_posix().encode())
            try:
                digest.update(path.read_bytes())
            except OSError:  # unreadable: its name still counts
                continue
    return digest.hexdigest()[:16]


def fingerprint(backend: str) -> dict[str, Any]:
    """What a measurement is a fact about: processor, TensorFlow, oneDNN state, backend and
    tfmx's code.

    >>> sorted(fingerprint("cpu"))  # doctest: +NORMALIZE_WHITESPACE
    ['backend', 'code', 'cpu', 'keras', 'onednn', 'tensorflow']
    """
    from tfmx import machine

    info = machine.fingerprint()
    cpu = info.get("cpu", {})
    return {
        "backend": backend,
        "cpu": {k: cpu.get(k) for k in ("vendor", "model", "family", "model_number", "flags")},
        "tensorflow": info.get("tensorflow"),
        "keras": info.get("keras"),
        "onednn": info.get("onednn"),
        "code": code_digest(),
    }


def _key(fp: Mapping[str, Any]) -> str:
    return hashlib.sha1(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass
class Decision:
    """One choice: what was decided, between what, with which figures and from where."""

    family: str
    signature: str
    choice: str
    candidates: tuple[str, ...]
    times_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    # "measured", "cached", or "conservative (<why>)"
    source: str = "measured"
    note: str = ""  # e.g. that the fastest median was within noise of the conservative form
    # each candidate's first call (building it, its first run: tracing, graph optimization)
    first_ms: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.family}|{self.signature}"

    def why(self) -> str:
        """Why ``choice`` was taken, for a decline reason: ``measured faster (a 1.2 ms, b 0.9
        ms)`` or the conservative form's reason."""
        if self.source.startswith("conservative"):
            return self.source[len("conservative ("):-1]
        times = ", ".join(f"{n} {self.times_ms[n]:.3f} ms" for n in self.candidates
                          if n in self.times_ms)
        when = "measured faster here" + (" (cached)" if self.source == "cached" else "")
        return f"{when}: {times}" + (f" ({self.note})" if self.note else "")

    def describe(self) -> str:
        """One line: ``family signature: choice (source) a 1.20 ms, b 0.90 ms``."""
        times = ", ".join(f"{n} {self.times_ms[n]:.3f} ms" for n in self.candidates
                          if n in self.times_ms)
        first = ", ".join(f"{n} {self.first_ms[n]:.0f} ms" for n in self.candidates
                          if n in self.first_ms)
        return f"{self.family} {self.signature}: {self.choice} ({self.source})" + (
            f"  {times}" if times else "") + (f"; first calls {first}" if first else "") + (
            f"  [{self.note}]" if self.note else "")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"candidates": list(self.candidates)}


class TuningCache:
    """The decisions measured on one machine, as a JSON file (see module doc).

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "t.json"
    >>> c = TuningCache(path, {"backend": "cpu"})
    >>> c.put(Decision("demo", "x", "b", ("a", "b"), {"a": 2.0, "b": 1.0}))
    >>> TuningCache(path, {"backend": "cpu"}).get("demo|x").choice
    'b'
    """

    def __init__(self, path: Path, fp: Mapping[str, Any]) -> None:
        self.path = Path(path)
        self.fingerprint = dict(fp)
        self._lock = threading.Lock()
        self._decisions: dict[str, dict[str, Any]] | None = None

    @classmethod
    def for_backend(cls, backend: str) -> TuningCache:
        """This machine's cache file for ``backend``."""
        fp = fingerprint(backend)
        return cls(cache_dir() / f"tuning-{backend}-{_key(fp)}.json", fp)

    def _load(self) -> dict[str, dict[str, Any]]:
        if self._decisions is None:
            self._decisions = {}
            try:
                data = json.loads(self.path.read_text())
            except (OSError, ValueError):
                data = None
            if isinstance(data, dict) and data.get("fingerprint") == self.fingerprint:
                self._decisions = dict(data.get("decisions", {}))
        return self._decisions

    def get(self, key: str) -> Decision | None:
        with self._lock:
            raw = self._load().get(key)
        if raw is None:
            return None
        try:
            return Decision(raw["family"], raw["signature"], raw["choice"],
                            tuple(raw["candidates"]), dict(raw.get("times_ms", {})), "cached",
                            str(raw.get("note", "")), dict(raw.get("first_ms", {})))
        except (KeyError, TypeError):
            return None

    def put(self, decision: Decision) -> None:
        """Record a measured decision and write the file (atomically; errors are ignored: a
        cache that cannot be written costs a measurement next time, nothing else)."""
        with self._lock:
            self._load()[decision.key] = decision.as_dict()
            self._write()

    def merge(self, decisions: Mapping[str, Mapping[str, Any]]) -> int:
        """Add decisions (as exported); returns how many were new or changed."""
        with self._lock:
            current = self._load()
            changed = sum(1 for k, v in decisions.items() if current.get(k) != v)
            current.update({k: dict(v) for k, v in decisions.items()})
            self._write()
        return changed

    def contents(self) -> dict[str, Any]:
        with self._lock:
            return {"fingerprint": self.fingerprint, "decisions": dict(self._load())}

    def _write(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"fingerprint": self.fingerprint, "decisions": self._decisions},
                          f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError:
            pass


class Timings(dict):
    """Median seconds per candidate (the dict), and every round's sample of each
    (``samples[name][i]``: round ``i``, the rounds of all candidates aligned), so that a choice
    can be tested against the noise (:func:`sign_test`); ``first``: each candidate's first
    call in seconds (building it and running it once), where measured."""

    def __init__(self, samples: Mapping[str, list[float]],
                 first: Mapping[str, float] | None = None) -> None:
        super().__init__({name: statistics.median(s) for name, s in samples.items()})
        self.samples = {name: list(s) for name, s in samples.items()}
        self.first = dict(first or {})


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


class OverBudget(Exception):
    """Measuring a decision would take it past its allowance (:func:`measure`); ``call_s``:
    the first candidate's time per call, as measured before it stopped."""

    def __init__(self, message: str, call_s: float = 0.0) -> None:
        super().__init__(message)
        self.call_s = call_s


def measure(candidates: Mapping[str, RunFactory], seconds: float,
            allowance: Callable[[float], float] | None = None) -> Timings:
    """Median seconds per candidate, with every round's samples (:class:`Timings`): each is
    built and run once (graph optimization, first-run allocation: its first call, timed apart
    in ``first``), then the candidates run interleaved (order rotated every round) for
    ``seconds``, at least :data:`MIN_ROUNDS` and at most :data:`MAX_ROUNDS` rounds.

    ``allowance`` bounds what building the candidates may take: called with the first
    candidate's time per call (timed once more after its first call), it returns the seconds
    the decision may spend; a candidate whose build (expected to take as long as the longest
    so far) would take it past them is not built, and :class:`OverBudget` is raised.

    >>> import time
    >>> t = measure({"fast": lambda: (lambda: None), "slow": lambda: (lambda: time.sleep(0.002))},
    ...             0.01)
    >>> t["fast"] < t["slow"]
    True
    >>> measure({"a": lambda: (lambda: time.sleep(0.01)), "b": lambda: (lambda: None)}, 0.01,
    ...         allowance=lambda call_s: 0.0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tfmx.tuner.OverBudget: building the candidates would take ~0.0... s, over the 0.00 s allowed
    """
    runs, first = {}, {}
    start = time.perf_counter()
    limit, call_s = math.inf, 0.0
    for name, factory in candidates.items():
        spent = time.perf_counter() - start
        expected = spent + max(first.values(), default=0.0)
        if first and expected > limit:
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
    return Timings(samples, first)


class Tuner:
    """Decides between correct forms for one backend (see module doc).

    Args:
        mode: ``"auto"``, ``"cached"`` or ``"off"`` (None: ``$TFMX_TUNE`` or ``"auto"``).
        cache: the :class:`TuningCache` to read and write (None: none).
        timer: how candidates are timed (:func:`measure`; tests inject timings).
        budget: seconds this tuner may spend measuring (None: :func:`budget_seconds`).
        on_decision: called with every :class:`Decision` (the report records them).
        off_reason: why mode ``"off"`` measures nothing, as decisions record it.
    """

    def __init__(self, mode: str | None = None, cache: TuningCache | None = None,
                 timer: Timer | None = None, budget: float | None = None,
                 on_decision: Callable[[Decision], None] | None = None,
                 off_reason: str = "tune=off") -> None:
        self.mode = resolve_mode(mode)
        self.off_reason = off_reason
        self.cache = cache
        self.timer = timer or measure
        self.budget = budget_seconds() if budget is None else budget
        self.spent = 0.0
        self.on_decision = on_decision
        self._memo: dict[str, Decision] = {}
        self.step_hint: Callable[[], float | None] | None = None  # a planned step's known s
        self._plan_serial: int | None = None  # the fit whose measuring is counted below
        self._plan_spent = 0.0  # seconds measured in that fit
        self._plan_step = 0.0  # the conservative forms' medians measured in it (seconds)
        self._plan_decisions = 0
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
            decision = for_plan(decision, conservative, planned_steps())
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
            # a decision made between other forms (a newer tfmx offers more) is made again
            if cached is not None and set(cached.candidates) == set(candidates):
                return cached
        if self.mode == "cached":
            return fallback("not in the cache; tune=cached")
        if self.spent >= self.budget:
            return fallback(f"tuning budget of {self.budget:g} s spent; measured on a later run")
        left = self.budget - self.spent
        timer, timed = self.timer, candidates
        planned = self._plan_left()
        if planned is not None:
            allowed, why = planned
            if allowed(0.0) <= 0:
                return fallback(why(0.0))
            if timer is measure:  # conservative form first: its call time sizes the run
                timer = functools.partial(measure, allowance=allowed)
                timed = {conservative: candidates[conservative],
                         **{n: f for n, f in candidates.items() if n != conservative}}
        start = time.perf_counter()
        self._depth += 1  # a decision made while building another's candidates is nested
        try:
            seconds = _outside_trace(timer, timed,
                                     min(DECISION_SECONDS * len(candidates), max(left, 0.0)))
            times = {n: float(seconds[n]) * 1e3 for n in names}
        except OverBudget as exc:  # the conservative form's call still tells of the step
            self._plan_step += exc.call_s
            return fallback(f"{planned[1](0.0)} ({exc})")
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is not chosen
            return fallback(f"measuring failed: {type(exc).__name__}: {exc}"[:200])
        finally:
            self._depth -= 1
            if self._depth == 0:  # a nested decision's time is in the outer one's
                took = time.perf_counter() - start
                self.spent += took
                self._plan_spent += took
        self._plan_decisions += 1
        first = {n: float(v) * 1e3 for n, v in getattr(seconds, "first", {}).items()
                 if n in candidates}
        # Ties go to the conservative form; otherwise the fastest median wins, if it won
        # enough of its rounds against the conservative form to be more than noise.
        best = min(names, key=lambda n: (times[n], n != conservative))
        notes = []
        kernels = [n for n in names if not is_region(n)]
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
        note = "; ".join(notes)
        decision = Decision(family, signature, best, names, times, "measured", note, first)
        if self.cache is not None:
            self.cache.put(decision)
        return decision

    def _sync_plan(self) -> None:
        """Count this fit's measuring and step time afresh when a new fit began."""
        from tfmx.guard import active_plan

        plan = active_plan()
        serial = plan.serial if plan is not None else None
        if serial != self._plan_serial:
            self._plan_serial, self._plan_spent = serial, 0.0
            self._plan_step, self._plan_decisions = 0.0, 0

    def _plan_left(self) -> tuple[Callable[[float], float], Callable[[float], str]] | None:
        """Within a planned fit (see :data:`PLAN_SHARE`): a function from the time per call of
        the decision's conservative form (0 before it is timed) to the seconds left to measure
        in this fit, and one saying why there are none; None outside a fit (or without a
        share)."""
        from tfmx.guard import active_plan

        share = plan_share()
        plan = active_plan()
        if share is None or plan is None or not plan.steps:
            return None
        self._sync_plan()
        hint = (self.step_hint() if self.step_hint is not None else None) or 0.0

        def step(call_s: float) -> float:
            return max(self._plan_step + call_s, hint)

        def allowed(call_s: float) -> float:
            if call_s <= 0 and step(0.0) <= 0:
                return math.inf  # nothing known yet: the conservative form's call will say
            return share * plan.steps * step(call_s) - self._plan_spent

        def why(call_s: float) -> str:
            how = ("known from a previous fit" if hint > 0 and hint >= self._plan_step + call_s
                   else "the conservative forms measured in this fit")
            return (f"measuring budget spent: {share:.0%} of the planned run, {plan.steps} "
                    f"steps x {step(call_s) * 1e3:.1f} ms a step ({how}) = "
                    f"{share * plan.steps * step(call_s):.2f} s; measured on a later run")

        return allowed, why


def planned_steps() -> int | None:
    """The steps the ``fit`` under way plans (``tfmx.guard.active_plan``), None outside one.

    >>> planned_steps() is None
    True
    """
    from tfmx.guard import active_plan

    plan = active_plan()
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


def _outside_trace(timer: Timer, candidates: Mapping[str, RunFactory],
                   seconds: float) -> Mapping[str, float]:
    """Run ``timer`` on a thread of its own: a rewrite runs while TensorFlow traces a step
    (inside a graph, under Keras's gradient tape), and the candidates must be built and timed
    eagerly with no tape recording; TensorFlow keeps both per thread. The fit under way
    (``tfmx.guard.active_plan``) is the thread's too: decisions its candidates make are made
    for it."""
    from tfmx.guard import active_plan, adopting

    plan = active_plan()

    def timed() -> Mapping[str, float]:
        with adopting(plan):
            return timer(candidates, seconds)

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(timed).result()


def export_cache(path: str | os.PathLike, backend: str = "cpu") -> Path:
    """Write this machine's tuning results for ``backend`` to ``path`` (JSON); returns it.

    >>> import tempfile, pathlib
    >>> out = export_cache(pathlib.Path(tempfile.mkdtemp()) / "fleet.json")
    >>> sorted(__import__("json").loads(out.read_text()))
    ['decisions', 'fingerprint']
    """
    contents = TuningCache.for_backend(backend).contents()
    out = Path(path)
    out.write_text(json.dumps(contents, indent=1, sort_keys=True))
    return out


def import_cache(path: str | os.PathLike, force: bool = False) -> int:
    """Merge an exported file into this machine's cache; returns the decisions added.

    A file from a machine with another fingerprint (processor, TensorFlow, oneDNN state, tfmx's
    code) is refused with a ValueError saying what differs, unless ``force=True``.
    """
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "fingerprint" not in data or "decisions" not in data:
        raise ValueError(f"{path}: not a tfmx tuning export (no fingerprint/decisions)")
    theirs = data["fingerprint"]
    cache = TuningCache.for_backend(str(theirs.get("backend", "cpu")))
    if theirs != cache.fingerprint and not force:
        differs = sorted(k for k in set(theirs) | set(cache.fingerprint)
                         if theirs.get(k) != cache.fingerprint.get(k))
        raise ValueError(
            f"{path} was measured on another machine or by another tfmx (differs in "
            f"{', '.join(differs)}); its timings are not facts about this one. Pass force=True "
            "(tfmx tune --import FILE --force) to use them anyway.")
    return cache.merge(data["decisions"])


__all__ = ["CODE_PACKAGES", "Decision", "MODES", "OverBudget", "Timings", "Tuner", "TuningCache",
           "cache_dir", "code_digest", "export_cache", "fingerprint", "for_plan", "import_cache",
           "measure", "plan_share", "planned_steps", "share_from_env", "resolve_mode", "sign_test",
           "within_noise"]
