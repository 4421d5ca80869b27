"""Sibling projections: products of one input by several kernels as one product, where measured.

A gated feed-forward block (SwiGLU, GeGLU: keras_hub's Llama, Mistral, Gemma and Qwen decoders,
``Dense_gate(x)`` and ``Dense_up(x)``) and the query, key and value projections of an attention
layer multiply one input ``x`` by several kernels. Merged, the step runs one product of ``x``
with the kernels side by side (a ``ConcatV2`` of them, and of their biases) and splits its
output (``SplitV``). Its gradient, where it has the shape TensorFlow's MatMul gradient gives
it, is merged too: the input's gradient, ``sum_i dy_i @ W_i^T`` (several MatMuls and an
``AddN``), becomes one MatMul of the concatenated output gradients with the concatenated
kernel, and the kernels' gradients ``x^T @ dy_i`` one MatMul split back per kernel. The price is
the per-step copy of the kernels and output gradients into their concatenations; whether the
merged form is faster depends on the shapes and the machine, so every group is a tuner decision
(the group's forward and backward nodes timed as fragments of the graph), the conservative form
the separate products Keras traced.

Why a graph pass and not a stage: the siblings are separate Keras calls (``Dense``,
``EinsumDense``) made by layers the user or keras_hub wrote, whose code reads the first
sibling's output (keras_hub casts and activates the gate) before it makes the second call. A
stage sees one call at a time and must return its output at once: it cannot know a sibling
follows, nor change an output the layer has already used; a guess made at the first call would
compute the merged product even where no sibling comes. Subclassed layers have no functional
graph to look ahead in. The traced step holds every sibling, its gradient nodes and their
readers, whatever class made them: the pass matches the ops themselves, forward and backward,
and leaves the gradient of anything it does not merge as TensorFlow wrote it (the forward merge
alone is exact on its own: the gradient nodes read the kernels and output gradients, which
stay).

Matched: ``MatMul`` (and ``_FusedMatMul`` with one bias, as the contraction family leaves a
``Dense`` with a bias and activation) and ``BatchMatMulV2`` of a rank-2 kernel (Keras's
einsum of an ``EinsumDense``), the kernels not transposed, whose first operands are one value
(the same tensor, or the same pure computation of it: each Keras ``Dense`` on tokens reshapes
its input on its own) and whose attributes are equal. The gradient is merged with its forward
where each sibling's input gradient is one product read by one sum (directly, or through the
same reshapes: TensorFlow's batched product's gradient reshapes and sums over no axis) and,
for a 2-D MatMul, its kernel gradient one MatMul of the same input. Where the input takes no
gradient (a model's input), the forward merges alone (the report says why) and the kernels'
gradients ``x^T @ dy_i``, products of one transposed input, merge as a group of their own.
Declined, with the reason: kernels read transposed, kernels of unknown width, a kernel computed
from a sibling's output, control edges, fetched outputs, dtypes other than float32, bfloat16
and float16, a target without a ``ConcatV2`` or ``SplitV`` kernel in the dtype. Products of
different values (an input and its cast to another dtype) are no siblings.

Not folded here: the gated product ``activation(gate) * up`` that reads the two outputs. It
is the gated_product stage's (``fusion.calls.gated_product``): made before differentiation,
with both gradients in closed form or as an XLA region, from the gate and ``up`` whichever
form this pass leaves them in.

Example:
    >>> import tensorflow as tf
    >>> from fusion.graph import GraphView
    >>> from fusion.graphs.sibling_projections import find_siblings
    >>> from tfmx.backends import get_backend
    >>> @tf.function
    ... def f(x, w1, w2):
    ...     return tf.matmul(x, w1) * tf.matmul(x, w2)
    >>> g = f.get_concrete_function(*[tf.TensorSpec(s) for s in ([8, 4], [4, 6], [4, 6])]
    ...                             ).graph.as_graph_def(add_shapes=True)
    >>> found, declined = find_siblings(GraphView(g.node), get_backend("cpu"))
    >>> [m.signature for m in found], declined
    (['MatMul float32 8x4 x [6, 6] (forward)'], [])
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from fusion.family import register
from fusion.fragment import shape_text, tensor_shape
from fusion.graph import GraphView, NodeDef, output_shape, parse_input, tensor_ref
from fusion.match import const_node, const_value, dtype_name, new_node
from fusion.pattern import Chooser, RewriteContext, Target
from fusion.rule import Rule, RuleContext

FAMILY = "sibling_projections"
SCOPE = "tfmx_siblings"
"""The scope of the nodes written for one group: ``<first sibling's name>/tfmx_siblings/``."""

