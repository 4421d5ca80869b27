"""Runnable training recipes: ``python -m recipes.<name>`` or ``tfmx recipe <name>``.

Each recipe is a module with ``main(argv=None) -> dict`` that trains a real model stock and with
tfmx, prints Keras progress bars, ``tfmx.report()`` and measured numbers, and returns them.

Example:
    >>> from recipes import available
    >>> from recipes.small_cnn import main  # doctest: +SKIP
    >>> main(["--quick"])["tfmx_accuracy"] > 0.1  # doctest: +SKIP
    True
"""

from __future__ import annotations

import pkgutil


def available() -> list[str]:
    """Names of the recipes in this package (modules with a ``main``), sorted.

    >>> "small_cnn" in available()
    True
    """
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


__all__ = ["available"]
