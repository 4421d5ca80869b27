"""policies: mixed precision for Keras 3 that is safe by default and chooses by measurement.

    import policies
    policies.set_global("auto")   # before building the model; says what it chose and why
    model = build_model()
    model.compile(...)            # output/softmax/normalization in float32; loss scaling if fp16
    print(policies.audit(model))  # per layer: compute/variable dtype, where casts sit

"auto" picks for the hardware (:mod:`policies.hardware_choice`) and, where it picks 16 bit,
keeps float32 in the layers where 16 bit measures slower (:func:`tune`). Keras's own switch is
``keras.mixed_precision.set_global_policy``; the holes this closes are listed in
:mod:`policies.safety` and :mod:`policies.hook`.

Modules (every public name is re-exported here; none is named as a module):

- :mod:`policies.global_policy`: ``set_global``, ``scope``, ``resolve``, ``explain``, ``reset``;
  :mod:`policies.state`: what they share (``current``, ``hardware``, ``stale_layers``);
- :mod:`policies.hardware_choice`: what 16-bit hardware the machine has (``detect``) and the
  policy "auto" picks for it (``choose``);
- :mod:`policies.safety`: what stays float32, loss scaling; :mod:`policies.hook`: the compile
  hook that applies it;
- :mod:`policies.layer_tuning`: ``tune``, per-layer precision by measurement;
- :mod:`policies.dtype_audit`: ``audit`` and ``check``, per-layer dtypes and casts;
- :mod:`policies.model_probe`: running a model's layers on sample inputs, recording their calls
  (what tuning and the audit share);
- :mod:`policies.layers`, :mod:`policies.names`, :mod:`policies.errors`: layer and policy-name
  helpers, and the warning and error classes.

Example:
    >>> import keras, policies
    >>> policies.POLICY_NAMES
    ('float32', 'mixed_float16', 'mixed_bfloat16', 'auto')
    >>> with policies.scope("mixed_bfloat16"):
    ...     model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8),
    ...                               keras.layers.Dense(3, activation="softmax")])
    ...     model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    >>> [layer.compute_dtype for layer in model.layers]  # the output stays float32
    ['bfloat16', 'float32']
"""

from __future__ import annotations

from typing import Any

from policies import hook, layers, model_probe, names
from policies.dtype_audit import Audit, LayerAudit, audit, check
from policies.errors import LayerDtypeError, PolicyWarning
from policies.global_policy import explain, reset, resolve, scope, set_global
from policies.hardware_choice import Choice, Hardware, choose, detect
from policies.layer_tuning import LayerChoice, TuneResult, tune
from policies.names import POLICY_NAMES
from policies.safety import make_safe
from policies.state import current, hardware, stale_layers


def apply(model: Any, name: str | None = None, *, safe: bool = True,
          sample_batch: Any = None) -> list[str]:
    """Switch the layers of an already built ``model`` to policy ``name`` (default: current).

    The fix for "the policy was set after the model was built": mixed policies keep float32
    variables, so the built weights are kept and only the compute dtype changes. Then the safe
    defaults are applied (``safe=True``) and every layer is checked; a layer that breaks under
    the policy raises :class:`LayerDtypeError` naming it, and the model is left as it was
    (the check runs on ``sample_batch``, or on a random batch when the model's input shapes are
    known; otherwise it is skipped). Returns the names of the layers that changed.

    >>> import keras, policies
    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="h"),
    ...                           keras.layers.Dense(2, name="o")])
    >>> policies.apply(model, "mixed_bfloat16")
    ['h']
    >>> model.layers[0].compute_dtype, model.layers[1].compute_dtype
    ('bfloat16', 'float32')
    """
    target = resolve(names.check_name(name)).policy if name is not None else current()
    hook.install()
    built = list(layers.iter_layers(model))
    saved = [layer.dtype_policy for layer in built]
    try:
        for layer in built:
            if layer.dtype_policy.name != target:
                layers.set_policy(layer, target)
        if safe:
            make_safe(model)
        if sample_batch is None:
            try:
                sample_batch = model_probe.sample_inputs(model, batch_size=2)
            except ValueError:
                sample_batch = None  # shapes unknown: nothing to run the check on
        if sample_batch is not None:
            check(model, sample_batch)
    except Exception:
        for layer, policy in zip(built, saved):
            layer._dtype_policy = policy
        raise
    model_probe.reset_step_functions(model)
    return [layer.name for layer, old in zip(built, saved)
            if layer.dtype_policy.name != old.name]


__all__ = [
    "POLICY_NAMES",
    "Audit",
    "Choice",
    "Hardware",
    "LayerAudit",
    "LayerChoice",
    "LayerDtypeError",
    "PolicyWarning",
    "TuneResult",
    "apply",
    "audit",
    "check",
    "choose",
    "current",
    "detect",
    "explain",
    "hardware",
    "make_safe",
    "reset",
    "resolve",
    "scope",
    "set_global",
    "stale_layers",
    "tune",
]
