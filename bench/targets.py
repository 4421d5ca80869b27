"""BENCHMARKS.md's "Targets" section: per machine, each target, the rows that meet it, and
each row that misses it with its figure, the gap and what holds the time.

The targets, each in TensorFlow's default oneDNN state on the machine measured
(:func:`bench.environment.default_onednn`):

1. A training step (every workload of ``bench/results/*.json``): tfmx at most
   :data:`STEP_VS_BEST` x the best alternative (the fastest of stock and XLA in either oneDNN
   state, :func:`bench.compare.compare`).
2. The transformer workloads (:func:`bench.floor.is_transformer`): tfmx at most
   :data:`bench.floor.TARGET` x stock's contraction floor (:mod:`bench.floor`).
3. A one-minute fit (``fit_price/minute/``, :mod:`bench.minute_fit`): tfmx at most
   :data:`bench.minute_fit.VS_STOCK` x stock's wall time, and never above the best
   alternative's.
4. A small model's epoch (``loop/``, :mod:`bench.loop`): tfmx at most Keras 2's.

What holds the time (:func:`what_holds`) is only what a record holds: for a zoo model with a
composite record (:mod:`bench.composite`) of the same processor (vendor, family, model
number) and oneDNN state, its composite patterns with the largest share of tfmx's step;
otherwise, where the step record has a floor, the floor's part of stock's profiled step and
tfmx's step over it; otherwise the command that would profile it.

Example:
    >>> format_targets([])
    ''
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.compare import by_workload, compare
from bench.environment import default_onednn, machine
from bench.floor import TARGET as FLOOR_TARGET
from bench.floor import floor_ratios, is_transformer
from bench.minute_fit import VS_STOCK as FIT_VS_STOCK
from bench.onednn import onednn_state

STEP_VS_BEST = 0.85
"""tfmx's step over the best alternative's that every workload is measured against."""

TOP_PATTERNS = 3
"""Composite patterns named per row that misses a target."""

STEP_COMMAND = "tfmx bench --model {model} --onednn both --record"
COMPOSITE_COMMAND = "python -m bench.composite --model {model} --record"
MINUTE_COMMAND = "python -m bench.fit_price --minute --model NAME --rounds 3 --record"
LOOP_COMMAND = "python -m bench.loop --record"

INTRO = (
    "The project's targets, each in TensorFlow's default oneDNN state on the machine "
    "measured (medians of interleaved rounds), checked against the records of the sections "
    "below: how many rows meet each, and each row that misses it with its figure and the "
    "gap. What holds the time is only what a record holds: for a zoo model profiled on the "
    "same processor, the patterns tfmx leaves composite with their share of tfmx's step (the "
    "composite section); otherwise, where its record has one, the contraction floor's part "
    "of stock's profiled step and tfmx's step over the floor; otherwise the command that "
    "would profile it.")


def processor(env: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """The processor of ``env``: (vendor, family, model number); None where none is recorded.

    >>> processor({"cpu_vendor": "AuthenticAMD", "cpu_family": "25", "cpu_model": "17"})
    ('AuthenticAMD', '25', '17')
    >>> processor({"cpu": "AMD EPYC"}) is None
    True
    """
    ids = tuple((env or {}).get(k) for k in ("cpu_vendor", "cpu_family", "cpu_model"))
    return ids if any(ids) else None


def composite_for(model: str, state: str, env: Mapping[str, Any],
                  composites: Iterable[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The composite record (:func:`bench.composite.load_composite`) of ``model`` at its bench
    size, on the processor of ``env`` and in oneDNN ``state``; None where there is none.

    >>> env = {"cpu_vendor": "AuthenticAMD", "cpu_family": "25", "cpu_model": "17"}
    >>> rec = {"model": "zoo_llama", "size": "bench", "env": {**env, "onednn": True}}
    >>> composite_for("zoo_llama", "on", env, [rec]) is rec
    True
    >>> composite_for("zoo_llama", "on", {**env, "cpu_model": "1"}, [rec]) is None
    True
    """
    ids = processor(env)
    if ids is None:
        return None
    return next((c for c in composites
                 if c.get("model") == model and c.get("size", "bench") == "bench"
                 and processor(c.get("env") or {}) == ids and onednn_state(c) == state), None)


def _share(value: float) -> str:
    return f"{100 * value:.1f}%"


