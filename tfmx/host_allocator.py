"""The host allocator: a pooled allocator for CPU tensors where TensorFlow would use malloc.

TensorFlow picks the allocator of its CPU tensors once per process, when it creates its
devices (the first op). With oneDNN on it picks oneDNN's, a best-fit pool (BFC) that keeps
freed blocks for the next step. With oneDNN off (the default of the 2.21 wheel on CPUs
without AVX-512, AMD's Zen 3 among them) it picks plain ``malloc``: every large tensor of
every step is mapped fresh from the kernel, page-faulted in and given back, which slows
the elementwise ops and XLA's compiled code as much as the contractions. TensorFlow's own
switch for a pool in that state is the environment variable ``TF_CPU_ALLOCATOR_USE_BFC``,
read when the devices are created.

:func:`apply` sets that variable where all of these hold: the backend is the CPU, the
system is Linux, oneDNN is off, the user has not set it either way, ``TFMX_HOST_ALLOCATOR`` is
not ``keep``, and TensorFlow has not made its devices yet (no op has run). The pool's cap is
TensorFlow's (64 GiB, ``TF_CPU_BFC_MEM_LIMIT_IN_MB``) or the machine's memory where that is
larger. A script often builds its data or its model, and so runs its first op, before it
calls ``tfmx.enable()``, so ``import tfmx`` decides (:func:`at_import`): at once where
TensorFlow is imported already (the usual order of a script's imports: ``import keras`` or
``import tensorflow`` above ``import tfmx``; :func:`apply_at_import`), else once TensorFlow's
import ends (:func:`watch_import`: ``import tfmx`` never imports TensorFlow itself);
``tfmx.enable()`` decides where neither could. Where the devices exist already, nothing
changes, and the report says how to get the pool: import tfmx, or call ``tfmx.enable()``,
before the first TensorFlow op, or set the variable.
:func:`restore` (``tfmx.disable()``) puts the environment back; an allocator TensorFlow has
made stays for the process's life, as every allocator does.

The choice is process-wide and made before anything runs, so it cannot be timed inside the
process like the tuner's choices. It follows TensorFlow's own pairing (oneDNN's pool where
oneDNN is on). ``python -m bench.allocator`` measures both allocators on a machine, and
BENCHMARKS.md shows the result per processor. A step is the same either way: the allocator
places tensors, it computes nothing.

Example:
    >>> from tfmx import host_allocator
    >>> choice = host_allocator.decide(backend="cpu", onednn=False, system="Linux",
    ...                                devices_made=False, environ={})
    >>> choice.pool, choice.sets
    (True, {'TF_CPU_ALLOCATOR_USE_BFC': '1'})
    >>> host_allocator.decide(backend="cpu", onednn=True, system="Linux",
    ...                       devices_made=False, environ={}).reason
    "oneDNN is on: TensorFlow's oneDNN pool"
"""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Mapping

TF_POOL = "TF_CPU_ALLOCATOR_USE_BFC"
"""TensorFlow's switch for a best-fit pool (BFC) as the CPU allocator, read at device creation."""

TF_POOL_LIMIT = "TF_CPU_BFC_MEM_LIMIT_IN_MB"
"""The pool's cap in MiB; TensorFlow's default is 64 GiB."""

TF_DEFAULT_LIMIT_MB = 1 << 16

ENV_MODE = "TFMX_HOST_ALLOCATOR"
"""``auto`` (default): the pool where :func:`decide` says; ``keep``: TensorFlow's choice."""

MODES = ("auto", "keep")


@dataclasses.dataclass(frozen=True)
class Choice:
    """What :func:`decide` chose: ``pool`` (tfmx set TensorFlow's pool), the environment
    variables it sets, and the reason in words."""

    pool: bool
    reason: str
    sets: dict[str, str] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        """The report's line.

        >>> Choice(False, "TFMX_HOST_ALLOCATOR=keep").describe()
        "host allocator: TensorFlow's choice (TFMX_HOST_ALLOCATOR=keep)"
        """
        if self.pool:
            return f"host allocator: TensorFlow's best-fit pool ({self.reason})"
        return f"host allocator: TensorFlow's choice ({self.reason})"


def memory_mb() -> int | None:
    """This machine's physical memory in MiB (None where the system does not say).

    >>> (memory_mb() or 1) > 0
    True
    """
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)
    except (ValueError, OSError, AttributeError):
        return None


