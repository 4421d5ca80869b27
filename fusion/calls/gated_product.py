"""The gated_product stage: a gated feed-forward block's ``activation(gate) * up`` (SwiGLU,
GeGLU) trained with both gradients in closed form, or as one XLA region.

keras_hub's Llama, Mistral, Qwen and Qwen3 decoders compute ``ops.multiply(up,
ops.cast(silu(ops.cast(gate, "float32")), compute_dtype))`` (the SiLU in float32 whatever the
policy), Gemma's ``keras.activations.gelu(gate, approximate=True) * up``, and users' own layers
``keras.activations.silu(g) * u`` or ``keras.ops.multiply(keras.ops.silu(g), u)``. Stock
differentiates the product and the activation apart: ``dy * up`` and ``dy * act(gate)``, then
the activation's gradient (``tf.nn.silu``'s recomputes its sigmoid), each a pass over the
block's largest tensors ([tokens, hidden]). No Keras layer holds the block, and a stage sees
one call at a time, so the stage hooks the calls the block is made of and joins them in the
graph being traced: the TensorFlow backend's ``silu`` and ``gelu`` (every ``keras.ops`` and
``keras.activations`` spelling reaches them) note their input and output in the graph's state
(``fusion.trace_state``); the backend's ``multiply`` (``keras.ops.multiply``) and TensorFlow's
``*`` operator on tensors (``math_ops._mul_dispatch``, what ``Tensor.__mul__`` and
``__rmul__`` call), of which the stage takes only the calls one of whose operands is a noted
activation's output (or a ``Cast`` or ``Identity`` of it: keras_hub's cast back to the compute
dtype), emit the product from the gate and ``up``:

- ``custom``: the activation in the gate's dtype (as stock computes it), the product with
  ``up`` in ``up``'s dtype, and a custom gradient from what the forward kept (SiLU's sigmoid,
  GELU's normal CDF or tanh: ``fusion.kernels.activations``): ``du = dy * act(gate)`` and
  ``dgate = (dy * up) * act'(gate)``, with stock's casts between;
- ``custom upcast`` (16-bit gate): the same with the activation computed in float32;
- ``xla`` (cpu and cuda with ``tfmx.enable(xla=True)``, never metal): the activation's value
  and derivative and the product computed in float32 by one XLA-compiled region, one loop
  reading gate and ``up`` once and writing the product, the activation (in ``up``'s dtype)
  and its derivative (in the gate's), the gradients two products outside XLA; ``xla
  backward`` the same with the gradients computed by a second region.

The activation's own call has run by then (Keras's, or the swish or gelu stage's form): read by
nobody once the product is emitted, its ops are taken out of the step (held apart from the
failed stage attempts' ops: ``fusion.transaction.superseded``), and what its stage counted
fused there is counted declined, with the reason: where only the activation is there, its
stage's form stays.
Every product is a tuner decision (forward and backward at its shapes) against the activation
(as its stage emits it) and the product, the conservative form. Without a gradient tape
recording (inference) nothing is noted. Declined, with the reason in the report: gates or
``up`` of dtypes other than float32, float16 and bfloat16, operands of two dtypes, shapes that
broadcast (static shapes that differ) or of unknown rank, an activation output read by another
op too or multiplied by itself.

Example:
    >>> import numpy as np, tensorflow as tf
    >>> from fusion.calls.gated_product import SILU, gated_custom
    >>> g = tf.constant(np.linspace(-3.0, 3.0, 7, dtype="float32"))
    >>> u = tf.constant(np.linspace(1.0, 2.0, 7, dtype="float32"))
    >>> with tf.GradientTape(persistent=True) as tape:
    ...     _ = tape.watch([g, u])
    ...     y, want = gated_custom(g, u, SILU), tf.nn.silu(g) * u
    >>> bool(np.allclose(y, want, atol=1e-6))
    True
    >>> all(np.allclose(tape.gradient(y, v), tape.gradient(want, v), atol=1e-6) for v in (g, u))
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from fusion import private_api, trace_state
from fusion.family import OBSERVED_AFTER, OBSERVED_ORDER, Family, Form, Forms, conservative, declare
from fusion.kernels import activations
from fusion.pattern import PatternStats
from fusion.stage import (
    XLA,
    XLA_CALLS,
    CallSite,
    Hook,
    StageContext,
    custom_gradient,
    noted_call,
    noted_through,
    recording,
    rewrite_call,
    timed_form,
    tracing,
    with_xla,
    xla_region,
)

# -- match: the Keras calls it hooks, and what it finds in them -----------------------------------
FAMILY = "gated_product"
SCOPE = "tfmx_gated"
MATCHES = ("keras.src.backend.tensorflow:nn.silu", "keras.src.backend.tensorflow:nn.gelu",
           "keras.src.backend.tensorflow:numpy.multiply",
           "tensorflow.python.ops:math_ops._mul_dispatch")
"""The calls the stage hooks: the TensorFlow backend's ``silu`` and ``gelu`` (noted), its
``multiply`` (``keras.ops.multiply``) and TensorFlow's ``*`` operator on tensors, of which the
stage takes the products of a noted activation."""
SILU, GELU, GELU_TANH = "SiLU", "GELU", "GELU (tanh)"
GELU_ERF = "GELU (erf)"  # the exact GELU through Erf, for a target without an Erfc kernel
_KERNELS: dict[str, activations.Kernel] = {
    SILU: activations.silu,
    GELU: lambda x: activations.gelu_exact(x, erfc=True),  # tf.nn.gelu's own CDF
    GELU_ERF: lambda x: activations.gelu_exact(x, erfc=False),
    GELU_TANH: activations.gelu_tanh,
}
_STAGE_OF = {SILU: "swish", GELU: "gelu", GELU_TANH: "gelu"}  # the stage of each activation


@dataclasses.dataclass
class Gate:
    """An activation call noted while a step is traced: its input ``x``, which activation
    (``kind``: :data:`SILU`, :data:`GELU`, :data:`GELU_TANH`), its output, the names of the ops
    the call made (its stage's form or Keras's) and the statistics its stage recorded for it."""

    x: tf.Tensor
    kind: str
    out: tf.Tensor
    made: tuple[str, ...]
    stats: list[PatternStats]


@dataclasses.dataclass
class Product:
    """A gated product found at a multiplication: the :class:`Gate`, the operand the product
    reads (``read``: the gate's output, or a cast of it), the ops from the one to the other
    (``between``) and the other operand, ``up``."""

    gate: Gate
    read: tf.Tensor
    between: tuple[tf.Operation, ...]
    up: tf.Tensor


def find_product(a: Any, b: Any) -> Product | None:
    """The gated product ``a * b`` is, where one operand is a noted activation's output (or a
    ``Cast`` or ``Identity`` of it, up to two); else None.

    >>> find_product(tf.constant(1.0), 2.0) is None
    True
    """
    for read, up in ((a, b), (b, a)):
        try:
            graph = read.graph
        except AttributeError:  # not a tensor of a graph (an eager tensor, a number)
            continue
        noted = trace_state.held(graph, FAMILY)
        if not noted or not tf.is_tensor(up):
            continue
        hit = noted_through(read, noted)
        if hit is not None:
            return Product(hit[0], read, hit[1], up)
    return None


def _a_product(a: Any, b: Any, *rest: Any, **kwargs: Any) -> bool:
    """Whether a multiplication is one the stage may take (its hook's ``when``): never raises."""
    try:
        return find_product(a, b) is not None
    except Exception:  # noqa: BLE001 - an operand of a kind not foreseen: not a product
        return False


# -- check: why a call keeps Keras's own form (None: it need not) ---------------------------------
_DTYPES = ("float32", "float16", "bfloat16")


def check(product: Product) -> str | None:
    """Why the stage leaves this product to Keras's calls, or None.

    >>> import tensorflow as tf
    >>> gate = Gate(tf.zeros([2, 3], tf.float64), SILU, tf.zeros([2, 3], tf.float64), (), [])
    >>> check(Product(gate, gate.out, (), tf.zeros([2, 3], tf.float64)))
    'gate dtype float64'
    """
    g, read, up = product.gate.x, product.read, product.up
    for what, t in (("gate", g), ("up", up)):
        if t.dtype.name not in _DTYPES:
            return f"{what} dtype {t.dtype.name}"
    if up.ref() == read.ref():
        return "the activation's output times itself"
    if read.dtype != up.dtype:
        return f"operands of two dtypes ({read.dtype.name} and {up.dtype.name})"
    if read.shape.rank is None or up.shape.rank is None or g.shape.rank is None:
        return "operands of unknown rank"
    if read.shape.as_list() != up.shape.as_list():
        return f"shapes that broadcast ({read.shape.as_list()} and {up.shape.as_list()})"
    chain = [product.gate.out, *(op.outputs[0] for op in product.between)]
    readers = [op for op in product.between]
    for t, reader in zip(chain, [*readers, None]):
        if [op.name for op in t.consumers()] != ([reader.name] if reader is not None else []):
            return "the activation's output is read by another op too"
    return None


# -- forms: what it emits (CONSERVATIVE: the form Keras runs), and the hook's flow ----------------
_SILU_OPS = frozenset({"AddV2", "Mul", "Sigmoid", "Sub"})
_CDF = frozenset({"Sigmoid", "Erf", "Erfc", "Tanh"})  # the op that shows a closed form
_OPS = {SILU: _SILU_OPS, GELU: frozenset({"AddV2", "Erfc", "Exp", "Mul", "Neg", "Sub"}),
        GELU_ERF: frozenset({"AddV2", "Erf", "Exp", "Mul", "Sub"}),
        GELU_TANH: frozenset({"AddV2", "Mul", "Square", "Sub", "Tanh"})}

CONSERVATIVE = conservative("keras", "the activation and Keras's product")
"""The activation as its stage emits it (or Keras's), and Keras's product, differentiated
apart."""
CUSTOM = Form("custom", "gated product: act(gate) * up, both gradients in closed form (custom "
                        "gradient)", marks=_CDF, emits=_SILU_OPS)
UPCAST = Form("custom upcast", "gated product: act(gate) * up, both gradients in closed form "
                               "(custom gradient), the activation in float32 for a 16-bit gate",
              marks=_CDF,
              emits=frozenset({"Cast"}) | frozenset(f"{op}:float32" for op in _SILU_OPS))
XLA_FORM = Form(XLA, "gated product: act(gate) * up with the activation's value and derivative "
                     "in one XLA-compiled region, the gradients two products",
                marks=XLA_CALLS)
XLA_BACKWARD = Form(f"{XLA} backward", "gated product: act(gate) * up with the activation's "
                                       "value and derivative in one XLA-compiled region, the "
                                       "gradients a second one", marks=XLA_CALLS)
FORMS = Forms(SCOPE, (CONSERVATIVE, CUSTOM, UPCAST, XLA_FORM, XLA_BACKWARD))
"""Every form, emitted under ``tfmx_gated_<form>``: its report label, the ops that show it in a
traced graph (its Sigmoid, Erf, Erfc or Tanh, or its region's call) and the ops it emits (SiLU's:
a GELU's are given where the form is offered, :func:`forms_for`)."""


def emitted_ops(kind: str, gate: tf.DType, up: tf.DType, wide: bool = False) -> frozenset[str]:
    """The ops the closed form emits for ``kind`` with a gate of dtype ``gate`` and ``up`` of
    ``up`` (``wide``: the activation in float32), spelled as :class:`fusion.family.Form`'s
    ``emits`` in ``up``'s dtype (the product's).

    >>> sorted(emitted_ops(SILU, tf.float32, tf.bfloat16))
    ['AddV2:float32', 'Cast', 'Mul', 'Mul:float32', 'Sigmoid:float32', 'Sub:float32']
    """
    inner = tf.float32 if wide else gate
    ops = _OPS[kind] if inner == up else frozenset(f"{op}:{inner.name}" for op in _OPS[kind])
    return ops | {"Mul"} | ({"Cast"} if inner != up or gate != inner else frozenset())


def forms_for(product: Product, target: Any = None,
              ) -> dict[Form, Callable[[tf.Tensor, tf.Tensor], tf.Tensor]]:
    """The closed forms for ``product`` on ``target``, each with its function of (gate, up)
    and the ops it emits (the first the one taken without a tuner): the activation in the
    gate's dtype, and for a 16-bit gate in float32 too; the exact GELU through TensorFlow's
    own Erfc, or Erf where ``target`` has no Erfc kernel."""
    kind, gate, up = product.gate.kind, product.gate.x.dtype, product.up.dtype
    if kind == GELU and target is not None and not target.runs_op("Erfc"):
        kind = GELU_ERF
    forms = {dataclasses.replace(CUSTOM, emits=emitted_ops(kind, gate, up)):
             lambda g, u: gated_custom(g, u, kind)}
    if gate in (tf.float16, tf.bfloat16):
        forms[dataclasses.replace(UPCAST, emits=emitted_ops(kind, gate, up, wide=True))] = (
            lambda g, u: gated_custom(g, u, kind, wide=True))
    return forms


def _shaped(grad: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """``grad`` summed down to ``like``'s shape where their static shapes do not say they are
    equal (a dimension unknown when traced might broadcast at run time)."""
    if grad.shape.is_fully_defined() and grad.shape == like.shape:
        return grad
    reduce, _ = tf.raw_ops.BroadcastGradientArgs(s0=tf.shape(like), s1=tf.shape(grad))
    return tf.reshape(tf.reduce_sum(grad, reduce), tf.shape(like))


def gated_custom(g: tf.Tensor, u: tf.Tensor, kind: str, wide: bool = False) -> tf.Tensor:
    """``cast(act(g), u.dtype) * u`` (``act``: ``kind``, computed in ``g``'s dtype, or with
    ``wide`` in float32) with both gradients in closed form from what the forward kept:
    ``du = dy * act(g)`` and ``dg = cast(dy * u) * act'(g)``, the casts stock's.

    >>> g, u = tf.constant([-1.0, 0.5], tf.bfloat16), tf.constant([2.0, 3.0], tf.bfloat16)
    >>> y = gated_custom(g, u, GELU_TANH, wide=True)
    >>> y.dtype.name, [round(float(v), 2) for v in y]
    ('bfloat16', [-0.32, 1.04])
    """
    kernel = _KERNELS[kind]

    @custom_gradient
    def gated(g: tf.Tensor, u: tf.Tensor) -> Any:
        x = tf.cast(g, tf.float32) if wide else g
        a, slope = kernel(x)
        kept = tf.cast(a, u.dtype)
        y = kept * u

        def gradient(dy: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            dg = tf.cast(tf.cast(dy * u, x.dtype) * slope(), g.dtype)
            return _shaped(dg, g), _shaped(dy * kept, u)

        return y, gradient

    return gated(g, u)


def _value_and_slope(g: tf.Tensor, u: tf.Tensor, kind: str) -> tuple[tf.Tensor, ...]:
    """``act(g) * u`` computed in float32 and given in ``u``'s dtype, with ``act(g)`` (in
    ``u``'s dtype) and ``act'(g)`` (in ``g``'s) for the gradients: the forward region's body."""
    a, slope = _KERNELS[kind](tf.cast(g, tf.float32))
    return (tf.cast(a * tf.cast(u, tf.float32), u.dtype), tf.cast(a, u.dtype),
            tf.cast(slope(), g.dtype))


def _gradients(dy: tf.Tensor, u: tf.Tensor, a: tf.Tensor, s: tf.Tensor) -> tuple[tf.Tensor, ...]:
    """``(dy * u * act'(g), dy * act(g))`` computed in float32, given in the dtypes of ``s``
    and ``a``: the backward region's body."""
    wide = tf.cast(dy, tf.float32)
    return (tf.cast(wide * tf.cast(u, tf.float32) * tf.cast(s, tf.float32), s.dtype),
            tf.cast(wide * tf.cast(a, tf.float32), a.dtype))


def gated_xla(g: tf.Tensor, u: tf.Tensor, kind: str, backward_region: bool = False) -> tf.Tensor:
    """``act(g) * u`` with the activation's value and derivative computed in one XLA-compiled
    region (float32 inside: one loop reading ``g`` and ``u`` once, writing the product, the
    activation in ``u``'s dtype and its derivative in ``g``'s); the gradients are the products
    ``du = dy * act(g)`` and ``dg = cast(dy * u) * act'(g)`` outside XLA, or with
    ``backward_region`` a second region computing both in float32.

    >>> g, u = tf.constant([-1.0, 0.5]), tf.constant([2.0, 3.0])
    >>> with tf.GradientTape() as tape:
    ...     _ = tape.watch(g)
    ...     y = gated_xla(g, u, SILU, backward_region=True)
    >>> [round(float(v), 4) for v in y], [round(float(v), 4) for v in tape.gradient(y, g)]
    ([-0.5379, 0.9337], [0.1447, 2.2199])
    """
    forward = xla_region(lambda g, u: _value_and_slope(g, u, kind))
    backward = xla_region(_gradients) if backward_region else None

    @custom_gradient
    def gated(g: tf.Tensor, u: tf.Tensor) -> Any:
        y, a, s = forward(g, u)

        def gradient(dy: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            if backward is not None:
                dg, du = backward(dy, u, a, s)
            else:
                dg, du = tf.cast(dy * u, s.dtype) * s, dy * a
            return _shaped(dg, g), _shaped(du, u)

        return y, gradient

    return gated(g, u)


def _supersede(product: Product) -> None:
    """The activation call's ops, and the casts between it and the product, taken out of the
    step (read by nobody now: ``fusion.transaction.without_abandoned`` keeps any a kept op
    reads), held apart from the failed stage attempts' ops. Its stage's count of it is moved
    to its declines once the product's call has returned (:func:`fused_product`): where it
    fails after this, the activation stays, read by Keras's product, and counted as its stage
    emitted it."""
    graph = product.gate.out.graph
    held = trace_state.of(graph, create=True).superseded
    held.update(product.gate.made)
    held.update(op.name for op in product.between)


def _noted(ctx: StageContext, call: Callable[[], Any], x: Any, kind: str) -> Any:
    """An activation call while a step is traced with a tape recording: run as it would be (its
    own stage's, then Keras's), its input, output, ops and statistics noted in the graph's
    state for a product that may read it."""
    out, made, recorded = noted_call(ctx, call)
    if tf.is_tensor(out) and tf.is_tensor(x):
        graph = tf.compat.v1.get_default_graph()
        trace_state.slot(graph, FAMILY)[out.ref()] = Gate(x, kind, out, made, recorded)
    return out


def noted_silu(ctx: StageContext, original: Callable, x: Any) -> Any:
    """The TensorFlow backend's ``silu`` while tfmx traces: noted (:func:`_noted`)."""
    return _noted(ctx, lambda: original(x), x, SILU)


def noted_gelu(ctx: StageContext, original: Callable, x: Any, approximate: bool = True) -> Any:
    """The TensorFlow backend's ``gelu`` while tfmx traces: noted (:func:`_noted`)."""
    return _noted(ctx, lambda: original(x, approximate), x, GELU_TANH if approximate else GELU)


def fused_product(ctx: StageContext, original: Callable, a: Any, b: Any, *rest: Any,
                  **kwargs: Any) -> Any:
    """A multiplication of a noted activation's output (``keras.ops.multiply``, ``*``) while
    tfmx traces: the gated product in closed form or as an XLA region where the tuner measures
    it faster than the activation and Keras's product; else Keras's call."""
    from fusion.fragment import shape_text

    product = find_product(a, b)
    if product is None:
        return original(a, b, *rest, **kwargs)
    trace_state.slot(product.read.graph, FAMILY).pop(product.gate.out.ref(), None)
    gate, up, kind = product.gate.x, product.up, product.gate.kind
    why = check(product)
    forms = forms_for(product, ctx.target) if why is None else {}
    shapes = [gate.shape, up.shape]

    def timed(fn: Callable[[tf.Tensor, tf.Tensor], tf.Tensor]) -> Any:
        # every candidate's inputs made in up's dtype, the gate cast to its own
        return timed_form(lambda g, u: fn(tf.cast(g, gate.dtype), u), shapes, up.dtype)

    def stock(g: tf.Tensor, u: tf.Tensor) -> tf.Tensor:  # as the step would run it
        stage = _STAGE_OF[kind]
        quiet = dataclasses.replace(ctx, chooser=None, record=lambda family, stats: None,
                                    families=(stage,) if ctx.wants(stage) else ())
        nn = private_api.get("keras.backend_nn")
        with tracing(quiet):
            a = nn.silu(g) if kind == SILU else nn.gelu(g, kind == GELU_TANH)
        return tf.cast(a, u.dtype) * u

    def candidates() -> dict:
        timed_forms = {CONSERVATIVE.name: timed(stock),
                       **{form.name: timed(fn) for form, fn in forms.items()}}
        for form in (XLA_FORM, XLA_BACKWARD):  # offered where ctx.xla
            region = form is XLA_BACKWARD
            timed_forms = with_xla(ctx, timed_forms, lambda g, u, region=region: gated_xla(
                tf.cast(g, gate.dtype), u, kind, region), shapes, up.dtype, name=form.name)
        return timed_forms

    def emit(form: Form) -> Any:
        if form.name in (XLA_FORM.name, XLA_BACKWARD.name):
            out = gated_xla(gate, up, kind, backward_region=form.name == XLA_BACKWARD.name)
        else:
            out = next(fn for known, fn in forms.items() if known.name == form.name)(gate, up)
        _supersede(product)
        taken.append(product.gate)
        return out

    taken: list[Gate] = []
    out = rewrite_call(ctx, CallSite(
        DECLARED, tuple(forms), keras=lambda: original(a, b, *rest, **kwargs), emit=emit,
        what=f"gated product ({kind})", why=why, dtype=up.dtype, candidates=candidates,
        signature=lambda: (f"gated product {kind} gate {shape_text(gate.shape)} "
                           f"{gate.dtype.name} up {shape_text(up.shape)} {up.dtype.name}")))
    for noted in taken:
        for stats in noted.stats:
            stats.taken(f"taken into its product with up ({FAMILY})")
    return out


# -- declaration ----------------------------------------------------------------------------------
DECLARED = declare(Family(
    FAMILY,
    "a gated feed-forward block's act(gate) * up (SwiGLU, GeGLU: keras_hub's Llama, Mistral, "
    "Qwen, Gemma; users' silu(g) * u) in training -> both gradients in closed form (custom "
    "gradient) or one XLA region, where measured faster than the activation and the product",
    # outer: it notes an activation before the swish or gelu stage rewrites it
    hooks=(Hook.on(MATCHES[0], noted_silu, outer=1, when=recording),
           Hook.on(MATCHES[1], noted_gelu, outer=1, when=recording),
           Hook.on(MATCHES[2], fused_product, when=_a_product),
           Hook.on(MATCHES[3], fused_product, when=_a_product)),
    forms=FORMS,
    after=OBSERVED_AFTER, order=OBSERVED_ORDER,
))
