"""Chapter 3's claims (llmlab.claims.ch03): C10, the planner against the ZeRO paper's figures."""

import math

from llmlab import claims
from llmlab.claims import ch03
from llmlab.memory import planner


def test_claim_c10_reproduces_the_paper():
    m = ch03.zero_figures()
    assert m.verdict == "holds"
    assert [round(v, 1) for k, v in m.value.items() if k != "tiny measured/planned"] == list(
        planner.ZERO_PAPER_EXAMPLE["gb"])
    assert not claims.audit(claims.get("C10"))
    assert math.isclose(m.value["tiny measured/planned"], 1, rel_tol=1e-3)