def _composite_words(record: Mapping[str, Any]) -> str:
    modes = record.get("modes") or {}
    mode = "tfmx" if "tfmx" in modes else "stock"
    shares = {p: s["share"] for p, s in ((modes.get(mode) or {}).get("patterns") or {}).items()
              if s.get("share")}
    top = sorted(shares, key=lambda p: -shares[p])[:TOP_PATTERNS]
    date = str((record.get("env") or {}).get("date") or "")[:10]
    if not top:
        return f"no composite pattern ran in {mode}'s profiled step ({date})"
    return (f"composite {', '.join(f'{p} {_share(shares[p])}' for p in top)} of {mode}'s step "
            f"(profiled {date})")


def _floor_of(result: Mapping[str, Any]) -> Mapping[str, Any] | None:
    floor = result.get("floor")
    return floor if floor and floor.get("ms") and not floor.get("error") else None


def _floor_words(result: Mapping[str, Any], with_ratio: bool = True) -> str:
    floor = _floor_of(result) or {}
    step = floor.get("wall_ms") or floor.get("busy_ms")
    words = (f"contractions {_share(floor['ms'] / step)} of stock's profiled step"
             if step else f"contractions {floor['ms']:.2f} ms a step")
    ratio = floor_ratios(floor, result.get("modes") or {}).get("tfmx/floor")
    if with_ratio and ratio is not None:
        words += f", tfmx {ratio:.3f} x that floor"
    return words


def what_holds(result: Mapping[str, Any] | None, model: str, state: str,
               env: Mapping[str, Any], composites: Sequence[Mapping[str, Any]],
               with_ratio: bool = True) -> str:
    """What the records say holds the time of ``model``'s step on the machine of ``env`` in
    oneDNN ``state``: the largest composite patterns of its composite record
    (:func:`composite_for`), else its floor (``result``'s, a :func:`bench.runner.run_benchmark`
    result; ``with_ratio``: tfmx's step over it too), else the command that would profile it.

    >>> what_holds(None, "vit", "on", {}, [])
    'not profiled here: `tfmx bench --model vit --onednn both --record`'
    >>> what_holds({"floor": {"ms": 30.0, "wall_ms": 40.0},
    ...             "modes": {"stock": {"median_ms": 40.0}, "tfmx": {"median_ms": 36.0}}},
    ...            "vit", "on", {}, [])
    "contractions 75.0% of stock's profiled step, tfmx 1.200 x that floor"
    """
    from bench.composite import zoo_workloads

    record = composite_for(model, state, env, composites)
    if record is not None:
        return _composite_words(record)
    if result is not None and _floor_of(result):
        return _floor_words(result, with_ratio)
    command = COMPOSITE_COMMAND if model in zoo_workloads() else STEP_COMMAND
    return f"not profiled here: `{command.format(model=model)}`"


def _floor_needed(result: Mapping[str, Any], best_ms: float | None) -> str:
    """Where ``result`` has a contraction floor: how close to it tfmx's step must come to
    meet the step target against a best alternative of ``best_ms``.

    >>> _floor_needed({"floor": {"ms": 36.0}}, 45.0)
    '; meeting it needs tfmx within 1.062 x the contraction floor (36.00 ms)'
    >>> _floor_needed({}, 45.0)
    ''
    """
    floor = _floor_of(result)
    if floor is None or not best_ms:
        return ""
    return (f"; meeting it needs tfmx within {STEP_VS_BEST * best_ms / floor['ms']:.3f} x the "
            f"contraction floor ({floor['ms']:.2f} ms)")


def _guard_words(result: Mapping[str, Any], alt: Mapping[str, Any]) -> str:
    """Where the best alternative is XLA and tfmx's whole-step guard kept another form: which,
    and the guard's own reason (its XLA duel's figures, or why XLA was not tried).

    >>> guard = [{"kept": "fused", "reason": "xla's first call costs more than it saves"}]
    >>> _guard_words({"guard": guard}, {"mode": "xla"})
    "; tfmx's guard kept the fused step: xla's first call costs more than it saves"
    >>> _guard_words({"guard": guard}, {"mode": "stock"})
    ''
    """
    guards = result.get("guard") or []
    if alt.get("mode") != "xla" or not guards or not isinstance(guards[0], Mapping):
        return ""
    kept, reason = guards[0].get("kept"), str(guards[0].get("reason") or "").strip()
    if not kept or kept == "xla":
        return ""
    return f"; tfmx's guard kept the {kept} step" + (f": {reason}" if reason else "")


