"""Pattern families, one module each; importing this package registers them in pipeline order.

>>> import fusion.patterns
>>> from fusion.pattern import registered
>>> list(registered())[:1]
['contraction']
"""

# The import order is the pipeline order.
# isort: off
from fusion.patterns import (
    contraction,  # noqa: F401  (registers "contraction")
    conv_bn_fold,  # noqa: F401  (registers "conv_bn_fold")
    optimizer_update,  # noqa: F401  (registers "optimizer_update")
    rnn,  # noqa: F401  (registers "rnn")
)

# Then: inference batch norms that conv_bn_fold did not fold into a convolution.
from fusion.patterns import batch_norm  # noqa: F401  (registers "batch_norm")
from fusion.patterns import casts  # noqa: F401  (registers "casts"; runs after the others)

# Then: what the fused graph still computes twice (reads of a variable, Keras's per-variable
# optimizer scalars) is computed once.
from fusion.patterns import dedupe  # noqa: F401  (registers "dedupe")

# Last: what is still a plain convolution goes to oneDNN's kernel where the backend says so.
from fusion.patterns import onednn  # noqa: F401  (registers "onednn")

# isort: on
