"""The Triton interpreter's one workaround, shared by every kernel: bfloat16 done by hand.

Triton 3.9's interpreter (TRITON_INTERPRET=1, the CPU tier) keeps bfloat16 values as raw 16-bit integers:
`x + y` on two bf16 blocks adds their bit patterns, `tl.dot` on bf16 tiles returns garbage, widening a
bf16 subnormal to fp32 gives the wrong value, and its fp32 → bf16 cast truncates instead of rounding.

With the switch `EMULATE_BF16` on (only when interpreted), kernels widen bf16 to fp32 themselves (exact: a
bf16 is the top half of an fp32), compute in fp32, and round back to the nearest bf16, ties to even — what
PyTorch and a GPU do. Compiled Triton needs none of this and never takes this path.
"""

import triton
import triton.language as tl

from llmlab import runtime

EMULATE_BF16 = runtime.triton_interpreted()  # the one interpreter-only switch


@triton.jit
def bf16_to_fp32(v):
    """Widen bf16 to fp32 bit by bit: the 16 bits of a bf16 become the high half of the fp32."""
    return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def fp32_to_bf16(v):
    """Round fp32 to the nearest bf16, ties to even: add just under half of the 16 dropped bits' unit
    (0x7FFF), plus one more when the kept part is odd, then drop the low 16 bits."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
