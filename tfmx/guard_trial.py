"""The whole-step guard's trial: duels between forms of a step, timed on its first real batches.

The fused and the stock step run alternately on the real batches (every step trains as usual,
nothing is computed twice); the first call of each form only warms it up (tracing, compiling),
later calls are timed. After each pair the trial compares them: a sequential t-test on the
pairs' log time ratios (from 2 pairs, at p < :data:`P_EARLY` per look; a form slower by a wide
margin is dropped after 2-3 pairs, see also :data:`PLAIN`) and a sign test (from
:data:`MIN_PAIRS` pairs); after :data:`MAX_PAIRS` pairs it keeps the challenger only if it is
faster beyond noise. A trial is a sequence of such duels: each challenger (the fused step, then
the XLA-compiled one where given) against the form kept so far (stock at first).

:class:`Trial` holds the duels and what they timed; what the trial may spend is
``tfmx.guard_budget``'s, running the forms ``tfmx.guard``'s.

Example (injected times: the fused step is slower, stock is kept):
    >>> from tfmx.guard_trial import Trial
    >>> trial = Trial()
    >>> while trial.kept is None:
    ...     form = trial.next
    ...     _ = trial.record(form, 0.010 if form == "fused" else 0.008)
    >>> trial.kept, trial.medians_ms()
    ('stock', {'fused': 10.0, 'stock': 8.0})
"""

from __future__ import annotations

import statistics

from tfmx.timing import sign_test, t_test

MIN_PAIRS = 6
"""Pairs before the sign test may decide (the t-test may decide from 2)."""
MAX_PAIRS = 24
"""Pairs after which the guard decides whatever the evidence (stock unless fused is faster)."""
P_EARLY = 0.01
"""p-value that ends a duel early in favour of one form."""
P_FINAL = 0.05
"""At :data:`MAX_PAIRS`, or when the budget runs out, a challenger is kept only at this
significance."""
PLAIN = (1.1, 1.25)
"""A challenger slower in each of its first 3 pairs by at least the first, and by the second in
their median, is dropped then, however noisy (its t-test may not yet be)."""


