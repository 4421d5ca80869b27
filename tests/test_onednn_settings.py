"""The tests that depend on oneDNN's state, run under the other state in a child process.

TensorFlow reads TF_ENABLE_ONEDNN_OPTS once, when it is imported, so one process has one state:
on by default on some machines and wheels, off on others. The tests that need a state, or check
what differs with it, are marked (helpers.needs_onednn: ``onednn_on``, ``onednn_off``,
``onednn_either``). This process runs those of its own state; for each setting this test starts
``python -m pytest -m ...`` over tests/ with TF_ENABLE_ONEDNN_OPTS set, selecting only the
marked tests, and requires them to pass. The child's conftest shares this run's tuning cache
and starts no children (TFMX_TEST_CHILD=1).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CHILD_ENV, ONEDNN_MARKERS, onednn_state

TESTS = Path(__file__).resolve().parent


@pytest.mark.skipif(bool(os.environ.get(CHILD_ENV)), reason="a child starts no children")
@pytest.mark.parametrize("state", ["off", "on"])
def test_onednn_dependent_tests_pass_with_onednn(state):
    here = onednn_state()
    if state == here:
        pytest.skip(f"oneDNN is {state} in this process: its tests ran here")
    value = "1" if state == "on" else "0"
    markers = f"{ONEDNN_MARKERS[state]} or {ONEDNN_MARKERS['either']}"
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=value, **{CHILD_ENV: "1"})
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", markers,
         str(TESTS)],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=1800,
    )
    output = done.stdout + done.stderr
    found = re.search(r"tfmx tests: oneDNN (on|off)", output)  # conftest's terminal summary
    if found and found.group(1) != state:
        pytest.skip(f"TF_ENABLE_ONEDNN_OPTS={value} leaves oneDNN {found.group(1)} here")
    assert done.returncode == 0, (
        f"TF_ENABLE_ONEDNN_OPTS={value} (oneDNN {state}): pytest -m '{markers}' exited "
        f"{done.returncode}\n{output[-6000:]}")
    print(output.strip().splitlines()[-1])
