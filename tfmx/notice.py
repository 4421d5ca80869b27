"""The one line a first run prints when tfmx starts measuring a model on this machine.

Measuring (the tuner's forms, the whole-step guard's trial) makes a model's first ``fit`` on a
machine slower than the next ones, which reuse what was measured. So the first time tfmx
starts measuring within a fit (or, outside one, within a traced function), it says so once on
stderr, in the style of Keras's progress output::

    tfmx: measuring 3 choices for this model (first run only, about 4 s)

Silenced by any of: ``fit(verbose=0)``, ``tfmx.enable(verbose=0)``, ``TFMX_VERBOSE=0``, or
Keras's ``keras.config.disable_interactive_logging()``. Nothing here may raise into a fit: a
notice that cannot be printed is skipped.

Example:
    >>> from tfmx.notice import announce, set_verbose
    >>> set_verbose(1)
    >>> import contextlib, io
    >>> err = io.StringIO()
    >>> with contextlib.redirect_stderr(err):
    ...     announce("demo-key", 3, 4.2), announce("demo-key", 3, 4.2)
    (True, False)
    >>> print(err.getvalue().strip())
    tfmx: measuring 3 choices for this model (first run only, about 4 s)
    >>> set_verbose(None)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

ENV_VERBOSE = "TFMX_VERBOSE"

_verbose: int | None = None  # tfmx.enable(verbose=...); None: $TFMX_VERBOSE, else 1
_announced: set[str] = set()


def set_verbose(value: int | None) -> None:
    """What ``tfmx.enable(verbose=...)`` sets: 0 silences the first-run line, 1 shows it,
    None leaves it to ``$TFMX_VERBOSE`` (default 1).

    >>> set_verbose(0); verbose()
    0
    >>> set_verbose(None)
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 0):
        raise ValueError(f"verbose must be 0, 1 or None, got {value!r}")
    global _verbose
    _verbose = value


def verbose() -> int:
    """The verbosity in force: ``tfmx.enable(verbose=...)``, else ``$TFMX_VERBOSE``, else 1
    (an unreadable variable counts as 1).

    >>> set_verbose(None); os.environ.pop(ENV_VERBOSE, None) and None; verbose()
    1
    """
    if _verbose is not None:
        return _verbose
    raw = os.environ.get(ENV_VERBOSE, "").strip().lower()
    if raw in ("0", "false", "off", "no"):
        return 0
    return 1


def _keras_quiet() -> bool:
    """True where Keras prints nothing either: the fit under way has ``verbose=0``, or
    Keras's interactive logging is off."""
    from tfmx.fit_plan import active_plan

    plan = active_plan()
    if plan is not None and getattr(plan, "verbose", None) == 0:
        return True
    try:
        from keras.config import is_interactive_logging_enabled

        return not is_interactive_logging_enabled()
    except Exception:  # noqa: BLE001 - an older Keras: its progress output decides nothing
        return False


def announce(key: str, choices: int | None,
             seconds: float | Callable[[], float] | None, bound: bool = False) -> bool:
    """Print the first-run line once per ``key`` (a fit, or a traced function outside one):
    ``choices`` forms or decisions to measure (None: not known yet), ``seconds`` the time it
    is expected to take, or a function giving it (called only if the line prints;
    ``bound``: at most that). Returns whether it printed.

    >>> set_verbose(0)
    >>> announce("quiet-key", 2, 1.0)
    False
    >>> set_verbose(None)
    """
    try:
        if key in _announced or verbose() == 0 or _keras_quiet():
            return False
        _announced.add(key)
        seconds = seconds() if callable(seconds) else seconds
        what = f"{choices} choices" if choices else "the choices"
        how = "up to" if bound else "about"
        when = f", {how} {seconds:.0f} s" if seconds is not None and seconds >= 0.5 else ""
        print(f"tfmx: measuring {what} for this model (first run only{when})",
              file=sys.stderr, flush=True)
        return True
    except Exception:  # noqa: BLE001 - a notice never stops a fit
        return False


def fit_key(fallback: str) -> str:
    """The key a notice is printed once for: the fit under way (its serial), else
    ``fallback`` (a traced function's name).

    >>> fit_key("f")
    'f'
    """
    from tfmx.fit_plan import active_plan

    plan = active_plan()
    return f"fit {plan.serial}" if plan is not None else fallback


def forget() -> None:
    """Let every key be announced again (tests).

    >>> forget()
    """
    _announced.clear()
