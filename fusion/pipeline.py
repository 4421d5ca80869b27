"""The pass pipeline: every pattern, over the main graph and every function body, safely.

``rewrite(graph_def, target)`` is a function from a GraphDef to a GraphDef (plus what happened).
Each pattern runs on each body inside a transaction: if it raises, or leaves an input that points
nowhere, that body is restored exactly as it was and the error is recorded; the other patterns
and bodies go on. Function bodies that change are renamed (``<name>_tfmx<N>``) and every reference
to them is updated, so the rewritten library never clashes with functions TensorFlow already
registered under the old names.

Example:
    >>> import tensorflow as tf
    >>> from fusion.pipeline import rewrite
    >>> from tfmx.backends import get_backend
    >>> @tf.function
    ... def f(x, w, b):
    ...     return tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w), b))
    >>> g = f.get_concrete_function(tf.TensorSpec([2, 3]), tf.TensorSpec([3, 4]),
    ...                             tf.TensorSpec([4])).graph.as_graph_def()
    >>> result = rewrite(g, get_backend("cpu"))
    >>> result.stats["contraction"].fused
    1
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Iterable

from tensorflow.core.framework import attr_value_pb2, function_pb2, graph_pb2, node_def_pb2

from fusion.family import Family, passes
from fusion.graph import FunctionBody, GraphView
from fusion.pattern import (
    REGION_NAME,
    Chooser,
    PatternStats,
    RewriteAlways,
    RewriteContext,
    Target,
)


@dataclasses.dataclass
class RewriteResult:
    """The rewritten GraphDef and what each pattern did."""

    graph_def: graph_pb2.GraphDef
    stats: dict[str, PatternStats]
    seconds: float
    renamed_functions: dict[str, str]
    skipped_functions: dict[str, str]
    control_renames: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return any(s.fused for s in self.stats.values())

    @property
    def errors(self) -> list[str]:
        return [e for s in self.stats.values() for e in s.errors]


def _run_pattern(
    pattern: Family,
    view: GraphView,
    target: Target,
    external: Iterable[str],
    total: PatternStats,
    where: str,
    tuner: Chooser,
) -> GraphView:
    """Run one pattern on one body as a transaction; return the view to go on with.

    A family whose graph part only observes (no graph pass: :meth:`Forms.observe` counts the
    units its stage emitted) edits nothing, so the view before it is the view after it: it is
    copied only where the observer fails, as the snapshot of any other pass would be."""
    read_only = getattr(pattern, "graph_pass", False) is None
    snapshot = bookkeeping = had_cycle = None
    if not read_only:
        snapshot = [n.SerializeToString() for n in view.nodes()]
        bookkeeping = GraphView(())
        bookkeeping.copy_bookkeeping(view)
        had_cycle = _has_loop(view)
    ctx = RewriteContext(target=target, stats=PatternStats(), tuner=tuner)
    try:
        pattern.run(view, ctx)
        dangling = view.dangling_inputs(external)
        if dangling:
            raise RuntimeError(f"rewrite left inputs pointing nowhere: {dangling[:3]}")
        if ctx.stats.fused and not (_has_loop(view) if had_cycle is None else had_cycle) \
                and view.cycle():
            raise RuntimeError(f"rewrite made a cycle through {view.cycle()[:3]}")
    except Exception as exc:  # noqa: BLE001 - any failure must leave the graph as it was
        if snapshot is None:  # an observer: the view is as it was
            snapshot = [n.SerializeToString() for n in view.nodes()]
            bookkeeping = view
        restored = GraphView(node_def_pb2.NodeDef.FromString(b) for b in snapshot)
        restored.copy_bookkeeping(bookkeeping)
        total.errors.append(f"{where}: {type(exc).__name__}: {exc}")
        return restored
    total.merge(ctx.stats)
    return view


_LOOP_OPS = frozenset({"NextIteration", "RefNextIteration"})


def _has_loop(view: GraphView) -> bool:
    """True if ``view`` holds a TensorFlow 1 loop's back edge (a cycle by design)."""
    return not _LOOP_OPS.isdisjoint([n.op for n in view.nodes()])


