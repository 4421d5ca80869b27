"""One worker of a MultiWorkerMirroredStrategy cluster on loopback (TF_CONFIG set by the caller).

``python multi_worker.py MODE OUT [ARGS]`` writes one JSON file, OUT, at the end (each worker
its own). Run by tests/test_distribute.py, two workers at a time, each a subprocess.

Modes:
- ``train``: from the same initial weights, a custom loop (``strategy.run`` in ``tf.function``)
  stock, the same loop in ``tfmx.function``, stock ``model.fit`` (expected to fail:
  keras-team/keras#20585, its error kept), and ``model.fit`` + ``evaluate`` + ``predict`` under
  tfmx with its rewrites on and with none.
- ``fault``: a long custom loop under tfmx; prints ``step N`` as it goes. The caller kills one
  worker; the other must fail (its error and the seconds it took go to OUT) rather than hang.
- ``checkpoint DIR STEPS FROM``: the custom loop under tfmx for STEPS steps, a
  ``tf.train.CheckpointManager`` checkpoint in DIR after each (the chief's; the other workers
  write to a directory of their own, as TensorFlow's multi-worker guide does), first restoring
  the checkpoint of step FROM (0: none). Without TF_CONFIG: one process, a MirroredStrategy
  over two logical CPUs.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["TFMX_GUARD"] = "0"  # under several workers tfmx turns it off anyway
import tensorflow as tf  # noqa: E402

MODE, OUT = sys.argv[1], sys.argv[2]
COLLECTIVE_TIMEOUT = 15.0  # seconds: a collective that long without its peers fails

if "TF_CONFIG" in os.environ:
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=COLLECTIVE_TIMEOUT))
else:  # one process, two replicas on logical CPUs: what two one-replica workers compute
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

import numpy as np  # noqa: E402
from dist_common import (  # noqa: E402
    BATCH,
    build,
    custom_step,
    data,
    distributed_data,
    graph_ops,
    keras_ops,
    names_of,
    run_custom,
    state_of,
)

import fusion  # noqa: E402
import tfmx  # noqa: E402

# helpers.exact_patterns
PATTERNS = [p for p in fusion.available_patterns() if p not in ("onednn", "bias_row")]
TASK = json.loads(os.environ.get("TF_CONFIG", '{"task": {"index": 0}}'))["task"]["index"]


def _brief(exc: BaseException) -> str:
    """The error's type and message, its middle (a batch's values) left out."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 2000 else f"{text[:300]} [...] {text[-1200:]}"


def fit(patterns: list[str] | None) -> dict:
    """model.fit (with validation data), evaluate and predict; under tfmx when ``patterns``
    is not None. An error is returned, not raised."""
    if patterns is not None:
        tfmx.enable(backend="cpu", patterns=patterns)
    try:
        x, y = data()
        model = build(strategy)
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                            validation_data=(x[:32], y[:32]))
        loss = model.evaluate(x, y, batch_size=BATCH, verbose=0)
        predicted = model.predict(x, batch_size=BATCH, verbose=0)
        return {
            "state": state_of(model),
            "history": {k: [float(a) for a in v] for k, v in history.history.items()},
            "evaluate": float(loss),
            "predict": np.asarray(predicted, np.float64).tolist(),
            "local_predict": np.asarray(model(x, training=False), np.float64).tolist(),
            "ops": {kind: keras_ops(getattr(model, f"{kind}_function"))
                    for kind in ("train", "test", "predict")},
            "report": tfmx.report().to_dict() if patterns is not None else {},
        }
    except Exception as exc:  # noqa: BLE001 - stock Keras's failure is a result here
        return {"error": _brief(exc)}
    finally:
        if patterns is not None:
            tfmx.disable()


def train() -> dict:
    out = {"names": names_of(build(strategy)),
           "custom_stock": run_custom(strategy, tf.function)}
    tfmx.enable(backend="cpu", patterns=PATTERNS)
    out["custom_fused"] = run_custom(strategy, tfmx.function)
    out["custom_report"] = tfmx.report().to_dict()
    tfmx.disable()
    out["fit_stock"] = fit(None)
    out["fit_fused"] = fit(PATTERNS)
    out["fit_no_rewrite"] = fit([])
    return out


def fault() -> dict:
    tfmx.enable(backend="cpu", patterns=PATTERNS)
    model = build(strategy)
    step = custom_step(strategy, model, tfmx.function)
    dist = distributed_data(strategy)
    start = None
    n = 0
    try:
        while True:
            for batch in dist:
                step(batch).numpy()
                n += 1
                if n == 3:
                    start = time.monotonic()  # the caller kills a worker after this line
                print(f"step {n}", flush=True)
    except Exception as exc:  # noqa: BLE001 - what the surviving worker sees
        return {"steps": n, "error": _brief(exc),
                "seconds_after_step_3": time.monotonic() - (start or time.monotonic())}


def checkpoint(directory: str, steps: int, restore_from: int) -> dict:
    """``steps`` steps of the custom loop under tfmx, checkpointed after each; first restored
    from the checkpoint of step ``restore_from`` (0: from scratch)."""
    tfmx.enable(backend="cpu", patterns=PATTERNS)
    model = build(strategy)
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    own = directory if TASK == 0 else tempfile.mkdtemp(prefix=f"worker{TASK}-")
    manager = tf.train.CheckpointManager(ckpt, own, max_to_keep=None)
    if restore_from:
        ckpt.restore(os.path.join(directory, f"ckpt-{restore_from}")).assert_consumed()
    step = custom_step(strategy, model, tfmx.function)
    start = int(model.optimizer.iterations.numpy())
    batches = iter(distributed_data(strategy, repeat=True))
    for _ in range(start):  # the batches the steps before the checkpoint took
        next(batches)
    losses = []
    for _ in range(steps):
        losses.append(float(step(next(batches))))
        manager.save(checkpoint_number=int(model.optimizer.iterations.numpy()))
    report = tfmx.report().to_dict()
    tfmx.disable()
    return {"start": start, "losses": losses, "state": state_of(model),
            "ops": graph_ops(step.concrete_functions()), "report": report}


if MODE == "train":
    result = train()
elif MODE == "fault":
    result = fault()
else:
    result = checkpoint(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
with open(OUT, "w") as f:
    json.dump(result, f)
os._exit(0)  # not TensorFlow's exit: it waits for every worker at a shutdown barrier
