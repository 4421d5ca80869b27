"""Which machine this is: the CPU and its flags that decide kernel speed, and TensorFlow's state.

One place for what ``tfmx bench`` prints above its tables and what the tuner keys its
measurements by. :func:`cpu_info` reads the CPU only (no TensorFlow import); :func:`fingerprint`
adds the TensorFlow and Keras versions and whether oneDNN is on (it imports TensorFlow).

The one module that reads the machine: the CPU's model name and flags (:func:`parse_cpuinfo`,
:func:`read_cpuinfo`, which ``policies.hardware_choice.detect`` uses too), its vendor, family
and model number, the flags that matter for CPU kernels (:data:`RELEVANT_FLAGS`), CUDA GPUs'
compute capabilities and an Apple GPU.

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
import sys
from typing import Any

#: CPU flags that decide which float32/bfloat16 kernels run fast (``/proc/cpuinfo`` names).
RELEVANT_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile",
                  "avx_vnni")


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) from the text of ``/proc/cpuinfo`` (the first processor's).

    >>> name, flags = parse_cpuinfo("model name\\t: Xeon\\nflags\\t\\t: fpu amx_bf16\\n")
    >>> name, sorted(flags)
    ('Xeon', ['amx_bf16', 'fpu'])
    """
    name, flags = "unknown CPU", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name == "unknown CPU":
            name = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return name, flags


def cuda_capabilities() -> tuple[tuple[int, int], ...]:
    """The compute capability of every CUDA GPU TensorFlow lists (none: ())."""
    try:
        import tensorflow as tf

        caps = []
        for dev in tf.config.list_physical_devices("GPU"):
            cc = tf.config.experimental.get_device_details(dev).get("compute_capability")
            if cc:
                caps.append((int(cc[0]), int(cc[1])))
        return tuple(caps)
    except Exception:  # noqa: BLE001 - detection never fails the caller
        return ()


def apple_gpu() -> tuple[bool, tuple[int, ...] | None]:
    """(an Apple-silicon GPU TensorFlow lists, the macOS version); (False, None) elsewhere."""
    if sys.platform != "darwin":
        return False, None
    version = tuple(int(p) for p in platform.mac_ver()[0].split(".") if p.isdigit()) or None
    try:
        import tensorflow as tf

        has_gpu = platform.machine() == "arm64" and bool(tf.config.list_physical_devices("GPU"))
    except Exception:  # noqa: BLE001
        has_gpu = False
    return has_gpu, version


def read_cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str, frozenset[str]]:
    """(model name, flags) of this machine's CPU; without ``path`` (not Linux) the name
    ``platform`` gives and no flags.

    >>> name, flags = read_cpuinfo("/no/such/file")
    >>> isinstance(name, str), flags
    (True, frozenset())
    """
    try:
        with open(path) as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return platform.processor() or platform.machine() or "unknown CPU", frozenset()


def parse_cpu_info(text: str) -> dict[str, Any]:
    """:func:`cpu_info` from the text of ``/proc/cpuinfo`` (the first processor's fields).

    >>> text = ("processor\\t: 0\\nvendor_id\\t: GenuineIntel\\ncpu family\\t: 6\\n"
    ...         "model\\t\\t: 143\\nmodel name\\t: Intel Xeon\\n"
    ...         "flags\\t\\t: fpu avx2 avx512f amx_tile amx_bf16 sse4_2\\n")
    >>> parse_cpu_info(text)  # doctest: +NORMALIZE_WHITESPACE
    {'model': 'Intel Xeon', 'vendor': 'GenuineIntel', 'family': '6', 'model_number': '143',
     'flags': ['amx_bf16', 'amx_tile', 'avx2', 'avx512f']}
    """
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
