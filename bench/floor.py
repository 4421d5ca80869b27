"""The contraction floor: how long a training step's contractions take on their own.

A step cannot run faster than its matrix products and convolutions (MatMul, BatchMatMul,
Conv2D, DepthwiseConv2dNative, Einsum, their backprop ops and the fused kernels built around
them: ``_FusedMatMul``, ``_MklNativeFusedConv2D``, ...): what a rewrite can take away is the
rest. ``tfmx bench`` measures that floor on stock's step (:func:`measure_floor`):

1. ``steps`` calls of stock's compiled step under TensorFlow's profiler
   (:func:`bench.composite.profile_step`: one event per op kernel executed on the host
   threads, with its node name and op type).
2. Each thread's events cut into self time (an event's time minus that of op events nested
   in it on the same thread); the pieces of the contraction kernels (:func:`is_contraction`,
   on the op type with oneDNN's ``_Mkl``/``_MklNative`` prefix removed) are joined across the
   threads: the **floor** is the time during which at least one contraction kernel ran, per
   step (:func:`contraction_floor`; two kernels running at once count once). Their summed
   self time is kept too (``summed_ms``), with the time any op ran (``busy_ms``).
3. Each mode's step over the floor, ``stock/floor``, ``tfmx/floor``, ``xla/floor``
   (:func:`floor_ratios`): stock's profiled step over the floor, times the mode's median over
   stock's from the interleaved rounds (so a load that changes between the rounds and the
   profile cancels). The target for the transformer workloads (:func:`is_transformer`): tfmx
   at most :data:`TARGET` x the floor.

:func:`format_floors` lays the results out for ``tfmx bench``'s output, :func:`format_record_floors`
the records for BENCHMARKS.md.

Example:
    >>> from bench.composite import OpEvent
    >>> events = [OpEvent("d/MatMul", "_MklMatMul", 1, 0, 4 * 10**9),
    ...           OpEvent("d/Relu", "Relu", 1, 4 * 10**9, 5 * 10**9),
    ...           OpEvent("e/MatMul", "MatMul", 2, 2 * 10**9, 6 * 10**9)]
    >>> floor = contraction_floor(events, steps=2)
    >>> floor["ms"], floor["summed_ms"], floor["busy_ms"], floor["kernels"]
    (3.0, 4.0, 3.0, 2)
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

TARGET = 1.3
"""tfmx's step over the floor that the transformer workloads are measured against."""

TRANSFORMERS = ("transformer", "vit", "decoder", "zoo_bert", "zoo_gpt2", "zoo_llama",
                "zoo_mixtral", "zoo_qwen_moe")
"""The own workloads whose step is mostly attention and feed-forward contractions (with
the zoo's transformer backbones: :func:`is_transformer`)."""

STEPS = 5
"""Profiled calls of stock's step by default (``tfmx bench --floor-steps``)."""

_CONTRACTION = re.compile(
    r"(PadWith)?(Fused)?(MatMul|BatchMatMul(V[23])?|SparseMatMul|Einsum"
    r"|Conv[23]D(Backprop(Input|Filter)(V2)?)?(WithBias)?"
    r"|DepthwiseConv2dNative(Backprop(Input|Filter))?)")


def is_contraction(op: str) -> bool:
    """Whether the op type ``op`` is a contraction kernel (oneDNN's prefix and a leading
    underscore removed first).

    >>> [is_contraction(op) for op in ("_MklNativeFusedMatMul", "BatchMatMulV2",
    ...  "Conv2DBackpropFilter", "_MklNativeDepthwiseConv2dNativeBackpropInput", "_FusedConv2D",
    ...  "_MklEinsum", "MatMulGrad", "BiasAdd", "_MklLayerNorm")]
    [True, True, True, True, True, True, False, False, False]
    """
    op = re.sub(r"^_Mkl(Native)?", "", op).lstrip("_")
    return _CONTRACTION.fullmatch(op) is not None


