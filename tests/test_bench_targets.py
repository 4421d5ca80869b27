"""bench/targets.py: BENCHMARKS.md's Targets section, from hand-made records.

Each target counts the rows that meet it in TensorFlow's default oneDNN state and names each
row that misses it with its figure and gap; what holds the time comes from a composite record
of the same processor and state, else the step record's floor, else the command that would
profile it; records of another machine stay in their own machine's list.
"""

from __future__ import annotations

import json

import pytest

from bench import floor, publish, targets
from bench.records import load_records, write_records

EPYC = {"date": "2026-01-02 10:00", "tensorflow": "2.21.0", "keras": "3.15.1",
        "python": "3.11.7", "platform": "Linux", "cpu": "EPYC", "cpu_vendor": "AuthenticAMD",
        "cpu_family": "25", "cpu_model": "17", "cpu_flags": ["avx2", "avx512_vnni"],
        "cpu_count": 2, "gpus": 0}
OLD = {**EPYC, "cpu": "Old", "cpu_model": "1", "cpu_flags": ["avx2"]}  # oneDNN off by default


def result(model: str, state: str = "on", env: dict | None = None, floor_ms: float = 0.0,
           **ms: float) -> dict:
    r = {"model": model, "optimizer": "adam", "batch_size": 32, "rounds": 2, "steps": 3,
         "warmup": 1, "policy": None,
         "env": {**(env or EPYC), "onednn": state == "on", "onednn_env": None},
         "modes": {m: {"median_ms": v, "p25_ms": v, "p75_ms": v, "min_ms": v,
                       "first_call_s": 1.0} for m, v in ms.items()}}
    if floor_ms:  # stock's profiled step as long as its median: tfmx/floor = tfmx / floor
        r["floor"] = {"steps": 5, "ms": floor_ms, "wall_ms": ms["stock"], "kernels": 9}
    return r


def records(tmp_path, *results: dict) -> list[dict]:
    write_records(results, "tfmx bench --record", tmp_path)
    return load_records(tmp_path)


def composite(model: str, env: dict, state: str = "on", **shares: float) -> dict:
    patterns = {p.replace("_", " "): {"share": s} for p, s in shares.items()}
    return {"schema": 1, "model": model, "size": "bench", "steps": 10,
            "env": {**env, "onednn": state == "on"}, "patterns": list(patterns),
            "modes": {"stock": {"busy_ms": 9.0, "patterns": {p: {"share": 0.01}
                                                             for p in patterns}},
                      "tfmx": {"busy_ms": 8.0, "patterns": patterns}}}


def lines(text: str) -> list[str]:
    return text.splitlines()


def test_rows_meeting_and_missing_the_step_target(tmp_path):
    text = targets.format_targets(records(
        tmp_path, result("mlp", stock=10.0, xla=12.0, tfmx=8.0),
        result("gru", stock=4.0, tfmx=5.0)))
    assert ("**tfmx's step at most 0.85 x the best alternative (every workload)**: 1 of 2 meet "
            "it (mlp); 1 miss it:") in lines(text)
    assert ("- gru: 1.250 x best (stock on), 0.400 over 0.85; what holds the time: not "
            "profiled here: `tfmx bench --model gru --onednn both --record`") in lines(text)
    assert "- mlp" not in text
    assert lines(text)[0] == "## Targets"
    assert lines(text)[4] == ("### EPYC, 2 cores (flags: avx2 avx512_vnni); TensorFlow 2.21.0, "
                              "Keras 3.15.1, Python 3.11.7: oneDNN on by default")


def test_the_default_state_row_is_judged_against_the_best_of_either_state(tmp_path):
    on = result("mlp", "on", OLD, stock=10.0, tfmx=7.0)  # 0.70 x best: not the default state
    off = result("mlp", "off", OLD, stock=9.0, tfmx=8.1)  # 0.90 x the best: stock off
    text = targets.format_targets(records(tmp_path, on, off))
    assert "oneDNN off by default" in text
    assert "- mlp: 0.900 x best (stock off), 0.050 over 0.85;" in text
    assert "0 of 1 meet it" in text


def test_a_composite_record_of_the_same_processor_names_the_largest_patterns(tmp_path):
    llama = result("zoo_llama", floor_ms=30.0, stock=40.0, xla=38.0, tfmx=39.01)
    found = composite("zoo_llama", EPYC, RMSNorm=0.106, SwiGLU=0.112,
                      grouped_query_attention=0.206, rotary_embedding=0.056)
    text = targets.format_targets(records(tmp_path, llama), [found])
    assert ("- zoo_llama: 1.027 x best (XLA on), 0.177 over 0.85; what holds the time: "
            "composite grouped query attention 20.6%, SwiGLU 11.2%, RMSNorm 10.6% of tfmx's step "
            "(profiled 2026-01-02); meeting it needs tfmx within 1.077 x the contraction floor "
            "(30.00 ms)") in lines(text)
    assert "rotary" not in text  # the three largest only
    # the floor target's miss names the same patterns, not its own figure again
    assert ("- zoo_llama: 1.300 x the floor, under 0.001 over 1.3; what holds the time: "
            "composite grouped query attention") in text


@pytest.mark.parametrize("other", [{**EPYC, "cpu_model": "207"}, None])
def test_a_composite_record_of_another_processor_or_state_is_not_used(tmp_path, other):
    llama = result("zoo_llama", floor_ms=30.0, stock=40.0, xla=38.0, tfmx=39.01)
    elsewhere = (composite("zoo_llama", other, RMSNorm=0.2) if other
                 else composite("zoo_llama", EPYC, "off", RMSNorm=0.2))
    text = targets.format_targets(records(tmp_path, llama), [elsewhere])
    assert "RMSNorm" not in text
    assert ("- zoo_llama: 1.027 x best (XLA on), 0.177 over 0.85; what holds the time: "
            "contractions 75.0% of stock's profiled step, tfmx 1.300 x that floor; meeting it "
            "needs tfmx within 1.077 x the contraction floor (30.00 ms)") in lines(text)


