"""Parity of a training run with fused optimizer updates against stock Keras, to rounding.

Stock and fused runs from identical weights differ only where the fused update kernel rounds
differently from Keras's composite: each step, each state value goes through the roundings of
one update (counted below per optimizer from keras/src/optimizers/*.py), and over the steps
those differences add up (first order: a difference in the weights changes later gradients by
lr times it, which these small learning rates do not amplify). So each tensor must be within
helpers.float_tolerance(float32, steps x roundings per update, its largest stock value). A
constant c the kernel turns into 1 - c itself (in float32) differs from Keras's float32(1 - c)
by a relative error that is added too, in roundings, each step; Adam's 1 - beta_2 (1.3e-5,
docs/families.md) once, since the second moment is an average of g^2: whole for it, half for
the steps that divide by its square root.
"""

from __future__ import annotations

import math

import numpy as np
from helpers import float_tolerance, unit_roundoff

# One update per step, per state value: the float32 operations on the path to it in Keras's
# composite (keras/src/optimizers/*.py update_step; the fused kernel evaluates the same formula,
# at most in another order), and the constants c the kernel turns into 1 - c itself.
UPDATE_ROUNDINGS = {
    "SGD": (2, ()),  # var - lr * g
    "SGD(momentum)": (4, ()),  # m = m * momentum - g * lr (3); var + m
    "SGD(nesterov=True)": (7, ()),  # m as above (3); var + (m * momentum - g * lr) (4)
    # alpha = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t) (7); m += (g - m) * (1 - beta_1) (3);
    # v += (g^2 - v) * (1 - beta_2) (4); var -= m * alpha / (sqrt(v) + epsilon) (5)
    "Adam": (19, (0.9,)),
    "Adam(amsgrad=True)": (19, (0.9,)),  # v_hat = max(v_hat, v): exact
    # m as Adam's (3); u = max(beta_2 * u, |g|) (1); 1 - beta_1^t (2);
    # var -= lr * m / ((1 - beta_1^t) * (u + epsilon)) (5)
    "Adamax": (11, (0.9,)),
    # v = rho * v + (1 - rho) * g^2 (4); lr * g / sqrt(v + epsilon) (4); m = momentum * m + that
    # (2); var - m (1)
    "RMSprop(momentum)": (11, (0.9,)),
    # plus a = rho * a + (1 - rho) * g (3), v - a^2 (2)
    "RMSprop(centered, momentum)": (16, (0.9,)),
    # a = rho * a + (1 - rho) * g^2 (4); d = sqrt(ad + eps) * g / sqrt(a + eps) (6);
    # ad = rho * ad + (1 - rho) * d^2 (4)
    "Adadelta": (14, (0.95,)),
}
# What Keras adds around the kernel (weight decay: two Muls and a Sub; EMA: two Muls and an
# Add; gradient accumulation: an Add and a Div), counted for every case.
AROUND_THE_KERNEL = 3
F32 = np.float32


def _one_minus_error(c: float) -> float:
    """Relative difference between 1 - c as a kernel computes it from float32 c (exact: Sterbenz)
    and Keras's constant float32(1 - c): 2.2e-7 for c = 0.9 or 0.95, 1.3e-5 for 0.999."""
    keras_constant = float(F32(1 - c))
    return abs(float(F32(1) - F32(c)) - keras_constant) / keras_constant


# With no update fused ("" below) the updates are Keras's own, but the step's other families
# (contraction) may run the forward and backward MatMuls as other kernels than Grappler picks
# for stock: with oneDNN on, one run in three showed a 1-ulp difference in a gradient. A Dense
# kernel's gradient is a sum over the batch (8 here) of products: 2 roundings per term a step.
GRADIENT_ROUNDINGS = 2 * 8


def assert_optimizer_parity(names, stock, fused, kind: str, steps: int) -> None:
    """Each state tensor of a run of ``steps`` updates of ``kind`` (a key of UPDATE_ROUNDINGS;
    "": no update fused) within the rounding the module doc derives."""
    roundings, constants = UPDATE_ROUNDINGS[kind] if kind else (0, ())
    per_step = 0 if kind else GRADIENT_ROUNDINGS
    if kind:
        per_step = roundings + AROUND_THE_KERNEL + sum(
            math.ceil(_one_minus_error(c) / unit_roundoff("float32")) for c in constants)
    adam_beta_2 = _one_minus_error(0.999) if kind.startswith("Adam") and kind != "Adamax" else 0.0
    for name, a, b in zip(names, stock, fused):
        scale = float(np.max(np.abs(a))) if np.size(a) else 0.0
        beta_2 = adam_beta_2 if "velocit" in name else adam_beta_2 / 2
        diff = float(np.max(np.abs(np.asarray(b, np.float64) - a))) if np.size(a) else 0.0
        tol = float_tolerance("float32", steps * per_step, scale) + beta_2 * scale
        assert diff <= tol, f"{name}: max diff {diff:.3g}, scale {scale:.3g}, tolerance {tol:.3g}"
