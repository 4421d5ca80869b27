"""Runnable training recipes: ``python -m recipes.<name>`` or ``tfmx recipe <name>``.

Each recipe is a module with ``main(argv=None) -> dict`` whose docstring's first line says what
it shows (``tfmx recipe --list``). The training recipes share one runner (``recipes._runner``:
flags, stock / tfmx / stock' runs from the same weights, step times, ``metrics.json``, a PNG,
TensorBoard logs; its parts in ``recipes._flags``, ``recipes._train``, ``recipes._compare`` and
``recipes._plot``) and one set of data loaders (``recipes._data``); ``recipes.tour`` runs the
ones where tfmx shows its worth and summarises them in one table and one picture.

Example:
    >>> from recipes import available
    >>> from recipes.small_cnn import main  # doctest: +SKIP
    >>> main(["--quick", "--out", "/tmp/small_cnn"])["tfmx_accuracy"] >= 0.0  # doctest: +SKIP
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
