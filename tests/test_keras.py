"""tfmx.enable() on real Keras models: parity with stock, and the fused nodes in what ran."""

from __future__ import annotations

import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_within_rounding, exact_patterns, needs_onednn, ops_that_ran

import fusion.graphs.contraction as contraction
import tfmx
from tfmx.keras_hook import installed

# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")



def build_model(seed: int = 0, compile_kwargs: dict | None = None) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(6, 3, padding="same", activation="relu")(inp)
    y = keras.layers.Conv2D(6, 3, padding="same")(x)
    x = keras.layers.ReLU()(keras.layers.Add()([x, y]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(12, activation="relu")(x)
    out = keras.layers.Dense(3, activation="softmax")(x)
    model = keras.Model(inp, out)
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        **(compile_kwargs or {}),
    )
    return model


def data(n: int = 36, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((n, 8, 8, 3), dtype=np.float32), rng.integers(0, 3, n)


def max_rel_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y) / (np.abs(x) + 1e-6))) for x, y in zip(a, b))


def fused_conv(ran: set[str]) -> bool:
    """A fused convolution ran: Eigen's, or oneDNN's where the onednn family moved it there
    (all families, oneDNN off)."""
    return bool({"_FusedConv2D", "_MklNativeFusedConv2D"} & ran)


def assert_parity(stock: list, fused: list, terms: int) -> None:
    """Each tensor within float_tolerance(float32, terms, its largest value). With the exact
    families and this model (Relu chains) the fused nodes are the kernels Grappler's own
    remapper gives the stock step, so the numbers are the same but for what those kernels do
    not promise: with oneDNN on, one full run in three showed a 1-ulp gradient difference
    between two runs of the same step (tests/parity.py), so a training run is held to one
    rounding per step (:data:`STEPS`); a single inference to none."""
    for i, (a, b) in enumerate(zip(stock, fused)):
        assert_within_rounding(b, a, terms, what=f"tensor {i}")


STEPS = 2 * 5  # train(): 2 epochs of ceil(36 / 8) batches


def weights(model: keras.Model) -> list[np.ndarray]:
    return [v.numpy() for v in model.weights] + [v.numpy() for v in model.optimizer.variables]


def train(enable: bool, **fit_kwargs):
    if enable:
        tfmx.enable(backend="cpu", patterns=exact_patterns())
    else:
        tfmx.disable()
    model = build_model()
    x, y = data()
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, **fit_kwargs)
    return model, history


def test_fit_matches_stock_and_runs_fused_nodes():
    stock, h_stock = train(False)
    fused, h_fused = train(True)
    assert_parity(weights(stock), weights(fused), STEPS)
    assert_parity([h_stock.history["loss"]], [h_fused.history["loss"]], STEPS)
    ran = ops_that_ran(fused.train_function)
    assert {"_FusedConv2D", "_FusedMatMul"} <= ran
    assert "_FusedConv2D" not in ops_that_ran(stock.train_function)
    rep = tfmx.report()
    assert rep.fused("contraction") >= 4
    assert any(t.status == "rewritten" for t in rep.traces)


def test_predict_and_evaluate_match_stock():
    stock, _ = train(False)
    x, y = data(10, seed=3)
    p_stock, e_stock = stock.predict(x, verbose=0), stock.evaluate(x, y, verbose=0)
    fused, _ = train(True)
    p_fused, e_fused = fused.predict(x, verbose=0), fused.evaluate(x, y, verbose=0)
    assert_parity([p_stock, e_stock], [p_fused, e_fused], STEPS)  # of trained weights
    assert "_FusedConv2D" in ops_that_ran(fused.predict_function)
    assert "_FusedMatMul" in ops_that_ran(fused.test_function)


def test_tf_data_steps_per_execution_validation_and_callbacks(tmp_path):
    x, y = data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    results = {}
    for enable in (False, True):
        tfmx.enable(backend="cpu", patterns=exact_patterns()) if enable else tfmx.disable()
        model = build_model(compile_kwargs={"steps_per_execution": 3})
        ckpt = tmp_path / f"best_{enable}.weights.h5"
        model.fit(
            ds,
            epochs=3,
            verbose=0,
            validation_data=(x[:10], y[:10]),
            callbacks=[
                keras.callbacks.ModelCheckpoint(str(ckpt), save_weights_only=True),
                keras.callbacks.EarlyStopping(monitor="loss", patience=5),
            ],
        )
        assert ckpt.exists()
        results[enable] = weights(model)
    assert_parity(results[False], results[True], 3 * 5)  # 3 epochs of 5 batches


@needs_onednn("either")  # all families: with oneDNN off the onednn family too
def test_model_compiled_before_enable_is_rebuilt_and_disable_restores_stock():
    x, y = data()
    model = build_model()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert not fused_conv(ops_that_ran(model.train_function))
    tfmx.enable(backend="cpu")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    fused_fn = model.train_function
    assert fused_conv(ops_that_ran(fused_fn))
    tfmx.disable()  # every patch put back; the model's next step builds Keras's own
    from fusion import patches

    assert [p for p in patches.installed() if p.group.startswith("tfmx")] == []
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.train_function is not fused_fn
    assert not fused_conv(ops_that_ran(model.train_function))
    assert fused_conv(ops_that_ran(fused_fn))  # a reference kept still runs fused


