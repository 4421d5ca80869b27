"""``tfmx bench``: stock vs tfmx vs XLA training step time, interleaved, per oneDNN state.

How it measures ("measure, do not guess"):

1. Build one identical model per mode (same seed, same initial weights, same optimizer).
   ``stock`` is built and traced with tfmx disabled, ``tfmx`` with tfmx enabled (the rewrite
   happens when the step is traced), ``xla`` with ``jit_compile=True`` (tfmx leaves it alone).
2. Warm-up: call each mode's ``model.train_function`` a few times on its own repeating
   ``tf.data`` iterator. The first call traces (and rewrites, or XLA-compiles); it is timed
   separately and excluded.
3. Interleave: for each round, for each mode (order rotated every round), time ``steps`` calls
   and synchronise on the returned logs. Report the median ms/step over rounds, the spread, and
   the ratios to stock. No assertions: this module only measures.
4. oneDNN (``run_benchmarks(..., onednn="on"|"off"|"both")``, ``tfmx bench --onednn``):
   TensorFlow reads ``TF_ENABLE_ONEDNN_OPTS`` once, when it is imported, so each oneDNN state
   runs in a new process (``python -m tfmx.bench``, :func:`child_command`) with the variable
   set to ``1`` or ``0``; the child checks the state took effect and hands its results back as
   JSON. States run one after the other; the modes within a state are interleaved as above.
   Without ``onednn`` everything runs in this process, in its current state.
5. Replicas (``run_benchmarks(..., replicas=N)``, ``tfmx bench --replicas N``; default 1: one
   device, no strategy): each measuring process splits its CPU into N logical devices before
   TensorFlow runs anything (:func:`split_cpu`) and builds and compiles every mode's model in a
   ``tf.distribute.MirroredStrategy`` over them, fed a distributed dataset; the global batch
   stays the workload's (each replica gets batch / N). The same modes with 1 replica (no
   strategy) are built in the same process and interleaved with them in the same rounds, so
   :func:`compare_replicas` sets tfmx / stock with N replicas against 1 replica's (issue 16:
   within :data:`REPLICA_TOLERANCE`). XLA's step and ``policy="auto"`` cannot run under the
   strategy: :func:`check_replicas` says so and what to pass instead.

The output (:func:`format_markdown`):

- A machine line: date, CPU model name (vendor, family, model number), cores, the CPU flags of
  :data:`tfmx.machine.RELEVANT_FLAGS` present (avx2, avx512f, avx512_bf16, avx512_vnni,
  amx_bf16, amx_tile, avx_vnni), TensorFlow, Keras and Python versions, platform, GPUs.
- A oneDNN line: each state measured and how its process got it (``TF_ENABLE_ONEDNN_OPTS=1``
  or ``=0`` in a process of its own, or the calling process's state).
- The summary table, one row per workload (model, optimizer, batch, policy), median ms/step:

  - ``stock (on)``, ``stock (off)``: Keras's own step with oneDNN on / off;
  - ``XLA (on)``, ``XLA (off)``: ``jit_compile=True`` in the process of that state;
  - ``tfmx (on)``, ``tfmx (off)``: the rewritten step in that state;
  - ``best alternative``: the fastest of the stock and XLA columns, named (``9.00 stock
    (off)``): what a user who does not use tfmx could get by choosing the state and XLA;
  - ``tfmx (on) / best``, ``tfmx (off) / best``: tfmx's median over the best alternative
    (below 1: tfmx is faster than anything else measured);
  - ``best tfmx / best`` (two states only): tfmx's faster state over the best alternative,
    the state named.

  Only the modes and states measured get columns; results without a recorded state get
  columns without "(on)"/"(off)".
- Per workload, a table per oneDNN state and mode: median, p25-p75, min, ``vs stock`` and
  ``vs XLA`` (the ratios within one process: tfmx/stock, tfmx/xla, xla/stock), first call
  (trace, rewrite or compile) seconds; the same ratios taken round by round (each round
  times every mode back to back, :func:`paired_ratios`), median and p25-p75; then each traced
  function's rewrite, and how many chains/updates tfmx fused, per state.
- With N > 1 replicas: a line saying how they ran (:func:`format_replica_setup`), the rows and
  sections per replica count ("1 replica", "N replicas"), and after the summary table
  tfmx / stock with 1 and with N replicas per workload, their difference and whether it is
  within 0.05 (:func:`format_replicas`).

Keras's step function is an outer ``tf.function`` that calls tfmx's rewritten step, so the
rewrite is baked in when it is traced; tfmx is kept enabled while timing anyway, so that a
retrace (which would rewrite again) also sees the right switch. The stock and XLA step
functions were built without the hook's rewrite and do not look at the switch.

Example:
    >>> from tfmx.bench import format_markdown, run_benchmark, run_benchmarks
    >>> results = run_benchmark("mlp", rounds=3, steps=5)  # doctest: +SKIP
    >>> print(format_markdown(results))  # doctest: +SKIP
    >>> both = run_benchmarks(["mlp"], onednn="both", rounds=3, steps=5)  # doctest: +SKIP
    >>> print(format_markdown(both))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from tfmx.tuner import sync

MODES = ("stock", "tfmx", "xla")


# -- timing ----------------------------------------------------------------------------------
def _quantile(values: Sequence[float], q: float) -> float:
    return float(np.quantile(np.asarray(values, dtype=np.float64), q))


def time_step_functions(
    fns: Mapping[str, Callable[[Any], Any]],
    iterator_factory: Callable[[str], Iterator],
    rounds: int = 10,
    steps: int = 10,
    warmup: int = 2,
) -> dict[str, dict[str, Any]]:
    """Time step functions interleaved: median ms per call over ``rounds``, warm-up excluded.

    Args:
        fns: mode name (or any key, e.g. (mode, replicas)) -> a step function taking an
            iterator (e.g. ``model.train_function``).
        iterator_factory: called once per mode with the mode name; returns that mode's
            (repeating) iterator, e.g. ``lambda mode: iter(dataset.repeat())``.
        rounds: interleaved rounds; each round times ``steps`` calls of every mode, in an
            order rotated by one each round so no mode always runs first.
        steps: calls per mode per round; the round's time is divided by ``steps``.
        warmup: untimed calls per mode first; the first call (tracing, rewriting, compiling)
            is reported separately as ``first_call_s``.

    Returns:
        mode -> ``{"median_ms", "p25_ms", "p75_ms", "min_ms", "rounds_ms", "first_call_s"}``.

    >>> import itertools
    >>> timing = time_step_functions({"a": next, "b": next},
    ...                              lambda mode: itertools.count(), rounds=3, steps=4)
    >>> sorted(timing), len(timing["a"]["rounds_ms"])
    (['a', 'b'], 3)
    >>> timing["a"]["median_ms"] >= 0.0
    True
    """
    if rounds < 1 or steps < 1:
        raise ValueError(f"rounds and steps must be >= 1, got rounds={rounds} steps={steps}")
    names = list(fns)
    iterators = {name: iterator_factory(name) for name in names}
    first_call: dict[str, float] = {}
    for name in names:
        for i in range(max(warmup, 1)):
            t0 = time.perf_counter()
            sync(fns[name](iterators[name]))
            if i == 0:
                first_call[name] = time.perf_counter() - t0
    per_round: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            fn, it = fns[name], iterators[name]
            out = None
            t0 = time.perf_counter()
            for _ in range(steps):
                out = fn(it)
            sync(out)
            per_round[name].append((time.perf_counter() - t0) * 1000.0 / steps)
    return {
        name: {
            "median_ms": statistics.median(ms),
            "p25_ms": _quantile(ms, 0.25),
            "p75_ms": _quantile(ms, 0.75),
            "min_ms": min(ms),
            "rounds_ms": ms,
            "first_call_s": first_call[name],
        }
        for name, ms in per_round.items()
    }


# -- workloads -------------------------------------------------------------------------------
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


def small_cnn_model(seed: int = 0, image_shape: tuple[int, int, int] = (32, 32, 3),
                    num_classes: int = 10) -> Any:
    """The small CNN (uncompiled) of the ``small_cnn`` workload and of ``recipes.small_cnn``:
    Conv2D+bias+relu, a strided conv, a residual block, Dense layers; weights from ``seed``.

    >>> small_cnn_model().output_shape  # doctest: +SKIP
    (None, 10)
    """
    import keras
    from keras import layers

    keras.utils.set_random_seed(seed)
    inputs = keras.Input(image_shape)
    x = layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    x = layers.Conv2D(32, 3, strides=2, padding="same", activation="relu")(x)  # 16x16
    y = layers.Conv2D(32, 3, padding="same", activation="relu")(x)
    y = layers.Conv2D(32, 3, padding="same")(y)
    x = layers.Activation("relu")(layers.Add()([x, y]))  # residual block
    x = layers.Conv2D(64, 3, strides=2, padding="same", activation="relu")(x)  # 8x8
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dense(64, activation="relu")(x)
    x = layers.Dense(32, activation="relu")(x)
    outputs = layers.Dense(num_classes, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="small_cnn")


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


def bn_resnet_model(num_classes: int = 10, momentum: float = 0.99) -> Any:
    """The ``bn_resnet`` workload's model (uncompiled; also ``recipes.bn_resnet``'s): a small
    ResNet-style CNN on 32x32x3 with batch norm, 7 convolutions each followed by
    BatchNormalization (``momentum``), two residual blocks (one downsampling, with a
    projection).

    >>> bn_resnet_model(3).output_shape  # doctest: +SKIP
    (None, 3)
    """
    import keras
    from keras import layers

    def conv_bn(x: Any, filters: int, kernel: int = 3, strides: int = 1) -> Any:
        x = layers.Conv2D(filters, kernel, strides=strides, padding="same", use_bias=False)(x)
        return layers.BatchNormalization(momentum=momentum)(x)

    inp = keras.Input((32, 32, 3))
    x = layers.ReLU()(conv_bn(inp, 32))
    y = conv_bn(layers.ReLU()(conv_bn(x, 32)), 32)
    x = layers.ReLU()(layers.Add()([x, y]))
    y = conv_bn(layers.ReLU()(conv_bn(x, 64, strides=2)), 64)
    x = layers.ReLU()(layers.Add()([conv_bn(x, 64, kernel=1, strides=2), y]))
    x = layers.GlobalAveragePooling2D()(x)
    out = layers.Dense(num_classes, activation="softmax")(x)
    return keras.Model(inp, out, name="bn_resnet")


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
    """``zoo_<name>`` for each model of :mod:`tfmx.zoo` at its bench size (keras_hub is
    imported only when a backbone is built)."""
    from tfmx import zoo

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


def _dataset(workload: Workload, batch_size: int, seed: int, batches: int = 4) -> Any:
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


def _build(workload: Workload, mode: str, seed: int, weights: list | None,
           policy: str | None = None, optimizer: str = "adam", strategy: Any = None,
           dataset: Any = None) -> Any:
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


def environment() -> dict[str, Any]:
    """Date, versions, machine and oneDNN state that go with every table.

    The CPU comes from :func:`tfmx.machine.fingerprint`: ``cpu`` (model name), ``cpu_vendor``,
    ``cpu_family``, ``cpu_model`` (number) and ``cpu_flags`` (:data:`tfmx.machine.RELEVANT_FLAGS`
    present). ``onednn`` is this process's state and ``onednn_env`` the value of
    ``TF_ENABLE_ONEDNN_OPTS`` it was imported with (None: unset, TensorFlow's default).

    >>> env = environment()
    >>> sorted(env)[:6]
    ['cpu', 'cpu_count', 'cpu_family', 'cpu_flags', 'cpu_model', 'cpu_vendor']
    >>> env["onednn"] in (True, False)
    True
    """
    import tensorflow as tf

    from tfmx.machine import fingerprint

    fp = fingerprint()
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "tensorflow": fp["tensorflow"],
        "keras": fp["keras"],
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "cpu": fp["model"],
        "cpu_vendor": fp["vendor"],
        "cpu_family": fp["family"],
        "cpu_model": fp["model_number"],
        "cpu_flags": fp["flags"],
        "cpu_count": os.cpu_count(),
        "onednn": fp["onednn"],
        "onednn_env": os.environ.get(ONEDNN_ENV),
        "gpus": len(tf.config.list_physical_devices("GPU")),
    }


# -- replicas: a MirroredStrategy over logical CPU devices -------------------------------------
REPLICA_TOLERANCE = 0.05  # issue 16: tfmx / stock under N replicas within this of 1 replica's
# What cannot run inside a MirroredStrategy over logical CPUs, and what to do instead.
_XLA_UNDER_REPLICAS = (
    "the xla mode cannot run with replicas > 1: Keras's jit_compile=True step under a "
    "MirroredStrategy reads a replica's variables from another logical CPU, which XLA refuses "
    "('Trying to access resource ... located in device CPU:1 from device CPU:0'); pass "
    "--modes stock tfmx (without --modes, --replicas N > 1 measures stock and tfmx)")
_AUTO_UNDER_REPLICAS = (
    "--policy auto cannot run with replicas > 1: its per-layer tuning reads the layers' "
    "variables outside the replica context, which a MirroredStrategy's variables refuse (it "
    "would fall back to one policy everywhere); pass a fixed policy (float32, mixed_float16, "
    "mixed_bfloat16)")


def replica_modes(replicas: int) -> tuple[str, ...]:
    """The modes measured when none are asked for: every mode with one replica, stock and tfmx
    with more (XLA's step cannot run under the strategy: :func:`check_replicas`).

    >>> replica_modes(1), replica_modes(2)
    (('stock', 'tfmx', 'xla'), ('stock', 'tfmx'))
    """
    return MODES if replicas == 1 else tuple(m for m in MODES if m != "xla")


def check_replicas(replicas: Any, modes: Sequence[str] = ("stock", "tfmx"),
                   policy: str | None = None, batch_sizes: Mapping[str, int] | None = None,
                   ) -> None:
    """ValueError, saying what to do, if ``replicas`` cannot be measured with these options.

    ``replicas`` must be an int >= 1; above 1 the ``xla`` mode and ``policy="auto"`` cannot run
    under the strategy, and each workload's global batch (``batch_sizes``: name -> batch) must
    split evenly over the replicas.

    >>> check_replicas(2, ["stock", "tfmx"], batch_sizes={"mlp": 32})
    >>> check_replicas(0)
    Traceback (most recent call last):
    ...
    ValueError: replicas must be an integer >= 1 (1: one device, no strategy), got 0
    >>> check_replicas(3, batch_sizes={"mlp": 32})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: mlp's batch of 32 does not split over 3 replicas: ...
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1 (1: one device, no strategy), got "
                         f"{replicas!r}")
    if replicas == 1:
        return
    if "xla" in modes:
        raise ValueError(_XLA_UNDER_REPLICAS)
    if policy == "auto":
        raise ValueError(_AUTO_UNDER_REPLICAS)
    for name, batch in (batch_sizes or {}).items():
        if batch % replicas:
            raise ValueError(f"{name}'s batch of {batch} does not split over {replicas} "
                             f"replicas: pass --batch-size a multiple of {replicas} (the "
                             f"global batch; each replica gets batch / {replicas})")


def split_cpu(replicas: int) -> list[str]:
    """Split this process's physical CPU into ``replicas`` logical CPU devices; their names.

    TensorFlow allows it only before it initialises its devices (before any op runs): a
    process that already ran TensorFlow gets a RuntimeError saying so, unless its CPU is
    already split that way. The devices share the process's thread pools (the same cores).
    """
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if len(current or [None]) != replicas:
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(replicas)])
        except RuntimeError as err:
            raise RuntimeError(
                f"tfmx bench: {replicas} replicas need the CPU split into {replicas} logical "
                f"devices before TensorFlow runs anything, and this process has already run "
                f"TensorFlow ({err}); run the benchmark in a new process (the tfmx bench "
                f"command does, as does onednn='on'/'off'/'both')") from None
    return [d.name for d in tf.config.list_logical_devices("CPU")[:replicas]]


