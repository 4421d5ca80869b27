"""fusion: a Grappler-style graph-rewrite engine for Keras 3 training graphs, in Python.

A pass is a function from a GraphDef to a GraphDef (:func:`fusion.rewrite`); the families it
runs are declared in one registry, :mod:`fusion.family`.

>>> import fusion
>>> "contraction" in fusion.available_patterns()
True
"""

from fusion.family import families
from fusion.graph import FunctionBody, GraphView, op_histogram
from fusion.pattern import PatternStats
from fusion.pipeline import RewriteResult, rewrite


def available_patterns() -> list[str]:
    """Names of every family (what ``tfmx.enable(patterns=..., exclude=...)`` takes), in
    pipeline order."""
    return [f.name for f in families()]


__all__ = [
    "FunctionBody",
    "GraphView",
    "PatternStats",
    "RewriteResult",
    "available_patterns",
    "op_histogram",
    "rewrite",
]
