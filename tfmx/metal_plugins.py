"""The Metal plugins tfmx knows, as data: the ops each registers and in which dtypes, the
``fused_ops`` lists its fused kernels take, and the ops a given TensorFlow keeps off it.

- ``tensorflow-metal`` 1.2.0, Apple's closed plugin (TensorFlow 2.18-2.19): its kernel names,
  the strings of three characters or more of its public wheel's ``libmetal_plugin.dylib`` that
  are TensorFlow 2.21 ops (``Mul``, ``Sub``, ``Sum`` among them; the two-letter ``If``, ``Lu``,
  ``Qr`` left out, too short to tell from chance), ship as
  ``tfmx/data/tensorflow-metal-1.2.0-ops.txt``. The wheel does not say which dtypes each kernel
  takes, so every op's set is empty (read: any); its fused lists are the conv computations its
  error strings name.
- ``tensorflow-metal-plugin`` 0.4.1, the open PluggableDevice built against TensorFlow 2.21:
  ``tools/metal_plugin_table.py`` reads its sdist's source (the kernel C API registrations with
  their type constraints, the fused kernels' attr parser, the graph pass, the ops registered
  only when TensorFlow exports the kernel C API for resource variables) into
  ``tfmx/data/tensorflow-metal-plugin-0.4.1.json``, with the sdist's SHA-256.

"Host only" means the plugin has no kernel of its own for the op under that TensorFlow: 2.20
and 2.21 export none of the entry points the plugin needs for resource variables
(tensorflow/tensorflow#126374, fixed for 2.22), so the optimizers' ``ResourceApply*`` ops and
the resource gathers and scatters run TensorFlow's own kernels (the CPU's, or for the few
TensorFlow registers for any device, such as ``AssignVariableOp``, its generic kernel, which
reaches device memory from the host).

Importing this module loads no TensorFlow; the tables are read from the package's data once.

>>> table = plugin_table("tensorflow-metal-plugin")
>>> table.version, table.tensorflow
('0.4.1', ('2.21', '2.21'))
>>> ("BiasAdd", "Relu") in table.fused_ops["_FusedMatMul"]
True
>>> table.runs("ResourceApplyAdam", "float32", tensorflow="2.21")
False
"""

from __future__ import annotations

import dataclasses
import functools
import json
import platform
import re
import types
from collections.abc import Iterable, Mapping
from importlib import metadata, resources

APPLE = "tensorflow-metal"
OPEN = "tensorflow-metal-plugin"
PLUGINS = (APPLE, OPEN)

_APPLE_FILE = re.compile(r"tensorflow-metal-(\d[\w.]*)-ops\.txt")
_OPEN_FILE = re.compile(r"tensorflow-metal-plugin-(\d[\w.]*)\.json")
# Apple 1.2.0: the conv fused computations its error text names (biasAdd, biasAddWith{Relu,
# Relu6,Elu,LeakyRelu}); tfmx's metal backend emits the same lists for _FusedMatMul.
_APPLE_CHAINS = (("BiasAdd",), ("BiasAdd", "Relu"), ("BiasAdd", "Relu6"), ("BiasAdd", "Elu"),
                 ("BiasAdd", "LeakyRelu"))
_APPLE_TENSORFLOW = {"1.2.0": ("2.18", "2.19")}


def _minor(version: str) -> tuple[int, int]:
    """``"2.21.0"``, ``"2.21"`` or ``"2.22.0-dev20260914"`` as ``(2, 21)``."""
    m = re.match(r"\s*(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"not a TensorFlow version: {version!r}")
    return int(m.group(1)), int(m.group(2))


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version))


def _frozen(mapping: Mapping) -> types.MappingProxyType:
    return types.MappingProxyType(dict(mapping))


