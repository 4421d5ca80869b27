"""Every patch tfmx and policies make to Keras has one owner, and is undone by it.

Both change Keras only through ``fusion.patches``: each patch group installs and uninstalls its
own (``tfmx.stages``, ``tfmx.keras``, ``tfmx.keras_fixes``, ``policies``), and a write that
lasts one ``with`` block (Keras's trainer module's ``tf``, a cell's dropout mask, a layer's
dtype policy) is a ``temporarily`` swap, listed while it lasts. Here every attribute of every
class and module either can patch is snapshot before anything is enabled: the owners the
registry lists after ``tfmx.enable()`` and ``policies.set_global(...)`` (asked of a child
process, so that this one is snapshot untouched), with Keras's trainer module,
``keras.Model``, ``keras.layers.Layer`` and ``CallbackList``. A cycle of enable, fit and
disable (tfmx), or set_global, compile, fit and reset (policies), must leave each of those
attributes the very object it was, and no patch installed in any group.
"""

from __future__ import annotations

import gc
import importlib
import json
import subprocess
import sys
import types
from pathlib import Path

import keras
import numpy as np
import pytest

import policies
import tfmx
from fusion import patches
from tfmx import keras_fixes, keras_hook

ROOT = Path(__file__).resolve().parent.parent

# What the child runs: enable both, and name every owner the registry then lists.
_LIST_OWNERS = """
import json, types
import policies, tfmx
from fusion import patches
tfmx.enable(backend="cpu")
policies.set_global("mixed_bfloat16")
names = []
for patch in patches.installed():
    owner = patch.owner
    if isinstance(owner, types.ModuleType):
        names.append([owner.__name__, ""])
    else:
        names.append([owner.__module__, owner.__qualname__])
print(json.dumps(names))
"""

_ABSENT = object()


def _resolve(module: str, qualname: str) -> object:
    owner = importlib.import_module(module)
    for part in filter(None, qualname.split(".")):
        owner = getattr(owner, part)
    return owner


def _patchable_owners() -> list[object]:
    done = subprocess.run([sys.executable, "-c", _LIST_OWNERS], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    listed = [_resolve(m, q) for m, q in json.loads(done.stdout.strip().splitlines()[-1])]
    from fusion import private_api

    fixed = [private_api.get("keras.trainer_module"), private_api.get("keras.trainer"),
             keras.Model, keras.layers.Layer, private_api.get("keras.CallbackList")]
    return list({id(owner): owner for owner in [*listed, *fixed]}.values())


def _name(owner: object) -> str:
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    return f"{owner.__module__}.{owner.__qualname__}"


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 6, 3)).astype("float32"), rng.normal(size=(16, 1)).astype(
        "float32")


def _model() -> keras.Model:
    """A GRU with input dropout (the rnn stage's tuner swaps its cell's dropout mask), a
    LayerNormalization and two Dense layers: a few of the stages' methods run."""
    inputs = keras.Input((6, 3))
    h = keras.layers.GRU(8, dropout=0.25)(inputs)
    h = keras.layers.Dense(8, activation="relu")(h)
    h = keras.layers.LayerNormalization()(h)
    return keras.Model(inputs, keras.layers.Dense(1)(h))


def _fit(model: keras.Model) -> None:
    x, y = _data()
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    model.evaluate(x, y, batch_size=8, verbose=0)
    model.predict(x, batch_size=8, verbose=0)


@pytest.fixture(scope="module")
def snapshot():
    """``vars()`` of every patchable owner, after a stock fit (Keras's own first-use state
    settled) and before tfmx or policies patch anything in this process's test."""
    tfmx.disable()
    policies.reset()
    assert patches.installed() == []
    _fit(_model())
    return {id(owner): (owner, dict(vars(owner))) for owner in _patchable_owners()}


def _python_made(attribute: str, before: object, now: object) -> bool:
    """Python's own first-read cache: reading ``cls.__annotations__`` of a class that has none
    stores an empty dict in it (Python 3.10+), and a runtime-checkable Protocol's isinstance
    (TensorFlow's ``tf.is_tensor`` of a layer) reads it of every class in the MRO."""
    return attribute == "__annotations__" and before is _ABSENT and now == {}


def _changed(snapshot) -> list[str]:
    """Each attribute of a snapshot owner that is no longer the object it was."""
    changed = []
    for owner, before in snapshot.values():
        now = vars(owner)
        for attribute in sorted(set(before) | set(now)):
            old, new = before.get(attribute, _ABSENT), now.get(attribute, _ABSENT)
            if new is not old and not _python_made(attribute, old, new):
                changed.append(f"{_name(owner)}.{attribute}")
    return changed


