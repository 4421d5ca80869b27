"""What 16-bit hardware this machine has, and which policy "auto" picks for it.

:func:`detect` describes the machine (``/proc/cpuinfo`` flags, Apple GPU, CUDA compute
capability) from what :mod:`tfmx.machine` reads;
:func:`choose` is a pure function from a :class:`Hardware` description to a :class:`Choice`
(policy and the reason), so every rule is testable on any machine.

Rules ("auto"):

- CUDA GPU, compute capability >= 8.0 (Ampere and later): ``mixed_bfloat16`` (tensor cores run
  bfloat16; no loss scaling needed). 7.x (Volta, Turing): ``mixed_float16`` (tensor cores run
  float16 only; dynamic loss scaling is added). Below 7.0: ``float32`` (no tensor cores).
- Apple GPU (tensorflow-metal): ``mixed_float16``; the GPU runs float16 natively, bfloat16 only
  from macOS 14 and not faster.
- CPU with ``amx_bf16`` or ``avx512_bf16``: ``mixed_bfloat16`` (refined per layer by measurement,
  see :func:`policies.tune`). Any other CPU: ``float32`` (16-bit math is converted in software
  and runs slower than float32).

Example:
    >>> from policies.hardware_choice import Hardware, choose
    >>> choose(Hardware(cpu_name="Xeon", cpu_flags=frozenset({"avx512f", "amx_bf16"}))).policy
    'mixed_bfloat16'
    >>> print(choose(Hardware(cpu_name="AMD EPYC", cpu_flags=frozenset({"avx2", "f16c"}))).reason)
    CPU AMD EPYC has no bfloat16 or float16 matrix instructions (...): 16-bit math would be ...
    >>> choose(Hardware(cuda_capabilities=((7, 5),))).policy
    'mixed_float16'
"""

from __future__ import annotations

import dataclasses

from tfmx import machine

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
FP16_CPU_FLAGS = ("amx_fp16", "avx512_fp16")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The parts of a machine that decide whether 16-bit compute pays."""

    cpu_name: str = "unknown CPU"
    cpu_flags: frozenset[str] = frozenset()
    apple_gpu: bool = False
    macos_version: tuple[int, ...] | None = None
    cuda_capabilities: tuple[tuple[int, int], ...] = ()

    @property
    def cpu_bf16(self) -> bool:
        """The CPU has bfloat16 matrix instructions (AMX or AVX512_BF16)."""
        return any(f in self.cpu_flags for f in BF16_CPU_FLAGS)

    @property
    def cpu_fp16(self) -> bool:
        """The CPU has float16 arithmetic instructions (AMX-FP16 or AVX512-FP16)."""
        return any(f in self.cpu_flags for f in FP16_CPU_FLAGS)

    @property
    def gpu(self) -> bool:
        """A GPU TensorFlow can use (CUDA or Apple)."""
        return self.apple_gpu or bool(self.cuda_capabilities)

    def describe(self) -> str:
        """One line: the device the choice is made for.

        >>> Hardware(cuda_capabilities=((8, 0), (8, 0))).describe()
        '2 CUDA GPU(s), compute capability 8.0'
        """
        if self.cuda_capabilities:
            low = min(self.cuda_capabilities)
            return (f"{len(self.cuda_capabilities)} CUDA GPU(s), compute capability "
                    f"{low[0]}.{low[1]}")
        if self.apple_gpu:
            ver = ".".join(map(str, self.macos_version)) if self.macos_version else "?"
            return f"Apple GPU (macOS {ver})"
        flags = [f for f in (*BF16_CPU_FLAGS, *FP16_CPU_FLAGS) if f in self.cpu_flags]
        return f"CPU {self.cpu_name} ({', '.join(flags) if flags else 'no 16-bit matrix flags'})"


@dataclasses.dataclass(frozen=True)
class Choice:
    """What a policy name resolved to, and why."""

    requested: str
    policy: str
    reason: str
    hardware: str = ""

    def __str__(self) -> str:
        head = (f"policies: {self.requested!r} chose {self.policy!r}"
                if self.requested != self.policy else f"policies: {self.policy!r}")
        return f"{head}: {self.reason}"


def detect(cpuinfo_path: str = "/proc/cpuinfo") -> Hardware:
    """Describe this machine.

    >>> isinstance(detect().cpu_flags, frozenset)
    True
    """
    name, flags = machine.read_cpuinfo(cpuinfo_path)
    apple, macos = machine.apple_gpu()
    cuda = () if apple else machine.cuda_capabilities()
    return Hardware(cpu_name=name, cpu_flags=flags, apple_gpu=apple, macos_version=macos,
                    cuda_capabilities=cuda)


def choose(hw: Hardware) -> Choice:
    """The policy "auto" picks for ``hw``, with the reason (see the module's rules).

    >>> choice = choose(Hardware(cuda_capabilities=((8, 6),)))
    >>> choice.policy, choice.hardware
    ('mixed_bfloat16', '1 CUDA GPU(s), compute capability 8.6')
    """
    where = hw.describe()
    if hw.cuda_capabilities:
        major, minor = min(hw.cuda_capabilities)
        if major >= 8:
            return Choice("auto", "mixed_bfloat16", f"CUDA compute capability {major}.{minor} "
                          ">= 8.0 runs bfloat16 on tensor cores (no loss scaling needed)", where)
        if major >= 7:
            return Choice("auto", "mixed_float16", f"CUDA compute capability {major}.{minor} "
                          "runs float16 (not bfloat16) on tensor cores; dynamic loss scaling "
                          "is added", where)
        return Choice("auto", "float32", f"CUDA compute capability {major}.{minor} < 7.0 has "
                      "no tensor cores: 16-bit does not pay", where)
    if hw.apple_gpu:
        return Choice("auto", "mixed_float16", "Apple GPUs run float16 natively (bfloat16 only "
                      "from macOS 14, and not faster); dynamic loss scaling is added", where)
    if hw.cpu_bf16:
        flags = ", ".join(f for f in BF16_CPU_FLAGS if f in hw.cpu_flags)
        return Choice("auto", "mixed_bfloat16", f"CPU {hw.cpu_name} has bfloat16 matrix "
                      f"instructions ({flags}); layers where bfloat16 measures slower are kept "
                      "in float32 (policies.tune)", where)
    return Choice("auto", "float32", f"CPU {hw.cpu_name} has no bfloat16 or float16 matrix "
                  f"instructions (no {', '.join(BF16_CPU_FLAGS + FP16_CPU_FLAGS)} flags): 16-bit "
                  "math would be converted in software and run slower than float32", where)
