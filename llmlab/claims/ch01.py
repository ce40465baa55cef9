"""Chapter 1's claims (§1, compute), measured: GPT-3's FLOPs (C1) and GPU-days (C2), tensor cores and 2:4
sparsity (C3), bandwidth against peak FLOP/s (C4)."""

from __future__ import annotations

import torch

from llmlab import flops, hardware, sparsity
from llmlab.claims import INCONCLUSIVE, Measurement, here, register
from llmlab.hardware import SPECS, roofline
from llmlab.model import GPTConfig
from llmlab.timing import compare

__all__ = ["gpt3_flops", "gpt3_days", "tensor_cores", "bandwidth_matters"]


@register("C1", chapter=1)
def gpt3_flops() -> Measurement:
    gpt3 = flops.GPT3
    six_nd = flops.training_flops(gpt3["n_params"], gpt3["tokens"])
    cfg = GPTConfig(**flops.GPT3_CONFIG)
    per_token = flops.training_step_flops(cfg, 1) / cfg.block_size  # counted matmul by matmul, attention included
    counted = per_token * gpt3["tokens"]
    error = abs(six_nd - gpt3["paper_flops"]) / gpt3["paper_flops"]
    return Measurement(
        value={"6ND": six_nd, "per-matmul count": counted}, unit="FLOP",
        text=f"6·N·D = {six_nd:.3g}; counted per matmul (T=2048, attention and lm head included) = {counted:.3g}",
        device="computed", verdict="holds" if error < 0.02 else "wrong")


@register("C2", chapter=1)
def gpt3_days() -> Measurement:
    peak = SPECS["A100 SXM"].peak_flops("bf16")
    needed = flops.implied_mfu(flops.GPT3["paper_flops"], flops.CLAIMED_GPUS, flops.CLAIMED_DAYS, peak)
    reported = flops.REPORTED_MFU
    # within the range of MFUs real runs reported, up to Megatron-LM's 52% of A100 peak at 1T parameters
    # (Narayanan et al. 2021)
    plausible = min(reported.values()) <= needed <= 0.52
    return Measurement(
        value=needed, unit="MFU",
        text=f"needs {needed:.0%} MFU of the A100's {peak / 1e12:.0f} TFLOP/s bf16 dense: "
             f"{'within' if plausible else 'outside'} the {min(reported.values()):.0%}–52% that large runs "
             "reported",
        device="computed", verdict="holds with conditions" if plausible else "misleading")


@register("C3", chapter=1)
def tensor_cores() -> Measurement:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1024, 1024, generator=g)
    x = torch.randn(256, 1024, generator=g)
    w24 = sparsity.prune_2_4(w)
    zeros = (w24 == 0).float().mean().item()
    slowdown = compare(lambda: x @ w24.T, lambda: x @ w.T, min_rounds=7).ratio  # pruned time / dense time
    ratios = {f"{s.bf16_sparse_tflops / s.bf16_tflops:.2g}×" for s in SPECS.values() if s.bf16_sparse_tflops}
    return Measurement(
        value={"zero fraction": zeros, "pruned/dense time": slowdown}, unit="",
        text=(f"2:4 pruning zeroes {zeros:.0%} of a weight, yet a dense matmul with it takes "
              f"{slowdown:.2f}× the time here; the spec sheets' sparse peaks are {', '.join(sorted(ratios))} dense, "
              "reached only by sparse kernels on 2:4 weights. Tensor cores are matrix units inside SIMT SMs "
              "(issued per warp), not SIMT units themselves"),
        device=here(), verdict="misleading")


@register("C4", chapter=1)
def bandwidth_matters() -> Measurement:
    # a weight far larger than any cache (256 MiB of fp32), so every byte really comes from memory; timed in the
    # same rounds as the peak matmul and the read bandwidth, so a busy spell slows them together
    gemv = roofline.Point("matrix-vector", 1, 8192, 8192, 4)
    machine = hardware.measure(seconds=1.0, points=[gemv])
    (gemv,) = machine.points
    n = machine.matmul_n
    predicted = roofline.attainable(gemv.intensity, *machine.roof)
    share = machine.rate(gemv.label, roofline.gemm_flops(gemv.m, gemv.n, gemv.k))  # its FLOP/s / the peak's
    side = share.direction(0.5)  # under half the peak: bandwidth, not FLOP/s, decides
    machine.check_roof()
    return Measurement(
        value={"square FLOP/s": machine.matmul_flops, "gemv FLOP/s": gemv.measured_flops,
               "gemv roofline FLOP/s": predicted, "gemv / square": share.value, "spread": share.spread},
        unit="FLOP/s",
        text=(f"a square {n}³ GEMM (intensity {roofline.gemm_intensity(n, n, n, 4):.0f} FLOP/B) runs at "
              f"{machine.matmul_flops / 1e9:.0f} GFLOP/s; a matrix-vector product with an 8192² weight "
              f"(intensity {gemv.intensity:.2f}), timed in the same rounds, at {gemv.measured_flops / 1e9:.1f} "
              f"GFLOP/s = {share.value:.0%} ±{share.spread:.0%} of it, against ≤ {predicted / 1e9:.1f} predicted by "
              f"the roofline from the measured read bandwidth ({machine.read_bandwidth / 1e9:.3g} GB/s, "
              f"{machine.read_by}; {machine.load})"),
        device=here(),
        verdict={"below": "holds", "above": "holds with conditions"}.get(side, INCONCLUSIVE))