def test_without_composite_or_floor_a_zoo_model_gets_the_composite_command(tmp_path):
    text = targets.format_targets(records(
        tmp_path, result("zoo_mobilenet_v3_small", stock=10.0, tfmx=9.0)),
        [composite("zoo_llama", EPYC, RMSNorm=0.2)])
    assert ("what holds the time: not profiled here: "
            "`python -m bench.composite --model zoo_mobilenet_v3_small --record`") in text


def test_the_floor_target_covers_the_transformers_only(tmp_path):
    text = targets.format_targets(records(
        tmp_path,
        result("transformer", floor_ms=30.0, stock=40.0, tfmx=33.0),  # 1.100: met
        result("vit", floor_ms=20.0, stock=40.0, tfmx=30.0),  # 1.500: missed
        result("decoder", stock=40.0, tfmx=30.0),  # no floor
        result("small_cnn", floor_ms=5.0, stock=40.0, tfmx=30.0)))  # not a transformer
    assert ("**tfmx's step at most 1.3 x the contraction floor (transformers)**: 1 of 2 meet it "
            "(transformer); 1 miss it:") in lines(text)
    assert ("- vit: 1.500 x the floor, 0.200 over 1.3; what holds the time: contractions "
            "50.0% of stock's profiled step") in lines(text)
    assert ("No floor recorded: decoder (`tfmx bench --model NAME --onednn both --record` "
            "records it).") in lines(text)
    assert "small_cnn: 6.000 x the floor" not in text
    assert floor.is_transformer("zoo_gemma") and not floor.is_transformer("zoo_densenet121")
    alone = targets.format_targets(records(tmp_path / "alone", result("decoder", stock=4.0,
                                                                      tfmx=3.0)))
    assert ("**tfmx's step at most 1.3 x the contraction floor (transformers)**: no floor "
            "recorded: decoder (`tfmx bench --model NAME --onednn both --record` records "
            "it).") in lines(alone)


def test_each_machine_keeps_its_own_rows_and_records(tmp_path):
    minute = {"workload": "transformer", "env": {**EPYC, "onednn": True},
              "verdict": {"tfmx/stock": 0.997, "tfmx/best": 0.997, "best_alternative": "stock",
                          "vs_stock_met": False, "vs_best_met": True},
              "fits": {"tfmx": [{"kept": "stock"}, {"kept": "fused"}]}}
    loops = [{"model": "mlp", "env": {**EPYC, "onednn": True}, "ratios": {"tfmx/keras2": 0.99}},
             {"model": "small_gru", "env": {**EPYC, "onednn": True}, "steps_per_call": 32,
              "ratios": {"tfmx/keras2": 1.05}}]
    text = targets.format_targets(
        records(tmp_path, result("transformer", floor_ms=30.0, stock=40.0, tfmx=33.0),
                result("gru", "off", OLD, stock=4.0, tfmx=3.0)), [], [minute], loops)
    machines = {part.split(",")[0]: part for part in text.split("\n### ")[1:]}
    epyc, old = machines["EPYC"], machines["Old"]
    assert old.startswith("Old") and "oneDNN off by default" in old
    assert ("- transformer: 0.997 x stock, 0.097 over 0.9; what holds the time: its step: "
            "contractions 75.0% of stock's profiled step, tfmx 1.100 x that floor; the last "
            "timed tfmx fit ran tfmx's fused step") in lines(epyc)
    assert ("**A small model's epoch: tfmx at most Keras 2's**: 1 of 2 meet it (mlp); 1 miss "
            "it:") in lines(epyc)
    assert ("- small_gru: 1.050 x Keras 2, 0.050 over 1; what holds the time: tfmx ran 32 steps "
            "a call; the epoch not profiled here") in lines(epyc)
    assert "1 of 1 meet it (transformer)" in epyc
    assert "1 of 1 meet it (gru)" in old  # 3.0 / 4.0: met on its own machine
    assert "no one-minute fit recorded on this machine" in old
    assert "no epoch against Keras 2 recorded on this machine" in old
    assert "transformer" not in old.split("Not measured on this machine")[0]


def test_benchmarks_md_opens_with_the_targets_from_the_folders(tmp_path):
    results = tmp_path / "results"
    write_records([result("zoo_bert", stock=10.0, tfmx=9.5)], "tfmx bench --record", results)
    (results / "composite").mkdir()
    (results / "composite" / "zoo_bert-onednn-on.json").write_text(
        json.dumps(composite("zoo_bert", EPYC, embeddings=0.035)))
    bench_md = tmp_path / "BENCHMARKS.md"
    assert publish.main(["--markdown", "--results", str(results), "--benchmarks", str(bench_md),
                         "--readme", str(tmp_path / "README.md")]) == 0
    text = bench_md.read_text()
    heads = [x for x in lines(text) if x.startswith("## ")]
    assert heads[:2] == ["## Targets", "## EPYC, 2 cores (flags: avx2 avx512_vnni); "
                         "TensorFlow 2.21.0, Keras 3.15.1, Python 3.11.7"]
    assert ("- zoo_bert: 0.950 x best (stock on), 0.100 over 0.85; what holds the time: "
            "composite embeddings 3.5% of tfmx's step (profiled 2026-01-02)") in lines(text)
