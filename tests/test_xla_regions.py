"""XLA-compiled regions as a tuner candidate: a layer norm, an RMS norm, a GELU or an attention
block compiled by XLA as one function (its gradient too), where the tuner measures it faster."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import TRANSCENDENTAL, assert_models_within_rounding, xla_functions

import fusion
import tfmx
from fusion.calls import attention, feed_forward, gelu, layer_norm
from fusion.stage import XLA


class _PickXla:
    """Takes the XLA region ``form`` wherever it is a candidate, and records whether it was."""

    def __init__(self, form: str = XLA) -> None:
        self.form = form
        self.offered: dict[str, bool] = {}
        self.names: set[str] = set()  # every candidate's name

    def choose(self, family, signature, candidates, conservative):
        from fusion.pattern import RewriteAlways

        self.offered[signature] = self.form in candidates
        self.names.update(candidates)
        if self.form in candidates:
            candidates = {self.form: None}
        return RewriteAlways().choose(family, signature, candidates, conservative)


T, D = 6, 8


def _model(kind: str, dropout: float = 0.0) -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((T, D))
    x = keras.layers.Dense(16)(inp)
    norms = {"layer_norm": keras.layers.LayerNormalization,
             "rms_norm": keras.layers.RMSNormalization}
    if kind.startswith("residual_"):  # post-norm: the sum read by the norm alone
        norm = norms[kind.removeprefix("residual_")]
        x = norm()(keras.layers.Add()([x, keras.layers.Dense(16)(x)]))
    elif kind.startswith("pre_norm_"):  # the sum read by the norm and the next residual
        norm = norms[kind.removeprefix("pre_norm_")]
        s = keras.layers.Add()([x, keras.layers.Dense(16)(x)])
        x = keras.layers.Add()([s, keras.layers.Dense(16)(norm()(s))])
    elif kind == "layer_norm":
        x = keras.layers.LayerNormalization()(x)
    elif kind == "rms_norm":
        x = keras.layers.RMSNormalization()(x)
    elif kind == "gelu":
        x = keras.layers.Dense(16, activation="gelu")(x)
    elif kind == "feed_forward":
        x = keras.layers.Dense(16)(keras.layers.Dense(32, activation="gelu")(x))
    else:
        x = keras.layers.Add()([x, keras.layers.MultiHeadAttention(2, 4, dropout=dropout)(
            x, x, use_causal_mask=True)])
    out = keras.layers.Dense(3, activation="softmax")(keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    return model


LABELS = {"layer_norm": layer_norm.FORMS["xla"].label,
          "rms_norm": layer_norm.FORMS["rms xla"].label, "gelu": gelu.FORMS[XLA].label,
          "attention": attention.FORMS["xla"].label, "feed_forward": feed_forward.FORMS[XLA].label}
FAMILIES = {"layer_norm": "layer_norm", "rms_norm": "layer_norm", "gelu": "gelu",
            "attention": "attention", "feed_forward": "feed_forward"}


@pytest.mark.parametrize("kind", sorted(LABELS))
def test_fit_with_an_xla_region_matches_stock(monkeypatch, kind):
    from tfmx import state

    chooser = _PickXla(layer_norm.RMS_REGIONS.xla.name if kind == "rms_norm" else XLA)
    monkeypatch.setattr(state, "tuner", lambda: chooser)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((24, T, D)).astype("float32")
    y = rng.integers(0, 3, 24)
    family = FAMILIES[kind]
    models = {}
    initial = [v.numpy() for v in _model(kind).weights]
    for on in (False, True):
        tfmx.enable(backend="cpu", patterns=[family], guard=False) if on else tfmx.disable()
        model = _model(kind)
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        models[on] = model
    assert chooser.offered and all(chooser.offered.values())
    # the region and its gradient (the GELU's is one multiplication, outside XLA), compiled by
    # XLA, in the function that ran
    assert len(xla_functions(models[True].train_function)) >= (1 if kind == "gelu" else 2)
    assert not xla_functions(models[False].train_function)
    stats = tfmx.report().patterns[family]
    assert stats.fused == 1 and set(stats.fused_kinds) == {LABELS[kind]}, tfmx.report()
    assert stats.observed[LABELS[kind]] >= 1
    # XLA fuses and reorders the region's sums: 6 steps of the Dense (D terms), the region
    # (its reductions over 16 values, softmax over T), pooling and the Dense; backward twice
    step = 3 * (D + 2 * 16 + T + TRANSCENDENTAL + 16 + T + 20)
    assert_models_within_rounding(models[False], models[True], initial, 6 * step)


def test_no_xla_region_with_dropout_or_with_xla_off(monkeypatch):
    """Dropout's random stream inside XLA is not the stock one; ``xla=False`` means none."""
    from tfmx import state

    chooser = _PickXla()
    monkeypatch.setattr(state, "tuner", lambda: chooser)
    x, y = np.zeros((8, T, D), "float32"), np.zeros(8, "int32")
    tfmx.enable(backend="cpu", patterns=["attention"], guard=False)
    _model("attention", dropout=0.5).fit(x, y, batch_size=8, epochs=1, verbose=0)
    tfmx.enable(backend="cpu", patterns=["layer_norm"], guard=False, xla=False)
    _model("layer_norm").fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert len(chooser.offered) == 2 and not any(chooser.offered.values()), chooser.offered
    # nor a form with a region inside (the norms' gradients, the GELU's value and derivative)
    tfmx.enable(backend="cpu", patterns=["gelu"], guard=False, xla=False)
    _model("gelu").fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert not [name for name in chooser.names if "xla" in name], chooser.names
    assert "onednn" in chooser.names and "custom" in chooser.names  # the test can see forms


