"""Helpers the test modules share (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def step_functions(fn) -> list:
    """Every ConcreteFunction Keras's step function (train/test/predict_function) traced: those
    of the functions it calls (its closure's), else, where those traced none, of the ones
    behind them (a wrapper's ``__wrapped__``, a closure's closure), level by level: Keras 3.16
    calls its step through a wrapper of its own, and tfmx calls Keras's function from its own
    where a strategy's distributed iterator keeps Keras's one-step call."""
    import types

    def cells(f) -> list:
        if not isinstance(f, types.FunctionType):
            return []
        found = []
        for cell in f.__closure__ or ():
            try:
                found.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        return found

    def concrete_of(targets: list) -> dict:
        return {id(cf): cf for target in targets
                for cf in getattr(target, "_list_all_concrete_functions", lambda: [])()}

    fn = getattr(fn, "__wrapped__", fn)
    level, seen, concrete = [fn, *cells(fn)], set(), {}
    while level and not concrete:
        level = [t for t in {id(t): t for t in level}.values() if id(t) not in seen]
        seen.update(id(t) for t in level)
        concrete = concrete_of(level)
        level = [t.__wrapped__ for t in level if hasattr(t, "__wrapped__")] + [
            c for t in level for c in cells(t)]
    return list(concrete.values())


def traced_graphs(fn) -> list:
    """The GraphDef (with its function library) of every graph Keras's step function traced."""
    concrete = {id(cf): cf for cf in step_functions(fn)}
    graphs = {cf.name.decode() if isinstance(cf.name, bytes) else cf.name: cf.graph.as_graph_def()
              for cf in concrete.values()}
    # a step Keras calls from its loop's graph is in that graph's library: counted there once
    called = {f.signature.name for g in graphs.values() for f in g.library.function}
    return [g for name, g in graphs.items() if name not in called]


def nodes_that_ran(fn) -> list:
    """Every node (NodeDef, with its attributes) of every graph and function library Keras's
    step function traced."""
    nodes: list = []
    for g in traced_graphs(fn):
        nodes.extend(g.node)
        for f in g.library.function:
            nodes.extend(f.node_def)
    return nodes


def profiled_ops(run, tmp_path) -> set[tuple[str, str]]:
    """(node name, kernel) of every op that ran in one call of ``run()`` under TensorFlow's
    profiler (profile written under ``tmp_path``): the graph as the runtime executed it, after
    Grappler and the oneDNN pass, which a traced graph does not show."""
    import glob

    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    tf.profiler.experimental.start(str(tmp_path))
    try:
        run()
    finally:
        tf.profiler.experimental.stop()
    space = xplane_pb2.XSpace()
    with open(glob.glob(f"{tmp_path}/**/*.xplane.pb", recursive=True)[0], "rb") as f:
        space.ParseFromString(f.read())
    names = {plane.event_metadata[e.metadata_id].name
             for plane in space.planes for line in plane.lines for e in line.events}
    return {tuple(n.rsplit(":", 1)) for n in names if ":" in n}


def xla_functions(fn) -> list:
    """The functions XLA must compile in every graph Keras's step function traced."""
    import fusion.pipeline

    return [f for g in traced_graphs(fn) for f in g.library.function
            if fusion.pipeline.compiled_by_xla(f)]


def ops_that_ran(fn) -> set[str]:
    """Op types in every graph (and function library) Keras's step function traced."""
    return {n.op for n in nodes_that_ran(fn)}


class PickForm:
    """A chooser (``fusion.pattern.Chooser``) that takes ``form`` for ``family``'s decisions
    where it is a candidate (``strict``: it must be one), and for every other decision the
    rewrite (``RewriteAlways``): a test's way to run one form of a stage whatever the tuner
    would measure here."""

    def __init__(self, form: str, family: str, strict: bool = False) -> None:
        self.form, self.family, self.strict = form, family, strict

    def choose(self, family, signature, candidates, conservative):
        from fusion.pattern import RewriteAlways

        if family == self.family:
            assert not self.strict or self.form in candidates, (signature, sorted(candidates))
            if self.form in candidates:
                candidates = {self.form: None}  # the conservative name itself when form == it
        return RewriteAlways().choose(family, signature, candidates, conservative)


def exact_patterns() -> list[str]:
    """Every registered family but ``onednn``, which runs convolutions on oneDNN's kernels and
    so changes float32 summation order (tests/test_onednn.py holds it to its own tolerance),
    and the families whose forms sum in another order (``fusion.forms.rounds_otherwise``: a
    kernel gradient out of a wider MatMul, the same sums perhaps blocked otherwise; their own
    tests hold them to rounding), and ``sibling_projections``, whose merged input gradient is
    one longer product in place of several and their sum, ``bias_grad`` (a bias gradient's sum
    as a MatMul) and ``matmul_layout`` (a product's operand transposed first), the same sums
    added in another order, where the step is traced with its batch's static shape. What these
    give equals stock but for the rounding of a fused kernel's own activation (Tanh, Sigmoid,
    Elu): bitwise for Relu chains, the kernels Grappler gives stock too."""
    import fusion
    from fusion.forms import rounds_otherwise

    left_out = {"onednn", "sibling_projections", "bias_grad", "matmul_layout",
                *rounds_otherwise()}
    return [name for name in fusion.available_patterns() if name not in left_out]


# -- tolerances from rounding --------------------------------------------------------------------
# Unit roundoff u of each dtype: one correctly rounded operation moves its result by at most
# u * |result| (u = 2**-p for a p-bit significand).
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11,
                 "bfloat16": 2.0**-8}


