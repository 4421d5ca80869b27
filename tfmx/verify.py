"""``enable(verify=True)``: run the first step both ways from the same variable values.

"Stock" is the function traced with no tfmx stage at all: Keras's own composite batch norms
and LSTM/GRU loops, which tfmx's pre-differentiation stages replace before the graph rewrite,
are checked as well as the rewrite itself. The check is built into the graph, so it works the
same when Keras calls the step inside its own ``tf.function`` and when a custom loop calls
``tfmx.function`` eagerly. On the first call of each traced signature: read every variable the
step touches, run the stock step, read them again, restore them, run the fused step, read them
again, compare variables and outputs. If the largest difference is beyond tolerance, the
variables are restored to their values before the step and the call fails with the name of the
worst variable and the difference (:class:`tfmx.errors.VerificationError` from Keras and eager
calls). Later calls run the fused step alone.

Example (a step whose fused form agrees):
    >>> import tensorflow as tf, tfmx
    >>> v = tf.Variable(tf.ones([2, 2]))
    >>> b = tf.Variable(tf.zeros([2]))
    >>> @tfmx.function
    ... def step(x):
    ...     v.assign_sub(0.1 * tf.nn.relu(tf.nn.bias_add(tf.matmul(x, v), b)))
    ...     return tf.reduce_sum(v)
    >>> tfmx.enable(backend="cpu", verify=True)
    >>> round(float(step(tf.ones([2, 2]))), 3)
    3.2
    >>> tfmx.disable()
"""

from __future__ import annotations

import sys
from typing import Any

import tensorflow as tf

from tfmx import state
from tfmx.errors import VerificationError

MARKER = "tfmx verify failed"
FALLBACK = "first-step"
"""``verify`` mode of cuda and metal by default: check the first step, warn and run stock if it
disagrees (no exception mid-fit)."""


def step_variables(concrete: Any) -> list[tf.Variable]:
    """Every variable whose handle ``concrete`` captures (model, optimizer, metrics, seeds)."""
    handles = {id(ext) for ext, _ in concrete.graph.captures}
    seen: dict[int, tf.Variable] = {}
    for var in concrete.graph.variables:
        if id(var.handle) in handles and id(var) not in seen:
            seen[id(var)] = var
    return list(seen.values())


def _mismatch(a: tf.Tensor, b: tf.Tensor, rtol: float, atol: float) -> tuple[tf.Tensor, tf.Tensor]:
    """(max of |a-b| / (atol + rtol*|a|), max |a-b|) as float64 scalars."""
    a = tf.reshape(tf.cast(a, tf.float64), [-1])
    b = tf.reshape(tf.cast(b, tf.float64), [-1])
    diff = tf.abs(a - b)
    ratio = tf.reduce_max(tf.concat([diff / (atol + rtol * tf.abs(a)), [0.0]], 0))
    return ratio, tf.reduce_max(tf.concat([diff, [0.0]], 0))


def _comparable(t: Any) -> bool:
    return isinstance(t, tf.Tensor) and (t.dtype.is_floating or t.dtype.is_integer)