def _tuner_words(result: Mapping[str, Any]) -> str:
    """Where tfmx's rewrite of the step spent the tuner's whole budget (``TFMX_TUNE_BUDGET``,
    30 s by default): the choices after that point ran Keras's form, and a later fit (the
    cache then holding what this one measured) measures them.

    >>> _tuner_words({"rewrite": [{"tune_seconds": 30.07}], "unmeasured": 120})
    "; tfmx's tuner spent its 30 s budget measuring (30.1 s), 120 choices left to Keras's form"
    >>> _tuner_words({"rewrite": [{"tune_seconds": 4.0}]})
    ''
    """
    from tfmx.tuner import DEFAULT_BUDGET_S

    spent = sum(float(t.get("tune_seconds") or 0.0) for t in result.get("rewrite") or ()
                if isinstance(t, Mapping))
    if not 0.98 * DEFAULT_BUDGET_S <= spent <= 2 * DEFAULT_BUDGET_S:  # past it: another budget
        return ""
    left = result.get("unmeasured")
    return (f"; tfmx's tuner spent its {DEFAULT_BUDGET_S:g} s budget measuring ({spent:.1f} s)"
            + (f", {left} choices left to Keras's form" if left else
               ", its later choices left to Keras's form"))


def _over(value: float, target: float) -> str:
    gap = value - target
    return f"{gap:.3f} over {target:g}" if gap >= 0.0005 else f"under 0.001 over {target:g}"


def _target(title: str, met: Sequence[str], missed: Sequence[str], total: int,
            none: str = "no row measured on this machine") -> list[str]:
    """A target's paragraph: how many rows meet it (named), then a bullet per row missing it;
    ``none`` where no row was measured."""
    if not total:
        return [f"**{title}**: {none}.", ""]
    named = f" ({', '.join(met)})" if met else ""
    lines = [f"**{title}**: {len(met)} of {total} meet it{named}"
             + (f"; {len(missed)} miss it:" if missed else ".")]
    return lines + (["", *(f"- {m}" for m in missed)] if missed else []) + [""]


def step_targets(results: Sequence[Mapping[str, Any]], composites: Sequence[Mapping[str, Any]],
                 label: Callable[[Mapping[str, Any]], str] | None = None) -> list[str]:
    """One machine's step targets (1 and 2) from its workload results (each record's
    ``result``), as markdown lines; each row named by its model, or by ``label`` where the
    machine has several workloads of that model."""
    from bench.workloads import WORKLOADS

    groups = by_workload(results)
    rows = compare(results)
    models = [next(iter(g.values()))["model"] for g in groups]
    best, floor = ([], []), ([], [])  # (met, missed)
    no_state, no_floor, transformers = [], [], 0
    for by_state, row in zip(groups, rows, strict=True):
        first = next(iter(by_state.values()))
        env = first.get("env") or {}
        state = default_onednn(env)
        name = (label(first) if label is not None and models.count(first["model"]) > 1
                else first["model"])
        result = by_state.get(state)
        if result is None:
            no_state.append(name)
            continue
        ratio = row["tfmx_vs_best_alternative"].get(state)
        alt = row["best_alternative"]
        if ratio is None:
            no_state.append(name)
            continue
        if ratio <= STEP_VS_BEST:
            best[0].append(name)
        else:
            named = f"{'XLA' if alt['mode'] == 'xla' else alt['mode']} {alt['onednn']}"
            best[1].append(f"{name}: {ratio:.3f} x best ({named}), "
                           f"{_over(ratio, STEP_VS_BEST)}; what holds the time: "
                           f"{what_holds(result, first['model'], state, env, composites)}"
                           f"{_floor_needed(result, alt.get('ms'))}"
                           f"{_guard_words(result, alt)}{_tuner_words(result)}")
        if not is_transformer(first["model"]):
            continue
        transformers += 1
        over = floor_ratios(_floor_of(result), result.get("modes") or {}).get("tfmx/floor")
        if over is None:
            no_floor.append(name)
        elif over <= FLOOR_TARGET:
            floor[0].append(name)
        else:
            holds = what_holds(result, first["model"], state, env, composites, False)
            floor[1].append(f"{name}: {over:.3f} x the floor, {_over(over, FLOOR_TARGET)}; "
                            f"what holds the time: {holds}")
    measured = len(groups) - len(no_state)
    lines = _target(f"tfmx's step at most {STEP_VS_BEST:g} x the best alternative (every "
                    f"workload)", best[0], best[1], measured)
    if no_state:
        lines += [f"No tfmx and alternative measured in the default oneDNN state: "
                  f"{', '.join(no_state)}.", ""]
    unmeasured = [w for w in WORKLOADS if w not in models]
    if unmeasured:
        lines += [f"Not measured on this machine ({len(unmeasured)}): {', '.join(unmeasured)} "
                  f"(`{STEP_COMMAND.format(model='NAME')}`).", ""]
    if transformers:
        unfloored = (f"no floor recorded: {', '.join(no_floor)} "
                     f"(`{STEP_COMMAND.format(model='NAME')}` records it)")
        judged = transformers - len(no_floor)
        lines += _target(f"tfmx's step at most {FLOOR_TARGET:g} x the contraction floor "
                         f"(transformers)", floor[0], floor[1], judged, unfloored)
        if no_floor and judged:
            lines += [unfloored[0].upper() + unfloored[1:] + ".", ""]
    return lines


