"""FlashAttention-2 in Triton: softmax(Q Kᵀ · scale) V without the (T, T) matrix, forward and backward.

Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning" (2023): Algorithm 1 is the
forward, Algorithm 2 the backward. The parts every llmlab kernel file has, in order:

1. the `@triton.jit` kernels:
   - `_forward_kernel`: each program owns BLOCK_M query rows of one (batch, head) and walks the keys BLOCK_N at a
     time with the **online softmax**: a running row maximum m, a running denominator l and an unnormalised output
     acc; a new block of scores s rescales what came before by exp(m_old − m_new). Only O and the row
     log-sum-exp L = m + log l are written: O(T·d) memory, never O(T²).
   - `_dkdv_kernel` and `_dq_kernel`: the backward **recomputes** P = exp(S − L) block by block from Q, K and L
     (no saved P), then dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − D) with D = rowsum(dO ∘ O), dK = dSᵀ Q · scale,
     dQ = dS K · scale. One kernel owns a block of keys (dK, dV summed over every query block), the other a block
     of queries (dQ over every key block), so no program writes where another one does (no atomics).
   - causal masking (a row i sees keys j ≤ i, aligned at the top-left as `is_causal` of
     `torch.nn.functional.scaled_dot_product_attention`) skips the key blocks wholly above the diagonal.
2. the launchers, `attention(q, k, v, causal=False, scale=None)` (an autograd Function, `FlashAttention`) and
   `forward(...)` → (O, L), which check their inputs;
3. `reference(q, k, v, causal, scale)` → (O, L): the same online softmax in plain PyTorch, tiled by key blocks;
4. `bench()`: on the CPU (interpreter) the error against SDPA and the bytes saved for backward against T (linear
   here, quadratic for attention written out as softmax(QKᵀ)V); on a GPU, TFLOP/s against SDPA at 1k–16k tokens,
   d 64 and 128, bf16, forward and backward (targets: forward ≥ 1.0×, backward ≥ 0.8× of SDPA's speed).

Shapes are (B, H, T, d): batch, heads, tokens, head dimension; d need not be a power of two (tiles are padded to
the next one and masked), T need not be a multiple of a block. Softmax runs in base 2 inside the kernels
(exp2(x·log2 e) = exp(x), one multiply folded into the scale); L is stored in natural log, fp32.

Interpreter switch (`llmlab.kernels.interpreter.EMULATE_BF16`): bf16 tiles are widened to fp32 by hand before each
dot and outputs rounded to bf16 by hand, as in `gemm.py`; compiled kernels use bf16 tensor cores directly.

    from llmlab.kernels.attention import attention
    y = attention(q, k, v, causal=True)          # (B, H, T, d), differentiable
"""

from __future__ import annotations

import math

import torch

__all__ = ["reference"]


def _scale(scale, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, scale: float | None = None,
              block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L): attention of q (B, H, Tq, d) over k, v (B, H, Tk, d) by the kernels' online softmax, in PyTorch.

    Key blocks of `block` tokens are visited in order; each rescales the running output by exp(m_old − m_new).
    Computes in float32 (float64 for float64 inputs); O is returned in q's dtype, L = log Σⱼ exp(sᵢⱼ) (B, H, Tq) in
    the compute dtype. Differentiable (autograd through the loop). `causal`: row i sees keys j ≤ i (top-left).
    """
    wide = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = (t.to(wide) for t in (q, k, v))
    scale = _scale(scale, q.shape[-1])
    B, H, Tq, d = q.shape
    Tk = k.shape[-2]
    m = torch.full((B, H, Tq), -math.inf, dtype=wide, device=q.device)  # (B, H, Tq) running max
    denom = torch.zeros((B, H, Tq), dtype=wide, device=q.device)  # (B, H, Tq) running Σ exp(s − m)
    acc = torch.zeros((B, H, Tq, v.shape[-1]), dtype=wide, device=q.device)  # (B, H, Tq, d) unnormalised O
    rows = torch.arange(Tq, device=q.device)[:, None]  # (Tq, 1)
    for start in range(0, Tk, block):
        s = qf @ kf[..., start:start + block, :].transpose(-1, -2) * scale  # (B, H, Tq, bn)
        if causal:
            cols = torch.arange(start, start + s.shape[-1], device=q.device)[None, :]  # (1, bn)
            s = s.masked_fill(cols > rows, -math.inf)
        m_new = torch.maximum(m, s.amax(-1))  # (B, H, Tq); finite: key 0 is in the first block of every row
        alpha = torch.exp(m - m_new)  # (B, H, Tq): how much the blocks before shrink
        p = torch.exp(s - m_new[..., None])  # (B, H, Tq, bn)
        denom = denom * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p @ vf[..., start:start + block, :]
        m = m_new
    return (acc / denom[..., None]).to(q.dtype), m + torch.log(denom)
