"""Two stacked recurrent layers as one unrolled wavefront (cpu): the ``rnn`` family's pair form.

Keras runs ``LSTM(return_sequences=True) -> LSTM`` as two loops one after the other: the upper
layer starts when the lower one has finished all its timesteps, and each loop is a chain of
small dependent MatMuls that keeps the cores of a CPU half idle. Unrolled together, the upper
layer's step ``t`` needs only the lower layer's step ``t``, so the executor runs the lower
layer's step ``t + 1`` beside it: two dependent chains side by side instead of one twice as
long. The backward pass is the same wavefront in reverse (the lower layer's step ``t`` waits for
the upper layer's step ``t`` only), written out as a ``tf.custom_gradient``: per step one MatMul
per layer for the state gradients; the weight gradients after the loop as one big MatMul each.

The arithmetic is Keras's, term for term (:mod:`fusion.kernels.rnn_cells`): the lower
layer's input projection is hoisted (one MatMul over every timestep); the upper layer's input and
recurrent MatMuls are two, the recurrent one free to run while the lower layer computes the
same step (measured 14 % faster on the pair than one MatMul of ``[h_low, h_up]``).

Scope: a static number of timesteps, no mask, neither layer going backwards; input dropout
(one mask for every step, as Keras's cuDNN path) on either layer, no recurrent dropout.

Example:
    >>> import numpy as np, tensorflow as tf
    >>> from fusion.calls.rnn_wavefront import lstm_pair
    >>> x = tf.ones([2, 3, 4]); z5, z6 = tf.zeros([2, 5]), tf.zeros([2, 6])
    >>> low = (tf.fill([4, 20], 0.1), tf.fill([5, 20], 0.1), tf.zeros([20]))
    >>> up = (tf.fill([5, 24], 0.1), tf.fill([6, 24], 0.1), tf.zeros([24]))
    >>> last, seq, (h, c) = lstm_pair(x, (z5, z5), low, (z6, z6), up, return_sequences=True)
    >>> seq.shape.as_list(), bool(np.allclose(last, h))
    ([2, 3, 6], True)
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from fusion.kernels.rnn import project
from fusion.kernels.rnn_cells import (
    flat,
    gru_after_back,
    gru_after_cell,
    lstm_gates,
    lstm_gates_back,
    or_zeros,
)
from fusion.stage import custom_gradient


def _time_major_projection(sequences: tf.Tensor, kernel, bias) -> tf.Tensor:
    """The lower layer's input projection of every timestep, time-major: [T, B, G]."""
    if sequences.shape[1] is None:
        raise ValueError("the wavefront form unrolls the sequence: it needs a static number "
                         "of timesteps (give keras.Input a fixed length)")
    return project(tf.transpose(sequences, [1, 0, 2]), kernel, bias)


def _weight_gradient(inputs: list, d: tf.Tensor) -> tf.Tensor:
    """A kernel's gradient over every step as one MatMul: the steps' inputs ([B, K] each),
    stacked, against the pre-activations' gradients [T * B, G]."""
    return tf.matmul(tf.concat(inputs, axis=0), d, transpose_a=True)


def _dropped(x: tf.Tensor, mask: tf.Tensor | None) -> tf.Tensor:
    """``x`` times the dropout ``mask`` (a constant of the pair: no gradient), or ``x``."""
    return x if mask is None else x * mask


def _keras_outputs(hs: tf.Tensor | None, h_t: tf.Tensor, sequences: tf.Tensor):
    """Keras's ``(last_output, outputs)`` of the upper layer from its states ``hs`` [T, B, H]
    (None: the final state only)."""
    if hs is None:
        return h_t, h_t[:, None]
    outputs = tf.transpose(hs, [1, 0, 2])
    outputs.set_shape(sequences.shape[:2].concatenate(h_t.shape[1:]))
    return h_t, outputs