@dataclasses.dataclass(frozen=True)
class PluginTable:
    """What one release of a Metal plugin registers. See :func:`plugin_table`.

    - ``tensorflow``: the lowest and highest TensorFlow (major.minor) it loads into;
    - ``source_sha256``: the digest of the sdist the table was read from (None for Apple's);
    - ``ops``: op -> the dtypes of its value type (empty: any, or not known);
    - ``fused_ops``: ``_FusedConv2D`` / ``_FusedMatMul`` -> the ``fused_ops`` lists their
      kernels take; ``graph_pass_fused_ops``: the lists the plugin's own graph pass emits;
    - ``host_only_before``: TensorFlow version -> the ops it leaves to TensorFlow's own kernels
      below that version (see :meth:`host_only`);
    - ``type_constraints``: op -> type attribute -> dtypes, every constraint it registers;
    - ``notes``: what the table's source says beside the lists.

    >>> apple = plugin_table("tensorflow-metal")
    >>> apple.tensorflow, apple.source_sha256
    (('2.18', '2.19'), None)
    >>> apple.runs("Conv2D", "float32"), apple.runs("Conv2D", tensorflow="2.21")
    (True, False)
    """

    name: str
    version: str
    tensorflow: tuple[str, str]
    source_sha256: str | None
    ops: Mapping[str, frozenset[str]] = dataclasses.field(compare=False, repr=False)
    fused_ops: Mapping[str, frozenset[tuple[str, ...]]] = dataclasses.field(
        compare=False, repr=False)
    host_only_before: Mapping[str, frozenset[str]] = dataclasses.field(
        compare=False, repr=False)
    type_constraints: Mapping[str, Mapping[str, frozenset[str]]] = dataclasses.field(
        compare=False, repr=False)
    graph_pass_fused_ops: Mapping[str, frozenset[tuple[str, ...]]] = dataclasses.field(
        compare=False, repr=False)
    notes: tuple[str, ...] = dataclasses.field(default=(), compare=False, repr=False)

    def loads_into(self, tensorflow: str) -> bool:
        """True if this release loads into TensorFlow ``tensorflow`` ("2.21", "2.21.0").

        >>> plugin_table("tensorflow-metal-plugin").loads_into("2.20.0")
        False
        """
        low, high = (_minor(v) for v in self.tensorflow)
        return low <= _minor(tensorflow) <= high

    def host_only(self, tensorflow: str) -> frozenset[str]:
        """The ops this release registers but not under TensorFlow ``tensorflow``.

        >>> table = plugin_table("tensorflow-metal-plugin")
        >>> {"ResourceApplyAdam", "ResourceGather"} <= table.host_only("2.21")
        True
        >>> table.host_only("2.22.0")
        frozenset()
        """
        below = _minor(tensorflow)
        return frozenset().union(*(ops for before, ops in self.host_only_before.items()
                                   if below < _minor(before)))

    def runs(self, op: str, dtype: str | None = None, tensorflow: str | None = None) -> bool:
        """True if this release has a kernel for ``op`` (in ``dtype``, under ``tensorflow``,
        where given). An op whose dtypes are not known runs in any.

        >>> table = plugin_table("tensorflow-metal-plugin")
        >>> table.runs("MatMul", "float16"), table.runs("MatMul", "bfloat16")
        (True, False)
        """
        if op not in self.ops or (dtype is not None and self.ops[op]
                                  and dtype not in self.ops[op]):
            return False
        return tensorflow is None or (self.loads_into(tensorflow)
                                      and op not in self.host_only(tensorflow))


@dataclasses.dataclass(frozen=True)
class InstalledPlugin:
    """A Metal plugin distribution installed here, and the TensorFlow beside it."""

    name: str
    version: str
    tensorflow: str | None

    def table(self) -> PluginTable:
        """Its :class:`PluginTable` (``LookupError`` for a release tfmx has no table of)."""
        return plugin_table(self.name, self.version)


def _data() -> list:
    return sorted(p.name for p in resources.files("tfmx").joinpath("data").iterdir())


def _versions(name: str) -> list[str]:
    pattern = _APPLE_FILE if name == APPLE else _OPEN_FILE
    found = [m.group(1) for f in _data() if (m := pattern.fullmatch(f))]
    return sorted(found, key=_release)


def _normalize(name: str) -> str:
    canonical = re.sub(r"[-_.]+", "-", name).lower()
    if canonical not in PLUGINS:
        raise ValueError(f"unknown Metal plugin {name!r}; choose one of {PLUGINS}")
    return canonical


def _chains(lists: Iterable[Iterable[str]]) -> frozenset[tuple[str, ...]]:
    return frozenset(tuple(chain) for chain in lists)


