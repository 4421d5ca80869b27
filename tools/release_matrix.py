"""Run the suite's core under each TensorFlow and Keras combination tfmx supports or is about to.

Each combination gets a virtual environment of its own (``<root>/venv-<name>``) with its
TensorFlow and Keras and the test tools, and no tfmx installed: the tests run from a copy of
the repository's committed tree (``git archive HEAD``, or the working tree with
``--worktree``) on ``PYTHONPATH``, one pytest process per test file, so a file that fails to
import under one combination fails alone. The results go to ``<root>/matrix.json`` after each
test file (a run stopped early keeps what it ran; the table names the files it did not reach)
and, as a table, to the standard output; ``--changelog`` writes that table into CHANGELOG.md's
"Tested with" section (between its ``release-matrix`` markers).

Usage, from the repository root (each environment is built once; ``--rebuild`` builds it
again; ``--only`` picks combinations by name, ``--tests`` test files)::

    python tools/release_matrix.py
    python tools/release_matrix.py --only tf2.21-keras3.16 --tests tests/test_gelu.py
    python tools/release_matrix.py --changelog

The default combination (TensorFlow 2.21, Keras 3.15) is what CI runs; the matrix is run
before each release, and the package's dependency bounds are what it passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Combination:
    """One environment: its name, what pip installs (``requirements``), and a Keras
    distribution installed over the one TensorFlow brings (``keras``: keras-nightly replaces
    keras, both providing the ``keras`` package)."""

    name: str
    requirements: tuple[str, ...]
    keras: str = ""


COMBINATIONS = (
    Combination("tf2.21-keras3.15", ("tensorflow==2.21.0", "keras==3.15.1")),
    Combination("tf2.21-keras3.16", ("tensorflow==2.21.0",),
                keras="keras-nightly==3.16.0.dev2026102704"),
    Combination("tf2.22rc-keras3.16", ("tensorflow==2.22.0rc0",),
                keras="keras-nightly==3.16.0.dev2026102704"),
)

TOOLS = ("pytest>=7", "numpy", "jax", "matplotlib>=3.5", "scikit-learn>=1.0")
"""The test extra's tools the core needs (keras-hub and the package build are not in it)."""

CORE = (
    # the seam and unknown versions
    "tests/test_private_api.py", "tests/test_versions.py",
    # the loop hook: fit, evaluate, predict through tfmx, the step loop's dispatch
    "tests/test_keras.py", "tests/test_dispatch.py", "tests/test_one_step.py",
    # the guard, the price gate and tfmx's form traced beside a fit's steps
    "tests/test_guard.py", "tests/test_price_gate.py", "tests/test_background_trace.py",
    # families: stage and graph
    "tests/test_gelu.py", "tests/test_swish.py", "tests/test_feed_forward.py",
    "tests/test_layer_norm.py", "tests/test_attention.py", "tests/test_batch_norm.py",
    "tests/test_depthwise.py", "tests/test_rnn.py", "tests/test_bias_row.py",
    "tests/test_optimizer_update.py",
    # the newer families (Keras's own ops they hook, keras_hub's layers where it imports)
    "tests/test_squeeze_excite.py", "tests/test_rms_norm.py", "tests/test_grouped_attention.py",
    "tests/test_rotary.py", "tests/test_sibling_projections.py", "tests/test_gated_product.py",
    "tests/test_scaled_rms_norm.py", "tests/test_pointwise.py",
    # several steps a call, the epochs' data iterators, every family's fused form at once
    "tests/test_step_loop.py", "tests/test_epoch_data.py", "tests/test_fuse_always.py",
    # the Metal plans per TensorFlow release
    "tests/test_metal_plugins.py", "tests/test_metal_backends.py",
)
"""The suite's core: what a new Keras or TensorFlow can break."""

_VERSIONS = ("import sys, keras, tensorflow as tf; "
             "print(keras.__version__, tf.__version__, sys.version.split()[0])")


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


def build(combination: Combination, root: Path, rebuild: bool = False) -> Path:
    """The environment of ``combination`` under ``root`` (built if absent or ``rebuild``);
    returns its python."""
    venv = root / f"venv-{combination.name}"
    python = venv / "bin" / "python"
    if python.exists() and not rebuild:
        return python
    _run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    done = _run([*pip, *combination.requirements, *TOOLS])
    if done.returncode:
        raise RuntimeError(f"{combination.name}: pip failed:\n{done.stderr[-2000:]}")
    if combination.keras:
        _run([str(python), "-m", "pip", "uninstall", "-q", "-y", "keras"])
        done = _run([*pip, "--no-deps", "--force-reinstall", combination.keras])
        if done.returncode:
            raise RuntimeError(f"{combination.name}: {combination.keras}:\n{done.stderr[-2000:]}")
    return python


