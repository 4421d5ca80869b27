"""The rnn stage: Keras LSTM / GRU layers -> a hoisted loop (CPU) or ``CudnnRNNV3`` (GPU).

A post-gradient rewrite would have to rebuild both the forward ``While`` body and the gradient
body that TensorFlow derived from it, with its TensorList accumulators. Instead, while tfmx
traces a step function (``fusion.stage.tracing``), each Keras ``LSTM`` / ``GRU`` layer's
``inner_loop`` is matched as it is called (:func:`find_rnn_layer` fills an :class:`RnnMatch` or
gives the reason it declines) and :func:`rewrite_rnn_layer` emits the target's form, whose
backward pass comes from a ``tf.custom_gradient`` (CPU) or from TensorFlow's registered gradient
of ``CudnnRNNV3`` (GPU targets). Emitted nodes live under a name scope ``tfmx_rnn_<kind>``;
declined layers run Keras's own loop under ``tfmx_rnn_declined_<why>``; the GraphDef pass
``fusion.graphs.rnn`` finds those scopes in the traced graph and reports what it observed.

CPU forms (``fusion.kernels.rnn``), chosen per layer call by the tuner
(:func:`cpu_forms`): Keras's loop, or the hoisted one (the input projection of all timesteps is
one MatMul before the loop, the loop keeps the recurrent MatMul and the gate arithmetic, the
backward is one reverse loop with one MatMul per step and the weight gradients as single big
MatMuls), looped in chunks or unrolled; or Keras's cell unrolled. GPU form: one ``CudnnRNNV3``
per layer; masks of any shape (left padding, holes) keep Keras's generic-loop semantics by
packing each row's unmasked steps to the front (cuDNN takes only sequence lengths), where Keras
itself asserts right padding.

Example:
    >>> import keras
    >>> from fusion.calls.rnn import find_rnn_layer
    >>> from tfmx.backends import get_backend
    >>> match, why = find_rnn_layer(keras.layers.LSTM(4), get_backend("cpu"))
    >>> match.kind, match.form, why
    ('lstm', 'hoisted', None)
    >>> find_rnn_layer(keras.layers.GRU(4, unroll=True), get_backend("cpu"))[1]
    'unroll'
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any

from fusion import private_api, trace_state
from fusion.family import Family, Form, Forms, conservative, declare
from fusion.kernels.rnn import RnnKernels, rnn_kernels
from fusion.pattern import PatternStats, Target
from fusion.stage import CallSite, Emitted, Hook, StageContext, rewrite_call, timed_form

# -- match: the Keras calls it hooks, and what it finds in them -----------------------------------
FAMILY = "rnn"
SCOPE = "tfmx_rnn"
DECLINED = SCOPE + "_declined_"
MATCHES = ("keras.src.layers.rnn.lstm:LSTM.inner_loop", "keras.src.layers.rnn.gru:GRU.inner_loop")
"""The Keras calls the stage hooks: an ``LSTM`` or ``GRU`` layer's loop over the sequence."""


@dataclasses.dataclass
class RnnMatch:
    """One Keras LSTM / GRU layer call that the family fuses."""

    kind: str  # "lstm", "gru" (reset_after=True) or "gru_reset_before"
    form: str  # "hoisted" (CPU loop) or "cudnn" (CudnnRNNV3)
    layer: Any
    swap_zr: bool = False  # cuDNN on CUDA orders GRU gates r, z, h


def find_rnn_layer(layer: Any, target: Target) -> tuple[RnnMatch | None, str | None]:
    """Match one Keras ``LSTM`` / ``GRU`` layer for ``target``: (match, None) or (None, code).

    ``code`` is a key of :data:`DECLINE_REASONS`.
    """
    activations, ops = private_api.get("keras.activations"), private_api.get("keras.ops")

    cell = getattr(layer, "cell", None)
    if type(cell) is private_api.get("keras.LSTMCell"):
        kind = "lstm"
    elif type(cell) is private_api.get("keras.GRUCell"):
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


