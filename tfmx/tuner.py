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

DEFAULT_BUDGET_S = 30.0
"""Seconds one rewrite may spend measuring (``TFMX_TUNE_BUDGET``); what is left unmeasured
takes the conservative form and is measured on a later run. Measured once per machine and
shape (the cache keeps it): the transformer workload's 31 decisions took 21 s on a 2-core
Zen 3 (its attention, layer-norm and feed-forward forms 1-2.5 s each, a MatMul 0.3-1.2 s)."""

DECISION_SECONDS = 0.075
"""Seconds of interleaved rounds per candidate of a decision (after one warm-up call of each):
0.15 s for two forms, 0.45 s for six. Until session 21 a decision had 0.1 s whatever its
candidates, so one between six layer-norm forms ran its minimum 8 rounds, where a form 30%
faster than the conservative one won 6 of them: within noise, the slower form kept."""

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
        return f"{self.family} {self.signature}: {self.choice} ({self.source})" + (
            f"  {times}" if times else "") + (f"  [{self.note}]" if self.note else "")

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
                            str(raw.get("note", "")))
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
    can be tested against the noise (:func:`sign_test`)."""

    def __init__(self, samples: Mapping[str, list[float]]) -> None:
        super().__init__({name: statistics.median(s) for name, s in samples.items()})
        self.samples = {name: list(s) for name, s in samples.items()}


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


def measure(candidates: Mapping[str, RunFactory], seconds: float) -> Timings:
    """Median seconds per candidate, with every round's samples (:class:`Timings`): each is
    built, run once untimed (graph optimization, first-run allocation), then the candidates
    run interleaved (order rotated every round) for ``seconds``, at least
    :data:`MIN_ROUNDS` and at most :data:`MAX_ROUNDS` rounds.

    >>> import time
    >>> t = measure({"fast": lambda: (lambda: None), "slow": lambda: (lambda: time.sleep(0.002))},
    ...             0.01)
    >>> t["fast"] < t["slow"]
    True
    """
    runs = {name: factory() for name, factory in candidates.items()}
    for run in runs.values():
        run()
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
    return Timings(samples)


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
            decision = self._decide(family, signature, candidates, conservative)
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
        start = time.perf_counter()
        try:
            seconds = _outside_trace(self.timer, candidates,
                                     min(DECISION_SECONDS * len(candidates),
                                         max(self.budget - self.spent, 0.0)))
            times = {n: float(seconds[n]) * 1e3 for n in names}
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is not chosen
            return fallback(f"measuring failed: {type(exc).__name__}: {exc}"[:200])
        finally:
            self.spent += time.perf_counter() - start
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
        decision = Decision(family, signature, best, names, times, "measured", note)
        if self.cache is not None:
            self.cache.put(decision)
        return decision


def _outside_trace(timer: Timer, candidates: Mapping[str, RunFactory],
                   seconds: float) -> Mapping[str, float]:
    """Run ``timer`` on a thread of its own: a rewrite runs while TensorFlow traces a step
    (inside a graph, under Keras's gradient tape), and the candidates must be built and timed
    eagerly with no tape recording; TensorFlow keeps both per thread."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(timer, candidates, seconds).result()


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


__all__ = ["CODE_PACKAGES", "Decision", "MODES", "Timings", "Tuner", "TuningCache", "cache_dir",
           "code_digest", "export_cache", "fingerprint", "import_cache", "measure",
           "resolve_mode", "sign_test", "within_noise"]
