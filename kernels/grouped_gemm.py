"""A grouped GEMM for mixture-of-experts layers: Y[rows of group g] = X[rows of group g] @ W[g] (+ b[g]), G groups in
one launch, groups of any size (0 included), fp32 accumulation.

An MoE layer sorts its token rows by expert (`llmlab.moe_dispatch`): expert g owns the next counts[g] rows. MegaBlocks
(Gale et al. 2023) computes them *dropless* — no capacity, no padding to a common size — and torch's
`torch._grouped_mm` takes the same input: X (M, K) sorted by group, W (G, K, N), and `offsets` (G,), the cumulative
ends of the groups (group g is rows offsets[g−1] … offsets[g] − 1, offsets[−1] = M). That is this file's convention.

The parts every llmlab kernel file has, in order:
1. the kernels:
   - `_grouped_mm_kernel`: each program computes one (BLOCK_M, BLOCK_N) tile of Y from one group. The grid is 1-D
     over a bound on the row tiles × cdiv(N, BLOCK_N): each group needs cdiv(size_g, BLOCK_M) row tiles, at most
     (M + G·(BLOCK_M − 1)) // BLOCK_M in all, whatever the sizes. **The kernel walks the offsets itself** (rather
     than the launcher building a tile → group map on the host): every program loads the G ends as one vector,
     turns them into tiles per group and their running sum (`tl.cumsum`), and finds its group as the number of
     groups whose tiles end at or before its row tile. Programs past the last real tile return at once. So the
     group sizes never travel to the host: no synchronisation per call, the launch can be captured in a CUDA graph,
     and the grid does not depend on BLOCK_M's value outside the autotuner's grid function. The row tiles are
     ordered as `gemm.py`'s (groups of GROUP_M rows of tiles share W's tiles in L2). Rows, K and N are masked on
     every edge: a row tile never reads or writes the next group's rows.
   - `_grouped_wgrad_kernel`: dW[g] = X_gᵀ @ dY_g, a (K, N) product per group summed over that group's rows — the
     reduction length differs per group, so it is a second kernel: one program per (group, K tile, N tile) walks its
     group's rows BLOCK_K at a time. An empty group writes dW[g] = 0.
2. the launchers `grouped_mm(x, w, offsets, bias=None)` and `grouped_weight_grad(x, dy, offsets)`, which check
   their inputs, and `grouped_linear` (the autograd Function `GroupedMM`): the backward's dX = dY_g @ W_gᵀ is the
   same forward kernel with W's strides transposed (no copy), dW the second kernel, db a per-group sum of dY.
3. `reference(x, w, offsets, bias=None)` and `reference_weight_grad(x, dy, offsets)`: a loop of matmuls per group.
4. `bench()` (`llmlab bench grouped_gemm`): on a GPU, the kernel against `torch._grouped_mm` (where torch has it)
   and the per-expert loop of matmuls, forward and weight gradient, at MoE sizes; on the CPU, correctness only.

Block sizes are autotuned on a GPU over `llmlab.kernels.gemm_configs` (the GEMM's tiles for the chip), keyed on
(N, K, G) and not on M: an MoE layer's M moves with its routing, and a new M would re-tune every step. Under the
Triton interpreter (CPU tier) the GEMM's one small config is used. float64 inputs accumulate in float64 (exact
tests); the others in fp32. fp32 inputs go through TF32 where PyTorch allows it for its own matmuls (`gemm.py`).

Interpreter switch (`llmlab.kernels.interpreter.EMULATE_BF16`): bf16 tiles are widened to fp32 by hand before each
dot and the result rounded to bf16 by hand, as in `gemm.py`; compiled kernels use bf16 tensor cores directly.

    from llmlab.kernels.grouped_gemm import grouped_linear
    offsets = counts.cumsum(0).to(torch.int32)   # (G,) ends of each expert's rows in x
    y = grouped_linear(x, w, offsets, b)         # x (M, K), w (G, K, N), b (G, N) -> y (M, N), differentiable
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from llmlab.kernels import gemm, gemm_configs
from llmlab.kernels.interpreter import EMULATE_BF16, bf16_to_fp32, fp32_to_bf16

from llmlab import runtime
from llmlab.timing import compare

__all__ = ["DTYPES", "grouped_mm", "grouped_weight_grad", "GroupedMM", "grouped_linear", "reference",
           "reference_weight_grad", "bench"]

DTYPES = (*gemm.DTYPES, torch.float64)
_ACC = {torch.float64: tl.float64}  # accumulate in float64 for float64 inputs, else in float32


@triton.jit
def _ordered(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(tile row, tile column) of program `pid` in `gemm.py`'s grouped order (`gemm.program_tile` in Python)."""
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)  # the last band may be shorter
    return first_pid_m + (pid % num_pid_in_group) % group_size_m, (pid % num_pid_in_group) // group_size_m


