"""Warnings and errors ``policies`` raises, each saying what to do.

>>> from policies.errors import LayerDtypeError, PolicyWarning
>>> issubclass(PolicyWarning, UserWarning), issubclass(LayerDtypeError, TypeError)
(True, True)
"""


class PolicyWarning(UserWarning):
    """A policy choice that will be slow, or will not reach some layers."""


class LayerDtypeError(TypeError):
    """A layer fails under a 16-bit policy; the message names it and says how to fix it."""

    def __init__(self, layer_name: str, layer_class: str, policy: str, cause: BaseException):
        self.layer_name = layer_name
        self.layer_class = layer_class
        self.policy = policy
        self.cause = cause
        super().__init__(
            f"layer {layer_name!r} ({layer_class}) fails under policy {policy!r}: "
            f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause) else ''}"
            f"\nIts call probably mixes its 16-bit inputs with float32 tensors it makes itself. "
            f"Fix it by building that layer with dtype='float32' (it then casts its inputs), or "
            f"by creating its constants/tensors with dtype=self.compute_dtype."
        )
