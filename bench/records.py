"""Benchmark records: ``tfmx bench --record`` keeps each result as one JSON file.

One file per workload (model, optimizer, batch, policy, replicas), oneDNN state and processor
under ``bench/results/`` (:data:`RESULTS_DIR`); a new measurement of the same workload and state
on the same processor replaces its file, so the folder holds each processor's current figures
only. A record holds the command that measured it (and, as ``reproduce``, the same command for
its workload alone), the
machine (processor and its flags, cores, oneDNN state and how it was set, TensorFlow, Keras
and Python versions), per mode the median ms/step and the p25-p75 spread, the ratios
tfmx/stock and tfmx/best alternative (the fastest of stock and XLA in any oneDNN state of the
same run, :func:`bench.compare.compare`), where measured stock's contraction floor
(:mod:`bench.floor`) and tfmx/floor, and the full result it came from.
``python -m bench.tables --markdown`` (:mod:`bench.publish`) writes BENCHMARKS.md from these
files only.

Example:
    >>> import tempfile
    >>> from bench.records import load_records, write_records
    >>> result = {"model": "mlp", "optimizer": "adam", "batch_size": 32,
    ...           "env": {"onednn": True, "cpu": "cpu"},
    ...           "modes": {m: {"median_ms": v, "p25_ms": v, "p75_ms": v}
    ...                     for m, v in (("stock", 4.0), ("tfmx", 3.0))}}
    >>> folder = tempfile.mkdtemp()
    >>> [p.name for p in write_records([result], "tfmx bench --model mlp --record", folder)]
    ['mlp-adam-batch32-onednn-on.json']
    >>> record, = load_records(folder)
    >>> record["ratios"]["tfmx/stock"], record["command"]
    (0.75, 'tfmx bench --model mlp --record')
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from bench.compare import compare
from bench.onednn import onednn_state

RESULTS_DIR = Path(__file__).resolve().parent / "results"
"""Where ``tfmx bench --record`` writes and ``python -m bench.tables --markdown`` reads."""

SCHEMA = 1
"""The records' layout; a record of another layout is not read (:func:`load_records`)."""

ENV_KEYS = ("date", "cpu", "cpu_vendor", "cpu_family", "cpu_model", "cpu_flags", "cpu_count",
            "onednn", "onednn_env", "host_allocator", "tensorflow", "keras", "python", "platform",
            "gpus")
TIMING_KEYS = ("median_ms", "p25_ms", "p75_ms", "min_ms", "first_call_s")


def processor_key(env: Mapping[str, Any]) -> str:
    """A short name of the processor ``env`` (a record's machine) was measured on: its vendor,
    family and model; "" where the machine did not say.

    >>> processor_key({"cpu_vendor": "AuthenticAMD", "cpu_family": "25", "cpu_model": "17"})
    'amd-f25-m17'
    >>> processor_key({"cpu": "cpu"})
    ''
    """
    family, model = env.get("cpu_family"), env.get("cpu_model")
    if family in (None, "") or model in (None, ""):
        return ""
    vendor = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(
        str(env.get("cpu_vendor") or ""), str(env.get("cpu_vendor") or "cpu").lower())
    return f"{vendor}-f{family}-m{model}"


def record_name(result: Mapping[str, Any]) -> str:
    """The file name of ``result``'s record: its workload, oneDNN state and processor
    (:func:`processor_key`, where known).

    >>> record_name({"model": "gru", "optimizer": "adamw", "batch_size": 64,
    ...              "policy": "mixed_bfloat16", "replicas": 2, "env": {"onednn": False}})
    'gru-adamw-batch64-mixed_bfloat16-2replicas-onednn-off.json'
    >>> record_name({"model": "mlp", "batch_size": 32, "env": {
    ...     "onednn": True, "cpu_vendor": "GenuineIntel", "cpu_family": "6", "cpu_model": "207"}})
    'mlp-adam-batch32-onednn-on-intel-f6-m207.json'
    """
    parts = [result["model"], result.get("optimizer") or "adam"]
    if result.get("batch_size"):
        parts.append(f"batch{result['batch_size']}")
    if result.get("policy"):
        parts.append(str(result["policy"]))
    if (result.get("replicas") or 1) > 1:
        parts.append(f"{result['replicas']}replicas")
    state = onednn_state(result)
    parts.append("onednn-" + ("unknown" if state == "?" else state))
    processor = processor_key(result.get("env") or {})
    if processor:
        parts.append(processor)
    return re.sub(r"[^\w.-]+", "_", "-".join(str(p) for p in parts)) + ".json"


