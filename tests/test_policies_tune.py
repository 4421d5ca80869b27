"""policies.tune (injected timings) and policies.audit (cast counts)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from policies_fixtures import restore_global_policy  # noqa: F401 (autouse fixture)

import policies
from policies import global_policy, layer_tuning
from policies.dtype_audit import count_round_trips
from policies.hardware_choice import Hardware


@pytest.fixture(autouse=True)
def _own_tuning_cache(tmp_path, monkeypatch):
    """policies.tune caches layer times per machine (tfmx.tuner): tests that inject timings
    for the same layers must not read each other's."""
    monkeypatch.setenv("TFMX_CACHE_DIR", str(tmp_path / "tfmx-cache"))


BF16 = "mixed_bfloat16"


def model_for_tuning():
    inp = keras.Input((16,))
    x = keras.layers.Dense(32, name="fast")(inp)
    x = keras.layers.Activation("relu", name="act_after_fast")(x)
    x = keras.layers.Dense(32, name="slow")(x)
    x = keras.layers.Activation("relu", name="act_after_slow")(x)
    out = keras.layers.Dense(4, activation="softmax", name="out")(x)
    return keras.Model(inp, out, name="tunable")


def injected(table):
    calls = []

    def timer(layer, policy, run):
        calls.append((layer.name, policy))
        return table[(layer.name, policy)]

    return timer, calls


FAST_SLOW = {("fast", "float32"): 2e-3, ("fast", BF16): 1e-3,
             ("slow", "float32"): 1e-3, ("slow", BF16): 3e-3,
             # the whole-model check: float32, the per-layer choice, every accurate layer
             ("tunable", "float32"): 4e-3, ("tunable", "tuned"): 3e-3,
             ("tunable", "broad"): 3.5e-3}


def test_tune_keeps_16bit_where_faster_and_float32_where_slower():
    model = model_for_tuning()
    timer, calls = injected(FAST_SLOW)
    x = np.random.default_rng(0).standard_normal((8, 16)).astype("float32")
    result = policies.tune(model, x, policy=BF16, timer=timer)
    assert result.chosen() == {"fast": BF16, "act_after_fast": BF16, "slow": "float32",
                               "act_after_slow": "float32", "out": "float32"}
    assert set(calls) == set(FAST_SLOW)  # layers with weights, then the whole model
    assert calls.count(("fast", BF16)) == 5  # rounds, alternating with float32
    kinds = {c.layer: c.kind for c in result.layers}
    assert kinds == {"fast": "tuned", "act_after_fast": "follower", "slow": "tuned",
                     "act_after_slow": "follower", "out": "safety"}
    # Applied to the layers, and the model still trains.
    assert model.get_layer("fast").compute_dtype == "bfloat16"
    assert model.get_layer("slow").compute_dtype == "float32"
    fast = next(c for c in result.layers if c.layer == "fast")
    assert fast.float32_ms == pytest.approx(2.0) and fast.low_ms == pytest.approx(1.0)
    assert 0.0 < fast.error < 0.02
    assert (result.model_float32_ms, result.model_tuned_ms) == pytest.approx((4.0, 3.0))
    text = str(result)
    assert "fast" in text and "0.50x" in text and "(0.75x)" in text
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    logs = model.train_on_batch(x, np.arange(8) % 4, return_dict=True)
    assert np.isfinite(logs["loss"])


def test_tune_margin_and_tolerance_keep_float32():
    model = model_for_tuning()
    # 1% faster: under the margin; nor is the whole model with every layer in 16 bit faster
    table = {**FAST_SLOW, ("fast", BF16): 1.98e-3, ("tunable", "broad"): 4.1e-3}
    result = policies.tune(model, policy=BF16, timer=injected(table)[0], apply=False)
    assert result.chosen()["fast"] == "float32" and "not faster" in result.layers[0].reason
    assert model.get_layer("fast").compute_dtype == "float32"  # apply=False
    result = policies.tune(model, policy=BF16, timer=injected(FAST_SLOW)[0], tolerance=1e-9,
                           apply=False)
    assert result.chosen()["fast"] == "float32" and "tolerance" in result.layers[0].reason


def noisy(table, label, values):
    """``injected(table)``, but the whole model's ``label`` run takes ``values`` in turn."""
    timer, calls = injected(table)
    turns = iter(values * 100)

    def noisy_timer(layer, policy, run):
        return next(turns) if (layer.name, policy) == ("tunable", label) else timer(
            layer, policy, run)

    return noisy_timer, calls


