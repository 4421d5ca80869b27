"""Every public docstring example runs (the modules' doctests are part of the suite)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import bench
import fusion
import policies
import tfmx

MODULES = sorted(
    info.name
    for package in (bench, fusion, policies, tfmx)
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
    if not info.name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    import tfmx as api

    module = importlib.import_module(name)
    try:
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    finally:
        api.disable()
        _restore_policies()
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


def _restore_policies() -> None:
    """Docstring examples of ``policies`` set keras's global policy; put float32 back (and
    Keras's own compile and Layer.__call__)."""
    from policies import global_policy

    global_policy.reset()
