"""A small model with what tfmx fuses, under a 2-replica MirroredStrategy (two logical CPUs).

Stock, then tfmx, from the same initial weights: ``model.fit`` (with validation data),
``evaluate``, ``predict``, and a custom training loop (``strategy.run`` inside
``tf.function`` for stock, ``tfmx.function`` for tfmx). Prints one JSON line: the variables
after each run, the op types in the graphs that ran, tfmx's report.

Run by tests/test_distribute.py in a subprocess (logical devices must be configured before
TensorFlow initialises its devices). ``python mirrored_model.py [plain|tuned]``: ``plain``
has every match rewritten (tests/conftest.py every_rewrite) and the whole-step guard off;
``tuned`` builds its BatchNormalization with ``synchronized=True`` and lets the tuner measure
(in the caller's TFMX_CACHE_DIR) and the whole-step guard run, as a user's script would, its
trials seeing a fused step made slower (tests/helpers.py slow_trial_forms) so that they decide.
"""

import json
import os
import sys
from pathlib import Path

MODE = sys.argv[1] if len(sys.argv) > 1 else "plain"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["TFMX_GUARD"] = "1" if MODE == "tuned" else "0"  # tests/conftest.py: 0
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)
import numpy as np  # noqa: E402
from dist_common import BATCH, build, data, keras_ops, names_of, run_custom, state_of  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests/: helpers
from helpers import slow_trial_forms  # noqa: E402

import fusion  # noqa: E402
import tfmx  # noqa: E402
from fusion.pattern import RewriteAlways  # noqa: E402
from tfmx import state  # noqa: E402

# helpers.exact_patterns
PATTERNS = [p for p in fusion.available_patterns() if p not in ("onednn", "bias_row")]


def run_keras(strategy, fused: bool) -> dict:
    x, y = data()
    model = build(strategy, synchronized=MODE == "tuned")
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        validation_data=(x[:32], y[:32]))
    loss = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    predicted = model.predict(x, batch_size=BATCH, verbose=0)
    return {
        "names": names_of(model),
        "state": state_of(model),
        "history": {k: [float(a) for a in v] for k, v in history.history.items()},
        "evaluate": float(loss),
        "predict": np.asarray(predicted, np.float64).tolist(),
        "ops": {kind: keras_ops(getattr(model, f"{kind}_function"))
                for kind in ("train", "test", "predict")},
    }


def run(fused: bool) -> dict:
    if fused:
        tfmx.enable(backend="cpu", patterns=PATTERNS)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out = {"fit": run_keras(strategy, fused), "custom": run_custom(
        strategy, tfmx.function if fused else tf.function,
        model=build(strategy, synchronized=MODE == "tuned"))}
    if fused:
        report = tfmx.report()
        out["report"] = report.to_dict()
        out["decision_keys"] = [d.key for d in report.decisions]
        out["report_text"] = str(report)
        tfmx.disable()
    return out


if MODE == "plain":
    state.tuner = RewriteAlways  # every match rewritten (tests/conftest.py every_rewrite)
else:  # the guard's trials see a fused step 50 ms slower: they keep stock after 3 pairs
    slow_trial_forms(setattr, fused=0.05)
print(json.dumps({"stock": run(False), "fused": run(True)}))