@triton.jit
def _grouped_mm_kernel(
    x_ptr, w_ptr, y_ptr, bias_ptr, ends_ptr,
    M, N, K, G,
    stride_xm, stride_xk, stride_wg, stride_wk, stride_wn, stride_ym, stride_yn, stride_bg, stride_bn,
    HAS_BIAS: tl.constexpr, BF16_VIA_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, ACC: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # --- which row tile and column tile this program owns ---
    num_pid_m = (M + G * (BLOCK_M - 1)) // BLOCK_M  # row tiles, at most, over all groups
    pid_m, pid_n = _ordered(tl.program_id(axis=0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)

    # --- which group that row tile is in: walk the offsets, as one vector ---
    g = tl.arange(0, BLOCK_G)  # (BLOCK_G,) groups, padded to a power of two
    ends = tl.load(ends_ptr + g, mask=g < G, other=M)  # (BLOCK_G,) past G: empty groups at M
    starts = tl.where(g == 0, 0, tl.load(ends_ptr + g - 1, mask=(g > 0) & (g <= G), other=M))  # (BLOCK_G,)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M  # (BLOCK_G,) row tiles of each group
    tiles_to = tl.cumsum(tiles, axis=0)  # (BLOCK_G,) row tiles up to and including each group
    group = tl.sum((tiles_to <= pid_m).to(tl.int32), axis=0)  # groups wholly before this tile
    if group >= G:
        return  # past the last real tile (the grid is a bound)
    mine = g == group  # (BLOCK_G,) one-hot
    row_end = tl.sum(tl.where(mine, ends, 0), axis=0)
    row0 = tl.sum(tl.where(mine, starts + (pid_m - (tiles_to - tiles)) * BLOCK_M, 0), axis=0)

    rows = row0 + tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows of X and Y, in this group
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) columns of Y
    offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    in_rows = rows < row_end  # (BLOCK_M,) never the next group's rows
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk  # (BLOCK_M, BLOCK_K)
    w_ptrs = (w_ptr + group.to(tl.int64) * stride_wg
              + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn)  # (BLOCK_K, BLOCK_N) of W[group]

    # --- the K loop: one (BLOCK_M, BLOCK_K) x (BLOCK_K, BLOCK_N) product per step, summed in ACC ---
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=in_rows[:, None] & (offs_k[None, :] < k_left), other=0.0)  # (BLOCK_M, BLOCK_K)
        b = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)  # (BLOCK_K, BLOCK_N)
        if BF16_VIA_FP32:  # (inlined, not a helper: each @jit call costs the interpreter a patch of triton.language)
            a = bf16_to_fp32(a)
            b = bf16_to_fp32(b)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION, out_dtype=ACC)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    # --- epilogue: the group's bias, one cast, one masked store ---
    if HAS_BIAS:
        bias = tl.load(bias_ptr + group.to(tl.int64) * stride_bg + offs_n * stride_bn, mask=offs_n < N, other=0.0)
        bias = bf16_to_fp32(bias) if BF16_VIA_FP32 else bias
        acc += bias.to(ACC)[None, :]  # (BLOCK_N,) broadcast over the rows
    y = fp32_to_bf16(acc) if BF16_VIA_FP32 else acc.to(y_ptr.dtype.element_ty)
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn  # (BLOCK_M, BLOCK_N)
    tl.store(y_ptrs, y, mask=in_rows[:, None] & (offs_n[None, :] < N))


