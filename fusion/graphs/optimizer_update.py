"""Optimizer updates: Keras 3's composite per-variable update → one ``ResourceApply*`` kernel.

Keras 3 writes every optimizer step as small ops per variable (Sub, Mul, Square, Sqrt, RealDiv,
AssignAdd/AssignSub...). Each supported optimizer is a :class:`Spec`: the writes its
``update_step`` makes (slot updates, then the variable's own), as expressions
(:mod:`fusion.expr`), the checks on the constants it bakes in, and how they feed the kernel.
Matching is structural: op types, edges, the resource handles written and read (a read must
follow the write it depends on), never node names. A match whose constants disagree with what
the kernel computes, whose intermediate values are used elsewhere, or whose kernel the target
backend lacks is declined with the reason.

The fused node takes every control input of the ops it replaces, and every control consumer of
those ops (and the function's control outputs) now points at it, so ordering against other
reads and writes of the same variables is kept.

One rule (:mod:`fusion.rule`), as every family: its match starts from a variable's own write
and tries each spec in turn (an :class:`UpdateMatch`: what it bound, the nodes the kernel
replaces; a spec with no kernel declines there), its check says why Keras's composite stays
(the target's kernels, the constants, readers outside the update, the tuner), a last look adds
the optimizers it knows by name and does not fuse, :func:`rewrite_update` writes the kernel.

Example:
    >>> import numpy as np, tensorflow as tf, keras
    >>> from fusion.pipeline import rewrite
    >>> from tfmx.backends import get_backend
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> model.compile(keras.optimizers.Adam(), "mse")
    >>> step = tf.function(model.train_step).get_concrete_function(
    ...     (tf.TensorSpec([4, 3]), tf.TensorSpec([4, 2])))
    >>> result = rewrite(step.graph.as_graph_def(add_shapes=True), get_backend("cuda"),
    ...                  ["optimizer_update"],
    ...                  control_outputs=[op.name for op in step.graph.control_outputs])
    >>> result.stats["optimizer_update"].fused_kinds
    Counter({'Adam': 2})
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
from collections.abc import Callable

import numpy as np
import tensorflow as tf
from tensorflow.core.framework.attr_value_pb2 import AttrValue
from tensorflow.core.framework.node_def_pb2 import NodeDef
from tensorflow.python.framework import op_def_registry

from fusion.expr import Any, Const, Match, Op, Pattern, Read, match, norm_ref
from fusion.family import register
from fusion.graph import GraphView, output_shape, parse_input
from fusion.match import const_node, fused_node
from fusion.pattern import Chooser, RewriteContext, Target
from fusion.rule import Rule, RuleContext

WRITE_OPS = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})
RTOL = 1e-6  # how closely a baked-in constant must equal what the kernel computes
# The kernels compute 1 - beta themselves, in the variable's dtype. In float32 that cannot come
# closer to Keras's rounded constant than half a step of float32 near 1.0 (2**-24): for
# beta_2=0.999 the kernel's 1 - beta_2 is 1.3e-5 relative away from Keras's 0.001. Accept that
# rounding for float32/float64 variables (it moves the second-moment slot by as much, the
# weights by far less); demand RTOL otherwise.
ONE_MINUS_ATOL = 2.0**-24


@dataclasses.dataclass(frozen=True)
class Scalar(Pattern):
    """A rank-0 tensor that is not a constant (a learning rate): needed where the kernel
    takes a scalar and the composite's Mul would let a tensor take its place."""

    name: str


@dataclasses.dataclass(frozen=True)
class Write:
    """One variable write of an update: the handle it writes, the op, the value expression."""

    slot: str
    op: str
    value: Pattern


