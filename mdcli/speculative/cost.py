"""The cost model speculative decoding's `auto` plans with (mdcli/speculative/planner.py): what a decode
step costs on this machine, learnt from the steps timed during the run."""

from __future__ import annotations


class ForwardCost:
    """Seconds for a decode step, learnt from the steps timed during the run: a plain step of m
    tokens (each branch its next token), or one that also verifies d guesses.

    plain(m) is a running mean per width, recent steps weighing most, so it follows the cache
    growing. A verifying step costs plain(m) + c + b d: c is what verifying costs beyond the
    guesses themselves (on one CPU core a lone branch's second token switches to a dearer kernel;
    on a GPU, where more tokens cost almost nothing, the walk and the cache rollback are most of
    it), b what each guess costs. c and b are learnt over the whole run (least squares with a
    light prior): most steps of a run may be plain and say nothing about them, so the few that
    verified must not be forgotten within tens of steps. Before anything is timed, the prior says
    t(m) = 16 + m, in units of the first step timed: a guess costs 1/16 of a step.
    """

    decay = 0.95  # per plain step of that width
    slope_decay = 0.998  # per verifying step
    prior_c, prior_b = 0.0, 1.0
    # the prior's weight: for c, a quarter of a step; for b, a spread of 4 squared guesses (two
    # real steps 3 guesses apart outweigh it)
    c_weight, b_weight = 0.25, 4.0

    def __init__(self) -> None:
        self.unit: float | None = None  # seconds per prior unit, set by the first step timed
        self.plain_steps: dict[int, float] = {}  # width -> running mean, in prior units
        self.sums = [0.0] * 5  # over verifying steps (d, e = t - plain(m)): sums of 1, d, d^2, e, d e
        self.verifying = 0  # verifying steps timed

    def in_units(self, tokens: int, seconds: float) -> float:
        if self.unit is None:  # the first step lands on the prior's line
            self.unit = seconds / (16 + tokens)
        return seconds / self.unit

    def observe_plain(self, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        t = self.in_units(tokens, seconds)
        mean = self.plain_steps.get(tokens)
        self.plain_steps[tokens] = t if mean is None else mean + (1 - self.decay) * (t - mean)

    def observe_verified(self, tokens: int, guesses: int, seconds: float) -> None:
        """A step of `tokens` tokens of the branches' own plus `guesses` guessed ones."""
        if seconds <= 0 or guesses < 1:
            return
        self.verifying += 1
        extra = self.excess(tokens, guesses, seconds)
        sample = (1.0, guesses, guesses * guesses, extra, guesses * extra)
        self.sums = [self.slope_decay * v + x for v, x in zip(self.sums, sample)]

    def excess(self, tokens: int, guesses: int, seconds: float) -> float:
        """What a step of `tokens` tokens plus `guesses` guesses that took `seconds` cost beyond
        a plain step, in prior units, counting at most half a plain step over the prediction: a
        pause (the collector, the VM) or a shape's first forward in a process (its kernels' first
        call) in a rare verifying step must not set what every later one is expected to cost, as
        auto may then not verify again for a hundred steps."""
        plain = self.plain(tokens)
        ceiling = self.verified(tokens, guesses) - plain + 0.5 * plain
        return min(self.in_units(tokens + guesses, seconds) - plain, ceiling)

    def extra_line(self) -> tuple[float, float]:
        """(c, b): ridge least squares of e = c + b d, pulled towards the prior, with c >= 0:
        verifying never costs less than its guesses (steps that all verified about the same
        number of guesses leave the line's tilt free, and a negative c would call a few guesses
        free)."""
        n, sd, sdd, se, sde = self.sums
        a11, a12, a22 = n + self.c_weight, sd, sdd + self.b_weight
        r1, r2 = se + self.c_weight * self.prior_c, sde + self.b_weight * self.prior_b
        det = a11 * a22 - a12 * a12
        c = (r1 * a22 - a12 * r2) / det
        b = (a11 * r2 - a12 * r1) / det
        if c < 0:
            c, b = 0.0, r2 / a22
        return c, max(b, 1e-3)

    def plain(self, tokens: int) -> float:
        """Predicted cost of a plain step of `tokens` tokens, in prior units."""
        if tokens in self.plain_steps:
            return self.plain_steps[tokens]
        if not self.plain_steps:
            return 16.0 + tokens
        nearest = min(self.plain_steps, key=lambda m: abs(m - tokens))  # a branch finished, or forked
        return self.plain_steps[nearest] + self.extra_line()[1] * (tokens - nearest)

    def verified(self, tokens: int, guesses: int) -> float:
        """Predicted cost of a step of `tokens` tokens plus `guesses` guesses, in prior units."""
        if guesses < 1:
            return self.plain(tokens)
        c, b = self.extra_line()
        return self.plain(tokens) + max(c + b * guesses, 1e-3)
