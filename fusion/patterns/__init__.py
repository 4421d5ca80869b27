"""Pattern families, one module each; importing this package registers them.

The order they run in is data, :data:`PIPELINE_ORDER`, with the reason for each place;
``fusion.pattern.registered()`` returns the families in that order (a family registered
elsewhere, e.g. by a test, runs after them).

>>> import fusion.patterns
>>> from fusion.pattern import registered
>>> list(registered())[:1]
['contraction']
"""

from fusion.patterns import (  # noqa: F401  (each import registers its family)
    batch_norm,
    casts,
    contraction,
    conv_bn_fold,
    dedupe,
    onednn,
    optimizer_update,
    rnn,
)

PIPELINE_ORDER: tuple[str, ...] = (
    # Conv/MatMul + BiasAdd (+ Add) (+ activation) first: the chains the others must not split.
    "contraction",
    # Inference Conv + batch norm: reads the Conv2D that contraction left unfused (no BiasAdd).
    "conv_bn_fold",
    # Optimizer updates: independent of the forward chains.
    "optimizer_update",
    # Reports what the rnn stage emitted while tracing (a check, not a rewrite).
    "rnn",
    # Inference batch norms that conv_bn_fold did not fold into a convolution.
    "batch_norm",
    # Cast round trips and identity casts, after the others produced their final dtypes.
    "casts",
    # What the fused graph still computes twice (variable reads, Keras's per-variable
    # optimizer scalars) is computed once: after every family that removes or adds nodes.
    "dedupe",
    # Last: what is still a plain convolution, MatMul or batch norm goes to oneDNN's kernel
    # where the backend says so (the fused nodes above are its inputs).
    "onednn",
)
"""The pipeline: the families' run order, each placed for the reason beside it."""
