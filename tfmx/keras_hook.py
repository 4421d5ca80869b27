"""How ``tfmx.enable()`` reaches ``model.fit``, ``evaluate`` and ``predict`` of Keras 3.

Keras's TensorFlow trainer builds ``one_step_on_data`` (``strategy.run`` of
``self.train_step`` / ``self.test_step`` plus the cross-replica reduction) and wraps it in
``tf.function``; predict does the same around ``predict_step``. While Keras builds these, the
hook has its ``tf.function`` return a :class:`tfmx.fused_function.FusedFunction` for exactly those
step functions, so the whole per-batch step, every replica included, is traced, rewritten and
rebuilt, while Keras's own loops (steps_per_execution), distribution, callbacks and data
handling stay Keras's. Each model remembers the tfmx generation its step
functions were built under; after ``enable()``/``disable()`` they are rebuilt on next use, so
models compiled before enable() are covered too.

The multi-worker fixes of Keras's trainer that ``tfmx.enable()`` also installs are
:mod:`tfmx.keras_fixes`, a patch group of their own. What the hook keeps about the models and
functions it built (the generation each step function was built under, the functions it
guarded) is held here, weakly, never as attributes of Keras's objects.

Example:
    >>> from tfmx import keras_hook
    >>> keras_hook.install()  # the stage hooks this Keras lacks: none
    []
    >>> keras_hook.installed()
    True
    >>> keras_hook.uninstall()
    >>> keras_hook.installed()
    False
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from typing import Any

from fusion import patches, private_api, stage
from tfmx import state, step_loop
from tfmx.dispatch import IteratorDispatch
from tfmx.errors import UnknownKerasError
from tfmx.fused_function import FusedFunction
from tfmx.guard import closing_fit, ending_callbacks, make_guard, planning_callbacks
from tfmx.one_step import OneStepDispatch
from tfmx.verify import as_verification_error

# model -> {kind: the tfmx generation its step function of that kind was built under}
_STAMPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# id -> each step function _guard wrapped (held weakly: an entry goes with its function)
_GUARDED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _trainer_class() -> type:
    return private_api.get("keras.trainer")


def installed() -> bool:
    """True while the hook's patches are in place (between :func:`install` and
    :func:`uninstall`).

    >>> from tfmx import keras_hook
    >>> keras_hook.uninstall()
    >>> keras_hook.installed()
    False
    """
    return bool(patches.installed(GROUP))


def _stale(model: Any, kind: str) -> bool:
    return _STAMPS.get(model, {}).get(kind, 0) != state.generation()


def _stamp(model: Any, kind: str) -> None:
    _STAMPS.setdefault(model, {})[kind] = state.generation()


def _fusable(model: Any, kind: str) -> bool:
    opts = state.options()
    if opts is None or model.run_eagerly:
        return False
    if model.jit_compile:
        state.report().note(f"{type(model).__name__}.{kind}: jit_compile=True, left to XLA")
        return False
    return True


def _guard(fn: Any) -> Any:
    """Turn a failed verify assertion into tfmx.errors.VerificationError."""
    if fn is None or _GUARDED.get(id(fn)) is fn:
        return fn

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            converted = as_verification_error(exc)
            if converted is exc:
                raise
            raise converted from None

    _GUARDED[id(guarded)] = guarded
    return guarded


# Keras's functions that tfmx takes over: the step that runs one batch on every replica
# (``strategy.run`` and the cross-replica reduction inside it), and predict's outer functions.
_STEP_FUNCTIONS = frozenset({"one_step_on_data", "one_step_on_data_distributed",
                             "multi_step_on_data"})
_ITERATOR_LOOP = "multi_step_on_iterator"  # train/test: one call per step with the iterator


class _TfWithFusedFunction:
    """``tensorflow`` as Keras's trainer module sees it while tfmx builds a step function:
    ``tf.function`` of a Keras step returns a FusedFunction, of Keras's per-iterator loop an
    :class:`~tfmx.dispatch.IteratorDispatch`; everything else is TensorFlow's."""

    def __init__(self, tf: Any, name: str, prepare: Any = None, price_key: Any = None) -> None:
        self._tf = tf
        self._name = name
        self._prepare = prepare
        self._price_key = price_key
        self.dispatch: IteratorDispatch | None = None  # the step loop's, once made
        self.step: FusedFunction | None = None  # the train or test step, once made
        self.one_step: OneStepDispatch | None = None  # its one-step calls (Keras 3.16)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._tf, attr)

    def _make_guard(self, ops: Any, signature: str, replicas: int = 1) -> Any:
        opts = state.options()
        if opts is None or not opts.guard:
            return None
        made = make_guard(self._name, opts, ops, signature, state.tuning_cache(),
                          planned=self._name.endswith(".train_step"),  # fit's plan sizes it
                          replicas=replicas)
        state.report().add_guard(made)
        return made

    def function(self, fn: Any = None, **kwargs: Any) -> Any:
        if getattr(fn, "__name__", "") == _ITERATOR_LOOP and not kwargs.get("jit_compile"):
            state.report().note(
                "Keras's step loop (multi_step_on_iterator) is called through its traced "
                "function: tf.function's per-call lookup runs once per iterator type "
                "(tfmx.dispatch)")
            twin = lambda: self._tf.function(fn, **kwargs)  # noqa: E731
            self.dispatch = IteratorDispatch(self._tf.function(fn, **kwargs), twin=twin,
                                             make_guard=self._make_guard, name=self._name)
            if self.step is not None and private_api.release("keras") >= (3, 16):
                self.one_step = OneStepDispatch(self.step, self.dispatch, twin=twin,
                                                make_guard=self._make_guard, name=self._name)
            return self.dispatch
        if fn is None or getattr(fn, "__name__", "") not in _STEP_FUNCTIONS:
            return self._tf.function(fn, **kwargs) if fn is not None else self._tf.function(
                **kwargs)
        if kwargs.get("jit_compile"):
            return self._tf.function(fn, **kwargs)
        made = FusedFunction(
            fn, name=self._name, autograph=False,
            reduce_retracing=kwargs.get("reduce_retracing", False), prepare=self._prepare,
            price_key=self._price_key,
        )
        if fn.__name__ == "one_step_on_data":
            self.step = made
        return made


