"""Mixed precision with policies "auto" against float32 stock, on a GELU MLP over real digits.

The tfmx run is built and compiled under ``policies.scope(--policy)`` (default ``"auto"``:
``policies.resolve`` picks the policy this machine runs fastest, e.g. mixed_bfloat16 on a CPU
with AVX512_BF16, and ``policies.tune`` then times each weighted layer in float32 and 16 bit
and keeps the faster); the stock and stock' runs stay float32. The final held-out accuracy is
compared against stock's own rounding noise, so the table says whether 16-bit arithmetic cost
accuracy here, and the step times whether it paid.

Model: flattened images -> 4 x Dense(512, gelu) -> softmax Dense (float32 output). Data, best
first (each fallback announced): MNIST from the Keras cache or a download; scikit-learn's real
8x8 digits; synthetic stripe images.

Run it::

    python -m recipes.mixed_precision                  # "auto" vs float32
    python -m recipes.mixed_precision --policy mixed_bfloat16 --quick

Example:
    >>> RECIPE.default_policy
    'auto'
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from recipes import _data
from recipes._flags import positive_int
from recipes._recipe import Recipe
from recipes._runner import run


def _extra(p: argparse.ArgumentParser) -> None:
    p.add_argument("--width", type=positive_int, default=None,
                   help="units per hidden layer (default 512; 128 with --quick)")


def load(args: argparse.Namespace) -> _data.Dataset:
    """MNIST, else real digits, else synthetic images (announced)."""
    val = max(args.samples // 5, args.batch_size)
    return _data.first_available([
        ("MNIST", lambda: _data.mnist(args.samples, val)),
        ("scikit-learn digits", lambda: _data.digits(args.samples, seed=args.seed)),
        ("synthetic images", lambda: _data.synthetic_images(args.samples, val, args.seed)),
    ])


def build(args: argparse.Namespace, data: _data.Dataset) -> Any:
    """Flatten -> 4 x Dense(width, gelu) -> softmax Dense in float32 (uncompiled)."""
    import keras
    from keras import layers

    x = inp = keras.Input(data.x_train.shape[1:])
    x = layers.Flatten()(x)
    for _ in range(4):
        x = layers.Dense(args.width, activation="gelu")(x)
    out = layers.Dense(data.num_classes, activation="softmax", dtype="float32")(x)
    return keras.Model(inp, out, name="gelu_mlp")


RECIPE = Recipe(
    name="mixed_precision",
    summary=(__doc__ or "").strip().splitlines()[0].rstrip("."),
    load=load,
    build=build,
    default_policy="auto",
    defaults={"epochs": 10, "batch_size": 128, "samples": 8000, "lr": 1e-3, "width": 512,
              "rounds": 10, "steps": 5},
    quick={"epochs": 1, "batch_size": 64, "samples": 512, "width": 128, "rounds": 2,
           "steps": 2},
    extra_args=_extra,
)


def main(argv: Sequence[str] | None = None) -> dict:
    """Train stock (float32), tfmx under the policy, and stock'; print, write and return
    the numbers (``metrics.json``)."""
    return run(RECIPE, argv)


if __name__ == "__main__":
    main()
