"""tfmx.backends: the cpu table runs on this machine and matches the composite ops; the metal
plan only uses what the plugin runs; backend names and detection."""

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from helpers import ACTIVATION_ROUNDINGS, TRANSCENDENTAL, float_tolerance, needs_onednn
from tensorflow.core.framework import graph_pb2

import fusion
from fusion.graphs.contraction import ContractionKernels
from tfmx.backends import BACKEND_NAMES, _cpu, detect, get_backend, metal_kernels, onednn_enabled
from tfmx.rebuild import protected_names

ALPHA = 0.3
EPSILON = 0.001
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
FUSED_OP = {"Conv2D": "_FusedConv2D", "MatMul": "_FusedMatMul",
            "DepthwiseConv2dNative": "_FusedDepthwiseConv2dNative"}
METAL_FUSED_OPS = {("BiasAdd",)} | {("BiasAdd", a) for a in ("Relu", "Relu6", "Elu", "LeakyRelu")}
METAL_DTYPES = {tf.float32.as_datatype_enum, tf.float16.as_datatype_enum,
                tf.bfloat16.as_datatype_enum}


# -- (a) every cpu table entry runs and matches the composite ops ------------------------------
def _entries(backend):
    return sorted(
        (op, dtype, chain)
        for op, by_dtype in backend.capability(ContractionKernels).chains.items()
        for dtype, chains in by_dtype.items()
        for chain in chains
    )


def _activation(x, name):
    return {
        None: lambda v: v,
        "Relu": tf.nn.relu,
        "Relu6": tf.nn.relu6,
        "Elu": tf.nn.elu,
        "LeakyRelu": lambda v: tf.nn.leaky_relu(v, ALPHA),
        "Tanh": tf.nn.tanh,
        "Sigmoid": tf.nn.sigmoid,
        "GeluExact": lambda v: tf.nn.gelu(v, approximate=False),
        "GeluApproximate": lambda v: tf.nn.gelu(v, approximate=True),
    }[name](x)


def run_entry(op, dtype, chain, seed=0):
    """Run one fused node (Placeholder inputs, tf.compat.v1.Session) and the composite ops
    (eager, float32, from the same dtype-rounded inputs); return (error, tolerance)."""
    rng = np.random.default_rng(seed)
    npdt = NP_DTYPES[dtype]
    tfdt = tf.as_dtype(dtype)

    def rnd(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32).astype(npdt)

    if op == "MatMul":
        ins = {"a": rnd(2, 5, scale=1.5), "b": rnd(5, 3, scale=1.5)}
        core = tf.matmul(*(tf.constant(v.astype(np.float32)) for v in ins.values()))
    else:
        depthwise = op == "DepthwiseConv2dNative"
        ins = {"x": rnd(1, 5, 5, 2), "f": rnd(3, 3, 2, 2 if depthwise else 3)}
        x, f = (tf.constant(v.astype(np.float32)) for v in ins.values())
        core = (tf.nn.depthwise_conv2d(x, f, [1, 1, 1, 1], "SAME") if depthwise
                else tf.nn.conv2d(x, f, 1, "SAME"))
    channels = core.shape[-1]
    if chain[0] == "FusedBatchNorm":  # args: scale, offset, mean, variance
        args = {"scale": rnd(channels), "offset": rnd(channels), "mean": rnd(channels),
                "variance": np.abs(rnd(channels)) + npdt(0.5)}
        s, o, m, v = (a.astype(np.float32) for a in args.values())
        pre = (core - m) * tf.math.rsqrt(v + EPSILON) * s + o
    else:
        args = {"bias": rnd(channels, scale=2.0)}
        if "Add" in chain:
            args["addend"] = rnd(*core.shape, scale=2.0)
        pre = tf.nn.bias_add(core, args["bias"].astype(np.float32))
        if "Add" in chain:
            pre = pre + args["addend"].astype(np.float32)
    act = chain[-1] if chain[-1] not in ("BiasAdd", "Add", "FusedBatchNorm") else None
    ref = _activation(pre, act).numpy().astype(np.float64)

    g = graph_pb2.GraphDef()
    for name, value in {**ins, **args}.items():
        ph = g.node.add(name=name, op="Placeholder")
        ph.attr["dtype"].type = tfdt.as_datatype_enum
        ph.attr["shape"].shape.CopyFrom(tf.TensorShape(value.shape).as_proto())
    node = g.node.add(name="fused", op=FUSED_OP[op], input=[*ins, *args])
    node.attr["T"].type = tfdt.as_datatype_enum
    node.attr["num_args"].i = len(args)
    node.attr["fused_ops"].list.s.extend(s.encode() for s in chain)
    node.attr["leakyrelu_alpha"].f = ALPHA
    node.attr["epsilon"].f = EPSILON
    if op != "MatMul":
        node.attr["strides"].list.i.extend([1, 1, 1, 1])
        node.attr["padding"].s = b"SAME"
    if op == "Conv2D":
        node.attr["TArgs"].list.type.extend([tfdt.as_datatype_enum] * len(args))
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(g, name="")
        with tf.compat.v1.Session(graph=graph) as sess:
            out = sess.run("fused:0", {f"{k}:0": v for k, v in {**ins, **args}.items()})
    assert out.shape == ref.shape
    # Normalised by the pre-activation scale too: 16-bit rounding of a pre-activation of ~10
    # must not look like a bug next to a bounded output (tanh, sigmoid).
    scale = max(np.abs(ref).max(), np.abs(pre.numpy()).max(), 1e-30)
    err = float(np.abs(out.astype(np.float64) - ref).max() / scale)
    # The kernel rounds in `dtype` (16 bit: possibly after every multiply-add): the reduction's
    # terms, then each fused op's roundings (the batch norm: x - mean, variance + epsilon,
    # rsqrt, two Muls and an Add).
    reduction = {"MatMul": 5, "Conv2D": 3 * 3 * 2, "DepthwiseConv2dNative": 3 * 3}[op]
    roundings = {"BiasAdd": 1, "Add": 1, "FusedBatchNorm": 5 + TRANSCENDENTAL}
    terms = reduction + sum(roundings.get(o, ACTIVATION_ROUNDINGS.get(o, 0)) for o in chain)
    return err, float_tolerance(dtype, terms, 1.0)