def _run_patterns(
    patterns: list[Family],
    view: GraphView,
    target: Target,
    external: Iterable[str],
    stats: dict[str, PatternStats],
    where: str,
    tuner: Chooser,
) -> tuple[GraphView, bool]:
    changed = False
    for pattern in patterns:
        before = stats[pattern.name].fused
        view = _run_pattern(pattern, view, target, external, stats[pattern.name], where, tuner)
        changed |= stats[pattern.name].fused > before
    return view, changed


def _rename_refs(attr: attr_value_pb2.AttrValue, renames: dict[str, str]) -> bool:
    hit = False
    if attr.HasField("func") and attr.func.name in renames:
        attr.func.name = renames[attr.func.name]
        hit = True
    if attr.HasField("list"):
        for fn in attr.list.func:
            if fn.name in renames:
                fn.name = renames[fn.name]
                hit = True
    return hit


def _update_references(nodes: Iterable[graph_pb2.NodeDef], renames: dict[str, str]) -> bool:
    hit = False
    for node in nodes:
        if node.op in renames:
            node.op = renames[node.op]
            hit = True
        for attr in node.attr.values():
            hit |= _rename_refs(attr, renames)
    return hit


def rewrite(
    graph_def: graph_pb2.GraphDef,
    target: Target,
    patterns: list[str] | None = None,
    protected: Iterable[str] = (),
    control_outputs: Iterable[str] = (),
    tuner: Chooser | None = None,
) -> RewriteResult:
    """Run the patterns named (all by default) over ``graph_def`` for ``target``.

    ``tuner`` decides where a family has more than one correct form (``tfmx.tuner.Tuner``
    measures them on this machine); without one every decision takes the rewritten form
    (:class:`fusion.pattern.RewriteAlways`).

    ``protected`` names main-graph nodes that must keep their name and outputs (the traced
    function's inputs and fetched outputs); ``control_outputs`` names nodes that must run. A
    pattern may replace a control output by a node doing its work; the result's
    ``control_renames`` says which. The input GraphDef is not modified.
    """
    start = time.perf_counter()
    tuner = tuner if tuner is not None else RewriteAlways()
    selected = passes(patterns)
    stats = {p.name: PatternStats() for p in selected}
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)

    view = GraphView(out.node, protected=protected, control_outputs=control_outputs)
    view, _ = _run_patterns(selected, view, target, set(), stats, "main graph", tuner)
    # Always take the view's nodes: a pass that failed after editing a node in place was
    # undone in the view (restored from its snapshot), not in ``out``.
    rebuilt = graph_pb2.GraphDef()
    rebuilt.node.extend(view.nodes())
    for field in ("versions", "library", "debug_info"):
        if out.HasField(field):
            getattr(rebuilt, field).CopyFrom(getattr(out, field))
    out = rebuilt

    library = {f.signature.name: f for f in out.library.function}
    new_bodies: dict[str, function_pb2.FunctionDef] = {}
    skipped: dict[str, str] = {}
    for name, fdef in library.items():
        if compiled_by_xla(fdef):  # XLA fuses it; a fused kernel there has no XLA lowering
            _left_to_xla(fdef, selected, stats)
            continue
        try:
            body = FunctionBody(fdef, library)
        except Exception as exc:  # noqa: BLE001 - a body we cannot read stays as it is
            skipped[name] = f"{type(exc).__name__}: {exc}"
            continue
        fview = GraphView(
            body.nodes, protected=body.protected, control_outputs=body.control_outputs,
            args=body.arg_specs,
        )
        fview, changed = _run_patterns(selected, fview, target, body.args, stats, name,
                                       tuner)
        if changed:
            try:
                new_bodies[name] = body.to_function_def(
                    fview.nodes(), library, fview.control_renames
                )
            except Exception as exc:  # noqa: BLE001
                skipped[name] = f"could not write back: {type(exc).__name__}: {exc}"
                stats[selected[0].name].errors.append(f"{name}: {exc}")

    renames = _rename_library(out, new_bodies)
    return RewriteResult(
        out, stats, time.perf_counter() - start, renames, skipped, dict(view.control_renames)
    )