STOCK, FUSED = "separate", "merged"  # the tuner's names for the two forms
DTYPES = ("float32", "bfloat16", "float16")
# op -> (its attributes that transpose the first and the second operand)
PRODUCTS = {"MatMul": ("transpose_a", "transpose_b"),
            "_FusedMatMul": ("transpose_a", "transpose_b"),
            "BatchMatMulV2": ("adj_x", "adj_y")}
EMITS = frozenset({"ConcatV2", "SplitV"})
"""What the merged form adds to the products it replaces (checked against the target)."""
PASS_THROUGH = frozenset({"Reshape", "Sum", "Identity"})
"""What may stand between an input gradient and the sum that reads it."""
_SEARCH = 20000  # nodes a cycle check visits at most before it declines


@dataclasses.dataclass
class Gradient:
    """A sibling's gradient nodes: ``dx`` (``dy @ W^T``), the nodes between it and the sum that
    reads it (``chain``: a reshape, a sum over no axis, as TensorFlow's batched product's
    gradient writes them), the sum (``total``) and ``dw`` (``x^T @ dy``, None for a batched
    product, whose kernel gradient stays as it is)."""

    dy: str
    dx: str
    chain: list[str]
    total: str
    dw: str | None
    sums: frozenset[str] = frozenset()
    """The chain's sums over no axis: left out of the merged form and of the timed fragment
    (their axes may be computed from shapes, which a fragment cannot make up)."""

    @property
    def read(self) -> str:
        """The node the sum reads."""
        return self.chain[-1] if self.chain else self.dx


@dataclasses.dataclass
class SiblingGroup:
    """Products of one input ``x`` by several kernels: the sibling nodes' names, in order, the
    kernels' (and biases') references and widths, and their gradients where they merge."""

    op: str
    x: str
    siblings: list[str]
    kernels: list[str]
    biases: list[str]
    widths: list[int]
    x_shape: tuple[int | None, ...]
    contracted: int | None
    transposed: bool
    dtype: str
    rank: int
    gradients: list[Gradient] | None = None
    why_forward_only: str | None = None

    @property
    def signature(self) -> str:
        part = "kernel gradients" if self.transposed else \
            "forward and gradients" if self.gradients else "forward"
        x = f"({shape_text(self.x_shape)})^T" if self.transposed else shape_text(self.x_shape)
        return (f"{self.op} {self.dtype} {x} x {self.widths}"
                f"{' + bias' if self.biases else ''} ({part})")

    @property
    def nodes(self) -> list[str]:
        names = list(self.siblings)
        for grad in self.gradients or ():
            names += [grad.dx, *(n for n in grad.chain if n not in grad.sums), grad.total]
            names += [grad.dw] if grad.dw else []
        return list(dict.fromkeys(names))


# -- match ----------------------------------------------------------------------------------
def _pure(node: NodeDef) -> bool:
    if node.op == "ReadVariableOp":  # two reads with the same control inputs: one value
        return True
    op_def = op_def_registry.get(node.op)
    return op_def is not None and not op_def.is_stateful and node.op != "Placeholder"


def _value(view: GraphView, ref: str, memo: dict, depth: int = 0) -> int:
    """An id equal for two references exactly when they are one tensor or the same pure
    computation of equal inputs (ops, attributes, device and control inputs alike); deep
    chains are compared by reference only (never equal by mistake)."""
    name, port, _ = parse_input(ref)
    key = tensor_ref(name, port)
    found = memo.get(key)
    if found is not None:
        return found
    node = view.node(name)
    if node is None or depth > 48 or not _pure(node):
        shape: tuple = ("ref", key)
    else:
        attrs = tuple(sorted((k, v.SerializeToString(deterministic=True))
                             for k, v in node.attr.items() if not k.startswith("_")))
        shape = (node.op, port, node.device, attrs,
                 tuple(_value(view, i, memo, depth + 1) for i in view.data_inputs(node)),
                 tuple(sorted(i for i in node.input if i.startswith("^"))))
    ids = memo.setdefault("__ids__", {})
    memo[key] = ids.setdefault(shape, len(ids))
    return memo[key]


