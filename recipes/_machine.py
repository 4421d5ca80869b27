"""The machine a run happens on: date, versions, processor, oneDNN state.

Recorded with every recipe's ``metrics.json`` and, by the benchmark, with every result.

Example:
    >>> env = environment()
    >>> env["tensorflow"] != "" and env["cpu_count"] >= 1
    True
"""

from __future__ import annotations

import datetime
import os
import platform
from typing import Any

#: The environment variable TensorFlow reads, once per process, for its oneDNN state.
ONEDNN_ENV = "TF_ENABLE_ONEDNN_OPTS"


def environment() -> dict[str, Any]:
    """Date, versions, machine and oneDNN state that go with every table.

    The CPU comes from :func:`tfmx.machine.fingerprint`: ``cpu`` (model name), ``cpu_vendor``,
    ``cpu_family``, ``cpu_model`` (number) and ``cpu_flags`` (:data:`tfmx.machine.RELEVANT_FLAGS`
    present). ``onednn`` is this process's state and ``onednn_env`` the value of
    ``TF_ENABLE_ONEDNN_OPTS`` it was imported with (None: unset, TensorFlow's default).
    ``host_allocator``: the allocator of its CPU tensors (:func:`tfmx.host_allocator.in_use`).

    >>> env = environment()
    >>> sorted(env)[:6]
    ['cpu', 'cpu_count', 'cpu_family', 'cpu_flags', 'cpu_model', 'cpu_vendor']
    >>> env["onednn"] in (True, False)
    True
    """
    import tensorflow as tf

    from tfmx import host_allocator
    from tfmx.machine import fingerprint

    fp = fingerprint()
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "tensorflow": fp["tensorflow"],
        "keras": fp["keras"],
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "cpu": fp["model"],
        "cpu_vendor": fp["vendor"],
        "cpu_family": fp["family"],
        "cpu_model": fp["model_number"],
        "cpu_flags": fp["flags"],
        "cpu_count": os.cpu_count(),
        "onednn": fp["onednn"],
        "onednn_env": os.environ.get(ONEDNN_ENV),
        "host_allocator": host_allocator.in_use(),
        "gpus": len(tf.config.list_physical_devices("GPU")),
    }
