"""Stages never break training: a stage that fails, or meets an input it does not take, leaves
the call as Keras wrote it.

For each stage family, a small model where the family applies (every rewrite taken, so the
stage emits its form): with a failure injected as the handler starts, in the tuner, and after
the form was emitted, ``fit`` trains, the weights equal stock's, the report holds the error and
nothing the failed stage emitted runs. And each family's handler takes or declines, with a
reason, every input form Keras layers take (sparse, ragged, masked, integer, nested, 16-bit
policies, ``training=None/False/True``, symbolic calls, ``run_eagerly``, ``jit_compile``,
``train_step`` overrides, subclasses of the hooked layers).
"""

from __future__ import annotations

import importlib
import warnings

import keras
import numpy as np
import pytest
from helpers import FAULT_POINTS, StageExample, failing, nodes_that_ran

import tfmx
from fusion import stage
from fusion.family import get
from tfmx import state
from tfmx.errors import TfmxWarning

pytestmark = pytest.mark.usefixtures("every_rewrite")

def _examples() -> dict[str, StageExample | None]:
    """Each declared stage family's example, from its own test file (``tests/test_<family>.py``,
    ``STAGE_EXAMPLE``); None where that file or its example is missing."""
    found = {}
    for family in sorted(s.name for s in stage.stages()):
        try:
            module = importlib.import_module(f"test_{family}")
        except ModuleNotFoundError:
            module = None
        found[family] = getattr(module, "STAGE_EXAMPLE", None)
    return found


EXAMPLES = _examples()
STAGES = sorted(family for family, example in EXAMPLES.items() if example is not None)
"""The declared stage families with an example (a family's module removed, its test file
goes with it)."""


def test_every_stage_family_declares_its_example_in_its_test_file():
    missing = sorted(family for family, example in EXAMPLES.items() if example is None)
    assert not missing, (f"stage families without STAGE_EXAMPLE (a helpers.StageExample) in "
                         f"tests/test_<family>.py: {missing}")


def _data(model: keras.Model, n: int = 16) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    shape = tuple(model.inputs[0].shape[1:])
    return rng.normal(size=(n, *shape)).astype("float32"), rng.normal(size=(n, 4)).astype(
        "float32")


def _fit(family: str, **enable) -> tuple[keras.Model, list[np.ndarray]]:
    """Build ``family``'s model (seeded), train it two epochs with tfmx as ``enable`` says (None:
    off); the model and its initial weights."""
    if enable.get("off"):
        tfmx.disable()
    else:
        tfmx.enable(backend="cpu", patterns=[family], guard=False, **enable)
    keras.utils.set_random_seed(0)
    model = EXAMPLES[family].model()
    model.compile(keras.optimizers.SGD(0.01), "mse")
    initial = [w.numpy() for w in model.weights]
    x, y = _data(model)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return model, initial


def _emitted(model: keras.Model) -> list[str]:
    """The nodes a stage emitted (under a ``tfmx_`` scope) that compute something in what
    the train function runs (a failed attempt's ops become NoOps)."""
    return [n.name for n in nodes_that_ran(model.train_function)
            if "tfmx_" in n.name and n.op != "NoOp"]


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(state, "_warned", set())


_STOCK: dict[str, list[np.ndarray]] = {}


def _stock_weights(family: str) -> list[np.ndarray]:
    """``family``'s model trained stock (once per test run), its weights."""
    if family not in _STOCK:
        _STOCK[family] = [w.numpy() for w in _fit(family, off=True)[0].weights]
    return _STOCK[family]


@pytest.mark.parametrize("family", STAGES)
def test_each_stage_emits_its_form_on_its_model(family):
    """What the failure tests below take away is there without a failure."""
    fused, _ = _fit(family)
    assert tfmx.report().patterns[family].fused, tfmx.report().patterns[family].as_dict()
    assert _emitted(fused)


@pytest.mark.parametrize("where", FAULT_POINTS)
@pytest.mark.parametrize("family", STAGES)
def test_a_failing_stage_leaves_keras_call_and_trains_as_stock(family, where, fresh_warnings,
                                                              monkeypatch):
    stock = _stock_weights(family)
    failing(monkeypatch.setattr, family, where)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        failed, _ = _fit(family, strict=False)
    stats = tfmx.report().patterns[family]
    if not stats.errors:  # a family that asks no tuner cannot fail there: its form ran
        assert where == "tuner" and stats.fused, (family, where, stats.as_dict())
        return
    assert "injected failure" in stats.errors[0]
    assert any(issubclass(w.category, TfmxWarning) and family in str(w.message) for w in seen)
    assert stats.fused == 0 and not stats.observed, stats.as_dict()
    assert not _emitted(failed), _emitted(failed)[:5]
    for a, b in zip(failed.weights, stock):
        np.testing.assert_array_equal(a.numpy(), b, err_msg=a.path)


@pytest.mark.parametrize("family", STAGES)
def test_strict_raises_what_the_stage_raised(family, monkeypatch):
    failing(monkeypatch.setattr, family, "handler")
    with pytest.raises(Exception, match="injected failure"):
        _fit(family, strict=True)


