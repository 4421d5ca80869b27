"""Turn a traced ConcreteFunction and a rewritten GraphDef into a callable ConcreteFunction.

The new function has the same structured signature (so it is called exactly like the original),
the same captured tensors (variable handles and constants, re-bound to the same external
values), the same outputs and the same control outputs (every variable update still runs).

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

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.eager import context
from tensorflow.python.eager.polymorphic_function import concrete_function as cf_lib
from tensorflow.python.framework import func_graph as func_graph_lib
from tensorflow.python.framework import importer
from tensorflow.python.ops import array_ops, handle_data_util


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


def protected_names(concrete: tf.types.experimental.ConcreteFunction) -> set[str]:
    """Nodes a rewrite must keep: inputs, fetched outputs and control outputs."""
    graph = concrete.graph
    names = {t.op.name for t in graph.inputs}
    names.update(t.op.name for t in graph.outputs)
    names.update(op.name for op in graph.control_outputs)
    return names


def rebuild(
    concrete: tf.types.experimental.ConcreteFunction,
    graph_def: graph_pb2.GraphDef,
    name_suffix: str = "tfmx",
) -> tf.types.experimental.ConcreteFunction:
    """A ConcreteFunction running ``graph_def`` in place of ``concrete``'s own graph.

    ``graph_def`` must keep the names of ``concrete``'s placeholders, outputs and control
    outputs (:func:`protected_names`). Raises ValueError for captures that cannot be re-bound
    (a symbolic tensor of another graph).
    """
    old = concrete.graph
    _register_library(graph_def)
    captures = list(old.captures)
    for external, _ in captures:
        if not isinstance(external, tf.Tensor) or (
            not hasattr(external, "numpy") and external.graph is not old.outer_graph
        ):
            raise ValueError(
                f"capture {external!r} is a symbolic tensor of another graph; "
                "only eager captures (variables, constants) can be re-bound"
            )
    internal_ids = {id(t) for _, t in captures}
    arg_placeholders = [t for t in old.inputs if id(t) not in internal_ids]

    graph = func_graph_lib.FuncGraph(f"{old.name}_{name_suffix}")
    with graph.as_default():
        input_map = {}
        new_inputs = []
        for ph in arg_placeholders:
            new_ph = array_ops.placeholder(ph.dtype, ph.shape, name=ph.op.name)
            handle_data_util.copy_handle_data(ph, new_ph)
            input_map[ph.name] = new_ph
            new_inputs.append(new_ph)
        for external, internal in captures:
            new_internal = graph.capture(external, name=internal.op.name)
            input_map[internal.name] = new_internal
        graph.inputs = new_inputs + list(graph.internal_captures)

        fetch_tensors = [t.name for t in old.outputs if t.name not in input_map]
        fetch_ops = [op.name for op in old.control_outputs]
        stripped = _strip(graph_def, {t.op.name for t in old.inputs})
        returned = importer.import_graph_def(
            stripped,
            input_map=input_map,
            return_elements=fetch_tensors + fetch_ops,
            name="",
        )
    by_name = dict(zip(fetch_tensors, returned[: len(fetch_tensors)]))
    by_name.update(input_map)
    graph.outputs = [by_name[t.name] for t in old.outputs]
    graph.control_outputs = list(returned[len(fetch_tensors):])
    old_to_new = {id(t): by_name[t.name] for t in old.outputs}
    graph.structured_outputs = tf.nest.map_structure(
        lambda t: old_to_new.get(id(t), t) if isinstance(t, tf.Tensor) else t,
        old.structured_outputs,
        expand_composites=True,
    )
    graph.structured_input_signature = old.structured_input_signature
    graph.variables = old.variables
    return cf_lib.ConcreteFunction.from_func_graph(graph, concrete.function_type, attrs={})
