"""Per-trace state: what tfmx keeps about one graph while, and after, it is traced.

tfmx's stages and its tracing (``fusion.stage``, ``tfmx.staging``) keep state that belongs to
the graph being traced, one :class:`TraceState` per graph: the stage context a
``fusion.stage.tracing`` block set on it, the statistics its stages recorded for the report
and whether they reached it, the names of the ops abandoned stage attempts made and of those a
stage took over (both read when the traced function is rewritten), and one slot per family (or
contributing module) that keeps something of its own about the graph (:func:`slot`,
:func:`scoped_slot`). The states live in a registry keyed weakly by the graph: nothing is set
on TensorFlow's objects, and a graph's state goes when the graph is garbage collected.

Example:
    >>> import tensorflow as tf
    >>> from fusion import trace_state
    >>> graph = tf.Graph()
    >>> trace_state.of(graph) is None  # nothing kept about it yet
    True
    >>> trace_state.of(graph, create=True).abandoned.add("dead")
    >>> trace_state.of(graph).abandoned
    {'dead'}
    >>> trace_state.slot(graph, "demo")["seen"] = 1  # a family's own slot
    >>> trace_state.slot(graph, "demo")
    {'seen': 1}
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator
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
    >>> state.stage_context, state.committed, state.abandoned, state.superseded
    (UNSET, False, set(), set())
    """

    stage_context: Any = UNSET
    """The ``fusion.stage.StageContext`` of the ``tracing`` block tracing the graph (None: one
    with tfmx off); :data:`UNSET` outside one."""
    stage_stats: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    """(family, ``fusion.pattern.PatternStats``) of each stage that ran while it was traced."""
    committed: bool = False
    """Whether :attr:`stage_stats` reached the report (``tfmx.staging.commit``)."""
    abandoned: set[str] = dataclasses.field(default_factory=set)
    """The names of the ops that failed stage attempts made in the graph."""
    superseded: set[str] = dataclasses.field(default_factory=set)
    """The names of the ops a stage took over from an earlier call that succeeded (an
    activation a gated product computes itself): read by nobody once the stage's form is
    emitted."""
    slots: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What a family (or a contributing module) keeps about the graph, by its owner's name
    (:func:`slot`): only that owner reads or writes its slot."""


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
    >>> with scoped(graph, "committed", True) as state:
    ...     with scoped(graph, "committed", False):
    ...         inner = of(graph).committed
    ...     outer = state.committed
    >>> inner, outer, of(graph).committed
    (False, True, False)
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


def slot(graph: Any, owner: str, factory: Callable[[], Any] = dict) -> Any:
    """The slot ``owner`` keeps in ``graph``'s state: made by ``factory`` on first use.

    >>> import tensorflow as tf
    >>> graph = tf.Graph()
    >>> slot(graph, "demo", list).append("x")
    >>> slot(graph, "demo"), held(graph, "other")
    (['x'], None)
    """
    state = of(graph, create=True)
    with _LOCK:
        if owner not in state.slots:
            state.slots[owner] = factory()
        return state.slots[owner]


def held(graph: Any, owner: str) -> Any:
    """The slot ``owner`` keeps in ``graph``'s state, or None where it has none (nothing
    made)."""
    state = _STATES.get(graph)
    return None if state is None else state.slots.get(owner)


@contextlib.contextmanager
def scoped_slot(graph: Any, owner: str, value: Any) -> Iterator[None]:
    """Inside this block ``owner``'s slot in ``graph``'s state is ``value``, and what it was
    after (absent: absent again); nothing where ``graph`` is None.

    >>> import tensorflow as tf
    >>> graph = tf.Graph()
    >>> with scoped_slot(graph, "demo", True):
    ...     inside = held(graph, "demo")
    >>> inside, held(graph, "demo")
    (True, None)
    """
    if graph is None:
        yield
        return
    state = of(graph, create=True)
    missing = object()
    before = state.slots.get(owner, missing)
    state.slots[owner] = value
    try:
        yield
    finally:
        if before is missing:
            state.slots.pop(owner, None)
        else:
            state.slots[owner] = before


__all__ = ["UNSET", "TraceState", "enclosing", "held", "of", "scoped", "scoped_slot", "slot"]
