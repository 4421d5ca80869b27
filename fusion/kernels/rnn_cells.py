"""The recurrent cells of the ``rnn`` family's CPU forms: Keras's LSTM and GRU arithmetic, term for
term, as a loop (or an unrolled chain) that saves what its closed-form backward reads.

:mod:`fusion.kernels.rnn` builds whole sequences from these; ``fusion.calls.rnn_wavefront``
runs two layers' cells as one wavefront.

Example:
    >>> import tensorflow as tf
    >>> from fusion.kernels.rnn_cells import lstm_gates
    >>> z = tf.zeros([1, 8]); c = tf.zeros([1, 2])
    >>> (h, c_new), (saved,) = lstm_gates(z, c, saving=True)
    >>> h.shape.as_list(), c_new.shape.as_list(), saved.shape.as_list()
    ([1, 2], [1, 2], [1, 12])
"""
from __future__ import annotations

import tensorflow as tf

from fusion.forms import custom_gradient

PARALLEL_ITERATIONS = 32  # as keras.ops.rnn


# -- helpers ---------------------------------------------------------------------------------
class _Listed:
    """A TensorArray's read/write/stack over a Python list: the unrolled recurrence's arrays."""

    def __init__(self, items: list) -> None:
        self.items = items

    def read(self, i: int) -> tf.Tensor:
        return self.items[i]

    def write(self, i: int, value: tf.Tensor) -> _Listed:
        self.items[i] = value
        return self

    def stack(self) -> tf.Tensor:
        return tf.stack(self.items)


class Steps:
    """How a recurrence runs its timesteps: one ``While`` loop (any length) or unrolled.

    Unrolled (a static length only), every timestep is its own ops in the graph: no loop frame,
    no TensorArrays, and the executor may run one step's off-path work (a saved factor, a
    gradient's write) beside the next step's MatMul.
    """

    def __init__(self, unrolled: bool = False) -> None:
        self.unrolled = unrolled

    def count(self, x: tf.Tensor):
        if not self.unrolled:
            return tf.shape(x)[0]
        if x.shape[0] is None:
            raise ValueError("an unrolled recurrence needs a static number of timesteps; "
                             "run it as a loop (unrolled=False)")
        return int(x.shape[0])

    def array(self, dtype: tf.DType, n):
        return _Listed([None] * n) if self.unrolled else tf.TensorArray(dtype, size=n)

    def seq(self, x: tf.Tensor):
        if self.unrolled:
            return _Listed(tf.unstack(x, num=self.count(x)))
        return tf.TensorArray(x.dtype, size=tf.shape(x)[0]).unstack(x)

    def loop(self, n, body, loop_vars: tuple) -> tuple:
        if not self.unrolled:
            return tf.while_loop(
                lambda t, *_: t < n, body, (tf.constant(0),) + tuple(loop_vars),
                maximum_iterations=n, parallel_iterations=PARALLEL_ITERATIONS,
            )[1:]
        carry = (0, *loop_vars)
        for _ in range(n):
            carry = body(*carry)
        return tuple(carry[1:])


LOOPED = Steps(False)
UNROLLED = Steps(True)


def or_zeros(grad: tf.Tensor | None, like: tf.Tensor) -> tf.Tensor:
    return tf.zeros_like(like) if grad is None else grad


def _shifted(first: tf.Tensor, seq: tf.Tensor) -> tf.Tensor:
    """``[first, seq[0], ..., seq[T-2]]``: the state before each step."""
    return tf.concat([first[None], seq[:-1]], axis=0)


def flat(x: tf.Tensor) -> tf.Tensor:
    return tf.reshape(x, [-1, tf.shape(x)[-1]])


def _sig_grad(a: tf.Tensor) -> tf.Tensor:
    return a * (1.0 - a)


