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
4. `bench(...)` — `matmul` against `torch.matmul` (`llmlab bench gemm`); on a GPU, `sweep`: 1024…8192 in bf16,
   fp16 and fp32, each row with its fraction of torch.matmul and of the spec sheet's peak, and a check of C.

Block sizes are autotuned on a GPU over the short list `llmlab.kernels.gemm_configs` picks for the chip (Hopper's
wgmma tiles on H100/H200, the tutorial's on others); under the Triton interpreter (CPU tier) one small fixed config
is used, since the interpreter runs each program in NumPy and only correctness is measured there.

Interpreter switch (`llmlab.kernels.interpreter.EMULATE_BF16`): with triton 3.9, `tl.dot` on bf16 tiles
returns wrong values under TRITON_INTERPRET=1, and its fp32 → bf16 cast truncates. When interpreted, bf16
tiles are widened to fp32 by hand before the dot (exact: the accumulator is fp32 anyway) and C is rounded
to the nearest bf16 by hand. Compiled kernels use bf16 tiles on the tensor cores directly.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl
from llmlab.kernels import gemm_configs
from llmlab.kernels.interpreter import EMULATE_BF16, bf16_to_fp32, fp32_to_bf16

from llmlab import runtime
from llmlab.timing import compare

ACTIVATIONS = {None: 0, "relu": 1, "gelu": 2}  # gelu: the tanh approximation, as GPT-2 uses
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
    where, precision = gemm_configs.kind(a.device), _precision(a.dtype)
    if where == "hopper" and precision == "tf32":
        # wgmma reads TF32 operands only K-major; with a row-major B the kernel ran 2.3× slower (H200, 4096³). A
        # K-major copy (one pass over the operand) costs far less: 4096³ ran 1.7× faster with it, copy included
        a = a if a.stride(1) == 1 else a.contiguous()  # (M, K), row-major
        b = b if b.stride(0) == 1 else b.t().contiguous().t()  # (K, N), column-major
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _tuned(where, precision)[grid](
        a, b, out, bias if bias is not None else a,  # the bias pointer is unused when HAS_BIAS is False
        M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, ACTIVATION=ACTIVATIONS[activation],
        BF16_VIA_FP32=EMULATE_BF16 and a.dtype == torch.bfloat16,
        INPUT_PRECISION="tf32" if precision == "tf32" else "ieee",
    )
    return out


@functools.cache
def _tuned(where: str, precision: str):
    """The kernel autotuned over `gemm_configs.configs(where, precision)`: one autotuner per device kind and
    precision, so each tries only the tiles that suit it; the best config is kept per (M, N, K, epilogue, dtype)."""
    return triton.autotune(configs=gemm_configs.configs(where, precision),
                           key=["M", "N", "K", "HAS_BIAS", "ACTIVATION"])(_matmul_kernel)


def _precision(dtype: torch.dtype) -> str:
    """What the tensor cores multiply: 'bf16', 'fp16', or for fp32 inputs 'tf32' when PyTorch allows it for its own
    matmuls (`torch.backends.cuda.matmul.allow_tf32`, set by `torch.set_float32_matmul_precision("high")`), else
    'fp32' (IEEE, on the CUDA cores) — so that the kernel and torch.matmul always compute alike."""
    if dtype == torch.float32:
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


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


# relative Frobenius error allowed against the float64 product of the same inputs, by what the tensor cores multiply:
# rounding C to the output dtype (unit roundoff u: 2^-8 bf16, 2^-11 fp16) moves each element by at most u relative,
# ~u/2 in root mean square, so the bound is about 2.5u (bf16) and 4u (fp16) — a wrong or unwritten tile raises the
# error to O(1)·(its share of C)^½, above these from 64² tiles down. TF32 keeps 10 mantissa bits of each fp32 input
# (Hopper's wgmma drops the other 13: relative error up to 2^-10 each, 2^-9 per product); with random signs the
# products' errors add like the products themselves, so ~2^-9 relative overall: 5e-3 leaves 2.5×. IEEE fp32
# accumulates K products each rounded by 2^-24: √K·2^-24 ≈ 5e-6 at K = 8192; 1e-4 leaves 20×.
TOLERANCE = {"bf16": 1e-2, "fp16": 2e-3, "tf32": 5e-3, "fp32": 1e-4}


def bench(sizes=None, dtypes=None) -> list[dict]:
    """The time of `matmul` (impl) against `torch.matmul` (peer) on square (n, n) @ (n, n), per size and dtype.

    CPU tier: the kernel runs in the interpreter (NumPy, program by program), so the figures only show that it
    runs, on the preset's small sizes, fp32 and bf16. GPU tier: `sweep` (1024…8192 in bf16, fp16 and fp32).
    """
    if runtime.tier().is_gpu:
        return sweep(sizes, dtypes)
    device = runtime.device()
    rows = []
    for dtype in dtypes or [torch.float32, torch.bfloat16]:
        for n in sizes or runtime.preset().gemm_sizes:
            a, b, out = _operands(n, dtype, device)
            rows.append(_row(compare(functools.partial(matmul, a, b, out=out),
                                     functools.partial(torch.matmul, a, b, out=out), device=device), n, dtype))
    return rows


def sweep(sizes=None, dtypes=None) -> list[dict]:
    """The GPU tier's bench: every size of the preset up to `peak_gemm` (1024, 2048, 4096, 8192 on a GPU) in bf16,
    fp16 and fp32 (TF32 on both sides, as training runs fp32 matmuls on the tensor cores). Each row has

    - the kernels' times (`impl_ms`, `peer_ms`, `ratio`, TFLOP/s), each side replayed from a CUDA graph of
      `REPLAYS` products, and `of_torch` = 1 / ratio, the fraction of torch.matmul's speed (targets on H100/H200:
      ≥ 0.90 at 4096³ bf16, ≥ 0.70 at 1024³), with the autotuned `config`;
    - `of_torch_eager`: the same fraction with each product launched from Python, as `matmul(a, b)` is called. On
      an H200 node a call of `matmul` cost ~40 µs of Python (checks, autotuner's cache, Triton's launcher) against
      ~12 µs for torch.matmul: below ~4096³ that overhead, not the kernel, is what an eager loop times;
    - `of_peak`: the fraction of the spec sheet's dense peak for what the tensor cores multiply (`peak_of` names
      the `llmlab.hardware.SPECS` entry; blank for a device not in the table);
    - `rel_err`: the relative Frobenius error of C against the float64 product, `tol` its bound (`TOLERANCE`), and
      `check` 'ok' or 'FAILED': each row says both how fast and whether right.

    Under smoke mode (LLMLAB_GPU_SMOKE) the same code runs on the CPU, interpreted, on the smoke preset's sizes (a
    CPU launches nothing: there the two fractions are one measurement).
    """
    device = runtime.device()
    p = runtime.preset()
    spec = gemm_configs.spec_for(device)
    rows = []
    with _tf32():
        for dtype in dtypes or [torch.bfloat16, torch.float16, torch.float32]:
            for n in sizes or sorted({*p.gemm_sizes, p.peak_gemm}):
                a, b, out = _operands(n, dtype, device)
                impl, peer = functools.partial(matmul, a, b, out=out), functools.partial(torch.matmul, a, b, out=out)
                (impl_replayed, peer_replayed), calls = _replayed((impl, peer), device)
                kernels = compare(impl_replayed, peer_replayed, device=device)
                eager = compare(impl, peer, device=device) if device.type == "cuda" else kernels
                row = _row(kernels, n, dtype, calls)
                precision = _precision(dtype)
                exact = a.double() @ b.double()  # (n, n): exact products, sums off by ≤ n·2^-53 relative
                err = (torch.linalg.norm(matmul(a, b).double() - exact) / torch.linalg.norm(exact)).item()
                peak = gemm_configs.peak_flops(spec, precision)
                rows.append({**row, "precision": precision,
                             "config": gemm_configs.describe(_tuned(gemm_configs.kind(device), precision).best_config),
                             "of_torch": 1 / kernels.ratio, "of_torch_eager": 1 / eager.ratio,
                             "peak_of": spec.name if peak else "",
                             "of_peak": row["impl_TFLOP/s"] * 1e12 / peak if peak else None,
                             "rel_err": err, "tol": TOLERANCE[precision],
                             "check": "ok" if err <= TOLERANCE[precision] else "FAILED"})
    return rows


REPLAYS = 10  # products per CUDA-graph replay in `sweep`: one replay of 1024³ products runs well past its launch


def _operands(n: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))  # (n, n) each
    out = torch.empty(n, n, device=device, dtype=dtype)  # (n, n), written by both sides in turn
    return a, b, out