def test_a_variable_created_inside_an_attempt_is_initialized_when_it_ends():
    """A layer built lazily inside a stage's attempt (its variables created in Keras's
    StatelessScope, so deferred) has them initialized when the attempt ends, committed or
    not, as Keras's own scope does: a metric or weight created there is usable after."""
    from fusion.transaction import Attempt

    for commit in (True, False):
        with Attempt() as attempt:
            made = keras.Variable(initializer="ones", shape=(2,))
        attempt.commit() if commit else attempt.abandon()
        made.assign_add([1.0, 1.0])  # an uninitialized variable has nothing to add to
        assert made.numpy().tolist() == [2.0, 2.0]


SECTIONS = ("# -- match:", "# -- check:", "# -- forms:", "# -- declaration")


@pytest.mark.parametrize("family", STAGES)
def test_every_stage_module_reads_in_one_order(family):
    """Each stage family's module: what it matches, why a call declines, the forms it emits
    (the conservative one named), the declaration; each under its heading, in that order, with
    the same names (fusion/calls/__init__.py)."""
    import importlib
    import inspect

    from fusion.stage import Hook

    module = importlib.import_module(f"fusion.calls.{family}")
    source = inspect.getsource(module)
    at = [source.find("\n" + heading) for heading in SECTIONS]
    assert -1 not in at and at == sorted(at), dict(zip(SECTIONS, at))
    for name, section in (("MATCHES", 0), ("check", 1), ("CONSERVATIVE", 2), ("DECLARED", 3)):
        place = max(source.find(f"\n{spelled}", at[section])
                    for spelled in (f"{name} =", f"def {name}("))
        assert place > at[section] and (section == 3 or place < at[section + 1]), (name, family)
    declared = module.DECLARED
    assert [f"{h.owner}.{h.attribute}" for h in declared.hooks] == list(module.MATCHES)
    assert declared.forms is module.FORMS and declared.forms.conservative == module.CONSERVATIVE
    assert all(isinstance(h, Hook) for h in declared.hooks)


# -- forms whose ops the target has no kernel for --------------------------------------------------
LACKING = {family: EXAMPLES[family].lacking for family in STAGES if EXAMPLES[family].lacking}
"""Per family, an op every form its example can take emits (in float32: the examples train in
float32), as its test file declares it."""


def _families_emits() -> dict[str, dict[str, frozenset[str]]]:
    """Per stage family, the ops each of its forms emits (its declared and contributed
    forms)."""
    return {family: {form.name: form.emits for form in get(family).forms.all()}
            for family in STAGES}


def test_every_lacking_op_is_declared_by_its_family():
    for family in STAGES:
        declared = {o.partition(":")[0] for ops in _families_emits()[family].values()
                    for o in ops}
        if family in LACKING:
            assert LACKING[family] in declared, (family, sorted(declared))
        else:  # an example whose forms emit nothing a kernel table decides
            assert not declared, (family, sorted(declared))


@pytest.mark.parametrize("family", sorted(LACKING))
def test_a_backend_without_an_op_of_the_form_in_the_dtype_keeps_keras_call(family, monkeypatch):
    """The cpu backend, its table saying ``LACKING[family]`` has no float32 kernel: the stage
    declines every form with the reason naming the op and dtype, and trains as stock."""
    import dataclasses

    from tfmx import backends

    op = LACKING[family]
    real = backends._cpu

    def lacking(onednn: bool) -> backends.Backend:
        return dataclasses.replace(real(onednn), op_dtypes={op: frozenset({"float64"})})

    monkeypatch.setattr(backends, "_cpu", lacking)
    assert not backends.get_backend("cpu").runs_op(op, "float32")
    model, _ = _fit(family)
    stats = tfmx.report().patterns[family]
    reason = f"no {op} kernel in float32 under cpu: the call would run on the host"
    assert not stats.fused, stats.as_dict()
    assert any(reason in why for why in stats.declined), stats.as_dict()
    # Keras's own call, under the rnn stage's scope of declined layers where it has one
    assert [n for n in _emitted(model) if "_declined_" not in n] == []
    for got, want in zip(model.weights, _stock_weights(family)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["cpu", "cuda"])
def test_cpu_and_cuda_run_every_op_every_form_declares(name):
    from tfmx.backends import get_backend

    backend = get_backend(name)
    for family, emits in _families_emits().items():
        for form, ops in emits.items():
            for qualified in ops:
                op, _, fixed = qualified.partition(":")
                for dtype in [fixed] if fixed else ["float32", "float16", "bfloat16"]:
                    assert backend.runs_op(op, dtype), (name, family, form, op, dtype)


def test_the_open_plugin_declines_bfloat16_forms_naming_op_and_plugin():
    from fusion.forms import runnable_forms
    from tfmx.backends import get_backend

    metal = get_backend("metal", plugin="tensorflow-metal-plugin", tensorflow="2.21.0")
    for family in ("attention", "bias_row", "einsum_dense"):
        forms = [form for form in get(family).forms.all() if form.emits]
        kept, why = runnable_forms(metal, forms, "bfloat16")
        assert kept == [], kept
        assert why.endswith("kernel in bfloat16 under tensorflow-metal-plugin 0.4.1: the call "
                            "would run on the host"), why
        assert runnable_forms(metal, forms, "float16")[0] == forms
