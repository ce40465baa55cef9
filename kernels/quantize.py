"""Symmetric per-row int8 quantization in Triton: x → (q, scale) with x ≈ q · scale, and back.

Each row of x (the last dimension) gets its own scale s = max|x_row| / 127 and is stored as int8 codes
q = round(x / s) in [−127, 127] (the "absmax" scheme of LLM.int8(), Dettmers et al. 2022, §3.1; −128 is
left unused so the grid is symmetric). One byte per element plus one fp32 per row instead of 2 or 4 bytes
per element; dequantizing gives x̂ = q · s with |x − x̂| ≤ s/2 (half a step) for every element.

The parts every llmlab kernel file has, in order:
1. the kernels: `_quantize_kernel` (one program per row: a first pass over the row finds max|x|, a second
   rounds and stores the codes) and `_dequantize_kernel` (one program per row: q · s, cast to the dtype);
2. the launchers `quantize_int8(x)` and `dequantize_int8(q, scale, dtype)`, which check their arguments;
3. `reference(x)` and `reference_dequantize(q, scale, dtype)`, the same maths in PyTorch;
4. `bench()`, both kernels against the PyTorch reference, for `llmlab bench quant`.

Rounding is to nearest, ties to even (what `torch.round` does): 2.5 → 2, 3.5 → 4. Triton has no rint
that also runs under its interpreter, so the kernel rounds with the fp32 adder itself: y + 1.5·2²³ has no
bits left below the units place, so the hardware's round-to-nearest-even rounds y there, and subtracting
1.5·2²³ again is exact (valid for |y| < 2²²; here |y| ≤ 127). Both divisions are IEEE-rounded
(`tl.fdiv(..., ieee_rounding=True)`) so the codes equal PyTorch's exactly, on a GPU as under the interpreter.
A row of zeros gets s = 0 and q = 0, no NaN. x must be finite: an inf or NaN has no int8 code.

Interpreter switch (`llmlab.kernels.interpreter.EMULATE_BF16`): the interpreter keeps bf16 as raw 16-bit
integers, so bf16 is widened to fp32 and rounded back by hand there; compiled Triton converts directly.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from llmlab.kernels.interpreter import EMULATE_BF16, bf16_to_fp32, fp32_to_bf16

from llmlab import runtime
from llmlab.timing import compare

__all__ = ["quantize_int8", "dequantize_int8", "reference", "reference_dequantize", "bench", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QMAX = 127  # codes in [−127, 127]


@triton.jit
def _round_half_even(y):
    """Round fp32 y (|y| < 2²²) to the nearest integer, ties to even, with two exact-by-design additions."""
    return (y + 12582912.0) - 12582912.0  # 1.5·2²³: the sum's last bit is the units place


@triton.jit
def _load_fp32(ptrs, mask, BF16_VIA_FP32: tl.constexpr):
    v = tl.load(ptrs, mask=mask, other=0.0)
    return bf16_to_fp32(v) if BF16_VIA_FP32 else v.to(tl.float32)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, N, BLOCK_N: tl.constexpr, BF16_VIA_FP32: tl.constexpr):
    row = tl.program_id(axis=0).to(tl.int64)  # this program's row; 64-bit so row·N cannot overflow
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    # Pass 1: s = max|x_row| / 127, over the row in BLOCK_N pieces.
    amax = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        mask = start + cols < N
        x = _load_fp32(x_ptr + row * N + start + cols, mask, BF16_VIA_FP32)  # (BLOCK_N,) fp32
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.fdiv(tl.max(amax, axis=0), 127.0, ieee_rounding=True)  # scalar fp32
    tl.store(scale_ptr + row, scale)
    divisor = tl.where(scale > 0, scale, 1.0)  # a zero row: 0 / 1 = 0, not 0 / 0
    # Pass 2: q = round(x / s), clamped to [−127, 127] (x / s can exceed 127 by an ulp), stored as int8.
    for start in range(0, N, BLOCK_N):
        mask = start + cols < N
        x = _load_fp32(x_ptr + row * N + start + cols, mask, BF16_VIA_FP32)
        q = _round_half_even(tl.fdiv(x, divisor, ieee_rounding=True))  # (BLOCK_N,) integers held in fp32
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(q_ptr + row * N + start + cols, q.to(tl.int8), mask=mask)


@triton.jit
def _dequantize_kernel(q_ptr, scale_ptr, out_ptr, N, BLOCK_N: tl.constexpr, BF16_VIA_FP32: tl.constexpr):
    row = tl.program_id(axis=0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    scale = tl.load(scale_ptr + row)  # scalar fp32
    for start in range(0, N, BLOCK_N):
        mask = start + cols < N
        q = tl.load(q_ptr + row * N + start + cols, mask=mask, other=0)  # (BLOCK_N,) int8
        x = q.to(tl.float32) * scale  # exact integer times s: one fp32 rounding
        x = fp32_to_bf16(x) if BF16_VIA_FP32 else x.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * N + start + cols, x, mask=mask)


def _check_device(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not runtime.triton_interpreted():
        raise ValueError(f"{name} is on {t.device}, but Triton is compiled for the GPU here: move it to cuda, "
                         "or set TRITON_INTERPRET=1 before importing llmlab.kernels")


def _check_out(name: str, out, shape, dtype, device) -> None:
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != shape or out.dtype != dtype
                            or out.device != device or not out.is_contiguous()):
        got = f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{name} must be a contiguous {tuple(shape)} {dtype} tensor on {device}, got {got}")


def _block(n: int) -> int:
    return min(triton.next_power_of_2(max(n, 1)), 1024)  # a whole row at once up to 1024 columns


def quantize_int8(x: torch.Tensor, *, q_out: torch.Tensor | None = None,
                  scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): int8 codes shaped like x and one fp32 scale per row (shape x.shape[:-1]), x ≈ q · scale.

    x is fp32, fp16 or bf16, any shape with at least one dimension (the last one is the row); `q_out` and
    `scale_out`, if given, are written and returned (the tests poison them to prove every element is stored).
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (its last one is the row)")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x.dtype={x.dtype} is not supported; use one of {[str(d) for d in SUPPORTED_DTYPES]}")
    _check_device("x", x)
    _check_out("q_out", q_out, x.shape, torch.int8, x.device)
    _check_out("scale_out", scale_out, x.shape[:-1], torch.float32, x.device)
    if x.numel() >= 2**31:
        raise ValueError(f"x has {x.numel()} elements; at most 2**31 - 1")
    q = q_out if q_out is not None else torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scale = scale_out if scale_out is not None else torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    N = x.shape[-1]
    if N == 0:
        return q, scale.zero_()  # empty rows: max of nothing is 0
    if x.numel():
        _quantize_kernel[(x.numel() // N,)](x.contiguous(), q, scale, N, BLOCK_N=_block(N),
                                            BF16_VIA_FP32=EMULATE_BF16 and x.dtype == torch.bfloat16)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """x̂ = q · scale (each row by its scale), in `dtype`: the inverse of `quantize_int8` up to s/2 per element."""
    for name, t in (("q", q), ("scale", scale)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dtype != torch.int8 or q.dim() < 1:
        raise ValueError(f"q must be an int8 tensor with at least one dimension, got {q.dtype} {tuple(q.shape)}")
    if scale.dtype != torch.float32 or scale.shape != q.shape[:-1]:
        raise ValueError(f"scale must be fp32 of shape q.shape[:-1] = {tuple(q.shape[:-1])}, "
                         f"got {scale.dtype} {tuple(scale.shape)}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype={dtype} is not supported; use one of {[str(d) for d in SUPPORTED_DTYPES]}")
    if scale.device != q.device:
        raise ValueError(f"scale is on {scale.device} but q is on {q.device}")
    _check_device("q", q)
    _check_out("out", out, q.shape, dtype, q.device)
    out = out if out is not None else torch.empty(q.shape, dtype=dtype, device=q.device)
    N = q.shape[-1]
    if q.numel():
        _dequantize_kernel[(q.numel() // N,)](q.contiguous(), scale.contiguous(), out, N, BLOCK_N=_block(N),
                                              BF16_VIA_FP32=EMULATE_BF16 and dtype == torch.bfloat16)
    return out


def reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What `quantize_int8` must return, in PyTorch: per-row absmax scale, round half to even, clamp."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1) / QMAX if x.shape[-1] else x32.new_zeros(x.shape[:-1])  # (...,) per row
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]  # (..., 1)
    return torch.round(x32 / divisor).clamp(-QMAX, QMAX).to(torch.int8), scale


def reference_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What `dequantize_int8` must return: q · scale in fp32, rounded once to `dtype`."""
    return (q.float() * scale[..., None]).to(dtype)


