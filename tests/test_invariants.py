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
        tie = timing.Timing((0.54, 1.26, 1.08, 0.9, 0.72))  # median 0.9, rounds that disagree with t(1, 0.2)'s
        assert invariants.rising([t(1, 0.2), tie], "step time", [4, 16])
        fewer = timing.Timing((0.8, 0.9, 1.0))  # not the same rounds: judged by the spreads, which overlap
        assert invariants.rising([t(1, 0.2), fewer], "step time", [4, 16])
    with pytest.warns(invariants.InvariantWarning, match="step time fell from 2 s ±1% at 16 to 1 s ±1% at 64"):
        assert not invariants.rising([t(1, 0.01), t(2, 0.01), t(1, 0.01)], "step time", [4, 16, 64])


def test_rising_compares_shared_rounds_pair_by_pair():
    # the same 5 rounds: round 2 slowed the smaller work only (a busy spell); most rounds say the larger takes longer
    small = timing.Timing((1.0, 3.0, 1.0, 1.0, 1.0))
    large = timing.Timing((1.1, 1.0, 1.1, 1.1, 1.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert invariants.rising([small, large], "ring time", ["1 KiB", "16 KiB"])
    slightly = timing.Timing((0.97, 0.98, 0.97, 0.96, 0.97))  # every round agrees on a 3% fall: not material
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert invariants.rising([small, slightly], "ring time", ["1 KiB", "16 KiB"])
        assert invariants.rising([t(1, 0.01), t(0.95, 0.01)], "step time", [4, 16])  # beyond the spreads, not 10%
    faster = timing.Timing((0.8, 0.9, 0.8, 0.7, 0.8))  # every round agrees it fell
    with pytest.warns(invariants.InvariantWarning, match="ring time fell from 1 s ±0% at 1 KiB"):
        assert not invariants.rising([small, faster], "ring time", ["1 KiB", "16 KiB"])
