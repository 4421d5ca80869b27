"""Small CNN on synthetic images, trained stock and with tfmx, with measured numbers.

The data needs no network: 10 classes of 32x32x3 images, each class a stripe orientation and
a colour tint with a blob, random phase/position and Gaussian noise (fixed numpy seed), so
accuracy rises clearly above chance (10%) within a couple of epochs. The model has what tfmx
fuses on CPU: Conv2D+bias+relu, a residual Add block, Dense+bias+relu, and Adam updates.
The default 5 epochs train both runs to convergence: at 3, held-out accuracy is still on the
steep part of its curve, where float32 rounding differences (between tfmx and stock, or two
stock runs) move it by points (0.95 against 0.99 in one run; both 0.9989 after 5).

Run it::

    python -m recipes.small_cnn            # default run, a couple of minutes on 2 cores
    python -m recipes.small_cnn --quick    # tiny run (tests)
    tfmx recipe small_cnn --epochs 2 --plot /tmp/loss.png

It prints Keras progress bars for both runs, ``tfmx.report()``, the final accuracies, the
largest relative weight difference between the two models, and the median step-time ratio
tfmx/stock measured interleaved with :func:`tfmx.bench.time_step_functions`.

Example:
    >>> from recipes.small_cnn import make_data
    >>> x, y = make_data(20, seed=0)
    >>> x.shape, y.shape, x.dtype.name
    ((20, 32, 32, 3), (20,), 'float32')
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

NUM_CLASSES = 10
IMAGE_SHAPE = (32, 32, 3)
DEFAULT_SEED = 1234


def make_data(
    samples: int, seed: int = DEFAULT_SEED, noise: float = 2.5
) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic 10-class images with learnable structure; deterministic for a seed.

    Class ``c`` has stripes at angle ``c * 18`` degrees, a class colour tint and a bright
    blob; phase, blob position and noise are random per image.

    >>> x, y = make_data(100, seed=1)
    >>> sorted(set(y.tolist())) == list(range(10))
    True
    >>> bool(np.all(np.isfinite(x)))
    True
    """
    rng = np.random.default_rng(seed)
    h, w, c = IMAGE_SHAPE
    y = rng.integers(0, NUM_CLASSES, size=samples)
    yy, xx = np.meshgrid(np.arange(h, dtype=np.float32), np.arange(w, dtype=np.float32),
                         indexing="ij")
    angles = y * (math.pi / NUM_CLASSES)
    freq = 2 * math.pi / 6.0
    phase = rng.uniform(0, 2 * math.pi, size=samples)
    proj = (xx[None] * np.cos(angles)[:, None, None] + yy[None] * np.sin(angles)[:, None, None])
    stripes = np.sin(freq * proj + phase[:, None, None]).astype(np.float32)
    tints = np.random.default_rng(0).uniform(0.3, 1.0, size=(NUM_CLASSES, c)).astype(np.float32)
    cy, cx = rng.uniform(6, h - 6, size=samples), rng.uniform(6, w - 6, size=samples)
    blob = np.exp(-((yy[None] - cy[:, None, None]) ** 2 + (xx[None] - cx[:, None, None]) ** 2)
                  / (2 * 3.0**2)).astype(np.float32)
    x = stripes[..., None] * tints[y][:, None, None, :] + blob[..., None] * tints[
        (y + 3) % NUM_CLASSES][:, None, None, :]
    x += rng.normal(0.0, noise, size=x.shape).astype(np.float32)
    return x.astype(np.float32), y.astype(np.int32)


def build_model(seed: int = DEFAULT_SEED) -> Any:
    """The recipe's CNN (uncompiled), with weights drawn from ``seed``.

    >>> model = build_model()  # doctest: +SKIP
    >>> model.output_shape  # doctest: +SKIP
    (None, 10)
    """
    from tfmx.bench import small_cnn_model  # the bench's small_cnn workload is this model

    return small_cnn_model(seed, IMAGE_SHAPE, NUM_CLASSES)


def compile_model(model: Any, jit_compile: bool = False) -> Any:
    """Compile with Adam and sparse cross-entropy + accuracy (what the recipe and bench use)."""
    import keras

    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        jit_compile=jit_compile,
    )
    return model


