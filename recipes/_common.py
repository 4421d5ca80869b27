"""What every recipe shares: the flags, the stock-vs-tfmx runner, and its outputs.

A recipe is a :class:`Recipe` (how to load its data, build and compile its model, which metric
it reports, its default and ``--quick`` sizes); :func:`run` does the rest:

1. Flags in the style of keras-cv's and timm's training scripts (:func:`parser`):
   ``--epochs``, ``--batch-size``, ``--seed``, ``--policy``, ``--compare`` (the default) or
   ``--tfmx-only``, ``--quick``, ``--out DIR``, ``--rounds``, ``--samples``,
   ``--no-baseline``, ``--workers N`` (N local workers under MultiWorkerMirroredStrategy,
   the tfmx run only: :mod:`recipes._workers`); bad values stop with an argparse error before
   anything is built, and an
   unknown ``--policy`` raises ValueError (``policies.names.check_name``) before training.
2. Runs from the same initial weights, each after ``keras.utils.set_random_seed(seed)`` (same
   shuffling): ``stock`` (``tfmx.disable()``), ``tfmx`` (``tfmx.enable()``, under
   ``--policy`` when given) and the chaos baseline ``stock'``: stock again from the initial
   weights times ``1 + 1e-7 * N(0, 1)``. Float32 rounding differences grow over hundreds of
   steps, so ``|stock - stock'|`` is how far the final metric moves from rounding alone; the
   ``|stock - tfmx|`` difference is printed beside it, with a warning when it is larger than
   that noise allows (:func:`within_noise`).
3. Step times: a callback times every training batch in ``fit`` (the first epoch's first,
   tracing, step excluded; median and p25-p75 per epoch), and at the end the two traced train
   functions are timed interleaved (:func:`bench.timing.time_step_functions`).
4. Outputs in ``--out`` (default ``runs/<recipe>-<timestamp>``): ``metrics.json``
   (:data:`METRICS_KEYS`), ``<recipe>.png`` (loss and metric curves of every run, step-time
   bars with p25-p75 spread; needs matplotlib), ``tensorboard/<run>/`` (a
   ``keras.callbacks.TensorBoard`` log per run), and a final table in the terminal.

Example:
    >>> p = parser(Recipe("demo", "a demo", load=None, build=None))
    >>> args = p.parse_args(["--epochs", "3", "--tfmx-only", "--out", "/tmp/tfmx-demo"])
    >>> args.epochs, args.compare
    (3, False)
    >>> within_noise(0.90, 0.93, 0.905, floor=0.001)
    (False, 0.03, 0.005)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from recipes import _workers
from recipes._data import Dataset

STOCK, TFMX, BASELINE, XLA = "stock", "tfmx", "stock'", "xla"
#: The relative size of the chaos baseline's weight perturbation.
PERTURBATION = 1e-7
#: The top-level keys of every ``metrics.json``.
METRICS_KEYS = ("recipe", "summary", "args", "data", "runs", "timing", "comparison",
                "environment", "tfmx_report", "outputs", "seconds")


@dataclasses.dataclass
class Recipe:
    """One recipe: its name, what it shows, and how to load, build and compile.

    ``load(args)`` returns a :class:`recipes._data.Dataset`; ``build(args, data)`` an
    uncompiled Keras model (weights drawn from the seed set just before the call);
    ``compile(model, args, total_steps)`` compiles it (default: Adam with a cosine-decayed
    learning rate ``args.lr``, sparse cross-entropy, accuracy). ``metric`` is the held-out
    metric compared at the end. ``defaults`` and ``quick`` give the sizes (``epochs``,
    ``batch_size``, ``samples``, ``rounds``, ``steps``, ``lr`` and any recipe extra).
    ``extra_args(parser)`` adds recipe flags. ``train`` replaces ``fit`` (custom loops): see
    :func:`fit_run` for its signature; ``xla_step`` then replaces :func:`xla_fit_step`.
    """

    name: str
    summary: str
    load: Callable[[argparse.Namespace], Dataset] | None
    build: Callable[[argparse.Namespace, Dataset], Any] | None
    compile: Callable[[Any, argparse.Namespace, int], Any] | None = None
    metric: str = "val_accuracy"
    higher_is_better: bool = True
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    quick: dict[str, Any] = dataclasses.field(default_factory=dict)
    extra_args: Callable[[argparse.ArgumentParser], None] | None = None
    default_policy: str | None = None
    train: Callable[..., RunRecord] | None = None
    xla_step: Callable[..., tuple[Any, Any]] | None = None
    description: str = ""


@dataclasses.dataclass
class RunRecord:
    """One training run: the model, its per-epoch history, its batch times per epoch (ms), a
    step function and an iterator factory for the interleaved timing, and its wall time."""

    model: Any
    history: dict[str, list[float]]
    batch_ms: list[list[float]]
    step_fn: Callable[[Any], Any] | None
    iterator: Callable[[str], Any] | None
    seconds: float = 0.0


# -- flags -----------------------------------------------------------------------------------
def positive_int(text: str) -> int:
    """argparse type: an integer >= 1.

    >>> positive_int("4")
    4
    >>> positive_int("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be a positive integer, got '0'
    """
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a float > 0.

    >>> positive_float("1e-3")
    0.001
    """
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or not np.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def parser(recipe: Recipe) -> argparse.ArgumentParser:
    """The recipe's flags: the shared ones, then the recipe's extras."""
    d, q = recipe.defaults, recipe.quick

    def default(key: str) -> str:
        return f"default {d.get(key)}; {q.get(key, d.get(key))} with --quick"

    p = argparse.ArgumentParser(
        prog=f"python -m recipes.{recipe.name}",
        description=recipe.description or recipe.summary,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--epochs", type=positive_int, default=None,
                   help=f"epochs ({default('epochs')})")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help=f"batch size ({default('batch_size')})")
    p.add_argument("--samples", type=positive_int, default=None,
                   help=f"training samples ({default('samples')})")
    p.add_argument("--lr", type=positive_float, default=None,
                   help=f"peak learning rate, cosine-decayed to 0 ({default('lr')})")
    p.add_argument("--seed", type=int, default=1234, help="seed of the weights and shuffling")
    p.add_argument("--policy", default=recipe.default_policy,
                   help="build and compile the tfmx run under this policies name (float32, "
                        "mixed_float16, mixed_bfloat16, auto); stock stays float32 "
                        f"(default {recipe.default_policy})")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--compare", dest="compare", action="store_true", default=True,
                       help="train stock, tfmx and the stock' baseline; time stock and tfmx "
                            "interleaved (the default)")
    which.add_argument("--tfmx-only", dest="compare", action="store_false",
                       help="train and time the tfmx run only")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the stock' run (stock from weights perturbed by 1e-7): no "
                        "noise estimate")
    p.add_argument("--xla", action="store_true",
                   help="also time the step compiled by XLA (jit_compile=True, built from the "
                        "same weights, not trained) interleaved with stock and tfmx: the best "
                        "alternative a user has without tfmx")
    p.add_argument("--quick", action="store_true", help="a small run (tests, CI)")
    p.add_argument("--rounds", type=positive_int, default=None,
                   help=f"interleaved timing rounds ({default('rounds')})")
    p.add_argument("--out", metavar="DIR", default=None,
                   help=f"output folder (default runs/{recipe.name}-<timestamp>)")
    p.add_argument("--workers", type=positive_int, default=1,
                   help="train with N local worker processes under MultiWorkerMirroredStrategy "
                        "(loopback; the tfmx run only: Keras's own fit fails under several "
                        "workers, keras-team/keras#20585); default 1")
    if recipe.extra_args:
        recipe.extra_args(p)
    return p


