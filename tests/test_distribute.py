"""tfmx under tf.distribute: MirroredStrategy on two logical CPUs, and
MultiWorkerMirroredStrategy with two worker processes on loopback.

Each case runs scripts of tests/scripts/ in subprocesses, each bounded by :data:`TIMEOUT` and
killed in ``finally``: logical devices must be configured before TensorFlow initialises its
devices, and each worker of a cluster is a process (``TF_CONFIG`` names its task).

Parity, stock vs tfmx from the same initial weights. The runs differ only where tfmx computes
something in another rounding order; per training step and per value these are (float32):

- LayerNormalization over 16 features (fusion.calls.layer_norm, FusedBatchNormV3 or the
  closed-form gradient): forward, two 16-term reductions (mean, variance) and 5 elementwise
  ops; backward, two 16-term reductions for the input gradient, one 8-term reduction (a
  replica's rows) for gamma's and beta's, and 5 elementwise ops: 82.
- BatchNormalization in training (``FusedBatchNormV3`` emitted in each replica's graph, the
  moving statistics assigned through the layer's variables as Keras does): forward, two
  reductions over a replica's rows of each channel (:data:`BN_ROWS`) and 5 elementwise ops;
  backward, the same for the input's, gamma's and beta's gradients.
- Adam's fused update (``ResourceApplyAdam``) against Keras's composite: tests/parity.py's 19,
  3 around the kernel and 1 - beta_1 as the kernel computes it (4), plus 1 - beta_2's constant
  error once on the second moments.
- The Dense chains (``_FusedMatMul``) run the same kernels as stock; the cross-replica
  all-reduce is the same op in both.

A difference in a weight changes the next steps' gradients by about lr times it, which this
learning rate does not amplify, so the bound is steps x (82 + 2058 + 26) roundings of each tensor's
largest stock magnitude. Inference (evaluate, predict) adds one forward pass of the folded
Conv2D+BatchNorm (27 terms and the scale's product) and the LayerNormalization (37).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_within_rounding, float_tolerance
from parity import _one_minus_error

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
TIMEOUT = 240  # seconds, per subprocess
BOUND = 60  # seconds: a worker whose peer died must have failed by then

LAYER_NORM_ROUNDINGS = (2 * 16 + 5) + (2 * 16 + 8 + 5)
BN_ROWS = 8 * 8 * 8  # a replica's (a worker's) half batch x 8 x 8 pixels, per channel
BATCH_NORM_ROUNDINGS = 2 * (2 * BN_ROWS + 5)
ADAM_ROUNDINGS = 19 + 3 + 4
PER_STEP = LAYER_NORM_ROUNDINGS + BATCH_NORM_ROUNDINGS + ADAM_ROUNDINGS
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
    # training batch norm: FusedBatchNormV3 in each replica's graph (2 replicas x (fit,
    # custom loop)), nothing declined but the ReLU after it (no _FusedBatchNormEx on CPU)
    assert patterns["batch_norm"]["fused"] == 4
    assert all(why.startswith("FusedBatchNormV3+Relu: cpu: no _FusedBatchNormEx")
               for why in patterns["batch_norm"]["declined"]), patterns["batch_norm"]["declined"]
    assert patterns["optimizer_update"]["fused"] == patterns["optimizer_update"]["matched"]


def test_mirrored_synchronized_batch_norm_is_declined_and_tuner_measures_once(tmp_path):
    # measured afresh, every decision: a budget no slower processor runs out of (a short one
    # can leave a decision to its conservative form on a loaded machine)
    # and the whole-step guard's trials run to their end (no budget: the fits are short)
    # (and no share of the planned fit: these fits are a few steps)
    env = dict(os.environ, TFMX_CACHE_DIR=str(tmp_path), TFMX_TUNE_BUDGET="300",
               TFMX_TUNE_SHARE="none", TFMX_GUARD_BUDGET="none")
    result = run_script("mirrored_model.py", "tuned", env=env)
    _check_mirrored(result)
    report = result["fused"]["report"]
    assert any("synchronized=True" in why
               for why in report["patterns"]["batch_norm"]["declined"])
    decisions = report["decisions"]
    assert decisions and all(d["source"] == "measured" for d in decisions), decisions
    # the whole-step guard's trial for fit's and evaluate's steps (Keras's loop called with a
    # distributed iterator) and for the custom loop's eager calls, all replicas in one process
    kept = {g["function"]: g["kept"] for g in report["guards"]}
    # (the script makes the fused step 50 ms slower in the trials: stock is kept)
    assert kept["Sequential.train_step"] == kept["step"] == "stock", kept
    assert "Sequential.test_step" in kept
    # XLA's form is not tried in a step of two replicas (it fails on the other replica's
    # variables, after Keras's loop took a batch: evaluate would miss that batch)
    reasons = {g["function"]: g["reason"] for g in report["guards"]}
    assert "runs in 2 replicas" in reasons["Sequential.test_step"], reasons


# -- MultiWorkerMirroredStrategy: two workers, each a process, on loopback --------------------


def free_ports(count: int) -> list[int]:
    """``count`` loopback ports free now (bound together, so distinct, then released)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