def _forward(xp, states, mask, cell, keep_states, saved, steps=LOOPED):
    """The forward loop over ``xp`` [T, B, G].

    ``cell(x_t, *states) -> (new_states, saved_tensors)`` is one step. Masked steps keep the
    old states. Returns the final states, the stacked first state of every step when
    ``keep_states`` (else None), and ``saved`` TensorArrays of the cell's saved tensors (what
    the backward pass reads, computed in the forward loop where it is off the recurrence's
    critical path; ``saved=0`` for inference).
    """
    n = steps.count(xp)
    xs = steps.seq(xp)
    ms = None if mask is None else steps.seq(mask)
    k = len(states)

    def step(t, *carry):
        old, arrays = carry[:k], list(carry[k:])
        new, keep = cell(xs.read(t), *old)
        if ms is not None:
            m = ms.read(t)
            new = [tf.where(m, a, b) for a, b in zip(new, old)]
        if keep_states:
            arrays[0] = arrays[0].write(t, new[0])
        for j, tensor in enumerate(keep[:saved]):
            arrays[keep_states + j] = arrays[keep_states + j].write(t, tensor)
        return (t + 1, *new, *arrays)

    arrays = [steps.array(xp.dtype, n) for _ in range(int(keep_states) + saved)]
    out = steps.loop(n, step, (*states, *arrays))
    final, arrays = list(out[:k]), list(out[k:])
    hs = arrays.pop(0).stack() if keep_states else None
    return n, final, hs, arrays


def _backward_reads(d_hs, mask, dtype, steps):
    """What a reverse loop reads per step: the outputs' gradients (None when only the final
    state has one) and the float masks (None without a mask)."""
    dseq = None if d_hs is None else steps.seq(d_hs)
    return dseq, None if mask is None else steps.seq(tf.cast(mask, dtype))


def _plus_output_grad(dh, dseq, s):
    """The state's gradient at step ``s`` plus that step's output gradient, if any."""
    return dh if dseq is None else dh + dseq.read(s)


# The backward loops carry only what the recurrence needs (the state gradients) and read the
# factors the forward loop saved; weight gradients are single big MatMuls after the loop. With
# ``sequence=False`` the core returns only the final states and the backward loop reads no
# per-step output gradient. Without ``training`` no custom gradient and nothing is saved: the
# loop stays differentiable by TensorFlow's own While gradient.


# -- LSTM ------------------------------------------------------------------------------------
def lstm_gates(z, c, saving):
    """One LSTM step from its pre-activations ``z`` [B, 4H] (gates i, f, c, o) and the cell
    state ``c``: ``([h, c_new], saved)``, ``saved`` what :func:`lstm_gates_back` reads."""
    zi, zf, zg, zo = tf.split(z, 4, axis=1)
    i, f, g, o = tf.sigmoid(zi), tf.sigmoid(zf), tf.tanh(zg), tf.sigmoid(zo)
    c_new = f * c + i * g
    tc = tf.tanh(c_new)
    if not saving:
        return [o * tc, c_new], ()
    # dc_new = dc + dh * p1; dz = [dc_new, dc_new, dc_new, dh] * fac
    p1 = o * (1.0 - tc * tc)
    fac = tf.concat([g * _sig_grad(i), c * _sig_grad(f), i * (1.0 - g * g),
                     tc * _sig_grad(o)], axis=1)
    return [o * tc, c_new], (tf.concat([p1, f, fac], axis=1),)


def lstm_gates_back(dh, dc, saved, units):
    """The backward of :func:`lstm_gates`: ``(dz, dc_prev)`` from the gradients of its new
    ``h`` and ``c`` and what it saved."""
    p1, f, fac = tf.split(saved, [units, units, 4 * units], axis=1)
    dcn = dc + dh * p1
    return tf.concat([dcn, dcn, dcn, dh], axis=1) * fac, dcn * f


def _lstm_cell(rk, saving):
    def cell(x_t, h, c):
        return lstm_gates(x_t + tf.matmul(h, rk), c, saving)

    return cell