def verified_call(entry: Any, args: tuple, kwargs: dict, opts: Any, name: str,
                  reference: Any) -> Any:
    """Call ``entry.fused`` after checking it once against ``reference`` (the function traced
    without tfmx; see module doc)."""
    # Across several workers one worker falling back alone would run other collectives than
    # the rest: there a disagreement raises on the worker that saw it, as verify=True does.
    fallback = opts.verify == FALLBACK and not state.multi_worker()
    if entry.verify_flag is None:
        with tf.init_scope():
            # 0: not yet checked, 1: checked and equal, 2: disagreed (fallback: run stock)
            entry.verify_flag = tf.Variable(0, trainable=False, name="tfmx_verified")
    variables = step_variables(reference)
    flag = entry.verify_flag

    def first() -> Any:
        before = [tf.identity(v.read_value()) for v in variables]
        stock_out = reference(*args, **kwargs)
        stock_flat = tf.nest.flatten(stock_out, expand_composites=True)
        with tf.control_dependencies([t for t in stock_flat if isinstance(t, tf.Tensor)]):
            stock_after = [tf.identity(v.read_value()) for v in variables]
        with tf.control_dependencies(stock_after):
            restores = [v.assign(b) for v, b in zip(variables, before)]
        with tf.control_dependencies(restores):
            fused_out = entry.fused(*args, **kwargs)
        fused_flat = tf.nest.flatten(fused_out, expand_composites=True)
        with tf.control_dependencies([t for t in fused_flat if isinstance(t, tf.Tensor)]):
            fused_after = [tf.identity(v.read_value()) for v in variables]
        labels, ratios, diffs = [], [], []
        pairs = list(zip([v.name for v in variables], stock_after, fused_after))
        pairs += [(f"output {i}", s, f) for i, (s, f) in enumerate(zip(stock_flat, fused_flat))]
        for label, s, f in pairs:
            if _comparable(s) and _comparable(f):
                ratio, diff = _mismatch(s, f, opts.rtol, opts.atol)
                labels.append(label)
                ratios.append(ratio)
                diffs.append(diff)
        if not ratios:
            flag.assign(1)
            return fused_out
        ratios_t, diffs_t = tf.stack(ratios), tf.stack(diffs)
        worst = tf.argmax(ratios_t)
        ok = tf.reduce_max(ratios_t) <= 1.0
        if fallback:
            return _settle_fallback(ok, fused_out, stock_out, variables, stock_after, flag,
                                    name, tf.gather(tf.constant(labels), worst),
                                    tf.gather(diffs_t, worst))

        def restore() -> tf.Tensor:
            ops = [v.assign(b) for v, b in zip(variables, before)]
            with tf.control_dependencies(ops):
                return tf.constant(False)

        settled = tf.cond(ok, lambda: tf.constant(True), restore)
        with tf.control_dependencies([settled]):
            check = tf.debugging.Assert(
                ok,
                [
                    f"{MARKER} for {name!r}: largest difference in",
                    tf.gather(tf.constant(labels), worst),
                    "abs diff",
                    tf.gather(diffs_t, worst),
                    f"beyond rtol={opts.rtol} atol={opts.atol}; variables restored",
                ],
                summarize=8,
            )
        with tf.control_dependencies([check]):
            done = flag.assign(1)
        with tf.control_dependencies([done]):
            return tf.nest.map_structure(
                lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t,
                fused_out,
                expand_composites=True,
            )

    try:
        return tf.switch_case(flag.read_value(), [
            first, lambda: entry.fused(*args, **kwargs), lambda: reference(*args, **kwargs)])
    except tf.errors.InvalidArgumentError as exc:
        raise as_verification_error(exc) from None


def _settle_fallback(ok: tf.Tensor, fused_out: Any, stock_out: Any, variables: list,
                     stock_after: list, flag: tf.Variable, name: str, label: tf.Tensor,
                     diff: tf.Tensor) -> Any:
    """verify="first-step": keep the fused step if it agreed; otherwise put stock's results in
    the variables, say so on stderr, and mark the function to run stock from now on."""

    def agreed() -> Any:
        with tf.control_dependencies([flag.assign(1)]):
            return _identity(fused_out)

    def disagreed() -> Any:
        restores = [v.assign(a) for v, a in zip(variables, stock_after)]
        printed = tf.print(
            f"tfmx WARNING: the fused {name!r} disagreed with the stock step on its first "
            "call (largest difference in", label, "abs", diff, "); it runs stock from now on. "
            "Please report it with tfmx.report().", output_stream=sys.stderr)
        with tf.control_dependencies([*restores, printed, flag.assign(2)]):
            return _identity(stock_out)

    return tf.cond(ok, agreed, disagreed)


def _identity(structure: Any) -> Any:
    return tf.nest.map_structure(lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t,
                                 structure, expand_composites=True)


def disagreed(entry: Any) -> bool:
    """True once a first-step check of ``entry`` found the fused step wrong (it runs stock)."""
    flag = getattr(entry, "verify_flag", None)
    return flag is not None and int(flag.numpy()) == 2


def as_verification_error(exc: BaseException) -> BaseException:
    """A VerificationError for a failed verify assertion; ``exc`` itself otherwise."""
    text = str(exc)
    if MARKER not in text:
        return exc
    start = text.index(MARKER)
    return VerificationError(text[start:].split("\n")[0].strip() + " (see tfmx.report())")
