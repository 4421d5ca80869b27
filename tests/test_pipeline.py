"""fusion.pipeline: transactions per pass and body, function-library rewrites, pattern names."""

import re

import numpy as np
import pytest
import tensorflow as tf
from helpers import FUSED_MATMULS, assert_within_rounding

import fusion
import fusion.graphs  # noqa: F401  (registers the real families before the throwaway ones)
from fusion.family import forget, passes, register, resolve
from tfmx.rebuild import protected_names

F32 = tf.float32
SPECS = (tf.TensorSpec([3, 3], F32), tf.TensorSpec([3, 3], F32), tf.TensorSpec([3], F32))


def _dense(x, w, b):
    return tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w), b))


DENSE_ROUNDINGS = 3 + 1  # a 3-term MatMul, the BiasAdd (Relu is exact)


@pytest.fixture
def throwaway():
    """register(name, fn) a family's pass for one test, run after every built-in one; it is
    removed from the registry afterwards."""
    names = []

    def _register(name, fn):
        register(name, "test-only pattern", after=("onednn",), order="a test's")(fn)
        names.append(name)

    yield _register
    for name in names:
        forget(name)


@pytest.fixture(scope="module")
def dense_graph():
    concrete = tf.function(_dense, autograph=False).get_concrete_function(*SPECS)
    return concrete, concrete.graph.as_graph_def(add_shapes=True)


def _bytes(graph_def):
    """The serialized GraphDef, map entries (attrs) in a deterministic order."""
    return graph_def.SerializeToString(deterministic=True)


def _args(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s.shape.as_list()).astype("float32") for s in SPECS]


# -- transactions ---------------------------------------------------------------------------
def test_raising_pattern_leaves_graph_as_it_was(throwaway, dense_graph, cpu):
    concrete, g = dense_graph

    def boom(view, ctx):
        ctx.stats.matched += 1
        ctx.stats.fuse("boom")
        view.remove("MatMul")
        view.replace("Relu", tf.compat.v1.NodeDef(name="Relu", op="NoOp"))
        raise RuntimeError("boom went off")

    throwaway("boom", boom)
    before = _bytes(g)
    res = fusion.rewrite(g, cpu, patterns=["boom"], protected=protected_names(concrete))
    assert _bytes(res.graph_def) == before
    assert _bytes(g) == before  # the input is never modified
    st = res.stats["boom"]
    assert st.errors == ["main graph: RuntimeError: boom went off"]
    assert res.errors == st.errors
    assert (st.matched, st.fused) == (0, 0) and not res.changed  # the failed pass's stats dropped


def test_a_failing_observer_leaves_the_graph_as_the_pass_before_it_left_it(
        dense_graph, cpu, monkeypatch):
    """An observing family (a stage's graph part: no graph pass) edits nothing and is run
    without a snapshot; where it raises, the graph is the one the passes before it made."""
    from fusion.family import Forms, get

    concrete, g = dense_graph
    protected = protected_names(concrete)
    fused = fusion.rewrite(g, cpu, patterns=["contraction"], protected=protected)
    assert fused.stats["contraction"].fused == 1
    observer = next(f.name for f in passes(None) if f.graph_pass is None and f.run is not None)
    assert get(observer).forms.observed

    def boom(self, view):
        raise RuntimeError("observer went off")

    monkeypatch.setattr(Forms, "units", boom)
    res = fusion.rewrite(g, cpu, patterns=["contraction", observer], protected=protected)
    assert _bytes(res.graph_def) == _bytes(fused.graph_def)
    assert res.stats[observer].errors == ["main graph: RuntimeError: observer went off"]
    assert res.stats["contraction"].fused == 1


def test_raising_pattern_after_a_good_one_keeps_the_good_one(throwaway, dense_graph, cpu):
    concrete, g = dense_graph

    def boom(view, ctx):
        view.remove("Relu")
        raise ValueError("late failure")

    throwaway("boom_late", boom)
    res = fusion.rewrite(g, cpu, patterns=["contraction", "boom_late"],
                         protected=protected_names(concrete))
    assert [n.op for n in res.graph_def.node if n.name == "Relu"] == ["_FusedMatMul"]
    assert res.stats["contraction"].fused == 1
    assert res.stats["boom_late"].errors == ["main graph: ValueError: late failure"]


