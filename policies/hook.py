"""The compile hook: safe defaults and warnings reach ``model.compile`` of every Keras model.

Installed by ``set_global`` / ``scope`` / ``apply`` (idempotent; a model built in a ``scope``
is compiled after it), removed by ``policies.reset``. Before Keras's own compile it
(1) warns about layers built before the last ``set_global`` that keep the old policy, (2) under
"auto" with a 16-bit choice, tunes the model per layer (:func:`policies.tune`), (3) puts the
output layer, softmax and non-upcasting normalization in float32 and (4) wraps the optimizer in a
dynamic ``LossScaleOptimizer`` when some layer computes in float16 and the optimizer has none
(Keras does it only when the whole model is "mixed_float16"). ``compile(auto_scale_loss=False)``
still turns (4) off. Nothing here can make compile fail except a layer that breaks under its
policy (a :class:`~policies.errors.LayerDtypeError` naming it).

Example:
    >>> from policies import hook
    >>> hook.install()
    >>> hook.installed()
    True
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from typing import Any

from fusion import patches
from policies import safety
from policies.errors import LayerDtypeError, PolicyWarning
from policies.layer_tuning import tune
from policies.state import current, settings, stale_layers

_COMPILED: weakref.WeakSet = weakref.WeakSet()  # models compiled while the hook was on


def installed() -> bool:
    """True while the hook's patches of Keras are in place (see the module's example)."""
    return bool(patches.installed(GROUP))


def forget_compiled_models() -> None:
    """Forget the models seen so far (``policies.reset``).

    >>> forget_compiled_models()
    >>> len(_COMPILED)
    0
    """
    _COMPILED.clear()


def warn_compiled_models() -> None:
    """Warn now about models compiled earlier whose layers keep an old policy.

    ``set_global`` calls it: ``build; compile; set_global; fit`` would otherwise say nothing.

    >>> forget_compiled_models()
    >>> warn_compiled_models()  # no model compiled since: nothing to say
    """
    for model in list(_COMPILED):
        _warn_stale(model, stacklevel=4)


def _warn_stale(model: Any, stacklevel: int = 4) -> None:
    stale = stale_layers(model)
    if not stale:
        return
    names = [layer.name for layer, _ in stale]
    kept = sorted({name for _, name in stale})
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    warnings.warn(
        f"policy {current()!r} was set after {len(names)} layer(s) of model {model.name!r} were "
        f"built; they keep {', '.join(map(repr, kept))}: {shown}. Call policies.set_global(...) "
        "before building the model, or policies.apply(model) to switch the built layers.",
        PolicyWarning, stacklevel=stacklevel,
    )


def prepare(model: Any, optimizer: Any, auto_scale_loss: bool = True) -> Any:
    """Apply the safe defaults to ``model``; return the optimizer compile should use.

    >>> import keras
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, dtype="mixed_float16"),
    ...                           keras.layers.Dense(1)])
    >>> type(prepare(model, "sgd")).__name__  # a layer computes in float16: loss scaling
    'LossScaleOptimizer'
    """
    choice, safe, tune_on = settings()
    _warn_stale(model)
    _COMPILED.add(model)
    if choice is not None and choice.requested == "auto" and tune_on and choice.policy != \
            "float32" and getattr(model, "_policies_tuned", None) is None:
        try:
            result = tune(model, policy=choice.policy)
            object.__setattr__(model, "_policies_tuned", result)
        except LayerDtypeError:
            raise
        except Exception as err:  # noqa: BLE001 - tuning is an optimisation, never a failure
            warnings.warn(f"policies: could not tune {model.name!r} per layer ({err}); it keeps "
                          f"{choice.policy!r} everywhere", PolicyWarning, stacklevel=4)
    if safe:
        safety.make_safe(model)
        if auto_scale_loss and optimizer is not None and safety.uses_float16(model):
            optimizer = safety.wrap_optimizer(optimizer)
    return optimizer


DTYPE_ERROR_HINTS = ("does not match type", "expected to be a", "must be the same type",
                     "Cannot convert", "incompatible dtype", "different dtype")


def looks_like_dtype_error(err: BaseException) -> bool:
    """True if ``err`` reads like a float32 / 16-bit mismatch inside a layer's call.

    >>> looks_like_dtype_error(TypeError("Input 'y' of 'AddV2' Op has type float32 that does "
    ...                                  "not match type bfloat16 of argument 'x'."))
    True
    >>> looks_like_dtype_error(ValueError("shapes (2,) and (3,) are incompatible"))
    False
    """
    text = str(err)
    return any(h in text for h in DTYPE_ERROR_HINTS) and ("float16" in text)


def _wrap_layer_call(original: Any) -> Any:
    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        except (TypeError, ValueError) as err:
            if isinstance(err, LayerDtypeError) or not looks_like_dtype_error(err) or \
                    getattr(self, "compute_dtype", "float32") not in ("float16", "bfloat16"):
                raise
            raise LayerDtypeError(self.name, type(self).__name__, self.dtype_policy.name,
                                  err) from err

    return __call__


GROUP = "policies"  # the fusion.patches group of this hook's two patches


def _wrap_compile(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        params = bound.arguments
        params["optimizer"] = prepare(self, params.get("optimizer"),
                                      bool(params.get("auto_scale_loss", True)))
        return original(*bound.args, **bound.kwargs)

    return compile


def install() -> None:
    """Wrap ``keras.Model.compile`` and ``keras.layers.Layer.__call__`` once (idempotent).

    The ``__call__`` wrapper only turns a dtype mismatch raised inside a 16-bit layer into a
    :class:`~policies.errors.LayerDtypeError` that names the layer and the fix. Both are
    ``fusion.patches`` of the group :data:`GROUP`.
    """
    import keras

    patches.install(GROUP, keras.layers.Layer, "__call__", _wrap_layer_call)
    patches.install(GROUP, keras.Model, "compile", _wrap_compile)


def uninstall() -> None:
    """Restore Keras's own ``compile`` and ``Layer.__call__``.

    >>> install()
    >>> uninstall()
    >>> installed()
    False
    """
    patches.uninstall(GROUP)
