"""Turn a traced ConcreteFunction and a rewritten GraphDef into a callable ConcreteFunction.

The new function has the same structured signature (so it is called exactly like the original),
the same captured tensors (variable handles and constants, re-bound to the same external
values), the same outputs and the same control outputs (every variable update still runs).

:func:`rebuild` writes the rewritten graph as a FunctionDef straight into the runtime and wraps
it in a one-op graph that calls it: no Python ``Operation`` is created per node, so a
ResNet-50 train step rebuilds in a fraction of a second. TensorFlow inlines the call when it
instantiates the function. :func:`rebuild_imported` imports every node into a new FuncGraph
instead: slower, but the result can be differentiated (its graph holds the ops themselves).

Example:
    >>> import tensorflow as tf
    >>> from tfmx.rebuild import rebuild
    >>> v = tf.Variable(2.0)
    >>> cf = tf.function(lambda x: x * v).get_concrete_function(tf.TensorSpec([], tf.float32))
    >>> same = rebuild(cf, cf.graph.as_graph_def())
    >>> float(same(tf.constant(3.0)))
    6.0
"""

from __future__ import annotations

import hashlib

import tensorflow as tf
from tensorflow.core.framework import function_pb2, graph_pb2
from tensorflow.python.eager import context
from tensorflow.python.eager.polymorphic_function import atomic_function
from tensorflow.python.eager.polymorphic_function import concrete_function as cf_lib
from tensorflow.python.framework import auto_control_deps_utils as acd
from tensorflow.python.framework import func_graph as func_graph_lib
from tensorflow.python.framework import importer, ops
from tensorflow.python.ops import array_ops, handle_data_util

from fusion.graph import function_def_ref, output_sizes, parse_input
from fusion.pipeline import unused_function_name


def _strip(graph_def: graph_pb2.GraphDef, names: set[str]) -> graph_pb2.GraphDef:
    """A copy of ``graph_def`` without the nodes called ``names``."""
    out = graph_pb2.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    out.node.extend(n for n in graph_def.node if n.name not in names)
    return out


def _register_library(graph_def: graph_pb2.GraphDef) -> None:
    """Make the (renamed, rewritten) library functions known to the eager runtime."""
    ctx = context.context()
    for fdef in graph_def.library.function:
        if not ctx.has_function(fdef.signature.name):
            ctx.add_function_def(fdef)


def _content_digest(graph_def: graph_pb2.GraphDef,
                    concrete: tf.types.experimental.ConcreteFunction,
                    control_renames: dict[str, str] | None) -> str:
    """A name part for the rebuilt function, from what it computes and the function it
    replaces: rebuilding the same graph twice registers one function, never two names (and
    never one name for two different bodies)."""
    digest = hashlib.sha256(graph_def.SerializeToString(deterministic=True))
    digest.update(concrete.function_def.SerializeToString(deterministic=True))
    digest.update(repr(sorted((control_renames or {}).items())).encode())
    return digest.hexdigest()[:16]


def protected_names(concrete: tf.types.experimental.ConcreteFunction) -> set[str]:
    """Nodes a rewrite must keep as they are: the inputs and the fetched outputs."""
    graph = concrete.graph
    names = {t.op.name for t in graph.inputs}
    names.update(t.op.name for t in graph.outputs)
    return names


def control_output_names(concrete: tf.types.experimental.ConcreteFunction) -> set[str]:
    """Nodes that must run (variable updates...); a rewrite may replace them by their work."""
    return {op.name for op in concrete.graph.control_outputs}


def _prepare(
    concrete: tf.types.experimental.ConcreteFunction, graph_def: graph_pb2.GraphDef
) -> func_graph_lib.FuncGraph:
    """Check ``concrete``'s captures can be re-bound, register the library; the old graph."""
    old = concrete.graph
    for external, _ in old.captures:
        if not isinstance(external, tf.Tensor) or (
            not hasattr(external, "numpy") and external.graph is not old.outer_graph
        ):
            raise ValueError(
                f"capture {external!r} is a symbolic tensor of another graph; "
                "only eager captures (variables, constants) can be re-bound"
            )
    _register_library(graph_def)
    return old


