"""The squeeze_excite stage: a squeeze-and-excitation block as one region, its backward in
closed form or compiled by XLA."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    TRANSCENDENTAL,
    PickForm,
    StageExample,
    assert_models_within_rounding,
    assert_within_rounding,
    fit_stock_and_tfmx,
    nodes_that_ran,
    profiled_ops,
)

import tfmx
from fusion.calls import squeeze_excite as stage
from fusion.pattern import PatternStats
from fusion.stage import XLA, StageContext, tracing
from tfmx.backends import get_backend

# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")

L = keras.layers


def _efficientnet_block(x, activation: str = "swish"):
    """EfficientNet's: pool, Reshape, Conv2D(swish) reduce, Conv2D(sigmoid) expand."""
    c = x.shape[-1]
    se = L.Reshape((1, 1, c))(L.GlobalAveragePooling2D()(x))
    se = L.Conv2D(max(1, c // 4), 1, padding="same", activation=activation)(se)
    se = L.Conv2D(c, 1, padding="same", activation="sigmoid")(se)
    return L.multiply([x, se])


def _mobilenet_block(x):
    """MobileNetV3's: pool with keepdims, Conv2D, ReLU, Conv2D, relu6(z + 3) * (1 / 6) written
    with a layer and Keras ops, then Multiply."""
    c = x.shape[-1]
    se = L.GlobalAveragePooling2D(keepdims=True)(x)
    se = L.ReLU()(L.Conv2D(max(1, c // 4), 1, padding="same")(se))
    se = L.Conv2D(c, 1, padding="same")(se)
    se = L.ReLU(6.0)(se + 3.0) * (1.0 / 6.0)
    return L.Multiply()([x, se])


def _dense_block(x):
    """A user's: pool, Dense(relu) without a bias, Dense(hard_sigmoid), Reshape, gate first."""
    c = x.shape[-1]
    se = L.Dense(c // 2, activation="relu", use_bias=False)(L.GlobalAveragePooling2D()(x))
    se = L.Reshape((1, 1, c))(L.Dense(c, activation="hard_sigmoid")(se))
    return L.Multiply()([se, x])


BLOCKS = {"efficientnet": _efficientnet_block, "mobilenet": _mobilenet_block,
          "dense": _dense_block}


def _model(blocks=tuple(BLOCKS), shape=(6, 6, 3), outputs: int = 3) -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input(shape)
    x = inp
    for name in blocks:
        x = L.Conv2D(8, 3, padding="same", activation="swish")(x)
        x = BLOCKS[name](x)
    out = L.Dense(outputs)(L.GlobalAveragePooling2D()(x))
    model = keras.Model(inp, out)
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


def _stage_example() -> keras.Model:
    return _model(("efficientnet",), shape=(4, 4, 3), outputs=4)


STAGE_EXAMPLE = StageExample(_stage_example, lacking="SigmoidGrad")
"""This family's model in the stage-safety tests (tests/test_stage_safety.py)."""


def _data(n: int = 16, shape=(6, 6, 3)) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.standard_normal((n, *shape)).astype("float32"), rng.standard_normal(
        (n, 3)).astype("float32")


def _loss_and_gradients(model, x, y, ctx: StageContext | None) -> list[np.ndarray]:
    """The loss and the gradient of every trainable weight, traced with the stage's context
    ``ctx`` (None: stock)."""
    @tf.function(autograph=False)
    def step(x, y):
        with tracing(ctx), tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(model(x, training=True), tf.float32) - y))
        return [loss, *tape.gradient(loss, model.trainable_variables)]

    return [t.numpy().astype(np.float64) for t in step(tf.constant(x), tf.constant(y))], step


@pytest.mark.parametrize("form,shape", [("custom", (6, 6, 3)), (XLA, (6, 6, 3)),
                                        ("custom", (None, None, 3))])
def test_loss_and_every_gradient_match_stock_with_the_region_in_the_graph(form, shape):
    """EfficientNet's, MobileNetV3's and a user's Dense block (their images' sizes known, or
    not): the loss and the gradient of every weight as stock's, within the blocks' roundings;
    the form under its scope."""
    tfmx.enable(backend="cpu", patterns=["squeeze_excite"], guard=False)  # installs the hooks
    model, (x, y) = _model(shape=shape), _data()
    seen: list[PatternStats] = []
    ctx = StageContext(get_backend("cpu"), PickForm(form, "squeeze_excite", strict=True),
                       families=("squeeze_excite",), xla=True,
                       record=lambda family, stats: seen.append(stats))
    got, step = _loss_and_gradients(model, x, y, ctx)
    want, _ = _loss_and_gradients(model, x, y, None)
    label = stage.FORMS[form].label
    assert [dict(s.fused_kinds) for s in seen] == [{label: 1}] * 3, [s.as_dict() for s in seen]
    graph = step.get_concrete_function(tf.constant(x), tf.constant(y)).graph.as_graph_def()
    scope = f"{stage.FORMS.scope_of(stage.FORMS[form])}"
    marks = stage.FORMS[form].marks
    nodes = [*graph.node, *(n for f in graph.library.function for n in f.node_def)]
    assert sum(n.op in marks and scope in n.name for n in nodes) >= 3, (form, marks)
    # a pool over 36 values, 8-term dot products, sigmoids, the 3x3 convolution's 72 terms
    terms = 36 + 2 * 8 + 2 * (TRANSCENDENTAL + 4) + 72
    for i, (g, w) in enumerate(zip(got, want)):
        assert_within_rounding(g, w, terms, what=f"output {i}")


@pytest.mark.parametrize("activation,gate", [("relu", "sigmoid"), ("silu", "sigmoid"),
                                             ("relu", "hard_sigmoid"),
                                             ("silu", "hard_sigmoid_layers")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_closed_form_is_autodiff_of_the_block(activation, gate, dtype):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((3, 5, 4, 8)) * 2, dtype)
    weights = [tf.constant(rng.standard_normal(s) * 0.5, dtype)
               for s in ((8, 3), (3,), (3, 8), (8,))]

    def gradients(fn):
        with tf.GradientTape() as tape:
            tape.watch([x, *weights])
            y = fn(x, weights, activation, gate)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * tf.cast(tf.sin(x), tf.float32))
        return [y, *tape.gradient(loss, [x, *weights])]

    for i, (g, w) in enumerate(zip(gradients(stage.squeeze_excite_custom),
                                   gradients(stage.squeeze_excite))):
        assert_within_rounding(g, w, 20 + 2 * TRANSCENDENTAL, dtype=dtype, what=f"output {i}")


def test_mobilenet_v3_small_trains_a_step_with_its_blocks_fused():
    tfmx.enable(backend="cpu", patterns=["squeeze_excite"], guard=False)
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV3Small(input_shape=(32, 32, 3), weights=None,
                                                classes=3, include_preprocessing=False)
    model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy")
    x = np.random.default_rng(0).standard_normal((2, 32, 32, 3)).astype("float32")
    history = model.fit(x, np.array([0, 1]), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    stats = tfmx.report().patterns["squeeze_excite"]
    assert stats.fused_kinds == {stage.CUSTOM.label: 9} and not stats.declined, stats.as_dict()
    scope = f"/{stage.FORMS.scope_of(stage.CUSTOM)}/"
    ran = [n for n in nodes_that_ran(model.train_function) if scope in n.name]
    assert sum(n.op == "MatMul" and not n.name.startswith("gradient_tape") for n in ran) == 18
    assert any(n.op == "Relu6Grad" and n.name.startswith("gradient_tape") for n in ran)


def test_keras_layers_of_a_fused_block_do_not_run_in_the_step(tmp_path):
    """The block's own Conv2D layers and gate, read by nobody once the region replaces the
    Multiply's output, are pruned: the runtime runs none of their kernels, forward or
    backward (the model's one 3x3 convolution and its filter gradient alone), and runs the
    region's MatMuls."""
    tfmx.enable(backend="cpu", patterns=["squeeze_excite"], guard=False)
    model, (x, y) = _model(("efficientnet",)), _data(8)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    ran = profiled_ops(lambda: model.fit(x, y, batch_size=8, epochs=1, verbose=0), tmp_path)
    scope = f"{stage.FORMS.scope_of(stage.CUSTOM)}/"
    assert any(scope in name and "MatMul" in kernel for name, kernel in ran), sorted(ran)
    # the model's 3x3 convolution alone (its input needs no gradient); no sigmoid of a layer's
    # but the region's (TensorFlow's swish gradient of the 3x3 convolution has its own, at the
    # step's top level)
    convolutions = sorted(kernel for _, kernel in ran if "Conv2D" in kernel)
    assert len(convolutions) == 2 and not any("BackpropInput" in k for k in convolutions), \
        convolutions
    # a sigmoid in the scope of a layer whose convolution runs is that layer's (the 3x3's
    # swish: one kernel or a Sigmoid and a Mul, as Grappler fuses it in the graph that runs)
    running = {name.rpartition("/")[0] for name, kernel in ran
               if "Conv2D" in kernel and "gradient_tape" not in name}
    layers = [(name, kernel) for name, kernel in ran
              if "Sigmoid" in kernel and "functional" in name and scope not in name
              and name.rpartition("/")[0] not in running]
    assert not layers, layers


@pytest.mark.parametrize("form,policy", [("custom", "mixed_bfloat16"), (XLA, "mixed_bfloat16"),
                                         ("custom", "mixed_float16")])
def test_mixed_precision_fit_matches_stock_with_the_form(monkeypatch, form, policy):
    """The layers' compute dtype: the region computes in it (the pool's mean in float32, as
    Keras's), the weights cast as the layers cast them."""
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, "squeeze_excite", strict=True))
    x, y = _data(8)
    keras.mixed_precision.set_global_policy(policy)
    try:
        models, initial = fit_stock_and_tfmx(_model, x, y, ["squeeze_excite"], epochs=1)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    stats = tfmx.report().patterns["squeeze_excite"]
    assert stats.fused_kinds == {stage.FORMS[form].label: 3}, stats.as_dict()
    scope = f"/{stage.FORMS.scope_of(stage.FORMS[form])}/"
    assert any(n.op in stage.FORMS[form].marks and scope in n.name
               for n in nodes_that_ran(models[True].train_function))
    assert_models_within_rounding(models[False], models[True], initial, 200,
                                  dtype=policy.removeprefix("mixed_"))


class SubclassedBlock(keras.Model):
    def __init__(self):
        super().__init__()
        self.conv = L.Conv2D(8, 3, padding="same")
        self.pool, self.scale = L.GlobalAveragePooling2D(keepdims=True), L.Multiply()
        self.reduce = L.Conv2D(2, 1, activation="relu")
        self.expand = L.Conv2D(8, 1, activation="sigmoid")
        self.head = L.Dense(3)

    def call(self, x):
        x = self.conv(x)
        x = self.scale([x, self.expand(self.reduce(self.pool(x)))])
        return self.head(L.Flatten()(x))


def _declines(build) -> dict:
    tfmx.enable(backend="cpu", patterns=["squeeze_excite"], guard=False)
    model = build()
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x, y = _data(4)
    model.fit(x, y, epochs=1, verbose=0)
    return tfmx.report().patterns["squeeze_excite"].as_dict()


def test_blocks_it_cannot_see_or_take_keep_keras_layers_with_the_reason():
    stats = _declines(SubclassedBlock)
    assert not stats["fused"] and "subclassed model" in str(stats["declined"]), stats

    def other_gate() -> keras.Model:
        inp = keras.Input((6, 6, 3))
        x = L.Conv2D(8, 3, padding="same")(inp)
        se = L.GlobalAveragePooling2D(keepdims=True)(x)
        se = L.Conv2D(8, 1, activation="tanh")(L.Conv2D(2, 1, activation="relu")(se))
        return keras.Model(inp, L.Dense(3)(L.Flatten()(L.Multiply()([x, se]))))

    stats = _declines(other_gate)
    assert not stats["fused"] and "not a sigmoid" in str(stats["declined"]), stats


def test_declines_what_it_cannot_take():
    block = stage.Block(0, (), None, None, "relu", "sigmoid")
    assert stage.check(block, tf.zeros([2, 4, 4, 8], tf.float64),
                       tf.zeros([2, 1, 1, 8], tf.float64)) == "input dtype float64"
    inp = keras.Input((8, 4, 4))
    se = L.GlobalAveragePooling2D(data_format="channels_first", keepdims=True)(inp)
    se = L.Conv2D(8, 1, activation="sigmoid", data_format="channels_first")(
        L.Conv2D(2, 1, activation="relu", data_format="channels_first")(se))
    scale = L.Multiply()
    keras.Model(inp, scale([inp, se]))
    assert stage.find_block(scale) == (None, "the pool is channels_first")
    assert stage.se_shaped([tf.zeros([2, 4, 4, 8]), tf.zeros([2, 4, 4, 8])]) is None


def test_inference_keeps_keras_call():
    tfmx.enable(backend="cpu", patterns=["squeeze_excite"], guard=False)
    model = _model()
    x = _data(4)[0]
    np.testing.assert_allclose(model.predict(x, verbose=0), model(x).numpy(), atol=1e-5)
    assert "squeeze_excite" not in tfmx.report().patterns or \
        not tfmx.report().patterns["squeeze_excite"].fused


def test_metal_runs_the_closed_form_where_its_plugin_places_every_op_and_never_xla():
    """Both plugins' tables: the XLA region never offered, the closed form where the plugin
    has a kernel for every op it emits; its traced ops, forward and gradient, are among
    them."""
    from tfmx.backends import metal_kernels
    from tfmx.metal_plugins import APPLE, OPEN

    for plugin in (APPLE, OPEN):
        metal = get_backend("metal", plugin=plugin, tensorflow="2.21.0")
        assert not StageContext(metal).xla
        forms = metal.capability(stage.SqueezeExciteForms).forms
        assert XLA not in forms
        runs = all(metal.runs_op(op.partition(":")[0], op.partition(":")[2] or "float16")
                   for op in stage.CUSTOM.emits)
        assert (stage.CUSTOM.name in forms) == runs, (plugin, forms)

    @tf.function(autograph=False)
    def step(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, *w])
            y = stage.squeeze_excite_custom(x, w, "silu", "hard_sigmoid_layers")
        return tape.gradient(y, [x, *w])

    spec = [tf.TensorSpec(s, tf.float16) for s in ([8, 3], [3], [3, 8], [8])]
    graph = step.get_concrete_function(tf.TensorSpec([2, 4, 4, 8], tf.float16), spec).graph
    ops = {op.type for op in graph.get_operations()}
    unlisted = {op for op in ops if op not in metal_kernels() and len(op) > 3}
    assert not unlisted, unlisted
    declared = {op.partition(":")[0] for op in stage.CUSTOM.emits}
    assert {op for op in ops if op in metal_kernels()} - declared <= {
        "Reshape", "Identity", "IdentityN", "Placeholder", "Const", "Shape", "StridedSlice", "Fill",
        "ZerosLike", "OnesLike", "ExpandDims"}, ops
