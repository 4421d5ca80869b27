"""fusion: a Grappler-style graph-rewrite engine for Keras 3 training graphs, in Python.

A pass is a function from a GraphDef to a GraphDef (:func:`fusion.rewrite`); each pattern
family is one module under :mod:`fusion.patterns`.

>>> import fusion
>>> "contraction" in fusion.available_patterns()
True
"""

from fusion.graph import FunctionBody, GraphView, op_histogram
from fusion.pattern import PatternStats, registered
from fusion.pipeline import RewriteResult, rewrite


def available_patterns() -> list[str]:
    """Names of every registered pattern family, in pipeline order."""
    return list(registered())


__all__ = [
    "FunctionBody",
    "GraphView",
    "PatternStats",
    "RewriteResult",
    "available_patterns",
    "op_histogram",
    "rewrite",
]
