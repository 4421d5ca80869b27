"""Pattern families, one module each; importing this package imports every module in it,
which registers its family (a new family is a new module here, nothing else to edit).

The order they run in is data, :data:`PIPELINE_ORDER`, with the reason for each place;
``fusion.pattern.registered()`` returns the families in that order (a family registered
elsewhere, e.g. by a test, runs after them).

>>> import fusion.patterns
>>> from fusion.pattern import registered
>>> list(registered())[:2]
['reshaped_bias', 'contraction']
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):  # each module registers its family
    importlib.import_module(f"{__name__}.{_module.name}")

PIPELINE_ORDER: tuple[str, ...] = (
    # A bias added after a MatMul's reshape (Keras Dense on rank > 2) moved ahead of it: makes
    # MatMul + BiasAdd chains for contraction.
    "reshaped_bias",
    # Conv/MatMul + BiasAdd (+ Add) (+ activation) first: the chains the others must not split.
    "contraction",
    # Inference Conv + batch norm: reads the Conv2D that contraction left unfused (no BiasAdd).
    "conv_bn_fold",
    # Optimizer updates: independent of the forward chains.
    "optimizer_update",
    # Report what the rnn, layer_norm, gelu, feed_forward, attention, einsum_dense and
    # bias_row stages emitted while tracing (checks; einsum_dense's MatMuls may already be
    # fused with their bias by contraction).
    "rnn",
    "layer_norm",
    "gelu",
    "feed_forward",
    "attention",
    "einsum_dense",
    "bias_row",
    # Inference batch norms that conv_bn_fold did not fold into a convolution.
    "batch_norm",
    # Cast round trips and identity casts, after the others produced their final dtypes.
    "casts",
    # Bias gradients as MatMuls of ones where measured faster: their row of ones is a Const
    # that dedupe shares between the gradients of one shape.
    "bias_grad",
    # A transpose_b MatMul (an input gradient dy @ w^T) reading its operand transposed once
    # where measured faster: after the families that write MatMuls, before dedupe (which
    # shares the transposition of a weight read twice).
    "matmul_layout",
    # What the fused graph still computes twice (variable reads, Keras's per-variable
    # optimizer scalars) is computed once: after every family that removes or adds nodes.
    "dedupe",
    # Last: what is still a plain convolution, MatMul or batch norm goes to oneDNN's kernel
    # where the backend says so (the fused nodes above are its inputs).
    "onednn",
)
"""The pipeline: the families' run order, each placed for the reason beside it."""
