"""A causal character-level transformer language model on the Python standard library's source.

Characters of ``--seq-len`` (64) -> token + position embeddings (``--width`` 128) -> 2
post-norm blocks of ``keras.layers.MultiHeadAttention(use_causal_mask=True)`` (4 heads) +
residual + LayerNormalization, a GELU feed-forward (4 x width) + residual +
LayerNormalization -> a softmax over the characters at every position. tfmx's attention and
layer_norm stages time their forms per call (Einsum or BatchMatMul attention; Keras's layer
norm composite, the fused kernel or a closed-form gradient) and keep the fastest; Dense + GELU
and Adam are fused.

The text is real and offline: the standard library's own ``*.py`` files in a fixed order
(``recipes._data.stdlib_text``), training windows from the first 90%, held-out windows from
the last 10%. The metric is held-out next-character accuracy (loss: nats per character).

Run it::

    python -m recipes.transformer            # 6 epochs
    python -m recipes.transformer --quick

Example:
    >>> RECIPE.name, RECIPE.defaults["seq_len"]
    ('transformer', 64)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from recipes import _data
from recipes._flags import positive_int
from recipes._recipe import Recipe
from recipes._runner import run


def _extra(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="characters per window (default 64; 32 with --quick)")
    p.add_argument("--width", type=positive_int, default=None,
                   help="model width (default 128; 64 with --quick)")
    p.add_argument("--blocks", type=positive_int, default=None,
                   help="transformer blocks (default 2; 1 with --quick)")


def load(args: argparse.Namespace) -> _data.Dataset:
    """Next-character windows of the standard library's source."""
    val = max(args.samples // 5, args.batch_size)
    return _data.text_dataset(args.samples, val, args.seq_len, args.seed, max_chars=2_000_000)


def build(args: argparse.Namespace, data: _data.Dataset) -> Any:
    """The causal transformer LM (uncompiled)."""
    import keras
    from keras import layers, ops

    class PositionEmbedding(layers.Layer):
        """Adds a learned embedding of each position."""

        def build(self, input_shape: Any) -> None:
            self.table = self.add_weight(shape=tuple(input_shape[1:]), name="positions",
                                         initializer="glorot_uniform")

        def call(self, x: Any) -> Any:
            return x + ops.cast(self.table, x.dtype)

    width, heads = args.width, 4
    inp = keras.Input((args.seq_len,), dtype="int32")
    x = PositionEmbedding()(layers.Embedding(data.num_classes, width)(inp))
    for _ in range(args.blocks):
        attended = layers.MultiHeadAttention(heads, width // heads)(x, x, use_causal_mask=True)
        x = layers.LayerNormalization()(layers.Add()([x, attended]))
        ffn = layers.Dense(width, name=None)(layers.Dense(4 * width, activation="gelu")(x))
        x = layers.LayerNormalization()(layers.Add()([x, ffn]))
    out = layers.Dense(data.num_classes, activation="softmax", dtype="float32")(x)
    return keras.Model(inp, out, name="char_transformer")


RECIPE = Recipe(
    name="transformer",
    summary=(__doc__ or "").strip().splitlines()[0].rstrip("."),
    load=load,
    build=build,
    defaults={"epochs": 6, "batch_size": 32, "samples": 4000, "lr": 5e-3, "seq_len": 64,
              "width": 128, "blocks": 2, "rounds": 8, "steps": 5},
    quick={"epochs": 1, "batch_size": 16, "samples": 256, "seq_len": 32, "width": 64,
           "blocks": 1, "rounds": 2, "steps": 2},
    extra_args=_extra,
)


def main(argv: Sequence[str] | None = None) -> dict:
    """Train stock, tfmx and stock'; print, write and return the numbers (``metrics.json``)."""
    return run(RECIPE, argv)


if __name__ == "__main__":
    main()