def max_relative_weight_difference(a: Any, b: Any) -> float:
    """Largest ``max|wa - wb| / max|wa|`` over the weights of two same-architecture models."""
    worst = 0.0
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        scale = float(np.max(np.abs(wa))) or 1.0
        worst = max(worst, float(np.max(np.abs(wa - wb))) / scale)
    return worst


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m recipes.small_cnn",
        description="Train a small CNN on synthetic images stock and with tfmx; compare.",
    )
    p.add_argument("--epochs", type=int, default=None,
                   help="epochs per run (default 5, where both runs have converged; 2 with "
                        "--quick)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="batch size (default 64; 32 with --quick)")
    p.add_argument("--samples", type=int, default=None,
                   help="training images (default 6000; 1024 with --quick; 15%% more are held out)")
    p.add_argument("--quick", action="store_true", help="tiny run for tests (< 40 s)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved timing rounds (default 15)")
    p.add_argument("--noise", type=float, default=None,
                   help="std of the Gaussian pixel noise (default 2.5; 1.0 with --quick)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--policy", default=None,
                   help="build and compile the tfmx run under this policies name (float32, "
                        "mixed_float16, mixed_bfloat16, auto); the stock run stays float32")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="save a PNG of the loss curves, stock vs tfmx (needs matplotlib)")
    return p


class _BatchLosses:
    """A Keras callback factory recording the loss after every batch."""

    @staticmethod
    def make(store: list[float]) -> Any:
        import keras

        class Record(keras.callbacks.Callback):
            def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
                if logs and "loss" in logs:
                    store.append(float(logs["loss"]))

        return Record()


