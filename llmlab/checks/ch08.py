"""Checks for chapter 8's exercises (solutions/08_frontier.ipynb), each against llmlab's own implementation:

    from llmlab.checks import ch08 as check
    check.lora_layer(LoRA)                      # 8.1 a LoRA layer with merge and unmerge (ch08_lora, llmlab.lora)
    check.top2_router(top2_route)               # 8.2 the top-2 router with capacity (ch08_moe, llmlab.moe.route)
    check.lsq(LSQ, lsq_init_step)               # 8.3 LSQ as an autograd Function (ch08_lsq, llmlab.quant)
    check.nf4(nf4_quantize, nf4_dequantize)     # 8.4 NF4 with double quantization (ch08_nf4, llmlab.nf4)
    check.bias_balance(AuxFreeMoE)              # 8.5 an MoE layer balanced by an expert bias (ch08_balance, llmlab.moe)
"""

from llmlab.checks.ch08_balance import GAP, bias_balance
from llmlab.checks.ch08_lora import lora_layer
from llmlab.checks.ch08_lsq import lsq, lsq_inputs
from llmlab.checks.ch08_moe import FIELDS, top2_router
from llmlab.checks.ch08_nf4 import MARGIN, nf4, nf4_weight

__all__ = ["lora_layer", "top2_router", "FIELDS", "lsq", "lsq_inputs", "nf4", "nf4_weight", "MARGIN",
           "bias_balance", "GAP"]