XLA_REASON = ("in a function XLA must compile (jit_compile=True, as Keras compiles a grouped "
              "convolution, which has no CPU kernel): left to XLA's own fusion")


def _left_to_xla(fdef: function_pb2.FunctionDef, selected: list[Family],
                 stats: dict[str, PatternStats]) -> None:
    """Each family whose anchor ops a function XLA must compile holds declines them there,
    with :data:`XLA_REASON`; a region that is one of tfmx's own XLA forms
    (:func:`fusion.forms.xla_region`) is its family's fused form, no other family's decline."""
    if REGION_NAME in fdef.signature.name:
        return
    ops = {n.op for n in fdef.node_def}
    for pattern in selected:
        found = sorted(ops & pattern.anchors)
        if found:
            stats[pattern.name].decline(f"{'/'.join(found)} {XLA_REASON}")


def compiled_by_xla(fdef: function_pb2.FunctionDef) -> bool:
    """True for a function XLA must compile (``_XlaMustCompile``: a ``jit_compile=True``
    region and its gradient), which the passes leave as it is.

    >>> f = function_pb2.FunctionDef()
    >>> f.attr["_XlaMustCompile"].b = True
    >>> compiled_by_xla(f), compiled_by_xla(function_pb2.FunctionDef())
    (True, False)
    """
    return "_XlaMustCompile" in fdef.attr and fdef.attr["_XlaMustCompile"].b


def unused_function_name(base: str) -> str:
    """``base``, or ``base_2``, ``base_3``... : the first name no live function of this process
    holds. Names come from content, so a second rewrite of the same graph would otherwise share
    a name with a function another rebuilt step still runs, and whichever is freed first would
    remove the definition under the other."""
    from tensorflow.python.eager import context

    ctx, name, k = context.context(), base, 1
    while ctx.has_function(name):
        k += 1
        name = f"{base}_{k}"
    return name


def _rename_library(
    out: graph_pb2.GraphDef, new_bodies: dict[str, function_pb2.FunctionDef]
) -> dict[str, str]:
    """Give every changed function (and every function that calls one) a new name, made of its
    content's hash, so rewriting the same graph twice gives the same names."""
    if not new_bodies:
        return {}
    functions = {f.signature.name: f for f in out.library.function}
    functions.update(new_bodies)
    renames: dict[str, str] = {}
    pending = set(new_bodies)
    while pending:
        known = ",".join(f"{k}={v}" for k, v in sorted(renames.items()))
        for name in sorted(pending):  # named by content: the same rewrite, the same name
            digest = hashlib.sha256(functions[name].SerializeToString(deterministic=True))
            digest.update(known.encode())
            renames[name] = unused_function_name(f"{name}_tfmx_{digest.hexdigest()[:12]}")
        pending = {
            name
            for name, fdef in functions.items()
            if name not in renames
            and any(
                n.op in renames or any(_mentions(a, renames) for a in n.attr.values())
                for n in fdef.node_def
            )
        }
    del out.library.function[:]
    for name, fdef in functions.items():
        copy = out.library.function.add()
        copy.CopyFrom(fdef)
        _update_references(copy.node_def, renames)
        if name in renames:
            copy.signature.name = renames[name]
    _update_references(out.node, renames)
    for grad in out.library.gradient:
        grad.function_name = renames.get(grad.function_name, grad.function_name)
        grad.gradient_func = renames.get(grad.gradient_func, grad.gradient_func)
    return renames


def _mentions(attr: attr_value_pb2.AttrValue, names: dict[str, str]) -> bool:
    if attr.HasField("func") and attr.func.name in names:
        return True
    return attr.HasField("list") and any(f.name in names for f in attr.list.func)
