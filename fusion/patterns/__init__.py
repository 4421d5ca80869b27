"""Pattern families, one module each; importing this package registers them in pipeline order.

>>> import fusion.patterns
>>> from fusion.pattern import registered
>>> list(registered())[:1]
['contraction']
"""

from fusion.patterns import (
    contraction,  # noqa: F401  (registers "contraction")
    conv_bn_fold,  # noqa: F401  (registers "conv_bn_fold")
    rnn,  # noqa: F401  (registers "rnn")
)
