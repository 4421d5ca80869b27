"""The built-in families' graph passes, one module each (a family's pass may import parts of
itself from a module of its own, as batch_norm from batch_norm_ex); importing this package
imports every module in it, which declares its family's pass (``fusion.family.register``).

Each pass says which families it runs after and why; ``fusion.family.families()`` orders the
pipeline from those declarations.

>>> from fusion.family import families
>>> [f.name for f in families()][-1]
'onednn'
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):  # each module declares its family's pass
    importlib.import_module(f"{__name__}.{_module.name}")
