"""Chapter 6's claims (llmlab.claims.ch06): C16, the material's warmup wastes update 0; C17, clipping a spike."""

from llmlab.claims import ch06


def test_claim_c16(one_thread):
    m = ch06.warmup()
    assert m.value["update 0 moved weights by (material)"] == 0.0
    assert m.value["update 0 moved weights by (ours)"] > 0.0


def test_claim_c17(one_thread):
    m = ch06.clipping()
    assert m.verdict == "holds with conditions", m.text
    assert m.value["loss after, clipped"] < m.value["loss after, unclipped"]