def test_tune_falls_back_to_float32_when_the_whole_model_is_not_faster():
    model = model_for_tuning()
    table = {**FAST_SLOW, ("tunable", "tuned"): 4.4e-3, ("tunable", "broad"): 4.5e-3}
    result = policies.tune(model, policy=BF16, timer=injected(table)[0])
    assert set(result.chosen().values()) == {"float32"}
    fast = next(c for c in result.layers if c.layer == "fast")
    assert "whole model ran 1.10x float32" in fast.reason
    assert model.get_layer("fast").compute_dtype == "float32"
    skipped = policies.tune(model, policy=BF16, timer=injected(table)[0], check_model=False,
                            apply=False)
    assert skipped.chosen()["fast"] == BF16 and skipped.model_tuned_ms is None


def test_a_whole_model_faster_within_noise_keeps_float32():
    """The per-layer choice's median is 0.95x float32's, but it was faster in half the rounds
    only (the check goes on while 16 bit still could win beyond noise): chance, so float32
    everywhere; faster in every round, it is kept however small the gain (``margin`` is the
    cut for a layer alone)."""
    model = model_for_tuning()
    table = {**FAST_SLOW, ("tunable", "broad"): 4.5e-3}
    timer, _ = noisy(table, "tuned", [3.6e-3, 4.4e-3, 3.8e-3, 4.2e-3])
    result = policies.tune(model, policy=BF16, timer=timer, apply=False)
    assert set(result.chosen().values()) == {"float32"}, result
    fast = next(c for c in result.layers if c.layer == "fast")
    assert "faster in 8 of 16 rounds (not beyond noise)" in fast.reason
    table[("tunable", "tuned")] = 3.96e-3  # 0.99x, in every round
    result = policies.tune(model, policy=BF16, timer=injected(table)[0], apply=False)
    assert result.model_choice == "tuned" and result.chosen()["fast"] == BF16


def test_tune_keeps_16bit_as_a_block_where_no_layer_pays_alone():
    """Alone, each layer pays the casts at its borders; a run of 16-bit layers does not: where
    the whole model with every accurate layer in 16 bit beats float32 by the margin, it is
    kept though no layer was faster alone."""
    model = model_for_tuning()
    table = {**FAST_SLOW, ("fast", BF16): 2.1e-3, ("tunable", "broad"): 3e-3}
    result = policies.tune(model, policy=BF16, timer=injected(table)[0])
    assert result.chosen() == {"fast": BF16, "act_after_fast": BF16, "slow": BF16,
                               "act_after_slow": BF16, "out": "float32"}
    assert result.model_choice == "broad" and result.model_tuned_ms is None
    assert "whole model ran 0.75x float32" in result.layers[0].reason
    assert model.get_layer("slow").compute_dtype == "bfloat16"
    assert "every accurate layer in 16 bit 3.000 ms (0.75x); kept: broad" in str(result)
    # a layer whose 16-bit output is not accurate stays float32 in the block too
    strict = policies.tune(model_for_tuning(), policy=BF16, timer=injected(table)[0],
                           tolerance=1e-9)
    assert set(strict.chosen().values()) == {"float32"}


def test_tune_with_real_timer_runs_and_decides_every_layer():
    model = model_for_tuning()
    result = policies.tune(model, policy=BF16, batch_size=4, rounds=2)
    assert set(result.chosen()) == {"fast", "act_after_fast", "slow", "act_after_slow", "out"}
    tuned = [c for c in result.layers if c.kind == "tuned"]
    assert all(c.float32_ms > 0 and c.low_ms > 0 for c in tuned)


def test_tune_refuses_a_float32_candidate():
    with pytest.raises(ValueError, match="16-bit policy"):
        policies.tune(model_for_tuning(), policy="float32")


def test_tune_names_a_layer_that_breaks():
    class Breaks(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1],))

        def call(self, x):
            return x * tf.ones_like(x, dtype=tf.float32) + self.w

    inp = keras.Input((4,))
    out = Breaks(name="breaks")(keras.layers.Dense(4)(inp))
    model = keras.Model(inp, keras.layers.Dense(2)(out))
    with pytest.raises(policies.LayerDtypeError, match="'breaks'"):
        policies.tune(model, policy=BF16, timer=lambda layer, policy, run: 1.0)


def test_auto_tunes_at_compile_when_it_picks_16bit(monkeypatch):
    monkeypatch.setattr(global_policy._STATE, "hardware",
                        Hardware(cpu_name="Xeon", cpu_flags=frozenset({"amx_bf16"})))
    timer, calls = injected(FAST_SLOW)
    monkeypatch.setattr(layer_tuning, "default_timer", timer)
    policies.set_global("auto", verbose=False)
    model = model_for_tuning()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    assert model._policies_tuned.chosen()["slow"] == "float32"
    assert model.get_layer("fast").compute_dtype == "bfloat16"
    assert model.get_layer("slow").compute_dtype == "float32"
    assert model.get_layer("out").compute_dtype == "float32"


