"""What passes between a tfmx step function and the outer function it is traced into.

A whole-step guard times forms of an outer function (Keras's step loop) that calls tfmx's step
functions. While it traces another form of that loop (stock, XLA-compiled), :func:`forcing`
asks the step functions traced inside to embed that form (:func:`forced_form`). While the loop
traces, :func:`collecting` gathers what each tfmx step traced into it says of itself
(:func:`embedded`, an :class:`Embedded`): whether tfmx changed it, its ops, its signature and
price record. Both are per thread.

Example:
    >>> from tfmx.outer_trace import collecting, embedded
    >>> with collecting() as seen:
    ...     embedded(True, {"MatMul": 2}, signature="demo")
    >>> seen[0].changed, seen[0].ops, seen[0].signature
    (True, {'MatMul': 2}, 'demo')
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from tfmx.thread_local import swapped

_local = threading.local()


@contextlib.contextmanager
def forcing(form: str) -> Iterator[None]:
    """While a guard traces another form (``"stock"``, ``"xla"``) of an outer function
    (Keras's step loop), tfmx's step functions traced inside it embed that form.

    >>> with forcing("stock"):
    ...     forced_form()
    'stock'
    >>> forced_form() is None
    True
    """
    with swapped(_local, "forced", form):
        yield


def forced_form() -> str | None:
    """The form :func:`forcing` asks for, None outside it.

    >>> forced_form() is None
    True
    """
    return getattr(_local, "forced", None)


@contextlib.contextmanager
def collecting(switchable: bool = False) -> Iterator[list[Any]]:
    """Collect what tfmx's step functions embed while an outer function traces (see
    :func:`embedded`): the caller learns whether tfmx changed anything inside.
    ``switchable``: the caller can trace the outer function again in tfmx's form later in the
    same fit (:func:`switchable`), so a step may start as stock.

    >>> with collecting() as seen:
    ...     embedded(False)
    >>> [e.changed for e in seen]
    [False]
    """
    with swapped(_local, "collected", []) as collected, \
            swapped(_local, "switchable", switchable):
        yield collected


def switchable() -> bool:
    """Whether the outer function being traced can be traced again in tfmx's form later in
    the same fit (see :func:`collecting`).

    >>> with collecting(switchable=True):
    ...     switchable()
    True
    >>> switchable()
    False
    """
    return bool(getattr(_local, "switchable", False))


@dataclasses.dataclass(frozen=True)
class Embedded:
    """What an outer trace learns of a tfmx step traced into it."""

    changed: bool  # it differs from stock (a stage or a pass rewrote it)
    ops: Mapping[str, int] = dataclasses.field(default_factory=dict)  # its stock graph's ops
    signature: str = ""  # what the step is (its ops, shapes, what tfmx made of it): a cache key
    price_key: str = ""  # what the step is before it is traced: its price record's key
    gated: bool = False  # the price gate ran it as stock (see ``tfmx.step_price.price_gate``)
    replicas: int = 1  # the replicas it runs in (``tf.distribute``): one trace each
    deferred: int = 0  # the tuner's decisions in it left unmeasured (its budget spent)


def embedded(changed: bool, ops: Mapping[str, int] | None = None, signature: str = "",
             price_key: str = "", gated: bool = False, replicas: int = 1,
             deferred: int = 0) -> None:
    """A tfmx step function was traced into an outer function (see :class:`Embedded`).

    >>> embedded(True)  # outside collecting(): nobody asks, nothing is kept
    """
    collected = getattr(_local, "collected", None)
    if collected is not None:
        collected.append(Embedded(changed, dict(ops or {}), signature, price_key, gated,
                                  replicas, deferred))


__all__ = ["Embedded", "collecting", "embedded", "forced_form", "forcing", "switchable"]