def _group_key(view: GraphView, node: NodeDef, memo: dict) -> tuple | None:
    if node.op not in PRODUCTS or len(view.data_inputs(node)) < 2:
        return None
    attrs = tuple(sorted((k, v.SerializeToString(deterministic=True))
                         for k, v in node.attr.items() if not k.startswith("_")))
    return node.op, node.device, attrs, _value(view, view.data_inputs(node)[0], memo)


def _groups(ctx: RuleContext) -> list[str] | None:
    """Every node's group of products of one value (the rule's ``begin``)."""
    groups: dict[tuple, list[str]] = {}
    memo: dict = {}
    for node in ctx.view.nodes():
        key = _group_key(ctx.view, node, memo)
        if key is not None:
            groups.setdefault(key, []).append(node.name)
    ctx.memo["groups"] = {names[0]: names for names in groups.values() if len(names) > 1}
    ctx.memo["values"] = memo
    return None


def _match(node: NodeDef, ctx: RuleContext) -> SiblingGroup | str | None:
    """The group whose first product is ``node`` (a str: why it cannot be one)."""
    names = ctx.memo["groups"].get(node.name)
    if names is None:
        return None
    view = ctx.view
    nodes = [view.node(n) for n in names]
    first_t, second_t = PRODUCTS[node.op]
    dtype = dtype_name(node)
    what = f"{len(names)} {node.op} of one input ({node.name})"
    transposed = node.attr[first_t].b  # x^T @ dy_i: kernel gradients
    if ctx.overlaps(names) or (transposed and node.op not in ("MatMul", "_FusedMatMul")):
        return None  # a forward group's gradients, merged with it
    if node.attr[second_t].b:
        return f"{what}: the kernels read transposed"
    if dtype not in DTYPES:
        return f"{what}: dtype {dtype}"
    if node.op == "_FusedMatMul" and node.attr["num_args"].i != 1:
        return f"{what}: fused with {node.attr['num_args'].i} extra operands (not one bias)"
    x = view.data_inputs(node)[0]
    x_shape = tensor_shape(view, x)
    kernels = [view.data_inputs(n)[1] for n in nodes]
    shapes = [tensor_shape(view, k) for k in kernels]
    if any(s is not None and len(s) != 2 for s in shapes):
        return None  # batched operands on both sides: no projection by kernels
    if x_shape is None or any(s is None or s[1] is None for s in shapes):
        return f"{what}: the input's rank or a kernel's width is not known"
    contracted = {s[0] for s in shapes} - {None}
    if len(contracted) > 1:  # each is a product of the same input: never where it runs
        return f"{what}: the kernels' contracted sizes differ"
    if len(set(kernels)) != len(kernels):
        return f"{what}: one kernel read twice"
    for n in nodes:
        if view.has_control_edges(n) or n.name in view.protected:
            return f"{what}: a product has a control edge or is fetched"
    biases = [view.data_inputs(n)[2] for n in nodes] if node.op == "_FusedMatMul" else []
    order = _order(ctx)
    if _reaches(view, order, kernels + biases, names):
        return f"{what}: a kernel is computed from a sibling's output"
    group = SiblingGroup(node.op, x, names, kernels, biases, [s[1] for s in shapes], x_shape,
                         next(iter(contracted), None), transposed, dtype, len(x_shape))
    if transposed:
        group.why_forward_only = "products of a transposed input (kernel gradients)"
    else:
        _find_gradients(view, group, ctx)
    return group


def _order(ctx: RuleContext) -> dict[str, int]:
    if "order" not in ctx.memo:
        ctx.memo["order"] = {n: i for i, n in enumerate(ctx.view.topological_order())}
    return ctx.memo["order"]


def _reaches(view: GraphView, order: dict[str, int], starts: list[str],
             targets: list[str]) -> bool:
    """Whether a node of ``targets`` is ``starts`` or an ancestor of one (True where unsure)."""
    wanted = set(targets)
    floor = min(order.get(t, -1) for t in targets)
    seen: set[str] = set()
    work = [parse_input(s)[0] for s in starts]
    while work:
        name = work.pop()
        if name in wanted:
            return True
        if name in seen or order.get(name, floor) < floor:
            continue
        seen.add(name)
        if len(seen) > _SEARCH:
            return True
        node = view.node(name)
        if node is not None:
            work.extend(parse_input(i)[0] for i in node.input)
    return False


