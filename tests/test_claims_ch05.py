"""Chapter 5's claims (llmlab.claims.ch05): C15, the network advice priced by the α-β model."""

from llmlab import claims
from llmlab.claims import ch05


def test_claim_c15_is_computed_from_the_link_table():
    c15 = claims.get("C15")
    assert c15.measure is ch05.network_advice
    assert c15.chapter == 5 and claims.audit(c15) == []  # computed from cost.LINKS, nothing typed in
