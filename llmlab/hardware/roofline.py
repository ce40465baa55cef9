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

Measured points are checked against a measured roof with `check_under_roof`: a point above its roof is a warning
(`llmlab.invariants`), except that a GEMM whose operands fit in the cache is checked against the flat roof only —
the sloped roof's bandwidth is main memory's, and a cache is faster.

Claim C4 (bandwidth matters, not only TFLOPS) is measured with it in `llmlab.claims.ch01`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from llmlab import invariants, runtime, timing, validation

__all__ = ["gemm_flops", "gemm_bytes", "gemm_intensity", "attainable", "ridge_point", "bound", "Point",
           "model_gemms", "gemm_function", "measure_point", "check_under_roof"]


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
    """A GEMM placed on a roofline: its shape, intensity and (optionally) a measured FLOP/s, with the Timing it
    came from (its spread and the machine's load)."""

    label: str
    m: int
    n: int
    k: int
    bytes_per_element: int = 2
    measured_flops: float | None = None
    timing: timing.Timing | None = None

    @property
    def intensity(self) -> float:
        return gemm_intensity(self.m, self.n, self.k, self.bytes_per_element)

    @property
    def operand_bytes(self) -> int:
        """A, B and C together: the working set, compared with the cache."""
        return gemm_bytes(self.m, self.n, self.k, self.bytes_per_element)

    @property
    def spread(self) -> float:
        """The measured figure's spread (0 for a point not measured or given without its Timing)."""
        return self.timing.spread if self.timing is not None else 0.0

    def timed(self, t: timing.Timing, bytes_per_element: int) -> Point:
        """This point measured: `t` the seconds of one product whose elements are `bytes_per_element` bytes."""
        return replace(self, bytes_per_element=bytes_per_element, timing=t,
                       measured_flops=gemm_flops(self.m, self.n, self.k) / t.seconds)


def gemm_function(point: Point, device=None):
    """`(fn, bytes_per_element)`: a function computing `point`'s product once into a preallocated output, in fp32
    when bytes_per_element is 4, else bf16 on a GPU / fp32 on a CPU (whose matmul has no fast bf16 path)."""

    device = runtime.device() if device is None else torch.device(device)
    dtype = torch.bfloat16 if (device.type == "cuda" and point.bytes_per_element == 2) else torch.float32
    a = torch.randn(point.m, point.k, device=device, dtype=dtype)  # (m, k)
    b = torch.randn(point.k, point.n, device=device, dtype=dtype)  # (k, n)
    c = torch.empty(point.m, point.n, device=device, dtype=dtype)  # (m, n)
    return (lambda: torch.matmul(a, b, out=c)), a.element_size()


def measure_point(point: Point, device=None, budget_s: float = 0.5) -> Point:
    """`point` with its FLOP/s measured here by `llmlab.timing` in about `budget_s` seconds (see `gemm_function`
    for the dtype). To place points under a measured roof, measure them with the roof instead, in the same rounds
    (`llmlab.hardware.measure(points=...)`), so that a busy spell lowers both."""

    validation.positive("budget_s", budget_s)
    device = runtime.device() if device is None else torch.device(device)
    fn, size = gemm_function(point, device)
    return point.timed(timing.measure(fn, device=device, budget_s=budget_s), size)


def check_under_roof(point: Point, peak_flops: float, bandwidth: float, *, peak_spread: float = 0.0,
                     bandwidth_spread: float = 0.0, cache_bytes: int = 0, roof: str = "the roof") -> bool:
    """Check (`llmlab.invariants.check`) that the measured `point` is not above the roof min(P, I·W), allowing for
    the point's and the roof's spreads. A point whose operands fit in `cache_bytes` (0: no cache known) is
    checked against the flat roof P only: the slope W is main memory's bandwidth, and a cached GEMM may beat it.
    Returns whether it holds."""

    if point.measured_flops is None:
        raise ValueError(f"point={point.label!r} has no measured_flops: measure it before checking it")
    validation.positive("peak_flops", peak_flops)
    validation.positive("bandwidth", bandwidth)
    cached = point.operand_bytes <= cache_bytes
    sloped = not cached and bound(point.intensity, peak_flops, bandwidth) == "memory"
    ceiling = point.intensity * bandwidth if sloped else peak_flops
    allowance = 1 + point.spread + (bandwidth_spread if sloped else peak_spread)
    which = (f"{point.intensity:.3g} FLOP/B × {bandwidth / 1e9:.3g} GB/s (the sloped roof)" if sloped
             else f"the flat roof, {peak_flops / 1e9:.3g} GFLOP/s"
             + (f" (its {point.operand_bytes / 2**20:.3g} MiB of operands fit in the cache)" if cached else ""))
    return invariants.check(
        point.measured_flops <= ceiling * allowance,
        f"{point.label} measured {point.measured_flops / 1e9:.3g} GFLOP/s ±{point.spread:.0%}, above {roof}: "
        f"{which} = {ceiling / 1e9:.3g} GFLOP/s, allowing for the spreads")


def model_gemms(config, tokens: int, bytes_per_element: int = 2) -> list[Point]:
    """The weight GEMMs of one transformer layer of `config` (llmlab.model.GPTConfig) on `tokens` tokens."""
    validation.positive("tokens", tokens)
    C = config.n_embd
    shapes = [("qkv", 3 * C, C), ("attn out", C, C), ("mlp up", 4 * C, C), ("mlp down", C, 4 * C)]
    return [Point(f"{name} ({tokens}×{k} @ {k}×{n})", tokens, n, k, bytes_per_element) for name, n, k in shapes]


