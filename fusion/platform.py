"""The target a backend is built for, as the families read it to say what they run there.

Each family that must know something of a backend declares a function from a
:class:`Platform` to its own small dataclass (``Family.capability``, :mod:`fusion.family`);
``tfmx.backends`` builds one :class:`Platform` per backend it makes and asks every family.

Example:
    >>> from fusion.platform import Platform
    >>> cpu = Platform("cpu", onednn=False)
    >>> cpu.apple_metal, cpu.runs_op("Conv2D")
    (False, True)
    >>> from tfmx.metal_plugins import plugin_table
    >>> table = plugin_table("tensorflow-metal-plugin", "0.4.1")
    >>> metal = Platform("metal", table=table, tensorflow="2.21.0",
    ...                  kernels=frozenset(table.ops) - table.host_only("2.21.0"))
    >>> sorted(metal.dtypes("MatMul", "_FusedMatMul")), metal.dtypes("ResourceApplyAdam")
    (['float16', 'float32'], frozenset())
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

APPLE_METAL = "tensorflow-metal"
"""The distribution of Apple's closed Metal plugin (``tfmx.metal_plugins.APPLE``): its table
says no dtypes, so the families declare what they run there by hand, from its symbols."""

METAL_FLOATS = frozenset({"float32", "float16"})
"""The dtypes :meth:`Platform.dtypes` considers on a Metal plugin's table."""


class PluginTable(Protocol):
    """What a family reads of a Metal plugin's table (``tfmx.metal_plugins.PluginTable``)."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def ops(self) -> Mapping[str, frozenset[str]]:
        """op -> the dtypes of its value type (empty: any, or not known)."""
        ...

    @property
    def fused_ops(self) -> Mapping[str, frozenset[tuple[str, ...]]]:
        """``_Fused<op>`` -> the ``fused_ops`` lists its kernel takes."""
        ...


@dataclasses.dataclass(frozen=True)
class Platform:
    """One target a backend is built for: its ``name`` (``cpu``, ``cuda``, ``metal``); for
    cpu, whether TensorFlow's oneDNN pass is on (``onednn``); for metal, the plugin's
    ``table`` and the TensorFlow version planned for (``tensorflow``; None where the plugin's
    declarations do not depend on it); and the ops with a kernel there (``kernels``; None:
    every registered TensorFlow op).

    >>> Platform("metal", kernels=frozenset({"MatMul"})).runs_op("Conv2D")
    False
    """

    name: str
    onednn: bool = False
    table: PluginTable | None = None
    tensorflow: str | None = None
    kernels: frozenset[str] | None = None

    @property
    def apple_metal(self) -> bool:
        """True on Apple's tensorflow-metal (:data:`APPLE_METAL`)."""
        return self.table is not None and self.table.name == APPLE_METAL

    def runs_op(self, op: str) -> bool:
        """True if ``op`` has a kernel here."""
        return self.kernels is None or op in self.kernels

    def places(self, emits: frozenset[str], dtype: str | None = None,
               any_dtype: frozenset[str] = frozenset({"Cast"})) -> bool:
        """True where every op a form ``emits`` (``Op`` or ``Op:dtype``, a :class:`Form`'s
        ``emits``) has a kernel here and, with a plugin table, a float kernel they share:
        ``dtype`` among them where given, else either float; the ops of ``any_dtype`` are not
        held to the shared dtype.

        >>> Platform("metal", kernels=frozenset({"Rsqrt"})).places(frozenset({"Rsqrt", "Mul"}))
        False
        >>> Platform("metal").places(frozenset({"Rsqrt", "Mul:float32"}), "float32")
        True
        """
        ops = {op.partition(":")[0] for op in emits}
        if not all(self.runs_op(op) for op in ops):
            return False
        if self.table is None:
            return True
        shared = self.dtypes(*(ops - any_dtype))
        return dtype in shared if dtype else bool(shared)

    def dtypes(self, *ops: str) -> frozenset[str]:
        """The float32/float16 dtypes every one of ``ops`` has a kernel in (empty if one has
        none here); an op registered with its value type unconstrained takes both.

        >>> Platform("cuda").dtypes("MatMul")
        frozenset()
        """
        if self.table is None:
            return frozenset()
        found = set(METAL_FLOATS)
        for op in ops:
            if not self.runs_op(op):
                return frozenset()
            found &= self.table.ops[op] or METAL_FLOATS
        return frozenset(found)
