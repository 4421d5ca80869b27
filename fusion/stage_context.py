"""The context of a tfmx trace: what a stage handler knows while tfmx traces a step, and where
it is found (this thread's, or the graph's being traced: ``fusion.trace_state``).

Example:
    >>> from fusion.pattern import PlainTarget
    >>> from fusion.stage_context import StageContext, active, tracing
    >>> ctx = StageContext(PlainTarget("cpu"), families=("rnn",))
    >>> with tracing(ctx):
    ...     active() is ctx, ctx.wants("rnn"), ctx.wants("gelu")
    (True, True, False)
    >>> active() is None
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

from fusion import trace_state
from fusion.pattern import Chooser, PatternStats, Target

_local = threading.local()


@dataclasses.dataclass(frozen=True)
class StageContext:
    """What a stage handler knows while tfmx traces: the target, the chooser deciding between
    correct forms (None: the rewritten form), the families switched on (None: all), and where
    its statistics go (``record(family, stats)``)."""

    target: Target
    chooser: Chooser | None = None
    families: tuple[str, ...] | None = None
    record: Callable[[str, PatternStats], None] = lambda family, stats: None
    warn: Callable[[str, str], None] = lambda key, message: None
    xla: bool = False  # a region may be compiled by XLA (cpu, cuda; never metal)
    # The GraphDef passes the step gets, as a function from a timed candidate's traced
    # ConcreteFunction to the one to run (None: the candidate runs as traced): a form whose
    # gradient a pass rewrites in the step (a BiasAddGrad, a MatMul + BiasAdd) is timed so.
    passes: Callable[[Any], Any] | None = None
    # A handler that raises falls back to Keras's call (see :func:`transaction`); strict: the
    # exception reaches the caller instead (tests, ``tfmx.enable(strict=True)``).
    strict: bool = False

    def wants(self, family: str) -> bool:
        return self.families is None or family in self.families


def active() -> StageContext | None:
    """The context of the tfmx trace in progress on this thread, or None outside one. A thread
    that never entered :func:`tracing` (a ``MirroredStrategy`` replica thread, which traces
    each replica's part of ``strategy.run`` into its caller's graph) sees the context of the
    graph it traces into, or of the graphs that graph is traced in."""
    ctx = getattr(_local, "context", _local)
    if ctx is not _local:
        return ctx
    from tensorflow.python.framework import ops

    for state in trace_state.enclosing(ops.get_default_graph()):
        if state.stage_context is not trace_state.UNSET:
            return state.stage_context
    return None


@contextlib.contextmanager
def tracing(ctx: StageContext | None) -> Iterator[None]:
    """Inside this block (on this thread, and on the replica threads of the graph it traces),
    patched methods run their stage's handler."""
    from tensorflow.python.framework import ops

    previous = active()
    # a function's graph only: the process-wide graph of eager code is every thread's
    graph = ops.get_default_graph() if ops.inside_function() else None
    _local.context = ctx
    try:
        with trace_state.scoped(graph, "stage_context", ctx):
            yield
    finally:
        _local.context = previous


__all__ = ["StageContext", "active", "tracing"]
