"""Every private name of Keras and TensorFlow tfmx uses is in fusion.private_api and resolves on
the installed versions; a missing one names itself, the versions and what stays off, and tfmx
steps aside for it."""

from __future__ import annotations

import ast
import importlib.util
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
from test_versions import _fit  # a small fit's weights

import tfmx
from fusion import private_api, stage
from tfmx import state
from tfmx.errors import TfmxWarning

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for package in ("tfmx", "fusion", "policies")
                 for p in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("key", [p.key for p in private_api.PRIVATE])
def test_every_private_name_resolves_here(key):
    problem = private_api.check()[key]
    assert problem is None, problem


def test_every_stage_hook_resolves_here():
    missing = []
    for family in stage.stages():
        for hook in family.hooks:
            if importlib.util.find_spec(hook.owner.split(".")[0]) is None:
                continue  # a hook of a package not installed here (keras_hub's)
            try:
                getattr(hook.owner_class(), hook.attribute)
            except (ImportError, AttributeError) as exc:
                missing.append(f"{family.name}: {hook.owner}.{hook.attribute} ({exc})")
    assert not missing, f"{private_api.versions()}: {missing}"


def _imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_keras_private_modules_are_imported_only_through_the_table():
    direct = {str(p.relative_to(ROOT)): sorted(m for m in _imported_modules(p)
                                               if m.startswith("keras.src"))
              for p in SOURCES if p.name != "private_api.py"}
    assert not {p: m for p, m in direct.items() if m}


def test_every_tensorflow_private_module_imported_is_in_the_table():
    listed = {path.partition(":")[0] for p in private_api.PRIVATE for _, path in p.places}
    imported = {m for p in SOURCES for m in _imported_modules(p)
                if m.startswith("tensorflow.python.")}
    # "from tensorflow.python.framework import ops" lists both the package and the module
    unlisted = {m for m in imported if m not in listed and not any(
        name.startswith(m + ".") for name in listed) and m.rpartition(".")[0] not in listed}
    assert not unlisted


def test_a_moved_owner_is_found_where_this_keras_holds_it():
    owner = private_api.locate("keras.src.backend.tensorflow:nn")
    expected = ("keras.src.backend.tensorflow.ops:nn" if private_api.release("keras") >= (3, 16)
                else "keras.src.backend.tensorflow:nn")
    assert owner == expected
    assert private_api.locate("keras.src.nowhere:thing") == "keras.src.nowhere:thing"


def _gone(monkeypatch, key: str) -> None:
    gone = private_api.Private(key, (("keras 3.15", "keras.src.nowhere:Gone"),),
                               private_api._BY_KEY[key].off)
    monkeypatch.setitem(private_api._BY_KEY, key, gone)


def test_a_missing_name_says_which_where_and_what_stays_off(monkeypatch):
    _gone(monkeypatch, "keras.Dense")
    with pytest.raises(ImportError) as caught:
        private_api.get("keras.Dense")
    message = str(caught.value)
    assert "keras.Dense" in message and "keras.src.nowhere:Gone" in message
    assert f"Keras {keras.__version__}" in message and "feed_forward family stays off" in message
    assert private_api.check()["keras.Dense"] == message


def test_a_keras_without_the_trainer_in_the_table_warns_once_and_fits_as_stock(monkeypatch):
    tfmx.disable()
    stock = _fit()
    monkeypatch.setattr(state, "_warned", set())
    _gone(monkeypatch, "keras.trainer")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tfmx.enable(backend="cpu", guard=False)
    seen = [w for w in seen if issubclass(w.category, TfmxWarning)]
    try:
        assert len(seen) == 1 and "keras.trainer" in str(seen[0].message), seen
        assert not tfmx.enabled()
        for got, want in zip(_fit(), stock):
            np.testing.assert_array_equal(got, want)
    finally:
        tfmx.disable()
