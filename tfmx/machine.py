"""Which machine this is: the CPU and its flags that decide kernel speed, and TensorFlow's state.

One place for what ``tfmx bench`` prints above its tables and what the tuner keys its
measurements by. :func:`cpu_info` reads the CPU only (no TensorFlow import); :func:`fingerprint`
adds the TensorFlow and Keras versions and whether oneDNN is on (it imports TensorFlow).

The model name and the flags are read by :func:`policies.hardware.parse_cpuinfo` (the detector
the ``auto`` policy uses); this module adds the vendor, family and model number and keeps the
flags that matter for CPU kernels (:data:`RELEVANT_FLAGS`).

Example:
    >>> from tfmx.machine import RELEVANT_FLAGS, cpu_info
    >>> info = cpu_info()
    >>> sorted(info)
    ['family', 'flags', 'model', 'model_number', 'vendor']
    >>> set(info["flags"]) <= set(RELEVANT_FLAGS)
    True
"""

from __future__ import annotations

import platform
from typing import Any

#: CPU flags that decide which float32/bfloat16 kernels run fast (``/proc/cpuinfo`` names).
RELEVANT_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile",
                  "avx_vnni")


def parse_cpu_info(text: str) -> dict[str, Any]:
    """:func:`cpu_info` from the text of ``/proc/cpuinfo`` (the first processor's fields).

    >>> text = ("processor\\t: 0\\nvendor_id\\t: GenuineIntel\\ncpu family\\t: 6\\n"
    ...         "model\\t\\t: 143\\nmodel name\\t: Intel Xeon\\n"
    ...         "flags\\t\\t: fpu avx2 avx512f amx_tile amx_bf16 sse4_2\\n")
    >>> parse_cpu_info(text)  # doctest: +NORMALIZE_WHITESPACE
    {'model': 'Intel Xeon', 'vendor': 'GenuineIntel', 'family': '6', 'model_number': '143',
     'flags': ['amx_bf16', 'amx_tile', 'avx2', 'avx512f']}
    """
    from policies.hardware import parse_cpuinfo

    name, flags = parse_cpuinfo(text)
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key in ("vendor_id", "cpu family", "model") and key not in fields:
            fields[key] = value.strip()
    if name == "unknown CPU":  # e.g. ARM Linux: no "model name" line
        name = platform.processor() or platform.machine() or name
    return {
        "model": name,
        "vendor": fields.get("vendor_id", ""),
        "family": fields.get("cpu family", ""),
        "model_number": fields.get("model", ""),
        "flags": sorted(f for f in RELEVANT_FLAGS if f in flags),
    }


def cpu_info(cpuinfo_path: str = "/proc/cpuinfo") -> dict[str, Any]:
    """This machine's CPU: model name, vendor, family, model number and :data:`RELEVANT_FLAGS`.

    Read from ``cpuinfo_path`` on Linux; elsewhere the model is ``platform.processor()`` and
    vendor, family, model number and flags are empty.

    >>> info = cpu_info("/no/such/file")
    >>> info["model"] != "", info["flags"]
    (True, [])
    """
    try:
        with open(cpuinfo_path) as f:
            return parse_cpu_info(f.read())
    except OSError:
        return {"model": platform.processor() or platform.machine() or "unknown CPU",
                "vendor": "", "family": "", "model_number": "", "flags": []}


def fingerprint() -> dict[str, Any]:
    """:func:`cpu_info` plus ``tensorflow`` and ``keras`` versions and ``onednn`` (bool).

    oneDNN's state is fixed when TensorFlow is imported (``TF_ENABLE_ONEDNN_OPTS``), so two
    processes of one machine can differ only there.

    >>> fp = fingerprint()
    >>> fp["onednn"] in (True, False), sorted(fp)[-3:]
    (True, ['onednn', 'tensorflow', 'vendor'])
    """
    import keras
    import tensorflow as tf

    from tfmx.backends import onednn_enabled

    return {**cpu_info(), "tensorflow": tf.__version__, "keras": keras.__version__,
            "onednn": onednn_enabled()}


__all__ = ["RELEVANT_FLAGS", "cpu_info", "fingerprint", "parse_cpu_info"]