def decide(backend: str, onednn: bool, system: str, devices_made: bool,
           environ: Mapping[str, str], machine_mb: int | None = None,
           moment: str = "tfmx.enable()") -> Choice:
    """Whether to ask TensorFlow for its pool, from the facts that decide it.

    Args:
        backend: tfmx's backend name; only ``"cpu"`` is considered.
        onednn: whether TensorFlow runs oneDNN (its pool is then TensorFlow's own choice).
        system: ``platform.system()``; only Linux, where malloc's behaviour was measured.
        devices_made: whether TensorFlow has created its devices (the allocator is made then).
        environ: the process's environment.
        machine_mb: physical memory; the cap is raised to it where it exceeds TensorFlow's.
        moment: when tfmx decides (``tfmx.enable()``, ``import tfmx``, or TensorFlow's import
            where tfmx was imported first), for the reason.

    >>> decide("cpu", False, "Linux", True, {}).reason.split(":")[0]
    'TensorFlow had made its devices before tfmx was imported or enabled'
    >>> decide("cpu", False, "Linux", False, {}, moment="import tfmx").reason.split("; ")[1]
    'TF_CPU_ALLOCATOR_USE_BFC=1 set at import tfmx'
    >>> decide("cpu", False, "Linux", False, {"TF_CPU_ALLOCATOR_USE_BFC": "0"}).reason
    'TF_CPU_ALLOCATOR_USE_BFC=0 set by the user'
    >>> decide("cpu", False, "Linux", False, {}, machine_mb=131072).sets[TF_POOL_LIMIT]
    '131072'
    """
    mode = environ.get(ENV_MODE, "auto").strip().lower() or "auto"
    if mode not in MODES:
        return Choice(False, f"{ENV_MODE}={environ[ENV_MODE]!r} is not one of {MODES}")
    if mode == "keep":
        return Choice(False, f"{ENV_MODE}=keep")
    if TF_POOL in environ:
        return Choice(environ[TF_POOL].strip().lower() in ("1", "true"),
                      f"{TF_POOL}={environ[TF_POOL]} set by the user")
    if backend != "cpu":
        return Choice(False, f"the {backend} backend: its devices hold the tensors")
    if onednn:
        return Choice(False, "oneDNN is on: TensorFlow's oneDNN pool")
    if system != "Linux":
        return Choice(False, f"{system}: the pool is measured on Linux only")
    if devices_made:
        return Choice(False, "TensorFlow had made its devices before tfmx was imported or "
                             "enabled: for the pool, import tfmx or call tfmx.enable() before "
                             f"the first TensorFlow op, or set {TF_POOL}=1")
    sets = {TF_POOL: "1"}
    if machine_mb and machine_mb > TF_DEFAULT_LIMIT_MB and TF_POOL_LIMIT not in environ:
        sets[TF_POOL_LIMIT] = str(machine_mb)
    return Choice(True, f"oneDNN is off, where TensorFlow would use malloc; {TF_POOL}=1 "
                        f"set at {moment}", sets)


def devices_made() -> bool:
    """Whether TensorFlow's eager context has created its devices (and so its allocator).

    >>> import tensorflow as tf
    >>> _ = tf.ones([1])
    >>> devices_made()
    True
    """
    try:
        from tensorflow.python.eager import context

        return bool(context.context()._initialized)
    except Exception:  # a TensorFlow without the attribute: assume made, change nothing
        return True


_choice: Choice | None = None
_saved: dict[str, str | None] = {}


def apply(backend: str, onednn: bool, moment: str = "tfmx.enable()") -> Choice:
    """Decide for this process and set the environment where the pool is chosen; never raises.

    >>> isinstance(apply("cpu", onednn=True), Choice)  # the pool kept where chosen before
    True
    """
    global _choice
    if _choice is not None and _choice.pool and all(
            os.environ.get(name) == value for name, value in _choice.sets.items()):
        return _choice  # set earlier (at import, or by an earlier enable()): still in place
    try:
        choice = decide(backend, onednn, platform.system(), devices_made(), os.environ,
                        memory_mb(), moment)
        for name, value in choice.sets.items():
            _saved.setdefault(name, os.environ.get(name))
            os.environ[name] = value
    except Exception as exc:  # the allocator is an optimization: never stop a fit for it
        choice = Choice(False, f"not decided: {type(exc).__name__}: {exc}")
    if _choice is None or choice.pool or not _choice.pool:
        _choice = choice
    return _choice


def _keras_backend(modules: Mapping[str, object], environ: Mapping[str, str]) -> str:
    """The backend Keras runs on, without importing it: Keras's configuration where it is
    loaded (Keras reads it before it imports a backend), else ``KERAS_BACKEND``, else Keras's
    default.

    >>> _keras_backend({}, {"KERAS_BACKEND": "jax"}), _keras_backend({}, {})
    ('jax', 'tensorflow')
    """
    config = modules.get("keras.src.backend.config")
    backend = getattr(config, "backend", None)
    if callable(backend):
        return str(backend())
    return environ.get("KERAS_BACKEND") or "tensorflow"


def _not_ours_at_import() -> bool:
    """Whether the import-time choice is out of tfmx's hands whatever TensorFlow says: another
    system than Linux, or ``TFMX_HOST_ALLOCATOR=keep`` (``enable()`` reports either)."""
    return (platform.system() != "Linux"
            or os.environ.get(ENV_MODE, "").strip().lower() == "keep")


