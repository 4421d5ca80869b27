"""tfmx's side of the stages (``fusion.stage``): one context for every trace tfmx makes.

:func:`staged` wraps a step's Python function so that whenever TensorFlow traces it (fit's,
evaluate's and predict's steps, ``tfmx.function``, the outer-tape path) the stages see one
:class:`~fusion.stage.StageContext` built from the options of ``tfmx.enable()``: the backend,
the tuner, the families switched on. What they rewrite is kept in the traced graph's state
(``fusion.trace_state``) and reaches ``tfmx.report()`` once per graph that runs (:func:`commit`).

Example:
    >>> import tfmx
    >>> from fusion import stage
    >>> from tfmx import staging
    >>> staging.context(None) is None
    True
    >>> tfmx.enable(backend="cpu", patterns=["rnn"])
    >>> ctx = staging.context(tfmx.state.options())
    >>> ctx.wants("rnn"), ctx.wants("batch_norm")
    (True, False)
    >>> tfmx.disable()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tensorflow.python.framework import ops
from tensorflow.python.util import tf_decorator

from fusion import stage, trace_state
from fusion.pattern import PatternStats
from tfmx import state
from tfmx.rebuild import rebuild
from tfmx.rewriting import rewrite_traced


def context(opts: state.Options | None,
            into: list | None = None) -> stage.StageContext | None:
    """The stage context of a trace under ``opts`` (None: tfmx is off, no stage runs);
    the stages' statistics are appended to ``into`` (they reach the report with
    :func:`commit`, once per traced graph, however often TensorFlow traces a function)."""
    if opts is None:
        return None
    sink = [] if into is None else into
    return stage.StageContext(
        target=opts.backend,
        chooser=state.tuner() if opts.backend.available else None,
        families=opts.patterns,
        record=lambda family, stats: sink.append((family, stats)),
        warn=state.warn_once,
        xla=opts.xla_allowed(),
        passes=fragment_passes(opts) if opts.backend.available else None,
        strict=opts.strict,
    )


def fragment_passes(opts: state.Options) -> Callable[[Any], Any]:
    """The GraphDef passes of a step under ``opts`` as a function from a ConcreteFunction to
    the rewritten one (the same one where nothing changed): what a stage's timed candidate
    (``fusion.stage.timed_form``) is run through, so that it is timed as the step runs it. Its
    decisions are the tuner's, as in the step; nothing reaches the report's traces."""
    def apply(concrete: Any) -> Any:
        result = rewrite_traced(concrete, opts)
        if not result.changed:
            return concrete
        return rebuild(concrete, result.graph_def, result.control_renames)

    return apply


def staged(fn: Callable) -> Callable:
    """``fn`` with the stages on while it is traced (tfmx wraps the functions it traces); what
    they rewrote is kept in the traced graph's state (``fusion.trace_state``) for
    :func:`commit`."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        recorded = trace_state.of(ops.get_default_graph(), create=True).stage_stats
        with stage.tracing(context(state.options(), recorded)):
            return fn(*args, **kwargs)

    return tf_decorator.make_decorator(fn, wrapper)


def commit(graph: Any) -> int:
    """Merge what the stages recorded while ``graph`` was traced into ``tfmx.report()`` (once
    per graph); the number of layers they rewrote in it."""
    held = trace_state.of(graph, create=True)
    fused = sum(stats.fused for _, stats in held.stage_stats)
    if held.committed:
        return fused
    held.committed = True
    report = state.report()
    for family, stats in held.stage_stats:
        report.patterns.setdefault(family, PatternStats()).merge(stats)
        if stats.fused:
            report.note(f"{family}: layers were rewritten before differentiation "
                        f"(fusion.calls.{family}), so a traced step's 'before' graph already "
                        "holds the fused form")
    return fused
