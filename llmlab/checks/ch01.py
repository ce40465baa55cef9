"""Checks for chapter 1's exercises (solutions/01_compute.ipynb): FLOPs, the roofline, a Triton K loop, MFU.

    from llmlab.checks import ch01 as check
    check.block_flops(block_flops)              # 1.1
    check.gemm_roofline(gemm_roofline)          # 1.2
    check.gemm_k_loop(matmul_kernel)            # 1.3 (a @triton.jit kernel, launched here)
    check.implied_mfu(implied_mfu)              # 1.4

Each check compares the learner's answer with llmlab's own (llmlab.flops, llmlab.hardware.roofline,
torch.matmul) on fresh random inputs plus the edge cases a plausible mistake gets wrong, and when the answer
matches a known mistake (no attention T² terms, 1 byte per element, forward-only FLOPs...) it says so.
"""

from __future__ import annotations

import ast
import inspect
import math
import random
import textwrap

import torch
import triton

from llmlab import flops, runtime
from llmlab.checks import Hint, Mismatch, assert_close, check, fresh_rng, number
from llmlab.hardware import SPECS, roofline
from llmlab.model import GPTConfig

__all__ = ["block_flops", "gemm_roofline", "gemm_k_loop", "implied_mfu", "K_LOOP_BLOCKS", "k_loop_shapes"]


def _close(got: float, want: float, rel: float = 1e-9) -> bool:
    """FLOP counts, intensities and MFUs from a handful of float64 products and quotients (or exact ints): another
    arrangement differs by a few ulp, ~1e-15 relative; 1e-9 is far above that and far below the smallest named
    mistake (one of the two attention matmuls missing: 2T/(24C + 4T) of a block's FLOPs, ≥ 1e-4 for every size
    drawn here)."""
    return math.isclose(got, want, rel_tol=rel, abs_tol=0.0)


# --- 1.1: a transformer block's forward FLOPs ----------------------------------------------------------------

def _block_matmuls(B: int, T: int, C: int, n_head: int):
    cfg = GPTConfig(vocab_size=1, block_size=T, n_layer=1, n_head=n_head, n_embd=C)
    return [mm for mm in flops.forward_matmuls(cfg, B, T) if mm.name != "lm head"]


def _block_cases(rng: random.Random) -> list[tuple[int, int, int, int]]:
    cases = [(1, 1, 8, 1), (2, 7, 12, 3), (3, 64, 64, 4)]  # T = 1, odd sizes, the tiny GPT's shape
    for _ in range(4):
        n_head = rng.choice([1, 2, 4, 6, 8, 12])
        cases.append((rng.randint(1, 16), rng.randint(2, 512), n_head * rng.choice([8, 16, 32, 64]), n_head))
    return cases


@check("1.1", "a transformer block's forward FLOPs", hint=Hint(
    nudge="count the matmuls one block does and what each costs: which of them does your total leave out, or count "
          "twice?",
    idea="sum 2·m·n·k over every matmul of the block — the three projections and the output projection, the two "
         "attention matmuls per head (they grow with T², not with C²) and the MLP's two",
    formula="a block does six matmuls: q,k,v projection (C→3C), scores q·kᵀ and the weighted sum p·v "
            "(T×T per head: n_head matmuls of head size C/n_head each), output projection (C→C), MLP up (C→4C) and "
            "down (4C→C); an (m, k) @ (k, n) matmul costs 2·m·n·k FLOPs"))
def block_flops(fn):
    for B, T, C, n_head in _block_cases(fresh_rng()):
        what = f"block_flops(B={B}, T={T}, C={C}, n_head={n_head})"
        got = number(fn(B, T, C, n_head), what)
        matmuls = _block_matmuls(B, T, C, n_head)
        want = sum(mm.flops for mm in matmuls)
        if _close(got, want):
            continue
        attention = sum(mm.flops for mm in matmuls if mm.name.startswith(("attn scores", "attn weighted")))
        diagnosis = {
            want - attention: "that is the weight matmuls only: the attention scores q·kᵀ and the weighted sum p·v "
                              f"({attention:.6g} FLOPs here, 4·B·T²·C) are missing",
            want / 2: "exactly half: a multiply-add is 2 FLOPs, so (m, k) @ (k, n) is 2·m·n·k",
            3 * want: "3× the forward: that is forward + backward (a training step); count the forward only",
            want - attention / 2: "one of the two attention matmuls (q·kᵀ or p·v) is missing",
        }
        known = next((d for value, d in diagnosis.items() if _close(got, value)), None)
        raise Mismatch(f"{what} = {got:.6g}, expected {want:.6g}" + (f": {known}" if known else ""))


# --- 1.2: a GEMM's arithmetic intensity and bound --------------------------------------------------------------