@dataclasses.dataclass(frozen=True)
class Spec:
    """A Keras optimizer's update and the kernel computing it (None: declined with ``why``)."""

    optimizer: str
    kernel: str | None
    writes: tuple[Write, ...]
    inputs: tuple[str, ...] = ()  # kernel inputs: bound refs, or "=name" for a bound constant
    checks: tuple[tuple[str, Callable[[dict[str, float]], float]], ...] = ()
    extra: tuple[tuple[str, Pattern], ...] = ()  # bound refs that must match these too
    attrs: tuple[tuple[str, bool], ...] = ()
    why: str = ""


# -- match: the specs, one per Keras update_step form (keras/src/optimizers/*.py) ----------
G = Any("grad")


def _w(slot: str, op: str, value: Pattern) -> Write:
    return Write(slot, op, value)


def _after(slot: str) -> Read:
    return Read(slot, after=f"write_{slot}")


def _one_minus(name: str) -> tuple[str, Callable[[dict[str, float]], float]]:
    return (f"one_minus_{name}", lambda v: 1.0 - v[name])


def _power(beta: str) -> Op:
    return Op("Pow", Const(beta), Any("step"), bind=f"{beta}_power")


_ALPHA = Op(
    "RealDiv",
    Op("Mul", Scalar("lr"), Op("Sqrt", Op("Sub", Const("one"), _power("beta_2")))),
    Op("Sub", Const("one"), _power("beta_1")),
)
_ADAM_M = _w("m", "AssignAddVariableOp",
             Op("Mul", Op("Sub", G, Read("m")), Const("one_minus_beta_1")))
_ADAM_V = _w("v", "AssignAddVariableOp",
             Op("Mul", Op("Sub", Op("Square", G), Read("v")), Const("one_minus_beta_2")))
_ADAM_CHECKS = (("one", lambda v: 1.0), _one_minus("beta_1"), _one_minus("beta_2"))
_ADAM_SCALARS = ("beta_1_power", "beta_2_power", "lr", "=beta_1", "=beta_2", "=epsilon", "grad")


def _adam_var(v_slot: str) -> Write:
    return _w("var", "AssignSubVariableOp", Op(
        "RealDiv",
        Op("Mul", _after("m"), Any("alpha")),
        Op("AddV2", Op("Sqrt", _after(v_slot)), Const("epsilon")),
    ))


_SGD_STEP = Op("Mul", G, Scalar("lr"))
_RMS_V = _w("v", "AssignVariableOp", Op(
    "AddV2", Op("Mul", Const("rho"), Read("v")), Op("Mul", Const("one_minus_rho"), Op("Square", G))
))
_RMS_MG = _w("mg", "AssignVariableOp", Op(
    "AddV2", Op("Mul", Const("rho"), Read("mg")), Op("Mul", Const("one_minus_rho"), G)
))
_RMS_CHECKS = (_one_minus("rho"),)


def _rms_increment(centered: bool) -> Op:
    ms = (
        Op("Sub", _after("v"), Op("Square", _after("mg"))) if centered else _after("v")
    )
    return Op("RealDiv", Op("Mul", Scalar("lr"), G),
              Op("Sqrt", Op("AddV2", ms, Const("epsilon"))))


def _rms_momentum(centered: bool) -> Write:
    return _w("mom", "AssignVariableOp", Op(
        "AddV2", Op("Mul", Const("momentum"), Read("mom")), _rms_increment(centered)
    ))


_MOMENTUM_SLOT = (
    "ResourceApplyRMSProp always updates a momentum slot, and Keras's RMSprop(momentum=0) "
    "has none"
)
_ADADELTA_DELTA = Op("Neg", Op(
    "RealDiv",
    Op("Mul", Op("Sqrt", Op("AddV2", Read("ad"), Const("epsilon"))), G),
    Op("Sqrt", Op("AddV2", _after("ag"), Const("epsilon"))),
), bind="delta")

