"""The roofline model: is a kernel limited by arithmetic or by memory traffic?

A kernel doing F FLOPs while moving B bytes to and from memory has arithmetic intensity I = F / B. On a
device with peak P FLOP/s and memory bandwidth W bytes/s it can run at most

    attainable(I) = min(P, I · W)

so below the ridge point I* = P / W it is memory-bound (the sloped roof), above it compute-bound (the flat
roof). A GEMM (m, k) @ (k, n) does 2mnk FLOPs on at least (mk + kn + mn) elements: big square GEMMs sit far
right of the ridge; a GEMM with m = 1 (a matrix-vector product, e.g. decoding one token) sits far left.

    from llmlab.hardware import roofline, SPECS
    I = roofline.gemm_intensity(4096, 4096, 4096, bytes_per_element=2)    # 1365 FLOP/byte
    roofline.attainable(I, SPECS["A100 SXM"].peak_flops(), SPECS["A100 SXM"].hbm_gbs * 1e9)

Claim C4 (bandwidth matters, not only TFLOPS) is measured with it in `llmlab.claims.ch01`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from llmlab import runtime, validation
from llmlab.timing import measure as time_rounds

__all__ = ["gemm_flops", "gemm_bytes", "gemm_intensity", "attainable", "ridge_point", "bound", "Point",
           "model_gemms", "measure_point"]


def _check_shape(m, n, k) -> None:
    for name, value in (("m", m), ("n", n), ("k", k)):
        validation.positive(name, value)


def gemm_flops(m: int, n: int, k: int) -> int:
    _check_shape(m, n, k)
    return 2 * m * n * k


def gemm_bytes(m: int, n: int, k: int, bytes_per_element: int = 2) -> int:
    """The least memory traffic of C = A @ B: read A and B once, write C once."""
    _check_shape(m, n, k)
    validation.positive("bytes_per_element", bytes_per_element)
    return (m * k + k * n + m * n) * bytes_per_element


def gemm_intensity(m: int, n: int, k: int, bytes_per_element: int = 2) -> float:
    """FLOPs per byte of the GEMM (m, k) @ (k, n)."""
    return gemm_flops(m, n, k) / gemm_bytes(m, n, k, bytes_per_element)


def attainable(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roof: min(peak, intensity × bandwidth), in FLOP/s."""
    validation.positive("intensity", intensity)
    validation.positive("peak_flops", peak_flops)
    validation.positive("bandwidth", bandwidth)
    return min(peak_flops, intensity * bandwidth)


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    validation.positive("peak_flops", peak_flops)
    validation.positive("bandwidth", bandwidth)
    return peak_flops / bandwidth


def bound(intensity: float, peak_flops: float, bandwidth: float) -> str:
    """'memory' left of the ridge point, 'compute' at or right of it."""
    return "compute" if intensity >= ridge_point(peak_flops, bandwidth) else "memory"


@dataclass(frozen=True)
class Point:
    """A GEMM placed on a roofline: its shape, intensity and (optionally) a measured FLOP/s."""

    label: str
    m: int
    n: int
    k: int
    bytes_per_element: int = 2
    measured_flops: float | None = None

    @property
    def intensity(self) -> float:
        return gemm_intensity(self.m, self.n, self.k, self.bytes_per_element)


def measure_point(point: Point, device=None, repeats: int = 5) -> Point:
    """`point` with its FLOP/s measured here (fp32 when bytes_per_element is 4, else bf16 on a GPU / fp32 on
    a CPU, whose matmul has no fast bf16 path)."""

    device = runtime.device() if device is None else torch.device(device)
    dtype = torch.bfloat16 if (device.type == "cuda" and point.bytes_per_element == 2) else torch.float32
    a = torch.randn(point.m, point.k, device=device, dtype=dtype)
    b = torch.randn(point.k, point.n, device=device, dtype=dtype)
    seconds = time_rounds(lambda: a @ b, device=device, min_rounds=repeats).seconds
    return replace(point, bytes_per_element=a.element_size(),
                   measured_flops=gemm_flops(point.m, point.n, point.k) / seconds)


def model_gemms(config, tokens: int, bytes_per_element: int = 2) -> list[Point]:
    """The weight GEMMs of one transformer layer of `config` (llmlab.model.GPTConfig) on `tokens` tokens."""
    validation.positive("tokens", tokens)
    C = config.n_embd
    shapes = [("qkv", 3 * C, C), ("attn out", C, C), ("mlp up", 4 * C, C), ("mlp down", C, 4 * C)]
    return [Point(f"{name} ({tokens}×{k} @ {k}×{n})", tokens, n, k, bytes_per_element) for name, n, k in shapes]


