"""A small model with what tfmx fuses, under a 2-replica MirroredStrategy (two logical CPUs).

Stock, then tfmx, from the same initial weights: ``model.fit`` (with validation data),
``evaluate``, ``predict``, and a custom training loop (``strategy.run`` inside
``tf.function`` for stock, ``tfmx.function`` for tfmx). Prints one JSON line: the variables
after each run, the op types in the graphs that ran, tfmx's report.

Run by tests/test_distribute.py in a subprocess (logical devices must be configured before
TensorFlow initialises its devices). ``python mirrored_model.py [plain|tuned]``: ``plain``
has every match rewritten (tests/conftest.py every_rewrite) and the whole-step guard off;
``tuned`` builds its BatchNormalization with ``synchronized=True`` and lets the tuner measure
(in the caller's TFMX_CACHE_DIR) and the whole-step guard run, as a user's script would.
"""

import json
import os
import sys

MODE = sys.argv[1] if len(sys.argv) > 1 else "plain"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["TFMX_GUARD"] = "1" if MODE == "tuned" else "0"  # tests/conftest.py: 0
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)
import keras  # noqa: E402
import numpy as np  # noqa: E402

import fusion  # noqa: E402
import tfmx  # noqa: E402
from fusion.pattern import RewriteAlways  # noqa: E402
from tfmx import state  # noqa: E402

SAMPLES, BATCH, HW, CLASSES = 64, 16, 8, 3
PATTERNS = [p for p in fusion.available_patterns() if p != "onednn"]  # helpers.exact_patterns


def graph_ops(functions) -> list[str]:
    """Op types of these ConcreteFunctions and their function libraries."""
    ops: set[str] = set()
    for cf in functions:
        g = cf.graph.as_graph_def()
        ops.update(n.op for n in g.node)
        for f in g.library.function:
            ops.update(n.op for n in f.node_def)
    return sorted(ops)


def keras_ops(fn) -> list[str]:
    """Op types of what a Keras step function (train/test/predict_function) traced."""
    fn = getattr(fn, "__wrapped__", fn)
    found = []
    for cell in [fn] + [c.cell_contents for c in getattr(fn, "__closure__", None) or ()]:
        cell = getattr(cell, "_function", cell)  # tfmx.dispatch.IteratorDispatch
        if hasattr(cell, "_list_all_concrete_functions"):
            found.extend(cell._list_all_concrete_functions())
    return graph_ops(found)


def build(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((HW, HW, 3)),
            keras.layers.Conv2D(4, 3, padding="same", use_bias=False),
            keras.layers.BatchNormalization(synchronized=MODE == "tuned"),
            keras.layers.ReLU(),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(CLASSES),
        ])
        model.compile(keras.optimizers.Adam(1e-2),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(SAMPLES, HW, HW, 3)).astype("float32")
    y = rng.integers(0, CLASSES, SAMPLES).astype("int32")
    return x, y


def state_of(model) -> list:
    variables = list(model.weights) + list(model.optimizer.variables)
    return [np.asarray(v.numpy(), np.float64).tolist() for v in variables]


def run_keras(strategy, fused: bool) -> dict:
    x, y = data()
    model = build(strategy)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        validation_data=(x[:32], y[:32]))
    loss = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    predicted = model.predict(x, batch_size=BATCH, verbose=0)
    return {
        "names": [v.path for v in list(model.weights) + list(model.optimizer.variables)],
        "state": state_of(model),
        "history": {k: [float(a) for a in v] for k, v in history.history.items()},
        "evaluate": float(loss),
        "predict": np.asarray(predicted, np.float64).tolist(),
        "ops": {kind: keras_ops(getattr(model, f"{kind}_function"))
                for kind in ("train", "test", "predict")},
    }


def run_custom(strategy, fused: bool) -> dict:
    x, y = data()
    model = build(strategy)
    optimizer = model.optimizer
    with strategy.scope():  # its slots made here, not in the first traced step
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="sum_over_batch_size")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    dist = strategy.experimental_distribute_dataset(dataset)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            per_replica = loss_fn(yb, model(xb, training=True))
            loss = per_replica / strategy.num_replicas_in_sync
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def step(batch):
        losses = strategy.run(replica_step, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    wrapped = (tfmx.function if fused else tf.function)(step)
    losses = []
    for _ in range(2):
        for batch in dist:
            losses.append(float(wrapped(batch)))
    functions = (wrapped.concrete_functions() if fused
                 else wrapped._list_all_concrete_functions())
    return {"state": state_of(model), "losses": losses, "ops": graph_ops(functions)}


def run(fused: bool) -> dict:
    if fused:
        tfmx.enable(backend="cpu", patterns=PATTERNS)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out = {"fit": run_keras(strategy, fused), "custom": run_custom(strategy, fused)}
    if fused:
        report = tfmx.report()
        out["report"] = report.to_dict()
        out["decision_keys"] = [d.key for d in report.decisions]
        out["report_text"] = str(report)
        tfmx.disable()
    return out


if MODE == "plain":
    state.tuner = RewriteAlways  # every match rewritten (tests/conftest.py every_rewrite)
print(json.dumps({"stock": run(False), "fused": run(True)}))
