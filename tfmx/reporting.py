"""``tfmx.report()``: what was fused, what was declined and why, op histograms before and after.

Example:
    >>> from tfmx.reporting import Report
    >>> r = Report(backend="cpu")
    >>> r.to_dict()["traces"]
    []
    >>> print(r)  # doctest: +ELLIPSIS
    tfmx report (backend cpu): 0 traced function(s)...
"""

from __future__ import annotations

import collections
import dataclasses
import os
from pathlib import Path
from typing import Any

from tensorflow.core.framework import graph_pb2

from fusion.graph import op_histogram
from fusion.pattern import PatternStats
from tfmx.verdict import verdict

MAX_KEPT_GRAPHS = 32


@dataclasses.dataclass
class TraceRecord:
    """One traced function (one input signature) and what the rewrite did to it."""

    function: str
    backend: str
    status: str  # "rewritten", "unchanged", "stock: <why>", "plan only"
    seconds: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    ops_before: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    ops_after: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    errors: list[str] = dataclasses.field(default_factory=list)
    graph_before: graph_pb2.GraphDef | None = None
    graph_after: graph_pb2.GraphDef | None = None
    trace_seconds: float = 0.0  # tracing the step with the stages on (their tuning included)
    tune_seconds: float = 0.0  # the tuner's measuring, in the trace and in the rewrite
    # The step as Keras alone traces it (no stage, no rewrite), recorded beside a metal plan;
    # the placement audit falls back to ``graph_before`` where it is not.
    graph_stock: graph_pb2.GraphDef | None = None

    def as_dict(self) -> dict:
        changed = {
            op: [self.ops_before[op], self.ops_after[op]]
            for op in sorted(set(self.ops_before) | set(self.ops_after))
            if self.ops_before[op] != self.ops_after[op]
        }
        return {
            "function": self.function,
            "backend": self.backend,
            "status": self.status,
            "rewrite_seconds": round(self.seconds, 4),
            "trace_seconds": round(self.trace_seconds, 4),
            "tune_seconds": round(self.tune_seconds, 4),
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "ops_changed": changed,
            "errors": list(self.errors),
        }


