"""The built-in families' stages, one module each: rewrites made before differentiation
(``fusion.stage``). Importing this package imports every module in it, which declares its
family (``fusion.family.declare``) with its hooks and, where its units are only observed in
the traced graph, how (``fusion.family.Forms``).

Every stage module reads in one order, under the same four headings: ``match`` (``MATCHES``,
the Keras calls it hooks as ``"module:Class.method"``, and what it finds in them), ``check``
(``check``: the reason a call keeps Keras's own form, or None), ``forms`` (``CONSERVATIVE``,
the form Keras runs, then the forms it emits with their report labels and marks, and the
hook's flow through ``fusion.stage.rewrite_call``), ``declaration`` (``DECLARED``). Helpers
too large for one module live beside it (``layer_norm_kernels``, ``rnn_kernels``,
``rnn_wavefront``) and declare nothing.

>>> from fusion.stage import stages
>>> names = {s.name for s in stages()}  # each module's family, with its hooks
>>> {"attention", "batch_norm", "gelu", "layer_norm", "rnn"} <= names
True
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):  # each module declares its family
    importlib.import_module(f"{__name__}.{_module.name}")
