"""What tfmx costs on a whole ``fit``: wall time of short fits, stock against tfmx.

``tfmx bench`` times steps once each form has settled; a user's ``fit`` also pays tracing,
tfmx's rewrite and the whole-step guard's trial (:mod:`tfmx.guard`). This measures that price:
for each workload of :data:`bench.workloads.WORKLOADS`, fits of ``epochs`` epochs on ``samples``
random samples (3 on 512 by default: 48 steps of 32), each on a new model built from the same
weights, timed from ``fit``'s call to its return, in these modes, interleaved round by round:

- ``stock``: tfmx off;
- ``tfmx``: ``tfmx.enable()`` as a user calls it (the guard on, within its 2 % budget);
- ``guard off``: ``tfmx.enable(guard=False)``: the rewrite alone, what the guard's price is
  measured against;
- ``no budget``: the guard's trial run to its end whatever it costs (``TFMX_GUARD_BUDGET=none``),
  what a trial costs a short fit without the budget;
- ``decided``: a new model of the same architecture fitted right after ``no budget``'s, in the
  same process: the trial's outcome reused, no trial.

Before the rounds one tfmx fit of each workload fills the tuner's cache, so the timed fits
measure tracing, rewriting and the guard, not the tuner's first measurements (they are made
once per machine and shape; the timed tfmx fits run ``tune="cached"``, or ``--tune``).
With ``--cold`` there is no such fit: every tfmx fit starts from an empty cache of its own
(``tune="auto"``, as a first fit on a new machine), so it pays the tuner's measurements too.

``--model`` takes workload names and group names (``zoo``: :data:`bench.workloads.GROUPS`);
each workload gets its own inputs (:func:`bench.workloads.random_dataset`: int32 token ids
below the vocabulary for the zoo's language models, standard normal features otherwise).

Run it with ``python -m bench.fit_price [--model M ...] [--epochs 3] [--samples 512] [--cold]
[--record [DIR]]``. With ``--minute`` it measures the one-minute fit instead
(:mod:`bench.minute_fit`: a fit sized to take stock ``--target-seconds``, stock, tfmx and XLA
each in a process of its own). ``--record`` keeps one JSON record per workload and cold/warm under
``bench/results/fit_price/`` (:data:`RESULTS_DIR`; a subfolder, so
:func:`bench.records.load_records` never reads them): the machine, the command that reproduces
it, each mode's median and every fit (with the tfmx fits' guard line and price-gate notes),
and the error of the price gate's estimate of tfmx's first call (:func:`first_call_estimates`:
where the gate ran tfmx's form on an estimate of its first call, predicted and measured). A
new record of the same workload and cold/warm replaces its file. :func:`load_fit_prices` reads
them back and :func:`format_fit_price_section` renders them for BENCHMARKS.md.

Example:
    >>> from bench.fit_price import (format_fit_price_section, format_fit_prices,
    ...                              load_fit_prices, run_fit_prices, write_fit_prices)
    >>> rows = run_fit_prices(["mlp"], rounds=1)  # doctest: +SKIP
    >>> print(format_fit_prices(rows))  # doctest: +SKIP
    >>> write_fit_prices(rows, "python -m bench.fit_price --model mlp --record")  # doctest: +SKIP
    >>> print(format_fit_price_section(load_fit_prices()))  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.environment import format_environment, format_onednn, machine
from bench.onednn import onednn_state
from bench.records import RESULTS_DIR as RECORDS_DIR
from bench.records import narrow_command, read_json_records
from bench.workloads import GROUPS, WORKLOADS, Workload, build_model, expand_models, random_dataset
from recipes._machine import environment

MODES = ("stock", "tfmx", "guard off", "no budget", "decided")

RESULTS_DIR = RECORDS_DIR / "fit_price"
"""Where ``--record`` writes and :func:`load_fit_prices` reads: a subfolder of
:data:`bench.records.RESULTS_DIR`, out of :func:`bench.records.load_records`'s sight."""

