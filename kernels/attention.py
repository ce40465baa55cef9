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

import functools
import math

import torch
import triton
import triton.language as tl
from llmlab.kernels.interpreter import EMULATE_BF16, bf16_to_fp32, fp32_to_bf16

from llmlab import runtime

__all__ = ["DTYPES", "FlashAttention", "attention", "forward", "reference", "bench"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x · LOG2E), folded into the scale on the host in float64


@triton.jit
def _tile(ptr, rows, n_rows, D, BLOCK_D: tl.constexpr, WIDEN: tl.constexpr):
    """The (len(rows), BLOCK_D) tile of a contiguous (T, d) matrix at `ptr`, zero past its end (rows ≥ n_rows,
    columns ≥ d); bf16 widened to fp32 when WIDEN."""
    dims = tl.arange(0, BLOCK_D)
    t = tl.load(ptr + rows[:, None] * D + dims[None, :], mask=(rows[:, None] < n_rows) & (dims[None, :] < D), other=0.0)
    return bf16_to_fp32(t) if WIDEN else t


@triton.jit
def _put(ptr, value, rows, n_rows, D, BLOCK_D: tl.constexpr, NARROW: tl.constexpr):
    """Store a (len(rows), BLOCK_D) tile into a contiguous (T, d) matrix in its dtype (bf16 rounded by hand when
    NARROW), masked to the matrix."""
    dims = tl.arange(0, BLOCK_D)
    value = fp32_to_bf16(value) if NARROW else value.to(ptr.dtype.element_ty)
    tl.store(ptr + rows[:, None] * D + dims[None, :], value, mask=(rows[:, None] < n_rows) & (dims[None, :] < D))


@triton.jit
def _scores(q, k, rows, cols, T_K, scale_log2, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr):
    """S · log2 e = Q Kᵀ · scale · log2 e for one (BLOCK_M, BLOCK_N) block; −inf where a key is past the end or,
    causal, after the row."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=ACC) * scale_log2  # (BLOCK_M, BLOCK_N)
    seen = cols[None, :] < T_K
    if CAUSAL:
        seen = seen & (cols[None, :] <= rows[:, None])
    return tl.where(seen, s, float("-inf"))


@triton.jit
def _forward_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, scales_ptr, T_Q, T_K, D,
                    CAUSAL: tl.constexpr, WIDEN: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Algorithm 1 of FlashAttention-2 for BLOCK_M query rows of one (batch, head); writes O and L · log2 e."""
    start_m, bh = tl.program_id(0), tl.program_id(1)
    scale_log2 = tl.load(scales_ptr + 1)  # scale · log2 e, in the compute dtype
    q_ptr, o_ptr = q_ptr + bh * T_Q * D, o_ptr + bh * T_Q * D  # this head's (T_Q, d) matrices
    k_ptr, v_ptr = k_ptr + bh * T_K * D, v_ptr + bh * T_K * D  # this head's (T_K, d) matrices
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    q = _tile(q_ptr, rows, T_Q, D, BLOCK_D, WIDEN)  # (BLOCK_M, BLOCK_D)
    m = tl.full((BLOCK_M,), float("-inf"), ACC)  # running row max of S · log2 e
    denom = tl.zeros((BLOCK_M,), ACC)  # running Σ exp2(s − m)
    acc = tl.zeros((BLOCK_M, BLOCK_D), ACC)  # running unnormalised O
    end = T_K
    if CAUSAL:
        end = tl.minimum(T_K, (start_m + 1) * BLOCK_M)  # key blocks past the block's last row are not seen
    for start_n in range(0, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        k = _tile(k_ptr, cols, T_K, D, BLOCK_D, WIDEN)  # (BLOCK_N, BLOCK_D)
        v = _tile(v_ptr, cols, T_K, D, BLOCK_D, WIDEN)  # (BLOCK_N, BLOCK_D)
        s = _scores(q, k, rows, cols, T_K, scale_log2, CAUSAL, PRECISION, ACC)  # (BLOCK_M, BLOCK_N)
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: key 0 is in the first block, seen by every row
        alpha = tl.exp2(m - m_new)  # (BLOCK_M,) how much the blocks before shrink
        p = tl.exp2(s - m_new[:, None])  # (BLOCK_M, BLOCK_N)
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=ACC)
        m = m_new
    _put(o_ptr, acc / denom[:, None], rows, T_Q, D, BLOCK_D, WIDEN)
    tl.store(lse_ptr + bh * T_Q + rows, m + tl.log2(denom), mask=rows < T_Q)  # L · log2 e (the launcher: × ln 2)