@pytest.fixture
def swaps(monkeypatch):
    """The (owner, attribute) of every ``patches.temporarily`` swap made in the test."""
    seen = []
    original = patches.temporarily

    def spying(owner, attribute, value):
        seen.append((owner, attribute))
        return original(owner, attribute, value)

    monkeypatch.setattr(patches, "temporarily", spying)
    return seen


def test_the_snapshot_covers_every_group(snapshot):
    names = {_name(owner) for owner, _ in snapshot.values()}
    assert "keras.src.backend.tensorflow.trainer" in names
    assert "keras.src.layers.rnn.gru.GRU" in names  # a stage's
    assert "keras.src.models.model.Model" in names  # policies'


def test_tfmx_enable_fit_disable_leaves_every_attribute_as_it_was(snapshot, swaps):
    tfmx.enable(backend="cpu")
    _fit(_model())
    tfmx.disable()
    assert _changed(snapshot) == []
    assert patches.installed() == []
    # the writes that last a block were swaps, each put back (the trainer module's ``tf``
    # while a step function is built, the GRU cell's dropout mask while a candidate traces)
    attributes = {attribute for _, attribute in swaps}
    assert "tf" in attributes
    assert "_dropout_mask" in attributes


def test_policies_set_global_fit_reset_leaves_every_attribute_as_it_was(snapshot):
    policies.set_global("mixed_bfloat16")
    _fit(_model())
    policies.reset()
    assert _changed(snapshot) == []
    assert patches.installed() == []


def test_both_together_each_undoes_its_own(snapshot):
    tfmx.enable(backend="cpu")
    policies.set_global("mixed_bfloat16")
    _fit(_model())
    tfmx.disable()
    assert {p.group for p in patches.installed()} == {"policies"}
    policies.reset()
    assert _changed(snapshot) == []
    assert patches.installed() == []


def test_keras_fixes_are_a_group_of_their_own():
    tfmx.enable(backend="cpu")
    try:
        fixed = {p.attribute for p in patches.installed(keras_fixes.GROUP)}
        assert fixed == {"_maybe_symbolic_build", "reduce_per_replica"}
        assert not fixed & {p.attribute for p in patches.installed(keras_hook.GROUP)}
    finally:
        tfmx.disable()
    assert not keras_fixes.installed() and not keras_hook.installed()


def test_the_hook_keeps_what_it_knows_of_a_model_off_the_model():
    tfmx.enable(backend="cpu")
    try:
        model = _model()
        _fit(model)
        ours = [name for name in vars(model) if name.startswith("_tfmx")]
        ours += [name for name in vars(model.train_function) if name.startswith("_tfmx")]
        assert ours == []
        assert set(keras_hook._STAMPS[model]) == {"train", "test", "predict"}
        assert keras_hook._GUARDED.get(id(model.train_function)) is model.train_function
        count = len(keras_hook._STAMPS)
        del model
        gc.collect()
        assert len(keras_hook._STAMPS) == count - 1  # held weakly
    finally:
        tfmx.disable()
    assert len(keras_hook._STAMPS) == 0


def test_a_swap_of_an_instance_attribute_is_listed_while_it_lasts():
    from fusion.calls.rnn import _stand_in_dropout

    layer = keras.layers.GRU(4, dropout=0.5)
    layer.build((None, 5, 3))
    before = dict(vars(layer.cell))
    with _stand_in_dropout([layer], np.ones((2, 5, 3), "float32")):
        (swap,) = patches.installed(patches.TEMPORARY)
        assert (swap.owner, swap.attribute) == (layer.cell, "_dropout_mask")
        assert layer.cell._dropout_mask.shape == (2, 3)
        with pytest.raises(RuntimeError, match="already patched by 'temporarily'"):
            patches.install("demo", layer.cell, "_dropout_mask", lambda original: None)
    assert patches.installed() == []
    after = vars(layer.cell)
    assert set(after) == set(before)
    assert all(after[name] is before[name] for name in before)


def test_a_layer_probed_in_float32_keeps_its_own_policy_object():
    from policies.model_probe import probe_layers

    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4, dtype="mixed_bfloat16")
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden(inputs)))
    policy = vars(hidden)["_dtype_policy"]
    ins, outs = probe_layers(model, [hidden], np.ones((2, 4), "float32"))
    assert keras.backend.standardize_dtype(outs[0].dtype) == "float32"  # probed in float32
    assert vars(hidden)["_dtype_policy"] is policy
    assert patches.installed() == []
