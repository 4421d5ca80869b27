"""What the global policy's functions share: the last choice, its options, the machine.

``policies.global_policy`` writes it (``set_global``, ``scope``, ``reset``); the compile
hook and ``policies.tune`` read it. A module of its own so that none of them imports another
in a circle.

>>> from policies import state
>>> state.current()
'float32'
"""

from __future__ import annotations

import dataclasses
from typing import Any

from policies.hardware_choice import Choice, Hardware, detect
from policies.layers import iter_layers


@dataclasses.dataclass
class _State:
    choice: Choice | None = None  # what the last set_global / active scope chose
    replaced: list = dataclasses.field(default_factory=list)  # global policy objects replaced
    safe: bool = True  # float32 outputs/softmax/normalization, automatic loss scaling
    tune: bool = True  # "auto" refines per layer by measurement at compile time
    hardware: Hardware | None = None


STATE = _State()


def hardware() -> Hardware:
    """This machine's description (detected once).

    >>> import policies
    >>> policies.hardware() is policies.hardware()
    True
    """
    if STATE.hardware is None:
        STATE.hardware = detect()
    return STATE.hardware


def keras_global_policy() -> Any:
    """Keras's global dtype policy object (what layers built now take).

    >>> keras_global_policy().name
    'float32'
    """
    import keras

    return keras.config.dtype_policy()


def current() -> str:
    """The name of the global policy now in force ("auto" shows what it resolved to).

    >>> import policies
    >>> policies.current()
    'float32'
    """
    return keras_global_policy().name


def settings() -> tuple[Choice | None, bool, bool]:
    """(last choice, safe, tune) in force.

    >>> import policies
    >>> with policies.scope("mixed_bfloat16", safe=False):
    ...     choice, safe, tune = settings()
    >>> choice.policy, safe, tune
    ('mixed_bfloat16', False, True)
    """
    return STATE.choice, STATE.safe, STATE.tune


def stale_layers(model: Any) -> list[tuple[Any, str]]:
    """Layers of ``model`` built before the last ``set_global`` that keep the old policy.

    Returns (layer, the policy name it keeps) pairs. A layer given an explicit ``dtype=`` is
    never stale: it holds its own policy object.

    >>> import keras, policies
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> _ = policies.set_global("mixed_bfloat16")
    >>> [name for _, name in policies.stale_layers(model)]
    ['float32']
    >>> policies.reset()
    """
    now = current()
    stale = []
    for layer in iter_layers(model):
        held = layer.dtype_policy
        if held.name != now and any(held is r for r in STATE.replaced):
            stale.append((layer, held.name))
    return stale


