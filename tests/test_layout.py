"""The house's layout holds: layers import downwards only, no import cycle, small modules, one
registry of families with every graph pass and stage in it.

The layers, lowest first: ``fusion`` (the rewrite engine), ``tfmx`` (enable, trace, rebuild,
guard, report), ``policies`` (mixed precision), ``recipes`` (in the wheel), then ``bench``
(the repository's benchmark, not in the wheel), which nothing below it imports. Imports are
read from the source (``ast``), function-local ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"fusion": 1, "tfmx": 2, "policies": 3, "recipes": 4, "bench": 5}
LIBRARY = ("fusion", "tfmx", "policies")
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    found = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """The project modules ``path`` imports (at any depth of its code)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES
                     else node.module for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def test_every_import_runs_downwards():
    up = [(a, b) for a, targets in GRAPH.items() for b in targets
          if LAYERS[b.split(".")[0]] > LAYERS[a.split(".")[0]]]
    assert not up, f"imports from a lower layer to a higher one: {up}"


def test_no_import_cycle():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in GRAPH:
        if name not in index:
            visit(name)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("name", [n for n in MODULES if n.split(".")[0] in LIBRARY])
def test_library_modules_are_small(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name}: {lines} lines"


def test_the_library_never_imports_its_benchmark_or_recipes():
    reached = {t.split(".")[0] for n, ts in GRAPH.items() if n.split(".")[0] in LIBRARY
               for t in ts}
    assert not reached & {"bench", "recipes"}


def test_the_recipes_ship_without_the_benchmark():
    """The wheel holds the recipes but not ``bench``: no recipe imports it."""
    reached = {t.split(".")[0] for n, ts in GRAPH.items() if n.startswith("recipes")
               for t in ts}
    assert "bench" not in reached


def test_every_graph_pass_and_stage_is_a_declared_family():
    """One registry: each module of fusion/graphs either declares its family's pass or is a
    part a declared family's pass imports; each family with hooks is in the registry, and a
    stage family's units are observed by its declared forms or by its own pass."""
    from fusion import stage
    from fusion.family import families

    declared = {f.name: f for f in families()}
    for path in (ROOT / "fusion" / "graphs").glob("*.py"):
        if path.stem == "__init__":
            continue
        source = path.read_text()
        assert "@register(" in source or any(
            f"fusion.graphs.{path.stem} import" in p.read_text()
            for p in (ROOT / "fusion" / "graphs").glob("*.py")), path.name
    for family in stage.stages():
        assert family.name in declared
        assert family.graph_pass is not None or (family.forms and family.forms.observed), \
            family.name


WINGS = ("fusion.calls", "fusion.graphs")


def test_stages_and_graph_passes_never_import_each_other():
    """The two wings of ``fusion`` meet through the registry (``fusion.family``) and the
    kernels both use (``fusion.kernels``), never by an import of one from the other."""
    def wing(name: str) -> str | None:
        return next((w for w in WINGS if name == w or name.startswith(w + ".")), None)

    crossing = sorted((a, b) for a, targets in GRAPH.items() for b in targets
                      if wing(a) and wing(b) and wing(a) != wing(b))
    assert not crossing, crossing


CONTRIBUTED = ("fusion.calls.bias_row", "fusion.bfloat16_bits")
"""Modules that offer their forms to other stages through ``fusion.forms`` alone: removing one
(and its own test) leaves every other module as it is."""


@pytest.mark.parametrize("module", CONTRIBUTED)
def test_contributed_forms_are_reached_through_fusion_forms_alone(module):
    """No other library module, and neither of the tests' shared helpers, imports a module
    that contributes forms (``fusion.forms.contribute``): the stages ask ``fusion.forms``."""
    importers = [name for name, targets in GRAPH.items() if module in targets]
    importers += [f"tests/{name}.py" for name in ("helpers", "parity")
                  if module in _imports(ROOT / "tests" / f"{name}.py")]
    assert not importers, f"{module} imported by {sorted(importers)}"
