"""The metal backend per Metal plugin (tfmx.backends.metal_backend): which plugin ``metal``
resolves to, what each plugin's backend declares, and the plan each gives for a small Keras
model traced on Linux, checked op by op against that plugin's table. Nothing here ran on a Mac:
the plans are graphs to inspect (running one raises BackendUnavailableError)."""

from __future__ import annotations

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmx
from fusion.graph import GraphView
from fusion.graphs.contraction import ContractionKernels
from fusion.graphs.optimizer_update import find_updates
from fusion.kernels.batch_norm import BatchNormKernels, kernel_blocker
from fusion.kernels.rnn import RnnKernels
from tfmx import metal_plugins
from tfmx.backends import get_backend, metal_backend, metal_kernels
from tfmx.metal_plugins import APPLE, OPEN, InstalledPlugin, plugin_table

# Every match rewritten, whatever the tuner would measure here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_rewrite")

FUSED = ("_FusedConv2D", "_FusedMatMul")
OPEN_DTYPES = {tf.float32.as_datatype_enum, tf.float16.as_datatype_enum}
# The open plugin's resource-variable kernels are host-only under the TensorFlow installed here.
HOST_ONLY_HERE = "ResourceApplyAdam" in plugin_table(OPEN).host_only(tf.__version__)
needs_host_only = pytest.mark.skipif(
    not HOST_ONLY_HERE, reason=f"TensorFlow {tf.__version__} exports the resource-variable C API")


# -- the plans: Dense + relu, Conv2D + bias + relu, Adam ---------------------------------------
def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(3, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(4, activation="relu"),
        keras.layers.Dense(2),
    ])
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    return model


VARIABLES = 6  # three kernels, three biases: one Adam update each


def _ops(graph_def) -> collections.Counter:
    ops = collections.Counter(n.op for n in graph_def.node)
    for fdef in graph_def.library.function:
        ops.update(n.op for n in fdef.node_def)
    return ops


def _fused_nodes(graph_def):
    nodes = [n for n in graph_def.node if n.op in FUSED]
    return nodes + [n for f in graph_def.library.function for n in f.node_def if n.op in FUSED]


@pytest.fixture(scope="module")
def plans():
    """plans(plugin) -> (the backend, the report, the train step's trace): what
    ``tfmx.enable(backend="metal", plugin=plugin)`` planned for :func:`_model`'s fit. The
    bias_row stage is left out: without a tuner (no Mac here) it would put each Dense's bias
    into its MatMul, and the Dense layers are what the contraction family fuses here."""
    made: dict = {}

    def plan(plugin):
        if plugin not in made:
            tfmx.enable(backend="metal", plugin=plugin, exclude=["bias_row"])
            backend = tfmx.state.options().backend
            x, y = np.zeros((8, 6, 6, 2), np.float32), np.zeros((8, 2), np.float32)
            with pytest.raises(tfmx.BackendUnavailableError, match="metal"):
                _model().fit(x, y, batch_size=8, epochs=1, verbose=0)
            report = tfmx.report()
            trace = next(t for t in report.traces if t.function.endswith("train_step"))
            tfmx.disable()
            made[plugin] = backend, report, trace
        return made[plugin]

    return plan


def test_open_plugin_plan_uses_only_its_fused_ops_lists_and_dtypes(plans):
    backend, _, trace = plans(OPEN)
    table = plugin_table(OPEN)
    assert backend.plugin == (OPEN, table.version) and trace.status == "plan only"
    fused = _fused_nodes(trace.graph_after)
    assert sorted(n.op for n in fused) == ["_FusedConv2D", "_FusedMatMul", "_FusedMatMul"]
    for node in fused:
        chain = tuple(s.decode() for s in node.attr["fused_ops"].list.s)
        assert chain in table.fused_ops[node.op], (node.name, chain)
        assert node.attr["T"].type in OPEN_DTYPES
        planned = tf.__version__ if table.loads_into(tf.__version__) else table.tensorflow[1]
        assert table.runs(node.op, tf.as_dtype(node.attr["T"].type).name, planned)
    chains = sorted(tuple(s.decode() for s in n.attr["fused_ops"].list.s) for n in fused)
    assert chains == [("BiasAdd",), ("BiasAdd", "Relu"), ("BiasAdd", "Relu")]
    # Every op the plan adds is one the plugin runs on its GPU under this TensorFlow.
    added = set(_ops(trace.graph_after)) - set(_ops(trace.graph_before))
    assert added and added <= backend.kernels, added - backend.kernels


