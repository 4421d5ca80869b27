"""The host allocator measured: each workload's step with malloc and with TensorFlow's pool.

With oneDNN off, TensorFlow allocates CPU tensors with malloc unless
``TF_CPU_ALLOCATOR_USE_BFC=1`` asks for its best-fit pool, which tfmx does before the first
op (:mod:`tfmx.host_allocator`). ``python -m bench.allocator --model NAME
[NAME ...]`` runs ``tfmx bench``'s measurement (:func:`bench.runner.run_benchmarks`, stock,
XLA and tfmx interleaved) twice per workload in the oneDNN off state, each in a process of
its own: once with TensorFlow's malloc (``TFMX_HOST_ALLOCATOR=keep``), once with the pool.
Every mode of a process runs with its allocator, so the table shows what the pool gives
stock, XLA and tfmx alike, and what tfmx in TensorFlow's default state (the pool) gives
over stock as a user runs it (malloc). ``--record [DIR]`` keeps one JSON record per
workload and processor (default ``bench/results/allocator/``); :func:`format_section` renders
them for BENCHMARKS.md.

Example:
    >>> row = summarize("mlp", {"malloc": {"stock": 10.0, "xla": 9.0, "tfmx": 8.0},
    ...                         "pool": {"stock": 8.0, "xla": 8.5, "tfmx": 6.0}})
    >>> row["pool/malloc"]["stock"], row["tfmx pool/stock malloc"]
    (0.8, 0.6)
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results" / "allocator"
SCHEMA = "tfmx-bench-allocator/1"
ALLOCATORS = {"malloc": {"TFMX_HOST_ALLOCATOR": "keep"}, "pool": {}}
"""Each allocator measured and the environment its process gets."""
MODES = ("stock", "xla", "tfmx")


def summarize(model: str, medians: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """One workload's row from its median step (ms) per allocator and mode: each mode's
    pool/malloc ratio, and tfmx with the pool over stock with malloc."""
    ratio = {mode: round(medians["pool"][mode] / medians["malloc"][mode], 3)
             for mode in MODES if medians["pool"].get(mode) and medians["malloc"].get(mode)}
    headline = None
    if medians["pool"].get("tfmx") and medians["malloc"].get("stock"):
        headline = round(medians["pool"]["tfmx"] / medians["malloc"]["stock"], 3)
    return {"model": model, "medians_ms": {a: dict(m) for a, m in medians.items()},
            "pool/malloc": ratio, "tfmx pool/stock malloc": headline}


def measure(model: str, rounds: int, steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``model`` measured with each allocator in the oneDNN off state: its row
    (:func:`summarize`, with each mode's p25-p75 spread) and the environment of the pool's
    process."""
    from bench.runner import run_benchmarks

    medians: dict[str, dict[str, float]] = {}
    spreads: dict[str, dict[str, list[float]]] = {}
    env: dict[str, Any] = {}
    for allocator, environ in ALLOCATORS.items():
        [result] = run_benchmarks([model], onednn="off", environ=environ, rounds=rounds,
                                  steps=steps, modes=list(MODES))
        ran = result["env"].get("host_allocator")
        if ran != allocator:
            raise RuntimeError(f"{model}: the {allocator} process ran with {ran}")
        medians[allocator] = {mode: result["modes"][mode]["median_ms"] for mode in MODES}
        spreads[allocator] = {mode: [result["modes"][mode]["p25_ms"],
                                     result["modes"][mode]["p75_ms"]] for mode in MODES}
        env = result["env"]
    return {**summarize(model, medians), "p25_p75_ms": spreads}, env


def write_record(row: Mapping[str, Any], env: Mapping[str, Any], command: str,
                 directory: str | Path = RESULTS_DIR) -> Path:
    """``row`` as a JSON record named by workload and processor (replacing an earlier one)."""
    from bench.records import processor_key

    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    processor = processor_key(env)
    path = folder / f"{row['model']}-{processor}.json" if processor else folder / (
        f"{row['model']}.json")
    path.write_text(json.dumps({"schema": SCHEMA, "command": command, "env": dict(env), **row},
                               indent=1, sort_keys=True) + "\n")
    return path


def load_records(directory: str | Path = RESULTS_DIR) -> list[dict[str, Any]]:
    """Every record of this benchmark in ``directory`` ([] if none)."""
    from bench.records import read_json_records

    return read_json_records(directory, lambda record: record.get("schema") == SCHEMA)