@triton.jit
def _probabilities(q, k, rows, cols, lse_ptr, T_Q, T_K, scale_log2, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                   ACC: tl.constexpr):
    """P = exp(S − L) for one block, recomputed from Q, K and the saved log-sum-exp; 0 on padded rows."""
    lse2 = tl.load(lse_ptr + rows, mask=rows < T_Q, other=0.0)  # (BLOCK_M,) L · log2 e, as the forward wrote it
    p = tl.exp2(_scores(q, k, rows, cols, T_K, scale_log2, CAUSAL, PRECISION, ACC) - lse2[:, None])
    return tl.where(rows[:, None] < T_Q, p, 0.0)  # (BLOCK_M, BLOCK_N)


@triton.jit
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, scales_ptr, T_Q, T_K, D,
                 CAUSAL: tl.constexpr, WIDEN: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Algorithm 2's outer loop for BLOCK_N keys: dV = Σ Pᵀ dO and dK = Σ dSᵀ Q · scale over the query blocks."""
    start_n, bh = tl.program_id(0), tl.program_id(1)
    scale, scale_log2 = tl.load(scales_ptr), tl.load(scales_ptr + 1)
    q_ptr, do_ptr = q_ptr + bh * T_Q * D, do_ptr + bh * T_Q * D
    k_ptr, v_ptr = k_ptr + bh * T_K * D, v_ptr + bh * T_K * D
    dk_ptr, dv_ptr = dk_ptr + bh * T_K * D, dv_ptr + bh * T_K * D
    lse_ptr, delta_ptr = lse_ptr + bh * T_Q, delta_ptr + bh * T_Q
    cols = start_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    k = _tile(k_ptr, cols, T_K, D, BLOCK_D, WIDEN)  # (BLOCK_N, BLOCK_D)
    v = _tile(v_ptr, cols, T_K, D, BLOCK_D, WIDEN)  # (BLOCK_N, BLOCK_D)
    dk = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    dv = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    begin = 0
    if CAUSAL:
        begin = (start_n * BLOCK_N) // BLOCK_M * BLOCK_M  # rows before the block's first key see none of it
    for start_m in range(begin, T_Q, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
        q = _tile(q_ptr, rows, T_Q, D, BLOCK_D, WIDEN)  # (BLOCK_M, BLOCK_D)
        do = _tile(do_ptr, rows, T_Q, D, BLOCK_D, WIDEN)  # (BLOCK_M, BLOCK_D)
        delta = tl.load(delta_ptr + rows, mask=rows < T_Q, other=0.0)  # (BLOCK_M,) rowsum(dO ∘ O)
        p = _probabilities(q, k, rows, cols, lse_ptr, T_Q, T_K, scale_log2, CAUSAL, PRECISION, ACC)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION, out_dtype=ACC)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION, out_dtype=ACC)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])  # (BLOCK_M, BLOCK_N)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION, out_dtype=ACC)
    _put(dk_ptr, dk * scale, cols, T_K, D, BLOCK_D, WIDEN)
    _put(dv_ptr, dv, cols, T_K, D, BLOCK_D, WIDEN)


