"""The docs cannot drift silently: every project path and public name they mention exists.

Read: README.md, BENCHMARKS.md and every docstring of the library's modules (module, classes,
functions, methods). Checked:

- a path under one of the project's folders (``tfmx/...``, ``fusion/graphs/x.py``,
  ``tests/...``, ``.ci/run``) or a top-level file name (``README.md``) is a file or folder of
  the repository (``../shared/...`` is the shared folder beside it, when present);
- a dotted name under one of the packages (``fusion.stage.tracing``, ``tfmx.tuner.Tuner``)
  imports: its longest module prefix, then each attribute after it.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tfmx", "fusion", "policies", "recipes", "bench")
FOLDERS = (*PACKAGES, "tests", ".ci")
TOP_LEVEL = ("README.md", "BENCHMARKS.md", "DESIGN.md", "pyproject.toml", "LICENSE")

_FOLDERS_RE = "|".join(re.escape(f) for f in FOLDERS)
_TOP_RE = "|".join(re.escape(f) for f in TOP_LEVEL)
_PATH = re.compile(rf"(?<![\w./-])(?:\.\./shared/[\w./-]+|(?:{_FOLDERS_RE})/[\w./-]*|{_TOP_RE})")
_NAME = re.compile(r"(?<![\w./])(?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_]\w*)+")


def _docstrings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                found.append(doc)
    return found


def _sources() -> dict[str, str]:
    texts = {name: (ROOT / name).read_text() for name in ("README.md", "BENCHMARKS.md")}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            texts[str(path.relative_to(ROOT))] = "\n".join(_docstrings(path))
    return texts


def _is_path(mention: str) -> bool:
    """A file (a name with an extension), a folder (a trailing slash) or CI's script; not a
    ratio such as tfmx/stock."""
    last = mention.rstrip(".,:;)").rsplit("/", 1)[-1]
    return mention.endswith("/") or "." in last or mention.startswith(".ci/")


def _path_exists(mention: str) -> bool:
    mention = mention.rstrip(".,:;)")
    if mention.startswith("../shared/"):
        shared = ROOT.parent / "shared"
        return not shared.exists() or (ROOT.parent / mention[3:]).exists()
    if "*" in mention or "<" in mention:
        return True
    return (ROOT / mention).exists()


def _name_exists(mention: str) -> bool:
    parts = mention.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


SOURCES = _sources()


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_every_project_path_mentioned_exists(source):
    missing = sorted({m.rstrip(".,:;)") for m in _PATH.findall(SOURCES[source])
                      if _is_path(m) and not _path_exists(m)})
    assert not missing, f"{source} mentions paths that do not exist: {missing}"


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_every_public_name_mentioned_exists(source):
    missing = sorted({m for m in _NAME.findall(SOURCES[source]) if not _name_exists(m)})
    assert not missing, f"{source} mentions names that do not exist: {missing}"


def test_the_checks_can_fail():
    assert not _path_exists("fusion/graphs/no_such_family.py")
    assert not _is_path("tfmx/stock") and _is_path("tfmx/") and _is_path("fusion/stage.py")
    assert not _name_exists("fusion.stage.no_such_function")
    assert _name_exists("fusion.stage.tracing") and _path_exists("fusion/stage.py")
    assert _PATH.findall("see `tfmx/tuner.py` and README.md.") == ["tfmx/tuner.py", "README.md"]
