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

Run it with ``python -m bench.fit_price [--model M ...] [--epochs 3] [--samples 512] [--cold]``.

Example:
    >>> from bench.fit_price import format_fit_prices, run_fit_prices
    >>> rows = run_fit_prices(["mlp"], rounds=1)  # doctest: +SKIP
    >>> print(format_fit_prices(rows))  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from bench.environment import environment
from bench.tables import format_environment
from bench.workloads import WORKLOADS, build_model

MODES = ("stock", "tfmx", "guard off", "no budget", "decided")


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
    tfmx.disable()
    return out


def run_fit_prices(models: Sequence[str], epochs: int = 3, samples: int = 512,
                   batch_size: int = 32, rounds: int = 2,
                   modes: Sequence[str] = MODES, tune: str = "cached",
                   cold: bool = False) -> list[dict[str, Any]]:
    """Time whole fits of each of ``models`` in ``modes`` (see module doc), ``rounds`` times
    interleaved; one row per workload with each mode's median seconds and its fits.
    ``tune``: the timed tfmx fits' tuner mode after the cache-filling fit; ``cold``: no such
    fit, every tfmx fit from an empty cache of its own."""
    import keras

    import tfmx

    rows = []
    for name in models:
        workload = WORKLOADS[name]
        rng = np.random.default_rng(0)
        x = rng.standard_normal((samples, *workload.input_shape)).astype(np.float32)
        y = rng.integers(0, workload.num_classes, size=samples).astype(np.int32)
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
        rows.append({"workload": name, "epochs": epochs, "samples": samples, "cold": cold,
                     "batch_size": batch_size, "steps": epochs * -(-samples // batch_size),
                     "median_s": medians, "fits": fits})
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
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.fit_price``: print the table (and the machine it ran on)."""

    parser = argparse.ArgumentParser(prog="python -m bench.fit_price", description=__doc__)
    parser.add_argument("--model", nargs="+", default=["mlp", "small_cnn", "transformer"],
                        choices=sorted(WORKLOADS))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--tune", default="cached", choices=("auto", "cached", "off"),
                        help="the timed tfmx fits' tuner mode (after a fit fills the cache)")
    parser.add_argument("--cold", action="store_true",
                        help="no cache-filling fit: each tfmx fit from an empty cache")
    args = parser.parse_args(argv)
    rows = run_fit_prices(args.model, args.epochs, args.samples, args.batch_size, args.rounds,
                          [m for m in MODES if m in args.modes], args.tune, args.cold)
    print(format_environment(environment()))
    print()
    print(format_fit_prices(rows))
    return 0


__all__ = ["MODES", "format_fit_prices", "run_fit_prices"]


if __name__ == "__main__":
    sys.exit(main())
