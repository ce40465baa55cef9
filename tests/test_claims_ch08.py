"""Chapter 8's claims (llmlab.claims.ch08): C20, the parameters and FLOPs a token uses in a MoE layer."""

import dataclasses
import functools

from llmlab import claims
from llmlab.claims import ch08


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
