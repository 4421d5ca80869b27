"""``tfmx bench``: stock vs tfmx vs XLA training step time, interleaved in one process.

How it measures (DESIGN.md: "Measure, do not guess"):

1. Build one identical model per mode (same seed, same initial weights, same optimizer).
   ``stock`` is built and traced with tfmx disabled, ``tfmx`` with tfmx enabled (the rewrite
   happens when the step is traced), ``xla`` with ``jit_compile=True`` (tfmx leaves it alone).
2. Warm-up: call each mode's ``model.train_function`` a few times on its own repeating
   ``tf.data`` iterator. The first call traces (and rewrites, or XLA-compiles); it is timed
   separately and excluded.
3. Interleave: for each round, for each mode (order rotated every round), time ``steps`` calls
   and synchronise on the returned logs. Report the median ms/step over rounds, the spread, and
   the ratios to stock. No assertions: this module only measures.

Keras's step function is an outer ``tf.function`` that calls tfmx's rewritten step, so the
rewrite is baked in when it is traced; tfmx is kept enabled while timing anyway, so that a
retrace (which would rewrite again) also sees the right switch. The stock and XLA step
functions were built without the hook's rewrite and do not look at the switch.

Example:
    >>> from tfmx.bench import run_benchmark, format_markdown
    >>> results = run_benchmark("mlp", rounds=3, steps=5)  # doctest: +SKIP
    >>> print(format_markdown(results))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

MODES = ("stock", "tfmx", "xla")


# -- timing ----------------------------------------------------------------------------------
def _sync(outputs: Any) -> None:
    """Block until ``outputs`` (a structure of tensors) are computed."""
    import tensorflow as tf

    for t in tf.nest.flatten(outputs):
        if hasattr(t, "numpy"):
            t.numpy()


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
        fns: mode name -> a step function taking an iterator (e.g. ``model.train_function``).
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
            _sync(fns[name](iterators[name]))
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
            _sync(out)
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


def _small_cnn() -> Any:
    from recipes.small_cnn import build_model

    return build_model(seed=0)


def _resnet50() -> Any:
    import keras

    return keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)


def _bn_resnet() -> Any:
    """A small ResNet-style CNN with batch norm: 7 convolutions, each followed by
    BatchNormalization, two residual blocks (one downsampling, with a projection)."""
    import keras
    from keras import layers

    def conv_bn(x: Any, filters: int, kernel: int = 3, strides: int = 1) -> Any:
        x = layers.Conv2D(filters, kernel, strides=strides, padding="same", use_bias=False)(x)
        return layers.BatchNormalization()(x)

    inp = keras.Input((32, 32, 3))
    x = layers.ReLU()(conv_bn(inp, 32))
    y = conv_bn(layers.ReLU()(conv_bn(x, 32)), 32)
    x = layers.ReLU()(layers.Add()([x, y]))
    y = conv_bn(layers.ReLU()(conv_bn(x, 64, strides=2)), 64)
    x = layers.ReLU()(layers.Add()([conv_bn(x, 64, kernel=1, strides=2), y]))
    x = layers.GlobalAveragePooling2D()(x)
    out = layers.Dense(10, activation="softmax")(x)
    return keras.Model(inp, out, name="bn_resnet")


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


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("small_cnn", "recipes.small_cnn: Conv2D+bias+relu, residual Add, Dense relu",
                 _small_cnn, (32, 32, 3), 10, batch_size=64, rounds=15, steps=10),
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
    )
}


def _dataset(workload: Workload, batch_size: int, seed: int, batches: int = 4) -> Any:
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    n = batch_size * batches
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
           policy: str | None = None, optimizer: str = "adam") -> Any:
    import contextlib

    import keras

    if policy is not None and mode != "stock":
        import policies

        context: Any = policies.scope(policy)
    else:
        context = contextlib.nullcontext()
    with context:  # built and compiled under the policy (its compile hook tunes and guards)
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
    return model


def environment() -> dict[str, Any]:
    """Date, versions and machine description that go with every table.

    >>> sorted(environment())[:3]
    ['cpu', 'cpu_count', 'date']
    """
    import keras
    import tensorflow as tf

    from tfmx.backends import onednn_enabled

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "onednn": onednn_enabled(),
        "gpus": len(tf.config.list_physical_devices("GPU")),
    }


def run_benchmark(
    model_name: str,
    rounds: int | None = None,
    steps: int | None = None,
    modes: Sequence[str] = MODES,
    batch_size: int | None = None,
    warmup: int = 2,
    seed: int = 0,
    backend: str | None = None,
    optimizer: str = "adam",
    policy: str | None = None,
) -> dict[str, Any]:
    """Benchmark one workload's training step in each mode, interleaved; return the numbers.

    Args:
        model_name: one of ``WORKLOADS`` (``small_cnn``, ``resnet50``, ``mlp``, ``gelu_mlp``,
            ``lstm``, ``gru``).
        rounds, steps, batch_size: default to the workload's (see ``WORKLOADS``).
        modes: any of ``"stock"``, ``"tfmx"``, ``"xla"``.
        warmup: untimed calls per mode before timing (the first one traces).
        backend: passed to ``tfmx.enable`` (None detects this machine's).
        optimizer: one of ``OPTIMIZERS`` (Keras defaults; AdamW with weight_decay=0.004).
        policy: a ``policies`` name ("auto", "mixed_bfloat16", ...) the non-stock modes are
            built and compiled under; stock stays float32. Recorded as ``policy`` and
            ``policy_choice`` (what it resolved to and why) and, for "auto", ``tuned``.

    Returns a dict with ``model``, ``batch_size``, ``rounds``, ``steps``, ``modes`` (per-mode
    timing from :func:`time_step_functions`), ``ratios`` (``"tfmx/stock"``, ``"xla/stock"``),
    ``rewrite`` (one entry per traced function from ``tfmx.report()``: status, nodes, seconds),
    ``fused`` and ``env``. tfmx's enabled state is restored afterwards.

    >>> r = run_benchmark("mlp", rounds=3, steps=5)  # doctest: +SKIP
    >>> r["ratios"]["tfmx/stock"] > 0  # doctest: +SKIP
    True
    """
    import tfmx
    from tfmx import state

    if model_name not in WORKLOADS:
        raise ValueError(f"unknown model {model_name!r}; choose one of {tuple(WORKLOADS)}")
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {bad}; choose from {MODES}")
    workload = WORKLOADS[model_name]
    batch_size = batch_size or workload.batch_size
    rounds = rounds or workload.rounds
    steps = steps or workload.steps
    previous = state.options()
    # stock first (built and traced with tfmx off), then tfmx and xla with tfmx on.
    ordered = [m for m in MODES if m in modes]
    dataset = _dataset(workload, batch_size, seed)
    fns: dict[str, Callable[[Any], Any]] = {}
    first_trace: dict[str, float] = {}
    weights = None
    report = None
    layer_policies: dict[str, dict[str, int]] = {}
    choice = None
    if policy is not None:
        import policies

        choice = policies.resolve(policy)
    try:
        for mode in ordered:
            if mode == "stock":
                tfmx.disable()
            else:
                tfmx.enable(backend=backend)
            model = _build(workload, mode, seed, weights, policy, optimizer)
            layer_policies[mode] = _layer_policies(model)
            weights = weights if weights is not None else model.get_weights()
            model.make_train_function()
            fn = model.train_function
            # Trace now, while the switch is right for this mode.
            t0 = time.perf_counter()
            _sync(fn(iter(dataset)))
            first_trace[mode] = time.perf_counter() - t0
            fns[mode] = fn
        if "tfmx" in fns or "xla" in fns:
            tfmx.enable(backend=backend)  # same options as above: a no-op, traces stay valid
        report = tfmx.report() if "tfmx" in fns else None
        timing = time_step_functions(fns, lambda mode: iter(dataset), rounds, steps, warmup)
    finally:
        if previous is None:
            tfmx.disable()
        else:
            tfmx.enable(backend=previous.backend.name, patterns=previous.patterns,
                        verify=previous.verify)
    for mode in timing:
        timing[mode]["first_call_s"] = first_trace[mode]
    ratios = {
        f"{m}/stock": timing[m]["median_ms"] / timing["stock"]["median_ms"]
        for m in timing if m != "stock" and "stock" in timing
    }
    return {
        "model": model_name,
        "description": workload.description,
        "optimizer": optimizer,
        "batch_size": batch_size,
        "rounds": rounds,
        "steps": steps,
        "warmup": warmup,
        "modes": timing,
        "ratios": ratios,
        "rewrite": [t.as_dict() for t in report.traces] if report else [],
        "fused": report.fused() if report else None,
        "env": environment(),
        "policy": policy,
        "policy_choice": str(choice) if choice else None,
        "layer_policies": layer_policies,
    }


def _layer_policies(model: Any) -> dict[str, int]:
    """How many layers of ``model`` compute under each policy name."""
    import collections

    counts: collections.Counter = collections.Counter(
        layer.dtype_policy.name for layer in model.layers if layer.weights)
    return dict(counts)


# -- output ----------------------------------------------------------------------------------
def format_environment(env: Mapping[str, Any]) -> str:
    """One markdown line describing when and where a benchmark ran."""
    return (f"_{env['date']}; TensorFlow {env['tensorflow']}, Keras {env['keras']}, "
            f"Python {env['python']}; {env['platform']}; {env['cpu']}, {env['cpu_count']} "
            f"cores; oneDNN {'on' if env['onednn'] else 'off'}; GPUs: {env['gpus']}_")


def format_markdown(results: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> str:
    """Markdown for one :func:`run_benchmark` result or a list of them.

    >>> fake = {"model": "mlp", "description": "d", "batch_size": 32, "rounds": 3, "steps": 5,
    ...         "warmup": 2, "ratios": {"tfmx/stock": 0.9}, "rewrite": [], "fused": 3,
    ...         "modes": {m: {"median_ms": v, "p25_ms": v, "p75_ms": v, "min_ms": v,
    ...                       "first_call_s": 1.0} for m, v in (("stock", 10.0), ("tfmx", 9.0))}}
    >>> print(format_markdown(fake))  # doctest: +NORMALIZE_WHITESPACE
    ### mlp (adam): batch 32, 3 interleaved rounds x 5 steps (warm-up 2 excluded)
    <BLANKLINE>
    d
    <BLANKLINE>
    | mode | median ms/step | p25-p75 ms | min ms | vs stock | first call s |
    |---|---:|---:|---:|---:|---:|
    | stock | 10.00 | 10.00-10.00 | 10.00 | 1.000 | 1.0 |
    | tfmx | 9.00 | 9.00-9.00 | 9.00 | 0.900 | 1.0 |
    <BLANKLINE>
    tfmx fused 3 chain(s)/update(s).
    """
    if isinstance(results, Mapping):
        results = [results]
    blocks = []
    for r in results:
        lines = [
            f"### {r['model']} ({r.get('optimizer', 'adam')}): batch {r['batch_size']}, "
            f"{r['rounds']} interleaved rounds x "
            f"{r['steps']} steps (warm-up {r['warmup']} excluded)",
            "",
        ]
        if r.get("env"):
            lines += [format_environment(r["env"]), ""]
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
            "| mode | median ms/step | p25-p75 ms | min ms | vs stock | first call s |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for mode, t in r["modes"].items():
            ratio = 1.0 if mode == "stock" else r["ratios"].get(f"{mode}/stock")
            ratio_s = f"{ratio:.3f}" if ratio is not None else "-"
            lines.append(
                f"| {mode} | {t['median_ms']:.2f} | {t['p25_ms']:.2f}-{t['p75_ms']:.2f} | "
                f"{t['min_ms']:.2f} | {ratio_s} | {t['first_call_s']:.1f} |"
            )
        if r.get("rewrite"):
            lines += ["", "| traced function | status | nodes | rewrite s |", "|---|---|---|---:|"]
            for t in r["rewrite"]:
                lines.append(f"| {t['function']} | {t['status']} | {t['nodes_before']}->"
                             f"{t['nodes_after']} | {t['rewrite_seconds']:.3f} |")
        if r.get("fused") is not None:
            lines += ["", f"tfmx fused {r['fused']} chain(s)/update(s)."]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


__all__ = [
    "MODES",
    "WORKLOADS",
    "Workload",
    "environment",
    "format_environment",
    "format_markdown",
    "run_benchmark",
    "time_step_functions",
]
