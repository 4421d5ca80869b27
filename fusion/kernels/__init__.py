"""The fused forms' kernels, imported by both wings of ``fusion``: the stages of
``fusion.calls`` and the graph passes of ``fusion.graphs`` (neither imports the other).

- :mod:`fusion.kernels.activations`: SiLU and GELU (exact, tanh) with their derivatives in
  closed form from what the forward kept;
- :mod:`fusion.kernels.batch_norm`: what a backend's ``FusedBatchNormV3`` /
  ``_FusedBatchNormEx`` kernels take, and why a call cannot use them;
- :mod:`fusion.kernels.layer_norm`: layer norm through ``FusedBatchNormV3``, in closed form,
  through oneDNN's ``_MklLayerNorm``;
- :mod:`fusion.kernels.rnn_cells` and :mod:`fusion.kernels.rnn`: Keras's LSTM / GRU cells
  and whole sequences (the CPU loop with the input projection hoisted, cuDNN's layout).

Importing this package declares no family.

>>> from fusion.kernels import rnn
>>> rnn.CHUNKS > 0
True
"""
