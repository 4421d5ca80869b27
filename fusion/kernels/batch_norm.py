"""What a backend runs of the batch-norm kernels: ``FusedBatchNormV3`` (and its gradient) and
``_FusedBatchNormEx``, as the batch_norm family and the stages that emit those kernels read it
(``target.capability(BatchNormKernels)``, declared per platform by the family:
:func:`fusion.graphs.batch_norm.batch_norm_kernels`).

Example:
    >>> from fusion.kernels.batch_norm import kernel_blocker
    >>> from tfmx.backends import get_backend
    >>> kernel_blocker(get_backend("cpu"), "FusedBatchNormV3", "float32", "NHWC") is None
    True
"""

from __future__ import annotations

import dataclasses
import os

from fusion.pattern import Target


@dataclasses.dataclass(frozen=True)
class BatchNormKernels:
    """What a backend declares for this family: what it runs of ``FusedBatchNormV3`` (and its
    gradient) and ``_FusedBatchNormEx``.

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

    def describe(self) -> dict:
        """What a backend's description prints of it.

        >>> shown = BatchNormKernels(frozenset({"float32"}), frozenset({"NHWC"})).describe()
        >>> shown["batch_norm"]["FusedBatchNormV3"], shown["batch_norm"]["_FusedBatchNormEx"]
        (['float32'], {'inference': [], 'training': []})
        """
        return {"batch_norm": {
            "FusedBatchNormV3": sorted(self.dtypes),
            "data_formats": sorted(self.data_formats),
            "_FusedBatchNormEx": {
                "inference": sorted(self.ex_inference_dtypes),
                "training": sorted(self.ex_training_dtypes),
            },
        }}

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


def kernel_blocker(target: Target, op: str, dtype: str, data_format: str,
                   is_training: bool = True, channels: int | None = None,
                   epsilon: float | None = None) -> str | None:
    """Why ``target`` cannot run batch-norm kernel ``op`` so configured, or None."""
    kernels = target.capability(BatchNormKernels)
    if kernels is None or not target.runs_op(op):
        return f"{target.name} runs no {op}"
    why = kernels.blocker(op, dtype, data_format, is_training, channels, epsilon)
    return None if why is None else f"{target.name}: {why}"

LOW_PRECISION = ("float16", "bfloat16")
