"""Helpers the test modules share (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations


def ops_that_ran(fn) -> set[str]:
    """Op types in every graph (and function library) Keras's step function traced."""
    fn = getattr(fn, "__wrapped__", fn)
    ops: set[str] = set()
    candidates = [fn] + [c.cell_contents for c in getattr(fn, "__closure__", None) or ()]
    for target in candidates:
        if hasattr(target, "_list_all_concrete_functions"):
            for cf in target._list_all_concrete_functions():
                g = cf.graph.as_graph_def()
                ops.update(n.op for n in g.node)
                for f in g.library.function:
                    ops.update(n.op for n in f.node_def)
    return ops


def exact_patterns() -> list[str]:
    """Every registered family but ``onednn``, which runs convolutions on oneDNN's kernels and
    so changes float32 summation order (tests/test_onednn.py holds it to its own tolerance).
    What these give must equal stock elementwise."""
    from fusion.pattern import registered

    return [name for name in registered() if name != "onednn"]
