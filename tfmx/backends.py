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
    >>> from fusion.patterns.contraction import ContractionKernels
    >>> cpu.capability(ContractionKernels).runs("Conv2D", "float32", ("BiasAdd", "Relu"))
    True
    >>> metal = get_backend("metal").capability(ContractionKernels)
    >>> metal.runs("DepthwiseConv2dNative", "float32", ("BiasAdd",))
    False
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
from collections.abc import Iterable
from importlib import resources
from typing import Any, TypeVar

C = TypeVar("C")

BACKEND_NAMES = ("cpu", "cuda", "metal")


def _chains(*chains: Iterable[str]) -> frozenset[tuple[str, ...]]:
    return frozenset(tuple(c) for c in chains)


def _with_acts(prefix: tuple[str, ...], acts: Iterable[str]) -> list[tuple[str, ...]]:
    return [prefix] + [(*prefix, a) for a in acts]




@dataclasses.dataclass(frozen=True)
class Backend:
    """One rewrite target (a ``fusion.pattern.Target``): its name, kernel list and, per family,
    that family's own dataclass (``capabilities``; :meth:`capability` looks one up). Instances
    are data; see :func:`get_backend`. (Importing this module loads no TensorFlow: the
    families' dataclasses are imported when a backend is made.)

    >>> from fusion.patterns.contraction import ContractionKernels
    >>> get_backend("metal").capability(ContractionKernels).runs("MatMul", "float16", ("BiasAdd",))
    True
    """

    name: str
    description: str
    device_type: str
    capabilities: tuple[Any, ...] = ()
    kernels: frozenset[str] | None = None  # None: every registered TensorFlow op
    notes: tuple[str, ...] = ()

    def runs_op(self, op: str) -> bool:
        """True if this backend has a kernel for ``op``."""
        return self.kernels is None or op in self.kernels

    def capability(self, kind: type[C]) -> C | None:
        """What this backend declares for the family whose dataclass is ``kind``, or None."""
        return next((c for c in self.capabilities if isinstance(c, kind)), None)

    @property
    def available(self) -> bool:
        """True if graphs for this backend can run on this machine."""
        return self.name in _present_backends()

    def describe(self) -> dict:
        """A plain dict of what this backend fuses, for reports and the README table."""
        from fusion.patterns.batch_norm_kernels import BatchNormKernels
        from fusion.patterns.contraction import ContractionKernels

        contraction = self.capability(ContractionKernels)
        batch_norm = self.capability(BatchNormKernels)
        return {
            "name": self.name,
            "description": self.description,
            "available_here": self.available,
            "contractions": {} if contraction is None else contraction.describe(),
            "batch_norm": None if batch_norm is None else {
                "FusedBatchNormV3": sorted(batch_norm.dtypes),
                "data_formats": sorted(batch_norm.data_formats),
                "_FusedBatchNormEx": {
                    "inference": sorted(batch_norm.ex_inference_dtypes),
                    "training": sorted(batch_norm.ex_training_dtypes),
                },
            },
            "notes": list(self.notes),
        }


_ACTS_BASIC = ("Relu", "Relu6", "Elu", "LeakyRelu")




def _cpu(onednn: bool) -> Backend:
    from fusion.patterns.batch_norm_kernels import BatchNormKernels
    from fusion.patterns.contraction import ContractionKernels
    from fusion.patterns.onednn import OneDnnKernels, kernels_registered
    from fusion.stages.rnn import RnnKernels

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
    kernels = ContractionKernels(contractions, {"Conv2D": frozenset({"NHWC"}),
                                                "DepthwiseConv2dNative": frozenset({"NHWC"})})
    # With oneDNN on, TensorFlow's own pass retargets them.
    retargets = (OneDnnKernels(),) if not onednn and kernels_registered() else ()
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
        capabilities=(
            kernels, *retargets, RnnKernels("hoisted"),
            # Probed (TF 2.21, x86-64): FusedBatchNormV3 and its gradient run in float32,
            # bfloat16 and float16, NHWC and NCHW. _FusedBatchNormEx is registered on CPU but
            # its kernel produces no output ("Missing 0-th output"), oneDNN on or off.
            BatchNormKernels(
                dtypes=frozenset({"float32", "bfloat16", "float16"}),
                data_formats=frozenset({"NHWC", "NCHW", "NDHWC", "NCDHW"}),
                ex_reason="registered on CPU but its kernel produces no output in TF 2.21",
            ),
        ),
    )