# -- check: why a call keeps Keras's own form (None: it need not) ---------------------------------
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
    "kernel": "the target has no kernel for an op of the form in the call's dtype",
    "error": "building the fused form raised (see the warning); Keras's own loop runs",
}


def check(layer: Any, target: Target) -> str | None:
    """Why ``layer``'s calls keep Keras's own loop on ``target`` (:func:`find_rnn_layer`'s
    code, in words), or None.

    >>> import keras
    >>> from tfmx.backends import get_backend
    >>> check(keras.layers.LSTM(4, stateful=True), get_backend("cpu"))
    'stateful=True is not fused (states live in variables across batches)'
    """
    why = find_rnn_layer(layer, target)[1]
    return None if why is None else DECLINE_REASONS[why]


# -- forms: what it emits (CONSERVATIVE: the form Keras runs), and the hook's flow ----------------
CONSERVATIVE = conservative("keras", "Keras's own loop")
_KIND_NAMES = {"lstm": "LSTM", "gru": "GRU(reset_after=True)",
               "gru_reset_before": "GRU(reset_after=False)"}
_LOOP = frozenset({"AddV2", "ConcatV2", "MatMul", "Mul", "Sigmoid", "Sub", "Tanh", "Transpose"})
_LOOPS = frozenset({"While", "StatelessWhile"})
_UNROLLED = frozenset({"MatMul"})
_CPU_FORMS = {  # form -> (words, the ops that show a unit of it, the ops it emits)
    "hoisted": ("hoisted input projection + recurrent loop, custom gradient", _LOOPS, _LOOP),
    "unrolled": ("hoisted input projection + unrolled recurrence, custom gradient", _UNROLLED,
                 _LOOP),
    "keras_unrolled": ("Keras's cell unrolled (measured faster than its loop)", _UNROLLED,
                       _LOOP - {"ConcatV2", "Transpose"}),
}
_CUDNN = frozenset({"ConcatV2", "CudnnRNNBackpropV3", "CudnnRNNV3", "Split", "Transpose",
                    "ZerosLike"})


def _form(kind: str, form: str, label: str, marks: frozenset[str],
          emits: frozenset[str]) -> Form:
    """The ``form`` of a ``kind`` layer: named (and scoped, ``tfmx_rnn_<kind>[_<form>]``) after
    the kind, then the form unless it is the hoisted loop."""
    words = kind.replace("_", " ") + ("" if form == "hoisted" else " " + form.replace("_", " "))
    return Form(words, label, marks=marks, emits=emits)


KIND_FORMS = {(kind, form): _form(kind, form, f"{name}: {text}", marks, emits)
              for kind, name in _KIND_NAMES.items()
              for form, (text, marks, emits) in _CPU_FORMS.items()}
KIND_FORMS[("lstm", "wavefront")] = _form(
    "lstm", "wavefront", "LSTM -> LSTM: the layer below and this one unrolled as one wavefront, "
                         "custom gradient", _UNROLLED, _LOOP)
KIND_FORMS[("gru", "wavefront")] = _form(
    "gru", "wavefront", "GRU -> GRU (reset_after=True): the layer below and this one unrolled "
                        "as one wavefront, custom gradient", _UNROLLED, _LOOP)
for _kind, _name in (("lstm", "LSTM"), ("gru", "GRU")):
    KIND_FORMS[(_kind, "cudnn")] = _form(
        _kind, "cudnn", f"{_name}: CudnnRNNV3 (+ CudnnRNNBackpropV3 by its gradient)",
        frozenset({"CudnnRNNV3"}), _CUDNN)
FORMS = Forms(SCOPE, (CONSERVATIVE, *KIND_FORMS.values()))
"""Every form, by (layer kind, form) in :data:`KIND_FORMS`: emitted under its scope
(``tfmx_rnn_<kind>`` for the hoisted loop, ``tfmx_rnn_<kind>_<form>`` otherwise; Keras's loop
declined under ``tfmx_rnn_declined_<code>``), reported under its label (each form reports what
it rewrote itself; the family's graph pass checks and observes its units), its marks the ops
that show a unit of it (its loop, its first MatMul where unrolled, its ``CudnnRNNV3``), its
emits the ops it emits in the sequences' dtype: a backend without one of them in that dtype
keeps Keras's loop."""