def narrow_command(command: str, model: str | None = None) -> str:
    """``command`` (a ``tfmx bench`` command line) as a record shows it: a ``--record`` folder
    dropped (the record is reproduced into the project's own, the default) and, given
    ``model``, measuring that workload alone: its ``--model`` list replaced by it (added where
    the command had none).

    >>> narrow_command("tfmx bench --model mlp gru --onednn both --record", "gru")
    'tfmx bench --model gru --onednn both --record'
    >>> narrow_command("tfmx bench --rounds 3", "small_cnn")
    'tfmx bench --rounds 3 --model small_cnn'
    >>> narrow_command("tfmx bench --model mlp gru --record /scratch/rec --rounds 3")
    'tfmx bench --model mlp gru --record --rounds 3'
    """
    out: list[str] = []
    skipping, found = False, False
    for word in shlex.split(command):
        if skipping and not word.startswith("-"):
            continue
        skipping = False
        if model is not None and (word == "--model" or word.startswith("--model=")):
            out += ["--model", model]
            skipping, found = word == "--model", True
            continue
        if word == "--record" or word.startswith("--record="):
            out.append("--record")
            skipping = word == "--record"
            continue
        out.append(word)
    return shlex.join(out if found or model is None else [*out, "--model", model])


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def make_record(result: Mapping[str, Any], row: Mapping[str, Any] | None, command: str
                ) -> dict[str, Any]:
    """``result`` (one :func:`bench.runner.run_benchmark` result) as a record; ``row`` is its
    workload's :func:`bench.compare.compare` row (the best alternative over the run's states).

    >>> r = {"model": "mlp", "env": {"onednn": False},
    ...      "modes": {"stock": {"median_ms": 2.0}, "xla": {"median_ms": 1.0},
    ...                "tfmx": {"median_ms": 1.5}}}
    >>> row, = compare([r])
    >>> rec = make_record(r, row, "tfmx bench --model mlp")
    >>> rec["onednn"], rec["ratios"]
    ('off', {'tfmx/stock': 0.75, 'tfmx/best_alternative': 1.5})
    >>> rec["best_alternative"]
    {'ms': 1.0, 'mode': 'xla', 'onednn': 'off'}
    """
    modes = {mode: {k: t[k] for k in TIMING_KEYS if k in t}
             for mode, t in result.get("modes", {}).items()}
    median = {mode: t.get("median_ms") for mode, t in modes.items()}
    best = row.get("best_alternative") if row else None
    floor = result.get("floor") or {}
    over_floor = (floor.get("ratios") or {}).get("tfmx/floor")  # bench.floor.floor_ratios
    return {
        "schema": SCHEMA,
        "command": narrow_command(command) if command else "",
        "reproduce": narrow_command(command, result["model"]) if command else "",
        "workload": {k: result.get(k) for k in ("model", "description", "optimizer",
                                                "batch_size", "policy", "replicas", "rounds",
                                                "steps", "warmup")},
        "onednn": onednn_state(result),
        "isolated": bool(result.get("isolated")),
        "env": {k: (result.get("env") or {}).get(k) for k in ENV_KEYS},
        "modes": modes,
        "ratios": {"tfmx/stock": _ratio(median.get("tfmx"), median.get("stock")),
                   "tfmx/best_alternative": _ratio(median.get("tfmx"),
                                                   best["ms"] if best else None),
                   **({"tfmx/floor": over_floor} if over_floor is not None else {})},
        "best_alternative": best,
        **({"floor": floor} if floor else {}),
        "result": dict(result),
    }


def write_records(results: Iterable[Mapping[str, Any]], command: str,
                  directory: str | Path | None = None) -> list[Path]:
    """Write one record per result (:func:`make_record`, :func:`record_name`) into
    ``directory`` (default :data:`RESULTS_DIR`, created if missing), replacing the files of
    the same workload and state measured on the same processor; the paths written, in order."""
    results = list(results)
    folder = Path(directory) if directory is not None else RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    rows = {(r["model"], r.get("optimizer", "adam"), r.get("policy"), r.get("batch_size"),
             r.get("replicas", 1)): r for r in compare(results)}
    written = []
    for result in results:
        key = (result["model"], result.get("optimizer", "adam"), result.get("policy"),
               result.get("batch_size"), result.get("replicas", 1))
        record = make_record(result, rows.get(key), command)
        path = folder / record_name(result)
        path.write_text(json.dumps(record, indent=1, default=str) + "\n")
        written.append(path)
    return written


def load_records(directory: str | Path | None = None) -> list[dict[str, Any]]:
    """Every record in ``directory`` (default :data:`RESULTS_DIR`), by file name; files of
    another layout (:data:`SCHEMA`) or not JSON are left out. [] if there is no folder.

    >>> load_records("/no/such/folder")
    []
    """
    return read_json_records(directory if directory is not None else RESULTS_DIR,
                             lambda record: record.get("schema") == SCHEMA)


def read_json_records(directory: str | Path,
                      accept: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    """The JSON objects of ``directory``'s ``*.json`` files, by file name, that ``accept``
    takes; files that cannot be read or parsed, or hold no object, are left out. [] if there
    is no folder.

    >>> read_json_records("/no/such/folder", lambda record: True)
    []
    """
    folder = Path(directory)
    records = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and accept(record):
            records.append(record)
    return records