def _new_signature_graph(
    concrete: tf.types.experimental.ConcreteFunction, name: str
) -> tuple[func_graph_lib.FuncGraph, dict[str, tf.Tensor]]:
    """A FuncGraph with placeholders for the arguments and the same captures as ``concrete``.

    Returns the graph and a map from each old input tensor name to its new placeholder; the
    graph's ``inputs`` are in the same order as the old graph's.
    """
    old = concrete.graph
    by_value = {id(internal): external for external, internal in old.captures}
    old_captures = old.function_captures
    by_ref = {id(t): key for key, t in old_captures.by_ref_internal.items()}  # call-time values
    graph = func_graph_lib.FuncGraph(name)
    input_map: dict[str, tf.Tensor] = {}
    with graph.as_default():
        for ph in old.inputs:
            if id(ph) in by_value:
                new_ph = graph.capture(by_value[id(ph)], name=ph.op.name)
            else:
                new_ph = array_ops.placeholder(ph.dtype, ph.shape, name=ph.op.name)
                handle_data_util.copy_handle_data(ph, new_ph)
                key = by_ref.get(id(ph))
                if key is not None:
                    graph.function_captures.add_or_replace(
                        key=key,
                        external=old_captures.by_ref_external[key],
                        internal=new_ph,
                        tracetype=old_captures.by_ref_tracetype[key],
                        is_by_ref=True,
                    )
            input_map[ph.name] = new_ph
        graph.inputs = [input_map[ph.name] for ph in old.inputs]
    return graph, input_map


def _finish(
    concrete: tf.types.experimental.ConcreteFunction,
    graph: func_graph_lib.FuncGraph,
    outputs: list[tf.Tensor],
    control_outputs: list,
) -> tf.types.experimental.ConcreteFunction:
    old = concrete.graph
    graph.outputs = outputs
    graph.control_outputs = control_outputs
    old_to_new = {id(t): new for t, new in zip(old.outputs, outputs)}
    graph.structured_outputs = tf.nest.map_structure(
        lambda t: old_to_new.get(id(t), t) if isinstance(t, tf.Tensor) else t,
        old.structured_outputs,
        expand_composites=True,
    )
    graph.structured_input_signature = old.structured_input_signature
    graph.variables = old.variables
    return cf_lib.ConcreteFunction.from_func_graph(graph, concrete.function_type, attrs={})


def to_function_def(
    graph_def: graph_pb2.GraphDef,
    template: function_pb2.FunctionDef,
    inputs: list[str],
    outputs: list[str],
    name: str,
    control_renames: dict[str, str] | None = None,
) -> function_pb2.FunctionDef:
    """``graph_def``'s main graph as a FunctionDef with ``template``'s signature.

    ``inputs`` are the placeholder node names in the order of ``template``'s input args,
    ``outputs`` the returned tensor names (``node:port``) in the order of its output args.
    Control outputs are ``template``'s, with ``control_renames`` applied.

    >>> import tensorflow as tf
    >>> cf = tf.function(lambda x: tf.nn.relu(x)).get_concrete_function(tf.TensorSpec([2]))
    >>> fdef = to_function_def(cf.graph.as_graph_def(), cf.function_def,
    ...                        [t.op.name for t in cf.graph.inputs],
    ...                        [t.name for t in cf.graph.outputs], "relu_copy")
    >>> sorted(n.op for n in fdef.node_def), fdef.signature.name
    (['Identity', 'Relu'], 'relu_copy')
    """
    library = {f.signature.name: f for f in graph_def.library.function}
    args = dict(zip(inputs, (a.name for a in template.signature.input_arg)))
    sizes = {n.name: output_sizes(n, library) for n in graph_def.node if n.name not in args}

    def nested(ref: str) -> str | None:
        producer, _, control = parse_input(ref)
        if producer in args:
            return None if control else args[producer]
        return ref if control else function_def_ref(ref, sizes.get(producer))

    out = function_pb2.FunctionDef()
    out.signature.CopyFrom(template.signature)
    out.signature.name = name
    for key in ("attr", "arg_attr", "resource_arg_unique_id"):
        getattr(out, key).MergeFrom(getattr(template, key))
    for node in graph_def.node:
        if node.name in args:
            continue
        copy = out.node_def.add()
        copy.CopyFrom(node)
        del copy.input[:]
        copy.input.extend(r for r in map(nested, node.input) if r is not None)
    for arg, ref in zip(template.signature.output_arg, outputs):
        out.ret[arg.name] = nested(ref)
    renames = control_renames or {}
    for key, node_name in template.control_ret.items():
        out.control_ret[key] = renames.get(node_name, node_name)
    return out


