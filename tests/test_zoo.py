"""The zoo (bench/zoo.py): models tfmx's authors did not write, trained stock and with tfmx.

For each zoo model at its tiny size, from the same weights and data: a few ``fit`` steps stock,
with tfmx, and as stock' (stock again from the weights times ``1 + 1e-7 * N(0, 1)``, the
chaos baseline of recipes/_train.py: how far float32 rounding alone moves a run). tfmx's
losses and weights must stay within the baseline's distance from stock (times
:data:`NOISE_FACTOR`, one stock' run being a rough estimate of the noise); the families the
model has must be fused; what tfmx declined must read as reasons.

Speed is not under test: every match is rewritten (the ``every_rewrite`` fixture: the tuner
never measures), the guard and XLA regions are off. Each model is traced twice (stock and
tfmx; stock' reruns stock's traced step), once per module (:func:`runs`).
"""

from __future__ import annotations

import sys

import keras
import numpy as np
import pytest
from helpers import onednn_state, weight_scales

import tfmx
from bench import zoo
from recipes._train import perturbed

pytestmark = pytest.mark.usefixtures("every_rewrite")

SAMPLES, BATCH, EPOCHS = 48, 4, 1  # 12 steps, each on batches not seen before
STEPS = EPOCHS * SAMPLES // BATCH
NOISE_FACTOR = 3.0
# Below this (relative to a weight's scale) any two runs agree: a few float32 roundings a step.
FLOOR = STEPS * 8 * float(np.finfo(np.float32).eps)

HUB = pytest.mark.skipif(
    sys.version_info < (3, 11),
    reason="keras-hub (the zoo's transformer backbones) needs Python 3.11 or newer")
NAMES = [pytest.param(name, marks=[HUB] if zoo.MODELS[name].needs_keras_hub else [])
         for name in zoo.MODELS]


class _Losses(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def _state(model: keras.Model) -> list[np.ndarray]:
    return [v.numpy() for v in model.variables + model.optimizer.variables]


def _restore(model: keras.Model, values: list[np.ndarray]) -> None:
    for v, value in zip(model.variables + model.optimizer.variables, values):
        v.assign(value)


def _fit(model: keras.Model, x: np.ndarray, y: np.ndarray) -> dict:
    losses = _Losses()
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False,
              callbacks=[losses])
    return {"losses": np.array(losses.losses), "weights": [v.numpy() for v in model.weights]}


def _compiled(name: str) -> keras.Model:
    model = zoo.build(name, size="tiny", seed=0)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    model.optimizer.build(model.trainable_variables)  # its slots exist before the first step
    return model


@pytest.fixture(scope="module")
def runs():
    """name -> {"stock", "baseline", "tfmx": {losses, weights}, "initial": weights, "report",
    "error"}: each model trained once per module, on first use."""
    done: dict[str, dict] = {}

    def run(name: str) -> dict:
        if name in done:
            return done[name]
        x, y = zoo.sample_data(name, SAMPLES, size="tiny")
        out: dict = {}
        tfmx.disable()
        stock = _compiled(name)
        start = _state(stock)
        out["initial"] = [v.numpy() for v in stock.weights]
        out["paths"] = [v.path for v in stock.weights]
        out["stock"] = _fit(stock, x, y)
        n_model = len(stock.variables)
        # stock': the same traced step from perturbed trainable weights, the rest as it was
        trainable = {id(v) for v in stock.trainable_variables}
        shaken = perturbed(start[:n_model], seed=1)
        _restore(stock, [s if id(v) in trainable else w for v, s, w in
                         zip(stock.variables, shaken, start)] + start[n_model:])
        out["baseline"] = _fit(stock, x, y)
        tfmx.enable(backend="cpu", guard=False, xla=False)
        tfmx.report(reset=True)
        try:
            fused = _compiled(name)
            _restore(fused, start)
            out["tfmx"] = _fit(fused, x, y)
            out["error"] = None
        except Exception as exc:  # noqa: BLE001 - reported by the tests below
            out["error"] = exc
        out["report"] = tfmx.report()
        tfmx.disable()
        done[name] = out
        return out

    yield run
    tfmx.disable()


def _distance(a: dict, b: dict, scales: list[float]) -> tuple:
    """(largest loss difference relative to the loss, largest weight difference relative to
    the weight's scale (helpers.weight_scales), that weight's index)."""
    loss = float(np.max(np.abs(a["losses"] - b["losses"]) / np.abs(a["losses"])))
    rel = [float(np.max(np.abs(wa.astype(np.float64) - wb))) / scale if wa.size else 0.0
           for wa, wb, scale in zip(a["weights"], b["weights"], scales)]
    worst = int(np.argmax(rel))
    return loss, rel[worst], worst


class _Weights:  # what weight_scales reads of a model, for a list of arrays
    def __init__(self, paths: list[str], values: list[np.ndarray]):
        self.weights = [_Value(path, v) for path, v in zip(paths, values)]


class _Value:
    def __init__(self, path: str, value: np.ndarray):
        self.path, self._value = path, value

    def numpy(self) -> np.ndarray:
        return self._value


def _trained(out: dict) -> dict:
    if out["error"] is not None:
        pytest.fail(f"tfmx's fit failed: {type(out['error']).__name__}: {out['error']}"[:2000])
    return out


