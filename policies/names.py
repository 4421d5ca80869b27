"""Policy names: the four ``policies.set_global`` accepts, and what each computes in.

Example:
    >>> from policies.names import check_name, compute_dtype
    >>> check_name("mixed_bfloat16"), compute_dtype("mixed_bfloat16")
    ('mixed_bfloat16', 'bfloat16')
    >>> check_name("fp16")
    Traceback (most recent call last):
    ...
    ValueError: unknown policy 'fp16'; choose one of 'float32', ... (did you mean 'mixed_float16'?)
"""

from __future__ import annotations

POLICY_NAMES: tuple[str, ...] = ("float32", "mixed_float16", "mixed_bfloat16", "auto")
"""What ``set_global`` / ``scope`` accept, in this order."""

SIXTEEN_BIT: dict[str, str] = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}
"""Mixed policies and the 16-bit dtype they compute in (variables stay float32)."""

_HINTS = {
    "float16": "mixed_float16", "fp16": "mixed_float16", "half": "mixed_float16",
    "bfloat16": "mixed_bfloat16", "bf16": "mixed_bfloat16", "mixed_bf16": "mixed_bfloat16",
    "mixed_fp16": "mixed_float16", "fp32": "float32", "float": "float32",
}


def check_name(name: object) -> str:
    """Return ``name`` if it is one of :data:`POLICY_NAMES`, else raise ValueError listing them.

    Pure 16-bit names ("float16", "bfloat16") are refused: they keep the variables in 16 bit
    too, which loses small updates; the hint names the mixed policy to use instead.

    >>> check_name("auto")
    'auto'
    """
    if isinstance(name, str) and name in POLICY_NAMES:
        return name
    choices = ", ".join(repr(n) for n in POLICY_NAMES)
    hint = _HINTS.get(name.lower()) if isinstance(name, str) else None
    extra = f" (did you mean {hint!r}?)" if hint else ""
    raise ValueError(f"unknown policy {name!r}; choose one of {choices}{extra}")


def compute_dtype(name: str) -> str:
    """The dtype layers compute in under policy ``name`` ("float32" for float32).

    >>> compute_dtype("float32")
    'float32'
    """
    return SIXTEEN_BIT.get(name, "float32")


def is_16bit(name: str) -> bool:
    """True for the mixed policies.

    >>> is_16bit("mixed_float16"), is_16bit("float32")
    (True, False)
    """
    return name in SIXTEEN_BIT
