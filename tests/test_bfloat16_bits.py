"""bfloat16 at the edges of XLA regions by integer operations (fusion.bfloat16_bits): outputs
rounded to the same bits as TensorFlow's Cast and XLA's convert, special values included,
inputs widened to the same float32 as theirs (every bfloat16 word); the regions that use it (the
GELU's value and derivative, the 16-bit layer norm's gradient) give the same results either
way; and the choice is the tuner's, measured on the region itself."""

import numpy as np
import pytest
import tensorflow as tf
from helpers import PickForm, needs_onednn

from fusion import bfloat16_bits as bits
from fusion import forms
from fusion.calls import gelu
from fusion.calls import layer_norm as ln
from fusion.pattern import PlainTarget
from fusion.stage import XLA, XLA_CALLS, StageContext, xla_region
from tfmx.tuner import Tuner


def _special_values() -> np.ndarray:
    """Floats whose rounding to bfloat16 is a corner: ties to even both ways, the largest
    finite values (one rounds to infinity), infinities, NaNs of both signs (one with payload
    bits only below the kept 16), zeros, denormals, and a spread of normal values."""
    words = np.array([
        0x3F808000, 0x3F818000,  # ties: down to even, up to even
        0x3F808001, 0x3F807FFF,  # just above and below a tie
        0x7F7FFFFF, 0x7F7F7FFF,  # the largest float (rounds to inf), one that stays finite
        0x7F800000, 0xFF800000,  # +-inf
        0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001,  # NaNs; payload below the kept bits
        0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00400000,  # zeros, denormals
    ], np.uint32).view(np.float32)
    rng = np.random.default_rng(0)
    spread = (rng.standard_normal(4096) * 10.0 ** rng.integers(-30, 30, 4096)).astype("f4")
    return np.concatenate([words, spread])


def _assert_same_bits(got: np.ndarray, want: np.ndarray, x: np.ndarray,
                      nan_sign: bool = True) -> None:
    """bfloat16 words equal, ``x`` the float32 inputs. A denormal input may instead become the
    zero of its sign in ``want``: a conversion instruction that flushes denormals (AVX512_BF16's
    ``VCVTNEPS2BF16`` treats them as zero) may be what XLA or Eigen emit on another CPU. With
    ``nan_sign`` False a NaN need only be a NaN (TensorFlow's own Cast drops a NaN's sign on
    its vectorized path and keeps it on its scalar one)."""
    words = x.view(np.uint32)
    denormal = (words & 0x7F800000 == 0) & (words & 0x7FFFFF != 0)
    flushed = denormal & (want & 0x7FFF == 0) & (got & 0x7FFF != 0)
    assert np.array_equal(want[flushed] & 0x8000, got[flushed] & 0x8000)  # the sign kept
    keep = ~flushed
    if not nan_sign:
        nan = (want & 0x7F80 == 0x7F80) & (want & 0x7F != 0)
        assert np.array_equal(nan, (got & 0x7F80 == 0x7F80) & (got & 0x7F != 0))
        keep &= ~nan
    np.testing.assert_array_equal(got[keep], want[keep])


@pytest.mark.parametrize("compiled", [False, True])
def test_the_bits_are_tensorflows_cast_and_xlas_convert(compiled):
    values = _special_values()
    x = tf.constant(values)
    fn = tf.function(bits.to_bits, jit_compile=True) if compiled else bits.to_bits
    got = bits.from_bits(fn(x)).numpy().view(np.uint16)
    convert = tf.function(lambda v: tf.cast(v, tf.bfloat16), jit_compile=True)
    _assert_same_bits(got, convert(x).numpy().view(np.uint16), values)
    _assert_same_bits(got, tf.cast(x, tf.bfloat16).numpy().view(np.uint16), values,
                      nan_sign=False)


