"""A Keras tfmx does not know, or a Keras on another backend: ``tfmx.enable()`` warns once,
raises nothing, and the fit trains as stock Keras; a Keras missing only some hooked method
leaves those families' calls to Keras and the rest of tfmx on."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

import tfmx
from fusion import stage
from fusion.family import Family, declare, forget
from tfmx import keras_hook, state
from tfmx.errors import TfmxWarning


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(state, "_warned", set())


def _fit() -> list[np.ndarray]:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    model.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0, shuffle=False)
    return [w.numpy() for w in model.weights]


def _enable(**options) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tfmx.enable(backend="cpu", guard=False, **options)
    return [w for w in seen if issubclass(w.category, TfmxWarning)]


def test_a_keras_without_the_trainer_tfmx_hooks_warns_and_trains_as_stock(monkeypatch):
    tfmx.disable()
    stock = _fit()

    def renamed():  # as Keras 3.16 renames TensorFlowTrainer
        from keras.src.backend import tensorflow

        return tensorflow.TensorFlowTrainerRenamedAway

    monkeypatch.setattr(keras_hook, "_trainer_class", renamed)
    seen = _enable()
    assert len(seen) == 1 and "tfmx stays off" in str(seen[0].message), seen
    assert f"Keras {keras.__version__}" in str(seen[0].message)
    assert not tfmx.enabled() and not keras_hook.installed()
    for got, want in zip(_fit(), stock):
        np.testing.assert_array_equal(got, want)
    assert _enable() == []  # once per process


def test_a_keras_without_a_hooked_layer_method_leaves_that_family_to_keras():
    from fusion.stage import Hook

    declare(Family("vanished", "a family hooking a method this Keras has not",
                   hooks=(Hook.on("keras.src.layers.core.dense:Dense.call_renamed_away",
                                  lambda ctx, original, *a, **k: original(*a, **k)),)))
    try:
        seen = _enable()
        assert tfmx.enabled() and keras_hook.installed()
        assert len(seen) == 1, seen
        assert "vanished: keras.src.layers.core.dense:Dense.call_renamed_away" in str(
            seen[0].message)
        assert "the rest of tfmx is on" in str(seen[0].message)
        _fit()
        assert tfmx.report().traces  # the step was traced by tfmx
    finally:
        tfmx.disable()
        forget("vanished")
        stage.uninstall()


def test_hooks_of_a_package_not_imported_wait_for_it_silently(monkeypatch, tmp_path):
    """A family hooking a package besides Keras (as keras_hub's layers are hooked): enable()
    neither imports it nor warns; once the user imports it, the next step traced installs the
    hook, and the family's handler runs."""
    import sys

    from fusion import patches
    from fusion.stage import Hook

    (tmp_path / "hub_like.py").write_text(
        "import keras\n"
        "class Doubler(keras.layers.Layer):\n"
        "    def call(self, x):\n"
        "        return x * 2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "hub_like", raising=False)
    handled = []

    def handler(ctx, original, instance, *args, **kwargs):
        handled.append(type(instance).__name__)
        return original(instance, *args, **kwargs)

    declare(Family("hub_like_family", "a family hooking a package besides Keras",
                   hooks=(Hook.on("hub_like:Doubler.call", handler),)))
    try:
        seen = _enable()
        assert not seen and "hub_like" not in sys.modules
        assert not [p for p in patches.installed() if "hub_like" in p.where]
        import hub_like

        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), hub_like.Doubler(), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse")
        x = np.ones((8, 4), "float32")
        model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
        assert [p for p in patches.installed() if "hub_like" in p.where]
        assert "Doubler" in handled
    finally:
        tfmx.disable()
        forget("hub_like_family")
        stage.uninstall()


def test_a_hooked_function_called_with_every_argument_by_keyword_reaches_its_handler():
    """A routed module function whose caller passes its first argument by keyword (as Keras
    3.16's MultiHeadAttention calls the backend's ``nn.dot_product_attention``): the chain
    hands the handler, and Keras's function after it, the same arguments, on or off."""
    import tensorflow as tf

    from fusion.pattern import PlainTarget
    from fusion.stage import Hook, StageContext, _routed, tracing

    def scaled(query, key, scale=1.0):
        return (query + key) * scale

    seen = []

    def handler(ctx, original, query, *args, **kwargs):
        seen.append((float(query), sorted(kwargs)))
        return original(query, *args, **kwargs)

    family = Family("keyword_demo", "", hooks=(Hook.on("demo:nn.scaled", handler),))
    routed = _routed([(family, family.hooks[0])])(scaled)
    one, two = tf.constant(1.0), tf.constant(2.0)
    assert float(routed(query=one, key=two, scale=3.0)) == 9.0  # off: Keras's function
    with tracing(StageContext(PlainTarget("cpu"), strict=True)):
        assert float(routed(query=one, key=two, scale=3.0)) == 9.0
        assert float(routed(one, key=two)) == 3.0
    assert seen == [(1.0, ["key", "scale"]), (1.0, ["key"])]
    with pytest.raises(TypeError, match="query"):
        routed(key=two)


def test_keras_on_another_backend_says_so_and_stays_off(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    seen = _enable()
    assert len(seen) == 1 and "KERAS_BACKEND=jax" in str(seen[0].message), seen
    assert not tfmx.enabled() and not keras_hook.installed()
