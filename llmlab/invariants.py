"""Rules a chapter's measured figures must obey, checked where they are drawn: a violation is shown, not drawn over.

A chapter that says "the roof bounds every kernel" or "a bigger batch takes longer per step" relies on it; when a
measurement breaks such a rule (a busy machine, a cache the roof does not model, a bug), the cell prints a warning
naming the rule and the figures, and the plot is still drawn, so a learner sees both.

    from llmlab import invariants
    invariants.check(point <= roof, f"the GEMM's {point:.3g} FLOP/s is above the roof's {roof:.3g} FLOP/s")
    invariants.rising(times, "step time", labels=batches)    # non-decreasing, beyond the measured spread

`llmlab site` and the busy-machine check (tools/busy_check.py) look for the warning's name, `InvariantWarning`,
on every executed page.
"""

from __future__ import annotations

import math
import warnings

from llmlab import timing

__all__ = ["InvariantWarning", "check", "rising", "FALL_TOLERANCE"]

# A fall smaller than this share of the time is no evidence that more work ran faster: where the work barely
# differs (a latency-bound 1 KiB vs 16 KiB message), systematic effects of a few percent that no number of rounds
# removes (where a buffer lands in memory, which core the scheduler picks) can order two equal times either way,
# every round alike (seen: 7.46 ms at 1 KiB, 7.2 ms at 16 KiB, a 3.5% fall most rounds agreed on).
FALL_TOLERANCE = 0.10


class InvariantWarning(UserWarning):
    """A measured figure broke a rule its chapter relies on."""


def check(holds: bool, message: str) -> bool:
    """Warn (InvariantWarning: 'invariant violated: `message`') unless `holds`; return `holds`."""
    if not holds:
        with warnings.catch_warnings():
            warnings.simplefilter("always", InvariantWarning)  # every violation shows, not only a location's first
            warnings.warn(f"invariant violated: {message}", InvariantWarning, stacklevel=2)
    return bool(holds)


def rising(timings, what: str, labels) -> bool:
    """Check that `timings` (timing.Timing, in order of growing work) do not fall from one to the next.

    Timings measured in the same rounds (as many samples each: `timing.interleave`, or a sweep repeated as a
    whole) are compared round by round: a fall is one that most rounds agree on (the paired ratios' interquartile
    range lies below 1 − FALL_TOLERANCE), so a busy spell that slowed one round of the smaller work does not count.
    Otherwise a fall must exceed both figures' spreads and the tolerance. Where the work barely differs (a
    latency-bound message, a small batch) two equal times can come out either way; only a material fall the rounds
    agree on is a violation."""
    pairs, ok = list(zip(labels, timings, strict=True)), True
    for (a, ta), (b, tb) in zip(pairs, pairs[1:], strict=False):
        if len(ta.samples) == len(tb.samples) > 1:
            ratios = tuple(y / x if x > 0 else math.inf for x, y in zip(ta.samples, tb.samples, strict=True))
            fell = timing.Comparison(tb, ta, ratios).direction(1 - FALL_TOLERANCE) == "faster"
        else:
            fell = tb.seconds * (1 + tb.spread) < min(ta.seconds * (1 - ta.spread), ta.seconds * (1 - FALL_TOLERANCE))
        ok &= check(not fell, f"{what} fell from {ta} at {a} to {tb} at {b}, though {b} is more work")
    return ok
