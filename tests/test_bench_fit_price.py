"""bench.fit_price: --record keeps whole-fit prices as JSON records that load back and render
as BENCHMARKS.md's section; --model zoo expands to the zoo's workloads; token models get ids."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from bench import fit_price, zoo
from bench.records import load_records
from bench.workloads import GROUPS, WORKLOADS, Workload


def _row(workload: str = "mlp", cold: bool = False, stock: float = 2.0,
         tfmx: float = 3.0) -> dict:
    return {"workload": workload, "description": "d", "epochs": 3, "samples": 512,
            "batch_size": 32, "steps": 48, "rounds": 3, "tune": "cached", "cold": cold,
            "median_s": {"stock": stock, "tfmx": tfmx},
            "fits": {"stock": [{"mode": "stock", "seconds": stock}],
                     "tfmx": [{"mode": "tfmx", "seconds": tfmx,
                               "guard": "Functional.train_step: kept fused",
                               "price": ["price gate: ran tfmx's form"]}]}}


ENV = {"cpu": "Test CPU", "cpu_count": 2, "cpu_flags": ["avx2"], "onednn": False,
       "onednn_env": "0", "tensorflow": "2.21.0", "keras": "3.15.1", "python": "3.11.7",
       "date": "2026-01-01 00:00"}


def test_record_of_a_tiny_fit_loads_back(tmp_path) -> None:
    """One real fit per mode of the smallest workload, recorded and read back."""
    argv = ["--model", "mlp", "--epochs", "1", "--samples", "64", "--rounds", "1",
            "--modes", "stock", "tfmx", "--cold", "--record", str(tmp_path)]
    assert fit_price.main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp-cold.json"]
    record, = fit_price.load_fit_prices(tmp_path)
    assert record["workload"] == "mlp" and record["cold"] is True
    assert (record["epochs"], record["samples"], record["batch_size"], record["steps"]) == (
        1, 64, 32, 2)
    assert record["command"].startswith("python -m bench.fit_price --model mlp --epochs 1")
    assert "--cold" in record["command"] and record["reproduce"] == record["command"]
    assert record["env"]["cpu"] and record["env"]["onednn"] in (True, False)
    assert set(record["median_s"]) == {"stock", "tfmx"}
    for mode in ("stock", "tfmx"):
        seconds = [f["seconds"] for f in record["fits"][mode]]
        assert len(seconds) == 1 and seconds[0] > 0
        assert record["median_s"][mode] == seconds[0]
    assert record["tfmx/stock"] == pytest.approx(
        record["median_s"]["tfmx"] / record["median_s"]["stock"])
    tfmx_fit, = record["fits"]["tfmx"]
    assert isinstance(tfmx_fit["price"], list)  # the price gate's notes, kept
    assert isinstance(tfmx_fit["first_call"], list)  # its estimates of tfmx's first call
    assert record["first_call_estimates"] == fit_price.first_call_estimates(
        {"fits": record["fits"]})
    assert "mlp | 1 x 64 (2 steps of 32)" in fit_price.format_fit_price_section([record])


def test_recording_again_replaces_the_file(tmp_path) -> None:
    fit_price.write_fit_prices([_row(), _row(cold=True)], "python -m bench.fit_price",
                               tmp_path, ENV)
    fit_price.write_fit_prices([_row(stock=4.0)], "python -m bench.fit_price --rounds 5",
                               tmp_path, ENV)
    records = fit_price.load_fit_prices(tmp_path)
    assert [(r["workload"], r["cold"], r["median_s"]["stock"]) for r in records] == [
        ("mlp", True, 2.0), ("mlp", False, 4.0)]
    assert records[1]["command"].endswith("--rounds 5")
    assert records[1]["fits"]["tfmx"][0]["guard"] == "Functional.train_step: kept fused"


def test_fit_price_records_stay_out_of_the_step_records(tmp_path) -> None:
    """Even in bench/results/ itself, a fit-price record is not read as a step record, nor a
    file of another layout as a fit-price record."""
    fit_price.write_fit_prices([_row()], "python -m bench.fit_price", tmp_path, ENV)
    (tmp_path / "other.json").write_text(json.dumps({"schema": 1, "model": "mlp"}))
    (tmp_path / "broken.json").write_text("{")
    assert load_records(tmp_path) == [{"schema": 1, "model": "mlp"}]
    assert [r["workload"] for r in fit_price.load_fit_prices(tmp_path)] == ["mlp"]
    assert fit_price.RESULTS_DIR.parent.name == "results"


def test_section_renders_from_records() -> None:
    records = [fit_price.make_fit_price_record(_row("zoo_llama", True, 10.0, 12.5),
                                               "python -m bench.fit_price --model zoo --cold",
                                               ENV),
               fit_price.make_fit_price_record(_row("mlp"), "python -m bench.fit_price", ENV)]
    text = fit_price.format_fit_price_section(records)
    lines = text.splitlines()
    assert lines[0] == "## The price of a short fit"
    assert "tracing" in text and "empty tuning cache" in text
    assert "python -m bench.fit_price --model zoo --cold" in text
    assert "Test CPU, 2 cores" in text and "oneDNN off: TF_ENABLE_ONEDNN_OPTS=0" in text
    head = "| workload | fit | stock s | tfmx s | tfmx / stock | cold / warm | tfmx ran |"
    assert lines[lines.index(head) + 2:] == [  # tfmx's own workloads first, then the zoo's
        "| mlp | 3 x 512 (48 steps of 32) | 2.00 | 3.00 | 1.500 | warm | - |",
        "| zoo_llama | 3 x 512 (48 steps of 32) | 10.00 | 12.50 | 1.250 | cold | - |"]


ESTIMATE = {"function": "Functional.train_step", "form": "fused", "predicted_s": 2.4,
            "measured_s": 2.1, "measured/predicted": 0.875, "how": "1.20 x stock's"}


def test_records_keep_the_error_of_the_first_call_estimate(tmp_path) -> None:
    row = _row("zoo_llama", True, 10.0, 12.5)
    row["fits"]["tfmx"].append({"mode": "tfmx", "seconds": 12.0, "first_call": [ESTIMATE]})
    fit_price.write_fit_prices([row], "python -m bench.fit_price --model zoo --cold", tmp_path,
                               ENV)
    (record,) = fit_price.load_fit_prices(tmp_path)
    assert record["first_call_estimates"] == [
        {"mode": "tfmx", "round": 2, "predicted_s": 2.4, "measured_s": 2.1,
         "measured/predicted": 0.875}]
    assert record["fits"]["tfmx"][1]["first_call"] == [ESTIMATE]
    text = fit_price.format_fit_price_section([record])
    lines = text.splitlines()
    head = "| workload | cold / warm | fit | predicted s | measured s | measured / predicted |"
    assert lines[lines.index(head) + 2:] == [
        "| zoo_llama | cold | tfmx, round 2 | 2.40 | 2.10 | 0.875 |"]
    assert ("- zoo_llama, tfmx (round 2): tfmx's first call predicted 2.40 s, measured 2.10 s "
            "(measured/predicted 0.875)") in fit_price.format_fit_prices([row])


def test_records_without_first_call_estimates_render_as_before() -> None:
    new = fit_price.make_fit_price_record(_row(), "c", ENV)
    assert new["first_call_estimates"] == []
    bare = {k: v for k, v in new.items() if k != "first_call_estimates"}
    for record in (new, bare):
        text = fit_price.format_fit_price_section([record])
        assert "predicted" not in text
        assert text.splitlines()[-1] == (
            "| mlp | 3 x 512 (48 steps of 32) | 2.00 | 3.00 | 1.500 | warm | - |")
    with_fits = {**bare, "fits": {"tfmx": [{"first_call": [ESTIMATE]}]}}  # from its fits
    assert fit_price.first_call_estimates(with_fits)[0]["measured/predicted"] == 0.875


def test_section_has_a_table_per_machine_and_onednn_state() -> None:
    on = {**ENV, "onednn": True, "onednn_env": "1"}
    records = [fit_price.make_fit_price_record(_row(), "c", env) for env in (ENV, on)]
    text = fit_price.format_fit_price_section(records)
    assert text.count("| workload | fit |") == 2
    assert "oneDNN off" in text and "oneDNN on" in text
    assert fit_price.format_fit_price_section([]) == ""


def test_model_zoo_expands_to_the_zoo_workloads(monkeypatch, tmp_path) -> None:
    seen = {}

    def run(models, *args, **kwargs):
        seen["models"] = list(models)
        return []

    monkeypatch.setattr(fit_price, "run_fit_prices", run)
    assert fit_price.main(["--model", "mlp", "zoo", "--modes", "stock",
                           "--record", str(tmp_path)]) == 0
    assert seen["models"] == ["mlp", *GROUPS["zoo"]]
    assert "zoo_llama" in seen["models"] and "zoo_mobilenet_v3_small" in seen["models"]
    assert list(tmp_path.iterdir()) == []


def test_token_models_get_token_ids() -> None:
    for name in GROUPS["zoo"]:
        workload = WORKLOADS[name]
        x, y = fit_price.fit_data(workload, 16)
        assert x.shape == (16, *workload.input_shape) and y.dtype == np.int32
        if workload.vocabulary:
            assert x.dtype == np.int32 and 0 <= x.min() and x.max() < workload.vocabulary
        else:
            assert x.dtype == np.float32
    assert {n for n in GROUPS["zoo"] if WORKLOADS[n].vocabulary} >= {
        "zoo_llama", "zoo_bert", "zoo_gpt2"}


@pytest.mark.skipif(not zoo.keras_hub_available(), reason="needs keras_hub")
def test_a_token_model_fits() -> None:
    """The fit a zoo language model gets, at the zoo's tiny size (its bench size is the same
    builder with more layers, width and tokens)."""
    spec = zoo.MODELS["llama"]
    tiny = Workload("zoo_llama_tiny", spec.description,
                    functools.partial(zoo.build, "llama", "tiny"), spec.shape("tiny"), 10,
                    batch_size=8, rounds=1, steps=1, vocabulary=spec.vocab("tiny"))
    row, = fit_price.run_fit_prices([tiny], epochs=1, samples=16, batch_size=8, rounds=1,
                                    modes=("stock", "tfmx"), cold=True)
    assert row["workload"] == "zoo_llama_tiny" and row["steps"] == 2
    assert row["median_s"]["stock"] > 0 and row["median_s"]["tfmx"] > 0
