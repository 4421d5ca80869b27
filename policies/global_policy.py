"""The global policy: ``set_global``, ``scope``, ``current``, and which layers it missed.

Keras reads the global policy when a layer is CONSTRUCTED. A layer created without ``dtype=``
holds the very policy object that was global then; ``set_global`` remembers the objects it
replaces, so :func:`stale_layers` can name the layers that were built before and keep the old
policy (``policies.apply(model)`` fixes them in place).

Example:
    >>> import policies
    >>> with policies.scope("mixed_bfloat16"):
    ...     policies.current()
    'mixed_bfloat16'
    >>> policies.current()
    'float32'
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from policies import hook
from policies.errors import PolicyWarning
from policies.hardware_choice import Choice, choose
from policies.names import check_name
from policies.state import STATE as _STATE
from policies.state import current, hardware, keras_global_policy


def resolve(name: str) -> Choice:
    """What ``name`` means on this machine: "auto" is resolved, the others stand as given.

    Warns (:class:`~policies.errors.PolicyWarning`) for float16 on a CPU without float16
    hardware.

    >>> resolve("float32").policy
    'float32'
    """
    name = check_name(name)
    hw = hardware()
    if name == "auto":
        return choose(hw)
    choice = Choice(name, name, "requested", hw.describe())
    if name == "mixed_float16" and not hw.gpu and not hw.cpu_fp16:
        warnings.warn(
            f"mixed_float16 on {hw.describe()}: this CPU has no float16 arithmetic "
            "(no amx_fp16/avx512_fp16), so float16 math is converted in software and training "
            "will be SLOWER than float32. Use 'auto' (it picks what pays here) or 'float32'.",
            PolicyWarning, stacklevel=3,
        )
    return choice


def _set_keras(policy: Any) -> None:
    import keras

    keras.config.set_dtype_policy(policy)


def set_global(name: str, *, safe: bool = True, tune: bool = True,
               verbose: bool | None = None) -> Choice:
    """Set the global policy for layers built from now on; return what was chosen and why.

    Args:
        name: "float32", "mixed_float16", "mixed_bfloat16" or "auto" (picks for this
            machine's hardware and says why; see :mod:`policies.hardware_choice`).
        safe: keep the output layer, softmax and normalization in float32 and add dynamic loss
            scaling for float16 when models are compiled (default True).
        tune: with "auto" and a 16-bit choice, time each layer at compile time and keep
            float32 where 16-bit is slower (:func:`policies.tune`).
        verbose: print the choice (default: only for "auto").

    Layers already built keep their policy: compile warns which ones, and
    ``policies.apply(model)`` switches them.

    >>> import policies
    >>> print(policies.set_global("mixed_bfloat16"))
    policies: 'mixed_bfloat16': requested
    >>> policies.set_global("float32").policy
    'float32'
    >>> policies.set_global("half")
    Traceback (most recent call last):
    ...
    ValueError: unknown policy 'half'; choose one of 'float32', ... (did you mean 'mixed_float16'?)
    """
    choice = resolve(name)
    old = keras_global_policy()
    if not any(old is r for r in _STATE.replaced):
        _STATE.replaced.append(old)
    _set_keras(choice.policy)
    _STATE.choice, _STATE.safe, _STATE.tune = choice, bool(safe), bool(tune)
    hook.install()
    hook.warn_compiled_models()
    if verbose or (verbose is None and name == "auto"):
        print(choice)
    return choice


@contextlib.contextmanager
def scope(name: str, *, safe: bool = True, tune: bool = True) -> Iterator[Choice]:
    """Layers built inside the ``with`` block get policy ``name``; the global comes back after.

    >>> import keras, policies
    >>> with policies.scope("mixed_bfloat16") as choice:
    ...     layer = keras.layers.Dense(4)
    >>> layer.compute_dtype, choice.policy, policies.current()
    ('bfloat16', 'mixed_bfloat16', 'float32')
    """
    choice = resolve(name)
    previous_policy = keras_global_policy()
    previous = (_STATE.choice, _STATE.safe, _STATE.tune)
    _set_keras(choice.policy)
    _STATE.choice, _STATE.safe, _STATE.tune = choice, bool(safe), bool(tune)
    hook.install()
    try:
        yield choice
    finally:
        _set_keras(previous_policy)
        _STATE.choice, _STATE.safe, _STATE.tune = previous


def explain() -> str:
    """Why the current global policy is what it is (the last ``set_global``/``scope`` choice).

    >>> import policies
    >>> policies.explain().startswith("policies: 'float32'")
    True
    """
    choice = _STATE.choice
    if choice is None or choice.policy != current():
        return f"policies: {current()!r}: Keras's global policy (not set through policies)"
    return str(choice)


def reset() -> None:
    """Back to Keras's float32 global policy; forget what ``set_global`` and compile recorded,
    and put back Keras's ``compile`` and ``Layer.__call__`` (the hook's patches).

    >>> import policies
    >>> from policies import hook
    >>> policies.reset()
    >>> policies.current(), hook.installed()
    ('float32', False)
    """
    _set_keras("float32")
    _STATE.choice, _STATE.safe, _STATE.tune = None, True, True
    _STATE.replaced.clear()
    hook.forget_compiled_models()
    hook.uninstall()
