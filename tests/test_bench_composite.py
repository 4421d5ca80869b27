"""bench/composite.py: the share of the patterns tfmx leaves composite in the zoo's steps.

On the zoo's tiny models (one profiled step each): every composite pattern a model names
matches forward and gradient ops of its training step, stock and with tfmx; a custom
gradient's ops (SiLU's, at the step's root scope) join their pattern; a record round-trips
through write/load and stays out of bench/results/*.json's reader; the section renders.
"""

from __future__ import annotations

import json
import sys

import pytest

from bench import composite, zoo
from bench.composite import OpEvent
from bench.records import load_records

HUB = pytest.mark.skipif(
    sys.version_info < (3, 11) or not zoo.keras_hub_available(),
    reason="keras-hub (the zoo's transformer backbones) needs Python 3.11 or newer")


@pytest.fixture(scope="module")
def mobilenet() -> dict:
    """zoo_mobilenet_v3_small at tiny size, one profiled step, stock and with tfmx."""
    return composite.measure("zoo_mobilenet_v3_small", steps=1, size="tiny", warmup=0,
                             batch_size=4, tfmx_options={"tune": "off", "xla": False})


def _check_patterns(record: dict, modes: tuple[str, ...]) -> None:
    for mode in modes:
        summary = record["modes"][mode]
        assert summary["busy_ms"] > 0 and summary["ops"] > 0, mode
        shares = []
        for pattern in zoo.MODELS[record["zoo"]].composite:
            found = summary["patterns"][pattern]
            assert found["ops"] > 0 and found["share"] > 0, (mode, pattern, found)
            assert found["gradient_ops"] > 0, (mode, pattern, found["top"])
            assert found["gradient_ops"] < found["ops"], (mode, pattern, "no forward op")
            shares.append(found["share"])
        assert sum(shares) < 1.0, (mode, shares)


def test_every_composite_pattern_has_a_matcher_and_every_model_a_test():
    assert {n for n, _ in OTHERS} | {"mobilenet_v3_small", "llama"} == set(zoo.MODELS)
    for spec in zoo.MODELS.values():
        assert spec.composite, spec.name
        assert set(spec.composite) <= set(composite.MATCHERS), spec.name


def test_mobilenet_patterns_match_forward_and_gradient_ops(mobilenet):
    _check_patterns(mobilenet, ("stock", "tfmx"))
    assert mobilenet["patterns"] == ["hard-swish", "squeeze-excite", "depthwise convolution"]
    depthwise = mobilenet["modes"]["stock"]["patterns"]["depthwise convolution"]["top"]
    assert any("DepthwiseConv2dNative" in t["op"] for t in depthwise)


@HUB
def test_llama_patterns_match_and_silu_gradient_joins_swiglu():
    record = composite.measure("zoo_llama", steps=1, size="tiny", warmup=0, batch_size=4,
                               modes=("stock",))
    _check_patterns(record, ("stock",))
    # tf.nn.silu's custom gradient puts its ops at the step's root scope
    assert record["modes"]["stock"]["patterns"]["SwiGLU"]["root_ops"] > 0


# the other zoo models, stock: (model, a pattern whose gradient has ops at the root scope)
OTHERS = [("efficientnet_b0", "swish"),  # tf.nn.silu's custom gradient
          ("convnext_tiny", "depthwise convolution"),  # Keras's XLA-compiled grouped conv
          ("densenet121", None), ("bert", None), ("gpt2", None),
          ("mixtral", "MoE experts"), ("qwen_moe", "MoE experts"),  # the experts' SiLU
          ("efficientnet_v2_b0", None), ("resnet50_v2", None), ("xception", None),
          ("gemma", None),
          ("qwen3", None)]


@pytest.mark.parametrize("name, rooted", [
    pytest.param(n, r, marks=[HUB] if zoo.MODELS[n].needs_keras_hub else [])
    for n, r in OTHERS])
def test_other_zoo_patterns_match_forward_and_gradient_ops(name, rooted):
    record = composite.measure(f"zoo_{name}", steps=1, size="tiny", warmup=0, batch_size=4,
                               modes=("stock",))
    _check_patterns(record, ("stock",))
    if rooted:
        assert record["modes"]["stock"]["patterns"][rooted]["root_ops"] > 0


