"""tfmx bench: oneDNN states in processes of their own, the best-alternative comparison, output.

Everything but the last test runs on hand-made results; the last runs one tiny real benchmark
(mlp, 1 round of 1 step, stock and tfmx, oneDNN on and off: two processes, ~35 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import onednn, runner
from bench.cli import _parser
from bench.compare import compare, results_document
from bench.onednn import child_command, onednn_states
from bench.publish import END, START, format_benchmarks, format_readme_table
from bench.publish import main as publish_main
from bench.records import load_records, record_name, write_records
from bench.runner import run_benchmarks
from bench.tables import format_comparison, format_markdown, format_onednn
from tfmx import machine

ROOT = Path(__file__).resolve().parents[1]


def timing(ms: float) -> dict[str, float]:
    return {"median_ms": ms, "p25_ms": ms, "p75_ms": ms, "min_ms": ms, "first_call_s": 1.0}


def result(state: str | None, model: str = "mlp", isolated: bool = True, fused: int = 3,
           **ms: float) -> dict:
    """A run_benchmark-shaped result measured with oneDNN ``state`` (None: not recorded)."""
    r = {"model": model, "description": f"{model} workload", "optimizer": "adam",
         "batch_size": 32, "rounds": 2, "steps": 3, "warmup": 1, "policy": None,
         "modes": {mode: timing(v) for mode, v in ms.items()}, "fused": fused,
         "rewrite": [{"function": "Functional.train_step", "status": "rewritten",
                      "nodes_before": 100, "nodes_after": 60, "rewrite_seconds": 0.1}]}
    if state is not None:
        r["env"] = {"date": "2026-01-02 10:00", "tensorflow": "2.21.0", "keras": "3.15.1",
                    "python": "3.11.7", "platform": "Linux", "cpu": "Xeon",
                    "cpu_vendor": "GenuineIntel", "cpu_family": "6", "cpu_model": "143",
                    "cpu_flags": ["amx_bf16", "avx512f"], "cpu_count": 2, "gpus": 0,
                    "onednn": state == "on", "onednn_env": "1" if state == "on" else "0"}
        r["isolated"] = isolated
    return r


# -- command line ----------------------------------------------------------------------------
def test_bad_onednn_value_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["--onednn", "maybe"])
    assert exit_info.value.code == 2
    assert "argument --onednn: invalid choice: 'maybe' (choose from 'on', 'off', 'both')" in (
        capsys.readouterr().err)


def test_onednn_defaults_to_this_process_and_json_takes_an_optional_file():
    args = _parser().parse_args(["--model", "mlp"])
    assert args.onednn is None and args.json is None
    args = _parser().parse_args(["--onednn", "both", "--json"])
    assert args.onednn == "both" and args.json == "-"
    args = _parser().parse_args(["--json", "out.json", "--model", "mlp"])
    assert args.json == "out.json" and args.model == ["mlp"]


def test_onednn_states():
    assert onednn_states("both") == ("on", "off")
    assert onednn_states("on") == ("on",)
    with pytest.raises(ValueError, match="unknown oneDNN choice"):
        onednn_states("maybe")


# -- child processes -------------------------------------------------------------------------
@pytest.mark.parametrize(("state", "value"), [("on", "1"), ("off", "0")])
def test_child_command_sets_the_onednn_variable_for_the_child_only(monkeypatch, state, value):
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "something else")
    monkeypatch.setenv("TFMX_TEST_MARKER", "kept")
    options = {"rounds": 2, "steps": 3, "modes": ["stock", "tfmx"], "policy": None}
    argv, env = child_command(state, ["mlp", "small_cnn"], options, "/tmp/out.json")
    assert argv[:3] == [sys.executable, "-m", "bench.runner"] and argv[4] == "/tmp/out.json"
    assert json.loads(argv[3]) == {"onednn": state, "models": ["mlp", "small_cnn"],
                                   "options": options}
    assert env["TF_ENABLE_ONEDNN_OPTS"] == value
    assert env["TFMX_TEST_MARKER"] == "kept"  # the rest of the environment is inherited
    assert os.environ["TF_ENABLE_ONEDNN_OPTS"] == "something else"  # this process untouched
    with pytest.raises(ValueError, match="unknown oneDNN state"):
        child_command("both", ["mlp"], {}, "/tmp/out.json")


def test_child_refuses_to_measure_a_state_tensorflow_did_not_take(tmp_path, capsys):
    from tfmx.backends import onednn_enabled

    other = "off" if onednn_enabled() else "on"
    out = tmp_path / "r.json"
    spec = json.dumps({"onednn": other, "models": ["mlp"], "options": {}})
    assert runner.child_main([spec, str(out)]) == 3
    assert f"cannot run with oneDNN {other}" in capsys.readouterr().err
    assert not out.exists()


def test_run_benchmarks_merges_the_children_results_and_reports_failures(monkeypatch):
    def fake_child(state, models, options, path, environ=None):
        results = [result(state, model=m, stock=1.0) for m in models]
        code = f"import sys; open(sys.argv[1], 'w').write({json.dumps(results)!r})"
        return [sys.executable, "-c", code, path], {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1"}

    monkeypatch.setattr(onednn, "child_command", fake_child)
    merged = run_benchmarks(["mlp", "gru"], onednn="both", rounds=1)
    assert [(r["model"], onednn.onednn_state(r), r["isolated"]) for r in merged] == [
        ("mlp", "on", True), ("gru", "on", True), ("mlp", "off", True), ("gru", "off", True)]

    monkeypatch.setattr(onednn, "child_command", lambda *args, **kwargs: (
        [sys.executable, "-c", "raise SystemExit(5)"],
        {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "0"}))
    with pytest.raises(RuntimeError, match="oneDNN off process exited with status 5"):
        run_benchmarks(["mlp"], onednn="off")
    with pytest.raises(ValueError, match="unknown model"):
        run_benchmarks(["no_such_model"], onednn="both")


# -- comparison ------------------------------------------------------------------------------
def test_best_alternative_is_the_fastest_stock_or_xla_in_any_state():
    rows = compare([result("on", stock=10.0, xla=7.0, tfmx=8.0),
                    result("off", stock=9.0, xla=7.5, tfmx=6.3)])
    row, = rows
    assert row["best_alternative"] == {"ms": 7.0, "mode": "xla", "onednn": "on"}
    assert row["tfmx_vs_best_alternative"] == pytest.approx({"on": 8.0 / 7.0, "off": 0.9})
    assert row["tfmx_best"] == pytest.approx({"onednn": "off", "ms": 6.3,
                                              "vs_best_alternative": 0.9})


def test_comparison_without_alternatives_or_tfmx():
    row, = compare([result("on", tfmx=5.0)])
    assert row["best_alternative"] is None and row["tfmx_vs_best_alternative"] == {}
    assert row["tfmx_best"]["onednn"] == "on"
    row, = compare([result("off", stock=5.0)])
    assert row["best_alternative"]["mode"] == "stock" and row["tfmx_best"] is None


def test_results_are_grouped_per_workload_whatever_their_order():
    rows = compare([result("on", model="mlp", stock=2.0), result("on", model="gru", stock=4.0),
                    result("off", model="mlp", stock=3.0), result("off", model="gru", stock=1.0)])
    assert [(r["model"], r["ms"]["stock"]) for r in rows] == [
        ("mlp", {"on": 2.0, "off": 3.0}), ("gru", {"on": 4.0, "off": 1.0})]
    # The same workload and state twice: two rows, nothing dropped.
    assert len(compare([result("on", stock=1.0), result("on", stock=2.0)])) == 2


def test_summary_table_has_a_column_per_mode_and_state_measured():
    text = format_comparison([result("on", stock=10.0, xla=12.0, tfmx=8.0),
                              result("off", stock=9.0, xla=11.0, tfmx=8.5)])
    header, align, row = text.splitlines()
    assert header == ("| workload | stock (on) | stock (off) | XLA (on) | XLA (off) | tfmx (on) | "
                      "tfmx (off) | best alternative | tfmx (on) / best | tfmx (off) / best | "
                      "best tfmx / best |")
    assert align.count("|") == header.count("|")
    assert row == ("| mlp (adam, batch 32) | 10.00 | 9.00 | 12.00 | 11.00 | 8.00 | 8.50 | "
                   "9.00 stock (off) | 0.889 | 0.944 | 0.889 (on) |")


def test_summary_table_for_one_state_has_no_best_state_column():
    header, _, row = format_comparison([result("on", stock=4.0, tfmx=3.0)]).splitlines()
    assert header == ("| workload | stock (on) | tfmx (on) | best alternative | "
                      "tfmx (on) / best |")
    assert row == "| mlp (adam, batch 32) | 4.00 | 3.00 | 4.00 stock (on) | 0.750 |"


def test_markdown_names_the_machine_the_states_and_keeps_per_process_ratios():
    text = format_markdown([result("on", stock=10.0, xla=12.0, tfmx=8.0, fused=5),
                            result("off", stock=9.0, xla=11.0, tfmx=8.5, fused=4)])
    lines = text.splitlines()
    assert lines[0].startswith("_2026-01-02 10:00; Xeon (GenuineIntel, family 6, model 143), "
                               "2 cores, flags: amx_bf16 avx512f; TensorFlow 2.21.0, Keras 3.15.1")
    assert ("_oneDNN on: TF_ENABLE_ONEDNN_OPTS=1, a process of its own; oneDNN off: "
            "TF_ENABLE_ONEDNN_OPTS=0, a process of its own_") in lines
    # Per state and mode: vs stock and vs XLA within the same process.
    assert "| on | tfmx | 8.00 | 8.00-8.00 | 8.00 | 0.800 | 0.667 | 1.0 |" in lines
    assert "| off | tfmx | 8.50 | 8.50-8.50 | 8.50 | 0.944 | 0.773 | 1.0 |" in lines
    assert "| off | stock | 9.00 | 9.00-9.00 | 9.00 | 1.000 | 0.818 | 1.0 |" in lines
    assert "| on | Functional.train_step | rewritten | 100->60 | 0.100 |" in lines
    assert "tfmx fused chain(s)/update(s): 5 with oneDNN on, 4 with oneDNN off." in lines


def test_markdown_gives_the_per_round_ratios():
    r = result("on", stock=10.0, tfmx=8.0, xla=9.0)
    r["modes"]["stock"]["rounds_ms"] = [10.0, 20.0, 10.0, 30.0]  # the load drifts
    r["modes"]["tfmx"]["rounds_ms"] = [8.0, 16.0, 9.0, 24.0]
    r["modes"]["xla"]["rounds_ms"] = [9.0, 18.0, 9.0, 27.0]
    line = next(x for x in format_markdown([r]).splitlines() if x.startswith("Per-round"))
    assert line == ("Per-round ratios (oneDNN on), median (p25-p75): tfmx/stock 0.800 "
                    "(0.800-0.825); tfmx/xla 0.889 (0.889-0.917); xla/stock 0.900 (0.900-0.900)")


def test_markdown_says_when_a_run_was_noisy():
    quiet = result("on", stock=10.0, tfmx=8.0)
    assert "noisy" not in format_markdown([quiet])
    r = result("on", stock=10.0, tfmx=8.0)
    r["modes"]["stock"].update(p25_ms=9.0, p75_ms=12.5)  # a busy neighbour: 35 % of 10 ms
    r["modes"]["tfmx"].update(p25_ms=7.9, p75_ms=8.6)  # 9 %: within NOISY_SPREAD
    line = next(x for x in format_markdown([r]).splitlines() if x.startswith("A noisy run"))
    assert line.startswith("A noisy run (oneDNN on): stock's p25-p75 spread is 35% of its "
                           "median (over 10%).")
    assert "tfmx's" not in line


def test_onednn_line_says_when_the_state_came_from_the_calling_process():
    r = result("on", stock=1.0, isolated=False)
    r["env"]["onednn_env"] = None
    assert format_onednn([r]) == ("_oneDNN on: TF_ENABLE_ONEDNN_OPTS unset (TensorFlow's "
                                  "default), the calling process_")
    assert format_onednn([result(None, stock=1.0)]) == ""


def test_json_document_is_serialisable_and_holds_the_comparison():
    results = [result("on", stock=2.0, tfmx=1.0), result("off", stock=3.0, tfmx=1.5)]
    doc = json.loads(json.dumps(results_document(results, "both")))
    assert doc["onednn"] == "both" and len(doc["results"]) == 2
    assert doc["comparison"][0]["tfmx_vs_best_alternative"] == {"on": 0.5, "off": 0.75}


# -- machine ---------------------------------------------------------------------------------
def test_cpu_info_keeps_the_relevant_flags_sorted():
    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
            "model name\t: AMD EPYC\nflags\t\t: fpu avx512f avx2 avx512_vnni sse avx_vnni\n"
            "processor\t: 1\nvendor_id\t: Other\nmodel\t\t: 99\n")
    assert machine.parse_cpu_info(text) == {
        "model": "AMD EPYC", "vendor": "AuthenticAMD", "family": "25", "model_number": "17",
        "flags": ["avx2", "avx512_vnni", "avx512f", "avx_vnni"]}
    assert machine.cpu_info("/no/such/cpuinfo")["flags"] == []


# -- one tiny real run -----------------------------------------------------------------------
def test_tiny_real_run_measures_both_states_in_their_own_processes(tmp_path):
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "TF_ENABLE_ONEDNN_OPTS"}
    proc = subprocess.run(
        [sys.executable, "-m", "tfmx", "bench", "--model", "mlp", "--rounds", "1", "--steps",
         "1", "--warmup", "1", "--modes", "stock", "tfmx", "--onednn", "both", "--json",
         str(out), "--record", str(tmp_path / "results")], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| workload | stock (on) | stock (off) | tfmx (on) | tfmx (off) |" in proc.stdout
    assert "TF_ENABLE_ONEDNN_OPTS=1, a process of its own" in proc.stdout
    doc = json.loads(out.read_text())
    assert [(r["env"]["onednn"], r["env"]["onednn_env"]) for r in doc["results"]] == [
        (True, "1"), (False, "0")]
    row, = doc["comparison"]
    assert set(row["tfmx_vs_best_alternative"]) == {"on", "off"}
    assert row["best_alternative"]["mode"] == "stock"
    # the records, one per oneDNN state, and BENCHMARKS.md and the README's table from them
    records = load_records(tmp_path / "results")
    assert [r["onednn"] for r in records] == ["off", "on"]
    assert records[0]["command"].startswith("tfmx bench --model mlp --rounds 1")
    assert records[0]["command"].endswith("--record")  # its folder left out
    assert records[0]["env"]["tensorflow"] and records[0]["env"]["cpu_count"] >= 1
    assert set(records[0]["modes"]["tfmx"]) >= {"median_ms", "p25_ms", "p75_ms"}
    assert records[0]["ratios"]["tfmx/stock"] > 0
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{START}\nold\n{END}\nrest\n")
    bench_md = tmp_path / "BENCHMARKS.md"
    assert publish_main(["--markdown", "--results", str(tmp_path / "results"),
                         "--benchmarks", str(bench_md), "--readme", str(readme)]) == 0
    text = bench_md.read_text()
    assert text.startswith("# Benchmarks\n") and "| mlp (adam, batch " in text
    assert f"`{records[0]['reproduce']}`" in text and "--model mlp" in records[0]["reproduce"]
    assert readme.read_text().startswith(f"intro\n{START}\n| workload | processor |")
    assert readme.read_text().endswith(f"{END}\nrest\n") and "old" not in readme.read_text()


# -- records and the published tables -------------------------------------------------------
def test_records_one_file_per_workload_and_state_holding_the_ratios(tmp_path):
    results = [result("on", stock=10.0, xla=12.0, tfmx=8.0),
               result("off", stock=9.0, xla=11.0, tfmx=8.5)]
    paths = write_records(results, "tfmx bench --model mlp --onednn both --record", tmp_path)
    assert [p.name for p in paths] == ["mlp-adam-batch32-onednn-on-intel-f6-m143.json",
                                       "mlp-adam-batch32-onednn-off-intel-f6-m143.json"]
    off, on = load_records(tmp_path)
    assert on["ratios"]["tfmx/stock"] == pytest.approx(0.8)
    assert on["ratios"]["tfmx/best_alternative"] == pytest.approx(8.0 / 9.0)
    assert on["best_alternative"] == {"ms": 9.0, "mode": "stock", "onednn": "off"}
    assert on["env"]["cpu"] == "Xeon" and on["env"]["onednn_env"] == "1"
    assert on["modes"]["tfmx"] == timing(8.0)
    # a new measurement of one state replaces its file: the folder holds current figures
    write_records([result("on", stock=10.0, tfmx=7.0)], "again", tmp_path)
    off, on = load_records(tmp_path)
    assert (on["command"], on["modes"]["tfmx"]["median_ms"]) == ("again", 7.0)
    assert off["command"].startswith("tfmx bench")
    (tmp_path / "notes.json").write_text("[]")  # not a record: left out
    assert len(load_records(tmp_path)) == 2
    # another processor's measurement sits beside this one's
    other = result("on", stock=12.0, tfmx=9.0)
    other["env"].update(cpu="EPYC", cpu_vendor="AuthenticAMD", cpu_family="25", cpu_model="1")
    (path,) = write_records([other], "elsewhere", tmp_path)
    assert path.name == "mlp-adam-batch32-onednn-on-amd-f25-m1.json"
    assert sorted(r["command"] for r in load_records(tmp_path)) == ["again", "elsewhere",
                                                                    off["command"]]
    assert record_name({"model": "gru", "optimizer": "adam"}) == "gru-adam-onednn-unknown.json"


def test_benchmarks_md_is_the_records_only(tmp_path):
    write_records([result("on", stock=10.0, xla=12.0, tfmx=8.0),
                   result("off", stock=9.0, xla=11.0, tfmx=8.5)], "tfmx bench X", tmp_path)
    gru = result("on", model="gru", stock=4.0, tfmx=5.0)
    gru["env"]["cpu"] = "EPYC"
    write_records([gru], "tfmx bench Y", tmp_path)
    records = load_records(tmp_path)
    text = format_benchmarks(records)
    lines = text.splitlines()
    assert lines[0] == "# Benchmarks" and "python -m bench.tables --markdown" in text
    heads = [x for x in lines if x.startswith("## ")]
    assert heads == [
        "## EPYC, 2 cores (flags: amx_bf16 avx512f); TensorFlow 2.21.0, Keras 3.15.1, "
        "Python 3.11.7",
        "## Xeon, 2 cores (flags: amx_bf16 avx512f); TensorFlow 2.21.0, Keras 3.15.1, "
        "Python 3.11.7"]
    assert ("| mlp (adam, batch 32) | off | 9.00 (9.00-9.00) | 11.00 (11.00-11.00) | "
            "8.50 (8.50-8.50) | 0.944 | 9.00 stock (off) | 0.944 |") in lines
    assert ("| mlp (adam, batch 32) | on | 10.00 (10.00-10.00) | 12.00 (12.00-12.00) | "
            "8.00 (8.00-8.00) | 0.800 | 9.00 stock (off) | 0.889 |") in lines
    assert ("| gru (adam, batch 32) | on | 4.00 (4.00-4.00) | 5.00 (5.00-5.00) | 1.250 | "
            "4.00 stock (on) | 1.250 |") in lines
    assert "| mlp (adam, batch 32) | on | 2026-01-02 10:00 | `tfmx bench X --model mlp` |" in lines
    table = format_readme_table(records).splitlines()
    # TensorFlow's default state on these flags (AMX) is on: its figures first, off beside
    assert table[2:4] == [
        "| gru (adam, batch 32) | EPYC (family 6, model 143) | on | 1.250 | 1.250 (stock on) | - |",
        "| mlp (adam, batch 32) | Xeon (family 6, model 143) | on | 0.800 | 0.889 (stock off) | "
        "off: 0.944 (stock off) |"]
    assert "TF_ENABLE_ONEDNN_OPTS=0" in table[-1]
    assert "Measured on: EPYC, 2 cores (flags: amx_bf16 avx512f); TensorFlow 2.21.0" in table[-1]


def test_publishing_touches_the_readme_only_between_its_markers(tmp_path):
    write_records([result("on", stock=2.0, tfmx=1.0)], "tfmx bench Z", tmp_path / "r")
    bench_md, readme = tmp_path / "B.md", tmp_path / "README.md"
    readme.write_text("no markers here\n")
    args = ["--markdown", "--results", str(tmp_path / "r"), "--benchmarks", str(bench_md),
            "--readme", str(readme)]
    assert publish_main(args) == 0
    assert readme.read_text() == "no markers here\n" and bench_md.exists()
    bench_md.write_text("old figures\n")
    assert publish_main([*args[:2], str(tmp_path / "none"), *args[3:]]) == 1
    assert bench_md.read_text() == "old figures\n"  # no record: nothing written


def test_the_record_option_defaults_to_bench_results():
    assert _parser().parse_args(["--record"]).record == str(ROOT / "bench" / "results")
    assert _parser().parse_args([]).record is None
