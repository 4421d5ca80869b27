"""Data for the recipes: real data where it can be had, a clearly announced fallback otherwise.

Sources, best first:

- ``keras.datasets`` files (MNIST, CIFAR-10, IMDB) already in the Keras cache
  (``$KERAS_HOME/datasets``, else ``~/.keras/datasets``), read here without Keras; else one
  download attempt through ``keras.datasets`` with a short socket timeout (5 s), so a machine
  without network fails fast;
- real data every installation carries: the Python standard library's own source text
  (:func:`stdlib_text`, a character-level corpus) and scikit-learn's bundled 8x8 handwritten
  digits (:func:`digits`, when scikit-learn is installed: ``pip install -e ".[recipes]"``);
- synthetic data (:func:`make_data`, the small CNN's stripe images) as the last resort.

Every fallback is printed (:func:`announce`), never silent. Each loader returns a
:class:`Dataset` holding the arrays and a ``source`` line saying where they came from.

Example:
    >>> text = stdlib_text(max_chars=2000)
    >>> len(text)
    2000
    >>> x, y = char_windows(encode(text), seq_len=16, samples=8, seed=0)
    >>> x.shape, y.shape, bool((x[:, 1:] == y[:, :-1]).all())
    ((8, 16), (8, 16), True)
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import socket
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

DOWNLOAD_TIMEOUT_S = 5.0
#: Set to 1 to never try a download (the tests do: their data is made, not fetched).
OFFLINE_ENV = "TFMX_RECIPES_OFFLINE"
#: The character vocabulary of the text recipes: tab, newline and printable ASCII; anything
#: else maps to the last id (``UNKNOWN``).
VOCAB = "\t\n" + "".join(chr(c) for c in range(32, 127))
UNKNOWN = len(VOCAB)
VOCAB_SIZE = len(VOCAB) + 1


@dataclasses.dataclass
class Dataset:
    """Train and held-out arrays, the number of classes, and where they came from."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    num_classes: int
    source: str

    def describe(self) -> str:
        """One line: sizes, shapes and source.

        >>> d = Dataset(np.zeros((4, 2)), np.zeros(4), np.zeros((2, 2)), np.zeros(2), 3, "made")
        >>> d.describe()
        'made: 4 training / 2 held-out samples of shape (2,), 3 classes'
        """
        return (f"{self.source}: {len(self.x_train)} training / {len(self.x_val)} held-out "
                f"samples of shape {tuple(self.x_train.shape[1:])}, {self.num_classes} classes")


class Unavailable(Exception):
    """A data source cannot be had here; the message says why."""


def announce(message: str) -> None:
    """Print a data-source announcement (a fallback is always said out loud)."""
    print(f"[data] {message}", flush=True)


def keras_datasets_dir() -> Path:
    """Where Keras caches its datasets: ``$KERAS_HOME/datasets``, else ``~/.keras/datasets``.

    >>> keras_datasets_dir().name
    'datasets'
    """
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return Path(home) / "datasets"


def _download(loader: Callable[[], Any], what: str) -> Any:
    """Call a ``keras.datasets`` loader with a short socket timeout; Unavailable on failure."""
    if os.environ.get(OFFLINE_ENV, "") not in ("", "0"):
        raise Unavailable(f"{what} is not in {keras_datasets_dir()} and {OFFLINE_ENV} is set")
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        return loader()
    except Exception as err:  # noqa: BLE001 - any failure means: not available here
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise Unavailable(f"{what} is not in {keras_datasets_dir()} and the download failed "
                          f"({reason[:160]})") from None
    finally:
        socket.setdefaulttimeout(previous)


def _split(x: np.ndarray, y: np.ndarray, limit: int | None, val_limit: int | None,
           x_val: np.ndarray, y_val: np.ndarray, num_classes: int, source: str) -> Dataset:
    return Dataset(x[:limit], y[:limit], x_val[:val_limit], y_val[:val_limit], num_classes,
                   source)


