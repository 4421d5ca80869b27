"""Keras's epoch data: the ``tf.data`` iterators a fit drops, released off the fit's thread.

Keras's ``EpochIterator`` makes a new ``tf.data`` iterator at each epoch's end and, where the
fit gives no ``steps_per_epoch``, another at the next epoch's start, dropping the first unused
(``evaluate`` on validation data the same, every epoch). Dropping the last reference to an
iterator deletes it there and then, on the fit's thread, and deleting an iterator stops its
pipeline's threads, ``tf.data``'s autotuning thread among them: measured on a 2-core CPU with
TensorFlow 2.21, one deletion in a few blocks the caller for 1.3-2.5 s (with autotuning off,
none does), and in a fit of random in-memory data such a stall came at most epoch starts.
With tfmx enabled, the datasets Keras's epoch iterators read (``TFEpochIterator``, patched by
``tfmx.keras_hook`` through ``tfmx.step_loop``) hand each iterator they make to a
:class:`Releaser` as well: once nothing else holds it, the releaser's thread drops it, and the
deletion, however long it takes, runs there while the fit goes on. The batches, their order
and every step are Keras's; only where an exhausted iterator is deleted changes. A distribution
strategy's datasets (``tf.distribute.DistributedDataset``) keep Keras's deletions: deleting
their iterators off the fit's thread was measured to take up to tens of seconds, and it once
never returned. The interpreter's exit waits for a deletion under way (at most
:data:`EXIT_WAIT_S`) and deletes none of the iterators still held (see
:meth:`Releaser.close`).

``TFMX_ITERATOR_RELEASE=0`` leaves the deletions where Keras makes them. The report's note
``epoch data: ...`` counts the iterators released and the seconds their deletions took (time
the fit did not wait for).

Example:
    >>> import threading, time
    >>> from tfmx.epoch_data import Releaser
    >>> class Slow:
    ...     def __del__(self):
    ...         time.sleep(0.2)
    ...         seen.append(threading.current_thread().name)
    >>> seen, releaser = [], Releaser()
    >>> thing = Slow()
    >>> releaser.hold(thing)
    >>> start = time.perf_counter(); del thing; dropped_in = time.perf_counter() - start
    >>> releaser.drain(timeout=5.0)
    True
    >>> dropped_in < 0.1, seen, releaser.released
    (True, ['tfmx-release'], 1)
"""

from __future__ import annotations

import atexit
import ctypes
import sys
import threading
import time
from typing import Any

from tfmx.env import enabled_by_env

ENV_RELEASE = "TFMX_ITERATOR_RELEASE"
POLL_S = 0.05
"""How often the releaser looks for iterators nothing else holds any more."""

NOTE = "epoch data: "

EXIT_WAIT_S = 60.0
"""How long the interpreter's exit waits for the deletion under way (one waits for its
pipeline's threads to stop: up to a few seconds)."""


