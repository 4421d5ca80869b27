"""The ``tfmx`` command (also ``python -m tfmx``).

Subcommands::

    tfmx bench [--model M [M ...]] [--rounds N] [--steps N] [--batch-size B]
               [--modes stock tfmx xla] [--policy NAME] [--onednn on|off|both]
               [--replicas N] [--output FILE.md] [--json [FILE.json]]   # python -m bench
    tfmx recipe NAME [recipe args...]      # e.g. tfmx recipe small_cnn --quick
    tfmx recipe --list                     # the recipes and what each shows
    tfmx backends [--json]                 # what each backend fuses (metal: per plugin)
    tfmx placement SCRIPT.py|RECIPE [--plugin P] [--tensorflow V] [--json] [-- args...]
                                           # where each node would run on a Mac (a plan)
    tfmx tune [--export F | --import F [--force] | --clear]   # this machine's tuning cache

Only the subcommands import TensorFlow, so ``tfmx --help`` answers at once.

``tfmx bench`` runs ``python -m bench`` in a process of its own, as ``tfmx recipe`` runs the
recipes: the benchmark lives in a clone of the repository (run it from there, or from an
editable install), not in the wheel, and the library never loads it.

Example:
    >>> from tfmx.cli import main
    >>> main(["recipe", "no_such_recipe"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    SystemExit: tfmx recipe: unknown recipe 'no_such_recipe'; available: bn_resnet...
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tfmx", description="tfmx: graph-rewrite fusion for Keras 3 on TensorFlow."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    # listed for --help only: main hands "tfmx bench ..." to python -m bench before parsing
    sub.add_parser("bench", add_help=False,
                   help="time stock vs tfmx vs XLA training steps, interleaved")

    recipe = sub.add_parser(
        "recipe", help="run a training recipe: tfmx recipe NAME [args...]",
        description="Run recipes.NAME's main with the remaining arguments.",
    )
    recipe.add_argument("--list", action="store_true",
                        help="list the recipes and what each shows, then exit")
    recipe.add_argument("name", nargs="?", help="recipe name (tfmx recipe --list)")
    recipe.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the recipe")

    placement = sub.add_parser(
        "placement", help="where each node of a model's training step would run on a Mac: "
                          "the ops that fall back to the host, stock and with tfmx",
        description="Run a model script or a recipe (--quick, its tfmx run only) with tfmx "
                    "planning for the metal backend of a Metal plugin, on any machine: the "
                    "first step of each traced function raises once planned, and the placement "
                    "audit of each plan is printed (tfmx.placement). Exit status 1 if tfmx "
                    "moved a node from the device to the host. Arguments after -- go to the "
                    "script or the recipe.")
    placement.add_argument("target", help="a model script (path ending in .py) or a recipe name")
    placement.add_argument("--plugin", default=None,
                           help="tensorflow-metal or tensorflow-metal-plugin, optionally "
                                "==VERSION (default: the installed one, else tensorflow-metal)")
    placement.add_argument("--tensorflow", default=None, metavar="VERSION",
                           help="the TensorFlow version to plan for (default: the installed one)")
    placement.add_argument("--json", action="store_true", help="print as JSON")

    backends = sub.add_parser("backends", help="what each backend fuses")
    backends.add_argument("--json", action="store_true", help="print as JSON")

    tune = sub.add_parser(
        "tune", help="this machine's tuning cache: show, export, import, clear",
        description="tfmx times correct alternatives on each machine and caches the choices "
                    "per machine (CPU, TensorFlow, oneDNN state, backend) and tfmx version (a "
                    "hash of its source). Without an option: "
                    "show where the cache is and what it holds.")
    tune.add_argument("--backend", default="cpu", choices=("cpu", "cuda", "metal"),
                      help="whose cache (default cpu)")
    action = tune.add_mutually_exclusive_group()
    action.add_argument("--export", metavar="FILE", help="write this machine's cache to FILE")
    action.add_argument("--import", dest="import_", metavar="FILE",
                        help="merge FILE (exported on an identical machine) into the cache")
    action.add_argument("--clear", action="store_true", help="delete this machine's cache")
    tune.add_argument("--force", action="store_true",
                      help="with --import: accept a file measured on another machine")
    return parser


def _figure(name: str, value: float) -> str:
    """One figure of a cached record in its unit: a form's time, a price record's ``*_ms``
    (milliseconds), ``*_s`` (seconds) or a count (``ops``, ``fits``).

    >>> _figure("fused", 1.5), _figure("stock_first_s", 2.25), _figure("fits", 3.0)
    ('fused 1.500 ms', 'stock_first_s 2.250 s', 'fits 3')
    """
    if name.endswith("_s"):
        return f"{name} {value:.3f} s"
    if name in ("ops", "fits", "fused_deferred"):
        return f"{name} {value:g}"
    return f"{name} {value:.3f} ms"


def _tune(args: argparse.Namespace) -> int:
    from tfmx import tuner

    cache = tuner.TuningCache.for_backend(args.backend)
    if args.export:
        print(f"wrote {tuner.export_cache(args.export, args.backend)}")
    elif args.import_:
        try:
            added = tuner.import_cache(args.import_, force=args.force)
        except (OSError, ValueError) as err:
            raise SystemExit(f"tfmx tune: {err}") from None
        print(f"imported {added} decision(s) into {cache.path}")
    elif args.clear:
        for path in (cache.path, cache.figures().path):  # its decisions, the machine's figures
            existed = path.exists()
            path.unlink(missing_ok=True)
            print(f"{'removed' if existed else 'no cache at'} {path}")
    else:
        contents = cache.contents()
        print(f"cache: {cache.path} ({'present' if cache.path.exists() else 'empty'})")
        print(f"machine: {json.dumps(contents['fingerprint'], sort_keys=True)}")
        figures = cache.figures()
        for key, d in sorted({**figures.contents()["decisions"],
                              **contents["decisions"]}.items()):
            times = ", ".join(_figure(n, t) for n, t in d.get("times_ms", {}).items())
            print(f"  {key}: {d.get('choice')}  ({times})")
        print(f"the machine's figures (kept by another tfmx): {figures.path}")
    return 0


def bench_root() -> Path | None:
    """The folder holding the benchmark package ``bench``, or None: the benchmark lives in a
    clone of tfmx's repository, not in the wheel. Found where Python already finds it, in the
    current folder, or in the clone an editable install of tfmx points to.

    >>> root = bench_root()
    >>> root is None or (root / "bench" / "__main__.py").exists()
    True
    """
    spec = importlib.util.find_spec("bench")
    if spec is not None and spec.origin and Path(spec.origin).parent.joinpath("runner.py").exists():
        return Path(spec.origin).parent.parent
    here = Path(__file__).resolve().parents[1]
    for folder in (Path.cwd(), here):
        if (folder / "bench" / "__main__.py").exists() and (folder / "tfmx").is_dir():
            return folder
    return None


def _bench(argv: Sequence[str]) -> int:
    """Run ``python -m bench ARGS`` in a process of its own, with the clone that holds the
    benchmark (:func:`bench_root`) on ``PYTHONPATH``: the library never imports it."""
    import subprocess

    root = bench_root()
    if root is None:
        raise SystemExit("tfmx bench: the benchmark is not part of the installed package; it "
                         "runs from a clone of tfmx's repository (cd into the clone, or "
                         "pip install -e . there, then run tfmx bench again)")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.call([sys.executable, "-m", "bench", *argv], env=env)


def recipe_summaries() -> dict[str, str]:
    """Each runnable recipe (a module of the ``recipes`` package beside tfmx, not starting with
    ``_``, defining ``main``) -> the first line of its module docstring. Read from the files
    with ``ast``: the library never imports its recipes.

    >>> summaries = recipe_summaries()
    >>> "small_cnn" in summaries and summaries["small_cnn"] != ""
    True
    """
    import ast
    import pkgutil

    spec = importlib.util.find_spec("recipes")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("tfmx recipe: the recipes package is not installed beside tfmx "
                         "(pip install -e . from the project's checkout)")
    found: dict[str, str] = {}
    for info in pkgutil.iter_modules(spec.submodule_search_locations):
        if info.name.startswith("_") or info.ispkg:
            continue
        path = os.path.join(info.module_finder.path, f"{info.name}.py")  # type: ignore[union-attr]
        try:
            tree = ast.parse(open(path, encoding="utf-8").read())
        except (OSError, SyntaxError):
            continue
        if not any(isinstance(node, ast.FunctionDef) and node.name == "main"
                   for node in tree.body):
            continue
        doc = (ast.get_docstring(tree) or "").strip()
        found[info.name] = doc.splitlines()[0] if doc else ""
    return dict(sorted(found.items()))


def _recipe(args: argparse.Namespace) -> int:
    """Run ``python -m recipes.<name>`` in a process of its own: the library never imports
    its recipes (it only finds where they are and reads their docstrings)."""
    import subprocess

    summaries = recipe_summaries()
    if args.list or not args.name:
        if not args.list:
            print("tfmx recipe NAME [args...]: one of", file=sys.stderr)
        width = max((len(n) for n in summaries), default=0)
        for name, summary in summaries.items():
            print(f"{name:<{width}}  {summary}")
        return 0 if args.list else 2
    if args.name not in summaries:
        raise SystemExit(f"tfmx recipe: unknown recipe {args.name!r}; available: "
                         f"{', '.join(summaries) or '(none)'}")
    return subprocess.call([sys.executable, "-m", f"recipes.{args.name}", *args.args])


def _backends(args: argparse.Namespace) -> int:
    from tfmx.backends import BACKEND_NAMES, get_backend
    from tfmx.metal_plugins import known_plugins

    described = [get_backend(name).describe() for name in BACKEND_NAMES]
    default_metal = described[BACKEND_NAMES.index("metal")]["plugin"]
    for table in known_plugins():  # the other Metal plugins tfmx can plan for
        if f"{table.name} {table.version}" != default_metal:
            described.append(get_backend(
                "metal", plugin=f"{table.name}=={table.version}").describe())
    if args.json:
        print(json.dumps(described, indent=2))
        return 0
    for d in described:
        here = "available here" if d["available_here"] else "not on this machine: plan only"
        print(f"{d['name']}: {d['description']} ({here})")
        for op, by_dtype in d["contractions"].items():
            for dtype, chains in by_dtype.items():
                print(f"  _Fused{op} {dtype}: {', '.join(chains)}")
        bn = d.get("batch_norm")
        if bn:
            ex = bn["_FusedBatchNormEx"]
            print(f"  FusedBatchNormV3: {', '.join(bn['FusedBatchNormV3'])} "
                  f"({', '.join(bn['data_formats'])}); _FusedBatchNormEx inference: "
                  f"{', '.join(ex['inference']) or '-'}, training: "
                  f"{', '.join(ex['training']) or '-'}")
        for note in d["notes"]:
            print(f"  note: {note}")
        print()
    return 0


def _placement_run(args: argparse.Namespace) -> tuple[list[str], Any]:
    """The argv and the runner of ``tfmx placement``'s target."""
    import runpy
    import tempfile

    if args.target.endswith(".py"):
        if not os.path.isfile(args.target):
            raise SystemExit(f"tfmx placement: no script {args.target!r}")
        return [args.target, *args.args], lambda: runpy.run_path(args.target,
                                                               run_name="__main__")
    if args.target not in recipe_summaries():
        raise SystemExit(f"tfmx placement: {args.target!r} is neither a script (.py) nor a "
                         f"recipe; recipes: {', '.join(recipe_summaries())}")
    module = f"recipes.{args.target}"
    argv = [module, "--quick", "--tfmx-only", "--no-baseline", "--out",
            tempfile.mkdtemp(prefix="tfmx-placement-"), *args.args]
    return argv, lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)


