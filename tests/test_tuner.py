"""The tuner: decisions from injected timings, modes, the per-machine cache, fragments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tensorflow as tf

import fusion
import tfmx
from fusion.fragment import FragmentError, cut, make_inputs, runner, variant
from fusion.graph import GraphView, op_histogram
from tfmx import fit_plan
from tfmx import tuner as tuner_mod
from tfmx.backends import get_backend
from tfmx.tuner import Tuner, TuningCache


def _timer(times):
    calls = []

    def timer(candidates, seconds):
        calls.append(sorted(candidates))
        return {name: times[name] for name in candidates}

    timer.calls = calls
    return timer


def _fail(candidates, seconds):
    raise AssertionError("the tuner measured although it should not")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TFMX_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_picks_the_faster_form_from_injected_timings():
    for times, expected in (({"stock": 2.0, "fused": 1.0}, "fused"),
                            ({"stock": 1.0, "fused": 2.0}, "stock"),
                            ({"stock": 1.0, "fused": 1.0}, "stock")):  # a tie: conservative
        d = Tuner("auto", None, _timer(times)).choose("f", "s", {"stock": None, "fused": None},
                                                      conservative="stock")
        assert d.choice == expected and d.source == "measured"
        assert d.times_ms == {k: v * 1e3 for k, v in times.items()}


def _rounds(**samples):
    return lambda candidates, seconds: tuner_mod.Timings(samples)


def test_a_form_faster_within_noise_keeps_the_conservative_one(cache_dir):
    # the fused median is lower, but it won 5 of 8 rounds: chance gives that 36% of the time
    samples = {"stock": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
               "fused": [0.9, 0.9, 0.9, 1.1, 1.1, 0.9, 1.2, 0.95]}
    d = Tuner("auto", TuningCache.for_backend("cpu"), _rounds(**samples)).choose(
        "f", "s", {"stock": None, "fused": None}, conservative="stock")
    assert d.choice == "stock" and d.source == "measured"
    assert d.times_ms["fused"] < d.times_ms["stock"]
    assert "5 of 8 rounds" in d.note and "within noise" in d.describe()
    again = TuningCache.for_backend("cpu").get(d.key)  # the note is cached with the choice
    assert (again.choice, again.note) == ("stock", d.note)


def test_a_form_faster_in_every_round_is_kept():
    samples = {"stock": [1.0] * 8, "fused": [0.97, 0.98, 0.99, 0.97, 0.9, 0.95, 0.99, 0.98]}
    d = Tuner("auto", None, _rounds(**samples)).choose(
        "f", "s", {"stock": None, "fused": None}, conservative="stock")
    assert d.choice == "fused" and d.note == ""


def test_a_region_within_noise_of_a_kernel_form_keeps_the_kernel_form():
    """Both beat the conservative form in every round; the region's lower median won 5 of 8
    rounds against the kernel form: the kernel form is kept, and the note says why."""
    samples = {"composite": [2.0] * 8, "kernel": [1.0] * 8,
               "residual xla": [0.9, 0.9, 0.9, 1.1, 1.1, 0.9, 1.2, 0.95]}
    d = Tuner("auto", None, _rounds(**samples)).choose(
        "f", "s", dict.fromkeys(samples), conservative="composite")
    assert d.choice == "kernel" and "5 of 8 rounds" in d.note and "region" in d.note
    # a region faster in every round is kept; so is a kernel form within noise of a region
    samples["residual xla"] = [0.9] * 8
    d = Tuner("auto", None, _rounds(**samples)).choose(
        "f", "s", dict.fromkeys(samples), conservative="composite")
    assert (d.choice, d.note) == ("residual xla", "")
    samples = {"composite": [2.0] * 8, "xla": [1.0] * 8,
               "kernel": [0.9, 0.9, 0.9, 1.1, 1.1, 0.9, 1.2, 0.95]}
    d = Tuner("auto", None, _rounds(**samples)).choose(
        "f", "s", dict.fromkeys(samples), conservative="composite")
    assert (d.choice, d.note) == ("kernel", "")


def test_measure_returns_aligned_rounds():
    t = tuner_mod.measure({"a": lambda: (lambda: None), "b": lambda: (lambda: None)}, 0.0)
    assert len(t.samples["a"]) == len(t.samples["b"]) == tuner_mod.MIN_ROUNDS
    assert set(t) == {"a", "b"}


def test_one_measurement_per_decision_and_each_recorded():
    seen = []
    timer = _timer({"a": 1.0, "b": 0.5})
    t = Tuner("auto", None, timer, on_decision=seen.append)
    for _ in range(3):
        assert t.choose("f", "s", {"a": None, "b": None}, conservative="a").choice == "b"
    assert len(timer.calls) == 1 and len(seen) == 1


def test_a_decision_measures_longer_the_more_forms_it_has():
    """Seconds per candidate, not per decision: six forms get three times two forms' time
    (at the minimum 8 rounds, a form that is really faster can still lose 2 of them)."""
    asked = {}

    def timer(candidates, seconds):
        asked[len(candidates)] = seconds
        return {name: 1.0 for name in candidates}

    t = Tuner("auto", None, timer, budget=100.0)
    for n in (2, 6):
        t.choose("f", f"s{n}", {f"form {i}": None for i in range(n)}, conservative="form 0")
    assert asked == pytest.approx({2: 2 * tuner_mod.DECISION_SECONDS,
                                   6: 6 * tuner_mod.DECISION_SECONDS})
    Tuner("auto", None, timer, budget=0.05).choose("f", "s", {"a": None, "b": None}, "a")
    assert asked[2] <= 0.05  # never more than the budget left


def test_off_and_cached_modes_never_measure(cache_dir):
    cache = TuningCache.for_backend("cpu")
    for mode in ("off", "cached"):
        d = Tuner(mode, cache, _fail).choose("f", "s", {"a": None, "b": None}, conservative="a")
        assert d.choice == "a" and d.source.startswith("conservative")


def test_a_failing_candidate_or_a_spent_budget_takes_the_conservative_form():
    def broken(candidates, seconds):
        raise RuntimeError("no kernel")

    d = Tuner("auto", None, broken).choose("f", "s", {"a": None, "b": None}, conservative="a")
    assert d.choice == "a" and "measuring failed" in d.source
    d = Tuner("auto", None, _fail, budget=0).choose("f", "s", {"a": None, "b": None}, "a")
    assert d.choice == "a" and "budget" in d.source
    with pytest.raises(ValueError, match="not a candidate"):
        Tuner("auto", None, _fail).choose("f", "s", {"a": None}, conservative="z")


def test_a_decision_the_budget_leaves_takes_the_form_its_family_keeps_here(cache_dir):
    """Three shapes of a family measured here, the fused form kept in each: a fourth shape the
    budget leaves unmeasured takes it (not written to the cache, counted as left for later);
    a family whose measured decisions disagree, another dtype, or an XLA region keep stock."""
    cache = TuningCache.for_backend("cpu")
    forms = {"stock": None, "fused": None, "xla": None}
    measuring = Tuner("auto", cache, _timer({"stock": 2.0, "fused": 1.0, "xla": 1.5}))
    for n in (8, 16, 32):
        assert measuring.choose("f", f"float32 {n}", forms, "stock").choice == "fused"
    spent = Tuner("auto", TuningCache.for_backend("cpu"), _fail, budget=0)
    d = spent.choose("f", "float32 64", forms, "stock")
    assert (d.choice, d.source, spent.deferred) == ("fused", "prior", 1)
    assert "kept over stock in 3 of 3" in d.why() and "budget" in d.why()
    assert TuningCache.for_backend("cpu").get("f|float32 64") is None
    assert spent.choose("f", "bfloat16 64", forms, "stock").choice == "stock"  # another dtype
    # one of four measured the other way: 3 of 4 still agree; two of five do not
    Tuner("auto", cache, _timer({"stock": 1.0, "fused": 2.0, "xla": 1.5})).choose(
        "f", "float32 128", forms, "stock")
    assert Tuner("auto", TuningCache.for_backend("cpu"), _fail, budget=0).choose(
        "f", "float32 65", forms, "stock").choice == "fused"
    Tuner("auto", cache, _timer({"stock": 1.0, "fused": 2.0, "xla": 1.5})).choose(
        "f", "float32 256", forms, "stock")
    assert Tuner("auto", TuningCache.for_backend("cpu"), _fail, budget=0).choose(
        "f", "float32 66", forms, "stock").source.startswith("conservative")
    regions = Tuner("auto", cache, _timer({"stock": 2.0, "xla": 1.0}))
    for n in (8, 16, 32):
        assert regions.choose("g", f"float32 {n}", {"stock": None, "xla": None},
                              "stock").choice == "xla"
    assert Tuner("auto", TuningCache.for_backend("cpu"), _fail, budget=0).choose(
        "g", "float32 64", {"stock": None, "xla": None}, "stock").choice == "stock"


def test_a_cached_decision_between_other_forms_is_measured_again(cache_dir):
    """A newer tfmx may offer a form the cached decision never weighed (an XLA region, say):
    the decision is measured again, and stored."""
    cache = TuningCache.for_backend("cpu")
    first = Tuner("auto", cache, _timer({"a": 2.0, "b": 1.0}))
    assert first.choose("f", "s", {"a": None, "b": None}, "a").choice == "b"
    again = Tuner("auto", TuningCache.for_backend("cpu"), _fail)
    assert again.choose("f", "s", {"b": None, "a": None}, "a").source == "cached"
    more = Tuner("auto", TuningCache.for_backend("cpu"), _timer({"a": 2.0, "b": 1.0, "c": 0.5}))
    d = more.choose("f", "s", {"a": None, "b": None, "c": None}, "a")
    assert (d.choice, d.source) == ("c", "measured")
    assert TuningCache.for_backend("cpu").get("f|s").choice == "c"


def test_mode_and_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv("TFMX_TUNE", "cached")
    assert Tuner().mode == "cached"
    monkeypatch.setenv("TFMX_TUNE", "sometimes")
    with pytest.raises(ValueError, match=r"\$TFMX_TUNE must be one of"):
        Tuner()
    with pytest.raises(ValueError, match="tune must be one of"):
        tfmx.enable(tune="fast")
    monkeypatch.setenv("TFMX_TUNE", "auto")
    monkeypatch.setenv("TFMX_TUNE_BUDGET", "lots")
    with pytest.raises(ValueError, match="number of seconds"):
        Tuner()


_CHILD = textwrap.dedent("""
    import json, sys
    from tfmx.tuner import Tuner, TuningCache
    mode = sys.argv[1]
    def timer(candidates, seconds):
        if mode == "forbid":
            raise SystemExit("measured in the second process")
        return {"eigen": 0.002, "onednn": 0.001}
    t = Tuner("auto", TuningCache.for_backend("cpu"), timer)
    d = t.choose("onednn", "MatMul 32x64 64x64", {"eigen": None, "onednn": None}, "eigen")
    print(json.dumps([d.choice, d.source]))