@functools.cache
def _strategy(replicas: int) -> Any:
    """None for one replica (Keras's default, as without --replicas); else a MirroredStrategy
    over ``replicas`` logical CPUs of this process (:func:`split_cpu`), one per process for
    every workload: two strategies of one process hand out the same collective instance keys,
    and the runtime then takes one model's all-reduce for the other's ("Shape mismatch in the
    collective instance")."""
    if replicas == 1:
        return None
    import tensorflow as tf

    return tf.distribute.MirroredStrategy(split_cpu(replicas))


def run_benchmark(
    model_name: str,
    rounds: int | None = None,
    steps: int | None = None,
    modes: Sequence[str] | None = None,
    batch_size: int | None = None,
    warmup: int = 2,
    seed: int = 0,
    backend: str | None = None,
    optimizer: str = "adam",
    policy: str | None = None,
    replicas: int = 1,
) -> dict[str, Any]:
    """Benchmark one workload's training step in each mode, interleaved; return the numbers.

    Args:
        model_name: one of ``WORKLOADS`` (``small_cnn``, ``resnet50``, ``mlp``, ``gelu_mlp``,
            ``lstm``, ``gru``, ``transformer``, ``vit``, ``decoder``).
        rounds, steps, batch_size: default to the workload's (see ``WORKLOADS``).
        modes: any of ``"stock"``, ``"tfmx"``, ``"xla"``; None: :func:`replica_modes` (all
            three with one replica).
        warmup: untimed calls per mode before timing (the first one traces).
        backend: passed to ``tfmx.enable`` (None detects this machine's).
        optimizer: one of ``OPTIMIZERS`` (Keras defaults; AdamW with weight_decay=0.004).
        policy: a ``policies`` name ("auto", "mixed_bfloat16", ...) the non-stock modes are
            built and compiled under; stock stays float32. Recorded as ``policy`` and
            ``policy_choice`` (what it resolved to and why) and, for "auto", ``tuned``.
        replicas: 1 (default): one device, no strategy. N > 1: every mode's model built and
            compiled in a ``tf.distribute.MirroredStrategy`` over N logical CPUs of this
            process (:func:`split_cpu`: before TensorFlow runs anything), fed a distributed
            dataset; ``batch_size`` stays the global batch, each replica gets batch / N.
            :func:`check_replicas` says what cannot run so. :func:`run_benchmarks` with
            ``replicas=N`` also measures 1 replica, interleaved.

    Returns a dict with ``model``, ``batch_size``, ``replicas``, ``rounds``, ``steps``,
    ``modes`` (per-mode timing from :func:`time_step_functions`), ``ratios`` (``"tfmx/stock"``,
    ``"xla/stock"``, ``"tfmx/xla"``, those whose modes ran),
    ``rewrite`` (one entry per traced function from ``tfmx.report()``: status, nodes, seconds),
    ``fused`` and ``env``. tfmx's enabled state is restored afterwards.

    >>> r = run_benchmark("mlp", rounds=3, steps=5)  # doctest: +SKIP
    >>> r["ratios"]["tfmx/stock"] > 0  # doctest: +SKIP
    True
    """
    return _measure(model_name, (replicas,), rounds=rounds, steps=steps, modes=modes,
                    batch_size=batch_size, warmup=warmup, seed=seed, backend=backend,
                    optimizer=optimizer, policy=policy)[0]