def lstm_pair(sequences: tf.Tensor, low_states: Sequence[tf.Tensor], low_weights: Sequence,
              up_states: Sequence[tf.Tensor], up_weights: Sequence,
              return_sequences: bool = False, up_dropout: tf.Tensor | None = None):
    """``LSTM(return_sequences=True) -> LSTM`` as one wavefront: the upper layer's Keras
    ``inner_loop`` result ``(last_output, outputs, [h, c])``.

    ``sequences``: the lower layer's input (its dropout already applied); ``*_states``:
    ``(h0, c0)`` of each layer; ``*_weights``: ``(kernel, recurrent_kernel, bias or None)``;
    ``return_sequences``: the upper layer's; ``up_dropout``: the upper layer's input dropout
    mask ([B, H] of the lower layer, one for every step, as Keras's cuDNN path), or None.
    """
    (k1, r1, b1), (k2, r2, b2) = low_weights, up_weights
    units1, units2 = int(r1.shape[0]), int(r2.shape[0])
    xp = _time_major_projection(sequences, k1, b1)
    steps = int(xp.shape[0])
    b2 = tf.zeros([4 * units2], k2.dtype) if b2 is None else b2

    @custom_gradient
    def core(xp, h1, c1, h2, c2, r1, k2, r2, b2):
        xs = tf.unstack(xp, num=steps)
        before1, ins2, before2, saved1, saved2, hs2 = [], [], [], [], [], []
        for t in range(steps):
            before1.append(h1)
            before2.append(h2)
            # the upper layer's recurrent MatMul needs only its own last state: it runs while
            # the lower layer computes this step (one MatMul of both would wait for it)
            recurrent2 = tf.nn.bias_add(tf.matmul(h2, r2), b2)
            (h1, c1), (s1,) = lstm_gates(xs[t] + tf.matmul(h1, r1), c1, True)
            ins2.append(_dropped(h1, up_dropout))
            (h2, c2), (s2,) = lstm_gates(tf.matmul(ins2[-1], k2) + recurrent2, c2, True)
            saved1.append(s1)
            saved2.append(s2)
            hs2.append(h2)
        h_t, c_t = h2, c2

        def grad(*d_out):
            d_hs, d_h, d_c = d_out if return_sequences else (None, *d_out)
            dh2, dc2 = or_zeros(d_h, h_t), or_zeros(d_c, c_t)
            dh1 = dc1 = tf.zeros_like(h1)
            d_seq = None if d_hs is None else tf.unstack(d_hs, num=steps)
            # transpose_b MatMuls are slower here
            r1_t, k2_t, r2_t = tf.transpose(r1), tf.transpose(k2), tf.transpose(r2)
            dz1s, dz2s = [None] * steps, [None] * steps
            for t in reversed(range(steps)):
                if d_seq is not None:
                    dh2 = dh2 + d_seq[t]
                dz2s[t], dc2 = lstm_gates_back(dh2, dc2, saved2[t], units2)
                dh2 = tf.matmul(dz2s[t], r2_t)
                d_low = _dropped(tf.matmul(dz2s[t], k2_t), up_dropout)
                dz1s[t], dc1 = lstm_gates_back(dh1 + d_low, dc1, saved1[t], units1)
                dh1 = tf.matmul(dz1s[t], r1_t)
            dz1, dz2 = tf.stack(dz1s), tf.concat(dz2s, axis=0)
            return (dz1, dh1, dc1, dh2, dc2, _weight_gradient(before1, flat(dz1)),
                    _weight_gradient(ins2, dz2), _weight_gradient(before2, dz2),
                    tf.reduce_sum(dz2, axis=0))

        return ((tf.stack(hs2), h_t, c_t) if return_sequences else (h_t, c_t)), grad

    out = core(xp, *low_states, *up_states, r1, k2, r2, b2)
    hs, h_t, c_t = out if return_sequences else (None, *out)
    last, outputs = _keras_outputs(hs, h_t, sequences)
    return last, outputs, [h_t, c_t]