def _builder_of(model: Any) -> Any:
    """What a model's train or test step runs before its first trace: Keras's own symbolic
    build (what its trainer runs before the first step under a distribution strategy) from
    the batch the step is traced for, where the model's layers are built and its optimizer,
    compiled metrics or loss are not. Keras otherwise builds those inside the first trace,
    and a ``tf.function`` that creates variables there is traced twice; built before, the
    step is traced once."""
    ref = weakref.ref(model)

    def build(args: tuple, kwargs: dict) -> None:
        import tensorflow as tf

        model = ref()
        if model is None or len(args) != 1 or kwargs:
            return
        if not all(layer.built for layer in model._flatten_layers()):
            return  # its layers' weights: drawn where Keras draws them, in the trace
        optimizer = getattr(model, "optimizer", None)
        metrics = getattr(model, "_compile_metrics", None)
        loss = getattr(model, "_compile_loss", None)
        if ((optimizer is None or optimizer.built) and (metrics is None or metrics.built)
                and (loss is None or loss.built)):
            return
        from tensorflow.python.distribute import distribute_lib

        if tf.distribute.get_strategy() is not distribute_lib._get_default_strategy():
            return  # Keras builds these itself under a strategy (its symbolic build)
        # Built as outside any function: the trace this runs in (Keras's step loop) would
        # otherwise capture the new variables and be traced again for them.
        with tf.init_scope(), stage.tracing(None), _plain_variables():
            model._symbolic_build(data_batch=args[0])

    return build