def _row(times, n: int, dtype: torch.dtype, calls: int = 1) -> dict:
    """A bench row from `times` (a `llmlab.timing.Comparison` of `calls` n³ products on each side)."""
    flops = 2.0 * n**3 * calls
    mode = "interpreted" if runtime.triton_interpreted() else "compiled"
    return {"impl": f"triton gemm ({mode})", "peer": "torch.matmul", "size": n,
            "dtype": str(dtype).removeprefix("torch."),
            **times.row(), "impl_ms": times.impl.ms / calls, "peer_ms": times.peer.ms / calls,
            "impl_TFLOP/s": flops / times.impl.ms / 1e9, "peer_TFLOP/s": flops / times.peer.ms / 1e9}


def _replayed(fns, device) -> tuple[list, int]:
    """Each of `fns` called REPLAYS times back to back, as one function, and that count: on CUDA each captured once
    into a CUDA graph that is then replayed, so the GPU runs the kernels with no Python between them. A CPU (smoke
    mode) launches nothing: there the functions are returned as they are, with a count of 1."""
    if device.type != "cuda":
        return list(fns), 1
    replays = []
    for fn in fns:
        side = torch.cuda.Stream(device)  # warm up off the current stream (compile, autotune), as capture requires
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(REPLAYS):
                fn()
        replays.append(graph.replay)
    return replays, REPLAYS


@contextlib.contextmanager
def _tf32():
    """fp32 matmuls on the tensor cores in TF32, torch.matmul's and this kernel's alike, for the block's duration."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)
