"""What tfmx's step saves over stock's on this machine: learnt, and expected for a step whose
fused form was never measured here.

Whether trying tfmx's form of a step pays within a fit depends on what the fused step saves a
call, which is known only once it ran. Before that, the price gate (``tfmx.step_price``) weighs
a prior: the ratio of the fused step's median to stock's, learnt here from every step measured
in both forms (:func:`learn_gain`, fed by ``tfmx.step_price.learn_price``) and read as the
median of their logarithms (``tfmx.first_call.robust``); before any step was measured in
both forms, :data:`GAIN_SEED`. A fused step measured with some of the tuner's decisions left
to Keras's form (its share of the fit spent) teaches nothing: it is the gain of a tuned step
the gate weighs (``tfmx.step_price.provisional``), and one model fitted again and again would
otherwise fill the history with its own step as its tuning goes on.

A prior is an expectation, not a measurement: the gate tries the fused form on it only where
the fit's expected saving covers the extra first call :data:`GAIN_MARGIN` times over, so that a
step which turns out to gain nothing costs the fit at most that share of what was expected (and
the whole-step guard's trial then keeps stock).

What is learnt is kept for the process and, given the machine's tuning cache
(``tfmx.tuning_cache.TuningCache``), for this machine, in the file of its figures that another
tfmx version keeps (``tfmx.tuning_cache.figures_cache``).

Example (two steps measured here: the fused ones ran 0.7 and 0.8 x stock's):
    >>> from tfmx.step_gain import expected_gain, learn_gain
    >>> learn_gain(35.0, 50.0)
    >>> learn_gain(40.0, 50.0)
    >>> expected_gain()  # doctest: +NORMALIZE_WHITESPACE
    (0.748..., 'the median of 2 step(s) measured in both forms here')
    >>> from tfmx.first_call import forget_first_calls
    >>> forget_first_calls()
"""

from __future__ import annotations

from typing import Any

from tfmx.first_call import history, observe, robust

GAIN_FAMILY = "step-gain-ratio"
"""The tuning cache's family of the ratios of a fused step's median to stock's, per step
measured in both forms here (its last ``tfmx.first_call.HISTORY``)."""
GAIN_SEED = 0.85
"""Before any step was measured in both forms on this machine, a fused step is expected to run
at this ratio of stock's (a seed: the first step measured in both forms replaces it)."""
GAIN_MARGIN = 2.0
"""How many times over the expected saving must cover a fused step's extra first call before
the gate tries it on a prior (:func:`pays_on_prior`)."""


def learn_gain(form_ms: float, stock_ms: float, cache: Any = None, form: str = "fused") -> None:
    """Record that a step ran ``form_ms`` a call in ``form`` (``"fused"``: tfmx's, ``"xla"``:
    compiled by XLA) where stock's ran ``stock_ms`` (medians measured here).

    >>> learn_gain(30.0, 60.0)
    >>> expected_gain()[0]
    0.5
    >>> from tfmx.first_call import forget_first_calls
    >>> forget_first_calls()
    """
    if form_ms > 0 and stock_ms > 0:
        observe(GAIN_FAMILY, form, form_ms / stock_ms, cache)


def expected_gain(cache: Any = None, form: str = "fused") -> tuple[float, str]:
    """The ratio of stock's a step not yet measured in ``form`` is expected to run at in it,
    and how that was estimated: learnt here (:func:`learn_gain`), else, for tfmx's form,
    :data:`GAIN_SEED` and for XLA's no gain (1.0: what XLA gains differs too much between
    models for a seed to stand for it).

    >>> expected_gain(), expected_gain(form="xla")[0]
    ((0.85, 'seed: nothing measured in both forms here yet'), 1.0)
    """
    values = history(GAIN_FAMILY, form, cache)
    if not values:
        seed = GAIN_SEED if form == "fused" else 1.0
        return seed, "seed: nothing measured in both forms here yet"
    return robust(values), f"the median of {len(values)} step(s) measured in both forms here"


def pays_on_prior(extra_s: float, calls: int, stock_ms: float, cache: Any = None,
                  what: str = "the fused step not measured yet") -> tuple[bool, str, int]:
    """Whether trying the fused form of a step whose stock call takes ``stock_ms`` pays over
    ``calls`` calls for a first call ``extra_s`` beyond what stock's costs, on the expected
    gain (:func:`expected_gain`, with :data:`GAIN_MARGIN`); the reason; and the fit's calls
    from which it would (0: never, the prior expects no gain).

    >>> pays_on_prior(2.0, 1000, 50.0)  # 1000 x 50 ms x 0.15 = 7.5 s > 2 x 2 s
    ... # doctest: +NORMALIZE_WHITESPACE
    (True, "the fused step not measured yet is expected at 0.85 x stock's (seed: nothing
    measured in both forms here yet): ~7.50 s saved over the fit's 1000 calls (stock 50.00 ms a
    call), more than 2 x its extra first call", 534)
    >>> pays_on_prior(2.0, 500, 50.0)[0]
    False
    """
    ratio, how = expected_gain(cache)
    per_call_s = stock_ms * (1.0 - ratio) / 1e3
    if per_call_s <= 0:
        return False, f"{what} is expected at {ratio:.2f} x stock's ({how}): no gain expected", 0
    saved = calls * per_call_s
    pays_from = int(GAIN_MARGIN * extra_s / per_call_s) + 1
    more = "more" if saved > GAIN_MARGIN * extra_s else "not more"
    return saved > GAIN_MARGIN * extra_s, (
        f"{what} is expected at {ratio:.2f} x stock's ({how}): "
        f"~{saved:.2f} s saved over the fit's {calls} calls (stock {stock_ms:.2f} ms a call), "
        f"{more} than {GAIN_MARGIN:g} x its extra first call"), pays_from


__all__ = ["GAIN_FAMILY", "GAIN_MARGIN", "GAIN_SEED", "expected_gain", "learn_gain",
           "pays_on_prior"]