def unit_roundoff(dtype) -> float:
    """u of a dtype name, numpy dtype or tf.DType; 0 for integers and bool (exact)."""
    name = str(getattr(dtype, "name", dtype))
    if name.startswith(("int", "uint", "bool")):
        return 0.0
    return UNIT_ROUNDOFF[name]


def float_tolerance(dtype, terms: int, scale: float) -> float:
    """The largest difference two correct computations of one quantity may show.

    A result that goes through ``terms`` roundings in ``dtype`` (an n-term sum or dot product:
    n; a chain of elementwise ops: one each; a training run: steps x roundings per step), on
    values no larger than ``scale``, is within ``terms * u * scale`` of the exact value (first
    order; Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., sec. 3.1). Two
    computations that round differently (another kernel, another summation order, another but
    equal formula) are each within that bound, so they differ by at most
    ``2 * terms * u * scale``; u = 2**-24 (float32), 2**-11 (float16), 2**-8 (bfloat16).

    ``scale`` is the largest magnitude involved (the tensor's max |value|, or its inputs'),
    never the element itself: a sum that cancels is small while its rounding errors are not.
    ``terms=0`` means bitwise equality.
    """
    if not terms:
        return 0.0
    return 2.0 * terms * unit_roundoff(dtype) * float(scale)


def assert_within_rounding(got, want, terms: int, dtype="float32", scale=None,
                           what="") -> None:
    """max |got - want| <= float_tolerance(dtype, terms, scale); scale defaults to max |want|."""
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if scale is None:
        scale = float(np.max(np.abs(want))) if want.size else 0.0
    diff = float(np.max(np.abs(got - want))) if want.size else 0.0
    tol = float_tolerance(dtype, terms, scale)
    assert diff <= tol, (f"{what}: max difference {diff:.3g} > {tol:.3g} = 2 x {terms} "
                         f"roundings x u({dtype}) x scale {scale:.3g}")


FUSED_MATMULS = frozenset({"_FusedMatMul", "_MklNativeFusedMatMul"})
"""A fused MatMul on Eigen's kernel, or on oneDNN's where the onednn family moved it there (all
families, oneDNN off, where the tuner measures it faster)."""


# Roundings one elementwise op may add, for counting ``terms``: +, -, *, / and sqrt are
# correctly rounded (1); Eigen's and oneDNN's exp, tanh, erf(c), rsqrt and pow are accurate to
# a few ulps, not to the last bit: counted as 4. Relu, Relu6, max, abs, neg and select are exact.
TRANSCENDENTAL = 4
ACTIVATION_ROUNDINGS = {
    None: 0, "Relu": 0, "Relu6": 0,
    "LeakyRelu": 1,  # alpha * x
    "Elu": TRANSCENDENTAL + 1,  # exp(x) - 1
    "Tanh": TRANSCENDENTAL,
    "Sigmoid": TRANSCENDENTAL + 2,  # 1 / (1 + exp(-x))
    "GeluExact": TRANSCENDENTAL + 3,  # 0.5 * x * erfc(-x / sqrt(2))
    # 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))
    "GeluApproximate": TRANSCENDENTAL + 8,
}
_ONE_ROUNDING = frozenset({
    "Add", "AddV2", "Sub", "Mul", "Div", "RealDiv", "DivNoNan", "BiasAdd", "Sqrt", "Square",
    "SquaredDifference", "LeakyRelu", "Reciprocal"})
