"""What a recipe is (:class:`Recipe`), what one training run leaves (:class:`RunRecord`), and
the names of the runs a recipe compares.

The runs: ``stock`` (``tfmx.disable()``), ``tfmx`` (``tfmx.enable()``, under ``--policy`` when
given), the chaos baseline ``stock'`` (stock from the initial weights times
``1 + PERTURBATION * N(0, 1)``) and ``xla`` (the step compiled with ``jit_compile=True``, timed
only).

Example:
    >>> r = Recipe("demo", "a demo", load=None, build=None)
    >>> r.metric, r.higher_is_better, (STOCK, TFMX, BASELINE, XLA)
    ('val_accuracy', True, ('stock', 'tfmx', "stock'", 'xla'))
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from recipes._data import Dataset

STOCK, TFMX, BASELINE, XLA = "stock", "tfmx", "stock'", "xla"
#: The relative size of the chaos baseline's weight perturbation.
PERTURBATION = 1e-7


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
    :func:`recipes._train.fit_run` for its signature; ``xla_step`` then replaces
    :func:`recipes._train.xla_fit_step`.
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
