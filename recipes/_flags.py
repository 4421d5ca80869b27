"""The recipes' flags: one parser for every recipe (:func:`parser`), and :func:`parse`, which
fills the sizes and checks the values before anything is built.

Flags in the style of keras-cv's and timm's training scripts: ``--epochs``, ``--batch-size``,
``--samples``, ``--lr``, ``--seed``, ``--policy``, ``--compare`` (the default) or
``--tfmx-only``, ``--no-baseline``, ``--xla``, ``--quick``, ``--fuse`` (the tfmx run's
``tfmx.enable(fuse=...)``), ``--rounds``, ``--out DIR``, ``--workers N`` (N local workers under
MultiWorkerMirroredStrategy, the tfmx run only: :mod:`recipes._workers`), then the recipe's
extras. Bad values stop with an argparse error
before anything is built, and an unknown ``--policy`` raises ValueError
(``policies.names.check_name``) before training.

Example:
    >>> from recipes._recipe import Recipe
    >>> p = parser(Recipe("demo", "a demo", load=None, build=None))
    >>> args = p.parse_args(["--epochs", "3", "--tfmx-only", "--out", "/tmp/tfmx-demo"])
    >>> args.epochs, args.compare
    (3, False)
"""

from __future__ import annotations

import argparse
import datetime
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from recipes import _workers
from recipes._recipe import Recipe


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
    p.add_argument("--quick", action="store_true",
                   help="a small run (tests, CI); a fit this short may be too short to pay for "
                        "tracing tfmx's form, and the report's first line then says so and "
                        "from how many calls it runs (--fuse always runs it anyway)")
    p.add_argument("--fuse", choices=("measured", "always"), default=None,
                   help="the tfmx run's tfmx.enable(fuse=...): 'measured' keeps a fused form "
                        "only where it measures faster and pays within the fit; 'always' runs "
                        "the fused step untimed by the guard (default: $TFMX_FUSE, else "
                        "measured)")
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
