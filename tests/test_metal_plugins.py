"""The Metal plugins' tables (tfmx.metal_plugins): the open plugin's JSON, read from its sdist
by tools/metal_plugin_table.py, and Apple's op list; the script reproduces the JSON."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from tfmx import metal_plugins
from tfmx.metal_plugins import (
    APPLE,
    OPEN,
    InstalledPlugin,
    installed_plugin,
    known_plugins,
    plugin_table,
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "metal_plugin_table.py"
SHIPPED = sorted(p.name for p in resources.files("tfmx").joinpath("data").iterdir()
                 if re.fullmatch(r"tensorflow-metal-plugin-[\d.]+\.json", p.name))
OPTIMIZERS = ("ResourceApplyAdam", "ResourceApplyGradientDescent", "ResourceApplyMomentum",
              "ResourceApplyKerasMomentum", "ResourceApplyRMSProp")


def _json(name: str) -> dict:
    return json.loads(resources.files("tfmx").joinpath(f"data/{name}").read_text())


def test_one_open_plugin_table_ships():
    assert SHIPPED == ["tensorflow-metal-plugin-0.4.1.json"]


def test_the_json_carries_version_digest_and_fused_lists():
    data = _json(SHIPPED[0])
    assert data["plugin"] == OPEN and data["version"] == "0.4.1"
    assert re.fullmatch(r"[0-9a-f]{64}", data["source_sha256"])
    assert data["tensorflow"] == "2.21.0"
    assert set(data["fused_ops"]) == {"_FusedConv2D", "_FusedMatMul"}
    assert ["BiasAdd", "Relu"] in data["fused_ops"]["_FusedMatMul"]
    assert not [n for n in data["notes"] if n.startswith("not read:")]
    # every op the table names has a kernel, and each constraint's dtypes are dtype names
    assert set(data["type_constraints"]) == set(data["ops"])
    assert all(d in {"float32", "float16", "bfloat16", "int8", "int16", "int32", "int64",
                     "uint8", "bool", "complex64"}
               for c in data["type_constraints"].values() for ds in c.values() for d in ds)


def test_fused_lists_are_the_bias_then_one_activation():
    table = plugin_table(OPEN)
    for op in ("_FusedConv2D", "_FusedMatMul"):
        lists = table.fused_ops[op]
        assert ("BiasAdd",) in lists and ("BiasAdd", "Relu") in lists
        assert ("BiasAdd", "GeluExact") in lists and ("BiasAdd", "Tanh") in lists
        assert ("BiasAdd", "Add") not in lists and ("BiasAdd", "Add", "Relu") not in lists
        assert ("FusedBatchNorm",) not in lists
        assert all(chain[0] == "BiasAdd" and len(chain) <= 2 for chain in lists)
        # what its own graph pass emits is a part of what the kernels take
        assert table.graph_pass_fused_ops[op] < lists
        assert ("BiasAdd", "GeluExact") not in table.graph_pass_fused_ops[op]
        assert table.ops[op] == {"float32", "float16"}


def test_value_dtypes_and_constraints():
    table = plugin_table(OPEN)
    assert table.ops["MatMul"] == table.ops["Conv2D"] == {"float32", "float16"}
    assert table.runs("MatMul", "float16") and not table.runs("MatMul", "bfloat16")
    assert "bfloat16" in table.ops["Cast"]
    assert table.type_constraints["GatherV2"]["Tindices"] == {"int32", "int64"}
    assert table.ops["GatherV2"] == {"float32", "float16"}
    assert table.ops["RandomUniform"] == {"float32", "float16"}  # dtype, not the shape's T
    assert table.ops["Any"] == frozenset()  # only its index type is constrained
    assert table.runs("Any", "bool")


def test_resource_ops_are_host_only_before_tensorflow_2_22():
    table = plugin_table(OPEN)
    for op in (*OPTIMIZERS, "ResourceGather", "ResourceGatherNd", "ResourceScatterUpdate"):
        assert op in table.ops, op
        assert op in table.host_only("2.21.0"), op
        assert op not in table.host_only("2.22"), op
        assert op not in table.host_only("2.22.0-dev20260914"), op
        assert not table.runs(op, "float32", tensorflow="2.21")
    # 0.4.1 registers GatherNd outside the gate (its README's table still lists it)
    assert "GatherNd" not in table.host_only("2.21")
    assert table.runs("GatherNd", "float32", tensorflow="2.21")
    assert len(table.ops) - len(table.host_only("2.21")) == 268


def test_tensorflow_range():
    table = plugin_table(OPEN)
    assert table.tensorflow == ("2.21", "2.21")
    assert table.loads_into("2.21.3") and not table.loads_into("2.19.1")
    assert not table.runs("MatMul", tensorflow="2.20")


def test_apple_table_is_the_shipped_op_list():
    from tfmx.backends import metal_kernels

    apple = plugin_table(APPLE)
    assert apple.version == "1.2.0" and apple.tensorflow == ("2.18", "2.19")
    assert set(apple.ops) == metal_kernels()
    assert all(dtypes == frozenset() for dtypes in apple.ops.values())
    assert apple.host_only("2.19") == frozenset() and apple.source_sha256 is None
    assert ("BiasAdd", "LeakyRelu") in apple.fused_ops["_FusedConv2D"]


def test_apple_table_has_the_three_letter_ops():
    """The wheel's strings were read from three characters up: the elementwise ops with short
    names are in, and every name is an op TensorFlow registers."""
    from tensorflow.python.framework import op_def_registry

    apple = plugin_table(APPLE)
    assert {"Mul", "Sub", "Sum", "Neg", "Pow", "Add", "Exp", "Log", "Max", "Abs"} <= set(apple.ops)
    assert not any(len(op) < 3 for op in apple.ops)
    assert [op for op in apple.ops if op_def_registry.get(op) is None] == []


def test_lookups():
    assert [(t.name, t.version) for t in known_plugins()] == [(APPLE, "1.2.0"), (OPEN, "0.4.1")]
    assert plugin_table("tensorflow_metal_plugin", "0.4.1") is plugin_table(OPEN)
    with pytest.raises(ValueError, match="unknown Metal plugin"):
        plugin_table("metal")
    with pytest.raises(LookupError, match="0.9.9"):
        plugin_table(OPEN, "0.9.9")


def test_installed_plugin(monkeypatch):
    assert installed_plugin(system="Linux") is None
    installed = {}
    monkeypatch.setattr(metal_plugins, "_installed", installed.get)
    assert installed_plugin(system="Darwin") is None
    installed.update({"tensorflow": "2.19.1", APPLE: "1.2.0"})
    assert installed_plugin(system="Darwin") == InstalledPlugin(APPLE, "1.2.0", "2.19.1")
    installed[OPEN] = "0.4.1"  # both: the one that loads into this TensorFlow
    assert installed_plugin(system="Darwin").name == APPLE
    installed["tensorflow"] = "2.21.0"
    found = installed_plugin(system="Darwin")
    assert found == InstalledPlugin(OPEN, "0.4.1", "2.21.0")
    assert found.table() is plugin_table(OPEN)


def test_importing_it_loads_no_tensorflow():
    code = ("import sys, tfmx.metal_plugins as m; m.known_plugins(); "
            "print('tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def _sdist(tmp_path: Path, version: str) -> Path:
    """The plugin's sdist: $TFMX_METAL_PLUGIN_SDIST, else what pip downloads (its cache first);
    the test is skipped where neither works."""
    given = os.environ.get("TFMX_METAL_PLUGIN_SDIST")
    if given:
        return Path(given)
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import metal_plugin_table
    finally:
        sys.path.remove(str(SCRIPT.parent))
    try:
        subprocess.run(metal_plugin_table.download_command(version, tmp_path), check=True,
                       capture_output=True, timeout=300)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"the sdist is not in pip's cache and PyPI is not reachable: {e}")
    return next(tmp_path.glob("*.tar.gz"))


def test_the_script_reproduces_the_json(tmp_path):
    committed = resources.files("tfmx").joinpath(f"data/{SHIPPED[0]}").read_bytes()
    data = json.loads(committed)
    sdist = _sdist(tmp_path / "sdist", data["version"])
    assert hashlib.sha256(sdist.read_bytes()).hexdigest() == data["source_sha256"]
    out = tmp_path / "table.json"
    run = subprocess.run([sys.executable, str(SCRIPT), str(sdist), "--output", str(out)],
                         capture_output=True, text=True, check=True, timeout=300)
    assert "285 ops in 717 kernel registrations" in run.stdout
    assert out.read_bytes() == committed