def test_passes_leave_functions_xla_compiles_as_they_are():
    """A fused kernel inside a jit_compile function would have no XLA lowering: the GraphDef
    passes rewrite the step around the region, never inside it."""
    w = tf.Variable(tf.random.normal([4, 4], seed=1))
    b = tf.Variable(tf.zeros([4]))
    region = tf.function(lambda x: tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w), b)),
                         jit_compile=True, autograph=False)

    def step(x):
        return tf.nn.relu(tf.nn.bias_add(tf.matmul(region(x), w), b))

    tfmx.enable(backend="cpu", patterns=["contraction"], guard=False)
    fn = tfmx.function(step)
    x = tf.random.normal([3, 4], seed=2)
    np.testing.assert_allclose(fn(x).numpy(), step(x).numpy(), rtol=1e-6)
    (trace,) = tfmx.report().traces
    assert any(n.op == "_FusedMatMul" for n in trace.graph_after.node)  # outside: fused
    (compiled,) = [f for f in trace.graph_after.library.function
                   if fusion.pipeline.compiled_by_xla(f)]
    ops = {n.op for n in compiled.node_def}
    assert "MatMul" in ops and "_FusedMatMul" not in ops


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_a_norm_and_its_residual_add_as_one_xla_region_match_stock(monkeypatch, norm):
    """Post-norm ``norm(Add()([x, f(x)]))``: the sum and the norm compiled as one region
    (the sum's gradient, the region's two input gradients, inside it too)."""
    from tfmx import state

    regions = layer_norm.RMS_REGIONS if norm == "rms_norm" else layer_norm.LAYER_REGIONS
    chooser = _PickXla(regions.residual.name)
    monkeypatch.setattr(state, "tuner", lambda: chooser)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((24, T, D)).astype("float32")
    y = rng.integers(0, 3, 24)
    kind = f"residual_{norm}"
    initial = [v.numpy() for v in _model(kind).weights]
    models = {}
    for on in (False, True):
        tfmx.enable(backend="cpu", patterns=["layer_norm"], guard=False) if on \
            else tfmx.disable()
        model = _model(kind)
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        models[on] = model
    (signature,) = chooser.offered
    assert chooser.offered[signature] and signature.endswith("after a residual Add")
    functions = xla_functions(models[True].train_function)
    assert len(functions) >= 2
    # the sum inside the region: an AddV2 feeding the norm's statistics in XLA's function
    assert any(n.op == "AddV2" for f in functions for n in f.node_def)
    label = regions.residual.label
    stats = tfmx.report().patterns["layer_norm"]
    assert stats.fused == 1 and set(stats.fused_kinds) == {label}, tfmx.report()
    assert stats.observed[label] >= 1
    step = 3 * (D + 2 * 16 + 2 + 16 + T + TRANSCENDENTAL + 20)
    assert_models_within_rounding(models[False], models[True], initial, 6 * step)


@pytest.mark.parametrize("kind", ["pre_norm_layer_norm", "layer_norm"])
def test_no_residual_region_where_the_sum_has_another_reader_or_no_add(monkeypatch, kind):
    """Pre-norm: the sum is read again by the next residual, so the region would add twice;
    a norm of a Dense's output has no residual to take in. The plain region stays offered."""
    from tfmx import state

    offered: list[set] = []

    class Recording(_PickXla):
        def choose(self, family, signature, candidates, conservative):
            offered.append(set(candidates))
            return super().choose(family, signature, candidates, conservative)

    monkeypatch.setattr(state, "tuner", Recording)
    x, y = np.zeros((8, T, D), "float32"), np.zeros(8, "int32")
    tfmx.enable(backend="cpu", patterns=["layer_norm"], guard=False)
    _model(kind).fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert offered and all(XLA in o and layer_norm.LAYER_REGIONS.residual.name not in o
                               for o in offered)
    assert tfmx.report().patterns["layer_norm"].fused_kinds == {layer_norm.FORMS[XLA].label: 1}


def test_a_feed_forward_block_kept_as_two_layers(monkeypatch):
    """The region is a candidate against the two layers (timed with the gelu stage's closed
    form between them); a step that keeps the layers holds no XLA function, and the gelu stage
    still rewrites the first layer's GELU."""
    from tfmx import state

    offered: list[dict] = []

    class Separate:
        def choose(self, family, signature, candidates, conservative):
            from fusion.pattern import RewriteAlways

            offered.append({"family": family, "signature": signature,
                            "candidates": set(candidates)})
            if family == "feed_forward":
                candidates = {conservative: None}
            return RewriteAlways().choose(family, signature, candidates, conservative)

    monkeypatch.setattr(state, "tuner", Separate)
    x, y = np.zeros((8, T, D), "float32"), np.zeros(8, "int32")
    tfmx.enable(backend="cpu", patterns=["feed_forward", "gelu"], guard=False)
    model = _model("feed_forward")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    blocks = [o for o in offered if o["family"] == "feed_forward"]
    assert blocks and all(o["candidates"] == {"separate", XLA}
                          for o in blocks)
    assert blocks[0]["signature"] == ("feed-forward input 8x6x16 float32: Dense(32, gelu) -> "
                                      "Dense(16, linear)")
    assert not xla_functions(model.train_function)
    stats = tfmx.report().patterns
    assert stats["feed_forward"].fused == 0 and stats["gelu"].fused == 1, tfmx.report()

