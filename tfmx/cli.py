"""The ``tfmx`` command (also ``python -m tfmx``).

Subcommands::

    tfmx bench [--model M [M ...]] [--rounds N] [--steps N] [--batch-size B]
               [--modes stock tfmx xla] [--policy NAME] [--onednn on|off|both]
               [--replicas N] [--output FILE.md] [--json [FILE.json]]
    tfmx recipe NAME [recipe args...]      # e.g. tfmx recipe small_cnn --quick
    tfmx recipe --list                     # the recipes and what each shows
    tfmx backends [--json]                 # what each backend fuses
    tfmx tune [--export F | --import F [--force] | --clear]   # this machine's tuning cache

Only the subcommands import TensorFlow, so ``tfmx --help`` answers at once.

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


def _replicas(text: str) -> int:
    """``--replicas``'s value: an integer >= 1, else argparse's error saying so."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a replica count: pass an integer >= 1 (1: one device, no "
            f"strategy; 2: a MirroredStrategy over 2 logical CPUs)")
    return value


def _parser() -> argparse.ArgumentParser:
    from tfmx.bench import GROUPS, MODES, ONEDNN_CHOICES, WORKLOADS

    parser = argparse.ArgumentParser(
        prog="tfmx", description="tfmx: graph-rewrite fusion for Keras 3 on TensorFlow."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    bench = sub.add_parser(
        "bench", help="time stock vs tfmx vs XLA training steps, interleaved",
        description="Time one training step stock, with tfmx and with XLA (jit_compile=True), "
                    "interleaved in one process (with --onednn: one process per oneDNN "
                    "state), warm-up excluded; print a markdown table with the fastest "
                    "alternative to tfmx.",
    )
    bench.add_argument("--model", nargs="+", default=["small_cnn"],
                       choices=sorted(WORKLOADS) + sorted(GROUPS), metavar="M",
                       help=f"workload(s): {', '.join(WORKLOADS)}, or a group of them: "
                            f"{', '.join(GROUPS)} (default small_cnn)")
    bench.add_argument("--rounds", type=int, default=None,
                       help="interleaved rounds (default: per workload)")
    bench.add_argument("--steps", type=int, default=None,
                       help="steps per mode per round (default: per workload)")
    bench.add_argument("--batch-size", type=int, default=None,
                       help="batch size (default: per workload)")
    bench.add_argument("--modes", nargs="+", default=None, choices=MODES, metavar="MODE",
                       help="modes to run (default: stock tfmx xla; with --replicas N > 1: "
                            "stock tfmx)")
    bench.add_argument("--warmup", type=int, default=2, help="untimed calls per mode (default 2)")
    bench.add_argument("--backend", default=None, help="tfmx backend (default: detect)")
    bench.add_argument("--optimizer", default="adam",
                       choices=("adam", "adamw", "sgd", "rmsprop"),
                       help="optimizer of the benchmarked model (default adam)")
    bench.add_argument("--policy", default=None,
                       help="build the non-stock modes under this policies name (float32, "
                            "mixed_float16, mixed_bfloat16, auto); stock stays float32")
    bench.add_argument("--onednn", default=None, choices=ONEDNN_CHOICES,
                       help="run each oneDNN state in a process of its own with "
                            "TF_ENABLE_ONEDNN_OPTS=1 (on) or =0 (off), or both, and compare "
                            "against the fastest of stock and XLA in any state (default: "
                            "this process, in its current state)")
    bench.add_argument("--replicas", type=_replicas, default=1, metavar="N",
                       help="split the CPU into N logical devices and build every mode's model "
                            "in a MirroredStrategy over them (global batch unchanged: batch / "
                            "N per replica); N > 1 also measures 1 replica, interleaved, and "
                            "compares tfmx / stock between them (default 1: no strategy)")
    bench.add_argument("--output", metavar="FILE.md", default=None,
                       help="also append the table to this markdown file (created if missing)")
    bench.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE.json",
                       help="save the raw results and the comparison as JSON to FILE.json "
                            "(without FILE: print them after the table)")

    recipe = sub.add_parser(
        "recipe", help="run a training recipe: tfmx recipe NAME [args...]",
        description="Run recipes.NAME's main with the remaining arguments.",
    )
    recipe.add_argument("--list", action="store_true",
                        help="list the recipes and what each shows, then exit")
    recipe.add_argument("name", nargs="?", help="recipe name (tfmx recipe --list)")
    recipe.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the recipe")

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
        existed = cache.path.exists()
        cache.path.unlink(missing_ok=True)
        print(f"{'removed' if existed else 'no cache at'} {cache.path}")
    else:
        contents = cache.contents()
        print(f"cache: {cache.path} ({'present' if cache.path.exists() else 'empty'})")
        print(f"machine: {json.dumps(contents['fingerprint'], sort_keys=True)}")
        for key, d in sorted(contents["decisions"].items()):
            times = ", ".join(f"{n} {t:.3f} ms" for n, t in d.get("times_ms", {}).items())
            print(f"  {key}: {d.get('choice')}  ({times})")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from tfmx.bench import (
        WORKLOADS,
        check_replicas,
        expand_models,
        format_markdown,
        replica_modes,
        results_document,
        run_benchmarks,
    )

    modes = list(args.modes or replica_modes(args.replicas))
    try:  # before anything runs: what cannot run under --replicas, and what to do
        check_replicas(args.replicas, modes, args.policy,
                       {m: args.batch_size or WORKLOADS[m].batch_size
                        for m in expand_models(args.model)})
    except ValueError as err:
        raise SystemExit(f"tfmx bench: {err}") from None
    try:
        results = run_benchmarks(
            args.model, onednn=args.onednn, rounds=args.rounds, steps=args.steps,
            modes=modes, batch_size=args.batch_size, warmup=args.warmup,
            backend=args.backend, optimizer=args.optimizer, policy=args.policy,
            replicas=args.replicas,
        )
    except RuntimeError as err:  # a oneDNN state's process failed (it printed why), or the
        # CPU could not be split into logical devices
        raise SystemExit(str(err)) from None
    table = format_markdown(results)
    print(table)
    if args.json:
        document = json.dumps(results_document(results, args.onednn), indent=2, default=str)
        if args.json == "-":
            print(document)
        else:
            with open(args.json, "w") as f:
                f.write(document + "\n")
            print(f"wrote {args.json}", file=sys.stderr)
    if args.output:
        existing = os.path.exists(args.output) and os.path.getsize(args.output) > 0
        with open(args.output, "a") as f:
            f.write(("\n" if existing else "") + table)
        print(f"{'appended to' if existing else 'wrote'} {args.output}", file=sys.stderr)
    return 0


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

    described = [get_backend(name).describe() for name in BACKEND_NAMES]
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tfmx`` console script; returns the exit status.

    Parsing (and ``--help``) does not import TensorFlow; the subcommands do, with TensorFlow's
    C++ info logs off unless ``TF_CPP_MIN_LOG_LEVEL`` is already set.

    >>> main(["backends"])  # doctest: +ELLIPSIS
    cpu: ...
    0
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    handler = {"bench": _bench, "recipe": _recipe, "backends": _backends,
               "tune": _tune}[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
