"""Chapter 3's claims (llmlab.claims.ch03): C10, the planner against the ZeRO paper's figures; C9's verdict from
constructed rounds (no timing in a test)."""

import math
import statistics

import pytest

from llmlab import claims
from llmlab.claims import ch03
from llmlab.memory import checkpoint, planner
from llmlab.memory.checkpoint import StepTimes
from llmlab.timing import Load, Rounds, Timing


def test_claim_c10_reproduces_the_paper():
    m = ch03.zero_figures()
    assert m.verdict == "holds"
    assert [round(v, 1) for k, v in m.value.items() if k != "tiny measured/planned"] == list(
        planner.ZERO_PAPER_EXAMPLE["gb"])
    assert not claims.audit(claims.get("C10"))
    assert math.isclose(m.value["tiny measured/planned"], 1, rel_tol=1e-3)


def _step_times(ratios):
    """A StepTimes whose checkpointed steps take `ratios` × the plain step's 10 ms, round by round."""
    load = Load(1.0, 2)
    plain = tuple(0.01 for _ in ratios)
    samples = {"no checkpointing": plain, "llmlab checkpoint": tuple(0.01 * r for r in ratios),
               "torch.utils.checkpoint": tuple(0.01 * r for r in ratios), "forward only": tuple(0.0033 for _ in ratios)}
    return StepTimes("tiny GPT", Rounds({k: Timing(v, 1, load) for k, v in samples.items()}, load),
                     {"no checkpointing": 10.0, "llmlab checkpoint": 1.0, "torch.utils.checkpoint": 1.0})


@pytest.mark.parametrize("ratios, verdict", [
    ((1.30, 1.32, 1.33, 1.35, 1.36), "holds"),  # every round within +20-50%
    ((1.05, 1.06, 1.07, 1.08, 1.09), "holds with conditions"),  # every round below +20%
    ((1.10, 1.15, 1.25, 1.35, 1.40), claims.INCONCLUSIVE),  # the rounds straddle +20%
    ((0.8, 1.0, 1.3, 1.8, 2.6), claims.INCONCLUSIVE),  # spread too wide to say anything
])
def test_claim_c9_verdict_follows_the_rounds_or_says_inconclusive(monkeypatch, ratios, verdict):
    monkeypatch.setattr(checkpoint.step_times, "recent", lambda: _step_times(ratios))
    m = ch03.checkpoint_overhead()
    assert m.verdict == verdict
    assert f"{statistics.median(ratios):.2f}×" in m.text and "±" in m.text  # the figure and its spread, always


def test_claim_c9_names_selective_recompute_at_gpt3_scale(monkeypatch):
    """Korthikanti et al. 2022: a GPT-3 175B layer (s = 2048, h = 12288, a = 96) keeps 34·sbh + 5·as²b bytes, 34·sbh
    with selective recompute: 34 / (34 + 5as/h) = 34/114 of them (the planner adds the LayerNorms' statistics and
    the causal mask, 0.15% more to the first). Recompute FLOPs over a step's 3 forwards: the core's 4·s²·h per
    layer, under 1%; every layer's forward, just under a third (the head is not recomputed)."""
    monkeypatch.setattr(checkpoint.step_times, "recent", lambda: _step_times((1.30, 1.32, 1.33, 1.35, 1.36)))
    m = ch03.checkpoint_overhead()
    assert m.value["GPT-3 selective kept / none"] == pytest.approx(34 / 114, rel=2e-3)
    assert 0.005 < m.value["GPT-3 selective extra FLOPs"] < 0.01
    assert m.value["GPT-3 full extra FLOPs"] == pytest.approx(1 / 3, rel=0.01)
    assert "selective recompute of the attention core keeps 30%" in m.text
