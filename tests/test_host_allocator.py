"""tfmx.host_allocator: TensorFlow's pool for CPU tensors where oneDNN is off, set before the
first op, never where the user or the process decided otherwise, and undone by disable()."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tfmx import host_allocator
from tfmx.host_allocator import TF_POOL, TF_POOL_LIMIT, decide

LINUX_OFF = {"backend": "cpu", "onednn": False, "system": "Linux", "devices_made": False}


@pytest.mark.parametrize("change, environ, pool, reason", [
    ({}, {}, True, "oneDNN is off, where TensorFlow would use malloc"),
    ({}, {"TFMX_HOST_ALLOCATOR": "keep"}, False, "TFMX_HOST_ALLOCATOR=keep"),
    ({}, {"TFMX_HOST_ALLOCATOR": "pool"}, False, "is not one of"),
    ({}, {TF_POOL: "0"}, False, "TF_CPU_ALLOCATOR_USE_BFC=0 set by the user"),
    ({}, {TF_POOL: "true"}, True, "set by the user"),
    ({"backend": "metal"}, {}, False, "the metal backend"),
    ({"backend": "cuda"}, {}, False, "the cuda backend"),
    ({"onednn": True}, {}, False, "oneDNN is on"),
    ({"system": "Darwin"}, {}, False, "measured on Linux only"),
    ({"devices_made": True}, {}, False, "had made its devices before tfmx was imported"),
])
def test_decide(change: dict, environ: dict, pool: bool, reason: str) -> None:
    choice = decide(**{**LINUX_OFF, **change}, environ=environ)
    assert choice.pool is pool
    assert reason in choice.reason
    assert choice.sets == ({TF_POOL: "1"} if pool and TF_POOL not in environ else {})


def test_the_cap_is_the_machines_memory_where_larger() -> None:
    assert decide(**LINUX_OFF, environ={}, machine_mb=32768).sets == {TF_POOL: "1"}
    big = decide(**LINUX_OFF, environ={}, machine_mb=262144)
    assert big.sets == {TF_POOL: "1", TF_POOL_LIMIT: "262144"}
    assert decide(**LINUX_OFF, environ={TF_POOL_LIMIT: "1000"}, machine_mb=262144).sets == {
        TF_POOL: "1"}


def test_apply_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("no sysconf")

    monkeypatch.setattr(host_allocator, "memory_mb", broken)
    monkeypatch.setattr(host_allocator, "_choice", None)
    choice = host_allocator.apply("cpu", onednn=False)
    assert not choice.pool and "not decided: OSError: no sysconf" in choice.reason


SCRIPT = textwrap.dedent("""
    import json, os, sys
    mode = sys.argv[1]
    if mode == "tfmx-first":  # tfmx imported before TensorFlow: decided once its import ends
        import tfmx
        at_import = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC")
        tf_imported = "tensorflow" in sys.modules
    import numpy as np
    import tensorflow as tf
    import keras
    if mode == "op-first":
        tf.ones([1])
    import tfmx
    from tfmx import host_allocator
    if mode != "tfmx-first":
        at_import, tf_imported = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC"), True
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])  # its variables: the first ops
    if mode != "stock":
        tfmx.enable(guard=False, tune="off")
    set_by_tfmx = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC")
    model.compile("adam", "mse")
    x = np.random.RandomState(0).rand(64, 8).astype("float32")
    model.fit(x, x[:, :1], batch_size=16, epochs=2, verbose=0)
    notes = [n for n in tfmx.report().notes if n.startswith("host allocator")]
    in_use = host_allocator.in_use()
    tfmx.disable()
    after = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC")
    print(json.dumps({"at_import": at_import, "tf_imported": tf_imported, "set": set_by_tfmx,
                      "after_disable": after, "in_use": in_use, "notes": notes,
                      "weights": [w.tolist() for w in model.get_weights()]}))
""")


def _run_script(script: str, *args: str, **extra: str) -> dict:
    """``script``'s last printed JSON line, run in a fresh process with oneDNN off and none of
    the allocator's variables set but ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in (TF_POOL, TF_POOL_LIMIT, "TFMX_HOST_ALLOCATOR")}
    env.update(TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="3", **extra)
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, check=True,
                         capture_output=True, text=True, timeout=300).stdout
    return json.loads(out.strip().splitlines()[-1])


def _run(mode: str, **extra: str) -> dict:
    return _run_script(SCRIPT, mode, **extra)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pool is set on Linux only")
def test_a_fit_runs_with_the_pool_and_the_same_weights() -> None:
    # tensorflow and keras imported above tfmx, the model built before enable(): the pool was
    # chosen at import, before the model's first op
    pooled = _run("tfmx")
    assert pooled["at_import"] == "1" and pooled["set"] == "1" and pooled["in_use"] == "pool"
    assert pooled["after_disable"] is None  # disable() put the environment back
    assert pooled["notes"] and "best-fit pool" in pooled["notes"][0]
    assert "set at import tfmx" in pooled["notes"][0]
    # tfmx imported first: its import leaves TensorFlow alone and decides once TensorFlow's
    # import ends, before the first op
    first = _run("tfmx-first")
    assert first["at_import"] is None and first["tf_imported"] is False
    assert first["set"] == "1" and first["in_use"] == "pool"
    assert "set at TensorFlow's import (tfmx imported before it)" in first["notes"][0]
    kept = _run("tfmx", TFMX_HOST_ALLOCATOR="keep")
    assert kept["at_import"] is None and kept["set"] is None and kept["in_use"] == "malloc"
    assert "TFMX_HOST_ALLOCATOR=keep" in kept["notes"][0]
    late = _run("op-first")
    assert late["set"] is None and late["in_use"] == "malloc"
    assert "had made its devices" in late["notes"][0]
    stock = _run("stock", TFMX_HOST_ALLOCATOR="keep")
    assert stock["in_use"] == "malloc"
    import numpy as np

    for a, b in zip(pooled["weights"], stock["weights"], strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)


def test_disable_before_tensorflow_is_imported_stops_watching_its_import() -> None:
    script = textwrap.dedent("""
        import json, os, sys
        import tfmx
        from tfmx import host_allocator
        watching = host_allocator._watcher in sys.meta_path
        tfmx.disable()
        import tensorflow as tf
        print(json.dumps({"watching": watching,
                          "after": host_allocator._watcher in sys.meta_path,
                          "set": os.environ.get("TF_CPU_ALLOCATOR_USE_BFC"),
                          "loader": type(tf.__spec__.loader).__name__}))
    """)
    result = _run_script(script)
    assert result == {"watching": sys.platform.startswith("linux"), "after": False,
                      "set": None, "loader": "SourceFileLoader"}

