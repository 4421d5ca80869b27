"""Print a digest of the graph tfmx rewrites for each benchmark workload, to compare revisions.

For each workload of ``bench.workloads.WORKLOADS`` named on the command line, the model is
built and its train step traced and rewritten once under ``tfmx.enable(guard=False)`` with
every decision between correct forms taking the rewritten one (``fusion.pattern.RewriteAlways``,
as the tests' ``every_rewrite`` fixture does: no timing of this machine enters the graph). It
prints one JSON line per workload: the status, and for the traced graph (``before``: after the
stages) and the rewritten one (``after``) a digest of the main graph's nodes (name, op, inputs,
device, attributes), a digest of the function library, and their counts.

Two revisions rewrite the same graphs where their lines are equal. Usage, from the root of each
revision's tree::

    python tools/rewrite_digest.py mlp small_cnn zoo_mobilenet_v3_small > digests.jsonl
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any


def graph_digest(graph_def: Any) -> dict[str, Any]:
    """Digests of ``graph_def``'s nodes (name, op, inputs, device, attributes; in name order)
    and of its library functions (serialized deterministically, sorted), and their counts."""
    nodes = sorted((n.name, n.op, tuple(n.input), n.device,
                    tuple(sorted((k, v.SerializeToString(deterministic=True))
                                 for k, v in n.attr.items())))
                   for n in graph_def.node)
    library = sorted(f.SerializeToString(deterministic=True) for f in graph_def.library.function)
    return {"nodes": hashlib.sha256(repr(nodes).encode()).hexdigest()[:16],
            "library": hashlib.sha256(repr(library).encode()).hexdigest()[:16],
            "node_count": len(nodes), "functions": len(library)}


def main(names: list[str]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tree's own packages
    import tfmx
    from bench.workloads import WORKLOADS, build_model, random_dataset
    from fusion.pattern import RewriteAlways
    from tfmx import state

    state.tuner = RewriteAlways
    for name in names:
        workload = WORKLOADS[name]
        tfmx.enable(guard=False)
        model = build_model(workload, "tfmx", 0, None)
        model.make_train_function()
        model.train_function(iter(random_dataset(workload, 8, 0)))
        record = tfmx.report().traces[-1]
        print(json.dumps({"workload": name, "status": record.status,
                          "before": graph_digest(record.graph_before),
                          "after": graph_digest(record.graph_after)}), flush=True)
        tfmx.disable()


if __name__ == "__main__":
    main(sys.argv[1:])
