"""Replicas: every mode's model in a MirroredStrategy over logical CPU devices.

With ``replicas=N`` (``tfmx bench --replicas N``; default 1: one device, no strategy) each
measuring process splits its CPU into N logical devices before TensorFlow runs anything
(:func:`split_cpu`) and builds and compiles every mode's model in a
``tf.distribute.MirroredStrategy`` over them (:func:`mirrored_strategy`), fed a distributed
dataset; the global batch stays the workload's (each replica gets batch / N). The same modes
with 1 replica (no strategy) run interleaved with them in the same rounds, so
:func:`compare_replicas` sets tfmx / stock with N replicas against 1 replica's (within
:data:`REPLICA_TOLERANCE`). XLA's step and ``policy="auto"`` cannot run under the
strategy: :func:`check_replicas` says so and what to pass instead.

Example:
    >>> from bench.replicas import check_replicas, replica_modes
    >>> replica_modes(2)
    ('stock', 'tfmx')
    >>> check_replicas(2, replica_modes(2), batch_sizes={"mlp": 32})
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from bench.onednn import onednn_state
from bench.workloads import MODES
from recipes._timing import median_ratios

REPLICA_TOLERANCE = 0.05  # tfmx / stock under N replicas within this of 1 replica's
# What cannot run inside a MirroredStrategy over logical CPUs, and what to do instead.
_XLA_UNDER_REPLICAS = (
    "the xla mode cannot run with replicas > 1: Keras's jit_compile=True step under a "
    "MirroredStrategy reads a replica's variables from another logical CPU, which XLA refuses "
    "('Trying to access resource ... located in device CPU:1 from device CPU:0'); pass "
    "--modes stock tfmx (without --modes, --replicas N > 1 measures stock and tfmx)")
_AUTO_UNDER_REPLICAS = (
    "--policy auto cannot run with replicas > 1: its per-layer tuning reads the layers' "
    "variables outside the replica context, which a MirroredStrategy's variables refuse (it "
    "would fall back to one policy everywhere); pass a fixed policy (float32, mixed_float16, "
    "mixed_bfloat16)")


def replica_modes(replicas: int) -> tuple[str, ...]:
    """The modes measured when none are asked for: every mode with one replica, stock and tfmx
    with more (XLA's step cannot run under the strategy: :func:`check_replicas`).

    >>> replica_modes(1), replica_modes(2)
    (('stock', 'tfmx', 'xla'), ('stock', 'tfmx'))
    """
    return MODES if replicas == 1 else tuple(m for m in MODES if m != "xla")


def check_replicas(replicas: Any, modes: Sequence[str] = ("stock", "tfmx"),
                   policy: str | None = None, batch_sizes: Mapping[str, int] | None = None,
                   ) -> None:
    """ValueError, saying what to do, if ``replicas`` cannot be measured with these options.

    ``replicas`` must be an int >= 1; above 1 the ``xla`` mode and ``policy="auto"`` cannot run
    under the strategy, and each workload's global batch (``batch_sizes``: name -> batch) must
    split evenly over the replicas.

    >>> check_replicas(2, ["stock", "tfmx"], batch_sizes={"mlp": 32})
    >>> check_replicas(0)
    Traceback (most recent call last):
    ...
    ValueError: replicas must be an integer >= 1 (1: one device, no strategy), got 0
    >>> check_replicas(3, batch_sizes={"mlp": 32})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: mlp's batch of 32 does not split over 3 replicas: ...
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1 (1: one device, no strategy), got "
                         f"{replicas!r}")
    if replicas == 1:
        return
    if "xla" in modes:
        raise ValueError(_XLA_UNDER_REPLICAS)
    if policy == "auto":
        raise ValueError(_AUTO_UNDER_REPLICAS)
    for name, batch in (batch_sizes or {}).items():
        if batch % replicas:
            raise ValueError(f"{name}'s batch of {batch} does not split over {replicas} "
                             f"replicas: pass --batch-size a multiple of {replicas} (the "
                             f"global batch; each replica gets batch / {replicas})")


