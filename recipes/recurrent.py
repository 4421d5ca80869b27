"""A GRU/LSTM sequence classifier on real text: IMDB reviews, or next characters of Python's source.

Embedding -> two recurrent layers (``--cell gru`` by default, or ``lstm``; 128 units, the
first returning sequences) -> a softmax Dense. tfmx's rnn stage times, per layer call, Keras's
loop against a hoisted loop (the input projection of every step done as one MatMul) and keeps
the faster on this machine; the Dense layers and Adam updates are fused as usual.

Data, best first (each fallback announced): IMDB sentiment (``imdb.npz`` in the Keras cache,
or a download; reviews cut to the last ``--seq-len`` words); else the next character after
``--seq-len`` characters of the Python standard library's own source (``recipes._data``,
training windows from the first 90% of the text, held-out from the rest).

Run it::

    python -m recipes.recurrent                 # GRU, 6 epochs
    python -m recipes.recurrent --cell lstm --quick

Example:
    >>> RECIPE.name, RECIPE.defaults["cell"]
    ('recurrent', 'gru')
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
    p.add_argument("--cell", choices=("gru", "lstm"), default=None,
                   help="recurrent layer (default gru)")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="characters (or words) per sample (default 50; 20 with --quick)")
    p.add_argument("--units", type=positive_int, default=None,
                   help="units per recurrent layer (default 128; 32 with --quick)")


def load(args: argparse.Namespace) -> _data.Dataset:
    """IMDB, else next-character classification on the standard library's source."""
    val = max(args.samples // 5, args.batch_size)
    return _data.first_available([
        ("IMDB", lambda: _data.imdb(args.samples, val, maxlen=args.seq_len)),
        ("the Python standard library's source",
         lambda: _data.text_dataset(args.samples, val, args.seq_len, args.seed,
                                    max_chars=1_000_000, last_only=True)),
    ])


def build(args: argparse.Namespace, data: _data.Dataset) -> Any:
    """Embedding -> 2 x GRU/LSTM -> softmax Dense (uncompiled)."""
    import keras
    from keras import layers

    vocab = 10000 if data.source.startswith("IMDB") else _data.VOCAB_SIZE
    cell = {"gru": layers.GRU, "lstm": layers.LSTM}[args.cell]
    inp = keras.Input((args.seq_len,), dtype="int32")
    x = layers.Embedding(vocab, 32)(inp)
    x = cell(args.units, return_sequences=True)(x)
    x = cell(args.units)(x)
    out = layers.Dense(data.num_classes, activation="softmax")(x)
    return keras.Model(inp, out, name=f"{args.cell}_text")


RECIPE = Recipe(
    name="recurrent",
    summary=(__doc__ or "").strip().splitlines()[0].rstrip("."),
    load=load,
    build=build,
    defaults={"epochs": 6, "batch_size": 64, "samples": 8000, "lr": 1e-2, "cell": "gru",
              "seq_len": 50, "units": 128, "rounds": 8, "steps": 5},
    quick={"epochs": 1, "batch_size": 32, "samples": 256, "seq_len": 20, "units": 32,
           "rounds": 2, "steps": 2},
    extra_args=_extra,
)


def main(argv: Sequence[str] | None = None) -> dict:
    """Train stock, tfmx and stock'; print, write and return the numbers (``metrics.json``)."""
    return run(RECIPE, argv)


if __name__ == "__main__":
    main()
