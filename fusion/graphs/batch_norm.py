"""Keras 3's composite BatchNormalization -> ``FusedBatchNormV3`` (and ``_FusedBatchNormEx``).

Keras 3 on TensorFlow writes batch norm as ``tf.nn.moments`` + ``tf.nn.batch_normalization``::

    training:  mean = Squeeze(Mean(x, axes, keep_dims))
               var  = Squeeze(Mean(SquaredDifference(x, StopGradient(Mean(x, axes)))))
                      (TensorFlow 2.22: d = Sub(x, StopGradient(mean));
                       var = Squeeze(Maximum(Mean(Square(d)) - Square(Mean(d)), 0)))
               moving_* <- moving_* * momentum + batch_* * (1 - momentum)   (AssignVariableOp)
    both:      inv  = Rsqrt(AddV2(var, epsilon)) [* gamma]
               y    = AddV2(Mul(x, inv), Sub(beta, Mul(mean, inv)))   (Neg(...) without beta)

with ``Reshape`` of the per-channel vectors when the channel axis is not the last, and a
``Cast`` in and out under a float16/bfloat16 policy (Keras computes batch norm in float32).

Two rules (:mod:`fusion.rule`), one after the other (as in Grappler's remapper):

- :class:`BatchNormMatch` (``find_batch_norm`` / ``rewrite_batch_norm``): the composite, training
  or inference, -> one ``FusedBatchNormV3`` (``is_training`` accordingly). In training the
  moving-average updates stay Keras's own nodes, fed from the kernel's ``batch_mean`` and from its
  ``batch_variance`` times ``(n - 1) / n``: the kernel returns the Bessel-corrected variance
  (``exponential_avg_factor=1``), Keras averages the biased one. Under a 16-bit policy the two
  Casts are swallowed and the kernel takes the 16-bit activations with float32 statistics.
- ``BatchNormExMatch`` (:mod:`fusion.graphs.batch_norm_ex`): ``FusedBatchNormV3`` +
  residual ``Add`` + ``Relu`` -> ``_FusedBatchNormEx`` where the target runs it. In training
  (cuda: half, NHWC, channels % 4, ``TF_USE_CUDNN_BATCHNORM_SPATIAL_PERSISTENT=1``) with its
  backward: ``ReluGrad`` + ``FusedBatchNormGradV3`` -> ``_FusedBatchNormGradEx``.

What each backend runs of these kernels, a
:class:`~fusion.kernels.batch_norm.BatchNormKernels`, is declared per platform by
:func:`batch_norm_kernels` (the family's ``capability``).

A training composite whose intermediates the backward pass reads is declined here: training batch
norm is fused *before* differentiation, by the stage ``fusion.calls.batch_norm`` (which runs
this same pattern on the layer's forward graph and lets TensorFlow's registered
``FusedBatchNormV3`` gradient build ``FusedBatchNormGradV3``).

Example:
    >>> import tensorflow as tf, keras
    >>> from fusion.graph import GraphView
    >>> from fusion.graphs.batch_norm import find_batch_norm
    >>> from tfmx.backends import get_backend
    >>> bn = keras.layers.BatchNormalization()
    >>> bn.build((None, 4, 4, 8))
    >>> g = tf.function(lambda x: bn(x, training=True), autograph=False).get_concrete_function(
    ...     tf.TensorSpec([None, 4, 4, 8])).graph.as_graph_def(add_shapes=True)
    >>> matches, declined = find_batch_norm(GraphView(g.node), get_backend("cpu"))
    >>> [(m.kind, m.data_format, m.channels) for m in matches]
    [('training', 'NHWC', 8)]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from fusion.expr import Any, Const, Match, OneOf, Op, Pattern, Where, match
from fusion.family import Family, declare, register
from fusion.graph import GraphView, NodeDef, output_shape, parse_input, tensor_ref
from fusion.graphs.batch_norm_ex import RULE as EX_RULE
from fusion.kernels.batch_norm import LOW_PRECISION, BatchNormKernels, kernel_blocker
from fusion.match import blocker, const_node, const_value, dtype_name, new_node
from fusion.pattern import RewriteContext, Target
from fusion.platform import Platform
from fusion.rule import Rule, RuleContext, graph_pass


@dataclasses.dataclass
class BatchNormMatch:
    """One composite batch norm, training or inference."""

    kind: str  # "training" | "inference"
    x: str  # input of the fused op (the 16-bit tensor when the Casts are swallowed)
    tail: NodeDef  # the node whose output is the batch norm's output
    interior: tuple[NodeDef, ...]  # nodes removed (the tail excluded)
    rank: int
    axis: int
    channels: int
    dtype: str  # T of the fused op
    epsilon: float
    gamma: str | None = None
    beta: str | None = None
    mean: str | None = None  # inference: the moving mean read
    variance: str | None = None
    batch_mean: NodeDef | None = None  # training: nodes whose consumers get the kernel's stats
    batch_variance: NodeDef | None = None

    @property
    def data_format(self) -> str:
        return _layout(self.rank, self.axis)[0]


# -- match ----------------------------------------------------------------------------------
def _layout(rank: int, axis: int) -> tuple[str, str | None]:
    """(data_format, how x is brought to 4-D or 5-D) for a channel ``axis`` of a ``rank`` input;
    ("", None) when FusedBatchNormV3 cannot take it."""
    return {
        (4, 3): ("NHWC", None), (4, 1): ("NCHW", None),
        (5, 4): ("NDHWC", None), (5, 1): ("NCDHW", None),
        (2, 1): ("NHWC", "reshape"), (3, 2): ("NHWC", "reshape"),
        (3, 1): ("NCHW", "reshape"),
    }.get((rank, axis), ("", None))


def _per_channel(view: GraphView, ref: str, rank: int) -> tuple[str, NodeDef | None,
                                                              int | None, int | None] | None:
    """A per-channel vector feeding the normalization: (vector ref, its Reshape or None,
    channel axis, channels); axis None for a plain vector (broadcast on the last axis)."""
    node = view.node(ref)
    if node is None:
        return None
    if node.op == "Reshape":
        target = const_value(view, node.input[1])
        src = view.node(node.input[0])
        src_shape = None if src is None else output_shape(src, parse_input(node.input[0])[1])
        if target is None or src_shape is None or len(src_shape) != 1 or target.ndim != 1:
            return None
        dims = [int(d) for d in target]
        if len(dims) != rank or sorted(dims)[:-1] != [1] * (rank - 1):
            return None
        axis = int(np.argmax(dims))
        return node.input[0], node, axis, dims[axis]
    shape = output_shape(node, parse_input(ref)[1])
    if shape is None or len(shape) != 1 or shape[0] is None:
        return None
    return ref, None, None, shape[0]


def _is_vector(view: GraphView, ref: str) -> bool:
    """True if ``ref`` is a rank-1 tensor or a (Squeeze, Reshape) that may make one."""
    node = view.node(ref)
    if node is None:
        return False
    shape = output_shape(node, parse_input(ref)[1])
    return (shape is not None and len(shape) == 1) or node.op in ("Squeeze", "Reshape")


# tf.nn.moments(x, axes, keepdims=True), Squeezed: the batch statistics of training.
_MEAN = Op("Squeeze", Op("Mean", Any("x"), Any("axes_m"), bind="mean_k"), bind="mean_sq")
_VARIANCE = Op("Squeeze", Op("Mean", Op("SquaredDifference", Any("x"), Op(
    "StopGradient", Any("mean_k"), bind="sg"), bind="sqd"), Any("axes_v"), bind="var_k"),
    bind="var_sq")
# TensorFlow 2.22's tf.nn.moments: with d = x - stop_gradient(mean), the variance is
# max(mean(d^2) - mean(d)^2, 0).
_VARIANCE_SHIFTED = Op("Squeeze", Op("Maximum", Op(
    "Sub",
    Op("Mean", Op("Square", Op("Sub", Any("x"), Op("StopGradient", Any("mean_k"), bind="sg"),
                               bind="diff"), bind="sqd"), Any("axes_v"), bind="var_k"),
    Op("Square", Op("Mean", Any("diff"), Any("axes_d"), bind="diff_mean"), bind="diff_sq"),
    bind="var_sub"), Any("zero"), bind="var_max"), bind="var_sq")
_SHIFTED_NODES = ("mean_k", "sg", "diff", "sqd", "var_k", "diff_mean", "diff_sq", "var_sub",
                  "var_max")


def _is_zero(view: GraphView, ref: str) -> bool:
    """True if ``ref`` is a constant zero, or the Cast of one."""
    node = view.node(ref)
    if node is not None and node.op == "Cast" and not any(r.startswith("^") for r in node.input):
        ref = node.input[0]
    value = const_value(view, ref)
    return value is not None and value.size == 1 and float(value.ravel()[0]) == 0.0


def _moments(view: GraphView, mean_ref: str, var_ref: str) -> tuple | None:
    """(x ref, reduction axes, nodes, mean Squeeze, variance Squeeze) if ``mean_ref`` and
    ``var_ref`` are the Squeezed outputs of ``tf.nn.moments`` (TensorFlow 2.21's form or
    2.22's shifted one); None otherwise."""
    names: tuple[str, ...] = ("mean_k", "sg", "sqd", "var_k")
    reductions = ("mean_k", "var_k")
    found = match(view, var_ref, _VARIANCE)
    if found is None:
        found = match(view, var_ref, _VARIANCE_SHIFTED)
        if found is not None and not _is_zero(view, found.refs["zero"]):
            found = None
        names, reductions = _SHIFTED_NODES, ("mean_k", "var_k", "diff_mean")
    found = None if found is None else match(view, mean_ref, _MEAN, found)
    if found is None:
        return None
    node = {name: view.node(found.refs[name]) for name in (*names, "mean_sq", "var_sq")}
    axes = [const_value(view, found.refs[a]) for a in ("axes_m", "axes_v", "axes_d")
            if a in found.refs]
    if any(a is None for a in axes) or len({tuple(sorted(a.ravel())) for a in axes}) != 1:
        return None
    if not all(node[r].attr["keep_dims"].b for r in reductions):
        return None
    return (found.refs["x"], [int(a) for a in axes[0].ravel()],
            tuple(node[n] for n in names), node["mean_sq"], node["var_sq"])


def _sole_consumer_is(ops: tuple[str, ...], name: str) -> Callable[[GraphView, Match], bool]:
    def check(view: GraphView, found: Match) -> bool:
        after = view.consumers(found.refs[name])
        return len(after) == 1 and after[0].op in ops

    return check


def _mean_is_vector(view: GraphView, found: Match) -> bool:
    return _is_vector(view, found.refs["mean"])


def normalization(gamma: bool) -> Pattern:
    """``rsqrt(variance + epsilon)``, times ``gamma`` if ``gamma``: the ``inv`` of Keras's
    composite batch norm (bound as ``inv``; its nodes as ``add_eps``, ``rsqrt``)."""
    rsqrt = Op("Rsqrt", Op(("AddV2", "Add"), Any("var"), Const("epsilon"), bind="add_eps"),
               bind="rsqrt" if gamma else "inv")
    return Op("Mul", rsqrt, Any("gamma"), bind="inv") if gamma else rsqrt


def affine(inv: Pattern) -> Pattern:
    """``x * inv + (beta - mean * inv)``, or without beta ``x * inv + -(mean * inv)`` or
    ``x * inv + (-mean) * inv``: Keras's composite batch norm around ``inv`` (the shared
    subpattern of this family and of ``conv_bn_fold``)."""
    scale = Op("Mul", Any("x"), inv, bind="scale_mul")
    mean_mul = Where(Op("Mul", Any("mean"), Any("inv"), bind="mean_mul"),
                     _sole_consumer_is(("Sub", "Neg"), "mean_mul"),
                     "mean * inv feeds more than its shift")
    return OneOf(
        Op(("AddV2", "Add"), scale, Op("Sub", Any("beta"), mean_mul, bind="shift"), bind="out"),
        Op(("AddV2", "Add"), scale, Op("Neg", mean_mul, bind="shift"), bind="out"),
        Op(("AddV2", "Add"), scale,
           Where(Op("Mul", Op("Neg", Any("mean"), bind="neg"), Any("inv"), bind="mean_mul"),
                 _mean_is_vector, "-mean is not a vector"), bind="out"),
    )


_AFFINE = (affine(normalization(gamma=True)), affine(normalization(gamma=False)))


def _normalization(view: GraphView, rsqrt: NodeDef) -> dict | None:
    """The ``tf.nn.batch_normalization`` subgraph around ``rsqrt`` (:func:`affine` of
    :func:`normalization`), found from its output. Other consumers of its nodes (the
    backward's) are tolerated here; the blocker check declines them with the reason."""
    for inv in [c for c in view.consumers(rsqrt.name) if c.op == "Mul"] + [rsqrt]:
        pattern = _AFFINE[inv is rsqrt]
        for scale_mul in (c for c in view.consumers(inv.name) if c.op == "Mul"):
            for out in (c for c in view.consumers(scale_mul.name) if c.op in ("AddV2", "Add")):
                found = match(view, out.name, pattern, Match(refs={"inv": inv.name}))
                if found is None or found.refs["scale_mul"] != scale_mul.name:
                    continue
                names = ["add_eps", "rsqrt", "inv", "scale_mul", "mean_mul", "shift", "neg"]
                nodes = [view.node(found.refs[n]) for n in names if n in found.refs]
                return dict(x=found.refs["x"], mean=found.refs["mean"],
                            beta=found.refs.get("beta"), out=out, nodes=nodes,
                            var=found.refs["var"], gamma=found.refs.get("gamma"),
                            epsilon=found.values["epsilon"])
    return None


def _match_at(view: GraphView, rsqrt: NodeDef) -> tuple[BatchNormMatch | None, str | None]:
    """A :class:`BatchNormMatch` around ``rsqrt``, or (None, why) / (None, None) if absent."""
    norm = _normalization(view, rsqrt)
    if norm is None:
        return None, None
    x_node = view.node(norm["x"])
    x_shape = None if x_node is None else output_shape(x_node, parse_input(norm["x"])[1])
    if x_shape is None:
        return None, "input rank unknown"
    rank = len(x_shape)
    moments = _moments(view, *_strip_reshape(view, norm["mean"], norm["var"]))
    kind = "training" if moments is not None else "inference"
    vectors = {}
    axis = channels = None
    for key in ("mean", "var", "gamma", "beta"):
        if norm[key] is None:
            continue
        ref = norm[key]
        if kind == "training" and key in ("mean", "var"):
            node = view.node(ref)
            vectors[key] = (ref, node if node is not None and node.op == "Reshape" else None)
            continue
        found = _per_channel(view, ref, rank)
        if found is None:
            return None, None  # not a per-channel normalization (LayerNorm, ...)
        src, reshape, ax, ch = found
        ax = rank - 1 if ax is None else ax
        if axis is not None and (ax, ch) != (axis, channels):
            return None, None
        axis, channels = ax, ch
        vectors[key] = (src, reshape)
    if moments is not None:
        x_ref, axes, moment_nodes, mean_sq, var_sq = moments
        if x_ref != norm["x"]:
            return None, None
        kept = sorted(set(range(rank)) - {a % rank for a in axes})
        if len(kept) != 1 or (axis is not None and kept[0] != axis):
            return None, f"moments over axes {sorted(axes)} of a rank-{rank} input"
        axis = kept[0]
        channels = x_shape[axis] if channels is None else channels
    if axis is None or channels is None:
        return None, None
    if x_shape[axis] is not None and x_shape[axis] != channels:
        return None, None
    interior = list(norm["nodes"])
    for _, reshape in vectors.values():
        if reshape is not None:
            interior.append(reshape)
    match = BatchNormMatch(
        kind=kind, x=norm["x"], tail=norm["out"], interior=(), rank=rank, axis=axis,
        channels=channels, dtype=dtype_name(norm["out"]), epsilon=norm["epsilon"],
        gamma=vectors["gamma"][0] if "gamma" in vectors else None,
        beta=vectors["beta"][0] if "beta" in vectors else None,
    )
    if moments is not None:
        interior.extend(moments[2])
        match.batch_mean, match.batch_variance = moments[3], moments[4]
    else:
        match.mean, match.variance = vectors["mean"][0], vectors["var"][0]
    match.interior = tuple(interior)
    _swallow_casts(view, match)
    return match, None


def _strip_reshape(view: GraphView, *refs: str) -> list[str]:
    out = []
    for ref in refs:
        node = view.node(ref)
        out.append(node.input[0] if node is not None and node.op == "Reshape" else ref)
    return out


def _swallow_casts(view: GraphView, match: BatchNormMatch) -> None:
    """Under a 16-bit policy take the 16-bit input and output directly (float32 statistics)."""
    cast_in = view.node(match.x)
    outs = view.consumers(match.tail.name)
    if cast_in is None or cast_in.op != "Cast" or len(outs) != 1 or outs[0].op != "Cast":
        return
    low = tf.as_dtype(cast_in.attr["SrcT"].type).name
    if low not in LOW_PRECISION or tf.as_dtype(outs[0].attr["DstT"].type).name != low:
        return
    inside = {n.name for n in (*match.interior, match.tail, cast_in, outs[0])}
    if blocker(view, cast_in, inside) is not None or blocker(view, match.tail, inside):
        return
    match.interior = (*match.interior, cast_in, match.tail)
    match.tail, match.x, match.dtype = outs[0], cast_in.input[0], low


def _match(rsqrt: NodeDef, ctx: RuleContext) -> BatchNormMatch | str | None:
    """The composite around ``rsqrt`` (:func:`_match_at`): its record, why it is declined
    before one could be made, or None."""
    match, why = _match_at(ctx.view, rsqrt)
    return match if match is not None else (f"BatchNorm: {why}" if why else None)


# -- check ----------------------------------------------------------------------------------
def _check(match: BatchNormMatch, ctx: RuleContext) -> str | None:
    """Why the composite stays: a layout FusedBatchNormV3 cannot take, no kernel on the
    target, intermediates read elsewhere (in training: by the backward), an overlap."""
    view = ctx.view
    label = f"BatchNorm({match.kind})"
    fmt = match.data_format
    if not fmt:
        return (f"{label}: channel axis {match.axis} of a rank-{match.rank} input "
                "(FusedBatchNormV3 takes channels last or first)")
    if _layout(match.rank, match.axis)[1] and match.axis != match.rank - 1:
        x_node = view.node(match.x)
        shape = output_shape(x_node, parse_input(match.x)[1]) if x_node else None
        if shape is None or shape[2] is None:
            return f"{label}: channels-first 3-D input of unknown length"
    why = kernel_blocker(ctx.target, "FusedBatchNormV3", match.dtype, fmt,
                         match.kind == "training", match.channels, match.epsilon)
    why = why or _blocked(view, match)
    if why is None and ctx.overlaps(n.name for n in match.interior):
        why = "overlaps another batch norm"
    if why is None:
        return None
    if match.kind == "training" and "feeds" in why:
        why += (" (the backward reads it: training batch norm is fused before "
                "differentiation, by the batch_norm stage)")
    return f"{label}: {why}"


def _blocked(view: GraphView, match: BatchNormMatch) -> str | None:
    stats = [n for n in (match.batch_mean, match.batch_variance) if n is not None]
    inside = {n.name for n in (*match.interior, match.tail, *stats)}
    for node in match.interior:
        why = blocker(view, node, inside)
        if why is not None:
            return why
    for node in (match.batch_mean, match.batch_variance):
        if node is not None and (node.name in view.protected or view.has_control_edges(node)):
            return f"batch {node.op} is fetched or has a control edge"
    if view.has_control_edges(match.tail):
        return "batch norm output has a control edge"
    return None


# -- emit -----------------------------------------------------------------------------------
def _set_shapes(node: NodeDef, shapes: list[tuple | None]) -> None:
    attr = node.attr["_output_shapes"]
    del attr.list.shape[:]
    for shape in shapes:
        attr.list.shape.add().CopyFrom(tf.TensorShape(shape).as_proto())


def _shape4(match: BatchNormMatch, x_shape: tuple | None) -> list[int]:
    """The 4-D shape a 2-D/3-D input is reshaped to for FusedBatchNormV3."""
    if match.axis == match.rank - 1:
        return [-1, 1, 1, match.channels]
    return [-1, match.channels, x_shape[2], 1]  # [N, C, T] -> NCHW [N, C, T, 1]


def _batch_statistics(view: GraphView, match: BatchNormMatch, fused_name: str, x4: str,
                      new: list[NodeDef]) -> list[tuple[NodeDef, int, str]]:
    """Keras's moving-average updates read the batch statistics: the rewiring that gives them
    the kernel's (nodes it needs appended to ``new``); the composite's statistics removed."""
    base, dev, c = f"{match.tail.name}/tfmx_bn", match.tail.device, match.channels
    dtype = tf.as_dtype(match.dtype)
    rewire: list[tuple[NodeDef, int, str]] = []
    inside = {n.name for n in match.interior}
    for stat, port in ((match.batch_mean, 1), (match.batch_variance, 2)):
        for consumer, index, _, ctl in view.consumer_edges(stat.name):
            if not ctl and consumer.name not in inside:
                rewire.append((consumer, index, tensor_ref(fused_name, port)))
    if any(ref.endswith(":2") for _, _, ref in rewire):
        # batch_variance is Bessel-corrected (times n / (n - 1)); Keras averages the biased
        # one: divide by the same factor, computed as the kernel does. (Ops from the Metal
        # plugin's list only: no Mul/Sub there.)
        new.append(new_node(f"{base}/count", "Size", [x4], dev, T=dtype, out_type=tf.int32))
        new.append(new_node(f"{base}/count_f", "Cast", [new[-1].name], dev,
                              SrcT=tf.int32, DstT=tf.float32, Truncate=False))
        new.append(const_node(f"{base}/channels", np.array(float(c), np.float32), dev))
        new.append(new_node(f"{base}/n", "RealDiv", [f"{base}/count_f", f"{base}/channels"],
                              dev, T=tf.float32))
        new.append(const_node(f"{base}/minus_one", np.array(-1.0, np.float32), dev))
        new.append(new_node(f"{base}/n_minus_1", "AddV2", [f"{base}/n", f"{base}/minus_one"],
                              dev, T=tf.float32))
        new.append(new_node(f"{base}/bessel", "RealDiv", [f"{base}/n", f"{base}/n_minus_1"],
                              dev, T=tf.float32))
        new.append(new_node(f"{base}/batch_variance", "RealDiv",
                              [tensor_ref(fused_name, 2), f"{base}/bessel"], dev, T=tf.float32))
        rewire = [(cn, i, f"{base}/batch_variance" if ref.endswith(":2") else ref)
                  for cn, i, ref in rewire]
    for stat in (match.batch_mean, match.batch_variance):
        view.remove(stat.name)
    return rewire


def rewrite_batch_norm(view: GraphView, match: BatchNormMatch) -> NodeDef:
    """Replace the composite with one ``FusedBatchNormV3``; return it."""
    tail, dev = match.tail, match.tail.device
    base = f"{tail.name}/tfmx_bn"
    fmt, how = _layout(match.rank, match.axis)
    c = match.channels
    dtype = tf.as_dtype(match.dtype)
    new: list[NodeDef] = []
    x4 = match.x
    x_node = view.node(match.x)
    x_shape = output_shape(x_node, parse_input(match.x)[1]) if x_node is not None else None
    if how is not None:
        new.append(const_node(f"{base}/shape4", np.array(_shape4(match, x_shape), np.int32), dev))
        new.append(new_node(f"{base}/to4d", "Reshape", [match.x, new[-1].name], dev,
                              T=dtype, Tshape=tf.int32))
        x4 = new[-1].name

    def vector(ref: str | None, fill: float, name: str) -> str:
        if ref is not None:
            return ref
        new.append(const_node(f"{base}/{name}", np.full([c], fill, np.float32), dev))
        return new[-1].name

    training = match.kind == "training"
    if training:
        new.append(const_node(f"{base}/empty", np.zeros([0], np.float32), dev))
        mean = variance = new[-1].name
    else:
        mean, variance = match.mean, match.variance
    fused_name = tail.name if how is None else f"{base}/FusedBatchNormV3"
    fused = new_node(
        fused_name, "FusedBatchNormV3",
        [x4, vector(match.gamma, 1.0, "ones"), vector(match.beta, 0.0, "zeros"), mean, variance],
        dev, T=dtype, U=tf.float32, epsilon=match.epsilon, exponential_avg_factor=1.0,
        data_format=fmt.encode(), is_training=training,
    )
    y_shape = x_shape if how is None else None
    _set_shapes(fused, [y_shape, (c,), (c,), (c,), (c,), None])
    new.append(fused)
    if how is not None:
        new.append(new_node(f"{base}/shape", "Shape", [match.x], dev, T=dtype,
                              out_type=tf.int32))
        new.append(new_node(tail.name, "Reshape", [fused_name, new[-1].name], dev, T=dtype,
                              Tshape=tf.int32))
    if how is not None and "_output_shapes" in tail.attr:
        new[-1].attr["_output_shapes"].CopyFrom(tail.attr["_output_shapes"])

    rewire = _batch_statistics(view, match, fused_name, x4, new) if training else []
    for node in match.interior:
        view.remove(node.name)
    view.remove(tail.name)
    for node in new:
        view.add(node)
    for consumer, index, ref in rewire:
        view.replace_input(consumer, index, ref)
    return fused


# -- declaration ----------------------------------------------------------------------------
RULE = Rule(anchors=frozenset({"Rsqrt"}), match=_match, check=_check,
            emit=lambda v, m: rewrite_batch_norm(v, m),
            kind=lambda m: f"FusedBatchNormV3({m.kind}, {m.dtype})",
            claims=lambda m: [n.name for n in m.interior])


_BOTH = graph_pass(RULE, EX_RULE)  # the composite first: its FusedBatchNormV3 may take a side input


def find_batch_norm(view: GraphView, target: Target) -> tuple[list[BatchNormMatch], list[str]]:
    """Every composite batch norm in ``view`` that ``target`` can run fused, and declines."""
    return RULE.find(view, target)


@register(
    "batch_norm",
    "composite BatchNormalization -> FusedBatchNormV3 (training: before differentiation, "
    "via the stage fusion.calls.batch_norm); FusedBatchNormV3 + Add + Relu -> _FusedBatchNormEx",
    after=("conv_bn_fold",),
    order=("it fuses the inference batch norms that conv_bn_fold did not fold into a "
           "convolution"),
)
def batch_norm_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Fuse every composite batch norm, then every batch norm + residual Add + Relu."""
    _BOTH(view, ctx)


# Read from tensorflow-metal-plugin 0.4.1's source: its batch norms, _FusedBatchNormEx and
# _FusedBatchNormGradEx among them, rank-4 NHWC or NCHW with any channel count, activation
# Identity or Relu (metal_batch_norm_ops.mm; the Ex gradient undoes the Relu from y, its 8th
# input, as tfmx's batch_norm_ex wires it).
_OPEN_FORMATS = frozenset({"NHWC", "NCHW"})


def batch_norm_kernels(platform: Platform) -> BatchNormKernels | None:
    """What ``platform`` runs of the batch-norm kernels (the family's ``capability``); None
    where it has no ``FusedBatchNormV3`` with its gradient.

    >>> batch_norm_kernels(Platform("cuda")).blocker("_FusedBatchNormEx", "float16", "NCHW")
    '_FusedBatchNormEx in training takes NHWC'
    >>> print(batch_norm_kernels(Platform("cpu")).blocker("FusedBatchNormV3", "float16", "NCHW"))
    None
    """
    if platform.name == "cpu":
        # Probed (TF 2.21, x86-64): FusedBatchNormV3 and its gradient run in float32,
        # bfloat16 and float16, NHWC and NCHW. _FusedBatchNormEx is registered on CPU but
        # its kernel produces no output ("Missing 0-th output"), oneDNN on or off.
        return BatchNormKernels(
            dtypes=frozenset({"float32", "bfloat16", "float16"}),
            data_formats=frozenset({"NHWC", "NCHW", "NDHWC", "NCDHW"}),
            ex_reason="registered on CPU but its kernel produces no output in TF 2.21",
        )
    if platform.name == "cuda":
        # tensorflow/core/kernels/fused_batch_norm_op.cc and Grappler's remapper.cc:
        # inference _FusedBatchNormEx is a custom CUDA kernel (float, half; NHWC/NCHW);
        # training goes through cuDNN (half, NHWC, channels % 4) and needs the backward as
        # _FusedBatchNormGradEx, which tfmx does not emit yet.
        return BatchNormKernels(
            dtypes=frozenset({"float32", "float16"}),
            data_formats=frozenset({"NHWC", "NCHW", "NDHWC", "NCDHW"}),
            ex_inference_dtypes=frozenset({"float32", "float16"}),
            ex_data_formats=frozenset({"NHWC", "NCHW"}),
            # The kernel's own checks (fused_batch_norm_op.cc): with an activation or a side
            # input in training, half only, NHWC only, cuDNN's persistent mode on; the remapper
            # adds channels % 4.
            ex_training_dtypes=frozenset({"float16"}),
            ex_training_channel_multiple=4,
            ex_training_env="TF_USE_CUDNN_BATCHNORM_SPATIAL_PERSISTENT",
            min_epsilon=1.001e-5,
        )
    if platform.apple_metal:
        # The plugin registers FusedBatchNorm{,V2,V3}, their grads and _FusedBatchNormEx; its
        # messages say the side-input + activation form wants half, NHWC and channels % 4.
        return BatchNormKernels(
            dtypes=frozenset({"float32", "float16", "bfloat16"}),
            data_formats=frozenset({"NHWC", "NCHW"}),
            ex_inference_dtypes=frozenset({"float16"}),
            ex_data_formats=frozenset({"NHWC"}),
            ex_channel_multiple=4,
            ex_reason="training needs the backward as _FusedBatchNormGradEx, which the plugin "
                      "does not register",
        )
    bn = platform.dtypes("FusedBatchNormV3", "FusedBatchNormGradV3")
    if not bn:
        return None
    ex = platform.dtypes("_FusedBatchNormEx") & bn
    ex_training = ex & platform.dtypes("_FusedBatchNormGradEx")
    assert platform.table is not None
    return BatchNormKernels(
        dtypes=bn, data_formats=_OPEN_FORMATS,
        ex_inference_dtypes=ex, ex_data_formats=_OPEN_FORMATS,
        ex_training_dtypes=ex_training, ex_training_data_formats=_OPEN_FORMATS,
        ex_reason=("" if ex_training else
                   f"{platform.table.name} {platform.table.version} has no _FusedBatchNormEx / "
                   "_FusedBatchNormGradEx kernel"),
    )


declare(Family("batch_norm", "", capability=batch_norm_kernels))
