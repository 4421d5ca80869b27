"""What tests/scripts/mirrored_model.py and multi_worker.py share: the model, its data, a
custom training loop under a strategy, and reading back what ran.

Imported after the caller has configured TensorFlow's devices (it imports TensorFlow).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

SAMPLES, BATCH, HW, CLASSES = 64, 16, 8, 3  # BATCH: the global batch, over every replica


def graph_ops(functions: Any) -> list[str]:
    """Op types of these ConcreteFunctions and their function libraries."""
    ops: set[str] = set()
    for cf in functions:
        g = cf.graph.as_graph_def()
        ops.update(n.op for n in g.node)
        for f in g.library.function:
            ops.update(n.op for n in f.node_def)
    return sorted(ops)


def keras_ops(fn: Any) -> list[str]:
    """Op types of what a Keras step function (train/test/predict_function) traced
    (``tests/helpers.step_functions``: behind Keras 3.16's wrapper too)."""
    import sys
    from pathlib import Path

    sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests/: helpers
    from helpers import step_functions

    return graph_ops(step_functions(fn))


def build(strategy: tf.distribute.Strategy, synchronized: bool = False) -> keras.Model:
    """Conv2D+BatchNormalization+ReLU, Dense+bias+relu, LayerNormalization, Dense; Adam;
    the same initial weights at every call."""
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((HW, HW, 3)),
            keras.layers.Conv2D(4, 3, padding="same", use_bias=False),
            keras.layers.BatchNormalization(synchronized=synchronized),
            keras.layers.ReLU(),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(CLASSES),
        ])
        model.compile(keras.optimizers.Adam(1e-2),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.optimizer.build(model.trainable_variables)  # its slots here, not in a trace
    return model


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(SAMPLES, HW, HW, 3)).astype("float32")
    y = rng.integers(0, CLASSES, SAMPLES).astype("int32")
    return x, y


def state_of(model: keras.Model) -> list:
    """Every variable and optimizer slot, as nested lists of float64."""
    variables = list(model.weights) + list(model.optimizer.variables)
    return [np.asarray(v.numpy(), np.float64).tolist() for v in variables]


def names_of(model: keras.Model) -> list[str]:
    return [v.path for v in list(model.weights) + list(model.optimizer.variables)]


def custom_step(strategy: tf.distribute.Strategy, model: keras.Model,
                wrap: Callable) -> Callable:
    """One training step over every replica (``strategy.run``), wrapped by ``wrap``
    (``tf.function`` or ``tfmx.function``); returns the global batch's mean loss."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def replica_step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            # the replica's mean loss over 1/replicas: Keras's Loss scales it under a strategy
            # (keras/src/losses/loss.py scale_loss_for_distribution), as fit's train_step does
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def step(batch: Any) -> tf.Tensor:
        losses = strategy.run(replica_step, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    return wrap(step)


def distributed_data(strategy: tf.distribute.Strategy, repeat: bool = False) -> Any:
    """:func:`data` in global batches of BATCH, split over the replicas (and workers)."""
    x, y = data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    return strategy.experimental_distribute_dataset(dataset.repeat() if repeat else dataset)


def run_custom(strategy: tf.distribute.Strategy, wrap: Callable, epochs: int = 2,
               model: keras.Model | None = None) -> dict:
    """Train ``epochs`` epochs with :func:`custom_step`: final state, losses, ops that ran."""
    model = model or build(strategy)
    step = custom_step(strategy, model, wrap)
    dist = distributed_data(strategy)
    losses = [float(step(batch)) for _ in range(epochs) for batch in dist]
    functions = (step.concrete_functions() if hasattr(step, "concrete_functions")
                 else step._list_all_concrete_functions())
    return {"state": state_of(model), "losses": losses, "ops": graph_ops(functions)}
