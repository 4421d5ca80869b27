"""fusion.graph: tensor references, the editable GraphView, FunctionDef bodies, op_histogram."""

import pytest
import tensorflow as tf
from tensorflow.core.framework import function_pb2

from fusion.graph import FunctionBody, GraphView, NodeDef, op_histogram, parse_input, tensor_ref


# -- references -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ref, expected",
    [
        ("conv", ("conv", 0, False)),
        ("conv:0", ("conv", 0, False)),
        ("conv:1", ("conv", 1, False)),
        ("scope/split:12", ("scope/split", 12, False)),
        ("^init", ("init", -1, True)),
        ("^scope/init", ("scope/init", -1, True)),
        ("odd:name", ("odd:name", 0, False)),  # not a port: the whole string is the name
    ],
)
def test_parse_input(ref, expected):
    assert parse_input(ref) == expected


def test_tensor_ref_round_trip():
    assert tensor_ref("x") == "x"
    assert tensor_ref("x", 0) == "x"
    assert tensor_ref("a/b", 3) == "a/b:3"
    for name, port in [("x", 0), ("a/b", 1), ("s", 10)]:
        assert parse_input(tensor_ref(name, port)) == (name, port, False)


# -- GraphView ----------------------------------------------------------------------------
def _node(name, op, *inputs):
    return NodeDef(name=name, op=op, input=list(inputs))


def _small_view():
    #   a ---> n1 (Neg) ---> s (AddV2 a, n1)
    #   a:1 -> s2 (Split-like consumer of port 1); ^a -> ctl
    return GraphView(
        [
            _node("a", "Unique"),
            _node("n1", "Neg", "a"),
            _node("s", "AddV2", "a", "n1"),
            _node("p1", "Identity", "a:1"),
            _node("ctl", "NoOp", "^a"),
        ]
    )


def _index_is_consistent(view):
    """The consumer index equals one rebuilt from scratch."""
    fresh = GraphView(view.nodes(), protected=view.protected)
    for node in view.nodes():
        got = sorted((c.name, i, p, ctl) for c, i, p, ctl in view.consumer_edges(node.name))
        want = sorted((c.name, i, p, ctl) for c, i, p, ctl in fresh.consumer_edges(node.name))
        assert got == want, node.name
    return True


def test_view_reading():
    view = _small_view()
    assert len(view) == 5 and "a" in view and "zz" not in view
    assert [n.name for n in view] == ["a", "n1", "s", "p1", "ctl"]
    assert view.node("a:1").name == "a" and view.node("^a").name == "a"
    assert view.node("missing") is None
    assert sorted(n.name for n in view.consumers("a")) == ["n1", "s"]
    assert [n.name for n in view.consumers("a", 1)] == ["p1"]
    edges = sorted((c.name, i, p, ctl) for c, i, p, ctl in view.consumer_edges("a"))
    assert edges == [("ctl", 0, -1, True), ("n1", 0, 0, False), ("p1", 0, 1, False),
                     ("s", 0, 0, False)]
    assert view.has_control_edges(view.node("a"))  # a control consumer
    assert view.has_control_edges(view.node("ctl"))  # a control input
    assert not view.has_control_edges(view.node("n1"))
    assert view.data_inputs(_node("x", "AddV2", "a", "^b", "c:1")) == ["a", "c:1"]


def test_view_one_entry_per_edge():
    view = GraphView([_node("a", "Placeholder"), _node("sq", "Mul", "a", "a")])
    assert [n.name for n in view.consumers("a")] == ["sq", "sq"]


def test_view_add_duplicate_raises():
    view = _small_view()
    with pytest.raises(ValueError, match="duplicate node name 'n1'"):
        view.add(_node("n1", "Neg", "a"))


def test_view_add_and_remove_keep_index():
    view = _small_view()
    view.add(_node("n2", "Neg", "n1"))
    assert [n.name for n in view.consumers("n1")] == ["s", "n2"]
    view.remove("n2")
    assert [n.name for n in view.consumers("n1")] == ["s"]
    view.remove("s")
    assert sorted(n.name for n in view.consumers("a")) == ["n1"]
    assert view.consumers("n1") == []
    assert _index_is_consistent(view)


def test_view_replace_same_name_keeps_consumers():
    view = _small_view()
    new = _node("n1", "Abs", "a")
    view.replace("n1", new)
    assert view.node("n1") is new
    assert [n.name for n in view.consumers("n1")] == ["s"]  # consumers of the name survive
    assert sorted(n.name for n in view.consumers("a")) == ["n1", "s"]
    assert _index_is_consistent(view)


def test_view_replace_with_other_name_and_inputs():
    view = _small_view()
    view.replace("n1", _node("m", "Square", "p1"))
    assert "n1" not in view and "m" in view
    assert [n.name for n in view.consumers("p1")] == ["m"]
    assert [n.name for n in view.consumers("a")] == ["s"]
    assert view.dangling_inputs() == ["s <- n1"]
    assert _index_is_consistent(view)