def test_record_round_trips_and_stays_out_of_the_results_reader(mobilenet, tmp_path):
    folder = tmp_path / "composite"
    path, = composite.write_composite([mobilenet], "python -m bench.composite --size tiny",
                                      folder)
    assert path.name == composite.record_name(mobilenet)
    loaded, = composite.load_composite(folder)
    assert loaded["command"] == "python -m bench.composite --size tiny"
    assert loaded["reproduce"].startswith(
        "python -m bench.composite --model zoo_mobilenet_v3_small --steps 1 --size tiny")
    assert loaded["modes"] == json.loads(json.dumps(mobilenet["modes"]))
    assert loaded["env"]["tensorflow"] and "onednn" in loaded["env"]
    assert load_records(tmp_path) == []  # bench/results/*.json's reader: not a subfolder
    section = composite.format_composite([loaded])
    share = loaded["modes"]["stock"]["patterns"]["hard-swish"]["share"]
    assert f"| zoo_mobilenet_v3_small (tiny) | hard-swish | {100 * share:.1f}% |" in section


def test_format_composite_renders_a_table():
    env = {"date": "2026-01-02 10:00", "tensorflow": "2.21.0", "keras": "3.15.1",
           "python": "3.12.1", "platform": "Linux", "cpu": "Some CPU", "cpu_count": 2,
           "gpus": 0, "onednn": True}
    record = {"model": "zoo_mobilenet_v3_small", "size": "bench", "steps": 10, "env": env,
              "command": "python -m bench.composite --model zoo --record",
              "patterns": ["hard-swish", "depthwise convolution"],
              "matchers": {"hard-swish": "the activations"},
              "modes": {"stock": {"busy_ms": 10.0, "patterns": {
                  "hard-swish": {"share": 0.1234}, "depthwise convolution": {"share": 0.3}}}}}
    text = composite.format_composite([record])
    assert text.startswith("## What tfmx leaves composite in the zoo models\n")
    assert "`python -m bench.composite --model zoo --record`" in text
    assert "Some CPU" in text
    assert "| model | composite pattern | share of the step (stock) | (tfmx) |" in text
    assert "| zoo_mobilenet_v3_small | hard-swish | 12.3% |  |" in text
    assert "| zoo_mobilenet_v3_small | depthwise convolution | 30.0% |  |" in text
    assert "- hard-swish: the activations" in text
    assert composite.format_composite([]) == ""


def test_concurrent_ops_share_the_moment_and_nested_ops_are_not_counted_twice():
    events = [OpEvent("StatefulPartitionedCall/a", "Mul", 1, 0, 100),
              OpEvent("StatefulPartitionedCall/b", "Mul", 2, 50, 150),
              OpEvent("c", "PartitionedCall", 1, 200, 400),
              OpEvent("c_inner", "Add", 1, 250, 300)]
    own, shared, busy = composite.attributed_times(events)
    assert own == pytest.approx({"a": 100, "b": 100, "c": 150, "c_inner": 50})
    assert shared == pytest.approx({"a": 75, "b": 75, "c": 150, "c_inner": 50})
    assert busy == pytest.approx(350)
    assert sum(shared.values()) == pytest.approx(busy)


def test_an_op_counts_in_one_pattern_only():
    name = "zoo_m_tiny_1/expanded_conv_squeeze_excite_conv_1/depthwise"
    op = "_MklNativeDepthwiseConv2dNative"
    both = [p for p, m in composite.MATCHERS.items() if m.matches(name, op)]
    assert both == ["squeeze-excite", "depthwise convolution"]
    # MATCHERS's order decides, whatever the order the model names its patterns in
    assert composite.pattern_of(name, op, ["depthwise convolution", "squeeze-excite"]) == (
        "squeeze-excite")
    assert composite.pattern_of(name, op, ["depthwise convolution"]) == "depthwise convolution"
    with pytest.raises(ValueError, match="no matcher"):
        composite.pattern_of(name, op, ["flash attention"])
