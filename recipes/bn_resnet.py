"""A batch-norm ResNet on CIFAR-10 (or real digits): Conv2D + BatchNormalization, residual Adds.

The model is ``tfmx bench``'s ``bn_resnet`` workload (batch-norm momentum 0.9): 7
convolutions each followed by BatchNormalization, two residual blocks (one downsampling with a
projection), global average pooling, a softmax Dense, on 32x32x3 images. tfmx fuses the
training batch norms
(``FusedBatchNormV3`` / ``_FusedBatchNormEx``), the convolutions and the Adam updates.

Data, best first (each fallback announced): CIFAR-10 from the Keras cache or a download;
scikit-learn's 1797 real 8x8 handwritten digits upsampled to 32x32x3 (``.[recipes]`` extra);
the synthetic stripe images of ``recipes.small_cnn``.

Run it::

    python -m recipes.bn_resnet              # 8 epochs, a few minutes on 2 cores
    python -m recipes.bn_resnet --quick      # a tiny run (tests)
    tfmx recipe bn_resnet --epochs 4 --out /tmp/bn_resnet

Example:
    >>> RECIPE.name, RECIPE.metric
    ('bn_resnet', 'val_accuracy')
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from recipes import _data
from recipes._recipe import Recipe
from recipes._runner import run


def load(args: argparse.Namespace) -> _data.Dataset:
    """CIFAR-10, else real digits at 32x32x3, else synthetic images (announced)."""
    val = max(args.samples // 5, args.batch_size)
    return _data.first_available([
        ("CIFAR-10", lambda: _data.cifar10(args.samples, val)),
        ("scikit-learn digits", lambda: _data.digits(args.samples, seed=args.seed,
                                                     image_shape=(32, 32, 3))),
        ("synthetic images", lambda: _data.synthetic_images(args.samples, val, args.seed)),
    ])


def build(args: argparse.Namespace, data: _data.Dataset) -> Any:
    """``tfmx bench``'s bn_resnet architecture (uncompiled), its batch norms with
    ``--bn-momentum`` (0.9): Keras's default 0.99 leaves the moving statistics, which the
    held-out evaluation uses, far from the data's after a few hundred steps."""
    from recipes._models import bn_resnet_model

    return bn_resnet_model(data.num_classes, momentum=args.bn_momentum)


def _extra(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bn-momentum", type=float, default=0.9,
                   help="BatchNormalization momentum of the moving statistics (default 0.9)")


RECIPE = Recipe(
    name="bn_resnet",
    summary=(__doc__ or "").strip().splitlines()[0].rstrip("."),
    load=load,
    build=build,
    extra_args=_extra,
    defaults={"epochs": 8, "batch_size": 64, "samples": 4000, "lr": 3e-3, "rounds": 8,
              "steps": 3},
    quick={"epochs": 1, "batch_size": 32, "samples": 256, "rounds": 2, "steps": 2},
)


def main(argv: Sequence[str] | None = None) -> dict:
    """Train stock, tfmx and stock'; print, write and return the numbers (``metrics.json``)."""
    return run(RECIPE, argv)


if __name__ == "__main__":
    main()