@contextlib.contextmanager
def _plain_variables() -> Iterator[None]:
    """Variables created inside are plain eager variables, whatever ``tf.function`` trace is
    running (its variable creator, which would trace its function again, is not called)."""
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import resource_variable_ops

    def plain(next_creator: Any, **kwargs: Any) -> Any:
        return resource_variable_ops.default_variable_creator_v2(None, **kwargs)

    with ops.get_default_graph()._variable_creator_scope(plain, priority=100):
        yield


def _price_key_of(model: Any) -> Any:
    """The key of a train step's price record (``tfmx.guard.price_gate``), known before it is
    traced: the model's class, its layers' classes and weight shapes, its optimizer's class,
    ``steps_per_execution`` and the batch's dtypes and shapes. Two models of the same
    architecture share it; layer names (numbered per process) are left out."""
    ref = weakref.ref(model)

    def key(args: tuple, kwargs: dict) -> str:
        import hashlib

        import tensorflow as tf

        model = ref()
        if model is None:
            return ""
        layers = [(type(layer).__name__, [tuple(w.shape) for w in layer.weights])
                  for layer in model._flatten_layers(include_self=False)]
        batch = [(str(t.dtype), tuple(t.shape)) if hasattr(t, "shape") else type(t).__name__
                 for t in tf.nest.flatten((args, kwargs))]
        parts = [layers, type(getattr(model, "optimizer", None)).__name__,
                 getattr(model, "steps_per_execution", 1), batch]
        digest = hashlib.sha1(repr(parts).encode()).hexdigest()[:16]
        return f"{type(model).__name__}.train_step {digest}"

    return key


def _trainer_module() -> Any:
    return private_api.get("keras.trainer_module")


def _one_step_calls(model: Any, proxy: _TfWithFusedFunction, keras_function: Any) -> Any:
    """Keras's train or test function, whose one step a call (``steps_per_execution == 1``)
    Keras 3.16 runs by reading the batch outside its traced step and calling the step alone:
    such a call, on a ``tf.data`` iterator, goes to ``proxy.one_step``
    (:class:`~tfmx.one_step.OneStepDispatch`: the same step called the same way, in the form the
    guard and the price gate choose), under ``verify`` to Keras's traced loop through
    ``proxy.dispatch`` (one traced call a step, as with Keras 3.15). Other Keras versions,
    other iterators and several steps a call: Keras's function."""
    one_step, dispatch = proxy.one_step, proxy.dispatch
    if one_step is None:
        return keras_function
    import tensorflow as tf

    ref = weakref.ref(model)
    # a strategy's distributed iterator: Keras's own call (Keras's traced loop fails on one:
    # an unfed placeholder, as with steps_per_execution > 1 under MirroredStrategy)
    iterators = (tf.data.Iterator,)

    def function(iterator: Any) -> Any:
        model = ref()
        if model is None or model.steps_per_execution != 1 or not isinstance(iterator, iterators):
            return keras_function(iterator)
        opts = state.options()
        outputs = (dispatch if opts is not None and opts.verify else one_step)(iterator)
        if not outputs.has_value():
            raise StopIteration
        return outputs.get_value()

    return function


_BUILT: weakref.WeakSet = weakref.WeakSet()  # models whose step functions the hook built
_KINDS = {"train": "train_function", "test": "test_function", "predict": "predict_function"}
GROUP = "tfmx.keras"  # the fusion.patches group of the trainer's three builders


