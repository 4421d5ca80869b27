"""A custom training loop: tfmx.function against tf.function, on a deep MLP over real digits.

The loop is what Keras users write when ``fit`` does not fit: a step function with a
``tf.GradientTape``, ``optimizer.apply`` and a loss, called once per batch on eager tensors.
The stock and stock' runs wrap it in ``tf.function``, the tfmx run in ``tfmx.function`` (the
same rewrite as ``fit``'s, plus a per-call lookup by the arguments' dtypes and shapes instead of
``tf.function``'s, which hashes every captured variable: it pays on small, optimizer-bound
steps). Model: flattened images -> ``--depth`` (31) x Dense(64, relu) -> softmax Dense; Adam.

Data, best first (each fallback announced): scikit-learn's 1797 real 8x8 digits (64
features); MNIST from the Keras cache or a download; synthetic stripe images.

Run it::

    python -m recipes.custom_loop
    python -m recipes.custom_loop --quick --tfmx-only

Example:
    >>> RECIPE.train is train
    True
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from recipes import _data
from recipes._flags import positive_int
from recipes._recipe import TFMX, Recipe, RunRecord
from recipes._runner import run
from recipes._train import progress_verbosity, schedule, tensorboard_callback


def _extra(p: argparse.ArgumentParser) -> None:
    p.add_argument("--depth", type=positive_int, default=None,
                   help="hidden Dense(64, relu) layers (default 31; 8 with --quick)")


def load(args: argparse.Namespace) -> _data.Dataset:
    """Real digits (64 features), else MNIST, else synthetic images (announced)."""
    val = max(args.samples // 5, args.batch_size)
    return _data.first_available([
        ("scikit-learn digits", lambda: _data.digits(args.samples, seed=args.seed,
                                                     image_shape=(64,))),
        ("MNIST", lambda: _data.mnist(args.samples, val)),
        ("synthetic images", lambda: _data.synthetic_images(args.samples, val, args.seed)),
    ])


def build(args: argparse.Namespace, data: _data.Dataset) -> Any:
    """Flatten -> depth x Dense(64, relu) -> softmax Dense (uncompiled). He-initialised, so
    that 31 plain ReLU layers train (Glorot's default starts them near zero gradients)."""
    import keras
    from keras import layers

    x = inp = keras.Input(data.x_train.shape[1:])
    x = layers.Flatten()(x)
    for _ in range(args.depth):
        x = layers.Dense(64, activation="relu", kernel_initializer="he_normal")(x)
    out = layers.Dense(data.num_classes, activation="softmax")(x)
    return keras.Model(inp, out, name=f"mlp_{args.depth}x64")


def make_step(model: Any, optimizer: Any, wrap: Any) -> Any:
    """The training step ``(x, y) -> (loss, accuracy)``, wrapped by ``wrap`` (``tf.function``
    or ``tfmx.function``)."""
    import keras
    import tensorflow as tf

    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    def step(x: Any, y: Any) -> tuple[Any, Any]:
        with tf.GradientTape() as tape:
            pred = model(x, training=True)
            loss = loss_fn(y, pred)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        hits = tf.cast(tf.equal(tf.argmax(pred, -1, output_type=tf.int32), y), tf.float32)
        return loss, tf.reduce_mean(hits)

    return wrap(step)


def _evaluate(model: Any, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    import keras

    pred = model(x, training=False)
    loss = float(keras.losses.SparseCategoricalCrossentropy()(y, pred))
    return loss, float(np.mean(np.argmax(np.asarray(pred), -1) == y))


def train(recipe: Recipe, args: argparse.Namespace, data: _data.Dataset, run_name: str,
          weights: list[np.ndarray]) -> RunRecord:
    """One run of the custom loop (``Recipe.train``): Keras progress bars, per-epoch loss,
    accuracy and held-out numbers, each batch timed (the first, tracing, call excluded)."""
    import keras
    import tensorflow as tf

    import tfmx

    model = build(args, data)
    model.set_weights(weights)
    steps = len(data.x_train) // args.batch_size
    optimizer = keras.optimizers.Adam(schedule(args.lr, steps * args.epochs))
    optimizer.build(model.trainable_variables)
    step = make_step(model, optimizer, tfmx.function if run_name == TFMX else tf.function)
    board = tensorboard_callback(args.out, run_name)
    board.set_model(model)
    board.on_train_begin()
    history: dict[str, list[float]] = {"loss": [], "accuracy": [], "val_loss": [],
                                       "val_accuracy": []}
    batch_ms: list[list[float]] = []
    y_train = data.y_train.astype(np.int32)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        print(f"Epoch {epoch + 1}/{args.epochs}")
        bar = keras.utils.Progbar(steps, verbose=progress_verbosity(args))
        losses, accs, times = [], [], []
        for i, (x, y) in enumerate(_data.batches(data.x_train, y_train, args.batch_size,
                                                 seed=args.seed + 1000 * epoch)):
            x, y = tf.constant(x), tf.constant(y)
            t0 = time.perf_counter()
            loss, acc = step(x, y)
            loss, acc = float(loss), float(acc)
            if epoch or i:
                times.append((time.perf_counter() - t0) * 1000.0)
            losses.append(loss)
            accs.append(acc)
            bar.update(i + 1, [("loss", loss), ("accuracy", acc)])
        val_loss, val_acc = _evaluate(model, data.x_val, data.y_val.astype(np.int32))
        logs = {"loss": float(np.mean(losses)), "accuracy": float(np.mean(accs)),
                "val_loss": val_loss, "val_accuracy": val_acc}
        print(f"  held-out: loss {val_loss:.4f} - accuracy {val_acc:.4f}")
        for key, value in logs.items():
            history[key].append(value)
        board.on_epoch_end(epoch, logs)
        batch_ms.append(times)
    board.on_train_end()
    seconds = time.perf_counter() - start
    fixed = _fixed_batches(data, args.batch_size)
    return RunRecord(model, history, batch_ms, lambda it: step(*next(it)),
                     lambda _mode: itertools.cycle(fixed), seconds)


def xla_step(recipe: Recipe, args: argparse.Namespace, data: _data.Dataset,
             weights: list[np.ndarray]) -> tuple[Any, Any]:
    """The same step under ``tf.function(jit_compile=True)`` from ``weights`` (not trained),
    for ``--xla``'s interleaved timing."""
    import functools

    import keras
    import tensorflow as tf

    model = build(args, data)
    model.set_weights(weights)
    steps = len(data.x_train) // args.batch_size
    optimizer = keras.optimizers.Adam(schedule(args.lr, steps * args.epochs))
    optimizer.build(model.trainable_variables)
    step = make_step(model, optimizer, functools.partial(tf.function, jit_compile=True))
    fixed = _fixed_batches(data, args.batch_size)
    return (lambda it: step(*next(it))), (lambda _mode: itertools.cycle(fixed))


def _fixed_batches(data: _data.Dataset, batch_size: int) -> list[tuple[Any, Any]]:
    import tensorflow as tf

    n = (len(data.x_train) // batch_size) * batch_size
    y = data.y_train.astype(np.int32)
    return [(tf.constant(data.x_train[i:i + batch_size]), tf.constant(y[i:i + batch_size]))
            for i in range(0, n, batch_size)]


RECIPE = Recipe(
    name="custom_loop",
    summary=(__doc__ or "").strip().splitlines()[0].rstrip("."),
    load=load,
    build=build,
    train=train,
    xla_step=xla_step,
    defaults={"epochs": 30, "batch_size": 32, "samples": 4000, "lr": 1e-3, "depth": 31,
              "rounds": 15, "steps": 20},
    quick={"epochs": 2, "batch_size": 32, "samples": 256, "depth": 8, "rounds": 2,
           "steps": 5},
    extra_args=_extra,
)


def main(argv: Sequence[str] | None = None) -> dict:
    """Train stock (``tf.function``), tfmx (``tfmx.function``) and stock'; print, write and
    return the numbers (``metrics.json``)."""
    return run(RECIPE, argv)


if __name__ == "__main__":
    main()
