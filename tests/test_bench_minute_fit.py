"""bench/minute_fit.py (``python -m bench.fit_price --minute``): a whole fit sized to take stock
a target time, stock against tfmx and XLA, each fit in a process of its own.

With a tiny target (one second, the smallest workload, in this process): the probe sizes the
fit, the warm-up fit comes before the rounds, every mode is fitted each round, the medians,
ratios and targets, records that load back and the rows of BENCHMARKS.md's section. One real
child process: TensorFlow's default oneDNN state, the given tuning cache.
"""

from __future__ import annotations

import json
import os

import pytest

from bench import fit_price, minute_fit, publish
from bench.workloads import WORKLOADS, Workload, tfmx_restored

TINY = {"samples": 64, "batch_size": 32}


def _two_dense():
    import keras

    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, activation="softmax")(hidden))


@pytest.fixture(scope="module")
def rows():
    """The whole plumbing at a one-second target on a two-layer model, each fit run in this
    process."""
    specs = []

    def run(spec):
        specs.append(dict(spec))
        return minute_fit.fit_in_process(spec)

    tiny = Workload("two_dense", "Dense(16, relu) -> Dense(4)", _two_dense, (8,), 4,
                    batch_size=32, rounds=1, steps=1)
    with pytest.MonkeyPatch.context() as mp, tfmx_restored():
        mp.setitem(WORKLOADS, tiny.name, tiny)
        measured = minute_fit.run_minute_fits([tiny.name], target_s=1.0, rounds=2, run=run,
                                              small_models=(tiny.name,), **TINY)
    return measured, specs


def test_the_probe_sizes_the_fit_and_the_warm_fit_comes_first(rows):
    (row,), specs = rows
    small, specs = specs[0], specs[1:]  # a small model fitted with tfmx before all else
    assert (small["mode"], small["epochs"]) == ("small", 1)
    assert row["small"][0]["workload"] == "two_dense" and row["small"][0]["seconds"] > 0
    assert "gain_expected" in row["small"][0]["tuning"]
    for key in minute_fit.SMALL_ENV:  # its tuner and trial ran to their end, in that fit only
        assert key not in os.environ
    assert [s["mode"] for s in specs[:2]] == ["probe", "warm"]
    assert specs[0]["epochs"] == minute_fit.PROBE_EPOCHS
    sizing = row["sizing"]
    assert sizing["epoch_s"] > 0 and sizing["first_epoch_s"] >= sizing["epoch_s"] * 0.5
    assert row["epochs"] == minute_fit.size_epochs(sizing, 1.0) >= 1
    assert row["steps"] == row["epochs"] * 2
    assert specs[1]["epochs"] == row["epochs"]  # the warm-up fit as long as the timed ones
    # the rounds: every mode once per round, the order rotated
    timed = [s["mode"] for s in specs[2:]]
    assert timed == ["stock", "tfmx", "xla", "tfmx", "xla", "stock"]
    assert all(s["epochs"] == row["epochs"] for s in specs[2:])
    # XLA's fits, and only they, stop at XLA_CAP x stock's predicted fit
    predicted = row["sizing"]["predicted_s"]
    for s in specs[2:]:
        assert s.get("limit_s") == (pytest.approx(minute_fit.XLA_CAP * predicted)
                                    if s["mode"] == "xla" else None), s


def test_medians_ratios_and_the_tuning_cache_in_use(rows):
    (row,), _ = rows
    for mode in minute_fit.MODES:
        seconds = [f["seconds"] for f in row["fits"][mode]]
        assert len(seconds) == 2 and min(seconds) > 0
        assert row["median_s"][mode] == pytest.approx(sum(seconds) / 2)
    v = row["verdict"]
    assert v["tfmx/stock"] == pytest.approx(row["median_s"]["tfmx"] / row["median_s"]["stock"])
    best = min(("stock", "xla"), key=row["median_s"].get)
    assert v["best_alternative"] == best
    assert v["meets"] == (v["tfmx/stock"] <= minute_fit.VS_STOCK and v["tfmx/best"] <= 1.0)
    warm = row["warm"]["tuning"]
    assert warm["cache_dir"] == os.environ["TFMX_CACHE_DIR"]
    for fit in row["fits"]["tfmx"]:  # the warm-up fit's cache, read by the timed fits
        tuning = fit["tuning"]
        assert tuning["cache_dir"] == warm["cache_dir"]
        assert tuning["held"] >= warm["held_after"] >= warm["held"], (warm, tuning)
        assert isinstance(tuning["decisions"], dict), tuning
    assert row["warm"]["seconds"] > 0
    assert "guard" not in row["fits"]["stock"][0] and row["env"]["cpu"]