def test_raising_pattern_after_replace_input_leaves_graph_as_it_was(throwaway, dense_graph,
                                                                    cpu):
    concrete, g = dense_graph

    def boom(view, ctx):
        view.replace_input(view.node("Relu"), 0, "MatMul")
        raise RuntimeError("boom after an in-place edit")

    throwaway("boom_in_place", boom)
    res = fusion.rewrite(g, cpu, patterns=["boom_in_place"], protected=protected_names(concrete))
    assert res.stats["boom_in_place"].errors
    relu = next(n for n in res.graph_def.node if n.name == "Relu")
    assert list(relu.input) == ["BiasAdd"]  # fails: ["MatMul"], the undone edit leaked out


def test_dangling_input_is_undone(throwaway, dense_graph, cpu):
    concrete, g = dense_graph

    def dangle(view, ctx):
        ctx.stats.fuse("dangle")
        view.remove("MatMul")  # BiasAdd still reads it

    throwaway("dangle", dangle)
    res = fusion.rewrite(g, cpu, patterns=["dangle"], protected=protected_names(concrete))
    assert _bytes(res.graph_def) == _bytes(g)
    (err,) = res.stats["dangle"].errors
    assert err.startswith("main graph: RuntimeError: rewrite left inputs pointing nowhere")
    assert "BiasAdd <- MatMul" in err
    assert res.stats["dangle"].fused == 0 and not res.changed


def test_function_arguments_are_not_dangling(throwaway, cpu):
    # A body may read its arguments; only names that are neither nodes nor args dangle.
    g = _loop_and_cond_graph()[1]
    seen = []

    def look(view, ctx):
        seen.append(view.dangling_inputs())

    throwaway("look", look)
    res = fusion.rewrite(g, cpu, patterns=["look"])
    assert not res.errors
    assert seen[0] == []  # main graph
    assert any(d for d in seen[1:])  # bodies read their args ...
    assert res.graph_def == g  # ... and still nothing was flagged or changed


def test_raising_pattern_in_a_function_body(throwaway, cpu):
    concrete, g = _loop_and_cond_graph()

    def boom_in_body(view, ctx):
        if any(n.op == "MatMul" for n in view) and "x" not in view:
            view.remove(next(n.name for n in view if n.op == "MatMul"))
            raise KeyError("inside a body")

    throwaway("boom_body", boom_in_body)
    res = fusion.rewrite(g, cpu, patterns=["boom_body"], protected=protected_names(concrete))
    assert _bytes(res.graph_def) == _bytes(g)
    assert res.renamed_functions == {}
    errors = res.stats["boom_body"].errors
    assert len(errors) == 2
    assert {e.split(":")[0] for e in errors} == {
        f.signature.name for f in g.library.function
        if any(n.op == "MatMul" for n in f.node_def)}


# -- control flow ---------------------------------------------------------------------------
def _loop_and_cond(x, w, b):
    def body(i, y):
        return i + 1, _dense(y, w, b) * 0.5

    _, y = tf.while_loop(lambda i, y: i < 3, body, [tf.constant(0), x])
    return tf.cond(tf.reduce_sum(x) > 0, lambda: _dense(y, w, b), lambda: y - 1.0)


# three loop steps (a dense and * 0.5 each), then a dense or - 1.0
LOOP_AND_COND_ROUNDINGS = 3 * (DENSE_ROUNDINGS + 1) + DENSE_ROUNDINGS


def _loop_and_cond_graph():
    concrete = tf.function(_loop_and_cond, autograph=False).get_concrete_function(*SPECS)
    return concrete, concrete.graph.as_graph_def(add_shapes=True)


def _func_refs(graph_def):
    """Every function name referenced by a node attr, in the main graph and the library."""
    refs = []
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    for node in nodes:
        for key, attr in node.attr.items():
            if attr.HasField("func"):
                refs.append((node.op, key, attr.func.name))
    return refs


def _session_run(graph_def, feeds, fetch="Identity:0"):
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
        with tf.compat.v1.Session(graph=graph) as sess:
            return sess.run(fetch, {f"{k}:0": v for k, v in feeds.items()})


@pytest.fixture(scope="module")
def loop_and_cond(cpu):
    concrete, g = _loop_and_cond_graph()
    res = fusion.rewrite(g, cpu, protected=protected_names(concrete))
    return concrete, g, res


