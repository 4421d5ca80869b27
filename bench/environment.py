"""The machine a benchmark ran on, as the tables print it.

:func:`recipes._machine.environment` (date, versions, processor, oneDNN state) is recorded
with every result (``tfmx bench``, the whole-fit prices, the recipes' ``metrics.json``) and
printed above every table (:func:`format_environment`, with :func:`format_onednn` for the
oneDNN state; :func:`machine` as a heading; :func:`default_onednn` TensorFlow's default
state there).

Example:
    >>> from recipes._machine import environment
    >>> format_environment(environment()).startswith("_")
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from bench.onednn import ONEDNN_ENV, onednn_state


def format_environment(env: Mapping[str, Any]) -> str:
    """One markdown line: when, which processor (and its flags), versions.

    The oneDNN state is per result: :func:`format_onednn`.

    >>> print(format_environment({"date": "2026-01-02 10:00", "tensorflow": "2.21.0",
    ...     "keras": "3.15.1", "python": "3.12.1", "platform": "Linux-6.8", "cpu": "AMD EPYC",
    ...     "cpu_vendor": "AuthenticAMD", "cpu_family": "25", "cpu_model": "17",
    ...     "cpu_flags": ["avx2", "avx512f"], "cpu_count": 2, "gpus": 0}))
    ... # doctest: +NORMALIZE_WHITESPACE
    _2026-01-02 10:00; AMD EPYC (AuthenticAMD, family 25, model 17), 2 cores,
    flags: avx2 avx512f; TensorFlow 2.21.0, Keras 3.15.1, Python 3.12.1; Linux-6.8; GPUs: 0_
    """
    ids = [env.get("cpu_vendor")]
    ids += [f"{name} {env[key]}" for name, key in (("family", "cpu_family"),
                                                  ("model", "cpu_model")) if env.get(key)]
    ids_s = ", ".join(i for i in ids if i)
    cpu = f"{env['cpu']} ({ids_s})" if ids_s else env["cpu"]
    flags = " ".join(env.get("cpu_flags") or []) or "none of " + " ".join(_relevant_flags())
    return (f"_{env['date']}; {cpu}, {env['cpu_count']} cores, flags: {flags}; "
            f"TensorFlow {env['tensorflow']}, Keras {env['keras']}, Python {env['python']}; "
            f"{env['platform']}; GPUs: {env['gpus']}_")


def _relevant_flags() -> tuple[str, ...]:
    from tfmx.machine import RELEVANT_FLAGS

    return RELEVANT_FLAGS


#: How a record's ``env["host_allocator"]`` reads in a table's header.
ALLOCATOR_WORDS = {"pool": "CPU tensors in a best-fit pool (every mode)",
                   "malloc": "CPU tensors from malloc (every mode)"}


def format_onednn(results: Iterable[Mapping[str, Any]]) -> str:
    """One markdown line: each oneDNN state measured, how the process got it, and the
    allocator of its CPU tensors where the record names it (``tfmx.host_allocator``).

    >>> print(format_onednn([
    ...     {"env": {"onednn": True, "onednn_env": "1"}, "isolated": True},
    ...     {"env": {"onednn": False, "onednn_env": None, "host_allocator": "pool"}}]))
    ... # doctest: +NORMALIZE_WHITESPACE
    _oneDNN on: TF_ENABLE_ONEDNN_OPTS=1, a process of its own; oneDNN off:
    TF_ENABLE_ONEDNN_OPTS unset (TensorFlow's default), the calling process, CPU tensors in a
    best-fit pool (every mode)_
    """
    seen: dict[str, str] = {}
    for r in results:
        state = onednn_state(r)
        if state == "?" or state in seen:
            continue
        value = r["env"].get("onednn_env")
        how = (f"{ONEDNN_ENV}={value}" if value is not None
               else f"{ONEDNN_ENV} unset (TensorFlow's default)")
        where = "a process of its own" if r.get("isolated") else "the calling process"
        allocator = ALLOCATOR_WORDS.get(r["env"].get("host_allocator"))
        seen[state] = f"oneDNN {state}: {how}, {where}" + (f", {allocator}" if allocator else "")
    return f"_{'; '.join(seen.values())}_" if seen else ""


#: The CPU flags with which TensorFlow turns its oneDNN pass on by default (Linux x86-64).
ONEDNN_DEFAULT_FLAGS = ("avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_tile")


def default_onednn(env: Mapping[str, Any]) -> str:
    """TensorFlow's default oneDNN state on the machine of ``env`` (:func:`environment`):
    "on" where the CPU has AVX512_VNNI, AVX512_BF16, AVX_VNNI or AMX, "off" elsewhere, "?"
    where the record names no flags.

    >>> default_onednn({"cpu_flags": ["avx2", "avx512_vnni"]}), default_onednn({"cpu_flags": []})
    ('on', 'off')
    """
    flags = env.get("cpu_flags")
    if flags is None:
        return "?"
    return "on" if set(flags) & set(ONEDNN_DEFAULT_FLAGS) else "off"


def machine(env: Mapping[str, Any]) -> str:
    """The machine a record ran on, as a heading: processor, cores, flags, versions.

    >>> machine({"cpu": "AMD EPYC", "cpu_count": 2, "cpu_flags": ["avx2"],
    ...          "tensorflow": "2.21.0", "keras": "3.15.1", "python": "3.11.7"})
    'AMD EPYC, 2 cores (flags: avx2); TensorFlow 2.21.0, Keras 3.15.1, Python 3.11.7'
    """
    flags = " ".join(env.get("cpu_flags") or []) or "none of interest"
    gpus = f", {env['gpus']} GPU(s)" if env.get("gpus") else ""
    return (f"{env.get('cpu') or 'unknown processor'}, {env.get('cpu_count')} cores "
            f"(flags: {flags}){gpus}; TensorFlow {env.get('tensorflow')}, Keras "
            f"{env.get('keras')}, Python {env.get('python')}")


def by_machine(records: Iterable[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Records grouped by :func:`machine`, in the order first seen.

    >>> env = {"cpu": "c", "cpu_count": 2, "tensorflow": "2.21.0", "keras": "3.15.1"}
    >>> list(by_machine([{"env": env}, {"env": {**env, "cpu": "d"}}, {"env": env}]).values())
    ... # doctest: +ELLIPSIS
    [[{'env': {'cpu': 'c', ...}}, {'env': {'cpu': 'c', ...}}], [{'env': {'cpu': 'd', ...}}]]
    """
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for record in records:
        groups.setdefault(machine(record.get("env") or {}), []).append(record)
    return groups
