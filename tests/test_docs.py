"""The docs cannot drift silently: what they mention exists, what they show runs.

Read: README.md, docs/*.md, BENCHMARKS.md and every docstring of the library's modules (module,
classes, functions, methods). Checked:

- a path under one of the project's folders (``tfmx/...``, ``fusion/graphs/x.py``,
  ``tests/...``, ``.ci/run``) or a top-level file name (``README.md``) is a file or folder of
  the repository (``../shared/...`` is the shared folder beside it, when present);
- a dotted name under one of the packages (``fusion.stage.tracing``, ``tfmx.tuner.Tuner``)
  imports: its longest module prefix, then each attribute after it;
- in README.md and docs/*.md: every relative link resolves; every ```python block runs (or,
  preceded by ``<!-- not run: why -->``, compiles); every ``tfmx <command>`` and
  ``python -m <module>`` they name exists (its ``--help`` runs); no development diary; the
  README is short, holds the two commands CI and users run, and the benchmark table's markers;
  mkdocs.yml's nav lists every page of docs/ and nothing else.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
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
DOCS = ROOT / "docs"
DOC_PAGES = sorted(DOCS.glob("*.md"))
USER_DOCS = [ROOT / "README.md", *DOC_PAGES]


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
    texts.update({str(path.relative_to(ROOT)): path.read_text() for path in DOC_PAGES})
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
    missing = sorted({m for m in _NAME.findall(SOURCES[source])
                      if not m.endswith(".md") and not _name_exists(m)})  # recipes.md: a page
    assert not missing, f"{source} mentions names that do not exist: {missing}"


def test_the_checks_can_fail():
    assert not _path_exists("fusion/graphs/no_such_family.py")
    assert not _is_path("tfmx/stock") and _is_path("tfmx/") and _is_path("fusion/stage.py")
    assert not _name_exists("fusion.stage.no_such_function")
    assert _name_exists("fusion.stage.tracing") and _path_exists("fusion/stage.py")
    assert _PATH.findall("see `tfmx/tuner.py` and README.md.") == ["tfmx/tuner.py", "README.md"]


# -- README.md and docs/*.md: links, code, commands ------------------------------------------
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_NOT_RUN = re.compile(r"<!-- not run: (.+?) -->\s*\Z")
_SPAN = re.compile(r"`([^`\n]+)`")
_TFMX_COMMAND = re.compile(r"(?:^|[\s;&|(])tfmx ([a-z][\w-]*)")
_PYTHON_M = re.compile(r"\bpython -m ([A-Za-z_][\w.]*)")
README_COMMANDS = ('python -m pip install -e ".[recipes]" && python -m recipes.tour',
                   'python -m pip install -e ".[test]" && ruff check . && python -m pytest -q')
DIARY = re.compile(r"session|\bissue \d+", re.I)


def _doc_name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def broken_links(path: Path, text: str) -> list[str]:
    """Relative links of ``text`` (a page at ``path``) whose file does not exist, or, from a
    page of docs/, that leave docs/ (the site built from it has no such page); web links and
    in-page anchors are not followed.

    >>> broken_links(ROOT / "README.md", "[a](docs/index.md) [b](https://x.org) [c](#t) [d](no.md)")
    ['no.md']
    """
    missing = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        resolved = (path.parent / target.split("#")[0]).resolve()
        inside = DOCS in resolved.parents or path.parent != DOCS
        if not resolved.exists() or not inside:
            missing.append(target)
    return missing


def code_blocks(text: str) -> list[tuple[int, str, str, str | None]]:
    """(line, language, code, why it is not run or None) of every fenced block of ``text``.

    >>> code_blocks("x\\n<!-- not run: needs a cluster -->\\n```python\\nf()\\n```\\n")
    [(3, 'python', 'f()\\n', 'needs a cluster')]
    """
    blocks = []
    for found in _FENCE.finditer(text):
        line = text.count("\n", 0, found.start()) + 1
        why = _NOT_RUN.search(text[: found.start()])
        blocks.append((line, found.group(1), found.group(2), why.group(1) if why else None))
    return blocks


def commands(text: str) -> set[tuple[str, str]]:
    """("tfmx", command) and ("python -m", module) named in ``text``'s inline code and its
    shell blocks (prose and printed output are not read: "tfmx runs" is no command; a
    template such as ``python -m recipes.<name>`` names no module).

    >>> sorted(commands("run `tfmx bench --model mlp`, then `python -m recipes.tour`; tfmx runs"))
    [('python -m', 'recipes.tour'), ('tfmx', 'bench')]
    """
    code = [span for span in _SPAN.findall(_FENCE.sub("", text))]
    code += [re.sub(r"(?m)(^|\s)#.*$", "", body)  # a shell comment is prose
             for _, language, body, _ in code_blocks(text) if language in ("bash", "sh")]
    found = set()
    for piece in code:
        found |= {("tfmx", name) for name in _TFMX_COMMAND.findall(piece)}
        found |= {("python -m", name) for name in _PYTHON_M.findall(piece)
                  if not name.endswith(".")}  # recipes.<name>: a template
    return found


def _python_blocks() -> list[tuple[str, str, str | None]]:
    return [(f"{_doc_name(path)}:{line}", code, why) for path in USER_DOCS
            for line, language, code, why in code_blocks(path.read_text())
            if language == "python"]


@pytest.mark.parametrize("page", USER_DOCS, ids=_doc_name)
def test_every_relative_link_resolves(page):
    missing = broken_links(page, page.read_text())
    assert not missing, f"{_doc_name(page)}: links to no file (or out of docs/): {missing}"


@pytest.mark.parametrize("where,code,why", _python_blocks(), ids=[b[0] for b in _python_blocks()])
def test_every_python_block_runs(where, code, why):
    """A block runs as a user would paste it (tfmx switched off after it); a block that cannot
    run here says why and must still compile."""
    compiled = compile(code, where, "exec")
    if why is not None:
        assert why.strip(), f"{where}: say why the block is not run"
        return
    import tfmx

    try:
        exec(compiled, {"__name__": "__docs__"})
    finally:
        tfmx.disable()


def _all_commands() -> list[tuple[str, str]]:
    found = set()
    for page in USER_DOCS:
        found |= commands(page.read_text())
    return sorted(found)


@pytest.mark.parametrize("kind,name", _all_commands(), ids=[" ".join(c) for c in _all_commands()])
def test_every_command_named_exists(kind, name):
    if kind == "python -m" and name.split(".")[0] not in (*PACKAGES, "recipes"):
        assert importlib.util.find_spec(name) is not None, f"python -m {name}: no such module"
        return
    argv = [name, "--help"] if kind == "python -m" else ["tfmx", name, "--help"]
    done = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"{kind} {name} --help failed:\n{done.stderr[-2000:]}"


@pytest.mark.parametrize("page", USER_DOCS, ids=_doc_name)
def test_no_development_diary(page):
    hits = [line for line in page.read_text().splitlines() if DIARY.search(line)]
    assert not hits, f"{_doc_name(page)} reads like a diary: {hits[:3]}"


def test_readme_is_short_and_holds_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    for command in README_COMMANDS:
        assert command in readme, f"README.md lost the command {command!r}"
    assert README_COMMANDS[1] in (ROOT / ".ci" / "run").read_text()


def test_readme_bench_table_between_its_markers():
    readme = (ROOT / "README.md").read_text()
    start, end = "<!-- bench-table:start -->", "<!-- bench-table:end -->"
    assert readme.count(start) == 1 and readme.count(end) == 1
    table = readme[readme.index(start) + len(start): readme.index(end)]
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert len(rows) >= 3, "no table between the bench-table markers"
    assert not re.search(r"TODO|TBD|XXX|placeholder", table, re.I)


def test_mkdocs_nav_lists_every_page():
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs"
    listed = [page for entry in config["nav"] for page in entry.values()]
    pages = [path.name for path in DOC_PAGES]
    unlisted, absent = sorted(set(pages) - set(listed)), sorted(set(listed) - set(pages))
    assert not unlisted, f"add to mkdocs.yml's nav: {unlisted}"
    assert not absent, f"mkdocs.yml's nav lists pages docs/ does not have: {absent}"
    assert len(listed) == len(set(listed)), "mkdocs.yml's nav lists a page twice"


def test_the_doc_checks_can_fail():
    assert broken_links(ROOT / "docs" / "index.md", "[x](no_such_page.md)") == ["no_such_page.md"]
    assert broken_links(DOCS / "index.md", "[x](../README.md)") == ["../README.md"]
    assert broken_links(DOCS / "index.md", "[x](tuning.md#the-cache)") == []
    assert commands("```bash\ntfmx nosuch --x  # tfmx and XLA\n```\n") == {("tfmx", "nosuch")}
    assert commands("```\ntfmx report (backend cpu)\n```\n`python -m recipes.<name>`") == set()
    assert code_blocks("```python\nx\n```\n")[0][3] is None
    assert DIARY.search("in session 12") and DIARY.search("issue 16") and not DIARY.search("a")
    done = subprocess.run([sys.executable, "-m", "tfmx", "nosuch", "--help"], cwd=ROOT,
                          capture_output=True, timeout=120)
    assert done.returncode != 0


# -- the site: mkdocs build --strict, the API reference complete -----------------------------
def _environment_variables() -> set[str]:
    """Every ``TFMX_*`` variable the library reads (its source names each as a string)."""
    found = set()
    for package in ("tfmx", "fusion", "policies"):
        for path in (ROOT / package).rglob("*.py"):
            found |= set(re.findall(r"\"(TFMX_[A-Z_]+)\"", path.read_text()))
    return found - {"TFMX_NO_SUCH_SHARE"}  # tfmx.env's doctest of an unset variable


@pytest.mark.slow
def test_the_site_builds_strict_with_every_public_name(tmp_path):
    """``mkdocs build --strict`` (a broken link, a docstring mkdocstrings cannot render fails
    it) and the API page holds every name ``tfmx`` exports, every parameter of its calls and
    every environment variable tfmx reads."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the docs and test extras)")
    pytest.importorskip("mkdocstrings_handlers.python",
                        reason="mkdocstrings[python] is not installed (the docs and test extras)")
    import inspect

    import tfmx

    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    ids = set(re.findall(r'id="(tfmx\.[\w.]+)"', api))
    missing = [n for n in tfmx.__all__ if not any(i.rsplit(".", 1)[-1] == n for i in ids)]
    assert not missing, f"docs/api.md lacks {missing}"
    for call in (tfmx.enable, tfmx.report, tfmx.function):
        for param in inspect.signature(call).parameters:
            assert re.search(rf"<code>{param}</code>|>{param}<", api), f"{call.__name__}({param}=)"
    page = (DOCS / "api.md").read_text()
    unlisted = sorted(v for v in _environment_variables() if f"`{v}`" not in page)
    assert not unlisted, f"docs/api.md's table lacks {unlisted}"
    assert {"TFMX_FUSE", "TFMX_VERBOSE", "TFMX_CACHE_DIR"} <= _environment_variables()
