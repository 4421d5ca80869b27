"""Running the benchmark: each mode built, traced and timed interleaved, here or in a process
per oneDNN state.

How it measures ("measure, do not guess"):

1. Build one identical model per mode (same seed, same initial weights, same optimizer:
   :func:`bench.workloads.build_model`). ``stock`` is built and traced with tfmx disabled,
   ``tfmx`` with tfmx enabled (the rewrite happens when the step is traced), ``xla`` with
   ``jit_compile=True`` (tfmx leaves it alone).
2. Warm-up: call each mode's ``model.train_function`` a few times on its own repeating
   ``tf.data`` iterator. The first call traces (and rewrites, or XLA-compiles); it is timed
   separately and excluded.
3. Interleave (:func:`recipes._timing.time_step_functions`): for each round, for each mode (order
   rotated every round), time ``steps`` calls and synchronise on the returned logs. Report the
   median ms/step over rounds, the spread, and the ratios to stock. No assertions: this
   module only measures.
4. oneDNN (``run_benchmarks(..., onednn="on"|"off"|"both")``, ``tfmx bench --onednn``):
   each oneDNN state runs in a new process (:mod:`bench.onednn`; the child runs
   :func:`child_main`, ``python -m bench.runner``) with ``TF_ENABLE_ONEDNN_OPTS`` set to ``1``
   or ``0``. States run one after the other; the modes within a state are interleaved as
   above. Without ``onednn`` everything runs in this process, in its current state.
5. Replicas (``run_benchmarks(..., replicas=N)``, ``tfmx bench --replicas N``; default 1):
   every mode's model in a MirroredStrategy over N logical CPUs, interleaved with the same
   modes on 1 replica (:mod:`bench.replicas`).

Keras's step function is an outer ``tf.function`` that calls tfmx's rewritten step, so the
rewrite is baked in when it is traced; tfmx is kept enabled while timing anyway, so that a
retrace (which would rewrite again) also sees the right switch. The stock and XLA step
functions were built without the hook's rewrite and do not look at the switch.

Example:
    >>> from bench.runner import run_benchmark, run_benchmarks
    >>> from bench.tables import format_markdown
    >>> results = run_benchmark("mlp", rounds=3, steps=5)  # doctest: +SKIP
    >>> print(format_markdown(results))  # doctest: +SKIP
    >>> both = run_benchmarks(["mlp"], onednn="both", rounds=3, steps=5)  # doctest: +SKIP
    >>> print(format_markdown(both))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bench.floor import STEPS as FLOOR_STEPS
from bench.floor import floor_ratios, measure_floor
from bench.onednn import ONEDNN_ENV, onednn_states, run_child
from bench.replicas import check_replicas, mirrored_strategy, replica_modes
from bench.workloads import (
    GROUPS,
    MODES,
    WORKLOADS,
    Workload,
    build_model,
    expand_models,
    random_dataset,
    tfmx_restored,
)
from recipes._machine import environment
from recipes._timing import median_ratios, paired_ratios, time_step_functions
from tfmx.timing import sync


def run_benchmark(
    model_name: str,
    rounds: int | None = None,
    steps: int | None = None,
    modes: Sequence[str] | None = None,
    batch_size: int | None = None,
    warmup: int = 2,
    seed: int = 0,
    backend: str | None = None,
    optimizer: str = "adam",
    policy: str | None = None,
    replicas: int = 1,
    floor_steps: int = FLOOR_STEPS,
) -> dict[str, Any]:
    """Benchmark one workload's training step in each mode, interleaved; return the numbers.

    Args:
        model_name: one of ``WORKLOADS`` (``small_cnn``, ``resnet50``, ``mlp``, ``gelu_mlp``,
            ``lstm``, ``gru``, ``transformer``, ``vit``, ``decoder``).
        rounds, steps, batch_size: default to the workload's (see ``WORKLOADS``).
        modes: any of ``"stock"``, ``"tfmx"``, ``"xla"``; None: :func:`replica_modes` (all
            three with one replica).
        warmup: untimed calls per mode before timing (the first one traces).
        backend: passed to ``tfmx.enable`` (None detects this machine's).
        optimizer: one of ``OPTIMIZERS`` (Keras defaults; AdamW with weight_decay=0.004).
        policy: a ``policies`` name ("auto", "mixed_bfloat16", ...) the non-stock modes are
            built and compiled under; stock stays float32. Recorded as ``policy`` and
            ``policy_choice`` (what it resolved to and why) and, for "auto", ``tuned``.
        replicas: 1 (default): one device, no strategy. N > 1: every mode's model built and
            compiled in a ``tf.distribute.MirroredStrategy`` over N logical CPUs of this
            process (:func:`bench.replicas.split_cpu`: before TensorFlow runs anything), fed a
            distributed dataset; ``batch_size`` stays the global batch, each replica gets
            batch / N.
            :func:`check_replicas` says what cannot run so. :func:`run_benchmarks` with
            ``replicas=N`` also measures 1 replica, interleaved.
        floor_steps: stock's step profiled this many calls after the timed rounds for its
            contraction floor (:func:`bench.floor.measure_floor`); 0: no floor.

    Returns a dict with ``model``, ``batch_size``, ``replicas``, ``rounds``, ``steps``,
    ``modes`` (per-mode timing from :func:`time_step_functions`), ``ratios`` (``"tfmx/stock"``,
    ``"xla/stock"``, ``"tfmx/xla"``, those whose modes ran),
    ``rewrite`` (one entry per traced function from ``tfmx.report()``: status, nodes, seconds),
    ``fused``, ``floor`` (stock's contraction floor with each mode's ratio to it, or None) and
    ``env``. tfmx's enabled state is restored afterwards.

    >>> r = run_benchmark("mlp", rounds=3, steps=5)  # doctest: +SKIP
    >>> r["ratios"]["tfmx/stock"] > 0  # doctest: +SKIP
    True
    """
    return _measure(model_name, (replicas,), rounds=rounds, steps=steps, modes=modes,
                    batch_size=batch_size, warmup=warmup, seed=seed, backend=backend,
                    optimizer=optimizer, policy=policy, floor_steps=floor_steps)[0]


def _measure(model_name: str, counts: Sequence[int], rounds: int | None = None,
             steps: int | None = None, modes: Sequence[str] | None = None,
             batch_size: int | None = None, warmup: int = 2, seed: int = 0,
             backend: str | None = None, optimizer: str = "adam", policy: str | None = None,
             floor_steps: int = FLOOR_STEPS) -> list[dict[str, Any]]:
    """:func:`run_benchmark` at each replica count of ``counts``, every (mode, count) step
    timed interleaved with the others in one :func:`time_step_functions`: one result per
    count. ``modes`` None: :func:`replica_modes` of the largest count."""
    import tfmx

    if model_name not in WORKLOADS:
        raise ValueError(f"unknown model {model_name!r}; choose one of {tuple(WORKLOADS)}")
    modes = replica_modes(max(counts)) if modes is None else modes
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {bad}; choose from {MODES}")
    workload = WORKLOADS[model_name]
    batch_size = batch_size or workload.batch_size
    for n in counts:
        check_replicas(n, modes, policy, {model_name: batch_size})
    rounds = rounds or workload.rounds
    steps = steps or workload.steps
    strategies = {n: mirrored_strategy(n) for n in counts}  # first: the CPU split before any op
    # stock first (built and traced with tfmx off), then tfmx and xla with tfmx on.
    ordered = [m for m in MODES if m in modes]
    dataset = random_dataset(workload, batch_size, seed)
    feeds = {n: dataset if s is None else s.experimental_distribute_dataset(dataset)
             for n, s in strategies.items()}
    report = None
    choice = None
    if policy is not None:
        import policies

        choice = policies.resolve(policy)
    with tfmx_restored():
        fns, first_trace, layer_policies, spans = _step_functions(
            workload, ordered, strategies, feeds, dataset, seed, backend, policy, optimizer)
        if "tfmx" in ordered or "xla" in ordered:
            tfmx.enable(backend=backend)  # same options as above: a no-op, traces stay valid
        report = tfmx.report() if "tfmx" in ordered else None
        timing = time_step_functions(fns, lambda key: iter(feeds[key[1]]), rounds, steps,
                                     warmup)
        floors = {n: measure_floor(fns[("stock", n)], iter(feeds[n]), floor_steps)
                  for n in counts if "stock" in ordered and floor_steps > 0}
    env = environment()
    results = []
    for n in counts:
        by_mode = {mode: {**timing[(mode, n)], "first_call_s": first_trace[(mode, n)]}
                   for mode in ordered}
        part = _report_part(report, spans.get(n))
        floor = floors.get(n)
        if floor is not None:
            floor = {**floor, "ratios": floor_ratios(floor, by_mode)}
        results.append({
            "model": model_name,
            "description": workload.description,
            "optimizer": optimizer,
            "batch_size": batch_size,
            "replicas": n,
            "devices": list(strategies[n].extended.worker_devices) if strategies[n] else None,
            "rounds": rounds,
            "steps": steps,
            "warmup": warmup,
            "modes": by_mode,
            "ratios": median_ratios(by_mode),
            "paired_ratios": paired_ratios(by_mode),
            **part,
            "floor": floor,
            "env": env,
            "policy": policy,
            "policy_choice": str(choice) if choice else None,
            "layer_policies": {mode: layer_policies[(mode, n)] for mode in ordered},
        })
    return results


def _report_position(report: Any) -> tuple[int, int, int, int]:
    """How much ``report`` holds: traces, guards, tuner decisions, fused chains/updates."""
    return len(report.traces), len(report.guards), len(report.decisions), report.fused()


def _report_part(report: Any, span: tuple[tuple, tuple | None] | None) -> dict[str, Any]:
    """What ``report`` recorded within ``span`` (:func:`_report_position` at its start, and at
    its end or None: up to now): the traces, guards, tuner decisions and fused count of one
    replica count's tfmx step."""
    if report is None or span is None:
        return {"rewrite": [], "guard": [], "tuned": 0, "unmeasured": 0, "fused": None}
    start, end = span
    end = end or _report_position(report)
    decisions = report.decisions[start[2]:end[2]]
    return {
        "rewrite": [t.as_dict() for t in report.traces[start[0]:end[0]]],
        "guard": [dataclasses.asdict(g.summary()) for g in report.guards[start[1]:end[1]]],
        "tuned": end[2] - start[2],
        # left to Keras's form or the family's prior, unmeasured (the tuner's budget spent)
        "unmeasured": sum(1 for d in decisions if not str(getattr(d, "source", "")).startswith(
            ("measured", "cached"))),
        "fused": end[3] - start[3],
    }


def _step_functions(workload: Workload, ordered: Sequence[str], strategies: Mapping[int, Any],
                    feeds: Mapping[int, Any], dataset: Any, seed: int, backend: str | None,
                    policy: str | None, optimizer: str) -> tuple[dict, dict, dict, dict]:
    """Each (mode, replica count)'s model built from the same weights and its train step
    traced (tfmx off for stock, on for the others): (step functions, first-call seconds,
    layer policies), keyed by (mode, count), and per count the span of ``tfmx.report()``
    its tfmx step's build recorded (:func:`_report_part`)."""
    import tfmx

    fns: dict[tuple[str, int], Callable[[Any], Any]] = {}
    first_trace: dict[tuple[str, int], float] = {}
    layer_policies: dict[tuple[str, int], dict[str, int]] = {}
    spans: dict[int, Any] = {}
    weights = None
    open_span = None  # the count whose tfmx step was built last, its span not yet closed
    for mode in ordered:
        for n, strategy in strategies.items():
            tfmx.disable() if mode == "stock" else tfmx.enable(backend=backend)
            position = _report_position(tfmx.report())
            if open_span is not None:
                spans[open_span] = (spans[open_span][0], position)
                open_span = None
            if mode == "tfmx":
                spans[n], open_span = (position, None), n
            model = build_model(workload, mode, seed, weights, policy, optimizer, strategy,
                                dataset)
            layer_policies[(mode, n)] = _layer_policies(model)
            weights = weights if weights is not None else model.get_weights()
            model.make_train_function()
            fn = model.train_function
            t0 = time.perf_counter()  # trace now, while the switch is right for this mode
            sync(fn(iter(feeds[n])))
            first_trace[(mode, n)] = time.perf_counter() - t0
            if mode == "tfmx":
                _settle_guards(fn, feeds[n])
            fns[(mode, n)] = fn
    return fns, first_trace, layer_policies, spans


def _settle_guards(fn: Callable[[Any], Any], dataset: Any) -> None:
    """Run tfmx's step until its whole-step guard has kept a form (bounded): the timed rounds
    then measure what a user's training runs after its first steps."""
    import tfmx
    from tfmx.guard import MAX_PAIRS

    iterator = iter(dataset)
    for g in tfmx.report().guards:  # the steady state of a long fit: each trial to its end
        g.lift_budget()
    for _ in range(4 * MAX_PAIRS + 8):  # two duels (fused vs stock, then vs XLA)
        if all(g.decided for g in tfmx.report().guards):
            return
        sync(fn(iterator))


def _layer_policies(model: Any) -> dict[str, int]:
    """How many layers of ``model`` compute under each policy name."""
    import collections

    counts: collections.Counter = collections.Counter(
        layer.dtype_policy.name for layer in model.layers if layer.weights)
    return dict(counts)


def run_benchmarks(models: Sequence[str], onednn: str | None = None, replicas: int = 1,
                   environ: Mapping[str, str] | None = None,
                   **options: Any) -> list[dict[str, Any]]:
    """:func:`run_benchmark` for each of ``models``, here or once per oneDNN state.

    Args:
        models: workload names (``WORKLOADS``) or group names (``GROUPS``: ``"zoo"``).
        onednn: None runs in this process, in its oneDNN state. ``"on"``, ``"off"`` or
            ``"both"``: one new process per state (:func:`bench.onednn.child_command`), one
            after the other (never two at once: they would share the cores); their results
            are tagged ``"isolated": True``. Every process applies tfmx's host allocator
            before its first op (:mod:`tfmx.host_allocator`: every mode runs with it).
        environ: with ``onednn``, further environment variables for each new process
            (``{"TFMX_HOST_ALLOCATOR": "keep"}``: TensorFlow's own allocator).
        replicas: 1 (default): one device, no strategy. N > 1: each workload measured under
            N replicas (:func:`run_benchmark`) and, interleaved with it in the same process,
            with 1 replica (no strategy): :func:`bench.replicas.compare_replicas`. Checked first
            (:func:`check_replicas`): a ValueError says what cannot run and what to do.
        options: keyword arguments of :func:`run_benchmark` (``rounds``, ``modes``, ...).

    Returns one :func:`run_benchmark` result per state, model and replica count (state "on"
    first, 1 replica before N); each records its state in ``env["onednn"]`` (see
    :func:`bench.onednn.onednn_state`) and its count in ``replicas``.

    >>> from bench.onednn import onednn_state
    >>> results = run_benchmarks(["mlp"], onednn="both", rounds=2, steps=3)  # doctest: +SKIP
    >>> [(r["model"], onednn_state(r)) for r in results]  # doctest: +SKIP
    [('mlp', 'on'), ('mlp', 'off')]
    """
    if onednn is None:  # this process measures: its allocator as tfmx.enable() would set it
        from tfmx import host_allocator
        from tfmx.backends import onednn_enabled

        host_allocator.apply("cpu", onednn_enabled())
    models = expand_models(models)
    unknown = [m for m in models if m not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; choose from {tuple(WORKLOADS)} or a "
                         f"group: {tuple(GROUPS)}")
    modes = options.get("modes") or replica_modes(replicas)
    check_replicas(replicas, modes, options.get("policy"),
                   {m: options.get("batch_size") or WORKLOADS[m].batch_size for m in models})
    if onednn is not None:
        child_options = {**options, "replicas": replicas} if replicas != 1 else options
        return [r for state in onednn_states(onednn)
                for r in run_child(state, models, child_options, environ)]
    results = []
    counts = (1,) if replicas == 1 else (1, replicas)
    for name in models:
        print(f"benchmarking {name} ({', '.join(modes)}"
              f"{'' if replicas == 1 else f'; 1 and {replicas} replicas, interleaved'}) ...",
              file=sys.stderr, flush=True)
        results.extend(_measure(name, counts, **{**options, "modes": modes}))
    return results


def child_main(argv: Sequence[str]) -> int:
    """The process :func:`bench.onednn.child_command` starts (``python -m bench.runner SPEC
    RESULT_PATH``): check oneDNN's state, benchmark, write the results as JSON; 0, or 3 (and
    why on stderr) if this process's oneDNN state is not the one asked for.

    >>> from tfmx.backends import onednn_enabled
    >>> other = "off" if onednn_enabled() else "on"
    >>> child_main([json.dumps({"onednn": other, "models": [], "options": {}}), "unused"])
    3
    """
    from tfmx.backends import onednn_enabled

    spec_text, result_path = argv
    spec = json.loads(spec_text)
    state = "on" if onednn_enabled() else "off"
    if state != spec["onednn"]:
        print(f"tfmx bench: {ONEDNN_ENV}={os.environ.get(ONEDNN_ENV)} left oneDNN {state}: this "
              f"TensorFlow build cannot run with oneDNN {spec['onednn']}", file=sys.stderr)
        return 3
    results = run_benchmarks(spec["models"], **spec["options"])
    with open(result_path, "w") as f:
        json.dump(results, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
