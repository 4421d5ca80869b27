"""The recipes: every one runs at --quick sizes and writes a valid metrics.json, a PNG
and TensorBoard logs; the data loaders read made data in the layouts Keras caches; the flags
refuse bad values with a clear message; ``tfmx recipe --list`` lists them all without
importing them."""

from __future__ import annotations

import doctest
import importlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import recipes
from recipes import _compare, _data, _runner

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TRAINING_RECIPES = [name for name in recipes.available() if name != "tour"]
# --quick sizes, smaller still where a recipe allows (the suite's time matters)
SMALLER = {
    "small_cnn": ["--samples", "256", "--epochs", "2"],
    "bn_resnet": ["--samples", "128", "--batch-size", "32"],
    "recurrent": ["--samples", "128", "--seq-len", "12", "--units", "16"],
    # the fused train step asked for: the run's report and summary say which step ran
    "transformer": ["--samples", "128", "--seq-len", "16", "--width", "32", "--fuse", "always"],
    "mixed_precision": ["--samples", "256", "--width", "64"],
    "custom_loop": ["--samples", "256", "--depth", "4", "--xla"],
}


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No download attempts, and an empty Keras cache: the loaders fall back (announced)."""
    monkeypatch.setenv(_data.OFFLINE_ENV, "1")
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras-home"))


@pytest.fixture
def restore_globals():
    yield
    import tfmx
    from policies import global_policy, hook

    tfmx.disable()
    global_policy.reset()
    hook.uninstall()


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# -- every recipe runs -----------------------------------------------------------------------
@pytest.mark.parametrize("name", TRAINING_RECIPES)
def test_recipe_quick_run_writes_metrics_png_and_tensorboard(name, tmp_path, restore_globals,
                                                             capsys):
    out = tmp_path / "out"
    module = importlib.import_module(f"recipes.{name}")
    result = module.main(["--quick", "--epochs", "1", "--rounds", "1", "--out", str(out),
                          *SMALLER.get(name, [])])
    printed = capsys.readouterr().out

    metrics = json.loads((out / "metrics.json").read_text())
    assert tuple(sorted(metrics)) == tuple(sorted(_runner.METRICS_KEYS))
    assert metrics["recipe"] == name and metrics["summary"]
    assert set(metrics["runs"]) == {"stock", "tfmx", "stock'"}
    for run in metrics["runs"].values():
        assert run["epochs"], run
        for epoch in run["epochs"]:
            assert isinstance(epoch["epoch"], int)
            for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
                assert isinstance(epoch[key], float) and np.isfinite(epoch[key]), (key, epoch)
            assert isinstance(epoch["step_ms"], float) and epoch["step_ms"] > 0
            assert epoch["step_ms_p25"] <= epoch["step_ms"] <= epoch["step_ms_p75"]
        assert run["fit_step_ms"]["median_ms"] > 0 and run["seconds"] > 0
    timing = metrics["timing"]
    assert set(timing["interleaved"]) == {"stock", "tfmx", *(["xla"] if "--xla" in
                                                              SMALLER[name] else [])}
    assert timing["best_alternative"]["mode"] in timing["interleaved"]
    assert isinstance(timing["ratio_to_best"], float)
    assert timing["interleaved"]["stock"]["median_ms"] > 0
    assert isinstance(timing["ratio"], float) and timing["ratio"] > 0
    assert isinstance(timing["fit_ratio"], float)
    comp = metrics["comparison"]
    assert comp["metric"] == "val_accuracy"
    for key in ("stock", "tfmx", "baseline", "difference", "noise"):
        assert isinstance(comp[key], float), key
    assert isinstance(comp["within_noise"], bool)
    env = metrics["environment"]
    assert env["cpu"] and isinstance(env["cpu_flags"], list)
    assert env["onednn_state"] in ("on", "off") and env["tensorflow"] and env["keras"]
    assert isinstance(metrics["tfmx_report"]["fused"], int)
    assert metrics["tfmx_report"]["traces"]
    step = metrics["tfmx_report"]["step"]  # the train step the tfmx run kept, and why
    assert step["form"] in ("fused", "stock", "xla") and step["line"].startswith("tfmx: "), step
    assert f"tfmx run's train step: {_compare.step_cell(step)}" in printed
    if "--fuse" in SMALLER[name]:
        assert (step["form"], step["how"]) == ("fused", "fuse=always"), step
        assert metrics["tfmx_report"]["fuse"] == "always"
        assert "runs the fused step (not timed: fuse='always')" in step["line"]
    if step["how"] == "price gate":  # a fit this short: the gate's words and what runs it now
        line = next(x for x in printed.splitlines() if x.startswith("tfmx run's train step"))
        assert step["why"] and step["why"] in line and "--fuse always runs the fused step" in line
    assert metrics["data"]["train_samples"] > 0 and metrics["data"]["source"]
    assert result["comparison"] == comp

    assert "|stock - tfmx|" in printed and "|stock - stock'|" in printed
    assert "tfmx/stock" in printed
    events = list((out / "tensorboard").rglob("events.out.tfevents.*"))
    assert {p.relative_to(out / "tensorboard").parts[0] for p in events} == {
        "stock", "tfmx", "stock_prime"}
    if not _has_matplotlib():
        pytest.skip("matplotlib is not installed: the PNG is not written (pip install -e "
                    "\".[recipes]\")")
    png = out / f"{name}.png"
    assert metrics["outputs"]["png"] == str(png)
    assert png.read_bytes()[:8] == PNG_SIGNATURE


def test_small_cnn_keeps_its_flat_keys_and_tfmx_only(tmp_path, restore_globals):
    from recipes.small_cnn import main

    result = main(["--quick", "--epochs", "1", "--samples", "128", "--rounds", "1",
                   "--tfmx-only", "--policy", "float32", "--out", str(tmp_path)])
    assert set(result["runs"]) == {"tfmx"}
    assert result["policy"] == "float32" and result["stock_accuracy"] is None
    assert 0.0 <= result["tfmx_accuracy"] <= 1.0 and result["tfmx_ms"] > 0
    assert result["step_time_ratio"] is None and isinstance(result["fused"], int)


def test_the_quick_tour_prints_one_table_and_writes_one_png(tmp_path, capsys):
    from recipes import tour

    result = tour.main(["--quick", "--only", "custom_loop", "--rounds", "1",
                        "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert [r["workload"] for r in result["rows"]] == ["custom_loop"]
    assert "| custom_loop |" in printed and "tfmx / stock" in printed
    assert result["rows"][0]["ratio"] > 0
    # the quick tour runs tfmx's fused step, and its table and lines say which step ran
    step = result["rows"][0]["step"]
    assert step["form"] == "fused", step
    assert f"| {_compare.step_cell(step)} | **" in printed and "| tfmx step |" in printed
    assert f"  custom_loop: {step['line']}" in printed
    assert json.loads((tmp_path / "tour.json").read_text())["table"] == result["table"]
    if _has_matplotlib():
        assert (tmp_path / "tour.png").read_bytes()[:8] == PNG_SIGNATURE


def test_the_tour_table_names_the_step_each_tfmx_run_kept():
    from recipes import tour

    base = {"data": "d", "stock_ms": 10.0, "tfmx_ms": 9.0, "xla_ms": None, "best": None,
            "ratio": 0.9, "ratio_to_best": 0.9, "metric": "val_accuracy", "stock": 0.9,
            "tfmx": 0.9, "baseline": 0.9, "difference": 0.0, "noise": 0.0,
            "within_noise": True}
    rows = [{**base, "workload": "a", "step": {"form": "fused", "how": "fuse=always",
                                               "line": "tfmx: a runs the fused step"}},
            {**base, "workload": "b", "ratio": 1.07,
             "step": {"form": "stock", "how": "price gate", "line": "tfmx: b runs stock"}}]
    table = tour.format_table(rows).splitlines()
    header = [c.strip() for c in table[0].split(" | ")]
    assert header[5] == "tfmx step" and header[6] == "tfmx / stock"
    assert len(table[1].split("|")) - 2 == len(header)  # the alignment row matches
    assert "| fused (fuse=always) | **0.900** |" in table[2]
    # two runs of stock's step: the ratio is not shown as tfmx's
    assert "| stock (price gate) | 1.070 (both stock) |" in table[3]
    assert tour.step_lines(rows).splitlines()[1:] == ["  a: tfmx: a runs the fused step",
                                                     "  b: tfmx: b runs stock"]


# -- flags -----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--epochs", "0"], "argument --epochs: must be a positive integer, got '0'"),
    (["--batch-size", "-8"], "argument --batch-size: must be a positive integer, got '-8'"),
    (["--samples", "many"], "argument --samples: must be a positive integer, got 'many'"),
    (["--lr", "0"], "argument --lr: must be a positive number, got '0'"),
    (["--compare", "--tfmx-only"], "not allowed with argument"),
])
def test_bad_flag_values_stop_with_a_clear_message(argv, message, capsys, tmp_path):
    from recipes.small_cnn import main

    with pytest.raises(SystemExit) as stop:
        main([*argv, "--out", str(tmp_path)])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_an_out_dir_that_cannot_be_written_is_refused(tmp_path, capsys):
    from recipes.custom_loop import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit):
        main(["--quick", "--out", str(blocker / "sub")])
    assert "argument --out: cannot write to" in capsys.readouterr().err


def test_an_unknown_policy_is_refused_before_training(tmp_path):
    from recipes.mixed_precision import main

    with pytest.raises(ValueError, match="unknown policy 'bf16'"):
        main(["--quick", "--policy", "bf16", "--out", str(tmp_path)])


def test_workers_refused_for_a_recipe_with_its_own_loop(capsys, tmp_path):
    from recipes.custom_loop import main

    with pytest.raises(SystemExit):
        main(["--quick", "--workers", "2", "--out", str(tmp_path)])
    assert "argument --workers: recipes.custom_loop runs its own training loop" in \
        capsys.readouterr().err


def test_workers_two_local_workers_train_the_tfmx_run(tmp_path):
    """--workers 2: two processes on loopback under MultiWorkerMirroredStrategy train the tfmx
    run (Keras's own fit fails there); the chief writes metrics.json, the other its log."""
    env = {**os.environ, _data.OFFLINE_ENV: "1"}
    env.pop("TFMX_RECIPE_WORKER", None)
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.small_cnn", "--quick", "--samples", "128",
         "--epochs", "1", "--batch-size", "32", "--workers", "2", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert set(metrics["runs"]) == {"tfmx"} and metrics["args"]["workers"] == 2
    loss = metrics["runs"]["tfmx"]["epochs"][-1]["loss"]
    assert np.isfinite(loss)
    assert metrics["tfmx_report"]["fused"] > 0
    assert "several workers" in json.dumps(metrics["tfmx_report"])  # under the strategy
    assert (tmp_path / "worker-1.log").exists()
    assert json.loads((tmp_path / "worker-1" / "metrics.json").read_text())["runs"]["tfmx"]


def test_recipe_extras_are_validated(capsys, tmp_path):
    from recipes.recurrent import main

    with pytest.raises(SystemExit):
        main(["--cell", "rnn", "--out", str(tmp_path)])
    assert "argument --cell: invalid choice: 'rnn'" in capsys.readouterr().err


def test_within_noise():
    assert _compare.within_noise(0.90, 0.91, 0.905) == (True, 0.01, 0.005)
    assert _compare.within_noise(0.90, 0.95, 0.905)[0] is False
    assert _compare.within_noise(0.90, 0.901, 0.90, floor=0.002)[0] is True


# -- tfmx recipe --list ----------------------------------------------------------------------
def test_tfmx_recipe_list_names_every_recipe_without_importing_them():
    code = ("import sys; from tfmx.cli import main; code = main(['recipe', '--list']); "
            "assert not [m for m in sys.modules if m.startswith('recipes')], 'imported'; "
            "sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    listed = {line.split()[0]: line.split(None, 1)[1] for line in proc.stdout.splitlines()}
    assert set(listed) == set(recipes.available())
    for name, summary in listed.items():
        module_doc = importlib.import_module(f"recipes.{name}").__doc__
        assert summary == module_doc.strip().splitlines()[0]


# -- loaders on made data --------------------------------------------------------------------
def test_mnist_reads_the_keras_cache_file(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "mnist.npz",
             x_train=rng.integers(0, 256, (12, 28, 28), dtype=np.uint8),
             y_train=np.arange(12, dtype=np.uint8) % 10,
             x_test=np.full((5, 28, 28), 255, np.uint8), y_test=np.arange(5, dtype=np.uint8))
    d = _data.mnist(limit=10, root=tmp_path)
    assert d.x_train.shape == (10, 28, 28, 1) and d.x_train.dtype == np.float32
    assert d.x_val.shape == (5, 28, 28, 1) and float(d.x_val.max()) == 1.0
    assert d.y_train.dtype == np.int32 and d.num_classes == 10
    assert d.source.startswith("MNIST")


def _cifar_batch(path: Path, n: int, channel: int) -> None:
    data = np.zeros((n, 3, 32, 32), np.uint8)
    data[:, channel] = 255
    with open(path, "wb") as f:
        pickle.dump({b"data": data.reshape(n, 3072), b"labels": list(range(n))}, f)


@pytest.mark.parametrize("layout", ["cifar-10-batches-py-target/cifar-10-batches-py",
                                    "cifar-10-batches-py"])
def test_cifar10_reads_the_python_batches(tmp_path, layout):
    folder = tmp_path / layout
    folder.mkdir(parents=True)
    _cifar_batch(folder / "data_batch_1", 6, channel=0)
    _cifar_batch(folder / "data_batch_2", 4, channel=0)
    _cifar_batch(folder / "test_batch", 3, channel=2)
    d = _data.cifar10(root=tmp_path)
    assert d.x_train.shape == (10, 32, 32, 3) and d.x_val.shape == (3, 32, 32, 3)
    assert d.y_train.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    # channels last: the train set's red channel is its brightest, the test set's blue
    assert d.x_val[..., 2].mean() > d.x_val[..., 0].mean()
    assert d.source.startswith("CIFAR-10")


def test_imdb_reads_the_cache_file_with_keras_encoding(tmp_path):
    seqs = np.empty(2, dtype=object)
    seqs[0], seqs[1] = [5, 6, 7], list(range(1, 30))
    np.savez(tmp_path / "imdb.npz", x_train=seqs, y_train=np.array([0, 1]), x_test=seqs,
             y_test=np.array([1, 0]))
    d = _data.imdb(num_words=20, maxlen=8, root=tmp_path)
    assert d.x_train.shape == (2, 8) and d.num_classes == 2
    assert d.x_train[0].tolist() == [0, 0, 0, 0, 1, 8, 9, 10]  # padded, start 1, words + 3
    assert max(d.x_train[1].tolist()) < 20 and 2 in d.x_train[1].tolist()  # out of vocabulary


def test_missing_datasets_fall_back_out_loud(tmp_path, capsys):
    with pytest.raises(_data.Unavailable, match="MNIST is not in"):
        _data.mnist(root=tmp_path)
    d = _data.first_available([
        ("MNIST", lambda: _data.mnist(root=tmp_path)),
        ("synthetic images", lambda: _data.synthetic_images(8, 4, seed=0)),
    ])
    assert d.source.startswith("synthetic")
    assert "[data] MNIST not available (MNIST is not in" in capsys.readouterr().out


def test_a_failing_download_is_reported_with_its_reason(tmp_path, monkeypatch):
    import keras

    monkeypatch.delenv(_data.OFFLINE_ENV)

    def no_network():
        import socket

        assert socket.getdefaulttimeout() == _data.DOWNLOAD_TIMEOUT_S
        raise OSError("Name or service not known")

    monkeypatch.setattr(keras.datasets.cifar10, "load_data", no_network)
    with pytest.raises(_data.Unavailable, match=r"download failed \(Name or service not known"):
        _data.cifar10(root=tmp_path)


def test_stdlib_text_reads_source_files_in_a_fixed_order(tmp_path):
    for rel, text in {"b.py": "bbbb\n", "a.py": "aaaa\n", "sub/c.py": "cccc\n",
                      "test/t.py": "TEST\n", "site-packages/s.py": "SITE\n",
                      "notes.txt": "TXT\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert [p.name for p in _data.stdlib_files(tmp_path)] == ["a.py", "b.py", "c.py"]
    assert _data.stdlib_text(root=tmp_path) == "aaaa\nbbbb\ncccc\n"
    assert _data.stdlib_text(max_chars=7, root=tmp_path) == "aaaa\nbb"
    with pytest.raises(_data.Unavailable):
        _data.stdlib_text(root=tmp_path / "sub" / "none")


def test_text_dataset_windows_and_targets(tmp_path):
    (tmp_path / "m.py").write_text("def f(x):\n    return x + 1\n" * 40)
    d = _data.text_dataset(32, 8, seq_len=10, seed=0, root=tmp_path)
    assert d.x_train.shape == d.y_train.shape == (32, 10)
    assert (d.x_train[:, 1:] == d.y_train[:, :-1]).all()
    assert d.x_train.max() < _data.VOCAB_SIZE and d.num_classes == _data.VOCAB_SIZE
    last = _data.text_dataset(32, 8, seq_len=10, seed=0, root=tmp_path, last_only=True)
    assert last.y_train.shape == (32,) and (last.y_train == d.y_train[:, -1]).all()


def test_digits_when_scikit_learn_is_installed():
    pytest.importorskip("sklearn")
    images = _data.digits(image_shape=(32, 32, 3))
    assert images.x_train.shape[1:] == (32, 32, 3) and len(images.x_val) == 359
    flat = _data.digits(limit=100, image_shape=(64,))
    assert flat.x_train.shape == (100, 64) and set(flat.y_val.tolist()) == set(range(10))


# -- docstring examples of the recipes package -----------------------------------------------
@pytest.mark.parametrize("name", ["recipes", "recipes._data", "recipes._recipe", "recipes._flags",
                                  "recipes._train", "recipes._compare", "recipes._plot",
                                  "recipes._runner", "recipes._workers",
                                  *(f"recipes.{n}" for n in recipes.available())])
def test_recipes_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


def test_runs_folder_is_ignored_by_git():
    assert "/runs/" in (ROOT / ".gitignore").read_text().split()
    assert os.path.basename(_runner.__file__).startswith("_")  # not listed as a recipe


def test_tfmx_recipe_name_passes_its_arguments_to_the_recipe():
    proc = subprocess.run([sys.executable, "-m", "tfmx", "recipe", "bn_resnet", "--help"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "python -m recipes.bn_resnet" in proc.stdout and "--bn-momentum" in proc.stdout
    for flag in ("--epochs", "--batch-size", "--seed", "--policy", "--compare", "--tfmx-only",
                 "--quick", "--out"):
        assert flag in proc.stdout
