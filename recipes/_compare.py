"""The stock-vs-tfmx comparison of a recipe's runs: per-epoch rows, step-time statistics, the
final metric against the chaos baseline's noise, and the table printed at the end.

``|stock - stock'|`` is how far the final metric moves from float32 rounding alone (stock'
trained from the initial weights times ``1 + 1e-7 * N(0, 1)``: float32 rounding differences
grow over hundreds of steps); the ``|stock - tfmx|`` difference is printed beside it, with a
warning when it is larger than that noise allows (:func:`within_noise`).

Example:
    >>> within_noise(0.90, 0.93, 0.905, floor=0.001)
    (False, 0.03, 0.005)
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from recipes._data import Dataset
from recipes._recipe import BASELINE, PERTURBATION, STOCK, TFMX, XLA, Recipe, RunRecord


def within_noise(stock: float, tfmx_value: float, baseline: float,
                 floor: float = 0.0, factor: float = 3.0) -> tuple[bool, float, float]:
    """(is ``|stock - tfmx|`` inside the noise, that difference, the noise ``|stock - stock'|``).

    Inside means at most ``factor`` times the noise, or at most ``floor`` (the resolution of
    the metric, e.g. two held-out samples of an accuracy): one baseline run is a rough
    estimate of stock's spread, hence the factor.

    >>> within_noise(0.5, 0.52, 0.51)
    (True, 0.02, 0.01)
    """
    diff, noise = abs(tfmx_value - stock), abs(baseline - stock)
    return bool(diff <= max(factor * noise, floor) + 1e-12), round(diff, 12), round(noise, 12)


def _median(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def _quartiles(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return float(np.quantile(values, 0.25)), float(np.quantile(values, 0.75))


def _epochs(record: RunRecord) -> list[dict[str, Any]]:
    n = max((len(v) for v in record.history.values()), default=0)
    rows = []
    for e in range(n):
        row: dict[str, Any] = {"epoch": e + 1}
        for key, values in record.history.items():
            if e < len(values):
                row[key] = values[e]
        times = record.batch_ms[e] if e < len(record.batch_ms) else []
        row["step_ms"] = _median(times)
        row["step_ms_p25"], row["step_ms_p75"] = _quartiles(times)
        rows.append(row)
    return rows


def _fit_times(record: RunRecord) -> list[float]:
    """Batch times of every epoch but the first (which compiles), or the first if alone."""
    later = [t for epoch in record.batch_ms[1:] for t in epoch]
    return later or [t for epoch in record.batch_ms[:1] for t in epoch]


def _metric_floor(recipe: Recipe, data: Dataset) -> float:
    """The resolution of the compared metric: two held-out predictions of an accuracy."""
    if "accuracy" in recipe.metric:
        return 2.0 / max(int(np.asarray(data.y_val).size), 1)
    return 0.0


def run_summaries(records: dict[str, RunRecord]) -> dict[str, Any]:
    """Per run: its epochs (:func:`_epochs`), wall time, and fit's step times (median, p25,
    p75 over the epochs after the first)."""
    runs: dict[str, Any] = {}
    for name, rec in records.items():
        times = _fit_times(rec)
        p25, p75 = _quartiles(times)
        runs[name] = {"epochs": _epochs(rec), "seconds": rec.seconds,
                      "fit_step_ms": {"median_ms": _median(times), "p25_ms": p25,
                                      "p75_ms": p75, "steps": len(times)}}
    return runs


def step_timing(interleaved: dict[str, Any], runs: dict[str, Any],
                args: argparse.Namespace) -> dict[str, Any]:
    """The interleaved step times, the tfmx/stock ratios (interleaved and in fit), and the
    best alternative to tfmx (stock or XLA, the faster) with tfmx's ratio to it."""
    timing: dict[str, Any] = {"interleaved": {r: {k: t[k] for k in ("median_ms", "p25_ms",
                                                                    "p75_ms", "min_ms",
                                                                    "first_call_s")}
                                              for r, t in interleaved.items()},
                              "rounds": args.rounds, "steps": args.steps,
                              "ratio": None, "fit_ratio": None, "best_alternative": None,
                              "ratio_to_best": None}
    if STOCK in interleaved and TFMX in interleaved:
        timing["ratio"] = interleaved[TFMX]["median_ms"] / interleaved[STOCK]["median_ms"]
        best = min((m for m in (STOCK, XLA) if m in interleaved),
                   key=lambda m: interleaved[m]["median_ms"])
        timing["best_alternative"] = {"mode": best, "ms": interleaved[best]["median_ms"]}
        timing["ratio_to_best"] = interleaved[TFMX]["median_ms"] / interleaved[best]["median_ms"]
    fits = {r: runs[r]["fit_step_ms"]["median_ms"] for r in (STOCK, TFMX) if r in runs}
    if fits.get(STOCK) and fits.get(TFMX):
        timing["fit_ratio"] = fits[TFMX] / fits[STOCK]
    return timing


