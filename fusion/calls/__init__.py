"""The built-in families' stages, one module each: rewrites made before differentiation
(``fusion.stage``). Importing this package imports every module in it, which declares its
family (``fusion.family.declare``) with its hooks and, where its units are only observed in
the traced graph, how (``fusion.family.Forms``).

>>> from fusion.stage import stages
>>> sorted(s.name for s in stages())  # doctest: +NORMALIZE_WHITESPACE
['attention', 'batch_norm', 'bias_row', 'einsum_dense', 'feed_forward', 'gelu',
 'layer_norm', 'rnn']
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):  # each module declares its family
    importlib.import_module(f"{__name__}.{_module.name}")