SCHEMA = 1
"""The records' layout, kept as ``fit_price_schema`` (not ``schema``: no step record reader
takes a fit-price record for one of its own); a record of another layout is not read."""


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    previous = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _fit_once(workload: Any, mode: str, weights: list, x: Any, y: Any, epochs: int,
              batch_size: int, tune: str = "cached") -> dict[str, Any]:
    """One timed fit of a new model in ``mode``; what the train step's guard did. ``tune``:
    the tuner's mode, or ``"cold"``: ``"auto"`` with an empty cache of the fit's own."""
    import tfmx
    from tfmx import guard

    cold = tune == "cold"
    if mode == "stock":
        tfmx.disable()
    else:
        if mode != "decided":
            guard.forget()  # each mode's trial from nothing (``decided`` reuses the last one)
    with contextlib.ExitStack() as stack:
        if cold and mode != "stock":  # a first fit on a new machine: an empty cache
            stack.enter_context(_env("TFMX_CACHE_DIR", tempfile.mkdtemp(prefix="tfmx-cold-")))
        if mode != "stock":
            tfmx.enable(guard=mode != "guard off", tune="auto" if cold else tune)
            tfmx.report(reset=True)
        out = _timed_fit(workload, mode, weights, x, y, epochs, batch_size)
    return out


def _timed_fit(workload: Any, mode: str, weights: list, x: Any, y: Any, epochs: int,
               batch_size: int) -> dict[str, Any]:
    import tfmx

    model = build_model(workload, "stock" if mode == "stock" else "tfmx", 0, weights)
    with _env("TFMX_GUARD_BUDGET", "none" if mode == "no budget" else None):
        start = time.perf_counter()
        model.fit(x, y, epochs=epochs, batch_size=batch_size, verbose=0)
        seconds = time.perf_counter() - start
    out: dict[str, Any] = {"mode": mode, "seconds": seconds}
    if mode != "stock":
        guards = [g.summary() for g in tfmx.report().guards
                  if g.function.endswith("train_step")]
        if guards:
            g = guards[0]
            out.update(kept=g.kept, final=g.final, cost_s=g.cost_s, run_s=g.run_s,
                       saved_s=g.saved_s, xla_compile_s=g.xla_compile_s, guard=g.describe())
        report = tfmx.report()
        out["rewrite_s"] = sum(t.seconds for t in report.traces)
        out["tune_s"] = sum(getattr(t, "tune_seconds", 0.0) for t in report.traces)
        out["price"] = [n for n in report.notes if n.startswith("price gate")]
        out["first_call"] = [dict(f) for f in getattr(report, "first_calls", [])]
    tfmx.disable()
    return out


def fit_data(workload: Workload, samples: int, seed: int = 0) -> tuple[Any, Any]:
    """``samples`` random inputs and int32 labels for ``workload`` as numpy arrays, as
    ``tfmx bench`` makes them (:func:`bench.workloads.random_dataset`): int32 token ids below
    its vocabulary, else standard normal float32 features; the same ``seed``, the same data.

    >>> x, y = fit_data(WORKLOADS["zoo_llama"], 6)
    >>> x.shape, x.dtype.name, bool(0 <= x.min() and x.max() < 1000), y.dtype.name
    ((6, 64), 'int32', True, 'int32')
    >>> fit_data(WORKLOADS["mlp"], 6)[0].dtype.name
    'float32'
    """
    x, y = next(iter(random_dataset(workload, samples, seed, batches=1)))
    return x.numpy(), y.numpy()


