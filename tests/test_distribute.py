"""tfmx under tf.distribute (issue 16): MirroredStrategy on two logical CPUs.

Each case runs a script of tests/scripts/ in a subprocess, bounded by :data:`TIMEOUT`: logical
devices must be configured before TensorFlow initialises its devices.

Parity, stock vs tfmx from the same initial weights. The runs differ only where tfmx computes
something in another rounding order; per training step and per value these are (float32):

- LayerNormalization over 16 features (fusion.stages.layer_norm, FusedBatchNormV3 or the
  closed-form gradient): forward, two 16-term reductions (mean, variance) and 5 elementwise
  ops; backward, two 16-term reductions for the input gradient, one 8-term reduction (a
  replica's rows) for gamma's and beta's, and 5 elementwise ops: 82.
- Adam's fused update (``ResourceApplyAdam``) against Keras's composite: tests/parity.py's 19,
  3 around the kernel and 1 - beta_1 as the kernel computes it (4), plus 1 - beta_2's constant
  error once on the second moments.
- The Dense chains (``_FusedMatMul``) run the same kernels as stock; the cross-replica
  all-reduce is the same op in both.

A difference in a weight changes the next steps' gradients by about lr times it, which this
learning rate does not amplify, so the bound is steps x (82 + 26) roundings of each tensor's
largest stock magnitude. Inference (evaluate, predict) adds one forward pass of the folded
Conv2D+BatchNorm (27 terms and the scale's product) and the LayerNormalization (37).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_within_rounding, float_tolerance
from parity import _one_minus_error

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
TIMEOUT = 240  # seconds, per subprocess

LAYER_NORM_ROUNDINGS = (2 * 16 + 5) + (2 * 16 + 8 + 5)
ADAM_ROUNDINGS = 19 + 3 + 4
PER_STEP = LAYER_NORM_ROUNDINGS + ADAM_ROUNDINGS
FORWARD = (27 + 1) + (2 * 16 + 5)


def run_script(name: str, *args: str, env: dict | None = None,
               timeout: float = TIMEOUT) -> dict:
    """Run tests/scripts/``name`` with ``args``; its last stdout line, parsed as JSON."""
    done = subprocess.run([sys.executable, str(SCRIPTS / name), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_states_within_rounding(names: list[str], stock: list, fused: list,
                                  steps: int) -> None:
    """Every variable and optimizer slot within ``steps`` x :data:`PER_STEP` roundings of its
    largest stock magnitude (second moments: plus 1 - beta_2's constant error)."""
    beta_2 = _one_minus_error(0.999)
    for name, a, b in zip(names, stock, fused):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if not a.size:
            continue
        scale = float(np.max(np.abs(a)))
        extra = beta_2 * scale if "velocity" in name else 0.0
        diff = float(np.max(np.abs(a - b)))
        tol = float_tolerance("float32", steps * PER_STEP, scale) + extra
        assert diff <= tol, f"{name}: max diff {diff:.3g} > tolerance {tol:.3g}"


def _check_mirrored(result: dict) -> None:
    stock, fused = result["stock"], result["fused"]
    names, steps = stock["fit"]["names"], 2 * 4  # 2 epochs of 64 samples, batches of 16
    for part in ("fit", "custom"):
        assert_states_within_rounding(names, stock[part]["state"], fused[part]["state"], steps)
    terms = steps * PER_STEP
    for key in ("loss", "val_loss"):
        assert_within_rounding(fused["fit"]["history"][key], stock["fit"]["history"][key],
                               terms, what=key)
    assert_within_rounding(fused["custom"]["losses"], stock["custom"]["losses"], terms,
                           what="custom loop losses")
    assert_within_rounding(fused["fit"]["evaluate"], stock["fit"]["evaluate"], terms + FORWARD,
                           what="evaluate")
    assert_within_rounding(fused["fit"]["predict"], stock["fit"]["predict"], terms + FORWARD,
                           what="predict")
    # the cross-replica reduction is the strategy's own, in what ran stock and fused
    for ops in (stock["fit"]["ops"]["train"], fused["fit"]["ops"]["train"],
                stock["custom"]["ops"], fused["custom"]["ops"]):
        assert "CollectiveReduceV2" in ops
    # each decision measured once, not once per replica
    keys = fused["decision_keys"]
    assert len(keys) == len(set(keys)), keys


def test_mirrored_two_replicas_fit_evaluate_predict_and_custom_loop_match_stock():
    result = run_script("mirrored_model.py", "plain")
    _check_mirrored(result)
    fused, report = result["fused"], result["fused"]["report"]
    for ran in (fused["fit"]["ops"]["train"], fused["custom"]["ops"]):
        # Dense+bias+relu, LayerNormalization (stage, in each replica's thread), Adam
        assert {"_FusedMatMul", "FusedBatchNormV3", "ResourceApplyAdam"} <= set(ran)
    assert "_FusedConv2D" in fused["fit"]["ops"]["test"]  # Conv2D+BatchNorm folded
    assert "_FusedConv2D" in fused["fit"]["ops"]["predict"]
    patterns = report["patterns"]
    assert patterns["layer_norm"]["fused"] == 8  # 2 replicas x (fit, custom loop) x 2 traces
    # training batch norm stays Keras's composite, per replica, and the report says why
    assert any("inside a tf.distribute strategy" in why
               for why in patterns["batch_norm"]["declined"])
    assert patterns["optimizer_update"]["fused"] == patterns["optimizer_update"]["matched"]


def test_mirrored_synchronized_batch_norm_is_declined_and_tuner_measures_once(tmp_path):
    env = dict(__import__("os").environ, TFMX_CACHE_DIR=str(tmp_path))  # measured afresh
    result = run_script("mirrored_model.py", "tuned", env=env)
    _check_mirrored(result)
    report = result["fused"]["report"]
    assert any("synchronized=True" in why
               for why in report["patterns"]["batch_norm"]["declined"])
    decisions = report["decisions"]
    assert decisions and all(d["source"] == "measured" for d in decisions), decisions
    # the custom loop's eager calls under the strategy get the whole-step guard's trial
    assert any(g["function"] == "step" for g in report["guards"]), report["guards"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
