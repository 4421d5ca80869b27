"""Errors tfmx raises, each saying what to do.

>>> from tfmx.errors import BackendUnavailableError
>>> issubclass(BackendUnavailableError, RuntimeError)
True
"""


class TfmxWarning(UserWarning):
    """A rewrite was skipped or undone; training goes on with the stock graph for that part."""


class BackendUnavailableError(RuntimeError):
    """The graph was rewritten for a backend this machine does not have (a plan, not a run)."""


class VerificationError(AssertionError):
    """``enable(verify=True)`` found the fused step and the stock step disagree.

    The variables were restored to their values before the step, so nothing was lost.
    """


class UnknownKerasError(RuntimeError):
    """The installed Keras does not have what tfmx hooks where tfmx hooks it (a Keras version
    tfmx was not built for): ``tfmx.enable()`` warns and leaves Keras as it is."""
