"""How ``tfmx.enable()`` reaches ``model.fit``, ``evaluate`` and ``predict`` of Keras 3.

Keras's TensorFlow trainer builds ``one_step_on_data`` around ``self.train_step`` /
``self.test_step`` in ``_make_function``, and ``predict_step`` in ``make_predict_function``.
The hook wraps the step in a :class:`tfmx.function.FusedFunction`: Keras's own
``tf.function`` then calls the rewritten step, so steps_per_execution loops, distribution,
callbacks and data handling stay Keras's. Each model remembers the tfmx generation its step
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
from tfmx.function import FusedFunction
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


def _make_function(self: Any, step_function: Any) -> Any:
    kind = getattr(step_function, "__name__", "step")
    if _fusable(self, kind):
        step_function = FusedFunction(
            step_function, name=f"{type(self).__name__}.{kind}", autograph=False,
            reduce_retracing=True,
        )
    return _ORIGINAL["_make_function"](self, step_function)


def _make_builder(kind: str, attr: str) -> Any:
    original = _ORIGINAL[f"make_{kind}_function"]

    @functools.wraps(original)
    def make(self: Any, force: bool = False) -> Any:
        if getattr(self, attr) is not None and not force and not _stale(self, kind):
            return getattr(self, attr)
        if kind == "predict":
            _shadow_predict_step(self)
        original(self, force=True)
        setattr(self, attr, _guard(getattr(self, attr)))
        _stamp(self, kind)
        return getattr(self, attr)

    return make


def _shadow_predict_step(model: Any) -> None:
    """Route Keras's predict loop through a FusedFunction of the model's predict_step."""
    model.__dict__.pop("predict_step", None)
    if _fusable(model, "predict_step"):
        fused = FusedFunction(
            model.predict_step, name=f"{type(model).__name__}.predict_step", autograph=False,
            reduce_retracing=True,
        )
        object.__setattr__(model, "predict_step", fused)


def install() -> None:
    """Patch Keras's TensorFlow trainer once (idempotent)."""
    from tfmx import forward

    forward.install()
    if _ORIGINAL:
        return
    trainer = _trainer_class()
    for name in ("_make_function", "make_train_function", "make_test_function",
                 "make_predict_function"):
        _ORIGINAL[name] = getattr(trainer, name)
    trainer._make_function = _make_function
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