_TRANSCENDENTAL_OPS = frozenset({
    "Exp", "Expm1", "Log", "Log1p", "Tanh", "Sigmoid", "Erf", "Erfc", "Rsqrt", "Pow", "Elu",
    "Selu", "Softplus", "Softsign", "Sin", "Cos"})


def graph_roundings(concrete) -> int:
    """Roundings in a traced function, every op counted (at least the longest path's): an
    n-term contraction or reduction n, an arithmetic op 1, a transcendental TRANSCENDENTAL,
    exact ops (Relu, max, reshapes, reads) 0. Control flow bodies are not entered."""
    import math

    total = 0
    for op in concrete.graph.get_operations():
        kind = op.type
        if kind in _ONE_ROUNDING:
            total += 1
        elif kind in _TRANSCENDENTAL_OPS:
            total += TRANSCENDENTAL
        elif kind == "AddN":
            total += len(op.inputs) - 1
        elif kind in ("MatMul", "BatchMatMulV2"):
            a = op.inputs[0].shape
            total += int(a[-2] if op.get_attr("transpose_a" if kind == "MatMul" else "adj_x")
                         else a[-1])
        elif kind in ("Conv2D", "DepthwiseConv2dNative"):
            f = op.inputs[1].shape
            total += int(f[0] * f[1] * (f[2] if kind == "Conv2D" else 1))
        elif kind in ("Sum", "Mean", "Prod"):
            total += max(1, math.prod(op.inputs[0].shape) // max(1, math.prod(op.outputs[0].shape)))
    return total


# -- oneDNN's state ------------------------------------------------------------------------------
# TensorFlow reads TF_ENABLE_ONEDNN_OPTS once, when it is imported (on by default on some
# processors and wheels, off on others), so one process sees one state. A test that needs one
# runs here when this process has it, and otherwise in the child process that
# tests/test_onednn_settings.py starts with TF_ENABLE_ONEDNN_OPTS set the other way.
CHILD_ENV = "TFMX_TEST_CHILD"  # set in that child: it starts no children of its own
ONEDNN_MARKERS = {"on": "onednn_on", "off": "onednn_off", "either": "onednn_either"}


def onednn_state() -> str:
    """``"on"`` or ``"off"``: whether this process's TensorFlow runs its oneDNN graph pass."""
    from tfmx.backends import onednn_enabled

    return "on" if onednn_enabled() else "off"


def needs_onednn(state: str):
    """Decorator for a test that depends on oneDNN's state: its marker.

    ``"on"`` / ``"off"``: it needs that state; conftest skips it in a process with the other
    one (the reason names both), where the child of the other setting runs it. ``"either"``:
    valid in both, but what it checks differs with the state (the live cpu tables): it runs
    here and again in the child of the other setting.
    """
    import pytest

    return getattr(pytest.mark, ONEDNN_MARKERS[state])


def fit_stock_and_tfmx(build, x, y, patterns: list[str], epochs: int = 2,
                       batch_size: int = 8, **options) -> tuple[dict, list]:
    """Train ``build()`` (a compiled model, seeded so every build starts from the same
    weights) on ``x``, ``y`` with tfmx off and then on with ``patterns`` (cpu, no guard; the
    rest of ``tfmx.enable``'s ``options`` as given): ({False: stock model, True: tfmx model},
    the initial weights)."""
    import tfmx

    initial = [v.numpy() for v in build().weights]
    models = {}
    for on in (False, True):
        tfmx.enable(backend="cpu", patterns=patterns, **{"guard": False, **options}) if on \
            else tfmx.disable()
        models[on] = build()
        models[on].fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, shuffle=False)
    return models, initial


def fit_conv_block_with_form(family: str, form: str, block, monkeypatch, side: int = 8,
                             channels: int = 4, seed: int = 0) -> tuple[dict, list]:
    """A convolution family's fit with ``form`` picked for every call of ``family``
    (``monkeypatch``: the test's): ``side`` x ``side`` x ``channels`` images through a 1x1
    ``Conv2D``, ``block(x)`` (the family's layers), a global pool and ``Dense(3)``, trained
    with momentum on MSE stock and with tfmx (:func:`fit_stock_and_tfmx`)."""
    import keras
    import numpy as np

    from tfmx import state

    monkeypatch.setattr(state, "tuner", lambda: PickForm(form, family, strict=True))

    def build() -> keras.Model:
        keras.utils.set_random_seed(seed)
        inp = keras.Input((side, side, channels))
        x = block(keras.layers.Conv2D(channels, 1)(inp))
        model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(x)))
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
        return model

    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, side, side, channels)).astype("float32")
    y = rng.standard_normal((16, 3)).astype("float32")
    return fit_stock_and_tfmx(build, x, y, [family])