def apply_at_import(moment: str = "import tfmx") -> Choice | None:
    """Where TensorFlow is imported, Keras runs on it and no op has run, decide as
    ``tfmx.enable()`` would (:func:`apply`), before the script's first op does: at
    ``import tfmx``, or where tfmx was imported first, once TensorFlow's import ends
    (:func:`watch_import`). None where it is too early (TensorFlow not imported) or not tfmx's
    to decide (another Keras backend, another system, ``TFMX_HOST_ALLOCATOR=keep``, the devices
    made already: ``enable()`` says why). Never raises, never imports TensorFlow.

    >>> apply_at_import() is None or isinstance(apply_at_import(), Choice)
    True
    """
    import sys

    try:
        if ("tensorflow" not in sys.modules or _not_ours_at_import()
                or _keras_backend(sys.modules, os.environ) != "tensorflow" or devices_made()):
            return None
        from tfmx.backends import detect, onednn_enabled

        if onednn_enabled():
            return None
        return apply(detect(), False, moment=moment)
    except Exception:  # noqa: BLE001 - an optimization: enable() decides again
        return None


class _Loader:
    """TensorFlow's own loader, which decides the allocator once TensorFlow's module has run
    (its import ended) and then hands the module back to the loader it came with."""

    def __init__(self, inner: object, watcher: _TensorFlowImport) -> None:
        self._inner, self._watcher = inner, watcher

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def create_module(self, spec: object) -> object:
        return self._inner.create_module(spec)  # type: ignore[attr-defined]

    def exec_module(self, module: object) -> None:
        try:
            self._inner.exec_module(module)  # type: ignore[attr-defined]
        finally:
            self._watcher.remove()
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self._inner  # type: ignore[attr-defined]
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self._inner
        apply_at_import("TensorFlow's import (tfmx imported before it)")


class _TensorFlowImport:
    """A finder on ``sys.meta_path`` (first) that finds nothing itself: for ``tensorflow`` it
    asks the other finders and wraps the loader they found (:class:`_Loader`). It removes
    itself once TensorFlow's import ends, or when ``tfmx.disable()`` undoes it."""

    def __init__(self) -> None:
        self._finding = False

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname != "tensorflow" or self._finding:
            return None
        import importlib.util

        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        except Exception:  # noqa: BLE001 - TensorFlow's import goes on without tfmx
            return None
        finally:
            self._finding = False
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(spec.loader, self)
        return spec

    def remove(self) -> None:
        import sys

        while self in sys.meta_path:
            sys.meta_path.remove(self)


_watcher: _TensorFlowImport | None = None


def watch_import() -> bool:
    """Where TensorFlow is not imported yet (tfmx imported first), decide once its import
    ends, before the script's first op: a finder on ``sys.meta_path`` until then (undone by
    :func:`restore`). True where it now watches.

    >>> import tensorflow  # imported: nothing to watch
    >>> watch_import()
    False
    """
    global _watcher
    import sys

    if "tensorflow" in sys.modules or _not_ours_at_import():
        return False
    if _watcher is None or _watcher not in sys.meta_path:
        _watcher = _TensorFlowImport()
        sys.meta_path.insert(0, _watcher)
    return True


def at_import() -> None:
    """``import tfmx``'s part (never raises): decide now where TensorFlow is imported, else
    once its import ends (:func:`watch_import`)."""
    try:
        if apply_at_import() is None:
            watch_import()
    except Exception:  # noqa: BLE001 - an optimization: enable() decides again
        pass


def restore() -> None:
    """Put back the environment variables :func:`apply` set (the allocator made stays).

    >>> restore()
    """
    if _watcher is not None:  # TensorFlow not imported yet: nothing to decide for it now
        _watcher.remove()
    for name, value in _saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _saved.clear()


def in_use() -> str:
    """The CPU allocator TensorFlow runs with, once its devices exist: ``"pool"`` (a best-fit
    pool, TensorFlow's or oneDNN's), ``"malloc"``, or ``"not made"`` before the first op.

    >>> import tensorflow as tf
    >>> _ = tf.ones([1])
    >>> in_use() in ("pool", "malloc")
    True
    """
    if not devices_made():
        return "not made"
    import tensorflow as tf

    try:
        tf.config.experimental.get_memory_info("CPU:0")
    except Exception:  # no statistics: not a pool (ValueError in TensorFlow 2.21)
        return "malloc"
    return "pool"


def expected() -> str:
    """:func:`in_use`, or before the first op the allocator TensorFlow will make: ``"pool"``
    where tfmx chose it, ``TF_CPU_ALLOCATOR_USE_BFC`` asks for it or oneDNN is on (its pool),
    else ``"malloc"``.

    >>> expected() in ("pool", "malloc")
    True
    """
    made = in_use()
    if made != "not made":
        return made
    from tfmx.backends import onednn_enabled

    asked = os.environ.get(TF_POOL, "").strip().lower() in ("1", "true")
    return "pool" if asked or onednn_enabled() else "malloc"


def note(report: object) -> None:
    """Add the choice to ``report`` (a :class:`tfmx.reporting.Report`), once."""
    if _choice is not None:
        report.note(_choice.describe())  # type: ignore[attr-defined]
