"""Chapter 8's claims (llmlab.claims.ch08): C20, the parameters and FLOPs a token uses in a MoE layer; C19 with
constructed step times (no timing in a test); C21 alone and after the runs it shares with the chapter."""

import dataclasses
import functools

from llmlab import claims, lora, quant
from llmlab.claims import ch08
from llmlab.timing import Comparison, Load, Timing


def test_claim_c20_is_measured_and_holds():
    claim = claims.get("C20")
    assert claim.measure is ch08.moe_active_parameters
    m = claim.measure()
    measured_once = functools.wraps(claim.measure)(lambda: m)  # audit reads the source through __wrapped__
    assert claim.chapter == 8 and not claims.audit(dataclasses.replace(claim, measure=measured_once))
    assert m.verdict == "holds"
    assert 0.25 < m.value["active/total params"] < 0.26  # k/E of the experts, plus the router
    assert 2 < m.value["MoE/dense(H) FLOPs per token"] < 2.01  # 2 experts, plus the router's 2·C·E
    assert m.value["drop rate cf=None"] == 0


def test_claim_c19_prints_the_step_time_it_was_given_and_its_verdict_rests_on_bytes(monkeypatch):
    """The bytes already fail 90% (the frozen weights stay), so rounds that cannot decide the time leave the
    verdict where it is; the text carries the ratio, its spread and the busy-machine note (no timing here)."""
    load = Load(6.0, 2)
    ratios = (0.5, 0.6, 1.0, 1.5, 1.6)  # LoRA / full, round by round: spread too wide to say anything
    full = Timing((0.01,) * 5, 1, load)
    busy = Comparison(Timing(tuple(0.01 * r for r in ratios), 1, load), full, ratios)
    monkeypatch.setattr(lora.step_times, "recent", lambda: busy)
    m = ch08.lora_resources()
    assert m.verdict == "holds with conditions"
    assert m.value["fwd+bwd time LoRA/full (tiny)"] == 1.0
    assert "1.00× ±" in m.text and "not conclusive" in m.text


def test_claim_c21_trains_its_runs_alone_and_after_that_reads_them(one_thread):
    """Alone (nothing cached), C21 trains its fp32 and W4A8 runs itself; called again (as after chapter 8's QAT
    cell, which trains the same runs) it trains nothing and finds the same value and verdict. Both runs are
    deterministic, so the figures are equal exactly."""
    quant._trained.cache_clear()
    alone = ch08.quantized_training()
    assert quant._trained.cache_info().misses == 2 and quant._trained.cache_info().hits == 0
    again = claims.get("C21").measure()
    assert quant._trained.cache_info().misses == 2 and quant._trained.cache_info().hits == 2
    assert again.value == alone.value and again.verdict == alone.verdict == "holds with conditions"
    assert "60 AdamW steps" in alone.text