def bench(sizes=None, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Time both kernels against the PyTorch reference on (rows, cols) matrices; two rows per size.

    Both are bound by memory (a few operations per byte): the GB/s columns count x read twice and q
    written for quantize (the two passes), q read and x̂ written for dequantize. Under the interpreter the
    kernels run as NumPy program by program and are far slower: only small sizes there.
    """
    interpreted = runtime.triton_interpreted()
    sizes = sizes or ([(16, 256), (64, 1024)] if interpreted else [(4096, 4096), (16384, 8192)])
    device = runtime.device()
    mode = "interpreted" if interpreted else "compiled"
    rows = []
    for m, n in sizes:
        x = torch.randn(m, n, device=device, dtype=dtype)
        q, scale = quantize_int8(x)
        out = torch.empty_like(x)
        for op, impl, peer, moved in (
            ("quantize", functools.partial(quantize_int8, x, q_out=q, scale_out=scale),
             functools.partial(reference, x), m * n * (2 * x.element_size() + 1)),
            ("dequantize", functools.partial(dequantize_int8, q, scale, dtype, out=out),
             functools.partial(reference_dequantize, q, scale, dtype), m * n * (1 + x.element_size())),
        ):
            times = compare(impl, peer, device=device)
            rows.append({"impl": f"triton {op} ({mode})", "peer": f"torch {op}", "size": f"{m}x{n}",
                         "dtype": str(dtype).removeprefix("torch."), **times.row(),
                         "impl_GB/s": moved / times.impl.ms / 1e6, "peer_GB/s": moved / times.peer.ms / 1e6})
    return rows