def _only_reader(view: GraphView, name: str) -> NodeDef | None:
    edges = view.consumer_edges(name)
    if len(edges) != 1 or edges[0][3] or edges[0][2] != 0 or name in view.protected:
        return None
    return edges[0][0]


def _gradient(view: GraphView, group: SiblingGroup, i: int, memo: dict) -> Gradient | str:
    """Sibling ``i``'s gradient nodes, or why they do not merge."""
    sibling = view.node(group.siblings[i])
    first_t, second_t = PRODUCTS[group.op]
    base = "MatMul" if group.op == "_FusedMatMul" else group.op
    kernel = group.kernels[i]
    dxs = [c for c in view.consumers(*_name_port(kernel))
           if c.op == base and c.attr[second_t].b and not c.attr[first_t].b
           and c.attr["T"].type == sibling.attr["T"].type and view.data_inputs(c)[1] == kernel]
    if len(dxs) != 1:
        return "no one input-gradient product per kernel (the input takes no gradient)"
    dx = dxs[0]
    dy = view.data_inputs(dx)[0]
    chain: list[str] = []
    reader = _only_reader(view, dx.name)
    while reader is not None and reader.op in PASS_THROUGH and len(chain) < 3 \
            and not view.has_control_edges(reader) and _passes(view, reader):
        chain.append(reader.name)
        reader = _only_reader(view, reader.name)
    if reader is None or reader.op != "AddN" or view.has_control_edges(dx):
        return "an input gradient is not read by one sum alone"
    total = reader
    dw = None
    if group.op in ("MatMul", "_FusedMatMul"):
        dws = [c for c in view.consumers(*_name_port(dy))
               if c.op == "MatMul" and c.attr[first_t].b and not c.attr[second_t].b
               and view.data_inputs(c)[1] == dy
               and _value(view, view.data_inputs(c)[0], memo) == _value(view, group.x, memo)]
        if len(dws) == 1 and not view.has_control_edges(dws[0]) and \
                dws[0].name not in view.protected:
            dw = dws[0].name
    sums = frozenset(n for n in chain if view.node(n).op == "Sum")
    return Gradient(dy, dx.name, chain, total.name, dw, sums)


def _passes(view: GraphView, node: NodeDef) -> bool:
    """Whether ``node`` keeps its input's values as they are: a reshape, or a sum over no
    axis (a constant empty list, or axes computed where the sum keeps its input's rank)."""
    if node.op != "Sum":
        return True
    axes = const_value(view, view.data_inputs(node)[1])
    if axes is not None:
        return axes.size == 0
    # axes computed (a batched product's BroadcastGradientArgs): none when the rank stays
    before, after = tensor_shape(view, view.data_inputs(node)[0]), output_shape(node)
    return not node.attr["keep_dims"].b and before is not None and after is not None \
        and len(before) == len(after)


def _name_port(ref: str) -> tuple[str, int]:
    name, port, _ = parse_input(ref)
    return name, port


def _find_gradients(view: GraphView, group: SiblingGroup, ctx: RuleContext) -> None:
    found = [_gradient(view, group, i, ctx.memo["values"]) for i in range(len(group.siblings))]
    why = next((g for g in found if isinstance(g, str)), None)
    if why is None:
        grads = [g for g in found if isinstance(g, Gradient)]
        chains = [[view.node(n) for n in g.chain] for g in grads]
        if len({g.total for g in grads}) != 1:
            why = "the input gradients are not summed by one node"
        elif len({_chain_key(view, c, ctx.memo["values"]) for c in chains}) != 1:
            why = "the input gradients are reshaped unlike each other"
        elif _reaches(view, _order(ctx), [g.dy for g in grads],
                      [n for g in grads for n in (g.dx, g.dw) if n]):
            why = "an output gradient is computed from a sibling's gradient"
        else:
            if any(g.dw is None for g in grads):  # the kernels' gradients stay as they are
                for g in grads:
                    g.dw = None
            group.gradients = grads
            return
    group.why_forward_only = why


def _chain_key(view: GraphView, chain: list[NodeDef], memo: dict) -> tuple:
    """What each node of a chain does: its op and its other operands' values (a sum's axes
    aside: it reduces none, :func:`_passes`)."""
    return tuple((n.op, () if n.op == "Sum" else
                  tuple(_value(view, i, memo) for i in view.data_inputs(n)[1:])) for n in chain)