@triton.jit
def _grouped_wgrad_kernel(
    x_ptr, dy_ptr, dw_ptr, ends_ptr,
    N, K,
    stride_xm, stride_xk, stride_dym, stride_dyn, stride_dwg, stride_dwk, stride_dwn,
    BF16_VIA_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # dW[g] (K, N) = X_gᵀ (K, rows) @ dY_g (rows, N): a GEMM whose "M" is K and whose reduction runs over the rows
    num_pid_m, num_pid_n = tl.cdiv(K, BLOCK_M), tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(axis=0)
    group = pid // (num_pid_m * num_pid_n)
    pid_m, pid_n = _ordered(pid % (num_pid_m * num_pid_n), num_pid_m, num_pid_n, GROUP_M)
    row_end = tl.load(ends_ptr + group)
    row0 = tl.load(ends_ptr + group - 1, mask=group > 0, other=0)

    offs_k = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows of dW[group]: K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) columns of dW[group]: N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for r in range(row0, row_end, BLOCK_K):  # this group's rows, BLOCK_K at a time (none for an empty group)
        rows = r + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
        in_rows = rows < row_end
        xt = tl.load(x_ptr + rows.to(tl.int64)[None, :] * stride_xm + offs_k[:, None] * stride_xk,
                     mask=(offs_k[:, None] < K) & in_rows[None, :], other=0.0)  # (BLOCK_M, BLOCK_K) of X_gᵀ
        dy = tl.load(dy_ptr + rows.to(tl.int64)[:, None] * stride_dym + offs_n[None, :] * stride_dyn,
                     mask=in_rows[:, None] & (offs_n[None, :] < N), other=0.0)  # (BLOCK_K, BLOCK_N)
        if BF16_VIA_FP32:
            xt = bf16_to_fp32(xt)
            dy = bf16_to_fp32(dy)
        acc = tl.dot(xt, dy, acc, input_precision=INPUT_PRECISION, out_dtype=ACC)
    dw = fp32_to_bf16(acc) if BF16_VIA_FP32 else acc.to(dw_ptr.dtype.element_ty)
    dw_ptrs = (dw_ptr + group.to(tl.int64) * stride_dwg
               + offs_k[:, None] * stride_dwk + offs_n[None, :] * stride_dwn)  # (BLOCK_M, BLOCK_N)
    tl.store(dw_ptrs, dw, mask=(offs_k[:, None] < K) & (offs_n[None, :] < N))


# -- the launchers ------------------------------------------------------------------------------------------------

def _check_tensor(name: str, t, dim: int, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D ({what}), got {t.dim()}-D with shape {tuple(t.shape)}")
    if t.dtype not in DTYPES:
        raise ValueError(f"{name}.dtype={t.dtype} not supported; use one of {[str(d) for d in DTYPES]}")


def _check_offsets(offsets, groups: int, rows: int, device, check_values: bool) -> None:
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
        what = (f"{offsets.dim()}-D {offsets.dtype}" if isinstance(offsets, torch.Tensor) else type(offsets).__name__)
        raise ValueError(f"offsets must be a 1-D int32 or int64 tensor (the cumulative end row of each group), "
                         f"got {what}")
    if offsets.numel() != groups:
        raise ValueError(f"offsets has {offsets.numel()} entries; w has {groups} groups (one end row per group)")
    if offsets.device != device:
        raise ValueError(f"offsets is on {offsets.device}, x on {device}")
    if check_values and rows > torch.iinfo(torch.int32).max:
        raise ValueError(f"x has {rows} rows: offsets are int32 in the kernel, at most {torch.iinfo(torch.int32).max}")
    if check_values:  # reads the G ends on the host: one synchronisation (trusted callers pass check_offsets=False)
        ends = offsets.tolist()
        if any(b < a for a, b in zip([0, *ends], ends, strict=False)) or ends[-1] != rows:
            raise ValueError(f"offsets={ends} must be non-decreasing, from ≥ 0, and end at x's {rows} rows "
                             f"(group g is rows offsets[g-1] … offsets[g] − 1)")


def _check(x, w, offsets, bias, check_offsets: bool) -> None:
    _check_tensor("x", x, 2, "rows sorted by group, K")
    _check_tensor("w", w, 3, "groups, K, N")
    if x.dtype != w.dtype:
        raise ValueError(f"x.dtype={x.dtype} and w.dtype={w.dtype} differ; cast one of them")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device} and w on {w.device}; move them to one device")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"inner dimensions differ: x is {tuple(x.shape)}, w is {tuple(w.shape)} "
                         f"(x.shape[1]={x.shape[1]} != w.shape[1]={w.shape[1]})")
    if w.shape[0] == 0:
        raise ValueError("w has 0 groups; give it at least one")
    _check_offsets(offsets, w.shape[0], x.shape[0], x.device, check_offsets)
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (w.shape[0], w.shape[2])
                             or bias.dtype != x.dtype or bias.device != x.device):
        got = f"{tuple(bias.shape)} {bias.dtype} on {bias.device}" if isinstance(bias, torch.Tensor) else \
            type(bias).__name__
        raise ValueError(f"bias must be a ({w.shape[0]}, {w.shape[2]}) {x.dtype} tensor on {x.device} (one row per "
                         f"group), got {got}")