def form_units(model, forms, form: str) -> list:
    """The nodes of ``form``'s scope (in ``forms``, a family's ``fusion.family.Forms``) in the
    graph ``model``'s step ran, the gradient's copies aside."""
    scope = forms.scope_of(forms[form])
    return [n for n in nodes_that_ran(model.train_function)
            if scope in n.name and not n.name.startswith("gradient_tape")]


def weight_scales(model, initial) -> list[float]:
    """Each weight's scale for comparing two fits from ``initial`` (a list in ``weights``
    order): its magnitude in ``model``, or the largest change of a weight of its layer if
    larger (see :func:`assert_models_within_rounding`)."""
    import numpy as np

    moved = {v.path: float(np.max(np.abs(v.numpy() - w0)))
             for v, w0 in zip(model.weights, initial)}
    return [max([float(np.max(np.abs(v.numpy())))]
                + [m for path, m in moved.items()
                   if path.rsplit("/", 1)[0] == v.path.rsplit("/", 1)[0]])
            for v in model.weights]


def assert_models_within_rounding(stock, fused, initial, terms: int,
                                  dtype: str = "float32") -> None:
    """Every weight of two models trained from the same ``initial`` weights (a list, in
    ``weights`` order) within ``terms`` roundings of ``dtype`` (the compute dtype). Each
    weight's scale is its own magnitude, or the largest change of a weight of the same layer
    if larger: the key projection's bias of an attention adds one constant per score row,
    which softmax cancels, so its gradient is a sum of the layer's terms that is zero but for
    rounding, and its value is rounding-sized while the roundings are the size of the layer's
    updates."""
    for a, b, scale in zip(stock.weights, fused.weights, weight_scales(stock, initial)):
        assert_within_rounding(b.numpy(), a.numpy(), terms, dtype=dtype, scale=scale,
                               what=a.path)


def fit_float32_reference(build, x, y, epochs: int = 2, batch_size: int = 8):
    """``build()`` trained stock (tfmx off) under the float32 policy, from the same seeded
    weights as a 16-bit fit: the reference a 16-bit step's deviation is measured from."""
    import keras

    import tfmx

    before = keras.mixed_precision.global_policy().name
    tfmx.disable()
    keras.mixed_precision.set_global_policy("float32")
    try:
        model = build()
        model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, shuffle=False)
    finally:
        keras.mixed_precision.set_global_policy(before)
    return model


def no_further_terms(steps: int, extra: int = 0) -> int:
    """The ``terms`` of :func:`assert_no_further_from_float32` for ``steps`` training steps of
    forms that round ``extra`` times per step where stock does not: one rounding per step
    besides (where two computations round differently, their deviations from float32 are
    not ordered element by element, so the maxima compared may swap by a rounding)."""
    return steps * (1 + extra)


def assert_no_further_from_float32(reference, stock, fused, initial, terms: int,
                                   dtype: str = "bfloat16") -> None:
    """A 16-bit fit with tfmx is no further from the float32 fit (``reference``, from the same
    ``initial`` weights) than stock's 16-bit fit is, but for ``terms`` roundings of ``dtype``
    (the forms' own): for every weight, max |fused - reference| <= max |stock - reference| +
    2 x terms x u x scale, the scale as in :func:`assert_models_within_rounding`. Stock's own
    16-bit deviation is the allowance: a form that loses accuracy beyond it fails, where a
    bound counting every 16-bit rounding of the step could not."""
    import numpy as np

    excess = {}  # weight -> (tfmx's deviation beyond stock's, in roundings x scale)
    scales = weight_scales(reference, initial)
    for r, a, b, scale in zip(reference.weights, stock.weights, fused.weights, scales):
        stock_off = float(np.max(np.abs(a.numpy().astype(np.float64) - r.numpy())))
        fused_off = float(np.max(np.abs(b.numpy().astype(np.float64) - r.numpy())))
        excess[r.path] = (fused_off - stock_off) / (2 * unit_roundoff(dtype) * scale)
    worst = max(excess, key=excess.get)
    assert excess[worst] <= terms, (
        f"{worst}: tfmx's 16-bit fit is {excess[worst]:.2f} roundings of {dtype} (x the "
        f"weight's scale) further from float32 than stock's, above the {terms} allowed")