@triton.jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, scales_ptr, T_Q, T_K, D,
               CAUSAL: tl.constexpr, WIDEN: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dQ = Σ dS K · scale over the key blocks, for BLOCK_M query rows."""
    start_m, bh = tl.program_id(0), tl.program_id(1)
    scale, scale_log2 = tl.load(scales_ptr), tl.load(scales_ptr + 1)
    q_ptr, do_ptr, dq_ptr = q_ptr + bh * T_Q * D, do_ptr + bh * T_Q * D, dq_ptr + bh * T_Q * D
    k_ptr, v_ptr = k_ptr + bh * T_K * D, v_ptr + bh * T_K * D
    lse_ptr, delta_ptr = lse_ptr + bh * T_Q, delta_ptr + bh * T_Q
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    q = _tile(q_ptr, rows, T_Q, D, BLOCK_D, WIDEN)  # (BLOCK_M, BLOCK_D)
    do = _tile(do_ptr, rows, T_Q, D, BLOCK_D, WIDEN)  # (BLOCK_M, BLOCK_D)
    delta = tl.load(delta_ptr + rows, mask=rows < T_Q, other=0.0)  # (BLOCK_M,)
    dq = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    end = T_K
    if CAUSAL:
        end = tl.minimum(T_K, (start_m + 1) * BLOCK_M)
    for start_n in range(0, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        k = _tile(k_ptr, cols, T_K, D, BLOCK_D, WIDEN)  # (BLOCK_N, BLOCK_D)
        v = _tile(v_ptr, cols, T_K, D, BLOCK_D, WIDEN)  # (BLOCK_N, BLOCK_D)
        p = _probabilities(q, k, rows, cols, lse_ptr, T_Q, T_K, scale_log2, CAUSAL, PRECISION, ACC)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION, out_dtype=ACC)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])  # (BLOCK_M, BLOCK_N)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION, out_dtype=ACC)
    _put(dq_ptr, dq * scale, rows, T_Q, D, BLOCK_D, WIDEN)


# -- the launchers --------------------------------------------------------------------------------------------
_INTERPRETED = {"BLOCK_M": 16, "BLOCK_N": 16}  # the interpreter runs programs one by one in NumPy: small tiles
_CONFIGS = {  # (BLOCK_M, BLOCK_N, warps, stages), autotuned per (T_Q, T_K, d) on a GPU
    "forward": [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4), (128, 32, 4, 4)],
    "backward": [(64, 64, 4, 2), (32, 128, 4, 2), (128, 64, 8, 2), (64, 128, 8, 2)],
}
_ACC = {torch.float64: tl.float64}  # accumulate in float64 for float64 inputs, else in float32


@functools.cache
def _kernel(name: str):
    """`name`'s kernel, autotuned on a GPU over `_CONFIGS`; under the interpreter the kernel itself (fixed tiles)."""
    kernel = {"forward": _forward_kernel, "dkdv": _dkdv_kernel, "dq": _dq_kernel}[name]
    if runtime.triton_interpreted():
        return kernel
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
               for m, n, w, st in _CONFIGS["forward" if name == "forward" else "backward"]]
    return triton.autotune(configs=configs, key=["T_Q", "T_K", "D", "CAUSAL"])(kernel)


def _launch(name: str, grid_rows: str, shape: tuple[int, int, int, int, int], *args, causal: bool, dtype):
    """Launch kernel `name` over (row blocks, B·H): rows blocked by BLOCK_M ('m': queries) or BLOCK_N ('n': keys)."""
    B, H, T_Q, T_K, d = shape
    rows = T_Q if grid_rows == "m" else T_K
    grid = lambda meta: (triton.cdiv(rows, meta[f"BLOCK_{grid_rows.upper()}"]), B * H)  # noqa: E731
    fixed = _INTERPRETED if runtime.triton_interpreted() else {}
    _kernel(name)[grid](*args, T_Q, T_K, d, CAUSAL=causal, WIDEN=EMULATE_BF16 and dtype == torch.bfloat16,
                        PRECISION=_precision(dtype), ACC=_ACC.get(dtype, tl.float32),
                        BLOCK_D=max(16, triton.next_power_of_2(d)), **fixed)


def _precision(dtype: torch.dtype) -> str:
    """What `tl.dot` multiplies in: TF32 for fp32 where PyTorch allows it for its own matmuls (as `gemm.py`)."""
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _scale(scale, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def _check(q, k, v, causal, scale) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, tokens, head dim), got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}.dtype={t.dtype} not supported; use one of {[str(x) for x in DTYPES]}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}, q is {q.dtype} on {q.device}: make them alike")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, heads and head dim")
    if not 1 <= q.shape[3] <= 256:
        raise ValueError(f"head dim {q.shape[3]} must be between 1 and 256 (one tile holds a row of q)")
    if k.shape[2] == 0:
        raise ValueError("k and v have no tokens: attention over nothing is undefined")
    if not isinstance(causal, bool):
        raise ValueError(f"causal={causal!r} must be True or False")
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                  and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r} must be a positive finite number (None: 1/sqrt(head dim))")


