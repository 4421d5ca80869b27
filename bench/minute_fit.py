"""A one-minute fit: the wall time of a whole ``fit`` that takes stock about a minute, stock
against tfmx and XLA, each fit in a process of its own.

``python -m bench.fit_price --minute`` (:func:`run_minute_fits`) measures, per workload of
:data:`bench.workloads.WORKLOADS` (the zoo's or the benchmark's own, with its random data,
as :func:`bench.fit_price.fit_data` makes it):

1. Sizing: one stock fit of 3 epochs of ``samples`` in a new process (``probe``); its later
   epochs give the time of an epoch, its first one the tracing on top. The timed fits run the
   number of epochs that brings stock's whole ``fit`` nearest ``target_s`` (:func:`size_epochs`;
   60 s by default, at least one epoch).
2. The tuning cache: small models (:data:`SMALL_MODELS`) fitted with tfmx first, then one
   untimed tfmx fit like the timed ones (same workload, data and
   epochs: the tuner weighs a form's first call against the steps the fit plans), in a new
   process (``warm``: ``tfmx.enable()`` as a user calls it, the tuner measuring what the cache
   lacks, the whole-step guard storing its trial's outcome once the trial ends) with the same
   tuning cache (``$TFMX_CACHE_DIR``, or ``--cache-dir``) as the timed fits: those run on a
   machine where this model was fitted with tfmx before. Each tfmx fit records how many
   decisions the cache held before it and after, and how many of its own decisions were
   measured or read from the cache (``tuning``). With ``warm=False`` there is no such fit:
   the cache as it is.
3. ``rounds`` interleaved rounds of one fit per mode (the order rotated every round), each in a
   new process (:func:`child_command`): ``stock`` (tfmx off), ``tfmx`` (``tfmx.enable()``, its
   defaults: tuner, guard, XLA offered), ``xla`` (``jit_compile=True``). Every process runs in
   TensorFlow's default oneDNN state (``TF_ENABLE_ONEDNN_OPTS`` removed from its
   environment). A fit is timed from ``fit``'s call to its return: tracing, the rewrite, the
   guard's trial, XLA's compilation and the tuner's measurements included; building and
   compiling the model and making the data are not. An XLA fit still running at
   :data:`XLA_CAP` x stock's predicted fit (the sizing's) stops at the end of its batch: it
   is not the best alternative, and its figure is a lower bound (``stopped``: the seconds and
   steps it ran), shown ``>`` in the table. (XLA's CPU convolutions make some models' steps
   several times stock's: their whole fits would take the bench most of its time for no
   figure the verdict reads.)
4. Medians per mode; ``tfmx/stock``, ``xla/stock``, the best alternative (the faster of stock
   and XLA) and ``tfmx/best``, against the targets: tfmx at most :data:`VS_STOCK` x stock and
   never above the best alternative (:func:`verdict`).

``--record`` writes one JSON record per workload and oneDNN state into the subfolder
``minute`` of ``bench/results/fit_price/`` (:data:`RESULTS_DIR`); :func:`format_minute_section`
renders them for BENCHMARKS.md.

Example:
    >>> size_epochs({"first_epoch_s": 7.0, "epoch_s": 5.0}, target_s=60.0)
    12
    >>> verdict({"stock": 60.0, "xla": 58.0, "tfmx": 50.0})["meets"]
    True
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.environment import by_machine, format_onednn
from bench.onednn import run_json_process
from bench.records import RESULTS_DIR as RECORDS_DIR
from bench.records import narrow_command, processor_key, read_json_records

SMALL_MODELS = ("mlp", "small_cnn", "gru")
"""Fitted with tfmx before anything is timed, one epoch each in a process of its own (``small``
fits): the machine as one where small models were fitted with tfmx before. Their tuners and
guard trials run to their end (:data:`SMALL_ENV`), as many shorter fits of them would over
time, so that the machine's figures (``tfmx.tuning_cache.figures_cache``: first calls and step
gains relative to stock's) and the tuning cache hold what these models measured; the timed
fits' own decisions are not among theirs."""

MODES = ("stock", "tfmx", "xla")
"""The timed fits: Keras's own, with tfmx, XLA-compiled (``jit_compile=True``)."""