# -- audit -------------------------------------------------------------------------------------
def test_audit_counts_casts_per_layer():
    x = np.ones((4, 16), "float32")
    model = model_for_tuning()
    report = policies.audit(model, x)
    assert report.layer_casts == 0 and report.model_casts == 0

    policies.apply(model, BF16)
    report = policies.audit(model, x)
    fast = report.layer("fast")
    assert (fast.compute_dtype, fast.variable_dtype, fast.output_dtype) == \
        ("bfloat16", "float32", "bfloat16")
    # input, kernel and bias cast to bfloat16; their gradients cast back (kernel, bias, input).
    assert fast.casts_forward == 3 and fast.cast_kinds["float32->bfloat16"] == 3
    assert fast.casts_backward == 3
    slow = report.layer("slow")  # its input arrives in bfloat16: only kernel and bias cast
    assert slow.casts_forward == 2
    out = report.layer("out")
    assert out.compute_dtype == "float32" and out.casts_forward == 1
    assert out.cast_kinds == {"bfloat16->float32": 1, "float32->bfloat16": 1}
    assert "output layer" in out.note
    assert report.model_casts > 0 and report.round_trips == 0
    text = str(report)
    assert "fast" in text and "bfloat16->float32" in text
    assert report.to_dict()["layers"][0]["casts"] == 6


def test_audit_notes_a_failing_layer_and_stale_layers():
    class AddOnes(keras.layers.Layer):
        def call(self, x):
            return x + tf.ones_like(x, dtype=tf.float32)

    inp = keras.Input((4,))
    out = AddOnes(name="adds")(keras.layers.Dense(4, name="d")(inp))
    model = keras.Model(inp, out)
    model.get_layer("adds").dtype_policy = BF16
    policies.set_global(BF16)
    report = policies.audit(model)
    assert "fails under policy 'mixed_bfloat16'" in report.layer("adds").note
    assert "built before the last set_global" in report.layer("d").note
    with pytest.raises(policies.LayerDtypeError, match="'adds'"):
        policies.check(model)


def test_round_trips_are_counted():
    @tf.function
    def f(x, y):
        a = tf.cast(tf.cast(x, tf.float32), tf.bfloat16)  # lossless round trip
        b = tf.cast(tf.cast(y, tf.bfloat16), tf.float32)  # lossy: not a round trip
        return a, b

    g = f.get_concrete_function(tf.TensorSpec([2], tf.bfloat16), tf.TensorSpec([2]))
    assert count_round_trips(g.graph.as_graph_def()) == 1


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="sub")
        self.fast = keras.layers.Dense(16, name="fast")
        self.act = keras.layers.ReLU(name="act")
        self.twice = keras.layers.Dense(16, name="twice")
        self.head = keras.layers.Dense(4, name="head")

    def call(self, x):
        x = self.act(self.fast(x))
        return self.head(self.twice(self.twice(x)))


def test_tune_a_subclassed_model_from_its_recorded_calls():
    model = _Subclassed()
    x = np.random.default_rng(0).standard_normal((8, 16)).astype("float32")
    model(x)
    with pytest.raises(ValueError, match="subclassed.*sample_batch"):
        policies.tune(model, policy=BF16)
    table = {("fast", "float32"): 2e-3, ("fast", BF16): 1e-3,
             ("sub", "float32"): 4e-3, ("sub", "tuned"): 3e-3}
    timer, calls = injected(table)
    result = policies.tune(model, x, policy=BF16, timer=timer)
    kinds = {c.layer: (c.kind, c.policy) for c in result.layers}
    assert kinds == {"fast": ("tuned", BF16), "act": ("kept", "float32"),
                     "twice": ("kept", "float32"), "head": ("safety", "float32")}
    assert "shared" in next(c.reason for c in result.layers if c.layer == "twice")
    assert set(calls) == set(table)
    assert model.fast.compute_dtype == "bfloat16" and model.head.compute_dtype == "float32"
    # The layer classes are as they were, and the model trains.
    assert "__call__" not in vars(keras.layers.Dense) and "__call__" not in vars(keras.layers.ReLU)
    model.compile(optimizer="adam", loss="mse")
    logs = model.train_on_batch(x, np.zeros((8, 4), "float32"), return_dict=True)
    assert np.isfinite(logs["loss"])


