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
    for command in ("bench", "recipe", "backends"):
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
    # An info line TensorFlow logs after start-up at TF_CPP_MIN_LOG_LEVEL 0 (not at 2).
    assert "cpu_feature_guard" not in proc.stderr
