"""Per-thread settings held for the length of a block.

Example:
    >>> import threading
    >>> from tfmx.thread_local import swapped
    >>> state = threading.local()
    >>> with swapped(state, "form", "stock") as form:
    ...     form, state.form
    ('stock', 'stock')
    >>> state.form is None  # what it was before (unset reads as None)
    True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def swapped(local: threading.local, attr: str, value: T) -> Iterator[T]:
    """This thread's ``local.attr`` is ``value`` for the block (which receives it), then what
    it was before (None where it was unset), however the block ends.

    >>> state = threading.local()
    >>> with swapped(state, "plan", 1):
    ...     with swapped(state, "plan", 2):
    ...         state.plan
    ...     state.plan
    2
    1
    """
    previous = getattr(local, attr, None)
    setattr(local, attr, value)
    try:
        yield value
    finally:
        setattr(local, attr, previous)


__all__ = ["swapped"]