@contextlib.contextmanager
def workers(tmp_path: Path, *args: str, count: int = 2) -> Iterator[list[subprocess.Popen]]:
    """Start ``count`` workers of tests/scripts/multi_worker.py (``args``; worker i writes
    its result to tmp_path/worker{i}.json, its output to worker{i}.out and .err), each with
    its TF_CONFIG on loopback; killed on the way out."""
    ports = free_ports(count)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    procs = []
    try:
        for index in range(count):
            env = dict(os.environ, TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": index}}))
            with open(tmp_path / f"worker{index}.out", "w") as out, \
                    open(tmp_path / f"worker{index}.err", "w") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, str(SCRIPTS / "multi_worker.py"), args[0],
                     str(tmp_path / f"worker{index}.json"), *args[1:]],
                    cwd=ROOT, env=env, stdout=out, stderr=err))
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _stderr(tmp_path: Path, index: int) -> str:
    return (tmp_path / f"worker{index}.err").read_text()[-4000:]


def run_workers(tmp_path: Path, *args: str, count: int = 2) -> list[dict]:
    """Run a cluster to the end (bounded by :data:`TIMEOUT`); each worker's result."""
    deadline = time.monotonic() + TIMEOUT
    with workers(tmp_path, *args, count=count) as procs:
        for index, proc in enumerate(procs):
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                pytest.fail(f"worker {index} still running after {TIMEOUT} s")
            assert proc.returncode == 0, _stderr(tmp_path, index)
    return [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in range(count)]


def test_multi_worker_custom_loop_and_fit_under_tfmx_match_stock(tmp_path):
    results = run_workers(tmp_path, "train")
    steps = 2 * 4
    for result in results:
        names, reference = result["names"], result["custom_stock"]["state"]
        # the custom loop, stock (tf.function) and in tfmx.function
        assert_states_within_rounding(names, reference, result["custom_fused"]["state"], steps)
        assert_within_rounding(result["custom_fused"]["losses"],
                               result["custom_stock"]["losses"], steps * PER_STEP)
        assert "_FusedMatMul" in result["custom_fused"]["ops"]
        assert "CollectiveReduceV2" in result["custom_fused"]["ops"]
        # stock model.fit fails across workers (keras-team/keras#20585)...
        error = result["fit_stock"].get("error", "")
        assert "PerReplica" in error and "unsupported type" in error, error[:500]
        # ... and works under tfmx, rewrites on or none: the custom loop's computation
        for kind in ("fit_fused", "fit_no_rewrite"):
            fit = result[kind]
            assert "error" not in fit, fit.get("error")
            assert_states_within_rounding(names, reference, fit["state"], steps)
            assert "CollectiveReduceV2" in fit["ops"]["train"]
            assert "CollectiveGatherV2" in fit["ops"]["predict"]  # predict gathers the workers'
        fused = result["fit_fused"]
        assert "_FusedMatMul" in fused["ops"]["train"]
        assert "_FusedConv2D" in fused["ops"]["test"] and "_FusedConv2D" in fused["ops"]["predict"]
        assert_within_rounding(fused["predict"], result["fit_no_rewrite"]["predict"],
                               steps * PER_STEP + FORWARD, what="predict")
        assert_within_rounding(fused["evaluate"], result["fit_no_rewrite"]["evaluate"],
                               steps * PER_STEP + FORWARD, what="evaluate")
        # no timing picks a form across workers: every decision the form stock TensorFlow
        # runs (each family names its own: "composite", "keras", "BiasAddGrad", ...), once each
        decisions = fused["report"]["decisions"]
        assert decisions and all(d["source"].startswith("conservative (several workers")
                                 and not d["times_ms"] for d in decisions), decisions
        keys = [(d["family"], d["signature"]) for d in decisions]
        assert len(keys) == len(set(keys))
    # the workers hold the same trained weights (BatchNormalization's moving statistics are
    # each worker's own, from its own batches, in stock Keras too)
    for a, b, name in zip(results[0]["fit_fused"]["state"], results[1]["fit_fused"]["state"],
                          results[0]["names"]):
        if "moving_" not in name:
            assert np.array_equal(a, b), name


