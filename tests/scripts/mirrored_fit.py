"""Train under a 2-replica MirroredStrategy (two logical CPUs), stock then tfmx; print JSON.

Run by tests/test_optimizer_update.py in a subprocess: logical devices must be configured
before TensorFlow initialises its devices.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TFMX_GUARD", "0")  # tests/conftest.py
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)
import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests/: helpers
from helpers import step_functions  # noqa: E402

import fusion  # noqa: E402
import tfmx  # noqa: E402
from fusion.graph import op_histogram  # noqa: E402
from fusion.pattern import RewriteAlways  # noqa: E402
from tfmx import state  # noqa: E402

# Every update fused whatever the tuner would measure (tests/conftest.py every_rewrite).
state.tuner = RewriteAlways

OPTIMIZER = sys.argv[1] if len(sys.argv) > 1 else "adam"
SAMPLES, BATCH = 80, 16


def train(fused: bool):
    if fused:  # the families that round like stock (tests/helpers.py exact_patterns)
        tfmx.enable(backend="cpu", patterns=[p for p in fusion.available_patterns()
                                             if p not in ("onednn", "bias_row")])
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(4)])
        opt = {"adam": keras.optimizers.Adam(1e-3),
               "momentum": keras.optimizers.SGD(0.05, momentum=0.9)}[OPTIMIZER]
        model.compile(opt, "mse")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    y = rng.normal(size=(SAMPLES, 4)).astype("float32")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    ops = set()
    for cf in step_functions(model.train_function):
        ops |= set(op_histogram(cf.graph.as_graph_def()))
    report = tfmx.report().to_dict() if fused else {}
    tfmx.disable()
    variables = list(model.weights) + list(model.optimizer.variables)
    state = [np.asarray(v.numpy(), np.float64).tolist() for v in variables]
    return [v.path for v in variables], state, sorted(ops), report


names, stock, _, _ = train(False)
_, fused, ops, report = train(True)
print(json.dumps({
    "replicas": 2,
    "steps": SAMPLES // BATCH,
    "names": names, "stock": stock, "fused_state": fused,
    "ops": ops,
    "fused": report.get("patterns", {}).get("optimizer_update", {}).get("fused_kinds", {}),
    "errors": report.get("patterns", {}).get("optimizer_update", {}).get("errors", []),
}))
