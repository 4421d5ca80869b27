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
    >>> [(u.tag, sorted(u.ops)) for u in find_rnn_units(GraphView(g.node))]
    [('lstm_unrolled', ['MatMul'])]
"""

from __future__ import annotations

import dataclasses
import re

from fusion.calls.rnn import KIND_LABELS, SCOPE
from fusion.family import GRADIENT_SCOPES, register
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
_SCOPE_RE = re.compile(r"^(?P<prefix>.*?)" + SCOPE + r"(?P<tag>[A-Za-z_]+?)(_\d+)?/")


@dataclasses.dataclass
class RnnUnit:
    """The nodes of one layer call the forward stage handled, found by its name scope."""

    scope: str
    tag: str  # a kind ("lstm", "gru", "gru_reset_before") or "declined_<code>"
    ops: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # op -> node names
    grad_ops: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # its gradient's


def find_rnn_units(view: GraphView) -> list[RnnUnit]:
    """Every forward-stage scope in ``view``; its gradient's nodes go to ``grad_ops``."""
    units: dict[str, RnnUnit] = {}
    gradient_nodes = []
    for node in view.nodes():
        if node.name.startswith(GRADIENT_SCOPES):
            gradient_nodes.append(node)
            continue
        found = _SCOPE_RE.match(node.name)
        if found is None:
            continue
        scope = found.group(0)
        unit = units.setdefault(scope, RnnUnit(scope, found.group("tag")))
        unit.ops.setdefault(node.op, []).append(node.name)
    for node in gradient_nodes:
        found = _SCOPE_RE.match(node.name.split("/", 1)[1])
        if found is not None and found.group(0) in units:
            units[found.group(0)].grad_ops.setdefault(node.op, []).append(node.name)
    # A loop body traced inside the scope names its nodes after it too: a unit is where the
    # layer's loop (or cuDNN call) is, or an unrolled layer, which has no loop anywhere.
    return [u for u in units.values()
            if u.tag.endswith("unroll") or u.tag.endswith(UNROLLED_FORMS)
            or any(op in u.ops for op in UNIT_OPS)]


UNROLLED_FORMS = ("_keras_unrolled", "_wavefront", "_unrolled")  # scope suffixes, longest first


def _kind_form(unit: RnnUnit) -> tuple[str, str]:
    """(kind, form) of a fused unit from its scope's tag and ops."""
    for suffix in UNROLLED_FORMS:
        if unit.tag.endswith(suffix):
            return unit.tag[: -len(suffix)], suffix[1:]
    return unit.tag, "cudnn" if "CudnnRNNV3" in unit.ops else "hoisted"


def _check_unit(view: GraphView, unit: RnnUnit, target: Target) -> tuple[str | None, str | None]:
    """(label, partial reason) for a fused unit, or (None, decline reason) if it is broken."""
    kind, form = _kind_form(unit)
    label = KIND_LABELS.get((kind, form))
    if label is None:
        return None, f"{kind}: unexpected {form} form"
    if form in ("unrolled", "keras_unrolled", "wavefront"):
        loops = [n for op in ("While", "StatelessWhile") for n in unit.ops.get(op, ())]
        if loops or "MatMul" not in unit.ops:
            return None, f"{kind}: {form} form with a loop or no MatMul under {unit.scope}"
        return label, None
    if form == "hoisted":
        loops = [n for op in ("While", "StatelessWhile") for n in unit.ops.get(op, ())]
        if not loops:
            return None, f"{kind}: no recurrent loop found under {unit.scope}"
        return label, None
    if not any(parse_input(i)[0] in view for n in unit.ops["CudnnRNNV3"]
               for i in view.node(n).input):
        return None, f"{kind}: CudnnRNNV3 without inputs"
    missing = unlisted_ops({**unit.ops, **unit.grad_ops}, target)
    if any(op in missing for op in CUDNN_OPS):
        return None, f"{kind}: {target.name} runs no {', '.join(missing)}"
    if missing:
        return label, f"ops beside the RNN kernel not in {target.name}'s list: {', '.join(missing)}"
    return label, None


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
    for unit in find_rnn_units(view):
        if unit.tag.startswith("declined_"):
            continue  # the stage recorded why when it traced the layer
        label, why = _check_unit(view, unit, ctx.target)
        if label is None:
            ctx.stats.errors.append(f"rnn unit {unit.scope}: {why}")
        else:
            ctx.stats.observe(label, why)
