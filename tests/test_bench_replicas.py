"""tfmx bench --replicas N: parsing and validation, the 1-vs-N comparison, and one tiny real run.

Everything but the last test runs on hand-made results or before anything is measured; the last
runs one tiny real benchmark (mlp and gelu_mlp, 1 round of 1 step, stock and tfmx at 1 and 2
replicas, ~40 s on 2 cores) in a subprocess: the CPU must be split into logical devices before
TensorFlow initialises its devices (as tests/test_distribute.py's scripts do), which this pytest
process has long done. Two workloads, because two in one process once mixed their all-reduces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import onednn_state
from test_bench import result

from bench import runner
from bench.cli import _parser, main
from bench.compare import results_document
from bench.onednn import child_command
from bench.replicas import check_replicas, compare_replicas, replica_modes, split_cpu
from bench.runner import run_benchmarks
from bench.tables import format_markdown, format_replicas

ROOT = Path(__file__).resolve().parents[1]


def replica_result(replicas: int, state: str = "on", model: str = "mlp", **ms: float) -> dict:
    """test_bench.result measured with ``replicas`` replicas."""
    return {**result(state, model=model, **ms), "replicas": replicas}


# -- command line ----------------------------------------------------------------------------
def test_replicas_defaults_to_one_and_modes_to_none():
    args = _parser().parse_args(["--model", "mlp"])
    assert args.replicas == 1 and args.modes is None
    args = _parser().parse_args(["--model", "mlp", "--replicas", "2"])
    assert args.replicas == 2


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_replica_count_below_one_or_not_an_integer_is_an_argparse_error(capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args([f"--replicas={value}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --replicas: {value!r} is not a replica count: pass an integer >= 1" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--modes", "stock", "xla"], "the xla mode cannot run with replicas > 1"),
    (["--policy", "auto"], "--policy auto cannot run with replicas > 1"),
    (["--batch-size", "33"], "mlp's batch of 33 does not split over 2 replicas: pass "
                             "--batch-size a multiple of 2"),
])
def test_what_cannot_run_under_replicas_stops_the_command_before_it_measures(
        monkeypatch, argv, message):
    def must_not_run(*args, **kwargs):
        raise AssertionError("measured despite a bad option")

    monkeypatch.setattr(runner, "run_benchmarks", must_not_run)
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "mlp", "--replicas", "2", *argv])
    assert str(exit_info.value).startswith("tfmx bench: ")
    assert message in str(exit_info.value)


def test_without_modes_replicas_measure_stock_and_tfmx(monkeypatch, capsys):
    seen = {}

    def fake(models, **options):
        seen.update(options)
        return [replica_result(1, stock=2.0, tfmx=1.0), replica_result(2, stock=4.0, tfmx=3.0)]

    monkeypatch.setattr(runner, "run_benchmarks", fake)
    assert main(["--model", "mlp", "--replicas", "2"]) == 0
    assert seen["modes"] == ["stock", "tfmx"] and seen["replicas"] == 2
    assert "| mlp (adam, batch 32, 2 replicas) |" in capsys.readouterr().out
    assert main(["--model", "mlp"]) == 0
    assert seen["modes"] == ["stock", "tfmx", "xla"] and seen["replicas"] == 1


# -- validation ------------------------------------------------------------------------------
def test_check_replicas():
    assert replica_modes(1) == ("stock", "tfmx", "xla") and replica_modes(3) == ("stock", "tfmx")
    check_replicas(1, ["stock", "tfmx", "xla"], "auto", {"mlp": 33})  # one replica: all runs
    check_replicas(2, ["stock", "tfmx"], "mixed_bfloat16", {"mlp": 32, "bn_resnet": 128})
    for bad in (0, -2, 1.0, "2", True, None):
        with pytest.raises(ValueError, match="replicas must be an integer >= 1"):
            check_replicas(bad)
    with pytest.raises(ValueError, match="pass --modes stock tfmx"):
        check_replicas(2, ["tfmx", "xla"])
    with pytest.raises(ValueError, match=r"pass a fixed policy \(float32, mixed_float16"):
        check_replicas(2, ["stock", "tfmx"], "auto")
    with pytest.raises(ValueError, match="resnet50's batch of 8 does not split over 3"):
        check_replicas(3, ["stock"], None, {"mlp": 48, "resnet50": 8})


def test_run_benchmarks_checks_replicas_before_starting_any_process(monkeypatch):
    monkeypatch.setattr(runner, "run_child", lambda *a: pytest.fail("a process was started"))
    with pytest.raises(ValueError, match="the xla mode cannot run"):
        run_benchmarks(["mlp"], onednn="both", replicas=2, modes=["stock", "xla"])
    with pytest.raises(ValueError, match="replicas must be an integer >= 1"):
        run_benchmarks(["mlp"], onednn="on", replicas=0, modes=["stock"])
    with pytest.raises(ValueError, match="gelu_mlp's batch of 256 does not split over 3"):
        run_benchmarks(["gelu_mlp"], onednn="on", replicas=3, modes=["stock", "tfmx"])


def test_the_replica_count_goes_to_each_onednn_process(monkeypatch):
    seen = []
    monkeypatch.setattr(runner, "run_child",
                        lambda state, models, options, environ=None:
                        seen.append((state, options)) or [])
    run_benchmarks(["mlp"], onednn="both", replicas=2, rounds=1)
    assert seen == [("on", {"rounds": 1, "replicas": 2}), ("off", {"rounds": 1, "replicas": 2})]
    seen.clear()
    run_benchmarks(["mlp"], onednn="off", rounds=1)  # one replica: the options as before
    assert seen == [("off", {"rounds": 1})]
    argv, _ = child_command("on", ["mlp"], {"replicas": 2}, "/tmp/r.json")
    assert json.loads(argv[3])["options"] == {"replicas": 2}


def test_an_initialised_tensorflow_cannot_be_split_and_says_what_to_do():
    import tensorflow as tf

    _ = tf.constant(1.0) + 1.0  # this process's devices are initialised now
    if len(tf.config.list_logical_devices("CPU")) == 2:
        pytest.skip("this process already has two logical CPUs")
    with pytest.raises(RuntimeError, match="run the benchmark in a new process"):
        split_cpu(2)


# -- comparison and output -------------------------------------------------------------------
def test_compare_replicas_pairs_each_workload_and_state_with_its_one_replica_run():
    rows = compare_replicas([
        replica_result(1, "on", stock=10.0, tfmx=8.0),
        replica_result(2, "on", stock=20.0, tfmx=17.0),
        replica_result(1, "on", model="gru", stock=10.0, tfmx=9.0),
        replica_result(2, "on", model="gru", stock=10.0, tfmx=8.0),
        replica_result(1, "off", stock=10.0, tfmx=9.0), replica_result(2, "off", stock=10.0),
        replica_result(2, "on", model="gelu_mlp", stock=1.0, tfmx=1.0),  # no 1-replica run
    ])
    got = [(r["model"], r["onednn"], r["replicas"], r["tfmx_vs_stock_1"], r["tfmx_vs_stock_n"],
            r["within"]) for r in rows]
    assert got == [("mlp", "on", 2, 0.8, 0.85, True), ("gru", "on", 2, 0.9, 0.8, False),
                   ("mlp", "off", 2, 0.9, None, None)]
    assert rows[0]["difference"] == pytest.approx(0.05)
    assert rows[1]["difference"] == pytest.approx(-0.1)


def test_markdown_names_the_replicas_in_the_setup_the_rows_the_comparison_and_sections():
    text = format_markdown([replica_result(1, stock=10.0, tfmx=8.0),
                            replica_result(2, stock=20.0, tfmx=19.0)])
    lines = text.splitlines()
    setup = next(line for line in lines if line.startswith("_2 replicas: "))
    assert "MirroredStrategy over 2 logical CPU devices" in setup
    assert "each replica gets batch / 2" in setup and "XLA not measured" in setup
    assert "| mlp (adam, batch 32, 1 replica) | 10.00 | 8.00 | 10.00 stock (on) | 0.800 |" in lines
    assert "| mlp (adam, batch 32, 2 replicas) | 20.00 | 19.00 | 20.00 stock (on) | 0.950 |" in (
        lines)
    assert ("| workload | oneDNN | tfmx / stock, 1 replica | tfmx / stock, 2 replicas | "
            "difference | within 0.05 |") in lines
    assert "| mlp (adam, batch 32) | on | 0.800 | 0.950 | +0.150 | no: smaller speed-up |" in lines
    assert any(line.startswith("### mlp (adam): batch 32, 1 replica, 2 interleaved rounds")
               for line in lines)
    assert any(line.startswith("### mlp (adam): batch 32, 2 replicas (16 each), 2 interleaved")
               for line in lines)
    assert format_replicas([replica_result(1, stock=1.0)]) == ""


def test_one_replica_output_is_unchanged():
    plain = [result("on", stock=10.0, tfmx=8.0)]
    assert format_markdown([replica_result(1, stock=10.0, tfmx=8.0)]) == format_markdown(plain)
    assert "replicas" not in results_document([replica_result(1, stock=1.0, tfmx=1.0)])
    doc = json.loads(json.dumps(results_document(
        [replica_result(1, stock=2.0, tfmx=1.0), replica_result(2, stock=4.0, tfmx=3.0)])))
    assert [(r["replicas"], r["tfmx_vs_stock_n"], r["within"]) for r in doc["replicas"]] == [
        (2, 0.75, False)]


# -- one tiny real run -----------------------------------------------------------------------
def test_tiny_real_run_with_two_replicas(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tfmx", "bench", "--model", "mlp", "gelu_mlp", "--replicas", "2",
         "--rounds", "1", "--steps", "1", "--warmup", "1", "--json", str(out)],
        cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("_2 replicas: a tf.distribute.MirroredStrategy") for line in lines)
    for workload in ("mlp (adam, batch 32", "gelu_mlp (adam, batch 256"):
        assert any(line.startswith(f"| {workload}, 1 replica) |") for line in lines)
        assert any(line.startswith(f"| {workload}, 2 replicas) |") for line in lines)
        # the oneDNN state column: this process's, which the child inherits (on or off by
        # processor: TensorFlow's default differs between machines)
        state = onednn_state()
        row = next(line for line in lines if line.startswith(f"| {workload}) | {state}"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        one, two, difference = (float(c) for c in cells[2:5])
        assert one > 0 and two > 0 and difference == pytest.approx(two - one, abs=2e-3)
        assert cells[5] == "yes" or cells[5].startswith("no: ")
    doc = json.loads(out.read_text())
    two_cpus = ["/job:localhost/replica:0/task:0/device:CPU:0",
                "/job:localhost/replica:0/task:0/device:CPU:1"]
    assert [(r["model"], r["replicas"], r["devices"]) for r in doc["results"]] == [
        ("mlp", 1, None), ("mlp", 2, two_cpus), ("gelu_mlp", 1, None), ("gelu_mlp", 2, two_cpus)]
    assert all(set(r["modes"]) == {"stock", "tfmx"} for r in doc["results"])
    assert [r["replicas"] for r in doc["replicas"]] == [2, 2]
