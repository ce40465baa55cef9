"""Vector addition, the first Triton kernel (Triton's tutorial 01), and the anatomy of every llmlab kernel.

`out[i] = x[i] + y[i]` for every i < n. A Triton kernel is written for one *program*; the launcher starts a
grid of them that run in parallel. Program `pid` handles the block of BLOCK_SIZE elements starting at
`pid · BLOCK_SIZE`. Unless n is a multiple of BLOCK_SIZE, the last block sticks out past the end of the
vectors, so every load and store is *masked*: the lanes whose offset is ≥ n neither read nor write.

Every llmlab kernel file has these parts, in this order:
1. the kernel, `add_kernel`, decorated with `@triton.jit`;
2. the launcher, `add(x, y)`, which checks its arguments, chooses the grid and launches;
3. `reference(x, y)`, the same computation in plain PyTorch, which the tests compare with;
4. `bench(sizes)`, timing `add` against PyTorch's own addition, for `llmlab bench vector_add`.

    from llmlab.kernels import vector_add
    out = vector_add.add(x, y)

Under the interpreter, bf16 is widened and rounded by hand (`llmlab.kernels.interpreter.EMULATE_BF16`: the
interpreter adds bf16 values as raw integers); compiled Triton adds them directly.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from llmlab.kernels.interpreter import EMULATE_BF16, bf16_to_fp32, fp32_to_bf16

from llmlab import runtime, validation
from llmlab.timing import compare

__all__ = ["add_kernel", "add", "reference", "bench"]


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr, BF16_VIA_FP32: tl.constexpr):
    pid = tl.program_id(axis=0)  # which block this program handles
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements  # False on the lanes past the end of the vectors
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    if BF16_VIA_FP32:
        out = fp32_to_bf16(bf16_to_fp32(x) + bf16_to_fp32(y))
    else:
        out = x + y
    tl.store(out_ptr + offsets, out, mask=mask)


SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(name: str, t, like: torch.Tensor | None) -> None:
    """Check argument `name`: a tensor of a supported dtype, like `like` (x) in shape, dtype and device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if like is None:
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}.dtype={t.dtype} is not supported; use one of "
                             f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")
        if t.device.type != "cuda" and not runtime.triton_interpreted():
            raise ValueError(f"{name} is on {t.device}, but Triton is compiled for the GPU here: move the "
                             "tensors to cuda, or set TRITON_INTERPRET=1 before importing llmlab.kernels")
        return
    if t.shape != like.shape:
        raise ValueError(f"{name}.shape={tuple(t.shape)} differs from x.shape={tuple(like.shape)}")
    if t.dtype != like.dtype:
        raise ValueError(f"{name}.dtype={t.dtype} differs from x.dtype={like.dtype}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but x is on {like.device}")


def add(x: torch.Tensor, y: torch.Tensor, *, out: torch.Tensor | None = None,
        block_size: int = 1024) -> torch.Tensor:
    """x + y computed by `add_kernel`, for tensors of any shape (same shape, dtype and device).

    Non-contiguous inputs are copied to contiguous ones first (the kernel reads flat memory). `out`, if
    given, must be contiguous and is written in place and returned. `block_size` is the elements per
    program, a power of two (`tl.arange` needs one).
    """
    _check("x", x, None)
    _check("y", y, x)
    if out is not None:
        _check("out", out, x)
        if not out.is_contiguous():
            raise ValueError("out must be contiguous: the kernel writes it as one flat array")
    if validation.positive_int("block_size", block_size, hint="(a power of two)") & (block_size - 1):
        raise ValueError(f"block_size={block_size!r} must be a power of two")
    x, y = x.contiguous(), y.contiguous()
    if out is None:
        out = torch.empty_like(x)
    n = x.numel()
    if n == 0:
        return out
    if n >= 2**31:
        raise ValueError(f"x has {n} elements; the kernel's offsets are 32-bit, so at most 2**31 - 1")
    grid = (triton.cdiv(n, block_size),)  # one program per block; the last one is partly masked
    add_kernel[grid](x, y, out, n, BLOCK_SIZE=block_size,
                     BF16_VIA_FP32=EMULATE_BF16 and x.dtype == torch.bfloat16)
    return out


def reference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """What `add` must return, in plain PyTorch."""
    return x + y


def bench(sizes=None, dtype: torch.dtype = torch.float32) -> list[dict]:
    """Time `add` against `torch.add` on vectors of each size; one row per size.

    An addition does almost no arithmetic (1 FLOP per 12 bytes in fp32), so both are bound by memory: the
    GB/s columns (x and y read, out written) are the figures to compare with the machine's copy bandwidth.
    Under the interpreter `add` runs as NumPy, block by block, and is far slower than PyTorch; the default
    sizes are smaller there.
    """
    interpreted = runtime.triton_interpreted()
    if sizes is None:
        sizes = (1 << 10, 1 << 14, 1 << 18) if interpreted else (1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 27)
    for i, n in enumerate(sizes):
        validation.positive_int(f"sizes[{i}]", n)
    device = runtime.device()
    rows = []
    for n in sizes:
        x, y = (torch.rand(n, device=device, dtype=dtype) for _ in range(2))
        out = torch.empty_like(x)
        times = compare(functools.partial(add, x, y, out=out), functools.partial(torch.add, x, y, out=out),
                        device=device)
        moved = 3 * n * x.element_size()  # bytes: x and y read, out written
        rows.append({"impl": f"triton add ({'interpreted' if interpreted else 'compiled'})",
                     "peer": "torch.add", "size": n, "dtype": str(dtype).removeprefix("torch."), **times.row(),
                     "impl_GB/s": moved / times.impl.ms / 1e6,
                     "peer_GB/s": moved / times.peer.ms / 1e6})
    return rows
