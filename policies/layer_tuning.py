"""Per-layer precision by measurement: keep 16 bit only where it is faster and still accurate.

What Apple's WWDC23 talk describes for MPSGraph and nobody ships for Keras: time each layer's
training work (forward and gradient) in float32 and in the 16-bit policy on this backend, compare
its 16-bit output with the float32 one, and keep 16 bit only where it is faster by more than
``margin`` AND within ``tolerance``. Three kinds of layer:

- **tuned**: layers with weights of their own (Dense, Conv, LSTM, Embedding...), timed;
- **followers**: layers without weights (activations, Add, pooling, reshapes) and the
  normalization layers Keras already computes in float32: they take the precision of the layers
  that feed them (16 bit only if all of them are), so no pointless casts appear between them;
- **float32 by safety**: output layer, softmax, non-upcasting normalization
  (:mod:`policies.safety`).

Each layer's two variants are timed interleaved by ``tfmx.tuner`` (medians; the machine may be
shared and noisy), which caches the times per machine: the next process, and ``"auto"`` at the
next compile, reuse them (``TFMX_TUNE=off`` measures nothing and keeps float32). Then the
whole model's forward + gradient is timed (``check_model``; rewritten by tfmx where it is
enabled, as the training step will be: its stages have 16-bit forms stock Keras has not) in
float32, with the per-layer choice, and with every layer whose 16-bit output is accurate in
16 bit (the block candidate:
a layer timed alone pays the casts at its borders, which a run of 16-bit layers does not, so
16 bit can pay for a block where it pays for no layer alone). The fastest of the 16-bit
assignments is kept if it beats float32 beyond noise (at least 8 interleaved rounds and the
tuner's sign test, as every tfmx choice); otherwise every layer goes back to float32 (a layer
alone can be faster in 16 bit while the casts and the rest of the step eat the gain). Timing
is injectable (``timer=``, called with the model and "float32" / "tuned" / "broad" for that
check) so the choice can be tested with made-up numbers. The layers' inputs and outputs come
from :mod:`policies.model_probe`.

Example:
    >>> import keras, numpy as np
    >>> from policies.layer_tuning import tune
    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="a"),
    ...                           keras.layers.Dense(8, name="b"),
    ...                           keras.layers.Dense(2, name="out")], name="seq")
    >>> fake = {("a", "float32"): 2.0, ("a", "mixed_bfloat16"): 1.0,
    ...         ("b", "float32"): 1.0, ("b", "mixed_bfloat16"): 3.0,
    ...         ("seq", "float32"): 4.0, ("seq", "tuned"): 3.0,  # the whole-model check
    ...         ("seq", "broad"): 3.5}
    >>> result = tune(model, np.ones((4, 8), "float32"), policy="mixed_bfloat16",
    ...               timer=lambda layer, policy, run: fake[(layer.name, policy)])
    >>> result.chosen()
    {'a': 'mixed_bfloat16', 'b': 'float32', 'out': 'float32'}
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from policies.errors import LayerDtypeError
from policies.hardware_choice import choose
from policies.layers import (
    as_tensors,
    call_layer,
    layer_step,
    output_layers,
    policy_name,
    set_policy,
    weighted,
)
from policies.model_probe import (
    has_graph,
    inputs_of,
    probe_layers,
    producers,
    record_calls,
    reset_step_functions,
    runnable_alone,
    sample_inputs,
)
from policies.names import check_name, is_16bit
from policies.safety import NORMALIZATION_WITH_UPCAST, float32_reason
from policies.state import hardware
from tfmx import backends
from tfmx.tuner import (
    MIN_ROUNDS,
    SIGNIFICANCE,
    Tuner,
    TuningCache,
    resolve_mode,
    sign_test,
    sync,
)

Timer = Callable[[Any, str, Callable[[], Any]], float]
"""``timer(layer, policy, run) -> seconds per call``; ``run()`` does one forward + gradient."""


@dataclasses.dataclass
class LayerChoice:
    """The precision chosen for one layer, with the measurements behind it."""

    layer: str
    cls: str
    policy: str
    kind: str  # "tuned", "follower", "safety", "kept"
    reason: str
    float32_ms: float | None = None
    low_ms: float | None = None
    error: float | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class TuneResult:
    """What :func:`tune` measured and chose; ``print`` it for a table."""

    policy: str
    layers: list[LayerChoice]
    tolerance: float
    margin: float
    applied: bool
    model_float32_ms: float | None = None  # whole-model check: all float32
    model_tuned_ms: float | None = None  # whole-model check: the per-layer choice
    model_broad_ms: float | None = None  # whole-model check: every accurate layer in 16 bit
    model_choice: str | None = None  # "float32", "tuned" or "broad": what the check kept

    def chosen(self) -> dict[str, str]:
        """layer name -> policy name."""
        return {c.layer: c.policy for c in self.layers}

    def low_precision_layers(self) -> list[str]:
        return [c.layer for c in self.layers if is_16bit(c.policy)]

    def to_dict(self) -> dict:
        return {"policy": self.policy, "tolerance": self.tolerance, "margin": self.margin,
                "applied": self.applied, "model_float32_ms": self.model_float32_ms,
                "model_tuned_ms": self.model_tuned_ms, "model_broad_ms": self.model_broad_ms,
                "model_choice": self.model_choice,
                "layers": [c.as_dict() for c in self.layers]}

    def __str__(self) -> str:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.3f}"

        rows = [(c.layer, c.cls, c.policy, ms(c.float32_ms), ms(c.low_ms),
                 "-" if c.error is None else f"{c.error:.2g}", c.reason) for c in self.layers]
        head = ("layer", "class", "policy", "f32 ms", "16b ms", "rel err", "why")
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        lines = [f"policies.tune: {self.policy} vs float32 (tolerance {self.tolerance:g}, "
                 f"margin {self.margin:.0%}); {len(self.low_precision_layers())}/"
                 f"{len(self.layers)} layers in 16 bit"]
        if self.model_float32_ms is not None:
            parts = [f"float32 {self.model_float32_ms:.3f} ms"]
            for label, value in (("per-layer choice", self.model_tuned_ms),
                                 ("every accurate layer in 16 bit", self.model_broad_ms)):
                if value is not None:
                    parts.append(f"{label} {value:.3f} ms "
                                 f"({value / self.model_float32_ms:.2f}x)")
            lines.append(f"whole model, forward + gradient: {', '.join(parts)}; kept: "
                         f"{self.model_choice}")
        lines.append("")
        for r in [head, *rows]:
            lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
        return "\n".join(lines)


def measure(run: Callable[[], Any], warmup: int = 1, repeats: int = 3) -> float:
    """Median seconds per call of ``run`` (which returns tensors), warm-up excluded.

    >>> measure(lambda: 1, warmup=0, repeats=3) >= 0.0
    True
    """
    for _ in range(warmup):
        sync(run())
    times = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        sync(run())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def default_timer(layer: Any, policy: str, run: Callable[[], Any]) -> float:
    """The timer :func:`tune` uses unless given one: :func:`measure` of ``run``.

    >>> default_timer(None, "float32", lambda: 1) >= 0.0
    True
    """
    return measure(run)


def _rel_error(got: Any, ref: Any) -> float:
    import tensorflow as tf

    worst = 0.0
    for g, r in zip(tf.nest.flatten(got), tf.nest.flatten(ref)):
        r = np.asarray(tf.cast(r, tf.float32))
        g = np.asarray(tf.cast(g, tf.float32))
        denom = float(np.linalg.norm(r)) or 1.0
        worst = max(worst, float(np.linalg.norm(g - r)) / denom)
    return worst


def make_runner(layer: Any, policy: str, inputs: Any) -> tuple[Callable[[], Any], Any]:
    """A traced forward + gradient of ``layer`` under ``policy`` on ``inputs`` (training mode:
    what a training step runs); and its output in inference mode, as the float32 reference of
    :func:`~policies.model_probe.probe_layers` is taken (a layer's dropout would otherwise
    count as 16-bit error).

    The layer's policy is set only while tracing; it is restored before this returns.
    Raises :class:`LayerDtypeError` naming the layer if it fails under a 16-bit policy.

    >>> import keras, numpy as np
    >>> layer = keras.layers.Dense(2)
    >>> run, out = make_runner(layer, "mixed_bfloat16", np.ones((1, 3), "float32"))
    >>> out.dtype.name, layer.compute_dtype, run()[0].dtype.name
    ('bfloat16', 'float32', 'bfloat16')
    """
    saved = layer.dtype_policy

    step = layer_step(layer)
    x = as_tensors(inputs)
    state = [v.numpy() for v in layer.non_trainable_variables]
    try:
        set_policy(layer, policy)
        step(x)
        out = call_layer(layer, x, training=False)
    except Exception as err:
        if is_16bit(policy):
            raise LayerDtypeError(layer.name, type(layer).__name__, policy, err) from err
        raise
    finally:
        layer.dtype_policy = saved
        for v, value in zip(layer.non_trainable_variables, state):
            v.assign(value)

    def run() -> Any:
        return step(x)

    return run, out


def _default_candidate() -> str:
    chosen = choose(hardware()).policy
    return chosen if is_16bit(chosen) else "mixed_bfloat16"


def tune(
    model: Any,
    sample_batch: Any = None,
    policy: str | None = None,
    timer: Timer | None = None,
    tolerance: float = 0.02,
    margin: float = 0.10,
    apply: bool = True,
    batch_size: int = 32,
    rounds: int = 5,
    check_model: bool = True,
) -> TuneResult:
    """Choose float32 or ``policy`` for each layer of ``model`` by measuring on this backend.

    Args:
        model: a built Keras model (its top-level layers are chosen). For a subclassed model
            pass ``sample_batch``: the layers' inputs are recorded on one float32 forward; a
            layer called more than once, or without weights, keeps its policy.
        sample_batch: inputs (or an ``(x, y)`` batch) to time on; default: a random batch of
            ``batch_size`` shaped like the model's inputs (Functional and Sequential only).
        policy: the 16-bit candidate ("mixed_bfloat16" or "mixed_float16"); default: what
            "auto" picks for this hardware, or "mixed_bfloat16".
        timer: ``timer(layer, policy, run) -> seconds``, called ``rounds`` times per variant,
            alternating; the medians decide. Default: ``tfmx.tuner`` times the layers (one
            forward + gradient per run) and caches the times per machine; the whole-model
            check uses :func:`measure`.
        tolerance: largest relative L2 error of the layer's 16-bit output against float32.
        margin: a layer alone must be at least this fraction faster in 16 bit to be kept in
            the per-layer choice (its time carries the casts at its borders).
        apply: set the chosen policies on the layers (and drop the model's traced step
            functions so they are traced again); with False only report.
        rounds: alternations of float32 / 16-bit timing per layer (and for the model check).
        check_model: time the whole model with the choice against all-float32 and fall back
            to float32 everywhere unless the choice is faster beyond noise.

    Returns a :class:`TuneResult` (print it for a table).

    >>> import keras, numpy as np
    >>> m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="h"),
    ...                       keras.layers.Dense(2, name="o")])
    >>> r = tune(m, np.ones((2, 4), "float32"), policy="mixed_bfloat16",
    ...          timer=lambda layer, policy, run: 1.0)  # equal times: 16 bit does not pay
    >>> r.chosen(), r.layers[0].reason
    ({'h': 'float32', 'o': 'float32'}, '16 bit not faster (1.00x)')
    """
    policy = policy or _default_candidate()
    if check_name(policy) not in ("mixed_float16", "mixed_bfloat16"):
        raise ValueError(f"tune compares float32 with a 16-bit policy; got {policy!r}: pass "
                         "'mixed_bfloat16' or 'mixed_float16'")
    import keras

    top = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    graph = has_graph(model)
    candidates = runnable_alone(top, graph)
    if not graph and sample_batch is None:
        raise ValueError(f"model {model.name!r} is subclassed: its inputs are not known, so "
                         "tune needs sample_batch= (a batch of real inputs)")
    x = inputs_of(sample_batch) if sample_batch is not None else sample_inputs(model, batch_size)
    with quiet_tf_logs():
        return _tune(model, x, top, candidates, policy, timer, tolerance, margin, apply,
                     max(rounds, 1), check_model)


@contextlib.contextmanager
def quiet_tf_logs() -> Iterator[None]:
    """Silence TensorFlow's Python logger (its retracing notes) inside the block.

    >>> import tensorflow as tf
    >>> with quiet_tf_logs():
    ...     tf.get_logger().level == 40  # logging.ERROR
    True
    """
    import tensorflow as tf

    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")
    try:
        yield
    finally:
        logger.setLevel(level)


def _interleaved(timer: Timer, subject: Any, runs: dict[str, Callable[[], Any]],
                 rounds: int) -> dict[str, float]:
    """Median ms per call of each run, timed alternately ``rounds`` times."""
    return {label: statistics.median(ms)
            for label, ms in _rounds(timer, subject, runs, rounds).items()}


def _rounds(timer: Timer, subject: Any, runs: dict[str, Callable[[], Any]],
            rounds: int) -> dict[str, list[float]]:
    """Every round's ms per call of each run, timed alternately ``rounds`` times."""
    times: dict[str, list[float]] = {label: [] for label in runs}
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for label in order:
            times[label].append(timer(subject, label, runs[label]) * 1000.0)
    return times


