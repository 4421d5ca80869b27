"""Backends as data: which fused nodes, fused_ops lists and dtypes each target runs.

- ``cpu``: TensorFlow's own CPU kernels. With oneDNN on (``TF_ENABLE_ONEDNN_OPTS=1``; off by
  default in the TensorFlow 2.21 Linux wheel) the fused kernels take more (residual Add, GELU,
  Tanh/Sigmoid after MatMul). The tables were read off the kernels by running each entry against
  the composite ops (``tests/test_backends.py`` runs them again).
- ``cuda``: TensorFlow's GPU kernels (tensorflow/core/kernels/conv_ops_fused_impl.h,
  matmul_op_fused.cc).
- ``metal``: the Metal plugin this machine has (:func:`tfmx.metal_plugins.installed_plugin`)
  under the installed TensorFlow, or the one a plan names (``get_backend("metal",
  plugin=...)``): Apple's tensorflow-metal 1.2.0, from the symbols of its public wheel (shared
  reference; its kernel list ships as ``tfmx/data/tensorflow-metal-1.2.0-ops.txt``), the default
  where none is installed (Linux); or the open tensorflow-metal-plugin, from the table
  :mod:`tfmx.metal_plugins` read from its source (:func:`metal_backend`).

What a backend runs for each family is declared in that family's module, per target
(``fusion.family.Family.capability`` of a :class:`fusion.platform.Platform`: the name, oneDNN's
state, the Metal plugin's table and the TensorFlow planned for, the kernel list); this module
builds each target's :class:`~fusion.platform.Platform` and asks every family.

A backend that is not present on this machine (``metal`` on Linux) still rewrites: the result is
a plan to inspect, and running it raises :class:`tfmx.errors.BackendUnavailableError`.

Example:
    >>> from tfmx.backends import get_backend
    >>> cpu = get_backend("cpu")
    >>> from fusion.graphs.contraction import ContractionKernels
    >>> cpu.capability(ContractionKernels).runs("Conv2D", "float32", ("BiasAdd", "Relu"))
    True
    >>> metal = get_backend("metal").capability(ContractionKernels)
    >>> metal.runs("DepthwiseConv2dNative", "float32", ("BiasAdd",))
    False
    >>> open_metal = get_backend("metal", plugin="tensorflow-metal-plugin", tensorflow="2.21")
    >>> open_metal.capability(ContractionKernels).runs("MatMul", "float32", ("BiasAdd", "Tanh"))
    True
    >>> open_metal.runs_op("ResourceApplyAdam")  # host-only under TensorFlow 2.21
    False
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import types
from importlib import resources
from typing import TYPE_CHECKING, Any, TypeVar

from tfmx import metal_plugins

if TYPE_CHECKING:
    from fusion.platform import Platform

C = TypeVar("C")

BACKEND_NAMES = ("cpu", "cuda", "metal")


@dataclasses.dataclass(frozen=True)
class Backend:
    """One rewrite target (a ``fusion.pattern.Target``): its name, kernel list and, per family,
    that family's own dataclass as the family declares it for this target
    (``capabilities``: ``fusion.family.Family.capability`` of the backend's
    :class:`fusion.platform.Platform`; :meth:`capability` looks one up). Instances are data;
    see :func:`get_backend`. (Importing this module loads no TensorFlow: the families are
    loaded when a backend is made.)

    >>> from fusion.graphs.contraction import ContractionKernels
    >>> get_backend("metal").capability(ContractionKernels).runs("MatMul", "float16", ("BiasAdd",))
    True
    """

    name: str
    description: str
    device_type: str
    capabilities: tuple[Any, ...] = ()
    kernels: frozenset[str] | None = None  # None: every registered TensorFlow op
    notes: tuple[str, ...] = ()
    # A Metal plugin's (distribution, version); None for cpu and cuda.
    plugin: tuple[str, str] | None = None
    # Ops the plugin registers but not under the TensorFlow planned for: TensorFlow's own
    # kernels run them from the host (not in ``kernels``); ``host_only_why`` says why.
    host_only: frozenset[str] = frozenset()
    host_only_why: str = ""
    # op -> the value dtypes its kernel takes, where the backend's table says (absent or
    # empty: any); see :meth:`runs_op`.
    op_dtypes: Any = dataclasses.field(default=None, compare=False, repr=False)

    def runs_op(self, op: str, dtype: str | None = None) -> bool:
        """True if this backend has a kernel for ``op`` (in ``dtype``, where given and its
        table lists dtypes: a stage that emits a helper op in the step's dtype asks this).

        >>> metal = get_backend("metal", plugin="tensorflow-metal-plugin", tensorflow="2.21")
        >>> metal.runs_op("ConcatV2"), metal.runs_op("ConcatV2", "bfloat16")
        (True, False)
        >>> get_backend("cuda").runs_op("ConcatV2", "bfloat16")
        True
        """
        if self.kernels is not None and op not in self.kernels:
            return False
        allowed = (self.op_dtypes or {}).get(op)
        return dtype is None or not allowed or dtype in allowed

    def host_only_reason(self, op: str) -> str | None:
        """Why ``op`` would run on the host here (its plugin has a kernel for it, but not under
        this TensorFlow), or None.

        >>> metal = get_backend("metal", plugin="tensorflow-metal-plugin", tensorflow="2.21.0")
        >>> metal.host_only_reason("ResourceApplyAdam").startswith(
        ...     "ResourceApplyAdam would run on the host")
        True
        >>> get_backend("metal", plugin="tensorflow-metal-plugin", tensorflow="2.22.0"
        ...             ).host_only_reason("ResourceApplyAdam") is None
        True
        """
        if op not in self.host_only:
            return None
        return f"{op} would run on the host, not the GPU, every step: {self.host_only_why}"

    def capability(self, kind: type[C]) -> C | None:
        """What this backend declares for the family whose dataclass is ``kind``, or None."""
        return next((c for c in self.capabilities if isinstance(c, kind)), None)

    @property
    def available(self) -> bool:
        """True if graphs for this backend can run on this machine."""
        return self.name in _present_backends()

    def describe(self) -> dict:
        """A plain dict of what this backend fuses, for reports and ``tfmx backends``: its
        sections are what its capabilities with a ``describe()`` print.

        >>> shown = get_backend("cuda").describe()
        >>> shown["contractions"]["Conv2D"]["float16"][:2], shown["batch_norm"]["data_formats"]
        (['BiasAdd', 'BiasAdd+Elu'], ['NCDHW', 'NCHW', 'NDHWC', 'NHWC'])
        """
        # every description has these sections; a backend declaring nothing for one shows this
        sections: dict[str, Any] = {"contractions": {}, "batch_norm": None}
        for capability in self.capabilities:
            described = getattr(capability, "describe", None)
            if described is not None:
                sections.update(described())
        return {
            "name": self.name,
            "description": self.description,
            "available_here": self.available,
            "plugin": None if self.plugin is None else " ".join(self.plugin),
            **sections,
            "host_only": sorted(self.host_only),
            "notes": list(self.notes),
        }


def _capabilities(platform: Platform) -> dict[str, Any]:
    """Family name -> what the family declares for ``platform`` (``Family.capability``), for
    every family that declares something there, in pipeline order.

    >>> from fusion.platform import Platform
    >>> sorted(_capabilities(Platform("cuda")))
    ['batch_norm', 'contraction', 'rms_norm', 'rnn', 'scaled_rms_norm', 'squeeze_excite']
    """
    from fusion.family import families

    found = {}
    for family in families():
        capability = None if family.capability is None else family.capability(platform)
        if capability is not None:
            found[family.name] = capability
    return found


def _cpu(onednn: bool) -> Backend:
    from fusion.platform import Platform

    return Backend(
        name="cpu",
        description=f"TensorFlow CPU kernels, oneDNN {'on' if onednn else 'off'}",
        device_type="CPU",
        notes=(() if onednn else (
            "residual Add, GELU and depthwise fuse only with oneDNN on "
            "(TF_ENABLE_ONEDNN_OPTS=1, set before TensorFlow is imported; TensorFlow leaves "
            "it off on CPUs without AVX512_VNNI, AVX512_BF16, AVX_VNNI or AMX)",
            ONEDNN_OFF_ADVICE,
        )) + ("_FusedBatchNormEx has no working CPU kernel (probed, oneDNN on and off)",
               "16-bit _FusedMatMul only where the tuner measures it faster than MatMul + "
               "BiasAdd here (it ran 25x slower in bfloat16 on one CPU)"),
        capabilities=tuple(_capabilities(Platform("cpu", onednn=onednn)).values()),
    )


def _cuda() -> Backend:
    from fusion.platform import Platform

    return Backend(
        name="cuda",
        description="TensorFlow CUDA kernels (cuDNN / cuBLASLt)",
        device_type="GPU",
        notes=("_FusedDepthwiseConv2dNative has no GPU kernel",
               "Tanh/Sigmoid/GELU after MatMul are cuBLASLt epilogues in 16-bit only"),
        capabilities=tuple(_capabilities(Platform("cuda")).values()),
    )


def metal_kernels() -> frozenset[str]:
    """Op names with a kernel in tensorflow-metal 1.2.0 (shipped list)."""
    text = resources.files("tfmx").joinpath("data/tensorflow-metal-1.2.0-ops.txt").read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.strip())


def _metal(notes: tuple[str, ...] = ()) -> Backend:
    """Apple's tensorflow-metal 1.2.0 (the only release of it tfmx has a table of)."""
    from fusion.platform import Platform

    table = metal_plugins.plugin_table(metal_plugins.APPLE, "1.2.0")
    kernels = metal_kernels()
    low, high = table.tensorflow
    return Backend(
        name="metal",
        description=(f"Apple {table.name} {table.version} (PluggableDevice GPU), built for "
                     f"TensorFlow {low}-{high}"),
        device_type="GPU",
        kernels=kernels,
        plugin=(table.name, table.version),
        notes=(
            "conv fused computations per the plugin: biasAdd, biasAddWith{Relu,Relu6,Elu,"
            "LeakyRelu}; no residual Add, no _FusedDepthwiseConv2dNative kernel",
            "GeluExact/GeluApproximate appear beside _FusedMatMul in the plugin's strings but "
            "cannot be confirmed without a Mac: not emitted",
            *notes,
        ),
        capabilities=tuple(_capabilities(Platform("metal", table=table,
                                                  kernels=kernels)).values()),
    )


def _open_metal(table: metal_plugins.PluginTable, tensorflow: str,
                notes: tuple[str, ...] = ()) -> Backend:
    """The open tensorflow-metal-plugin's backend under TensorFlow ``tensorflow``, every
    capability derived from its table (ops registered, dtypes, fused_ops lists)."""
    from fusion.platform import Platform

    host = table.host_only(tensorflow)
    kernels = frozenset(table.ops) - host
    capabilities = _capabilities(Platform("metal", table=table, tensorflow=tensorflow,
                                          kernels=kernels))
    low, high = table.tensorflow
    built = low if low == high else f"{low}-{high}"
    said = [f"table read from the {table.name} {table.version} sdist's source (SHA-256 "
            f"{table.source_sha256}): what it registers, not what ran (no Mac ran these plans)"]
    fused = [op for op in kernels if op.startswith("_Fused")]
    if not any("bfloat16" in table.ops[op] for op in fused):
        said.append("no bfloat16 kernel for its fused ops: bfloat16 chains stay unfused")
    if "_FusedDepthwiseConv2dNative" not in kernels:
        said.append("no _FusedDepthwiseConv2dNative kernel")
    if "rnn" not in capabilities:
        said.append("no CudnnRNN kernels: Keras's LSTM / GRU keep their own loop")
    if not table.loads_into(tensorflow):
        said.append(f"{table.version} is built for TensorFlow {built} and declines to load into "
                    f"{tensorflow} (TF_METAL_SKIP_VERSION_CHECK=1 overrides): a plan only")
    why = ""
    if host:
        gate = ("only where TensorFlow exports the kernel C API for resource variables (2.22 "
                "and later; tensorflow/tensorflow#126374)")
        why = (f"{table.name} {table.version} registers its kernel {gate}, which TensorFlow "
               f"{tensorflow} does not: TensorFlow's own kernel runs it")
        said.append(f"host only under TensorFlow {tensorflow}, TensorFlow's own kernels run "
                    f"them: {', '.join(sorted(host))} (the plugin registers them {gate})")
    return Backend(
        name="metal",
        description=(f"{table.name} {table.version} (open PluggableDevice GPU), built for "
                     f"TensorFlow {built}, planned for TensorFlow {tensorflow}"),
        device_type="GPU",
        kernels=kernels,
        capabilities=tuple(capabilities.values()),
        plugin=(table.name, table.version),
        host_only=host,
        host_only_why=why,
        op_dtypes=types.MappingProxyType(dict(table.ops)),
        notes=(*said, *notes),
    )


def _plugin_request(plugin: str) -> tuple[str, str | None]:
    """``"name"`` or ``"name==version"`` as the canonical name and the version (or None);
    ValueError naming the choices for a plugin or release tfmx has no table of."""
    name, _, version = (part.strip() for part in plugin.partition("=="))
    try:
        table = metal_plugins.plugin_table(name, version or None)
    except ValueError:
        raise ValueError(
            f"unknown Metal plugin {plugin!r}; choose one of {metal_plugins.PLUGINS} "
            "(optionally with a version, e.g. 'tensorflow-metal-plugin==0.4.1') or None for the "
            "installed one") from None
    except LookupError as e:
        raise ValueError(str(e)) from None
    return table.name, version or None


def _installed_tensorflow() -> str:
    import tensorflow as tf

    return tf.__version__


def metal_backend(plugin: str | None = None, tensorflow: str | None = None) -> Backend:
    """The ``metal`` :class:`Backend` of Metal plugin ``plugin`` (``"tensorflow-metal"``,
    ``"tensorflow-metal-plugin"``, either optionally ``"==<version>"``; the newest release tfmx
    has a table of when no version is given) under TensorFlow ``tensorflow`` (default: the
    installed one).

    With ``plugin`` None, the plugin installed here (:func:`tfmx.metal_plugins.installed_plugin`)
    at its version, under the TensorFlow installed beside it; where none is (Linux), Apple's
    tensorflow-metal 1.2.0, as before there was a choice. An installed release tfmx has no
    table of is planned with the newest table of that plugin, and the backend's notes say so.

    >>> print(metal_backend("tensorflow-metal-plugin", tensorflow="2.21.0").description)
    tensorflow-metal-plugin 0.4.1 (open PluggableDevice GPU), built for TensorFlow 2.21, ...
    >>> metal_backend("tensorflow-metal==1.2.0").plugin
    ('tensorflow-metal', '1.2.0')
    >>> metal_backend("tensorflow-metal-plugin==0.1")
    Traceback (most recent call last):
    ...
    ValueError: no table of tensorflow-metal-plugin 0.1; tfmx has ['0.4.1']
    """
    notes: tuple[str, ...] = ()
    if plugin is not None:
        name, version = _plugin_request(plugin)
    else:
        installed = metal_plugins.installed_plugin()
        if installed is None:
            return _metal()
        name, version = installed.name, installed.version
        tensorflow = tensorflow or installed.tensorflow
        try:
            metal_plugins.plugin_table(name, version)
        except LookupError:
            newest = metal_plugins.plugin_table(name).version
            notes = (f"{name} {version} is installed; tfmx has no table of it: planned with "
                     f"{newest}'s",)
            version = newest
    if name == metal_plugins.APPLE:
        return _metal(notes)
    table = metal_plugins.plugin_table(name, version)
    return _open_metal(table, tensorflow or _installed_tensorflow(), notes)


ONEDNN_OFF_ADVICE = (
    "oneDNN's pass is off in this process: stock with TF_ENABLE_ONEDNN_OPTS=1 (set before "
    "TensorFlow is imported) may train faster than tfmx without it (on one measured CPU, "
    "1.3-1.7 x faster on CNNs, MLPs and RNNs); `tfmx bench --model ... --onednn both` "
    "measures both states here")
"""What the cpu backend and ``tfmx.report()`` say where oneDNN's kernels are in the wheel and
its pass is off: a process cannot switch it (TensorFlow reads the variable at import)."""


def onednn_enabled() -> bool:
    """True if this TensorFlow runs its oneDNN CPU kernels (``TF_ENABLE_ONEDNN_OPTS``)."""
    from tensorflow.python.util import _pywrap_util_port

    return bool(_pywrap_util_port.IsMklEnabled())


@functools.cache
def _present_backends() -> frozenset[str]:
    import tensorflow as tf

    present = {"cpu"}
    gpus = tf.config.list_physical_devices("GPU")
    if gpus and platform.system() == "Darwin":
        present.add("metal")
    elif gpus and tf.test.is_built_with_cuda():
        present.add("cuda")
    return frozenset(present)


def detect() -> str:
    """The backend this machine trains on: ``metal`` on a Mac GPU, ``cuda``, else ``cpu``.

    >>> detect() in BACKEND_NAMES
    True
    """
    present = _present_backends()
    for name in ("metal", "cuda"):
        if name in present:
            return name
    return "cpu"


def get_backend(name: str | None = None, plugin: str | None = None,
                tensorflow: str | None = None) -> Backend:
    """The :class:`Backend` called ``name`` (auto-detected when None).

    For ``metal``, ``plugin`` names the Metal plugin to plan for (``"tensorflow-metal"``,
    ``"tensorflow-metal-plugin"``, optionally ``"==<version>"``) and ``tensorflow`` the
    TensorFlow version to assume; by default the plugin installed here under the installed
    TensorFlow, else Apple's tensorflow-metal 1.2.0 (see :func:`metal_backend`).

    >>> get_backend("cuda").device_type
    'GPU'
    >>> get_backend("metal").plugin  # none installed on Linux
    ('tensorflow-metal', '1.2.0')
    >>> get_backend("metal", plugin="tensorflow-metal-plugin").name
    'metal'
    >>> get_backend("tpu")
    Traceback (most recent call last):
    ...
    ValueError: unknown backend 'tpu'; choose one of ('cpu', 'cuda', 'metal') or None to detect
    >>> get_backend("metal", plugin="metal-for-all")
    Traceback (most recent call last):
    ...
    ValueError: unknown Metal plugin 'metal-for-all'; choose one of ('tensorflow-metal', ...
    """
    if name is None:
        name = detect()
    if name == "metal":
        return metal_backend(plugin, tensorflow)
    if plugin is not None or tensorflow is not None:
        raise ValueError(f"plugin= and tensorflow= name a Metal plugin and apply to the metal "
                         f"backend only, not {name!r}")
    if name == "cpu":
        return _cpu(onednn_enabled())
    if name == "cuda":
        return _cuda()
    raise ValueError(
        f"unknown backend {name!r}; choose one of {BACKEND_NAMES} or None to detect"
    )


def env_summary() -> dict[str, str]:
    """What the report prints about this machine's TensorFlow."""
    import tensorflow as tf

    return {
        "tensorflow": tf.__version__,
        "platform": f"{platform.system()} {platform.machine()}",
        "onednn": "on" if onednn_enabled() else "off",
        "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "(unset)"),
    }