@pytest.mark.parametrize("compiled", [False, True])
def test_widening_gives_the_float_of_every_bfloat16_word(compiled):
    """All 65,536 words, NaNs and denormals included: the float32 TensorFlow's Cast (and
    XLA's convert) gives, word for word; a NaN stays a NaN of its sign (its payload as the
    conversion keeps it, compared where both keep it)."""
    words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    x = tf.bitcast(tf.constant(words), tf.bfloat16)
    widen = tf.function(bits.widen_bits, jit_compile=True) if compiled else bits.widen_bits
    got = widen(x).numpy().view(np.uint32)
    np.testing.assert_array_equal(got, words.astype(np.uint32) << 16)  # the definition
    for cast in (lambda v: tf.cast(v, tf.float32),
                 tf.function(lambda v: tf.cast(v, tf.float32), jit_compile=True)):
        want = cast(x).numpy().view(np.uint32)
        nan = np.isnan(want.view(np.float32))
        assert np.array_equal(nan, np.isnan(got.view(np.float32)))
        assert np.array_equal(want[nan] >> 31, got[nan] >> 31)
        np.testing.assert_array_equal(got[~nan], want[~nan])


def test_a_region_in_integer_form_widens_by_shifts_and_a_plain_one_by_cast():
    """``widened`` inside a region: integer operations where the region rounds by them, a
    ``Cast`` in a plain region and outside any; the same values."""
    x = tf.cast(tf.constant(_special_values()[17:]), tf.bfloat16)

    def region(v):
        return bits.widened(v) * 2.0

    def ops(fn):
        graph = fn.get_concrete_function(x).graph
        return {op.type for op in graph.get_operations()}

    plain, rounded = (tf.function(lambda v, b=b: xla_region(region, bfloat16_bits=b)(v))
                      for b in (False, True))
    inner = [f for f in tf.function(lambda v: xla_region(region, bfloat16_bits=True)(v))
             .get_concrete_function(x).graph._functions.values()]  # noqa: SLF001
    assert any("LeftShift" in {n.op for n in f.definition.node_def} for f in inner)
    assert "LeftShift" not in ops(tf.function(region))
    np.testing.assert_array_equal(plain(x).numpy(), rounded(x).numpy())
    np.testing.assert_array_equal(tf.function(region)(x).numpy(), plain(x).numpy())


def test_a_region_gives_xla_converts_bits_and_reads_back_as_bfloat16():
    """One region, its bfloat16 outputs narrowed by XLA's convert or by integer rounding: the
    same bits; a float32 output passes as it is."""
    def region(x):
        return tf.cast(tf.math.erf(x) * 3.0, tf.bfloat16), x * 2.0, tf.cast(x, tf.bfloat16)

    x = tf.constant(_special_values()[17:])  # the finite spread
    plain = xla_region(region)(x)
    rounded = xla_region(region, bfloat16_bits=True)(x)
    assert [t.dtype for t in rounded] == [tf.bfloat16, tf.float32, tf.bfloat16]
    for got, want in zip(rounded, plain):
        np.testing.assert_array_equal(got.numpy().view(np.uint8), want.numpy().view(np.uint8))


@pytest.mark.parametrize("approximate", [False, True])
def test_the_gelu_region_gives_the_same_bits_and_gradient_either_way(approximate):
    x = tf.cast(tf.constant(np.linspace(-8.0, 8.0, 3001), tf.float32), tf.bfloat16)
    dy = tf.cast(tf.constant(np.cos(np.linspace(0.0, 40.0, 3001)), tf.float32), tf.bfloat16)

    @tf.function(autograph=False)  # as a step traces it
    def value_and_gradient(rounded: bool):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = gelu.gelu_xla_slope(x, approximate, bfloat16_bits=rounded)
        return y, tape.gradient(y, x, output_gradients=dy)

    for got, want in zip(value_and_gradient(True), value_and_gradient(False)):
        assert got.dtype == tf.bfloat16
        np.testing.assert_array_equal(got.numpy().view(np.uint16), want.numpy().view(np.uint16))