def test_view_replace_input():
    view = _small_view()
    s = view.node("s")
    view.replace_input(s, 1, "a:1")
    assert list(s.input) == ["a", "a:1"]
    assert view.consumers("n1") == []
    assert sorted(n.name for n in view.consumers("a", 1)) == ["p1", "s"]
    view.replace_input(s, 0, "n1")
    assert [n.name for n in view.consumers("n1")] == ["s"]
    assert _index_is_consistent(view)


def test_dangling_inputs():
    view = _small_view()
    assert view.dangling_inputs() == []
    view.remove("a")
    assert sorted(view.dangling_inputs()) == ["ctl <- ^a", "n1 <- a", "p1 <- a:1", "s <- a"]
    assert view.dangling_inputs(external={"a"}) == []
    # The consumer index forgets nothing: re-adding the producer reconnects its consumers.
    view.add(_node("a", "Unique"))
    assert sorted(n.name for n in view.consumers("a")) == ["n1", "s"]


# -- FunctionBody -----------------------------------------------------------------------
def _library(graph_def):
    return {f.signature.name: f for f in graph_def.library.function}


@pytest.fixture(scope="module")
def control_flow_graph():
    """A traced graph whose library holds a while body/cond and cond branches that use
    multi-output ops (Split: one list output arg; Unique: two output args)."""

    def f(x):
        def body(i, y):
            parts = tf.split(y, 3, axis=1)
            return i + 1, tf.concat([parts[2], parts[0], parts[1]], axis=1) * 0.5

        _, y = tf.while_loop(lambda i, y: i < 2, body, [tf.constant(0), x])

        def then():
            uniq, idx = tf.unique(tf.reshape(y, [-1]))
            return tf.reduce_sum(uniq) + tf.cast(tf.reduce_sum(idx), tf.float32)

        return tf.cond(tf.reduce_sum(x) > 0, then, lambda: tf.reduce_sum(y))

    concrete = tf.function(f, autograph=False).get_concrete_function(
        tf.TensorSpec([2, 3], tf.float32)
    )
    return concrete.graph.as_graph_def(add_shapes=True)


def test_function_body_flat_inputs(control_flow_graph):
    library = _library(control_flow_graph)
    assert len(library) == 4  # while body, while cond, then, else
    for fdef in library.values():
        body = FunctionBody(fdef, library)
        assert body.args == {a.name for a in fdef.signature.input_arg}
        for node in body.nodes:
            for ref in node.input:
                name, port, control = parse_input(ref)
                assert ref.count(":") <= 1, ref  # no node:out_arg:index left
                assert control or name in body.args or name in {n.name for n in body.nodes}
        for ref in body.ret.values():
            assert ref.count(":") <= 1
        assert body.protected <= {n.name for n in body.nodes} | body.args
    # Split output 2 and Unique's second output arg (idx) became ports 2 and 1.
    bodies = [FunctionBody(f, library).nodes for f in library.values()]
    loop = next(b for b in bodies if any(n.op == "Split" for n in b))
    concat = next(n for n in loop if n.op == "ConcatV2")
    split = next(n for n in loop if n.op == "Split")
    assert list(concat.input[:3]) == [f"{split.name}:2", split.name, f"{split.name}:1"]
    branch = next(b for b in bodies if any(n.op == "Unique" for n in b))
    uniq = next(n for n in branch if n.op == "Unique")
    readers = [i for n in branch for i in n.input if parse_input(i)[0] == uniq.name]
    assert sorted(readers) == sorted([uniq.name, f"{uniq.name}:1"])


def test_function_body_round_trip(control_flow_graph):
    library = _library(control_flow_graph)
    for name, fdef in library.items():
        body = FunctionBody(fdef, library)
        back = body.to_function_def(body.nodes, library)
        assert back == fdef, name
        for original, copy in zip(fdef.node_def, back.node_def):
            assert list(copy.input) == list(original.input)
        assert dict(back.ret) == dict(fdef.ret)


def test_function_body_rejects_unknown_references():
    fdef = function_pb2.FunctionDef()
    fdef.signature.name = "f"
    fdef.signature.input_arg.add(name="x", type=1)
    node = fdef.node_def.add(name="n", op="Neg")
    node.input.append("x")
    node.attr["T"].type = 1
    bad = fdef.node_def.add(name="m", op="Neg")
    bad.input.append("n:nope:0")
    bad.attr["T"].type = 1
    with pytest.raises(ValueError, match="output arg 'nope' not found"):
        FunctionBody(fdef, {})


def test_op_histogram_counts_library_functions(control_flow_graph):
    hist = op_histogram(control_flow_graph)
    main = [n.op for n in control_flow_graph.node]
    assert "Split" not in main and "Unique" not in main
    assert hist["Split"] == 1 and hist["Unique"] == 1 and hist["ConcatV2"] == 1
    total = len(control_flow_graph.node) + sum(
        len(f.node_def) for f in control_flow_graph.library.function
    )
    assert sum(hist.values()) == total
    assert hist["StatelessWhile"] + hist["While"] == 1