def _library_functions(
    concrete: tf.types.experimental.ConcreteFunction, graph_def: graph_pb2.GraphDef
) -> list[atomic_function.AtomicFunction]:
    """Runtime handles for every function ``graph_def``'s library holds."""
    known = dict(concrete.graph._functions)  # noqa: SLF001 - the old graph's own functions
    ctx = context.context()
    children = []
    for fdef in graph_def.library.function:
        fn = known.get(fdef.signature.name)
        if fn is None:
            fn = atomic_function.AtomicFunction(
                fdef.signature.name, ctx, concrete.function_type.__class__([])
            )
        children.append(fn)
    return children


def rebuild(
    concrete: tf.types.experimental.ConcreteFunction,
    graph_def: graph_pb2.GraphDef,
    control_renames: dict[str, str] | None = None,
    name_suffix: str = "tfmx",
) -> tf.types.experimental.ConcreteFunction:
    """A ConcreteFunction running ``graph_def`` in place of ``concrete``'s own graph.

    ``graph_def`` must keep the names of ``concrete``'s placeholders and fetched outputs
    (:func:`protected_names`); control outputs it replaced are named in ``control_renames``.
    The rewritten graph becomes a runtime function called from a one-op wrapper graph (see
    the module doc). Raises ValueError for captures that cannot be re-bound (a symbolic tensor
    of another graph).
    """
    old = _prepare(concrete, graph_def)
    children = _library_functions(concrete, graph_def)
    inner_name = unused_function_name(
        f"{old.name}_{name_suffix}_{_content_digest(graph_def, concrete, control_renames)}")
    fdef = to_function_def(
        graph_def,
        concrete.function_def,
        [t.op.name for t in old.inputs],
        [t.name for t in old.outputs],
        inner_name,
        control_renames,
    )
    ctx = context.context()
    ctx.add_function_def(fdef)
    inner = atomic_function.AtomicFunction(
        inner_name,
        ctx,
        concrete.function_type.__class__([]),
        children,
        atomic_function.CallOptions(
            collective_manager_ids_used=getattr(old, "collective_manager_ids_used", []),
            control_captures=set(),
            is_stateful=True,
        ),
    )
    graph, input_map = _new_signature_graph(concrete, f"{old.name}_{name_suffix}")
    with graph.as_default():
        graph._add_function_recursive(inner)  # noqa: SLF001
        call = atomic_function.partitioned_call_op(
            name=inner_name,
            args=[input_map[t.name] for t in old.inputs],
            is_stateful=True,
            tout=[t.dtype.as_datatype_enum for t in old.outputs],
            config=ctx.function_call_options.config_proto_serialized,
            executor_type=ctx.function_call_options.executor_type,
        )
        ops.set_int_list_attr(
            call, acd.READ_ONLY_RESOURCE_INPUTS_ATTR,
            acd.get_read_only_resource_input_indices_graph(old),
        )
    outputs = list(call.outputs)
    for new, old_t in zip(outputs, old.outputs):
        new.set_shape(old_t.shape)
        handle_data_util.copy_handle_data(old_t, new)
    return _finish(concrete, graph, outputs, [call])


def rebuild_imported(
    concrete: tf.types.experimental.ConcreteFunction,
    graph_def: graph_pb2.GraphDef,
    control_renames: dict[str, str] | None = None,
    name_suffix: str = "tfmx",
) -> tf.types.experimental.ConcreteFunction:
    """Like :func:`rebuild`, but every node is imported into the new function's own graph.

    Slower for big graphs; use it when the result must be differentiable (a GradientTape
    builds the backward from the graph's ops).
    """
    old = _prepare(concrete, graph_def)
    graph, input_map = _new_signature_graph(concrete, f"{old.name}_{name_suffix}")
    renames = control_renames or {}
    with graph.as_default():
        fetch_tensors = [t.name for t in old.outputs if t.name not in input_map]
        fetch_ops = sorted({renames.get(op.name, op.name) for op in old.control_outputs})
        stripped = _strip(graph_def, {t.op.name for t in old.inputs})
        returned = importer.import_graph_def(
            stripped,
            input_map=input_map,
            return_elements=fetch_tensors + fetch_ops,
            name="",
        )
    by_name = dict(zip(fetch_tensors, returned[: len(fetch_tensors)]))
    by_name.update(input_map)
    outputs = [by_name[t.name] for t in old.outputs]
    return _finish(concrete, graph, outputs, list(returned[len(fetch_tensors):]))
