"""Checks for chapter 1's exercises (solutions/01_compute.ipynb): FLOPs, the roofline, a tiled Triton GEMM, MFU.

    from llmlab.checks import ch01 as check
    check.block_flops(block_flops)              # 1.1
    check.gemm_roofline(gemm_roofline)          # 1.2
    check.tiled_gemm(matmul_kernel)             # 1.3 (a @triton.jit kernel, launched here; ch01_gemm)
    check.implied_mfu(implied_mfu)              # 1.4
    check.mfu_from_log(mfu_from_log)            # 1.5 (a training log's MFU; ch01_log)

Each check compares the learner's answer with llmlab's own (llmlab.flops, llmlab.hardware.roofline,
torch.matmul) on fresh random inputs plus the edge cases a plausible mistake gets wrong, and when the answer
matches a known mistake (no attention T² terms, 1 byte per element, forward-only FLOPs, the mean of a log's step
times...) it says so.
"""

from __future__ import annotations

import math
import random

from llmlab import flops
from llmlab.checks import Hint, Mismatch, check, fresh_rng, number
from llmlab.checks.ch01_gemm import BLOCKS, launch, tiled_gemm
from llmlab.checks.ch01_log import mfu_from_log, sample_log
from llmlab.hardware import SPECS, roofline
from llmlab.model import GPTConfig

__all__ = ["block_flops", "gemm_roofline", "tiled_gemm", "launch", "BLOCKS", "implied_mfu", "mfu_from_log",
           "sample_log"]


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