def _roofline_cases(rng: random.Random):
    gpus = [name for name in SPECS]
    cases = [(1, 4096, 4096, 2, "H100 SXM"), (8192, 8192, 8192, 2, "A100 SXM"), (1, 1, 1, 4, "laptop CPU"),
             (64, 768, 768, 2, "B200")]  # matrix-vector, big square, the smallest GEMM, a small batch
    for _ in range(6):
        cases.append((rng.choice([1, rng.randint(1, 64), rng.randint(64, 8192)]), rng.randint(1, 16384),
                      rng.randint(1, 16384), rng.choice([1, 2, 4]), rng.choice(gpus)))
    out = []
    for m, n, k, nbytes, gpu in cases:
        spec = SPECS[gpu]
        peak = spec.peak_flops("fp32" if nbytes == 4 else "bf16")
        out.append((m, n, k, nbytes, peak, spec.hbm_gbs * 1e9, gpu))
    return out


@check("1.2", "a GEMM's arithmetic intensity and bound", hint=Hint(
    nudge="compare your FLOPs and your bytes separately: does the byte count hold all three matrices, each at its "
          "element size?",
    idea="intensity is the GEMM's FLOPs over the bytes it must move at least once (A and B read, C written); the "
         "bound follows from comparing it with the device's ridge point",
    formula="intensity = 2·m·n·k FLOPs / ((m·k + k·n + m·n) · bytes_per_element) bytes (A and B read once, C written "
            "once); the ridge point is peak_flops / bandwidth; at or above it the GEMM is 'compute'-bound, below "
            "it 'memory'-bound"))
def gemm_roofline(fn):
    for m, n, k, nbytes, peak, bandwidth, gpu in _roofline_cases(fresh_rng()):
        what = f"gemm_roofline(m={m}, n={n}, k={k}, bytes_per_element={nbytes}, peak_flops={peak:.4g}, " \
               f"bandwidth={bandwidth:.4g}) [{gpu}]"
        answer = fn(m, n, k, nbytes, peak, bandwidth)
        if not isinstance(answer, tuple | list) or len(answer) != 2:
            raise Mismatch(f"{what} returned {answer!r}; expected a pair (intensity, 'memory' or 'compute')")
        intensity, bound = number(answer[0], f"{what}'s intensity"), answer[1]
        want = roofline.gemm_intensity(m, n, k, nbytes)
        if not _close(intensity, want):
            diagnosis = {
                want * nbytes: f"it is {nbytes}× too large: count {nbytes} bytes per element, not 1",
                want / 2: "exactly half: a multiply-add is 2 FLOPs",
                2 * m * n * k / ((m * k + k * n) * nbytes): "the write of C (m·n elements) is missing from the bytes",
                want * nbytes / 2: "count bytes_per_element bytes per element (this GEMM's is given), not 2",
            }
            known = next((d for value, d in diagnosis.items() if _close(intensity, value)), None)
            raise Mismatch(f"{what}: intensity {intensity:.6g} FLOP/B, expected {want:.6g}"
                           + (f": {known}" if known else ""))
        # compared exactly: a float intensity within an ulp of the ridge point, where two right answers could
        # disagree, has probability ~1e-16 for the random integer shapes drawn here
        want_bound = roofline.bound(want, peak, bandwidth)
        if bound != want_bound:
            ridge = roofline.ridge_point(peak, bandwidth)
            raise Mismatch(f"{what}: bound {bound!r}, expected {want_bound!r} (intensity {want:.4g} FLOP/B, "
                           f"ridge point {ridge:.4g} FLOP/B); return exactly 'memory' or 'compute'")


# --- 1.3: the Triton GEMM's K loop ----------------------------------------------------------------------------

K_LOOP_BLOCKS = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)  # tl.dot needs every tile dimension >= 16 on a GPU


def k_loop_shapes() -> list[tuple[int, int, int]]:
    """(M, N, K) shapes the K-loop check runs: the edge cases, then fresh random odd ones."""
    rng = fresh_rng()
    shapes = [(1, 1, 1),  # a single partial tile in every dimension
              (32, 32, 32),  # whole tiles only: what a loop without masks gets right
              (17, 33, 65),  # K = 4 whole blocks + 1: the last K block holds one column
              (64, 5, 130)]  # K = 8 blocks + 2, a narrow N
    shapes.append((rng.randint(2, 40), rng.randint(2, 40), rng.choice([17, 31, 47, 63, 79])))
    return shapes


def _placeholder_left(kernel) -> bool:
    """Does the kernel still contain the exercise's `raise NotImplementedError(...)`?

    Under the interpreter that raise would surface as an error from the launch; compiled Triton cannot even
    compile a `raise`. So the check reads the kernel's source first and reports "not attempted yet" itself.
    """
    fn = getattr(kernel, "fn", kernel)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id == "NotImplementedError":
                return True
    return False


