"""Backends as data: which fused nodes, fused_ops lists and dtypes each target runs.

- ``cpu``: TensorFlow's own CPU kernels. With oneDNN on (``TF_ENABLE_ONEDNN_OPTS=1``; off by
  default in the TensorFlow 2.21 Linux wheel) the fused kernels take more (residual Add, GELU,
  Tanh/Sigmoid after MatMul). The tables were read off the kernels by running each entry against
  the composite ops (``tests/test_backends.py`` runs them again).
- ``cuda``: TensorFlow's GPU kernels (tensorflow/core/kernels/conv_ops_fused_impl.h,
  matmul_op_fused.cc).
- ``metal``: Apple's tensorflow-metal 1.2.0 plugin, from the symbols of its public wheel
  (shared reference); its kernel list ships as ``tfmx/data/tensorflow-metal-1.2.0-ops.txt``.

A backend that is not present on this machine (``metal`` on Linux) still rewrites: the result is
a plan to inspect, and running it raises :class:`tfmx.errors.BackendUnavailableError`.

Example:
    >>> from tfmx.backends import get_backend
    >>> cpu = get_backend("cpu")
    >>> cpu.contraction_support("Conv2D", "float32", ("BiasAdd", "Relu"))
    True
    >>> get_backend("metal").contraction_support("DepthwiseConv2dNative", "float32", ("BiasAdd",))
    False
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
from collections.abc import Iterable, Mapping
from importlib import resources

BACKEND_NAMES = ("cpu", "cuda", "metal")


def _chains(*chains: Iterable[str]) -> frozenset[tuple[str, ...]]:
    return frozenset(tuple(c) for c in chains)


def _with_acts(prefix: tuple[str, ...], acts: Iterable[str]) -> list[tuple[str, ...]]:
    return [prefix] + [(*prefix, a) for a in acts]


Chains = frozenset[tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class BatchNormKernels:
    """What a backend runs of ``FusedBatchNormV3`` (and its gradient) and ``_FusedBatchNormEx``.

    ``ex_*`` describe ``_FusedBatchNormEx`` (side input + Relu) by mode; an empty dtype set
    means the backend does not run it in that mode, and ``ex_reason`` says why.
    """

    dtypes: frozenset[str]  # T of FusedBatchNormV3 / FusedBatchNormGradV3 (U is float32)
    data_formats: frozenset[str]
    ex_inference_dtypes: frozenset[str] = frozenset()
    ex_training_dtypes: frozenset[str] = frozenset()
    ex_data_formats: frozenset[str] = frozenset({"NHWC"})
    ex_channel_multiple: int = 1
    ex_reason: str = ""
    min_epsilon: float = 0.0
    # training _FusedBatchNormEx (+ _FusedBatchNormGradEx): its own layout conditions, and an
    # environment variable the kernel requires set at run time ("" for none)
    ex_training_data_formats: frozenset[str] = frozenset({"NHWC"})
    ex_training_channel_multiple: int = 1
    ex_training_env: str = ""

    def blocker(self, op: str, dtype: str, data_format: str, is_training: bool = True,
                channels: int | None = None, epsilon: float | None = None) -> str | None:
        """Why ``op`` ("FusedBatchNormV3" or "_FusedBatchNormEx") cannot run here, or None."""
        if epsilon is not None and epsilon < self.min_epsilon:
            return f"epsilon {epsilon:g} below the {self.min_epsilon:g} the kernel accepts"
        if op == "FusedBatchNormV3":
            if dtype not in self.dtypes:
                return f"no FusedBatchNormV3 kernel for {dtype}"
            if data_format not in self.data_formats:
                return f"no FusedBatchNormV3 kernel for {data_format}"
            return None
        mode = "training" if is_training else "inference"
        dtypes = self.ex_training_dtypes if is_training else self.ex_inference_dtypes
        if not dtypes:
            return f"no _FusedBatchNormEx in {mode}" + (f" ({self.ex_reason})"
                                                       if self.ex_reason else "")
        if dtype not in dtypes:
            return f"_FusedBatchNormEx in {mode} takes {'/'.join(sorted(dtypes))}, not {dtype}"
        formats = self.ex_training_data_formats if is_training else self.ex_data_formats
        multiple = self.ex_training_channel_multiple if is_training else self.ex_channel_multiple
        if data_format not in formats:
            return f"_FusedBatchNormEx in {mode} takes {'/'.join(sorted(formats))}"
        if multiple > 1 and (channels is None or channels % multiple):
            return f"_FusedBatchNormEx in {mode} needs channels % {multiple} == 0"
        env = self.ex_training_env if is_training else ""
        if env and os.environ.get(env, "").lower() not in ("1", "true"):
            return (f"_FusedBatchNormEx in training runs only with {env}=1 (cuDNN's persistent "
                    "batch norm, which TensorFlow leaves off: it may overflow for some input "
                    "ranges); set it to fuse")
        return None


@dataclasses.dataclass(frozen=True)
class Backend:
    """One rewrite target. Instances are data; see :func:`get_backend`."""

    name: str
    description: str
    device_type: str
    contractions: dict[str, dict[str, Chains]]  # op -> dtype -> fused_ops lists it runs
    data_formats: dict[str, frozenset[str]]
    kernels: frozenset[str] | None = None  # None: every registered TensorFlow op
    notes: tuple[str, ...] = ()
    batch_norm: BatchNormKernels | None = None
    # TensorFlow op -> the oneDNN op it runs on (fusion.patterns.onednn); empty: none.
    onednn_ops: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def contraction_support(self, op: str, dtype: str, fused_ops: tuple[str, ...]) -> bool:
        """True if ``_Fused<op>`` with ``fused_ops`` runs here in ``dtype``."""
        return tuple(fused_ops) in self.contractions.get(op, {}).get(dtype, frozenset())

    def contraction_data_format(self, op: str, data_format: str) -> bool:
        """True if the fused form of ``op`` runs here in ``data_format``."""
        return data_format in self.data_formats.get(op, frozenset())

    def runs_op(self, op: str) -> bool:
        """True if this backend has a kernel for ``op``."""
        return self.kernels is None or op in self.kernels

    def batch_norm_blocker(self, op: str, dtype: str, data_format: str,
                           is_training: bool = True, channels: int | None = None,
                           epsilon: float | None = None) -> str | None:
        """Why this backend cannot run batch-norm kernel ``op`` so configured, or None."""
        if self.batch_norm is None or not self.runs_op(op):
            return f"{self.name} runs no {op}"
        why = self.batch_norm.blocker(op, dtype, data_format, is_training, channels, epsilon)
        return None if why is None else f"{self.name}: {why}"

    @property
    def available(self) -> bool:
        """True if graphs for this backend can run on this machine."""
        return self.name in _present_backends()

    def describe(self) -> dict:
        """A plain dict of what this backend fuses, for reports and the README table."""
        return {
            "name": self.name,
            "description": self.description,
            "available_here": self.available,
            "contractions": {
                op: {dt: sorted("+".join(c) for c in chains) for dt, chains in by_dtype.items()}
                for op, by_dtype in self.contractions.items()
            },
            "batch_norm": None if self.batch_norm is None else {
                "FusedBatchNormV3": sorted(self.batch_norm.dtypes),
                "data_formats": sorted(self.batch_norm.data_formats),
                "_FusedBatchNormEx": {
                    "inference": sorted(self.batch_norm.ex_inference_dtypes),
                    "training": sorted(self.batch_norm.ex_training_dtypes),
                },
            },
            "notes": list(self.notes),
        }


_ACTS_BASIC = ("Relu", "Relu6", "Elu", "LeakyRelu")




@functools.cache
def onednn_kernels_registered() -> bool:
    """True if this TensorFlow has oneDNN's renamed CPU kernels (the Linux x86-64 wheels do),
    whether or not oneDNN's graph pass is on. Only x86-64 counts: that is where they were
    measured faster than Eigen (aarch64 builds route oneDNN through ACL, not measured)."""
    from tensorflow.python.framework import kernels

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False

    from fusion.patterns.onednn import KERNEL_LABEL, RETARGETS

    for op in RETARGETS.values():
        try:
            found = kernels.get_registered_kernels_for_op(op).kernel
        except Exception:  # noqa: BLE001 - an op this build does not know
            return False
        if not any(k.device_type == "CPU" and k.label == KERNEL_LABEL for k in found):
            return False
    return True


def _cpu(onednn: bool) -> Backend:
    from fusion.patterns.onednn import RETARGETS

    # Read off the kernels (TF 2.21, x86-64) by running every fused_ops list in every dtype
    # against the composite ops; tests/test_backends.py runs each entry again.
    conv = _chains(
        *_with_acts(("BiasAdd",), _ACTS_BASIC), *_with_acts(("FusedBatchNorm",), _ACTS_BASIC)
    )
    matmul = _chains(*_with_acts(("BiasAdd",), (*_ACTS_BASIC, "Tanh", "Sigmoid")))
    contractions = {
        "Conv2D": {"float32": conv},
        # 16-bit chains are tuner decisions (fusion.patterns.contraction): the bfloat16
        # _FusedMatMul ran 25x slower than MatMul + BiasAdd + Relu on a Zen 3 (256x512x512).
        "MatMul": {"float32": matmul, "float16": matmul, "bfloat16": matmul},
    }
    if onednn:
        contractions["Conv2D"]["float32"] = conv | _chains(
            *_with_acts(("BiasAdd", "Add"), _ACTS_BASIC)
        )
        contractions["MatMul"]["float32"] = matmul | _chains(
            ("BiasAdd", "GeluExact"), ("BiasAdd", "GeluApproximate"), ("BiasAdd", "Add")
        )
        # _FusedDepthwiseConv2dNative has a CPU kernel only through oneDNN.
        contractions["DepthwiseConv2dNative"] = {
            "float32": _chains(*_with_acts(("BiasAdd",), ("Relu", "Relu6", "Elu")))
        }
    return Backend(
        # With oneDNN on, TensorFlow's own pass retargets them.
        onednn_ops=dict(RETARGETS) if not onednn and onednn_kernels_registered() else {},
        name="cpu",
        description=f"TensorFlow CPU kernels, oneDNN {'on' if onednn else 'off'}",
        device_type="CPU",
        contractions=contractions,
        data_formats={"Conv2D": frozenset({"NHWC"}),
                      "DepthwiseConv2dNative": frozenset({"NHWC"})},
        notes=(() if onednn else (
            "residual Add, GELU and depthwise fuse only with oneDNN on "
            "(TF_ENABLE_ONEDNN_OPTS=1; off by default in the TF 2.21 Linux wheel)",
        )) + ("_FusedBatchNormEx has no working CPU kernel (probed, oneDNN on and off)",
               "16-bit _FusedMatMul only where the tuner measures it faster than MatMul + "
               "BiasAdd here (it ran 25x slower in bfloat16 on one CPU)"),
        # Probed (TF 2.21, x86-64): FusedBatchNormV3 and its gradient run in float32,
        # bfloat16 and float16, NHWC and NCHW. _FusedBatchNormEx is registered on CPU but its
        # kernel produces no output ("Missing 0-th output"), oneDNN on or off.
        batch_norm=BatchNormKernels(
            dtypes=frozenset({"float32", "bfloat16", "float16"}),
            data_formats=frozenset({"NHWC", "NCHW", "NDHWC", "NCDHW"}),
            ex_reason="registered on CPU but its kernel produces no output in TF 2.21",
        ),
    )


def _cuda() -> Backend:
    conv = _chains(*_with_acts(("BiasAdd",), _ACTS_BASIC))
    matmul32 = _chains(*_with_acts(("BiasAdd",), ("Relu",)))
    matmul16 = _chains(*_with_acts(("BiasAdd",), ("Relu", "Tanh", "Sigmoid",
                                                  "GeluApproximate", "GeluExact")))
    return Backend(
        name="cuda",
        description="TensorFlow CUDA kernels (cuDNN / cuBLASLt)",
        device_type="GPU",
        contractions={
            "Conv2D": {"float32": conv, "float16": conv},
            "MatMul": {"float32": matmul32, "float16": matmul16, "bfloat16": matmul16},
        },
        data_formats={"Conv2D": frozenset({"NHWC", "NCHW"})},
        notes=("_FusedDepthwiseConv2dNative has no GPU kernel",
               "Tanh/Sigmoid/GELU after MatMul are cuBLASLt epilogues in 16-bit only"),
        # tensorflow/core/kernels/fused_batch_norm_op.cc and Grappler's remapper.cc:
        # inference _FusedBatchNormEx is a custom CUDA kernel (float, half; NHWC/NCHW);
        # training goes through cuDNN (half, NHWC, channels % 4) and needs the backward as
        # _FusedBatchNormGradEx, which tfmx does not emit yet.
        batch_norm=BatchNormKernels(
            dtypes=frozenset({"float32", "float16"}),
            data_formats=frozenset({"NHWC", "NCHW", "NDHWC", "NCDHW"}),
            ex_inference_dtypes=frozenset({"float32", "float16"}),
            ex_data_formats=frozenset({"NHWC", "NCHW"}),
            # The kernel's own checks (fused_batch_norm_op.cc): with an activation or a side
            # input in training, half only, NHWC only, cuDNN's persistent mode on; the remapper
            # adds channels % 4.
            ex_training_dtypes=frozenset({"float16"}),
            ex_training_channel_multiple=4,
            ex_training_env="TF_USE_CUDNN_BATCHNORM_SPATIAL_PERSISTENT",
            min_epsilon=1.001e-5,
        ),
    )


def metal_kernels() -> frozenset[str]:
    """Op names with a kernel in tensorflow-metal 1.2.0 (shipped list)."""
    text = resources.files("tfmx").joinpath("data/tensorflow-metal-1.2.0-ops.txt").read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.strip())


def _metal() -> Backend:
    chains = _chains(*_with_acts(("BiasAdd",), _ACTS_BASIC))
    by_dtype = {dt: chains for dt in ("float32", "float16", "bfloat16")}
    return Backend(
        name="metal",
        description="Apple tensorflow-metal 1.2.0 (PluggableDevice GPU)",
        device_type="GPU",
        contractions={"Conv2D": by_dtype, "MatMul": dict(by_dtype)},
        data_formats={"Conv2D": frozenset({"NHWC", "NCHW"})},
        kernels=metal_kernels(),
        notes=(
            "conv fused computations per the plugin: biasAdd, biasAddWith{Relu,Relu6,Elu,"
            "LeakyRelu}; no residual Add, no _FusedDepthwiseConv2dNative kernel",
            "GeluExact/GeluApproximate appear beside _FusedMatMul in the plugin's strings but "
            "cannot be confirmed without a Mac: not emitted",
        ),
        # The plugin registers FusedBatchNorm{,V2,V3}, their grads and _FusedBatchNormEx; its
        # messages say the side-input + activation form wants half, NHWC and channels % 4.
        batch_norm=BatchNormKernels(
            dtypes=frozenset({"float32", "float16", "bfloat16"}),
            data_formats=frozenset({"NHWC", "NCHW"}),
            ex_inference_dtypes=frozenset({"float16"}),
            ex_data_formats=frozenset({"NHWC"}),
            ex_channel_multiple=4,
            ex_reason="training needs the backward as _FusedBatchNormGradEx, which the plugin "
                      "does not register",
        ),
    )


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


def get_backend(name: str | None = None) -> Backend:
    """The :class:`Backend` called ``name`` (auto-detected when None).

    >>> get_backend("cuda").device_type
    'GPU'
    >>> get_backend("tpu")
    Traceback (most recent call last):
    ...
    ValueError: unknown backend 'tpu'; choose one of ('cpu', 'cuda', 'metal') or None to detect
    """
    if name is None:
        name = detect()
    if name == "cpu":
        return _cpu(onednn_enabled())
    if name == "cuda":
        return _cuda()
    if name == "metal":
        return _metal()
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
