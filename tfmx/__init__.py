"""tfmx: make Keras 3 training on TensorFlow fast on every backend, and show why.

    import tfmx
    tfmx.enable()          # before model.fit / evaluate / predict
    model.fit(x, y)
    print(tfmx.report())   # what was fused, what was declined and why

Example:
    >>> import tfmx
    >>> tfmx.enable(backend="cpu")
    >>> tfmx.enabled()
    True
    >>> tfmx.disable()
    >>> tfmx.enabled()
    False

``import tfmx`` does not import TensorFlow (so ``tfmx --help`` is quick): ``FusedFunction``,
``function`` and ``Report`` load on first use, TensorFlow with them or with ``enable()``. Where
TensorFlow has run no op, ``import tfmx`` chooses the allocator of its CPU tensors
(``tfmx.host_allocator``: TensorFlow's pool where oneDNN is off, as ``enable()`` would, before
the script's first op): at once where TensorFlow is imported, else once its import ends.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tfmx.backends import BACKEND_NAMES
from tfmx.errors import (
    BackendUnavailableError,
    TfmxWarning,
    UnknownKerasError,
    VerificationError,
)

if TYPE_CHECKING:
    from tfmx.fused_function import FusedFunction, function
    from tfmx.reporting import Report

__version__ = "0.2.0"

# Public names whose modules import TensorFlow: loaded on first access (PEP 562).
_LAZY = {"FusedFunction": "tfmx.fused_function", "function": "tfmx.fused_function",
         "Report": "tfmx.reporting"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tfmx' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def enable(
    backend: str | None = None,
    patterns: Sequence[str] | None = None,
    verify: bool | str | None = None,
    tune: str | None = None,
    guard: bool | None = None,
    xla: bool | None = None,
    strict: bool | None = None,
    exclude: Sequence[str] | None = None,
    plugin: str | None = None,
    verbose: int | None = None,
    fuse: str | None = None,
) -> None:
    """Switch the rewrite on for every Keras model's fit/evaluate/predict and tfmx.function.

    Args:
        backend: ``"cpu"``, ``"cuda"``, ``"metal"``, or None to detect this machine's. A backend
            this machine lacks gives a plan (see ``tfmx.report()``) and an error if run.
        plugin: for ``"metal"``, the Metal plugin to fuse for: ``"tensorflow-metal"`` (Apple's)
            or ``"tensorflow-metal-plugin"`` (the open one), optionally ``"==<version>"``.
            None: the one installed here under the installed TensorFlow, else (Linux) Apple's
            tensorflow-metal 1.2.0 (``tfmx.backends.metal_backend``). The fused kernels, their
            ``fused_ops`` and dtypes, and the ops kept off the GPU are that plugin's.
        patterns: names of the families to run (default: all); see
            ``fusion.available_patterns()``.
        exclude: names of families not to run (of ``patterns``, or of all).
        verify: run the first step of each traced function both stock and fused from the same
            variable values and raise :class:`VerificationError` if they disagree (True), or
            warn and run stock from then on (``"first-step"``); False: no check. None (the
            default): ``"first-step"`` on cuda and metal, which no CI runs, False on cpu.
        tune: how choices between correct forms are made (:mod:`tfmx.tuner`): ``"auto"``
            measures on this machine and caches the result, ``"cached"`` only reads the
            cache, ``"off"`` takes the form stock TensorFlow runs. None: ``$TFMX_TUNE`` or
            ``"auto"``.
        guard: time the fused step against the stock step on the first real steps and keep
            stock unless the fused one is faster (:mod:`tfmx.guard`). None: ``$TFMX_GUARD``
            (default on).
        xla: the guard also times the step compiled by XLA (cpu and cuda; never metal) and
            keeps it where it is faster still, and the stages offer XLA-compiled regions (a
            layer norm, an attention) to the tuner. None: ``$TFMX_XLA`` (default on).
        strict: a stage (a rewrite made while a step is traced) that fails raises its
            exception: for tests and for debugging tfmx. Off (the default: ``$TFMX_STRICT``,
            else off), the call it failed on runs as Keras wrote it, ``tfmx.report()``
            records the error and a :class:`TfmxWarning` says so once: training goes on. (A
            GraphDef pass that fails always leaves its part of the graph as it was.)
        verbose: 0 silences the line a first run prints when tfmx starts measuring a model
            (:mod:`tfmx.notice`); None: ``$TFMX_VERBOSE`` (default 1).
        fuse: ``"measured"``: a fused form runs only where it measures faster on this machine
            and pays for its first call within the fit (the price gate, the guard, the
            tuner's budget); ``"always"``: every family takes its fused form where it applies,
            for verifying the fused step and for fits known to be long: no price gate, no
            whole-step trial (so ``guard=True`` is refused beside it), the tuner measures
            within its own budget (``$TFMX_TUNE_BUDGET``) whatever the fit's length, and every
            tuned choice takes a fused form, the fastest measured, else the first.
            ``tfmx.report()`` says so. None: ``$TFMX_FUSE`` or ``"measured"``
            (:data:`tfmx.env.FUSE_MODES`).

    Global and idempotent: calling it again replaces the settings; models compiled before
    rebuild their step functions on next use. Bad names raise ValueError listing the choices.

    >>> import tfmx
    >>> tfmx.enable(backend="gpu")
    Traceback (most recent call last):
    ...
    ValueError: unknown backend 'gpu'; choose one of ('cpu', 'cuda', 'metal') or None to detect
    >>> tfmx.enable(backend="metal", plugin="metal")
    Traceback (most recent call last):
    ...
    ValueError: unknown Metal plugin 'metal'; choose one of ('tensorflow-metal', ...
    >>> tfmx.enable(backend="metal", plugin="tensorflow-metal-plugin")
    >>> tfmx.state.options().backend.plugin
    ('tensorflow-metal-plugin', '0.4.1')
    >>> tfmx.enable(backend="cpu", exclude=["onednn"])
    >>> "onednn" in tfmx.state.options().patterns, "contraction" in tfmx.state.options().patterns
    (False, True)
    >>> tfmx.disable()
    """
    from fusion.family import resolve
    from tfmx import keras_hook, state
    from tfmx.backends import get_backend
    from tfmx.env import resolve_fuse
    from tfmx.guard import ENV_XLA, enabled_by_env
    from tfmx.notice import set_verbose
    from tfmx.tuner import resolve_mode

    set_verbose(verbose)
    target = get_backend(backend, plugin=plugin)
    patterns = resolve(patterns, exclude)
    if verify is None:
        verify = "first-step" if target.name in ("cuda", "metal") and target.available else False
    if not isinstance(verify, bool) and verify != "first-step":
        raise ValueError(f"verify must be True, False, 'first-step' or None, got {verify!r}")
    for name, value in (("guard", guard), ("xla", xla), ("strict", strict)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be True, False or None, got {value!r}")
    fuse = resolve_fuse(fuse)
    if fuse == "always":
        if guard:
            raise ValueError("guard=True keeps stock where the fused step is not faster; "
                             "fuse='always' runs the fused step: pass one of them")
        guard = False
    new = state.Options(backend=target, patterns=patterns, verify=verify,
                        tune=resolve_mode(tune),
                        guard=enabled_by_env() if guard is None else guard,
                        xla=enabled_by_env(ENV_XLA) if xla is None else xla,
                        strict=state.strict_by_env() if strict is None else strict,
                        fuse=fuse)
    if state.options() == new:
        return
    if not _keras_runs_tensorflow():
        return
    from tfmx import host_allocator, keras_fixes
    from tfmx.backends import onednn_enabled

    host_allocator.apply(target.name, onednn_enabled())  # before the first op, or too late

    try:
        missing = keras_hook.install()
    except UnknownKerasError as exc:
        disable()
        state.warn_once("keras-version", f"tfmx: {_versions()} is not what tfmx hooks "
                        f"({exc}); tfmx stays off and training runs as stock Keras. "
                        "tfmx is tested with the versions its package requires.")
        return
    keras_hook.warn_missing(missing)
    keras_fixes.install()  # Keras's fit under several workers, a patch group of its own
    state.set_options(new)


def _versions() -> str:
    """The installed Keras and TensorFlow, as a warning names them."""
    import keras
    import tensorflow as tf

    return f"Keras {keras.__version__} with TensorFlow {tf.__version__}"


def _keras_runs_tensorflow() -> bool:
    """Whether Keras runs on TensorFlow (tfmx rewrites nothing else); where it does not,
    a warning naming ``KERAS_BACKEND`` says so, once."""
    import keras

    from tfmx import state

    backend = keras.backend.backend()
    if backend == "tensorflow":
        return True
    state.warn_once("keras-backend", (
        f"tfmx: Keras runs on {backend!r} (KERAS_BACKEND={backend}); tfmx rewrites only "
        "Keras's TensorFlow backend, so it stays off and training runs as Keras does. Set "
        "KERAS_BACKEND=tensorflow before Keras is imported to use tfmx."))
    return False


def disable() -> None:
    """Switch the rewrite off. What was built while it was on runs fused until rebuilt.

    When it takes effect:

    - Every patch tfmx made to Keras (its trainer's three builders and ``fit``, the callbacks'
      ``on_train_begin``/``on_train_end``, the stages' layer methods, and Keras's multi-worker
      fixes, ``tfmx.keras_fixes``; all ``fusion.patches``) is put back now: the process is as
      it was before ``enable()``.
    - A Keras model: at its next step. Each step function tfmx built is replaced by a stand-in
      whose first call has Keras build its own and runs it (even inside a ``fit`` in
      progress). A reference kept to the old ``model.train_function`` still runs the fused
      graph.
    - A ``tfmx.function``: at its next call, unless an outer ``tf.function`` has already traced
      the call (that trace keeps the fused graph).

    - The host allocator (``tfmx.host_allocator``): the environment variable ``enable()`` set
      is removed; the allocator TensorFlow made with it serves the process to its end.

    ``tfmx.report()`` keeps what was recorded; a later ``enable()`` with new settings starts a
    fresh report.

    >>> import tfmx
    >>> tfmx.disable()
    >>> tfmx.enabled()
    False
    """
    from tfmx import host_allocator, keras_hook, state

    if state.options() is not None:
        state.set_options(None)
    host_allocator.restore()  # the environment; an allocator TensorFlow made stays
    from tfmx import keras_fixes

    keras_hook.uninstall()  # every patch tfmx made (fusion.patches), put back
    keras_fixes.uninstall()


def enabled() -> bool:
    """True between ``enable()`` and ``disable()``.

    >>> import tfmx
    >>> tfmx.disable()
    >>> tfmx.enabled()
    False
    """
    from tfmx import state

    return state.options() is not None


def report(reset: bool = False) -> Report:
    """What tfmx did since ``enable()``: print it, ``.to_dict()`` it, ``.export_graphs(dir)``.

    Args:
        reset: the returned report is the one so far, and a fresh one starts (the next
            ``report()`` holds only what happens after this call).

    Returns:
        The :class:`Report` (``tfmx.reporting.Report``); its first printed line says which
        step runs, how fast, and what measuring cost.

    >>> import tfmx
    >>> isinstance(tfmx.report(), tfmx.Report)
    True
    """
    from tfmx import epoch_data, host_allocator, state

    current = state.report()
    epoch_data.note(current, refresh=True)  # deletions that ended after the fit
    host_allocator.note(current)
    if reset:
        state.reset_report()
    return current


__all__ = [
    "BACKEND_NAMES",
    "BackendUnavailableError",
    "FusedFunction",
    "Report",
    "TfmxWarning",
    "VerificationError",
    "disable",
    "enable",
    "enabled",
    "function",
    "report",
]


def _host_allocator_at_import() -> None:
    """TensorFlow's pool for CPU tensors where oneDNN is off, chosen before a script's first op:
    now where TensorFlow is imported, else once its import ends (``tfmx.host_allocator``)."""
    try:
        from tfmx import host_allocator

        host_allocator.at_import()
    except Exception:  # noqa: BLE001 - an optimization: enable() decides again
        pass


_host_allocator_at_import()
