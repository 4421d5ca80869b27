"""The rnn family: Keras LSTM / GRU fused before differentiation, parity with stock Keras."""

from __future__ import annotations

import concurrent.futures
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    TRANSCENDENTAL,
    PickForm,
    StageExample,
    assert_within_rounding,
    needs_onednn,
    traced_graphs,
)

import tfmx
from fusion import stage
from fusion.calls import rnn
from fusion.graph import op_histogram
from fusion.graphs import rnn as rnn_units
from fusion.kernels import rnn as rnn_kernels
from tfmx.backends import get_backend, metal_kernels

# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")


def _stage_example() -> keras.Model:
    inp = keras.Input((5, 3))
    return keras.Model(inp, keras.layers.Dense(4)(keras.layers.LSTM(8)(inp)))


STAGE_EXAMPLE = StageExample(_stage_example, lacking="MatMul")
"""This family's model in the stage-safety tests (tests/test_stage_safety.py)."""

B, T, F_IN, H = 4, 7, 3, 5

# Roundings (helpers.float_tolerance), longest path. One timestep of a cell: the input and the
# recurrent projections (F_IN + H terms) and the bias, three gate nonlinearities and the new
# state's tanh (TRANSCENDENTAL each), about 10 Muls and Adds.
TIMESTEP = F_IN + H + 1 + 4 * TRANSCENDENTAL + 10
# The kernels against Keras's loop: T timesteps forward, a loss summing B x T x H terms, the
# backward through T timesteps (twice a forward timestep's ops each), and the weight gradients,
# which the fused backward sums over B x T in one MatMul.
KERNEL_TERMS = T * TIMESTEP + B * T * H + 2 * T * TIMESTEP + B * T
# A model's forward: two recurrent layers deep at most (H <= 6), pooling over T, the Dense
# (<= 3 x 6 inputs), softmax and the loss (TRANSCENDENTAL each, batch 8).
FORWARD_TERMS = 2 * T * (TIMESTEP + 1) + T + 18 + 2 * TRANSCENDENTAL + 8


def fit_terms(epochs: int) -> int:
    """A fit of 24 samples in batches of 8: per step the forward, the backward (twice it, the
    gradients' sums over the batch) and the momentum update (4)."""
    return epochs * (24 // 8) * (3 * FORWARD_TERMS + 8 + 4)



def _mask() -> np.ndarray:
    mask = np.ones((B, T), bool)
    mask[0, :2] = False  # left padding
    mask[1, 4:] = False  # right padding
    mask[2, 3] = False  # a hole
    return mask


# -- the kernels against Keras's own loop (outputs, states and every gradient) ----------------
def _kernel_case(kind: str, reset_after: bool, go_backwards: bool, masked: bool,
                 zero_output: bool, return_sequences: bool, unrolled: bool = False):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((B, T, F_IN)), tf.float32)
    h0 = tf.constant(rng.standard_normal((B, H)), tf.float32)
    c0 = tf.constant(rng.standard_normal((B, H)), tf.float32)
    if kind == "lstm":
        layer = keras.layers.LSTM(H, return_sequences=return_sequences, go_backwards=go_backwards)
        init = [h0, c0]
    else:
        layer = keras.layers.GRU(H, return_sequences=return_sequences, go_backwards=go_backwards,
                                 reset_after=reset_after)
        init = [h0]
    layer.build((B, T, F_IN))
    layer.zero_output_for_mask = zero_output
    for v in layer.weights:
        v.assign(rng.standard_normal(v.shape) * 0.5)
    mask = tf.constant(_mask()) if masked else None

    def loss_of(last, out, states):
        return (tf.reduce_sum(out * tf.sin(out)) + tf.reduce_sum(last ** 2)
                + sum(tf.reduce_sum(s * 1.7) for s in states))

    @tf.function
    def run(fused: bool):
        with tf.GradientTape() as tape:
            tape.watch([x, *init])
            if not fused:
                result = keras.layers.RNN.inner_loop(layer, x, init, mask)
            else:
                w = [v.value for v in layer.trainable_variables]
                flags = {"go_backwards": go_backwards, "return_sequences": return_sequences,
                         "zero_output_for_mask": zero_output, "unrolled": unrolled}
                if kind == "lstm":
                    result = rnn_kernels.lstm_sequence(x, h0, c0, mask, *w, **flags)
                else:
                    result = rnn_kernels.gru_sequence(x, h0, mask, *w, reset_after=reset_after,
                                                      **flags)
            loss = loss_of(*result)
        last, out, states = result
        return [last, out, *states, *tape.gradient(loss, [x, *init,
                                                          *layer.trainable_variables])]

    fused = run.get_concrete_function(True).graph.as_graph_def()
    loops = op_histogram(fused)["While"] + op_histogram(fused)["StatelessWhile"]
    assert (loops == 0) == unrolled, f"{loops} loops in the {'un' * unrolled}rolled form"
    return run(False), run(True)


