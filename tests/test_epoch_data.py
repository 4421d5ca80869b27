"""tfmx.epoch_data: the tf.data iterators Keras's epoch iterators drop, deleted off the fit's
thread, the fit's batches and steps unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest

import tfmx
from tfmx import epoch_data
from tfmx.epoch_data import ReleasedDataset, Releaser


class _Slow:
    """Deleting it takes ``seconds`` (as deleting a tf.data iterator can) and says where."""

    def __init__(self, seen: list[str], seconds: float = 0.3) -> None:
        self.seen, self.seconds = seen, seconds

    def __del__(self) -> None:
        time.sleep(self.seconds)
        self.seen.append(threading.current_thread().name)


def test_an_object_is_dropped_on_the_releasers_thread_once_nobody_else_holds_it():
    seen: list[str] = []
    releaser = Releaser(poll_s=0.01)
    kept, dropped = _Slow(seen), _Slow(seen)
    releaser.hold(kept)
    releaser.hold(dropped)
    start = time.perf_counter()
    del dropped
    assert time.perf_counter() - start < 0.1  # the caller never waits for the deletion
    assert releaser.drain(timeout=5.0)
    assert seen == ["tfmx-release"] and releaser.released == 1 and releaser.pending() == 1
    assert releaser.seconds >= 0.3 and releaser.longest >= 0.3
    del kept  # still held by the releaser: deleted there too
    assert releaser.drain(timeout=5.0) and seen == ["tfmx-release"] * 2
    releaser.close()
    late = _Slow(seen, 0.0)
    releaser.hold(late)  # closed: held no more, deleted where its last reference goes
    assert releaser.pending() == 0


def test_the_dataset_is_keras_own_but_for_its_iterators():
    releaser = Releaser(poll_s=0.01)
    data = ReleasedDataset([1, 2, 3], releaser)
    assert list(data) == [1, 2, 3] and data.count(2) == 1  # the list's own attributes
    assert releaser.drain(timeout=5.0) and releaser.released == 1


def _model() -> keras.Model:
    keras.utils.set_random_seed(7)
    inp = keras.Input((6,))
    out = keras.layers.Dense(3, activation="softmax")(keras.layers.Dense(8, "relu")(inp))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    return model


def _fit(monkeypatch: pytest.MonkeyPatch, release: str) -> list[np.ndarray]:
    monkeypatch.setenv(epoch_data.ENV_RELEASE, release)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((96, 6)).astype("float32"), rng.integers(0, 3, 96)
    tfmx.enable(backend="cpu", guard=False)
    try:
        model = _model()
        model.fit(x, y, batch_size=16, epochs=3, validation_data=(x[:32], y[:32]), verbose=0)
    finally:
        tfmx.disable()
    return [w.numpy() for w in model.weights]


def test_a_fit_deletes_the_iterators_keras_drops_off_its_thread_and_trains_the_same(
        monkeypatch):
    before = epoch_data._RELEASER.released
    kept = _fit(monkeypatch, "0")
    assert epoch_data._RELEASER.drain(timeout=30.0)
    assert epoch_data._RELEASER.released == before  # switched off: Keras deletes them
    tfmx.report(reset=True)
    released = _fit(monkeypatch, "1")
    assert epoch_data._RELEASER.drain(timeout=30.0)
    # three epochs of training (one at each epoch's end, one more at the next's start) and
    # of validation data
    assert epoch_data._RELEASER.released - before >= 6
    for a, b in zip(kept, released):
        np.testing.assert_array_equal(a, b)  # the same batches in the same order
    notes = [n for n in tfmx.report().notes if n.startswith(epoch_data.NOTE)]
    assert len(notes) == 1 and "deleted on a thread of their own" in notes[0], notes


EXIT_SCRIPT = """
import threading, time
import tensorflow as tf
from tfmx.epoch_data import _RELEASER as releaser

deleting = threading.Event()

class Slow:
    def __del__(self):
        deleting.set()
        time.sleep(0.5)
        print("deleted on", threading.current_thread().name, flush=True)

data = tf.data.Dataset.range(10**6).map(lambda v: v * 2, num_parallel_calls=tf.data.AUTOTUNE)
kept = iter(data.prefetch(tf.data.AUTOTUNE))
next(kept)
for held in (kept, Slow()):
    releaser.hold(held)
del held
assert deleting.wait(60)  # the releaser's thread is deleting the Slow
print("exiting", flush=True)
"""


def test_the_interpreters_exit_waits_for_the_deletion_under_way_and_deletes_no_more(tmp_path):
    """A process that exits while the releaser deletes an object ends normally once that
    deletion is done (a daemon thread cut inside TensorFlow's runtime by the exit aborts the
    process); an iterator the releaser still holds at exit is not deleted through it."""
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["exiting", "deleted on tfmx-release"], proc.stdout


def test_closing_keeps_what_is_still_held_from_being_deleted():
    seen: list[str] = []
    releaser = Releaser(poll_s=0.01)
    kept = _Slow(seen, 0.0)
    releaser.hold(kept)
    releaser.close()
    assert releaser.pending() == 0
    del kept  # its last reference but the one close() keeps
    assert seen == []


def test_a_distribution_strategys_dataset_keeps_keras_deletions():
    import tensorflow as tf

    data = tf.data.Dataset.range(4).batch(2)
    distributed = tf.distribute.OneDeviceStrategy("/cpu:0").experimental_distribute_dataset(data)
    assert epoch_data.released(distributed) is distributed
    assert isinstance(epoch_data.released(data), ReleasedDataset)
