"""fusion: a Grappler-style graph-rewrite engine for Keras 3 training graphs, in Python.

The package reads in the order a training step meets it:

- :mod:`fusion.calls`: Keras layer calls rewritten while the step is traced, before
  differentiation (each module one family's stage, run through :mod:`fusion.stage`);
- :mod:`fusion.graphs`: passes over the traced step's GraphDef, after differentiation (each
  module one family's pass; a pass is a function from a graph to a graph, :func:`fusion.rewrite`
  runs them as transactions, :mod:`fusion.pipeline`);
- :mod:`fusion.kernels`: the fused forms' kernels both of them use (neither imports the
  other).

Every family, whichever of the two it has, is declared once in one registry,
:mod:`fusion.family`; ``tfmx`` rebuilds the step from the rewritten graph, guards it and
reports what was done.

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