class Trial:
    """The duels of one step's forms (see module doc): :attr:`next` names the form to run,
    :meth:`record` takes its time; once the last duel ends, :attr:`kept` names the winner.
    ``notes`` open the trial's reasons (the report's).

    >>> trial = Trial(("fused", "xla"))
    >>> trial.forms(), trial.next  # the fused step ran first: stock is timed next
    (('stock', 'fused', 'xla'), 'stock')
    """

    def __init__(self, challengers: tuple[str, ...] = ("fused",), min_pairs: int = MIN_PAIRS,
                 max_pairs: int = MAX_PAIRS, notes: tuple[str, ...] = ()) -> None:
        self.min_pairs, self.max_pairs = min_pairs, max_pairs
        self.kept: str | None = None  # by the duels, a paused trial, or an outcome recalled
        self.queue = list(challengers)
        self.incumbent = "stock"
        self.challenger = self.queue.pop(0)
        self.reasons: list[str] = list(notes)
        self.timed: dict[str, list[float]] = {}  # every timed run, per form, for the report
        self.pair: dict[str, list[float]] = {self.challenger: [], self.incumbent: []}
        self.warm: dict[str, float] = {"fused": 0.0}  # the first traced call ran the fused form
        self.next = self.incumbent if self.challenger in self.warm else self.challenger

    def forms(self) -> tuple[str, ...]:
        """Every form the trial may keep: stock, the challenger, those queued after it."""
        return ("stock", self.challenger, *self.queue)

    def record(self, form: str, seconds: float) -> bool:
        """Record one run of ``form`` (its first run only warms it up); True when this ends
        the last duel (:attr:`kept` is then its winner).

        >>> trial = Trial()
        >>> trial.record("stock", 2.0), trial.warm["stock"], trial.next
        (False, 2.0, 'fused')
        """
        if form not in self.warm:
            self.warm[form] = seconds  # tracing and compiling it: the guard's doing
        else:
            self.timed.setdefault(form, []).append(seconds)
            if self.incumbent in self.warm and self.challenger in self.warm:
                self.pair.setdefault(form, []).append(seconds)  # the duel has begun
        self.next = self.incumbent if form == self.challenger else self.challenger
        return self._maybe_decide()

    def failed(self, form: str, why: str) -> bool:
        """``form`` could not run (e.g. XLA could not compile the step): if it is the
        challenger, it loses its duel. True when that ends the last duel.

        >>> trial = Trial(("fused", "xla"))
        >>> trial.failed("fused", "RuntimeError: boom"), trial.challenger
        (False, 'xla')
        """
        if form != self.challenger:
            return False
        return self._end_duel(self.incumbent, f"{form} could not run ({why[:120]})")

    def ratios(self) -> list[float]:
        """The challenger's time over the incumbent's, per timed pair of the duel."""
        mine, theirs = self.pair[self.challenger], self.pair[self.incumbent]
        return [c / i for c, i in zip(mine, theirs) if i > 0 and c > 0]

    def _maybe_decide(self) -> bool:
        challenger, incumbent = self.challenger, self.incumbent
        if len(self.pair[challenger]) != len(self.pair[incumbent]):
            return False
        ratios = self.ratios()
        n = len(ratios)
        if n < 2:
            return False
        median = statistics.median(ratios)
        verdict = t_test(ratios, P_EARLY)
        if verdict < 0 and median < 1.0:
            return self._end_duel(challenger, f"{challenger} {median:.2f}x {incumbent}, faster "
                                              f"in {n} pairs (t-test, p<{P_EARLY})")
        if verdict > 0:
            return self._end_duel(incumbent, f"{challenger} {median:.2f}x {incumbent}, slower "
                                             f"in {n} pairs (t-test, p<{P_EARLY})")
        if n == 3 and min(ratios) > PLAIN[0] and median > PLAIN[1]:  # slower in every pair
            return self._end_duel(incumbent, f"{challenger} {median:.2f}x {incumbent}, slower "
                                             "in each of 3 pairs")
        if n < self.min_pairs:
            return False
        faster = sum(r < 1.0 for r in ratios)
        p_new = sign_test(faster, n)  # evidence the challenger is faster
        p_old = sign_test(n - faster, n)  # evidence the incumbent is faster
        if p_new < P_EARLY and median < 1.0:
            return self._end_duel(challenger, f"{challenger} faster than {incumbent} in "
                                              f"{faster} of {n} pairs (p={p_new:.3f})")
        if p_old < P_EARLY:
            return self._end_duel(incumbent, f"{incumbent} faster than {challenger} in "
                                             f"{n - faster} of {n} pairs (p={p_old:.3f})")
        if n < self.max_pairs:
            return False
        if self.significantly_faster():
            return self._end_duel(challenger, f"{challenger} faster than {incumbent} in "
                                              f"{faster} of {n} pairs (p<{P_FINAL})")
        return self._end_duel(incumbent, f"{challenger} not faster than {incumbent} beyond "
                                         f"noise: faster in {faster} of {n} pairs "
                                         f"(p={p_new:.2f}), median ratio {median:.3f}")

    def significantly_faster(self) -> bool:
        """The challenger is faster at :data:`P_FINAL` (the t-test or the sign test).

        >>> Trial().significantly_faster()  # no timed pair
        False
        """
        ratios = self.ratios()
        if not ratios or statistics.median(ratios) >= 1.0:
            return False
        faster = sum(r < 1.0 for r in ratios)
        return t_test(ratios, P_FINAL) < 0 or sign_test(faster, len(ratios)) < P_FINAL

    def best_so_far(self) -> tuple[str, str]:
        """The form to keep where the trial stops before its duel ends, and why: the step
        that ran before the duel where it has no timed pair, else a challenger only if faster
        beyond noise.

        >>> Trial().best_so_far()[0]  # the fused step ran before the duel
        'fused'
        """
        challenger, incumbent = self.challenger, self.incumbent
        if not self.ratios():  # no timed pair: the step that ran before the duel stays
            kept = challenger if challenger == "fused" and incumbent == "stock" else incumbent
            return kept, "it ran before this duel, which has no timed pair"
        kept = challenger if self.significantly_faster() else incumbent
        return kept, "the best so far (a challenger only if faster beyond noise)"

    def _end_duel(self, winner: str, reason: str) -> bool:
        self.reasons.append(reason)
        if not self.queue:
            self.kept = winner
            return True
        self.incumbent, self.challenger = winner, self.queue.pop(0)
        self.pair = {self.challenger: [], self.incumbent: []}
        self.next = self.challenger
        return False

    def samples(self, form: str) -> list[float]:
        """Every timed run of ``form`` in the trial (seconds)."""
        return list(self.timed.get(form, ()))

    def medians_ms(self) -> dict[str, float]:
        """Each timed form's median run, in ms."""
        return {f: statistics.median(v) * 1e3 for f, v in self.timed.items() if v}

    def best_s(self) -> float | None:
        """The median run of the fastest form timed (seconds), None before any."""
        timed = [statistics.median(v) for v in self.timed.values() if v]
        return min(timed) if timed else None

    def cost(self) -> float:
        """Seconds the trial added: the first calls of the forms other than fused (tracing,
        compiling), and every timed step beyond the median of the form kept (or of the fastest
        so far, while undecided).

        >>> trial = Trial()
        >>> for form, seconds in (("stock", 1.0), ("fused", 0.01), ("stock", 0.03)):
        ...     _ = trial.record(form, seconds)
        >>> round(trial.cost(), 3)  # stock's first call, and its step 20 ms slower
        1.02
        """
        cost = sum(t for form, t in self.warm.items() if form != "fused")
        timed = {f: v for f, v in self.timed.items() if v}
        if not timed:
            return cost
        kept = self.kept if self.kept in timed else min(
            timed, key=lambda f: statistics.median(timed[f]))
        base = statistics.median(timed[kept])
        return cost + max(0.0, sum(t - base for f, v in timed.items() if f != kept
                                   for t in v))


__all__ = ["MAX_PAIRS", "MIN_PAIRS", "PLAIN", "P_EARLY", "P_FINAL", "Trial"]
