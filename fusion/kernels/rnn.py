"""What the ``rnn`` family emits in place of Keras's generic LSTM/GRU loop.

CPU (``lstm_sequence`` / ``gru_sequence``): the loop's structure, not a kernel name, is what
costs on a CPU (``BlockLSTMV2`` measured ~1.8x slower than Keras's loop). So:

- the input projection of every timestep is hoisted out of the loop: one ``[T*B, I] x [I, G]``
  MatMul (+ BiasAdd) before it;
- the loop keeps only the recurrent MatMul and the gate arithmetic, and saves the gate
  activations it needs for the backward pass (no TensorList accumulators built by autodiff);
- a ``tf.custom_gradient`` gives the backward: one reverse loop with one MatMul per step
  (``dz_t @ R^T``), then the recurrent-kernel gradient as one ``[H, T*B] x [T*B, G]`` MatMul;
  the input-projection gradients (``dX``, ``dKernel``, ``dBias``) are one big MatMul each,
  built by TensorFlow's own gradients of the hoisted projection.

The arithmetic is Keras's, term for term (``keras/src/layers/rnn/{lstm,gru}.py``, gate orders
i,f,c,o and z,r,h), masks keep the state and repeat the last output like ``keras.ops.rnn``.

GPU targets (``cudnn_lstm`` / ``cudnn_gru``): Keras's own cuDNN weight layout (``CudnnRNNV3``,
whose registered gradient is ``CudnnRNNBackpropV3``), which tensorflow-metal implements too;
any mask through :func:`run_keras_semantics`.

What a backend runs for the family (:class:`RnnKernels`, from :func:`rnn_kernels`, the family's
``capability``): the hoisted loop, one ``CudnnRNNV3``, or nothing.

Example:
    >>> import numpy as np, tensorflow as tf
    >>> from fusion.kernels.rnn import lstm_sequence
    >>> x = tf.ones([2, 3, 4]); h0 = c0 = tf.zeros([2, 5])
    >>> k, r, b = tf.fill([4, 20], 0.1), tf.fill([5, 20], 0.1), tf.zeros([20])
    >>> last, seq, (h, c) = lstm_sequence(x, h0, c0, None, k, r, b)
    >>> seq.shape.as_list(), bool(np.allclose(last, h))
    ([2, 1, 5], True)
"""


from __future__ import annotations

import dataclasses

import tensorflow as tf

from fusion.kernels.rnn_cells import (
    LOOPED,
    UNROLLED,
    gru_core_after,
    gru_core_before,
    lstm_core,
)
from fusion.platform import Platform

CHUNKS = 5  # default loops per sequence, so big MatMuls overlap the recurrence (lstm_core)

def _time_major(sequences, mask, go_backwards):
    x = tf.transpose(sequences, [1, 0, 2])
    m = None
    if mask is not None:
        m = tf.transpose(tf.cast(mask, tf.bool))[..., None]  # [T, B, 1]
    if go_backwards:
        x = tf.reverse(x, [0])
        m = None if m is None else tf.reverse(m, [0])
    return x, m


def _chunks(steps: int | None, chunks: int | None = None) -> list[tuple[int | None, int | None]]:
    """Timestep spans, one loop each (``chunks``, default :data:`CHUNKS`, of them when the
    length is static)."""
    chunks = CHUNKS if chunks is None else chunks
    if steps is None or chunks < 2 or steps < 2 * chunks:
        return [(None, None)]
    edges = [round(i * steps / chunks) for i in range(chunks + 1)]
    return list(zip(edges[:-1], edges[1:]))


def project(x, kernel, bias):
    """The hoisted input projection: every timestep in one MatMul (+ BiasAdd)."""
    shape = tf.shape(x)
    xp = tf.matmul(tf.reshape(x, [-1, x.shape[-1]]), kernel)
    if bias is not None:
        xp = tf.nn.bias_add(xp, bias)
    return tf.reshape(xp, [shape[0], shape[1], kernel.shape[-1]])


def _outputs(hs, h_t, m, return_sequences, zero_output_for_mask):
    """Keras's (last_output, outputs) from the states ``hs`` [T, B, H] (None: final only)."""
    if hs is None:  # return_sequences=False: the last output is the final state, or zeros
        if m is not None:
            ran = m[-1] if zero_output_for_mask else tf.reduce_any(m, axis=0)
            h_t = tf.where(ran, h_t, tf.zeros_like(h_t))
        return h_t, h_t[:, None]
    if m is not None:
        if zero_output_for_mask:
            hs = tf.where(m, hs, tf.zeros_like(hs))
        else:  # a masked step repeats the previous output; zeros before the first valid step
            seen = tf.cumsum(tf.cast(m, tf.int32), axis=0) > 0
            hs = tf.where(seen, hs, tf.zeros_like(hs))
    return hs[-1], tf.transpose(hs, [1, 0, 2])