def test_contraction_fused_inside_while_and_cond(loop_and_cond):
    _, g, res = loop_and_cond
    old = {f.signature.name: f for f in g.library.function}
    new = {f.signature.name: f for f in res.graph_def.library.function}
    changed = {n for n, f in old.items() if any(x.op == "MatMul" for x in f.node_def)}
    assert len(changed) == 2
    assert set(res.renamed_functions) == changed
    for name in changed:
        renamed = res.renamed_functions[name]
        assert re.fullmatch(re.escape(name) + r"_tfmx_[0-9a-f]{12}", renamed)
        assert name not in new and renamed in new
        body = new[renamed]
        fused = [n for n in body.node_def if n.op in FUSED_MATMULS]
        assert len(fused) == 1
        assert [s.decode() for s in fused[0].attr["fused_ops"].list.s] == ["BiasAdd", "Relu"]
        assert not {"MatMul", "BiasAdd", "Relu"} & {n.op for n in body.node_def}
        assert body.signature.input_arg == old[name].signature.input_arg
        assert body.signature.output_arg == old[name].signature.output_arg
        # The readers of the fused node use its FunctionDef output arg name.
        readers = [i for n in body.node_def for i in n.input
                   if i.split(":")[0] == fused[0].name]
        readers += [r for r in body.ret.values() if r.split(":")[0] == fused[0].name]
        assert readers and all(r == f"{fused[0].name}:product:0" for r in readers)
    unchanged = set(old) - changed
    assert unchanged <= set(new) and all(new[n] == old[n] for n in unchanged)
    st = res.stats["contraction"]
    assert st.fused == 2 and dict(st.fused_kinds) == {"_FusedMatMul(BiasAdd, Relu)": 2}
    assert res.skipped_functions == {} and res.errors == []


def test_every_reference_to_a_renamed_function_is_updated(loop_and_cond):
    _, g, res = loop_and_cond
    names = {f.signature.name for f in res.graph_def.library.function}
    refs = _func_refs(res.graph_def)
    assert refs and all(name in names for _, _, name in refs)
    assert not {name for _, _, name in refs} & set(res.renamed_functions)
    by_key = {(op, key): name for op, key, name in refs}
    loop = next(op for op, _, _ in refs if op.endswith("While"))
    cond = next(op for op, _, _ in refs if op.endswith("If"))
    old_refs = {(op, key): name for op, key, name in _func_refs(g)}
    assert by_key[(loop, "body")] == res.renamed_functions[old_refs[(loop, "body")]]
    assert by_key[(loop, "cond")] == old_refs[(loop, "cond")]
    assert by_key[(cond, "then_branch")] == res.renamed_functions[old_refs[(cond, "then_branch")]]
    assert by_key[(cond, "else_branch")] == old_refs[(cond, "else_branch")]


def test_rewritten_library_computes_the_same_numbers(loop_and_cond):
    concrete, _, res = loop_and_cond
    x, w, b = _args()
    for sign in (1.0, -1.0):  # both branches of the cond
        xs = np.abs(x) * sign
        got = _session_run(res.graph_def, {"x": xs, "w": w, "b": b})
        want = concrete(tf.constant(xs), tf.constant(w), tf.constant(b)).numpy()
        assert_within_rounding(got, want, LOOP_AND_COND_ROUNDINGS, what=f"sign {sign}")


def test_rebuilt_function_with_rewritten_library_runs(loop_and_cond, assert_same_numbers):
    concrete, _, res = loop_and_cond
    x, w, b = (tf.constant(a) for a in _args())
    assert_same_numbers(concrete, res, tf.abs(x), w, b, terms=LOOP_AND_COND_ROUNDINGS)


def test_caller_of_a_changed_function_is_renamed_too(cpu):
    def f(x, w, b):
        def then():
            _, y = tf.while_loop(lambda i, y: i < 2, lambda i, y: (i + 1, _dense(y, w, b)),
                                 [tf.constant(0), x])
            return y

        return tf.cond(tf.reduce_sum(x) > 0, then, lambda: x)

    concrete = tf.function(f, autograph=False).get_concrete_function(*SPECS)
    g = concrete.graph.as_graph_def(add_shapes=True)
    res = fusion.rewrite(g, cpu, protected=protected_names(concrete))
    assert res.stats["contraction"].fused == 1
    old_refs = {(op, key): name for op, key, name in _func_refs(g)}
    then_old = next(n for (op, k), n in old_refs.items() if k == "then_branch")
    body_old = next(n for (op, k), n in old_refs.items() if k == "body")
    assert set(res.renamed_functions) == {then_old, body_old}  # the body and its caller
    names = {fn.signature.name for fn in res.graph_def.library.function}
    assert all(n in names for _, _, n in _func_refs(res.graph_def))
    new_refs = {(op, key): name for op, key, name in _func_refs(res.graph_def)}
    assert next(n for (op, k), n in new_refs.items() if k == "body") == \
        res.renamed_functions[body_old]
    assert next(n for (op, k), n in new_refs.items() if k == "then_branch") == \
        res.renamed_functions[then_old]
    x, w, b = _args(1)
    got = _session_run(res.graph_def, {"x": np.abs(x), "w": w, "b": b})
    want = concrete(*(tf.constant(a) for a in (np.abs(x), w, b))).numpy()
    assert_within_rounding(got, want, 2 * DENSE_ROUNDINGS)  # two loop steps


