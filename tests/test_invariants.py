"""llmlab.invariants: a broken rule is a warning naming it; a rule kept is silent."""

import warnings

import pytest

from llmlab import invariants, timing


def test_check_warns_only_when_the_rule_is_broken():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert invariants.check(True, "fine") is True
    for _ in range(2):  # every violation shows, not only the first at this line
        with pytest.warns(invariants.InvariantWarning, match="invariant violated: the point is above the roof"):
            assert invariants.check(False, "the point is above the roof") is False


def t(seconds, spread):
    """A Timing with that median and spread (half the IQR / median)."""
    return timing.Timing((seconds * (1 - 2 * spread), seconds * (1 - spread), seconds, seconds * (1 + spread),
                          seconds * (1 + 2 * spread)))


def test_rising_names_a_fall_beyond_the_spreads():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert invariants.rising([t(1, 0.01), t(2, 0.01), t(4, 0.01)], "step time", [4, 16, 64])
        assert invariants.rising([t(1, 0.2), t(0.9, 0.2)], "step time", [4, 16])  # within the spreads: a tie
    with pytest.warns(invariants.InvariantWarning, match="step time fell from 2 s ±1% at 16 to 1 s ±1% at 64"):
        assert not invariants.rising([t(1, 0.01), t(2, 0.01), t(1, 0.01)], "step time", [4, 16, 64])