def _state_list(initial_state) -> list:
    """A layer call's initial states as a list (Keras passes one tensor or several)."""
    return list(initial_state) if isinstance(initial_state, (list, tuple)) else [initial_state]


def rewrite_rnn_layer(match: RnnMatch, sequences, initial_state, mask, training=False,
                      chunks=None, unrolled=False):
    """Emit ``match``'s form of the layer's inner loop; Keras's ``(last, outputs, states)``.

    ``chunks``: loops per sequence of the cpu form (default ``fusion.kernels.rnn.CHUNKS``);
    ``unrolled``: the cpu form with every timestep its own ops (a static length only)."""

    from fusion.kernels import rnn as k

    layer, cell = match.layer, match.layer.cell
    if isinstance(mask, (list, tuple)):
        mask = mask[0]
    states = _state_list(initial_state)
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
    forms = [RnnForm(CONSERVATIVE.name, False)]
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


def _zero_states(match: RnnMatch, x: Any) -> list:
    """A layer's zero initial states for the batch of ``x``."""
    import tensorflow as tf

    units, count = match.layer.cell.units, 2 if match.kind == "lstm" else 1
    return [tf.zeros([tf.shape(x)[0], units], x.dtype) for _ in range(count)]


def _run_form(match: RnnMatch, original, form: RnnForm, x: Any, training) -> Any:
    """The outputs of ``match``'s layer on ``x`` from zero states in ``form`` (a tuner
    candidate: any input dropout a stand-in mask)."""
    init = _zero_states(match, x)
    with _stand_in_dropout([match.layer], x):
        if form.hoisted:
            return rewrite_rnn_layer(match, x, init, None, training, form.chunks,
                                     form.unrolled)[1]
        return run_keras_loop(match.layer, original, x, init, None, training,
                              form.unrolled)[1]


def _layer_candidates(match: RnnMatch, original, sequences, training, input_gradient=True):
    """The forms of one layer call, each a factory of a runnable forward (+ backward when
    ``training``) at the call's shapes (unknown batch 32): :func:`cpu_forms`.
    ``input_gradient``: whether the backward computes the gradient of the sequences too (not
    for a layer reading the model's inputs)."""
    return {name: timed_form(lambda x, form=form: _run_form(match, original, form, x, training),
                             [sequences.shape], sequences.dtype,
                             match.layer.trainable_variables, watch=input_gradient,
                             backward=bool(training))
            for name, form in cpu_forms(sequences.shape[1]).items()}


def _tuned_form(match: RnnMatch, original, sequences, initial_state, mask, training,
                tuner) -> RnnForm:
    """The form the tuner measured fastest for this call (the report has the decision)."""
    from tensorflow.python.eager import record

    from fusion.fragment import shape_text

    shape = shape_text(sequences.shape)
    input_gradient = bool(training) and record.should_record_backprop([sequences])
    signature = (f"{match.kind} input {shape} units {match.layer.cell.units} "
                 f"sequences={match.layer.return_sequences} mask={mask is not None} "
                 f"training={bool(training)} input_gradient={input_gradient}")
    choice = tuner.choose(FAMILY, signature, _layer_candidates(
        match, original, sequences, training, input_gradient), conservative=CONSERVATIVE.name)
    return cpu_forms(sequences.shape[1])[choice.choice]


# -- stacked layers: the wavefront pair -------------------------------------------------------
WAVEFRONT = "wavefront"
PAIR_KINDS = ("lstm", "gru")  # GRU(reset_after=False) has no pair form


@dataclasses.dataclass(frozen=True)
class Below:
    """A layer call whose output sequence the next layer may read, with what the wavefront
    needs to run it again beside that layer (its inputs, states and the form it took)."""

    match: RnnMatch
    original: Any
    form: RnnForm
    sequences: Any
    initial_state: tuple


