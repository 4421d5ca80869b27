"""BENCHMARKS.md and the README's benchmark table, written from the records alone.

``python -m bench.tables --markdown`` (or ``python -m bench.publish --markdown``) reads every
record under ``bench/results/`` (:func:`bench.records.load_records`, written by
``tfmx bench ... --record``) and writes:

- BENCHMARKS.md (:func:`format_benchmarks`): how to reproduce a row, how to read the tables,
  the targets per machine (:mod:`bench.targets`: each target, the rows that meet it, each row
  that misses it with the gap and what holds the time), then per machine (processor, cores,
  flags, TensorFlow and Keras) one row per workload and oneDNN state: each mode's median
  ms/step with its p25-p75 spread, tfmx / stock, the best alternative and tfmx / best
  alternative; where recorded, the contraction floor
  (:mod:`bench.floor`) and each mode's step over it; then the command that measured each row;
  then the sections of the records kept in subfolders (:func:`extra_sections`): the price of a
  short fit (``python -m bench.fit_price --record``) and what tfmx leaves composite in the zoo
  models (``python -m bench.composite --record``).
- The README's small table (:func:`format_readme_table`), between the lines
  ``<!-- bench-table:start -->`` and ``<!-- bench-table:end -->``, only where both exist
  (:func:`replace_between_markers`); nothing else of the README is touched.

With no record it writes nothing and says which command makes one. Without ``--markdown`` it
prints BENCHMARKS.md's text.

Example:
    >>> from bench.publish import format_readme_table
    >>> print(format_readme_table([]))
    No benchmark recorded yet: `tfmx bench --model mlp --onednn both --record`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import allocator
from bench.compare import compare
from bench.environment import by_machine, default_onednn
from bench.floor import format_record_floors
from bench.records import RESULTS_DIR, load_records
from bench.targets import targets_section

ROOT = Path(__file__).resolve().parents[1]
START = "<!-- bench-table:start -->"
END = "<!-- bench-table:end -->"
LABELS = {"stock": "stock", "xla": "XLA", "tfmx": "tfmx"}
EXAMPLE = "tfmx bench --model mlp --onednn both --record"

HEADER = """# Benchmarks