def _writable_dir(path: str) -> Path:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    probe = out / ".write-test"
    probe.write_text("")
    probe.unlink()
    return out


def parse(recipe: Recipe, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and validate: sizes filled from ``--quick`` or the defaults, ``--out`` created
    and writable (else an argparse error), ``--policy`` checked (ValueError if unknown)."""
    p = parser(recipe)
    args = p.parse_args(argv)
    sizes = {**recipe.defaults, **(recipe.quick if args.quick else {})}
    for key, value in sizes.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.policy:
        from policies.names import check_name

        check_name(args.policy)  # ValueError now, not after the stock run
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    try:
        args.out = _writable_dir(args.out or os.path.join("runs", f"{recipe.name}-{stamp}"))
    except OSError as err:
        p.error(f"argument --out: cannot write to {args.out!r} ({err.strerror or err})")
    if args.workers > 1 and recipe.train is not None:
        p.error(f"argument --workers: recipes.{recipe.name} runs its own training loop, which "
                "--workers does not distribute; it takes --workers 1 only")
    if _workers.in_worker():  # the tfmx run alone, every step a collective of the workers
        args.compare, args.no_baseline, args.xla = False, True, False
    return args


# -- runs ------------------------------------------------------------------------------------
def _batch_timer(store: list[list[float]]) -> Any:
    """A callback appending each epoch's batch times (ms) to ``store``; the very first batch
    (tracing, rewriting) is left out."""
    import keras

    class BatchTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
            store.append([])

        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            if logs and "loss" in logs:
                np.asarray(logs["loss"])  # wait for the step
            if len(store) > 1 or batch > 0:
                store[-1].append((time.perf_counter() - self._t0) * 1000.0)

    return BatchTimer()


def schedule(peak: float, total_steps: int) -> Any:
    """The recipes' learning rate: a linear warm-up over the first 10% of the steps (at most
    200) to ``peak``, then a cosine decay to 0 at the last step.

    >>> s = schedule(1e-3, 100)
    >>> float(s(0)), round(float(s(10)), 6), round(float(s(100)), 6)
    (0.0, 0.001, 0.0)
    """
    import keras

    warmup = min(max(total_steps // 10, 1), 200)
    return keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=max(total_steps - warmup, 1), warmup_target=peak, warmup_steps=warmup)


def progress_verbosity(args: argparse.Namespace) -> int:
    """Keras's ``verbose``: progress bars (1) on a terminal, one line per epoch (2) with
    ``--quick`` or when the output goes to a file or pipe (bars would fill it with redraws)."""
    return 2 if args.quick or not sys.stdout.isatty() else 1


def default_compile(model: Any, args: argparse.Namespace, total_steps: int) -> Any:
    """Adam on :func:`schedule` (peak ``args.lr``), sparse categorical cross-entropy,
    accuracy."""
    import keras

    model.compile(optimizer=keras.optimizers.Adam(schedule(args.lr, total_steps)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def tensorboard_callback(out: Path, run: str) -> Any:
    """A callback writing per-epoch scalars (the fit logs) to ``out/tensorboard/<run>``:
    ``keras.callbacks.TensorBoard`` when the tensorboard package is installed; else the same
    scalar events through TensorFlow's own summary writer (``tf.summary.write`` with the
    scalars plugin's metadata, which TensorBoard reads), since TensorFlow no longer installs
    tensorboard and Keras's callback then fails at its first scalar."""
    import keras

    log_dir = str(out / "tensorboard" / run.replace("'", "_prime"))
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return _EpochScalars.make(log_dir)
    return keras.callbacks.TensorBoard(log_dir=log_dir, write_graph=False, profile_batch=0,
                                       update_freq="epoch")


