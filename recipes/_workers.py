"""``--workers N``: a recipe trained by N local worker processes under
``tf.distribute.MultiWorkerMirroredStrategy`` (loopback only).

The command the user ran becomes the launcher: it picks N free loopback ports, starts the same
recipe N times with a ``TF_CONFIG`` each (worker ``i`` of the cluster) and :data:`ENV_WORKER`
set, streams the chief's output (worker 0; the others log to ``<out>/worker-<i>.log``), and
stops every worker if one fails. Each worker creates the strategy before TensorFlow runs
anything, builds and compiles the model in its scope and trains with tfmx (Keras 3's own ``fit``
fails under several workers, keras-team/keras#20585; tfmx's rebuilt step works:
docs/distributed.md). A worker run is the tfmx run alone: no stock or stock' run to compare with
in the same processes, no interleaved timing (each step is a collective of every worker); the
chief writes ``metrics.json`` with the step times ``fit`` measured.

On several machines, run the recipe on each with its own ``TF_CONFIG`` and
``TFMX_RECIPE_WORKER=1`` instead (docs/distributed.md).

Example:
    >>> config = cluster_config(["localhost:2222", "localhost:2223"], 1)
    >>> config["task"]
    {'type': 'worker', 'index': 1}
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ENV_WORKER = "TFMX_RECIPE_WORKER"  # set in a worker: it trains, it launches nothing
COLLECTIVE_TIMEOUT_S = 120  # a collective waiting longer on a live peer fails


def in_worker() -> bool:
    """True in a process the launcher started (or a worker started by hand on a cluster)."""
    return os.environ.get(ENV_WORKER, "") not in ("", "0")


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports free now (bound, then released)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("localhost", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def cluster_config(addresses: Sequence[str], index: int) -> dict[str, Any]:
    """The ``TF_CONFIG`` of worker ``index`` of a cluster of ``addresses``."""
    return {"cluster": {"worker": list(addresses)}, "task": {"type": "worker", "index": index}}


def strategy() -> Any:
    """The worker's ``MultiWorkerMirroredStrategy`` (from ``TF_CONFIG``); created before any
    other TensorFlow op, as TensorFlow requires."""
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=COLLECTIVE_TIMEOUT_S)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


def launch(recipe: str, argv: Sequence[str], workers: int, out: Path,
           timeout: float | None = None) -> dict[str, Any]:
    """Start ``workers`` local processes of ``recipes.<recipe>`` (``argv``, ``--out`` each
    worker's folder: the chief's is ``out``), wait for them, and return the chief's
    ``metrics.json``. A worker that fails stops the others (after a grace period for their
    own error) and raises ``RuntimeError`` naming it and its log."""
    ports = free_ports(workers)
    addresses = [f"localhost:{p}" for p in ports]
    args = list(argv)
    procs: list[subprocess.Popen] = []
    logs: list[Path | None] = []
    try:
        for i in range(workers):
            env = {**os.environ, "TF_CONFIG": json.dumps(cluster_config(addresses, i)),
                   ENV_WORKER: str(i + 1), "TF_CPP_MIN_LOG_LEVEL":
                   os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
            folder = out if i == 0 else out / f"worker-{i}"
            folder.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", f"recipes.{recipe}", *args, "--out", str(folder)]
            if i == 0:
                procs.append(subprocess.Popen(cmd, env=env))
                logs.append(None)
            else:
                log = out / f"worker-{i}.log"
                with open(log, "w") as handle:
                    procs.append(subprocess.Popen(cmd, env=env, stdout=handle,
                                                  stderr=subprocess.STDOUT))
                logs.append(log)
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or (deadline is not None and time.monotonic() > deadline):
                grace = time.monotonic() + 30
                while any(p.poll() is None for p in procs) and time.monotonic() < grace:
                    time.sleep(0.5)
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [i for i, p in enumerate(procs) if p.returncode != 0]
    if bad:
        where = ", ".join(f"worker {i} (exit {procs[i].returncode}"
                          + (f", log {logs[i]})" if logs[i] else ", output above)")
                          for i in bad)
        raise RuntimeError(f"recipes.{recipe} --workers {workers}: {where}")
    return json.loads((out / "metrics.json").read_text())