def _measure(model_name: str, counts: Sequence[int], rounds: int | None = None,
             steps: int | None = None, modes: Sequence[str] | None = None,
             batch_size: int | None = None, warmup: int = 2, seed: int = 0,
             backend: str | None = None, optimizer: str = "adam", policy: str | None = None,
             ) -> list[dict[str, Any]]:
    """:func:`run_benchmark` at each replica count of ``counts``, every (mode, count) step
    timed interleaved with the others in one :func:`time_step_functions`: one result per
    count. ``modes`` None: :func:`replica_modes` of the largest count."""
    import tfmx
    from tfmx import state

    if model_name not in WORKLOADS:
        raise ValueError(f"unknown model {model_name!r}; choose one of {tuple(WORKLOADS)}")
    modes = replica_modes(max(counts)) if modes is None else modes
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {bad}; choose from {MODES}")
    workload = WORKLOADS[model_name]
    batch_size = batch_size or workload.batch_size
    for n in counts:
        check_replicas(n, modes, policy, {model_name: batch_size})
    rounds = rounds or workload.rounds
    steps = steps or workload.steps
    strategies = {n: _strategy(n) for n in counts}  # first: the CPU split before any op
    previous = state.options()
    # stock first (built and traced with tfmx off), then tfmx and xla with tfmx on.
    ordered = [m for m in MODES if m in modes]
    dataset = _dataset(workload, batch_size, seed)
    feeds = {n: dataset if s is None else s.experimental_distribute_dataset(dataset)
             for n, s in strategies.items()}
    report = None
    choice = None
    if policy is not None:
        import policies

        choice = policies.resolve(policy)
    try:
        fns, first_trace, layer_policies, spans = _step_functions(
            workload, ordered, strategies, feeds, dataset, seed, backend, policy, optimizer)
        if "tfmx" in ordered or "xla" in ordered:
            tfmx.enable(backend=backend)  # same options as above: a no-op, traces stay valid
        report = tfmx.report() if "tfmx" in ordered else None
        timing = time_step_functions(fns, lambda key: iter(feeds[key[1]]), rounds, steps,
                                     warmup)
    finally:
        if previous is None:
            tfmx.disable()
        else:
            tfmx.enable(backend=previous.backend.name, patterns=previous.patterns,
                        verify=previous.verify)
    env = environment()
    results = []
    for n in counts:
        by_mode = {mode: {**timing[(mode, n)], "first_call_s": first_trace[(mode, n)]}
                   for mode in ordered}
        part = _report_part(report, spans.get(n))
        results.append({
            "model": model_name,
            "description": workload.description,
            "optimizer": optimizer,
            "batch_size": batch_size,
            "replicas": n,
            "devices": list(strategies[n].extended.worker_devices) if strategies[n] else None,
            "rounds": rounds,
            "steps": steps,
            "warmup": warmup,
            "modes": by_mode,
            "ratios": _ratios(by_mode),
            "paired_ratios": paired_ratios(by_mode),
            **part,
            "env": env,
            "policy": policy,
            "policy_choice": str(choice) if choice else None,
            "layer_policies": {mode: layer_policies[(mode, n)] for mode in ordered},
        })
    return results


def _report_position(report: Any) -> tuple[int, int, int, int]:
    """How much ``report`` holds: traces, guards, tuner decisions, fused chains/updates."""
    return len(report.traces), len(report.guards), len(report.decisions), report.fused()