@needs_host_only
def test_open_plugin_plan_keeps_adam_off_the_host(plans):
    _, report, trace = plans(OPEN)
    assert "ResourceApplyAdam" not in _ops(trace.graph_after)
    declined = report.patterns["optimizer_update"].declined
    host = {why: n for why, n in declined.items()
            if why.startswith("Adam: ResourceApplyAdam would run on the host")}
    assert sum(host.values()) == VARIABLES, dict(declined)
    why = next(iter(host))
    assert OPEN in why and tf.__version__ in why and "tensorflow/tensorflow#126374" in why


def test_apple_plugin_plan_is_todays(plans):
    backend, report, trace = plans(APPLE)
    default, _, default_trace = plans(None)  # on Linux: Apple's 1.2.0, as before
    assert backend == default and backend.plugin == (APPLE, "1.2.0")
    assert backend.kernels == metal_kernels() and not backend.host_only
    assert _ops(trace.graph_after) == _ops(default_trace.graph_after)
    assert _ops(trace.graph_after)["ResourceApplyAdam"] == VARIABLES
    assert report.patterns["optimizer_update"].fused == VARIABLES
    for node in _fused_nodes(trace.graph_after):
        chain = tuple(s.decode() for s in node.attr["fused_ops"].list.s)
        assert chain in plugin_table(APPLE).fused_ops[node.op]


# -- the optimizer family under each plugin and TensorFlow -------------------------------------
def _step_graph(optimizer) -> GraphView:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(4)])
    model.compile(optimizer, "mse")
    step = tf.function(model.train_step).get_concrete_function(
        (tf.TensorSpec([8, 6]), tf.TensorSpec([8, 4])))
    return GraphView(step.graph.as_graph_def(add_shapes=True).node)


@pytest.mark.parametrize("make, kernel", [
    (keras.optimizers.Adam, "ResourceApplyAdam"),
    (lambda: keras.optimizers.SGD(momentum=0.9), "ResourceApplyKerasMomentum"),
])
def test_optimizer_family_declines_host_only_kernels_and_fuses_them_from_2_22(make, kernel):
    view = _step_graph(make())
    on_2_21 = get_backend("metal", plugin=OPEN, tensorflow="2.21.0")
    matches, declined = find_updates(view, on_2_21)
    assert matches == [] and len(declined) == 4
    assert all(f"{kernel} would run on the host, not the GPU, every step" in d
               for d in declined), declined
    on_2_22 = get_backend("metal", plugin=OPEN, tensorflow="2.22.0")
    assert on_2_22.runs_op(kernel) and not on_2_22.host_only
    matches, _ = find_updates(view, on_2_22)
    assert {m.spec.kernel for m in matches} == {kernel} and len(matches) == 4
    matches, _ = find_updates(view, get_backend("metal", plugin=APPLE))
    assert {m.spec.kernel for m in matches} == {kernel} and len(matches) == 4


def test_a_kernel_the_open_plugin_never_registers_is_declined_as_missing():
    view = _step_graph(keras.optimizers.Adamax())
    matches, declined = find_updates(view, get_backend("metal", plugin=OPEN))
    assert matches == []
    assert all("backend metal has no ResourceApplyAdaMax kernel" in d for d in declined)


