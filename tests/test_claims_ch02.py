"""Chapter 2's claims (llmlab.claims.ch02): C7's verdict from constructed rounds (no timing in a test)."""

import statistics

import pytest
from test_precision import step_times_of

from llmlab import claims, precision
from llmlab.claims import ch02
from llmlab.timing import Comparison, Load, Timing

SLOWER = (4.9, 5.0, 5.1, 5.2, 5.3)  # a step 5× the fp32 step's time: speed-up 0.2×


@pytest.mark.parametrize("bf16, fp16, verdict", [
    (SLOWER, SLOWER, "misleading"),  # both conclusively below 1.2×
    ((0.95, 0.97, 1.0, 1.02, 1.05), SLOWER, "misleading"),  # about as fast as fp32: still short of 1.2×
    ((0.55, 0.57, 0.6, 0.62, 0.64), SLOWER, "holds with conditions"),  # ≈1.7×, between the bars
    ((0.3, 0.31, 0.32, 0.33, 0.34), SLOWER, "holds"),  # ≈3.1×
    ((0.3, 0.31, 0.32, 0.33, 0.34), (0.7, 0.8, 0.9, 1.0, 1.1), "holds"),  # the best step decides; fp16 cannot lift it
    ((0.75, 0.8, 0.85, 0.9, 0.95), SLOWER, claims.INCONCLUSIVE),  # the rounds straddle 1.2× (ratio 0.83)
    ((0.3, 0.5, 0.8, 1.3, 2.0), SLOWER, claims.INCONCLUSIVE),  # spread too wide to say anything
])
def test_claim_c7_verdict_follows_the_rounds_or_says_inconclusive(monkeypatch, bf16, fp16, verdict):
    monkeypatch.setattr(precision.step_times, "recent", lambda: step_times_of(bf16, fp16))
    m = ch02.three_times_faster()
    assert m.verdict == verdict
    # the figures and their spreads, always; the one fp32 step time the speed-ups are relative to
    assert f"bf16 autocast {1 / statistics.median(bf16):.2f}× ±" in m.text and "fp32 step (20 ms ±0%)" in m.text
    assert m.value["fp16 + loss scaler speed-up"] == pytest.approx(1 / statistics.median(fp16))
    if verdict == claims.INCONCLUSIVE:
        assert "bf16 autocast: " in m.text  # says which comparison could not decide


@pytest.mark.parametrize("ratios, level", [
    ((0.9, 0.95, 1.0), (0, 0)), ((0.5, 0.55, 0.6), (1, 1)), ((0.2, 0.25, 0.3), (2, 2)),
    ((0.7, 0.8, 0.9), (0, 1)), ((0.3, 0.4, 0.5), (1, 2)), ((0.2, 0.5, 2.0), (0, 2)),
])
def test_speedup_level_is_the_range_the_rounds_allow(ratios, level):
    load = Load(1.0, 2)
    c = Comparison(Timing(ratios, 1, load), Timing((1.0,) * len(ratios), 1, load), ratios)
    assert ch02.speedup_level(c) == level
