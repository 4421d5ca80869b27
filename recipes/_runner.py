"""The runner every training recipe shares: :func:`run` parses the flags, trains and times the
runs, prints the comparison and writes the outputs.

A recipe is a :class:`recipes._recipe.Recipe` (how to load its data, build and compile its
model, which metric it reports, its default and ``--quick`` sizes); :func:`run` does the rest:

1. The flags (:mod:`recipes._flags`), checked before anything is built; with ``--workers N``
   the command launches N local workers instead (:mod:`recipes._workers`).
2. The runs from the same initial weights: ``stock``, ``tfmx`` and the chaos baseline
   ``stock'`` (:mod:`recipes._train`), then the traced train functions timed interleaved.
3. The comparison (:mod:`recipes._compare`): ``|stock - tfmx|`` against ``|stock - stock'|``,
   step-time ratios, and a final table in the terminal.
4. Outputs in ``--out`` (default ``runs/<recipe>-<timestamp>``): ``metrics.json``
   (:data:`METRICS_KEYS`), ``<recipe>.png`` (:mod:`recipes._plot`; needs matplotlib),
   ``tensorboard/<run>/`` (a TensorBoard log per run).

Example:
    >>> sorted(METRICS_KEYS)[:4]
    ['args', 'comparison', 'data', 'environment']
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from recipes import _compare, _train, _workers
from recipes._flags import parse
from recipes._plot import plot
from recipes._recipe import Recipe

#: The top-level keys of every ``metrics.json``.
METRICS_KEYS = ("recipe", "summary", "args", "data", "runs", "timing", "comparison",
                "environment", "tfmx_report", "outputs", "seconds")


def run(recipe: Recipe, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, load the data, train the runs, time them, print the comparison, write
    ``metrics.json``, the PNG and the TensorBoard logs; return what ``metrics.json`` holds.

    >>> run(Recipe("demo", "a demo", None, None), ["--epochs", "0"])  # doctest: +SKIP
    SystemExit: 2
    """
    args = parse(recipe, argv)
    if args.workers > 1 and not _workers.in_worker():
        return _workers.launch(recipe.name, list(sys.argv[1:] if argv is None else argv),
                               args.workers, args.out)
    _train.start_worker_strategy()  # before TensorFlow runs anything else
    start = time.perf_counter()
    import tfmx

    was_enabled = tfmx.enabled()
    data = recipe.load(args)
    print(f"recipes.{recipe.name}: {recipe.summary}")
    print(f"data: {data.describe()}")
    print(f"{args.epochs} epoch(s), batch {args.batch_size}, peak lr {args.lr}, seed {args.seed}"
          f", policy {args.policy or 'float32'} (tfmx run); output {args.out}", flush=True)
    try:
        import keras

        keras.utils.set_random_seed(args.seed)
        with _train.strategy_scope():
            initial = recipe.build(args, data).get_weights()
        records = _train.train_all(recipe, args, data, initial)
        report = tfmx.report()
        print("\n" + str(report))
        # under several workers each step is a collective of all of them: fit's times only
        interleaved = {} if _train.distributed() else _train.time_interleaved(
            recipe, records, args, data, initial)
    finally:
        tfmx.enable() if was_enabled else tfmx.disable()
    runs = _compare.run_summaries(records)
    timing = _compare.step_timing(interleaved, runs, args)
    comparison = _compare.comparison(recipe, data, runs)
    result: dict[str, Any] = {
        "recipe": recipe.name,
        "summary": recipe.summary,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "data": {"source": data.source, "train_samples": int(len(data.x_train)),
                 "val_samples": int(len(data.x_val)), "num_classes": int(data.num_classes),
                 "input_shape": list(data.x_train.shape[1:])},
        "runs": runs,
        "timing": timing,
        "comparison": comparison,
        "environment": _environment(),
        "tfmx_report": _report_summary(report),
        "outputs": {"dir": str(args.out), "tensorboard": str(args.out / "tensorboard"),
                    "png": None},
    }
    _compare.print_comparison(result)
    png = plot(args.out / f"{recipe.name}.png", result)
    if png is None:
        print("matplotlib is not installed: no PNG (pip install -e \".[recipes]\")")
    else:
        result["outputs"]["png"] = str(png)
    result["seconds"] = time.perf_counter() - start
    path = args.out / "metrics.json"
    path.write_text(json.dumps(result, indent=2, default=_jsonable) + "\n")
    print(f"wrote {path}" + (f", {png}" if png else "") +
          f", TensorBoard logs in {args.out / 'tensorboard'} ({result['seconds']:.0f} s in all)")
    sys.stdout.flush()
    return result


def _jsonable(value: Any) -> Any:
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def _report_summary(report: Any) -> dict[str, Any]:
    d = report.to_dict()
    d.pop("op_histogram", None)
    d["fused"] = report.fused()
    d["fuse"] = getattr(report, "fuse", "measured")
    d["step"] = _compare.tfmx_step(report)  # the train step the tfmx run kept, and why
    return d


def _environment() -> dict[str, Any]:
    from recipes._machine import environment

    env = environment()
    env["onednn_state"] = "on" if env["onednn"] else "off"
    return env
