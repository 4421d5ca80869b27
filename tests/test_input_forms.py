"""Every input form Keras layers take, fed to every stage family: the same outcome as stock.

Each case builds one small model around the family's layer (tfmx on while the model is built,
so functional construction and ``build`` run with the hooks installed), fed one input form,
and trains it a step or two stock and with tfmx (every rewrite taken; ``TFMX_STRICT=1`` in this
suite, so a stage that fails on the form raises here instead of falling back). The outcome is
the same as stock's: the same exception type where stock raises, else weights and
``evaluate``/``predict`` within rounding; the family's report has no error, and each call it
saw was fused or declined with a reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmx
from fusion import stage

pytestmark = pytest.mark.usefixtures("every_rewrite")

L = keras.layers
N = 16

# family -> (the input shape its layer reads, the layer(s) applied to a tensor, made with
# ``c(keras class)``: the class itself, or a user's subclass of it)
Maker = Callable[[Callable[[type], type]], Callable[..., Any]]
CORES: dict[str, tuple[tuple[int, ...], Maker]] = {
    "bias_row": ((8,), lambda c: c(L.Dense)(16, activation="relu")),
    "gelu": ((8,), lambda c: c(L.Dense)(16, activation="gelu")),
    "feed_forward": ((6, 8), lambda c: _chain(c(L.Dense)(16, activation="gelu"),
                                              c(L.Dense)(8))),
    "layer_norm": ((6, 8), lambda c: c(L.LayerNormalization)()),
    # keras.ops.rms_normalization's composite: the rms_norm stage alone finds its statistic
    "rms_norm": ((6, 8), lambda c: c(L.RMSNormalization)()),
    # the same composite's statistic, product and scale: the scaled_rms_norm stage takes it whole
    "scaled_rms_norm": ((6, 8), lambda c: c(L.RMSNormalization)()),
    "einsum_dense": ((6, 8), lambda c: c(L.EinsumDense)("abc,cd->abd", (None, 16),
                                                        bias_axes="d")),
    "attention": ((6, 8), lambda c: _self_attention(c(L.MultiHeadAttention)(2, 4))),
    "grouped_attention": ((6, 8), lambda c: _self_attention(c(L.GroupQueryAttention)(4, 4, 2))),
    "batch_norm": ((6, 6, 3), lambda c: c(L.BatchNormalization)()),
    "rnn": ((5, 3), lambda c: c(L.LSTM)(8, return_sequences=True)),
    "squeeze_excite": ((4, 4, 8), lambda c: _squeeze_excite(c)),
    # Keras layers making a SwiGLU block: the gated_product stage finds it from their ops
    "gated_product": ((6, 8), lambda c: _gated(c)),
}

STAGES = sorted(set(CORES) & {s.name for s in stage.stages()})
"""The families with a case here that are declared (a family's module removed, its case is
left unused)."""


def _keras(cls: type) -> type:
    return cls


def _user(cls: type) -> type:
    """A user's subclass of ``cls`` whose ``call`` wraps Keras's."""

    @functools.wraps(cls.call)  # Keras reads the signature (training, mask, build's)
    def call(self, *args, **kwargs):
        out = cls.call(self, *args, **kwargs)
        return out if isinstance(out, (tuple, list)) else out * 1.0

    return type(f"User{cls.__name__}", (cls,), {"call": call})


def _chain(*layers: Any) -> Callable[..., Any]:
    def call(x: Any, **kwargs: Any) -> Any:
        for layer in layers:
            x = layer(x, **kwargs)
        return x
    return call


def _self_attention(layer: Any) -> Callable[..., Any]:
    def call(x: Any, **kwargs: Any) -> Any:
        return layer(x, x, **kwargs)
    return call


def _squeeze_excite(c: Callable[[type], type]) -> Callable[..., Any]:
    """A squeeze-and-excitation block: pool, reduce, expand, the channel scale."""
    pool, scale = c(L.GlobalAveragePooling2D)(keepdims=True), c(L.Multiply)()
    squeeze = _chain(pool, c(L.Conv2D)(2, 1, activation="relu"),
                     c(L.Conv2D)(8, 1, activation="sigmoid"))

    def call(x: Any, **kwargs: Any) -> Any:
        return scale([x, squeeze(x, **kwargs)], **kwargs)
    return call


def _gated(c: Callable[[type], type]) -> Callable[..., Any]:
    """A gated feed-forward block of Keras layers: ``Multiply([Activation("silu")(Dense(x)),
    Dense(x)])``."""
    gate, up = c(L.Dense)(16), c(L.Dense)(16)
    act, product = c(L.Activation)("silu"), c(L.Multiply)()

    def call(x: Any, **kwargs: Any) -> Any:
        return product([act(gate(x, **kwargs), **kwargs), up(x, **kwargs)], **kwargs)
    return call


def _head(x: Any) -> Any:
    while len(x.shape) > 2:
        x = L.GlobalAveragePooling1D()(x) if len(x.shape) == 3 else L.GlobalAveragePooling2D()(x)
    return L.Dense(4)(x)


def _features(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    return rng.normal(size=(N, *shape)).astype("float32")


def build(family: str, form: str) -> tuple[keras.Model, Any, np.ndarray, dict]:
    """(compiled model, x, y, fit keyword arguments) of ``family``'s layer fed ``form``."""
    shape, make = CORES[family]
    rng = np.random.default_rng(1)
    y = rng.normal(size=(N, 4)).astype("float32")
    core = make(_user if form == "subclassed layer" else _keras)
    compile_kw: dict[str, Any] = {}
    fit_kw: dict[str, Any] = {}
    x: Any = _features(shape, rng)
    if form == "sparse":
        inp = keras.Input(shape, sparse=True)
        x = tf.sparse.from_dense(np.where(x > 0.5, x, 0.0))
        fit_kw["batch_size"] = 8
        out = core(inp)
    elif form == "ragged":
        inp = keras.Input(shape, ragged=True)
        x = tf.RaggedTensor.from_tensor(x)
        out = core(inp)
    elif form == "masked":
        inp = keras.Input(shape)
        x[:, -1] = 0.0  # the last step (or feature) masked
        out = core(L.Masking()(inp))
    elif form == "padding mask":  # a separate boolean mask input, as keras_hub models have
        inp = [keras.Input(shape), keras.Input(shape[:1], dtype="bool")]
        mask = np.ones((N, shape[0]), bool)
        mask[:, -2:] = False
        x = [x, mask]
        if family == "attention":
            layer = L.MultiHeadAttention(2, 4)
            out = layer(inp[0], inp[0], attention_mask=L.Lambda(
                lambda m: m[:, None, :] & m[:, :, None], output_shape=(shape[0], shape[0]))(
                inp[1]))
        else:
            out = core(inp[0] * L.Lambda(lambda m: tf.cast(m, "float32"))(inp[1])[
                (..., *[None] * (len(shape) - 1))])
    elif form == "dict":
        inp = {"a": keras.Input(shape, name="a"), "b": keras.Input(shape, name="b")}
        x = {"a": x, "b": _features(shape, rng)}
        out = core(L.Add()([inp["a"], inp["b"]]))
    elif form == "nested":
        inp = [keras.Input(shape), [keras.Input(shape)]]
        x = [x, [_features(shape, rng)]]
        out = core(L.Add()([inp[0], inp[1][0]]))
    elif form == "integer":
        inp = keras.Input(shape, dtype="int32")
        x = (x * 4).astype("int32")
        out = core(L.Lambda(lambda v: tf.cast(v, "float32"))(inp))
    elif form in ("training=True", "training=False"):
        inp = keras.Input(shape)
        out = core(inp, training=form.endswith("True"))
    else:
        inp = keras.Input(shape)
        out = core(inp)
    if form == "run_eagerly":
        compile_kw["run_eagerly"] = True
    if form == "jit_compile":
        compile_kw["jit_compile"] = True
    if isinstance(out, (tuple, list)):
        out = out[0]
    model_class = UserSteps if form == "train_step override" else keras.Model
    model = model_class(inp, _head(out))
    model.compile(keras.optimizers.SGD(0.01), "mse", **compile_kw)
    return model, x, y, fit_kw