def _report_part(report: Any, span: tuple[tuple, tuple | None] | None) -> dict[str, Any]:
    """What ``report`` recorded within ``span`` (:func:`_report_position` at its start, and at
    its end or None: up to now): the traces, guards, tuner decisions and fused count of one
    replica count's tfmx step."""
    if report is None or span is None:
        return {"rewrite": [], "guard": [], "tuned": 0, "fused": None}
    start, end = span
    end = end or _report_position(report)
    return {
        "rewrite": [t.as_dict() for t in report.traces[start[0]:end[0]]],
        "guard": [dataclasses.asdict(g.summary()) for g in report.guards[start[1]:end[1]]],
        "tuned": end[2] - start[2],
        "fused": end[3] - start[3],
    }


def _step_functions(workload: Workload, ordered: Sequence[str], strategies: Mapping[int, Any],
                    feeds: Mapping[int, Any], dataset: Any, seed: int, backend: str | None,
                    policy: str | None, optimizer: str) -> tuple[dict, dict, dict, dict]:
    """Each (mode, replica count)'s model built from the same weights and its train step
    traced (tfmx off for stock, on for the others): (step functions, first-call seconds,
    layer policies), keyed by (mode, count), and per count the span of ``tfmx.report()``
    its tfmx step's build recorded (:func:`_report_part`)."""
    import tfmx

    fns: dict[tuple[str, int], Callable[[Any], Any]] = {}
    first_trace: dict[tuple[str, int], float] = {}
    layer_policies: dict[tuple[str, int], dict[str, int]] = {}
    spans: dict[int, Any] = {}
    weights = None
    open_span = None  # the count whose tfmx step was built last, its span not yet closed
    for mode in ordered:
        for n, strategy in strategies.items():
            tfmx.disable() if mode == "stock" else tfmx.enable(backend=backend)
            position = _report_position(tfmx.report())
            if open_span is not None:
                spans[open_span] = (spans[open_span][0], position)
                open_span = None
            if mode == "tfmx":
                spans[n], open_span = (position, None), n
            model = _build(workload, mode, seed, weights, policy, optimizer, strategy, dataset)
            layer_policies[(mode, n)] = _layer_policies(model)
            weights = weights if weights is not None else model.get_weights()
            model.make_train_function()
            fn = model.train_function
            t0 = time.perf_counter()  # trace now, while the switch is right for this mode
            sync(fn(iter(feeds[n])))
            first_trace[(mode, n)] = time.perf_counter() - t0
            if mode == "tfmx":
                _settle_guards(fn, feeds[n])
            fns[(mode, n)] = fn
    return fns, first_trace, layer_policies, spans


PAIRS = (("tfmx", "stock"), ("tfmx", "xla"), ("xla", "stock"))
"""The modes compared round by round (:func:`paired_ratios`)."""


def paired_ratios(timing: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[float, ...]]:
    """For each pair of :data:`PAIRS` timed here, the ratio of the two modes' times within
    each round (``a_r / b_r``: the rounds interleave every mode, so both saw the same load):
    (median, p25, p75) of those ratios. On a shared machine whose load drifts between rounds
    this is steadier than the ratio of the two medians, which pairs nothing.

    >>> timing = {"tfmx": {"rounds_ms": [8.0, 16.0, 9.0]},
    ...           "stock": {"rounds_ms": [10.0, 20.0, 10.0]}}
    >>> [round(v, 3) for v in paired_ratios(timing)["tfmx/stock"]]
    [0.8, 0.8, 0.85]
    """
    out = {}
    for a, b in PAIRS:
        if a in timing and b in timing:
            ratios = [x / y for x, y in zip(timing[a]["rounds_ms"], timing[b]["rounds_ms"])]
            out[f"{a}/{b}"] = (statistics.median(ratios), _quantile(ratios, 0.25),
                               _quantile(ratios, 0.75))
    return out


NOISY_SPREAD = 0.10
"""A mode whose p25-p75 spread is over this fraction of its median ran in a noisy spell: the
markdown says so beside the table (:func:`noisy_modes`). A reading aid, not a decision."""


def noisy_modes(timing: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """Each mode whose p25-p75 spread is over :data:`NOISY_SPREAD` of its median, with that
    fraction: on a shared machine a busy neighbour widens it, and a ratio of medians moves
    with the load (the per-round ratios of :func:`paired_ratios` move less).

    >>> noisy_modes({"stock": {"median_ms": 50.0, "p25_ms": 47.0, "p75_ms": 71.0},
    ...              "tfmx": {"median_ms": 30.0, "p25_ms": 29.5, "p75_ms": 30.5}})
    {'stock': 0.48}
    """
    spreads = {mode: (t["p75_ms"] - t["p25_ms"]) / t["median_ms"] for mode, t in timing.items()
               if t.get("median_ms")}
    return {mode: round(f, 3) for mode, f in spreads.items() if f > NOISY_SPREAD}


def _ratios(timing: dict[str, dict]) -> dict[str, float]:
    """``m/stock`` for every mode timed beside stock, and ``tfmx/xla``, of the medians."""
    ratios = {
        f"{m}/stock": timing[m]["median_ms"] / timing["stock"]["median_ms"]
        for m in timing if m != "stock" and "stock" in timing
    }
    if "tfmx" in timing and "xla" in timing:
        ratios["tfmx/xla"] = timing["tfmx"]["median_ms"] / timing["xla"]["median_ms"]
    return ratios


def _settle_guards(fn: Callable[[Any], Any], dataset: Any) -> None:
    """Run tfmx's step until its whole-step guard has kept a form (bounded): the timed rounds
    then measure what a user's training runs after its first steps."""
    import tfmx
    from tfmx.guard import MAX_PAIRS

    iterator = iter(dataset)
    for g in tfmx.report().guards:  # the steady state of a long fit: each trial to its end
        g.lift_budget()
    for _ in range(4 * MAX_PAIRS + 8):  # two duels (fused vs stock, then vs XLA)
        if all(g.decided for g in tfmx.report().guards):
            return
        sync(fn(iterator))


def _layer_policies(model: Any) -> dict[str, int]:
    """How many layers of ``model`` compute under each policy name."""
    import collections

    counts: collections.Counter = collections.Counter(
        layer.dtype_policy.name for layer in model.layers if layer.weights)
    return dict(counts)


# -- one process per oneDNN state ------------------------------------------------------------
ONEDNN_ENV = "TF_ENABLE_ONEDNN_OPTS"
ONEDNN_CHOICES = ("on", "off", "both")
STATES = ("on", "off")


def onednn_states(choice: str) -> tuple[str, ...]:
    """The oneDNN states ``--onednn choice`` measures, each in its own process.

    >>> onednn_states("both"), onednn_states("off")
    (('on', 'off'), ('off',))
    """
    if choice not in ONEDNN_CHOICES:
        raise ValueError(f"unknown oneDNN choice {choice!r}; choose from {ONEDNN_CHOICES}")
    return STATES if choice == "both" else (choice,)


def child_command(state: str, models: Sequence[str], options: Mapping[str, Any],
                  result_path: str) -> tuple[list[str], dict[str, str]]:
    """Command line and environment of the process that benchmarks ``models`` in ``state``.

    The child runs ``python -m tfmx.bench SPEC RESULT_PATH``: :func:`run_benchmark` for each
    model with ``options`` (its keyword arguments), results written as JSON to ``result_path``.
    ``TF_ENABLE_ONEDNN_OPTS`` is ``1`` (``state`` "on") or ``0`` ("off") in its environment, so
    TensorFlow reads it when the child imports it; the child checks that it took effect.

    >>> argv, env = child_command("off", ["mlp"], {"rounds": 2}, "/tmp/r.json")
    >>> argv[1:3], argv[4], env["TF_ENABLE_ONEDNN_OPTS"]
    (['-m', 'tfmx.bench'], '/tmp/r.json', '0')
    >>> json.loads(argv[3])
    {'onednn': 'off', 'models': ['mlp'], 'options': {'rounds': 2}}
    """
    if state not in STATES:
        raise ValueError(f"unknown oneDNN state {state!r}; choose from {STATES}")
    spec = {"onednn": state, "models": list(models), "options": dict(options)}
    env = dict(os.environ)
    env[ONEDNN_ENV] = "1" if state == "on" else "0"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return [sys.executable, "-m", "tfmx.bench", json.dumps(spec), result_path], env


def _child_main(argv: Sequence[str]) -> int:
    """The process :func:`child_command` starts: check oneDNN's state, benchmark, write JSON."""
    from tfmx.backends import onednn_enabled

    spec_text, result_path = argv
    spec = json.loads(spec_text)
    state = "on" if onednn_enabled() else "off"
    if state != spec["onednn"]:
        print(f"tfmx bench: {ONEDNN_ENV}={os.environ.get(ONEDNN_ENV)} left oneDNN {state}: this "
              f"TensorFlow build cannot run with oneDNN {spec['onednn']}", file=sys.stderr)
        return 3
    results = run_benchmarks(spec["models"], **spec["options"])
    with open(result_path, "w") as f:
        json.dump(results, f, default=str)
    return 0


def _run_child(state: str, models: Sequence[str], options: Mapping[str, Any]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="tfmx-bench-") as tmp:
        path = os.path.join(tmp, "results.json")
        argv, env = child_command(state, models, options, path)
        print(f"oneDNN {state}: a new process with {ONEDNN_ENV}={env[ONEDNN_ENV]}",
              file=sys.stderr, flush=True)
        # The child's progress goes to stderr as it runs; its stdout too (stdout is the table).
        proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True)
        if proc.stdout:
            sys.stderr.write(proc.stdout)
        if proc.returncode != 0:
            raise RuntimeError(f"tfmx bench: the oneDNN {state} process exited with status "
                               f"{proc.returncode} (its messages are above)")
        with open(path) as f:
            results = json.load(f)
    for r in results:
        r["isolated"] = True
    return results