def tree(worktree: bool) -> Path:
    """The tree the tests run from: HEAD's (``git archive``), or the working tree."""
    if worktree:
        return ROOT
    out = Path(tempfile.mkdtemp(prefix="tfmx-matrix-tree-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "HEAD"],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(out, filter="data")
    return out


def run_file(python: Path, source: Path, test: str, timeout: float) -> dict:
    """One test file under one environment: its outcome counts and seconds."""
    env = {"PYTHONPATH": str(source), "PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
           "TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow"}
    start = time.monotonic()
    try:
        done = _run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                    cwd=source, env=env, timeout=timeout)
        out, code = done.stdout, done.returncode
    except subprocess.TimeoutExpired as exc:
        out, code = str(exc.stdout or ""), -1
    counts = {k: int(n) for n, k in re.findall(
        r"(\d+) (passed|failed|error|errors|skipped|deselected)", out.splitlines()[-1]
        if out.strip() else "")}
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in out.splitlines()
              if line.startswith(("FAILED ", "ERROR "))]
    return {"test": test, "ok": code == 0, "code": code, "counts": counts, "failed": failed,
            "seconds": round(time.monotonic() - start, 1)}


def table(results: list[dict]) -> str:
    """The markdown table of ``results`` (one row per combination)."""
    def stem(test: str) -> str:
        return Path(test).stem.removeprefix("test_")

    lines = ["| TensorFlow | Keras | Python | test files passed | failed |",
             "|---|---|---|---|---|"]
    for r in results:
        names = {True: [], False: []}
        for f in r["files"]:
            names[f["ok"]].append(stem(f["test"]))
        ran = {f["test"] for f in r["files"]}
        unrun = [stem(t) for t in r.get("tests", ()) if t not in ran]
        failed = ", ".join(names[False]) or "none"
        if unrun:  # a run stopped before its last file: what it did not reach, named
            failed += f"; not run: {', '.join(unrun)}"
        lines.append(f"| {r['tensorflow']} | {r['keras']} | {r['python']} | "
                     f"{len(names[True])} of {len(r['files']) + len(unrun)}: "
                     f"{', '.join(names[True])} | {failed} |")
    return "\n".join(lines)


def record_run(record: Path, result: dict) -> list[dict]:
    """Merge one combination's ``result`` into ``record`` (its previous run replaced), under
    a lock: combinations run at once each write their own row, after every test file, so a
    run stopped early leaves what it ran (``result["tests"]`` names what it was to run)."""
    import fcntl

    order = [c.name for c in COMBINATIONS]
    with open(record.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        previous = json.loads(record.read_text()) if record.exists() else []
        merged = {r["combination"]: r for r in previous}
        merged[result["combination"]] = result
        rows = sorted(merged.values(), key=lambda r: order.index(r["combination"]))
        record.write_text(json.dumps(rows, indent=1))
    return rows


def write_changelog(text: str, path: Path = ROOT / "CHANGELOG.md") -> None:
    """Put ``text`` between CHANGELOG.md's release-matrix markers."""
    start, end = "<!-- release-matrix -->", "<!-- /release-matrix -->"
    changelog = path.read_text()
    if start not in changelog:
        raise SystemExit(f"{path}: no {start} ... {end} markers to write the table between")
    head, rest = changelog.split(start, 1)
    path.write_text(f"{head}{start}\n{text}\n{end}{rest.split(end, 1)[1]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "tfmx-matrix")
    parser.add_argument("--only", nargs="*", default=None, help="combination names")
    parser.add_argument("--tests", nargs="*", default=list(CORE))
    parser.add_argument("--rebuild", action="store_true")
    parser.add_argument("--worktree", action="store_true", help="test the working tree")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per test file")
    parser.add_argument("--changelog", action="store_true",
                        help="write the table from <root>/matrix.json into CHANGELOG.md")
    args = parser.parse_args(argv)
    record = args.root / "matrix.json"
    if args.changelog:
        write_changelog(table(json.loads(record.read_text())))
        return 0
    args.root.mkdir(parents=True, exist_ok=True)
    source = tree(args.worktree)
    commit = "working tree" if args.worktree else _run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=True).stdout.strip()
    results, rows = [], []
    for combination in COMBINATIONS:
        if args.only is not None and combination.name not in args.only:
            continue
        python = build(combination, args.root, args.rebuild)
        keras, tf, py = _run([str(python), "-c", _VERSIONS], check=True).stdout.split()
        result = {"combination": combination.name, "keras": keras, "tensorflow": tf,
                  "python": py, "commit": commit, "tests": list(args.tests), "files": []}
        results.append(result)
        for test in args.tests:
            result["files"].append(run_file(python, source, test, args.timeout))
            f = result["files"][-1]
            print(f"{combination.name}: {test}: {'ok' if f['ok'] else 'FAILED'} "
                  f"{f['counts']} {f['seconds']} s {' '.join(f['failed'])}", flush=True)
            rows = record_run(record, result)
    print(table(rows))
    return 0 if all(f["ok"] for r in results for f in r["files"]) else 1


if __name__ == "__main__":
    sys.exit(main())