class _EpochScalars:
    """A Keras callback factory: each epoch's logs as TensorBoard scalar events
    (``train/<key>`` and ``validation/<key>``, as Keras's TensorBoard callback names them)."""

    @staticmethod
    def make(log_dir: str) -> Any:
        import keras
        import tensorflow as tf
        from tensorflow.core.framework import summary_pb2

        metadata = summary_pb2.SummaryMetadata()
        metadata.plugin_data.plugin_name = "scalars"
        writers: dict[str, Any] = {}

        class EpochScalars(keras.callbacks.Callback):
            def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
                for key, value in (logs or {}).items():
                    side = "validation" if key.startswith("val_") else "train"
                    name = key[4:] if side == "validation" else key
                    if side not in writers:
                        writers[side] = tf.summary.create_file_writer(f"{log_dir}/{side}")
                    with writers[side].as_default():
                        tf.summary.write(f"epoch_{name}", tf.constant(float(value)), step=epoch,
                                         metadata=metadata)

            def on_train_end(self, logs: dict | None = None) -> None:
                for writer in writers.values():
                    writer.flush()

        return EpochScalars()


_strategy: list[Any] = []  # the worker's MultiWorkerMirroredStrategy, once made (recipes._workers)


def strategy_scope() -> Any:
    """The worker's strategy scope (models built and compiled in it), else a null context."""
    return _strategy[0].scope() if _strategy else contextlib.nullcontext()