# (go_backwards, masked, zero_output_for_mask, return_sequences): a spread of the 24 combinations
FLAG_CASES = [(False, False, False, True), (True, True, False, False),
              (False, True, True, True), (True, False, False, False)]


@pytest.mark.parametrize("kind,reset_after", [("lstm", True), ("gru", True), ("gru", False)])
@pytest.mark.parametrize("go_backwards,masked,zero_output,return_sequences", FLAG_CASES)
def test_kernels_match_keras_loop(kind, reset_after, go_backwards, masked, zero_output,
                                  return_sequences):
    expected, got = _kernel_case(kind, reset_after, go_backwards, masked, zero_output,
                                 return_sequences)
    assert len(expected) == len(got)
    for i, (e, g) in enumerate(zip(expected, got)):
        assert_within_rounding(g.numpy(), e.numpy(), KERNEL_TERMS, what=f"output {i}")


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("go_backwards,masked,zero_output,return_sequences", FLAG_CASES[:3])
def test_several_chunk_loops_match_keras_loop(monkeypatch, kind, go_backwards, masked,
                                              zero_output, return_sequences):
    monkeypatch.setattr(rnn_kernels, "CHUNKS", 3)  # T=7: loops over steps 0-1, 2-4, 5-6
    assert len(rnn_kernels._chunks(T)) == 3
    expected, got = _kernel_case(kind, True, go_backwards, masked, zero_output,
                                 return_sequences)
    for i, (e, g) in enumerate(zip(expected, got)):
        assert_within_rounding(g.numpy(), e.numpy(), KERNEL_TERMS, what=f"output {i}")


@pytest.mark.parametrize("kind,reset_after", [("lstm", True), ("gru", True), ("gru", False)])
@pytest.mark.parametrize("go_backwards,masked,zero_output,return_sequences", FLAG_CASES)
def test_unrolled_kernels_match_keras_loop(kind, reset_after, go_backwards, masked, zero_output,
                                           return_sequences):
    expected, got = _kernel_case(kind, reset_after, go_backwards, masked, zero_output,
                                 return_sequences, unrolled=True)
    for i, (e, g) in enumerate(zip(expected, got)):
        assert_within_rounding(g.numpy(), e.numpy(), KERNEL_TERMS, what=f"output {i}")


def test_unrolled_form_needs_a_static_length():
    x = tf.TensorSpec([B, None, F_IN], tf.float32)
    w = [tf.ones([F_IN, 4 * H]), tf.ones([H, 4 * H]), tf.zeros([4 * H])]

    def fn(x):
        return rnn_kernels.lstm_sequence(x, tf.zeros([B, H]), tf.zeros([B, H]), None, *w,
                                         unrolled=True)[0]

    with pytest.raises(ValueError, match="static number of timesteps"):
        tf.function(fn).get_concrete_function(x)
    assert "hoisted unrolled" not in rnn.cpu_forms(None)
    assert "hoisted unrolled" not in rnn.cpu_forms(rnn.MAX_UNROLLED_STEPS + 1)