def _model_runner(model: Any, top: list[Any], assignment: dict[int, str],
                  x: Any) -> Callable[[], Any]:
    """A traced forward + gradient of the whole model with ``assignment`` (layer id -> policy),
    rewritten by tfmx where it is enabled: the 16-bit step it will train with (its stages
    emit 16-bit forms that stock Keras has not) is the one to time."""
    import tensorflow as tf

    step = layer_step(model, fused=True)
    xt = tf.nest.map_structure(tf.convert_to_tensor, x)
    saved = {id(layer): layer.dtype_policy for layer in top}
    state = [v.numpy() for v in model.non_trainable_variables]
    try:
        for layer in top:
            if id(layer) in assignment:
                layer.dtype_policy = assignment[id(layer)]
        step(xt)
    finally:
        for layer in top:
            layer._dtype_policy = saved[id(layer)]
        for v, value in zip(model.non_trainable_variables, state):
            v.assign(value)
    return lambda: step(xt)


def _tune(model: Any, x: Any, top: list[Any], candidates: list[Any], policy: str,
          timer: Timer, tolerance: float, margin: float, apply: bool, rounds: int,
          check_model: bool) -> TuneResult:
    import keras

    graph = has_graph(model)
    if graph:
        ins, outs = probe_layers(model, candidates, x)
        values = {id(layer): (i, o) for layer, i, o in zip(candidates, ins, outs)}
        outputs = output_layers(model)
    else:  # subclassed: what each layer was called with, recorded on one float32 forward
        values, outputs = record_calls(model, candidates, x)
    decided: dict[int, str] = {}
    choices = []
    for layer in top:
        cls = type(layer).__name__
        if id(layer) not in values:
            why = "nested model" if isinstance(layer, keras.Model) else "shared layer"
            choices.append(LayerChoice(layer.name, cls, policy_name(layer), "kept",
                                       f"not tuned: {why}"))
            decided[id(layer)] = policy_name(layer)
            continue
        safety = float32_reason(layer, outputs)
        if safety:
            decided[id(layer)] = "float32"
            choices.append(LayerChoice(layer.name, cls, "float32", "safety", safety))
            continue
        if (not weighted(layer) or cls in NORMALIZATION_WITH_UPCAST) and not graph:
            decided[id(layer)] = policy_name(layer)
            choices.append(LayerChoice(layer.name, cls, policy_name(layer), "kept",
                                       "not tuned: no weights, and a subclassed model has no "
                                       "graph to say what feeds it"))
            continue
        if not weighted(layer) or cls in NORMALIZATION_WITH_UPCAST:
            feeders = [decided.get(id(p), "float32") for p in producers(layer)]
            chosen = policy if feeders and all(is_16bit(p) for p in feeders) else "float32"
            decided[id(layer)] = chosen
            choices.append(LayerChoice(layer.name, cls, chosen, "follower",
                                       "follows its inputs' precision"))
            continue
        inputs, ref = values[id(layer)]
        run32, _ = make_runner(layer, "float32", inputs)
        run16, out16 = make_runner(layer, policy, inputs)
        error = _rel_error(out16, ref)
        if timer is not None:
            times = _interleaved(timer, layer, {"float32": run32, policy: run16}, rounds)
        else:
            times, unmeasured = _tuner_times(layer, inputs, policy, run32, run16, rounds)
            if unmeasured:
                decided[id(layer)] = "float32"
                choices.append(LayerChoice(layer.name, cls, "float32", "tuned", unmeasured,
                                           error=error))
                continue
        t32, t16 = times["float32"], times[policy]
        if error > tolerance:
            chosen, why = "float32", f"16-bit error {error:.2g} > tolerance {tolerance:g}"
        elif t16 < t32 * (1.0 - margin):
            chosen, why = policy, f"16 bit {t16 / t32:.2f}x the float32 time"
        else:
            chosen, why = "float32", f"16 bit not faster ({t16 / t32:.2f}x)"
        decided[id(layer)] = chosen
        choices.append(LayerChoice(layer.name, cls, chosen, "tuned", why, t32, t16, error))
    result = TuneResult(policy, choices, tolerance, margin, applied=apply)
    broad = _broad(top, choices, decided, policy, tolerance)
    if check_model and any(is_16bit(p) for p in (*decided.values(), *broad.values())):
        _check_whole_model(model, top, decided, broad, x, timer or default_timer, rounds,
                           result)
    if apply:
        by_name = {layer.name: layer for layer in top}
        for c in choices:
            if c.kind != "kept" and policy_name(by_name[c.layer]) != c.policy:
                set_policy(by_name[c.layer], c.policy)
        reset_step_functions(model)
    return result