# -- what each plugin's backend declares ----------------------------------------------------------
def test_open_backend_declares_what_its_table_registers():
    table = plugin_table(OPEN)
    backend = get_backend("metal", plugin=OPEN, tensorflow="2.21")
    assert backend.name == "metal" and backend.device_type == "GPU" and not backend.available
    assert backend.host_only == table.host_only("2.21")
    assert backend.kernels == frozenset(table.ops) - backend.host_only
    assert {"ResourceApplyAdam", "ResourceGather", "AssignVariableOp"} <= backend.host_only
    desc = backend.description
    assert OPEN in desc and table.version in desc and "TensorFlow 2.21" in desc
    contraction = backend.capability(ContractionKernels)
    assert set(contraction.chains) == {"Conv2D", "MatMul"}  # no _FusedDepthwiseConv2dNative
    for op, by_dtype in contraction.chains.items():
        assert set(by_dtype) == {"float32", "float16"}
        for chains in by_dtype.values():
            assert chains == table.fused_ops[f"_Fused{op}"]
    assert contraction.runs("MatMul", "float16", ("BiasAdd", "GeluApproximate"))
    assert not contraction.runs("MatMul", "bfloat16", ("BiasAdd",))
    assert not contraction.runs("Conv2D", "float32", ("BiasAdd", "Add", "Relu"))
    assert contraction.runs_format("Conv2D", "NCHW")
    bn = backend.capability(BatchNormKernels)
    assert bn.dtypes == table.ops["FusedBatchNormV3"] == {"float32", "float16"}
    assert bn.ex_inference_dtypes == bn.ex_training_dtypes == table.ops["_FusedBatchNormEx"]
    assert kernel_blocker(backend, "_FusedBatchNormEx", "float32", "NCHW", True, 6) is None
    assert "bfloat16" in kernel_blocker(backend, "FusedBatchNormV3", "bfloat16", "NHWC")
    assert "NDHWC" in kernel_blocker(backend, "FusedBatchNormV3", "float32", "NDHWC")
    assert backend.capability(RnnKernels) is None  # it registers no CudnnRNN kernel
    assert not any(op.startswith("CudnnRNN") for op in table.ops)
    assert any("no CudnnRNN" in n for n in backend.notes)


def test_open_backend_from_2_22_runs_the_resource_variable_kernels_on_the_gpu():
    backend = get_backend("metal", plugin=f"{OPEN}==0.4.1", tensorflow="2.22.0")
    assert backend.kernels == frozenset(plugin_table(OPEN).ops)
    assert backend.host_only_reason("ResourceApplyAdam") is None
    # 0.4.1 is built for 2.21 only: the plan says it would not load there.
    assert any("declines to load into 2.22.0" in n for n in backend.notes)


# -- which plugin ``metal`` resolves to -------------------------------------------------------
def test_metal_on_linux_is_apple_1_2_0():
    assert metal_plugins.installed_plugin() is None
    backend = get_backend("metal")
    assert backend.plugin == (APPLE, "1.2.0")
    assert "tensorflow-metal 1.2.0" in backend.description
    assert "TensorFlow 2.18-2.19" in backend.description
    assert backend == get_backend("metal", plugin="tensorflow_metal")


def test_metal_resolves_to_the_installed_plugin(monkeypatch):
    def installed(name, version, tensorflow="2.21.0"):
        monkeypatch.setattr(metal_plugins, "installed_plugin",
                            lambda system=None: InstalledPlugin(name, version, tensorflow))

    installed(OPEN, "0.4.1")
    backend = get_backend("metal")
    assert backend.plugin == (OPEN, "0.4.1") and "ResourceApplyAdam" in backend.host_only
    assert backend == get_backend("metal", plugin=OPEN, tensorflow="2.21.0")
    installed(OPEN, "0.4.1", tensorflow="2.22.0")
    assert not get_backend("metal").host_only
    installed(OPEN, "0.9.0")  # a release tfmx has no table of: the newest it has, said so
    backend = get_backend("metal")
    assert backend.plugin == (OPEN, "0.4.1")
    assert any("0.9.0 is installed" in n for n in backend.notes)
    installed(APPLE, "1.2.0", tensorflow="2.18.0")
    assert get_backend("metal").plugin == (APPLE, "1.2.0")
    # A plan that names a plugin is not moved by what is installed.
    assert get_backend("metal", plugin=OPEN).plugin == (OPEN, "0.4.1")