def _union(spans: Iterable[tuple[int, int]]) -> int:
    """The length of the union of ``spans`` (start, end).

    >>> _union([(0, 4), (2, 6), (8, 9)])
    7
    """
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def contraction_floor(events: Sequence[Any], steps: int) -> dict[str, Any]:
    """The contraction floor of ``steps`` profiled steps from their op events
    (:class:`bench.composite.OpEvent`, picoseconds), per step in ms: ``ms`` (time with a
    contraction kernel running), ``summed_ms`` (their summed self time), ``busy_ms`` (time
    with any op running); ``kernels`` (distinct contraction nodes that ran) and ``op_types``
    (their op types)."""
    from bench.composite import _self_segments, node_name

    by_thread: dict[int, list[Any]] = collections.defaultdict(list)
    for e in events:
        if e.end > e.start:
            by_thread[e.thread].append(e)
    op_types = {node_name(e.name): e.op for e in events}
    segments = [s for thread in by_thread.values() for s in _self_segments(thread)]
    mine = [(s, t) for s, t, name in segments if is_contraction(op_types.get(name, ""))]
    nodes = {name for _, _, name in segments if is_contraction(op_types.get(name, ""))}
    per_step = 1e9 * max(steps, 1)
    return {
        "steps": steps,
        "ms": _union(mine) / per_step,
        "summed_ms": sum(t - s for s, t in mine) / per_step,
        "busy_ms": _union((s, t) for s, t, _ in segments) / per_step,
        "kernels": len(nodes),
        "op_types": sorted({op_types[n] for n in nodes}),
    }


def floor_ratios(floor: Mapping[str, Any] | None, modes: Mapping[str, Mapping[str, Any]]
                 ) -> dict[str, float]:
    """Each mode's step over the floor: ``{"stock/floor": ..., ...}``; {} without a floor.

    Where the floor has the profiled steps' wall time (``wall_ms``) and stock ran, through
    stock's profiled step: the mode's median over stock's (the interleaved rounds) times
    stock's profiled step over the floor (the same profiled steps). Each pair is measured at
    the same moments, so a load that changes between the rounds and the profile cancels (the
    profiler's own cost counts against the ratio). Otherwise the mode's median over the floor.

    >>> modes = {"stock": {"median_ms": 5.0}, "tfmx": {"median_ms": 2.5}}
    >>> floor_ratios({"ms": 2.0}, modes)
    {'stock/floor': 2.5, 'tfmx/floor': 1.25}
    >>> floor_ratios({"ms": 2.0, "wall_ms": 6.0}, modes)
    {'stock/floor': 3.0, 'tfmx/floor': 1.5}
    """
    if not floor or not floor.get("ms"):
        return {}
    stock = (modes.get("stock") or {}).get("median_ms")
    if floor.get("wall_ms") and stock:
        scale = floor["wall_ms"] / floor["ms"] / stock
    else:
        scale = 1.0 / floor["ms"]
    return {f"{mode}/floor": t["median_ms"] * scale for mode, t in modes.items()
            if t.get("median_ms") is not None}


def measure_floor(fn: Any, iterator: Any, steps: int = STEPS, warmup: int = 1
                  ) -> dict[str, Any]:
    """The contraction floor of the compiled step ``fn`` (already traced) on ``iterator``:
    :func:`contraction_floor` of ``steps`` calls under the profiler, after ``warmup``, with
    ``wall_ms`` (the profiled calls' wall time per step). A profiler that cannot start or
    writes nothing gives ``{"error": why}``: the benchmark goes on without a floor.

    >>> measure_floor(model.train_function, iter(dataset))  # doctest: +SKIP
    """
    from bench.composite import profile_step

    try:
        profile = profile_step(fn, iterator, steps, warmup)
    except Exception as err:  # noqa: BLE001 - the figures without a floor, and why
        return {"error": f"{type(err).__name__}: {err}"}
    floor = contraction_floor(profile["events"], steps)
    floor["wall_ms"] = profile["wall_s"] * 1e3 / steps
    return floor


def is_transformer(model: str) -> bool:
    """Whether the workload ``model`` is held to :data:`TARGET`: one of :data:`TRANSFORMERS`,
    or a zoo model built on a keras_hub transformer backbone (:mod:`bench.zoo`).

    >>> [is_transformer(m) for m in ("vit", "zoo_gemma", "zoo_densenet121", "mlp")]
    [True, True, False, False]
    """
    from bench import zoo

    spec = zoo.MODELS.get(model.removeprefix("zoo_")) if model.startswith("zoo_") else None
    return model in TRANSFORMERS or bool(spec and spec.needs_keras_hub)


