"""The batch_norm family's second match: ``FusedBatchNormV3`` + residual ``Add`` + ``Relu`` ->
``_FusedBatchNormEx`` where the target runs it (declined with the target's reason elsewhere,
e.g. on CPU); in training with its backward, ``ReluGrad`` + ``FusedBatchNormGradV3`` ->
``_FusedBatchNormGradEx``, wired as Grappler's remapper wires them on GPU. A batch norm whose
``Relu`` follows with no residual ``Add`` is declined with the reason.

One rule (:mod:`fusion.rule`), which the batch_norm family runs after its first: its match is
an expression of :mod:`fusion.expr` at a ``Relu`` (:data:`BATCH_NORM_ADD_RELU`; in training
also the backward that reads the kernel's reserve spaces), its check says why the ops stay
apart, :func:`rewrite_batch_norm_ex` writes the fused kernels.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.graphs.batch_norm_ex import find_batch_norm_ex
    >>> from tfmx.backends import get_backend
    >>> @tf.function(autograph=False)
    ... def f(x, side, scale, offset):
    ...     y, *_ = tf.raw_ops.FusedBatchNormV3(x=x, scale=scale, offset=offset,
    ...         mean=tf.zeros([0]), variance=tf.zeros([0]), is_training=True)
    ...     return tf.nn.relu(y + side)
    >>> g = f.get_concrete_function(tf.TensorSpec([2, 4, 4, 8]), tf.TensorSpec([2, 4, 4, 8]),
    ...     tf.TensorSpec([8]), tf.TensorSpec([8])).graph.as_graph_def(add_shapes=True)
    >>> matches, declined = find_batch_norm_ex(GraphView(g.node), get_backend("cpu"))
    >>> matches, declined[0].split(":")[0]
    ([], 'FusedBatchNormV3+Add+Relu')
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from fusion.expr import Any, Op, Skip, match, norm_ref
from fusion.graph import SHAPE_ONLY_OPS, GraphView, NodeDef, output_shape, parse_input, tensor_ref
from fusion.kernels.batch_norm import kernel_blocker
from fusion.match import dtype_name, new_node
from fusion.pattern import Target
from fusion.rule import Rule, RuleContext


@dataclasses.dataclass
class BatchNormExMatch:
    """FusedBatchNormV3 -> Add(side input) -> Relu; in training also the forward stage's
    Identity between (if any) and the backward: ReluGrad -> FusedBatchNormGradV3."""

    fused: NodeDef
    add: NodeDef
    relu: NodeDef
    side_input: str
    identity: NodeDef | None = None
    relu_grad: NodeDef | None = None
    grad: NodeDef | None = None
    backward_why: str | None = None  # why the backward read is not one _FusedBatchNormGradEx

    @property
    def training(self) -> bool:
        return self.fused.attr["is_training"].b


# -- match ----------------------------------------------------------------------------------
_FUSED = Op("FusedBatchNormV3", *(Any(f"fused_input_{i}") for i in range(5)), bind="fused")
BATCH_NORM_RELU = Op("Relu", Skip("Identity", _FUSED), bind="relu")
"""A ``Relu`` of a ``FusedBatchNormV3``'s output (through one Identity at most)."""
BATCH_NORM_ADD_RELU = Op("Relu", Op(("Add", "AddV2"), Skip("Identity", _FUSED), Any("side"),
                                    bind="add"), bind="relu")
"""A ``Relu`` of a ``FusedBatchNormV3``'s output (through one Identity at most) plus a side
input, in either order."""


def _data_consumers(view: GraphView, name: str, port: int = 0) -> list[NodeDef]:
    return [c for c in view.consumers(name, port) if c.op not in SHAPE_ONLY_OPS]


def _ex_backward(view: GraphView, fused: NodeDef,
                 relu: NodeDef) -> tuple[NodeDef, NodeDef] | str:
    """The training backward of FusedBatchNormV3 + Add + Relu as ``_FusedBatchNormGradEx``
    takes it: (ReluGrad, FusedBatchNormGradV3), or why not."""
    readers = {c.name: c for port in (3, 4, 5) for c in view.consumers(fused.name, port)
               if c.op != "ZerosLike"}
    grad = next(iter(readers.values())) if len(readers) == 1 else None
    if grad is None or grad.op != "FusedBatchNormGradV3" or not grad.attr["is_training"].b:
        return "the reserve spaces have readers other than one FusedBatchNormGradV3"
    wanted = [fused.input[0], fused.input[1]] + [tensor_ref(fused.name, p) for p in (3, 4, 5)]
    if list(view.data_inputs(grad)[1:6]) != wanted:
        return "FusedBatchNormGradV3 takes other inputs than its forward's"
    relu_grads = [c for c in view.consumers(relu.name) if c.op == "ReluGrad"
                  and parse_input(c.input[1])[:2] == (relu.name, 0)]
    if len(relu_grads) != 1:
        return "no single ReluGrad of the Relu"
    relu_grad = relu_grads[0]
    if parse_input(grad.input[0])[:2] != (relu_grad.name, 0):
        return ("the Add's gradient reduces between ReluGrad and FusedBatchNormGradV3 "
                "(shapes not static)")
    for node in (grad, relu_grad):
        if view.has_control_edges(node) or node.name in view.protected:
            return f"{node.op} has control edges or is fetched"
    return relu_grad, grad