SPECS: tuple[Spec, ...] = (
    Spec("Adam", "ResourceApplyAdam", (_ADAM_M, _ADAM_V, _adam_var("v")),
         ("var", "m", "v") + _ADAM_SCALARS, _ADAM_CHECKS, (("alpha", _ALPHA),),
         (("use_nesterov", False),)),
    Spec("Adam(amsgrad=True)", "ResourceApplyAdamWithAmsgrad", (
        _ADAM_M, _ADAM_V,
        _w("vhat", "AssignVariableOp", Op("Maximum", Read("vhat"), _after("v"))),
        _adam_var("vhat"),
    ), ("var", "m", "v", "vhat") + _ADAM_SCALARS, _ADAM_CHECKS, (("alpha", _ALPHA),)),
    # Decoupled weight decay (AdamW, any optimizer's weight_decay=): var -= var * wd * lr,
    # claimed first so it is not taken for an SGD step; it stays as it is (one Mul, one write).
    Spec("weight decay", None, (_w("var", "AssignSubVariableOp", Op(
        "Mul", Op("Mul", Read("var"), Const("weight_decay")), Scalar("lr"))),)),
    Spec("SGD", "ResourceApplyGradientDescent",
         (_w("var", "AssignSubVariableOp", _SGD_STEP),), ("var", "lr", "grad")),
    Spec("SGD(momentum)", "ResourceApplyKerasMomentum", (
        _w("m", "AssignVariableOp", Op("Sub", Op("Mul", Read("m"), Const("momentum")), _SGD_STEP)),
        _w("var", "AssignAddVariableOp", _after("m")),
    ), ("var", "m", "lr", "grad", "=momentum"), attrs=(("use_nesterov", False),)),
    Spec("SGD(nesterov=True)", "ResourceApplyKerasMomentum", (
        _w("m", "AssignVariableOp", Op("Sub", Op("Mul", Read("m"), Const("momentum")), _SGD_STEP)),
        _w("var", "AssignAddVariableOp",
           Op("Sub", Op("Mul", _after("m"), Const("momentum")), _SGD_STEP)),
    ), ("var", "m", "lr", "grad", "=momentum"), attrs=(("use_nesterov", True),)),
    Spec("RMSprop(momentum)", "ResourceApplyRMSProp",
         (_RMS_V, _rms_momentum(False), _w("var", "AssignSubVariableOp", _after("mom"))),
         ("var", "v", "mom", "lr", "=rho", "=momentum", "=epsilon", "grad"), _RMS_CHECKS),
    Spec("RMSprop(centered, momentum)", "ResourceApplyCenteredRMSProp",
         (_RMS_V, _RMS_MG, _rms_momentum(True), _w("var", "AssignSubVariableOp", _after("mom"))),
         ("var", "mg", "v", "mom", "lr", "=rho", "=momentum", "=epsilon", "grad"), _RMS_CHECKS),
    Spec("RMSprop", None, (_RMS_V, _w("var", "AssignSubVariableOp", _rms_increment(False))),
         why=_MOMENTUM_SLOT),
    Spec("RMSprop(centered)", None,
         (_RMS_V, _RMS_MG, _w("var", "AssignSubVariableOp", _rms_increment(True))),
         why=_MOMENTUM_SLOT),
    Spec("Adadelta", "ResourceApplyAdadelta", (
        _w("ag", "AssignVariableOp", Op(
            "AddV2", Op("Mul", Const("rho"), Read("ag")),
            Op("Mul", Const("one_minus_rho"), Op("Square", G)))),
        _w("ad", "AssignVariableOp", Op(
            "AddV2", Op("Mul", Const("rho"), Read("ad")),
            Op("Mul", Const("one_minus_rho"), Op("Square", Any("delta"))))),
        _w("var", "AssignAddVariableOp", Op("Mul", Scalar("lr"), _ADADELTA_DELTA)),
    ), ("var", "ag", "ad", "lr", "=rho", "=epsilon", "grad"), _RMS_CHECKS),
    Spec("Adamax", "ResourceApplyAdaMax", (
        _ADAM_M,
        _w("v", "AssignVariableOp",
           Op("Maximum", Op("Mul", Const("beta_2"), Read("v")), Op("Abs", G))),
        _w("var", "AssignSubVariableOp", Op(
            "RealDiv", Op("Mul", Scalar("lr"), _after("m")),
            Op("Mul", Op("Sub", Const("one"), _power("beta_1")),
               Op("AddV2", _after("v"), Const("epsilon"))))),
    ), ("var", "m", "v", "beta_1_power", "lr", "=beta_1", "=beta_2", "=epsilon", "grad"),
        (("one", lambda v: 1.0), _one_minus("beta_1"))),
    Spec("Adagrad", None, (
        _w("acc", "AssignAddVariableOp", Op("Square", G)),
        _w("var", "AssignSubVariableOp", Op(
            "RealDiv", Op("Mul", Scalar("lr"), G),
            Op("Sqrt", Op("AddV2", _after("acc"), Const("epsilon"))))),
    ), why=(
        "Keras's Adagrad divides by sqrt(accumulator + epsilon), ResourceApplyAdagradV2 by "
        "sqrt(accumulator) + epsilon: the kernel's math differs"
    )),
)