def test_unknown_plugins_raise_and_name_the_choices():
    with pytest.raises(ValueError) as info:
        get_backend("metal", plugin="metal")
    assert "'metal'" in str(info.value) and APPLE in str(info.value) and OPEN in str(info.value)
    with pytest.raises(ValueError, match=r"no table of tensorflow-metal-plugin 9\.9; tfmx has "
                                         r"\['0\.4\.1'\]"):
        get_backend("metal", plugin=f"{OPEN}==9.9")
    with pytest.raises(ValueError, match="choose one of"):
        tfmx.enable(backend="metal", plugin="apple")
    assert not tfmx.enabled()
    with pytest.raises(ValueError, match="metal backend only"):
        get_backend("cpu", plugin=OPEN)


def test_metal_backend_names_its_plugin_in_the_description():
    for plugin in (APPLE, OPEN):
        backend = metal_backend(plugin)
        table = plugin_table(plugin)
        assert table.version in backend.description and "TensorFlow" in backend.description
        assert backend.describe()["plugin"] == f"{table.name} {table.version}"


# -- on a Mac: the first step checked at run time ------------------------------------------------
@pytest.mark.parametrize("plugin", [APPLE, OPEN])
def test_verify_first_step_is_the_default_where_metal_runs(monkeypatch, plugin):
    """Where the metal backend is present (a Mac with a plugin's GPU), enable() checks each
    traced function's first step against stock (tfmx.verify.FALLBACK): no CI runs Metal."""
    from tfmx import backends, state, verify

    assert verify.FALLBACK == "first-step"
    monkeypatch.setattr(backends, "_present_backends", lambda: frozenset({"cpu", "metal"}))
    try:
        tfmx.enable(backend="metal", plugin=plugin)
        assert state.options().backend.available
        assert state.options().verify == verify.FALLBACK
        tfmx.enable(backend="metal", plugin=plugin, verify=False)  # said: kept
        assert state.options().verify is False
        tfmx.enable(backend="cpu")
        assert state.options().verify is False
    finally:
        tfmx.disable()
    # Off a Mac the plan only traces: nothing runs, nothing to check.
    monkeypatch.undo()
    tfmx.enable(backend="metal", plugin=plugin)
    try:
        assert not state.options().backend.available and state.options().verify is False
    finally:
        tfmx.disable()


def test_the_open_backend_knows_the_dtypes_of_its_kernels():
    """A stage emitting a helper op in the step's dtype can ask the backend: the open plugin
    registers most of its kernels for float32 and float16 only."""
    open_metal = get_backend("metal", plugin=OPEN, tensorflow="2.21")
    table = plugin_table(OPEN)
    for op in ("ConcatV2", "Transpose", "StridedSlice", "MatMul"):
        assert open_metal.runs_op(op, "float32") and open_metal.runs_op(op, "float16")
        assert not open_metal.runs_op(op, "bfloat16"), op
        assert open_metal.runs_op(op)
    assert open_metal.runs_op("Cast", "bfloat16") == ("bfloat16" in table.ops["Cast"])
    assert not open_metal.runs_op("ResourceApplyAdam", "float32")  # host-only under 2.21
    apple = get_backend("metal", plugin=APPLE)  # no dtypes in its table: any
    assert apple.runs_op("ConcatV2", "bfloat16") and not apple.runs_op("Einsum", "float32")
