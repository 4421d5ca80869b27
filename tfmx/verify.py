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

from typing import Any

import tensorflow as tf

from tfmx.errors import VerificationError

MARKER = "tfmx verify failed"


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
    if entry.verify_flag is None:
        with tf.init_scope():
            entry.verify_flag = tf.Variable(False, trainable=False, name="tfmx_verified")
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
            flag.assign(True)
            return fused_out
        ratios_t, diffs_t = tf.stack(ratios), tf.stack(diffs)
        worst = tf.argmax(ratios_t)
        ok = tf.reduce_max(ratios_t) <= 1.0

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
            done = flag.assign(True)
        with tf.control_dependencies([done]):
            return tf.nest.map_structure(
                lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t,
                fused_out,
                expand_composites=True,
            )

    try:
        return tf.cond(flag, lambda: entry.fused(*args, **kwargs), first)
    except tf.errors.InvalidArgumentError as exc:
        raise as_verification_error(exc) from None


def as_verification_error(exc: BaseException) -> BaseException:
    """A VerificationError for a failed verify assertion; ``exc`` itself otherwise."""
    text = str(exc)
    if MARKER not in text:
        return exc
    start = text.index(MARKER)
    return VerificationError(text[start:].split("\n")[0].strip() + " (see tfmx.report())")