# -- keras.datasets files --------------------------------------------------------------------
def mnist(limit: int | None = None, val_limit: int | None = None,
          root: Path | None = None) -> Dataset:
    """MNIST as float32 28x28x1 in [0, 1], int32 labels; Unavailable if it cannot be had.

    Reads ``mnist.npz`` from the Keras cache (``root``: its datasets folder), else tries
    ``keras.datasets.mnist.load_data()`` once with a 5 s timeout.
    """
    path = (root or keras_datasets_dir()) / "mnist.npz"
    if path.exists():
        with np.load(path, allow_pickle=False) as f:
            (xt, yt), (xv, yv) = (f["x_train"], f["y_train"]), (f["x_test"], f["y_test"])
    else:
        import keras

        (xt, yt), (xv, yv) = _download(keras.datasets.mnist.load_data, "MNIST")

    def prep(x: np.ndarray) -> np.ndarray:
        return (x.astype(np.float32) / 255.0)[..., None]

    return _split(prep(xt), yt.astype(np.int32), limit, val_limit, prep(xv),
                  yv.astype(np.int32), 10, f"MNIST ({path.parent})")


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        d = pickle.load(f, encoding="bytes")
    data = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return data, np.asarray(d[b"labels"], dtype=np.int32)


def cifar10(limit: int | None = None, val_limit: int | None = None,
            root: Path | None = None) -> Dataset:
    """CIFAR-10 as float32 32x32x3 (per-channel standardised), int32 labels; Unavailable if
    it cannot be had.

    Reads the python batches (``cifar-10-batches-py``: ``data_batch_1..5``, ``test_batch``)
    from the Keras cache, where Keras 3 extracts them (``cifar-10-batches-py-target/``) or
    older Keras did; else tries ``keras.datasets.cifar10.load_data()`` once (5 s timeout).
    """
    base = root or keras_datasets_dir()
    found = [d for d in (base / "cifar-10-batches-py-target" / "cifar-10-batches-py",
                         base / "cifar-10-batches-py") if (d / "test_batch").exists()]
    if found:
        parts = [_cifar_batch(p) for p in sorted(found[0].glob("data_batch_*"))]
        xt = np.concatenate([p[0] for p in parts])
        yt = np.concatenate([p[1] for p in parts])
        xv, yv = _cifar_batch(found[0] / "test_batch")
        source = f"CIFAR-10 ({found[0]})"
    else:
        import keras

        (xt, yt), (xv, yv) = _download(keras.datasets.cifar10.load_data, "CIFAR-10")
        source = "CIFAR-10 (keras.datasets)"
    xt, xv = xt[:limit].astype(np.float32) / 255.0, xv[:val_limit].astype(np.float32) / 255.0
    mean, std = xt.mean(axis=(0, 1, 2)), xt.std(axis=(0, 1, 2)) + 1e-6
    return Dataset((xt - mean) / std, yt.reshape(-1)[:limit].astype(np.int32), (xv - mean) / std,
                   yv.reshape(-1)[:val_limit].astype(np.int32), 10, source)


def imdb(limit: int | None = None, val_limit: int | None = None, num_words: int = 10000,
         maxlen: int = 200, root: Path | None = None) -> Dataset:
    """IMDB reviews as int32 word ids (Keras's encoding: 1 start, 2 out-of-vocabulary, words
    from 3), truncated / left-padded to ``maxlen``; labels 0/1. Unavailable if not to be had.

    Reads ``imdb.npz`` (``x_train``, ``y_train``, ``x_test``, ``y_test``: lists of word
    indices) from the Keras cache, else tries ``keras.datasets.imdb.load_data()`` once.
    """
    path = (root or keras_datasets_dir()) / "imdb.npz"
    if path.exists():
        with np.load(path, allow_pickle=True) as f:
            raw = [(f["x_train"], f["y_train"]), (f["x_test"], f["y_test"])]
        # keras.datasets.imdb's encoding: shift by index_from=3, prepend start_char=1
        (xt, yt), (xv, yv) = [([[1] + [w + 3 for w in s] for s in x], y) for x, y in raw]
        source = f"IMDB ({path.parent})"
    else:
        import keras

        (xt, yt), (xv, yv) = _download(
            lambda: keras.datasets.imdb.load_data(num_words=num_words), "IMDB")
        source = "IMDB (keras.datasets)"

    def pad(seqs: Any, n: int | None) -> np.ndarray:
        seqs = list(seqs)[:n]
        out = np.zeros((len(seqs), maxlen), dtype=np.int32)
        for i, s in enumerate(seqs):
            s = [w if w < num_words else 2 for w in list(s)[-maxlen:]]
            if s:
                out[i, -len(s):] = s
        return out

    return Dataset(pad(xt, limit), np.asarray(yt)[:limit].astype(np.int32), pad(xv, val_limit),
                   np.asarray(yv)[:val_limit].astype(np.int32), 2, source)