def _out(out, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, device=like.device, dtype=like.dtype)
    if out.shape != shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"out must be {shape} {like.dtype} on {like.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    return out


def _flags(dtype: torch.dtype) -> dict:
    """The kernels' dtype switches: bf16 by hand when interpreted, the dot's precision, the accumulator."""
    precision = "fp64" if dtype == torch.float64 else gemm._precision(dtype)
    return {"BF16_VIA_FP32": EMULATE_BF16 and dtype == torch.bfloat16,
            "INPUT_PRECISION": "tf32" if precision == "tf32" else "ieee", "ACC": _ACC.get(dtype, tl.float32)}


@functools.cache
def _tuned(name: str, where: str, precision: str):
    """Kernel `name` ('mm' or 'wgrad') autotuned over the GEMM's configs for `where` and `precision`, keyed on
    (N, K, G) — never M, which moves with the routing (module docstring)."""
    kernel, key = {"mm": (_grouped_mm_kernel, ["N", "K", "G"]), "wgrad": (_grouped_wgrad_kernel, ["N", "K"])}[name]
    # float64 takes IEEE fp32's tiles: (64·32 + 32·128)·8 B = 48 KB a stage, 144 KB compiled for sm_90 (of 227 KB)
    configs = gemm_configs.configs(where, "fp32" if precision == "fp64" else precision)
    return triton.autotune(configs=configs, key=key)(kernel)


