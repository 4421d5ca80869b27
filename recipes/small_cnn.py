"""A small CNN on synthetic images: fused Conv2D+bias+relu, a residual Add, Dense relu, Adam.

The data needs no network: 10 classes of 32x32x3 images, each class a stripe orientation and
a colour tint with a blob, random phase/position and Gaussian noise (fixed numpy seed), so
accuracy rises clearly above chance (10%) within a couple of epochs. The model has what tfmx
fuses on CPU: Conv2D+bias+relu, a residual Add block, Dense+bias+relu, and Adam updates.
The default 5 epochs train both runs to convergence: at 3, held-out accuracy is still on the
steep part of its curve, where float32 rounding differences (between tfmx and stock, or two
stock runs) move it by points (0.95 against 0.99 in one run; both 0.9989 after 5).

Run it::

    python -m recipes.small_cnn            # default run, a few minutes on 2 cores
    python -m recipes.small_cnn --quick    # tiny run (tests)
    tfmx recipe small_cnn --epochs 2 --out /tmp/small_cnn

It trains stock, with tfmx and the stock' chaos baseline from the same weights (the shared
runner, ``recipes._runner``), prints Keras progress bars, ``tfmx.report()``, the final
accuracies beside stock's own rounding noise and the step times (in fit, and interleaved with
:func:`recipes._timing.time_step_functions`), and writes ``metrics.json``, ``small_cnn.png`` and
TensorBoard logs into ``--out``.

Example:
    >>> from recipes.small_cnn import make_data
    >>> x, y = make_data(20, seed=0)
    >>> x.shape, y.shape, x.dtype.name
    ((20, 32, 32, 3), (20,), 'float32')
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import numpy as np

from recipes._data import (  # noqa: F401 - make_data: the recipe's data, named here too
    STRIPE_CLASSES,
    STRIPE_SHAPE,
    Dataset,
    make_data,
    synthetic_images,
)
from recipes._recipe import Recipe
from recipes._runner import run

NUM_CLASSES = STRIPE_CLASSES
IMAGE_SHAPE = STRIPE_SHAPE
DEFAULT_SEED = 1234


def build_model(seed: int = DEFAULT_SEED) -> Any:
    """The recipe's CNN (uncompiled), with weights drawn from ``seed``.

    >>> model = build_model()  # doctest: +SKIP
    >>> model.output_shape  # doctest: +SKIP
    (None, 10)
    """
    from recipes._models import small_cnn_model  # also the benchmark's small_cnn workload

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


def _extra(p: argparse.ArgumentParser) -> None:
    p.add_argument("--noise", type=float, default=None,
                   help="std of the Gaussian pixel noise (default 2.5; 1.0 with --quick)")


def _load(args: argparse.Namespace) -> Dataset:
    held_out = max(args.samples * 15 // 100, args.batch_size)
    return synthetic_images(args.samples, held_out, seed=args.seed, noise=args.noise)


RECIPE = Recipe(
    name="small_cnn",
    summary=(__doc__ or "").strip().splitlines()[0].rstrip("."),
    load=_load,
    build=lambda args, data: build_model(args.seed),
    defaults={"epochs": 5, "batch_size": 64, "samples": 6000, "lr": 2e-3, "noise": 2.5,
              "rounds": 15, "steps": 10},
    quick={"epochs": 2, "batch_size": 32, "samples": 1024, "noise": 1.0, "rounds": 3,
           "steps": 3},
    extra_args=_extra,
)


def main(argv: Sequence[str] | None = None) -> dict:
    """Train stock, tfmx and stock', print the comparison, and return the numbers.

    ``--policy NAME`` builds the tfmx run under a ``policies`` name (the stock run stays
    float32), so the accuracies compare mixed precision with float32; an unknown name raises
    ValueError before training.

    Returns what ``metrics.json`` holds (``recipes._runner.METRICS_KEYS``) and, flat:
    ``policy``, ``epochs``, ``batch_size``, ``samples``, ``stock_accuracy``,
    ``tfmx_accuracy`` (held-out), ``stock_ms``, ``tfmx_ms`` (interleaved medians),
    ``step_time_ratio`` (tfmx/stock), ``fused`` (chains fused) and ``seconds``.

    >>> result = main(["--quick"])  # doctest: +SKIP
    >>> result["stock_accuracy"] > 0.1  # doctest: +SKIP
    True
    """
    result = run(RECIPE, argv)
    args, comp, timing = result["args"], result["comparison"], result["timing"]
    inter = timing["interleaved"]
    result.update(
        policy=args["policy"], epochs=args["epochs"], batch_size=args["batch_size"],
        samples=args["samples"], stock_accuracy=comp["stock"], tfmx_accuracy=comp["tfmx"],
        stock_ms=inter.get("stock", {}).get("median_ms"),
        tfmx_ms=inter.get("tfmx", {}).get("median_ms"), step_time_ratio=timing["ratio"],
        fused=result["tfmx_report"]["fused"],
    )
    return result


if __name__ == "__main__":
    main()