def _match(relu: NodeDef, ctx: RuleContext) -> BatchNormExMatch | str | None:
    """:data:`BATCH_NORM_ADD_RELU` at ``relu`` with, in training, the backward; a reason for
    :data:`BATCH_NORM_RELU` (a batch norm with its Relu and no residual Add); None for any
    other Relu."""
    view = ctx.view
    direct = match(view, relu.name, BATCH_NORM_RELU)
    if direct is not None:  # a batch norm and its activation, no residual (pre-activation)
        fused = view.node(direct.refs["fused"])
        return f"FusedBatchNormV3+Relu: {_without_side_input(view, fused, ctx.target)}"
    found = match(view, relu.name, BATCH_NORM_ADD_RELU)
    if found is None:
        return None
    fused, add = view.node(found.refs["fused"]), view.node(found.refs["add"])
    identity = next((view.node(n) for n in sorted(found.nodes)
                     if view.node(n).op == "Identity"), None)
    inputs = view.data_inputs(add)
    branch = (identity or fused).name  # the input the expression took for the batch norm's
    side = inputs[1] if norm_ref(inputs[0]) == branch else inputs[0]
    record = BatchNormExMatch(fused=fused, add=add, relu=relu, side_input=side,
                              identity=identity)
    if any(c.op != "ZerosLike" for p in (3, 4, 5) for c in view.consumers(fused.name, p)):
        backward = _ex_backward(view, fused, relu)
        if isinstance(backward, str):
            record.backward_why = backward
        else:
            record.relu_grad, record.grad = backward
    return record


# -- check ----------------------------------------------------------------------------------
def _check(match: BatchNormExMatch, ctx: RuleContext) -> str | None:
    """Why the ops stay apart: the target's kernel, shapes the kernel does not broadcast,
    other readers of the intermediates, or a backward that is not one
    ``_FusedBatchNormGradEx``."""
    view, fused, add, relu = ctx.view, match.fused, match.add, match.relu
    identity, side = match.identity, match.side_input
    shape = output_shape(fused, 0)
    side_node = view.node(side) if side else None
    side_shape = None if side_node is None else output_shape(side_node, parse_input(side)[1])
    training = fused.attr["is_training"].b
    fmt = fused.attr["data_format"].s.decode()
    channels = None
    if shape is not None and len(shape) == 4:
        channels = shape[3] if fmt == "NHWC" else shape[1]
    why = kernel_blocker(ctx.target, "_FusedBatchNormEx", dtype_name(fused), fmt, training,
                         channels, fused.attr["epsilon"].f)
    if why is None and identity is not None and not training:
        why = "an Identity with control inputs between"
    if why is None and (shape is None or shape != side_shape
                        or any(d is None for d in shape[1:])):
        why = "side input shape differs or is unknown (Add broadcasts, the kernel does not)"
    if why is None:
        first = identity or add
        if fused.name in view.protected or any(i.startswith("^") for i in fused.input) \
                or [c.name for c in _data_consumers(view, fused.name)] != [first.name]:
            why = "FusedBatchNormV3 output has other consumers"
        elif identity is not None and (
                identity.name in view.protected
                or any(ctl for *_, ctl in view.consumer_edges(identity.name))
                or [c.name for c in _data_consumers(view, identity.name)] != [add.name]):
            why = "the Identity after FusedBatchNormV3 has other consumers"
        elif len(_data_consumers(view, add.name)) != 1 or view.has_control_edges(add) \
                or add.name in view.protected or view.has_control_edges(relu):
            why = "Add output has other consumers"
    if why is None and match.backward_why is not None:
        why = f"backward not fusable as _FusedBatchNormGradEx: {match.backward_why}"
    return None if why is None else f"FusedBatchNormV3+Add+Relu: {why}"


def _without_side_input(view: GraphView, fused: NodeDef, target: Target) -> str:
    """Why a FusedBatchNormV3 followed by a Relu alone (no residual Add) stays apart: the
    target's kernel reason, else that this family fuses ``_FusedBatchNormEx`` with a side
    input only and leaves this one to Grappler's remapper (which fuses it where the device has
    the kernel)."""
    shape = output_shape(fused, 0)
    fmt = fused.attr["data_format"].s.decode()
    channels = None
    if shape is not None and len(shape) == 4:
        channels = shape[3] if fmt == "NHWC" else shape[1]
    why = kernel_blocker(target, "_FusedBatchNormEx", dtype_name(fused), fmt,
                         fused.attr["is_training"].b, channels, fused.attr["epsilon"].f)
    if why is not None:
        return f"{why}; the Relu stays apart"
    return ("no residual Add: left to Grappler's remapper, which fuses a batch norm and its "
            "Relu into _FusedBatchNormEx where the device has it")


