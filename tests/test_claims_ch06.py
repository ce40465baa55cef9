"""Chapter 6's claims (llmlab.claims.ch06): C16, warmup over the first steps swept against the peak LR; C17,
clipping a spike."""

from llmlab.claims import ch06
from llmlab.train.sweep import warmup_sweep


def test_claim_c16(one_thread):
    m = ch06.warmup()
    sweep = warmup_sweep.recent()  # the sweep the claim read: shown, not run a second time
    assert m.verdict == "holds with conditions", m.text  # tiny GPT, 3 seeds: every seed agrees by ≥ 0.2 nats
    assert m.value["best loss, warmup"] == sweep.mean(*sweep.compare_best()[1]) < m.value["best loss, no warmup"]
    assert m.value["highest stable peak LR, warmup"] > m.value["highest stable peak LR, no warmup"]
    assert "get_linear_schedule_with_warmup" in m.text


def test_claim_c17(one_thread):
    m = ch06.clipping()
    assert m.verdict == "holds with conditions", m.text
    assert m.value["loss after, clipped"] < m.value["loss after, unclipped"]