def run_benchmarks(models: Sequence[str], onednn: str | None = None, replicas: int = 1,
                   **options: Any) -> list[dict[str, Any]]:
    """:func:`run_benchmark` for each of ``models``, here or once per oneDNN state.

    Args:
        models: workload names (``WORKLOADS``) or group names (``GROUPS``: ``"zoo"``).
        onednn: None runs in this process, in its oneDNN state. ``"on"``, ``"off"`` or
            ``"both"``: one new process per state (:func:`child_command`), one after the
            other (never two at once: they would share the cores); their results are tagged
            ``"isolated": True``.
        replicas: 1 (default): one device, no strategy. N > 1: each workload measured under
            N replicas (:func:`run_benchmark`) and, interleaved with it in the same process,
            with 1 replica (no strategy): :func:`compare_replicas`. Checked first
            (:func:`check_replicas`): a ValueError says what cannot run and what to do.
        options: keyword arguments of :func:`run_benchmark` (``rounds``, ``modes``, ...).

    Returns one :func:`run_benchmark` result per state, model and replica count (state "on"
    first, 1 replica before N); each records its state in ``env["onednn"]`` (see
    :func:`onednn_state`) and its count in ``replicas``.

    >>> results = run_benchmarks(["mlp"], onednn="both", rounds=2, steps=3)  # doctest: +SKIP
    >>> [(r["model"], onednn_state(r)) for r in results]  # doctest: +SKIP
    [('mlp', 'on'), ('mlp', 'off')]
    """
    models = expand_models(models)
    unknown = [m for m in models if m not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; choose from {tuple(WORKLOADS)} or a "
                         f"group: {tuple(GROUPS)}")
    modes = options.get("modes") or replica_modes(replicas)
    check_replicas(replicas, modes, options.get("policy"),
                   {m: options.get("batch_size") or WORKLOADS[m].batch_size for m in models})
    if onednn is not None:
        child_options = {**options, "replicas": replicas} if replicas != 1 else options
        return [r for state in onednn_states(onednn)
                for r in _run_child(state, models, child_options)]
    results = []
    counts = (1,) if replicas == 1 else (1, replicas)
    for name in models:
        print(f"benchmarking {name} ({', '.join(modes)}"
              f"{'' if replicas == 1 else f'; 1 and {replicas} replicas, interleaved'}) ...",
              file=sys.stderr, flush=True)
        results.extend(_measure(name, counts, **{**options, "modes": modes}))
    return results


# -- comparison ------------------------------------------------------------------------------
MODE_LABELS = {"stock": "stock", "tfmx": "tfmx", "xla": "XLA"}
ALTERNATIVES = ("stock", "xla")


def onednn_state(result: Mapping[str, Any]) -> str:
    """``"on"`` or ``"off"``: the oneDNN state ``result`` was measured in; ``"?"`` if unknown.

    >>> onednn_state({"env": {"onednn": False}}), onednn_state({})
    ('off', '?')
    """
    env = result.get("env") or {}
    if "onednn" not in env:
        return "?"
    return "on" if env["onednn"] else "off"


def _by_workload(results: Iterable[Mapping[str, Any]]) -> list[dict[str, Mapping[str, Any]]]:
    """Results grouped per workload (model, optimizer, policy, batch, replicas): state ->
    result."""
    groups: list[tuple[tuple, dict[str, Mapping[str, Any]]]] = []
    for r in results:
        key = (r["model"], r.get("optimizer", "adam"), r.get("policy"), r.get("batch_size"),
               r.get("replicas", 1))
        state = onednn_state(r)
        for k, by_state in groups:
            if k == key and state not in by_state:
                by_state[state] = r
                break
        else:
            groups.append((key, {state: r}))
    order = ("on", "off", "?")
    return [dict(sorted(g.items(), key=lambda item: order.index(item[0]))) for _, g in groups]


