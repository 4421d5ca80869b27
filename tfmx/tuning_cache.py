"""The tuning cache: the decisions measured on one machine, kept in one JSON file per machine.

A :class:`Decision` records one choice between correct forms: what was chosen, between what,
with which figures and from where. :class:`TuningCache` keeps the measured ones in one JSON file
per machine under :func:`cache_dir` (``$TFMX_CACHE_DIR``, else ``$XDG_CACHE_HOME/tfmx``, else
``~/.cache/tfmx``), named by a hash of the machine's :func:`fingerprint`: the CPU model, family
and relevant flags, the TensorFlow version, the oneDNN state, the backend and tfmx's own code
(:func:`code_digest`). A new TensorFlow, oneDNN switched the other way, another processor or
another tfmx reads another file, so nothing measured elsewhere is reused, and a form
reimplemented under the same name is measured again. The machine's figures (what first calls
and whole steps cost in each form relative to stock's: priors, :func:`figures_cache`) sit in a
file beside it whose fingerprint leaves tfmx's code out. :func:`export_cache` and
:func:`import_cache` carry a file to identical machines running the same tfmx (preseed a
fleet).

Example:
    >>> from tfmx.tuning_cache import Decision
    >>> Decision("demo", "x", "b", ("a", "b"), {"a": 2.0, "b": 1.0}).describe()
    'demo x: b (measured)  a 2.000 ms, b 1.000 ms'
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tfmx import host_allocator, machine

ENV_DIR = "TFMX_CACHE_DIR"


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
    """What a measurement is a fact about: processor, TensorFlow, oneDNN state, the allocator
    of CPU tensors (:func:`tfmx.host_allocator.expected`), backend and tfmx's code.

    >>> sorted(fingerprint("cpu"))  # doctest: +NORMALIZE_WHITESPACE
    ['backend', 'code', 'cpu', 'host_allocator', 'keras', 'onednn', 'tensorflow']
    """

    info = machine.fingerprint()
    cpu = info.get("cpu", {})
    return {
        "backend": backend,
        "cpu": {k: cpu.get(k) for k in ("vendor", "model", "family", "model_number", "flags")},
        "tensorflow": info.get("tensorflow"),
        "keras": info.get("keras"),
        "onednn": info.get("onednn"),
        "host_allocator": host_allocator.expected(),
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
    # "measured", "cached", "conservative (<why>)", "prior" (not measured: the family's form
    # on this machine's figures, tfmx.tuning_prior; the note says why) or
    # "fuse='always' (<why not measured>)"
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
        if self.source.startswith("fuse="):
            return self.source
        if self.source == "prior":
            return self.note
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
        self._figures: TuningCache | None = None

    def figures(self) -> TuningCache:
        """The machine's figures (:func:`figures_cache`): a cache file beside this one whose
        fingerprint leaves out tfmx's code, so that another tfmx keeps them.

        >>> import tempfile, pathlib
        >>> c = TuningCache(pathlib.Path(tempfile.mkdtemp()) / "t.json", {"code": "1"})
        >>> f = c.figures()
        >>> f.fingerprint, f.path.name.startswith("figures-"), f is c.figures()
        ({}, True, True)
        """
        if self._figures is None:
            fp = {k: v for k, v in self.fingerprint.items() if k != "code"}
            backend = str(fp.get("backend", "any"))
            self._figures = TuningCache(self.path.parent / f"figures-{backend}-{_key(fp)}.json",
                                        fp)
        return self._figures

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

def figures_cache(cache: Any) -> Any:
    """Where the machine's figures of ``cache`` are kept: what first calls cost relative to
    stock's and what tfmx's and XLA's steps gain over stock's here (``tfmx.first_call``,
    ``tfmx.step_gain``). They are priors about the processor, TensorFlow and its oneDNN state,
    each the median of the last few observations, so they outlive a tfmx version (a
    :class:`TuningCache`'s :meth:`TuningCache.figures`), while decisions between forms are
    measured again by another tfmx. Any other cache (or None) keeps its figures itself.

    >>> figures_cache(None) is None
    True
    """
    figures = getattr(cache, "figures", None)
    return figures() if callable(figures) else cache


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


__all__ = ["CODE_PACKAGES", "Decision", "ENV_DIR", "TuningCache", "cache_dir", "code_digest",
           "export_cache", "figures_cache", "fingerprint", "import_cache"]