# -- check ----------------------------------------------------------------------------------
def _check(group: SiblingGroup, ctx: RuleContext) -> str | None:
    """Why the group keeps its separate products: the target, an overlap with a group taken
    before, or the tuner measuring them faster."""
    from fusion.forms import kernel_missing

    ops = EMITS | {"MatMul"} if group.gradients else EMITS
    why = kernel_missing(ctx.target, FUSED, ops, group.dtype)
    if why is None and ctx.overlaps(group.nodes):
        why = "its gradient nodes are another group's"
    if why is not None:
        return f"{group.signature}: {why}"
    kept = ctx.tuned(FAMILY, group.signature, group.nodes,
                     lambda v: rewrite_siblings(v, group), stock=STOCK, fused=FUSED)
    return None if kept is None else f"{group.signature}: separate products kept: {kept}"


# -- emit -----------------------------------------------------------------------------------
def _shaped(node: NodeDef, *shapes: tuple | None) -> NodeDef:
    if all(s is not None for s in shapes):
        for s in shapes:
            node.attr["_output_shapes"].list.shape.add().CopyFrom(tf.TensorShape(s).as_proto())
    return node


def _concat(view: GraphView, name: str, refs: list[str], axis: int, dtype: tf.DType,
            device: str, shape: tuple | None) -> str:
    view.add(const_node(f"{name}_axis", np.array(axis, np.int32), device))
    view.add(_shaped(new_node(name, "ConcatV2", [*refs, f"{name}_axis"], device, T=dtype,
                              N=len(refs), Tidx=tf.int32), shape))
    return name


def _split(view: GraphView, name: str, ref: str, widths: list[int], axis: int, dtype: tf.DType,
           device: str, shapes: list[tuple | None]) -> str:
    view.add(const_node(f"{name}_widths", np.array(widths, np.int32), device))
    view.add(const_node(f"{name}_axis", np.array(axis, np.int32), device))
    view.add(_shaped(new_node(name, "SplitV", [ref, f"{name}_widths", f"{name}_axis"], device,
                              T=dtype, num_split=len(widths), Tlen=tf.int32), *shapes))
    return name


def _stand_in(view: GraphView, old: str, ref: str) -> None:
    """Node ``old`` becomes an Identity of ``ref`` (its name and static shape kept)."""
    node = view.node(old)
    identity = new_node(old, "Identity", [ref], node.device, T=tf.as_dtype(node.attr["T"].type))
    if "_output_shapes" in node.attr:
        identity.attr["_output_shapes"].CopyFrom(node.attr["_output_shapes"])
    view.replace(old, identity)


def rewrite_siblings(view: GraphView, group: SiblingGroup) -> None:
    """Write the group's one product of the concatenated kernels (and biases) and its split,
    each sibling an Identity of its part; where the gradients merge, the input's gradient as
    one product of the concatenated output gradients summed in place of the siblings', and
    the kernels' gradients as one product split back."""
    first = view.node(group.siblings[0])
    device, base = first.device, f"{first.name}/{SCOPE}"
    dtype = tf.as_dtype(first.attr["T"].type)
    width = sum(group.widths)
    second_axis = 1  # the kernels' kept axis
    kernel = _concat(view, f"{base}/kernels", group.kernels, second_axis, dtype, device,
                     (group.contracted, width))
    product = NodeDef()
    product.CopyFrom(first)
    product.name = f"{base}/product"
    del product.input[:]
    product.input.extend([group.x, kernel])
    if group.biases:
        product.input.append(_concat(view, f"{base}/biases", group.biases, 0, dtype, device,
                                     (width,)))
    out = output_shape(first)
    merged = None if out is None else (*out[:-1], width)
    product.attr.pop("_output_shapes", None)
    view.add(_shaped(product, merged))
    parts = [None if out is None else (*out[:-1], w) for w in group.widths]
    split = _split(view, f"{base}/split", product.name, group.widths, group.rank - 1, dtype,
                   device, parts)
    for i, name in enumerate(group.siblings):
        _stand_in(view, name, tensor_ref(split, i))
    if group.gradients:
        _rewrite_gradients(view, group, base, kernel, dtype, device)


