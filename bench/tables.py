"""``tfmx bench``'s output: markdown lines and tables.

``python -m bench.tables --markdown`` writes BENCHMARKS.md and the README's table from the
records ``tfmx bench --record`` keeps (:mod:`bench.publish`, :mod:`bench.records`).

:func:`format_markdown` lays out:

- A machine line (:func:`format_environment`): date, CPU model name (vendor, family, model
  number), cores, the CPU flags of :data:`tfmx.machine.RELEVANT_FLAGS` present (avx2, avx512f,
  avx512_bf16, avx512_vnni, amx_bf16, amx_tile, avx_vnni), TensorFlow, Keras and Python
  versions, platform, GPUs.
- A oneDNN line (:func:`format_onednn`): each state measured and how its process got it
  (``TF_ENABLE_ONEDNN_OPTS=1`` or ``=0`` in a process of its own, or the calling process's
  state).
- The summary table (:func:`format_comparison`), one row per workload (model, optimizer,
  batch, policy), median ms/step:

  - ``stock (on)``, ``stock (off)``: Keras's own step with oneDNN on / off;
  - ``XLA (on)``, ``XLA (off)``: ``jit_compile=True`` in the process of that state;
  - ``tfmx (on)``, ``tfmx (off)``: the rewritten step in that state;
  - ``best alternative``: the fastest of the stock and XLA columns, named (``9.00 stock
    (off)``): what a user who does not use tfmx could get by choosing the state and XLA;
  - ``tfmx (on) / best``, ``tfmx (off) / best``: tfmx's median over the best alternative
    (below 1: tfmx is faster than anything else measured);
  - ``best tfmx / best`` (two states only): tfmx's faster state over the best alternative,
    the state named.

  Only the modes and states measured get columns; results without a recorded state get
  columns without "(on)"/"(off)".
- Per workload, a table per oneDNN state and mode: median, p25-p75, min, ``vs stock`` and
  ``vs XLA`` (the ratios within one process: tfmx/stock, tfmx/xla, xla/stock), first call
  (trace, rewrite or compile) seconds; the same ratios taken round by round (each round
  times every mode back to back, :func:`recipes._timing.paired_ratios`), median and p25-p75;
  then each traced function's rewrite, and how many chains/updates tfmx fused, per state.
- The contraction floor (:func:`bench.floor.format_floors`), where measured: per workload and
  oneDNN state, the time stock's contraction kernels took per step and each mode's step over
  it, against the transformer workloads' target.
- With N > 1 replicas: a line saying how they ran (:func:`format_replica_setup`), the rows and
  sections per replica count ("1 replica", "N replicas"), and after the summary table
  tfmx / stock with 1 and with N replicas per workload, their difference and whether it is
  within 0.05 (:func:`format_replicas`).

Example:
    >>> from bench.tables import format_comparison
    >>> print(format_comparison([{"model": "mlp", "modes": {"stock": {"median_ms": 2.0},
    ...                                                      "tfmx": {"median_ms": 1.5}}}]))
    | workload | stock | tfmx | best alternative | tfmx / best |
    |---|---:|---:|---|---:|
    | mlp (adam) | 2.00 | 1.50 | 2.00 stock | 0.750 |
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from bench.compare import by_workload, compare
from bench.environment import format_environment, format_onednn
from bench.floor import format_floors
from bench.onednn import onednn_state
from bench.replicas import REPLICA_TOLERANCE, compare_replicas, several_replicas
from recipes._timing import NOISY_SPREAD, noisy_modes, paired_ratios

MODE_LABELS = {"stock": "stock", "tfmx": "tfmx", "xla": "XLA"}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _state_suffix(state: str) -> str:
    return "" if state == "?" else f" ({state})"


def format_comparison(results: Iterable[Mapping[str, Any]]) -> str:
    """The summary table: one row per workload, every mode in every oneDNN state measured.

    Columns: the median ms/step of stock, XLA and tfmx in each state measured (the state in
    parentheses), the best alternative (fastest of stock and XLA, any state), tfmx / best
    alternative per state, and with two states "best tfmx / best" (tfmx's faster state).

    >>> def run(state, **ms):
    ...     return {"model": "mlp", "batch_size": 32, "env": {"onednn": state == "on"},
    ...             "modes": {m: {"median_ms": v} for m, v in ms.items()}}
    >>> print(format_comparison([run("on", stock=10.0, xla=12.0, tfmx=8.0),
    ...                          run("off", stock=9.0, xla=11.0, tfmx=8.5)]))
    ... # doctest: +NORMALIZE_WHITESPACE
    | workload | stock (on) | stock (off) | XLA (on) | XLA (off) | tfmx (on) | tfmx (off) |
      best alternative | tfmx (on) / best | tfmx (off) / best | best tfmx / best |
    |---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|
    | mlp (adam, batch 32) | 10.00 | 9.00 | 12.00 | 11.00 | 8.00 | 8.50 |
      9.00 stock (off) | 0.889 | 0.944 | 0.889 (on) |
    """
    rows = compare(results)
    states = [s for s in ("on", "off", "?")
              if any(s in by_state for row in rows for by_state in row["ms"].values())]
    columns = [(mode, s) for mode in ("stock", "xla", "tfmx") for s in states
               if any(s in row["ms"].get(mode, {}) for row in rows)]
    tfmx_states = [s for m, s in columns if m == "tfmx"]
    header = ["workload"] + [f"{MODE_LABELS[m]}{_state_suffix(s)}" for m, s in columns]
    header += ["best alternative"] + [f"tfmx{_state_suffix(s)} / best" for s in tfmx_states]
    if len(tfmx_states) > 1:
        header.append("best tfmx / best")
    align = ["---"] + ["---:"] * len(columns) + ["---"] + ["---:"] * (len(header) - len(columns)
                                                                      - 2)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    replicas = any(row["replicas"] > 1 for row in rows)
    for row in rows:
        cells = [_workload_label(row, replicas)]
        cells += [_ms(row["ms"].get(m, {}).get(s)) for m, s in columns]
        best = row["best_alternative"]
        cells.append(f"{_ms(best['ms'])} {MODE_LABELS[best['mode']]}{_state_suffix(best['onednn'])}"
                     if best else "-")
        cells += [_ratio(row["tfmx_vs_best_alternative"].get(s)) for s in tfmx_states]
        if len(tfmx_states) > 1:
            top = row["tfmx_best"]
            cells.append(f"{_ratio(top['vs_best_alternative'])}{_state_suffix(top['onednn'])}"
                         if top and top["vs_best_alternative"] is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _workload_label(row: Mapping[str, Any], replicas: bool = False) -> str:
    """``mlp (adam, batch 32)``: the model, optimizer, batch, policy, and with ``replicas``
    the replica count (``mlp (adam, batch 32, 2 replicas)``)."""
    what = [row.get("optimizer", "adam")]
    what += [f"batch {row['batch_size']}"] if row.get("batch_size") else []
    what += [f"policy {row['policy']}"] if row.get("policy") else []
    if replicas:
        n = row.get("replicas", 1)
        what.append(f"{n} replica{'s' if n > 1 else ''}")
    return f"{row['model']} ({', '.join(what)})"


def _replica_words(result: Mapping[str, Any]) -> str:
    """``, 2 replicas (16 each)`` or ``, 1 replica``."""
    n = result.get("replicas", 1)
    if n == 1:
        return ", 1 replica"
    each = f" ({result['batch_size'] // n} each)" if result.get("batch_size") else ""
    return f", {n} replicas{each}"


def _replica_counts(results: Iterable[Mapping[str, Any]]) -> str:
    """The replica counts above 1 measured, ``2`` or ``2/4``; empty if none."""
    return "/".join(str(c) for c in sorted({r["replicas"] for r in results
                                            if r.get("replicas", 1) > 1}))


def format_replica_setup(results: Iterable[Mapping[str, Any]]) -> str:
    """One markdown line: how the results under several replicas ran (empty if none).

    >>> print(format_replica_setup([{"replicas": 2, "modes": {"stock": {}}}]))
    ... # doctest: +NORMALIZE_WHITESPACE
    _2 replicas: a tf.distribute.MirroredStrategy over 2 logical CPU devices that split this
    process's CPU (tf.config.set_logical_device_configuration, in each measuring process),
    every mode's model built and compiled in its scope; the global batch is the workload's,
    each replica gets batch / 2. 1 replica: no strategy (as without --replicas), in the same
    process, interleaved with the 2-replica steps. XLA not measured: Keras's jit_compile=True
    step cannot run under the strategy._
    """
    results = list(results)
    n = _replica_counts(results)
    if not n:
        return ""
    xla = any("xla" in r["modes"] for r in results if r.get("replicas", 1) > 1)
    return (f"_{n} replicas: a tf.distribute.MirroredStrategy over {n} logical CPU devices "
            f"that split this process's CPU (tf.config.set_logical_device_configuration, in "
            f"each measuring process), every mode's model built and compiled in its scope; "
            f"the global batch is the workload's, each replica gets batch / {n}. 1 replica: "
            f"no strategy (as without --replicas), in the same process, interleaved with the "
            f"{n}-replica steps."
            + ("" if xla else " XLA not measured: Keras's jit_compile=True step cannot run "
               "under the strategy.") + "_")


def format_replicas(results: Iterable[Mapping[str, Any]],
                    tolerance: float = REPLICA_TOLERANCE) -> str:
    """Per workload and oneDNN state, tfmx / stock with 1 and with N replicas and their
    difference, flagged against ``tolerance`` (:func:`compare_replicas`); a sentence, then
    the table. Empty without results under several replicas.

    >>> def run(n, stock, tfmx):
    ...     return {"model": "mlp", "batch_size": 32, "replicas": n, "env": {"onednn": True},
    ...             "modes": {"stock": {"median_ms": stock}, "tfmx": {"median_ms": tfmx}}}
    >>> print(format_replicas([run(1, 10.0, 8.0), run(2, 20.0, 18.0)]))
    ... # doctest: +NORMALIZE_WHITESPACE
    Does tfmx's speed-up hold under 2 replicas? tfmx / stock with 1 and with 2 replicas
    (medians of the same process); within 0.05: the 2-replica ratio within 0.05 of the
    1-replica ratio.
    <BLANKLINE>
    | workload | oneDNN | tfmx / stock, 1 replica | tfmx / stock, 2 replicas | difference |
      within 0.05 |
    |---|---|---:|---:|---:|---|
    | mlp (adam, batch 32) | on | 0.800 | 0.900 | +0.100 | no: smaller speed-up |
    """
    results = list(results)
    n = _replica_counts(results)
    if not n:
        return ""
    lines = [f"Does tfmx's speed-up hold under {n} replicas? tfmx / stock with 1 and with {n} "
             f"replicas (medians of the same process); within {tolerance:g}: the {n}-replica "
             f"ratio within {tolerance:g} of the 1-replica ratio.", "",
             f"| workload | oneDNN | tfmx / stock, 1 replica | tfmx / stock, {n} replicas | "
             f"difference | within {tolerance:g} |", "|---|---|---:|---:|---:|---|"]
    for row in compare_replicas(results, tolerance):
        d = row["difference"]
        flag = ("-" if d is None else "yes" if row["within"]
                else f"no: {'smaller' if d > 0 else 'larger'} speed-up")
        label = _workload_label(row, replicas="/" in n)
        lines.append(f"| {label} | {row['onednn'] if row['onednn'] != '?' else '-'} | "
                     f"{_ratio(row['tfmx_vs_stock_1'])} | {_ratio(row['tfmx_vs_stock_n'])} | "
                     f"{'-' if d is None else f'{d:+.3f}'} | {flag} |")
    return "\n".join(lines)


def _in_state(state: str) -> str:
    """`` (oneDNN on)`` after a line of a workload's section, nothing where the state was not
    recorded (``?``)."""
    return "" if state == "?" else f" (oneDNN {state})"


def _format_workload(by_state: Mapping[str, Mapping[str, Any]], replicas: bool = False) -> str:
    """One workload's section: per state and mode, the timing and the in-process ratios."""
    r = next(iter(by_state.values()))
    lines = [
        f"### {r['model']} ({r.get('optimizer', 'adam')}): batch {r['batch_size']}"
        f"{_replica_words(r) if replicas else ''}, "
        f"{r['rounds']} interleaved rounds x "
        f"{r['steps']} steps (warm-up {r['warmup']} excluded)",
        "",
    ]
    if r.get("description"):
        lines += [r["description"], ""]
    if r.get("policy"):
        per_mode = "; ".join(
            f"{mode}: " + ", ".join(f"{n} x{c}" for n, c in sorted(counts.items()))
            for mode, counts in r.get("layer_policies", {}).items())
        lines += [f"Non-stock modes built under policy {r['policy']!r} "
                  f"({r.get('policy_choice')}). Layers with weights per policy: "
                  f"{per_mode}.", ""]
    lines += [
        "| oneDNN | mode | median ms/step | p25-p75 ms | min ms | vs stock | vs XLA | "
        "first call s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for state, result in by_state.items():
        modes = result["modes"]
        for mode, t in modes.items():
            vs = [t["median_ms"] / modes[base]["median_ms"] if base in modes else None
                  for base in ("stock", "xla")]
            lines.append(
                f"| {state if state != '?' else '-'} | {mode} | {t['median_ms']:.2f} | "
                f"{t['p25_ms']:.2f}-{t['p75_ms']:.2f} | {t['min_ms']:.2f} | {_ratio(vs[0])} | "
                f"{_ratio(vs[1])} | {t['first_call_s']:.1f} |")
    for state, result in by_state.items():
        noisy = noisy_modes(result["modes"])
        if noisy:
            lines += ["", f"A noisy run{_in_state(state)}: " + ", ".join(
                f"{mode}'s p25-p75 spread is {f:.0%} of its median" for mode, f in noisy.items())
                + f" (over {NOISY_SPREAD:.0%}). The machine was busy: a ratio of medians moves "
                "with the load, the per-round ratios (each round's modes paired) less; run "
                "again before reading a few points into it."]
    paired = [(s, paired_ratios(result["modes"])) for s, result in by_state.items()
              if all("rounds_ms" in t for t in result["modes"].values())]
    for state, ratios in paired:
        if ratios:
            lines += ["", f"Per-round ratios{_in_state(state)}, median (p25-p75): " + "; ".join(
                f"{name} {m:.3f} ({lo:.3f}-{hi:.3f})" for name, (m, lo, hi) in ratios.items())]
    traces = [(s, t) for s, result in by_state.items() for t in result.get("rewrite") or []]
    if traces:
        lines += ["", "| oneDNN | traced function | status | nodes | rewrite s |",
                  "|---|---|---|---|---:|"]
        for state, t in traces:
            lines.append(f"| {state if state != '?' else '-'} | {t['function']} | "
                         f"{t['status']} | {t['nodes_before']}->{t['nodes_after']} | "
                         f"{t['rewrite_seconds']:.3f} |")
    fused = [(s, result["fused"]) for s, result in by_state.items()
             if result.get("fused") is not None]
    if len(fused) == 1:
        state, n = fused[0]
        lines += ["", f"tfmx fused {n} chain(s)/update(s)"
                      f"{_in_state(state)}."]
    elif fused:
        lines += ["", "tfmx fused chain(s)/update(s): "
                      + ", ".join(f"{n} with oneDNN {s}" for s, n in fused) + "."]
    for state, result in by_state.items():
        for g in result.get("guard") or []:
            lines.append(f"whole-step guard{_in_state(state)}: {g['function']} kept "
                         f"{g['kept']} (fused {g['fused_ms']:.2f} ms, stock "
                         f"{g['stock_ms']:.2f} ms over {g['pairs']} pairs; {g['reason']})")
    return "\n".join(lines)


def format_markdown(results: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> str:
    """Markdown for one :func:`bench.runner.run_benchmark` result or a list of them (any
    oneDNN states).

    Layout: the machine line (:func:`format_environment`) and the oneDNN line
    (:func:`format_onednn`) if the results record them; the summary table
    (:func:`format_comparison`); then per workload its per-state, per-mode table (median,
    spread, min, ratios to stock and to XLA of the same process, first call), its traced
    functions and how many chains tfmx fused.

    >>> fake = {"model": "mlp", "description": "d", "batch_size": 32, "rounds": 3, "steps": 5,
    ...         "warmup": 2, "ratios": {"tfmx/stock": 0.9}, "rewrite": [], "fused": 3,
    ...         "modes": {m: {"median_ms": v, "p25_ms": v, "p75_ms": v, "min_ms": v,
    ...                       "first_call_s": 1.0} for m, v in (("stock", 10.0), ("tfmx", 9.0))}}
    >>> print(format_markdown(fake))  # doctest: +NORMALIZE_WHITESPACE
    Median ms per training step. Best alternative: the fastest of stock and XLA measured;
    tfmx / best below 1: tfmx is faster.
    <BLANKLINE>
    | workload | stock | tfmx | best alternative | tfmx / best |
    |---|---:|---:|---|---:|
    | mlp (adam, batch 32) | 10.00 | 9.00 | 10.00 stock | 0.900 |
    <BLANKLINE>
    ### mlp (adam): batch 32, 3 interleaved rounds x 5 steps (warm-up 2 excluded)
    <BLANKLINE>
    d
    <BLANKLINE>
    | oneDNN | mode | median ms/step | p25-p75 ms | min ms | vs stock | vs XLA | first call s |
    |---|---|---:|---:|---:|---:|---:|---:|
    | - | stock | 10.00 | 10.00-10.00 | 10.00 | 1.000 | - | 1.0 |
    | - | tfmx | 9.00 | 9.00-9.00 | 9.00 | 0.900 | - | 1.0 |
    <BLANKLINE>
    tfmx fused 3 chain(s)/update(s).
    """
    results = [results] if isinstance(results, Mapping) else list(results)
    if not results:
        return "\n"
    head = []
    env = next((r["env"] for r in results if r.get("env")), None)
    if env:
        head.append(format_environment(env))
    if format_onednn(results):
        head.append(format_onednn(results))
    replicas = several_replicas(results)
    if replicas:
        head.append(format_replica_setup(results))
    head += ["Median ms per training step. Best alternative: the fastest of stock and XLA "
             "measured" + (", in any oneDNN state" if len(
                 {onednn_state(r) for r in results}) > 1 else "") + "; tfmx / best below 1: "
             "tfmx is faster.", format_comparison(results)]
    if replicas:
        head.append(format_replicas(results))
    floors = format_floors(results, lambda r: _workload_label(r, bool(replicas)))
    if floors:
        head.append(floors)
    blocks = ["\n\n".join(head)] + [_format_workload(g, replicas)
                                     for g in by_workload(results)]
    return "\n\n".join(blocks) + "\n"


if __name__ == "__main__":  # python -m bench.tables --markdown: see bench.publish
    import sys

    from bench.publish import main

    sys.exit(main())