def _tuner_times(layer: Any, inputs: Any, policy: str, run32: Callable[[], Any],
                 run16: Callable[[], Any], rounds: int) -> tuple[dict[str, float], str | None]:
    """The layer's float32 and 16-bit times (ms) through ``tfmx.tuner``: measured here once
    (:func:`default_timer`, ``rounds`` alternations) and cached per machine, so the next
    process tunes nothing; (times, None), or ({}, why) when the tuner measures nothing
    (``TFMX_TUNE=off``, a cache miss under ``cached``)."""
    import tensorflow as tf

    backend = backends.detect()
    mode = resolve_mode(None)

    def timer(candidates: dict, seconds: float) -> dict[str, float]:
        runs = {name: factory() for name, factory in candidates.items()}
        return {name: ms / 1e3 for name, ms in
                _interleaved(default_timer, layer, runs, rounds).items()}

    tuner = Tuner(mode, None if mode == "off" else TuningCache.for_backend(backend), timer)
    shapes = " ".join(f"{t.dtype.name}{list(t.shape)}" for t in tf.nest.flatten(inputs)
                      if hasattr(t, "shape"))
    config = json.dumps(layer.get_config(), sort_keys=True, default=str)
    digest = hashlib.sha1(config.encode()).hexdigest()[:10]
    signature = f"{type(layer).__name__} config {digest} inputs {shapes} {policy}"
    decision = tuner.choose("policies", signature, {"float32": lambda: run32,
                                                    policy: lambda: run16},
                            conservative="float32")
    if not decision.times_ms:
        return {}, f"not measured: {decision.why()}"
    return dict(decision.times_ms), None