class Releaser:
    """Holds objects and drops each on a thread of its own once nobody else holds it."""

    def __init__(self, poll_s: float = POLL_S) -> None:
        self.poll_s = poll_s
        self.released = 0  # objects dropped on the releaser's thread
        self.seconds = 0.0  # what dropping them took there
        self.longest = 0.0
        self.errors = 0
        self._held: list[Any] = []
        self._dropping = False
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False

    def hold(self, obj: Any) -> None:
        """Keep ``obj`` until every other reference to it is gone, then drop it on the
        releaser's thread."""
        with self._lock:
            if self._closed:
                return
            self._held.append(obj)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tfmx-release",
                                                daemon=True)
                self._thread.start()

    def pending(self) -> int:
        """Objects held and not dropped yet (some still held elsewhere too)."""
        with self._lock:
            return len(self._held)

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every held object nobody else holds was dropped; False on ``timeout``."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if not self._dropping and not any(
                        _only_ours(self._held, i) for i in range(len(self._held))):
                    return True
            time.sleep(self.poll_s / 2)
        return False

    def close(self, timeout: float = EXIT_WAIT_S) -> None:
        """Stop (at interpreter exit): the deletion under way finishes (waited for at most
        ``timeout`` seconds: a daemon thread cut inside TensorFlow's runtime by the exit aborts
        the process), and nothing the releaser still holds is deleted through it afterwards.
        Deleting a ``tf.data`` iterator while the interpreter shuts down was seen never to
        return; the process's end frees their memory all the same."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            self._wake.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        with self._lock:
            kept, self._held = self._held, []
        for obj in kept:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))  # never freed through us

    def _run(self) -> None:
        idle_since = time.monotonic()
        while True:
            with self._lock:
                if self._closed:
                    return
                free = [i for i in range(len(self._held)) if _only_ours(self._held, i)]
                if not free:
                    if not self._held and time.monotonic() - idle_since > 20 * self.poll_s:
                        self._thread = None  # idle: the next hold starts another
                        return
                    self._wake.wait(self.poll_s)
                    continue
                dropped = [self._held[i] for i in free]
                for i in reversed(free):
                    del self._held[i]
                self._dropping = True
            start = time.perf_counter()
            try:
                dropped.clear()  # the last references: their deletions run here
            except Exception:  # noqa: BLE001 - a deletion that fails is TensorFlow's to log
                self.errors += 1
            took = time.perf_counter() - start
            with self._lock:
                self._dropping = False
                self.released += len(free)
                self.seconds += took
                self.longest = max(self.longest, took)
            idle_since = time.monotonic()


def _only_ours(held: list[Any], index: int) -> bool:
    # the list's reference and getrefcount's argument
    return sys.getrefcount(held[index]) <= 2


_RELEASER = Releaser()
atexit.register(_RELEASER.close)


class ReleasedDataset:
    """Keras's dataset (what ``TFEpochIterator._get_iterator`` returns) whose iterators the
    releaser holds too; everything else is the dataset's own."""

    def __init__(self, dataset: Any, releaser: Releaser | None = None) -> None:
        self._tfmx_dataset = dataset
        self._tfmx_releaser = releaser or _RELEASER

    def __iter__(self) -> Any:
        iterator = iter(self._tfmx_dataset)
        try:
            self._tfmx_releaser.hold(iterator)
        except Exception:  # noqa: BLE001 - Keras's iterator runs on, deleted where dropped
            pass
        return iterator

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tfmx_dataset, name)


def released(dataset: Any) -> Any:
    """``dataset``, its iterators released off the fit's thread (unless
    ``TFMX_ITERATOR_RELEASE=0``).

    >>> list(released([1, 2, 3]))
    [1, 2, 3]
    """
    try:
        on = enabled_by_env(ENV_RELEASE)
    except ValueError:  # a switch it cannot read leaves Keras's deletions as they are
        on = False
    return ReleasedDataset(dataset) if on and not _distributed(dataset) else dataset


def _distributed(dataset: Any) -> bool:
    """Whether ``dataset`` is a distribution strategy's: its iterators are left to Keras (one
    deleted off the fit's thread waited for its devices' pipelines for many seconds, measured,
    and at times never returned)."""
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(dataset, tf.distribute.DistributedDataset)


def note(report: Any, releaser: Releaser | None = None, refresh: bool = False) -> None:
    """Say in ``report`` (a ``tfmx.reporting.Report``) what the releaser did so far: at a
    fit's end (its iterators may still be held, their deletions under way), or with
    ``refresh`` where ``report`` already says it (its figures brought up to date)."""
    releaser = releaser or _RELEASER
    if report is None:
        return
    said = [n for n in report.notes if n.startswith(NOTE)]
    held = releaser.pending()
    if (refresh and not said) or not (releaser.released or held):
        return
    report.notes[:] = [n for n in report.notes if not n.startswith(NOTE)]
    more = f", {held} more held to be deleted there" if held else ""
    report.note(f"{NOTE}{releaser.released} tf.data iterator(s) Keras dropped were deleted on "
                f"a thread of their own{more}, {releaser.seconds:.2f} s the fit did not wait "
                f"for (the longest {releaser.longest:.2f} s; {ENV_RELEASE}=0 deletes them where "
                "Keras drops them)")


__all__ = ["ENV_RELEASE", "NOTE", "POLL_S", "ReleasedDataset", "Releaser", "note", "released"]
