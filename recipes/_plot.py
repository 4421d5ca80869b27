"""The recipe's picture: loss and metric curves of every run, and step-time bars.

:func:`plot` draws from what ``metrics.json`` holds (the ``result`` of
:func:`recipes._runner.run`) and writes ``<out>/<recipe>.png``; it needs matplotlib
(``pip install -e ".[recipes]"``) and returns None without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recipes._recipe import BASELINE, STOCK, TFMX, XLA


def plot(path: Path, result: dict[str, Any]) -> Path | None:
    """Write the recipe's PNG: loss and metric curves per run (train solid, held-out dashed)
    and step-time bars (median, p25-p75 error bars) in fit and interleaved. None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = result["runs"]
    metric = result["comparison"]["metric"]
    train_metric = metric[4:] if metric.startswith("val_") else metric
    colors = {STOCK: "#1f77b4", TFMX: "#d62728", BASELINE: "#7f7f7f", XLA: "#2ca02c"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for ax, (key, title) in zip(axes[:2], (("loss", "loss"), (train_metric, train_metric))):
        for run, rec in runs.items():
            epochs = [row["epoch"] for row in rec["epochs"]]
            for k, style, label in ((key, "-", "train"), (f"val_{key}", "--", "held-out")):
                ys = [row.get(k) for row in rec["epochs"]]
                if any(v is not None for v in ys):
                    ax.plot(epochs, ys, style, marker="o", ms=3, color=colors.get(run),
                            label=f"{run} {label}", alpha=0.85 if run != BASELINE else 0.6)
        ax.set_xlabel("epoch")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[2]
    groups = [("in fit", {r: rec["fit_step_ms"] for r, rec in runs.items()}),
              ("interleaved", result["timing"].get("interleaved", {}))]
    bars = list(runs) + ([XLA] if XLA in groups[1][1] else [])
    width = 0.8 / max(len(bars), 1)
    for g, (_label, by_run) in enumerate(groups):
        for i, run in enumerate(bars):
            t = by_run.get(run)
            if not t or t.get("median_ms") is None:
                continue
            med, lo, hi = t["median_ms"], t["p25_ms"], t["p75_ms"]
            x = g + (i - (len(bars) - 1) / 2) * width
            ax.bar(x, med, width * 0.9, color=colors.get(run),
                   yerr=[[med - lo], [hi - med]], capsize=4,
                   label=run if g == 0 or run == XLA else None, alpha=0.85)
            ax.text(x, hi, f"{med:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)), [g[0] for g in groups])
    ax.set_ylabel("ms per training step (median, p25-p75)")
    ratio = result["timing"].get("ratio")
    ax.set_title("step time" + (f": tfmx/stock {ratio:.3f}" if ratio else ""))
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    env = result["environment"]
    fig.suptitle(f"recipes.{result['recipe']}: {result['summary']}\n{result['data']['source']}; "
                 f"{env.get('cpu')}, oneDNN {env.get('onednn_state')}, TF {env.get('tensorflow')}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