def lstm_core(xps, h0, c0, rk, masks, sequence=True, training=True, steps=LOOPED):
    """Recurrence over the chunks ``xps`` ([T_j, B, 4H] each, input projection + bias added).

    Returns ``(hs, h_T, c_T)`` (``hs`` the states, [T, B, H]), or ``(h_T, c_T)``. Each chunk of
    timesteps is its own loop, so the big MatMuls of one chunk (its input projection before,
    its weight gradients after) can run beside the next chunk's recurrence.
    """
    k = len(xps)
    if not training:
        h, c, hs = h0, c0, []
        for j in range(k):
            _, (h, c), hs_j, _ = _forward(xps[j], (h, c), masks[j], _lstm_cell(rk, False),
                                          sequence, 0, steps)
            hs.append(hs_j)
        return (tf.concat(hs, 0), h, c) if sequence else (h, c)

    @custom_gradient
    def core(*args):
        xps, (h0, c0, rk) = args[:k], args[k:]
        h, c, chunks = h0, c0, []
        for j in range(k):
            n, (h, c), hs_j, (rec,) = _forward(xps[j], (h, c), masks[j], _lstm_cell(rk, True),
                                               True, 1, steps)
            chunks.append((n, hs_j, rec))
        h_t, c_t = h, c
        hs = tf.concat([hs_j for _, hs_j, _ in chunks], 0)
        units = tf.shape(h0)[-1]

        def grad(*d_out):
            d_hs, d_ht, d_ct = d_out if sequence else (None, *d_out)
            dh, dc = or_zeros(d_ht, h_t), or_zeros(d_ct, c_t)
            d_seqs = [None] * k if d_hs is None else tf.split(
                d_hs, [tf.shape(x)[0] for x in xps], axis=0)
            rk_t = tf.transpose(rk)  # MatMul with transpose_b is ~1.6x slower here
            dxps, drks = [None] * k, []
            for j in reversed(range(k)):
                n, hs_j, rec = chunks[j]
                h_first = h0 if j == 0 else chunks[j - 1][1][-1]
                dh, dc, dxps[j] = _lstm_backward(n, rec, d_seqs[j], masks[j], xps[j].dtype,
                                                 units, rk_t, dh, dc, steps)
                drks.append(tf.matmul(flat(_shifted(h_first, hs_j)), flat(dxps[j]),
                                      transpose_a=True))
            return (*dxps, dh, dc, tf.add_n(drks))

        return ((hs, h_t, c_t) if sequence else (h_t, c_t)), grad

    return core(*xps, h0, c0, rk)


def _lstm_backward(n, rec, d_hs, mask, dtype, units, rk_t, d_ht, d_ct, steps):
    """The reverse loop over one chunk: (dh, dc) before it and d(projection) of its steps."""
    dseq, mf = _backward_reads(d_hs, mask, dtype, steps)

    def back(t, dh, dc, dzs):
        s = n - 1 - t
        dh = _plus_output_grad(dh, dseq, s)
        dhn, dcn = dh, dc
        if mf is not None:
            m = mf.read(s)
            dhn, dcn = dh * m, dc * m
        dz, dc_prev = lstm_gates_back(dhn, dcn, rec.read(s), units)
        dh_prev = tf.matmul(dz, rk_t)
        if mf is not None:
            dh_prev, dc_prev = dh_prev + dh * (1.0 - m), dc_prev + dc * (1.0 - m)
        return t + 1, dh_prev, dc_prev, dzs.write(s, dz)

    dh0, dc0, dzs = steps.loop(n, back, (d_ht, d_ct, steps.array(dtype, n)))
    return dh0, dc0, dzs.stack()