# -- real data that ships with Python (and scikit-learn) -------------------------------------
def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The standard library's ``*.py`` files in a fixed order (sorted relative paths),
    without ``site-packages`` and the ``test`` / ``tests`` packages.

    >>> files = stdlib_files()
    >>> files == sorted(files) and all(f.suffix == ".py" for f in files)
    True
    """
    base = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = [p for p in base.rglob("*.py")
             if not skip.intersection(p.relative_to(base).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def stdlib_text(max_chars: int = 2_000_000, root: str | Path | None = None) -> str:
    """The standard library's source text, file after file in :func:`stdlib_files` order,
    cut at ``max_chars``: a real, offline corpus for character-level models.

    Raises Unavailable when no source file is found (a Python installed without its ``.py``
    files).
    """
    chunks: list[str] = []
    total = 0
    for path in stdlib_files(root):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        chunks.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if not chunks:
        raise Unavailable(f"no *.py files under {root or sysconfig.get_paths()['stdlib']}")
    return "".join(chunks)[:max_chars]


def encode(text: str) -> np.ndarray:
    """Character ids in :data:`VOCAB` (anything else -> :data:`UNKNOWN`), int32.

    >>> encode("a\\n\\u00e9").tolist() == [VOCAB.index("a"), 1, UNKNOWN]
    True
    """
    table = np.full(256, UNKNOWN, dtype=np.int32)
    for i, ch in enumerate(VOCAB):
        table[ord(ch)] = i
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return np.where(codes < 256, table[np.minimum(codes, 255)], UNKNOWN).astype(np.int32)


def decode(ids: np.ndarray) -> str:
    """The inverse of :func:`encode` (unknown ids as ``?``).

    >>> decode(encode("x = 1"))
    'x = 1'
    """
    return "".join(VOCAB[i] if i < len(VOCAB) else "?" for i in np.asarray(ids).tolist())


def char_windows(ids: np.ndarray, seq_len: int, samples: int,
                 seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``samples`` windows of ``seq_len`` characters at random offsets (seeded), and their
    targets: each window shifted by one character (next-character prediction)."""
    if len(ids) <= seq_len + 1:
        raise ValueError(f"text of {len(ids)} characters is too short for windows of {seq_len}")
    starts = np.random.default_rng(seed).integers(0, len(ids) - seq_len - 1, size=samples)
    idx = starts[:, None] + np.arange(seq_len)[None]
    return ids[idx], ids[idx + 1]


def text_dataset(samples: int, val_samples: int, seq_len: int, seed: int,
                 max_chars: int = 2_000_000, root: str | Path | None = None,
                 last_only: bool = False) -> Dataset:
    """Next-character windows from the standard library's source: training windows from the
    first 90% of the text, held-out windows from the last 10% (other files).

    ``last_only``: the target is the character after the window (one class of
    :data:`VOCAB_SIZE`), not the shifted window.

    >>> d = text_dataset(16, 4, seq_len=8, seed=0, max_chars=5000)
    >>> d.x_train.shape, d.y_val.shape, d.num_classes == VOCAB_SIZE
    ((16, 8), (4, 8), True)
    """
    ids = encode(stdlib_text(max_chars, root))
    cut = int(len(ids) * 0.9)
    x, y = char_windows(ids[:cut], seq_len, samples, seed)
    xv, yv = char_windows(ids[cut:], seq_len, val_samples, seed + 1)
    if last_only:
        y, yv = y[:, -1], yv[:, -1]
    base = root or sysconfig.get_paths()["stdlib"]
    return Dataset(x, y, xv, yv, VOCAB_SIZE,
                   f"Python standard library source ({base}, {len(ids):,} characters)")