# Keras optimizers this family fuses, by their default name (the ops' name scope).
FUSABLE = {
    "adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "rmsprop": "RMSprop",
    "adadelta": "Adadelta", "adamax": "Adamax",
}
SPARSE_OPS = frozenset({"UnsortedSegmentSum", "SparseSegmentSum", "ScatterNd"})
SPARSE_WRITES = frozenset({"ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterUpdate"})
# Keras optimizers with no kernel at all, by their default name (the ops' name scope).
NO_KERNEL = {
    "nadam": "Nadam", "lion": "Lion", "adafactor": "Adafactor", "ftrl": "Ftrl",
    "lamb": "Lamb", "muon": "Muon",
}


# -- match: a spec at a variable's own write ------------------------------------------------
@dataclasses.dataclass
class UpdateMatch:
    """One variable's update: the spec, what it bound, the nodes the kernel replaces (and
    ``blocked``: why they cannot all go, a variable read or write used elsewhere)."""

    spec: Spec
    found: Match
    anchor: str
    dtype: int
    remove: list[str]
    stateful: list[str]
    blocked: str | None = None


def _match_scalar(view: GraphView, ref: str, name: str, found: Match) -> Match | None:
    node = view.node(ref)
    if node is None or node.op == "Const":
        return None
    if output_shape(node, parse_input(ref)[1]) != ():
        return None
    return match(view, ref, Any(name), found)


@functools.cache  # patterns are frozen: each spec's trees are resolved once
def _resolve_scalars(pattern: Pattern) -> Pattern:
    """Scalar pieces become Any (the shape check runs after matching, on the bound refs)."""
    if isinstance(pattern, Scalar):
        return Any(pattern.name)
    if isinstance(pattern, Op):
        return Op(pattern.ops, *(_resolve_scalars(a) for a in pattern.args), bind=pattern.bind)
    return pattern


def _scalar_names(pattern: Pattern, out: set[str]) -> set[str]:
    if isinstance(pattern, Scalar):
        out.add(pattern.name)
    elif isinstance(pattern, Op):
        for a in pattern.args:
            _scalar_names(a, out)
    return out


def _match_write(view: GraphView, node: NodeDef, write: Write, found: Match) -> Match | None:
    found = match(view, node.input[0], Any(write.slot), found)
    if found is None:
        return None
    found.refs[f"write_{write.slot}"] = node.name
    found = match(view, node.input[1], _resolve_scalars(write.value), found)
    if found is not None:
        found.nodes.add(node.name)
    return found


