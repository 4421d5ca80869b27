"""RNN-cell patterns: Keras LSTM / GRU layers -> a hoisted loop (CPU) or ``CudnnRNNV3`` (GPU).

This family works in the stage *before* differentiation (DESIGN.md, "Two stages, one engine"):
a post-gradient rewrite would have to rebuild both the forward ``While`` body and the gradient
body that TensorFlow derived from it, with its TensorList accumulators. Instead, while tfmx
traces a step function, each Keras ``LSTM`` / ``GRU`` layer is matched as it is called
(:func:`find_rnn_layer` fills an :class:`RnnMatch` or gives the reason it declines) and
:func:`rewrite_rnn_layer` emits the target's form of the layer's inner loop, whose backward
pass comes from a ``tf.custom_gradient`` (CPU) or from TensorFlow's registered gradient of
``CudnnRNNV3`` (GPU targets). Emitted nodes live under a name scope ``tfmx_rnn_<kind>``;
declined layers run Keras's own loop under ``tfmx_rnn_declined_<why>``. The registered graph
pass, :func:`rnn_pass`, reads those scopes in the traced graph, checks the structure (a
``While`` loop on CPU; ``CudnnRNNV3`` nodes the target runs on GPU targets) and reports it,
like every other family.

CPU form (``fusion.patterns.rnn_kernels``): the input projection of all timesteps is one MatMul
before the loop, the loop keeps the recurrent MatMul and the gate arithmetic, the backward is
one reverse loop with one MatMul per step and the weight gradients as single big MatMuls.
GPU form: one ``CudnnRNNV3`` per layer; masks of any shape (left padding, holes) keep Keras's
generic-loop semantics by packing each row's unmasked steps to the front (cuDNN takes only
sequence lengths), where Keras itself asserts right padding.

Example:
    >>> import keras
    >>> from fusion.patterns.rnn import find_rnn_layer
    >>> from tfmx.backends import get_backend
    >>> match, why = find_rnn_layer(keras.layers.LSTM(4), get_backend("cpu"))
    >>> match.kind, match.form, why
    ('lstm', 'hoisted', None)
    >>> find_rnn_layer(keras.layers.GRU(4, unroll=True), get_backend("cpu"))[1]
    'unroll'
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

from fusion.graph import GraphView, parse_input
from fusion.pattern import RewriteContext, Target, register

SCOPE = "tfmx_rnn_"
DECLINED = SCOPE + "declined_"
GRADIENT_SCOPES = ("gradient_tape/", "gradients/")

# Why a layer keeps Keras's own loop, by the code that goes into its name scope.
DECLINE_REASONS = {
    "unroll": "unroll=True: Keras unrolls the loop in Python, nothing to fuse",
    "tuned": "Keras's own loop measured faster than the hoisted one on this machine "
             "(tfmx.report(): tuned)",
    "stateful": "stateful=True is not fused (states live in variables across batches)",
    "recurrent_dropout": "recurrent_dropout > 0 needs a fresh mask inside every step",
    "activation": "activation / recurrent_activation other than tanh / sigmoid",
    "dtype": "compute dtype other than float32 (mixed precision) is not fused yet",
    "use_cudnn_true": "use_cudnn=True on a target without cuDNN: Keras's own error stands",
    "use_cudnn_false": "use_cudnn=False asks the GPU target for Keras's generic loop",
    "reset_before_gpu": "GRU(reset_after=False) has no cuDNN / Metal kernel (cuDNN GRU "
                        "applies the reset gate after the MatMul)",
    "cell": "not a Keras LSTMCell / GRUCell",
    "target": "no RNN form for this target",
    "error": "building the fused form raised (see the warning); Keras's own loop runs",
}
KIND_LABELS = {
    ("lstm", "hoisted"): "LSTM: hoisted input projection + recurrent loop, custom gradient",
    ("gru", "hoisted"): "GRU(reset_after=True): hoisted input projection + recurrent loop, "
                        "custom gradient",
    ("gru_reset_before", "hoisted"): "GRU(reset_after=False): hoisted input projection + "
                                     "recurrent loop, custom gradient",
    ("lstm", "unrolled"): "LSTM: hoisted input projection + unrolled recurrence, custom gradient",
    ("gru", "unrolled"): "GRU(reset_after=True): hoisted input projection + unrolled "
                         "recurrence, custom gradient",
    ("gru_reset_before", "unrolled"): "GRU(reset_after=False): hoisted input projection + "
                                      "unrolled recurrence, custom gradient",
    ("lstm", "keras_unrolled"): "LSTM: Keras's cell unrolled (measured faster than its loop)",
    ("gru", "keras_unrolled"): "GRU(reset_after=True): Keras's cell unrolled (measured faster "
                               "than its loop)",
    ("gru_reset_before", "keras_unrolled"): "GRU(reset_after=False): Keras's cell unrolled "
                                            "(measured faster than its loop)",
    ("lstm", "cudnn"): "LSTM: CudnnRNNV3 (+ CudnnRNNBackpropV3 by its gradient)",
    ("gru", "cudnn"): "GRU: CudnnRNNV3 (+ CudnnRNNBackpropV3 by its gradient)",
}
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


@dataclasses.dataclass(frozen=True)
class RnnKernels:
    """What a backend declares for this family: the form its LSTM / GRU layers take
    ("hoisted": the hoisted loop, any TensorFlow device; "cudnn": one ``CudnnRNNV3``), and
    whether its cuDNN GRU orders the gates r, z, h (CUDA's cuDNN) instead of Keras's z, r, h."""

    form: str
    gru_gates_rzh: bool = False


@dataclasses.dataclass
class RnnMatch:
    """One Keras LSTM / GRU layer call that the family fuses."""

    kind: str  # "lstm", "gru" (reset_after=True) or "gru_reset_before"
    form: str  # "hoisted" (CPU loop) or "cudnn" (CudnnRNNV3)
    layer: Any
    swap_zr: bool = False  # cuDNN on CUDA orders GRU gates r, z, h

    @property
    def label(self) -> str:
        return KIND_LABELS[(self.kind, self.form)]


def _is_exactly(obj: Any, module: str, name: str) -> bool:
    cls = type(obj)
    return cls.__name__ == name and cls.__module__.startswith(module)


def find_rnn_layer(layer: Any, target: Target) -> tuple[RnnMatch | None, str | None]:
    """Match one Keras ``LSTM`` / ``GRU`` layer for ``target``: (match, None) or (None, code).

    ``code`` is a key of :data:`DECLINE_REASONS`.
    """
    from keras.src import activations, ops

    cell = getattr(layer, "cell", None)
    if _is_exactly(cell, "keras.src.layers.rnn.lstm", "LSTMCell"):
        kind = "lstm"
    elif _is_exactly(cell, "keras.src.layers.rnn.gru", "GRUCell"):
        kind = "gru" if cell.reset_after else "gru_reset_before"
    else:
        return None, "cell"
    kernels = target.capability(RnnKernels)
    if kernels is None:
        return None, "target"
    gpu = kernels.form == "cudnn"
    if layer.unroll:
        return None, "unroll"
    if layer.stateful:
        return None, "stateful"
    if cell.recurrent_dropout:
        return None, "recurrent_dropout"
    if cell.activation not in (activations.tanh, ops.tanh) or cell.recurrent_activation not in (
        activations.sigmoid, ops.sigmoid
    ):
        return None, "activation"
    if layer.compute_dtype != "float32" or cell.compute_dtype != "float32":
        return None, "dtype"
    use_cudnn = getattr(layer, "use_cudnn", "auto")
    if use_cudnn is True and not gpu:
        return None, "use_cudnn_true"
    if gpu and use_cudnn is False:
        return None, "use_cudnn_false"
    if gpu and kind == "gru_reset_before":
        return None, "reset_before_gpu"
    return RnnMatch(kind, kernels.form, layer, swap_zr=kernels.gru_gates_rzh), None


def rewrite_rnn_layer(match: RnnMatch, sequences, initial_state, mask, training=False,
                      chunks=None, unrolled=False):
    """Emit ``match``'s form of the layer's inner loop; Keras's ``(last, outputs, states)``.

    ``chunks``: loops per sequence of the cpu form (default ``rnn_kernels.CHUNKS``);
    ``unrolled``: the cpu form with every timestep its own ops (a static length only)."""
    import tensorflow as tf

    from fusion.patterns import rnn_kernels as k

    layer, cell = match.layer, match.layer.cell
    if isinstance(mask, (list, tuple)):
        mask = mask[0]
    states = list(initial_state) if isinstance(initial_state, (list, tuple)) else [
        initial_state]
    with tf.name_scope(SCOPE + match.kind + ("_unrolled" if unrolled else "")):
        if training and cell.dropout:  # Keras's cuDNN path: one input mask for every step
            dp_mask = cell.get_dropout_mask(sequences[:, 0, :])
            sequences = sequences * dp_mask[:, None, :]
        kernel, recurrent = cell.kernel.value, cell.recurrent_kernel.value
        bias = None if cell.bias is None else cell.bias.value
        flags = {"go_backwards": layer.go_backwards, "return_sequences": layer.return_sequences}
        flags["zero_output_for_mask"] = layer.zero_output_for_mask
        if match.form == "cudnn" and match.kind == "lstm":
            return k.cudnn_lstm(sequences, states[0], states[1], mask, kernel, recurrent, bias,
                                **flags)
        if match.form == "cudnn":
            return k.cudnn_gru(sequences, states[0], mask, kernel, recurrent, bias,
                               match.swap_zr, **flags)
        # Inference saves nothing for a backward pass (the loop stays differentiable by
        # TensorFlow's own While gradient); a symbolic ``training`` takes the training form.
        flags["training"] = training if isinstance(training, bool) else training is not None
        if match.kind == "lstm":
            return k.lstm_sequence(sequences, states[0], states[1], mask, kernel, recurrent,
                                   bias, chunks=chunks, unrolled=unrolled, **flags)
        return k.gru_sequence(sequences, states[0], mask, kernel, recurrent, bias,
                              reset_after=match.kind == "gru", chunks=chunks,
                              unrolled=unrolled, **flags)


TUNED_CHUNKS = (1, 5)
"""Loops per sequence the tuner times for the cpu form (besides Keras's own loop)."""
MAX_UNROLLED_STEPS = 128
"""Longest sequence whose unrolled forms are timed at all: unrolling grows the graph (and its
trace and rewrite time) with every timestep, as Keras's own ``unroll=True`` warns. It prunes the
search; among the forms it leaves, the tuner decides."""


@dataclasses.dataclass(frozen=True)
class RnnForm:
    """One correct way to run a layer call on cpu: Keras's or the hoisted loop, looped or
    unrolled. ``chunks``: loops per sequence of the hoisted looped form."""

    name: str
    hoisted: bool
    unrolled: bool = False
    chunks: int | None = None


def cpu_forms(steps: int | None) -> dict[str, RnnForm]:
    """The forms the tuner times for a sequence of ``steps`` timesteps (None: unknown).

    Example:
        >>> sorted(cpu_forms(50))
        ['hoisted unrolled', 'hoisted x1', 'hoisted x5', 'keras', 'keras unrolled']
        >>> sorted(cpu_forms(None))
        ['hoisted x1', 'keras']
    """
    forms = [RnnForm("keras", False)]
    for chunks in TUNED_CHUNKS:
        if chunks == 1 or (steps is not None and steps >= 2 * chunks):
            forms.append(RnnForm(f"hoisted x{chunks}", True, chunks=chunks))
    if steps is not None and 1 < steps <= MAX_UNROLLED_STEPS:
        forms += [RnnForm("keras unrolled", False, unrolled=True),
                  RnnForm("hoisted unrolled", True, unrolled=True)]
    return {form.name: form for form in forms}


def run_keras_loop(layer, original, sequences, initial_state, mask, training, unrolled=False):
    """Keras's own ``inner_loop`` for ``layer``, with ``unroll`` set for this call only."""
    saved = layer.unroll
    layer.unroll = unrolled or saved
    try:
        return original(layer, sequences, initial_state, mask, training=training)
    finally:
        layer.unroll = saved


def _layer_candidates(match: RnnMatch, original, sequences, initial_state, training,
                      input_gradient=True):
    """The forms of one layer call, each a factory of a runnable forward (+ backward when
    ``training``) at the call's shapes (unknown batch 32): :func:`cpu_forms`.
    ``input_gradient``: whether the backward computes the gradient of the sequences too (not
    for a layer reading the model's inputs)."""
    import tensorflow as tf

    layer = match.layer
    shape = [32 if d is None else int(d) for d in sequences.shape]
    states = list(initial_state) if isinstance(initial_state, (list, tuple)) else [
        initial_state]
    units = int(states[0].shape[-1])

    def factory(form: RnnForm):
        def make():
            @tf.function(autograph=False)
            def step(x):
                with tf.GradientTape() as tape:
                    if input_gradient:
                        tape.watch(x)
                    init = [tf.zeros([shape[0], units], x.dtype) for _ in states]
                    if form.hoisted:
                        _, outputs, _ = rewrite_rnn_layer(match, x, init, None, training,
                                                          form.chunks, form.unrolled)
                    else:
                        _, outputs, _ = run_keras_loop(layer, original, x, init, None,
                                                       training, form.unrolled)
                    loss = tf.reduce_sum(outputs * outputs)
                if not training:  # inference: the forward alone
                    return [loss]
                return tape.gradient(loss, [*layer.trainable_variables,
                                            *([x] if input_gradient else [])])

            x = tf.random.normal(shape, dtype=sequences.dtype, seed=1)

            def run():
                step(x)[0].numpy()

            return run

        return make

    return {name: factory(form) for name, form in cpu_forms(shape[1]).items()}


def _tuned_form(match: RnnMatch, original, sequences, initial_state, mask, training,
                tuner) -> tuple[RnnForm, str]:
    """The form the tuner measured fastest for this call, and the decision's text."""
    from tensorflow.python.eager import record

    from fusion.fragment import shape_text

    shape = shape_text(sequences.shape)
    input_gradient = bool(training) and record.should_record_backprop([sequences])
    signature = (f"{match.kind} input {shape} units {match.layer.cell.units} "
                 f"sequences={match.layer.return_sequences} mask={mask is not None} "
                 f"training={bool(training)} input_gradient={input_gradient}")
    choice = tuner.choose("rnn", signature, _layer_candidates(
        match, original, sequences, initial_state, training, input_gradient),
        conservative="keras")
    form = cpu_forms(sequences.shape[1])[choice.choice]
    return form, f"{match.kind} {signature}: {form.name} kept: {choice.why()}"


def forward_stage(layer, original, target: Target, sequences, initial_state, mask,
                  training=False, tuner=None):
    """A Keras LSTM/GRU ``inner_loop`` call while tfmx traces: fused, or Keras's, declined.

    On cpu ``tuner`` (``tfmx.tuner``) decides between the forms of :func:`cpu_forms` (Keras's
    loop or the hoisted one, looped in a few chunkings or unrolled) by timing them at the call's
    shapes; None: the hoisted loop."""
    import tensorflow as tf

    match, why = find_rnn_layer(layer, target)
    form = RnnForm("hoisted", True)
    if match is not None and match.form == "hoisted" and tuner is not None:
        train = training if isinstance(training, bool) else training is not None
        form, _ = _tuned_form(match, original, sequences, initial_state, mask, train, tuner)
        if form.name == "keras":
            match, why = None, "tuned"
        elif not form.hoisted:  # Keras's cell, unrolled: measured faster than every loop
            with tf.name_scope(SCOPE + match.kind + "_keras_unrolled"):
                return run_keras_loop(layer, original, sequences, initial_state, mask,
                                      training, unrolled=True)
    if match is not None:
        try:
            return rewrite_rnn_layer(match, sequences, initial_state, mask, training,
                                     form.chunks, form.unrolled)
        except Exception as exc:  # noqa: BLE001 - never break training: Keras's loop runs
            why = "error"
            warnings.warn(f"tfmx rnn: {layer.name}: {type(exc).__name__}: {exc}; "
                          "Keras's own loop runs", stacklevel=2)
    with tf.name_scope(DECLINED + why):
        return original(layer, sequences, initial_state, mask, training=training)


# -- the graph pass: find what the forward stage emitted, check it, report it --------------------
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


UNROLLED_FORMS = ("_keras_unrolled", "_unrolled")  # scope suffixes, longest first


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
    if form in ("unrolled", "keras_unrolled"):
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
    "Keras LSTM / GRU -> hoisted input projection + recurrent loop with custom gradient (cpu), "
    "CudnnRNNV3 (cuda, metal); emitted before differentiation, checked and reported here",
)
def rnn_pass(view: GraphView, ctx: RewriteContext) -> None:
    """Report the RNN layers the forward stage fused or declined in ``view``."""
    for unit in find_rnn_units(view):
        ctx.stats.matched += 1
        if unit.tag.startswith("declined_"):
            code = unit.tag[len("declined_"):]
            ctx.stats.decline(DECLINE_REASONS.get(code, code))
            continue
        label, why = _check_unit(view, unit, ctx.target)
        if label is None:
            ctx.stats.decline(why)
        else:
            ctx.stats.fuse(label, why)