@needs_onednn("on")
def test_the_16_bit_layer_norm_gradient_gives_the_same_bits_either_way():
    if not ln.onednn_layer_norm_runs("bfloat16"):
        pytest.skip("oneDNN builds its bfloat16 layer norm on AVX-512 CPUs only")
    rng = np.random.default_rng(4)
    x = tf.cast(rng.standard_normal((6, 5, 16)) * 3.0, tf.bfloat16)
    dy = tf.cast(rng.standard_normal((6, 5, 16)), tf.bfloat16)
    gamma = tf.constant(rng.standard_normal(16), tf.float32)
    beta = tf.constant(rng.standard_normal(16), tf.float32)

    @tf.function(autograph=False)  # as a step traces it
    def gradients(rounded: bool):
        with tf.GradientTape() as tape:
            tape.watch([x, gamma, beta])
            y = ln.layer_norm_onednn_16(x, gamma, beta, 2, 1e-3, xla_gradient=True,
                                        bfloat16_bits=rounded)
        return tape.gradient(y, [x, gamma, beta], output_gradients=dy)

    for got, want in zip(gradients(True), gradients(False)):
        np.testing.assert_array_equal(got.numpy().view(np.uint8), want.numpy().view(np.uint8))


def _scale(x):
    return tf.cast(tf.cast(x, tf.float32) * 1.5, tf.bfloat16), tf.reduce_sum(
        tf.cast(x, tf.float32), 0)


def test_the_tuner_times_the_region_both_ways():
    """A measured decision (either form, on this machine) of the family's own, with both
    forms timed on the region given, outputs of two dtypes; no tuner: integer rounding; tuning
    off: XLA's convert, the conservative form."""
    seen = []
    ctx = StageContext(PlainTarget("cpu"), Tuner("auto", None, on_decision=seen.append))
    chosen = forms.integer_rounding(ctx, "scale", _scale, [[64, 32]])
    (d,) = seen
    assert d.family == bits.FAMILY and d.source == "measured"
    assert d.signature.startswith("scale XLA region input 64x32 bfloat16")
    assert set(d.times_ms) == {bits.CONVERT, bits.INTEGER}
    assert chosen == (d.choice == bits.INTEGER)
    assert forms.integer_rounding(StageContext(PlainTarget("cpu")), "scale", _scale, [[4]])
    assert not forms.integer_rounding(StageContext(PlainTarget("cpu"), Tuner("off")), "scale",
                                     _scale, [[4]])


@pytest.mark.parametrize("form, calls", [(bits.INTEGER, 1), (bits.CONVERT, 0)])
def test_the_gelu_stage_emits_the_form_chosen(form, calls):
    """The GELU stage asks once per call (before its own forms are timed) and emits the region
    with the Bitcast that reads its integer-rounded outputs only where that form was chosen."""
    from fusion import stage as stages

    class Chooser:  # the GELU's XLA region, rounded as ``form``
        def choose(self, family, signature, candidates, conservative):
            pick = {"gelu": XLA, bits.FAMILY: form}[family]
            return PickForm(pick, family, strict=True).choose(family, signature, candidates,
                                                              conservative)

    ctx = StageContext(PlainTarget("cpu"), Chooser(), xla=True)

    @tf.function(autograph=False)
    def step(x):
        with stages.tracing(ctx), tf.GradientTape() as tape:
            tape.watch(x)
            y = gelu.fused_gelu(ctx, lambda v, a: v, x, False)
        return tape.gradient(y, x)

    graph = step.get_concrete_function(tf.TensorSpec([4, 8], tf.bfloat16)).graph
    bitcasts = [op for op in graph.get_operations() if op.type == "Bitcast"]
    assert len(bitcasts) == 2 * calls  # the value and the derivative
    assert [op for op in graph.get_operations() if op.type in XLA_CALLS]