def _broad(top: list[Any], choices: list[LayerChoice], decided: dict[int, str], policy: str,
           tolerance: float) -> dict[int, str]:
    """The block-level candidate: every tuned layer whose 16-bit output is accurate in 16 bit
    (whether or not it was faster alone: a layer timed alone pays the casts at its borders,
    which a run of 16-bit layers does not), followers following, safety and kept layers as
    decided."""
    by_name = {c.layer: c for c in choices}
    broad: dict[int, str] = {}
    for layer in top:
        c = by_name[layer.name]
        if c.kind == "tuned" and c.error is not None and c.error <= tolerance \
                and c.float32_ms is not None:
            broad[id(layer)] = policy
        elif c.kind == "follower":
            feeders = [broad.get(id(p), "float32") for p in producers(layer)]
            broad[id(layer)] = policy if feeders and all(is_16bit(p) for p in feeders) \
                else "float32"
        else:
            broad[id(layer)] = decided[id(layer)]
    return broad


CHECK_ROUNDS = 24
"""Most interleaved rounds of the whole-model check (it stops earlier once decided)."""
CHECK_EARLY = 0.01
"""Sign-test p-value that ends the whole-model check early in favour of 16 bit."""


def _check_whole_model(model: Any, top: list[Any], decided: dict[int, str],
                       broad: dict[int, str], x: Any, timer: Timer, rounds: int,
                       result: TuneResult) -> None:
    """Time the whole model (forward + gradient, as tfmx rewrites it where it is enabled) in
    float32, with the per-layer choice and with every accurate layer in 16 bit (``broad``),
    interleaved; keep the fastest of the 16-bit ones if it is faster than float32 beyond noise
    (its median lower, and faster in so many rounds that chance alone would do it with
    probability at most ``tfmx.tuner.SIGNIFICANCE``: the tuner's sign test), else float32
    everywhere. Rounds go on from ``max(rounds, tfmx.tuner.MIN_ROUNDS)`` until the leader is
    faster beyond doubt (p <= :data:`CHECK_EARLY`), can no longer get there, or
    :data:`CHECK_ROUNDS` are done. ``margin`` is the cut for a layer alone, whose time carries
    the casts at its borders; the whole model's time does not."""
    all32 = {key: "float32" for key in decided}
    runs = {"float32": _model_runner(model, top, all32, x)}
    if any(is_16bit(p) for p in decided.values()):
        runs["tuned"] = _model_runner(model, top, decided, x)
    if broad != decided and any(is_16bit(p) for p in broad.values()):
        runs["broad"] = _model_runner(model, top, broad, x)
    samples: dict[str, list[float]] = {label: [] for label in runs}
    first = max(rounds, MIN_ROUNDS)
    for r in range(max(first, CHECK_ROUNDS)):
        for label in list(runs) if r % 2 == 0 else list(reversed(runs)):
            samples[label].append(timer(model, label, runs[label]) * 1000.0)
        done, last = r + 1, max(first, CHECK_ROUNDS)
        if done >= first:
            lead = min((k for k in runs if k != "float32"),
                       key=lambda k: statistics.median(samples[k]))
            won = sum(a < b for a, b in zip(samples[lead], samples["float32"]))
            if (sign_test(won, done) <= CHECK_EARLY
                    or sign_test(won + last - done, last) > SIGNIFICANCE):
                break
    times = {label: statistics.median(ms) for label, ms in samples.items()}
    result.model_float32_ms = times["float32"]
    result.model_tuned_ms, result.model_broad_ms = times.get("tuned"), times.get("broad")
    best = min((k for k in runs if k != "float32"), key=lambda k: times[k])
    ratio = times[best] / times["float32"]
    wins = sum(a < b for a, b in zip(samples[best], samples["float32"]))
    if ratio >= 1.0 or sign_test(wins, len(samples[best])) > SIGNIFICANCE:
        result.model_choice = "float32"
        for c in result.layers:
            if c.kind != "kept" and is_16bit(c.policy):
                c.policy = "float32"
                c.reason += (f"; but the whole model ran {ratio:.2f}x float32 with it, faster "
                             f"in {wins} of {len(samples[best])} rounds (not beyond noise): "
                             "float32")
        return
    result.model_choice = best
    if best == "tuned":
        return
    by_id = {id(layer): layer.name for layer in top}
    chosen = {by_id[k]: v for k, v in broad.items()}
    for c in result.layers:
        if c.kind in ("tuned", "follower") and chosen[c.layer] != c.policy:
            c.policy = chosen[c.layer]
            c.reason += (f"; in 16 bit with the others: the whole model ran {ratio:.2f}x "
                         "float32 so")