def _pairable(match: RnnMatch, sequences, mask, training: bool) -> bool:
    """Whether a layer call fits in a wavefront pair, as the layer below or above: a static
    length the unrolled form takes, no mask, forwards, training (input dropout is fine)."""
    layer = match.layer
    steps = sequences.shape[1]
    return (training and mask is None and match.kind in PAIR_KINDS and not layer.go_backwards
            and steps is not None and 1 < steps <= MAX_UNROLLED_STEPS)


def _remember_below(match: RnnMatch | None, original, form: RnnForm, sequences, initial_state,
                    mask, training: bool, outputs) -> None:
    """Note a layer call whose outputs another layer may read as its upper half of a pair."""
    if match is None or match.form != "hoisted" or not match.layer.return_sequences:
        return
    if not _pairable(match, sequences, mask, training) or not hasattr(outputs, "graph"):
        return
    states = _state_list(initial_state)
    dropout = _dropout_mask(match, sequences)
    if dropout is not None:  # the mask this call's Keras step applied (one for every step)
        sequences = sequences * dropout[:, None, :]
    # the layer calls another may read as its lower half: their outputs' ``ref()`` -> Below
    below = trace_state.slot(outputs.graph, FAMILY)
    below[outputs.ref()] = Below(match, original, form, sequences, tuple(states))


def _dropout_mask(match: RnnMatch, sequences) -> Any:
    """The input dropout mask Keras configured for this training call (None without
    dropout): ``[B, features]``, the same for every step."""
    cell = match.layer.cell
    return cell.get_dropout_mask(sequences[:, 0, :]) if cell.dropout else None


@contextlib.contextmanager
def _stand_in_dropout(layers, x) -> Any:
    """While a tuner candidate is traced in a function of its own: each layer's input dropout
    mask a deterministic stand-in of the same shape (``x``'s batch), never the mask Keras
    configured in the step being traced (a tensor of another graph) nor a draw from the
    layer's seed generator (which would move the training's random stream). Each cell's
    ``_dropout_mask`` is a :func:`fusion.patches.temporarily` swap, undone on the way out."""
    import tensorflow as tf

    from fusion import patches

    with contextlib.ExitStack() as swaps:
        for cell in (layer.cell for layer in layers if layer.cell.dropout):
            width = int(cell.kernel.shape[0])
            mask = tf.fill([tf.shape(x)[0], width], 1.0 / (1.0 - cell.dropout))
            swaps.enter_context(patches.temporarily(cell, "_dropout_mask", mask))
        yield


def _below(match: RnnMatch, sequences, mask, training: bool) -> Below | None:
    """The layer call of the same kind whose outputs are this call's ``sequences``, if the
    two can run as one wavefront."""
    if not hasattr(sequences, "graph") or not _pairable(match, sequences, mask, training):
        return None
    held = trace_state.held(sequences.graph, FAMILY)
    below = None if held is None else held.get(sequences.ref())
    return below if below is not None and below.match.kind == match.kind else None


def _own_zeros(states, sequences) -> list:
    """``states`` with each zero fill rebuilt at ``sequences``' batch: Keras's initial state
    of the layer above takes its batch size from the shape of the layer below's outputs, which
    would keep that layer's own loop running beside the wavefront only to give a shape."""
    import tensorflow as tf

    def own(state):
        op = getattr(state, "op", None)
        if op is None or op.type != "Fill" or tf.get_static_value(op.inputs[1]) != 0:
            return state
        return tf.zeros([tf.shape(sequences)[0], state.shape[-1]], state.dtype)

    return [own(state) for state in states]


def rewrite_rnn_pair(low: RnnMatch, up: RnnMatch, sequences, low_states, up_states,
                     up_dropout=None):
    """Emit the wavefront of ``low`` -> ``up`` over ``low``'s input ``sequences`` (its
    dropout applied): ``up``'s Keras ``inner_loop`` result (:mod:`fusion.calls.rnn_wavefront`);
    ``up_dropout``: ``up``'s input dropout mask or None."""

    from fusion.calls import rnn_wavefront as w

    def weights(match: RnnMatch) -> tuple:
        cell = match.layer.cell
        return (cell.kernel.value, cell.recurrent_kernel.value,
                None if cell.bias is None else cell.bias.value)

    return_sequences = up.layer.return_sequences
    if up.kind == "lstm":
        return w.lstm_pair(sequences, list(low_states), weights(low), list(up_states),
                           weights(up), return_sequences, up_dropout)
    return w.gru_pair(sequences, low_states[0], weights(low), up_states[0], weights(up),
                      return_sequences, up_dropout)