def slow_trial_forms(patch, **delays: float) -> None:
    """Every step of a form that a whole-step guard times in its trial takes ``delays[form]``
    seconds more (a sleep within the timed call: ``StepGuard.run`` wrapped), so that the trial
    decides. ``patch(StepGuard, "run", new)`` sets it: ``monkeypatch.setattr`` in a test (undone
    after it), ``setattr`` in a script. The delays of a new call replace the old ones."""
    import functools
    import time

    from tfmx.guard import StepGuard

    run = getattr(StepGuard.run, "__wrapped__", StepGuard.run)

    @functools.wraps(run)
    def slowed(guard, forms):
        def slower(form, call):
            if not delays.get(form) or getattr(call, "slowed", False):
                return call

            def call_slowly():
                if guard.kept is None:  # the trial times this call
                    time.sleep(delays[form])
                return call()

            call_slowly.slowed = True  # a run after a challenger failed passes it on
            return call_slowly

        return run(guard, {form: slower(form, call) for form, call in forms.items()})

    patch(StepGuard, "run", slowed if any(delays.values()) else run)


# -- stages made to fail, and each stage family's example (tests/test_stage_safety.py) --------
FAULT_POINTS = ("handler", "tuner", "emit")
"""Where :func:`failing` makes a stage fail."""


class InjectedFault(RuntimeError):
    """The failure :func:`failing` injects."""


class _FailingChooser:
    def choose(self, family, *args, **kwargs):
        raise InjectedFault(f"{family}: injected failure in the tuner")


def failing(patch, family: str, where: str = "handler") -> None:
    """From now on (``patch``: ``monkeypatch.setattr``, undone after the test), ``family``'s
    stage raises at ``where``: as its handler starts (``"handler"``), when it asks the tuner
    (``"tuner"``), or after it emitted its form (``"emit"``: the form is in the graph and must
    not run). The failure is raised inside the stage's transaction
    (``fusion.stage.transaction``), as a bug of the stage would be."""
    import dataclasses

    from fusion import stage

    if where not in FAULT_POINTS:
        raise ValueError(f"where must be one of {FAULT_POINTS}, got {where!r}")
    real = stage.transaction

    def transaction(ctx, name, handler, following, instance, args, kwargs):
        if name != family:
            return real(ctx, name, handler, following, instance, args, kwargs)

        def faulty(attempt_ctx, *rest, **named):
            if where == "handler":
                raise InjectedFault(f"{family}: injected failure at handler")
            if where == "tuner":
                attempt_ctx = dataclasses.replace(attempt_ctx, chooser=_FailingChooser())
            out = handler(attempt_ctx, *rest, **named)
            if where == "emit":
                raise InjectedFault(f"{family}: injected failure at emit")
            return out

        return real(ctx, name, faulty, following, instance, args, kwargs)

    patch(stage, "transaction", transaction)


@dataclasses.dataclass(frozen=True)
class StageExample:
    """What tests/test_stage_safety.py needs of a stage family, declared in the family's own
    test file (``tests/test_<family>.py``, as ``STAGE_EXAMPLE``): a small model where the family
    applies (a function building it: float32 inputs, 4 outputs, trained on MSE), and an op every
    form the family takes on it emits in float32, so that a backend without a kernel for it keeps
    Keras's call (None: its forms emit no op a kernel table decides, as an XLA region)."""

    model: Callable[[], Any]
    lacking: str | None


def value_and_gradient(fn, x) -> list:
    """``fn(x)`` and the gradient at ``x`` of ``sum(fn(x) * sin(x))`` (a loss whose gradient
    weighs every element differently), both as float64 arrays, for an elementwise form's
    comparison with its reference."""
    import numpy as np
    import tensorflow as tf

    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * tf.sin(tf.cast(x, tf.float32)))
    return [y.numpy().astype(np.float64), tape.gradient(loss, x).numpy().astype(np.float64)]


def form_names(forms) -> list[str]:
    """The names of a stage's ``forms`` (its ``Form`` objects), in order."""
    return [form.name for form in forms]


def value_and_gradients(fn, *operands) -> list:
    """``fn(*operands)`` and the gradients of ``sum(y * sin(y))`` (a loss whose gradient
    depends on every output's value) w.r.t. each of ``operands``: a form's values and
    gradients, to compare with another form's."""
    import tensorflow as tf

    with tf.GradientTape() as tape:
        tape.watch(list(operands))
        y = fn(*operands)
        loss = tf.reduce_sum(y * tf.sin(y))
    return [y, *tape.gradient(loss, list(operands))]
