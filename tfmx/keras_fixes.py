"""Keras's ``model.fit`` under ``MultiWorkerMirroredStrategy``: two fixes of its trainer.

What Keras does wrong (keras-team/keras#20585). Stock Keras 3 fails there twice, both in
``keras/src/backend/tensorflow/trainer.py``, and only when the strategy spans several workers
(its ``_collective_all_reduce_multi_worker``):

1. ``TensorFlowTrainer._maybe_symbolic_build`` all-reduces the first batch, a nest of
   ``PerReplica`` values, with ``strategy.reduce("MEAN", batch, axis=None)``, eagerly, only to
   read the shapes and dtypes the symbolic build needs. Across workers that path converts the
   whole nest to one tensor: "Attempt to convert a value (PerReplica:...) with an unsupported
   type".
2. ``reduce_per_replica`` reduces the step's logs (scalars) with ``strategy.reduce("MEAN", v,
   axis=0)``: a reduction over dimension 0 of a scalar ("Invalid reduction dimension 0").

What the fix does. Across workers, and only there: the symbolic build reads the shapes and
dtypes from the first local replica's batch (no collective: a mean over replicas has the
shapes and dtypes of one replica's batch), and the logs are averaged over the replicas with
``axis=None``, which is what ``MirroredStrategy``'s path computes. Everywhere else both run as
Keras's own.

``tfmx.enable()`` installs the two patches (``fusion.patches``, group :data:`GROUP`) and
``tfmx.disable()`` puts Keras's own back.

Example:
    >>> from fusion import patches
    >>> from tfmx import keras_fixes
    >>> keras_fixes.install()
    >>> [p.where.rsplit(".", 2)[-2:] for p in patches.installed(keras_fixes.GROUP)]
    [['TensorFlowTrainer', '_maybe_symbolic_build'], ['trainer', 'reduce_per_replica']]
    >>> keras_fixes.uninstall()
    >>> patches.installed(keras_fixes.GROUP)
    []
"""

from __future__ import annotations

import functools
from typing import Any

from fusion import patches, private_api

GROUP = "tfmx.keras_fixes"  # the fusion.patches group of the two fixes


def _trainer_module() -> Any:
    return private_api.get("keras.trainer_module")


def _multi_worker_strategy(strategy: Any) -> bool:
    return bool(_trainer_module()._collective_all_reduce_multi_worker(strategy))


def _first_replica(strategy: Any, batch: Any) -> Any:
    """Each DistributedValues leaf of ``batch`` as its first local replica's tensor."""
    import tensorflow as tf

    tree = private_api.get("keras.tree")
    return tree.map_structure(
        lambda v: (strategy.experimental_local_results(v)[0]
                   if isinstance(v, tf.distribute.DistributedValues) else v), batch)


def _symbolic_build_wrapper(original: Any) -> Any:
    @functools.wraps(original)
    def build(self: Any, iterator: Any = None, data_batch: Any = None) -> Any:
        strategy = self._distribute_strategy
        if strategy is None or not _multi_worker_strategy(strategy):
            return original(self, iterator=iterator, data_batch=data_batch)
        if iterator is not None:
            for _, _, it in iterator:
                data_batch = next(it)
                break
        data_batch = _first_replica(strategy, data_batch)  # no collective: shapes only
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    return build


def _reduce_wrapper(original: Any) -> Any:
    @functools.wraps(original)
    def reduce_per_replica(values: Any, strategy: Any, reduction: str) -> Any:
        if reduction in ("auto", "mean") and _multi_worker_strategy(strategy):
            tree = private_api.get("keras.tree")
            return tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
        return original(values, strategy, reduction)

    return reduce_per_replica


def install() -> None:
    """Patch Keras's trainer with the two fixes (idempotent). See the module's example."""
    module = _trainer_module()
    patches.install(GROUP, private_api.get("keras.trainer"), "_maybe_symbolic_build",
                    _symbolic_build_wrapper)
    patches.install(GROUP, module, "reduce_per_replica", _reduce_wrapper)


def uninstall() -> None:
    """Put Keras's own ``_maybe_symbolic_build`` and ``reduce_per_replica`` back. See the
    module's example."""
    patches.uninstall(GROUP)


def installed() -> bool:
    """True while the fixes are in place (between :func:`install` and :func:`uninstall`).

    >>> from tfmx import keras_fixes
    >>> keras_fixes.uninstall()
    >>> keras_fixes.installed()
    False
    """
    return bool(patches.installed(GROUP))