def _scales(scale: float, like: torch.Tensor) -> torch.Tensor:
    """[scale, scale · log2 e] in the compute dtype, computed in float64: read by the kernels from memory, so a
    float64 run is not rounded to the fp32 that Triton gives a Python float argument."""
    wide = torch.promote_types(like.dtype, torch.float32)
    return torch.tensor([scale, scale * LOG2E], dtype=torch.float64).to(device=like.device, dtype=wide)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
            scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L) by `_forward_kernel`: O (B, H, Tq, d) in q's dtype, L (B, H, Tq) the rows' log-sum-exp (natural log,
    fp32, or float64 for float64 inputs). No autograd: `attention` is the differentiable one."""
    _check(q, k, v, causal, scale)
    o, lse2 = _forward(*(t.contiguous() for t in (q, k, v)), causal, _scale(scale, q.shape[-1]))
    return o, lse2 / LOG2E


def _forward(q, k, v, causal: bool, scale: float):
    B, H, T_Q, d = q.shape
    o = torch.empty_like(q)  # (B, H, Tq, d)
    lse2 = torch.empty((B, H, T_Q), device=q.device, dtype=torch.promote_types(q.dtype, torch.float32))
    if T_Q:
        _launch("forward", "m", (B, H, T_Q, k.shape[2], d), q, k, v, o, lse2, _scales(scale, q),
                causal=causal, dtype=q.dtype)
    return o, lse2


class FlashAttention(torch.autograd.Function):
    """softmax(Q Kᵀ · scale) V, FlashAttention-2 (Dao 2023): forward Algorithm 1 (online softmax; saves O and the
    log-sum-exp L, O(T·d)); backward Algorithm 2 (P recomputed from Q, K, L; D = rowsum(dO ∘ O) computed once by
    PyTorch, then dK, dV per key block and dQ per query block)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        q, k, v = (t.contiguous() for t in (q, k, v))
        o, lse2 = _forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse2)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse2 = ctx.saved_tensors
        do = do.contiguous()  # (B, H, Tq, d)
        wide = lse2.dtype
        delta = (do.to(wide) * o.to(wide)).sum(-1)  # (B, H, Tq): rowsum(dO ∘ O) = rowsum(P ∘ dP)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        B, H, T_Q, d = q.shape
        shape, scales = (B, H, T_Q, k.shape[2], d), _scales(ctx.scale, q)
        if T_Q:
            _launch("dkdv", "n", shape, q, k, v, do, lse2, delta, dk, dv, scales, causal=ctx.causal, dtype=q.dtype)
            _launch("dq", "m", shape, q, k, v, do, lse2, delta, dq, scales, causal=ctx.causal, dtype=q.dtype)
        else:
            dk.zero_(), dv.zero_()
        return dq, dk, dv, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale) v for q (B, H, Tq, d) and k, v (B, H, Tk, d), differentiable (`FlashAttention`);
    `scale` defaults to 1/√d and `causal` masks keys after each row (top-left aligned, as SDPA's `is_causal`).
    fp16, bf16, fp32 (TF32 where PyTorch allows it) and float64; inputs are made contiguous first."""
    _check(q, k, v, causal, scale)
    return FlashAttention.apply(q, k, v, causal, _scale(scale, q.shape[-1]))


# -- the reference ---------------------------------------------------------------------------------------------
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


# -- the bench -------------------------------------------------------------------------------------------------
def written_out(q, k, v, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Attention as the formula reads, softmax(Q Kᵀ · scale) V with the (Tq, Tk) matrix materialised: the memory
    FlashAttention avoids (the bench counts what autograd saves of it)."""
    s = q @ k.transpose(-1, -2) * _scale(scale, q.shape[-1])  # (B, H, Tq, Tk)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.softmax(s, dim=-1) @ v  # (B, H, Tq, d)


CPU_TOKENS = (64, 128, 256)  # the CPU bench's sequence lengths: saved bytes against T
GPU_TOKENS = (1024, 2048, 4096, 8192, 16384)
TARGETS = {"forward": 1.0, "backward": 0.8}  # of SDPA's speed, on a GPU (issue 29)


def bench(sizes=None) -> list[dict]:
    """On the CPU tier: per sequence length, the bytes autograd saves for backward beyond q, k, v — FlashAttention
    (O and L: linear in T) against attention written out (the (T, T) probabilities: quadratic) — and the largest
    error of O and of dQ, dK, dV against float64 SDPA. On a GPU: `sweep`."""
    from llmlab.memory.measure import saved_activation_bytes  # the bench's tool, not the kernel's

    if runtime.tier().is_gpu:
        return sweep(sizes)
    rows = []
    for T in sizes or CPU_TOKENS:
        q, k, v = (torch.randn(1, 2, T, 32, requires_grad=True) for _ in range(3))  # (B, H, T, d)
        o, flash_bytes = saved_activation_bytes(attention, q, k, v, causal=True, exclude=(q, k, v))
        _, naive_bytes = saved_activation_bytes(written_out, q, k, v, causal=True, exclude=(q, k, v))
        g = torch.randn_like(o)  # (B, H, T, d)
        grads = torch.autograd.grad(o, (q, k, v), g)
        wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
        exact = torch.nn.functional.scaled_dot_product_attention(*wide, is_causal=True)
        exact_grads = torch.autograd.grad(exact, wide, g.double())
        rows.append({"impl": "flash attention (triton, interpreted)", "peer": "attention written out", "size": T,
                     "d": 32, "causal": True, "impl_saved_bytes": flash_bytes, "peer_saved_bytes": naive_bytes,
                     "ratio": flash_bytes / naive_bytes,
                     "max_err_out": (o.double() - exact).abs().max().item(),
                     "max_err_grads": max((a.double() - b).abs().max().item()
                                          for a, b in zip(grads, exact_grads, strict=True))})
    return rows


def sweep(sizes=None) -> list[dict]:
    """The GPU bench: bf16, d 64 and 128, causal, at `sizes` tokens (1k–16k), B·T = 16k tokens and H·d = 2048;
    forward and backward each timed against `torch.nn.functional.scaled_dot_product_attention` (its fastest
    backend here) in the same interleaved rounds. TFLOP/s count 4·B·H·T²·d for the forward and 2.5× that for the
    backward (five matmuls against two), halved for causal. `of_sdpa` = SDPA's time / ours: ≥ 1 is as fast as it
    (targets `TARGETS`). Under smoke mode the same code runs on the CPU, interpreted, on tiny sizes."""
    from llmlab.timing import compare  # the bench's clock, not the kernel's

    device = runtime.device()
    real = device.type == "cuda"
    rows = []
    for d in (64, 128) if real else (16, 24):
        for T in sizes or (GPU_TOKENS if real else (32, 48)):
            B, H = max(1, 16384 // T) if real else 1, 2048 // d if real else 2
            q, k, v = (torch.randn(B, H, T, d, device=device, dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))  # (B, H, T, d)
            sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, is_causal=True)
            ours = functools.partial(attention, causal=True)
            outs = {name: fn(q, k, v) for name, fn in (("ours", ours), ("sdpa", sdpa))}
            g = torch.randn_like(outs["ours"])
            backward = {name: functools.partial(torch.autograd.grad, o, (q, k, v), g, retain_graph=True)
                        for name, o in outs.items()}
            flops = 4 * B * H * T * T * d / 2  # causal: half the (T, T) blocks
            err = ((outs["ours"].float() - outs["sdpa"].float()).norm() / outs["sdpa"].float().norm()).item()
            for part, impl, peer, work in (("forward", functools.partial(ours, q, k, v),
                                            functools.partial(sdpa, q, k, v), flops),
                                           ("backward", backward["ours"], backward["sdpa"], 2.5 * flops)):
                c = compare(impl, peer, device=device)
                rows.append({"impl": f"flash attention {part} (triton)", "peer": f"SDPA {part}", "size": T, "d": d,
                             "batch": B, "heads": H, "dtype": "bfloat16", "causal": True, **c.row(),
                             "impl_TFLOP/s": work / c.impl.seconds / 1e12, "peer_TFLOP/s": work / c.peer.seconds / 1e12,
                             "of_sdpa": 1 / c.ratio, "target": TARGETS[part],
                             "meets": "yes" if 1 / c.ratio >= TARGETS[part] else "no", "rel_err_out": err})
    return rows