def lstm_sequence(sequences, h0, c0, mask, kernel, recurrent_kernel, bias,
                  go_backwards=False, return_sequences=False, zero_output_for_mask=False,
                  training=True, chunks=None, unrolled=False):
    """Keras ``LSTM.inner_loop`` semantics, hoisted: ``(last_output, outputs, [h, c])``.

    ``training=False`` builds an inference loop (nothing saved for a backward pass).
    ``unrolled``: every timestep its own ops (a static length only), forward and backward.
    """
    x, m = _time_major(sequences, mask, go_backwards)
    spans = _chunks(x.shape[0], chunks)
    xps = [project(x[a:b], kernel, bias) for a, b in spans]
    masks = [None if m is None else m[a:b] for a, b in spans]
    out = lstm_core(xps, h0, c0, recurrent_kernel, masks, return_sequences, training,
                     UNROLLED if unrolled else LOOPED)
    hs, h_t, c_t = out if return_sequences else (None, *out)
    last, outputs = _outputs(hs, h_t, m, return_sequences, zero_output_for_mask)
    if return_sequences:  # the loops' stacks lose the static length; the next layer needs it
        outputs.set_shape(sequences.shape[:2].concatenate(outputs.shape[2:]))
    return last, outputs, [h_t, c_t]


def gru_sequence(sequences, h0, mask, kernel, recurrent_kernel, bias, reset_after=True,
                 go_backwards=False, return_sequences=False, zero_output_for_mask=False,
                 training=True, chunks=None, unrolled=False):
    """Keras ``GRU.inner_loop`` semantics, hoisted: ``(last_output, outputs, [h])``."""
    x, m = _time_major(sequences, mask, go_backwards)
    steps = UNROLLED if unrolled else LOOPED
    if reset_after:
        units = recurrent_kernel.shape[0]
        if bias is None:
            in_bias, rec_bias = None, tf.zeros([3 * units], kernel.dtype)
        else:
            in_bias, rec_bias = bias[0], bias[1]
        spans = _chunks(x.shape[0], chunks)
        out = gru_core_after([project(x[a:b], kernel, in_bias) for a, b in spans], h0,
                              recurrent_kernel, rec_bias,
                              [None if m is None else m[a:b] for a, b in spans],
                              return_sequences, training, steps)
    else:
        out = gru_core_before(project(x, kernel, bias), h0, recurrent_kernel, m,
                               return_sequences, training, steps)
    hs, h_t = out if return_sequences else (None, out)
    last, outputs = _outputs(hs, h_t, m, return_sequences, zero_output_for_mask)
    if return_sequences:  # the loops' stacks lose the static length; the next layer needs it
        outputs.set_shape(sequences.shape[:2].concatenate(outputs.shape[2:]))
    return last, outputs, [h_t]


# -- GPU targets: CudnnRNNV3 ---------------------------------------------------------------------
def _cudnn_params(weights, biases):
    """Keras's ``_standardize_cudnn_weights`` with transposed weights, flat."""
    flat = [tf.reshape(tf.transpose(w), [-1]) for w in weights]
    return tf.concat(flat + [tf.reshape(b, [-1]) for b in biases], axis=0)


def _cudnn_runner(params, mode, init_c):
    """``run(x, h0, lengths) -> (outputs, h, c)``: one CudnnRNNV3 over right-padded rows."""

    def run(x, h0, lengths):
        outputs, h, c, _, _ = tf.raw_ops.CudnnRNNV3(
            input=x, input_h=h0[:, None], input_c=init_c[:, None], params=params,
            is_training=True, rnn_mode=mode, sequence_lengths=lengths, time_major=False)
        return outputs, tf.squeeze(h, axis=1), (tf.squeeze(c, axis=1) if mode == "lstm" else c)

    return run