def _gru_biases(bias, units: int, dtype) -> tuple[tf.Tensor, tf.Tensor]:
    """(input bias, recurrent bias) of a GRU(reset_after=True), zeros without a bias."""
    if bias is None:
        zeros = tf.zeros([3 * units], dtype)
        return zeros, zeros
    return bias[0], bias[1]


def gru_pair(sequences: tf.Tensor, low_state: tf.Tensor, low_weights: Sequence,
             up_state: tf.Tensor, up_weights: Sequence, return_sequences: bool = False,
             up_dropout: tf.Tensor | None = None):
    """``GRU(return_sequences=True) -> GRU`` (both ``reset_after=True``) as one wavefront:
    the upper layer's Keras ``inner_loop`` result ``(last_output, outputs, [h])``.

    ``*_state``: each layer's ``h0``; ``*_weights``: ``(kernel, recurrent_kernel, bias or
    None)``, the bias ``[2, 3H]`` as Keras keeps it; the rest as :func:`lstm_pair`.
    """
    (k1, r1, bias1), (k2, r2, bias2) = low_weights, up_weights
    units1, units2 = int(r1.shape[0]), int(r2.shape[0])
    bin1, brec1 = _gru_biases(bias1, units1, k1.dtype)
    bin2, brec2 = _gru_biases(bias2, units2, k2.dtype)
    xp = _time_major_projection(sequences, k1, bin1)
    steps = int(xp.shape[0])

    @custom_gradient
    def core(xp, h1, h2, r1, brec1, k2, bin2, r2, brec2):
        xs = tf.unstack(xp, num=steps)
        low, up = gru_after_cell(r1, brec1, True), gru_after_cell(r2, brec2, True)
        before1, hs1, before2, saved1, saved2 = [], [], [], [], []
        for t in range(steps):
            before1.append(h1)
            (h1,), (s1,) = low(xs[t], h1)
            hs1.append(_dropped(h1, up_dropout))
            before2.append(h2)
            (h2,), (s2,) = up(tf.nn.bias_add(tf.matmul(hs1[-1], k2), bin2), h2)
            saved1.append(s1)
            saved2.append(s2)
        hs2 = before2[1:] + [h2]
        h_t = h2

        def grad(*d_out):
            d_hs, d_h = d_out if return_sequences else (None, *d_out)
            dh2, dh1 = or_zeros(d_h, h_t), tf.zeros_like(h1)
            d_seq = None if d_hs is None else tf.unstack(d_hs, num=steps)
            r1_t, r2_t, k2_t = tf.transpose(r1), tf.transpose(r2), tf.transpose(k2)
            dx1s, di1s, dx2s, di2s = ([None] * steps for _ in range(4))
            for t in reversed(range(steps)):
                if d_seq is not None:
                    dh2 = dh2 + d_seq[t]
                dh2, di2s[t], dcand2 = gru_after_back(dh2, saved2[t], units2, r2_t)
                dx2s[t] = tf.concat([di2s[t][:, : 2 * units2], dcand2], axis=1)
                d_low = _dropped(tf.matmul(dx2s[t], k2_t), up_dropout)
                dh1, di1s[t], dcand1 = gru_after_back(dh1 + d_low, saved1[t], units1, r1_t)
                dx1s[t] = tf.concat([di1s[t][:, : 2 * units1], dcand1], axis=1)
            di1, dx2, di2 = (tf.concat(d, axis=0) for d in (di1s, dx2s, di2s))
            return (tf.stack(dx1s), dh1, dh2, _weight_gradient(before1, di1),
                    tf.reduce_sum(di1, axis=0), _weight_gradient(hs1, dx2),
                    tf.reduce_sum(dx2, axis=0), _weight_gradient(before2, di2),
                    tf.reduce_sum(di2, axis=0))

        return ((tf.stack(hs2), h_t) if return_sequences else h_t), grad

    out = core(xp, low_state, up_state, r1, brec1, k2, bin2, r2, brec2)
    hs, h_t = out if return_sequences else (None, out)
    last, outputs = _keras_outputs(hs, h_t, sequences)
    return last, outputs, [h_t]