def comparison(recipe: Recipe, data: Dataset, runs: dict[str, Any]) -> dict[str, Any]:
    """The final held-out metric and val_loss of each run, the stock-tfmx differences and
    whether they are within the stock' noise."""
    finals = {r: runs[r]["epochs"][-1].get(recipe.metric) if runs[r]["epochs"] else None
              for r in runs}
    comp: dict[str, Any] = {"metric": recipe.metric, "higher_is_better":
                            recipe.higher_is_better, "stock": finals.get(STOCK),
                            "tfmx": finals.get(TFMX), "baseline": finals.get(BASELINE),
                            "difference": None, "noise": None, "within_noise": None,
                            "floor": _metric_floor(recipe, data)}
    if comp["stock"] is not None and comp["tfmx"] is not None:
        comp["difference"] = abs(comp["tfmx"] - comp["stock"])
        if comp["baseline"] is not None:
            inside, _, noise = within_noise(comp["stock"], comp["tfmx"], comp["baseline"],
                                            comp["floor"])
            comp["within_noise"], comp["noise"] = inside, noise
    losses = {r: runs[r]["epochs"][-1].get("val_loss") if runs[r]["epochs"] else None
              for r in runs}
    comp["val_loss"] = {"stock": losses.get(STOCK), "tfmx": losses.get(TFMX),
                        "baseline": losses.get(BASELINE), "difference": None,
                        "noise": None, "within_noise": None}
    if losses.get(STOCK) is not None and losses.get(TFMX) is not None:
        comp["val_loss"]["difference"] = abs(losses[TFMX] - losses[STOCK])
        if losses.get(BASELINE) is not None:
            inside, _, noise = within_noise(losses[STOCK], losses[TFMX], losses[BASELINE],
                                            floor=1e-6 * abs(losses[STOCK]))
            comp["val_loss"]["noise"] = noise
            comp["val_loss"]["within_noise"] = inside
    return comp


def tfmx_step(report: Any) -> dict[str, Any]:
    """Which train step the tfmx run kept, read from its ``tfmx.report()``: ``form`` (``fused``,
    ``stock``, ``xla``, or None before any trace), ``how`` (``measured faster``, ``fuse=always``,
    ``price gate``, ...), ``why`` (the price gate's or the guard's words, else "") and ``line``
    (the report's first line).

    >>> class Trace:
    ...     function, status, tune_seconds = "M.train_step", "rewritten", 0.0
    >>> class Report:
    ...     traces, guards, gates, fuse = [Trace()], [], {}, "always"
    >>> step = tfmx_step(Report())
    >>> step["form"], step["how"]
    ('fused', 'fuse=always')
    >>> Trace.status, Report.fuse = "stock: price gate", "measured"
    >>> Report.gates = {"M.train_step": "a fit of 8 calls cannot pay for tfmx's first call"}
    >>> step = tfmx_step(Report())
    >>> step["form"], step["how"], step["why"]
    ('stock', 'price gate', "a fit of 8 calls cannot pay for tfmx's first call")
    """
    from tfmx.verdict import verdict

    traces = list(getattr(report, "traces", []) or [])
    out: dict[str, Any] = {"form": None, "how": "", "why": "", "line": verdict(report),
                           "function": None}
    if not traces:
        return out
    trace = next((t for t in traces if "train" in t.function), traces[0])
    out["function"] = trace.function
    guard = next((g.summary() for g in getattr(report, "guards", []) or []
                  if g.summary().function == trace.function), None)
    status = str(trace.status)
    if guard is not None and guard.kept in ("fused", "stock", "xla"):
        out["form"] = guard.kept
        if not guard.final:
            out["how"] = "guard's trial paused: budget spent"
        else:
            out["how"] = "measured no faster" if guard.kept == "stock" else "measured faster"
        out["why"] = guard.reason
    elif status == "rewritten":
        out["form"] = "fused"
        out["how"] = ("fuse=always" if getattr(report, "fuse", "") == "always"
                      else "untimed: guard off")
    elif status.startswith("stock"):
        out["form"] = "stock"
        out["how"] = status.partition(":")[2].strip()
        out["why"] = (getattr(report, "gates", None) or {}).get(trace.function, "")
    else:
        out["how"] = status
    return out