def _apple(version: str) -> PluginTable:
    text = resources.files("tfmx").joinpath(f"data/tensorflow-metal-{version}-ops.txt")
    ops = {line.strip(): frozenset() for line in text.read_text().splitlines() if line.strip()}
    chains = _chains(_APPLE_CHAINS)
    return PluginTable(
        name=APPLE, version=version, tensorflow=_APPLE_TENSORFLOW[version],
        source_sha256=None, ops=_frozen(ops),
        fused_ops=_frozen({"_FusedConv2D": chains, "_FusedMatMul": chains}),
        host_only_before=_frozen({}), type_constraints=_frozen({}),
        graph_pass_fused_ops=_frozen({}),
        notes=("closed source: op names from the strings of its wheel, dtypes not known",
               "fused lists: the conv computations its error text names; the same for "
               "_FusedMatMul is an assumption tfmx's metal backend makes"),
    )


def _open(version: str) -> PluginTable:
    path = resources.files("tfmx").joinpath(f"data/tensorflow-metal-plugin-{version}.json")
    data = json.loads(path.read_text())
    built = ".".join(map(str, _minor(data["tensorflow"])))
    return PluginTable(
        name=OPEN, version=data["version"], tensorflow=(built, built),
        source_sha256=data["source_sha256"],
        ops=_frozen({op: frozenset(d) for op, d in data["ops"].items()}),
        fused_ops=_frozen({op: _chains(v) for op, v in data["fused_ops"].items()}),
        host_only_before=_frozen({v: frozenset(ops)
                                  for v, ops in data["host_only_before"].items()}),
        type_constraints=_frozen({op: _frozen({a: frozenset(d) for a, d in c.items()})
                                  for op, c in data["type_constraints"].items()}),
        graph_pass_fused_ops=_frozen({op: _chains(v)
                                      for op, v in data["graph_pass_fused_ops"].items()}),
        notes=tuple(data["notes"]),
    )


def plugin_table(name: str, version: str | None = None) -> PluginTable:
    """The table of Metal plugin ``name`` (``"tensorflow-metal"`` or
    ``"tensorflow-metal-plugin"``) at ``version``; the newest tfmx ships when None.

    >>> sorted(plugin_table("tensorflow-metal-plugin").ops["_FusedConv2D"])
    ['float16', 'float32']
    >>> plugin_table("tensorflow-metal", "9.9")
    Traceback (most recent call last):
    ...
    LookupError: no table of tensorflow-metal 9.9; tfmx has ['1.2.0']
    """
    name = _normalize(name)
    versions = _versions(name)
    if version is None and versions:
        version = versions[-1]
    if version not in versions:
        raise LookupError(f"no table of {name} {version}; tfmx has {versions}")
    return _read(name, version)


@functools.cache
def _read(name: str, version: str) -> PluginTable:
    return _apple(version) if name == APPLE else _open(version)


def known_plugins() -> tuple[PluginTable, ...]:
    """Every table tfmx ships, Apple's first, oldest release first.

    >>> [(t.name, t.version) for t in known_plugins()]
    [('tensorflow-metal', '1.2.0'), ('tensorflow-metal-plugin', '0.4.1')]
    """
    return tuple(plugin_table(name, v) for name in PLUGINS for v in _versions(name))


def _installed(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def installed_plugin(system: str | None = None) -> InstalledPlugin | None:
    """The Metal plugin distribution installed in this environment, or None (always None off
    macOS; ``system`` stands for ``platform.system()``). Read from the installed packages'
    metadata: nothing is imported. With both installed, the one that loads into the installed
    TensorFlow, else the open plugin (the only one that loads into TensorFlow 2.20 and later).

    >>> installed_plugin(system="Linux") is None
    True
    """
    if (system or platform.system()) != "Darwin":
        return None
    tensorflow = _installed("tensorflow") or _installed("tensorflow-macos")
    found = [InstalledPlugin(name, v, tensorflow) for name in (OPEN, APPLE)
             if (v := _installed(name)) is not None]
    if len(found) > 1 and tensorflow is not None:
        for plugin in found:
            try:
                if plugin.table().loads_into(tensorflow):
                    return plugin
            except LookupError:
                continue
    return found[0] if found else None