def _match_spec(
    view: GraphView, spec: Spec, anchor: NodeDef, writers: dict[str, list[NodeDef]]
) -> Match | None:
    """Match ``spec`` with ``anchor`` as the variable's own write; slots are found by handle."""
    found = _match_write(view, anchor, spec.writes[-1], Match())
    pending = list(spec.writes[:-1])
    while found is not None and pending:
        write = next((w for w in pending if w.slot in found.refs), None)
        if write is None:
            return None
        nodes = writers.get(found.refs[write.slot], [])
        if len(nodes) != 1 or nodes[0].op != write.op:
            return None  # a slot is written once per step, by this op
        found = _match_write(view, nodes[0], write, found)
        pending.remove(write)
    scalars: set[str] = set()
    for write in spec.writes:
        _scalar_names(write.value, scalars)
    for name, pattern in spec.extra:
        if found is None or name not in found.refs:
            return None
        found = match(view, found.refs[name], _resolve_scalars(pattern), found)
        _scalar_names(pattern, scalars)
    for name in scalars:
        if found is None or _match_scalar(view, found.refs[name], name, found) is None:
            return None
    return found if found is not None and found.order_holds(view) else None


def _is_stateful(node: NodeDef) -> bool:
    op_def = op_def_registry.get(node.op)
    variable_op = node.op in WRITE_OPS or node.op == "ReadVariableOp"
    return variable_op or bool(op_def and op_def.is_stateful)


def _removable(view: GraphView, covered: set[str]) -> tuple[list[str], str | None]:
    """The covered nodes nothing else needs; a reason if a variable read or write is needed."""
    keep = set(covered)
    changed = True
    while changed:
        changed = False
        for name in list(keep):
            node = view.node(name)
            for consumer, _, _, control in view.consumer_edges(name):
                if consumer.name in keep or (control and _is_stateful(node)):
                    continue
                keep.discard(name)
                changed = True
                break
    lost = [n for n in covered - keep if _is_stateful(view.node(n))]
    if lost:
        node = view.node(lost[0])
        return [], f"{node.op} {lost[0]!r} is also used outside the update"
    return sorted(keep), None


def variable_shape(view: GraphView, found: Match) -> tuple[int, ...] | None:
    """The static shape of the updated variable (its gradient's), None if not fully known."""
    grad = view.node(found.refs["grad"])
    shape = output_shape(grad, parse_input(found.refs["grad"])[1]) if grad is not None else None
    return None if shape is None or None in shape else tuple(int(d) for d in shape)


def _writers(ctx: RuleContext) -> dict[str, list[NodeDef]]:
    """The variable writes of the graph, by the handle they write."""
    if "writers" not in ctx.memo:
        writers: dict[str, list[NodeDef]] = collections.defaultdict(list)
        for node in ctx.view:
            if node.op in WRITE_OPS:
                writers[norm_ref(node.input[0])].append(node)
        ctx.memo["writers"] = writers
    return ctx.memo["writers"]


def _match(anchor: NodeDef, ctx: RuleContext) -> UpdateMatch | str | None:
    """The first spec whose update ends in ``anchor`` (the variable's own write) and takes no
    node an update matched before took; its nodes are claimed whether it is fused or not. A
    spec with no kernel declines with its reason (or silently: a write left alone on
    purpose)."""
    if anchor.name in ctx.claimed:
        return None
    view = ctx.view
    for spec in SPECS:
        if spec.writes[-1].op != anchor.op:
            continue
        found = _match_spec(view, spec, anchor, _writers(ctx))
        if found is None or ctx.overlaps(found.nodes):
            continue
        ctx.claimed |= found.nodes
        if spec.kernel is None:
            return f"{spec.optimizer}: {spec.why}" if spec.why else None
        fed = {parse_input(found.refs[i])[0] for i in spec.inputs if not i.startswith("=")}
        remove, blocked = _removable(view, found.nodes - fed)
        stateful = [n for n in remove if _is_stateful(view.node(n))]
        return UpdateMatch(spec, found, anchor.name, anchor.attr["dtype"].type, remove,
                           stateful, blocked)
    return None