def _step_result(model: str, results: Sequence[Mapping[str, Any]], state: str
                 ) -> Mapping[str, Any] | None:
    return next((r for r in results if r["model"] == model and onednn_state(r) == state), None)


def _fit_words(fit: Mapping[str, Any]) -> str:
    """What a timed tfmx fit left untried: its tuner's decisions left unmeasured, XLA's step.

    >>> _fit_words({"tuning": {"decisions": {"measured": 6, "cached": 16, "conservative": 35}},
    ...             "guard": "kept fused for now (XLA not tried: the trial paused)"})
    ', 35 of its 57 tuner decisions unmeasured, XLA not tried'
    >>> _fit_words({})
    ''
    """
    decisions = (fit.get("tuning") or {}).get("decisions") or {}
    left = sum(v for k, v in decisions.items() if k in ("conservative", "prior"))
    words = ([f"{left} of its {sum(decisions.values())} tuner decisions unmeasured"]
             if left else [])
    if "XLA not tried" in str(fit.get("guard") or ""):
        words.append("XLA not tried")
    return "".join(f", {w}" for w in words)


def minute_targets(minutes: Sequence[Mapping[str, Any]], results: Sequence[Mapping[str, Any]],
                   composites: Sequence[Mapping[str, Any]]) -> list[str]:
    """One machine's one-minute-fit target (3) from its minute-fit records in the default
    oneDNN state, each miss with what holds its step's time (its step record on the same
    machine) and which step tfmx's last timed fit ran."""
    title = (f"A one-minute fit: tfmx at most {FIT_VS_STOCK:g} x stock's wall time, never "
             f"above the best alternative's")
    minutes = [m for m in minutes if (m.get("verdict") or {}).get("tfmx/stock") is not None]
    met, missed = [], []
    for record in minutes:
        v = record["verdict"]
        if v.get("vs_stock_met") and v.get("vs_best_met"):
            met.append(record["workload"])
            continue
        gaps = []
        if not v.get("vs_stock_met") and v.get("tfmx/stock") is not None:
            gaps.append(f"{v['tfmx/stock']:.3f} x stock, {_over(v['tfmx/stock'], FIT_VS_STOCK)}")
        if not v.get("vs_best_met") and v.get("tfmx/best") is not None:
            best = "XLA" if v.get("best_alternative") == "xla" else v.get("best_alternative")
            gaps.append(f"{v['tfmx/best']:.3f} x best ({best}), {_over(v['tfmx/best'], 1.0)}")
        env = record.get("env") or {}
        state = onednn_state(record)
        holds = what_holds(_step_result(record["workload"], results, state),
                           record["workload"], state, env, composites)
        fit = ((record.get("fits") or {}).get("tfmx") or [{}])[-1]
        ran = {"fused": "tfmx's fused step", "stock": "the stock step",
               "xla": "XLA's step"}.get(fit.get("kept") or "")
        missed.append(f"{record['workload']}: {'; '.join(gaps) or 'not measured'}; what holds "
                      f"the time: its step: {holds}"
                      + (f"; the last timed tfmx fit ran {ran}{_fit_words(fit)}" if ran else ""))
    return _target(title, met, missed, len(minutes),
                   f"no one-minute fit recorded on this machine (`{MINUTE_COMMAND}`)")


