"""Keras glue for the ``rnn`` family's forward stage (before differentiation).

While a :class:`tfmx.function.FusedFunction` traces its step (and only then), Keras's
``LSTM.inner_loop`` / ``GRU.inner_loop`` go through :func:`fusion.patterns.rnn.forward_stage`,
which emits the target's fused form or runs Keras's own loop and records why. Outside such a
trace (tfmx disabled, stock or XLA models, eager calls) Keras runs untouched.

Example:
    >>> import tfmx
    >>> from tfmx import forward_rnn
    >>> forward_rnn.active_target() is None
    True
    >>> with forward_rnn.tracing(tfmx.state.Options(tfmx.backends.get_backend("cpu"), None, False)):
    ...     forward_rnn.active_target().name
    'cpu'
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_local = threading.local()
_ORIGINAL: dict[type, Any] = {}


def active_target() -> Any:
    """The backend the current trace rewrites for, None outside a tfmx trace."""
    return getattr(_local, "target", None)


def active_tuner() -> Any:
    """The tuner of the current trace (``tfmx.tuner``), None outside one or for a plan."""
    return getattr(_local, "tuner", None)


@contextlib.contextmanager
def tracing(opts: Any) -> Iterator[None]:
    """Route Keras LSTM/GRU layers traced inside this block through the ``rnn`` family."""
    if opts is None or (opts.patterns is not None and "rnn" not in opts.patterns):
        yield
        return
    install()
    from tfmx import state

    previous = active_target(), active_tuner()
    _local.target = opts.backend
    _local.tuner = state.tuner() if opts.backend.available else None
    try:
        yield
    finally:
        _local.target, _local.tuner = previous


def _patched(original: Any) -> Any:
    def inner_loop(self: Any, sequences: Any, initial_state: Any, mask: Any,
                   training: bool = False) -> Any:
        target = active_target()
        if target is None:
            return original(self, sequences, initial_state, mask, training=training)
        from fusion.patterns.rnn import forward_stage

        return forward_stage(self, original, target, sequences, initial_state, mask, training,
                             tuner=active_tuner())

    inner_loop.__wrapped__ = original
    return inner_loop


def install() -> None:
    """Wrap ``LSTM.inner_loop`` and ``GRU.inner_loop`` once (idempotent)."""
    if _ORIGINAL:
        return
    from keras.src.layers.rnn.gru import GRU
    from keras.src.layers.rnn.lstm import LSTM

    for cls in (LSTM, GRU):
        _ORIGINAL[cls] = cls.inner_loop
        cls.inner_loop = _patched(cls.inner_loop)


def uninstall() -> None:
    """Restore Keras's own ``inner_loop`` methods."""
    for cls, fn in _ORIGINAL.items():
        cls.inner_loop = fn
    _ORIGINAL.clear()
