"""A user's step function is traced no more often under tfmx than stock, and the report says
how often (Keras's own ``test_retracing``: a ``train_step`` override that counts its traces,
``steps_per_execution=20``, at most 2)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tfmx


def _fit_counting(on: bool, metrics: tuple[str, ...] = (), **enable) -> int:
    """Keras's retracing model (one Dense, Adam, steps_per_execution=20) fit for an epoch of
    100 single-sample steps; how often its ``train_step`` was traced."""
    keras.utils.set_random_seed(0)
    tfmx.enable(backend="cpu", **enable) if on else tfmx.disable()
    count = [0]

    class Counting(keras.Model):
        def train_step(self, *args):
            count[0] += 1
            return super().train_step(*args)

    inp = keras.Input(shape=[4])
    model = Counting(inputs=inp, outputs=keras.layers.Dense(1, activation="relu")(inp))
    model.compile(loss="mse", optimizer="adam", steps_per_execution=20, metrics=list(metrics))
    model.fit(np.ones((100, 4)), np.ones((100, 1)), batch_size=1, epochs=1, verbose=0)
    return count[0]


@pytest.mark.parametrize("metrics", [(), ("mae",)])
def test_no_more_traces_than_stock_and_the_report_counts_them(metrics):
    stock = _fit_counting(False, metrics)
    assert stock == 2  # Keras builds the optimizer (and metrics) in the first trace
    traced = _fit_counting(True, metrics, patterns=["optimizer_update"])
    assert traced <= stock
    assert tfmx.report().traces_of("Counting.train_step") == traced
    assert "traces of each step function's Python" in str(tfmx.report())


@pytest.mark.usefixtures("every_rewrite")
def test_a_stage_that_rewrites_and_the_guards_stock_form_stay_within_stock(monkeypatch):
    """A stage rewrites the Dense (every rewrite taken) and the guard runs a whole trial (no
    budget), so the stock form is traced too: still no more traces than stock."""
    monkeypatch.setenv("TFMX_GUARD_BUDGET", "none")
    traced = _fit_counting(True, patterns=["bias_row"], guard=True, xla=False)
    report = tfmx.report()
    assert report.patterns["bias_row"].fused == 1
    forms = {form for (name, form) in report.python_traces if name == "Counting.train_step"}
    assert "stock" in forms, report.python_traces
    assert traced <= 2