def attach_malloc(records: Sequence[dict[str, Any]],
                  allocator_records: Sequence[Mapping[str, Any]]) -> None:
    """Give each oneDNN-off step record measured with the pool (``bench.records``) the stock
    and XLA medians measured with malloc on the same processor (an allocator record), as the
    alternatives ``"off, malloc"`` of its result (:func:`bench.compare.compare`): what a user
    without tfmx runs in that state is a best alternative too.

    >>> step = {"onednn": "off", "result": {"model": "mlp", "env": {"host_allocator": "pool",
    ...         "cpu_vendor": "AuthenticAMD", "cpu_family": "25", "cpu_model": "1"}}}
    >>> alloc = {"model": "mlp", "env": step["result"]["env"],
    ...          "medians_ms": {"malloc": {"stock": 5.0, "xla": 6.0, "tfmx": 4.0}}}
    >>> attach_malloc([step], [alloc])
    >>> step["result"]["alternatives"]
    {'stock': {'off, malloc': 5.0}, 'xla': {'off, malloc': 6.0}}
    """
    from bench.records import processor_key

    malloc = {(r["model"], processor_key(r.get("env") or {})): r["medians_ms"]["malloc"]
              for r in allocator_records}
    for record in records:
        result = record.get("result") or {}
        env = result.get("env") or {}
        if record.get("onednn") != "off" or env.get("host_allocator") != "pool":
            continue
        found = malloc.get((result.get("model"), processor_key(env)))
        if found:
            result["alternatives"] = {mode: {"off, malloc": found[mode]}
                                      for mode in ("stock", "xla") if found.get(mode)}


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The markdown table of ``rows`` (:func:`summarize`).

    >>> print(format_table([summarize("mlp", {"malloc": {"stock": 10.0, "xla": 9.0,
    ...     "tfmx": 8.0}, "pool": {"stock": 8.0, "xla": 8.5, "tfmx": 6.0}})]))
    ... # doctest: +NORMALIZE_WHITESPACE
    | workload | stock malloc | stock pool | XLA malloc | XLA pool | tfmx malloc | tfmx pool |
      tfmx pool / stock malloc |
    |---|---:|---:|---:|---:|---:|---:|---:|
    | mlp | 10.00 | 8.00 (0.800) | 9.00 | 8.50 (0.944) | 8.00 | 6.00 (0.750) | 0.600 |
    """
    lines = ["| workload | stock malloc | stock pool | XLA malloc | XLA pool | tfmx malloc | "
             "tfmx pool | tfmx pool / stock malloc |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        cells = []
        for mode in MODES:
            malloc = row["medians_ms"]["malloc"].get(mode)
            pool = row["medians_ms"]["pool"].get(mode)
            ratio = row["pool/malloc"].get(mode)
            cells += ["-" if malloc is None else f"{malloc:.2f}",
                      "-" if pool is None else f"{pool:.2f}"
                      + ("" if ratio is None else f" ({ratio:.3f})")]
        head = row.get("tfmx pool/stock malloc")
        lines.append(f"| {row['model']} | " + " | ".join(cells)
                     + f" | {'-' if head is None else f'{head:.3f}'} |")
    return "\n".join(lines)


def format_section(records: Sequence[Mapping[str, Any]]) -> str:
    """BENCHMARKS.md's section of these records ("" without any): a table per machine."""
    if not records:
        return ""
    from bench.environment import by_machine, format_environment

    lines = ["## The host allocator: malloc or TensorFlow's pool (oneDNN off)", "",
             "Median milliseconds per training step, stock, XLA and tfmx interleaved in one "
             "process per allocator, oneDNN off in both: malloc is TensorFlow's allocator "
             "there, the pool the one `TF_CPU_ALLOCATOR_USE_BFC=1` asks for and "
             "`tfmx.enable()` sets before the first op (in parentheses: pool / malloc). The "
             "last column is tfmx as it runs in that state over stock as a user runs it. "
             "The tables above measure every mode with the pool in that state.", ""]
    for group in by_machine(records).values():
        commands = dict.fromkeys(record["command"] for record in group)
        lines += [format_environment(group[0]["env"]), "",
                  format_table(sorted(group, key=lambda r: r["model"])), "",
                  "Command: " + ", ".join(f"`{c}`" for c in commands), ""]
    return "\n".join(lines).rstrip()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.allocator``: measure, print the table, ``--record`` keeps it."""
    from bench.workloads import WORKLOADS

    parser = argparse.ArgumentParser(prog="python -m bench.allocator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", required=True, choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--record", nargs="?", const=str(RESULTS_DIR), default=None,
                        metavar="DIR", help="keep one JSON record per workload")
    args = parser.parse_args(argv)
    rows = []
    for model in args.model:
        row, env = measure(model, args.rounds, args.steps)
        rows.append(row)
        if args.record:
            command = shlex.join(["python", "-m", "bench.allocator", "--model", model,
                                  "--record"])
            print(f"recorded {write_record(row, env, command, args.record)}", file=sys.stderr)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
