"""Settings read from the environment: on/off switches and the shares of a run measuring may cost.

Switches (:func:`enabled_by_env`): the whole-step guard (``TFMX_GUARD``) and its duel with
XLA's form (``TFMX_XLA``). Which forms run (:func:`resolve_fuse`, ``TFMX_FUSE``): ``measured``
(a fused form only where it measures faster and pays within the fit) or ``always`` (every
family takes its fused form where it applies). Two budgets are shares of the run they serve:
the guard's trial (:func:`budget_share`, ``TFMX_GUARD_BUDGET``) and the tuner's measuring within
a planned ``fit`` (:func:`plan_share`, ``TFMX_TUNE_SHARE``); each is a fraction, or ``none`` for
no bound (:func:`share_from_env`).

Example:
    >>> from tfmx.env import budget_share, plan_share
    >>> budget_share(), plan_share()
    (0.02, 0.02)
"""

from __future__ import annotations

import os

ENV_GUARD = "TFMX_GUARD"
ENV_XLA = "TFMX_XLA"
ENV_GUARD_BUDGET = "TFMX_GUARD_BUDGET"
ENV_TUNE_SHARE = "TFMX_TUNE_SHARE"
ENV_FUSE = "TFMX_FUSE"

FUSE_MODES = ("measured", "always")
"""``tfmx.enable(fuse=...)``: ``"measured"`` (the default) keeps a fused form only where it
measures faster on this machine and pays for its first call within the fit (the price gate, the
whole-step guard, the tuner's budget and plan); ``"always"`` takes the fused form of every
family wherever it applies: no price gate, no whole-step trial, and each tuned choice takes a
fused form (the fastest measured, else the first), for verification and for fits known to be
long."""

BUDGET_SHARE = 0.02
"""The share of the run a guard's trial may cost (``TFMX_GUARD_BUDGET``: a fraction, or
``none``)."""

PLAN_SHARE = 0.02
"""In a ``fit`` whose plan is known (``tfmx.fit_plan.active_plan``), the share of the planned
run the tuner may spend measuring (``TFMX_TUNE_SHARE``: a fraction, or ``none``). The run's
time is the planned steps at the step time known for it: the sum of the conservative forms'
medians measured in this fit so far (a lower bound of the step), or the time a previous fit
of the same step measured (the tuner's ``step_hint``); with neither known, the fit's first
decision is measured, which seeds it. What the share does not cover takes the conservative
form and is measured on a later run."""


def enabled_by_env(name: str = ENV_GUARD) -> bool:
    """The environment switch ``name`` (``TFMX_GUARD``, ``TFMX_XLA``): unset or true-ish is on.

    >>> isinstance(enabled_by_env(), bool)
    True
    """
    value = os.environ.get(name, "1").strip().lower()
    if value in ("1", "true", "on", "yes", ""):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"${name} must be 1 or 0 (on/off), got {value!r}")


def share_from_env(name: str, default: float) -> float | None:
    """A share of a run from the environment variable ``name``: a fraction, ``none`` (None:
    unbounded), or ``default`` where unset; ValueError naming the variable otherwise.

    >>> share_from_env("TFMX_NO_SUCH_SHARE", 0.02)
    0.02
    """
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("none", "off", "inf"):
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${name} must be a fraction of the run (0.02) or none, "
                         f"got {raw!r}") from None
    if value < 0:
        raise ValueError(f"${name} must be >= 0, got {raw!r}")
    return value


def resolve_fuse(fuse: str | None) -> str:
    """``fuse``, else ``$TFMX_FUSE``, else ``"measured"``; ValueError naming the choices
    otherwise (see :data:`FUSE_MODES`).

    >>> resolve_fuse("always")
    'always'
    >>> resolve_fuse("yes")
    Traceback (most recent call last):
    ...
    ValueError: fuse must be one of ('measured', 'always'), got 'yes'
    """
    value = fuse if fuse is not None else os.environ.get(ENV_FUSE, "").strip().lower()
    value = value or "measured"
    if value not in FUSE_MODES:
        source = "fuse" if fuse is not None else f"${ENV_FUSE}"
        raise ValueError(f"{source} must be one of {FUSE_MODES}, got {value!r}")
    return value


def budget_share() -> float | None:
    """The share of a run a guard's trial may cost: ``$TFMX_GUARD_BUDGET`` or
    :data:`BUDGET_SHARE`; None (``none``, ``off``) lets a trial run to its end whatever it
    costs.

    >>> budget_share()
    0.02
    """
    return share_from_env(ENV_GUARD_BUDGET, BUDGET_SHARE)


def plan_share() -> float | None:
    """The share of a planned run the tuner may spend measuring: ``$TFMX_TUNE_SHARE`` or
    :data:`PLAN_SHARE`; None (``none``) bounds it by ``tfmx.tuner.budget_seconds`` alone.

    >>> plan_share()
    0.02
    """
    return share_from_env(ENV_TUNE_SHARE, PLAN_SHARE)


__all__ = ["BUDGET_SHARE", "ENV_FUSE", "ENV_GUARD", "ENV_GUARD_BUDGET", "ENV_TUNE_SHARE",
           "ENV_XLA", "FUSE_MODES", "PLAN_SHARE", "budget_share", "enabled_by_env", "plan_share",
           "resolve_fuse", "share_from_env"]