def test_rewritten_functions_are_named_by_their_content(cpu):
    """The same rewrite gives the same names (no process-wide counter); a different rewrite of
    the same functions never reuses one (one name is one body in TensorFlow's function
    library)."""
    _, g = _loop_and_cond_graph()
    first = fusion.rewrite(g, cpu).renamed_functions
    second = fusion.rewrite(g, cpu).renamed_functions
    assert first == second and first
    changed = type(g)()
    changed.CopyFrom(g)
    body = next(f for f in changed.library.function if f.signature.name in first)
    for node in body.node_def:  # some are fused away: mark every one
        node.attr["_marker"].s = b"another body under the same name"
    other = fusion.rewrite(changed, cpu).renamed_functions
    assert first.keys() == other.keys()
    assert other[body.signature.name] != first[body.signature.name]
    assert all(other[name] == first[name] for name in first if name != body.signature.name)


# -- family names -----------------------------------------------------------------------------
def test_resolve_unknown_pattern_lists_choices():
    with pytest.raises(ValueError) as info:
        resolve(["contraction", "nope"])
    msg = str(info.value)
    assert "'nope'" in msg and "choose from" in msg and "contraction" in msg
    assert "'contraction'" not in msg.split("choose from")[0]  # only the unknown name is blamed


def test_rewrite_with_unknown_pattern_raises(dense_graph, cpu):
    with pytest.raises(ValueError, match="unknown family"):
        fusion.rewrite(dense_graph[1], cpu, patterns=["nope"])


def test_resolve_known_names_and_exclude():
    assert resolve("contraction") == ("contraction",)
    assert resolve(["onednn", "contraction"]) == ("contraction", "onednn")  # pipeline order
    assert resolve(None) is None  # every family
    everything = [f.name for f in passes(None)]
    assert everything == fusion.available_patterns()
    assert resolve(None, exclude=["onednn"]) == tuple(everything[:-1])
    assert resolve(["contraction", "casts"], exclude="casts") == ("contraction",)
    with pytest.raises(ValueError, match="unknown family 'onednm'"):
        resolve(None, exclude=["onednm"])


def test_throwaway_patterns_are_gone():
    assert not {"boom", "boom_late", "boom_in_place", "dangle", "look", "boom_body"} & set(
        fusion.available_patterns())


def test_the_pass_order_comes_from_the_declarations_and_keeps_their_reasons():
    """Each family's ``after`` (with its ``order``) orders the pipeline: a family that reads
    another's output runs after it; dedupe after every family but onednn; onednn last."""
    from fusion.family import families

    declared = families()
    order = [f.name for f in declared]
    for f in declared:
        for name in f.after:
            if name != "*":
                assert order.index(name) < order.index(f.name), (name, f.name)
        assert not f.after or f.order, f"{f.name}: its place has no reason"
    before = [("reshaped_bias", "contraction"), ("contraction", "conv_bn_fold"),
              ("conv_bn_fold", "batch_norm"), ("optimizer_update", "dedupe"),
              ("casts", "dedupe"), ("contraction", "onednn"), ("batch_norm", "onednn"),
              ("bias_grad", "matmul_layout"), ("dedupe", "onednn")]
    for first, then in before:
        assert order.index(first) < order.index(then), (first, then)
    assert order[-2:] == ["dedupe", "onednn"]


def test_a_cycle_in_the_declarations_is_refused():
    from fusion.family import _ordered

    a = fusion.family.Family("a", "", after=("b",))
    b = fusion.family.Family("b", "", after=("a",))
    with pytest.raises(ValueError, match="cycle"):
        _ordered({"a": a, "b": b})