def digits(limit: int | None = None, val_fraction: float = 0.2, seed: int = 0,
           image_shape: tuple[int, ...] | None = None) -> Dataset:
    """scikit-learn's bundled handwritten digits (1797 real 8x8 images, no download),
    standardised; ``image_shape`` (32, 32, 3) upsamples 4x and repeats the channel, (64,)
    flattens. Unavailable without scikit-learn."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise Unavailable("scikit-learn is not installed (pip install -e \".[recipes]\")") from None
    data = load_digits()
    x = data.images.astype(np.float32) / 16.0
    y = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = (x[order] - 0.3) / 0.4, y[order]
    if image_shape is not None and len(image_shape) == 3:
        h, _, c = image_shape
        factor = h // 8
        x = np.repeat(np.repeat(x, factor, axis=1), factor, axis=2)[..., None]
        x = np.repeat(x, c, axis=3)
    elif image_shape is not None:
        x = x.reshape(len(x), -1)
    n_val = int(len(x) * val_fraction)
    return Dataset(x[n_val:][:limit], y[n_val:][:limit], x[:n_val], y[:n_val], 10,
                   "scikit-learn digits (1797 real 8x8 handwritten digits)")


STRIPE_CLASSES = 10
STRIPE_SHAPE = (32, 32, 3)


def make_data(
    samples: int, seed: int = 1234, noise: float = 2.5
) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic 10-class images with learnable structure; deterministic for a seed.

    Class ``c`` has stripes at angle ``c * 18`` degrees, a class colour tint and a bright
    blob; phase, blob position and noise are random per image.

    >>> x, y = make_data(100, seed=1)
    >>> sorted(set(y.tolist())) == list(range(10))
    True
    >>> bool(np.all(np.isfinite(x)))
    True
    """
    rng = np.random.default_rng(seed)
    h, w, c = STRIPE_SHAPE
    y = rng.integers(0, STRIPE_CLASSES, size=samples)
    yy, xx = np.meshgrid(np.arange(h, dtype=np.float32), np.arange(w, dtype=np.float32),
                         indexing="ij")
    angles = y * (math.pi / STRIPE_CLASSES)
    freq = 2 * math.pi / 6.0
    phase = rng.uniform(0, 2 * math.pi, size=samples)
    proj = (xx[None] * np.cos(angles)[:, None, None] + yy[None] * np.sin(angles)[:, None, None])
    stripes = np.sin(freq * proj + phase[:, None, None]).astype(np.float32)
    tints = np.random.default_rng(0).uniform(0.3, 1.0, size=(STRIPE_CLASSES, c)).astype(np.float32)
    cy, cx = rng.uniform(6, h - 6, size=samples), rng.uniform(6, w - 6, size=samples)
    blob = np.exp(-((yy[None] - cy[:, None, None]) ** 2 + (xx[None] - cx[:, None, None]) ** 2)
                  / (2 * 3.0**2)).astype(np.float32)
    x = stripes[..., None] * tints[y][:, None, None, :] + blob[..., None] * tints[
        (y + 3) % STRIPE_CLASSES][:, None, None, :]
    x += rng.normal(0.0, noise, size=x.shape).astype(np.float32)
    return x.astype(np.float32), y.astype(np.int32)



def synthetic_images(samples: int, val_samples: int, seed: int, noise: float = 2.5) -> Dataset:
    """:func:`make_data`'s 10 classes of 32x32x3 stripe images (learnable) as a Dataset.

    >>> synthetic_images(20, 5, seed=0).x_val.shape
    (5, 32, 32, 3)
    """
    x, y = make_data(samples + val_samples, seed=seed, noise=noise)
    return Dataset(x[:samples], y[:samples], x[samples:], y[samples:], 10,
                   f"synthetic 32x32x3 stripe images (noise {noise})")


def first_available(candidates: list[tuple[str, Callable[[], Dataset]]]) -> Dataset:
    """The first candidate that loads; each one that does not is announced with its reason.

    >>> def missing() -> Dataset:
    ...     raise Unavailable("not here")
    >>> d = first_available([("A", missing),
    ...                      ("B", lambda: synthetic_images(10, 2, seed=0))])
    [data] A not available (not here); trying B
    >>> d.source.startswith("synthetic")
    True
    """
    names = [name for name, _ in candidates]
    for i, (name, load) in enumerate(candidates):
        try:
            return load()
        except Unavailable as err:
            nxt = names[i + 1] if i + 1 < len(names) else None
            if nxt is None:
                raise
            announce(f"{name} not available ({err}); trying {nxt}")
    raise Unavailable("no candidates")


def batches(x: np.ndarray, y: np.ndarray, batch_size: int, seed: int,
            epochs: int = 1) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Shuffled full batches (seeded per epoch), for custom training loops.

    >>> [b[0].shape for b in batches(np.zeros((10, 2)), np.zeros(10), 4, seed=0)]
    [(4, 2), (4, 2)]
    """
    for epoch in range(epochs):
        order = np.random.default_rng(seed + epoch).permutation(len(x))
        for i in range(len(x) // batch_size):
            take = order[i * batch_size:(i + 1) * batch_size]
            yield x[take], y[take]