def test_disable_inside_a_fit_goes_on_with_keras_own_step():
    """A callback that switches tfmx off mid-epoch: the fit finishes on Keras's own step, and
    Keras's methods are Keras's again."""
    import keras

    x, y = data()
    tfmx.enable(backend="cpu")
    model = build_model()
    switched = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: tfmx.disable() if batch == 1 else None)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[switched])
    assert np.isfinite(history.history["loss"]).all()
    assert not fused_conv(ops_that_ran(model.train_function))
    from fusion import private_api

    assert not hasattr(private_api.get("keras.trainer").make_train_function, "__wrapped__")


@pytest.mark.parametrize("kind", ["train", "test", "predict"])
def test_make_functions_return_what_keras_returns(kind):
    """Keras's make_*_function returns None when it builds and the function when cached."""
    tfmx.enable(backend="cpu")
    model = build_model()
    make = getattr(model, f"make_{kind}_function")
    assert make() is None
    built = getattr(model, f"{kind}_function")
    assert built is not None
    assert make() is built
    assert make(force=True) is None
    tfmx.disable()  # a new generation: the next call rebuilds, as Keras builds: None
    assert make() is None
    assert getattr(model, f"{kind}_function") is not built


@needs_onednn("either")  # all families: with oneDNN off the onednn family too
def test_recompile_and_several_fits():
    tfmx.enable(backend="cpu")
    x, y = data()
    model = build_model()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    model.fit(x, y, batch_size=12, epochs=1, verbose=0)
    assert fused_conv(ops_that_ran(model.train_function))


def test_save_and_load_weights_are_what_ran(tmp_path):
    tfmx.enable(backend="cpu")
    model, _ = train(True)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    x, _ = data(6, seed=5)
    assert_parity([model.predict(x, verbose=0)], [loaded.predict(x, verbose=0)], 0)


def test_a_failing_pass_leaves_the_graph_and_training_goes_on(monkeypatch):
    def broken(view, match):
        raise RuntimeError("deliberate failure")

    monkeypatch.setattr(contraction, "rewrite_contraction", broken)
    stock, _ = train(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused, _ = train(True)
    assert max_rel_diff(weights(stock), weights(fused)) == 0.0
    errors = tfmx.report().patterns["contraction"].errors
    assert errors and "deliberate failure" in errors[0]
    assert any(issubclass(w.category, tfmx.TfmxWarning) for w in caught)
    assert "_FusedConv2D" not in ops_that_ran(fused.train_function)


def test_verify_passes_on_a_correct_rewrite():
    tfmx.enable(backend="cpu", verify=True)
    model, history = train(True)
    assert np.isfinite(history.history["loss"]).all()


def test_verify_catches_a_wrong_rewrite_and_restores_variables(monkeypatch):
    original = contraction.rewrite_contraction

    def wrong(view, match):
        fused = original(view, match)
        ops = [s.decode() for s in fused.attr["fused_ops"].list.s]
        if ops == ["BiasAdd", "Relu"]:
            del fused.attr["fused_ops"].list.s[:]
            fused.attr["fused_ops"].list.s.extend([b"BiasAdd", b"Elu"])
        return fused

    monkeypatch.setattr(contraction, "rewrite_contraction", wrong)
    tfmx.enable(backend="cpu", verify=True)
    model = build_model()
    model.optimizer.build(model.trainable_variables)
    before = weights(model)
    x, y = data()
    with pytest.raises(tfmx.VerificationError, match="largest difference"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert max_rel_diff(before, weights(model)) == 0.0


def test_metal_backend_on_linux_gives_a_plan_and_a_clear_error():
    tfmx.enable(backend="metal")
    model = build_model()
    x, y = data()
    with pytest.raises(tfmx.BackendUnavailableError, match="metal"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    rep = tfmx.report()
    assert rep.traces[0].status == "plan only"
    assert rep.traces[0].ops_after["_FusedConv2D"] >= 1


def test_jit_compile_models_are_left_to_xla():
    tfmx.enable(backend="cpu")
    model = build_model(compile_kwargs={"jit_compile": True})
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert any("jit_compile" in n for n in tfmx.report().notes)
    assert not tfmx.report().traces


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="choose one of"):
        tfmx.enable(backend="tpu")
    with pytest.raises(ValueError, match="choose from"):
        tfmx.enable(patterns=["conv_magic"])
    with pytest.raises(ValueError, match="verify"):
        tfmx.enable(verify="yes")
    assert not tfmx.enabled()


def test_enable_is_idempotent_and_global():
    tfmx.enable(backend="cpu")
    gen_report = tfmx.report()
    tfmx.enable(backend="cpu")
    assert tfmx.report() is gen_report
    assert installed() and tfmx.enabled()


def test_report_prints_dicts_and_exports_graphs(tmp_path):
    train(True)
    rep = tfmx.report()
    text = str(rep)
    assert "contraction" in text and "_FusedConv2D" in text
    d = rep.to_dict()
    assert d["patterns"]["contraction"]["fused"] >= 4
    assert d["op_histogram"]["_FusedConv2D"]["before"] == 0
    dirs = rep.export_graphs(tmp_path)
    assert dirs
    assert any(f.startswith("events") for f in os.listdir(dirs[0] / "after"))
    assert "_FusedConv2D" in (dirs[0] / "after.pbtxt").read_text()
