"""Training a recipe's runs and timing their steps.

Every run starts from the same initial weights, each after ``keras.utils.set_random_seed(seed)``
(the same shuffling): ``stock``, ``tfmx`` and the chaos baseline ``stock'`` (stock from the
initial weights times ``1 + 1e-7 * N(0, 1)``: :func:`perturbed`), trained by :func:`train_all`
(``fit`` through :func:`fit_run`, or the recipe's own loop). A callback times every training
batch in ``fit`` (the first epoch's first, tracing, step excluded); at the end the traced train
functions of stock and tfmx (and XLA's with ``--xla``) are timed interleaved
(:func:`time_interleaved`, :func:`recipes._timing.time_step_functions`). Each run writes its
TensorBoard scalars to ``<out>/tensorboard/<run>/`` (:func:`tensorboard_callback`).

Example:
    >>> w = perturbed([np.full(3, 2.0, np.float32)], seed=1)
    >>> bool(np.all(np.abs(w[0] / 2.0 - 1) < 1e-6)), bool(np.any(w[0] != 2.0))
    (True, True)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from recipes import _workers
from recipes._data import Dataset
from recipes._recipe import BASELINE, PERTURBATION, STOCK, TFMX, XLA, Recipe, RunRecord


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


def start_worker_strategy() -> None:
    """In a worker (:func:`recipes._workers.in_worker`), make its strategy once: before
    TensorFlow runs anything else."""
    if _workers.in_worker() and not _strategy:
        _strategy.append(_workers.strategy())


def distributed() -> bool:
    """True once a worker's strategy is made: every step is then a collective of the workers."""
    return bool(_strategy)


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


def train_all(recipe: Recipe, args: argparse.Namespace, data: Dataset,
              initial: list[np.ndarray]) -> dict[str, RunRecord]:
    """Train the runs from ``initial``: tfmx alone, or with ``--compare`` stock, tfmx and
    (unless ``--no-baseline``) stock' from :func:`perturbed` weights, in that order."""
    import tfmx

    plan = [TFMX]
    if args.compare:
        plan = [STOCK, TFMX] + ([] if args.no_baseline else [BASELINE])
    train = recipe.train or fit_run
    records: dict[str, RunRecord] = {}
    for run in plan:
        # the step function is built and traced inside fit: the switch is set first
        tfmx.enable(fuse=getattr(args, "fuse", None)) if run == TFMX else tfmx.disable()
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


def time_interleaved(recipe: Recipe, records: dict[str, RunRecord], args: argparse.Namespace,
                     data: Dataset, initial: list[np.ndarray]) -> dict:
    """The traced step functions of stock and tfmx (and XLA's with ``--xla``), timed
    interleaved (tfmx enabled)."""
    import tfmx
    from recipes._timing import time_step_functions

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
    tfmx.enable(fuse=getattr(args, "fuse", None))
    timing = time_step_functions(fns, lambda mode: iterators[mode](mode), rounds=args.rounds,
                                 steps=args.steps)
    return {r: dict(t) for r, t in timing.items()}