def test_inference_form_saves_nothing_and_stays_differentiable():
    rng = np.random.default_rng(1)
    x = tf.constant(rng.standard_normal((B, T, F_IN)), tf.float32)
    h0 = c0 = tf.zeros([B, H])
    k = tf.constant(rng.standard_normal((F_IN, 4 * H)), tf.float32)
    r = tf.constant(rng.standard_normal((H, 4 * H)) * 0.3, tf.float32)
    b = tf.zeros([4 * H])

    def grads(training):
        with tf.GradientTape() as tape:
            tape.watch([x, k, r])
            _, out, _ = rnn_kernels.lstm_sequence(x, h0, c0, None, k, r, b,
                                                  return_sequences=True, training=training)
            loss = tf.reduce_sum(out ** 2)
        return [out, *tape.gradient(loss, [x, k, r])]

    def forward():
        return rnn_kernels.lstm_sequence(x, h0, c0, None, k, r, b, return_sequences=True,
                                         training=False)[1]

    graph = tf.function(forward).get_concrete_function().graph.as_graph_def()
    assert op_histogram(graph)["TensorListSetItem"] == 1  # only the output sequence
    for i, (a, e) in enumerate(zip(tf.function(grads)(False), tf.function(grads)(True))):
        assert_within_rounding(a.numpy(), e.numpy(), KERNEL_TERMS, what=f"output {i}")


# -- Keras models through tfmx.enable(): parity, the fused structure in what ran, declines -----
def ops_that_ran(fn) -> set[str]:
    from tests.test_keras import ops_that_ran as ran

    return ran(fn)


def step_ops(fn) -> set[str]:
    """The ops of the functions Keras's step function calls (the function libraries of the
    graphs it traced): the step, whichever loop of Keras's calls it (Keras 3.16's while loop
    around its one-step call under tfmx is the traced graph's own, not in its library)."""
    return {n.op for graph in traced_graphs(fn) for f in graph.library.function
            for n in f.node_def}


def _seq_data(n: int = 24, seed: int = 1, vocab: int | None = None):
    rng = np.random.default_rng(seed)
    if vocab is None:
        x = rng.standard_normal((n, T, F_IN)).astype(np.float32)
        x[:, -2:][: n // 3] = 0.0  # right padding for Masking models
    else:
        x = rng.integers(1, vocab, (n, T))
        x[: n // 3, :2] = 0  # left padding: not cuDNN-compatible, fine here
        x[n // 3: 2 * n // 3, -3:] = 0
    return x, rng.integers(0, 3, n)


def _model(layers_fn, seed: int = 0, vocab: int | None = None) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inp = keras.Input((T,) if vocab else (T, F_IN))
    x = keras.layers.Embedding(vocab, F_IN, mask_zero=True)(inp) if vocab else inp
    x = layers_fn(x)
    out = keras.layers.Dense(3, activation="softmax")(x)
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    return model


def _weights(model: keras.Model) -> list[np.ndarray]:
    return [v.numpy() for v in model.weights] + [v.numpy() for v in model.optimizer.variables]


def assert_parity(stock, fused, terms: int) -> None:
    for i, (a, b) in enumerate(zip(stock, fused)):
        assert_within_rounding(b, a, terms, what=f"tensor {i}")


def fit_both(layers_fn, vocab=None, epochs=2, **enable):
    """Train the same model stock and with tfmx; return (stock, fused) models and the data."""
    x, y = _seq_data(vocab=vocab)
    models = []
    for on in (False, True):
        tfmx.enable(backend="cpu", **enable) if on else tfmx.disable()
        model = _model(layers_fn, vocab=vocab)
        model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, shuffle=False)
        models.append(model)
    return models[0], models[1], x, y


def _pair(*layers):
    """Branches side by side, each reduced to a vector, concatenated."""
    def build(x):
        outs = []
        for make in layers:
            y = make(x)
            outs.extend(y if isinstance(y, (list, tuple)) else [y])
        outs = [keras.layers.GlobalAveragePooling1D()(o) if len(o.shape) == 3 else o
                for o in outs]
        return keras.layers.Concatenate()(outs) if len(outs) > 1 else outs[0]
    return build


L, G, BI = keras.layers.LSTM, keras.layers.GRU, keras.layers.Bidirectional
CONFIGS = {  # every configuration in the scope, a few per model
    "stacked_lstm_return_state": _pair(
        lambda x: L(6, return_state=True)(L(H, return_sequences=True)(x))),
    "gru_both_reset_forms_backwards": _pair(
        lambda x: G(H)(x), lambda x: G(H, reset_after=False, go_backwards=True)(x),
        lambda x: G(H, use_bias=False, return_sequences=True)(x)),
    "bidirectional": _pair(lambda x: BI(L(H))(x), lambda x: BI(G(H, return_sequences=True))(x)),
    "masking_dropout_no_bias": lambda x: _pair(
        lambda m: L(H, go_backwards=True, use_bias=False)(m), lambda m: G(H, dropout=0.3)(m),
        lambda m: L(H, return_sequences=True)(m))(keras.layers.Masking(0.0)(x)),
}


@needs_onednn("either")  # all families: with oneDNN off the onednn family too
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fit_matches_stock(name):
    stock, fused, x, y = fit_both(CONFIGS[name], epochs=1)
    assert_parity(_weights(stock), _weights(fused), fit_terms(epochs=1))
    assert_fused_structure_ran(fused.train_function, stock.train_function)
    assert tfmx.report().fused("rnn") >= 1, tfmx.report()
    assert not tfmx.report().patterns["rnn"].declined


def assert_fused_structure_ran(fused_fn, stock_fn=None):
    """The graph that ran holds the family's loops and none of autodiff's loop accumulators."""
    ran = ops_that_ran(fused_fn)
    assert {"While", "StatelessWhile"} & ran and "TensorListSetItem" in ran
    assert "TensorListPushBack" not in ran  # the stock While gradient's accumulators
    if stock_fn is not None:
        assert "TensorListPushBack" in ops_that_ran(stock_fn)


@needs_onednn("either")  # all families: with oneDNN off the onednn family too
@pytest.mark.parametrize("form", ["keras unrolled", "hoisted unrolled"])
def test_unrolled_forms_fit_like_stock_with_no_loop_left(monkeypatch, form):
    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, "rnn", strict=True))
    layers_fn = _pair(lambda x: G(H, reset_after=False)(L(H, return_sequences=True)(x)),
                      lambda x: G(H, go_backwards=True)(keras.layers.Masking(0.0)(x)))
    stock, fused, x, y = fit_both(layers_fn, epochs=1)
    assert_parity(_weights(stock), _weights(fused), fit_terms(epochs=1))
    step = step_ops(fused.train_function)
    # a product ran in the step (MatMul, or its fused or oneDNN form), and no loop
    assert any("MatMul" in op for op in step) and not {"While", "StatelessWhile"} & step, step
    assert {"While", "StatelessWhile"} & ops_that_ran(stock.train_function)
    stats = tfmx.report().patterns["rnn"]
    assert stats.fused == 3 and not stats.declined, tfmx.report()
    suffix = "Keras's cell unrolled" if form == "keras unrolled" else "unrolled recurrence"
    assert all(suffix in label for label in stats.fused_kinds), stats.fused_kinds