def _rewrite_gradients(view: GraphView, group: SiblingGroup, base: str, kernel: str,
                       dtype: tf.DType, device: str) -> None:
    grads = group.gradients
    first_dx = view.node(grads[0].dx)
    dy_shape = output_shape(view.node(grads[0].dy), parse_input(grads[0].dy)[1])
    width = sum(group.widths)
    dys = _concat(view, f"{base}/output_grads", [g.dy for g in grads], group.rank - 1, dtype,
                  device, None if dy_shape is None else (*dy_shape[:-1], width))
    dx = NodeDef()
    dx.CopyFrom(first_dx)
    dx.name = f"{base}/input_grad"
    del dx.input[:]
    dx.input.extend([dys, kernel])
    view.add(dx)
    summed = dx.name
    for i, name in enumerate(grads[0].chain):  # the same reshapes, of the merged gradient
        if name in grads[0].sums:
            continue
        step = NodeDef()
        step.CopyFrom(view.node(name))
        step.name = f"{base}/input_grad_{i}"
        step.input[0] = summed
        view.add(step)
        summed = step.name
    total = view.node(grads[0].total)
    reads = {g.read for g in grads}
    data = [i for i in view.data_inputs(total) if parse_input(i)[0] not in reads]
    controls = [i for i in total.input if i.startswith("^")]
    new_total = new_node(total.name, "AddN" if data else "Identity", [summed, *data, *controls],
                         total.device, T=tf.as_dtype(total.attr["T"].type))
    if data:
        new_total.attr["N"].i = len(data) + 1
    if "_output_shapes" in total.attr:
        new_total.attr["_output_shapes"].CopyFrom(total.attr["_output_shapes"])
    view.replace(total.name, new_total)
    if all(g.dw is not None for g in grads):
        dw = NodeDef()
        dw.CopyFrom(view.node(grads[0].dw))
        dw.name = f"{base}/kernel_grad"
        del dw.input[:]
        dw.input.extend([group.x, dys])
        dw.attr.pop("_output_shapes", None)
        view.add(_shaped(dw, (group.contracted, width)))
        split = _split(view, f"{base}/kernel_grad_split", dw.name, group.widths, 1, dtype,
                       device, [(group.contracted, w) for w in group.widths])
        for i, g in enumerate(grads):
            _stand_in(view, g.dw, tensor_ref(split, i))
    view.prune([n for g in grads for n in (g.dx, *g.chain)])


# -- declaration ----------------------------------------------------------------------------
def _forward_first(view: GraphView) -> list[NodeDef]:
    """The view's nodes, products of a transposed input (kernel gradients) last: a forward
    group takes its gradients before they could make a group of their own."""
    return sorted(view.nodes(), key=lambda n: n.op in PRODUCTS and n.attr[PRODUCTS[n.op][0]].b)


RULE = Rule(anchors=frozenset(PRODUCTS), begin=_groups, walk=_forward_first, match=_match,
            check=_check,
            emit=lambda v, m: rewrite_siblings(v, m),
            kind=lambda m: (f"{len(m.siblings)} {m.op} of one {'transposed ' * m.transposed}"
                            f"input -> one {m.op} of the concatenated "
                            f"{'output gradients' if m.transposed else 'kernels'}"),
            partial=lambda m: None if m.gradients or m.transposed else
            f"forward only: {m.why_forward_only}",
            claims=lambda m: m.nodes)


def find_siblings(view: GraphView, target: Target, tuner: Chooser | None = None
                  ) -> tuple[list[SiblingGroup], list[str]]:
    """Every group of products of one input in ``view`` that ``tuner`` (if given) measures
    faster merged on ``target``, and a reason for each group left separate."""
    return RULE.find(view, target, tuner)


@register(
    FAMILY,
    "MatMul / _FusedMatMul / BatchMatMul siblings of one input (a gated feed-forward's gate and "
    "up projections, attention's query, key and value) -> one product of the concatenated "
    "kernels and a split, their gradients merged likewise, where the tuner measures it faster",
    after=("contraction", "einsum_dense", "reshaped_bias"),
    order=("it reads the products the contraction and einsum_dense families leave (a fused "
           "bias and activation merged with them); matmul_layout then lays out the merged "
           "input-gradient product"),
)
def sibling_projections_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Merge every group of products of one input that the tuner measures faster merged."""
    RULE.apply(view, ctx)