def compare(results: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per workload: median ms per mode and oneDNN state, the best alternative, tfmx against it.

    The best alternative is the fastest measured of stock and XLA in every oneDNN state; the
    ratios are tfmx's median over it, per state, and for tfmx's fastest state (``tfmx_best``).

    >>> def run(state, **ms):
    ...     return {"model": "mlp", "env": {"onednn": state == "on"},
    ...             "modes": {m: {"median_ms": v} for m, v in ms.items()}}
    >>> row, = compare([run("on", stock=10.0, xla=12.0, tfmx=8.0),
    ...                 run("off", stock=9.0, xla=11.0, tfmx=8.5)])
    >>> row["ms"]["stock"], row["best_alternative"]
    ({'on': 10.0, 'off': 9.0}, {'ms': 9.0, 'mode': 'stock', 'onednn': 'off'})
    >>> {s: round(v, 3) for s, v in row["tfmx_vs_best_alternative"].items()}
    {'on': 0.889, 'off': 0.944}
    >>> row["tfmx_best"]["onednn"], round(row["tfmx_best"]["vs_best_alternative"], 3)
    ('on', 0.889)
    """
    rows = []
    for by_state in _by_workload(results):
        first = next(iter(by_state.values()))
        ms = {mode: {s: r["modes"][mode]["median_ms"] for s, r in by_state.items()
                     if mode in r["modes"]} for mode in MODES}
        ms = {mode: v for mode, v in ms.items() if v}
        measured = [(v, mode, s) for mode in ALTERNATIVES for s, v in ms.get(mode, {}).items()]
        best = min(measured) if measured else None
        tfmx_ms = ms.get("tfmx", {})
        vs_best = {s: v / best[0] for s, v in tfmx_ms.items()} if best else {}
        tfmx_state = min(tfmx_ms, key=tfmx_ms.__getitem__) if tfmx_ms else None
        rows.append({
            "model": first["model"],
            "optimizer": first.get("optimizer", "adam"),
            "policy": first.get("policy"),
            "batch_size": first.get("batch_size"),
            "replicas": first.get("replicas", 1),
            "ms": ms,
            "best_alternative": ({"ms": best[0], "mode": best[1], "onednn": best[2]}
                                 if best else None),
            "tfmx_vs_best_alternative": vs_best,
            "tfmx_best": ({"onednn": tfmx_state, "ms": tfmx_ms[tfmx_state],
                           "vs_best_alternative": vs_best.get(tfmx_state)}
                          if tfmx_state else None),
        })
    return rows


def compare_replicas(results: Iterable[Mapping[str, Any]],
                     tolerance: float = REPLICA_TOLERANCE) -> list[dict[str, Any]]:
    """Per workload and oneDNN state measured with 1 and with N > 1 replicas: tfmx / stock at
    each (medians of the same process), the difference (N's minus 1's: above 0, a smaller
    speed-up under N replicas) and whether it is within ``tolerance`` (issue 16's 0.05).

    >>> def run(n, stock, tfmx):
    ...     return {"model": "mlp", "replicas": n, "env": {"onednn": True},
    ...             "modes": {"stock": {"median_ms": stock}, "tfmx": {"median_ms": tfmx}}}
    >>> row, = compare_replicas([run(1, 10.0, 8.0), run(2, 20.0, 17.0)])
    >>> row["replicas"], row["tfmx_vs_stock_1"], row["tfmx_vs_stock_n"]
    (2, 0.8, 0.85)
    >>> round(row["difference"], 3), row["within"]
    (0.05, True)
    """
    single: dict[tuple, Mapping[str, Any]] = {}
    several: list[tuple[tuple, Mapping[str, Any]]] = []
    for r in results:
        key = (r["model"], r.get("optimizer", "adam"), r.get("policy"), r.get("batch_size"),
               onednn_state(r))
        if r.get("replicas", 1) == 1:
            single.setdefault(key, r)
        else:
            several.append((key, r))
    rows = []
    for key, r in several:
        if key not in single:
            continue
        one, many = (_ratios(x["modes"]).get("tfmx/stock") for x in (single[key], r))
        difference = many - one if one is not None and many is not None else None
        rows.append({
            "model": key[0], "optimizer": key[1], "policy": key[2], "batch_size": key[3],
            "onednn": key[4], "replicas": r["replicas"],
            "tfmx_vs_stock_1": one, "tfmx_vs_stock_n": many, "difference": difference,
            "tolerance": tolerance,
            # rounded as printed, so that a table's 0.050 reads as within 0.05
            "within": (None if difference is None
                       else round(abs(difference), 3) <= tolerance),
        })
    return rows


def results_document(results: Sequence[Mapping[str, Any]],
                     onednn: str | None = None) -> dict[str, Any]:
    """What ``tfmx bench --json`` writes: the choice, every result and :func:`compare`'s rows;
    with results under several replicas, also :func:`compare_replicas`'s as ``replicas``.

    >>> sorted(results_document([], "both"))
    ['comparison', 'onednn', 'results']
    """
    document = {"onednn": onednn or "process", "results": list(results),
                "comparison": compare(results)}
    if _several_replicas(results):
        document["replicas"] = compare_replicas(results)
    return document


def _several_replicas(results: Iterable[Mapping[str, Any]]) -> bool:
    return any(r.get("replicas", 1) > 1 for r in results)


# -- output ----------------------------------------------------------------------------------
def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _state_suffix(state: str) -> str:
    return "" if state == "?" else f" ({state})"


def format_environment(env: Mapping[str, Any]) -> str:
    """One markdown line: when, which processor (and its flags), versions.

    The oneDNN state is per result: :func:`format_onednn`.

    >>> print(format_environment({"date": "2026-01-02 10:00", "tensorflow": "2.21.0",
    ...     "keras": "3.15.1", "python": "3.12.1", "platform": "Linux-6.8", "cpu": "AMD EPYC",
    ...     "cpu_vendor": "AuthenticAMD", "cpu_family": "25", "cpu_model": "17",
    ...     "cpu_flags": ["avx2", "avx512f"], "cpu_count": 2, "gpus": 0}))
    ... # doctest: +NORMALIZE_WHITESPACE
    _2026-01-02 10:00; AMD EPYC (AuthenticAMD, family 25, model 17), 2 cores,
    flags: avx2 avx512f; TensorFlow 2.21.0, Keras 3.15.1, Python 3.12.1; Linux-6.8; GPUs: 0_
    """
    ids = [env.get("cpu_vendor")]
    ids += [f"{name} {env[key]}" for name, key in (("family", "cpu_family"),
                                                  ("model", "cpu_model")) if env.get(key)]
    ids_s = ", ".join(i for i in ids if i)
    cpu = f"{env['cpu']} ({ids_s})" if ids_s else env["cpu"]
    flags = " ".join(env.get("cpu_flags") or []) or "none of " + " ".join(_relevant_flags())
    return (f"_{env['date']}; {cpu}, {env['cpu_count']} cores, flags: {flags}; "
            f"TensorFlow {env['tensorflow']}, Keras {env['keras']}, Python {env['python']}; "
            f"{env['platform']}; GPUs: {env['gpus']}_")


def _relevant_flags() -> tuple[str, ...]:
    from tfmx.machine import RELEVANT_FLAGS

    return RELEVANT_FLAGS


def format_onednn(results: Iterable[Mapping[str, Any]]) -> str:
    """One markdown line: each oneDNN state measured, and how the process got it.

    >>> print(format_onednn([
    ...     {"env": {"onednn": True, "onednn_env": "1"}, "isolated": True},
    ...     {"env": {"onednn": False, "onednn_env": None}}]))  # doctest: +NORMALIZE_WHITESPACE
    _oneDNN on: TF_ENABLE_ONEDNN_OPTS=1, a process of its own; oneDNN off:
    TF_ENABLE_ONEDNN_OPTS unset (TensorFlow's default), the calling process_
    """
    seen: dict[str, str] = {}
    for r in results:
        state = onednn_state(r)
        if state == "?" or state in seen:
            continue
        value = r["env"].get("onednn_env")
        how = (f"{ONEDNN_ENV}={value}" if value is not None
               else f"{ONEDNN_ENV} unset (TensorFlow's default)")
        where = "a process of its own" if r.get("isolated") else "the calling process"
        seen[state] = f"oneDNN {state}: {how}, {where}"
    return f"_{'; '.join(seen.values())}_" if seen else ""


def format_comparison(results: Iterable[Mapping[str, Any]]) -> str:
    """The summary table: one row per workload, every mode in every oneDNN state measured.

    Columns: the median ms/step of stock, XLA and tfmx in each state measured (the state in
    parentheses), the best alternative (fastest of stock and XLA, any state), tfmx / best
    alternative per state, and with two states "best tfmx / best" (tfmx's faster state).

    >>> def run(state, **ms):
    ...     return {"model": "mlp", "batch_size": 32, "env": {"onednn": state == "on"},
    ...             "modes": {m: {"median_ms": v} for m, v in ms.items()}}
    >>> print(format_comparison([run("on", stock=10.0, xla=12.0, tfmx=8.0),
    ...                          run("off", stock=9.0, xla=11.0, tfmx=8.5)]))
    ... # doctest: +NORMALIZE_WHITESPACE
    | workload | stock (on) | stock (off) | XLA (on) | XLA (off) | tfmx (on) | tfmx (off) |
      best alternative | tfmx (on) / best | tfmx (off) / best | best tfmx / best |
    |---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|
    | mlp (adam, batch 32) | 10.00 | 9.00 | 12.00 | 11.00 | 8.00 | 8.50 |
      9.00 stock (off) | 0.889 | 0.944 | 0.889 (on) |
    """
    rows = compare(results)
    states = [s for s in ("on", "off", "?")
              if any(s in by_state for row in rows for by_state in row["ms"].values())]
    columns = [(mode, s) for mode in ("stock", "xla", "tfmx") for s in states
               if any(s in row["ms"].get(mode, {}) for row in rows)]
    tfmx_states = [s for m, s in columns if m == "tfmx"]
    header = ["workload"] + [f"{MODE_LABELS[m]}{_state_suffix(s)}" for m, s in columns]
    header += ["best alternative"] + [f"tfmx{_state_suffix(s)} / best" for s in tfmx_states]
    if len(tfmx_states) > 1:
        header.append("best tfmx / best")
    align = ["---"] + ["---:"] * len(columns) + ["---"] + ["---:"] * (len(header) - len(columns)
                                                                      - 2)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    replicas = any(row["replicas"] > 1 for row in rows)
    for row in rows:
        cells = [_workload_label(row, replicas)]
        cells += [_ms(row["ms"].get(m, {}).get(s)) for m, s in columns]
        best = row["best_alternative"]
        cells.append(f"{_ms(best['ms'])} {MODE_LABELS[best['mode']]}{_state_suffix(best['onednn'])}"
                     if best else "-")
        cells += [_ratio(row["tfmx_vs_best_alternative"].get(s)) for s in tfmx_states]
        if len(tfmx_states) > 1:
            top = row["tfmx_best"]
            cells.append(f"{_ratio(top['vs_best_alternative'])}{_state_suffix(top['onednn'])}"
                         if top and top["vs_best_alternative"] is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _workload_label(row: Mapping[str, Any], replicas: bool = False) -> str:
    """``mlp (adam, batch 32)``: the model, optimizer, batch, policy, and with ``replicas``
    the replica count (``mlp (adam, batch 32, 2 replicas)``)."""
    what = [row.get("optimizer", "adam")]
    what += [f"batch {row['batch_size']}"] if row.get("batch_size") else []
    what += [f"policy {row['policy']}"] if row.get("policy") else []
    if replicas:
        n = row.get("replicas", 1)
        what.append(f"{n} replica{'s' if n > 1 else ''}")
    return f"{row['model']} ({', '.join(what)})"


def _replica_words(result: Mapping[str, Any]) -> str:
    """``, 2 replicas (16 each)`` or ``, 1 replica``."""
    n = result.get("replicas", 1)
    if n == 1:
        return ", 1 replica"
    each = f" ({result['batch_size'] // n} each)" if result.get("batch_size") else ""
    return f", {n} replicas{each}"


def _replica_counts(results: Iterable[Mapping[str, Any]]) -> str:
    """The replica counts above 1 measured, ``2`` or ``2/4``; empty if none."""
    return "/".join(str(c) for c in sorted({r["replicas"] for r in results
                                            if r.get("replicas", 1) > 1}))


def format_replica_setup(results: Iterable[Mapping[str, Any]]) -> str:
    """One markdown line: how the results under several replicas ran (empty if none).

    >>> print(format_replica_setup([{"replicas": 2, "modes": {"stock": {}}}]))
    ... # doctest: +NORMALIZE_WHITESPACE
    _2 replicas: a tf.distribute.MirroredStrategy over 2 logical CPU devices that split this
    process's CPU (tf.config.set_logical_device_configuration, in each measuring process),
    every mode's model built and compiled in its scope; the global batch is the workload's,
    each replica gets batch / 2. 1 replica: no strategy (as without --replicas), in the same
    process, interleaved with the 2-replica steps. XLA not measured: Keras's jit_compile=True
    step cannot run under the strategy._
    """
    results = list(results)
    n = _replica_counts(results)
    if not n:
        return ""
    xla = any("xla" in r["modes"] for r in results if r.get("replicas", 1) > 1)
    return (f"_{n} replicas: a tf.distribute.MirroredStrategy over {n} logical CPU devices "
            f"that split this process's CPU (tf.config.set_logical_device_configuration, in "
            f"each measuring process), every mode's model built and compiled in its scope; "
            f"the global batch is the workload's, each replica gets batch / {n}. 1 replica: "
            f"no strategy (as without --replicas), in the same process, interleaved with the "
            f"{n}-replica steps."
            + ("" if xla else " XLA not measured: Keras's jit_compile=True step cannot run "
               "under the strategy.") + "_")


def format_replicas(results: Iterable[Mapping[str, Any]],
                    tolerance: float = REPLICA_TOLERANCE) -> str:
    """Per workload and oneDNN state, tfmx / stock with 1 and with N replicas and their
    difference, flagged against ``tolerance`` (:func:`compare_replicas`); a sentence, then
    the table. Empty without results under several replicas.

    >>> def run(n, stock, tfmx):
    ...     return {"model": "mlp", "batch_size": 32, "replicas": n, "env": {"onednn": True},
    ...             "modes": {"stock": {"median_ms": stock}, "tfmx": {"median_ms": tfmx}}}
    >>> print(format_replicas([run(1, 10.0, 8.0), run(2, 20.0, 18.0)]))
    ... # doctest: +NORMALIZE_WHITESPACE
    Does tfmx's speed-up hold under 2 replicas? tfmx / stock with 1 and with 2 replicas
    (medians of the same process); within 0.05: the 2-replica ratio within 0.05 of the
    1-replica ratio.
    <BLANKLINE>
    | workload | oneDNN | tfmx / stock, 1 replica | tfmx / stock, 2 replicas | difference |
      within 0.05 |
    |---|---|---:|---:|---:|---|
    | mlp (adam, batch 32) | on | 0.800 | 0.900 | +0.100 | no: smaller speed-up |
    """
    results = list(results)
    n = _replica_counts(results)
    if not n:
        return ""
    lines = [f"Does tfmx's speed-up hold under {n} replicas? tfmx / stock with 1 and with {n} "
             f"replicas (medians of the same process); within {tolerance:g}: the {n}-replica "
             f"ratio within {tolerance:g} of the 1-replica ratio.", "",
             f"| workload | oneDNN | tfmx / stock, 1 replica | tfmx / stock, {n} replicas | "
             f"difference | within {tolerance:g} |", "|---|---|---:|---:|---:|---|"]
    for row in compare_replicas(results, tolerance):
        d = row["difference"]
        flag = ("-" if d is None else "yes" if row["within"]
                else f"no: {'smaller' if d > 0 else 'larger'} speed-up")
        label = _workload_label(row, replicas="/" in n)
        lines.append(f"| {label} | {row['onednn'] if row['onednn'] != '?' else '-'} | "
                     f"{_ratio(row['tfmx_vs_stock_1'])} | {_ratio(row['tfmx_vs_stock_n'])} | "
                     f"{'-' if d is None else f'{d:+.3f}'} | {flag} |")
    return "\n".join(lines)


def _in_state(state: str) -> str:
    """`` (oneDNN on)`` after a line of a workload's section, nothing where the state was not
    recorded (``?``)."""
    return "" if state == "?" else f" (oneDNN {state})"


def _format_workload(by_state: Mapping[str, Mapping[str, Any]], replicas: bool = False) -> str:
    """One workload's section: per state and mode, the timing and the in-process ratios."""
    r = next(iter(by_state.values()))
    lines = [
        f"### {r['model']} ({r.get('optimizer', 'adam')}): batch {r['batch_size']}"
        f"{_replica_words(r) if replicas else ''}, "
        f"{r['rounds']} interleaved rounds x "
        f"{r['steps']} steps (warm-up {r['warmup']} excluded)",
        "",
    ]
    if r.get("description"):
        lines += [r["description"], ""]
    if r.get("policy"):
        per_mode = "; ".join(
            f"{mode}: " + ", ".join(f"{n} x{c}" for n, c in sorted(counts.items()))
            for mode, counts in r.get("layer_policies", {}).items())
        lines += [f"Non-stock modes built under policy {r['policy']!r} "
                  f"({r.get('policy_choice')}). Layers with weights per policy: "
                  f"{per_mode}.", ""]
    lines += [
        "| oneDNN | mode | median ms/step | p25-p75 ms | min ms | vs stock | vs XLA | "
        "first call s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for state, result in by_state.items():
        modes = result["modes"]
        for mode, t in modes.items():
            vs = [t["median_ms"] / modes[base]["median_ms"] if base in modes else None
                  for base in ("stock", "xla")]
            lines.append(
                f"| {state if state != '?' else '-'} | {mode} | {t['median_ms']:.2f} | "
                f"{t['p25_ms']:.2f}-{t['p75_ms']:.2f} | {t['min_ms']:.2f} | {_ratio(vs[0])} | "
                f"{_ratio(vs[1])} | {t['first_call_s']:.1f} |")
    for state, result in by_state.items():
        noisy = noisy_modes(result["modes"])
        if noisy:
            lines += ["", f"A noisy run{_in_state(state)}: " + ", ".join(
                f"{mode}'s p25-p75 spread is {f:.0%} of its median" for mode, f in noisy.items())
                + f" (over {NOISY_SPREAD:.0%}). The machine was busy: a ratio of medians moves "
                "with the load, the per-round ratios (each round's modes paired) less; run "
                "again before reading a few points into it."]
    paired = [(s, paired_ratios(result["modes"])) for s, result in by_state.items()
              if all("rounds_ms" in t for t in result["modes"].values())]
    for state, ratios in paired:
        if ratios:
            lines += ["", f"Per-round ratios{_in_state(state)}, median (p25-p75): " + "; ".join(
                f"{name} {m:.3f} ({lo:.3f}-{hi:.3f})" for name, (m, lo, hi) in ratios.items())]
    traces = [(s, t) for s, result in by_state.items() for t in result.get("rewrite") or []]
    if traces:
        lines += ["", "| oneDNN | traced function | status | nodes | rewrite s |",
                  "|---|---|---|---|---:|"]
        for state, t in traces:
            lines.append(f"| {state if state != '?' else '-'} | {t['function']} | "
                         f"{t['status']} | {t['nodes_before']}->{t['nodes_after']} | "
                         f"{t['rewrite_seconds']:.3f} |")
    fused = [(s, result["fused"]) for s, result in by_state.items()
             if result.get("fused") is not None]
    if len(fused) == 1:
        state, n = fused[0]
        lines += ["", f"tfmx fused {n} chain(s)/update(s)"
                      f"{_in_state(state)}."]
    elif fused:
        lines += ["", "tfmx fused chain(s)/update(s): "
                      + ", ".join(f"{n} with oneDNN {s}" for s, n in fused) + "."]
    for state, result in by_state.items():
        for g in result.get("guard") or []:
            lines.append(f"whole-step guard{_in_state(state)}: {g['function']} kept "
                         f"{g['kept']} (fused {g['fused_ms']:.2f} ms, stock "
                         f"{g['stock_ms']:.2f} ms over {g['pairs']} pairs; {g['reason']})")
    return "\n".join(lines)


def format_markdown(results: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> str:
    """Markdown for one :func:`run_benchmark` result or a list of them (any oneDNN states).

    Layout: the machine line (:func:`format_environment`) and the oneDNN line
    (:func:`format_onednn`) if the results record them; the summary table
    (:func:`format_comparison`); then per workload its per-state, per-mode table (median,
    spread, min, ratios to stock and to XLA of the same process, first call), its traced
    functions and how many chains tfmx fused.

    >>> fake = {"model": "mlp", "description": "d", "batch_size": 32, "rounds": 3, "steps": 5,
    ...         "warmup": 2, "ratios": {"tfmx/stock": 0.9}, "rewrite": [], "fused": 3,
    ...         "modes": {m: {"median_ms": v, "p25_ms": v, "p75_ms": v, "min_ms": v,
    ...                       "first_call_s": 1.0} for m, v in (("stock", 10.0), ("tfmx", 9.0))}}
    >>> print(format_markdown(fake))  # doctest: +NORMALIZE_WHITESPACE
    Median ms per training step. Best alternative: the fastest of stock and XLA measured;
    tfmx / best below 1: tfmx is faster.
    <BLANKLINE>
    | workload | stock | tfmx | best alternative | tfmx / best |
    |---|---:|---:|---|---:|
    | mlp (adam, batch 32) | 10.00 | 9.00 | 10.00 stock | 0.900 |
    <BLANKLINE>
    ### mlp (adam): batch 32, 3 interleaved rounds x 5 steps (warm-up 2 excluded)
    <BLANKLINE>
    d
    <BLANKLINE>
    | oneDNN | mode | median ms/step | p25-p75 ms | min ms | vs stock | vs XLA | first call s |
    |---|---|---:|---:|---:|---:|---:|---:|
    | - | stock | 10.00 | 10.00-10.00 | 10.00 | 1.000 | - | 1.0 |
    | - | tfmx | 9.00 | 9.00-9.00 | 9.00 | 0.900 | - | 1.0 |
    <BLANKLINE>
    tfmx fused 3 chain(s)/update(s).
    """
    results = [results] if isinstance(results, Mapping) else list(results)
    if not results:
        return "\n"
    head = []
    env = next((r["env"] for r in results if r.get("env")), None)
    if env:
        head.append(format_environment(env))
    if format_onednn(results):
        head.append(format_onednn(results))
    replicas = _several_replicas(results)
    if replicas:
        head.append(format_replica_setup(results))
    head += ["Median ms per training step. Best alternative: the fastest of stock and XLA "
             "measured" + (", in any oneDNN state" if len(
                 {onednn_state(r) for r in results}) > 1 else "") + "; tfmx / best below 1: "
             "tfmx is faster.", format_comparison(results)]
    if replicas:
        head.append(format_replicas(results))
    blocks = ["\n\n".join(head)] + [_format_workload(g, replicas)
                                     for g in _by_workload(results)]
    return "\n\n".join(blocks) + "\n"


__all__ = [
    "GROUPS",
    "MODES",
    "NOISY_SPREAD",
    "ONEDNN_CHOICES",
    "REPLICA_TOLERANCE",
    "WORKLOADS",
    "Workload",
    "child_command",
    "check_replicas",
    "compare",
    "compare_replicas",
    "environment",
    "expand_models",
    "format_comparison",
    "format_environment",
    "format_markdown",
    "format_onednn",
    "format_replica_setup",
    "format_replicas",
    "noisy_modes",
    "onednn_state",
    "onednn_states",
    "replica_modes",
    "results_document",
    "run_benchmark",
    "run_benchmarks",
    "split_cpu",
    "time_step_functions",
]


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