def run_fit_prices(models: Sequence[str | Workload], epochs: int = 3, samples: int = 512,
                   batch_size: int = 32, rounds: int = 2,
                   modes: Sequence[str] = MODES, tune: str = "cached",
                   cold: bool = False,
                   on_row: Callable[[dict[str, Any]], Any] | None = None,
                   ) -> list[dict[str, Any]]:
    """Time whole fits of each of ``models`` in ``modes`` (see module doc), ``rounds`` times
    interleaved; one row per workload with each mode's median seconds and its fits.
    ``models``: workload names, group names (``"zoo"``) or :class:`bench.workloads.Workload`
    objects. ``tune``: the timed tfmx fits' tuner mode after the cache-filling fit; ``cold``:
    no such fit, every tfmx fit from an empty cache of its own. ``on_row`` is called with each
    workload's row as soon as it is measured (``--record`` writes it there)."""
    import keras

    import tfmx

    rows = []
    workloads = [w for m in models for w in ([m] if isinstance(m, Workload) else
                                             [WORKLOADS[n] for n in expand_models([m])])]
    for workload in workloads:
        name = workload.name
        x, y = fit_data(workload, samples)
        keras.utils.set_random_seed(0)
        weights = build_model(workload, "stock", 0, None).get_weights()
        if not cold:
            tfmx.enable(tune="auto", guard=False)  # fills the tuner's cache for this shape
            build_model(workload, "tfmx", 0, weights).fit(x, y, epochs=1,
                                                          batch_size=batch_size, verbose=0)
            tfmx.disable()
        fits: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for r in range(rounds):
            for mode in modes:
                fits[mode].append(_fit_once(workload, mode, weights, x, y, epochs, batch_size,
                                            "cold" if cold else tune))
                print(f"{name} round {r + 1} {mode}: {fits[mode][-1]['seconds']:.2f} s",
                      file=sys.stderr, flush=True)
        medians = {m: statistics.median(f["seconds"] for f in fits[m]) for m in modes}
        row = {"workload": name, "description": workload.description, "epochs": epochs,
               "samples": samples, "cold": cold, "batch_size": batch_size,
               "steps": epochs * -(-samples // batch_size), "rounds": rounds,
               "tune": "auto" if cold else tune, "median_s": medians, "fits": fits}
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def format_fit_prices(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table: each mode's median fit seconds and its ratio to stock's and to
    ``guard off``'s; then each workload's train-step guard as the report showed it.

    >>> row = {"workload": "w", "epochs": 3, "samples": 512, "steps": 48,
    ...        "median_s": {"stock": 2.0, "tfmx": 3.0, "guard off": 3.0},
    ...        "fits": {"tfmx": [{"guard": "w.train_step: kept fused for now"}]}}
    >>> print(format_fit_prices([row]).splitlines()[2])
    | w | 3 x 512 (48 steps) | 2.00 | 3.00 (1.50, 1.000) | 3.00 (1.50, 1.000) |
    """
    modes = [m for m in MODES if any(m in r["median_s"] for r in rows)]
    head = "| workload | fit | " + " | ".join(
        f"{m} s" + ("" if m == "stock" else " (/stock, /guard off)") for m in modes) + " |"
    lines = [head, "|" + "---|" * (len(modes) + 2)]
    for r in rows:
        med = r["median_s"]
        cells = []
        for m in modes:
            if m not in med:
                cells.append("")
            elif m == "stock" or "stock" not in med:
                cells.append(f"{med[m]:.2f}")
            else:
                off = f", {med[m] / med['guard off']:.3f}" if "guard off" in med else ""
                cells.append(f"{med[m]:.2f} ({med[m] / med['stock']:.2f}{off})")
        lines.append(f"| {r['workload']} | {r['epochs']} x {r['samples']} ({r['steps']} steps) "
                     f"| " + " | ".join(cells) + " |")
    for r in rows:
        for m in ("tfmx", "no budget", "decided"):
            for fit in r["fits"].get(m, [])[-1:]:
                if fit.get("guard"):
                    lines.append(f"- {r['workload']}, {m}: {fit['guard']}")
                if "rewrite_s" in fit:
                    lines.append(f"- {r['workload']}, {m}: rewrite {fit['rewrite_s']:.2f} s, "
                                 f"tuner measuring {fit.get('tune_s', 0.0):.2f} s"
                                 + "".join(f"; {p}" for p in fit.get("price", [])))
        for e in first_call_estimates(r):
            lines.append(f"- {r['workload']}, {e['mode']} (round {e['round']}): tfmx's first "
                         f"call predicted {e['predicted_s']:.2f} s, measured "
                         f"{e['measured_s']:.2f} s (measured/predicted "
                         f"{e['measured/predicted']:.3f})")
    return "\n".join(lines)


def first_call_estimates(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The price gate's estimates of tfmx's first call in ``record``'s (or a row's) fits,
    where one was both predicted and measured: each fit's ``mode``, ``round`` (from 1),
    ``predicted_s``, ``measured_s`` and ``measured/predicted``; the record's own list where it
    keeps one, [] for a record of fits that kept none.

    >>> fit = {"first_call": [{"predicted_s": 2.4, "measured_s": 2.1, "how": "1.20 x"}]}
    >>> first_call_estimates({"fits": {"stock": [{}], "tfmx": [{}, fit]}})
    ... # doctest: +NORMALIZE_WHITESPACE
    [{'mode': 'tfmx', 'round': 2, 'predicted_s': 2.4, 'measured_s': 2.1,
      'measured/predicted': 0.875}]
    >>> first_call_estimates({"fits": {"tfmx": [{"price": []}]}})
    []
    """
    if "first_call_estimates" in record:
        return [dict(e) for e in record["first_call_estimates"]]
    out = []
    for mode, fits in (record.get("fits") or {}).items():
        for i, fit in enumerate(fits):
            for e in fit.get("first_call") or []:
                predicted, measured = e.get("predicted_s"), e.get("measured_s")
                if predicted and measured:
                    out.append({"mode": mode, "round": i + 1, "predicted_s": predicted,
                                "measured_s": measured,
                                "measured/predicted": round(measured / predicted, 6)})
    return out


def record_name(row: Mapping[str, Any]) -> str:
    """The file name of ``row``'s record: its workload and whether its fits were cold.

    >>> record_name({"workload": "zoo_llama", "cold": True}), record_name({"workload": "mlp"})
    ('zoo_llama-cold.json', 'mlp-warm.json')
    """
    stem = f"{row['workload']}-{'cold' if row.get('cold') else 'warm'}"
    return re.sub(r"[^\w.-]+", "_", stem) + ".json"


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def make_fit_price_record(row: Mapping[str, Any], command: str,
                          env: Mapping[str, Any]) -> dict[str, Any]:
    """``row`` (one workload of :func:`run_fit_prices`) as a record: the machine ``env``
    (:func:`recipes._machine.environment`), ``command`` and, as ``reproduce``, the same
    command for this workload alone, the fit's sizes, cold or warm, each mode's median seconds,
    ``tfmx/stock`` and every mode's ratio to stock, every fit as measured (a tfmx fit's
    ``guard`` line, ``price`` notes, ``first_call`` estimates, rewrite and tuning seconds among
    them), and ``first_call_estimates`` (:func:`first_call_estimates`).

    >>> row = {"workload": "mlp", "epochs": 1, "samples": 64, "batch_size": 32, "steps": 2,
    ...        "cold": False, "median_s": {"stock": 2.0, "tfmx": 3.0},
    ...        "fits": {"stock": [{"mode": "stock", "seconds": 2.0}],
    ...                 "tfmx": [{"mode": "tfmx", "seconds": 3.0, "price": []}]}}
    >>> rec = make_fit_price_record(row, "python -m bench.fit_price --model mlp lstm",
    ...                             {"cpu": "cpu", "onednn": True})
    >>> rec["tfmx/stock"], rec["reproduce"], rec["cold"]
    (1.5, 'python -m bench.fit_price --model mlp', False)
    """
    median = dict(row["median_s"])
    return {
        "fit_price_schema": SCHEMA,
        "command": narrow_command(command) if command else "",
        "reproduce": narrow_command(command, row["workload"]) if command else "",
        "env": dict(env),
        "workload": row["workload"],
        "description": row.get("description", ""),
        **{k: row.get(k) for k in ("epochs", "samples", "steps", "batch_size", "rounds",
                                   "tune")},
        "cold": bool(row.get("cold")),
        "median_s": median,
        "tfmx/stock": _ratio(median.get("tfmx"), median.get("stock")),
        "ratios": {f"{m}/stock": _ratio(s, median.get("stock"))
                   for m, s in median.items() if m != "stock"},
        "fits": row["fits"],
        "first_call_estimates": first_call_estimates(row),
    }


def write_fit_prices(rows: Iterable[Mapping[str, Any]], command: str,
                     directory: str | Path | None = None,
                     env: Mapping[str, Any] | None = None) -> list[Path]:
    """Write one record per row (:func:`make_fit_price_record`, :func:`record_name`) into
    ``directory`` (default :data:`RESULTS_DIR`, created if missing), replacing the file of the
    same workload and cold/warm; ``env`` defaults to this machine's. The paths written.

    >>> import tempfile
    >>> row = {"workload": "mlp", "cold": True, "median_s": {"stock": 1.0}, "fits": {}}
    >>> [p.name for p in write_fit_prices([row], "", tempfile.mkdtemp(), env={"cpu": "c"})]
    ['mlp-cold.json']
    """
    folder = Path(directory) if directory is not None else RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    env = environment() if env is None else env
    written = []
    for row in rows:
        path = folder / record_name(row)
        record = make_fit_price_record(row, command, env)
        path.write_text(json.dumps(record, indent=1, default=str) + "\n")
        written.append(path)
    return written


def load_fit_prices(directory: str | Path | None = None) -> list[dict[str, Any]]:
    """Every fit-price record in ``directory`` (default :data:`RESULTS_DIR`), by file name;
    files of another layout (:data:`SCHEMA`) or not JSON are left out. [] if there is no
    folder.

    >>> load_fit_prices("/no/such/folder")
    []
    """
    return read_json_records(directory if directory is not None else RESULTS_DIR,
                             lambda record: record.get("fit_price_schema") == SCHEMA)


SECTION_INTRO = textwrap.fill(
    "Wall time of whole `model.fit` calls of a few epochs on random data, from the call to its "
    "return: tracing, tfmx's rewrite, the tuner's measurements and the whole-step guard's "
    "trial included; each fit a new model from the same weights, stock and tfmx interleaved, "
    "the median of the rounds. Warm: the tuning cache already holds the workload's shapes "
    "(any fit after the first on a machine); cold: every tfmx fit starts from an empty tuning "
    "cache, as a first fit on a new machine does. \"tfmx ran\" says which step tfmx ran: where "
    "it is the stock step (the price gate: tracing tfmx's form could not pay for itself in so "
    "few steps), tfmx's gain is in how Keras's loop runs it: the step built before its first "
    "trace, so traced once, and called without `tf.function`'s per-call lookup.", width=100)


def _order(record: Mapping[str, Any]) -> tuple[int, str, bool]:
    names = list(WORKLOADS)
    name = record.get("workload", "")
    return (names.index(name) if name in names else len(names), name, bool(record.get("cold")))


def format_fit_price_section(records: Sequence[Mapping[str, Any]]) -> str:
    """BENCHMARKS.md's section on whole short fits from ``records`` (:func:`load_fit_prices`):
    a heading, what is timed, the commands, then per machine (processor, oneDNN state) one row
    per record. "" without records.

    >>> env = {"cpu": "AMD EPYC", "cpu_count": 2, "cpu_flags": ["avx2"], "onednn": True,
    ...        "onednn_env": None, "tensorflow": "2.21.0", "keras": "3.15.1", "python": "3.11"}
    >>> rec = {"fit_price_schema": 1, "workload": "mlp", "epochs": 3, "samples": 512,
    ...        "steps": 48, "batch_size": 32, "cold": True, "env": env,
    ...        "median_s": {"stock": 2.0, "tfmx": 3.0}, "tfmx/stock": 1.5,
    ...        "command": "python -m bench.fit_price --model mlp --cold --record"}
    >>> text = format_fit_price_section([rec])
    >>> print(text.splitlines()[0])
    ## The price of a short fit
    >>> print(text.splitlines()[-1])
    | mlp | 3 x 512 (48 steps of 32) | 2.00 | 3.00 | 1.500 | cold | - |
    >>> format_fit_price_section([])
    ''
    """
    if not records:
        return ""
    records = sorted(records, key=_order)
    commands = list(dict.fromkeys(r.get("command") for r in records if r.get("command")))
    lines = ["## The price of a short fit", "", SECTION_INTRO, ""]
    if commands:
        lines += ["Measured with (`--record` writes a record per workload and cold/warm "
                  "under `bench/results/fit_price/`):", "", "```", *commands, "```", ""]

    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in records:
        groups.setdefault((machine(r.get("env") or {}), onednn_state(r)), []).append(r)
    for (title, _), group in groups.items():
        onednn = format_onednn(group)
        lines += [f"Machine: {title}." + (f" {onednn}" if onednn else ""), "",
                  "| workload | fit | stock s | tfmx s | tfmx / stock | cold / warm | tfmx ran |",
                  "|---|---|---:|---:|---:|---|---|"]
        for r in group:
            median = r.get("median_s") or {}
            cells = [r.get("workload", "?"),
                     f"{r.get('epochs')} x {r.get('samples')} ({r.get('steps')} steps of "
                     f"{r.get('batch_size')})",
                     *(f"{median[m]:.2f}" if m in median else "-" for m in ("stock", "tfmx")),
                     "-" if r.get("tfmx/stock") is None else f"{r['tfmx/stock']:.3f}",
                     "cold" if r.get("cold") else "warm", what_ran(r)]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        lines.append("")
        lines += _estimate_table(group)
    return "\n".join(lines).rstrip("\n")


def _estimate_table(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """The price gate's estimates of tfmx's first call in ``records``' fits, predicted and
    measured, as a table ([] where no fit kept one)."""
    rows = [(r, e) for r in records for e in first_call_estimates(r)]
    if not rows:
        return []
    lines = ["The price gate's estimate of tfmx's first call, where it ran tfmx's form on one "
             "(predicted before the call, measured after it):", "",
             "| workload | cold / warm | fit | predicted s | measured s | measured / predicted |",
             "|---|---|---|---:|---:|---:|"]
    for r, e in rows:
        lines.append(f"| {r.get('workload', '?')} | {'cold' if r.get('cold') else 'warm'} | "
                     f"{e['mode']}, round {e['round']} | {e['predicted_s']:.2f} | "
                     f"{e['measured_s']:.2f} | {e['measured/predicted']:.3f} |")
    return [*lines, ""]


def what_ran(record: Mapping[str, Any]) -> str:
    """What the last tfmx fit of ``record`` ran: the stock step by the price gate's verdict
    (every call, or its first calls before tfmx's form was traced), or the form its guard kept.

    >>> what_ran({"fits": {"tfmx": [{"price": ["price gate: f ran as stock: why"]}]}})
    'the stock step (price gate)'
    >>> what_ran({"fits": {"tfmx": [{"kept": "fused", "final": True}]}})
    'fused (guard)'
    """
    fits = (record.get("fits") or {}).get("tfmx") or []
    if not fits:
        return "-"
    last = fits[-1]
    price = last.get("price") or []
    if isinstance(price, str):
        price = [price]
    kept = last.get("kept")
    if kept:
        switched = any(" after " in n and "ran as tfmx" in n for n in price)
        when = "; traced mid-fit" if switched else ""
        return f"{kept} ({'guard' if last.get('final', True) else 'guard, trial paused'}{when})"
    if any("ran as stock" in n for n in price):
        return "the stock step (price gate)"
    return "-"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.fit_price``: print the table (and the machine it ran on); with
    ``--record [DIR]`` keep each workload's record (:func:`write_fit_prices`) as it finishes.
    """

    parser = argparse.ArgumentParser(prog="python -m bench.fit_price", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=None,
                        choices=sorted(WORKLOADS) + sorted(GROUPS), metavar="M",
                        help="workloads, or a group of them: "
                             f"{', '.join(GROUPS)} (default mlp small_cnn transformer; "
                             "--minute: transformer)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=None,
                        help="samples per epoch (default 512; --minute: 2048)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds (default 2; --minute: 3)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--tune", default="cached", choices=("auto", "cached", "off"),
                        help="the timed tfmx fits' tuner mode (after a fit fills the cache)")
    parser.add_argument("--cold", action="store_true",
                        help="no cache-filling fit: each tfmx fit from an empty cache")
    parser.add_argument("--record", nargs="?", const=str(RESULTS_DIR), default=None,
                        metavar="DIR",
                        help="keep one JSON record per workload and cold/warm, with this "
                             "command (default folder bench/results/fit_price/; --minute: "
                             "its minute/ subfolder)")
    parser.add_argument("--minute", action="store_true",
                        help="the one-minute fit instead (bench.minute_fit): epochs sized so "
                             "stock's fit takes --target-seconds, stock, tfmx and XLA each fit "
                             "in a new process, in the default oneDNN state")
    parser.add_argument("--target-seconds", type=float, default=60.0,
                        help="--minute: stock's fit's wall time to size for (default 60)")
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="--minute: the tfmx fits' tuning cache folder (default: "
                             "$TFMX_CACHE_DIR or tfmx's own)")
    parser.add_argument("--no-warm-fit", action="store_true",
                        help="--minute: no untimed tfmx fit filling the tuning cache first")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    command = shlex.join(["python", "-m", "bench.fit_price", *argv])
    if args.minute:
        from bench import minute_fit

        return minute_fit.main(args, command)
    env = environment()

    def record(row: dict[str, Any]) -> None:
        for path in write_fit_prices([row], command, args.record, env):
            print(f"recorded {path}", file=sys.stderr, flush=True)

    rows = run_fit_prices(expand_models(args.model or ["mlp", "small_cnn", "transformer"]),
                          args.epochs, args.samples or 512, args.batch_size, args.rounds or 2,
                          [m for m in MODES if m in args.modes],
                          args.tune, args.cold, on_row=record if args.record else None)
    print(format_environment(env))
    print()
    print(format_fit_prices(rows))
    return 0


__all__ = ["MODES", "RESULTS_DIR", "SCHEMA", "fit_data", "first_call_estimates",
           "format_fit_price_section",
           "format_fit_prices", "load_fit_prices", "make_fit_price_record", "record_name",
           "run_fit_prices", "write_fit_prices"]


if __name__ == "__main__":
    sys.exit(main())
