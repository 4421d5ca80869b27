"""Shared fixtures: backends, tracing a tiny tf.function, rewriting it, running the result."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from helpers import exact_patterns  # noqa: E402

import fusion  # noqa: E402
from tfmx.backends import _cpu, get_backend  # noqa: E402
from tfmx.rebuild import control_output_names, protected_names, rebuild  # noqa: E402


@pytest.fixture(scope="session")
def cpu():
    """The live cpu backend (oneDNN off on this machine unless TF_ENABLE_ONEDNN_OPTS=1)."""
    return get_backend("cpu")


@pytest.fixture(scope="session")
def onednn_cpu():
    """The cpu backend with its oneDNN tables (residual Add, GELU, depthwise)."""
    return _cpu(onednn=True)


@pytest.fixture(scope="session")
def trace():
    """trace(fn, *specs) -> (ConcreteFunction, GraphDef with _output_shapes)."""

    def _trace(fn, *specs):
        concrete = tf.function(fn, autograph=False).get_concrete_function(*specs)
        return concrete, concrete.graph.as_graph_def(add_shapes=True)

    return _trace


@pytest.fixture(scope="session")
def fuse():
    """fuse(concrete, graph_def, backend, protected=None) -> RewriteResult."""

    def _fuse(concrete, graph_def, backend, protected=None):
        if protected is None:
            protected = protected_names(concrete)
        return fusion.rewrite(
            graph_def, backend, exact_patterns(), protected=protected,
            control_outputs=control_output_names(concrete),
        )

    return _fuse


@pytest.fixture(scope="session")
def assert_same_numbers():
    """Rebuild the rewritten graph and compare its outputs with the original function's."""

    def _check(concrete, result, *args, rtol=1e-5, atol=1e-6):
        new = rebuild(concrete, result.graph_def, result.control_renames)
        expected = tf.nest.flatten(concrete(*args))
        got = tf.nest.flatten(new(*args))
        assert len(got) == len(expected)
        for e, g in zip(expected, got):
            np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=rtol, atol=atol)
        return new

    return _check


@pytest.fixture
def rng():
    return np.random.default_rng(0)