# -- emit -----------------------------------------------------------------------------------
def rewrite_batch_norm_ex(view: GraphView, match: BatchNormExMatch) -> NodeDef:
    """Replace FusedBatchNormV3 + Add + Relu with one ``_FusedBatchNormEx`` named like the Relu;
    in training see :func:`rewrite_batch_norm_ex_training`."""
    if match.training:
        return rewrite_batch_norm_ex_training(view, match)
    fused, add, relu = match.fused, match.add, match.relu
    ex = _ex_node(relu.name, fused, match.side_input)
    rewire = []
    for node in (fused, add):
        for consumer, index, port, ctl in view.consumer_edges(node.name):
            if consumer.name in (add.name, relu.name):
                continue
            rewire.append((consumer, index, ("^" + ex.name) if ctl else
                           tensor_ref(ex.name, port if node is fused else 0)))
    view.remove(fused.name)
    view.remove(add.name)
    view.replace(relu.name, ex)
    for consumer, index, ref in rewire:
        view.replace_input(consumer, index, ref)
    return ex


def _ex_node(name: str, fused: NodeDef, side_input: str) -> NodeDef:
    ex = NodeDef(name=name, op="_FusedBatchNormEx", device=fused.device)
    ex.input.extend([*[i for i in fused.input if not i.startswith("^")][:5], side_input])
    for key in ("T", "U", "epsilon", "exponential_avg_factor", "data_format", "is_training",
                "_output_shapes"):
        if key in fused.attr:
            ex.attr[key].CopyFrom(fused.attr[key])
    ex.attr["num_side_inputs"].i = 1
    ex.attr["activation_mode"].s = b"Relu"
    return ex


def _identity(name: str, ref: str, like: NodeDef, control: list[str] = ()) -> NodeDef:
    node = new_node(name, "Identity", [ref, *control], like.device,
                      T=tf.as_dtype(like.attr["T"].type))
    if "_output_shapes" in like.attr:
        node.attr["_output_shapes"].list.shape.add().CopyFrom(
            like.attr["_output_shapes"].list.shape[0])
    return node


def rewrite_batch_norm_ex_training(view: GraphView, match: BatchNormExMatch) -> NodeDef:
    """Training, as Grappler's remapper does on GPU: ``_FusedBatchNormEx`` takes the
    FusedBatchNormV3's name (its statistics and reserve spaces keep their readers), the Relu
    becomes an Identity of its output (keeping the forward stage's control inputs, which order
    the moving-average updates before the activation is read), and the backward
    ``FusedBatchNormGradV3`` becomes ``_FusedBatchNormGradEx`` taking the gradient before the
    ReluGrad, whose other readers (the side input's gradient) get the kernel's
    ``side_input_backprop``."""
    fused, add, relu, identity = match.fused, match.add, match.relu, match.identity
    ex = _ex_node(fused.name, fused, match.side_input)
    control = [i for i in identity.input if i.startswith("^")] if identity is not None else []
    view.replace(relu.name, _identity(relu.name, ex.name, relu, control))
    view.remove(add.name)
    if identity is not None:
        view.remove(identity.name)
    view.replace(fused.name, ex)
    grad, relu_grad = match.grad, match.relu_grad
    if grad is None or relu_grad is None:
        return ex
    gx = NodeDef(name=grad.name, op="_FusedBatchNormGradEx", device=grad.device)
    gx.input.extend([relu_grad.input[0], *view.data_inputs(grad)[1:6], fused.input[2],
                     relu.name])
    for key in ("T", "U", "epsilon", "data_format", "is_training"):
        gx.attr[key].CopyFrom(grad.attr[key])
    gx.attr["num_side_inputs"].i = 1
    gx.attr["activation_mode"].s = b"Relu"
    if "_output_shapes" in grad.attr and "_output_shapes" in relu_grad.attr:
        shapes = gx.attr["_output_shapes"].list.shape
        shapes.extend(grad.attr["_output_shapes"].list.shape)
        shapes.add().CopyFrom(relu_grad.attr["_output_shapes"].list.shape[0])
    view.replace(grad.name, gx)
    if view.consumer_edges(relu_grad.name):
        view.replace(relu_grad.name, _identity(relu_grad.name, tensor_ref(gx.name, 5), relu_grad))
    else:
        view.remove(relu_grad.name)
    return ex


# -- declaration ----------------------------------------------------------------------------
RULE = Rule(anchors=frozenset({"Relu"}), match=_match, check=_check,
            emit=lambda v, m: rewrite_batch_norm_ex(v, m),
            kind=lambda m: "_FusedBatchNormEx(side input, Relu)" + (
                " + _FusedBatchNormGradEx (training)" if m.grad is not None else ""))
"""The batch_norm family's second rule (``fusion.graphs.batch_norm`` declares the family)."""


def find_batch_norm_ex(view: GraphView,
                       target: Target) -> tuple[list[BatchNormExMatch], list[str]]:
    """Every FusedBatchNormV3 + residual Add + Relu that ``target`` runs as one
    ``_FusedBatchNormEx`` (in training with its backward as ``_FusedBatchNormGradEx``), and
    the declines."""
    return RULE.find(view, target)
