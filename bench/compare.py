"""The comparison: per workload, every mode in every oneDNN state, and the best alternative.

The best alternative is what a user who does not use tfmx could get by choosing the oneDNN
state and XLA: the fastest measured of stock and XLA in any state (:data:`ALTERNATIVES`).
:func:`compare` sets tfmx's median against it, per state and for tfmx's fastest state;
:func:`results_document` is what ``tfmx bench --json`` writes.

Example:
    >>> from bench.compare import compare
    >>> row, = compare([{"model": "mlp", "env": {"onednn": True},
    ...                  "modes": {"stock": {"median_ms": 4.0}, "tfmx": {"median_ms": 3.0}}}])
    >>> row["best_alternative"], row["tfmx_vs_best_alternative"]
    ({'ms': 4.0, 'mode': 'stock', 'onednn': 'on'}, {'on': 0.75})
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from bench.onednn import onednn_state
from bench.replicas import compare_replicas, several_replicas
from bench.workloads import MODES

ALTERNATIVES = ("stock", "xla")


def by_workload(results: Iterable[Mapping[str, Any]]) -> list[dict[str, Mapping[str, Any]]]:
    """Results grouped per workload (model, optimizer, policy, batch, replicas), in the order
    first seen: per workload, oneDNN state (on, off, ``?``) -> result.

    >>> groups = by_workload([{"model": "mlp", "env": {"onednn": False}},
    ...                       {"model": "gru"}, {"model": "mlp", "env": {"onednn": True}}])
    >>> [(next(iter(g.values()))["model"], list(g)) for g in groups]
    [('mlp', ['on', 'off']), ('gru', ['?'])]
    """
    groups: list[tuple[tuple, dict[str, Mapping[str, Any]]]] = []
    for r in results:
        key = (r["model"], r.get("optimizer", "adam"), r.get("policy"), r.get("batch_size"),
               r.get("replicas", 1))
        state = onednn_state(r)
        for k, by_state in groups:
            if k == key and state not in by_state:
                by_state[state] = r
                break
        else:
            groups.append((key, {state: r}))
    order = ("on", "off", "?")
    return [dict(sorted(g.items(), key=lambda item: order.index(item[0]))) for _, g in groups]


def _label(state: str, result: Mapping[str, Any]) -> str:
    """The state an alternative is named by: ``off, pool`` where oneDNN was off and every mode
    ran with TensorFlow's best-fit pool (``tfmx.host_allocator``), else the state.

    >>> _label("off", {"env": {"host_allocator": "pool"}}), _label("on", {})
    ('off, pool', 'on')
    """
    pool = (result.get("env") or {}).get("host_allocator") == "pool"
    return f"{state}, pool" if state == "off" and pool else state


def compare(results: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per workload: median ms per mode and oneDNN state, the best alternative, tfmx against it.

    The best alternative is the fastest measured of stock and XLA in every oneDNN state, and
    of a result's ``alternatives`` (mode -> state label -> ms: stock and XLA measured in
    another process of that state, as :func:`bench.allocator.attach_malloc` adds them); the
    ratios are tfmx's median over it, per state, and for tfmx's fastest state (``tfmx_best``).

    >>> def run(state, **ms):
    ...     return {"model": "mlp", "env": {"onednn": state == "on"},
    ...             "modes": {m: {"median_ms": v} for m, v in ms.items()}}
    >>> row, = compare([run("on", stock=10.0, xla=12.0, tfmx=8.0),
    ...                 run("off", stock=9.0, xla=11.0, tfmx=8.5)])
    >>> row["ms"]["stock"], row["best_alternative"]
    ({'on': 10.0, 'off': 9.0}, {'ms': 9.0, 'mode': 'stock', 'onednn': 'off'})
    >>> {s: round(v, 3) for s, v in row["tfmx_vs_best_alternative"].items()}
    {'on': 0.889, 'off': 0.944}
    >>> row["tfmx_best"]["onednn"], round(row["tfmx_best"]["vs_best_alternative"], 3)
    ('on', 0.889)
    """
    rows = []
    for by_state in by_workload(results):
        first = next(iter(by_state.values()))
        ms = {mode: {s: r["modes"][mode]["median_ms"] for s, r in by_state.items()
                     if mode in r["modes"]} for mode in MODES}
        ms = {mode: v for mode, v in ms.items() if v}
        measured = [(v, mode, _label(s, by_state[s])) for mode in ALTERNATIVES
                    for s, v in ms.get(mode, {}).items()]
        measured += [(v, mode, s) for r in by_state.values()  # measured in other processes
                     for mode, by_label in (r.get("alternatives") or {}).items()
                     if mode in ALTERNATIVES for s, v in by_label.items()]
        best = min(measured) if measured else None
        tfmx_ms = ms.get("tfmx", {})
        vs_best = {s: v / best[0] for s, v in tfmx_ms.items()} if best else {}
        tfmx_state = min(tfmx_ms, key=tfmx_ms.__getitem__) if tfmx_ms else None
        rows.append({
            "model": first["model"],
            "optimizer": first.get("optimizer", "adam"),
            "policy": first.get("policy"),
            "batch_size": first.get("batch_size"),
            "replicas": first.get("replicas", 1),
            "ms": ms,
            "best_alternative": ({"ms": best[0], "mode": best[1], "onednn": best[2]}
                                 if best else None),
            "tfmx_vs_best_alternative": vs_best,
            "tfmx_best": ({"onednn": tfmx_state, "ms": tfmx_ms[tfmx_state],
                           "vs_best_alternative": vs_best.get(tfmx_state)}
                          if tfmx_state else None),
        })
    return rows


def results_document(results: Sequence[Mapping[str, Any]],
                     onednn: str | None = None) -> dict[str, Any]:
    """What ``tfmx bench --json`` writes: the choice, every result and :func:`compare`'s rows;
    with results under several replicas, also :func:`compare_replicas`'s as ``replicas``.

    >>> sorted(results_document([], "both"))
    ['comparison', 'onednn', 'results']
    """
    document = {"onednn": onednn or "process", "results": list(results),
                "comparison": compare(results)}
    if several_replicas(results):
        document["replicas"] = compare_replicas(results)
    return document
