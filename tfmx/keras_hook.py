"""How ``tfmx.enable()`` reaches ``model.fit``, ``evaluate`` and ``predict`` of Keras 3.

Keras's TensorFlow trainer builds ``one_step_on_data`` (``strategy.run`` of
``self.train_step`` / ``self.test_step`` plus the cross-replica reduction) and wraps it in
``tf.function``; predict does the same around ``predict_step``. While Keras builds these, the
hook has its ``tf.function`` return a :class:`tfmx.function.FusedFunction` for exactly those
step functions, so the whole per-batch step, every replica included, is traced, rewritten and
rebuilt, while Keras's own loops (steps_per_execution), distribution, callbacks and data
handling stay Keras's. Each model remembers the tfmx generation its step
functions were built under; after ``enable()``/``disable()`` they are rebuilt on next use, so
models compiled before enable() are covered too.

Example:
    >>> from tfmx import keras_hook
    >>> keras_hook.install()
    >>> keras_hook.installed()
    True
"""

from __future__ import annotations

import functools
from typing import Any

from tfmx import state
from tfmx.dispatch import IteratorDispatch
from tfmx.function import FusedFunction
from tfmx.guard import make_guard
from tfmx.verify import as_verification_error

_STAMP = "_tfmx_stamp"
_ORIGINAL: dict[str, Any] = {}


def _trainer_class() -> type:
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return TensorFlowTrainer


def installed() -> bool:
    return bool(_ORIGINAL)


def _stale(model: Any, kind: str) -> bool:
    return getattr(model, _STAMP, {}).get(kind, 0) != state.generation()


def _stamp(model: Any, kind: str) -> None:
    stamps = dict(getattr(model, _STAMP, {}))
    stamps[kind] = state.generation()
    object.__setattr__(model, _STAMP, stamps)


def _fusable(model: Any, kind: str) -> bool:
    opts = state.options()
    if opts is None or model.run_eagerly:
        return False
    if model.jit_compile:
        state.report().note(f"{type(model).__name__}.{kind}: jit_compile=True, left to XLA")
        return False
    return True


def _guard(fn: Any) -> Any:
    """Turn a failed verify assertion into tfmx.errors.VerificationError."""
    if fn is None or getattr(fn, "_tfmx_guarded", False):
        return fn

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            converted = as_verification_error(exc)
            if converted is exc:
                raise
            raise converted from None

    guarded._tfmx_guarded = True
    return guarded


# Keras's functions that tfmx takes over: the step that runs one batch on every replica
# (``strategy.run`` and the cross-replica reduction inside it), and predict's outer functions.
_STEP_FUNCTIONS = frozenset({"one_step_on_data", "one_step_on_data_distributed",
                             "multi_step_on_data"})
_ITERATOR_LOOP = "multi_step_on_iterator"  # train/test: one call per step with the iterator


class _TfWithFusedFunction:
    """``tensorflow`` as Keras's trainer module sees it while tfmx builds a step function:
    ``tf.function`` of a Keras step returns a FusedFunction, of Keras's per-iterator loop an
    :class:`~tfmx.dispatch.IteratorDispatch`; everything else is TensorFlow's."""

    def __init__(self, tf: Any, name: str) -> None:
        self._tf = tf
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._tf, attr)

    def _make_guard(self, ops: frozenset[str], signature: str) -> Any:
        opts = state.options()
        if opts is None or not opts.guard:
            return None
        made = make_guard(self._name, opts, ops, signature, state.tuning_cache())
        state.report().add_guard(made)
        return made

    def function(self, fn: Any = None, **kwargs: Any) -> Any:
        if getattr(fn, "__name__", "") == _ITERATOR_LOOP and not kwargs.get("jit_compile"):
            state.report().note(
                "Keras's step loop (multi_step_on_iterator) is called through its traced "
                "function: tf.function's per-call lookup runs once per iterator type "
                "(tfmx.dispatch)")
            return IteratorDispatch(self._tf.function(fn, **kwargs),
                                    twin=lambda: self._tf.function(fn, **kwargs),
                                    make_guard=self._make_guard)
        if fn is None or getattr(fn, "__name__", "") not in _STEP_FUNCTIONS:
            return self._tf.function(fn, **kwargs) if fn is not None else self._tf.function(
                **kwargs)
        if kwargs.get("jit_compile"):
            return self._tf.function(fn, **kwargs)
        return FusedFunction(
            fn, name=self._name, autograph=False,
            reduce_retracing=kwargs.get("reduce_retracing", False),
        )


def _trainer_module() -> Any:
    import keras.src.backend.tensorflow.trainer as module

    return module


def _make_builder(kind: str, attr: str) -> Any:
    original = _ORIGINAL[f"make_{kind}_function"]

    @functools.wraps(original)
    def make(self: Any, force: bool = False) -> Any:
        # Keras's make_*_function, also rebuilding when tfmx's generation moved on. Returns what
        # Keras's does: the function when already built (and current), None when it builds.
        if getattr(self, attr) is not None and not force and not _stale(self, kind):
            return getattr(self, attr)
        module = _trainer_module()
        real_tf = module.tf
        if _fusable(self, f"{kind}_step"):
            module.tf = _TfWithFusedFunction(real_tf, f"{type(self).__name__}.{kind}_step")
        try:
            original(self, force=True)
        finally:
            module.tf = real_tf
        setattr(self, attr, _guard(getattr(self, attr)))
        _stamp(self, kind)
        return None

    return make


def install() -> None:
    """Patch Keras's TensorFlow trainer once (idempotent)."""
    from tfmx import forward

    forward.install()
    if _ORIGINAL:
        return
    trainer = _trainer_class()
    for name in ("make_train_function", "make_test_function", "make_predict_function"):
        _ORIGINAL[name] = getattr(trainer, name)
    trainer.make_train_function = _make_builder("train", "train_function")
    trainer.make_test_function = _make_builder("test", "test_function")
    trainer.make_predict_function = _make_builder("predict", "predict_function")


def uninstall() -> None:
    """Restore Keras's own methods (models rebuild their step functions on next use)."""
    from tfmx import forward

    forward.uninstall()
    if not _ORIGINAL:
        return
    trainer = _trainer_class()
    for name, fn in _ORIGINAL.items():
        setattr(trainer, name, fn)
    _ORIGINAL.clear()