def _plot(path: str, curves: dict[str, list[float]]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot(losses, label=name)
    ax.set_xlabel("batch")
    ax.set_ylabel("training loss (running mean per epoch)")
    ax.set_title("small_cnn: stock vs tfmx")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _sizes(args: argparse.Namespace) -> dict[str, Any]:
    """The run's sizes: the arguments given, else the quick or the default ones."""
    quick = args.quick
    return {
        "epochs": args.epochs or (2 if quick else 5),
        "batch_size": args.batch_size or (32 if quick else 64),
        "samples": args.samples or (1024 if quick else 6000),
        "noise": args.noise if args.noise is not None else (1.0 if quick else 2.5),
        "rounds": args.rounds or (3 if quick else 15),
        "steps": 3 if quick else 10,
    }


def _train_both(args: argparse.Namespace, size: dict, train: tuple, held_out: tuple,
                ) -> tuple[dict, dict, dict[str, list[float]]]:
    """Train the same model from the same weights stock, then with tfmx (under ``--policy``
    when given): (models, histories, each run's per-batch losses)."""
    import contextlib

    import keras

    import tfmx

    histories: dict[str, Any] = {}
    models: dict[str, Any] = {}
    batch_losses: dict[str, list[float]] = {"stock": [], "tfmx": []}
    initial = build_model(args.seed).get_weights()
    for mode in ("stock", "tfmx"):
        # The step function is built and traced inside fit, so the global switch is set first.
        tfmx.disable() if mode == "stock" else tfmx.enable()
        context: Any = contextlib.nullcontext()
        if mode == "tfmx" and args.policy:
            import policies

            context = policies.scope(args.policy)
            print(f"tfmx run: {policies.resolve(args.policy)}")
        with context:  # layers read the policy when built; compile applies its safe defaults
            model = compile_model(build_model(args.seed))
        model.set_weights(initial)
        keras.utils.set_random_seed(args.seed)  # same shuffling order in both runs
        print(f"\n== {mode} ==")
        histories[mode] = model.fit(
            *train, batch_size=size["batch_size"], epochs=size["epochs"],
            validation_data=held_out, verbose=1,
            callbacks=[_BatchLosses.make(batch_losses[mode])],
        ).history
        models[mode] = model
    return models, histories, batch_losses


def _compare(models: dict, histories: dict, batch_losses: dict) -> tuple:
    """Print and return (held-out accuracy, train accuracy, max relative weight difference,
    the first steps' largest relative loss difference)."""
    acc = {m: histories[m]["val_accuracy"][-1] for m in models}
    train_acc = {m: histories[m]["accuracy"][-1] for m in models}
    diff = max_relative_weight_difference(models["stock"], models["tfmx"])
    print(f"\nheld-out accuracy: stock {acc['stock']:.4f}   tfmx {acc['tfmx']:.4f}   "
          f"(chance 0.10)")
    print(f"train accuracy:    stock {train_acc['stock']:.4f}   tfmx {train_acc['tfmx']:.4f}")
    print(f"max relative weight difference after training: {diff:.3g}")
    first = min(10, len(batch_losses["stock"]), len(batch_losses["tfmx"]))
    early = max((abs(a - b) / max(abs(a), 1e-12) for a, b in
                 zip(batch_losses["stock"][:first], batch_losses["tfmx"][:first])), default=0.0)
    print(f"loss of the first {first} steps: max relative difference {early:.2g}. tfmx's kernels "
          "(oneDNN, fused optimizer updates) sum in another order than stock's, which float32 "
          "rounds differently; over hundreds of steps such differences grow, as between two "
          "stock runs started 1e-7 apart, so final weights and accuracies differ by that noise.")
    return acc, train_acc, diff, early


def _time_steps(models: dict, train: tuple, size: dict) -> tuple[dict, float]:
    """Time the two traced step functions interleaved: (timings, tfmx/stock ratio). The
    rewrite is baked into the tfmx model's traced step; tfmx stays enabled so that a retrace
    is rewritten too."""
    import tensorflow as tf

    from tfmx.bench import time_step_functions

    batch_size, rounds, steps = size["batch_size"], size["rounds"], size["steps"]
    n = (len(train[0]) // batch_size) * batch_size
    dataset = tf.data.Dataset.from_tensor_slices((train[0][:n], train[1][:n]))
    dataset = dataset.batch(batch_size, drop_remainder=True).repeat()
    timing = time_step_functions(
        {m: models[m].train_function for m in ("stock", "tfmx")},
        lambda mode: iter(dataset),
        rounds=rounds,
        steps=steps,
    )
    ratio = timing["tfmx"]["median_ms"] / timing["stock"]["median_ms"]
    print(f"\nstep time (median of {rounds} interleaved rounds x {steps} steps, warm-up "
          f"excluded): stock {timing['stock']['median_ms']:.2f} ms   "
          f"tfmx {timing['tfmx']['median_ms']:.2f} ms   ratio tfmx/stock {ratio:.3f}")
    return timing, ratio


def main(argv: Sequence[str] | None = None) -> dict:
    """Train stock and with tfmx, print the comparison, and return the numbers.

    ``--policy NAME`` builds the tfmx run under a ``policies`` name (the stock run stays
    float32), so the accuracies compare mixed precision with float32.

    Returns a dict with ``policy``, ``stock_accuracy``, ``tfmx_accuracy`` (held-out),
    ``stock_train_accuracy``,
    ``tfmx_train_accuracy``, ``max_rel_weight_diff``, ``first_steps_loss_rel_diff`` (the
    first 10 steps' losses), ``stock_ms``, ``tfmx_ms`` (median per step),
    ``step_time_ratio`` (tfmx/stock), ``fused`` (chains fused) and ``seconds`` (wall time).

    >>> result = main(["--quick"])  # doctest: +SKIP
    >>> sorted(result)[:3]  # doctest: +SKIP
    ['batch_size', 'epochs', 'first_steps_loss_rel_diff']
    """
    args = _parser().parse_args(argv)
    if args.policy:
        from policies.names import check_name

        check_name(args.policy)  # a bad name fails now, not after the stock run
    size = _sizes(args)
    start = time.perf_counter()
    import tfmx

    x, y = make_data(size["samples"] + max(size["samples"] * 15 // 100, size["batch_size"]),
                     seed=args.seed, noise=size["noise"])
    samples = size["samples"]
    train, held_out = (x[:samples], y[:samples]), (x[samples:], y[samples:])
    print(f"small_cnn: {samples} training / {len(held_out[0])} held-out synthetic 32x32x3 "
          f"images, 10 classes, noise {size['noise']}, batch {size['batch_size']}, "
          f"{size['epochs']} epoch(s)")
    models, histories, batch_losses = _train_both(args, size, train, held_out)
    report = tfmx.report()
    print("\n" + str(report))
    acc, train_acc, diff, early = _compare(models, histories, batch_losses)
    timing, ratio = _time_steps(models, train, size)
    if args.plot:
        written = _plot(args.plot, batch_losses)
        if written:
            print(f"loss curves saved to {written}")
        else:
            print("matplotlib is not installed: --plot skipped (pip install matplotlib)")
    epochs, batch_size = size["epochs"], size["batch_size"]

    seconds = time.perf_counter() - start
    print(f"total {seconds:.1f} s")
    return {
        "policy": args.policy,
        "epochs": epochs,
        "batch_size": batch_size,
        "samples": samples,
        "first_steps_loss_rel_diff": float(early),
        "stock_accuracy": float(acc["stock"]),
        "tfmx_accuracy": float(acc["tfmx"]),
        "stock_train_accuracy": float(train_acc["stock"]),
        "tfmx_train_accuracy": float(train_acc["tfmx"]),
        "stock_loss": [float(v) for v in histories["stock"]["loss"]],
        "tfmx_loss": [float(v) for v in histories["tfmx"]["loss"]],
        "max_rel_weight_diff": diff,
        "stock_ms": timing["stock"]["median_ms"],
        "tfmx_ms": timing["tfmx"]["median_ms"],
        "step_time_ratio": ratio,
        "fused": report.fused(),
        "rewrite_seconds": sum(t.seconds for t in report.traces),
        "seconds": seconds,
    }


if __name__ == "__main__":
    main()
