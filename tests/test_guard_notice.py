"""The first-run line: one line on stderr when tfmx starts measuring a model, silenced by
``fit(verbose=0)``, ``tfmx.enable(verbose=0)`` or ``TFMX_VERBOSE=0``."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tfmx
from tfmx import guard, notice
from tfmx.tuner import Tuner

LINE = "tfmx: measuring"


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.setenv("TFMX_TUNE", "off")
    monkeypatch.setenv("TFMX_GUARD_BUDGET", "none")
    monkeypatch.delenv(notice.ENV_VERBOSE, raising=False)
    guard.forget()
    notice.forget()
    yield
    guard.forget()
    notice.forget()
    notice.set_verbose(None)
    tfmx.disable()


def _fit(fit_verbose: int, fits: int = 1, **enable) -> None:
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Dense(16, "relu")(inp)))
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(128, 8)).astype("float32")
    y = rng.integers(0, 3, 128)
    tfmx.enable(backend="cpu", guard=True, tune="off", xla=False, **enable)
    for _ in range(fits):
        model.fit(x, y, batch_size=16, epochs=1, verbose=fit_verbose, shuffle=False)


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith(LINE)]


def test_a_first_fit_says_once_that_it_measures(capsys):
    _fit(2, fits=2)  # the second fit reuses the first one's trial: no line
    lines = _lines(capsys)
    assert len(lines) == 1, lines
    assert lines[0].startswith("tfmx: measuring 2 choices for this model (first run only")
    assert tfmx.report().guards


@pytest.mark.parametrize("how", ["fit", "enable", "env"])
def test_the_line_is_silenced(capsys, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv(notice.ENV_VERBOSE, "0")
    _fit(0 if how == "fit" else 2, **({"verbose": 0} if how == "enable" else {}))
    assert _lines(capsys) == []
    assert tfmx.report().guards  # the trial ran all the same


def test_the_tuner_says_so_before_its_first_measurement_only(capsys):
    tuner = Tuner(mode="auto", cache=None, budget=12.0,
                  timer=lambda runs, budget: {"a": 2.0, "b": 1.0})
    for signature in ("x", "y"):
        tuner.choose("demo", signature, {"a": lambda: None, "b": lambda: None},
                     conservative="a")
    assert _lines(capsys) == [
        "tfmx: measuring the choices for this model (first run only, up to 12 s)"]
    Tuner(mode="off").choose("demo", "z", {"a": None, "b": None}, conservative="a")
    assert _lines(capsys) == []


def test_a_bad_verbose_is_refused():
    with pytest.raises(ValueError, match="verbose must be 0, 1 or None"):
        tfmx.enable(backend="cpu", verbose="loud")