@needs_onednn("either")  # all families: with oneDNN off the onednn family too
def test_embedding_mask_zero_fit_predict_evaluate_match_stock():
    layers_fn = lambda x: keras.layers.GRU(H)(keras.layers.LSTM(H, return_sequences=True)(x))  # noqa: E731
    stock, fused, x, y = fit_both(layers_fn, vocab=11)
    assert_parity(_weights(stock), _weights(fused), fit_terms(epochs=2))
    assert_within_rounding(fused.predict(x, verbose=0), stock.predict(x, verbose=0),
                           fit_terms(epochs=2) + FORWARD_TERMS, what="predict")
    assert_within_rounding(fused.evaluate(x, y, verbose=0), stock.evaluate(x, y, verbose=0),
                           fit_terms(epochs=2) + FORWARD_TERMS + 24,
                           what="evaluate")
    assert_fused_structure_ran(fused.train_function, stock.train_function)
    assert_fused_structure_ran(fused.predict_function)
    assert tfmx.report().fused("rnn") >= 4  # train (2 layers) + predict/evaluate


@needs_onednn("either")  # all families: with oneDNN off the onednn family too
def test_declined_configurations_train_like_stock_and_say_why():
    declined = _pair(
        lambda x: L(H, activation="relu")(x),
        lambda x: G(H, unroll=True)(x),
        lambda x: L(H, recurrent_dropout=0.25)(x),
    )
    stock, fused, x, y = fit_both(declined, epochs=1)
    assert_parity(_weights(stock), _weights(fused), fit_terms(epochs=1))
    stats = tfmx.report().patterns["rnn"]
    assert stats.fused == 0
    reasons = set(stats.declined)
    for code in ("activation", "unroll", "recurrent_dropout"):
        assert rnn.DECLINE_REASONS[code] in reasons


