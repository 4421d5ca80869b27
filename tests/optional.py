"""Packages some tests need that a TensorFlow and Keras combination may lack: the test skips,
naming why, never errors."""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

import pytest


def keras_hub() -> Any:
    """keras_hub, or the calling test skipped with the reason it is unavailable: not installed,
    or its release does not import under the installed Keras (keras_hub 0.32 under Keras 3.16,
    which moved private names keras_hub imports)."""
    try:
        return importlib.import_module("keras_hub")
    except ImportError as exc:
        import keras

        try:
            hub = f"keras_hub {importlib.metadata.version('keras-hub')}"
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"keras_hub is not installed (Keras {keras.__version__})")
        pytest.skip(f"{hub} does not import under Keras {keras.__version__}: "
                    f"{type(exc).__name__}: {exc}")
