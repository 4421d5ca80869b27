"""The placement audit of a Keras model (:mod:`tfmx.placement`): its train step traced as
Keras alone traces it and as tfmx plans it for a Metal plugin, both placed and compared. Apart
from :mod:`tfmx.placement` because it switches tfmx on and off (``tfmx.report()`` reads the
placement rules; they import nothing of tfmx's state).

Example:
    >>> import keras, numpy as np
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> model.compile("sgd", "mse")
    >>> audit = audit_model(model, np.zeros((2, 3), "float32"), np.zeros((2, 2), "float32"),
    ...                     plugin="tensorflow-metal")
    >>> audit.ok
    True
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfmx.placement import Audit, compare


def _specs(x: Any, y: Any, batch_size: int) -> tuple:
    import tensorflow as tf

    def spec(a: Any) -> Any:
        a = tf.convert_to_tensor(a)
        return tf.TensorSpec([batch_size, *a.shape[1:]], a.dtype)

    return tf.nest.map_structure(spec, x), tf.nest.map_structure(spec, y)


def audit_model(model: Any, x: Any, y: Any, plugin: str | None = None,
                tensorflow: str | None = None, batch_size: int = 2) -> Audit:
    """Trace compiled Keras ``model``'s train step on one batch of ``x``, ``y`` (arrays) as
    Keras alone traces it and as tfmx plans it for the metal backend of ``plugin`` under
    TensorFlow ``tensorflow`` (see :func:`tfmx.backends.get_backend`), and audit both. tfmx's
    settings are put back afterwards (a fresh report starts where tfmx was on; where it was
    off, ``tfmx.report()`` keeps the plan's trace).

    >>> import keras, numpy as np
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="relu")])
    >>> model.compile("sgd", "mse")
    >>> audit = audit_model(model, np.zeros((2, 3), "float32"), np.zeros((2, 2), "float32"),
    ...                     plugin="tensorflow-metal-plugin", tensorflow="2.21")
    >>> audit.ok, audit.stock.device_of("MatMul"), sorted(audit.tfmx.host_ops())
    (True, 'GPU', ['AddV2', 'BroadcastTo', 'DivNoNan'])
    """
    import tensorflow as tf

    from tfmx import keras_fixes, keras_hook, state
    from tfmx.backends import get_backend
    from tfmx.errors import BackendUnavailableError

    backend = get_backend("metal", plugin=plugin, tensorflow=tensorflow)
    before = state.options()
    if before is not None:
        state.set_options(None)
    try:
        concrete = tf.function(model.train_step).get_concrete_function(
            _specs(x, y, batch_size))
        stock_graph = concrete.graph.as_graph_def(add_shapes=True)
        import tfmx

        tfmx.enable(backend="metal", plugin=plugin)
        state.set_options(dataclasses.replace(state.options(), backend=backend))
        xs = tf.nest.map_structure(lambda a: a[:batch_size], x)
        ys = tf.nest.map_structure(lambda a: a[:batch_size], y)
        try:
            model.fit(xs, ys, batch_size=batch_size, epochs=1, verbose=0)
        except BackendUnavailableError:
            pass
        trace = next((t for t in reversed(state.report().traces)
                      if t.function.endswith("train_step") and t.graph_after is not None), None)
        if trace is None:
            raise RuntimeError("tfmx made no plan of the train step")
        return compare(stock_graph, trace.graph_after, backend)
    finally:
        state.set_options(before)
        if before is None:
            keras_hook.uninstall()
            keras_fixes.uninstall()
        else:
            keras_hook.install()
            keras_fixes.install()