def _kernel(name: str, dtype: torch.dtype, device: torch.device):
    precision = "fp64" if dtype == torch.float64 else gemm._precision(dtype)
    return _tuned(name, gemm_configs.kind(device), precision)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, check_offsets: bool = True) -> torch.Tensor:
    """Y (M, N): rows offsets[g−1] … offsets[g] − 1 of `x` (M, K) times w[g] (K, N) (+ bias[g]), for every group g
    of `w` (G, K, N), in one launch. Any strides (a transposed view of w included), fp32/fp16/bf16/fp64.

    `offsets` (G,) are the groups' cumulative end rows, as `torch._grouped_mm`'s `offs`; `check_offsets` reads
    them on the host to refuse bad ones (one synchronisation: callers whose offsets come from a cumsum of counts
    pass False). `out` (M, N), if given, is written and returned (tests poison it to prove every row is stored).
    """
    _check(x, w, offsets, bias, check_offsets)
    M, K = x.shape
    G, _, N = w.shape
    out = _out(out, (M, N), x)
    if M == 0 or N == 0:
        return out
    ends = offsets.to(torch.int32)  # (G,)
    grid = lambda meta: (((M + G * (meta["BLOCK_M"] - 1)) // meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _kernel("mm", x.dtype, x.device)[grid](
        x, w, out, bias if bias is not None else w, ends,  # the bias pointer is unused when HAS_BIAS is False
        M, N, K, G,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        *(bias.stride() if bias is not None else (0, 0)),
        HAS_BIAS=bias is not None, BLOCK_G=triton.next_power_of_2(G), **_flags(x.dtype),
    )
    return out


def grouped_weight_grad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor | None = None,
                        check_offsets: bool = True) -> torch.Tensor:
    """dW (G, K, N): dW[g] = x_gᵀ @ dy_g for the rows of each group (x (M, K), dy (M, N), `offsets` (G,) as in
    `grouped_mm`); an empty group's dW[g] is 0. The gradient of `grouped_mm`'s w, by the second kernel."""
    _check_tensor("x", x, 2, "rows sorted by group, K")
    _check_tensor("dy", dy, 2, "rows sorted by group, N")
    if x.dtype != dy.dtype or x.device != dy.device or x.shape[0] != dy.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} on {x.device} and dy {tuple(dy.shape)} {dy.dtype} on "
                         f"{dy.device} must share their rows, dtype and device")
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.numel() == 0:
        raise ValueError("offsets must be a non-empty 1-D tensor: one end row per group")
    _check_offsets(offsets, offsets.numel(), x.shape[0], x.device, check_offsets)
    G, K, N = offsets.numel(), x.shape[1], dy.shape[1]
    out = _out(out, (G, K, N), x)
    if K == 0 or N == 0:
        return out
    grid = lambda meta: (G * triton.cdiv(K, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _kernel("wgrad", x.dtype, x.device)[grid](
        x, dy, out, offsets.to(torch.int32),
        N, K,
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), out.stride(0), out.stride(1), out.stride(2),
        **_flags(x.dtype),
    )
    return out


class GroupedMM(torch.autograd.Function):
    """Y_g = X_g·W_g + b_g for every group g of rows — the dropless expert computation of MegaBlocks (Gale et al.
    2023, "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts": variable-sized groups, nothing dropped
    or padded) — with the gradients of a matmul, per group: dX_g = dY_g·W_gᵀ (the forward kernel on W's transposed
    strides), dW_g = X_gᵀ·dY_g (`grouped_weight_grad`), db_g = Σ over the group's rows of dY_g."""

    @staticmethod
    def forward(ctx, x, w, offsets, bias):
        ctx.save_for_backward(x, w, offsets)
        ctx.has_bias = bias is not None
        return grouped_mm(x, w, offsets, bias, check_offsets=False)  # (M, N); offsets checked by grouped_linear

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors
        need_x, need_w, _, need_b = ctx.needs_input_grad
        dx = grouped_mm(dy, w.transpose(1, 2), offsets, check_offsets=False) if need_x else None  # (M, K)
        dw = grouped_weight_grad(x, dy, offsets, check_offsets=False) if need_w else None  # (G, K, N)
        db = None
        if ctx.has_bias and need_b:
            group = torch.searchsorted(offsets, torch.arange(x.shape[0], device=x.device), right=True)  # (M,)
            acc = torch.promote_types(dy.dtype, torch.float32)
            db = torch.zeros(w.shape[0], w.shape[2], dtype=acc, device=dy.device).index_add_(
                0, group, dy.to(acc)).to(dy.dtype)  # (G, N), summed in at least fp32
        return dx, dw, None, db


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None = None,
                   check_offsets: bool = True) -> torch.Tensor:
    """`grouped_mm` that autograd can train through (`GroupedMM`): x (M, K), w (G, K, N), offsets (G,), bias (G, N)
    or None -> (M, N)."""
    _check(x, w, offsets, bias, check_offsets)
    return GroupedMM.apply(x, w, offsets, bias)


def _bounds(offsets: torch.Tensor) -> list[tuple[int, int]]:
    ends = offsets.tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def reference(x, w, offsets, bias=None):
    """The same maths in plain PyTorch: one matmul per group, concatenated (M, N)."""
    blocks = [x[s:e] @ w[g] + (0 if bias is None else bias[g]) for g, (s, e) in enumerate(_bounds(offsets))]
    return torch.cat(blocks) if blocks else x.new_zeros(0, w.shape[2])


