"""The benchmark's workloads: the models ``tfmx bench`` times, their inputs and how each mode
builds them.

- :class:`Workload` and :data:`WORKLOADS`: each model's builder, input shape and default batch,
  rounds and steps; the zoo's models (:mod:`bench.zoo`) as ``zoo_<name>``, and
  :data:`GROUPS` (``zoo``), which :func:`expand_models` expands.
- ``small_cnn`` and ``bn_resnet`` are the recipes' models (:mod:`recipes._models`).
- :func:`random_dataset`: a workload's random inputs and labels as a repeating dataset.
- :data:`MODES` and :func:`build_model`: one identical model per mode (``stock``, ``tfmx``,
  ``xla``: same seed, same initial weights, same optimizer, :data:`OPTIMIZERS`).

Example:
    >>> from bench.workloads import WORKLOADS, expand_models
    >>> WORKLOADS["lstm"].input_shape, WORKLOADS["lstm"].batch_size
    ((50, 32), 64)
    >>> expand_models(["mlp", "gru"])
    ['mlp', 'gru']
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from bench import zoo
from recipes._models import bn_resnet_model, small_cnn_model

MODES = ("stock", "tfmx", "xla")
"""How a workload's step runs: Keras's own (tfmx off), rewritten by tfmx, XLA-compiled."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """A benchmark model: how to build it, its input, and default sizes."""

    name: str
    description: str
    build: Callable[[], Any]  # -> uncompiled keras.Model (seeded by the caller)
    input_shape: tuple[int, ...]
    num_classes: int
    batch_size: int
    rounds: int
    steps: int
    vocabulary: int = 0  # > 0: the inputs are int32 token ids below it (else float features)


def _small_cnn() -> Any:
    return small_cnn_model(seed=0)


def _vgg_cnn() -> Any:
    """A VGG-style CNN, as Keras's own examples build one: 2 x (2 x Conv2D 3x3 relu +
    MaxPooling2D), Flatten, Dense(128, relu), Dense(10, softmax)."""
    import keras
    from keras import layers

    x = inp = keras.Input((32, 32, 3))
    for filters in (32, 64):
        x = layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        x = layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        x = layers.MaxPooling2D()(x)
    x = layers.Dense(128, activation="relu")(layers.Flatten()(x))
    out = layers.Dense(10, activation="softmax")(x)
    return keras.Model(inp, out, name="vgg_cnn")


def _resnet50() -> Any:
    import keras

    return keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)


def _bn_resnet() -> Any:
    return bn_resnet_model()


def _dense_stack(depth: int, width: int, activation: str, inputs: int) -> Callable[[], Any]:
    def build() -> Any:
        import keras
        from keras import layers

        x = inp = keras.Input((inputs,))
        for _ in range(depth):
            x = layers.Dense(width, activation=activation)(x)
        out = layers.Dense(10, activation="softmax")(x)
        return keras.Model(inp, out, name=f"{activation}_mlp_{depth}x{width}")

    return build


def _rnn_stack(layer: str, units: int, steps: int, inputs: int) -> Callable[[], Any]:
    def build() -> Any:
        import keras
        from keras import layers

        cls = getattr(layers, layer)
        x = inp = keras.Input((steps, inputs))
        x = cls(units, return_sequences=True)(x)
        x = cls(units)(x)
        out = layers.Dense(10, activation="softmax")(x)
        return keras.Model(inp, out, name=f"{layer.lower()}_2x{units}_t{steps}")

    return build


def _encoder_blocks(x: Any, blocks: int, width: int, heads: int) -> Any:
    """Post-norm transformer encoder blocks: MultiHeadAttention + residual + LayerNorm, a GELU
    feed-forward (4 x width) + residual + LayerNorm."""
    from keras import layers

    for _ in range(blocks):
        attended = layers.MultiHeadAttention(heads, width // heads)(x, x)
        x = layers.LayerNormalization()(layers.Add()([x, attended]))
        ffn = layers.Dense(4 * width, activation="gelu")(x)
        x = layers.LayerNormalization()(layers.Add()([x, layers.Dense(width)(ffn)]))
    return x


def _transformer() -> Any:
    """A text encoder: 64 tokens of 32 features projected to 128, 2 encoder blocks."""
    import keras
    from keras import layers

    x = inp = keras.Input((64, 32))
    x = _encoder_blocks(layers.Dense(128)(x), blocks=2, width=128, heads=4)
    out = layers.Dense(10, activation="softmax")(layers.GlobalAveragePooling1D()(x))
    return keras.Model(inp, out, name="transformer_2x128")


def _vit() -> Any:
    """A small ViT: 4x4 patches of a 32x32x3 image (a strided Conv2D) -> 64 tokens of 128, 3
    encoder blocks."""
    import keras
    from keras import layers

    x = inp = keras.Input((32, 32, 3))
    x = layers.Reshape((64, 128))(layers.Conv2D(128, 4, strides=4)(x))
    x = _encoder_blocks(x, blocks=3, width=128, heads=4)
    out = layers.Dense(10, activation="softmax")(layers.GlobalAveragePooling1D()(x))
    return keras.Model(inp, out, name="vit_3x128")


def _decoder() -> Any:
    """A causal decoder (pre-norm, as GPT/LLaMA-style models): 64 tokens of 32 features
    projected to 128, 2 blocks of RMSNormalization -> causal MultiHeadAttention (dropout 0.1)
    -> residual, RMSNormalization -> GELU FFN -> residual; the last token classified."""
    import keras
    from keras import layers

    x = inp = keras.Input((64, 32))
    x = layers.Dense(128)(x)
    for _ in range(2):
        h = layers.RMSNormalization()(x)
        attended = layers.MultiHeadAttention(4, 32, dropout=0.1)(h, h, use_causal_mask=True)
        x = layers.Add()([x, attended])
        h = layers.RMSNormalization()(x)
        x = layers.Add()([x, layers.Dense(128)(layers.Dense(512, activation="gelu")(h))])
    x = layers.LayerNormalization()(x)
    out = layers.Dense(10, activation="softmax")(x[:, -1, :])
    return keras.Model(inp, out, name="decoder_2x128")


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("small_cnn", "recipes.small_cnn: Conv2D+bias+relu, residual Add, Dense relu",
                 _small_cnn, (32, 32, 3), 10, batch_size=64, rounds=15, steps=10),
        Workload("vgg_cnn", "VGG-style CNN: 2 x (2 x Conv2D 3x3 relu + MaxPooling2D), Dense "
                 "relu, 32x32x3", _vgg_cnn, (32, 32, 3), 10, batch_size=64, rounds=10, steps=5),
        Workload("resnet50", "keras.applications.ResNet50(weights=None), 64x64x3, 10 classes",
                 _resnet50, (64, 64, 3), 10, batch_size=8, rounds=5, steps=3),
        Workload("bn_resnet", "small ResNet-style CNN, 7 x Conv2D + BatchNormalization, "
                 "residual Adds, 32x32x3", _bn_resnet, (32, 32, 3), 10, batch_size=128,
                 rounds=10, steps=3),
        Workload("mlp", "31 x Dense(64, relu): optimizer-bound", _dense_stack(31, 64, "relu", 64),
                 (64,), 10, batch_size=32, rounds=15, steps=20),
        Workload("gelu_mlp", "7 x Dense(512, gelu)", _dense_stack(7, 512, "gelu", 512),
                 (512,), 10, batch_size=256, rounds=10, steps=5),
        Workload("lstm", "LSTM(128, return_sequences) -> LSTM(128) -> Dense, T=50, 32 features",
                 _rnn_stack("LSTM", 128, 50, 32), (50, 32), 10, batch_size=64, rounds=10,
                 steps=5),
        Workload("gru", "GRU(128, return_sequences) -> GRU(128) -> Dense, T=50, 32 features",
                 _rnn_stack("GRU", 128, 50, 32), (50, 32), 10, batch_size=64, rounds=10,
                 steps=5),
        Workload("transformer", "text encoder: 64 tokens x 32 features -> 128, 2 x "
                 "(MultiHeadAttention 4 heads + LayerNorm + GELU FFN 512)", _transformer,
                 (64, 32), 10, batch_size=32, rounds=10, steps=5),
        Workload("vit", "ViT: 32x32x3, 4x4 patches (Conv2D) -> 64 tokens x 128, 3 x "
                 "(MultiHeadAttention 4 heads + LayerNorm + GELU FFN 512)", _vit,
                 (32, 32, 3), 10, batch_size=32, rounds=10, steps=5),
        Workload("decoder", "causal decoder: 64 tokens x 32 features -> 128, 2 x (RMSNorm + "
                 "causal MultiHeadAttention 4 heads, dropout 0.1 + RMSNorm + GELU FFN 512)",
                 _decoder, (64, 32), 10, batch_size=32, rounds=10, steps=5),
    )
}


def _zoo_workloads() -> dict[str, Workload]:
    """``zoo_<name>`` for each model of :mod:`bench.zoo` at its bench size (keras_hub is
    imported only when a backbone is built)."""

    return {f"zoo_{m.name}": Workload(
        f"zoo_{m.name}", m.description, functools.partial(zoo.build, m.name, "bench"),
        m.input_shape, 10, batch_size=m.batch_size, rounds=m.rounds, steps=m.steps,
        vocabulary=m.vocabulary) for m in zoo.MODELS.values()}


WORKLOADS.update(_zoo_workloads())
#: Names ``run_benchmarks`` (``tfmx bench --model``) expands to several workloads.
GROUPS: dict[str, tuple[str, ...]] = {"zoo": tuple(n for n in WORKLOADS if n.startswith("zoo_"))}


def expand_models(models: Sequence[str]) -> list[str]:
    """``models`` with each group name of :data:`GROUPS` replaced by its workloads, in order,
    each workload once.

    >>> expand_models(["mlp", "zoo", "mlp"])[:3]
    ['mlp', 'zoo_mobilenet_v3_small', 'zoo_efficientnet_b0']
    """
    names = [n for m in models for n in GROUPS.get(m, (m,))]
    return list(dict.fromkeys(names))


def random_dataset(workload: Workload, batch_size: int, seed: int, batches: int = 4) -> Any:
    """A repeating ``tf.data`` dataset of ``batches`` batches of random inputs for
    ``workload`` (int32 token ids below its vocabulary, else standard normal float32
    features) and random int32 labels; the same ``seed``, the same data.

    >>> x, y = next(iter(random_dataset(WORKLOADS["mlp"], 4, seed=0)))
    >>> tuple(x.shape), x.dtype.name, tuple(y.shape), y.dtype.name
    ((4, 64), 'float32', (4,), 'int32')
    """
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    n = batch_size * batches
    if workload.vocabulary:
        x = rng.integers(0, workload.vocabulary, (n, *workload.input_shape)).astype(np.int32)
    else:
        x = rng.standard_normal((n, *workload.input_shape)).astype(np.float32)
    y = rng.integers(0, workload.num_classes, size=n).astype(np.int32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(
        batch_size, drop_remainder=True).repeat()


OPTIMIZERS = ("adam", "adamw", "sgd", "rmsprop")


def _optimizer(name: str) -> Any:
    import keras

    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose from {list(OPTIMIZERS)}")
    return {
        "adam": lambda: keras.optimizers.Adam(1e-3),
        "adamw": lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.004),
        "sgd": lambda: keras.optimizers.SGD(1e-2, momentum=0.9),
        "rmsprop": lambda: keras.optimizers.RMSprop(1e-3, momentum=0.9),
    }[name]()


def build_model(workload: Workload, mode: str, seed: int, weights: list | None,
                policy: str | None = None, optimizer: str = "adam", strategy: Any = None,
                dataset: Any = None) -> Any:
    """``workload``'s model built and compiled for ``mode`` (one of :data:`MODES`; ``"xla"``
    compiles with ``jit_compile=True``): weights from ``seed``, or ``weights`` when given;
    ``optimizer`` one of :data:`OPTIMIZERS`; the non-stock modes under ``policy`` (a
    ``policies`` name) when given; with ``strategy``, built in its scope and its variables
    created on ``dataset``'s first batch, as ``fit`` does.

    >>> model = build_model(WORKLOADS["mlp"], "xla", seed=0, weights=None, optimizer="sgd")
    >>> model.name, type(model.optimizer).__name__, model.jit_compile
    ('relu_mlp_31x64', 'SGD', True)
    """
    import contextlib

    import keras

    with contextlib.ExitStack() as stack:
        if strategy is not None:  # variables mirrored over the replicas' devices
            stack.enter_context(strategy.scope())
        if policy is not None and mode != "stock":
            import policies

            # built and compiled under the policy (its compile hook tunes and guards)
            stack.enter_context(policies.scope(policy))
        keras.utils.set_random_seed(seed)
        model = workload.build()
        if weights is not None:
            model.set_weights(weights)
        model.compile(
            optimizer=_optimizer(optimizer),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            jit_compile=(mode == "xla"),
        )
        if strategy is not None:
            # What fit does before its first step under a strategy: the optimizer's slots and
            # the metrics' variables created here, in the strategy's scope, not in the
            # replicas' trace (where creating a mirrored variable fails).
            model._maybe_symbolic_build(data_batch=next(iter(dataset)))
    return model


@contextlib.contextmanager
def tfmx_restored() -> Iterator[None]:
    """Inside, a benchmark switches tfmx on and off as it measures; after, tfmx is as it was
    before (off, or enabled with the same backend, patterns and verify).

    >>> import tfmx
    >>> with tfmx_restored():
    ...     tfmx.enable(backend="cpu")
    >>> tfmx.enabled()
    False
    """
    import tfmx
    from tfmx import state

    previous = state.options()
    try:
        yield
    finally:
        if previous is None:
            tfmx.disable()
        else:
            tfmx.enable(backend=previous.backend.name, patterns=previous.patterns,
                        verify=previous.verify)