# -- GRU -------------------------------------------------------------------------------------
def gru_after_cell(rk, brec, saving):
    def cell(x_t, h):
        inner = tf.matmul(h, rk) + brec
        x_z, x_r, x_h = tf.split(x_t, 3, axis=1)
        r_z, r_r, r_h = tf.split(inner, 3, axis=1)
        z = tf.sigmoid(x_z + r_z)
        r = tf.sigmoid(x_r + r_r)
        hh = tf.tanh(x_h + r * r_h)
        h_new = z * h + (1 - z) * hh
        if not saving:
            return [h_new], ()
        # d(pre-tanh) = dh * pz; d(inner) = [dh, dh, dh] * [qz, qr, pz * r]
        pz = (1 - z) * (1.0 - hh * hh)
        rec = tf.concat([(h - hh) * _sig_grad(z), pz * r_h * _sig_grad(r), pz * r, z, pz], 1)
        return [h_new], (rec,)

    return cell


def gru_core_after(xps, h0, rk, brec, masks, sequence=True, training=True, steps=LOOPED):
    """GRU(reset_after=True) recurrence over the chunks ``xps`` (x @ kernel + input bias,
    [T_j, B, 3H] each), one loop per chunk as :func:`lstm_core`."""
    k = len(xps)
    if not training:
        h, hs = h0, []
        for j in range(k):
            _, (h,), hs_j, _ = _forward(xps[j], (h,), masks[j],
                                        gru_after_cell(rk, brec, False), sequence, 0, steps)
            hs.append(hs_j)
        return (tf.concat(hs, 0), h) if sequence else h

    @custom_gradient
    def core(*args):
        xps, (h0, rk, brec) = args[:k], args[k:]
        h, chunks = h0, []
        for j in range(k):
            n, (h,), hs_j, (rec,) = _forward(xps[j], (h,), masks[j],
                                             gru_after_cell(rk, brec, True), True, 1, steps)
            chunks.append((n, hs_j, rec))
        h_t = h
        hs = tf.concat([hs_j for _, hs_j, _ in chunks], 0)
        units = tf.shape(h0)[-1]

        def grad(*d_out):
            d_hs, d_ht = d_out if sequence else (None, *d_out)
            dh = or_zeros(d_ht, h_t)
            d_seqs = [None] * k if d_hs is None else tf.split(
                d_hs, [tf.shape(x)[0] for x in xps], axis=0)
            rk_t = tf.transpose(rk)
            dxps, drks, dbrecs = [None] * k, [], []
            for j in reversed(range(k)):
                n, hs_j, rec = chunks[j]
                h_first = h0 if j == 0 else chunks[j - 1][1][-1]
                dh, dxps[j], dinner = _gru_after_backward(n, rec, d_seqs[j], masks[j],
                                                          xps[j].dtype, units, rk_t, dh, steps)
                drks.append(tf.matmul(flat(_shifted(h_first, hs_j)), dinner,
                                      transpose_a=True))
                dbrecs.append(tf.reduce_sum(dinner, axis=0))
            return (*dxps, dh, tf.add_n(drks), tf.add_n(dbrecs))

        return ((hs, h_t) if sequence else h_t), grad

    return core(*xps, h0, rk, brec)


def gru_after_back(dh, saved, units, rk_t):
    """The backward of one GRU(reset_after=True) step (:func:`gru_after_cell`) from the
    gradient of its new ``h``: ``(dh_prev, d_inner, d_candidate)``; the gradient of its input
    projection is ``[d_inner[:, :2H], d_candidate]``."""
    fac, z, pz = tf.split(saved, [3 * units, units, units], axis=1)
    dinner = tf.tile(dh, [1, 3]) * fac
    return dh * z + tf.matmul(dinner, rk_t), dinner, dh * pz


def _gru_after_backward(n, rec, d_hs, mask, dtype, units, rk_t, d_ht, steps):
    """The reverse loop over one chunk: dh before it, d(projection) of its steps and
    d(recurrent pre-activations) flattened to [T_j * B, 3H]."""
    dseq, mf = _backward_reads(d_hs, mask, dtype, steps)

    def back(t, dh, dis, dahs):
        s = n - 1 - t
        dh = _plus_output_grad(dh, dseq, s)
        dhn = dh if mf is None else dh * mf.read(s)
        dh_prev, dinner, dah = gru_after_back(dhn, rec.read(s), units, rk_t)
        if mf is not None:
            dh_prev = dh_prev + (dh - dhn)
        return t + 1, dh_prev, dis.write(s, dinner), dahs.write(s, dah)

    dh0, dis, dahs = steps.loop(n, back, (d_ht, steps.array(dtype, n), steps.array(dtype, n)))
    dinner = dis.stack()
    dxp = tf.concat([dinner[..., : 2 * units], dahs.stack()], axis=2)
    return dh0, dxp, flat(dinner)