def _pair_candidates(below: Below, up: RnnMatch, original, form: RnnForm):
    """The two ways to run a stacked pair, timed at the lower layer's input shape: layer by
    layer (each in the form its own decision took) or one wavefront."""
    from tensorflow.python.eager import record

    def layers(x: Any) -> Any:
        low_out = _run_form(below.match, below.original, below.form, x, True)
        return _run_form(up, original, form, low_out, True)

    def wave(x: Any) -> Any:
        with _stand_in_dropout([below.match.layer, up.layer], x):
            low_mask, up_mask = (_dropout_mask(m, x) for m in (below.match, up))
            dropped = x if low_mask is None else x * low_mask[:, None, :]
            return rewrite_rnn_pair(below.match, up, dropped, _zero_states(below.match, x),
                                    _zero_states(up, x), up_mask)[1]

    variables = [*below.match.layer.trainable_variables, *up.layer.trainable_variables]
    watch = record.should_record_backprop([below.sequences])
    return {name: timed_form(run, [below.sequences.shape], below.sequences.dtype, variables,
                             watch=watch)
            for name, run in (("layers", layers), (WAVEFRONT, wave))}, watch


def _pair_chosen(chooser, below: Below, up: RnnMatch, original, form: RnnForm) -> bool:
    """Whether the wavefront runs this pair: the tuner's measurement (the report has it), or
    the rewritten form itself without a chooser."""
    if chooser is None:
        return True
    from fusion.fragment import shape_text

    low = below.match.layer
    candidates, watch = _pair_candidates(below, up, original, form)
    signature = (f"{up.kind} pair input {shape_text(below.sequences.shape)} units "
                 f"{low.cell.units}->{up.layer.cell.units} bias={low.use_bias},"
                 f"{up.layer.use_bias} sequences={up.layer.return_sequences} "
                 f"input_gradient={watch} below={below.form.name} above={form.name}")
    return chooser.choose("rnn", signature, candidates, conservative="layers").choice == WAVEFRONT


def forward_stage(ctx: StageContext, original, layer, sequences, initial_state, mask=None,
                  training=False):
    """A Keras LSTM/GRU ``inner_loop`` call while tfmx traces (the stage's handler): the
    fused form, or Keras's loop, declined with the reason recorded.

    On cpu ``ctx.chooser`` (``tfmx.tuner``) decides between the forms of :func:`cpu_forms`
    (Keras's loop or the hoisted one, looped in a few chunkings or unrolled; Keras's cell
    unrolled) by timing them at the call's shapes; None: the hoisted loop. A layer reading
    the output sequence of the layer below it (``LSTM(return_sequences=True) -> LSTM``) may
    run with it as one unrolled wavefront (:func:`rewrite_rnn_pair`), when the chooser measures
    that faster than the two layers one after the other."""
    found, why = find_rnn_layer(layer, ctx.target)
    form = RnnForm("hoisted", True)
    train = training if isinstance(training, bool) else training is not None
    if found is not None and found.form == "hoisted" and ctx.chooser is not None:
        form = _tuned_form(found, original, sequences, initial_state, mask, train, ctx.chooser)
    result = _emit(ctx, found, why, form, original, layer, sequences, initial_state, mask,
                   training)
    _remember_below(found, original, form, sequences, initial_state, mask, train, result[1])
    return result