def _placement(args: argparse.Namespace) -> int:
    """Run the target with every ``tfmx.enable()`` planning for the chosen metal backend (each
    plan records its step's stock form beside it); print the placement audits."""
    import dataclasses

    import tfmx
    from tfmx import state
    from tfmx.backends import get_backend
    from tfmx.reporting import Report

    try:
        backend = get_backend("metal", plugin=args.plugin, tensorflow=args.tensorflow)
    except ValueError as err:
        raise SystemExit(f"tfmx placement: {err}") from None
    argv, run = _placement_run(args)
    enable = tfmx.enable

    reports: list = []  # each enable() starts a report: the traces of all of them are audited

    def planned(*positional: Any, **options: Any) -> None:
        reports.append(state.report())
        options.pop("backend", None)
        options.pop("plugin", None)
        enable("metal", *positional[1:], plugin=args.plugin, **options)
        state.set_options(dataclasses.replace(state.options(), backend=backend))

    saved_argv = sys.argv
    tfmx.enable, sys.argv = planned, argv
    try:
        planned()
        run()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the plan raises at its first step
        if not isinstance(exc, tfmx.BackendUnavailableError):
            print(f"tfmx placement: {args.target} stopped: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
    finally:
        tfmx.enable, sys.argv = enable, saved_argv
        reports.append(state.report())
        tfmx.disable()
    report = Report(backend="metal", metal=backend)
    for seen in {id(r): r for r in reports}.values():
        report.traces += [t for t in seen.traces if t.backend == "metal"]
    audits = report.placement()
    if args.json:
        print(json.dumps(report.to_dict()["placement"], indent=2))
    else:
        print(f"tfmx placement of {args.target} for {backend.description}")
        print("\n".join(report.placement_lines()) if audits else
              "no training step was traced before the run stopped")
    return 1 if any(audit.moved for _, audit in audits) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tfmx`` console script; returns the exit status.

    Parsing (and ``--help``) does not import TensorFlow; the subcommands do, with TensorFlow's
    C++ info logs off unless ``TF_CPP_MIN_LOG_LEVEL`` is already set.

    >>> main(["backends"])  # doctest: +ELLIPSIS
    cpu: ...
    0
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # every argument after it, --help included, is the benchmark's
        return _bench(argv[1:])
    extra: list[str] = []
    if argv[:1] == ["placement"] and "--" in argv:  # the rest is the script's or recipe's
        extra, argv = argv[argv.index("--") + 1:], argv[:argv.index("--")]
    args = _parser().parse_args(argv)
    args.args = getattr(args, "args", None) or extra
    handler = {"recipe": _recipe, "backends": _backends, "tune": _tune,
               "placement": _placement}[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