def step_cell(step: dict[str, Any] | None) -> str:
    """The tour's "tfmx step" cell: ``fused (measured faster)``, ``fused (fuse=always)``,
    ``stock (price gate)``, ...

    >>> step_cell({"form": "fused", "how": "fuse=always"}), step_cell(None)
    ('fused (fuse=always)', '-')
    """
    if not step or not step.get("form"):
        return "-"
    return f"{step['form']} ({step['how']})" if step.get("how") else step["form"]


def _table(result: dict[str, Any]) -> str:
    """One row per run: final loss, final held-out metric, fit's and the interleaved median
    step times, training seconds."""
    runs, comp = result["runs"], result["comparison"]
    metric = comp["metric"]
    inter = result["timing"].get("interleaved", {})
    lines = [f"{'run':<8} {'final loss':>10} {'held-out ' + metric[4:]:>22} {'fit ms/step':>12} "
             f"{'interleaved ms':>15} {'train s':>8}"]
    for run, rec in runs.items():
        last = rec["epochs"][-1] if rec["epochs"] else {}
        fit = rec["fit_step_ms"].get("median_ms")
        il = inter.get(run, {}).get("median_ms")
        lines.append(f"{run:<8} {last.get('loss', float('nan')):>10.4f} "
                     f"{last.get(metric, float('nan')):>22.4f} "
                     f"{fit if fit is not None else float('nan'):>12.2f} "
                     f"{il if il is not None else float('nan'):>15.2f} {rec['seconds']:>8.1f}")
    return "\n".join(lines)


def print_comparison(result: dict[str, Any]) -> None:
    """Print the table, the step-time ratios, XLA's time beside tfmx's, and the final metric
    and val_loss differences against the stock' noise (a warning when outside it)."""
    comp, timing = result["comparison"], result["timing"]
    print("\n" + _table(result))
    step = result.get("tfmx_report", {}).get("step") or {}
    if step.get("form"):  # one line: the step kept, and for a fit too short, what pays
        why = f": {step['why']}" if step["form"] == "stock" and step.get("why") else ""
        hint = ("; in a recipe, --fuse always runs the fused step (untimed by the guard)"
                if step["how"] == "price gate" else "")
        print(f"\ntfmx run's train step: {step_cell(step)}{why}{hint}")
    if timing.get("ratio") is not None:
        print(f"\nstep time tfmx/stock: {timing['ratio']:.3f} interleaved "
              f"({timing['rounds']} rounds x {timing['steps']} steps, warm-up excluded), "
              f"{timing['fit_ratio']:.3f} in fit (epochs after the first)"
              + ("; both runs trained stock's step, so this is timing noise"
                 if step.get("form") == "stock" else ""))
    xla = timing.get("interleaved", {}).get(XLA)
    if xla is not None and timing.get("best_alternative"):
        best = timing["best_alternative"]
        print(f"XLA (jit_compile=True) {xla['median_ms']:.2f} ms (compile "
              f"{xla['first_call_s']:.1f} s); best alternative {best['mode']} "
              f"{best['ms']:.2f} ms; tfmx / best {timing['ratio_to_best']:.3f}")
    if comp.get("tfmx") is None or comp.get("stock") is None:
        return
    m = comp["metric"]
    line = f"final {m}: stock {comp['stock']:.4f}, tfmx {comp['tfmx']:.4f}"
    if comp.get("baseline") is None:
        print(line + f" (|difference| {comp['difference']:.4f}; no stock' baseline run)")
        return
    print(line + f", stock' {comp['baseline']:.4f}")
    print(f"|stock - tfmx| = {comp['difference']:.4f}   |stock - stock'| = {comp['noise']:.4f}"
          f"   (stock' = stock from weights x (1 + {PERTURBATION:g} noise): float32 rounding "
          "alone)")
    vl = comp["val_loss"]
    if vl["noise"] is not None:
        print(f"final val_loss: stock {vl['stock']:.6f}, tfmx {vl['tfmx']:.6f}, stock' "
              f"{vl['baseline']:.6f}: |stock - tfmx| = {vl['difference']:.2e}, "
              f"|stock - stock'| = {vl['noise']:.2e}")
        if not vl["within_noise"]:
            print("note: the val_loss difference is outside stock's rounding noise (more than "
                  "3 x |stock - stock'|): expected under a 16-bit --policy; in float32, a sign "
                  "that tfmx's kernels round differently enough to matter (or that one stock' "
                  "run underestimates the noise: try another --seed)")
    if comp["within_noise"]:
        print("the tfmx difference is within the noise of float32 rounding")
    else:
        print(f"WARNING: the tfmx difference is outside the noise: {comp['difference']:.4f} > "
              f"max(3 x {comp['noise']:.4f}, {comp['floor']:.4f}). One baseline run is a rough "
              "estimate: rerun with another --seed, or more --epochs, before reading it as a "
              "numerical problem.")