@needs_onednn("either")  # the live table is oneDNN's when it is on
@pytest.mark.parametrize("op, dtype, chain", _entries(get_backend("cpu")),
                         ids=lambda v: "+".join(v) if isinstance(v, tuple) else v)
def test_live_cpu_table_entry_runs_and_matches(op, dtype, chain):
    err, tol = run_entry(op, dtype, chain)
    assert err <= tol


@needs_onednn("off")
@pytest.mark.parametrize(
    "op, chain",
    [("Conv2D", ("BiasAdd", "Tanh")), ("Conv2D", ("BiasAdd", "Add", "Relu")),
     ("MatMul", ("BiasAdd", "GeluExact")), ("DepthwiseConv2dNative", ("BiasAdd", "Relu"))],
)
def test_entries_left_out_of_the_live_table_do_not_run(op, chain, cpu):
    assert not cpu.capability(ContractionKernels).runs(op, "float32", chain)
    with pytest.raises(tf.errors.OpError):
        run_entry(op, "float32", chain)


# -- (b) the metal plan ------------------------------------------------------------------------
def _all_nodes(graph_def):
    yield from graph_def.node
    for fdef in graph_def.library.function:
        yield from fdef.node_def


@pytest.fixture(scope="module")
def metal_plan():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(3, 3, activation="relu"),
        keras.layers.DepthwiseConv2D(3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(4, activation="relu"),
        keras.layers.Dense(2),
    ])
    model.compile(optimizer="sgd", loss="mse")
    model.optimizer.build(model.trainable_variables)
    data = (tf.zeros([2, 6, 6, 2]), tf.zeros([2, 2]))
    concrete = tf.function(model.train_step, autograph=False).get_concrete_function(data)
    graph_def = concrete.graph.as_graph_def(add_shapes=True)
    result = fusion.rewrite(graph_def, get_backend("metal"), protected=protected_names(concrete))
    return graph_def, result


def test_metal_plan_uses_only_plugin_kernels(metal_plan):
    _, result = metal_plan
    kernels = metal_kernels()
    fused = [n for n in _all_nodes(result.graph_def) if n.op.startswith("_Fused")]
    assert sorted(n.op for n in fused) == ["_FusedConv2D", "_FusedMatMul", "_FusedMatMul"]
    for node in fused:
        assert node.op in kernels, node.op
        chain = tuple(s.decode() for s in node.attr["fused_ops"].list.s)
        assert chain in METAL_FUSED_OPS, (node.name, chain)
        assert node.attr["T"].type in METAL_DTYPES
        assert node.attr["num_args"].i == 1
    chains = sorted(tuple(s.decode() for s in n.attr["fused_ops"].list.s) for n in fused)
    assert chains == [("BiasAdd",), ("BiasAdd", "Relu"), ("BiasAdd", "Relu")]
    assert not result.errors


