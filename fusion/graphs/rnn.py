"""The rnn family's GraphDef pass: find what the rnn stage emitted, check it, report it.

The rewrite itself happens before differentiation, in the stage ``fusion.calls.rnn`` (Keras
LSTM / GRU layers -> the hoisted loop on cpu, ``CudnnRNNV3`` on GPU targets). This pass reads
the stage's name scopes in the traced graph, checks each unit's structure (a ``While`` loop, or
none for an unrolled form, on cpu; ``CudnnRNNV3`` nodes the target runs on GPU targets) and
reports it as observed: the stage reports what it rewrote, this pass what reached the graph.

It rewrites nothing, so it is not a rule (:mod:`fusion.rule`): a plain pass that finds the units
(:func:`find_rnn_units`), checks each (a broken unit is an error of the family, not a decline)
and counts it as observed.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.graphs.rnn import find_rnn_units
    >>> @tf.function
    ... def f(x):
    ...     with tf.name_scope("tfmx_rnn_lstm_unrolled"):
    ...         return tf.matmul(x, x)
    >>> g = f.get_concrete_function(tf.TensorSpec([2, 2])).graph.as_graph_def()
    >>> [(u.form.name, sorted(u.ops)) for u in find_rnn_units(GraphView(g.node))]
    [('lstm unrolled', ['MatMul'])]
"""

from __future__ import annotations

import dataclasses
import re

from fusion.family import GRADIENT_SCOPES, Form, Forms, get, register
from fusion.graph import GraphView, parse_input
from fusion.pattern import RewriteContext, Target

CUDNN_OPS = ("CudnnRNNV3", "CudnnRNNBackpropV3")
UNIT_OPS = ("While", "StatelessWhile", "CudnnRNNV3")
RUNTIME_OPS = frozenset({
    "Placeholder", "If", "StatelessIf", "While", "StatelessWhile",
    # variant containers the control-flow gradients use (cond_v2 keeps intermediates in
    # Optionals, while_v2 in TensorLists): kernels registered for every device type
    "OptionalFromValue", "OptionalGetValue", "OptionalNone", "OptionalHasValue",
    "EmptyTensorList", "TensorListReserve", "TensorListFromTensor", "TensorListPushBack",
    "TensorListPopBack", "TensorListElementShape", "TensorListStack", "TensorListGetItem",
    "TensorListSetItem", "TensorListLength",
    "VariableShape",  # a variable's shape, host memory output on every device
})
LOOP_OPS = ("While", "StatelessWhile")


@dataclasses.dataclass
class RnnUnit:
    """The nodes of one layer call the rnn stage emitted, found by its form's name scope."""

    scope: str
    form: Form  # one of the rnn family's forms (``fusion.calls.rnn``'s, read from the registry)
    ops: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # op -> node names
    grad_ops: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # its gradient's


def _scopes(forms: Forms) -> re.Pattern:
    """A name under one of ``forms``' scopes (or that scope uniquified, ``_<n>``)."""
    names = sorted((form.scope_name(forms.scope) for form in forms.all() if form.marks),
                   key=len, reverse=True)
    return re.compile(r"^(?P<prefix>.*?)(?P<scope>" + "|".join(map(re.escape, names))
                      + r")(_\d+)?/")


def find_rnn_units(view: GraphView, forms: Forms | None = None) -> list[RnnUnit]:
    """Every unit of the rnn family's ``forms`` (the registered family's by default) in
    ``view``; its gradient's nodes go to ``grad_ops``."""
    forms = get("rnn").forms if forms is None else forms
    by_scope = {form.scope_name(forms.scope): form for form in forms.all() if form.marks}
    scopes = _scopes(forms)
    units: dict[str, RnnUnit] = {}
    gradient_nodes = []
    for node in view.nodes():
        if node.name.startswith(GRADIENT_SCOPES):
            gradient_nodes.append(node)
            continue
        found = scopes.match(node.name)
        if found is None:
            continue
        scope = found.group(0)
        unit = units.setdefault(scope, RnnUnit(scope, by_scope[found.group("scope")]))
        unit.ops.setdefault(node.op, []).append(node.name)
    for node in gradient_nodes:
        found = scopes.match(node.name.split("/", 1)[1])
        if found is not None and found.group(0) in units:
            units[found.group(0)].grad_ops.setdefault(node.op, []).append(node.name)
    # A loop body traced inside the scope names its nodes after it too: a unit is where the
    # layer's loop (or cuDNN call) is, or an unrolled layer, which has no loop anywhere.
    return [u for u in units.values()
            if not u.form.marks & set(UNIT_OPS) or any(op in u.ops for op in UNIT_OPS)]


def _check_unit(view: GraphView, unit: RnnUnit, target: Target) -> tuple[str | None, str | None]:
    """(label, partial reason) for a unit, or (None, decline reason) if it is broken: an
    unrolled form has no loop and a MatMul, a looped one its loop, a cuDNN one its kernel with
    inputs, all of whose ops the target runs."""
    form = unit.form
    loops = [n for op in LOOP_OPS for n in unit.ops.get(op, ())]
    if not form.marks & set(UNIT_OPS):
        if loops or "MatMul" not in unit.ops:
            return None, f"{form.name}: an unrolled form with a loop or no MatMul under " \
                         f"{unit.scope}"
        return form.label, None
    if form.marks & set(LOOP_OPS):
        if not loops:
            return None, f"{form.name}: no recurrent loop found under {unit.scope}"
        return form.label, None
    if not any(parse_input(i)[0] in view for n in unit.ops.get("CudnnRNNV3", ())
               for i in view.node(n).input):
        return None, f"{form.name}: CudnnRNNV3 without inputs"
    missing = unlisted_ops({**unit.ops, **unit.grad_ops}, target)
    if any(op in missing for op in CUDNN_OPS):
        return None, f"{form.name}: {target.name} runs no {', '.join(missing)}"
    if missing:
        return form.label, (f"ops beside the RNN kernel not in {target.name}'s list: "
                            f"{', '.join(missing)}")
    return form.label, None


def unlisted_ops(ops, target: Target) -> list[str]:
    """Ops of ``ops`` the target's kernel list does not show.

    The metal list comes from ``strings -n 4`` of the plugin, so names of three letters or
    fewer (Mul, Sub, Sum, Neg) cannot appear in it: they are not counted as missing.
    """
    return sorted(op for op in ops if len(op) > 3 and op not in RUNTIME_OPS
                  and not target.runs_op(op))


@register(
    "rnn",
    "Keras LSTM / GRU, rewritten before differentiation by the rnn stage "
    "(fusion.calls.rnn): its units found in the traced graph, checked and reported as observed",
    after=("contraction",),
    order=("it checks each unit's ops as the contraction family left them"),
)
def rnn_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Observe the RNN units the rnn stage emitted in ``view`` (declined ones it recorded)."""
    for unit in find_rnn_units(view):  # (declined layers: the stage recorded why)
        label, why = _check_unit(view, unit, ctx.target)
        if label is None:
            ctx.stats.errors.append(f"rnn unit {unit.scope}: {why}")
        else:
            ctx.stats.observe(label, why)