def _gru_before_cell(rk_zr, rk_h, saving):
    def cell(x_t, h):
        inner = tf.matmul(h, rk_zr)
        x_z, x_r, x_h = tf.split(x_t, 3, axis=1)
        r_z, r_r = tf.split(inner, 2, axis=1)
        z = tf.sigmoid(x_z + r_z)
        r = tf.sigmoid(x_r + r_r)
        rh = r * h
        hh = tf.tanh(x_h + tf.matmul(rh, rk_h))
        h_new = z * h + (1 - z) * hh
        if not saving:
            return [h_new], ()
        # d(pre-tanh) = dh * pz; d[z, r pre-activations] = [dh * qz, d(r*h) * qr]
        pz = (1 - z) * (1.0 - hh * hh)
        rec = tf.concat([pz, (h - hh) * _sig_grad(z), h * _sig_grad(r), z, r], axis=1)
        return [h_new], (rec, rh)

    return cell


def gru_core_before(xp, h0, rk, mask, sequence=True, training=True, steps=LOOPED):
    """GRU(reset_after=False) recurrence: the reset gate scales h before its MatMul."""
    units = rk.shape[0]
    if not training:
        cell = _gru_before_cell(rk[:, : 2 * units], rk[:, 2 * units:], False)
        _, (h_t,), hs, _ = _forward(xp, (h0,), mask, cell, sequence, 0, steps)
        return (hs, h_t) if sequence else h_t

    @custom_gradient
    def core(xp, h0, rk):
        rk_zr, rk_h = rk[:, : 2 * units], rk[:, 2 * units:]
        n, (h_t,), hs, (rec, rhs) = _forward(xp, (h0,), mask,
                                             _gru_before_cell(rk_zr, rk_h, True), True, 2, steps)

        def grad(*d_out):
            d_hs, d_ht = d_out if sequence else (None, *d_out)
            d_ht = or_zeros(d_ht, h_t)
            dseq, mf = _backward_reads(d_hs, mask, xp.dtype, steps)
            rk_h_t, rk_zr_t = tf.transpose(rk_h), tf.transpose(rk_zr)

            def back(t, dh, dxs):
                s = n - 1 - t
                dh = _plus_output_grad(dh, dseq, s)
                pz, qz, qr, z, r = tf.split(rec.read(s), 5, axis=1)
                dhn = dh if mf is None else dh * mf.read(s)
                dah = dhn * pz
                d_rh = tf.matmul(dah, rk_h_t)
                dzr = tf.concat([dhn * qz, d_rh * qr], axis=1)
                dh_prev = dhn * z + d_rh * r + tf.matmul(dzr, rk_zr_t)
                if mf is not None:
                    dh_prev = dh_prev + (dh - dhn)
                return t + 1, dh_prev, dxs.write(s, tf.concat([dzr, dah], axis=1))

            dh0, dxs = steps.loop(n, back, (d_ht, steps.array(xp.dtype, n)))
            dxp = dxs.stack()
            d_zr, d_h = flat(dxp[..., : 2 * units]), flat(dxp[..., 2 * units:])
            drk = tf.concat([tf.matmul(flat(_shifted(h0, hs)), d_zr, transpose_a=True),
                             tf.matmul(flat(rhs.stack()), d_h, transpose_a=True)], axis=1)
            return dxp, dh0, drk

        return ((hs, h_t) if sequence else h_t), grad

    return core(xp, h0, rk)


# -- the Keras-shaped wrappers -----------------------------------------------------------------