def test_metal_plan_leaves_depthwise_unfused(metal_plan):
    graph_def, result = metal_plan
    ops = [n.op for n in _all_nodes(result.graph_def)]
    assert "_FusedDepthwiseConv2dNative" not in ops
    assert ops.count("DepthwiseConv2dNative") == 1
    assert "_FusedDepthwiseConv2dNative" not in metal_kernels()
    assert dict(result.stats["contraction"].declined) == {
        "DepthwiseConv2dNative: metal runs no fused DepthwiseConv2dNative in float32": 1}
    # The training graph keeps its gradients: ReluGrad reads the fused output; every bias's
    # gradient is a BiasAddGrad or, rewritten by bias_grad, a MatMul of ones (both run on metal)
    sums = [n for n in _all_nodes(result.graph_def) if n.name.endswith("/tfmx_bias_grad/sum")]
    assert ops.count("ReluGrad") == 3 and ops.count("BiasAddGrad") + len(sums) == 4


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_metal_plan_16_bit(dtype):
    def f(x, w, b, k, c):
        h = tf.nn.elu(tf.nn.bias_add(tf.nn.conv2d(x, w, 1, "SAME"), b))
        return tf.nn.relu6(tf.nn.bias_add(tf.matmul(tf.reshape(h, [1, 27]), k), c))

    specs = [tf.TensorSpec(s, dtype) for s in ([1, 3, 3, 2], [3, 3, 2, 3], [3], [27, 4], [4])]
    concrete = tf.function(f, autograph=False).get_concrete_function(*specs)
    g = concrete.graph.as_graph_def(add_shapes=True)
    result = fusion.rewrite(g, get_backend("metal"), protected=protected_names(concrete))
    fused = sorted((n.op, tuple(s.decode() for s in n.attr["fused_ops"].list.s), n.attr["T"].type)
                   for n in result.graph_def.node if n.op.startswith("_Fused"))
    enum = dtype.as_datatype_enum
    assert fused == [("_FusedConv2D", ("BiasAdd", "Elu"), enum),
                     ("_FusedMatMul", ("BiasAdd", "Relu6"), enum)]
    assert all(op in metal_kernels() for op, _, _ in fused)


def test_metal_backend_tables_are_within_the_plugin():
    metal = get_backend("metal")
    kernels = metal_kernels()
    assert not metal.available  # no Mac GPU here: a plan only
    for op, by_dtype in metal.capability(ContractionKernels).chains.items():
        assert FUSED_OP[op] in kernels and op in kernels
        assert set(by_dtype) <= {"float32", "float16", "bfloat16"}
        for chains in by_dtype.values():
            assert set(chains) <= METAL_FUSED_OPS


# -- (c) names and detection -------------------------------------------------------------------
def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError) as info:
        get_backend("nope")
    msg = str(info.value)
    assert "'nope'" in msg
    assert all(name in msg for name in BACKEND_NAMES)


def test_detect_is_cpu_here():
    assert detect() == "cpu"
    assert get_backend(None).name == "cpu"
    assert get_backend().description == get_backend("cpu").description


@needs_onednn("either")
def test_cpu_backend_follows_the_live_onednn_setting():
    def chains(backend):
        return backend.capability(ContractionKernels).chains

    assert chains(get_backend("cpu")) == chains(_cpu(onednn_enabled()))
    assert "DepthwiseConv2dNative" in chains(_cpu(True))
    assert "DepthwiseConv2dNative" not in chains(_cpu(False))
    assert get_backend("cpu").available


@needs_onednn("either")
def test_the_report_says_when_onednn_is_off_and_how_to_measure_it():
    """With oneDNN's pass off (TensorFlow's default on CPUs without VNNI/BF16/AMX), the report
    says that stock with it on may be faster, and how to measure both; with it on, nothing."""
    import tfmx
    from tfmx.backends import ONEDNN_OFF_ADVICE

    tfmx.enable(backend="cpu")
    try:
        notes = tfmx.report(reset=True).notes
    finally:
        tfmx.disable()
    assert (ONEDNN_OFF_ADVICE in notes) == (not onednn_enabled())
    assert ("--onednn both" in ONEDNN_OFF_ADVICE and "TF_ENABLE_ONEDNN_OPTS=1" in ONEDNN_OFF_ADVICE)