def test_audit_of_a_subclassed_model_matches_its_functional_twin():
    class Twin(keras.Model):
        def __init__(self):
            super().__init__(name="twin")
            self.a = keras.layers.Dense(16, name="a", dtype=BF16)
            self.b = keras.layers.Dense(4, name="b")

        def call(self, x):
            return self.b(self.a(x))

    x = np.ones((4, 8), "float32")
    sub = Twin()
    sub(x)
    inp = keras.Input((8,))
    out = keras.layers.Dense(4, name="b")(keras.layers.Dense(16, name="a", dtype=BF16)(inp))
    functional = keras.Model(inp, out)
    got, want = policies.audit(sub, x), policies.audit(functional, x)
    assert [(r.layer, r.casts_forward, r.casts_backward, r.note) for r in got.layers] == [
        (r.layer, r.casts_forward, r.casts_backward, r.note) for r in want.layers]
    assert got.layer("b").casts_forward == 1 and got.model_casts == want.model_casts


def _sequence_model(name: str, body) -> keras.Model:
    """``body`` on an [8, 16] sequence input, pooled, then a Dense(3) head."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 16))
    x = body(inp)
    out = keras.layers.Dense(3, name="out")(keras.layers.GlobalAveragePooling1D(name="pool")(x))
    return keras.Model(inp, out, name=name)


def _tune_timed(model: keras.Model, layer_ms: dict, model_ms: tuple) -> object:
    """policies.tune(model) in bfloat16, not applied, with injected times: ``layer_ms`` maps a
    layer's name to its (float32, bfloat16) ms, ``model_ms`` is the whole model's (float32,
    per-layer choice, every accurate layer in 16 bit) ms."""
    table = {(name, policy): ms / 1e3 for name, times in layer_ms.items()
             for policy, ms in zip(("float32", BF16), times)}
    table.update({(model.name, kind): ms / 1e3
                  for kind, ms in zip(("float32", "tuned", "broad"), model_ms)})
    return policies.tune(model, policy=BF16, timer=injected(table)[0], apply=False)


def test_tune_and_audit_take_layers_with_several_inputs_and_keyword_arguments():
    """MultiHeadAttention(query, value, use_causal_mask=True) and Add([a, b]) are called as
    the model calls them (they were "missing a required argument: 'value'" before)."""
    def body(inp):
        x = keras.layers.Dense(16, name="proj")(inp)
        a = keras.layers.MultiHeadAttention(2, 8, name="mha")(x, x, use_causal_mask=True)
        return keras.layers.LayerNormalization(name="norm")(keras.layers.Add(name="res")([x, a]))

    model = _sequence_model("encoder", body)
    result = _tune_timed(model, {"proj": (1, 2), "mha": (3, 1)}, (4, 3, 3.5))
    chosen = {c.layer: (c.policy, c.kind) for c in result.layers}
    assert chosen["mha"] == (BF16, "tuned"), result
    assert chosen["proj"] == ("float32", "tuned")
    assert chosen["res"][1] == "follower"
    report = policies.audit(model)
    assert not report.layer("mha").note, report


def test_a_layers_dropout_is_not_counted_as_16bit_error():
    """The float32 reference is an inference-mode forward; the 16-bit output compared with it
    must be one too, or a MultiHeadAttention's dropout reads as a 16-bit error of ~0.3 and
    keeps the model's costliest layer in float32."""
    def body(inp):
        a = keras.layers.MultiHeadAttention(2, 8, dropout=0.5, name="mha")(inp, inp)
        return keras.layers.Dropout(0.5, name="drop")(keras.layers.Dense(16, name="proj")(a))

    model = _sequence_model("dropping", body)
    result = _tune_timed(model, {"mha": (3, 1), "proj": (3, 1)}, (4, 2, 2))
    mha = next(c for c in result.layers if c.layer == "mha")
    assert mha.policy == BF16 and mha.error < 0.02, result


def test_the_whole_model_check_times_the_step_tfmx_rewrites():
    """With tfmx on, the three whole-model runs (float32, the per-layer choice, every accurate
    layer in 16 bit) are the model's forward + gradient as tfmx rewrites it (its 16-bit
    forms); with tfmx off, TensorFlow's."""
    import tfmx

    tfmx.enable(backend="cpu", guard=False)
    result = policies.tune(model_for_tuning(), policy=BF16, timer=injected(FAST_SLOW)[0],
                           apply=False)
    traces = [t for t in tfmx.report().traces if t.function == "policies_check_tunable"]
    assert result.model_broad_ms is not None and len(traces) == 3, tfmx.report()
    assert {t.status for t in traces} == {"rewritten"}
    tfmx.disable()
    tfmx.report(reset=True)
    policies.tune(model_for_tuning(), policy=BF16, timer=injected(FAST_SLOW)[0], apply=False)
    assert not [t for t in tfmx.report().traces if t.function == "policies_check_tunable"]