@dataclasses.dataclass
class Report:
    """Everything tfmx did since ``enable()`` (or the last ``report(reset=True)``)."""

    backend: str = ""
    traces: list[TraceRecord] = dataclasses.field(default_factory=list)
    patterns: dict[str, PatternStats] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    # tfmx.tuner.Decision and tfmx.guard.StepGuard, in the order they were made
    decisions: list = dataclasses.field(default_factory=list)
    guards: list = dataclasses.field(default_factory=list)
    # tfmx's first call of a step where the price gate ran it on an estimate: the function,
    # the form, predicted_s, measured_s, measured/predicted, how it was estimated
    first_calls: list[dict] = dataclasses.field(default_factory=list)
    # a fit's step loop (tfmx.step_loop): the function, the steps a call kept, N, why, the
    # per-step medians of one and N steps a call (ms), the N-step loop's trace (s), the source
    loops: list[dict] = dataclasses.field(default_factory=list)
    # (function, form) -> how often TensorFlow traced the user's step function for that form
    # ("stages": the one tfmx rewrites; "stock": the guard's and verify's reference; "taped":
    # under an outer tape; "xla": the guard's XLA form)
    python_traces: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # The metal backend (tfmx.backends.Backend) the traces were planned for, set by
    # tfmx.state with the options: the placement section audits them for it.
    metal: Any = None
    # tfmx.enable(fuse=...) (tfmx.env.FUSE_MODES): "always" runs every family's fused form
    fuse: str = "measured"
    # function -> why the price gate runs it as stock, in a few words (the first line's reason)
    gates: dict[str, str] = dataclasses.field(default_factory=dict)

    # -- recording -------------------------------------------------------------------------
    def add_trace(self, record: TraceRecord, stats: dict[str, PatternStats] | None = None) -> None:
        self.traces.append(record)
        for name, s in (stats or {}).items():
            self.patterns.setdefault(name, PatternStats()).merge(s)
        kept = [t for t in self.traces if t.graph_before is not None]
        for old in kept[:-MAX_KEPT_GRAPHS]:
            old.graph_before = old.graph_after = old.graph_stock = None

    def add_decision(self, decision: object) -> None:
        """Record one tuner decision (:class:`tfmx.tuner.Decision`)."""
        self.decisions.append(decision)

    def add_guard(self, guard: object) -> None:
        """Follow a whole-step guard (:class:`tfmx.guard.StepGuard`): the report shows its
        trial as it stands when printed."""
        self.guards.append(guard)

    def count_trace(self, function: str, form: str) -> None:
        """One more trace of ``function``'s Python for ``form`` (see :attr:`python_traces`)."""
        self.python_traces[(function, form)] += 1

    def traces_of(self, function: str) -> int:
        """How often the Python of ``function`` was traced, every form counted.

        >>> report = Report()
        >>> report.count_trace("M.train_step", "stages")
        >>> report.count_trace("M.train_step", "stock")
        >>> report.traces_of("M.train_step")
        2
        """
        return sum(n for (name, _), n in self.python_traces.items() if name == function)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    # -- reading ---------------------------------------------------------------------------
    def op_histogram(self) -> tuple[collections.Counter, collections.Counter]:
        """Op counts over every traced function, before and after the rewrite."""
        before: collections.Counter = collections.Counter()
        after: collections.Counter = collections.Counter()
        for t in self.traces:
            before.update(t.ops_before)
            after.update(t.ops_after)
        return before, after

    def fused(self, pattern: str | None = None) -> int:
        """How many chains/updates were fused (by one pattern, or all)."""
        return sum(s.fused for n, s in self.patterns.items() if pattern in (None, n))

    def placement(self) -> list[tuple[TraceRecord, Any]]:
        """Each kept trace's placement audit (:class:`tfmx.placement.Audit`: stock, or the
        trace as tfmx's stages left it where stock was not recorded, against the plan) for
        the metal backend it was planned for; empty for other backends.

        >>> Report(backend="cpu").placement()
        []
        """
        if self.metal is None:
            return []
        from tfmx.placement import compare

        audits = []
        for t in self.traces:
            stock = t.graph_stock if t.graph_stock is not None else t.graph_before
            if stock is not None and t.graph_after is not None:
                audits.append((t, compare(stock, t.graph_after, self.metal)))
        return audits

    def placement_lines(self) -> list[str]:
        """The placement section as printed (empty off metal; a line saying why where the
        audit could not be made: a report never fails on it).

        >>> Report(backend="cpu").placement_lines()
        []
        """
        try:
            audits = self.placement()
        except Exception as exc:  # noqa: BLE001 - a report never fails on its audit
            return [f"placement not audited: {type(exc).__name__}: {exc}"]
        lines = []
        for t, audit in audits:
            label = "stock" if t.graph_stock is not None else "traced"
            lines += ["", f"{t.function}:", *audit.lines(label)]
        return lines

    def _placement_dict(self) -> list[dict]:
        try:
            audits = self.placement()
        except Exception as exc:  # noqa: BLE001 - a report never fails on its audit
            return [{"error": f"{type(exc).__name__}: {exc}"}]

        def side(placed: Any) -> dict:
            return {"host_ops": dict(placed.host_ops()), "crossings": len(placed.crossings),
                    "crossing_bytes": placed.crossing_bytes()}

        return [{"function": t.function, "backend": a.backend,
                 "stock": "stock" if t.graph_stock is not None else "traced",
                 "before": side(a.stock), "tfmx": side(a.tfmx),
                 "moved_to_host": [f"{p.op} {p.name}" for p in a.moved]} for t, a in audits]

    def to_dict(self) -> dict:
        before, after = self.op_histogram()
        return {
            "backend": self.backend,
            "patterns": {n: s.as_dict() for n, s in self.patterns.items()},
            "traces": [t.as_dict() for t in self.traces],
            "op_histogram": {
                op: {"before": before[op], "after": after[op]}
                for op in sorted(set(before) | set(after))
            },
            "decisions": [d.as_dict() for d in self.decisions],
            "guards": [dataclasses.asdict(g.summary()) for g in self.guards],
            "first_calls": [dict(f) for f in self.first_calls],
            "loops": [dict(loop) for loop in self.loops],
            "python_traces": {f"{name} ({form})": n
                              for (name, form), n in self.python_traces.items()},
            "placement": self._placement_dict(),
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        lines = [*filter(None, [verdict(self)]),  # the step kept, its time, what measuring cost
                 f"tfmx report (backend {self.backend}): {len(self.traces)} traced function(s)"]
        if self.traces:
            lines.append("")
            lines.append(f"{'function':<28} {'status':<24} {'nodes':>13} {'rewrite s':>10} "
                         f"{'trace s':>8} {'tuning s':>9}")
            for t in self.traces:
                nodes = f"{t.nodes_before}->{t.nodes_after}"
                lines.append(f"{t.function[:28]:<28} {t.status[:24]:<24} {nodes:>13} "
                             f"{t.seconds:>10.3f} {t.trace_seconds:>8.3f} "
                             f"{t.tune_seconds:>9.3f}")
        if self.patterns:
            lines.append("")
            width = max(14, *(len(name) for name in self.patterns))
            lines.append(f"{'pattern':<{width}} {'matched':>8} {'fused':>6} {'declined':>9}")
            for name, s in self.patterns.items():
                lines.append(f"{name:<{width}} {s.matched:>8} {s.fused:>6} "
                             f"{sum(s.declined.values()):>9}")
                for kind, n in sorted(s.fused_kinds.items()):
                    lines.append(f"  fused     {n:>4} x {kind}")
                for kind, n in sorted(s.observed.items()):
                    lines.append(f"  observed  {n:>4} x {kind} (in the traced graph)")
                for why, n in sorted(s.partial.items()):
                    lines.append(f"  partial   {n:>4} x {why}")
                for why, n in sorted(s.declined.items()):
                    lines.append(f"  declined  {n:>4} x {why}")
                for err in s.errors:
                    lines.append(f"  undone    {err}")
        before, after = self.op_histogram()
        changed = [op for op in sorted(set(before) | set(after)) if before[op] != after[op]]
        if changed:
            lines.append("")
            lines.append(f"{'op':<32} {'before':>7} {'after':>7}")
            for op in changed:
                lines.append(f"{op:<32} {before[op]:>7} {after[op]:>7}")
        if self.decisions:
            lines.append("")
            lines.append("tuned (choice, how it was decided, median time of each candidate):")
            for d in self.decisions:
                lines.append(f"  {d.describe()}")
        if self.guards:
            lines.append("")
            lines.append("whole-step guard (fused vs stock on the first real steps):")
            for g in self.guards:
                lines.append(f"  {g.summary().describe()}")
        if self.python_traces:
            lines.append("")
            lines.append("traces of each step function's Python (by form):")
            for name in dict.fromkeys(name for name, _ in self.python_traces):
                forms = ", ".join(f"{form} {n}" for (other, form), n in
                                  self.python_traces.items() if other == name)
                lines.append(f"  {name}: {self.traces_of(name)} ({forms})")
        lines += self.placement_lines()
        for t in self.traces:
            for err in t.errors:
                lines.append(f"note: {t.function}: {err}")
        for text in self.notes:
            lines.append(f"note: {text}")
        return "\n".join(lines)

    def export_graphs(self, logdir: str | os.PathLike) -> list[Path]:
        """Write each kept trace's graph before and after, for TensorBoard and as text.

        Layout: ``logdir/<n>_<function>/before`` and ``/after`` hold TensorBoard event files
        (``tensorboard --logdir LOGDIR``, Graphs tab), beside ``before.pbtxt``/``after.pbtxt``.
        Returns the directories written.
        """
        import tensorflow as tf

        root = Path(logdir)
        written = []
        for i, t in enumerate(self.traces):
            if t.graph_before is None:
                continue
            base = root / f"{i:02d}_{t.function.replace('/', '_')}"
            for label, g in (("before", t.graph_before), ("after", t.graph_after)):
                if g is None:
                    continue
                (base / label).mkdir(parents=True, exist_ok=True)
                writer = tf.summary.create_file_writer(str(base / label))
                with writer.as_default():
                    tf.summary.graph(g)
                writer.close()
                (base / f"{label}.pbtxt").write_text(str(g))
            written.append(base)
        return written


def histogram(graph_def: graph_pb2.GraphDef) -> collections.Counter:
    """Op histogram over a GraphDef and its function library."""
    return op_histogram(graph_def)