def fit_run(recipe: Recipe, args: argparse.Namespace, data: Dataset, run: str,
            weights: list[np.ndarray]) -> RunRecord:
    """Build, compile and ``fit`` one run from ``weights`` (the switch and the policy are
    already set by the caller); what :attr:`Recipe.train` replaces."""
    import keras

    with strategy_scope():
        model = recipe.build(args, data)
        steps_per_epoch = len(data.x_train) // args.batch_size
        (recipe.compile or default_compile)(model, args, steps_per_epoch * args.epochs)
    model.set_weights(weights)
    keras.utils.set_random_seed(args.seed)  # the same shuffling in every run
    batch_ms: list[list[float]] = []
    start = time.perf_counter()
    history = model.fit(
        data.x_train, data.y_train, batch_size=args.batch_size, epochs=args.epochs,
        validation_data=(data.x_val, data.y_val), verbose=progress_verbosity(args),
        callbacks=[_batch_timer(batch_ms), tensorboard_callback(args.out, run)],
    ).history
    seconds = time.perf_counter() - start
    dataset = timing_dataset(data, args.batch_size)
    return RunRecord(model, {k: [float(v) for v in vs] for k, vs in history.items()}, batch_ms,
                     model.train_function, lambda _mode: iter(dataset), seconds)


