"""The built-in families' stages, one module each: rewrites made before differentiation
(``fusion.stage``). Importing this package imports every module in it, which declares its
family (``fusion.family.declare``) with its hooks and, where its units are only observed in
the traced graph, how (``fusion.family.Forms``).

Every stage module reads in one order, under the same four headings: ``match`` (``MATCHES``,
the Keras calls it hooks as ``"module:Class.method"``, and what it finds in them), ``check``
(``check``: the reason a call keeps Keras's own form, or None), ``forms`` (``CONSERVATIVE``,
the form Keras runs, then the forms it emits, each a ``fusion.family.Form`` record with its
report label, marks and ops, held in ``FORMS``, and the hook's flow: a
``fusion.stage.CallSite`` through ``fusion.stage.rewrite_call``), ``declaration``
(``DECLARED``). The kernels a family emits live in ``fusion.kernels`` (imported by stages and
graph passes alike); a stage's helper too large for its module lives beside it
(``rnn_wavefront``) and declares nothing.

>>> from fusion.stage import stages
>>> names = {s.name for s in stages()}  # each module's family, with its hooks
>>> {"attention", "batch_norm", "gelu", "layer_norm", "rnn"} <= names
True
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):  # each module declares its family
    importlib.import_module(f"{__name__}.{_module.name}")
