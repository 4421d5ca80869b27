"""The ``tfmx`` command: help without TensorFlow, subcommands with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_help_runs_and_lists_the_subcommands():
    proc = run("-m", "tfmx", "--help")
    assert proc.returncode == 0, proc.stderr
    for command in ("bench", "recipe", "backends", "placement"):
        assert command in proc.stdout


def test_importing_the_cli_and_parsing_do_not_import_tensorflow():
    proc = run("-c", "import sys, tfmx.cli; tfmx.cli._parser().parse_args(['backends']); "
                     "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_import_tfmx_then_enable_still_works():
    # Loading the submodules tfmx.reporting and tfmx.fused_function leaves the functions.
    proc = run("-c", "import tfmx; tfmx.enable(backend='cpu'); "
                     "import tfmx.fused_function, tfmx.reporting; "
                     "print(tfmx.enabled(), isinstance(tfmx.report(), tfmx.Report), "
                     "isinstance(tfmx.function(lambda x: x), tfmx.FusedFunction))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-3:] == ["True", "True", "True"]


def test_subcommands_keep_tensorflow_info_logs_quiet():
    proc = run("-m", "tfmx", "backends")
    assert proc.returncode == 0, proc.stderr
    assert "cpu:" in proc.stdout
    # metal once per Metal plugin tfmx has a table of
    assert "metal: Apple tensorflow-metal 1.2.0" in proc.stdout
    assert "metal: tensorflow-metal-plugin 0.4.1" in proc.stdout
    # An info line TensorFlow logs after start-up at TF_CPP_MIN_LOG_LEVEL 0 (not at 2).
    assert "cpu_feature_guard" not in proc.stderr


SCRIPT = """
import sys
import keras, numpy as np, tfmx
print("script arguments", sys.argv[1:], file=sys.stderr)
tfmx.enable(backend="cpu")  # tfmx placement plans for metal whatever a script asks
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="relu"),
                          keras.layers.Dense(2)])
model.compile("adam", "mse")
model.fit(np.zeros((4, 8), "float32"), np.zeros((4, 2), "float32"), epochs=1, verbose=0)
raise SystemExit("the plan ran")
"""


def test_placement_of_a_script_for_each_plugin(tmp_path):
    script = tmp_path / "model.py"
    script.write_text(SCRIPT)
    proc = run("-m", "tfmx", "placement", str(script), "--plugin", "tensorflow-metal-plugin")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "tensorflow-metal-plugin 0.4.1" in out and "the plan ran" not in proc.stderr
    assert "Sequential.train_step:" in out and "  stock: " in out and "  tfmx: " in out
    assert "DivNoNan x5" in out  # Keras's loss reduction: no kernel in the open plugin
    assert "moved from the device to the host by tfmx: 0" in out
    proc = run("-m", "tfmx", "placement", str(script), "--plugin", "tensorflow-metal", "--json",
               "--", "--epochs", "1")
    assert proc.returncode == 0, proc.stderr
    assert "script arguments ['--epochs', '1']" in proc.stderr
    import json

    (audit,) = json.loads(proc.stdout)
    assert audit["stock"] == "stock" and audit["moved_to_host"] == []
    assert "tensorflow-metal 1.2.0" in audit["backend"]


def test_placement_of_a_recipe_and_bad_targets():
    env_run = subprocess.run(
        [sys.executable, "-m", "tfmx", "placement", "small_cnn"], cwd=ROOT, capture_output=True,
        text=True, timeout=600, env={**os.environ, "TFMX_RECIPES_OFFLINE": "1"})
    assert env_run.returncode == 0, env_run.stderr
    assert "tensorflow-metal 1.2.0" in env_run.stdout and "train_step:" in env_run.stdout
    proc = run("-m", "tfmx", "placement", "no_such_recipe")
    assert proc.returncode != 0 and "neither a script" in proc.stderr
    proc = run("-m", "tfmx", "placement", "small_cnn", "--plugin", "metal")
    assert proc.returncode != 0 and "unknown Metal plugin" in proc.stderr
