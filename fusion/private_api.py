"""The private names of Keras and TensorFlow tfmx uses, in one place, per version.

tfmx hooks Keras's TensorFlow trainer and a few layer methods and backend functions, and reads
a few helpers Keras and TensorFlow do not export. Each such name is one :class:`Private`
record here: tfmx's key for it, where each known release holds it (``"module:attr"``; an empty
``attr`` names the module itself), and what stays off without it. :func:`get` resolves a key on
the installed versions (the place of the installed release first); a name found nowhere raises
:class:`MissingPrivateName` (an ``ImportError``) naming the symbol, the versions installed and
what stays off, which the callers catch and step aside for that part. :func:`locate` resolves a
stage hook's ``"module:attr"`` owner the same way (Keras 3.16 moved the TensorFlow backend's op
modules under ``keras.src.backend.tensorflow.ops``). :func:`check` lists every key's state:
``tests/test_private_api.py`` runs it on the installed versions.

Example:
    >>> from fusion import private_api
    >>> private_api.get("keras.Dense").__name__
    'Dense'
    >>> private_api.locate("keras.src.backend.tensorflow:nn") in (
    ...     "keras.src.backend.tensorflow:nn", "keras.src.backend.tensorflow.ops:nn")
    True
    >>> [key for key, problem in private_api.check().items() if problem]
    []
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from typing import Any


@dataclasses.dataclass(frozen=True)
class Private:
    """One private name: ``key`` (tfmx's), ``places`` as ``(release, "module:attr")`` pairs
    (the release that first holds it there: ``"keras 3.16"``, ``"tensorflow 2.21"``), and
    ``off``: what tfmx leaves to Keras or TensorFlow without it."""

    key: str
    places: tuple[tuple[str, str], ...]
    off: str

    @property
    def library(self) -> str:
        return self.places[0][0].split()[0]


class MissingPrivateName(ImportError):
    """A private name tfmx uses is not where any release tfmx knows holds it."""


def _p(key: str, off: str, *places: tuple[str, str]) -> Private:
    return Private(key, tuple(places), off)


K315, K316, TF = "keras 3.15", "keras 3.16", "tensorflow 2.21"
_BACKEND_NN = ((K315, "keras.src.backend.tensorflow.nn:{}"),
               (K316, "keras.src.backend.tensorflow.ops.nn:{}"))


def _nn(key: str, name: str, off: str) -> Private:
    return Private(key, tuple((r, p.format(name)) for r, p in _BACKEND_NN), off)


PRIVATE: tuple[Private, ...] = (
    # Keras: the trainer tfmx hooks (tfmx.keras_hook, tfmx.keras_fixes)
    _p("keras.trainer", "the whole of tfmx (Keras's fit, evaluate and predict run stock)",
       (K315, "keras.src.backend.tensorflow.trainer:TensorFlowTrainer"),
       (K316, "keras.src.backend.tensorflow.trainer:Trainer")),
    _p("keras.trainer_module", "the whole of tfmx",
       (K315, "keras.src.backend.tensorflow.trainer:")),
    _p("keras.CallbackList", "the whole of tfmx (the guard's plan of a fit)",
       (K315, "keras.src.callbacks.callback_list:CallbackList")),
    _p("keras.tree", "the multi-worker fixes of Keras's trainer", (K315, "keras.src:tree")),
    # Keras: helpers the families call
    _p("keras.standardize_data_format", "the depthwise and separable families",
       (K315, "keras.src.backend:standardize_data_format"),
       (K316, "keras.src.backend.config:standardize_data_format")),
    _p("keras.activations", "the rnn family", (K315, "keras.src:activations")),
    _p("keras.ops", "the rnn family", (K315, "keras.src:ops")),
    _p("keras.LSTMCell", "the rnn family's LSTM", (K315, "keras.src.layers.rnn.lstm:LSTMCell")),
    _p("keras.GRUCell", "the rnn family's GRU", (K315, "keras.src.layers.rnn.gru:GRUCell")),
    _p("keras.Dense", "the feed_forward family", (K315, "keras.src.layers.core.dense:Dense")),
    _p("keras.Add", "the layer_norm family's residual form",
       (K315, "keras.src.layers.merging.add:Add")),
    _nn("keras.apply_masks", "_apply_masks", "the attention family's masked form"),
    _nn("keras.get_large_negative", "_get_large_negative", "the attention family's masked form"),
    _nn("keras.dot_product_attention_xla", "_dot_product_attention_xla",
        "the attention family's reference (its doctest)"),
    _p("keras.backend_nn", "the stage hooks of Keras's TensorFlow nn functions (their tests)",
       (K315, "keras.src.backend.tensorflow:nn"), (K316, "keras.src.backend.tensorflow.ops:nn")),
    _p("keras.backend_math", "the stage hooks of Keras's TensorFlow math functions (their tests)",
       (K315, "keras.src.backend.tensorflow:math"),
       (K316, "keras.src.backend.tensorflow.ops:math")),
    _p("keras.backend_numpy", "the stage hooks of Keras's TensorFlow numpy functions (their "
       "tests)", (K315, "keras.src.backend.tensorflow:numpy"),
       (K316, "keras.src.backend.tensorflow.ops:numpy")),
    _p("keras.get_keras_mask", "the squeeze_excite family",
       (K315, "keras.src.backend.common.masking:get_keras_mask")),
    _p("keras.large_negative_number", "the attention family's masked softmax",
       (K315, "keras.src.layers.activations.softmax:_large_negative_number")),
    _p("keras.StatelessScope", "every stage family (their deferred writes)",
       (K315, "keras.src.backend.common.stateless_scope:StatelessScope")),
    _p("keras.get_autocast_scope", "mixed-precision forms of the stage families",
       (K315, "keras.src.backend.common.variables:get_autocast_scope")),
    _p("keras.AutocastScope", "the tuner's timing of mixed-precision forms",
       (K315, "keras.src.backend.common.variables:AutocastScope")),
    _p("keras.global_state", "tracing tfmx's form beside a fit's steps (traced in the fit's "
       "thread instead)", (K315, "keras.src.backend.common:global_state")),
    # TensorFlow: the modules tfmx imports from tensorflow.python (tfmx's trace, rebuild and
    # graph passes; a missing one is an ImportError of tfmx itself, caught by this table's test)
    *(_p(f"tf.{m.rpartition('.')[2]}", "tfmx's rewrite", (TF, f"tensorflow.python.{m}:"))
      for m in ("data.ops.iterator_ops", "distribute.input_lib", "distribute.distribute_lib",
                "eager.context", "eager.record", "eager.execute",
                "eager.polymorphic_function.atomic_function",
                "eager.polymorphic_function.concrete_function",
                "eager.polymorphic_function.polymorphic_function",
                "framework.auto_control_deps_utils", "framework.func_graph",
                "framework.importer", "framework.ops", "framework.kernels",
                "framework.op_def_registry", "framework.op_def_library", "framework.dtypes",
                "framework.tensor_util", "ops.array_ops", "ops.handle_data_util",
                "ops.resource_variable_ops", "util.tf_decorator", "util._pywrap_util_port")),
)
"""Every private name tfmx uses (the stage hooks' methods are the families' ``MATCHES``,
resolved through :func:`locate`)."""

_BY_KEY = {p.key: p for p in PRIVATE}

# Owners of stage hooks ("module:attr") moved in a later release: the old place -> the new.
MOVED: dict[str, tuple[str, str]] = {
    f"keras.src.backend.tensorflow:{m}": (K316, f"keras.src.backend.tensorflow.ops:{m}")
    for m in ("core", "image", "linalg", "math", "nn", "numpy")
}


def release(library: str) -> tuple[int, int]:
    """The installed ``library``'s (major, minor): ``"keras"`` or ``"tensorflow"``.

    >>> release("keras") >= (3, 0)
    True
    """
    module = importlib.import_module(library)
    found = re.match(r"(\d+)\.(\d+)", getattr(module, "__version__", "0.0"))
    return (int(found[1]), int(found[2])) if found else (0, 0)


def versions() -> str:
    """The installed Keras and TensorFlow, as named in tfmx's messages.

    >>> versions().startswith("Keras 3.")
    True
    """
    import keras
    import tensorflow as tf

    return f"Keras {keras.__version__}, TensorFlow {tf.__version__}"


def _ordered(places: tuple[tuple[str, str], ...]) -> list[str]:
    """``places``' paths, the newest release not after the installed one's first."""
    def since(label: str) -> tuple[int, int]:
        library, number = label.split()
        major, minor = number.split(".")
        return (int(major), int(minor)) if release(library) >= (int(major), int(minor)) else (
            -int(major), -int(minor))

    return [path for _, path in sorted(places, key=lambda p: since(p[0]), reverse=True)]


def _load(path: str) -> Any:
    module, _, attrs = path.partition(":")
    value: Any = importlib.import_module(module)
    for attr in filter(None, attrs.split(".")):
        value = getattr(value, attr)
    return value


def get(key: str) -> Any:
    """The object tfmx calls ``key`` on the installed versions; :class:`MissingPrivateName`
    where no known place holds it.

    >>> get("keras.trainer").__name__ in ("TensorFlowTrainer", "Trainer")
    True
    """
    private = _BY_KEY[key]
    for path in _ordered(private.places):
        try:
            return _load(path)
        except (ImportError, AttributeError):
            continue
    raise MissingPrivateName(
        f"{versions()} has no {key} where tfmx looks for it "
        f"({', '.join(f'{p} ({r})' for r, p in private.places)}): {private.off} stays off")


def locate(owner: str) -> str:
    """A stage hook's ``"module:attr"`` owner where the installed Keras holds it (its later
    place from :data:`MOVED` where the spelled one is gone); unchanged where neither resolves.

    >>> locate("keras.src.layers.core.dense:Dense")
    'keras.src.layers.core.dense:Dense'
    """
    moved = MOVED.get(owner)
    places = [("keras 3.15", owner)] + ([moved] if moved else [])
    for path in _ordered(tuple(places)):
        try:
            _load(path)
            return path
        except (ImportError, AttributeError):
            continue
    return owner


def check() -> dict[str, str | None]:
    """Every key of :data:`PRIVATE` -> None where it resolves here, else the message saying
    what is missing.

    >>> check()["keras.Dense"] is None
    True
    """
    out: dict[str, str | None] = {}
    for private in PRIVATE:
        try:
            get(private.key)
            out[private.key] = None
        except MissingPrivateName as exc:
            out[private.key] = str(exc)
    return out