def reference_weight_grad(x, dy, offsets):
    """dW (G, K, N) in plain PyTorch: x_gᵀ @ dy_g per group."""
    return torch.stack([x[s:e].T @ dy[s:e] for s, e in _bounds(offsets)])


# -- the bench ----------------------------------------------------------------------------------------------------

# (G, tokens·k rows, K, N): the MoE bench's GPU layer (`llmlab.moe_bench.SIZES["gpu"]`: C=768, H=3072, 8 experts,
# 8192 tokens, top-2), its up- and down-projection; and a fine-grained one (64 experts of hidden 768, top-8, as
# DeepSeekMoE-style layers split experts)
GPU_SIZES = ((8, 16384, 768, 3072), (8, 16384, 3072, 768), (64, 65536, 768, 768))
SMOKE_SIZES = ((4, 96, 32, 48), (8, 80, 16, 24))  # LLMLAB_GPU_SMOKE: the GPU branch in seconds, interpreted
CPU_SIZES = ((1, 40, 24, 16), (5, 67, 19, 21), (8, 100, 33, 40))  # the CPU tier: correctness, interpreted


def routed(groups: int, rows: int, device, seed: int = 0, skew: float = 0.5) -> torch.Tensor:
    """(G,) int32 cumulative ends of `rows` rows routed to `groups` experts by a skewed random router (each row
    draws its expert with probability ∝ exp(skew · N(0, 1))): uneven groups, as a trained router leaves them."""
    g = torch.Generator().manual_seed(seed)
    probs = (skew * torch.randn(groups, generator=g)).softmax(0)  # (G,)
    counts = torch.bincount(torch.multinomial(probs, rows, replacement=True, generator=g), minlength=groups)  # (G,)
    return counts.cumsum(0).to(torch.int32).to(device)


def _rel_err(got: torch.Tensor, exact: torch.Tensor) -> float:
    return (torch.linalg.norm(got.double() - exact) / torch.linalg.norm(exact)).item()


def bench(sizes=None) -> list[dict]:
    """On the CPU tier: per (G, M, K, N) of `sizes`, the relative error of `grouped_mm` and `grouped_weight_grad`
    against the float64 loop, in fp32 and bf16 (the interpreter runs each program in NumPy: no timing). On a GPU
    tier: `sweep`."""
    if runtime.tier().is_gpu:
        return sweep(sizes)
    device, rows = runtime.device(), []
    for G, M, K, N in sizes or CPU_SIZES:
        offsets = routed(G, M, device)
        for dtype in (torch.float32, torch.bfloat16):
            x, w, dy = _operands(G, M, K, N, dtype, device)
            tol = gemm.TOLERANCE[gemm._precision(dtype)]
            for part, got, exact in (("forward", grouped_mm(x, w, offsets), reference(x.double(), w.double(), offsets)),
                                     ("weight grad", grouped_weight_grad(x, dy, offsets),
                                      reference_weight_grad(x.double(), dy.double(), offsets))):
                err = _rel_err(got, exact)
                rows.append({"impl": f"triton grouped_mm {part} (interpreted)", "peer": "float64 loop of matmuls",
                             "size": f"G={G} M={M} K={K} N={N}", "dtype": str(dtype).removeprefix("torch."),
                             "groups": [e - s for s, e in _bounds(offsets)], "rel_err": err, "tol": tol,
                             "check": "ok" if err <= tol else "FAILED"})
    return rows


def _operands(G, M, K, N, dtype, device):
    x = torch.randn(M, K, device=device).to(dtype)  # (M, K)
    w = (torch.randn(G, K, N, device=device) / K**0.5).to(dtype)  # (G, K, N), scaled as an initialised layer
    dy = torch.randn(M, N, device=device).to(dtype)  # (M, N)
    return x, w, dy