def _emit(ctx: StageContext, match: RnnMatch | None, why: str | None, form: RnnForm, original,
          layer, sequences, initial_state, mask, training):
    """The layer call in ``form``, or with the layer below as one wavefront where that is
    chosen (:func:`fusion.stage.rewrite_call`; the forms were decided before, by
    :func:`_tuned_form` and :func:`_pair_chosen`), else Keras's loop under
    ``tfmx_rnn_declined_<code>``, recorded with the reason."""
    import tensorflow as tf

    train = training if isinstance(training, bool) else training is not None
    code = [why]  # the reason Keras's loop runs, as the code of its name scope

    def keras() -> Any:
        with tf.name_scope(DECLINED + (code[0] or "kernel")):  # or the form's op missing
            return original(layer, sequences, initial_state, mask, training=training)

    def alone() -> Any:  # the layer call by itself
        if match is not None and form.name == CONSERVATIVE.name:
            code[0] = "tuned"
        chosen = None if match is None or code[0] else KIND_FORMS[(
            match.kind, "keras_unrolled" if not form.hoisted and form.unrolled else
            "unrolled" if form.unrolled else match.form)]
        return rewrite_call(ctx, CallSite(
            DECLARED, (chosen,) if chosen else (), keras=keras, emit=own_form,
            why=DECLINE_REASONS.get(code[0], code[0]), dtype=getattr(sequences, "dtype", None)))

    def own_form(chosen: Form) -> Emitted:
        stats = PatternStats(matched=1)
        if chosen == KIND_FORMS[(match.kind, "keras_unrolled")]:
            # Keras's cell, unrolled: measured faster than every loop
            stats.fuse(chosen.label)
            return Emitted(run_keras_loop(layer, original, sequences, initial_state, mask,
                                          training, unrolled=True), stats)
        try:
            result = rewrite_rnn_layer(match, sequences, initial_state, mask, training,
                                       form.chunks, form.unrolled)
        except Exception as exc:  # noqa: BLE001 - never break training: Keras's loop runs
            code[0] = "error"
            stats.errors.append(f"{layer.name}: {type(exc).__name__}: {exc}")
            stats.decline(DECLINE_REASONS["error"])
            warnings.warn(f"tfmx rnn: {layer.name}: {type(exc).__name__}: {exc}; "
                          "Keras's own loop runs", stacklevel=3)
            return Emitted(None, stats, kept=True)
        stats.fuse(chosen.label)
        return Emitted(result, stats)

    def pair(chosen: Form) -> Emitted:
        try:
            states = _state_list(initial_state)
            up_dropout = _dropout_mask(match, sequences) if train else None
            result = rewrite_rnn_pair(below.match, match, below.sequences,
                                      below.initial_state, _own_zeros(states, below.sequences),
                                      up_dropout)
        except Exception as exc:  # noqa: BLE001 - never break training: the layers run
            failed = PatternStats()  # the call is counted once, by the layer's own form
            failed.errors.append(f"{layer.name}: {type(exc).__name__}: {exc}")
            warnings.warn(f"tfmx rnn: {layer.name} with the layer below: "
                          f"{type(exc).__name__}: {exc}; the layers run one by one",
                          stacklevel=3)
            return Emitted(None, failed, kept=True)
        stats = PatternStats(matched=1)
        stats.fuse(chosen.label)
        return Emitted(result, stats)

    below = None if match is None or match.form != "hoisted" else _below(match, sequences,
                                                                         mask, train)
    if below is not None and _pair_chosen(ctx.chooser, below, match, original, form):
        return rewrite_call(ctx, CallSite(
            DECLARED, (KIND_FORMS[(match.kind, WAVEFRONT)],), keras=alone, emit=pair,
            dtype=getattr(sequences, "dtype", None)))
    return alone()


# -- declaration ----------------------------------------------------------------------------------
DECLARED = declare(Family(
    FAMILY,
    "Keras LSTM / GRU -> hoisted input projection + recurrent loop (or unrolled) with custom "
    "gradient (cpu), CudnnRNNV3 (cuda, metal); emitted before differentiation",
    hooks=(Hook.on(MATCHES[0], forward_stage), Hook.on(MATCHES[1], forward_stage)),
    forms=FORMS,
    capability=rnn_kernels,
))