def target_cell(model: str, ratio: float | None) -> str:
    """Whether tfmx's ``ratio`` to the floor meets :data:`TARGET` for a transformer workload;
    "-" for the others.

    >>> target_cell("transformer", 1.21), target_cell("vit", 1.52), target_cell("mlp", 3.0)
    ('<= 1.3: yes', '<= 1.3: no', '-')
    """
    if not is_transformer(model) or ratio is None:
        return "-"
    return f"<= {TARGET:g}: {'yes' if ratio <= TARGET else 'no'}"


def _cell(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _row(model: str, label: str, state: str, floor: Mapping[str, Any],
         ratios: Mapping[str, float]) -> str:
    if floor.get("error"):
        return f"| {label} | {state} | - | - | - | - | - | - | not measured: {floor['error']} |"
    tfmx = ratios.get("tfmx/floor")
    step = floor.get("wall_ms") or floor.get("busy_ms")
    return (f"| {label} | {state} | {_cell(floor['ms'], 2)} | {floor['kernels']} | "
            f"{_cell(floor['ms'] / step if step else None)} | "
            f"{_cell(ratios.get('stock/floor'))} | {_cell(ratios.get('xla/floor'))} | "
            f"{_cell(tfmx)} | {target_cell(model, tfmx)} |")


HEADER = ["| workload | oneDNN | floor ms | kernels | floor / profiled step | stock / floor | "
          "XLA / floor | tfmx / floor | target |",
          "|---|---|---:|---:|---:|---:|---:|---:|---|"]

INTRO = ("Contraction floor: the time per step during which stock's MatMul, BatchMatMul, "
         "Conv2D, DepthwiseConv2dNative and Einsum kernels (their backprop ops and the fused "
         "kernels around them included) ran, from TensorFlow's profiler over {steps} of stock's "
         "steps (two kernels at once counted once); floor / profiled step: its part of those "
         "steps' wall time. Each mode's step over the floor: stock's profiled step over the "
         "floor times the mode's median over stock's from the interleaved rounds. Target: "
         "tfmx at most {target:g} x the floor on the transformer workloads.")


def format_floors(results: Iterable[Mapping[str, Any]],
                  label: Callable[[Mapping[str, Any]], str] | None = None) -> str:
    """The contraction floor of each result (:func:`bench.runner.run_benchmark`) that has
    one, as a paragraph and a table, each workload named by ``label`` (default: its model);
    "" if none has.

    >>> r = {"model": "transformer", "optimizer": "adam", "batch_size": 32,
    ...      "env": {"onednn": True},
    ...      "modes": {"stock": {"median_ms": 9.0}, "tfmx": {"median_ms": 6.0}},
    ...      "floor": {"steps": 5, "ms": 5.0, "busy_ms": 8.0, "kernels": 40}}
    >>> print(format_floors([r]).splitlines()[-1])
    | transformer | on | 5.00 | 40 | 0.625 | 1.800 | - | 1.200 | <= 1.3: yes |
    """
    from bench.onednn import onednn_state

    results = [r for r in results if r.get("floor")]
    if not results:
        return ""
    steps = "/".join(str(s) for s in sorted({r["floor"].get("steps", STEPS) for r in results}))
    lines = [INTRO.format(steps=steps, target=TARGET), "", *HEADER]
    for r in results:
        state = onednn_state(r)
        name = label(r) if label is not None else r["model"]
        lines.append(_row(r["model"], name, "-" if state == "?" else state, r["floor"],
                          floor_ratios(r["floor"], r.get("modes") or {})))
    return "\n".join(lines)


def format_record_floors(records: Sequence[Mapping[str, Any]],
                         label: Callable[[Mapping[str, Any]], str] | None = None) -> list[str]:
    """BENCHMARKS.md's floor lines for one machine's records (:mod:`bench.records`): a blank
    line, the paragraph and the table of :func:`format_floors`; [] where no record has one.

    >>> format_record_floors([{"result": {"model": "mlp"}}])
    []
    """
    text = format_floors([r["result"] for r in records if (r.get("result") or {}).get("floor")],
                         label)
    return ["", *text.splitlines()] if text else []