def split_cpu(replicas: int) -> list[str]:
    """Split this process's physical CPU into ``replicas`` logical CPU devices; their names.

    TensorFlow allows it only before it initialises its devices (before any op runs): a
    process that already ran TensorFlow gets a RuntimeError saying so, unless its CPU is
    already split that way. The devices share the process's thread pools (the same cores).
    """
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if len(current or [None]) != replicas:
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(replicas)])
        except RuntimeError as err:
            raise RuntimeError(
                f"tfmx bench: {replicas} replicas need the CPU split into {replicas} logical "
                f"devices before TensorFlow runs anything, and this process has already run "
                f"TensorFlow ({err}); run the benchmark in a new process (the tfmx bench "
                f"command does, as does onednn='on'/'off'/'both')") from None
    return [d.name for d in tf.config.list_logical_devices("CPU")[:replicas]]


@functools.cache
def mirrored_strategy(replicas: int) -> Any:
    """None for one replica (Keras's default, as without --replicas); else a MirroredStrategy
    over ``replicas`` logical CPUs of this process (:func:`split_cpu`), one per process for
    every workload: two strategies of one process hand out the same collective instance keys,
    and the runtime then takes one model's all-reduce for the other's ("Shape mismatch in the
    collective instance").

    >>> mirrored_strategy(1) is None
    True
    """
    if replicas == 1:
        return None
    import tensorflow as tf

    return tf.distribute.MirroredStrategy(split_cpu(replicas))


def compare_replicas(results: Iterable[Mapping[str, Any]],
                     tolerance: float = REPLICA_TOLERANCE) -> list[dict[str, Any]]:
    """Per workload and oneDNN state measured with 1 and with N > 1 replicas: tfmx / stock at
    each (medians of the same process), the difference (N's minus 1's: above 0, a smaller
    speed-up under N replicas) and whether it is within ``tolerance``.

    >>> def run(n, stock, tfmx):
    ...     return {"model": "mlp", "replicas": n, "env": {"onednn": True},
    ...             "modes": {"stock": {"median_ms": stock}, "tfmx": {"median_ms": tfmx}}}
    >>> row, = compare_replicas([run(1, 10.0, 8.0), run(2, 20.0, 17.0)])
    >>> row["replicas"], row["tfmx_vs_stock_1"], row["tfmx_vs_stock_n"]
    (2, 0.8, 0.85)
    >>> round(row["difference"], 3), row["within"]
    (0.05, True)
    """
    single: dict[tuple, Mapping[str, Any]] = {}
    several: list[tuple[tuple, Mapping[str, Any]]] = []
    for r in results:
        key = (r["model"], r.get("optimizer", "adam"), r.get("policy"), r.get("batch_size"),
               onednn_state(r))
        if r.get("replicas", 1) == 1:
            single.setdefault(key, r)
        else:
            several.append((key, r))
    rows = []
    for key, r in several:
        if key not in single:
            continue
        one, many = (median_ratios(x["modes"]).get("tfmx/stock") for x in (single[key], r))
        difference = many - one if one is not None and many is not None else None
        rows.append({
            "model": key[0], "optimizer": key[1], "policy": key[2], "batch_size": key[3],
            "onednn": key[4], "replicas": r["replicas"],
            "tfmx_vs_stock_1": one, "tfmx_vs_stock_n": many, "difference": difference,
            "tolerance": tolerance,
            # rounded as printed, so that a table's 0.050 reads as within 0.05
            "within": (None if difference is None
                       else round(abs(difference), 3) <= tolerance),
        })
    return rows


def several_replicas(results: Iterable[Mapping[str, Any]]) -> bool:
    """Whether any of ``results`` was measured with more than one replica.

    >>> several_replicas([{"replicas": 1}, {}]), several_replicas([{"replicas": 2}])
    (False, True)
    """
    return any(r.get("replicas", 1) > 1 for r in results)
