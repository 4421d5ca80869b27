"""The einsum_dense stage: Keras ``EinsumDense`` contractions as one ``MatMul`` (+ ``BiasAdd``).

Keras's ``EinsumDense`` (the Q/K/V and output projections of ``MultiHeadAttention`` and of
keras_hub's decoders, and a layer of its own) computes ``einsum(equation, x, kernel)`` then
adds its bias. Its projections contract the trailing axes of ``x`` with some axes of the
kernel and keep the rest, ``x``'s first and in order, then the kernel's: ``P C, K' -> P K``
where the kernel's axes ``K'`` are the contracted ``C`` and the kept ``K`` in any order. In
tensordot order (``abc,cde->abde``, ``abcd,cde->abe``, ``...b,bc->...c``) that is a ``MatMul``
of ``x`` viewed as ``[rows, contracted]`` and the kernel viewed as ``[contracted, kept]``; in
another order (keras_hub Gemma's ``btd,ndh->btnh``, the contracted axis the kernel's middle
one; ``abc,dc->abd``) the kernel is transposed to that order first: one ``Transpose`` of a
weight, whose gradient transposes the kernel's gradient back to the kernel's own layout. This
stage emits exactly that (``Transpose`` of the kernel where needed, ``Reshape``, ``MatMul``,
``BiasAdd`` where the bias covers the kept axes, the activation, ``Reshape``), so the
contraction family fuses the MatMul with its bias (and activation) into ``_FusedMatMul``, the
gradient is two MatMuls instead of two Einsums, and a backend without an ``Einsum`` kernel
(the Metal plugin has none) runs it at all.

Whether the MatMul form is faster than Keras's Einsum depends on the machine and the shapes,
so every call is a tuner decision (forward and backward at the call's shapes); the
conservative form is Keras's Einsum, or the MatMul form on a backend without an ``Einsum``
kernel. Declined, with the reason in the report (:func:`equation_problem`): a batch axis in
both operands (attention's own ``bqnh,bknh->bqkn``: not a projection), contracted axes that
are not ``x``'s trailing ones, an output that reorders ``x``'s kept axes, a letter summed in
one operand only or repeated, nothing contracted; quantized layers, operands of different
dtypes.

Example:
    >>> import keras, numpy as np, tensorflow as tf
    >>> from fusion.calls.einsum_dense import as_matmul, split_equation
    >>> split_equation("abc,cde->abde"), split_equation("btd,ndh->btnh")
    (('ab', 'c', 'de'), ('bt', 'd', 'nh'))
    >>> layer = keras.layers.EinsumDense("abc,cde->abde", (5, 2, 3), bias_axes="de")
    >>> x = tf.random.normal([2, 5, 4], seed=1)
    >>> expected = layer(x).numpy()
    >>> got = as_matmul(layer, x).numpy()
    >>> bool(np.allclose(got, expected, atol=1e-6))
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from fusion import trace_state
from fusion.family import OBSERVED_AFTER, OBSERVED_ORDER, Family, Form, Forms, conservative, declare
from fusion.forms import affine, contributed_forms
from fusion.stage import CallSite, Hook, StageContext, layer_value, rewrite_call, timed_form

# -- match: the Keras calls it hooks, and what it finds in them -----------------------------------
FAMILY = "einsum_dense"
SCOPE = "tfmx_einsum_dense"
MATCHES = ("keras.src.layers.core.einsum_dense:EinsumDense.call",
           "keras.src.layers.attention.multi_head_attention:MultiHeadAttention.call")
"""The Keras calls the stage hooks: an ``EinsumDense`` layer's, and a ``MultiHeadAttention``'s
(its three projections at once)."""


def _operands(equation: str) -> tuple[str, str, str] | None:
    """``(x's axes, the kernel's, the output's)`` of ``equation`` (spaces dropped), or None."""
    try:
        inputs, output = equation.replace(" ", "").split("->")
        lhs, rhs = inputs.split(",")
    except ValueError:
        return None
    return lhs, rhs, output


def _analysed(equation: str) -> tuple[str, str, str] | str:
    """:func:`split_equation`'s answer, or :func:`equation_problem`'s."""
    operands = _operands(equation)
    if operands is None:
        return "not 'input,kernel->output'"
    lhs, rhs, output = operands
    if "." in rhs:
        return "an ellipsis in the kernel"
    letters = [lhs.replace("...", ""), rhs, output.replace("...", "")]
    if not "".join(letters).isalpha():
        return "a label that is not a letter"
    for axes in letters:
        if len(set(axes)) != len(axes):
            return f"a letter twice in {axes!r} (a diagonal)"
    batch = [c for c in letters[0] if c in rhs and c in letters[2]]
    if batch:
        return (f"{''.join(batch)!r} in the input, the kernel and the output (a batch axis of "
                "both operands: not a projection)")
    summed = [c for c in letters[0] + rhs if c not in letters[2] and
              (c not in letters[0] or c not in rhs)]
    if summed:
        return f"{''.join(summed)!r} summed in one operand only"
    contracted = "".join(c for c in lhs if c in rhs)
    if not contracted:
        return "nothing contracted (an outer product)"
    kept_x = lhs[: len(lhs) - len(contracted)]
    if lhs != kept_x + contracted:
        return f"the contracted {contracted!r} are not the input's trailing axes"
    kept = output[len(kept_x):]
    if not output.startswith(kept_x) or sorted(kept) != sorted(set(rhs) - set(contracted)):
        return f"the output {output!r} is not the input's kept axes in order, then the kernel's"
    return kept_x, contracted, kept


def split_equation(equation: str) -> tuple[str, str, str] | None:
    """``(kept of x, contracted, kept of the kernel)`` when ``equation`` is ``P C, K' -> P K``
    (the trailing axes ``C`` of ``x`` contracted with the kernel's, ``K'`` being ``C`` and
    ``K`` in any order; the output ``x``'s other axes in order, then the kernel's kept ``K``;
    ``P`` may start with ``...``), else None (:func:`equation_problem` says why).

    >>> split_equation("...b,bc->...c"), split_equation("abc,dc->abd")
    (('...', 'b', 'c'), ('ab', 'c', 'd'))
    >>> split_equation("bqnh,bknh->bqkn") is None
    True
    """
    found = _analysed(equation)
    return None if isinstance(found, str) else found


def equation_problem(equation: str) -> str | None:
    """Why ``equation`` is not one :func:`split_equation` accepts, or None.

    >>> equation_problem("bqnh,bknh->bqkn")
    "'bn' in the input, the kernel and the output (a batch axis of both operands: not a \
projection)"
    >>> equation_problem("th,ehm->etm")
    "the output 'etm' is not the input's kept axes in order, then the kernel's"
    """
    found = _analysed(equation)
    return found if isinstance(found, str) else None


def kernel_order(equation: str) -> tuple[int, ...] | None:
    """The permutation of the kernel's axes to ``contracted + kept`` (``tf.transpose``'s
    ``perm``) for an ``equation`` :func:`split_equation` accepts, None where the kernel is
    in that order already.

    >>> kernel_order("btd,ndh->btnh"), kernel_order("abc,cde->abde")
    ((1, 0, 2), None)
    """
    _, contracted, kept = split_equation(equation)
    rhs = _operands(equation)[1]
    order = tuple(rhs.index(c) for c in contracted + kept)
    return None if order == tuple(range(len(rhs))) else order


def kept_dims(layer: Any) -> list[int]:
    """The sizes of the kept kernel axes of ``layer`` (an ``EinsumDense`` whose equation
    :func:`split_equation` accepts), in the output's order."""
    _, _, kept = split_equation(layer.equation)
    rhs = _operands(layer.equation)[1]
    return [int(layer.kernel.shape[rhs.index(c)]) for c in kept]


def matmul_kernel(layer: Any) -> tf.Tensor:
    """``layer``'s kernel (as its call reads it) as the ``[contracted, kept]`` matrix of its
    MatMul form: transposed to ``contracted + kept`` where its axes are in another order
    (:func:`kernel_order`), then reshaped."""
    kernel = layer_value(layer.kernel)
    order = kernel_order(layer.equation)
    if order is not None:
        kernel = tf.transpose(kernel, order)
    width = math.prod(kept_dims(layer))
    return tf.reshape(kernel, [math.prod(kernel.shape.as_list()) // width, width])


def has_flat_bias(layer: Any) -> bool:
    """Whether ``layer`` (an ``EinsumDense`` :func:`split_equation` accepts) has a bias over
    all its kept kernel axes: one per output column of its MatMul form."""
    return layer.bias is not None and tuple(layer.bias.shape) == tuple(kept_dims(layer))


def find_einsum_dense(layer: Any, inputs: Any) -> str | None:
    """Why this call keeps Keras's Einsum, or None if the stage can emit its MatMul form."""
    if getattr(layer, "quantization_mode", None):
        return f"quantized layer ({layer.quantization_mode})"
    problem = equation_problem(layer.equation)
    if problem is not None:
        return (f"equation {layer.equation!r} is not one MatMul of the input's trailing axes "
                f"with the kernel's: {problem}")
    if inputs.shape.rank is None or None in tuple(layer.kernel.shape):
        return "input of unknown rank or kernel of unknown shape"
    if inputs.dtype.name not in ("float32", "float16", "bfloat16"):
        return f"input dtype {inputs.dtype.name}"
    return None


def _projections(layer: Any) -> tuple[Any, Any, Any]:
    """A ``MultiHeadAttention``'s query, key and value ``EinsumDense`` layers."""
    return layer._query_dense, layer._key_dense, layer._value_dense  # noqa: SLF001


def _same_tensor(a: Any, b: Any) -> bool:
    """``a`` is ``b``, or both are casts of one tensor to one dtype (a mixed-precision policy
    casts each of a layer's inputs on its own)."""
    if a is b:
        return True
    ops = [getattr(t, "op", None) for t in (a, b)]
    return all(op is not None and op.type == "Cast" for op in ops) and \
        ops[0].inputs[0] is ops[1].inputs[0] and a.dtype == b.dtype


# -- check: why a call keeps Keras's own form (None: it need not) ---------------------------------
def check(layer: Any, inputs: tf.Tensor) -> str | None:
    """Why this call keeps Keras's Einsum (:func:`find_einsum_dense`, or its operands'
    dtypes differ), or None.

    >>> import keras
    >>> layer = keras.layers.EinsumDense("abc,cd->abd", (5, 3))
    >>> layer.build((None, 5, 4))
    >>> check(layer, tf.zeros([2, 5, 4])), check(layer, tf.zeros([2, 5, 4], tf.bfloat16))
    (None, 'input bfloat16 and kernel float32 differ')
    """
    why = find_einsum_dense(layer, inputs)
    kernel = layer_value(layer.kernel)
    if why is None and kernel.dtype != inputs.dtype:
        why = f"input {inputs.dtype.name} and kernel {kernel.dtype.name} differ"
    return why


def check_projections(layer: Any, query: Any, value: Any, key: Any) -> str | None:
    """Why this ``MultiHeadAttention`` call keeps three projections, or None when its query,
    key and value are one tensor projected by three ``EinsumDense`` of one equation that
    :func:`split_equation` accepts, with flat biases (all or none), no activation and the
    input's dtype: one MatMul of the input with the three kernels side by side computes all
    three.

    >>> import keras
    >>> mha = keras.layers.MultiHeadAttention(2, 3)
    >>> x, y = tf.zeros([2, 5, 4]), tf.ones([2, 5, 4])
    >>> _ = mha(x, x)
    >>> check_projections(mha, x, x, None) is None, check_projections(mha, x, y, None)
    (True, 'query, key and value are not one tensor (cross-attention)')
    """
    if not _same_tensor(query, value) or (key is not None and not _same_tensor(key, value)):
        return "query, key and value are not one tensor (cross-attention)"
    if getattr(layer, "_use_gate", False):
        return "gated attention (a fourth projection of the query)"
    denses = _projections(layer)
    for dense in denses:
        why = find_einsum_dense(dense, query)
        if why is not None:
            return why
    if len({d.equation for d in denses}) != 1:
        return "the projections' equations differ"
    biases = [d.bias is not None for d in denses]
    if len(set(biases)) != 1:
        return "some projections have a bias and some not"
    for dense in denses:
        if dense.activation is not None and getattr(dense.activation, "__name__", "") != \
                "linear":
            return f"a projection has the activation {dense.activation.__name__}"
        kernel = layer_value(dense.kernel)
        if kernel.dtype != query.dtype:
            return f"input {query.dtype.name} and kernel {kernel.dtype.name} differ"
        if dense.bias is not None and not has_flat_bias(dense):
            return "a bias over some of the kept axes only"
    return None


# -- forms: what it emits (CONSERVATIVE: the form Keras runs), and the hook's flow ----------------
CONSERVATIVE = conservative("einsum", "Keras's Einsum")
"""Keras's Einsum (a backend without that kernel: the tuner's default is the MatMul form)."""
SEPARATE = conservative("separate", "three MatMuls")
"""A ``MultiHeadAttention``'s three projections as Keras runs them."""
_MATMULS = frozenset({"MatMul", "_FusedMatMul"})
MATMUL = Form("matmul", "EinsumDense: Reshape + MatMul (+ BiasAdd; a Transpose of the kernel "
              "where its axes need it) in place of Einsum",
              marks=_MATMULS, emits=frozenset({"BiasAdd", "MatMul", "Transpose"}))
SHARED = Form("shared", "MultiHeadAttention: query, key and value projections as one MatMul",
              marks=_MATMULS,
              emits=frozenset({"BiasAdd", "ConcatV2", "MatMul", "Slice", "SplitV", "Transpose"}))
FORMS = Forms(SCOPE, (CONSERVATIVE, SEPARATE, MATMUL, SHARED),
              contributed=contributed_forms(FAMILY))
"""Every form, emitted under ``tfmx_einsum_dense_<form>``: the two MatMul forms (their MatMul,
plain or fused with its bias by contraction, shows them in a traced graph; they emit their ops
in the call's dtype, a backend without one of them keeping Keras's Einsum) and each with a
contributed product in place of its MatMul and bias (``fusion.forms.AffineForm``)."""


def _pending(graph: Any) -> dict:
    """The projections a ``MultiHeadAttention`` call computed in advance in ``graph``:
    ``id(EinsumDense)`` -> its output."""
    return trace_state.slot(graph, FAMILY)


def as_matmul(layer: Any, inputs: tf.Tensor, product: Callable | None = None) -> tf.Tensor:
    """``layer``'s output (an ``EinsumDense`` whose equation :func:`split_equation` accepts)
    as ``Reshape`` + ``MatMul`` (+ ``BiasAdd``) + activation + ``Reshape``, the kernel
    transposed first where its axes are not in ``contracted + kept`` order
    (:func:`matmul_kernel`); with ``product`` (a contributed
    :class:`fusion.forms.AffineForm`'s) a bias over all the kept axes is computed with the
    MatMul by that product instead.

    >>> import keras, numpy as np
    >>> layer = keras.layers.EinsumDense("btd,ndh->btnh", (5, 2, 3), bias_axes="nh")
    >>> x = tf.random.normal([2, 5, 4], seed=1)
    >>> expected = layer(x)
    >>> bool(np.allclose(as_matmul(layer, x), expected, atol=1e-6))
    True
    """
    _, contracted, kept = split_equation(layer.equation)
    flat_kernel = matmul_kernel(layer)
    dims = kept_dims(layer)
    rows = tf.reshape(inputs, [-1, flat_kernel.shape[0]])
    bias = None if layer.bias is None else layer_value(layer.bias)
    flat_bias = has_flat_bias(layer)
    if flat_bias:
        y = affine(rows, flat_kernel, tf.reshape(bias, [-1]), product)
    else:
        y = tf.matmul(rows, flat_kernel)
    early = layer.activation is not None and (len(kept) == 1 and (flat_bias or bias is None))
    if early:  # on the last axis, which the reshape keeps: the contraction family fuses it
        y = layer.activation(y)
    leading = tf.shape(inputs)[: inputs.shape.rank - len(contracted)]
    y = tf.reshape(y, tf.concat([leading, dims], 0))
    y.set_shape(inputs.shape[: inputs.shape.rank - len(contracted)].concatenate(dims))
    if bias is not None and not flat_bias:
        y = y + bias  # Keras's broadcast add (a bias over some of the kept axes)
    if layer.activation is not None and not early:
        y = layer.activation(y)
    return y


def shared_projection(layer: Any, x: tf.Tensor,
                      product: Callable | None = None) -> list[tf.Tensor]:
    """The query, key and value projections of ``x`` (a ``MultiHeadAttention``'s, accepted by
    :func:`check_projections`) as one ``MatMul`` of ``x`` viewed ``[rows, features]`` with
    the three kernels concatenated (+ one ``BiasAdd``), split back into the three outputs:
    the backward is one MatMul for the input's gradient (no sum of three) and one for the
    kernels'. With ``product`` (a contributed :class:`fusion.forms.AffineForm`'s) the MatMul
    and the biases are computed by that product.

    >>> import keras, numpy as np
    >>> mha = keras.layers.MultiHeadAttention(2, 3)
    >>> x = tf.random.normal([2, 5, 4], seed=1)
    >>> _ = mha(x, x)
    >>> q, k, v = shared_projection(mha, x)
    >>> bool(np.allclose(q, mha._query_dense(x), atol=1e-6)), q.shape.as_list()
    (True, [2, 5, 2, 3])
    """
    denses = _projections(layer)
    _, contracted, _ = split_equation(denses[0].equation)
    kernels = [matmul_kernel(d) for d in denses]
    kept = [kept_dims(d) for d in denses]
    widths = [math.prod(dims) for dims in kept]
    rows = tf.reshape(x, [-1, kernels[0].shape[0]])
    kernel = tf.concat(kernels, 1)
    bias = None if denses[0].bias is None else \
        tf.concat([tf.reshape(layer_value(d.bias), [-1]) for d in denses], 0)
    y = tf.matmul(rows, kernel) if bias is None else affine(rows, kernel, bias, product)
    leading = x.shape[: x.shape.rank - len(contracted)]
    dynamic = tf.shape(x)[: x.shape.rank - len(contracted)]
    outs = []
    for part, dims in zip(tf.split(y, widths, axis=1), kept):
        out = tf.reshape(part, tf.concat([dynamic, dims], 0))
        out.set_shape(leading.concatenate(dims))
        outs.append(out)
    return outs


def _with_products(form: Form, flat_bias: bool) -> tuple[Form, ...]:
    """``form`` and, where the bias is over all the kept axes (``flat_bias``), ``form``
    with each contributed product in place of its MatMul and bias (built by that product)."""
    return (form, *(contributed_forms(FAMILY)((form,)) if flat_bias else ()))


def fused_einsum_dense_call(ctx: StageContext, original: Callable, layer: Any, inputs: Any,
                            *args: Any, **kwargs: Any) -> Any:
    """``EinsumDense.call`` while tfmx traces: the MatMul form where it is correct and (by the
    tuner) faster, else Keras's Einsum with the reason recorded
    (:func:`fusion.stage.rewrite_call`). A projection that :func:`fused_attention_call`
    already computed (in one MatMul with its siblings) returns that output."""
    done = _pending(tf.compat.v1.get_default_graph()).pop(id(layer), None)
    if done is not None:
        return done
    if not tf.inside_function():
        return original(layer, inputs, *args, **kwargs)
    inputs = tf.convert_to_tensor(inputs)
    why = check(layer, inputs)
    forms = _with_products(MATMUL, has_flat_bias(layer)) if why is None else ()

    def signature() -> str:
        from fusion.fragment import shape_text

        return (f"EinsumDense {layer.equation} input {shape_text(inputs.shape)} "
                f"{inputs.dtype.name} bias={layer.bias is not None} "
                f"activation={getattr(layer.activation, '__name__', None)}")

    def candidates() -> dict:
        variables = layer.trainable_variables
        return {CONSERVATIVE.name: timed_form(lambda x: original(layer, x), [inputs.shape],
                                              inputs.dtype, variables),
                **{form.name: timed_form(lambda x, p=form.build: as_matmul(layer, x, p),
                                         [inputs.shape], inputs.dtype, variables)
                   for form in forms}}

    return rewrite_call(ctx, CallSite(
        DECLARED, forms, keras=lambda: original(layer, inputs, *args, **kwargs),
        emit=lambda form: as_matmul(layer, inputs, form.build), what="EinsumDense", why=why,
        dtype=inputs.dtype, signature=signature, candidates=candidates,
        default=CONSERVATIVE if ctx.target.runs_op("Einsum") else MATMUL))


def fused_attention_call(ctx: StageContext, original: Callable, layer: Any, query: Any,
                         value: Any, key: Any = None, *args: Any, **kwargs: Any) -> Any:
    """``MultiHeadAttention.call`` while tfmx traces: a self-attention's three projections as
    one MatMul (:func:`shared_projection`) where the tuner measures it faster than three, the
    rest of Keras's call as it is (its projections then return what was computed)."""
    if not tf.inside_function() or args:
        return original(layer, query, value, key, *args, **kwargs)
    why = check_projections(layer, query, value, key)
    denses = _projections(layer)
    forms = _with_products(SHARED, denses[0].bias is not None) if why is None else ()
    x = tf.convert_to_tensor(query) if why is None else query

    def signature() -> str:
        from fusion.fragment import shape_text

        return (f"MultiHeadAttention projections {denses[0].equation} input "
                f"{shape_text(x.shape)} {x.dtype.name} widths "
                f"{[math.prod(kept_dims(d)) for d in denses]}")

    def candidates() -> dict:
        variables = [v for d in denses for v in d.trainable_variables]

        def separate(v: Any) -> Any:
            return tf.stack([tf.reduce_sum(tf.square(as_matmul(d, v))) for d in denses])

        def shared(v: Any, product: Callable | None) -> Any:
            return tf.stack([tf.reduce_sum(tf.square(o))
                             for o in shared_projection(layer, v, product)])

        return {SEPARATE.name: timed_form(separate, [x.shape], x.dtype, variables),
                **{form.name: timed_form(lambda v, p=form.build: shared(v, p), [x.shape],
                                         x.dtype, variables)
                   for form in forms}}

    def rest(outs: list) -> Any:  # Keras's call, its projections returning ``outs``
        pending = _pending(tf.compat.v1.get_default_graph())
        before = dict(pending)
        pending.update({id(d): out for d, out in zip(denses, outs)})
        try:
            return original(layer, query, value, key, **kwargs)
        finally:
            pending.clear()
            pending.update(before)

    return rewrite_call(ctx, CallSite(
        DECLARED, forms, keras=lambda: original(layer, query, value, key, **kwargs),
        emit=lambda form: shared_projection(layer, x, form.build), what="MultiHeadAttention "
        "projections", why=why, dtype=getattr(x, "dtype", None), signature=signature,
        candidates=candidates, keeps=SEPARATE, then=rest))


# -- declaration ----------------------------------------------------------------------------------
DECLARED = declare(Family(
    FAMILY,
    "Keras EinsumDense (MultiHeadAttention's projections) -> Reshape + MatMul (+ BiasAdd, "
    "which the contraction family fuses; the kernel transposed where its axes are in another "
    "order) where the equation contracts the input's trailing axes and it measures faster",
    hooks=(Hook.on(MATCHES[0], fused_einsum_dense_call),
           Hook.on(MATCHES[1], fused_attention_call)),
    forms=FORMS,
    after=OBSERVED_AFTER, order=OBSERVED_ORDER,
))