def _cuda() -> Backend:
    from fusion.patterns.batch_norm_kernels import BatchNormKernels
    from fusion.patterns.contraction import ContractionKernels
    from fusion.stages.rnn import RnnKernels

    conv = _chains(*_with_acts(("BiasAdd",), _ACTS_BASIC))
    matmul32 = _chains(*_with_acts(("BiasAdd",), ("Relu",)))
    matmul16 = _chains(*_with_acts(("BiasAdd",), ("Relu", "Tanh", "Sigmoid",
                                                  "GeluApproximate", "GeluExact")))
    return Backend(
        name="cuda",
        description="TensorFlow CUDA kernels (cuDNN / cuBLASLt)",
        device_type="GPU",
        notes=("_FusedDepthwiseConv2dNative has no GPU kernel",
               "Tanh/Sigmoid/GELU after MatMul are cuBLASLt epilogues in 16-bit only"),
        capabilities=(ContractionKernels({
            "Conv2D": {"float32": conv, "float16": conv},
            "MatMul": {"float32": matmul32, "float16": matmul16, "bfloat16": matmul16},
        }, {"Conv2D": frozenset({"NHWC", "NCHW"})}),
            RnnKernels("cudnn", gru_gates_rzh=True),
            # tensorflow/core/kernels/fused_batch_norm_op.cc and Grappler's remapper.cc:
            # inference _FusedBatchNormEx is a custom CUDA kernel (float, half; NHWC/NCHW);
            # training goes through cuDNN (half, NHWC, channels % 4) and needs the backward as
            # _FusedBatchNormGradEx, which tfmx does not emit yet.
            BatchNormKernels(
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
        )),
    )


def metal_kernels() -> frozenset[str]:
    """Op names with a kernel in tensorflow-metal 1.2.0 (shipped list)."""
    text = resources.files("tfmx").joinpath("data/tensorflow-metal-1.2.0-ops.txt").read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.strip())


def _metal() -> Backend:
    from fusion.patterns.batch_norm_kernels import BatchNormKernels
    from fusion.patterns.contraction import ContractionKernels
    from fusion.stages.rnn import RnnKernels

    chains = _chains(*_with_acts(("BiasAdd",), _ACTS_BASIC))
    by_dtype = {dt: chains for dt in ("float32", "float16", "bfloat16")}
    return Backend(
        name="metal",
        description="Apple tensorflow-metal 1.2.0 (PluggableDevice GPU)",
        device_type="GPU",
        kernels=metal_kernels(),
        notes=(
            "conv fused computations per the plugin: biasAdd, biasAddWith{Relu,Relu6,Elu,"
            "LeakyRelu}; no residual Add, no _FusedDepthwiseConv2dNative kernel",
            "GeluExact/GeluApproximate appear beside _FusedMatMul in the plugin's strings but "
            "cannot be confirmed without a Mac: not emitted",
        ),
        capabilities=(ContractionKernels({"Conv2D": by_dtype, "MatMul": dict(by_dtype)},
                                         {"Conv2D": frozenset({"NHWC", "NCHW"})}),
                      RnnKernels("cudnn"),
        # The plugin registers FusedBatchNorm{,V2,V3}, their grads and _FusedBatchNormEx; its
        # messages say the side-input + activation form wants half, NHWC and channels % 4.
                      BatchNormKernels(
            dtypes=frozenset({"float32", "float16", "bfloat16"}),
            data_formats=frozenset({"NHWC", "NCHW"}),
            ex_inference_dtypes=frozenset({"float16"}),
            ex_data_formats=frozenset({"NHWC"}),
            ex_channel_multiple=4,
            ex_reason="training needs the backward as _FusedBatchNormGradEx, which the plugin "
                      "does not register",
        )),
    )


ONEDNN_OFF_ADVICE = (
    "oneDNN's pass is off in this process: stock with TF_ENABLE_ONEDNN_OPTS=1 (set before "
    "TensorFlow is imported) may train faster than tfmx without it (on one Zen 3, 1.3-1.7 x "
    "faster on CNNs, MLPs and RNNs); `tfmx bench --model ... --onednn both` measures both "
    "states here")
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