# -- check ----------------------------------------------------------------------------------
def _check(match: UpdateMatch, ctx: RuleContext) -> str | None:
    """Why Keras's composite stays: the target's kernel or the dtype, a constant the kernel
    does not compute, a read or write used outside the update, or the tuner."""
    spec = match.spec
    reason = _why_not(ctx.view, spec, match.found, ctx.target, match.dtype) or match.blocked
    if reason is None:
        reason = _tuned_reason(ctx, spec, match)
    if reason is None or reason.startswith(spec.optimizer):
        return reason
    return f"{spec.optimizer}: {reason}"


def _why_not(view: GraphView, spec: Spec, found: Match, target: Target, dtype: int) -> str | None:
    assert spec.kernel is not None
    if not target.runs_op(spec.kernel):
        # A kernel the target's device has only under another TensorFlow (a Metal plugin's
        # resource-variable kernels before 2.22) would run on the host every step.
        host = getattr(target, "host_only_reason", None)
        why = host(spec.kernel) if host is not None else None
        return f"{spec.optimizer}: {why or f'backend {target.name} has no {spec.kernel} kernel'}"
    if tf.dtypes.as_dtype(dtype) not in (tf.float16, tf.bfloat16, tf.float32, tf.float64):
        return f"{spec.optimizer}: {spec.kernel} does not take {tf.dtypes.as_dtype(dtype).name}"
    wide = tf.dtypes.as_dtype(dtype) in (tf.float32, tf.float64)
    for name, expected in spec.checks:
        have, want = found.values[name], expected(found.values)
        atol = ONE_MINUS_ATOL if wide and name.startswith("one_minus_") else 0.0
        if abs(have - want) > max(RTOL * abs(want), atol):
            return (f"{spec.optimizer}: constant {name} is {have!r} but the kernel computes "
                    f"{want!r}")
    handles = [found.refs[i] for i in spec.inputs if i in {w.slot for w in spec.writes}]
    if len(set(handles)) != len(handles):
        return f"{spec.optimizer}: the same variable holds two slots"
    return None


def size_class(shape: tuple[int, ...] | None) -> str:
    """The elements of a variable of ``shape`` as the range of sizes one tuner decision covers:
    from a power of two to just below the next. An update is elementwise, its cost a matter of
    how many elements it reads and writes, not of their layout: a model's many variables of
    like size share one measured decision rather than each paying for its own.

    >>> size_class((64, 64)), size_class((3, 3, 32, 1)), size_class((1,)), size_class(None)
    ('4096-8191 elements', '256-511 elements', '1 element', '? elements')
    """
    if shape is None:
        return "? elements"
    n = math.prod(shape)
    if n <= 1:
        return f"{n} element"
    low = 1 << (n.bit_length() - 1)
    return f"{low}-{2 * low - 1} elements"


def _tuned_reason(ctx: RuleContext, spec: Spec, m: UpdateMatch) -> str | None:
    """Why this update keeps the composite (the tuner measured it faster here), or None. The
    decision is the kernel's, dtype's and :func:`size_class`'s: measured once per size class."""
    shape = variable_shape(ctx.view, m.found)
    dtype = tf.dtypes.as_dtype(m.dtype).name
    signature = f"{spec.kernel} {dtype} {size_class(shape)}"
    kept = ctx.tuned("optimizer_update", signature, m.remove,
                     lambda v: rewrite_update(v, m), stock="composite", fused="kernel")
    if kept is None:
        return None
    shown = list(shape) if shape is not None else "?"
    return f"{spec.optimizer}: {spec.kernel} {dtype} {shown} keeps Keras's composite: {kept}"


def _by_name(matches: list[UpdateMatch], ctx: RuleContext
             ) -> tuple[list[UpdateMatch], list[str]]:
    """Every match kept, and the reasons for the optimizers' writes left composite that no
    spec matched (:func:`_unfused_by_name`)."""
    return matches, _unfused_by_name(ctx.view, ctx.claimed)


