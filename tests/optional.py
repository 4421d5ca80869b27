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


def tiny_decoder(name: str) -> tuple[Any, Any, Any]:
    """A tiny keras_hub backbone, ``"llama"`` or ``"gemma3"`` (vocabulary 64, 2 layers, 2 query
    heads, 1 key/value head, hidden 32, intermediate 64) on 8 tokens, its last token ->
    Dense(4), compiled for MSE: (a seeded build, token ids, targets) for 16 examples; the
    calling test skipped where keras_hub is unavailable (:func:`keras_hub`)."""
    import keras
    import numpy as np

    hub = keras_hub()

    def build() -> keras.Model:
        keras.utils.set_random_seed(0)
        common = dict(vocabulary_size=64, num_layers=2, num_query_heads=2,
                      num_key_value_heads=1, hidden_dim=32, intermediate_dim=64)
        if name == "llama":
            backbone = hub.models.LlamaBackbone(**common)
        else:  # Gemma3: Gemma's RMSNormalization, the per-head query and key norms too
            backbone = hub.models.Gemma3Backbone(**common, head_dim=16, image_size=16,
                                                 vision_encoder=None)
        ids = keras.Input((8,), dtype="int32")
        out = backbone({"token_ids": ids, "padding_mask": keras.ops.ones_like(ids)})
        model = keras.Model(ids, keras.layers.Dense(4)(out[:, -1, :]))
        model.compile(keras.optimizers.SGD(0.05), "mse")
        return model

    rng = np.random.default_rng(1)
    return build, rng.integers(0, 64, (16, 8)).astype("int32"), rng.standard_normal(
        (16, 4)).astype("float32")
