"""The forms a stage emits, and how they are timed: a layer's weights as its call reads them, a
tuner candidate of a layer call (forward and backward at the call's shapes), an XLA-compiled
region (its bfloat16 edges by XLA's convert or by integer operations, as measured), a custom
gradient whose backward is named as TensorFlow names a registered gradient's; and the one seam
through which a module contributes a form to other stages without their importing it
(:class:`AffineForm`: another product for the stages that compute ``x @ kernel + bias``;
:class:`RegionEdges`: another way an XLA region takes and gives bfloat16).

Example:
    >>> import tensorflow as tf
    >>> from fusion.forms import xla_region
    >>> xla_region(lambda x: x * 2.0)(tf.constant([1.5])).numpy().tolist()
    [3.0]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import pkgutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import tensorflow as tf

from fusion import private_api
from fusion.pattern import REGION_NAME
from fusion.stage_context import StageContext, active, tracing


def autocast_dtype() -> str | None:
    """The dtype Keras casts float variables to when a layer reads them here and now (a
    mixed-precision layer's ``call``: its compute dtype), or None outside such a call. Keras
    keeps it per thread, and the tuner times its candidates on a thread of its own.

    >>> autocast_dtype() is None
    True
    """
    try:
        get_autocast_scope = private_api.get("keras.get_autocast_scope")
    except ImportError:  # a Keras without it: variables are read as they are
        return None
    scope = get_autocast_scope()
    return None if scope is None else scope.dtype


@contextlib.contextmanager
def autocast(dtype: str | None) -> Iterator[None]:
    """Keras's autocast of float variables to ``dtype`` inside the block (none if None): a
    timed candidate reads a layer's weights in the dtype the layer's call reads them in."""
    if dtype is None:
        yield
        return
    AutocastScope = private_api.get("keras.AutocastScope")

    with AutocastScope(dtype):
        yield


def layer_value(value: Any) -> Any:
    """A Keras variable's value as a layer's call reads it (autocast to the call's compute
    dtype inside a mixed-precision layer's call), a tensor as it is.

    >>> import keras
    >>> layer_value(keras.Variable([1.0, 2.0])).numpy().tolist()
    [1.0, 2.0]
    """
    import tensorflow as tf

    return value.value if hasattr(value, "value") and hasattr(value, "assign") else \
        tf.convert_to_tensor(value)


def timed_form(forward: Callable[..., Any], shapes: list, dtype: Any, variables: Any = (),
               watch: bool = True, backward: bool = True) -> Callable[[], Callable[[], None]]:
    """A tuner candidate (``fusion.pattern.Chooser``): a factory of a runnable that computes
    ``forward`` on random inputs of ``shapes`` (an unknown dimension: 32) and ``dtype`` and,
    when ``backward``, the gradient of its squared sum w.r.t. ``variables`` and (``watch``) the
    inputs: one form of a layer call, forward and backward at the call's shapes. Where it is
    made inside a mixed-precision layer's call, ``forward`` reads the layer's weights cast as
    that call reads them (:func:`autocast_dtype`), on whichever thread the tuner times it; where
    it is made inside a tfmx trace whose context has ``passes``, the traced candidate is
    rewritten by them, as the step will be (a candidate they cannot rewrite runs as traced).

    >>> import tensorflow as tf
    >>> run = timed_form(lambda x: x * 2.0, [[None, 3]], tf.float32)()
    >>> run()
    """
    cast_to = autocast_dtype()
    ctx = active()
    passes = None if ctx is None else ctx.passes

    def make() -> Callable[[], None]:
        import tensorflow as tf

        known = [[32 if d is None else int(d) for d in shape] for shape in shapes]

        @tf.function(autograph=False)
        def step(*inputs):
            # the candidate exactly as written: no stage rewrites what it calls (a decision
            # timed inside another's candidate would be taken at the wrong moment)
            with tracing(None), autocast(cast_to), tf.GradientTape() as tape:
                if watch:
                    tape.watch(inputs)
                # tf.square, not ** 2: the gradient of a Pow is a Pow (x ** 1), a slow
                # kernel that TensorFlow does not simplify, which would weigh on every
                # candidate alike and most on the cheapest (an XLA region's)
                loss = tf.reduce_sum(tf.square(tf.cast(forward(*inputs), tf.float32)))
            if not backward:  # inference: the forward alone
                return [loss]
            return tape.gradient(loss, [*variables, *(inputs if watch else ())])

        args = [tf.random.normal(s, seed=i + 1, dtype=dtype) for i, s in enumerate(known)]
        concrete = step.get_concrete_function(*args)
        if passes is not None:
            try:
                concrete = passes(concrete)
            except Exception:  # noqa: BLE001 - a candidate the passes cannot take runs as is
                pass

        def run() -> None:
            concrete(*args)[0].numpy()

        return run

    return make


XLA = "xla"  # the name of the XLA-compiled form of a region among a decision's candidates
XLA_CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})  # how a region is called


def xla_region(fn: Callable[..., Any], bfloat16_bits: bool = False) -> Callable[..., Any]:
    """``fn`` as one function compiled by XLA (``jit_compile=True``; TensorFlow compiles its
    gradient function too), traced with no stage active: XLA fuses the region itself, and
    the GraphDef passes leave functions XLA must compile as they are. With
    ``bfloat16_bits`` its bfloat16 edges are the contributed :class:`RegionEdges`' (where a
    module contributes them, else XLA's convert): its outputs encoded inside the region and
    decoded outside, the bfloat16 inputs its code reads through :func:`widened` widened their
    way (the same bits, no gradient through them: for regions no gradient is taken of).

    >>> import tensorflow as tf
    >>> region = xla_region(lambda x: tf.nn.relu(x) * 2.0)
    >>> region(tf.constant([-1.0, 3.0])).numpy().tolist()
    [0.0, 6.0]
    >>> narrow = xla_region(lambda x: tf.cast(x * 2.0, tf.bfloat16), bfloat16_bits=True)
    >>> y = narrow(tf.constant([-1.0, 3.0]))
    >>> y.dtype.name, y.numpy().tolist()
    ('bfloat16', [-2.0, 6.0])
    """
    import tensorflow as tf

    edges = region_edges() if bfloat16_bits else None

    def body(*args: Any) -> Any:
        with tracing(None), (edges.edges(True) if edges else contextlib.nullcontext()):
            out = fn(*args)
        return tf.nest.map_structure(edges.encoded, out) if edges else out

    body.__name__ = REGION_NAME  # its functions' names (and its gradient's) hold it
    compiled = tf.function(body, jit_compile=True, autograph=False)
    if edges is None:
        return compiled
    return lambda *args: edges.decoded(compiled(*args))


def custom_gradient(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``tf.custom_gradient(fn)`` whose backward ops are named as TensorFlow names the gradient
    of a registered op: under ``gradient_tape/<the forward's name scope>/``. TensorFlow calls a
    custom gradient's function outside any scope, so its ops would otherwise be named ``mul``,
    ``Sum_3``... at the top of the graph: a profile could not say whose backward they are, and
    ``policies.audit`` would count their casts as the forward's.

    >>> import tensorflow as tf
    >>> @custom_gradient
    ... def double(x):
    ...     return 2.0 * x, lambda dy: dy * 2.0
    >>> @tf.function
    ... def step(x):
    ...     with tf.GradientTape() as tape:
    ...         tape.watch(x)
    ...         with tf.name_scope("block"):
    ...             y = double(x)
    ...     return tape.gradient(y, x)
    >>> graph = step.get_concrete_function(tf.TensorSpec([2])).graph
    >>> [op.name for op in graph.get_operations() if op.type == "Mul"][-1]
    'gradient_tape/block/mul'
    """
    import tensorflow as tf

    @functools.wraps(fn)
    def forward(*args: Any) -> Any:
        outputs, gradient = fn(*args)
        scope = tf.get_current_name_scope()

        def named(*dys: Any) -> Any:
            with tf.name_scope(f"gradient_tape/{scope}/" if scope else "gradient_tape/"):
                return gradient(*dys)

        return outputs, named

    return tf.custom_gradient(forward)


def with_xla(ctx: StageContext, candidates: dict, region: Callable[..., Any], shapes: list,
             dtype: Any, variables: Any = (), name: str = XLA) -> dict:
    """``candidates`` plus, where ``ctx`` allows XLA, the form ``region`` (a computation
    compiled by XLA: :func:`xla_region`, or a form that calls such regions), timed as the
    others (:func:`timed_form`), under the form's ``name``."""
    if not ctx.xla:
        return candidates
    return {**candidates, name: timed_form(region, shapes, dtype, variables)}


def integer_rounding(ctx: Any, what: str, region: Callable[..., Any], shapes: list,
                     dtype: Any = tf.bfloat16) -> bool:
    """Whether the XLA region computing ``region`` (its bfloat16 outputs narrowed by ``Cast``)
    for inputs of ``shapes`` and ``dtype`` takes and gives bfloat16 the contributed way
    (:class:`RegionEdges`: outputs encoded, the inputs it reads through :func:`widened`
    widened so): ``ctx``'s tuner times the region's forward both ways (a decision of the
    edges' own family, named by ``what`` and the shapes, cached per machine like every
    other); without a tuner, the contributed way; where no module contributes one, XLA's
    convert (False). The region itself is timed, not a stand-in: a conversion costs little in
    a loop that only moves memory and much more in one that computes.

    >>> import tensorflow as tf
    >>> from fusion.pattern import PlainTarget, RewriteAlways
    >>> from fusion.stage_context import StageContext
    >>> ctx = StageContext(PlainTarget("cpu"), RewriteAlways())
    >>> integer_rounding(ctx, "scale", lambda x: tf.cast(x * 2.0, tf.bfloat16), [[4]]) == (
    ...     region_edges() is not None)
    True
    """
    from fusion.fragment import shape_text

    edges = region_edges()
    if edges is None:
        return False
    if ctx.chooser is None:
        return True
    signature = (f"{what} XLA region input {' '.join(shape_text(s) for s in shapes)} "
                 f"{tf.as_dtype(dtype).name}: bfloat16 by XLA's convert or by integer "
                 "operations")

    def timed(mode: str) -> Callable[[], Callable[[], None]]:
        compiled = xla_region(region, bfloat16_bits=mode == edges.name)
        return timed_form(lambda *args: tf.add_n([  # one number of outputs of any dtypes
            tf.reduce_sum(tf.cast(out, tf.float32)) for out in tf.nest.flatten(compiled(*args))]),
            shapes, dtype, backward=False)

    candidates = {mode: timed(mode) for mode in (edges.conventional, edges.name)}
    choice = ctx.chooser.choose(edges.family, signature, candidates, edges.conventional).choice
    return choice == edges.name


# -- forms one module contributes to other stages --------------------------------------------
# A module that offers another way to compute what several stages compute registers it here;
# the stages ask this registry, never the module, so removing the module (and its test) leaves
# every stage as it was, without the contributed forms. The contributing modules are found, not
# named: every module of the fusion package and of the families' packages, imported on first
# need.
@dataclasses.dataclass(frozen=True)
class AffineForm:
    """Another way to compute ``rows @ kernel + bias`` (``rows`` ``[n, k]``, ``kernel``
    ``[k, m]``, ``bias`` ``[m]``: its ``product``) for the stages whose forms end in such a
    product: each such host form gains one more (:func:`contributed_forms`: the host form
    :meth:`~fusion.family.Form.extended` by ``suffix``, built by ``product``), reported under
    ``labels[host family][host form's name]``. ``family``: the contributor's own family, whose
    forms sum in another order than Keras's (what exact-parity tests leave out)."""

    family: str
    suffix: str
    product: Callable[[Any, Any, Any], Any]
    labels: Mapping[str, Mapping[str, str]]
    # the ops ``product`` emits in its inputs' dtype (added to the host form's)
    emits: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class RegionEdges:
    """Another way an XLA region (:func:`xla_region` with ``bfloat16_bits``) takes and gives
    bfloat16 than XLA's convert, with the same bits: ``edges(on)`` around the traced body
    (inside it :func:`widened` widens with ``widened``), ``encoded`` of each output inside the
    region, ``decoded`` of the region's result outside. The tuner's decision between the two
    (:func:`integer_rounding`) is of ``family``, its forms ``conventional`` and ``name``."""

    family: str
    name: str
    conventional: str
    edges: Callable[[bool], Any]
    widened: Callable[[Any], Any]
    encoded: Callable[[Any], Any]
    decoded: Callable[[Any], Any]


_AFFINE: dict[str, AffineForm] = {}
_EDGES: list[RegionEdges] = []
_loaded = False


def contribute(form: AffineForm | RegionEdges) -> AffineForm | RegionEdges:
    """Register ``form`` (a module-level call in the contributing module); the same suffix or
    family again replaces the earlier one.

    >>> demo = contribute(AffineForm("demo", " demo", lambda x, k, b: x @ k + b,
    ...                              {"host": {"matmul": "host: the demo product"}}))
    >>> [f.suffix for f in affine_forms("host")]
    [' demo']
    >>> withdraw(demo); affine_forms("host")
    []
    """
    if isinstance(form, AffineForm):
        _AFFINE[form.suffix] = form
    else:
        _EDGES[:] = [e for e in _EDGES if e.family != form.family] + [form]
    return form


def withdraw(form: AffineForm | RegionEdges) -> None:
    """Remove a contribution (one a test made).

    >>> edges = RegionEdges("demo", "demo", "convert", *[lambda x: x] * 4)
    >>> withdraw(contribute(edges)); edges in _EDGES
    False
    """
    if isinstance(form, AffineForm):
        _AFFINE.pop(form.suffix, None)
    elif form in _EDGES:
        _EDGES.remove(form)


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    import fusion
    from fusion.family import families

    families()  # the families' packages, whose modules contribute as they are imported
    for info in pkgutil.iter_modules(fusion.__path__):
        if not info.ispkg and not info.name.startswith("_"):
            importlib.import_module(f"fusion.{info.name}")


def affine_forms(host: str) -> list[AffineForm]:
    """The affine products contributed to the family ``host``'s forms, in registration order.

    >>> affine_forms("no such family")
    []
    """
    _load()
    return [form for form in _AFFINE.values() if host in form.labels]


def rounds_otherwise() -> list[str]:
    """The families whose contributed forms sum in another order than Keras's (the same
    sums, blocked otherwise): what a test comparing with stock bit for bit leaves out.

    >>> isinstance(rounds_otherwise(), list)
    True
    """
    _load()
    return sorted({form.family for form in _AFFINE.values()})


def affine(rows: Any, kernel: Any, bias: Any,
           product: Callable[[Any, Any, Any], Any] | None = None) -> Any:
    """``rows @ kernel + bias`` by a contributed ``product`` (None: ``MatMul`` then
    ``BiasAdd``).

    >>> affine(tf.ones([1, 2]), tf.ones([2, 1]), tf.constant([0.5])).numpy().tolist()
    [[2.5]]
    """
    if product is not None:
        return product(rows, kernel, bias)
    return tf.nn.bias_add(tf.matmul(rows, kernel), bias)


def contributed_forms(host: str) -> Callable[[tuple], tuple]:
    """What the family ``host``'s :class:`fusion.family.Forms` reads as its contributed forms:
    given its declared forms, each one a contributed :class:`AffineForm` has a label for,
    extended by that product (its name ``<form><suffix>``, its label the contributor's, its
    marks the host form's, its ops the host form's and the product's, built by the product),
    as they are when read, so the observer and the report see contributions that register
    after the host is declared.

    >>> from fusion.family import Form
    >>> demo = contribute(AffineForm("demo", " demo", lambda x, k, b: x @ k + b,
    ...                              {"host": {"matmul": "host: the demo product"}},
    ...                              emits=frozenset({"ConcatV2"})))
    >>> [(f.name, f.label, sorted(f.emits)) for f in contributed_forms("host")(
    ...     (Form("matmul", "host: MatMul", emits=frozenset({"MatMul"})),))]
    [('matmul demo', 'host: the demo product', ['ConcatV2', 'MatMul'])]
    >>> withdraw(demo)
    """

    def extend(declared: tuple) -> tuple:
        return tuple(form.extended(affine.suffix, affine.labels[host][form.name],
                                   affine.emits, affine.product)
                     for affine in affine_forms(host) for form in declared
                     if form.name in affine.labels[host])

    return extend


def region_edges() -> RegionEdges | None:
    """The contributed way of an XLA region's bfloat16 edges (:class:`RegionEdges`), or None
    where no module contributes one (every edge then XLA's convert).

    >>> region_edges() is None or region_edges().conventional
    'convert'
    """
    _load()
    return _EDGES[-1] if _EDGES else None


def widened(x: Any) -> tf.Tensor:
    """``x`` as float32, for code that runs inside an XLA region: as the contributed
    :class:`RegionEdges` widen it where the region is traced with them, else by ``Cast``. The
    same values either way.

    >>> widened(tf.constant([0.5, -3.0], tf.bfloat16)).numpy().tolist()
    [0.5, -3.0]
    """
    edges = region_edges()
    return edges.widened(x) if edges is not None else tf.cast(x, tf.float32)


# -- the kernels a form needs --------------------------------------------------------------------
# Each family declares, with each form, the ops it emits in the call's compute dtype
# (``fusion.family.Form.emits``). Ops TensorFlow itself runs on every device (Reshape, Identity,
# Const, Shape, ...) are not declared: they never move a call to the host.
def _runs(target: Any, op: str, dtype: str) -> bool:
    try:
        return bool(target.runs_op(op, dtype))
    except TypeError:  # a target whose kernels have no dtypes (fusion.pattern.PlainTarget)
        return bool(target.runs_op(op))


def _where(target: Any) -> str:
    plugin = getattr(target, "plugin", None)
    return " ".join(plugin) if plugin else getattr(target, "name", str(target))


def kernel_missing(target: Any, form: str, ops: Iterable[str], dtype: Any) -> str | None:
    """Why ``target`` cannot run ``form``, which emits ``ops`` in ``dtype`` (the call's compute
    dtype): the first op it has no kernel for in that dtype, named with the dtype and the
    backend (its plugin where it has one), or None where it runs every one.

    >>> from tfmx.backends import get_backend
    >>> metal = get_backend("metal", plugin="tensorflow-metal-plugin", tensorflow="2.21.0")
    >>> why = kernel_missing(metal, "bmm", {"Transpose", "BatchMatMulV2"}, tf.bfloat16)
    >>> why.split(": ")[1]
    'the target has no BatchMatMulV2 kernel in bfloat16 under tensorflow-metal-plugin 0.4.1'
    >>> kernel_missing(metal, "bmm", {"Transpose", "BatchMatMulV2"}, "float16") is None
    True
    >>> kernel_missing(metal, "upcast", {"Cast", "Erf:float32"}, tf.bfloat16) is None
    True
    >>> kernel_missing(get_backend("cpu"), "bmm", {"Transpose"}, "bfloat16") is None
    True
    """
    for qualified in sorted(ops):
        op, _, fixed = qualified.partition(":")
        name = fixed or tf.as_dtype(dtype).name
        if not _runs(target, op, name):
            return (f"the {form} form: the target has no {op} kernel in {name} under "
                    f"{_where(target)}: the call would run on the host")
    return None


def runnable_forms(target: Any, forms: Iterable[Any], dtype: Any) -> tuple[list[Any], str | None]:
    """``forms`` (``fusion.family.Form`` records, in order) whose every op (``Form.emits``)
    ``target`` runs in ``dtype``, and the reason of the first one it cannot run (None: it runs
    them all). A conservative form (Keras's call) is always kept.

    >>> from fusion.family import Form
    >>> from fusion.pattern import PlainTarget
    >>> fast, plain = (Form("fast", "", emits=frozenset({"ConcatV2"})),
    ...                Form("plain", "", emits=frozenset({"MatMul"})))
    >>> target = PlainTarget("toy", kernels=frozenset({"MatMul"}))
    >>> kept, why = runnable_forms(target, [fast, plain], "float32")
    >>> [f.name for f in kept], why.split(": ")[1]
    (['plain'], 'the target has no ConcatV2 kernel in float32 under toy')
    """
    kept: list[Any] = []
    why = None
    for form in forms:
        reason = None if form.conservative else \
            kernel_missing(target, form.name, form.emits, dtype)
        if reason is None:
            kept.append(form)
        elif why is None:
            why = reason
    return kept, why
