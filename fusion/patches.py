"""Every patch tfmx and policies make to Keras or TensorFlow, in one registry.

A patch replaces one attribute of one class or module. :func:`install` records the original
(and whether the owner held it itself or inherited it), :func:`uninstall` puts back everything a
group installed, in reverse order, so ``tfmx.disable()`` and ``policies.reset()`` leave the
process as they found it. :func:`temporarily` swaps an attribute for the length of a ``with``
block (Keras's trainer module's ``tf`` while tfmx builds a step function) under a lock, so two
threads never see each other's swap half-done. :func:`installed` lists what is patched now.

Example:
    >>> import types
    >>> from fusion import patches
    >>> owner = types.SimpleNamespace(greet=lambda: "hello")
    >>> _ = patches.install("demo", owner, "greet", lambda original: lambda: original() + "!")
    >>> owner.greet(), [p.attribute for p in patches.installed("demo")]
    ('hello!', ['greet'])
    >>> patches.uninstall("demo")
    >>> owner.greet(), patches.installed("demo")
    ('hello', [])
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

_MISSING = object()
_lock = threading.RLock()


@dataclasses.dataclass(frozen=True)
class Patch:
    """One replaced attribute: who replaced it, where, and what was there before."""

    group: str  # "tfmx", "policies"
    owner: Any  # a class or a module
    attribute: str
    original: Any  # what ``getattr(owner, attribute)`` gave before
    replacement: Any
    owned: bool  # the owner held the attribute itself (False: it inherited it)

    @property
    def where(self) -> str:
        name = getattr(self.owner, "__qualname__", None) or getattr(self.owner, "__name__", "?")
        return f"{getattr(self.owner, '__module__', '')}.{name}.{self.attribute}".lstrip(".")


_PATCHES: list[Patch] = []


def _owned(owner: Any, attribute: str) -> Any:
    """The attribute as the owner itself holds it (not inherited), or _MISSING."""
    namespace = getattr(owner, "__dict__", {})
    return namespace.get(attribute, _MISSING)


def install(group: str, owner: Any, attribute: str,
            make: Callable[[Any], Any]) -> Patch:
    """Replace ``owner.attribute`` by ``make(original)`` for ``group``; idempotent: a second
    install of the same group, owner and attribute returns the first patch unchanged."""
    with _lock:
        for patch in _PATCHES:
            if patch.owner is owner and patch.attribute == attribute:
                if patch.group != group:
                    raise RuntimeError(
                        f"{patch.where} is already patched by {patch.group!r}; {group!r} "
                        "would stack on it (fusion.patches keeps one patch per attribute)")
                return patch
        own = _owned(owner, attribute)
        original = getattr(owner, attribute)
        replacement = make(original)
        setattr(owner, attribute, replacement)
        patch = Patch(group, owner, attribute, original, replacement, own is not _MISSING)
        _PATCHES.append(patch)
        return patch


def uninstall(group: str) -> None:
    """Put back every attribute ``group`` replaced, last patched first."""
    with _lock:
        for patch in reversed([p for p in _PATCHES if p.group == group]):
            if patch.owned:
                setattr(patch.owner, patch.attribute, patch.original)
            else:
                delattr(patch.owner, patch.attribute)  # the inherited one shows again
            _PATCHES.remove(patch)


def installed(group: str | None = None) -> list[Patch]:
    """The patches in place now (of ``group``, or all), in the order they were made."""
    with _lock:
        return [p for p in _PATCHES if group is None or p.group == group]


@contextlib.contextmanager
def temporarily(owner: Any, attribute: str, value: Any) -> Iterator[None]:
    """``owner.attribute = value`` inside the block only (one such swap at a time)."""
    with _lock:
        saved = _owned(owner, attribute)
        setattr(owner, attribute, value)
        try:
            yield
        finally:
            if saved is _MISSING:
                delattr(owner, attribute)  # the inherited one shows again
            else:
                setattr(owner, attribute, saved)
