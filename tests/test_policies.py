"""policies: names, the global policy, "auto", safe defaults, loss scaling, warnings, errors."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from policies_fixtures import restore_global_policy  # noqa: F401 (autouse fixture)

import policies
from policies import global_policy
from policies.hardware_choice import Hardware, choose

XEON_AMX = Hardware(cpu_name="Xeon", cpu_flags=frozenset({"avx512f", "avx512_bf16", "amx_bf16",
                                                           "avx512_fp16"}))
PLAIN_CPU = Hardware(cpu_name="Plain", cpu_flags=frozenset({"avx2", "f16c"}))


def mlp(n_in=8, hidden=16, classes=3, softmax=True, name="mlp"):
    inp = keras.Input((n_in,))
    x = keras.layers.Dense(hidden, activation="relu", name="h1")(inp)
    x = keras.layers.Dense(hidden, activation="relu", name="h2")(x)
    out = keras.layers.Dense(classes, activation="softmax" if softmax else None, name="out")(x)
    return keras.Model(inp, out, name=name)


def fake_hardware(monkeypatch, hw):
    monkeypatch.setattr(global_policy._STATE, "hardware", hw)


# -- names and errors --------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["fp16", "mixed", "float64", None, 16])
def test_unknown_name_is_a_value_error_listing_the_names(bad):
    with pytest.raises(ValueError) as err:
        policies.set_global(bad)
    for name in policies.POLICY_NAMES:
        assert repr(name) in str(err.value)
    assert policies.current() == "float32"


def test_pure_16bit_names_get_a_hint():
    with pytest.raises(ValueError, match="did you mean 'mixed_bfloat16'"):
        policies.scope("bfloat16").__enter__()


# -- the global policy -------------------------------------------------------------------------
def test_policy_reaches_layers_built_after_it():
    before = keras.layers.Dense(4)
    choice = policies.set_global("mixed_bfloat16")
    after = mlp()
    assert choice.policy == policies.current() == "mixed_bfloat16"
    assert before.compute_dtype == "float32"
    assert after.get_layer("h1").compute_dtype == "bfloat16"
    assert after.get_layer("h1").variable_dtype == "float32"


def test_scope_restores_the_previous_global():
    policies.set_global("mixed_bfloat16")
    with policies.scope("float32"):
        inside = keras.layers.Dense(2)
        assert policies.current() == "float32"
    assert policies.current() == "mixed_bfloat16"
    assert inside.compute_dtype == "float32"
    with pytest.raises(RuntimeError), policies.scope("mixed_bfloat16"):
        raise RuntimeError("boom")
    assert policies.current() == "mixed_bfloat16"


def test_auto_says_what_it_chose_and_why(monkeypatch, capsys):
    fake_hardware(monkeypatch, XEON_AMX)
    choice = policies.set_global("auto")
    assert choice.policy == "mixed_bfloat16" and policies.current() == "mixed_bfloat16"
    printed = capsys.readouterr().out
    assert "'auto' chose 'mixed_bfloat16'" in printed and "amx_bf16" in printed
    assert "amx_bf16" in policies.explain()
    fake_hardware(monkeypatch, PLAIN_CPU)
    choice = policies.set_global("auto", verbose=False)
    assert choice.policy == "float32"
    assert "no bfloat16 or float16 matrix instructions" in choice.reason


def test_auto_on_this_machine_matches_its_cpu_flags():
    hw = policies.hardware()
    choice = policies.resolve("auto")
    if hw.cpu_bf16 and not hw.gpu:
        assert choice.policy == "mixed_bfloat16"
    elif not hw.gpu:
        assert choice.policy == "float32"


@pytest.mark.parametrize("hw, expected", [
    (Hardware(cuda_capabilities=((8, 6),)), "mixed_bfloat16"),
    (Hardware(cuda_capabilities=((7, 0),)), "mixed_float16"),
    (Hardware(cuda_capabilities=((6, 1),)), "float32"),
    (Hardware(apple_gpu=True, macos_version=(14, 2)), "mixed_float16"),
    (Hardware(apple_gpu=True, macos_version=(13, 6)), "mixed_float16"),
    (XEON_AMX, "mixed_bfloat16"),
    (Hardware(cpu_flags=frozenset({"avx512_bf16"})), "mixed_bfloat16"),
    (PLAIN_CPU, "float32"),
])
def test_auto_rules(hw, expected):
    choice = choose(hw)
    assert choice.policy == expected
    assert choice.reason


def test_hardware_detection_reads_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: fpu amx_bf16 "
                    "avx512_bf16\n\nprocessor\t: 1\nmodel name\t: Intel Xeon\nflags\t\t: fpu\n")
    hw = policies.detect(str(info))
    assert hw.cpu_name == "Intel Xeon" and hw.cpu_bf16 and not hw.cpu_fp16
    assert policies.detect(str(tmp_path / "missing")).cpu_flags == frozenset()


def test_float16_on_a_cpu_without_fp16_hardware_warns_slow(monkeypatch):
    fake_hardware(monkeypatch, PLAIN_CPU)
    with pytest.warns(policies.PolicyWarning, match="SLOWER than float32"):
        policies.set_global("mixed_float16")
    fake_hardware(monkeypatch, XEON_AMX)  # has avx512_fp16: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", policies.PolicyWarning)
        policies.set_global("mixed_float16")


# -- layers built before the policy ------------------------------------------------------------
def test_policy_set_after_build_warns_which_layers_and_apply_fixes_it():
    model = mlp(name="early")
    policies.set_global("mixed_bfloat16")
    with pytest.warns(policies.PolicyWarning) as caught:
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    message = str(caught[0].message)
    assert "'early'" in message and "h1" in message and "h2" in message
    assert "keep 'float32'" in message and "policies.apply(model)" in message
    assert model.get_layer("h1").compute_dtype == "float32"  # warned, not changed

    changed = policies.apply(model)
    assert changed == ["h1", "h2"]
    assert model.get_layer("h1").compute_dtype == "bfloat16"
    assert model.get_layer("out").compute_dtype == "float32"
    assert policies.stale_layers(model) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", policies.PolicyWarning)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")


def test_policy_set_after_compile_warns_at_set_global():
    policies.set_global("float32")  # the hook sees the compile below
    model = mlp(name="compiled_first")
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    with pytest.warns(policies.PolicyWarning, match="'compiled_first'.*h1, h2, out"):
        policies.set_global("mixed_bfloat16")


def test_explicit_layer_dtype_is_not_stale():
    inp = keras.Input((4,))
    out = keras.layers.Dense(2, dtype="float32", name="pinned")(inp)
    model = keras.Model(inp, out)
    policies.set_global("mixed_bfloat16")
    assert policies.stale_layers(model) == []


# -- safe defaults -----------------------------------------------------------------------------
def test_output_layer_softmax_and_loss_stay_float32():
    policies.set_global("mixed_bfloat16")
    inp = keras.Input((8,))
    x = keras.layers.Dense(16, name="h")(inp)
    x = keras.layers.Softmax(name="attn_like")(x)
    x = keras.layers.RMSNormalization(name="rms")(x)
    x = keras.layers.BatchNormalization(name="bn")(x)
    out = keras.layers.Dense(3, activation="softmax", name="out")(x)
    model = keras.Model(inp, out)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    dtypes = {layer.name: layer.compute_dtype for layer in model.layers[1:]}
    assert dtypes == {"h": "bfloat16", "attn_like": "float32", "rms": "float32",
                      "bn": "bfloat16", "out": "float32"}
    x = np.random.default_rng(0).standard_normal((4, 8)).astype("float32")
    y = np.array([0, 1, 2, 0])
    y_pred = model(x)
    assert y_pred.dtype == tf.float32
    assert model.compute_loss(x=x, y=y, y_pred=y_pred).dtype == tf.float32
    # Keras keeps batch-norm statistics in float32 itself.
    assert all(v.dtype == "float32" for v in model.get_layer("bn").weights)
    logs = model.train_on_batch(x, y, return_dict=True)
    assert np.isfinite(logs["loss"])


def test_safe_false_leaves_keras_defaults():
    policies.set_global("mixed_bfloat16", safe=False)
    model = mlp()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    assert model.get_layer("out").compute_dtype == "bfloat16"


# -- loss scaling ------------------------------------------------------------------------------
def test_loss_scaling_present_for_float16_absent_for_bfloat16(monkeypatch):
    fake_hardware(monkeypatch, XEON_AMX)
    policies.set_global("mixed_float16")
    model = mlp()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    x = np.random.default_rng(0).standard_normal((8, 8)).astype("float32")
    logs = model.train_on_batch(x, np.arange(8) % 3, return_dict=True)
    assert np.isfinite(logs["loss"])

    with pytest.warns(policies.PolicyWarning, match="keep 'mixed_float16': h1, h2"):
        policies.set_global("mixed_bfloat16")  # the float16 model above is told
    model = mlp()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)


def test_loss_scaling_added_when_only_some_layers_are_float16(monkeypatch):
    fake_hardware(monkeypatch, XEON_AMX)
    policies.set_global("float32")
    model = mlp()
    model.get_layer("h1").dtype_policy = "mixed_float16"  # Keras alone would not scale
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, keras.optimizers.SGD)
    model.compile(optimizer="sgd", loss="mse", auto_scale_loss=False)
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)


# -- layers that break -------------------------------------------------------------------------
class AddOnes(keras.layers.Layer):
    """Breaks under a 16-bit policy: adds a float32 tensor to its 16-bit input."""

    def call(self, x):
        return x + tf.ones_like(x, dtype=tf.float32)


def test_a_custom_layer_that_breaks_is_named():
    inp = keras.Input((4,))
    x = keras.layers.Dense(4, name="d")(inp)
    x = AddOnes(name="adds_ones")(x)
    out = keras.layers.Dense(2, name="out")(x)
    model = keras.Model(inp, out)
    with pytest.raises(policies.LayerDtypeError) as err:
        policies.apply(model, "mixed_bfloat16")
    assert err.value.layer_name == "adds_ones"
    assert "'adds_ones' (AddOnes)" in str(err.value) and "dtype='float32'" in str(err.value)
    # The model is left as it was.
    assert {layer.compute_dtype for layer in model.layers[1:]} == {"float32"}
    policies.check(model)  # float32 runs


# -- tfmx bench --policy -----------------------------------------------------------------------
def test_bench_table_says_which_policy_the_modes_ran_under():
    from bench.runner import _layer_policies
    from bench.tables import format_markdown

    timing = {"median_ms": 1.0, "p25_ms": 1.0, "p75_ms": 1.0, "min_ms": 1.0, "first_call_s": 1.0}
    result = {"model": "m", "batch_size": 2, "rounds": 1, "steps": 1, "warmup": 1,
              "modes": {"stock": timing, "tfmx": timing}, "ratios": {"tfmx/stock": 1.0},
              "policy": "auto", "policy_choice": "policies: 'auto' chose 'float32': because",
              "layer_policies": {"stock": {"float32": 3}, "tfmx": {"mixed_bfloat16": 2,
                                                                  "float32": 1}}}
    text = format_markdown(result)
    assert "under policy 'auto' (policies: 'auto' chose 'float32': because)" in text
    assert "tfmx: float32 x1, mixed_bfloat16 x2" in text
    policies.set_global("mixed_bfloat16")
    assert _layer_policies(mlp()) == {"mixed_bfloat16": 3}  # safe defaults come at compile


def test_bench_rejects_unknown_policy():
    from bench.runner import run_benchmark

    with pytest.raises(ValueError, match="unknown policy"):
        run_benchmark("mlp", policy="fp8", modes=("stock",))


def test_a_custom_layer_that_breaks_while_the_model_is_built_is_named():
    policies.set_global("mixed_bfloat16")
    inp = keras.Input((4,))
    with pytest.raises(policies.LayerDtypeError) as err:
        AddOnes(name="breaks_at_build")(keras.layers.Dense(4)(inp))
    assert err.value.layer_name == "breaks_at_build"
    assert "'breaks_at_build' (AddOnes) fails under policy 'mixed_bfloat16'" in str(err.value)
    assert isinstance(err.value, TypeError)  # what Keras raised: code catching it still does


def test_recipe_rejects_an_unknown_policy_before_training():
    from recipes.small_cnn import main

    with pytest.raises(ValueError, match="unknown policy 'bf16'"):
        main(["--quick", "--policy", "bf16"])


def test_apply_on_a_model_with_unknown_input_shapes_skips_the_check():
    inp = keras.Input((None, 4))
    out = keras.layers.Dense(2, name="o")(keras.layers.Dense(4, name="h")(inp))
    model = keras.Model(inp, out)
    assert policies.apply(model, "mixed_bfloat16") == ["h"]
    assert policies.apply(model, "float32", sample_batch=np.ones((2, 3, 4), "float32")) == ["h"]