def run_keras_semantics(run, sequences, h0, c0, mask, go_backwards=False,
                        return_sequences=False, zero_output_for_mask=False):
    """Keras's generic-loop results from a kernel that only takes right-padded sequences.

    ``run(x, h0, lengths)`` (cuDNN) processes each row's first ``lengths`` steps and returns
    (outputs zero past the length, final h, final c). Any mask works: each row's unmasked steps
    are gathered to the front (a stable sort), run, and every output is gathered back from the
    last step that ran at or before it (zeros before the first; with ``zero_output_for_mask``,
    zeros at masked steps), as ``keras.ops.rnn`` does. No ``Cumsum`` (the Metal plugin lists
    none): running counts are a MatMul with a triangular matrix.
    """
    x = tf.reverse(sequences, [1]) if go_backwards else sequences
    batch, steps = tf.shape(x)[0], tf.shape(x)[1]
    if mask is None:
        outputs, h, c = run(x, h0, tf.fill([batch], steps))
        last = h
    else:
        m = tf.cast(mask, tf.bool)
        if go_backwards:
            m = tf.reverse(m, [1])
        order = tf.argsort(tf.cast(tf.logical_not(m), tf.int32), axis=1, stable=True)
        lengths = tf.reduce_sum(tf.cast(m, tf.int32), axis=1)
        # gathers as one-hot BatchMatMuls: exact, and their gradients are BatchMatMuls too
        packed, h, c = run(tf.matmul(tf.one_hot(order, steps, dtype=x.dtype), x), h0,
                           tf.maximum(lengths, 1))
        ran = lengths[:, None] > 0  # an empty row keeps its initial state
        h = tf.where(ran, h, h0)
        c = c if c0 is None else tf.where(ran, c, c0)
        t = tf.range(steps)
        upper = tf.cast(t[:, None] <= t[None, :], packed.dtype)
        count = tf.cast(tf.matmul(tf.cast(m, packed.dtype), upper), tf.int32)  # steps run <= t
        outputs = tf.matmul(tf.one_hot(tf.maximum(count - 1, 0), steps, dtype=x.dtype), packed)
        keep = m if zero_output_for_mask else count > 0
        outputs = tf.where(keep[..., None], outputs, tf.zeros_like(outputs))
        last = outputs[:, -1]
    if not return_sequences:
        outputs = last[:, None]
    return last, outputs, h, c


def cudnn_lstm(sequences, h0, c0, mask, kernel, recurrent_kernel, bias, go_backwards=False,
               return_sequences=False, zero_output_for_mask=False):
    """LSTM as one ``CudnnRNNV3`` (Keras's cuDNN weight layout), Keras's mask semantics."""
    units = recurrent_kernel.shape[0]
    if bias is None:
        bias = tf.zeros([4 * units], kernel.dtype)
    weights = tf.split(kernel, 4, axis=1) + tf.split(recurrent_kernel, 4, axis=1)
    full_bias = tf.concat([tf.zeros_like(bias), bias], axis=0)
    params = _cudnn_params(weights, tf.split(full_bias, 8))
    last, outputs, h, c = run_keras_semantics(
        _cudnn_runner(params, "lstm", c0), sequences, h0, c0, mask, go_backwards,
        return_sequences, zero_output_for_mask)
    return last, outputs, [h, c]


def cudnn_gru(sequences, h0, mask, kernel, recurrent_kernel, bias, swap_zr, go_backwards=False,
              return_sequences=False, zero_output_for_mask=False):
    """GRU(reset_after=True) as one ``CudnnRNNV3``; cuDNN (CUDA) wants r before z."""
    units = recurrent_kernel.shape[0]
    if bias is None:
        bias = tf.zeros([2, 3 * units], kernel.dtype)
    weights = tf.split(kernel, 3, axis=1) + tf.split(recurrent_kernel, 3, axis=1)
    biases = tf.split(tf.reshape(bias, [-1]), 6)
    if swap_zr:
        for seq in (weights, biases):
            seq[0], seq[1], seq[3], seq[4] = seq[1], seq[0], seq[4], seq[3]
    params = _cudnn_params(weights, biases)
    last, outputs, h, _ = run_keras_semantics(
        _cudnn_runner(params, "gru", tf.zeros_like(h0)), sequences, h0, None, mask,
        go_backwards, return_sequences, zero_output_for_mask)
    return last, outputs, [h]


# -- what a backend runs ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RnnKernels:
    """What a backend declares for this family: the form its LSTM / GRU layers take
    ("hoisted": the hoisted loop, any TensorFlow device; "cudnn": one ``CudnnRNNV3``), and
    whether its cuDNN GRU orders the gates r, z, h (CUDA's cuDNN) instead of Keras's z, r, h."""

    form: str
    gru_gates_rzh: bool = False


def rnn_kernels(platform: Platform) -> RnnKernels | None:
    """What ``platform`` runs (the family's ``capability``): the hoisted loop on cpu; one
    ``CudnnRNNV3`` on cuda, and on a Metal plugin with it and its backward (else None).

    >>> rnn_kernels(Platform("cuda")), rnn_kernels(Platform("metal", kernels=frozenset()))
    (RnnKernels(form='cudnn', gru_gates_rzh=True), None)
    """
    if platform.name in ("cpu", "cuda"):
        return RnnKernels("hoisted") if platform.name == "cpu" else RnnKernels("cudnn", True)
    cudnn = platform.runs_op("CudnnRNNV3") and platform.runs_op("CudnnRNNBackpropV3")
    return RnnKernels("cudnn") if cudnn else None
