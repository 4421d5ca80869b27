"""The ``tfmx bench`` command (also ``python -m bench``)::

    tfmx bench [--model M [M ...]] [--rounds N] [--steps N] [--batch-size B]
               [--modes stock tfmx xla] [--policy NAME] [--onednn on|off|both]
               [--replicas N] [--floor-steps N] [--output FILE.md] [--json [FILE.json]]
               [--record [DIR]]

``tfmx bench ...`` runs ``python -m bench ...`` in a process of its own (:mod:`tfmx.cli`: the
library never imports its benchmark). Parsing (and ``--help``) does not import TensorFlow.

Example:
    >>> from bench.cli import main
    >>> main(["--model", "no_such_model"])
    Traceback (most recent call last):
    ...
    SystemExit: 2
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence

from bench.floor import STEPS as FLOOR_STEPS
from bench.onednn import ONEDNN_CHOICES
from bench.records import RESULTS_DIR
from bench.workloads import GROUPS, MODES, OPTIMIZERS, WORKLOADS, expand_models


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
    parser = argparse.ArgumentParser(
        prog="tfmx bench",
        description="Time one training step stock, with tfmx and with XLA (jit_compile=True), "
                    "interleaved in one process (with --onednn: one process per oneDNN "
                    "state), warm-up excluded; print a markdown table with the fastest "
                    "alternative to tfmx.",
    )
    parser.add_argument("--model", nargs="+", default=["small_cnn"],
                        choices=sorted(WORKLOADS) + sorted(GROUPS), metavar="M",
                        help=f"workload(s): {', '.join(WORKLOADS)}, or a group of them: "
                             f"{', '.join(GROUPS)} (default small_cnn)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds (default: per workload)")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per mode per round (default: per workload)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="batch size (default: per workload)")
    parser.add_argument("--modes", nargs="+", default=None, choices=MODES, metavar="MODE",
                        help="modes to run (default: stock tfmx xla; with --replicas N > 1: "
                             "stock tfmx)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per mode (default 2)")
    parser.add_argument("--backend", default=None, help="tfmx backend (default: detect)")
    parser.add_argument("--optimizer", default="adam", choices=OPTIMIZERS,
                        help="optimizer of the benchmarked model (default adam)")
    parser.add_argument("--policy", default=None,
                        help="build the non-stock modes under this policies name (float32, "
                             "mixed_float16, mixed_bfloat16, auto); stock stays float32")
    parser.add_argument("--onednn", default=None, choices=ONEDNN_CHOICES,
                        help="run each oneDNN state in a process of its own with "
                             "TF_ENABLE_ONEDNN_OPTS=1 (on) or =0 (off), or both, and compare "
                             "against the fastest of stock and XLA in any state (default: "
                             "this process, in its current state)")
    parser.add_argument("--replicas", type=_replicas, default=1, metavar="N",
                        help="split the CPU into N logical devices and build every mode's model "
                             "in a MirroredStrategy over them (global batch unchanged: batch / "
                             "N per replica); N > 1 also measures 1 replica, interleaved, and "
                             "compares tfmx / stock between them (default 1: no strategy)")
    parser.add_argument("--floor-steps", type=int, default=FLOOR_STEPS, metavar="N",
                        help="after the rounds, profile N calls of stock's step for its "
                             "contraction floor: the time its MatMul/BatchMatMul/Conv2D/Einsum "
                             f"kernels take (bench.floor); 0: none (default {FLOOR_STEPS})")
    parser.add_argument("--output", metavar="FILE.md", default=None,
                        help="also append the table to this markdown file (created if missing)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE.json",
                        help="save the raw results and the comparison as JSON to FILE.json "
                             "(without FILE: print them after the table)")
    parser.add_argument("--record", nargs="?", const=str(RESULTS_DIR), default=None,
                        metavar="DIR",
                        help="keep each result as a JSON record, one file per workload and "
                             "oneDNN state, with this command (default folder bench/results/; "
                             "python -m bench.tables --markdown writes BENCHMARKS.md from them)")
    return parser


def _bench(args: argparse.Namespace, command: str = "tfmx bench") -> int:
    from bench import runner
    from bench.compare import results_document
    from bench.replicas import check_replicas, replica_modes
    from bench.tables import format_markdown

    modes = list(args.modes or replica_modes(args.replicas))
    try:  # before anything runs: what cannot run under --replicas, and what to do
        check_replicas(args.replicas, modes, args.policy,
                       {m: args.batch_size or WORKLOADS[m].batch_size
                        for m in expand_models(args.model)})
    except ValueError as err:
        raise SystemExit(f"tfmx bench: {err}") from None
    try:
        results = runner.run_benchmarks(
            args.model, onednn=args.onednn, rounds=args.rounds, steps=args.steps,
            modes=modes, batch_size=args.batch_size, warmup=args.warmup,
            backend=args.backend, optimizer=args.optimizer, policy=args.policy,
            replicas=args.replicas, floor_steps=args.floor_steps,
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
    if args.record:
        from bench.records import write_records

        for path in write_records(results, command, args.record):
            print(f"recorded {path}", file=sys.stderr)
    if args.output:
        existing = os.path.exists(args.output) and os.path.getsize(args.output) > 0
        with open(args.output, "a") as f:
            f.write(("\n" if existing else "") + table)
        print(f"{'appended to' if existing else 'wrote'} {args.output}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m bench`` (and of ``tfmx bench``); returns the exit status.

    Parsing (and ``--help``) does not import TensorFlow; measuring does, with TensorFlow's C++
    info logs off unless ``TF_CPP_MIN_LOG_LEVEL`` is already set.

    >>> main(["--replicas", "2", "--modes", "stock", "xla"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    SystemExit: tfmx bench: the xla mode cannot run with replicas > 1: ...
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    return _bench(args, shlex.join(["tfmx", "bench", *argv]))