def _peers(x, w, dy, offsets, out, dw_out) -> dict[str, dict]:
    """Per part, each side's function writing into `out` / `dw_out`: this kernel, `torch._grouped_mm` (where torch
    has it) and a loop of one matmul per group, its group bounds read once here (the loop needs them on the host)."""
    bounds = _bounds(offsets)
    parts = {"forward": {"triton": functools.partial(grouped_mm, x, w, offsets, out=out, check_offsets=False),
                         "loop": lambda: [torch.matmul(x[s:e], w[g], out=out[s:e]) for g, (s, e) in enumerate(bounds)]},
             "weight grad": {"triton": functools.partial(grouped_weight_grad, x, dy, offsets, out=dw_out,
                                                         check_offsets=False),
                             "loop": lambda: [torch.matmul(x[s:e].T, dy[s:e], out=dw_out[g])
                                              for g, (s, e) in enumerate(bounds)]}}
    if hasattr(torch, "_grouped_mm"):
        parts["forward"]["torch._grouped_mm"] = functools.partial(torch._grouped_mm, x, w, offs=offsets)
        parts["weight grad"]["torch._grouped_mm"] = functools.partial(torch._grouped_mm, x.T, dy, offs=offsets)
    return parts


def sweep(sizes=None) -> list[dict]:
    """The GPU tier's bench, bf16: per (G, M, K, N) of `sizes` (`GPU_SIZES`; rows routed by `routed`), the forward
    Y = X_g·W_g and the weight gradient dW_g = X_gᵀ·dY_g, each timed against `torch._grouped_mm` (where it exists and
    runs) and against the per-expert loop of matmuls, in the same interleaved rounds, each side replayed from a
    CUDA graph of `gemm.REPLAYS` calls (no Python between kernels). Each row: the times, the ratio (impl / peer:
    below 1, the Triton kernel is faster), TFLOP/s (2·M·K·N), `of_peer` = 1 / ratio, the autotuned `config`, and
    `rel_err` against the float64 loop with `check` 'ok' or 'FAILED' (`gemm.TOLERANCE`). Under smoke mode the same
    code runs on the CPU, interpreted, on `SMOKE_SIZES`."""
    device = runtime.device()
    real = device.type == "cuda"
    dtype, rows = torch.bfloat16, []
    for G, M, K, N in sizes or (GPU_SIZES if real else SMOKE_SIZES):
        offsets = routed(G, M, device)
        x, w, dy = _operands(G, M, K, N, dtype, device)
        out, dw_out = torch.empty(M, N, device=device, dtype=dtype), torch.empty(G, K, N, device=device, dtype=dtype)
        exact = {"forward": reference(x.double(), w.double(), offsets),
                 "weight grad": reference_weight_grad(x.double(), dy.double(), offsets)}
        for part, sides in _peers(x, w, dy, offsets, out, dw_out).items():
            got = sides["triton"]()  # first call: compiles and autotunes, outside the timing
            err, tol = _rel_err(got, exact[part]), gemm.TOLERANCE["bf16"]
            config = _kernel("mm" if part == "forward" else "wgrad", dtype, device).best_config
            for peer in [name for name in sides if name != "triton"]:
                try:
                    sides[peer]()
                except RuntimeError as e:  # torch._grouped_mm refuses some devices and shapes
                    rows.append({"impl": f"triton grouped_mm {part}", "peer": peer, "size": f"G={G} M={M} K={K} N={N}",
                                 "note": f"peer did not run: {str(e).splitlines()[0]}"})
                    continue
                (impl, other), calls = gemm._replayed((sides["triton"], sides[peer]), device)
                c = compare(impl, other, device=device)
                flops = 2.0 * M * K * N * calls
                rows.append({"impl": f"triton grouped_mm {part}", "peer": peer, "size": f"G={G} M={M} K={K} N={N}",
                             "dtype": "bfloat16", **c.row(), "impl_ms": c.impl.ms / calls, "peer_ms": c.peer.ms / calls,
                             "impl_TFLOP/s": flops / c.impl.ms / 1e9, "peer_TFLOP/s": flops / c.peer.ms / 1e9,
                             "of_peer": 1 / c.ratio, "config": gemm_configs.describe(config),
                             "rel_err": err, "tol": tol, "check": "ok" if err <= tol else "FAILED"})
    return rows