def test_records_load_back_and_render_as_benchmarks_md_rows(rows, tmp_path):
    (row,), _ = rows
    command = "python -m bench.fit_price --minute --model two_dense transformer --record"
    path, = minute_fit.write_minute_fits([row], command, tmp_path / "fit_price" / "minute")
    assert path.name == minute_fit.record_name(row)
    record, = minute_fit.load_minute_fits(path.parent)
    assert record["reproduce"] == "python -m bench.fit_price --minute --model two_dense --record"
    assert record["median_s"] == row["median_s"] and record["epochs"] == row["epochs"]
    assert fit_price.load_fit_prices(tmp_path / "fit_price") == []  # the short fits' reader
    section = publish.extra_sections(tmp_path)[1]
    assert section.startswith("## A one-minute fit")
    assert minute_fit.format_row(record) in section.splitlines()
    assert f"| two_dense | {row['epochs']} x 64 ({row['steps']} steps of 32) |" in section
    assert record["reproduce"] in section


def test_the_fit_price_command_dispatches_and_records(monkeypatch, tmp_path):
    seen = {}

    def fake(models, target_s, samples, batch_size, rounds, warm, cache_dir, on_row):
        seen.update(models=models, target_s=target_s, samples=samples, rounds=rounds,
                    warm=warm, cache_dir=cache_dir)
        row = {"workload": models[0], "env": {"onednn": True}, "epochs": 1, "samples": samples,
               "batch_size": batch_size, "steps": 2, "median_s": {"stock": 2.0},
               "verdict": minute_fit.verdict({"stock": 2.0}), "fits": {}}
        on_row(row)
        return [row]

    monkeypatch.setattr(minute_fit, "run_minute_fits", fake)
    argv = ["--minute", "--target-seconds", "2", "--no-warm-fit", "--cache-dir", "/tmp/c",
            "--record", str(tmp_path)]
    assert fit_price.main(argv) == 0
    assert seen == {"models": ["transformer"], "target_s": 2.0, "samples": minute_fit.SAMPLES,
                    "rounds": 3, "warm": False, "cache_dir": "/tmp/c"}
    record = json.loads((tmp_path / "transformer-onednn-on.json").read_text())
    # the --record folder dropped: the record reproduces into the default one
    assert record["command"] == "python -m bench.fit_price " + " ".join(argv[:-1])


def test_a_fit_runs_in_a_process_of_its_own_in_the_default_onednn_state(tmp_path, monkeypatch):
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")  # removed for the child
    spec = {"workload": "mlp", "mode": "stock", "epochs": 1, **TINY}
    out = minute_fit.launch(spec, cache_dir=str(tmp_path))
    assert out["mode"] == "stock" and out["seconds"] > 0
    assert out["env"]["onednn_env"] is None  # the variable unset: TensorFlow's default


def test_a_fit_past_its_limit_stops_and_its_median_is_a_lower_bound(monkeypatch):
    tiny = Workload("two_dense", "Dense(16, relu) -> Dense(4)", _two_dense, (8,), 4,
                    batch_size=32, rounds=1, steps=1)
    monkeypatch.setitem(WORKLOADS, tiny.name, tiny)
    with tfmx_restored():
        out = minute_fit.fit_in_process({"workload": tiny.name, "mode": "stock", "epochs": 3,
                                         "limit_s": 0.0, **TINY})
        whole = minute_fit.fit_in_process({"workload": tiny.name, "mode": "stock", "epochs": 1,
                                           "limit_s": 1e6, **TINY})
    assert out["stopped"] == {"limit_s": 0.0, "seconds": out["seconds"], "steps": 1,
                              "of_steps": 6}
    assert "stopped" not in whole  # finished within its limit
    stopped = {"seconds": 9.0, "stopped": {"steps": 3, "of_steps": 40}}
    fits = {"stock": [{"seconds": 4.0}] * 3, "tfmx": [{"seconds": 3.0}] * 3,
            "xla": [stopped, stopped, {"seconds": 8.5}]}
    assert minute_fit.lower_bounds(fits) == ["xla"]
    assert minute_fit.lower_bounds({**fits, "xla": [stopped, {"seconds": 8.5}] * 1}) == []
    median = {"stock": 4.0, "xla": 9.0, "tfmx": 3.0}
    row = {"workload": "w", "epochs": 2, "samples": 64, "batch_size": 32, "steps": 4,
           "median_s": median, "verdict": minute_fit.verdict(median), "lower_bounds": ["xla"]}
    assert "| 4.0 | > 9.0 | 3.0 | 0.750 | 0.750 (stock) |" in minute_fit.format_row(row)