TARGET_S = 60.0
"""The stock fit's wall time the sizing aims at."""

VS_STOCK = 0.90
"""tfmx's fit over stock's that the one-minute fit is measured against."""

XLA_CAP = 2.0
"""An XLA fit stops once it has run this many times stock's predicted fit (a lower bound)."""

PROBE_EPOCHS = 3
SAMPLES = 2048
RESULTS_DIR = RECORDS_DIR / "fit_price" / "minute"
"""Where ``--record`` writes and :func:`load_minute_fits` reads."""

SCHEMA = 1
"""The records' layout (kept as ``minute_fit_schema``)."""


def size_epochs(probe: Mapping[str, float], target_s: float = TARGET_S) -> int:
    """The epochs that bring a stock fit nearest ``target_s`` seconds: the probe's epoch time
    (``epoch_s``) times the epochs, plus what its first epoch took over it (tracing); at least
    one.

    >>> size_epochs({"first_epoch_s": 3.0, "epoch_s": 0.5}, target_s=1.0)
    1
    """
    extra = max(0.0, probe["first_epoch_s"] - probe["epoch_s"])
    return max(1, round((target_s - extra) / max(probe["epoch_s"], 1e-9)))


def verdict(medians: Mapping[str, float]) -> dict[str, Any]:
    """tfmx's median fit against the targets: ``tfmx/stock`` at most :data:`VS_STOCK`, and
    not above the best alternative (the faster of stock and XLA).

    >>> v = verdict({"stock": 60.0, "xla": 50.0, "tfmx": 52.0})
    >>> round(v["tfmx/stock"], 3), v["best_alternative"], v["vs_stock_met"], v["vs_best_met"]
    (0.867, 'xla', True, False)
    """
    alternatives = {m: medians[m] for m in ("stock", "xla") if m in medians}
    best = min(alternatives, key=alternatives.get) if alternatives else None
    tfmx, stock = medians.get("tfmx"), medians.get("stock")
    vs_stock = tfmx / stock if tfmx is not None and stock else None
    vs_best = tfmx / alternatives[best] if tfmx is not None and best else None
    out = {"tfmx/stock": vs_stock,
           "xla/stock": medians["xla"] / stock if "xla" in medians and stock else None,
           "best_alternative": best, "tfmx/best": vs_best,
           "vs_stock_met": vs_stock is not None and vs_stock <= VS_STOCK,
           "vs_best_met": vs_best is not None and vs_best <= 1.0}
    out["meets"] = out["vs_stock_met"] and out["vs_best_met"]
    return out


# -- one fit, in its own process -------------------------------------------------------------------
def _tuning(backend: str | None) -> dict[str, Any]:
    from tfmx.step_gain import expected_gain
    from tfmx.tuning_cache import TuningCache, cache_dir

    cache = TuningCache.for_backend(backend) if backend else None
    held = len(cache.contents()["decisions"]) if cache is not None else None
    ratio, how = expected_gain(cache)
    return {"cache_dir": str(cache_dir()), "held": held,
            "gain_expected": f"{ratio:.2f} x stock's step ({how})"}


