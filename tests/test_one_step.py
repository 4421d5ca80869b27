"""tfmx.one_step: Keras's one-step call (Keras 3.16 reads the batch outside its traced step and
calls the step alone) runs under tfmx as Keras runs it: a step tfmx leaves as it was trains bit
for bit as stock's under the installed Keras, and the step that runs is the step's own function
where Keras calls it alone (no loop around it)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import needs_onednn, profiled_ops, step_functions

import tfmx
from fusion import private_api
from fusion.graphs import sibling_projections
from tfmx import guard
from tfmx.one_step import OneStepDispatch

pytestmark = pytest.mark.usefixtures("every_rewrite")


@pytest.fixture(autouse=True)
def _off():
    yield
    tfmx.disable()
    guard.forget()

ONE_STEP_CALL = private_api.release("keras") >= (3, 16)  # Keras calls its step alone


def _model():
    keras.utils.set_random_seed(5)
    model_input = keras.Input((6, 8))
    inp = keras.layers.Dense(8)(model_input)
    gate = keras.layers.Dense(16)(inp)
    up = keras.layers.Dense(24)(inp)
    hidden = keras.layers.Multiply()([keras.layers.Activation("silu")(
        keras.layers.Dense(24)(inp)), up])
    out = keras.layers.Dense(4)(keras.layers.Concatenate()([gate, hidden]))
    model = keras.Model(model_input, out)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def _fit(on: bool, guard: bool = False):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((12, 6, 8)).astype("float32")  # batches of 8 and 4
    y = rng.standard_normal((12, 6, 4)).astype("float32")
    if on:  # left on: the test reads the step functions tfmx built
        tfmx.enable(backend="cpu", patterns=[sibling_projections.FAMILY], guard=guard)
    else:
        tfmx.disable()
    model = _model()
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    return model, history.history["loss"]


def test_a_step_tfmx_leaves_as_it_was_trains_bit_for_bit_as_stock(monkeypatch):
    """The family's rewrite fails (injected): the step is stock's, and so is every weight and
    loss after two epochs of a full and a partial batch, bit for bit, as Keras calls it."""

    def broken(view, group):
        raise RuntimeError("injected")

    monkeypatch.setattr(sibling_projections, "rewrite_siblings", broken)
    stock, stock_loss = _fit(False)
    fused, loss = _fit(True)
    assert any("injected" in e for e in tfmx.report().patterns[sibling_projections.FAMILY]
               .errors)
    assert loss == stock_loss
    for got, want in zip(fused.weights, stock.weights):
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=got.path)


def _loops(model) -> set[str]:
    """The ops of the graphs that ran that read the iterator (a loop around the step)."""
    return {node.op for cf in step_functions(model.train_function)
            for node in cf.graph.as_graph_def().node if node.op.startswith("IteratorGetNext")}


def test_the_step_runs_alone_where_keras_calls_it_alone(monkeypatch):
    """Under a Keras that calls its step alone, the step tfmx rewrote runs alone (its own
    ConcreteFunction, for each batch's shape), in the forms the whole-step guard tries; under
    one that calls it from its traced loop, in that loop."""
    monkeypatch.setenv("TFMX_GUARD_BUDGET", "none")  # the guard's trial, whatever the fit
    guard.forget()
    stock, stock_loss = _fit(False)
    assert bool(_loops(stock)) is not ONE_STEP_CALL
    fused, loss = _fit(True, guard=True)
    np.testing.assert_allclose(loss, stock_loss, rtol=1e-5)
    assert tfmx.report().patterns[sibling_projections.FAMILY].fused >= 1
    assert step_functions(fused.train_function)
    assert bool(_loops(fused)) is not ONE_STEP_CALL
    dispatches = [c.cell_contents for c in fused.train_function.__wrapped__.__closure__
                  if isinstance(c.cell_contents, OneStepDispatch)]
    assert len(dispatches) == int(ONE_STEP_CALL)
    if ONE_STEP_CALL:
        (one,) = dispatches
        (slot,) = one._slots.values()
        assert slot.guard is not None and set(slot.forms) >= {"fused"}
        shapes = {tuple(cf.structured_input_signature[0][0][0].shape)
                  for cf in one._list_all_concrete_functions()}
        # the full batch's, and the partial batch's as tf.function traces it (reduce_retracing)
        assert (8, 6, 8) in shapes and len(shapes) == 2, shapes


@needs_onednn("either")
def test_a_step_tfmx_leaves_as_it_was_runs_stocks_kernels(tmp_path):
    """A 3x3 convolution's swish, which no family of the fit changes: the kernels that run
    are stock's under the installed Keras (with oneDNN on, its fused swish where TensorFlow's
    optimizer fuses it for a step Keras calls alone)."""

    def kernels(on: bool, where) -> set[str]:
        if on:
            tfmx.enable(backend="cpu", guard=False, patterns=["gelu"])  # nothing to fuse
        else:
            tfmx.disable()
        keras.utils.set_random_seed(1)
        model = keras.Sequential([
            keras.Input((16, 16, 8)), keras.layers.Conv2D(8, 3, padding="same", activation="swish"),
            keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
        rng = np.random.default_rng(2)
        x, y = rng.random((8, 16, 16, 8), "float32"), rng.random((8, 2), "float32")
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        ran = profiled_ops(lambda: model.fit(x, y, batch_size=8, epochs=1, verbose=0), where)
        return {kernel for _, kernel in ran if "Swish" in kernel or "Sigmoid" in kernel
                or "Conv2D" in kernel}

    stock = kernels(False, tmp_path / "stock")
    assert kernels(True, tmp_path / "tfmx") == stock


def test_another_form_is_traced_without_reading_the_iterator():
    """Another form is traced for the last batch's structure without reading the iterator (on
    the fit's thread or beside it): a form whose trace fails takes no batch, and the batches
    run in their order."""
    traced = []

    class Step:
        name = "step"

        def gated(self, concrete):
            return False

        def form_function(self, form, data):
            if form == "xla":
                raise RuntimeError("no XLA here")
            traced.append((form, tuple(data.shape)))
            return tf.function(lambda d: d * 2.0).get_concrete_function(data)

    one = OneStepDispatch(Step(), loop=None)
    it = iter(tf.data.Dataset.from_tensor_slices([[1.0], [2.0], [3.0]]))
    assert float(one._first_call(it)[0].get_value()[0]) == 2.0
    with pytest.raises(RuntimeError):
        one._form_function("xla", it)
    stock = one._form_function("stock", it)
    assert traced == [("fused", (1,)), ("stock", (1,))]
    assert [float(stock(it).get_value()[0]) for _ in range(2)] == [4.0, 6.0]
    assert not stock(it).has_value() and len(traced) == 2


def test_a_step_the_price_gate_runs_as_stock_runs_every_batch_as_stock(monkeypatch, tmp_path):
    """A short fit on a fresh tuning cache: the price gate runs the step as stock, its first
    batches and the epoch's last, smaller one alike (one gate verdict a fit, as with Keras's
    loop), and the fit is stock's bit for bit."""
    monkeypatch.setenv("TFMX_CACHE_DIR", str(tmp_path))  # nothing measured of this step
    guard.forget()
    stock, stock_loss = _fit(False)
    fused, loss = _fit(True, guard=True)
    statuses = [t.status for t in tfmx.report().traces if t.function.endswith("train_step")]
    assert statuses and set(statuses) == {"stock: price gate"}, statuses
    assert loss == stock_loss
    for got, want in zip(fused.weights, stock.weights):
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=got.path)
