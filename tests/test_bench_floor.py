"""bench/floor.py: the contraction floor of stock's step, from TensorFlow's profiler.

The floor of a tiny transformer's stock step, profiled by ``tfmx bench``'s runner, counts its
MatMul/BatchMatMul/Einsum kernels, lies below the step's median time and below the time any op
ran; it reaches the records, ``tfmx bench``'s markdown and BENCHMARKS.md's tables. The event
arithmetic: nested kernels count their own time, kernels running at once count once.
"""

from __future__ import annotations

import json

import pytest

from bench import floor, publish, records, runner, tables
from bench.composite import OpEvent
from bench.onednn import onednn_state

PS = 10**9  # picoseconds per ms


def test_floor_counts_contraction_self_time_once_across_threads():
    events = [
        OpEvent("StatefulPartitionedCall", "StatefulPartitionedCall", 1, 0, 10 * PS),
        OpEvent("StatefulPartitionedCall/d/MatMul", "_MklMatMul", 1, 1 * PS, 4 * PS),
        OpEvent("StatefulPartitionedCall/a/BatchMatMulV2", "BatchMatMulV2", 2, 3 * PS, 6 * PS),
        OpEvent("StatefulPartitionedCall/g/Conv2DBackpropFilter", "Conv2DBackpropFilter", 1,
                7 * PS, 8 * PS),
        OpEvent("StatefulPartitionedCall/d/BiasAdd", "BiasAdd", 2, 7 * PS, 9 * PS),
    ]
    got = floor.contraction_floor(events, steps=1)
    assert got["ms"] == pytest.approx(6.0)  # [1, 6) and [7, 8)
    assert got["summed_ms"] == pytest.approx(7.0)  # 3 + 3 + 1
    assert got["busy_ms"] == pytest.approx(10.0)
    assert got["kernels"] == 3
    assert got["op_types"] == ["BatchMatMulV2", "Conv2DBackpropFilter", "_MklMatMul"]
    assert floor.contraction_floor(events, steps=2)["ms"] == pytest.approx(3.0)


def test_a_profiler_that_fails_leaves_the_benchmark_without_a_floor(monkeypatch):
    from bench import composite

    def broken(*args, **kwargs):
        raise RuntimeError("another profiler is running")

    monkeypatch.setattr(composite, "profile_step", broken)
    got = floor.measure_floor(lambda it: None, iter(()), steps=1)
    assert got == {"error": "RuntimeError: another profiler is running"}
    line = floor.format_floors([{"model": "vit", "env": {"onednn": True},
                                 "modes": {}, "floor": got}]).splitlines()[-1]
    assert "not measured: RuntimeError" in line


@pytest.fixture(scope="module")
def transformer():
    """A tiny run of ``tfmx bench``'s runner on the transformer workload: stock alone, its
    floor from 2 profiled steps."""
    return runner.run_benchmark("transformer", rounds=2, steps=2, modes=["stock"], batch_size=4,
                                warmup=1, floor_steps=2)


def test_the_floor_of_a_tiny_transformer_is_below_its_step(transformer):
    got = transformer["floor"]
    assert "error" not in got, got
    # below the profiled steps' own time (their wall time, and the time any op ran): the
    # medians of the unprofiled rounds ran at another moment of a shared machine
    assert 0 < got["ms"] < got["busy_ms"] <= got["wall_ms"] * 1.01, got
    assert got["ms"] <= got["summed_ms"] + 1e-9
    step = transformer["modes"]["stock"]["median_ms"]
    assert got["steps"] == 2 and got["kernels"] > 0
    # attention's and the Dense layers' products, forward and backward
    assert any("MatMul" in op or "Einsum" in op for op in got["op_types"]), got["op_types"]
    assert all(floor.is_contraction(op) for op in got["op_types"])
    # through stock's profiled step: above 1 whatever the load did between rounds and profile
    assert got["ratios"]["stock/floor"] == pytest.approx(got["wall_ms"] / got["ms"])
    assert got["ratios"]["stock/floor"] > 1
    assert step > 0


def test_the_floor_reaches_the_markdown_the_records_and_benchmarks_md(transformer, tmp_path):
    text = tables.format_markdown([transformer])
    assert floor.HEADER[0] in text
    lines = text.splitlines()
    row = lines[lines.index(floor.HEADER[0]) + 2]
    assert row.startswith(f"| transformer (adam, batch 4) | {onednn_state(transformer)} | "
                          f"{transformer['floor']['ms']:.2f} |"), row
    assert row.endswith("| - | - |")  # no tfmx, no XLA: no ratio, no verdict
    path, = records.write_records([transformer], "tfmx bench --model transformer", tmp_path)
    record = json.loads(path.read_text())
    assert record["floor"]["ms"] == transformer["floor"]["ms"]
    assert "tfmx/floor" not in record["ratios"]  # no tfmx mode measured
    section = publish.format_benchmarks(records.load_records(tmp_path))
    state = onednn_state(transformer)
    assert floor.HEADER[0] in section
    assert f"| transformer (adam, batch 4) | {state} | {transformer['floor']['ms']:.2f} |" \
        in section


def test_records_keep_tfmx_over_the_floor():
    result = {"model": "vit", "optimizer": "adam", "batch_size": 32,
              "env": {"onednn": True},
              "modes": {m: {"median_ms": v, "p25_ms": v, "p75_ms": v, "min_ms": v}
                        for m, v in (("stock", 10.0), ("tfmx", 6.0))},
              "floor": {"steps": 5, "ms": 5.0, "summed_ms": 6.0, "busy_ms": 9.0,
                        "kernels": 30, "ratios": {"stock/floor": 2.0, "tfmx/floor": 1.2}}}
    record = records.make_record(result, None, "tfmx bench --model vit")
    assert record["ratios"]["tfmx/floor"] == 1.2
    lines = floor.format_record_floors([record], publish._workload)
    assert lines[-1] == ("| vit (adam, batch 32) | on | 5.00 | 30 | 0.556 | 2.000 | - | "
                         "1.200 | <= 1.3: yes |")


def test_the_floor_option_reaches_the_runner():
    from bench.cli import _parser

    assert _parser().parse_args([]).floor_steps == floor.STEPS
    assert _parser().parse_args(["--floor-steps", "0"]).floor_steps == 0
