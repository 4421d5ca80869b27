"""Per-trace state: what tfmx keeps about one graph while, and after, it is traced.

tfmx's stages and its tracing (``fusion.stage``, ``tfmx.staging``) keep state that belongs to
the graph being traced, one :class:`TraceState` per graph: the stage context a
``fusion.stage.tracing`` block set on it, the statistics its stages recorded for the report
and whether they reached it, the feed-forward stage's first ``Dense`` calls waiting for their
second, the names of the ops abandoned stage attempts made (read when the traced function is
rewritten) and whether bfloat16 is widened by integer operations in it. The states live in a
registry keyed weakly by the graph: nothing is set on TensorFlow's objects, and a graph's
state goes when the graph is garbage collected.

Example:
    >>> import tensorflow as tf
    >>> from fusion import trace_state
    >>> graph = tf.Graph()
    >>> trace_state.of(graph) is None  # nothing kept about it yet
    True
    >>> trace_state.of(graph, create=True).abandoned.add("dead")
    >>> trace_state.of(graph).abandoned
    {'dead'}
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Iterator
from typing import Any


class _Unset:
    """The type of :data:`UNSET`."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()
"""A :attr:`TraceState.stage_context` no ``tracing`` block set (None is a context: tfmx off)."""


@dataclasses.dataclass(eq=False)
class TraceState:
    """What tfmx keeps about one traced graph (see the module doc); found by :func:`of`.

    >>> state = TraceState()
    >>> state.stage_context, state.committed, state.abandoned
    (UNSET, False, set())
    """

    stage_context: Any = UNSET
    """The ``fusion.stage.StageContext`` of the ``tracing`` block tracing the graph (None: one
    with tfmx off); :data:`UNSET` outside one."""
    stage_stats: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    """(family, ``fusion.pattern.PatternStats``) of each stage that ran while it was traced."""
    committed: bool = False
    """Whether :attr:`stage_stats` reached the report (``tfmx.staging.commit``)."""
    feed_forward_inputs: dict[Any, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    """The feed-forward stage's first ``Dense`` calls: their output's ``ref()`` -> (layer,
    input)."""
    abandoned: set[str] = dataclasses.field(default_factory=set)
    """The names of the ops that failed stage attempts made in the graph."""
    rnn_below: dict[Any, Any] = dataclasses.field(default_factory=dict)
    """The rnn stage's layer calls another may read as its lower half of a wavefront:
    their outputs' ``ref()`` -> what the upper call needs of them."""
    integer_edges: bool | None = None
    """Whether a region traced in the graph widens bfloat16 by integer operations (the
    contributed ``fusion.forms.RegionEdges``); None: not said."""


_STATES: weakref.WeakKeyDictionary[Any, TraceState] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()  # replica threads of one step trace into the same graph
_FIELDS = frozenset(f.name for f in dataclasses.fields(TraceState))


def of(graph: Any, create: bool = False) -> TraceState | None:
    """The state of ``graph`` (a ``tf.Graph``, a FuncGraph): one object for its lifetime, made
    on the first call with ``create``; None where there is none yet (and ``create`` is
    false).

    >>> import tensorflow as tf
    >>> graph = tf.Graph()
    >>> of(graph) is None
    True
    >>> state = of(graph, create=True)
    >>> state is of(graph), state is of(graph, create=True), of(tf.Graph()) is None
    (True, True, True)
    """
    state = _STATES.get(graph)
    if state is None and create:
        with _LOCK:
            state = _STATES.get(graph)
            if state is None:
                state = _STATES[graph] = TraceState()
    return state


def enclosing(graph: Any) -> Iterator[TraceState]:
    """The states of ``graph`` and of the graphs it is traced in (its ``outer_graph``, theirs
    and so on), innermost first, skipping those with none.

    >>> import tensorflow as tf
    >>> from tensorflow.python.framework.func_graph import FuncGraph
    >>> outer = FuncGraph("outer")
    >>> with outer.as_default():
    ...     inner = FuncGraph("inner")
    >>> of(outer, create=True).committed = True
    >>> [state.committed for state in enclosing(inner)]
    [True]
    >>> of(inner, create=True) is next(enclosing(inner))
    True
    """
    while graph is not None:
        state = _STATES.get(graph)
        if state is not None:
            yield state
        graph = getattr(graph, "outer_graph", None)


@contextlib.contextmanager
def scoped(graph: Any, field: str, value: Any) -> Iterator[TraceState | None]:
    """Inside this block the state of ``graph`` has ``field`` set to ``value``, and the value it
    had before after; nothing where ``graph`` is None (no graph traced). Yields the state.

    >>> import tensorflow as tf
    >>> graph = tf.Graph()
    >>> with scoped(graph, "integer_edges", True) as state:
    ...     with scoped(graph, "integer_edges", False):
    ...         inner = of(graph).integer_edges
    ...     outer = state.integer_edges
    >>> inner, outer, of(graph).integer_edges
    (False, True, None)
    """
    if field not in _FIELDS:
        raise AttributeError(f"TraceState has no field {field!r}")
    if graph is None:
        yield None
        return
    state = of(graph, create=True)
    before = getattr(state, field)
    setattr(state, field, value)
    try:
        yield state
    finally:
        setattr(state, field, before)


__all__ = ["UNSET", "TraceState", "enclosing", "of", "scoped"]
