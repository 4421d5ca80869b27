"""One process per oneDNN state.

TensorFlow reads ``TF_ENABLE_ONEDNN_OPTS`` once, when it is imported, so each oneDNN state is
measured in a new process (:func:`child_command`, :func:`run_child`) with the variable set to
``1`` or ``0``; the child (:func:`bench.runner.child_main`) checks that the state took effect
and hands its results back as JSON. :func:`onednn_state` reads the state a result was measured
in.

Example:
    >>> from bench.onednn import onednn_state, onednn_states
    >>> onednn_states("both")
    ('on', 'off')
    >>> onednn_state({"env": {"onednn": True}})
    'on'
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from recipes._machine import ONEDNN_ENV

ONEDNN_CHOICES = ("on", "off", "both")
STATES = ("on", "off")


def onednn_states(choice: str) -> tuple[str, ...]:
    """The oneDNN states ``--onednn choice`` measures, each in its own process.

    >>> onednn_states("both"), onednn_states("off")
    (('on', 'off'), ('off',))
    """
    if choice not in ONEDNN_CHOICES:
        raise ValueError(f"unknown oneDNN choice {choice!r}; choose from {ONEDNN_CHOICES}")
    return STATES if choice == "both" else (choice,)


def onednn_state(result: Mapping[str, Any]) -> str:
    """``"on"`` or ``"off"``: the oneDNN state ``result`` was measured in; ``"?"`` if unknown.

    >>> onednn_state({"env": {"onednn": False}}), onednn_state({})
    ('off', '?')
    """
    env = result.get("env") or {}
    if "onednn" not in env:
        return "?"
    return "on" if env["onednn"] else "off"


def child_command(state: str, models: Sequence[str], options: Mapping[str, Any],
                  result_path: str, environ: Mapping[str, str] | None = None,
                  ) -> tuple[list[str], dict[str, str]]:
    """Command line and environment of the process that benchmarks ``models`` in ``state``.

    The child runs ``python -m bench.runner SPEC RESULT_PATH``
    (:func:`bench.runner.child_main`): :func:`bench.runner.run_benchmark` for each
    model with ``options`` (its keyword arguments), results written as JSON to ``result_path``.
    ``TF_ENABLE_ONEDNN_OPTS`` is ``1`` (``state`` "on") or ``0`` ("off") in its environment, so
    TensorFlow reads it when the child imports it; the child checks that it took effect.
    ``environ``: further variables for the child (``TFMX_HOST_ALLOCATOR=keep``: TensorFlow's
    own allocator, :mod:`tfmx.host_allocator`).

    >>> argv, env = child_command("off", ["mlp"], {"rounds": 2}, "/tmp/r.json")
    >>> argv[1:3], argv[4], env["TF_ENABLE_ONEDNN_OPTS"]
    (['-m', 'bench.runner'], '/tmp/r.json', '0')
    >>> json.loads(argv[3])
    {'onednn': 'off', 'models': ['mlp'], 'options': {'rounds': 2}}
    """
    if state not in STATES:
        raise ValueError(f"unknown oneDNN state {state!r}; choose from {STATES}")
    spec = {"onednn": state, "models": list(models), "options": dict(options)}
    env = {**os.environ, **(environ or {})}
    env[ONEDNN_ENV] = "1" if state == "on" else "0"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return [sys.executable, "-m", "bench.runner", json.dumps(spec), result_path], env


def run_child(state: str, models: Sequence[str], options: Mapping[str, Any],
              environ: Mapping[str, str] | None = None) -> list[dict]:
    """Benchmark ``models`` with ``options`` in a new process with oneDNN ``state`` (and
    ``environ``: :func:`child_command`) and wait for it; its results, each tagged
    ``"isolated": True``. The child's progress and output go to this process's stderr; a
    RuntimeError if it fails.

    >>> [r["model"] for r in run_child("on", ["mlp"], {"rounds": 1})]  # doctest: +SKIP
    ['mlp']
    """
    with tempfile.TemporaryDirectory(prefix="tfmx-bench-") as tmp:
        path = os.path.join(tmp, "results.json")
        argv, env = child_command(state, models, options, path, environ)
        print(f"oneDNN {state}: a new process with {ONEDNN_ENV}={env[ONEDNN_ENV]}",
              file=sys.stderr, flush=True)
        results = run_json_process(argv, env, path, f"tfmx bench: the oneDNN {state} process")
    for r in results:
        r["isolated"] = True
    return results


def run_json_process(argv: Sequence[str], env: Mapping[str, str], path: str, what: str) -> Any:
    """Run ``argv`` with ``env`` and wait for it; the JSON it wrote to ``path``. The child's
    progress goes to stderr as it runs, its stdout too (this process's stdout is the table);
    a RuntimeError naming ``what`` if it fails.

    >>> import tempfile
    >>> path = tempfile.mktemp()
    >>> run_json_process([sys.executable, "-c", f"open({path!r}, 'w').write('[1]')"],
    ...                  dict(os.environ), path, "a child")
    [1]
    """
    proc = subprocess.run(list(argv), env=dict(env), stdout=subprocess.PIPE, text=True)
    if proc.stdout:
        sys.stderr.write(proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited with status {proc.returncode} (its messages are "
                           f"above)")
    with open(path) as f:
        return json.load(f)
