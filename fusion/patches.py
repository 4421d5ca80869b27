"""Every patch tfmx and policies make to Keras or TensorFlow, in one registry.

A patch replaces one attribute of one class or module. :func:`install` records the original
(and whether the owner held it itself or inherited it), :func:`uninstall` puts back everything a
group installed, in reverse order, so ``tfmx.disable()`` and ``policies.reset()`` leave the
process as they found it. :func:`temporarily` swaps an attribute of a class, a module or an
instance for the length of a ``with`` block (Keras's trainer module's ``tf`` while tfmx builds
a step function, a layer's ``_dtype_policy`` while policies probes it) under a lock, so two
threads never see each other's swap half-done; the swap is recorded (group
:data:`TEMPORARY`) while it lasts. :func:`installed` lists what is patched now.

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
import types
from collections.abc import Callable, Iterator
from typing import Any

_MISSING = object()
_lock = threading.RLock()
TEMPORARY = "temporarily"  # the group of the swaps :func:`temporarily` holds in place


# eq=False: a patch is equal only to itself (an original may be a tensor, whose == is
# elementwise).
@dataclasses.dataclass(frozen=True, eq=False)
class Patch:
    """One replaced attribute: who replaced it, where, and what was there before."""

    group: str  # "tfmx.keras", "policies", ... or TEMPORARY
    owner: Any  # a class or a module (an instance: only in a TEMPORARY swap)
    attribute: str
    original: Any  # what ``getattr(owner, attribute)`` gave before (None: it had none)
    replacement: Any
    owned: bool  # the owner held the attribute itself (False: it inherited it)

    @property
    def where(self) -> str:
        owner = self.owner
        if isinstance(owner, types.ModuleType):
            return f"{owner.__name__}.{self.attribute}"
        if isinstance(owner, type):
            return f"{owner.__module__}.{owner.__qualname__}.{self.attribute}"
        kind = type(owner)
        label = getattr(owner, "name", None) or hex(id(owner))
        return f"{kind.__module__}.{kind.__qualname__}({label}).{self.attribute}"


_PATCHES: list[Patch] = []


def _owned(owner: Any, attribute: str) -> Any:
    """The attribute as the owner itself holds it (not inherited), or _MISSING."""
    namespace = getattr(owner, "__dict__", {})
    return namespace.get(attribute, _MISSING)


def install(group: str, owner: Any, attribute: str,
            make: Callable[[Any], Any]) -> Patch:
    """Replace ``owner.attribute`` by ``make(original)`` for ``group``; idempotent: a second
    install of the same group, owner and attribute returns the first patch unchanged. An
    attribute another group patched, or one swapped by :func:`temporarily` now, raises
    RuntimeError."""
    _check_group(group)
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


def _check_group(group: str) -> None:
    if group == TEMPORARY:
        raise ValueError(f"group {TEMPORARY!r} is temporarily()'s own: its swaps end with "
                         "their with block")


def _forget(patch: Patch) -> None:
    _PATCHES[:] = [p for p in _PATCHES if p is not patch]


def _put_back(patch: Patch) -> None:
    if patch.owned:
        setattr(patch.owner, patch.attribute, patch.original)
    else:
        delattr(patch.owner, patch.attribute)  # the inherited one (or none) shows again
    _forget(patch)


def uninstall(group: str) -> None:
    """Put back every attribute ``group`` replaced, last patched first."""
    _check_group(group)
    with _lock:
        for patch in reversed([p for p in _PATCHES if p.group == group]):
            _put_back(patch)


def installed(group: str | None = None) -> list[Patch]:
    """The patches in place now (of ``group``, or all, the swaps of :func:`temporarily` in
    progress included), in the order they were made.

    >>> from fusion import patches
    >>> [p.where for p in patches.installed("nobody")]
    []
    """
    with _lock:
        return [p for p in _PATCHES if group is None or p.group == group]


@contextlib.contextmanager
def temporarily(owner: Any, attribute: str, value: Any) -> Iterator[Patch]:
    """``owner.attribute = value`` inside the block only: a class's or a module's attribute, or
    an instance's (what its ``__dict__`` held comes back, or the attribute goes again if it
    had none). Holds the registry's lock for the block (one such swap at a time; the same
    thread may nest them) and is listed by :func:`installed` (group :data:`TEMPORARY`) while
    it lasts. Yields the :class:`Patch`.

    >>> import types
    >>> from fusion import patches
    >>> cell = types.SimpleNamespace()
    >>> with patches.temporarily(cell, "mask", 0.5) as patch:
    ...     cell.mask, patch.group, len(patches.installed(patches.TEMPORARY))
    (0.5, 'temporarily', 1)
    >>> hasattr(cell, "mask"), patches.installed(patches.TEMPORARY)
    (False, [])
    """
    with _lock:
        saved = _owned(owner, attribute)
        original = saved if saved is not _MISSING else getattr(owner, attribute, None)
        patch = Patch(TEMPORARY, owner, attribute, original, value, saved is not _MISSING)
        setattr(owner, attribute, value)
        _PATCHES.append(patch)
        try:
            yield patch
        finally:
            _put_back(patch)
