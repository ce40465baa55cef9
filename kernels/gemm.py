"""A tiled Triton GEMM: C = act(A @ B + bias), fp32 accumulation, for any M, N, K.

The parts every llmlab kernel file has, in order:
1. `_matmul_kernel` — the `@triton.jit` kernel. Each program computes one (BLOCK_M, BLOCK_N) tile of C
   by walking K in BLOCK_K steps: load a (BLOCK_M, BLOCK_K) tile of A and a (BLOCK_K, BLOCK_N) tile of B,
   multiply them on the tensor cores (`tl.dot`) into an fp32 accumulator, advance. Programs are ordered in
   groups of GROUP_M rows of tiles so that consecutive programs reuse the same tiles of B from L2 (the
   "grouped ordering" of Triton's matmul tutorial). Loads and stores are masked, so edges of any size are
   correct. The epilogue (bias, activation, cast) runs on the accumulator before the single store: fused,
   no extra pass over C in memory.
2. `matmul(a, b, bias=None, activation=None)` — the launcher: checks its inputs, allocates C, launches the
   grid of cdiv(M, BLOCK_M) · cdiv(N, BLOCK_N) programs.
3. `reference(a, b, bias=None, activation=None)` — the same maths in plain PyTorch.
4. `bench(...)` — TFLOP/s of `matmul` and `torch.matmul` side by side (`llmlab bench gemm`).

Block sizes are autotuned on a GPU; under the Triton interpreter (CPU tier) one small fixed config is used,
since the interpreter runs each program in NumPy and only correctness is measured there.

Interpreter switch (`llmlab.kernels.interpreter.EMULATE_BF16`): with triton 3.9, `tl.dot` on bf16 tiles
returns wrong values under TRITON_INTERPRET=1, and its fp32 → bf16 cast truncates. When interpreted, bf16
tiles are widened to fp32 by hand before the dot (exact: the accumulator is fp32 anyway) and C is rounded
to the nearest bf16 by hand. Compiled kernels use bf16 tiles on the tensor cores directly.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from llmlab.kernels.interpreter import EMULATE_BF16, bf16_to_fp32, fp32_to_bf16

from llmlab import runtime
from llmlab.timing import compare

ACTIVATIONS = {None: 0, "relu": 1, "gelu": 2}  # gelu: the tanh approximation, as GPT-2 uses
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _configs():
    if runtime.triton_interpreted():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4})]
    shapes = [  # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_stages, num_warps), from Triton's tutorial sweep
        (128, 256, 64, 8, 3, 8), (256, 128, 64, 8, 3, 8), (128, 128, 64, 8, 4, 4), (128, 128, 32, 8, 4, 4),
        (64, 256, 32, 8, 4, 4), (256, 64, 32, 8, 4, 4), (128, 64, 32, 8, 4, 4), (64, 128, 32, 8, 4, 4),
        (64, 64, 32, 8, 5, 2), (32, 64, 32, 8, 5, 2), (128, 256, 128, 8, 3, 8), (256, 128, 128, 8, 3, 8),
    ]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": g}, num_stages=s, num_warps=w)
            for m, n, k, g, s, w in shapes]


@triton.autotune(configs=_configs(), key=["M", "N", "K", "HAS_BIAS", "ACTIVATION"])
@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, BF16_VIA_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # --- which tile of C this program owns, in grouped order ---
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)  # the last group may be shorter
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows of C
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) columns of C
    offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn  # (BLOCK_K, BLOCK_N)

    # --- the K loop: one (BLOCK_M, BLOCK_K) x (BLOCK_K, BLOCK_N) product per step, summed in fp32 ---
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if BF16_VIA_FP32:
            a = bf16_to_fp32(a)
            b = bf16_to_fp32(b)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    # --- fused epilogue on the fp32 accumulator, then one masked store ---
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)  # (BLOCK_N,)
        bias = bf16_to_fp32(bias) if BF16_VIA_FP32 else bias.to(tl.float32)
        acc += bias[None, :]
    if ACTIVATION == 1:
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == 2:
        u = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)  # sqrt(2/pi) (x + 0.044715 x^3)
        e = tl.exp(-2.0 * tl.abs(u))  # tanh(u) = sign(u) (1 - e) / (1 + e): never overflows
        tanh_u = tl.where(u >= 0, 1.0, -1.0) * (1.0 - e) / (1.0 + e)
        acc = 0.5 * acc * (1.0 + tanh_u)
    c = fp32_to_bf16(acc) if BF16_VIA_FP32 else acc.to(c_ptr.dtype.element_ty)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, c, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def program_tile(pid: int, num_pid_m: int, num_pid_n: int, group_m: int) -> tuple[int, int]:
    """The (tile row, tile column) of C that program `pid` computes: the kernel's grouped ordering, the same
    arithmetic in Python (for figures and for the chapter's walk-through). group_m = 1 is row-major."""
    num_pid_in_group = group_m * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * group_m
    group_size_m = min(num_pid_m - first_pid_m, group_m)
    return first_pid_m + (pid % num_pid_in_group) % group_size_m, (pid % num_pid_in_group) // group_size_m


def _check(a, b, bias, activation):
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D (a matrix), got {t.dim()}-D with shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}.dtype={t.dtype} not supported; use one of {[str(d) for d in DTYPES]}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} "
                         f"(a.shape[1]={a.shape[1]} != b.shape[0]={b.shape[0]})")
    if a.dtype != b.dtype:
        raise ValueError(f"a.dtype={a.dtype} and b.dtype={b.dtype} differ; cast one of them")
    if a.device != b.device:
        raise ValueError(f"a is on {a.device} and b on {b.device}; move them to one device")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (b.shape[1],):
            shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"bias must be a tensor of shape ({b.shape[1]},), got {shape}")
        if bias.device != a.device:
            raise ValueError(f"bias is on {bias.device}, a and b on {a.device}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}; choose from {list(ACTIVATIONS)}")


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """act(a @ b + bias) with the Triton kernel; a (M, K), b (K, N), any strides, fp32/fp16/bf16.

    `out` (M, N), if given, is written and returned (tests poison it to prove every tile is stored).
    """
    _check(a, b, bias, activation)
    M, K = a.shape
    N = b.shape[1]
    if out is None:
        out = torch.empty((M, N), device=a.device, dtype=a.dtype)
    elif out.shape != (M, N) or out.dtype != a.dtype or out.device != a.device:
        raise ValueError(f"out must be ({M}, {N}) {a.dtype} on {a.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.copy_(reference(a, b, bias, activation))
    precision = "tf32" if (a.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32) else "ieee"
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _matmul_kernel[grid](
        a, b, out, bias if bias is not None else a,  # the bias pointer is unused when HAS_BIAS is False
        M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, ACTIVATION=ACTIVATIONS[activation],
        BF16_VIA_FP32=EMULATE_BF16 and a.dtype == torch.bfloat16,
        INPUT_PRECISION=precision,
    )
    return out


def reference(a, b, bias=None, activation=None):
    """The same computation in PyTorch: act(a @ b + bias)."""
    c = a @ b
    if bias is not None:
        c = c + bias
    if activation == "relu":
        c = torch.relu(c)
    elif activation == "gelu":
        c = torch.nn.functional.gelu(c, approximate="tanh")
    return c


def bench(sizes=None, dtypes=None) -> list[dict]:
    """TFLOP/s of `matmul` (impl) vs `torch.matmul` (peer) on square (n, n) @ (n, n), per size and dtype.

    On a GPU the sizes sweep 1024…4096 in bf16, fp16 and fp32 (the targets: ≥ 90% of torch.matmul at 4096³
    bf16, ≥ 70% at 1024³). Under the interpreter the kernel runs in NumPy, program by program: the figures
    only show it runs (a correctness tier), on small sizes.
    """
    device = runtime.device()
    sizes = sizes or runtime.preset().gemm_sizes
    dtypes = dtypes or ([torch.bfloat16, torch.float16, torch.float32] if device.type == "cuda"
                        else [torch.float32, torch.bfloat16])
    mode = "interpreted" if runtime.triton_interpreted() else "compiled"
    rows = []
    for dtype in dtypes:
        for n in sizes:
            a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
            out = torch.empty(n, n, device=device, dtype=dtype)
            times = compare(functools.partial(matmul, a, b, out=out), functools.partial(torch.matmul, a, b, out=out),
                            device=device)
            flops = 2.0 * n**3
            rows.append({"impl": f"triton gemm ({mode})", "peer": "torch.matmul", "size": n,
                         "dtype": str(dtype).removeprefix("torch."), **times.row(),
                         "impl_TFLOP/s": flops / times.impl.ms / 1e9,
                         "peer_TFLOP/s": flops / times.peer.ms / 1e9})
    return rows