def _make_builder(kind: str, attr: str) -> Any:
    def wrap(original: Any) -> Any:
        @functools.wraps(original)
        def make(self: Any, force: bool = False) -> Any:
            # Keras's make_*_function, also rebuilding when tfmx's generation moved on. Returns
            # what Keras's does: the function when built (and current), None when it builds.
            if getattr(self, attr) is not None and not force and not _stale(self, kind):
                return getattr(self, attr)
            if _fusable(self, f"{kind}_step"):
                warn_missing(stage.install())  # hooks of packages imported since enable()
                module = _trainer_module()
                proxy = _TfWithFusedFunction(
                    module.tf, f"{type(self).__name__}.{kind}_step",
                    prepare=_builder_of(self) if kind in ("train", "test") else None,
                    price_key=_price_key_of(self) if kind == "train" else None)
                with patches.temporarily(module, "tf", proxy):
                    original(self, force=True)
                if proxy.dispatch is not None:
                    setattr(self, attr, _one_step_calls(self, proxy, getattr(self, attr)))
                if kind == "train" and proxy.dispatch is not None:  # several steps a call
                    step_loop.register(self, proxy.one_step or proxy.dispatch)
            else:
                original(self, force=True)
            setattr(self, attr, _guard(getattr(self, attr)))
            _stamp(self, kind)
            _BUILT.add(self)
            return None

        return make

    return wrap


def install() -> list[str]:
    """Patch Keras's TensorFlow trainer and the stages' layer methods once (idempotent).

    Returns the stage hooks this Keras has no method for (``"family: module:Class.method"``:
    those families run Keras's calls). Where Keras's trainer itself is not where tfmx hooks it
    (another Keras version), nothing is patched and :class:`~tfmx.errors.UnknownKerasError`
    says what is missing."""
    try:
        trainer = _trainer_class()
        CallbackList = private_api.get("keras.CallbackList")

        for name in (*(f"make_{kind}_function" for kind in _KINDS), "fit"):
            getattr(trainer, name)
        for name in ("on_train_begin", "on_train_end"):
            getattr(CallbackList, name)
    except (ImportError, AttributeError) as exc:
        raise UnknownKerasError(f"{type(exc).__name__}: {exc}") from exc
    missing = stage.install()
    for kind, attr in _KINDS.items():
        patches.install(GROUP, trainer, f"make_{kind}_function", _make_builder(kind, attr))
    # a fit's epochs and steps, from its callbacks' params: the guard's budget (tfmx.guard)
    patches.install(GROUP, CallbackList, "on_train_begin",
                    lambda original: planning_callbacks(step_loop.looping_callbacks(original)))
    patches.install(GROUP, CallbackList, "on_train_end", ending_callbacks)
    patches.install(GROUP, trainer, "fit",
                    lambda original: closing_fit(step_loop.looping_fit(original)))
    module = _trainer_module()
    if isinstance(getattr(module, "TFEpochIterator", None), type):  # a fit's training epochs
        patches.install(GROUP, module, "TFEpochIterator", step_loop.epoch_iterator_class)
    return missing


def warn_missing(missing: list[str]) -> None:
    """Warn once that the stage hooks ``missing`` (``"family: module:Class.method"``, as
    :func:`install` returns them) have no method in the installed packages: those calls run as
    written, the rest of tfmx is on."""
    if missing:
        import keras
        import tensorflow as tf

        state.warn_once("keras-version:" + ",".join(missing), (
            f"tfmx: Keras {keras.__version__} with TensorFlow {tf.__version__} has no method "
            f"where tfmx hooks it for {'; '.join(missing)}: those calls run as Keras wrote "
            "them, the rest of tfmx is on."))


def uninstall() -> None:
    """Restore Keras's own methods, and drop the step functions the hook built, so every model
    builds Keras's own on its next fit, evaluate or predict."""
    stage.uninstall()
    patches.uninstall(GROUP)
    for model in list(_BUILT):
        for kind, attr in _KINDS.items():
            if kind in _STAMPS.get(model, {}):
                setattr(model, attr, _Rebuild(model, kind))
    _STAMPS.clear()
    _BUILT.clear()


class _Rebuild:
    """Stands in for a step function the hook built, once tfmx is off: its first call has
    Keras build its own step function and runs that (so even a ``fit`` in progress, whose
    loop calls ``model.train_function`` every step, goes on with Keras's own)."""

    def __init__(self, model: Any, kind: str) -> None:
        self._model, self._kind = model, kind

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self._model
        getattr(model, f"make_{self._kind}_function")(force=True)
        return getattr(model, _KINDS[self._kind])(*args, **kwargs)
