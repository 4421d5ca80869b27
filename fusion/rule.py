"""A graph pass as rules: what a rule matches, the check that says why it declines, what it emits.

Every match/rewrite family over the traced GraphDef has the shape of TensorFlow's remapper.cc
(``Find...()``, a check, ``Add...()``) and of ONNX Script's rewrite rules (a target pattern, a
``check`` that says whether and why, a replacement). A :class:`Rule` holds the three parts:

- ``match``: from an anchor node (a node whose op is one of ``anchors``) to a match record, or
  None where the node starts no candidate. Either an expression pattern of :mod:`fusion.expr`
  (the record is then the :class:`fusion.expr.Match` it binds), or a function
  ``(node, ctx) -> record | str | None``: a ``str`` is the reason for a candidate declined
  before any record could be made.
- ``check(record, ctx) -> str | None``: None to rewrite, else the reason it declines, as the
  report records it. Where two correct forms exist, the check asks the tuner
  (:meth:`RuleContext.tuned`).
- ``emit(view, record)``: writes the fused form (on the pass's view, or on a fragment of it the
  tuner times). A family passes ``lambda v, m: rewrite_x(v, m)``, so its module's function is
  the one looked up when the pass runs (a test may replace it to see a wrong rewrite caught).

Every candidate is matched and checked on the graph as it was, then every accepted record is
emitted, in the order the nodes were met; ``kind`` names the form each record emits in the
report (``partial``: why part of it was left, if so). A family's pass runs its rules one after
the other (:meth:`Rule.apply`) and is declared with ``fusion.family.register``.

Example:
    >>> from tensorflow.core.framework.node_def_pb2 import NodeDef
    >>> from fusion.expr import Any, Op
    >>> from fusion.graph import GraphView
    >>> from fusion.pattern import PatternStats, PlainTarget, RewriteContext
    >>> def emit(view, found):
    ...     node = NodeDef(name=found.refs["out"], op="Identity", input=[found.refs["x"]])
    ...     view.replace(found.refs["out"], node)
    >>> rule = Rule(anchors=frozenset({"Neg"}),
    ...             match=Op("Neg", Op("Neg", Any("x")), bind="out"),
    ...             check=lambda found, ctx: None, emit=emit,
    ...             kind=lambda found: "Neg(Neg(x)) -> x")
    >>> view = GraphView([NodeDef(name="x", op="Placeholder"),
    ...                   NodeDef(name="a", op="Neg", input=["x"]),
    ...                   NodeDef(name="b", op="Neg", input=["a"])])
    >>> ctx = RewriteContext(PlainTarget("toy"), PatternStats())
    >>> rule.apply(view, ctx)
    >>> ctx.stats.fused, view.node("b").op, list(view.node("b").input)
    (1, 'Identity', ['x'])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

from fusion import expr
from fusion.fragment import choose_rewrite
from fusion.graph import GraphView, NodeDef
from fusion.pattern import Chooser, RewriteContext, Target, apply_matches

M = TypeVar("M")


@dataclasses.dataclass
class RuleContext:
    """What a rule's match and check read besides the anchor: the view as it was before any
    rewrite of this rule, the target, the tuner (None: the rewritten form, untimed), the nodes
    the rule's accepted records claimed so far (:attr:`Rule.claims`) and a ``memo`` a rule
    may keep state in while it walks the graph."""

    view: GraphView
    target: Target
    tuner: Chooser | None = None
    claimed: set[str] = dataclasses.field(default_factory=set)
    memo: dict[str, Any] = dataclasses.field(default_factory=dict)

    def overlaps(self, names: Iterable[str]) -> bool:
        """True if a record accepted before claimed one of ``names``."""
        return not self.claimed.isdisjoint(names)

    def tuned(self, family: str, signature: str, nodes: Iterable[str],
              emit: Callable[[GraphView], object], stock: str, fused: str) -> str | None:
        """Why the tuner keeps ``nodes`` as they are (``stock``) rather than ``emit``'s form
        (``fused``), or None: it chose the fused form, or there is no tuner.

        >>> from fusion.pattern import PlainTarget, RewriteAlways
        >>> ctx = RuleContext(GraphView([]), PlainTarget("toy"), RewriteAlways())
        >>> ctx.tuned("toy", "sig", [], lambda view: None, "stock", "fused") is None
        True
        """
        if self.tuner is None:
            return None
        choice = choose_rewrite(self.tuner, family, signature, self.view, nodes, emit,
                                stock=stock, fused=fused)
        return choice.why() if choice.choice == stock else None


def _no_partial(record: Any) -> str | None:
    return None


def _in_order(view: GraphView) -> list[NodeDef]:
    return view.nodes()


@dataclasses.dataclass(frozen=True)
class Rule(Generic[M]):
    """One rewrite: ``match`` at each anchor node, ``check`` each record, ``emit`` the
    accepted ones (see the module doc).

    ``anchors``: the op types a match starts from (None: every node). ``claims``: the nodes an
    accepted record takes (later candidates see them in ``ctx.claimed``). ``walk``: the order
    the nodes are met in (the view's, by default). ``begin(ctx)``: None to walk the graph,
    else the reasons it is left alone (an empty list: silently). ``finish(records, ctx)``:
    a last look at the accepted records together, returning those kept and the reasons for
    the others (and for anything else the rule declines as a whole)."""

    match: expr.Pattern | Callable[[NodeDef, RuleContext], M | str | None]
    check: Callable[[M, RuleContext], str | None]
    emit: Callable[[GraphView, M], object]
    kind: Callable[[M], str]
    anchors: frozenset[str] | None = None
    partial: Callable[[M], str | None] = _no_partial
    claims: Callable[[M], Iterable[str]] | None = None
    walk: Callable[[GraphView], Iterable[NodeDef]] = _in_order
    begin: Callable[[RuleContext], list[str] | None] | None = None
    finish: Callable[[list[M], RuleContext], tuple[list[M], list[str]]] | None = None

    def _record(self, node: NodeDef, ctx: RuleContext) -> M | str | None:
        if isinstance(self.match, expr.Pattern):
            return expr.match(ctx.view, node.name, self.match)  # type: ignore[return-value]
        return self.match(node, ctx)

    def find(self, view: GraphView, target: Target, tuner: Chooser | None = None
             ) -> tuple[list[M], list[str]]:
        """The records ``view`` holds that pass the check for ``target`` (and ``tuner``), and
        the reason for each candidate declined."""
        ctx = RuleContext(view, target, tuner)
        if self.begin is not None:
            left = self.begin(ctx)
            if left is not None:
                return [], list(left)
        records: list[M] = []
        declined: list[str] = []
        for node in self.walk(view):
            if self.anchors is not None and node.op not in self.anchors:
                continue
            record = self._record(node, ctx)
            if record is None:
                continue
            why = record if isinstance(record, str) else self.check(record, ctx)
            if why is not None:
                declined.append(why)
                continue
            if self.claims is not None:
                ctx.claimed.update(self.claims(record))
            records.append(record)
        if self.finish is not None:
            records, more = self.finish(records, ctx)
            declined += more
        return records, declined

    def apply(self, view: GraphView, ctx: RewriteContext) -> None:
        """Find this rule's records in ``view`` and emit each, counted in ``ctx.stats``."""
        apply_matches(view, ctx, self.find(view, ctx.target, ctx.tuner), self.emit, self.kind,
                      self.partial)


def graph_pass(*rules: Rule) -> Callable[[GraphView, RewriteContext], None]:
    """The pass that applies ``rules`` one after the other (each sees what the one before it
    emitted); what ``fusion.family.register`` declares.

    >>> from fusion.pattern import PatternStats, PlainTarget, RewriteContext
    >>> nothing = Rule(match=lambda node, ctx: None, check=lambda r, ctx: None,
    ...                emit=lambda view, r: None, kind=str)
    >>> ctx = RewriteContext(PlainTarget("toy"), PatternStats())
    >>> graph_pass(nothing)(GraphView([]), ctx)
    >>> ctx.stats.matched
    0
    """

    def run(view: GraphView, ctx: RewriteContext) -> None:
        for rule in rules:
            rule.apply(view, ctx)

    return run


__all__ = ["Rule", "RuleContext", "graph_pass"]