def _poisoned(rows: int, cols: int, pad: int, dtype, device, transposed: bool = False):
    """A (rows, cols) view into a larger NaN-filled buffer, holding values uniform in [-1, 1).

    A load that reads past the matrix's edge (a missing mask) reads NaN rather than another tensor's memory, so
    the answer turns NaN instead of silently wrong or crashing. `transposed` gives column-major strides.
    """

    shape = (cols + pad, rows + pad) if transposed else (rows + pad, cols + pad)
    buf = torch.full(shape, float("nan"), dtype=dtype, device=device)
    view = buf[:cols, :rows].T if transposed else buf[:rows, :cols]
    view.copy_(torch.rand(rows, cols, device=device) * 2 - 1)
    return view


def _tolerances(dtype, K: int) -> tuple[float, float]:
    """(rtol, atol) between the kernel's C and torch.matmul's, both summing K products of values in [-1, 1).

    Both accumulate in fp32, in different orders: each sum's rounding error is at most K·u·Σ|aᵢbᵢ| ≤ K²·u
    (u = 2⁻²⁴, |aᵢbᵢ| ≤ 1), so the two differ by at most 2·K²·u (atol). fp16 output rounds each to fp16 once
    more: at most half an fp16 unit in the last place (2⁻¹¹ relative) each, one unit between them (rtol 2⁻¹⁰,
    doubled for slack). Compiled Triton multiplies fp32 tiles as TF32 by default (10-bit mantissas, u = 2⁻¹¹),
    so on a GPU fp32 products may differ by 2·2⁻¹¹ each: atol 2⁻¹⁰·K. A real bug (a missed block, a wrong
    mask, an unadvanced pointer) is off by O(1) or NaN, far outside all of these.
    """

    atol = 2 * K * K * 2.0**-24
    if dtype == torch.float16:
        return 2.0**-9, atol + 2.0**-24  # + the smallest fp16 subnormal, for results that round to 0
    if not runtime.triton_interpreted():
        atol += 2.0**-10 * K
    return 0.0, atol


def _launch(kernel, a, b, c) -> None:
    M, K = a.shape
    N = b.shape[1]
    bm, bn = K_LOOP_BLOCKS["BLOCK_M"], K_LOOP_BLOCKS["BLOCK_N"]
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    try:
        kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                     **K_LOOP_BLOCKS)
    except Exception as e:  # the interpreter wraps the kernel's own error: report that one
        if type(e).__name__ == "InterpreterError" and e.__cause__ is not None:
            raise e.__cause__ from None
        raise


@check("1.3", "the Triton GEMM's K loop", hint=Hint(
    nudge="look at the loads inside your K loop: which edge of which tile can run past the matrix, and is it "
          "masked?",
    idea="every step loads one tile of A and one of B, each masked on all its edges — the K edge too, since the "
         "last K block is partial — accumulates their product, and moves both pointers one block along K",
    formula="in each step load the (BLOCK_M, BLOCK_K) tile of A and the (BLOCK_K, BLOCK_N) tile of B with masks on "
            "every edge — rows offs_m < M, columns offs_n < N, AND the K edge offs_k < K - k·BLOCK_K (the last K "
            "block is partial when K is not a multiple of BLOCK_K) — with other=0.0; accumulate acc = tl.dot(a, b, "
            "acc) (or acc += tl.dot(a, b)); then advance a_ptrs by BLOCK_K·stride_ak and b_ptrs by BLOCK_K·stride_bk"))