def test_stateful_is_declined_and_still_trains():
    tfmx.enable(backend="cpu")
    keras.utils.set_random_seed(0)
    inp = keras.Input((T, F_IN), batch_size=8)
    model = keras.Model(inp, keras.layers.Dense(3)(L(H, stateful=True)(inp)))
    model.compile(optimizer="sgd", loss="mse")
    x, _ = _seq_data()
    history = model.fit(x, np.zeros((len(x), 3)), batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert rnn.DECLINE_REASONS["stateful"] in tfmx.report().patterns["rnn"].declined


def test_only_tfmx_traces_are_rewritten():
    """Keras outside a tfmx trace (disabled, eager, other tf.functions) is untouched."""
    layer = L(H)
    x = tf.ones([2, T, F_IN])
    assert stage.active() is None
    tfmx.enable(backend="cpu")
    graph = tf.function(layer).get_concrete_function(x).graph.as_graph_def()
    assert not any("tfmx_rnn" in n.name for n in graph.node)


def _plan(backend: str, layers_fn):
    """Trace a training step for a backend this machine lacks; return the rewritten GraphDef."""
    x, y = _seq_data()
    tfmx.enable(backend=backend)
    model = _model(layers_fn)
    with pytest.raises(tfmx.BackendUnavailableError):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    (trace,) = tfmx.report().traces
    return trace.graph_after, tfmx.report().patterns["rnn"]


def test_metal_plan_uses_the_plugins_cudnn_kernels_node_by_node():
    graph, stats = _plan("metal", _pair(
        lambda x: L(H)(x),
        lambda x: G(H, return_sequences=True)(keras.layers.Masking(0.0)(x)),
        lambda x: G(H, reset_after=False)(x)))
    ops = op_histogram(graph)
    assert ops["CudnnRNNV3"] == 2 and ops["CudnnRNNBackpropV3"] == 2
    assert stats.fused == 2 and not stats.partial
    assert list(stats.declined) == [rnn.DECLINE_REASONS["reset_before_gpu"]]
    # node by node: every op the family emitted, forward and gradient, has a Metal kernel;
    # three-letter names (Sum, Mul) cannot appear in the strings-based list
    emitted = {n.op for n in graph.node if re.search(r"tfmx_rnn_(lstm|gru)_cudnn/", n.name)}
    assert {"CudnnRNNV3", "CudnnRNNBackpropV3", "TopKV2", "OneHot", "BatchMatMulV2"} <= emitted
    unlisted = {op for op in emitted if op not in metal_kernels() and len(op) > 3}
    assert unlisted <= rnn_units.RUNTIME_OPS, unlisted
    assert rnn_units.unlisted_ops(emitted, get_backend("metal")) == []
    # no generic loop is left for the fused layers; the declined GRU keeps Keras's
    loops = [n.name for n in graph.node if n.op in ("While", "StatelessWhile")]
    assert loops and all("tfmx_rnn_declined_reset_before_gpu" in name for name in loops)


def test_cuda_plan_is_cudnn_with_cuda_gate_order():
    graph, stats = _plan("cuda", lambda x: G(H)(L(H, return_sequences=True)(x)))
    assert op_histogram(graph)["CudnnRNNV3"] == 2
    assert stats.fused == 2 and set(stats.fused_kinds) == {rnn.KIND_FORMS[("lstm", "cudnn")].label,
                                                           rnn.KIND_FORMS[("gru", "cudnn")].label}
    match, _ = rnn.find_rnn_layer(G(H), get_backend("cuda"))
    assert match.swap_zr and not rnn.find_rnn_layer(G(H), get_backend("metal"))[0].swap_zr


def test_rnn_pattern_can_be_switched_off():
    stock, fused, x, y = fit_both(lambda x: L(H)(x), epochs=1, patterns=["contraction"])
    graph = tfmx.report().traces[0].graph_after
    assert not any("tfmx_rnn" in n.name for n in graph.node)
    # contraction alone: MatMul+BiasAdd on the same kernel Grappler gives the stock step
    assert_parity(_weights(stock), _weights(fused), 0)


@pytest.mark.parametrize("go_backwards,zero_output,return_sequences",
                         [(False, False, True), (True, True, True), (True, False, False)])
def test_cudnn_form_gives_keras_mask_semantics_for_any_mask(go_backwards, zero_output,
                                                            return_sequences):
    """The GPU form's mask handling, with the CPU kernel standing in for CudnnRNNV3."""
    rng = np.random.default_rng(2)
    mask = _mask()
    mask[3] = False  # a row with no step at all keeps its initial state
    x = tf.constant(rng.standard_normal((B, T, F_IN)), tf.float32)
    h0 = tf.constant(rng.standard_normal((B, H)), tf.float32)
    c0 = tf.constant(rng.standard_normal((B, H)), tf.float32)
    layer = L(H, go_backwards=go_backwards, return_sequences=return_sequences)
    layer.build((B, T, F_IN))
    layer.zero_output_for_mask = zero_output
    w = [v.value for v in layer.trainable_variables]

    def cudnn_stand_in(xs, h, lengths):  # right-padded rows; zeros past each length
        right = tf.range(T)[None, :] < lengths[:, None]
        _, out, (h_t, c_t) = rnn_kernels.lstm_sequence(
            xs, h, c0, right, *w, return_sequences=True, zero_output_for_mask=True)
        return out, h_t, c_t

    def both():
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            ref = keras.layers.RNN.inner_loop(layer, x, [h0, c0], tf.constant(mask))
            last, out, h, c = rnn_kernels.run_keras_semantics(
                cudnn_stand_in, x, h0, c0, tf.constant(mask), go_backwards, return_sequences,
                zero_output)
            got = (last, out, [h, c])
            losses = [tf.reduce_sum(r[1] ** 2) + tf.reduce_sum(r[2][0]) for r in (ref, got)]
        return ([ref[0], ref[1], *ref[2], tape.gradient(losses[0], x)],
                [got[0], got[1], *got[2], tape.gradient(losses[1], x)])

    expected, got = tf.function(both)()
    for i, (e, g) in enumerate(zip(expected, got)):
        assert_within_rounding(g.numpy(), e.numpy(), KERNEL_TERMS, what=f"output {i}")


@pytest.mark.parametrize("make,backend,code", [
    (lambda: L(H, dtype="mixed_bfloat16"), "cpu", "dtype"),
    (lambda: L(H, use_cudnn=True), "cpu", "use_cudnn_true"),
    (lambda: G(H, use_cudnn=False), "metal", "use_cudnn_false"),
    (lambda: G(H, recurrent_activation="hard_sigmoid"), "cuda", "activation"),
    (lambda: keras.layers.SimpleRNN(H), "cpu", "cell"),
])
def test_find_declines_with_a_reason(make, backend, code):
    match, why = rnn.find_rnn_layer(make(), get_backend(backend))
    assert match is None and why == code and code in rnn.DECLINE_REASONS


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_tuner_candidates_of_a_dropout_layer_run_and_leave_its_random_stream(kind):
    layer = (L if kind == "lstm" else G)(H, dropout=0.3, return_sequences=True)
    layer.build((B, T, F_IN))
    match, _ = rnn.find_rnn_layer(layer, get_backend("cpu"))
    state = layer.cell.seed_generator.state
    before = state.numpy().copy()
    ran = []

    def measure(candidates):  # as tfmx.tuner does: built and run eagerly on a thread of its own
        for make in candidates.values():
            make()()
            ran.append(make)

    @tf.function
    def step(x, tune: bool):
        layer.cell.get_dropout_mask(x[:, 0, :])  # what Keras's call configures, then traced
        if tune:
            candidates = rnn._layer_candidates(match, type(layer).inner_loop, x, True)
            with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
                pool.submit(measure, candidates).result()
        layer.cell.reset_dropout_mask()
        return x

    x = tf.zeros([B, T, F_IN])
    step(x, False)
    one_step = state.numpy() - before  # the draw of the step's own mask
    step(x, True)  # no candidate reads the mask of the step's graph
    assert len(ran) == len(rnn.cpu_forms(T))
    # nor draws from the layer's seed generator: the training's masks stay stock's
    np.testing.assert_array_equal(state.numpy() - before, 2 * one_step)
