"""Whether XLA can compile a traced step: every op in it has an XLA kernel for the device.

The whole-step guard tries the step compiled by XLA (``jit_compile=True``) as a third form. XLA
compiles a function on its first call, after Keras's loop has taken that call's batch from the
iterator: a step XLA cannot compile would fail then, and that batch would be lost to training.
Most such failures are ops XLA has no kernel for (string ops, ``tf.py_function``, sparse and
ragged ops, some custom kernels). :func:`missing_kernels` finds them in the traced function
(its function library included) before it runs, from TensorFlow's own kernel registry, and
:func:`check_compilable` raises :class:`XlaUnsupportedError` while the loop is still being
traced, so the guard drops XLA's form with no batch taken.

XLA registers its kernels in TensorFlow's registry on its first compile; :func:`missing_kernels`
compiles a one-op function once per process to make sure they are there.

Example:
    >>> import tensorflow as tf
    >>> from tfmx.xla_support import missing_kernels
    >>> f = tf.function(lambda x: tf.strings.length(tf.strings.as_string(x)) + 1)
    >>> missing_kernels(f.get_concrete_function(tf.TensorSpec([3])))
    ['AsString', 'StringLength']
    >>> missing_kernels(tf.function(lambda x: x * 2).get_concrete_function(tf.TensorSpec([3])))
    []
"""

from __future__ import annotations

import functools
from typing import Any

DEVICE_TYPES = {"cpu": "XLA_CPU_JIT", "cuda": "XLA_GPU_JIT"}
"""The XLA device type whose kernels a backend's compiled step needs."""

STRUCTURAL = frozenset({"Placeholder", "Const", "Identity", "IdentityN", "NoOp", "_Arg",
                        "_Retval", "PartitionedCall", "StatefulPartitionedCall"})
"""Ops XLA compiles without a kernel of their own: arguments, results, constants, calls of
functions (whose bodies are checked)."""


class XlaUnsupportedError(RuntimeError):
    """A step has ops XLA has no kernel for: its XLA form cannot be compiled."""


@functools.cache
def _registered() -> bool:
    """Compile one tiny function, so XLA's kernels are in TensorFlow's registry."""
    import tensorflow as tf

    tf.function(lambda x: x + 1.0, jit_compile=True)(tf.constant(0.0))
    return True


def missing_kernels(concrete: Any, device_type: str = "XLA_CPU_JIT") -> list[str]:
    """The op types of ``concrete`` (a ConcreteFunction, its function library included) with
    no ``device_type`` kernel registered, sorted; [] when XLA can take every op."""
    from tensorflow.python.framework import kernels

    _registered()
    graph_def = concrete.graph.as_graph_def()
    functions = {f.signature.name for f in graph_def.library.function}
    ops = {n.op for n in graph_def.node}
    for f in graph_def.library.function:
        ops.update(n.op for n in f.node_def)
    missing = []
    for op in sorted(ops - STRUCTURAL - functions):
        devices = {k.device_type for k in kernels.get_registered_kernels_for_op(op).kernel}
        if device_type not in devices:
            missing.append(op)
    return missing


def check_compilable(concrete: Any, backend: str) -> None:
    """Raise :class:`XlaUnsupportedError` naming the ops of ``concrete`` XLA has no kernel for
    on ``backend`` ("cpu" or "cuda"; other backends are not checked).

    >>> import tensorflow as tf
    >>> f = tf.function(lambda x: tf.strings.as_string(x))
    >>> check_compilable(f.get_concrete_function(tf.TensorSpec([3])), "cpu")
    Traceback (most recent call last):
    ...
    tfmx.xla_support.XlaUnsupportedError: XLA has no XLA_CPU_JIT kernel for AsString
    """
    device_type = DEVICE_TYPES.get(backend)
    if device_type is None:
        return
    missing = missing_kernels(concrete, device_type)
    if missing:
        raise XlaUnsupportedError(f"XLA has no {device_type} kernel for {', '.join(missing)}")


__all__ = ["DEVICE_TYPES", "STRUCTURAL", "XlaUnsupportedError", "check_compilable",
           "missing_kernels"]