def test_multi_worker_killed_worker_makes_the_other_fail_with_a_clear_error(tmp_path):
    with workers(tmp_path, "fault") as procs:
        survivor, victim = procs
        deadline = time.monotonic() + TIMEOUT
        while "step 5\n" not in (tmp_path / "worker0.out").read_text():  # the cluster trains
            assert survivor.poll() is None and victim.poll() is None, _stderr(tmp_path, 0)
            assert time.monotonic() < deadline, "the cluster did not train"
            time.sleep(0.1)
        victim.kill()
        killed = time.monotonic()
        try:
            survivor.wait(timeout=BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the surviving worker still runs {BOUND} s after its peer was killed")
        elapsed = time.monotonic() - killed
    result = json.loads((tmp_path / "worker0.json").read_text())
    error = result["error"]
    assert elapsed < BOUND and result["steps"] >= 5
    # the dead peer named: "task:1" stopped sending heartbeats (the coordination service), its
    # connection was reset, or the collective timed out (CommunicationOptions' timeout)
    assert error.startswith(("UnavailableError", "DeadlineExceededError", "AbortedError"))
    assert "task:1" in error and "Collective ops is aborted" in error, error


def test_multi_worker_checkpoint_restores_and_continues_the_loss_curve(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    full = run_workers(tmp_path / "a", "checkpoint", str(ckpt), "8", "0")  # steps 1-8
    resumed = run_workers(tmp_path / "b", "checkpoint", str(ckpt), "4", "4")  # 5-8, restarted
    for before, after in zip(full, resumed):
        assert after["start"] == 4
        # the same graphs from the same state on the same batches: the same numbers
        assert after["losses"] == before["losses"][4:], (before["losses"], after["losses"])
        assert "_FusedMatMul" in after["ops"]
    assert full[0]["losses"][-1] < full[0]["losses"][0]  # it trains
    # one process with two replicas (MirroredStrategy, no TF_CONFIG) restores the two
    # workers' checkpoint and goes on: each replica's batch norm sees the half batch a worker
    # saw, so the numbers are the same but for the all-reduce's rounding
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "multi_worker.py"), "checkpoint",
         str(tmp_path / "one.json"), str(ckpt), "4", "4"],
        cwd=ROOT, env={**{k: v for k, v in os.environ.items() if k != "TF_CONFIG"},
                       "TFMX_TUNE": "off"},  # the stock forms, as the two workers ran
        capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    one = json.loads((tmp_path / "one.json").read_text())
    assert one["start"] == 4
    assert_within_rounding(one["losses"], full[0]["losses"][4:], 4 * PER_STEP,
                           what="losses of one process after restore")


def test_multi_worker_fit_patches_come_and_go_with_tfmx_and_leave_one_process_alone():
    import tensorflow as tf

    import tfmx
    from fusion import private_api
    from tfmx import state

    trainer = private_api.get("keras.trainer_module")
    keras_trainer = private_api.get("keras.trainer")
    original = (trainer.reduce_per_replica, keras_trainer._maybe_symbolic_build)
    tfmx.enable(backend="cpu")
    try:
        assert trainer.reduce_per_replica is not original[0]
        assert keras_trainer._maybe_symbolic_build is not original[1]
        assert not state.multi_worker()
        # one process: Keras's own reduction (the mean of the replicas' values)
        values = {"loss": tf.constant(2.0)}
        out = trainer.reduce_per_replica(values, tf.distribute.get_strategy(), "auto")
        assert float(out["loss"]) == 2.0
    finally:
        tfmx.disable()
    assert (trainer.reduce_per_replica, keras_trainer._maybe_symbolic_build) == original
