"""Keras's own tests, at the installed Keras version, give the same outcomes with tfmx enabled
for every test as they give stock.

Keras's source distribution on PyPI carries its tests. :func:`keras_source` downloads it once (``pip
download --no-deps --no-binary :all: keras==<installed>``; ``keras-nightly==<installed>`` where that
distribution installed the ``keras`` package, see :func:`keras_distribution`) into a cache directory
and unpacks it (keras-nightly's carries no tests: the test skips saying so, unless the cache
directory holds them from a checkout of Keras); :data:`KERAS_TESTS` picks the files that exercise
what tfmx touches. Child pytest processes run them against the installed Keras, each with this
directory's ``keras_suite/tfmx_keras_plugin.py`` recording every test's outcome (:data:`RUNS`): one
stock, two with ``--tfmx`` (``tfmx.enable()`` before every test, ``tfmx.disable()`` after it):
tfmx's defaults as a user gets them (see :func:`child_env`), and the guard off. With the defaults a
short ``fit`` of a step this machine never measured runs as stock (the price gate: tracing tfmx's
form could not pay for itself in a few steps), as most of Keras's fits are; with the guard off every
step tfmx can rewrite is rewritten, so Keras's tests meet tfmx's rewritten steps too. The test
asserts each tfmx run's outcome map equals stock's, listing every test whose outcome differs with
the tfmx run's traceback tail, and that the guard-off run did rewrite steps (:data:`MIN_REWRITTEN`);
it prints each run's wall and CPU time and what tfmx did, with any error its stages recorded.

The runs go in parallel: each is mostly one Python thread (a tfmx run needs about 1.2 times
stock's CPU time), so on 2 cores together they take about 1.5 times a tfmx run alone.

Keras's tests fail in both runs where a package they import is missing (torch, grain): the
same outcome both ways, so no difference. trainer_test.py imports jax at the top: jax is in
the ``test`` extra.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PLUGIN_DIR = HERE / "keras_suite"
PLUGIN = "tfmx_keras_plugin"

# Where the unpacked source distribution is kept: $TFMX_KERAS_TESTS_DIR, else
# $XDG_CACHE_HOME/tfmx-keras-tests, else ~/.cache/tfmx-keras-tests; one subdirectory per version.
ENV_DIR = "TFMX_KERAS_TESTS_DIR"

# Keras's test files and folders (relative to the unpacked source). What tfmx's stages and passes
# touch: the layers it reroutes or fuses (Dense, EinsumDense, the convolutions, batch, layer and RMS
# normalization, multi-head attention, the recurrent layers), every optimizer (the update
# patterns), the trainer (the step tfmx traces, rewrites and rebuilds), saving, and the callbacks
# that save, restore or change what a step runs.
KERAS_TESTS: tuple[str, ...] = (
    "keras/src/layers/core/dense_test.py",
    "keras/src/layers/core/einsum_dense_test.py",
    "keras/src/layers/convolutional/conv_test.py",
    "keras/src/layers/convolutional/conv_transpose_test.py",
    "keras/src/layers/convolutional/depthwise_conv_test.py",
    "keras/src/layers/convolutional/separable_conv_test.py",
    "keras/src/layers/normalization/batch_normalization_test.py",
    "keras/src/layers/normalization/layer_normalization_test.py",
    "keras/src/layers/normalization/rms_normalization_test.py",
    "keras/src/layers/attention/multi_head_attention_test.py",
    "keras/src/layers/rnn/lstm_test.py",
    "keras/src/layers/rnn/gru_test.py",
    "keras/src/layers/rnn/rnn_test.py",
    "keras/src/layers/rnn/bidirectional_test.py",
    "keras/src/optimizers",
    "keras/src/trainers/trainer_test.py",
    "keras/src/saving/saving_lib_test.py",
    "keras/src/saving/saving_api_test.py",
    "keras/src/callbacks/model_checkpoint_test.py",
    "keras/src/callbacks/backup_and_restore_test.py",
    "keras/src/callbacks/early_stopping_test.py",
    "keras/src/callbacks/reduce_lr_on_plateau_test.py",
    "keras/src/callbacks/learning_rate_scheduler_test.py",
    "keras/src/callbacks/csv_logger_test.py",
    "keras/src/callbacks/terminate_on_nan_test.py",
    "keras/src/callbacks/lambda_callback_test.py",
    "keras/src/callbacks/swap_ema_weights_test.py",
)

# Tests of those files left out (pytest node ids), each for its time: those in which neither tfmx
# run traced a step (tfmx left them alone: jit_compile, steps_per_execution > 1, run_eagerly,
# quantized layers, a loss-scale optimizer's callbacks) that took over 5 s in a run, where faster
# tests of the same kind stay; and saving an EfficientNetB0's weights in shards (the sharding is
# the same for any model; a run saved and loaded smaller models' weights besides). Measured:
# about a fifth of the three runs' time.
_LEFT_OUT: dict[str, tuple[str, ...]] = {
    "keras/src/layers/attention/multi_head_attention_test.py::MultiHeadAttentionTest": (
        "test_quantize_int8",
    ),
    "keras/src/trainers/trainer_test.py::TestTrainer": (
        "test_fit_with_data_adapter_py_dataset_infinite_cw",
        "test_steps_per_epoch_match_one_epoch_eager",
        "test_steps_per_epoch_match_one_epoch_jit",
        "test_steps_per_epoch_not_match_but_high_enough_eager",
        "test_steps_per_epoch_not_match_but_high_enough_jit",
        "test_steps_per_execution_steps_count_101_jit",
        "test_steps_per_execution_steps_count_3_jit",
        "test_steps_per_execution_steps_count_unknown_dataset_size_101_jit",
        "test_steps_per_execution_steps_count_unknown_dataset_size_3_jit",
        "test_steps_per_execution_steps_per_epoch_match_multi_epoch_jit",
        "test_steps_per_execution_steps_per_epoch_match_one_epoch_jit",
        "test_steps_per_execution_steps_per_epoch_not_match_but_high_enough_eager",
        "test_steps_per_execution_steps_per_epoch_not_match_but_high_enough_jit",
        "test_steps_per_execution_steps_per_epoch_unknown_data_size_match_jit",
        "test_steps_per_execution_steps_per_epoch_unknown_data_size_not_match_but_high_enough_eager",
        "test_steps_per_execution_steps_per_epoch_unknown_data_size_not_match_but_high_enough_jit",
        "test_steps_per_execution_unrolled_steps_steps_count_3",
        "test_steps_per_execution_unrolled_steps_steps_count_32",
        "test_steps_per_execution_unrolled_steps_steps_count_8",
    ),
    "keras/src/saving/saving_lib_test.py::SavingTest": (
        "test_weights_sharding_efficientnet_b0_10",
        "test_weights_sharding_efficientnet_b0_512",
    ),
    "keras/src/callbacks/swap_ema_weights_test.py::SwapEMAWeightsTest": (
        "test_swap_ema_weights",
        "test_swap_ema_weights_with_loss_scale_optimizer",
    ),
}
DESELECTED: tuple[str, ...] = tuple(f"{owner}::{name}" for owner, names in _LEFT_OUT.items()
                                    for name in names)

# The child's environment carries none of tfmx's switches (TFMX_*): the tfmx run is tfmx's
# defaults (the tuner measures, the guard times the fused step against stock within its budget,
# a failing stage falls back to Keras's call and is recorded), what a user gets. This suite's
# conftest.py turns the guard off and strict mode on for the process running it; not for the
# child. The errors the stages recorded are printed (TfmxActivity).

TIMEOUT = 40 * 60  # seconds, each child

# The guard-off run must have rewritten a traced function in at least this many tests (a run
# where tfmx did nothing would give stock's outcomes too).
MIN_REWRITTEN = 100

RUNS: dict[str, dict[str, str] | None] = {
    "stock": None,  # tfmx not enabled
    "tfmx": {},  # tfmx's defaults
    "tfmx, guard off": {"TFMX_GUARD": "0"},  # every step tfmx can rewrite, rewritten
}
"""The child runs: name -> the TFMX_* switches of a run with ``--tfmx`` (None: stock)."""


def cache_root() -> Path:
    """Where unpacked Keras sources are kept (see :data:`ENV_DIR`)."""
    explicit = os.environ.get(ENV_DIR)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tfmx-keras-tests"


def keras_distribution() -> tuple[str, str]:
    """The distribution that installed the ``keras`` package and its version:
    ``("keras", "3.15.1")``, or ``("keras-nightly", "3.16.0.dev...")`` where keras-nightly
    replaced keras."""
    names = importlib.metadata.packages_distributions().get("keras", []) or ["keras"]
    name = "keras" if "keras" in names else names[0]
    return name.replace("_", "-"), importlib.metadata.version(name)


class NoKerasTests(RuntimeError):
    """The source distribution of the installed Keras carries no test files."""


def _has_tests(source: Path) -> bool:
    return any((source / "keras" / "src").rglob("*_test.py"))


def keras_source(version: str, distribution: str = "keras") -> Path:
    """The unpacked source distribution of ``distribution==version`` (downloaded on first use),
    kept as ``<cache>/<distribution>-<version>``.

    Raises:
        RuntimeError: ``pip download`` failed (no network to PyPI, or no such release), with
            what to do instead.
        NoKerasTests: the distribution carries no tests (keras-nightly's), with where to put a
            checkout's instead.
    """
    root = cache_root()
    target = root / f"{distribution}-{version}"
    no_tests = NoKerasTests(
        f"{distribution} {version}'s source distribution carries no test files; to run Keras's "
        f"own tests at this version, put a checkout of Keras at the commit it was built from "
        f"so that {target}/keras/src holds its *_test.py files (or point ${ENV_DIR} at a "
        f"directory holding {target.name}/)")
    if (target / "keras" / "src").is_dir():
        if not _has_tests(target):
            raise no_tests
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-d", tmp, f"{distribution}=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        archives = sorted(Path(tmp).glob("keras*.tar.gz"))
        if proc.returncode != 0 or not archives:
            raise RuntimeError(
                f"could not download Keras {version}'s source distribution, which carries the "
                f"tests this test runs: `{' '.join(cmd)}` exited {proc.returncode}:\n"
                f"{proc.stderr[-2000:]}\nThis test needs PyPI. Without a network, unpack "
                f"{distribution}-{version}.tar.gz (from PyPI's 'Download files') so that "
                f"{target}/keras/src exists, or point ${ENV_DIR} at a directory holding "
                f"{target.name}/.")
        with tarfile.open(archives[0]) as tar:
            extract = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(tmp, **extract)
        unpacked = Path(tmp) / archives[0].name.removesuffix(".tar.gz")
        try:
            unpacked.rename(target)
        except OSError:  # another process unpacked it first
            if not (target / "keras" / "src").is_dir():
                raise
    if not _has_tests(target):
        raise no_tests
    return target


def read_outcomes(path: Path) -> dict[str, dict[str, str]]:
    """The plugin's JSON lines as ``{nodeid: {"outcome", "message"}}``."""
    if not path.exists():
        return {}
    with open(path, encoding="utf-8") as f:
        return {d.pop("nodeid"): d for d in map(json.loads, filter(str.strip, f))}


@dataclasses.dataclass
class Run:
    """A finished child pytest: exit code, output, wall and CPU (user + system) seconds."""

    returncode: int
    output: str
    wall: float
    cpu: float


def run_keras_tests(source: Path, out: Path, tfmx_on: bool, env: Mapping[str, str]) -> Run:
    """Run :data:`KERAS_TESTS` from ``source`` in a child pytest writing outcomes to ``out``
    (its output to ``out`` with the suffix ``.log``)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", PLUGIN,
           f"--rootdir={source}", "-c", str(source / "pyproject.toml"), "-o", "addopts=",
           "--keras-outcomes", str(out), *(["--tfmx"] if tfmx_on else []), *KERAS_TESTS,
           *(f"--deselect={nodeid}" for nodeid in DESELECTED)]
    log = out.with_suffix(".log")
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, cwd=source, env=dict(env), stdout=f,
                                stderr=subprocess.STDOUT)
        timer = threading.Timer(TIMEOUT, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return Run(proc.returncode, log.read_text(encoding="utf-8", errors="replace"),
               time.perf_counter() - start, usage.ru_utime + usage.ru_stime)


def child_env(cache: Path) -> dict[str, str]:
    """The environment of both children: Keras on TensorFlow, the plugin importable, tfmx's
    defaults (no ``TFMX_*`` switch), the tuner's and the guard's cache in ``cache``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFMX_")}
    env["KERAS_BACKEND"] = "tensorflow"
    env["TF_CPP_MIN_LOG_LEVEL"] = env.get("TF_CPP_MIN_LOG_LEVEL", "3")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")) if p)
    env["TFMX_CACHE_DIR"] = str(cache)
    env["PYTHONFAULTHANDLER"] = "1"  # a crash prints every thread's Python stack
    return env


@dataclasses.dataclass
class TfmxActivity:
    """What tfmx did over the tfmx run, from each test's ``"tfmx"`` entry (the plugin's
    ``tfmx_summary``)."""

    tests: int = 0  # tests with an entry
    traced: int = 0  # tests in which tfmx traced a function
    rewritten: int = 0  # tests in which it rewrote one
    fused: int = 0  # chains and updates fused, over all tests
    errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @classmethod
    def of(cls, outcomes: Mapping[str, Mapping[str, object]]) -> TfmxActivity:
        activity = cls()
        for entry in outcomes.values():
            summary = entry.get("tfmx")
            if not isinstance(summary, dict):
                continue
            activity.tests += 1
            activity.traced += summary["traced"] > 0
            activity.rewritten += summary["rewritten"] > 0
            activity.fused += summary["fused"]
            activity.errors.update(summary["errors"])
        return activity

    def __str__(self) -> str:
        lines = [f"tfmx: {self.tests} tests, traced in {self.traced}, rewrote in "
                 f"{self.rewritten}, {self.fused} fused; errors its stages and passes recorded "
                 f"(the part left as it was), by the number of tests: {len(self.errors)}"]
        lines += [f"  {n} x {text[:300]}" for text, n in self.errors.most_common()]
        return "\n".join(lines)


def differences(stock: Mapping[str, Mapping[str, str]], fused: Mapping[str, Mapping[str, str]]
                ) -> list[str]:
    """One entry per test whose outcome differs (``missing``: the run recorded no outcome, its
    process died first), with the tfmx run's message (and stock's where stock did not pass)."""
    missing = {"outcome": "missing", "message": ""}
    lines = []
    for nodeid in sorted(set(stock) | set(fused)):
        a, b = stock.get(nodeid, missing), fused.get(nodeid, missing)
        if a["outcome"] == b["outcome"]:
            continue
        lines.append(f"{nodeid}: stock {a['outcome']}, tfmx {b['outcome']}")
        for name, entry in (("tfmx", b), ("stock", a)):
            if entry["message"] and entry["outcome"] != "passed":
                lines += [f"    {name}: {line}" for line in entry["message"].splitlines()]
    return lines


def test_keras_own_tests_same_outcomes_with_tfmx(tmp_path: Path) -> None:
    """Every selected Keras test has the same outcome (passed, failed, skipped, error, xfailed)
    with tfmx enabled (:data:`RUNS`) as stock. The runs go in parallel; each prints its wall
    time."""
    distribution, version = keras_distribution()
    try:
        source = keras_source(version, distribution)
    except NoKerasTests as e:
        pytest.skip(str(e))
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        pytest.fail(str(e), pytrace=False)
    env = child_env(tmp_path / "tfmx-cache")
    outs = {name: tmp_path / f"{name.replace(', ', '-').replace(' ', '-')}.jsonl"
            for name in RUNS}
    with ThreadPoolExecutor(len(RUNS)) as pool:
        futures = {name: pool.submit(run_keras_tests, source, outs[name], switches is not None,
                                     {**env, **(switches or {})})
                   for name, switches in RUNS.items()}
        runs = {name: f.result() for name, f in futures.items()}
    outcomes = {name: read_outcomes(out) for name, out in outs.items()}
    for name, run in runs.items():
        counts = collections.Counter(entry["outcome"] for entry in outcomes[name].values())
        print(f"Keras {version} tests, {name}: wall {run.wall:.0f} s, CPU {run.cpu:.0f} s, "
              f"exit {run.returncode}, {dict(sorted(counts.items()))}")
        # 0: all passed, 1: some failed; anything else is pytest's own failure (usage, crash,
        # killed at TIMEOUT)
        assert run.returncode in (0, 1), (
            f"the {name} run of Keras's tests exited {run.returncode}:\n{run.output[-5000:]}")
    assert outcomes["stock"], f"the stock run recorded no test:\n{runs['stock'].output[-5000:]}"
    activities = {name: TfmxActivity.of(outcomes[name]) for name in RUNS if name != "stock"}
    diffs = {}
    for name, activity in activities.items():
        print(f"{name}: {activity}")
        diffs[name] = differences(outcomes["stock"], outcomes[name])
    for name, diff in diffs.items():
        changed = sum(not line.startswith(" ") for line in diff)
        assert not diff, (f"{changed} Keras tests differ with tfmx enabled ({name}):\n"
                          + "\n".join(diff))
    # the same outcomes, and tfmx was at work: it rewrote a traced function in many tests
    rewriting = activities["tfmx, guard off"]
    assert rewriting.rewritten >= MIN_REWRITTEN, rewriting


def test_differences_lists_each_changed_outcome() -> None:
    """The comparison names a changed outcome, a test missing from one run, and keeps equal
    ones out."""
    stock = {"a": {"outcome": "passed", "message": ""},
             "b": {"outcome": "skipped", "message": "no jax"},
             "c": {"outcome": "passed", "message": ""}}
    fused = {"a": {"outcome": "passed", "message": ""},
             "b": {"outcome": "skipped", "message": "no jax"},
             "c": {"outcome": "failed", "message": "E   TypeError: boom"}}
    assert differences(stock, stock) == []
    assert differences(stock, fused) == ["c: stock passed, tfmx failed",
                                         "    tfmx: E   TypeError: boom"]
    assert differences(stock, {})[0] == "a: stock passed, tfmx missing"


def test_keras_source_failure_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    """Without the release on PyPI (here: a version that does not exist) the error names the
    command and what to do instead."""
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(RuntimeError, match="This test needs PyPI"):
        keras_source("0.0.0")
    assert list(tmp_path.iterdir()) == []


def test_keras_distribution_is_the_installed_keras() -> None:
    """The distribution found is the one whose version Keras reports (keras, or keras-nightly
    where it replaced keras)."""
    import keras

    name, version = keras_distribution()
    assert name in ("keras", "keras-nightly") and version == keras.__version__, (name, version)


def test_a_source_without_tests_says_where_to_put_them(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A source tree without test files (keras-nightly's source distribution) raises
    NoKerasTests naming where a checkout's tests go."""
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    (tmp_path / "keras-nightly-3.16.0.dev1" / "keras" / "src").mkdir(parents=True)
    with pytest.raises(NoKerasTests, match="carries no test files.*keras-nightly-3.16.0.dev1"):
        keras_source("3.16.0.dev1", "keras-nightly")
    (tmp_path / "keras-nightly-3.16.0.dev1" / "keras" / "src" / "a_test.py").write_text("")
    assert keras_source("3.16.0.dev1", "keras-nightly") == tmp_path / "keras-nightly-3.16.0.dev1"
