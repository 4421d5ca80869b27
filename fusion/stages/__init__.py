"""Stage families, one module each: rewrites made before differentiation (``fusion.stage``).

Importing this package registers them. ``fusion/patterns/`` keeps the GraphDef passes; a stage
family whose rewrite reaches the traced graph has a pass of the same name there that observes
and reports it.

>>> from fusion.stage import stages
>>> sorted(s.name for s in stages())  # doctest: +NORMALIZE_WHITESPACE
['attention', 'batch_norm', 'bias_row', 'einsum_dense', 'feed_forward', 'gelu',
 'layer_norm', 'rnn']
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):  # each stage module registers its stage
    importlib.import_module(f"{__name__}.{_module.name}")
