"""The epoch time of small Keras models, where Keras's per-step loop is most of the step.

``python -m bench.loop`` fits each small model (:data:`MODELS`: a 16-32-1 MLP, a small CNN, a
small GRU) under Keras 3 stock, tfmx, XLA (``jit_compile=True``) and Keras 2 (``tf_keras``,
in a process of its own with ``TF_USE_LEGACY_KERAS=1``). Each mode runs in its own worker
process, which first fits its model once untimed (``--warm-epochs``: tracing, tfmx's guard and
its step loop's trial, :mod:`tfmx.step_loop`, happen there; one worker warms at a time, so
those trials measure on a machine no other worker loads), then on each round fits
``--epochs`` epochs, every epoch timed by an epoch-level callback (from ``on_epoch_begin`` to
``on_epoch_end``: the epoch's steps, no fit set-up). The modes take turns within a round
(interleaved, the order rotating), each round's figure is the median of its epochs, and the
table shows each mode's median over the rounds with its p25-p75 spread, tfmx / Keras 2 and
tfmx / stock, and how many steps a call tfmx's loop kept (from ``tfmx.report().loops``).

Keras 2 needs ``pip install "tf_keras==2.21.*"`` (the TensorFlow release's own); without it
that mode is left out and the table says so. ``--record [DIR]`` keeps one JSON record per
model (default ``bench/results/loop/``); :func:`format_loop_section` renders them for
BENCHMARKS.md. Figures need a quiet machine.

Example:
    >>> from bench.loop import summarize
    >>> row = summarize("mlp", {"stock": [120.0, 124.0, 122.0], "tfmx": [80.0, 82.0, 81.0],
    ...                         "keras2": [91.0, 90.0, 92.0]}, {"steps_per_call": 32})
    >>> row["modes"]["tfmx"]["median_ms"], row["ratios"]["tfmx/keras2"], row["steps_per_call"]
    (81.0, 0.89, 32)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

MODES = ("stock", "tfmx", "xla", "keras2")
RESULTS_DIR = Path(__file__).resolve().parent / "results" / "loop"
SCHEMA = "tfmx-bench-loop/1"
KERAS2_INSTALL = 'pip install "tf_keras==2.21.*"'


def _mlp(keras: Any) -> tuple[Any, tuple, tuple, str]:
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1)])
    return model, (16,), (1,), "mse"


def _small_cnn(keras: Any) -> tuple[Any, tuple, tuple, str]:
    model = keras.Sequential([keras.Input((12, 12, 1)),
                              keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.MaxPooling2D(), keras.layers.Flatten(),
                              keras.layers.Dense(10)])
    return model, (12, 12, 1), (10,), "mse"


def _small_gru(keras: Any) -> tuple[Any, tuple, tuple, str]:
    model = keras.Sequential([keras.Input((8, 4)), keras.layers.GRU(16),
                              keras.layers.Dense(1)])
    return model, (8, 4), (1,), "mse"


MODELS = {"mlp": _mlp, "small_cnn": _small_cnn, "small_gru": _small_gru}
"""Small models: name -> builder of (model, input shape, target shape, loss) from a Keras
module (Keras 3 or tf_keras). Each trains with Adam on 2048 samples, batches of 32 (64 steps
an epoch)."""


# -- the worker (one mode, one model, in its own process) ------------------------------------
def _keras(mode: str) -> Any:
    if mode == "keras2":
        import tf_keras

        return tf_keras
    import keras

    if mode == "tfmx":
        import tfmx

        tfmx.enable()
    return keras


def worker(mode: str, model_name: str, epochs: int, warm_epochs: int, samples: int,
           batch_size: int) -> None:
    """Serve one mode: fit once untimed, then one timed fit per ``run`` line on stdin, each
    answered with a JSON line of its epochs' milliseconds (and, for tfmx, its loop's choice)."""
    import numpy as np

    keras = _keras(mode)
    rng = np.random.default_rng(0)
    model, x_shape, y_shape, loss = MODELS[model_name](keras)
    x = rng.normal(size=(samples, *x_shape)).astype("float32")
    y = rng.normal(size=(samples, *y_shape)).astype("float32")
    options = {"jit_compile": mode == "xla"}
    model.compile(keras.optimizers.Adam(1e-3), loss, **options)
    times: list[float] = []

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            times.append((time.perf_counter() - self._start) * 1e3)

    def fit(n: int) -> list[float]:
        times.clear()
        model.fit(x, y, batch_size=batch_size, epochs=n, verbose=0, shuffle=False,
                  callbacks=[EpochTimer()])
        return list(times)

    fit(warm_epochs)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        answer: dict[str, Any] = {"epochs_ms": fit(epochs)}
        if mode == "tfmx":
            import tfmx

            loops = tfmx.report().loops
            answer["loop"] = loops[-1] if loops else None
        print(json.dumps(answer), flush=True)


# -- the parent: workers interleaved ---------------------------------------------------------
def _keras2_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tf_keras") is not None


class _Worker:
    def __init__(self, mode: str, model: str, args: argparse.Namespace) -> None:
        env = dict(os.environ)
        if mode == "keras2":
            env["TF_USE_LEGACY_KERAS"] = "1"
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        command = [sys.executable, "-m", "bench.loop", "--worker", mode, "--model", model,
                   "--epochs", str(args.epochs), "--warm-epochs", str(args.warm_epochs),
                   "--samples", str(args.samples), "--batch-size", str(args.batch_size)]
        self.mode = mode
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env=env,
                                        cwd=Path(__file__).resolve().parent.parent)

    def read(self) -> dict[str, Any]:
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"bench.loop: the {self.mode} worker ended "
                           f"(exit {self.process.wait()})")

    def run(self) -> dict[str, Any]:
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)


def measure(model: str, modes: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    """One model: its workers warmed, then ``args.rounds`` interleaved rounds."""
    workers: list[_Worker] = []
    try:
        for mode in modes:  # one warms at a time: tfmx's trials measure on a quiet machine
            workers.append(_Worker(mode, model, args))
            workers[-1].read()  # ready
        rounds: dict[str, list[float]] = {mode: [] for mode in modes}
        loop = None
        for r in range(args.rounds):
            for w in workers[r % len(workers):] + workers[:r % len(workers)]:
                answer = w.run()
                rounds[w.mode].append(statistics.median(answer["epochs_ms"]))
                loop = answer.get("loop", loop)
        return summarize(model, rounds, loop)
    finally:
        for w in workers:
            w.close()


def _spread(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    if len(ordered) > 1:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {"median_ms": round(statistics.median(ordered), 3), "p25_ms": round(q1, 3),
            "p75_ms": round(q3, 3), "rounds": len(ordered)}


def summarize(model: str, rounds: Mapping[str, Sequence[float]],
              loop: Mapping[str, Any] | None) -> dict[str, Any]:
    """A model's row: per mode the median epoch (ms) over the rounds and its spread, the
    ratios of tfmx to Keras 2 and to stock, tfmx's steps a call."""
    modes = {mode: _spread(values) for mode, values in rounds.items() if values}
    tfmx = modes.get("tfmx", {}).get("median_ms")
    ratios = {f"tfmx/{other}": round(tfmx / modes[other]["median_ms"], 3)
              for other in ("keras2", "stock", "xla")
              if tfmx and other in modes and modes[other]["median_ms"]}
    return {"model": model, "modes": modes, "ratios": ratios,
            "steps_per_call": (loop or {}).get("steps_per_call"), "loop": dict(loop or {})}


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table of rows (:func:`summarize`): ms an epoch, median (p25-p75).

    >>> print(format_table([summarize("mlp", {"stock": [2.0], "tfmx": [1.0]}, None)]))
    | model | stock | tfmx | xla | keras2 | tfmx/keras2 | tfmx/stock | tfmx steps a call |
    |---|---|---|---|---|---|---|---|
    | mlp | 2.0 (2.0-2.0) | 1.0 (1.0-1.0) | - | - | - | 0.5 | - |
    """
    lines = ["| model | " + " | ".join(MODES) + " | tfmx/keras2 | tfmx/stock | "
             "tfmx steps a call |", "|---" * (len(MODES) + 4) + "|"]
    for row in rows:
        cells = []
        for mode in MODES:
            m = row["modes"].get(mode)
            cells.append(f"{m['median_ms']:.1f} ({m['p25_ms']:.1f}-{m['p75_ms']:.1f})"
                         if m else "-")
        ratios = row.get("ratios", {})
        cells += [str(ratios.get("tfmx/keras2", "-")), str(ratios.get("tfmx/stock", "-")),
                  str(row.get("steps_per_call") or "-")]
        lines.append(f"| {row['model']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_records(rows: Sequence[Mapping[str, Any]], command: str, env: Mapping[str, Any],
                  directory: str | Path = RESULTS_DIR) -> list[Path]:
    """One JSON record per model and processor (replacing that model's earlier one measured on
    the same processor, :func:`bench.records.processor_key`)."""
    from bench.records import processor_key

    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    processor = processor_key(env)
    paths = []
    for row in rows:
        name = f"{row['model']}-{processor}" if processor else row["model"]
        path = folder / f"{name}.json"
        path.write_text(json.dumps({"schema": SCHEMA, "command": command, "env": dict(env),
                                    **row}, indent=1, sort_keys=True) + "\n")
        paths.append(path)
    return paths


def load_records(directory: str | Path = RESULTS_DIR) -> list[dict[str, Any]]:
    """Every record of this benchmark in ``directory`` ([] if none)."""
    from bench.records import read_json_records

    return read_json_records(directory, lambda record: record.get("schema") == SCHEMA)


def format_loop_section(records: Sequence[Mapping[str, Any]]) -> str:
    """BENCHMARKS.md's section of these records ("" without any): a table per machine."""
    if not records:
        return ""
    from bench.environment import by_machine, format_environment

    lines = ["## Small models: the epoch, where Keras's per-step loop is most of it", "",
             "Milliseconds an epoch (64 steps of 32 samples), median over interleaved rounds "
             "(p25-p75); Keras 2 is tf_keras in a process of its own. tfmx runs several steps "
             "a call where its fit's trial measured it faster (tfmx.step_loop).", ""]
    for group in by_machine(records).values():
        commands = dict.fromkeys(record["command"] for record in group)
        states = {(r["env"].get("onednn"), r["env"].get("onednn_env")) for r in group}
        onednn = "; ".join(
            f"oneDNN {'on' if on else 'off'} in every mode ("
            + ("TensorFlow's default state here" if set_by is None
               else f"TF_ENABLE_ONEDNN_OPTS={set_by}") + ")"
            for on, set_by in sorted(states, key=str))
        lines += [format_table(group), "",
                  f"Machine: {format_environment(group[0]['env'])}. {onednn}.",
                  *(f"Command: `{command}`" for command in commands), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.loop``: measure, print the table, ``--record`` keeps it."""
    parser = argparse.ArgumentParser(prog="python -m bench.loop", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=list(MODELS), choices=sorted(MODELS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--epochs", type=int, default=5, help="timed epochs a round")
    parser.add_argument("--warm-epochs", type=int, default=100,
                        help="the untimed first fit (tfmx's trials happen there)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--record", nargs="?", const=str(RESULTS_DIR), default=None,
                        metavar="DIR", help="keep one JSON record per model")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.model[0], args.epochs, args.warm_epochs, args.samples,
               args.batch_size)
        return 0
    modes = list(args.modes)
    if "keras2" in modes and not _keras2_available():
        print(f"bench.loop: Keras 2 left out: tf_keras is not installed ({KERAS2_INSTALL})")
        modes.remove("keras2")
    command = shlex.join(["python", "-m", "bench.loop", *argv])
    rows = [measure(model, modes, args) for model in args.model]
    print(format_table(rows))
    if args.record:
        from recipes._machine import environment

        for path in write_records(rows, command, environment(), args.record):
            print(f"recorded {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