def _sparse_gradient(view: GraphView, node: NodeDef, depth: int = 4) -> bool:
    """True if ``node``'s value comes from a densified IndexedSlices (UnsortedSegmentSum)."""
    frontier = [node]
    for _ in range(depth):
        frontier = [p for n in frontier for r in view.data_inputs(n) if (p := view.node(r))]
        if any(p.op in SPARSE_OPS for p in frontier):
            return True
    return False


def _unfused_by_name(view: GraphView, claimed: set[str]) -> list[str]:
    """Reasons for the writes of Keras optimizers (found by their name scope) left composite:
    optimizers with no kernel, and sparse (IndexedSlices) gradients."""
    reasons = []
    for node in view:
        if node.name in claimed or not (node.op in WRITE_OPS or node.op in SPARSE_WRITES):
            continue
        for part in node.name.split("/")[:-1]:
            name = re.sub(r"_\d+$", "", part)
            if name in NO_KERNEL:
                reasons.append(f"{NO_KERNEL[name]}: no ResourceApply* kernel computes its update")
                break
            if name in FUSABLE and (node.op in SPARSE_WRITES or _sparse_gradient(view, node)):
                reasons.append(
                    f"{FUSABLE[name]}: sparse gradient (IndexedSlices, e.g. Embedding): Keras "
                    "densifies it per use or scatters it, no ResourceSparseApply* kernel "
                    "computes the same; left as it is"
                )
                break
    return reasons


# -- emit -----------------------------------------------------------------------------------
def rewrite_update(view: GraphView, m: UpdateMatch) -> NodeDef:
    """Replace one matched update by its kernel; returns the fused node."""
    spec = m.spec
    assert spec.kernel is not None
    name = f"{m.anchor}/{spec.kernel}"
    inputs: list[str] = []
    for item in spec.inputs:
        if item.startswith("="):
            const = const_node(f"{name}/{item[1:]}", np.array(
                m.found.values[item[1:]], tf.as_dtype(m.dtype).as_numpy_dtype))
            view.add(const)
            inputs.append(const.name)
        else:
            inputs.append(m.found.refs[item])
    removed = set(m.remove)
    inputs += sorted({
        ref for n in m.stateful for ref in view.node(n).input
        if ref.startswith("^") and ref[1:] not in removed
    })
    anchor = view.node(m.anchor)  # its device: the replica the variable lives on
    fused = fused_node(anchor, spec.kernel, NodeDef(name=name), inputs, {
        "T": AttrValue(type=m.dtype), "use_locking": False, **dict(spec.attrs)})
    view.add(fused)
    for n in m.stateful:
        view.redirect_control_edges(n, name)
        if n in view.control_outputs:
            view.retire_control_output(n, name)
    inputs = {parse_input(r)[0] for n in m.remove for r in view.node(n).input}
    for n in m.remove:
        view.remove(n)
    view.prune(inputs - removed)
    return fused


# -- declaration ----------------------------------------------------------------------------
RULE = Rule(anchors=WRITE_OPS, match=_match, check=_check,
            emit=lambda v, m: rewrite_update(v, m), kind=lambda m: m.spec.optimizer,
            finish=_by_name)


def find_updates(view: GraphView, target: Target, tuner: Chooser | None = None,
                 ) -> tuple[list[UpdateMatch], list[str]]:
    """Every variable update a Spec matches, and reasons for those declined.

    Where the kernel and Keras's composite are both correct, ``tuner`` decides which runs
    (measured on this machine by ``tfmx.tuner``; None: the kernel)."""
    return RULE.find(view, target, tuner)


@register(
    "optimizer_update",
    "Keras optimizer updates (Adam, AdamW, SGD, RMSprop, Adadelta, Adamax) → ResourceApply*",
)
def optimizer_update_pass(view: GraphView, ctx: RewriteContext) -> None:
    """The optimizer-update family's pass: find every update, fuse what the target runs."""
    RULE.apply(view, ctx)