def loop_targets(loops: Sequence[Mapping[str, Any]]) -> list[str]:
    """One machine's small-model target (4) from its loop records in the default oneDNN
    state."""
    title = "A small model's epoch: tfmx at most Keras 2's"
    judged = [r for r in loops if (r.get("ratios") or {}).get("tfmx/keras2") is not None]
    met, missed = [], []
    for record in judged:
        ratio = record["ratios"]["tfmx/keras2"]
        if ratio <= 1.0:
            met.append(record["model"])
            continue
        n = record.get("steps_per_call")
        ran = f"tfmx ran {n} step{'s' if n != 1 else ''} a call; " if n else ""
        missed.append(f"{record['model']}: {ratio:.3f} x Keras 2, {_over(ratio, 1.0)}; "
                      f"what holds the time: {ran}the epoch not profiled here")
    return _target(title, met, missed, len(judged),
                   f"no epoch against Keras 2 recorded on this machine (`{LOOP_COMMAND}`)")


def _in_default_state(record: Mapping[str, Any]) -> bool:
    return onednn_state(record) == default_onednn(record.get("env") or {})


def format_targets(records: Sequence[Mapping[str, Any]],
                   composites: Sequence[Mapping[str, Any]] = (),
                   minutes: Sequence[Mapping[str, Any]] = (),
                   loops: Sequence[Mapping[str, Any]] = (),
                   label: Callable[[Mapping[str, Any]], str] | None = None) -> str:
    """The "Targets" section: a paragraph, then per machine (:func:`bench.environment.machine`,
    in the order first seen) the step targets of its workload ``records``
    (:func:`bench.records.load_records`), the one-minute fit of its ``minutes``
    (:func:`bench.minute_fit.load_minute_fits`) and the epochs of its ``loops``
    (:func:`bench.loop.load_records`), those in the default oneDNN state only; ``composites``
    (:func:`bench.composite.load_composite`) say what holds the time; ``label`` names a workload
    where a machine has several of one model (:func:`step_targets`). "" without any record.

    >>> env = {"cpu": "EPYC", "cpu_count": 2, "cpu_flags": ["avx512_vnni"], "onednn": True}
    >>> loop = {"model": "mlp", "env": env, "ratios": {"tfmx/keras2": 1.1}, "steps_per_call": 1}
    >>> print(format_targets([], loops=[loop]).splitlines()[-1])
    - mlp: 1.100 x Keras 2, 0.100 over 1; what holds the time: tfmx ran 1 step a call; the \
epoch not profiled here
    """
    machines: dict[str, dict[str, list]] = {}
    for kind, items in (("results", [r["result"] for r in records]), ("minutes", minutes),
                        ("loops", loops)):
        for item in items:
            slot = machines.setdefault(machine(item.get("env") or {}),
                                       {"results": [], "minutes": [], "loops": []})
            slot[kind].append(item)
    if not machines:
        return ""
    lines = ["## Targets", "", INTRO, ""]
    for title, slot in machines.items():
        envs = [item.get("env") or {} for items in slot.values() for item in items]
        lines += [f"### {title}: oneDNN {default_onednn(envs[0])} by default", ""]
        results = slot["results"]
        if results:
            lines += step_targets(results, composites, label)
        lines += minute_targets([m for m in slot["minutes"] if _in_default_state(m)], results,
                                composites)
        lines += loop_targets([r for r in slot["loops"] if _in_default_state(r)])
    return "\n".join(lines).rstrip("\n")


def targets_section(records: Sequence[Mapping[str, Any]], folder: str | Path,
                    label: Callable[[Mapping[str, Any]], str] | None = None) -> str:
    """:func:`format_targets` of ``records`` (``label``: their workloads' names) with the
    composite, one-minute-fit and loop records kept in the subfolders of ``folder``
    (``bench/results/``).

    >>> targets_section([], "/no/such/folder")
    ''
    """
    from bench import composite, loop, minute_fit

    folder = Path(folder)
    return format_targets(records, composite.load_composite(folder / "composite"),
                          minute_fit.load_minute_fits(folder / "fit_price" / "minute"),
                          loop.load_records(folder / "loop"), label)