@pytest.mark.parametrize("name", NAMES)
def test_tfmx_trains_like_stock_within_the_rounding_noise(runs, name):
    out = _trained(runs(name))
    scales = [max(s, 1e-30) for s in weight_scales(_Weights(out["paths"], out["stock"]["weights"]),
                                                    out["initial"])]
    loss_t, weight_t, at_t = _distance(out["stock"], out["tfmx"], scales)
    loss_n, weight_n, _ = _distance(out["stock"], out["baseline"], scales)
    print(f"{name}: |stock - tfmx| loss {loss_t:.2e} weights {weight_t:.2e} (weight {at_t}); "
          f"|stock - stock'| loss {loss_n:.2e} weights {weight_n:.2e}")
    assert loss_t <= max(NOISE_FACTOR * loss_n, FLOOR), (
        f"{name}: losses differ by {loss_t:.2e} (relative), stock' by {loss_n:.2e}")
    assert weight_t <= max(NOISE_FACTOR * weight_n, FLOOR), (
        f"{name}: weight {at_t} differs by {weight_t:.2e} of its scale, stock' by "
        f"{weight_n:.2e}")


@pytest.mark.parametrize("name", NAMES)
def test_the_families_the_model_has_are_fused(runs, name):
    report = _trained(runs(name))["report"]
    fused = {family: report.fused(family) for family in zoo.MODELS[name].families}
    assert all(fused.values()), f"{name}: nothing fused by {fused}:\n{report}"
    assert any(t.status == "rewritten" for t in report.traces), str(report)
    _, after = report.op_histogram()  # the step's graph as tfmx rewrote it
    if {"batch_norm", "layer_norm"} & set(fused):  # both run through FusedBatchNormV3, as
        # TensorFlow's kernel or (the onednn family, oneDNN off) as oneDNN's
        for op in ("FusedBatchNormV3", "FusedBatchNormGradV3"):
            assert after[op] or after[f"_MklNative{op}"], f"no {op}: {dict(after)}"


def test_the_zoo_is_a_bench_group():
    from bench.workloads import WORKLOADS, expand_models, random_dataset

    assert expand_models(["zoo"]) == [f"zoo_{name}" for name in zoo.MODELS]
    llama = WORKLOADS["zoo_llama"]
    x, y = next(iter(random_dataset(llama, 4, seed=0)))
    assert x.dtype.name == "int32" and tuple(x.shape) == (4, 64)
    assert 0 <= int(np.min(x)) and int(np.max(x)) < llama.vocabulary
    x, _ = next(iter(random_dataset(WORKLOADS["zoo_convnext_tiny"], 2, seed=0)))
    assert x.dtype.name == "float32" and tuple(x.shape) == (2, 32, 32, 3)


# What the report says tfmx declined or left apart in each tiny model (a part of a reason).
DECLINES = {
    "mobilenet_v3_small": "residual Add left apart",  # the SE block's multiply feeds the Add
    "efficientnet_b0": "Sigmoid left apart",  # the SE block's 1x1 convolution + sigmoid
    # its 7x7 depthwise convolutions are grouped Conv2Ds, which Keras compiles with XLA: the
    # depthwise family runs them as TensorFlow's depthwise kernels, so nothing is left to say
    "convnext_tiny": None,
    "densenet121": "FusedBatchNormV3+Relu",  # BN-ReLU-Conv: no residual Add
    "bert": "sparse gradient",  # the embeddings' Adam updates
    "gpt2": "sparse gradient",
    "llama": "sparse gradient",
    "mixtral": "top-k routing kept",  # the moe family: dense dispatch, data-dependent shapes
    "qwen_moe": "top-k routing kept",
    "efficientnet_v2_b0": "Sigmoid left apart",  # as efficientnet_b0's
    # the convolution shortcut and the last 1x1 convolution of a block meet in one Add: with
    # oneDNN, whose Conv2D fuses an Add, the other addend's chain fused it; without, none can
    "resnet50_v2": ("residual Add left apart: the other addend's chain fused it"
                    if onednn_state() == "on" else "residual Add left apart: cpu runs no fused "
                    "Conv2D+Add"),
    "xception": "FusedBatchNormV3+Relu",  # a separable convolution's batch norm, then ReLU
    "gemma": "sparse gradient",
    "qwen3": "sparse gradient",
}


@pytest.mark.parametrize("name", NAMES)
def test_the_report_says_what_was_declined_and_why(runs, name):
    report = runs(name)["report"]
    reasons = [why for stats in report.patterns.values()
               for why in (*stats.declined, *stats.partial)]
    errors = [e for stats in report.patterns.values() for e in stats.errors]
    errors += [e for t in report.traces for e in t.errors]
    assert not errors, f"{name}: tfmx recorded errors:\n" + "\n".join(errors)
    for why in reasons:
        assert len(why.split()) >= 3 and " at 0x" not in why, f"unreadable reason: {why!r}"
    if DECLINES[name] is None:
        assert report.patterns["depthwise"].fused, f"{name}: grouped convolutions left:\n{report}"
        return
    assert reasons, f"{name}: nothing declined, nothing said:\n{report}"
    assert any(DECLINES[name] in why for why in reasons), (
        f"{name}: no reason mentions {DECLINES[name]!r}: {reasons}")
    text = str(report)
    assert all(why in text for why in reasons)
