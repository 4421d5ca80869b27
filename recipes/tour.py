"""The tour: the recipes where tfmx shows its worth on a CPU, one table and one picture.

Runs each recipe of :data:`TOUR` in a process of its own (``python -m recipes.<name> --out
DIR/<name>``, its output kept in ``DIR/<name>.log``), each training stock, tfmx and the stock'
chaos baseline from the same weights, and (``--xla``, not in the quick tour) times XLA's
compiled step beside them; then prints one table (workload, data, step time stock, XLA and
tfmx interleaved, the train step the tfmx run kept and why, the ratios to stock and to the
best alternative, the final held-out metric of each run, and the difference against stock's
own rounding noise), each tfmx run's ``tfmx.report()`` first line, and writes
``DIR/tour.png`` and ``DIR/tour.json``.

Run it::

    python -m pip install -e ".[recipes]" && python -m recipes.tour   # a few minutes
    python -m recipes.tour --quick                                     # about 2 minutes
    python -m recipes.tour --only custom_loop bn_resnet --out /tmp/tour

Example:
    >>> [name for name, _, _ in TOUR][:2]
    ['custom_loop', 'bn_resnet']
    >>> print(format_table([]).splitlines()[0][:28])
    | workload | data | stock ms
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: (recipe, its arguments in the tour, its arguments in the quick tour). The quick tour trains
#: each recipe well above chance in a few hundred steps. tfmx.function runs custom_loop's
#: fused step as it is; a fit of bn_resnet's or transformer's quick length is thousands of
#: calls too short to pay for tfmx's first call (the price gate's verdict), so there the quick
#: tour asks for the fused step with ``--fuse always`` and its table says so.
TOUR: list[tuple[str, list[str], list[str]]] = [
    ("custom_loop", ["--epochs", "20", "--xla"], ["--quick", "--epochs", "8", "--depth", "31",
                                         "--samples", "1400", "--rounds", "5"]),
    ("bn_resnet", ["--epochs", "6", "--samples", "1500", "--xla"],
     ["--quick", "--fuse", "always", "--epochs", "2", "--samples", "1400", "--rounds", "5"]),
    ("recurrent", ["--epochs", "4", "--samples", "3000", "--xla"], []),
    ("transformer", ["--epochs", "4", "--samples", "2000", "--xla"],
     ["--quick", "--fuse", "always", "--epochs", "4", "--samples", "3900", "--batch-size", "32",
      "--rounds", "5"]),
    ("mixed_precision", ["--epochs", "8", "--xla"], []),
]


def _parser() -> argparse.ArgumentParser:
    from recipes._flags import positive_int

    p = argparse.ArgumentParser(prog="python -m recipes.tour", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="the small tour: three recipes, each trained well above chance with "
                        "tfmx's fused train step (about 2 minutes on 2 cores)")
    p.add_argument("--only", nargs="+", metavar="RECIPE", choices=[t[0] for t in TOUR],
                   help="run only these recipes of the tour")
    p.add_argument("--seed", type=int, default=1234, help="passed to every recipe")
    p.add_argument("--rounds", type=positive_int, default=None,
                   help="interleaved timing rounds of every recipe (default: the recipe's)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="output folder (default runs/tour-<timestamp>)")
    return p


def _fmt(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _sci(value: Any) -> str:
    return "-" if value is None else f"{value:.1e}"


def row(metrics: dict[str, Any]) -> dict[str, Any]:
    """One table row from a recipe's ``metrics.json``."""
    inter = metrics["timing"]["interleaved"]
    comp = metrics["comparison"]
    return {
        "workload": metrics["recipe"],
        "data": metrics["data"]["source"].split(" (")[0].split(":")[0],
        "stock_ms": inter.get("stock", {}).get("median_ms"),
        "tfmx_ms": inter.get("tfmx", {}).get("median_ms"),
        "stock_iqr": [inter.get("stock", {}).get(k) for k in ("p25_ms", "p75_ms")],
        "tfmx_iqr": [inter.get("tfmx", {}).get(k) for k in ("p25_ms", "p75_ms")],
        "xla_iqr": [inter.get("xla", {}).get(k) for k in ("p25_ms", "p75_ms")],
        "xla_ms": inter.get("xla", {}).get("median_ms"),
        "best": metrics["timing"].get("best_alternative"),
        "ratio": metrics["timing"]["ratio"],
        "ratio_to_best": metrics["timing"].get("ratio_to_best"),
        "metric": comp["metric"],
        "stock": comp["stock"], "tfmx": comp["tfmx"], "baseline": comp["baseline"],
        "difference": comp["difference"], "noise": comp["noise"],
        "within_noise": comp["within_noise"],
        "loss_difference": comp["val_loss"]["difference"], "loss_noise": comp["val_loss"]["noise"],
        "loss_within_noise": comp["val_loss"].get("within_noise"),
        "policy": metrics["args"].get("policy"),
        "step": metrics.get("tfmx_report", {}).get("step"),
    }


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The tour's markdown table; its "tfmx step" column is the train step each tfmx run
    kept (``recipes._compare.tfmx_step``), and a ratio between two runs of stock's step says
    "(both stock)"."""
    from recipes._compare import step_cell

    lines = ["| workload | data | stock ms | XLA ms | tfmx ms | tfmx step | tfmx / stock "
             "| best alternative "
             "| tfmx / best | held-out metric | stock | tfmx | stock' | \\|stock - tfmx\\| "
             "| \\|stock - stock'\\| (noise) | val loss \\|stock - tfmx\\| | val loss noise |",
             "|---|---|---:|---:|---:|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = r["workload"] + (f" ({r['policy']})" if r.get("policy") else "")
        flag = "" if r["within_noise"] in (True, None) else " **outside noise**"
        best = r.get("best") or {}
        best_text = f"{best['mode']} {best['ms']:.2f}" if best else "-"
        step = r.get("step") or {}
        # both runs trained stock's step: their ratio is timing noise, not tfmx's doing
        ratio = (f"{_fmt(r['ratio'], 3)} (both stock)" if step.get("form") == "stock"
                 else f"**{_fmt(r['ratio'], 3)}**")
        lines.append(f"| {name} | {r['data']} | {_fmt(r['stock_ms'])} | {_fmt(r.get('xla_ms'))} "
                     f"| {_fmt(r['tfmx_ms'])} | {step_cell(step)} | {ratio} | {best_text} | "
                     f"{_fmt(r.get('ratio_to_best'), 3)} | {r['metric'][4:]} | "
                     f"{_fmt(r['stock'], 4)} | "
                     f"{_fmt(r['tfmx'], 4)} | {_fmt(r['baseline'], 4)} | "
                     f"{_fmt(r['difference'], 4)}{flag} | {_fmt(r['noise'], 4)} | "
                     f"{_sci(r.get('loss_difference'))}"
                     f"{'' if r.get('loss_within_noise') in (True, None) else ' (outside)'} | "
                     f"{_sci(r.get('loss_noise'))} |")
    return "\n".join(lines)


def step_lines(rows: Sequence[dict[str, Any]]) -> str:
    """Each recipe's train step as its tfmx run's report says it (the report's first line).

    >>> line = "tfmx: M.train_step runs the fused step"
    >>> print(step_lines([{"workload": "demo", "step": {"line": line}}]))
    tfmx step of each recipe's tfmx run (its tfmx.report()'s first line):
      demo: tfmx: M.train_step runs the fused step
    """
    lines = ["tfmx step of each recipe's tfmx run (its tfmx.report()'s first line):"]
    for r in rows:
        lines.append(f"  {r['workload']}: {(r.get('step') or {}).get('line') or '-'}")
    return "\n".join(lines)


def plot(path: Path, rows: Sequence[dict[str, Any]], title: str) -> Path | None:
    """Two panels: step time relative to stock (p25-p75 bars), and final held-out metric of
    stock, tfmx and stock'. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [r["workload"] for r in rows]
    xs = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    modes = [("stock", "#1f77b4", "stock"), ("tfmx", "#d62728", "tfmx")]
    if any(r.get("xla_ms") for r in rows):
        modes.insert(1, ("xla", "#2ca02c", "XLA (jit_compile)"))
    width = 0.8 / len(modes)
    for i, (key, color, label) in enumerate(modes):
        offset = (i - (len(modes) - 1) / 2) * width
        meds, errs = [], [[], []]
        for r in rows:
            base = r["stock_ms"] or 1.0
            med = (r.get(f"{key}_ms") or 0.0) / base
            lo, hi = ((v or 0.0) / base for v in r.get(f"{key}_iqr", [None, None]))
            meds.append(med)
            errs[0].append(max(med - lo, 0.0))
            errs[1].append(max(hi - med, 0.0))
        a.bar([x + offset for x in xs], meds, width * 0.95, yerr=errs, capsize=3, color=color,
              label=label, alpha=0.85)
        if key == "tfmx":
            for x, m, top, r in zip(xs, meds, errs[1], rows):
                a.text(x + offset, m + top + 0.02, f"{m:.2f}\n{_fmt(r['tfmx_ms'], 1)} ms",
                       ha="center", va="bottom", fontsize=8)
    a.axhline(1.0, color="black", lw=0.8)
    a.set_xticks(list(xs), names, rotation=15)
    a.set_ylabel("step time / stock median (p25-p75)")
    a.set_ylim(0, max(1.35, a.get_ylim()[1]))
    a.set_title("training step time, interleaved (lower is faster)")
    a.legend(loc="lower right", fontsize=8, framealpha=0.95)
    a.grid(axis="y", alpha=0.3)
    for offset, key, color, label in ((-0.27, "stock", "#1f77b4", "stock"),
                                      (0.0, "tfmx", "#d62728", "tfmx"),
                                      (0.27, "baseline", "#7f7f7f", "stock' (1e-7 noise)")):
        b.bar([x + offset for x in xs], [r[key] or 0.0 for r in rows], 0.27, color=color,
              label=label, alpha=0.85)
    for x, r in zip(xs, rows):
        if r["tfmx"] is not None:
            b.text(x, r["tfmx"] + 0.01, f"{r['tfmx']:.3f}", ha="center", va="bottom", fontsize=8)
    b.set_xticks(list(xs), names, rotation=15)
    b.set_ylabel("final held-out accuracy")
    b.set_ylim(0, 1.22)
    b.set_title("final held-out metric: tfmx against stock's rounding noise")
    b.legend(loc="upper center", fontsize=8, ncol=3)
    b.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the tour; print and return ``{"rows", "table", "png", "out"}``."""
    args = _parser().parse_args(argv)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or os.path.join("runs", f"tour-{stamp}"))
    out.mkdir(parents=True, exist_ok=True)
    plan = [(n, q if args.quick else d) for n, d, q in TOUR
            if (args.only and n in args.only) or (not args.only and (not args.quick or q))]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    rows, start = [], time.perf_counter()
    print(f"tour: {', '.join(n for n, _ in plan)}; each recipe's output in {out}/<recipe>.log",
          flush=True)
    for name, extra in plan:
        cmd = [sys.executable, "-m", f"recipes.{name}", "--out", str(out / name),
               "--seed", str(args.seed), *extra]
        if args.rounds:
            cmd += ["--rounds", str(args.rounds)]
        t0 = time.perf_counter()
        print(f"  {name}: {' '.join(cmd[2:])} ...", end=" ", flush=True)
        with open(out / f"{name}.log", "w") as log:
            status = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        if status != 0:
            print(f"FAILED (exit {status}; see {out / (name + '.log')})")
            continue
        r = row(json.loads((out / name / "metrics.json").read_text()))
        rows.append(r)
        print(f"{time.perf_counter() - t0:.0f} s, tfmx/stock {_fmt(r['ratio'], 3)}", flush=True)
    table = format_table(rows)
    from recipes._machine import environment

    e = environment()
    machine = (f"{e['cpu']} (family {e['cpu_family']}, model {e['cpu_model']}), "
               f"{e['cpu_count']} cores, oneDNN {'on' if e['onednn'] else 'off'}, "
               f"TensorFlow {e['tensorflow']}, Keras {e['keras']}")
    print(f"\n{machine}\n\n{table}\n\n{step_lines(rows)}")
    noisy = [r["workload"] for r in rows if r["within_noise"] is False]
    if noisy:
        print(f"\nWARNING: the tfmx difference is outside stock's rounding noise for "
              f"{', '.join(noisy)}: see that recipe's log")
    png = plot(out / "tour.png", rows, f"python -m recipes.tour{' --quick' if args.quick else ''}"
               f": {machine}")
    print(f"\nwrote {out / 'tour.json'}" + (f", {png}" if png else
                                           " (matplotlib is not installed: no PNG)")
          + f" ({time.perf_counter() - start:.0f} s in all)")
    result = {"rows": rows, "table": table, "machine": machine,
              "png": str(png) if png else None, "out": str(out)}
    (out / "tour.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