""")


def test_the_cache_is_reused_by_a_second_process(cache_dir):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    outs = []
    for mode in ("measure", "forbid"):
        done = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        outs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert outs == [["onednn", "measured"], ["onednn", "cached"]]
    (written,) = list(cache_dir.glob("tuning-cpu-*.json"))
    # the machine as a fresh process sees it (this one's allocator is an earlier test's)
    probe = "import json; from tfmx.tuner import fingerprint; print(json.dumps(fingerprint('cpu')))"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, timeout=300)
    expected = json.loads(done.stdout.strip().splitlines()[-1])
    assert json.loads(written.read_text())["fingerprint"] == expected


@pytest.mark.parametrize("field,value", [("tensorflow", "2.99.0"), ("onednn", "flipped"),
                                         ("cpu", {"model": "another CPU"}),
                                         ("code", "another tfmx")])
def test_the_cache_is_invalidated_by_another_tensorflow_onednn_state_cpu_or_code(
        cache_dir, monkeypatch, field, value):
    Tuner("auto", TuningCache.for_backend("cpu"), _timer({"a": 2.0, "b": 1.0})).choose(
        "f", "s", {"a": None, "b": None}, "a")
    real = tuner_mod.fingerprint

    def changed(backend):
        fp = real(backend)
        fp[field] = value
        return fp

    monkeypatch.setattr("tfmx.tuning_cache.fingerprint", changed)
    timer = _timer({"a": 1.0, "b": 2.0})
    d = Tuner("auto", TuningCache.for_backend("cpu"), timer).choose(
        "f", "s", {"a": None, "b": None}, "a")
    assert (d.choice, d.source, len(timer.calls)) == ("a", "measured", 1)


def test_the_code_digest_follows_every_source_file_of_the_packages(tmp_path, monkeypatch):
    package = tmp_path / "formsdemo"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "forms.py").write_text("def gelu(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("tfmx.tuning_cache.CODE_PACKAGES", ("formsdemo",))
    digest = tuner_mod.code_digest.__wrapped__
    first = digest()
    assert digest() == first
    (package / "sub" / "forms.py").write_text("def gelu(x):\n    return 2 * x\n")
    assert digest() != first
    assert tuner_mod.code_digest() != first  # the installed packages, not the demo


def test_export_and_import_preseed_another_machine(cache_dir, tmp_path, monkeypatch):
    Tuner("auto", TuningCache.for_backend("cpu"), _timer({"a": 2.0, "b": 1.0})).choose(
        "f", "s", {"a": None, "b": None}, "a")
    exported = tuner_mod.export_cache(tmp_path / "fleet.json")
    monkeypatch.setenv("TFMX_CACHE_DIR", str(tmp_path / "fresh"))
    assert tuner_mod.import_cache(exported) == 1
    d = Tuner("auto", TuningCache.for_backend("cpu"), _fail).choose(
        "f", "s", {"a": None, "b": None}, "a")
    assert (d.choice, d.source) == ("b", "cached")
    foreign = json.loads(exported.read_text())
    foreign["fingerprint"]["tensorflow"] = "1.0"
    (tmp_path / "foreign.json").write_text(json.dumps(foreign))
    with pytest.raises(ValueError, match="another machine.*tensorflow"):
        tuner_mod.import_cache(tmp_path / "foreign.json")
    assert tuner_mod.import_cache(tmp_path / "foreign.json", force=True) == 0


def _adam_step():
    v = tf.Variable(tf.ones([64, 64]))
    opt = tf.keras.optimizers.Adam(0.01) if hasattr(tf, "keras") else None
    import keras

    opt = keras.optimizers.Adam(0.01)
    opt.build([v])

    @tf.function(autograph=False)
    def step(g):
        opt.apply([g], [v])
        return v.read_value()

    return v, opt, step.get_concrete_function(tf.TensorSpec([64, 64]))


def test_the_optimizer_family_asks_the_tuner_and_says_why():
    v, opt, concrete = _adam_step()
    graph_def = concrete.graph.as_graph_def(add_shapes=True)
    backend = get_backend("cpu")
    for times, fused in (({"composite": 1.0, "kernel": 2.0}, 0),
                         ({"composite": 2.0, "kernel": 1.0}, 1)):
        timer = _timer(times)
        result = fusion.rewrite(graph_def, backend, ["optimizer_update"],
                                tuner=Tuner("auto", None, timer))
        assert result.stats["optimizer_update"].fused == fused
        assert timer.calls == [["composite", "kernel"]]
        assert op_histogram(result.graph_def)["ResourceApplyAdam"] == fused
    (reason,) = fusion.rewrite(graph_def, backend, ["optimizer_update"], tuner=Tuner(
        "auto", None, _timer({"composite": 1.0, "kernel": 2.0}))).stats[
        "optimizer_update"].declined
    assert "ResourceApplyAdam float32 [64, 64] keeps Keras's composite: measured faster" in reason


def test_identical_sites_of_one_graph_are_measured_once_and_share_the_decision():
    """Three variables of one shape and one of another shape but as many elements: four
    updates of one signature (an update's size class), one measurement, one decision, every
    update in its form; a variable of another size class is a second."""
    import keras

    variables = ([tf.Variable(tf.ones([64, 64])) for _ in range(3)]
                 + [tf.Variable(tf.ones([32, 128])), tf.Variable(tf.ones([8]))])
    opt = keras.optimizers.Adam(0.01)
    opt.build(variables)

    @tf.function(autograph=False)
    def step(g, f, h):
        opt.apply([g, g, g, f, h], variables)
        return variables[0].read_value()

    graph_def = step.get_concrete_function(tf.TensorSpec([64, 64]), tf.TensorSpec([32, 128]),
                                           tf.TensorSpec([8])).graph.as_graph_def(add_shapes=True)
    seen = []
    timer = _timer({"composite": 2.0, "kernel": 1.0})
    result = fusion.rewrite(graph_def, get_backend("cpu"), ["optimizer_update"],
                            tuner=Tuner("auto", None, timer, on_decision=seen.append))
    assert result.stats["optimizer_update"].fused == 5
    assert op_histogram(result.graph_def)["ResourceApplyAdam"] == 5
    assert len(timer.calls) == 2
    assert sorted(d.signature for d in seen) == ["ResourceApplyAdam float32 4096-8191 elements",
                                                 "ResourceApplyAdam float32 8-15 elements"]


def test_fragments_of_a_real_update_run_in_both_forms():
    """The real timer: the composite fragment and its rewritten variant both build and run."""
    from fusion.graphs.optimizer_update import find_updates, rewrite_update

    v, opt, concrete = _adam_step()
    view = GraphView(concrete.graph.as_graph_def(add_shapes=True).node)
    (match,), _ = find_updates(view, get_backend("cpu"))
    piece = cut(view, match.remove)
    fused = variant(piece, lambda w: rewrite_update(w, match))
    assert "ResourceApplyAdam" in {n.op for n in fused.graph_def.node}
    assert "ResourceApplyAdam" not in {n.op for n in piece.graph_def.node}
    inputs = make_inputs(piece)
    times = tuner_mod.measure({"composite": lambda: runner(piece, inputs),
                               "kernel": lambda: runner(fused, inputs)}, 0.01)
    assert set(times) == {"composite", "kernel"} and min(times.values()) > 0


def test_a_stateless_fragment_computes_what_it_times():
    """A fragment of stateless nodes (a MatMul, or its oneDNN retarget) computes its targets
    when the runner runs, in both forms: Grappler must not prune them (it turns an op read by a
    control dependency alone into a NoOp, and the tuner then timed the call only). The values
    the runner returns are the products of its inputs."""
    from fusion.graphs.onednn import (
        OneDnnKernels,
        find_onednn,
        kernels_registered,
        rewrite_onednn,
    )
    from fusion.pattern import PlainTarget

    @tf.function(autograph=False)
    def f(a, b):
        return tf.matmul(a, b, transpose_b=True)

    g = f.get_concrete_function(tf.TensorSpec([48, 16]), tf.TensorSpec([24, 16]))
    view = GraphView(g.graph.as_graph_def(add_shapes=True).node)
    piece = cut(view, ["MatMul"])
    forms = {"eigen": piece}
    if kernels_registered():
        matches, _ = find_onednn(view, PlainTarget("cpu", (OneDnnKernels(),)))
        forms["onednn"] = variant(piece, lambda w: [rewrite_onednn(w, m) for m in matches])
        assert {n.op for n in forms["onednn"].graph_def.node} >= {"_MklMatMul"}
    inputs = make_inputs(piece, copies=3)
    for name, form in forms.items():
        outputs = runner(form, inputs)()
        assert len(outputs) == 3, name
        for made, out in zip(inputs, outputs):
            a, b = (made[f"tfmx_fragment_in/{x}/0"].numpy() for x in ("a", "b"))
            np.testing.assert_allclose(out.numpy(), a @ b.T, rtol=1e-5, err_msg=name)


def test_a_gradient_transpose_carries_its_inverse_permutation():
    """A transpose's gradient permutes by InvertPermutation of the forward's constant: the
    fragment takes both in, and computes the real inverse transpose."""

    @tf.function(autograph=False)
    def f(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.transpose(x, [0, 2, 1]) * tf.range(12.0)[None, :, None])
        return tape.gradient(loss, x)

    g = f.get_concrete_function(tf.TensorSpec([2, 5, 12]))
    view = GraphView(g.graph.as_graph_def(add_shapes=True).node)
    backward = next(n for n in view if n.op == "Transpose" and "gradient_tape" in n.name)
    piece = cut(view, [backward.name])
    assert "InvertPermutation" in {n.op for n in piece.graph_def.node}
    inputs = make_inputs(piece, copies=2)
    feed = next(iter(piece.feeds))
    for made, out in zip(inputs, runner(piece, inputs)()):
        np.testing.assert_array_equal(out.numpy(), np.transpose(made[feed].numpy(), [0, 2, 1]))


def test_a_fragment_that_cannot_be_made_up_is_refused():
    @tf.function(autograph=False)
    def f(x, i):
        return tf.gather(x, i)

    g = f.get_concrete_function(tf.TensorSpec([4, 3]), tf.TensorSpec([2], tf.int32))
    view = GraphView(g.graph.as_graph_def(add_shapes=True).node)
    gather = next(n.name for n in view if n.op.startswith("Gather"))
    with pytest.raises(FragmentError, match="cannot be made up"):
        cut(view, [gather])


def test_the_tune_command_shows_exports_imports_and_clears(cache_dir, tmp_path, capsys,
                                                           monkeypatch):
    from tfmx.cli import main

    Tuner("auto", TuningCache.for_backend("cpu"), _timer({"a": 2.0, "b": 1.0})).choose(
        "f", "s", {"a": None, "b": None}, "a")
    assert main(["tune"]) == 0
    assert "f|s: b" in capsys.readouterr().out
    assert main(["tune", "--export", str(tmp_path / "e.json")]) == 0
    monkeypatch.setenv("TFMX_CACHE_DIR", str(tmp_path / "other"))
    assert main(["tune", "--import", str(tmp_path / "e.json")]) == 0
    assert "imported 1 decision" in capsys.readouterr().out
    from tfmx.step_gain import learn_gain

    learn_gain(30.0, 60.0, TuningCache.for_backend("cpu"))  # a figure of the machine
    assert main(["tune"]) == 0
    assert "step-gain-ratio|fused" in capsys.readouterr().out
    figures = TuningCache.for_backend("cpu").figures().path
    assert figures.exists()
    assert main(["tune", "--clear"]) == 0
    assert capsys.readouterr().out.count("removed") == 2 and not figures.exists()
    with pytest.raises(SystemExit, match="tfmx tune"):
        main(["tune", "--import", str(tmp_path / "missing.json")])


def test_a_prior_is_the_kind_of_op_its_decision_is_for(cache_dir):
    """One family, two kinds of op (a signature's first word): the form kept for three MatMuls
    is the prior of a fourth MatMul, and says nothing of a BatchMatMulV2, whose kernels may
    lose where the MatMul's win."""
    cache = TuningCache.for_backend("cpu")
    forms = {"eigen": None, "onednn": None}
    measuring = Tuner("auto", cache, _timer({"eigen": 2.0, "onednn": 1.0}))
    for n in (8, 16, 32):
        assert measuring.choose("k", f"MatMul {n}x{n}", forms, "eigen").choice == "onednn"
    spent = Tuner("auto", TuningCache.for_backend("cpu"), _fail, budget=0)
    matmul = spent.choose("k", "MatMul 64x64", forms, "eigen")
    assert (matmul.choice, matmul.source) == ("onednn", "prior")
    other = spent.choose("k", "BatchMatMulV2 4x64x64", forms, "eigen")
    assert other.choice == "eigen" and other.source.startswith("conservative"), other.source


def test_a_fit_with_no_budget_runs_the_swish_form_its_family_keeps_here(cache_dir, monkeypatch):
    """End to end: a fit whose tuner may measure nothing leaves its swish to Keras's form; with
    three other swish shapes measured here, the closed form kept in each, the same fit runs the
    closed form (its scope in the graph that ran) on that prior, within rounding of stock."""
    import keras
    from helpers import assert_models_within_rounding, fit_stock_and_tfmx, nodes_that_ran

    from fusion.calls import swish

    def build() -> keras.Model:
        keras.utils.set_random_seed(3)
        inp = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="swish")(inp)
        model = keras.Model(inp, keras.layers.Dense(3, activation="softmax")(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy")
        return model

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 8)).astype("float32"), rng.integers(0, 3, 32)
    monkeypatch.setenv("TFMX_TUNE_BUDGET", "0")
    fit_stock_and_tfmx(build, x, y, ["swish"], epochs=1)
    (left,) = [d for d in tfmx.report().decisions if d.family == "swish"]
    assert left.choice == "keras" and left.source.startswith("conservative"), left
    cache = TuningCache.for_backend("cpu")
    for n in (64, 128, 256):  # other shapes, the closed form kept in each
        cache.put(tuner_mod.Decision("swish", f"{left.signature} at {n}", "custom",
                                     left.candidates,
                                     {name: 1.0 for name in left.candidates} | {"custom": 0.7}))
    models, initial = fit_stock_and_tfmx(build, x, y, ["swish"], epochs=1)
    (taken,) = [d for d in tfmx.report().decisions if d.family == "swish"]
    assert (taken.choice, taken.source) == ("custom", "prior"), taken
    scope = f"/{swish.FORMS.scope_of(swish.CUSTOM)}/"
    assert any(scope in n.name for n in nodes_that_ran(models[True].train_function))
    assert_models_within_rounding(models[False], models[True], initial, 4 * (16 * 8 + 60))


# -- measuring that pays for itself within a planned fit ----------------------------------------
def _sleeping(seconds, build=0.0):
    """A form's factory: building it takes ``build`` s, a call ``seconds``."""
    def factory():
        time.sleep(build)
        return lambda: time.sleep(seconds)

    return factory


def _seed_family(cache, family, times):
    """Three measured decisions of ``family`` here, with the injected ``times``."""
    seeding = Tuner("auto", cache, _timer(times))
    for n in (8, 16, 32):
        seeding.choose(family, f"float32 {n}", dict.fromkeys(times), "stock")


def test_past_the_fits_share_a_decision_is_measured_where_its_family_says_it_pays(cache_dir):
    """The fit's share spent: a decision of a family whose measured decisions here saved half
    the conservative form's time is measured (a 2 ms form, 1000 steps: ~1 s to save), its note
    says why; one of a family never measured here is left for a later run."""
    cache = TuningCache.for_backend("cpu")
    _seed_family(cache, "paying", {"stock": 2.0, "fast": 1.0})
    tuner = Tuner("auto", cache)
    tuner.step_hint = lambda: 0.004  # a 4 ms step known from a previous fit
    forms = {"stock": _sleeping(0.002), "fast": _sleeping(0.001)}
    with fit_plan.fitting(10, 100):  # 1000 steps x 4 ms: the 2% share is 0.08 s
        tuner._sync_plan()
        tuner._plan_spent = 0.08
        unknown = tuner.choose("new", "float32 64", forms, "stock")
        paying = tuner.choose("paying", "float32 64", forms, "stock")
    assert unknown.source.startswith("conservative (measuring budget spent: 2% of the planned")
    assert (paying.source, paying.choice) == ("measured", "fast"), paying.describe()
    assert ("measured beyond the fit's 2% share: its 3 measured paying decisions here saved "
            "50% of the conservative form's time on average") in paying.note
    assert 0.08 < tuner._plan_spent < 0.4  # within the cap: 10% of the run


def test_a_step_fitted_before_measures_for_the_fits_expected_after_this_one(cache_dir):
    """The same fit's share spent twice over (2% of 1000 steps x 4 ms is 0.08 s): for a step
    never fitted here the decision is left, for one fitted twice before (three fits served:
    0.24 s) it is measured; a step fitted a hundred times is served as one fitted
    RETURNING_FITS times, and the reason a decision is left names the fits."""
    forms = {"stock": _sleeping(0.002), "fast": _sleeping(0.001)}

    def decide(returning, spent):
        tuner = Tuner("auto", TuningCache.for_backend("cpu"))
        tuner.step_hint = lambda: 0.004
        with fit_plan.fitting(10, 100):
            serial = fit_plan.active_plan().serial
            tuner.returning = (serial, returning) if returning is not None else None
            tuner._sync_plan()
            tuner._plan_spent = spent
            return tuner.choose("new", f"float32 {returning} {spent}", forms, "stock")

    assert decide(None, 0.16).source.startswith("conservative (measuring budget spent")
    assert decide(0, 0.16).source.startswith("conservative (measuring budget spent")
    assert decide(2, 0.16).source == "measured"
    capped = decide(100, 0.33).source  # at most 1 + 3 fits: 0.32 s
    assert capped.startswith("conservative (measuring budget spent: 2% of the planned run, "
                             "1000 steps x 4 fits (this one and as many after it as fitted "
                             "before here, at most 3) x 4.0 ms a step"), capped
    stale = Tuner("auto", None)
    stale.returning = (-1, 3)  # another fit's
    with fit_plan.fitting(10, 100):
        assert stale.fits_before(fit_plan.active_plan().serial) == 0


def _seed_costly(cache, family, saved_ms, build_ms):
    """Three measured decisions of ``family`` here: each kept ``fast``, ``saved_ms`` under
    ``stock``'s 2 ms, its two candidates built in ``build_ms`` each."""
    for n in (8, 16, 32):
        cache.put(tuner_mod.Decision(family, f"float32 {n}", "fast", ("stock", "fast"),
                                     {"stock": 2.0, "fast": 2.0 - saved_ms}, "measured", "",
                                     {"stock": build_ms, "fast": build_ms}))


def test_within_the_share_a_decision_that_cannot_pay_is_left_after_its_keras_form(cache_dir):
    """The share unspent (2% of 1000 steps x 4 ms: 0.08 s): a decision of a family whose
    measured decisions here, of Keras's form at 2 ms a call, each saved 2.5% of it for 0.4 s of
    building is left once its Keras form is timed at 2 ms too (~0.05 s to save over the fit),
    with the figures, on the family's form; one of the same family at 40 ms a call (no
    decision of its size measured) is measured, as is one of a family that saved 25% for 50 ms
    of building."""
    cache = TuningCache.for_backend("cpu")
    _seed_costly(cache, "costly", saved_ms=0.05, build_ms=200.0)
    _seed_costly(cache, "cheap", saved_ms=0.5, build_ms=25.0)
    tuner = Tuner("auto", cache)
    tuner.step_hint = lambda: 0.004
    with fit_plan.fitting(10, 100):
        small = tuner.choose("costly", "float32 64", {"stock": _sleeping(0.002),
                                                      "fast": _sleeping(0.001)}, "stock")
        large = tuner.choose("costly", "float32 4096", {"stock": _sleeping(0.04),
                                                        "fast": _sleeping(0.02)}, "stock")
        cheap = tuner.choose("cheap", "float32 64", {"stock": _sleeping(0.002),
                                                     "fast": _sleeping(0.001)}, "stock")
    assert (small.source, small.choice) == ("prior", "fast"), small.describe()
    assert small.why().startswith("fast on this machine's prior"), small.why()
    assert "its 3 measured costly decisions here of about its size saved " in small.why(), \
        small.why()
    assert "on average, and measuring one took ~0.55 s: at 2." in small.why()
    assert "over the 1000 steps it serves, less than its measuring" in small.why()
    assert TuningCache.for_backend("cpu").get("costly|float32 64") is None
    assert (large.source, large.choice) == ("measured", "fast"), large.describe()
    assert (cheap.source, cheap.choice) == ("measured", "fast"), cheap.describe()


def test_a_decision_that_cannot_pay_for_its_measuring_is_left_and_the_attempt_counted(
        cache_dir):
    """Past the share, the same family: a form of microseconds built in 40 ms saves too little
    over the run to pay for building it, and a 2 ms form over 10 steps too little to pay for
    its rounds; neither is measured, each says so, and once such attempts used up the share
    none is tried."""
    cache = TuningCache.for_backend("cpu")
    _seed_family(cache, "paying", {"stock": 2.0, "fast": 1.0})
    tuner = Tuner("auto", cache)
    tuner.step_hint = lambda: 0.004
    tiny = {"stock": _sleeping(0.0, build=0.04), "fast": _sleeping(0.0, build=0.04)}
    with fit_plan.fitting(10, 100):
        tuner._sync_plan()
        tuner._plan_spent = 0.08
        left = tuner.choose("paying", "float32 64", tiny, "stock")
        assert 0 < tuner._plan_waste < 0.08
        tuner._plan_waste = 0.08  # attempts that could not pay used up the share
        untried = tuner.choose("paying", "float32 128", {"stock": _fail, "fast": _fail}, "stock")
    with fit_plan.fitting(1, 10):
        tuner._sync_plan()
        tuner._plan_spent = 0.002
        short = tuner.choose("paying", "float32 256",
                             {"stock": _sleeping(0.002), "fast": _sleeping(0.001)}, "stock")
    for d in (left, short):  # the family's form on this machine's prior, not measured
        assert d.source == "prior" and "not enough to pay for measuring it" in d.why(), d.why()
    assert untried.source == "prior" and "not enough to pay" not in untried.why()
    assert TuningCache.for_backend("cpu").get("paying|float32 64") is None


def test_a_fits_allowance_measures_the_forms_it_covers_and_leaves_the_regions_for_later(
        cache_dir):
    """A fit whose share covers building Keras's form and one kernel form but not an XLA
    region: the two are measured and the faster kept, the region left out (named in the note);
    the partial decision is reused by a later fit and completed where no fit bounds it."""
    forms = {"xla": _sleeping(0.0005, build=0.06), "stock": _sleeping(0.002, build=0.06),
             "fast": _sleeping(0.001, build=0.06)}
    tuner = Tuner("auto", TuningCache.for_backend("cpu"))
    tuner.step_hint = lambda: 0.0075  # 2% of 1000 steps x 7.5 ms: 0.15 s, two builds' worth
    with fit_plan.fitting(10, 100):
        d = tuner.choose("f", "float32 8", forms, "stock")
    assert (d.source, d.choice, set(d.times_ms)) == ("measured", "fast", {"stock", "fast"})
    assert "not measured: xla (building them would take it past this fit's allowance" in d.note
    assert tuner_mod.is_partial(d)
    later = Tuner("auto", TuningCache.for_backend("cpu"), _fail)
    with fit_plan.fitting(10, 100):
        assert later.choose("f", "float32 8", forms, "stock").source == "cached"
    whole = Tuner("auto", TuningCache.for_backend("cpu")).choose("f", "float32 8", forms, "stock")
    assert (whole.source, set(whole.times_ms)) == ("measured", {"stock", "fast", "xla"})
    assert whole.choice in ("fast", "xla") and not tuner_mod.is_partial(whole)