def gemm_k_loop(kernel):
    """`kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M, BLOCK_N, BLOCK_K)`: one program per (BLOCK_M, BLOCK_N) tile of C on a 2-D grid."""

    import llmlab.kernels  # noqa: F401  (interpreted Triton on the CPU tier, before anything is launched)

    if _placeholder_left(kernel):
        raise NotImplementedError("Exercise 1.3")
    device = runtime.device()
    pad = max(K_LOOP_BLOCKS.values())
    cases = [(shape, dtype, False) for shape in k_loop_shapes() for dtype in (torch.float32, torch.float16)]
    cases.append(((23, 19, 37), torch.float32, True))  # A and B column-major: the strides must be used
    for (M, N, K), dtype, transposed in cases:
        a = _poisoned(M, K, pad, dtype, device, transposed)  # (M, K)
        b = _poisoned(K, N, pad, dtype, device, transposed)  # (K, N)
        c = torch.full((M, N), float("nan"), dtype=dtype, device=device)  # an unwritten tile stays NaN
        _launch(kernel, a, b, c)
        want = (a.float() @ b.float()).to(dtype)  # fp32 products and sums, one rounding to the output dtype
        what = (f"C = A @ B with A {M}×{K}, B {K}×{N}, {str(dtype).removeprefix('torch.')}"
                f"{', column-major A and B' if transposed else ''} (BLOCK_K={K_LOOP_BLOCKS['BLOCK_K']})")
        nan = torch.isnan(c)
        if nan.any():
            rows, cols = nan.any(1).nonzero().flatten().tolist(), nan.any(0).nonzero().flatten().tolist()
            raise Mismatch(f"{what}: {int(nan.sum())} of {c.numel()} values are NaN (rows {rows[:3]}…, columns "
                           f"{cols[:3]}…): a load read outside A or B, which are surrounded by NaN here — "
                           f"{_missing_mask(M, N, K)}")
        rtol, atol = _tolerances(dtype, K)
        try:
            assert_close(c, want, what=what, rtol=rtol, atol=atol)
        except Mismatch as e:
            several = K > K_LOOP_BLOCKS["BLOCK_K"]
            if several and torch.allclose(c.float(), _unadvanced(a, b), rtol=1e-2, atol=1e-2):
                raise Mismatch(f"{e}: C is what re-reading the first K block in every step gives: a_ptrs and "
                               "b_ptrs are never advanced along K") from None
            if several and torch.allclose(c.float(), _last_block(a, b), rtol=1e-2, atol=1e-2):
                raise Mismatch(f"{e}: C is only the last K block's product: acc is overwritten instead of "
                               "accumulated") from None
            raise


def _missing_mask(M: int, N: int, K: int) -> str:
    bk = K_LOOP_BLOCKS["BLOCK_K"]
    if K % bk:
        return (f"K={K} is not a multiple of BLOCK_K={bk}, so the last K block has only {K % bk} valid "
                "column(s) of A and row(s) of B: mask offs_k < K - k·BLOCK_K in both loads")
    return f"mask the rows of A (offs_m < M={M}) and the columns of B (offs_n < N={N})"


def _unadvanced(a, b):
    """C of a K loop whose pointers stay on the first block: step s adds that block, masked to K - s·BLOCK_K."""
    bk, K = K_LOOP_BLOCKS["BLOCK_K"], a.shape[1]
    widths = [min(bk, K - start) for start in range(0, K, bk)]
    return sum(a[:, :w].float() @ b[:w].float() for w in widths)


def _last_block(a, b):
    """C of a K loop that overwrites the accumulator: only the last K block's product survives."""
    bk = K_LOOP_BLOCKS["BLOCK_K"]
    start = (a.shape[1] - 1) // bk * bk
    return a[:, start:].float() @ b[start:].float()


# --- 1.4: the MFU a training run implies ----------------------------------------------------------------------

@check("1.4", "the MFU a training run implies", hint=Hint(
    nudge="check the units: the FLOPs the run did, and the FLOPs its GPUs could have done in the same time",
    idea="MFU is achieved over possible FLOPs: 6 FLOPs per parameter per token for the run, and gpus × seconds × "
         "peak for the cluster, with days turned into seconds",
    formula="MFU = (6·N·D FLOPs) / (gpus × days × 86,400 s/day × peak FLOP/s per GPU)"))
def implied_mfu(fn):
    rng = fresh_rng()
    cases = [(175e9, 300e9, 1000, 34.0, SPECS["A100 SXM"].peak_flops("bf16"))]  # the course text's GPT-3 claim
    for _ in range(5):
        spec = SPECS[rng.choice([name for name in SPECS if name != "laptop CPU"])]
        cases.append((rng.choice([1.3e9, 7e9, 70e9, 540e9]) * rng.uniform(0.5, 2), rng.uniform(2e10, 2e13),
                      rng.choice([8, 64, 512, 2048, 6144]), rng.uniform(0.5, 90), spec.peak_flops("bf16")))
    for n_params, tokens, gpus, days, peak in cases:
        what = (f"implied_mfu(n_params={n_params:.4g}, tokens={tokens:.4g}, gpus={gpus}, days={days:.4g}, "
                f"peak_flops={peak:.4g})")
        got = number(fn(n_params, tokens, gpus, days, peak), what)
        want = flops.implied_mfu(flops.training_flops(n_params, tokens), gpus, days, peak)
        if _close(got, want):
            continue
        diagnosis = {want / 3: "a third: 2·N·D is the forward pass only; training is 6·N·D (backward is 2× forward)",
                     want / 6: "6× too small: the compute is 6·N·D, not N·D",
                     want * 24: "24× too large: a day has 86,400 seconds (you used hours)",
                     want * 100: "100× too large: return a fraction (0.34), not a percentage",
                     want * 1440: "1440× too large: a day has 86,400 seconds (you used minutes)"}
        known = next((d for value, d in diagnosis.items() if _close(got, value, rel=1e-6)), None)
        raise Mismatch(f"{what} = {got:.6g}, expected {want:.6g}" + (f": {known}" if known else ""))