def planned_steps(epochs: int, samples: int, batch_size: int) -> int:
    """The steps a fit of ``epochs`` over ``samples`` in batches of ``batch_size`` runs (the last
    batch of an epoch may be short).

    >>> planned_steps(3, 100, 32)
    12
    """
    return epochs * -(-samples // batch_size)


SMALL_ENV = {"TFMX_GUARD_BUDGET": "none", "TFMX_TUNE_SHARE": "none"}
"""A ``small`` fit's settings: its guard's trial and its tuner run to their end (the tuner
within its own budget, ``tfmx.tuner.DEFAULT_BUDGET_S``), not within a share of its short fit."""


def fit_in_process(spec: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`_fit` with, for a ``small`` fit, :data:`SMALL_ENV` set in this process while it
    runs."""
    if spec.get("mode") != "small":
        return _fit(spec)
    before = {k: os.environ.get(k) for k in SMALL_ENV}
    os.environ.update(SMALL_ENV)
    try:
        return _fit(spec)
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _fit(spec: Mapping[str, Any]) -> dict[str, Any]:
    """One fit as ``spec`` says (``workload``, ``mode``: one of :data:`MODES`, ``probe``,
    ``warm`` or ``small`` (:data:`SMALL_MODELS`), ``epochs``, ``samples``, ``batch_size``), in
    this process; what it measured:
    ``seconds`` (``fit``'s call to its return), the probe's ``first_epoch_s`` and ``epoch_s``,
    a tfmx fit's ``guard`` line, its report's first line (``report_line``) and ``tuning``
    (the cache's folder, decisions it held before the fit and after, and this fit's decisions
    by source), and the machine (``env``). With ``limit_s`` in ``spec`` the fit stops at the
    end of the first batch that ends past it, and ``stopped`` says after how many seconds and
    steps (of how many planned): ``seconds`` is then a lower bound of the whole fit's."""
    import keras

    import tfmx
    from bench.workloads import WORKLOADS, build_model, random_dataset
    from recipes._machine import environment
    from tfmx import state
    from tfmx.verdict import verdict as verdict_line

    workload = WORKLOADS[spec["workload"]]
    mode = spec["mode"]
    # the data bench.fit_price's fits use: one batch of all samples, as numpy arrays
    x, y = (t.numpy() for t in next(iter(random_dataset(workload, int(spec["samples"]), 0,
                                                        batches=1))))
    out: dict[str, Any] = {"mode": mode}
    tuning = None
    if mode in ("tfmx", "warm", "small"):
        tfmx.enable()
        tfmx.report(reset=True)
        tuning = _tuning(state.options().backend.name)
    else:
        tfmx.disable()
    model = build_model(workload, {"warm": "tfmx", "small": "tfmx", "probe": "stock"}.get(
        mode, mode), 0, None)
    ends: list[float] = []
    epochs = PROBE_EPOCHS if mode == "probe" else int(spec["epochs"])
    marks = keras.callbacks.LambdaCallback(on_epoch_end=lambda *_: ends.append(time.perf_counter()))
    limit = spec.get("limit_s")
    steps = [0]

    def batch_end(*_: Any, **__: Any) -> None:
        steps[0] += 1
        if limit is not None and time.perf_counter() - start > float(limit):
            model.stop_training = True

    callbacks = [marks] if mode == "probe" else []
    if limit is not None:
        callbacks.append(keras.callbacks.LambdaCallback(on_train_batch_end=batch_end))
    start = time.perf_counter()
    model.fit(x, y, epochs=epochs, batch_size=int(spec["batch_size"]), verbose=0,
              callbacks=callbacks or None)
    out["seconds"] = time.perf_counter() - start
    planned = planned_steps(epochs, len(x), int(spec["batch_size"]))
    if limit is not None and steps[0] < planned:
        out["stopped"] = {"limit_s": float(limit), "seconds": out["seconds"],
                          "steps": steps[0], "of_steps": planned}
    if mode == "probe":
        out["first_epoch_s"] = ends[0] - start
        out["epoch_s"] = statistics.median(b - a for a, b in zip(ends, ends[1:]))
    if tuning is not None:
        report = tfmx.report()
        out["report_line"] = verdict_line(report)
        guards = [g.summary() for g in report.guards if g.function.endswith("train_step")]
        if guards:
            out["guard"] = guards[0].describe()
            out["kept"] = guards[0].kept
        sources: dict[str, int] = {}
        for d in report.decisions:
            key = str(getattr(d, "source", "?")).split(" ")[0]
            sources[key] = sources.get(key, 0) + 1
        tuning["decisions"] = sources
        tuning["held_after"] = _tuning(state.options().backend.name)["held"]
        out["tuning"] = tuning
        tfmx.disable()
    out["env"] = environment()
    return out


def child_command(spec: Mapping[str, Any], result_path: str,
                  cache_dir: str | None = None) -> tuple[list[str], dict[str, str]]:
    """Command line and environment of the process that runs one fit
    (``python -m bench.minute_fit SPEC RESULT_PATH``): TensorFlow's default oneDNN state
    (``TF_ENABLE_ONEDNN_OPTS`` removed), ``TFMX_CACHE_DIR`` set to ``cache_dir`` when given.

    >>> argv, env = child_command({"mode": "stock"}, "/tmp/r.json", cache_dir="/tmp/c")
    >>> argv[1:3], json.loads(argv[3]), "TF_ENABLE_ONEDNN_OPTS" in env, env["TFMX_CACHE_DIR"]
    (['-m', 'bench.minute_fit'], {'mode': 'stock'}, False, '/tmp/c')
    """
    env = {k: v for k, v in os.environ.items() if k != "TF_ENABLE_ONEDNN_OPTS"}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if cache_dir:
        env["TFMX_CACHE_DIR"] = str(cache_dir)
    return [sys.executable, "-m", "bench.minute_fit", json.dumps(dict(spec)), result_path], env


def launch(spec: Mapping[str, Any], cache_dir: str | None = None) -> dict[str, Any]:
    """Run one fit (:func:`fit_in_process`) in a new process (:func:`child_command`) and
    return what it measured; a RuntimeError if the process fails."""
    with tempfile.TemporaryDirectory(prefix="tfmx-minute-") as tmp:
        path = os.path.join(tmp, "fit.json")
        argv, env = child_command(spec, path, cache_dir)
        return run_json_process(argv, env, path,
                                f"bench.minute_fit: the {spec.get('mode')} fit's process")


# -- the measurement -------------------------------------------------------------------------------
def run_minute_fits(models: Sequence[str], target_s: float = TARGET_S, samples: int = SAMPLES,
                    batch_size: int = 32, rounds: int = 3, warm: bool = True,
                    cache_dir: str | None = None,
                    run: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None,
                    small_models: Sequence[str] = SMALL_MODELS,
                    on_row: Callable[[dict[str, Any]], Any] | None = None,
                    ) -> list[dict[str, Any]]:
    """The one-minute fit of each of ``models`` (see the module doc): one row per workload
    with the sizing, the warm-up fit, every fit, each mode's median seconds and
    :func:`verdict`. ``run`` runs one fit spec (default: :func:`launch`, a new process with
    ``cache_dir``); ``on_row`` gets each row as soon as it is measured; with ``warm``,
    ``small_models`` are fitted first (``small`` fits, recorded in each row)."""
    def default_run(spec: Mapping[str, Any]) -> dict[str, Any]:
        return launch(spec, cache_dir)

    run = run or default_run
    rows = []
    small = [run({"workload": m, "mode": "small", "epochs": 1, "samples": samples,
                  "batch_size": batch_size}) for m in (small_models if warm else ())]
    for fit in small:
        print(f"small model fitted with tfmx: {fit.get('guard') or fit.get('report_line')}",
              file=sys.stderr, flush=True)
    small_fits = [{"workload": m, **{k: f.get(k) for k in ("seconds", "kept", "tuning")}}
                  for m, f in zip(small_models, small)]
    for name in models:
        base = {"workload": name, "samples": samples, "batch_size": batch_size}
        probe = run({**base, "mode": "probe", "epochs": PROBE_EPOCHS})
        epochs = size_epochs(probe, target_s)
        predicted = max(0.0, probe["first_epoch_s"] - probe["epoch_s"]) + epochs * probe["epoch_s"]
        print(f"{name}: an epoch of stock {probe['epoch_s']:.2f} s -> {epochs} epoch(s), "
              f"about {predicted:.0f} s", file=sys.stderr, flush=True)
        warmed = run({**base, "mode": "warm", "epochs": epochs}) if warm else None
        fits: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        limits = {"xla": XLA_CAP * max(predicted, probe["epoch_s"])}
        for r in range(rounds):
            for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
                spec = {**base, "mode": mode, "epochs": epochs}
                if mode in limits:
                    spec["limit_s"] = limits[mode]
                fits[mode].append(run(spec))
                stopped = fits[mode][-1].get("stopped")
                print(f"{name} round {r + 1} {mode}: {fits[mode][-1]['seconds']:.2f} s"
                      + (f" (stopped after {stopped['steps']} of {stopped['of_steps']} steps)"
                         if stopped else ""), file=sys.stderr, flush=True)
        medians = {m: statistics.median(f["seconds"] for f in fits[m]) for m in MODES}
        row = {"workload": name, "target_s": target_s, "epochs": epochs, "samples": samples,
               "batch_size": batch_size, "steps": planned_steps(epochs, samples, batch_size),
               "rounds": rounds,
               "sizing": {k: probe.get(k) for k in ("first_epoch_s", "epoch_s", "seconds")}
               | {"predicted_s": predicted},
               "small": small_fits,
               "warm": None if warmed is None else {k: warmed.get(k) for k in
                                                    ("seconds", "guard", "kept", "tuning")},
               "median_s": medians, "verdict": verdict(medians), "fits": fits,
               "lower_bounds": lower_bounds(fits),
               "env": fits["stock"][0].get("env") or {}}
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def lower_bounds(fits: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """The modes whose median is a lower bound: more than half their fits stopped at their
    limit (``stopped``), so the median fit is one that stopped.

    >>> lower_bounds({"stock": [{}], "xla": [{"stopped": {}}, {"stopped": {}}, {}]})
    ['xla']
    """
    return [m for m, runs in fits.items()
            if runs and 2 * sum(1 for f in runs if "stopped" in f) > len(runs)]


# -- records and tables ----------------------------------------------------------------------------
def record_name(row: Mapping[str, Any]) -> str:
    """The file name of ``row``'s record: its workload, oneDNN state and processor
    (``bench.records.processor_key``, where known).

    >>> record_name({"workload": "zoo_bert", "env": {"onednn": True}})
    'zoo_bert-onednn-on.json'
    >>> record_name({"workload": "mlp", "env": {"onednn": False, "cpu_vendor": "AuthenticAMD",
    ...                                         "cpu_family": "25", "cpu_model": "1"}})
    'mlp-onednn-off-amd-f25-m1.json'
    """
    env = row.get("env") or {}
    onednn = env.get("onednn")
    state = "unknown" if onednn is None else ("on" if onednn else "off")
    name = "-".join(filter(None, (f"{row['workload']}-onednn-{state}", processor_key(env))))
    return re.sub(r"[^\w.-]+", "_", name) + ".json"


def write_minute_fits(rows: Iterable[Mapping[str, Any]], command: str,
                      directory: str | Path | None = None) -> list[Path]:
    """Write one record per row (``minute_fit_schema``, ``command`` and, as ``reproduce``, the
    same command for that workload alone) into ``directory`` (default :data:`RESULTS_DIR`),
    replacing the file of the same workload and state; the paths written.

    >>> import tempfile
    >>> row = {"workload": "mlp", "env": {"onednn": False}, "median_s": {}}
    >>> [p.name for p in write_minute_fits([row], "", tempfile.mkdtemp())]
    ['mlp-onednn-off.json']
    """
    folder = Path(directory) if directory is not None else RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for row in rows:
        record = {"minute_fit_schema": SCHEMA,
                  "command": narrow_command(command) if command else "",
                  "reproduce": narrow_command(command, row["workload"]) if command else "",
                  **row}
        path = folder / record_name(row)
        path.write_text(json.dumps(record, indent=1, default=str) + "\n")
        written.append(path)
    return written


def load_minute_fits(directory: str | Path | None = None) -> list[dict[str, Any]]:
    """Every one-minute-fit record in ``directory`` (default :data:`RESULTS_DIR`), by file
    name; [] if there is no folder.

    >>> load_minute_fits("/no/such/folder")
    []
    """
    return read_json_records(directory if directory is not None else RESULTS_DIR,
                             lambda record: record.get("minute_fit_schema") == SCHEMA)


def _s(value: float | None, bound: bool = False) -> str:
    return "-" if value is None else f"{'> ' if bound else ''}{value:.1f}"


def _r(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _tuning_cell(row: Mapping[str, Any]) -> str:
    """How the timed tfmx fits found the tuning cache: decisions held before the first one,
    and their own decisions measured (missing from it), read from it, and left unmeasured (on
    the machine's prior for their family, ``tfmx.tuning_prior``, or Keras's form).

    >>> fits = [{"tuning": {"held": 12, "decisions": {"measured": 2, "cached": 9, "prior": 20,
    ...                                               "conservative": 4}}}] * 2
    >>> print(_tuning_cell({"warm": {}, "fits": {"tfmx": fits}}))  # doctest: +NORMALIZE_WHITESPACE
    12 held; 4 measured, 18 cached, 40 on the family's form measured here (unmeasured),
    8 left to Keras's form (unmeasured)
    >>> row = {"small": [{"workload": "mlp"}], "warm": {"seconds": 9.0}, "fits": {"tfmx": fits}}
    >>> _tuning_cell(row).split(";")[0]
    'small models (mlp) and warm-up fit, 12 held'
    >>> timed = [{"seconds": s, "tuning": {"held": 5}} for s in (50.0, 41.5)]
    >>> _tuning_cell({"fits": {"tfmx": timed}}).split("; ")[-1]  # as the cache filled
    'tfmx fits in the order run: 50.0, 41.5 s'
    """
    fits = (row.get("fits") or {}).get("tfmx") or []
    tunings = [f.get("tuning") or {} for f in fits]
    if not tunings:
        return "-"
    measured = sum((t.get("decisions") or {}).get("measured", 0) for t in tunings)
    cached = sum((t.get("decisions") or {}).get("cached", 0) for t in tunings)
    kept = sum((t.get("decisions") or {}).get("conservative", 0) for t in tunings)
    prior = sum((t.get("decisions") or {}).get("prior", 0) for t in tunings)
    small = ", ".join(f.get("workload", "?") for f in row.get("small") or ())
    warm = (f"small models ({small}) and " if small else "") + (
        "warm-up fit, " if row.get("warm") else "")
    on_prior = f", {prior} on the family's form measured here (unmeasured)" if prior else ""
    left = f", {kept} left to Keras's form (unmeasured)" if kept else ""
    gain = tunings[0].get("gain_expected")
    seconds = [f["seconds"] for f in fits if f.get("seconds")]
    order = (f"; tfmx fits in the order run: {', '.join(f'{t:.1f}' for t in seconds)} s"
             if len(seconds) > 1 else "")
    return (f"{warm}{tunings[0].get('held')} held; {measured} measured, {cached} cached"
            f"{on_prior}{left}" + (f"; gain expected {gain}" if gain else "") + order)


HEADER = ["| workload | fit | stock s | XLA s | tfmx s | tfmx / stock | tfmx / best | "
          f"<= {VS_STOCK:g} x stock | <= best | tuning cache (timed tfmx fits) |",
          "|---|---|---:|---:|---:|---:|---:|---|---|---|"]


def format_row(row: Mapping[str, Any]) -> str:
    """One workload's table row.

    >>> row = {"workload": "transformer", "epochs": 20, "samples": 2048, "batch_size": 32,
    ...        "steps": 1280, "median_s": {"stock": 61.0, "xla": 70.0, "tfmx": 50.0},
    ...        "verdict": verdict({"stock": 61.0, "xla": 70.0, "tfmx": 50.0})}
    >>> print(format_row(row))  # doctest: +NORMALIZE_WHITESPACE
    | transformer | 20 x 2048 (1280 steps of 32) | 61.0 | 70.0 | 50.0 | 0.820 |
      0.820 (stock) | yes | yes | - |
    """
    med, v = row.get("median_s") or {}, row.get("verdict") or {}
    best, bounds = v.get("best_alternative"), row.get("lower_bounds") or ()
    return (f"| {row['workload']} | {row.get('epochs')} x {row.get('samples')} "
            f"({row.get('steps')} steps of {row.get('batch_size')}) | "
            + " | ".join(_s(med.get(m), m in bounds) for m in ("stock", "xla", "tfmx"))
            + f" | {_r(v.get('tfmx/stock'))} | {_r(v.get('tfmx/best'))}"
            + (f" ({'XLA' if best == 'xla' else best})" if best else "")
            + f" | {'yes' if v.get('vs_stock_met') else 'no'} | "
              f"{'yes' if v.get('vs_best_met') else 'no'} | {_tuning_cell(row)} |")


def format_minute_fits(rows: Sequence[Mapping[str, Any]]) -> str:
    """The table of :func:`run_minute_fits`' rows, then each workload's tfmx guard line.

    >>> print(format_minute_fits([]).splitlines()[1])
    |---|---|---:|---:|---:|---:|---:|---|---|---|
    """
    lines = [*HEADER, *(format_row(r) for r in rows)]
    for r in rows:
        for fit in ((r.get("fits") or {}).get("tfmx") or [])[-1:]:
            if fit.get("guard"):
                lines.append(f"- {r['workload']}, tfmx (last round): {fit['guard']}")
    return "\n".join(lines)


INTRO = (
    "The wall time of a whole `model.fit` that takes stock about {target:g} s on the machine "
    "(epochs sized by a stock probe fit), from the call to its return: tracing, tfmx's "
    "rewrite and tuning, the whole-step guard's trial and XLA's compilation included. Each "
    "fit in a new process, in TensorFlow's default oneDNN state, from the same initial "
    "weights; stock, XLA (`jit_compile=True`) and tfmx (`tfmx.enable()`) interleaved over the "
    "rounds, the median of each. Before the rounds, in the tuning cache the timed tfmx fits "
    "use, small models (" + ", ".join(SMALL_MODELS) + ": one epoch each, their tuners and "
    "guard trials run to their end) and then one untimed fit of the workload are fitted "
    "with tfmx, as on a machine where small models and this model were fitted with tfmx "
    "before (the last column: which of them preceded the row's fits, decisions the cache "
    "held, how many of the timed fits' "
    "decisions were measured or read from it, and the step gain the price gate expected on "
    "the machine's figures). An XLA fit still running at {cap:g} x stock's predicted fit "
    "stops there: `>` marks such a median, a lower bound. Every fit's process imports tfmx "
    "(stock's and XLA's without enabling it), so where oneDNN is off every mode runs with "
    "the CPU allocator tfmx's import chooses (the machine line names it). Targets: tfmx at "
    "most {vs:g} x stock, and never above the best alternative (the faster of stock and XLA).")


def format_minute_section(records: Sequence[Mapping[str, Any]]) -> str:
    """BENCHMARKS.md's section on the one-minute fit from ``records``
    (:func:`load_minute_fits`): a heading, what is timed, the commands, one table per machine
    and oneDNN state; "" without records.

    >>> format_minute_section([])
    ''
    """
    if not records:
        return ""
    commands = list(dict.fromkeys(r.get("reproduce") or r.get("command") for r in records
                                  if r.get("command")))
    lines = ["## A one-minute fit", "",
             INTRO.format(target=records[0].get("target_s") or TARGET_S, vs=VS_STOCK,
                          cap=XLA_CAP), ""]
    if commands:
        lines += ["Measured with (`--record` writes a record per workload under "
                  "`bench/results/fit_price/minute/`):", "", "```", *commands, "```", ""]
    for title, group in by_machine(records).items():
        onednn = format_onednn(group)
        lines += [f"Machine: {title}." + (f" {onednn}" if onednn else ""), "", *HEADER,
                  *(format_row(r) for r in group), ""]
        said = [f"- {r['workload']}, the last timed tfmx fit's report: `{fit['report_line']}`"
                for r in group for fit in ((r.get("fits") or {}).get("tfmx") or [])[-1:]
                if fit.get("report_line")]
        lines += [*said, ""] if said else []
    return "\n".join(lines).rstrip("\n")


def main(args: Any, command: str) -> int:
    """``python -m bench.fit_price --minute ...`` (``args``: :func:`bench.fit_price.main`'s
    parsed options; ``command``: its command line): measure, print the table, and with
    ``--record`` keep each workload's record as it finishes (``--record`` without a folder:
    :data:`RESULTS_DIR`)."""
    from bench.workloads import expand_models

    folder = args.record
    if folder is not None and Path(folder) == RESULTS_DIR.parent:  # --record's default
        folder = str(RESULTS_DIR)

    def record(row: dict[str, Any]) -> None:
        for path in write_minute_fits([row], command, folder):
            print(f"recorded {path}", file=sys.stderr, flush=True)

    rows = run_minute_fits(expand_models(args.model or ["transformer"]), args.target_seconds,
                           args.samples or SAMPLES, args.batch_size, args.rounds or 3,
                           warm=not args.no_warm_fit, cache_dir=args.cache_dir,
                           on_row=record if folder is not None else None)
    print(format_minute_fits(rows))
    return 0


def child_main(argv: Sequence[str]) -> int:
    """``python -m bench.minute_fit SPEC RESULT_PATH``: one fit (:func:`fit_in_process`), its
    figures written as JSON to ``RESULT_PATH``."""
    spec_text, result_path = argv
    out = fit_in_process(json.loads(spec_text))
    with open(result_path, "w") as f:
        json.dump(out, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