def timing_dataset(data: Dataset, batch_size: int) -> Any:
    """The training data as full batches, repeating: what the interleaved timing feeds."""
    import tensorflow as tf

    n = (len(data.x_train) // batch_size) * batch_size
    dataset = tf.data.Dataset.from_tensor_slices((data.x_train[:n], data.y_train[:n]))
    return dataset.batch(batch_size, drop_remainder=True).repeat()


def xla_fit_step(recipe: Recipe, args: argparse.Namespace, data: Dataset,
                 weights: list[np.ndarray]) -> tuple[Any, Any]:
    """The recipe's model compiled with ``jit_compile=True`` from ``weights`` (tfmx disabled;
    not trained): its train function and an iterator factory, for the interleaved timing."""
    model = recipe.build(args, data)
    steps = len(data.x_train) // args.batch_size
    (recipe.compile or default_compile)(model, args, steps * args.epochs)
    model.jit_compile = True
    model.set_weights(weights)
    model.make_train_function(force=True)
    dataset = timing_dataset(data, args.batch_size)
    return model.train_function, lambda _mode: iter(dataset)


def perturbed(weights: list[np.ndarray], seed: int,
              scale: float = PERTURBATION) -> list[np.ndarray]:
    """``weights`` times ``1 + scale * N(0, 1)`` elementwise (float arrays; others as is).

    >>> w = perturbed([np.ones(4, np.float32)], seed=0, scale=1e-3)
    >>> bool(np.all(np.abs(w[0] - 1) < 1e-2)), bool(np.any(w[0] != 1)), w[0].dtype.name
    (True, True, 'float32')
    """
    rng = np.random.default_rng(seed)
    out = []
    for w in weights:
        if np.issubdtype(w.dtype, np.floating):
            w = (w * (1.0 + scale * rng.standard_normal(w.shape))).astype(w.dtype)
        out.append(w)
    return out


def _train_all(recipe: Recipe, args: argparse.Namespace, data: Dataset,
               initial: list[np.ndarray]) -> dict[str, RunRecord]:
    import tfmx

    plan = [TFMX]
    if args.compare:
        plan = [STOCK, TFMX] + ([] if args.no_baseline else [BASELINE])
    train = recipe.train or fit_run
    records: dict[str, RunRecord] = {}
    for run in plan:
        # the step function is built and traced inside fit: the switch is set first
        tfmx.enable() if run == TFMX else tfmx.disable()
        context: Any = contextlib.nullcontext()
        if run == TFMX and args.policy:
            import policies

            context = policies.scope(args.policy)
            print(f"tfmx run under policy {args.policy!r}: {policies.resolve(args.policy)}")
        weights = perturbed(initial, args.seed) if run == BASELINE else initial
        print(f"\n== {run} ==", flush=True)
        with context:  # layers read the policy when built; compile applies its safe defaults
            records[run] = train(recipe, args, data, run, weights)
    return records


def _time_interleaved(recipe: Recipe, records: dict[str, RunRecord], args: argparse.Namespace,
                      data: Dataset, initial: list[np.ndarray]) -> dict:
    """The traced step functions of stock and tfmx (and XLA's with ``--xla``), timed
    interleaved (tfmx enabled)."""
    import tfmx
    from bench.timing import time_step_functions

    fns = {r: records[r].step_fn for r in (STOCK, TFMX)
           if r in records and records[r].step_fn is not None}
    iterators = {r: records[r].iterator for r in fns}
    if not fns:
        return {}
    if args.xla:
        tfmx.disable()
        context: Any = contextlib.nullcontext()
        if args.policy:
            import policies

            context = policies.scope(args.policy)
        print("\n== xla (jit_compile=True; timed only) ==", flush=True)
        with context:
            fns[XLA], iterators[XLA] = (recipe.xla_step or xla_fit_step)(recipe, args, data,
                                                                          initial)
    tfmx.enable()
    timing = time_step_functions(fns, lambda mode: iterators[mode](mode), rounds=args.rounds,
                                 steps=args.steps)
    return {r: dict(t) for r, t in timing.items()}


# -- numbers ---------------------------------------------------------------------------------
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


def _report_summary(report: Any) -> dict[str, Any]:
    d = report.to_dict()
    d.pop("op_histogram", None)
    d["fused"] = report.fused()
    return d


def _environment() -> dict[str, Any]:
    from bench.environment import environment

    env = environment()
    env["onednn_state"] = "on" if env["onednn"] else "off"
    return env


def _metric_floor(recipe: Recipe, data: Dataset) -> float:
    """The resolution of the compared metric: two held-out predictions of an accuracy."""
    if "accuracy" in recipe.metric:
        return 2.0 / max(int(np.asarray(data.y_val).size), 1)
    return 0.0


# -- outputs ---------------------------------------------------------------------------------
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


def _table(result: dict[str, Any]) -> str:
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


def _print_comparison(result: dict[str, Any]) -> None:
    comp, timing = result["comparison"], result["timing"]
    print("\n" + _table(result))
    if timing.get("ratio") is not None:
        print(f"\nstep time tfmx/stock: {timing['ratio']:.3f} interleaved "
              f"({timing['rounds']} rounds x {timing['steps']} steps, warm-up excluded), "
              f"{timing['fit_ratio']:.3f} in fit (epochs after the first)")
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
    if _workers.in_worker() and not _strategy:
        _strategy.append(_workers.strategy())  # before TensorFlow runs anything else
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
        with strategy_scope():
            initial = recipe.build(args, data).get_weights()
        records = _train_all(recipe, args, data, initial)
        report = tfmx.report()
        print("\n" + str(report))
        # under several workers each step is a collective of all of them: fit's times only
        interleaved = {} if _strategy else _time_interleaved(recipe, records, args, data,
                                                              initial)
    finally:
        tfmx.enable() if was_enabled else tfmx.disable()
    runs: dict[str, Any] = {}
    for name, rec in records.items():
        times = _fit_times(rec)
        p25, p75 = _quartiles(times)
        runs[name] = {"epochs": _epochs(rec), "seconds": rec.seconds,
                      "fit_step_ms": {"median_ms": _median(times), "p25_ms": p25,
                                      "p75_ms": p75, "steps": len(times)}}
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
    finals = {r: runs[r]["epochs"][-1].get(recipe.metric) if runs[r]["epochs"] else None
              for r in runs}
    comparison: dict[str, Any] = {"metric": recipe.metric, "higher_is_better":
                                  recipe.higher_is_better, "stock": finals.get(STOCK),
                                  "tfmx": finals.get(TFMX), "baseline": finals.get(BASELINE),
                                  "difference": None, "noise": None, "within_noise": None,
                                  "floor": _metric_floor(recipe, data)}
    if comparison["stock"] is not None and comparison["tfmx"] is not None:
        comparison["difference"] = abs(comparison["tfmx"] - comparison["stock"])
        if comparison["baseline"] is not None:
            inside, _, noise = within_noise(comparison["stock"], comparison["tfmx"],
                                            comparison["baseline"], comparison["floor"])
            comparison["within_noise"], comparison["noise"] = inside, noise
    losses = {r: runs[r]["epochs"][-1].get("val_loss") if runs[r]["epochs"] else None
              for r in runs}
    comparison["val_loss"] = {"stock": losses.get(STOCK), "tfmx": losses.get(TFMX),
                              "baseline": losses.get(BASELINE), "difference": None,
                              "noise": None, "within_noise": None}
    if losses.get(STOCK) is not None and losses.get(TFMX) is not None:
        comparison["val_loss"]["difference"] = abs(losses[TFMX] - losses[STOCK])
        if losses.get(BASELINE) is not None:
            inside, _, noise = within_noise(losses[STOCK], losses[TFMX], losses[BASELINE],
                                            floor=1e-6 * abs(losses[STOCK]))
            comparison["val_loss"]["noise"] = noise
            comparison["val_loss"]["within_noise"] = inside
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
    _print_comparison(result)
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

