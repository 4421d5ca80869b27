"""Shared fixtures: backends, tracing a tiny tf.function, rewriting it, running the result."""

import atexit
import functools
import os
import shutil
import tempfile

from helpers import CHILD_ENV  # imports nothing of TensorFlow or tfmx

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Set before anything imports tfmx. The whole-step guard (it alternates the fused and the stock
# step on the first steps and keeps the faster) would make what ran and what a fit computes
# depend on timings: off here (TFMX_GUARD=0); the tuner writes its measurements to a directory
# of this test run's own, never to the user's ~/.cache (TFMX_CACHE_DIR). The guard and the tuner
# have their own tests (tests/test_guard.py, tests/test_tuner.py); TFMX_TUNE is left as it is.
os.environ.setdefault("TFMX_GUARD", "0")
# A stage that fails falls back to Keras's call for users; here it raises, so a bug shows.
os.environ.setdefault("TFMX_STRICT", "1")
if not (os.environ.get(CHILD_ENV) and os.environ.get("TFMX_CACHE_DIR")):
    # (a child of tests/test_onednn_settings.py shares its parent's)
    _CACHE = tempfile.mkdtemp(prefix="tfmx-test-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    os.environ["TFMX_CACHE_DIR"] = _CACHE

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from helpers import (  # noqa: E402
    ONEDNN_MARKERS,
    assert_within_rounding,
    exact_patterns,
    graph_roundings,
    onednn_state,
    slow_trial_forms,
)

import fusion  # noqa: E402
from tfmx.backends import _cpu, get_backend  # noqa: E402
from tfmx.rebuild import control_output_names, protected_names, rebuild  # noqa: E402


def pytest_configure(config):
    for state, why in (("on", "needs oneDNN on"), ("off", "needs oneDNN off"),
                       ("either", "checks what differs with oneDNN's state")):
        config.addinivalue_line(
            "markers", f"{ONEDNN_MARKERS[state]}: {why} (helpers.needs_onednn; the other "
                       "state runs in tests/test_onednn_settings.py's child)")


def pytest_collection_modifyitems(config, items):
    """A test marked for one oneDNN state is skipped in a process of the other, however it was
    marked (helpers.needs_onednn or the bare marker): the child of that state runs it."""
    here = onednn_state()
    for state in ("on", "off"):
        if state == here:
            continue
        value = "1" if state == "on" else "0"
        skip = pytest.mark.skip(reason=(
            f"needs oneDNN {state}; it is {here} in this process: run by "
            f"tests/test_onednn_settings.py in a child with TF_ENABLE_ONEDNN_OPTS={value}"))
        for item in items:
            if item.get_closest_marker(ONEDNN_MARKERS[state]) is not None:
                item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    if os.environ.get(CHILD_ENV):  # what tests/test_onednn_settings.py reads back
        terminalreporter.write_line(f"tfmx tests: oneDNN {onednn_state()}")


@pytest.fixture
def every_rewrite(monkeypatch):
    """tfmx.enable() rewrites every match, as a bare fusion.rewrite() does: the tuner's
    choices between correct forms (kernel or composite, oneDNN or Eigen) are timings of this
    machine, and a test that checks which kernels ran or compares numbers must not depend on
    them. Modules use it with ``pytestmark = pytest.mark.usefixtures("every_rewrite")``."""
    from fusion.pattern import RewriteAlways
    from tfmx import state

    monkeypatch.setattr(state, "tuner", RewriteAlways)


@pytest.fixture
def slow_forms(monkeypatch):
    """``slow_forms(fused=s, stock=s, xla=s)``: the steps of each form a whole-step guard
    times in its trial take so many seconds more, until the test ends
    (helpers.slow_trial_forms); called again, its delays replace the old ones."""
    return functools.partial(slow_trial_forms, monkeypatch.setattr)


@pytest.fixture(scope="session")
def cpu():
    """The live cpu backend (its tables follow this process's oneDNN state)."""
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
        # the bit-exact families and the two that only sum in another order (bias_grad,
        # matmul_layout): the graphs these tests rewrite are compared within rounding
        patterns = [*exact_patterns(), "bias_grad", "matmul_layout"]
        return fusion.rewrite(
            graph_def, backend, patterns, protected=protected,
            control_outputs=control_output_names(concrete),
        )

    return _fuse


@pytest.fixture(scope="session")
def assert_same_numbers():
    """Rebuild the rewritten graph and compare its outputs with the original function's: a
    rewrite may round differently (another kernel, another order), by no more than the
    original's own roundings allow (helpers.float_tolerance)."""

    def _check(concrete, result, *args, terms=None):
        """Each output within the rounding of ``terms`` operations (default: every rounding
        in ``concrete``, helpers.graph_roundings; 0: bitwise) of its largest value."""
        if terms is None:
            terms = graph_roundings(concrete)
        new = rebuild(concrete, result.graph_def, result.control_renames)
        expected = tf.nest.flatten(concrete(*args))
        got = tf.nest.flatten(new(*args))
        assert len(got) == len(expected)
        for i, (e, g) in enumerate(zip(expected, got)):
            assert_within_rounding(g.numpy(), e.numpy(), terms, e.dtype, what=f"output {i}")
        return new

    return _check


@pytest.fixture(autouse=True)
def _tfmx_off():
    """Every test starts and ends with tfmx disabled (one fixture for the whole suite)."""
    import tfmx

    tfmx.disable()
    yield
    tfmx.disable()


@pytest.fixture
def rng():
    return np.random.default_rng(0)