class UserSteps(keras.Model):
    """A user's ``train_step`` and ``test_step``, written with a GradientTape."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}

    def test_step(self, data):
        x, y = data
        return {"loss": tf.reduce_mean(tf.square(self(x, training=False) - y))}


FORMS = ("plain", "sparse", "ragged", "masked", "padding mask", "dict", "nested", "integer",
         "mixed_float16", "mixed_bfloat16", "training=True", "training=False", "run_eagerly",
         "jit_compile", "train_step override", "subclassed layer")


def _run(family: str, form: str, on: bool) -> dict[str, Any]:
    """Build and train the case with tfmx ``on`` or off: its weights, evaluate's and predict's
    results, or the exception type it raised."""
    policy = form if form.startswith("mixed_") else "float32"
    if on:
        tfmx.enable(backend="cpu", patterns=[family], guard=False)
    else:
        tfmx.disable()
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        model, x, y, fit_kw = build(family, form)
        model.fit(x, y, epochs=1, shuffle=False, verbose=0, **{"batch_size": 8, **fit_kw})
        loss = model.evaluate(x, y, batch_size=8, verbose=0)
        predicted = model.predict(x, batch_size=8, verbose=0)
        return {"weights": [w.numpy().astype("float64") for w in model.weights],
                "paths": [w.path for w in model.weights], "evaluate": np.asarray(loss),
                "predict": np.asarray(predicted, "float64")}
    except Exception as exc:  # noqa: BLE001 - the outcome compared with stock's
        return {"raised": type(exc).__name__, "message": str(exc)[:300]}
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _tolerance(form: str) -> float:
    """Relative tolerance: float32 forms round differently from Keras's in a few operations
    per value; a 16-bit policy's forms, by a few roundings of its 8- or 11-bit significand."""
    return {"mixed_bfloat16": 2.0**-8 * 8, "mixed_float16": 2.0**-11 * 8}.get(form, 1e-5)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("family", STAGES)
def test_each_family_takes_or_declines_each_input_form(family, form):
    stock = _run(family, form, on=False)
    tfmx.report(reset=True)
    fused = _run(family, form, on=True)
    if "raised" in stock:
        assert fused.get("raised") == stock["raised"], (stock, fused)
        return
    assert "raised" not in fused, fused
    stats = tfmx.report().patterns.get(family)
    assert stats is None or not stats.errors, stats.errors
    rtol = _tolerance(form)
    for path, a, b in zip(stock["paths"], stock["weights"], fused["weights"]):
        scale = max(1.0, float(np.max(np.abs(a)))) if a.size else 1.0
        np.testing.assert_allclose(b, a, rtol=0, atol=rtol * scale * 8, err_msg=path)
    for key in ("evaluate", "predict"):
        scale = max(1.0, float(np.max(np.abs(stock[key]))))
        np.testing.assert_allclose(fused[key], stock[key], rtol=0, atol=rtol * scale * 8,
                                   err_msg=key)