Written by `python -m bench.tables --markdown` from the records in `bench/results/` (one JSON
file per workload and oneDNN state), not by hand. To measure a row again, run its command
(last table of its machine's section) on a quiet machine: it replaces that row's record.
Then run `python -m bench.tables --markdown` again to rewrite this file and the README's
table. A record keeps the full result it came from (every round, the rewrite, the guard's
trial).

How to read the tables: median milliseconds per training step over interleaved rounds, the
warm-up (tracing, rewriting, compiling) excluded, with the p25-p75 spread of the rounds in
parentheses. stock: Keras's own step; XLA: the step with `jit_compile=True`; tfmx: the step
after `tfmx.enable()`. tfmx / stock: tfmx's median over stock's, both measured in the same
process. A oneDNN cell "off (pool)": every mode of that record ran with TensorFlow's best-fit
pool for CPU tensors, as tfmx sets it where oneDNN is off; stock and XLA with
TensorFlow's malloc, measured by the host-allocator records ("The host allocator" below),
count as alternatives too ("off, malloc"). Best alternative: the
fastest of stock and XLA in any oneDNN state (and allocator) recorded for the workload on that
machine; tfmx / best below 1: tfmx is faster than anything else measured."""


def _workload(result: Mapping[str, Any]) -> str:
    what = [result.get("optimizer") or "adam"]
    what += [f"batch {result['batch_size']}"] if result.get("batch_size") else []
    what += [f"policy {result['policy']}"] if result.get("policy") else []
    n = result.get("replicas") or 1
    what += [f"{n} replicas"] if n > 1 else []
    return f"{result['model']} ({', '.join(what)})"


def _timing(t: Mapping[str, Any] | None) -> str:
    if not t or t.get("median_ms") is None:
        return "-"
    spread = (f" ({t['p25_ms']:.2f}-{t['p75_ms']:.2f})"
              if t.get("p25_ms") is not None and t.get("p75_ms") is not None else "")
    return f"{t['median_ms']:.2f}{spread}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _suffix(state: str) -> str:
    return "" if state in ("?", None) else f" {state}"


def _state(state: str) -> str:
    return "-" if state in ("?", None) else state


def _state_cell(record: Mapping[str, Any]) -> str:
    """A record's oneDNN cell: its state, ``off (pool)`` where oneDNN was off and its modes
    ran with TensorFlow's best-fit pool (``tfmx.host_allocator``).

    >>> _state_cell({"onednn": "off", "env": {"host_allocator": "pool"}})
    'off (pool)'
    """
    state = record.get("onednn", "?")
    pool = (record.get("env") or {}).get("host_allocator") == "pool"
    return f"{_state(state)} (pool)" if state == "off" and pool else _state(state)


def _rows(records: Sequence[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], dict]]:
    """Each record with its workload's :func:`bench.compare.compare` row over the records of
    the same machine (the best alternative in any state recorded)."""
    order = {"on": 0, "off": 1}
    first: dict[str, int] = {}
    for r in records:
        first.setdefault(_workload(r["result"]), len(first))
    records = sorted(records, key=lambda r: (first[_workload(r["result"])],
                                             order.get(r.get("onednn"), 2)))
    results = [r["result"] for r in records]
    rows = {(c["model"], c["optimizer"], c["policy"], c["batch_size"], c["replicas"]): c
            for c in compare(results)}
    out = []
    for record in records:
        r = record["result"]
        key = (r["model"], r.get("optimizer", "adam"), r.get("policy"), r.get("batch_size"),
               r.get("replicas", 1))
        out.append((record, rows[key]))
    return out


def format_machine(title: str, records: Sequence[Mapping[str, Any]]) -> str:
    """One machine's section of BENCHMARKS.md: the figures, the contraction floors where
    recorded (:func:`bench.floor.format_record_floors`), then the commands."""
    modes = [m for m in ("stock", "xla", "tfmx") if any(m in r["modes"] for r in records)]
    header = (["workload", "oneDNN"] + [f"{LABELS[m]} ms" for m in modes]
              + ["tfmx / stock", "best alternative", "tfmx / best"])
    lines = [f"## {title}", "",
             "| " + " | ".join(header) + " |",
             "|---|---|" + "---:|" * len(modes) + "---:|---|---:|"]
    commands = ["", "| workload | oneDNN | measured | command |", "|---|---|---|---|"]
    for record, row in _rows(records):
        state = record.get("onednn", "?")
        best = row["best_alternative"]
        best_s = (f"{best['ms']:.2f} {LABELS[best['mode']]}"
                  + ("" if best["onednn"] == "?" else f" ({best['onednn']})")) if best else "-"
        vs_best = row["tfmx_vs_best_alternative"].get(state)
        cells = [_workload(record["result"]), _state_cell(record)]
        cells += [_timing(record["modes"].get(m)) for m in modes]
        cells += [_ratio(record["ratios"].get("tfmx/stock")), best_s, _ratio(vs_best)]
        lines.append("| " + " | ".join(cells) + " |")
        date = (record.get("env") or {}).get("date") or "-"
        commands.append(f"| {_workload(record['result'])} | {_state_cell(record)} | {date} | "
                        f"`{record.get('reproduce') or record.get('command', '-')}` |")
    return "\n".join(lines + format_record_floors(records, _workload) + commands)


def format_benchmarks(records: Sequence[Mapping[str, Any]], extras: Sequence[str] = (),
                      targets: str = "") -> str:
    """BENCHMARKS.md's text from ``records`` (:func:`bench.records.load_records`): the
    ``targets`` section (:func:`bench.targets.targets_section`) after the header where not
    empty, the machines' sections, then the ``extras`` sections (:func:`extra_sections`) that
    are not empty.

    >>> text = format_benchmarks([])
    >>> text.splitlines()[0], "No benchmark recorded yet" in text
    ('# Benchmarks', True)
    """
    if not records:
        return f"{HEADER}\n\nNo benchmark recorded yet: `{EXAMPLE}`.\n"
    sections = [targets.strip()] if targets and targets.strip() else []
    sections += [format_machine(title, group) for title, group in by_machine(records).items()]
    sections += [extra.strip() for extra in extras if extra and extra.strip()]
    return HEADER + "\n\n" + "\n\n".join(sections) + "\n"


def extra_sections(results: str | Path | None = None) -> list[str]:
    """BENCHMARKS.md's sections from the records kept beside the step records, in subfolders
    of ``results`` (default :data:`bench.records.RESULTS_DIR`): the price of a short fit
    (``fit_price/``, :mod:`bench.fit_price`), the one-minute fit (``fit_price/minute/``,
    :mod:`bench.minute_fit`), what tfmx leaves composite in the zoo models
    (``composite/``, :mod:`bench.composite`), the host allocator (``allocator/``,
    :mod:`bench.allocator`) and small models' epochs (``loop/``, :mod:`bench.loop`); ""
    where none is recorded.

    >>> extra_sections("/no/such/folder")
    ['', '', '', '', '']
    """
    from bench import allocator, composite, fit_price, loop, minute_fit

    folder = Path(results) if results is not None else RESULTS_DIR
    return [fit_price.format_fit_price_section(fit_price.load_fit_prices(folder / "fit_price")),
            minute_fit.format_minute_section(
                minute_fit.load_minute_fits(folder / "fit_price" / "minute")),
            composite.format_composite(composite.load_composite(folder / "composite")),
            allocator.format_section(allocator.load_records(folder / "allocator")),
            loop.format_loop_section(loop.load_records(folder / "loop"))]


def _vs_best(row: Mapping[str, Any], state: str) -> str:
    """tfmx / best alternative in ``state`` of a :func:`bench.compare.compare` row, the best
    alternative named."""
    value = row["tfmx_vs_best_alternative"].get(state)
    best = row["best_alternative"]
    named = (f" ({LABELS[best['mode']]}{_suffix(best['onednn'])})"
             if best and value is not None else "")
    return f"{_ratio(value)}{named}"


def _processor(env: Mapping[str, Any]) -> str:
    """The processor a record ran on, as the README's table names it: its name, with its
    family and model where recorded (two processors of one name differ there).

    >>> _processor({"cpu": "AMD EPYC", "cpu_family": "25", "cpu_model": "1"})
    'AMD EPYC (family 25, model 1)'
    >>> _processor({})
    'unknown'
    """
    name = env.get("cpu") or "unknown"
    if env.get("cpu_family") and env.get("cpu_model"):
        return f"{name} (family {env['cpu_family']}, model {env['cpu_model']})"
    return name


def format_readme_table(records: Sequence[Mapping[str, Any]]) -> str:
    """The README's table: per machine and workload, in TensorFlow's default oneDNN state on
    that machine (:func:`bench.environment.default_onednn`), tfmx / stock and tfmx / best
    alternative, then tfmx / best alternative in the other state as a column of its own; a
    line on how to switch the state and where the figures come from.

    >>> print(format_readme_table([]))
    No benchmark recorded yet: `tfmx bench --model mlp --onednn both --record`.
    """
    if not records:
        return f"No benchmark recorded yet: `{EXAMPLE}`."
    lines = ["| workload | processor | oneDNN by default | tfmx / stock | "
             "tfmx / best alternative | other oneDNN state: tfmx / best alternative |",
             "|---|---|---|---:|---:|---:|"]
    for group in by_machine(records).values():
        by_row: dict[int, tuple[dict, dict[str, Mapping[str, Any]]]] = {}
        for record, row in _rows(group):
            by_row.setdefault(id(row), (row, {}))[1][record.get("onednn", "?")] = record
        for row, states in by_row.values():
            first = next(iter(states.values()))
            env = first.get("env") or {}
            default = default_onednn(env)
            other = {"on": "off", "off": "on"}.get(default, "?")
            here = states.get(default)
            stock = _ratio(here["ratios"].get("tfmx/stock")) if here else "-"
            other_cell = (f"{other}: {_vs_best(row, other)}" if other in states else "-")
            lines.append(f"| {_workload(first['result'])} | {_processor(env)} | "
                         f"{_state(default)} | {stock} | "
                         f"{_vs_best(row, default) if here else '-'} | {other_cell} |")
    lines += ["", "Ratios of median step times (below 1: tfmx faster) in TensorFlow's default "
              "oneDNN state on the machine measured, the state a user runs unless they switch "
              "it; the best alternative is the fastest of stock and XLA in either oneDNN state. "
              "To switch: `TF_ENABLE_ONEDNN_OPTS=0` (or `=1`) in the environment before Python "
              "starts; TensorFlow reads it once per process. Where oneDNN is off, stock, XLA "
              "and tfmx ran with TensorFlow's best-fit pool for CPU tensors (`pool`: "
              "tfmx sets it there; without tfmx, `TF_CPU_ALLOCATOR_USE_BFC=1`), "
              "and stock and XLA with malloc count as alternatives too; tfmx against stock "
              "with malloc, as a user runs it: BENCHMARKS.md, The host allocator. "
              "Measured on: "
              + "; ".join(by_machine(records)) + "."
              + " Written by `python -m bench.tables --markdown` from `bench/results/`; "
              "every figure and the command that measured it: BENCHMARKS.md."]
    return "\n".join(lines)


def replace_between_markers(text: str, table: str) -> str | None:
    """``text`` with what lies between :data:`START` and :data:`END` replaced by ``table``;
    None where either marker is missing or they are out of order.

    >>> print(replace_between_markers("a\\n<!-- bench-table:start -->\\nold\\n"
    ...                               "<!-- bench-table:end -->\\nb", "new"))
    a
    <!-- bench-table:start -->
    new
    <!-- bench-table:end -->
    b
    >>> replace_between_markers("no markers", "new") is None
    True
    """
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        return None
    return text[:start + len(START)] + "\n" + table.strip("\n") + "\n" + text[end:]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tables",
        description="Write BENCHMARKS.md and the README's benchmark table from the records "
                    "under bench/results/ (tfmx bench ... --record).")
    parser.add_argument("--markdown", action="store_true",
                        help="write BENCHMARKS.md and the README's table (default: print "
                             "BENCHMARKS.md's text)")
    parser.add_argument("--results", default=str(RESULTS_DIR), metavar="DIR",
                        help="the records' folder (default bench/results/)")
    parser.add_argument("--benchmarks", default=str(ROOT / "BENCHMARKS.md"), metavar="FILE",
                        help="the file to write (default BENCHMARKS.md beside bench/)")
    parser.add_argument("--readme", default=str(ROOT / "README.md"), metavar="FILE",
                        help="the README whose bench-table markers get the small table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.tables [--markdown] [--results DIR] [--benchmarks FILE]
    [--readme FILE]``; returns the exit status (1: no record, nothing written).

    >>> main(["--markdown", "--results", "/no/such/folder"])
    1
    """
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    records = load_records(args.results)
    allocator.attach_malloc(records, allocator.load_records(
        Path(args.results if args.results is not None else RESULTS_DIR) / "allocator"))
    benchmarks = format_benchmarks(records, extra_sections(args.results),
                                   targets_section(records, args.results, _workload))
    if not args.markdown:
        print(benchmarks, end="")
        return 0
    if not records:
        print(f"bench.tables: no record in {args.results}; make some with `{EXAMPLE}`; "
              f"nothing written", file=sys.stderr)
        return 1
    Path(args.benchmarks).write_text(benchmarks)
    print(f"wrote {args.benchmarks} from {len(records)} record(s)", file=sys.stderr)
    readme = Path(args.readme)
    text = readme.read_text() if readme.is_file() else ""
    updated = replace_between_markers(text, format_readme_table(records))
    if updated is None:
        print(f"{readme}: no bench-table markers; left as it is", file=sys.stderr)
    elif updated != text:
        readme.write_text(updated)
        print(f"wrote the table between the bench-table markers of {readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
