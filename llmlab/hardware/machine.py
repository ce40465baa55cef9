"""Measured here: what the machine under a chapter can do, its matmul FLOP/s and memory bandwidth.

A speed a chapter reports means something only next to what the machine could do at best. Two numbers bound
almost every kernel (the roofline model):

- compute: FLOP/s of a large fp32 matrix multiply, the most compute-dense operation there is;
- memory: bytes per second that a kernel can **read** from main memory — the sum of a tensor far larger than the
  last-level cache, counting every byte read once. That is the roof's slope, because a GEMM or a matrix-vector
  product mostly reads (its output is small next to its operands). A GEMM measured in the same rounds whose
  operands exceed the cache read each of its bytes from memory at least once, so its bytes / time is a
  bandwidth the memory sustained too: when one is faster than the sum, it sets the slope (`read_by` names which).
  The slope is the best main-memory read measured, as the flat roof is the best matmul.

A **copy** bandwidth (`dst.copy_(src)`, counting every byte read and every byte written, as STREAM's "Copy")
is measured too and kept as a separate, named figure: a copy pays for a write (on most CPUs also a read of the
destination) per byte read, so it is not the bandwidth a matrix-vector product sees, and drawing the roof with it
puts read-mostly kernels above the roof.

All of them are timed in the same interleaved rounds (`llmlab.timing`), together with whatever the caller wants
placed under that roof (`points`: GEMMs; `alongside`: any function, e.g. a training step): a busy spell of the
machine then lowers the roof and the points together, and a figure relative to the peak (an MFU) is a ratio
within rounds, which a busy machine hardly moves.

    from llmlab import hardware
    m = hardware.measure()        # about a second
    print(m)    # cpu · AMD EPYC · 2 threads: matmul 0.09 TFLOP/s fp32 (n=1024) ±2%, read 20 GB/s ±3% ...
    m.roof                         # (peak FLOP/s, read bandwidth B/s): for plots.roofline and the widgets
    m.rate("step", flops_per_step) # a function measured alongside, as a share of the peak (an MFU), round by round

Everything is measured the same way on a laptop CPU and on a GPU (where the clock is read only after
`runtime.synchronize`, see `llmlab.timing`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmlab import runtime, timing, validation
from llmlab.hardware import roofline

__all__ = ["Measured", "Rate", "device_name", "cache_bytes", "measure", "matmul_peak", "peak_matmul"]

PEAK, READ, COPY = "matmul", "read", "copy"  # the names of the machine's own kernels in `Measured.rounds`
MIN_PRODUCT_S = 0.01  # the search for n stops once one product takes this long: milliseconds, not microseconds


def device_name(device=None) -> str:
    """A human name for `device` (default: this tier's): the GPU's marketing name, or the CPU model."""

    device = runtime.device() if device is None else torch.device(device)
    return runtime.device_properties(device).name if device.type == "cuda" else runtime.cpu_name()


def cache_bytes(device=None) -> int:
    """The size of `device`'s largest cache in bytes (a CPU's last level, from sysfs; a GPU's L2), 0 if unknown.
    GEMMs whose operands fit in it may run above the roof drawn with main memory's bandwidth."""

    device = runtime.device() if device is None else torch.device(device)
    return runtime.device_properties(device).l2_cache_size if device.type == "cuda" else runtime.cpu_cache_bytes()


@dataclass(frozen=True)
class Rate:
    """One function's FLOP/s over a peer's, from the rounds they shared: (flops / time) / (peer_flops / peer time),
    the median of the per-round values. Against the peak matmul it is an MFU."""

    comparison: timing.Comparison  # the peer's time / this function's time, round by round
    scale: float  # flops / peer_flops per call

    @property
    def value(self) -> float:
        return self.scale * self.comparison.ratio

    @property
    def spread(self) -> float:
        return self.comparison.spread

    @property
    def conclusive(self) -> bool:
        return self.comparison.conclusive

    def direction(self, threshold: float = 1.0) -> str:
        """'above' when the rounds' interquartile range lies above `threshold`, 'below' when under it, else
        'not conclusive'."""
        side = self.comparison.direction(threshold / self.scale)  # the peer's time / ours, against threshold/scale
        return {"slower": "above", "faster": "below"}.get(side, side)

    def note(self) -> str:
        return self.comparison.note()

    def __str__(self) -> str:
        return f"{self.value:.3g} ±{self.spread:.0%}"


@dataclass(frozen=True)
class Measured:
    """What `measure` found on one device: every timing of its rounds, and the sizes it chose."""

    device: str  # the torch device, e.g. "cpu" or "cuda:0"
    name: str  # e.g. "AMD EPYC 7B13" or "NVIDIA H200"
    threads: int  # CPU threads torch computes with (torch.get_num_threads())
    matmul_n: int  # the n of the fp32 n×n @ n×n product timed for the peak
    matmul_search: tuple[tuple[int, float], ...]  # (n, seconds of one product) for each n the search tried
    read_bytes: int  # the size of the tensor summed for the read bandwidth
    copy_bytes: int  # the size of the tensor copied for the copy bandwidth
    cache_bytes: int  # the largest cache (0 if unknown): operands that fit may beat the read bandwidth
    budget_s: float  # the seconds the rounds were given
    rounds: timing.Rounds  # "matmul", "read", "copy", each point's label and each alongside name
    points: tuple[roofline.Point, ...] = ()  # the GEMMs measured in the same rounds

    @property
    def matmul(self) -> timing.Timing:
        return self.rounds[PEAK]

    def _readers(self) -> list[tuple[str, int, timing.Timing]]:
        """(what, bytes read from main memory at least, Timing) of the sum and of every point beyond the cache."""
        return [(f"sum of {self.read_bytes >> 20} MiB", self.read_bytes, self.rounds[READ])] + [
            (pt.label, pt.operand_bytes, pt.timing) for pt in self.points if pt.operand_bytes > self.cache_bytes]

    def _fastest_reader(self) -> tuple[str, int, timing.Timing]:
        return max(self._readers(), key=lambda r: r[1] / r[2].seconds)

    @property
    def read_by(self) -> str:
        """The kernel whose reads set the roof's slope: the sum, or a GEMM beyond the cache that read faster."""
        return self._fastest_reader()[0]

    @property
    def read(self) -> timing.Timing:
        """The Timing of the kernel that set the read bandwidth (`read_by`)."""
        return self._fastest_reader()[2]

    @property
    def copy(self) -> timing.Timing:
        return self.rounds[COPY]

    @property
    def matmul_flops(self) -> float:
        """FLOP/s of the n×n fp32 product, counting 2n³ FLOPs: the roof's flat part."""
        return 2 * self.matmul_n**3 / self.matmul.seconds

    @property
    def read_bandwidth(self) -> float:
        """Bytes/s read from main memory, each byte counted once: the roof's slope. The sum over `read_bytes`, or
        a point beyond the cache whose operands' bytes / time is higher (`read_by`)."""
        _, nbytes, t = self._fastest_reader()
        return nbytes / t.seconds

    @property
    def copy_bandwidth(self) -> float:
        """Bytes/s of a copy of `copy_bytes`, counting every byte read and every byte written (STREAM's Copy)."""
        return 2 * self.copy_bytes / self.copy.seconds

    @property
    def roof(self) -> tuple[float, float]:
        """(peak FLOP/s, bandwidth B/s) of this machine's roofline: the matmul's FLOP/s and the read bandwidth."""
        return self.matmul_flops, self.read_bandwidth

    @property
    def load(self) -> timing.Load:
        return self.rounds.load

    def rate(self, name: str, flops: float, peer: str = PEAK, peer_flops: float | None = None) -> Rate:
        """`name`'s FLOP/s (doing `flops` per call) over `peer`'s (`peer_flops` per call; by default the peak
        matmul and its 2n³), round by round: an MFU against the measured peak, or one batch size against another."""
        validation.one_of("name", name, self.rounds.timings)
        validation.one_of("peer", peer, self.rounds.timings)
        validation.positive("flops", flops)
        peer_flops = 2 * self.matmul_n**3 if peer_flops is None else validation.positive("peer_flops", peer_flops)
        return Rate(self.rounds.ratio(peer, name), flops / peer_flops)

    def check_roof(self, points=None) -> bool:
        """Check that every measured point (default: this measurement's own) is under this roof, allowing for the
        spreads; a point whose operands fit in the cache is held to the flat roof only (see
        `roofline.check_under_roof`). Returns whether all hold."""
        points = self.points if points is None else points
        return all([roofline.check_under_roof(pt, *self.roof, peak_spread=self.matmul.spread,
                                              bandwidth_spread=self.read.spread, cache_bytes=self.cache_bytes,
                                              roof=f"this machine's measured roof ({self.name})")
                    for pt in points])  # a list, so that every violation is reported, not only the first

    def place(self, point: roofline.Point) -> str:
        """One line placing a measured `point` on this roof: its FLOP/s and spread, its share of the roof there,
        and, for operands that fit in the cache, where it stands against main memory's sloped roof."""
        if point.measured_flops is None:
            raise ValueError(f"point={point.label!r} has no measured_flops: measure it before placing it")
        roof = roofline.attainable(point.intensity, *self.roof)
        line = (f"{point.label}: {point.intensity:.3g} FLOP/B, measured {point.measured_flops / 1e9:.3g} GFLOP/s "
                f"±{point.spread:.0%} = {point.measured_flops / roof:.0%} of this machine's roof there "
                f"({roofline.bound(point.intensity, *self.roof)}-bound)")
        if point.operand_bytes > self.cache_bytes:
            return line + f"; its {point.operand_bytes / 2**20:.3g} MiB of operands stream from main memory"
        if roofline.bound(point.intensity, *self.roof) == "compute":
            return line + (f"; its {point.operand_bytes / 2**20:.3g} MiB of operands fit in the "
                           f"{self.cache_bytes / 2**20:.3g} MiB cache")
        slope = point.intensity * self.read_bandwidth
        where = ("above main memory's sloped roof, as a cache can be" if point.measured_flops > slope
                 else "under main memory's sloped roof all the same")
        return (line + f"; its {point.operand_bytes / 2**20:.3g} MiB of operands fit in the "
                f"{self.cache_bytes / 2**20:.3g} MiB cache: {point.measured_flops / slope:.2f}× "
                f"{point.intensity:.3g} FLOP/B × the read bandwidth, {where}")

    def note(self) -> str:
        """'' when the roof's figures are conclusive, else the busy-machine sentence of the widest of them."""
        return max((t.note() for t in (self.matmul, self.read, self.copy)), key=len)

    def __str__(self) -> str:
        return (f"{self.device} · {self.name} · {self.threads} thread{'s' * (self.threads != 1)}, {self.load}: "
                f"matmul {self.matmul_flops / 1e12:.3g} TFLOP/s fp32 (n={self.matmul_n}) ±{self.matmul.spread:.0%}, "
                f"read {self.read_bandwidth / 1e9:.3g} GB/s ±{self.read.spread:.0%} "
                f"({self.read_by}: the roof's slope), "
                f"copy {self.copy_bandwidth / 1e9:.3g} GB/s ±{self.copy.spread:.0%} "
                f"({self.copy_bytes >> 20} MiB, read + write counted)")


def _matmul(n: int, device):
    """A function computing one n×n @ n×n fp32 product into a preallocated output."""

    a, b = (torch.randn(n, n, device=device) for _ in range(2))  # (n, n) each
    c = torch.empty(n, n, device=device)  # (n, n)
    return lambda: torch.matmul(a, b, out=c)


def _search_n(device) -> tuple[int, tuple[tuple[int, float], ...]]:
    """The n of the peak matmul: doubled from 1024 (4096 on a GPU) until one product takes MIN_PRODUCT_S.

    Small matrices under-fill the machine (threads, cores, SMs idle) and time overheads, so n grows until a
    product is long enough that the clock and the OS's noise are small next to it, or to the largest size a
    small machine's memory holds. A busy machine only makes a product slower, so it can stop the search early
    but never at a size below the start, which already fills the machine. On a GPU this is true fp32 unless
    TF32 was switched on (`torch.set_float32_matmul_precision("high")`); torch's default is off.
    """

    n, n_max = (4096, 16384) if device.type == "cuda" else (1024, 4096)
    tried = []
    while True:
        one = timing.measure(_matmul(n, device), device=device, min_rounds=1, max_rounds=1).seconds
        tried.append((n, one))
        if one >= MIN_PRODUCT_S or n >= n_max:
            return n, tuple(tried)
        n *= 2


def peak_matmul(device=None) -> tuple[int, Callable[[], object]]:
    """(n, a function computing one fp32 n×n product): the matmul `measure` times for the roof's flat part, n found
    by the same search, for a caller to time beside its own work."""
    device = runtime.usable_device(device)
    n, _ = _search_n(device)
    return n, _matmul(n, device)


def matmul_peak(device=None, seconds: float = 0.5) -> tuple[float, int, timing.Timing]:
    """The roof's flat part alone: (FLOP/s, n, Timing) of the fp32 n×n matmul `measure` times, n found by the same
    search, on the threads torch uses now, in about `seconds` of rounds. Without the bandwidths, whose tensors
    exceed the last-level cache (up to 1 GiB each: seconds to allocate and sum on a server CPU)."""
    validation.positive("seconds", seconds)
    device = runtime.usable_device(device)
    n, product = peak_matmul(device)
    t = timing.measure(product, device=device, budget_s=seconds)
    return 2 * n**3 / t.seconds, n, t


def measure(device=None, seconds: float = 1.0, points=(), alongside: dict | None = None,
            threads: int | None = None) -> Measured:
    """Measure the peak matmul FLOP/s, the read and the copy bandwidth on `device` (default: this tier's), in
    rounds of about `seconds` in all (at least `timing.interleave`'s five rounds), with each roofline `Point` of
    `points` and each function of `alongside` ({name: fn}) timed in the same rounds.

    `threads` (default: torch's current setting) sets the CPU threads torch computes with during the rounds, and
    is restored after. One thread makes a CPU measurement of many small operators robust on a shared machine: a
    multi-threaded operator ends at a barrier that waits for its slowest thread, and when another program holds a
    core that wait is the OS's time slice, at every operator.

    The returned `Measured` holds every Timing (`.rounds`), the points with their FLOP/s (`.points`), and
    `.rate(name, flops)` for an alongside function's share of the peak.
    """

    if math.isinf(validation.positive("seconds", seconds)):
        raise ValueError(f"seconds={seconds!r} must be a finite positive number")
    alongside = dict(alongside or {})
    if not all(isinstance(k, str) and callable(f) for k, f in alongside.items()):
        raise ValueError(f"alongside={alongside!r} must be a dict of {{name: function}}")
    if threads is not None:
        validation.positive_int("threads", threads)
    points = tuple(points)
    if not all(isinstance(pt, roofline.Point) for pt in points):
        raise ValueError(f"points={points!r} must be roofline.Point objects")
    names = [PEAK, READ, COPY, *(pt.label for pt in points), *alongside]
    if len(set(names)) != len(names):
        raise ValueError(f"the names of points and alongside, {names[3:]}, must be distinct and not one of "
                         f"{names[:3]}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return _measure(runtime.device() if device is None else torch.device(device), float(seconds), points,
                        alongside)
    finally:
        torch.set_num_threads(before)


def _measure(device, seconds: float, points: tuple, alongside: dict) -> Measured:
    started = time.perf_counter()
    cache = cache_bytes(device)
    n, tried = _search_n(device)
    # beyond the last-level cache, so that every byte comes from main memory: STREAM's 4 × the cache, but on a CPU
    # no more than 1 GiB where that is already 2 × (a 480 MiB server L3 would ask for 2 × 1.9 GB: seconds per round)
    floor = (1 << 30) if device.type == "cuda" else (128 << 20)
    nbytes = max(floor, 4 * cache if device.type == "cuda" else min(4 * cache, max(2 * cache, 1 << 30)))
    src = torch.ones(nbytes // 4, device=device)  # written once, so every page is really allocated
    dst = torch.zeros_like(src)
    gemms = {pt.label: roofline.gemm_function(pt, device) for pt in points}
    fns = {PEAK: _matmul(n, device), READ: src.sum, COPY: lambda: dst.copy_(src),
           **{label: fn for label, (fn, _) in gemms.items()}, **alongside}
    budget = max(0.0, seconds - (time.perf_counter() - started))
    rounds = timing.interleave(fns, device=device, budget_s=budget)
    measured = tuple(pt.timed(rounds[pt.label], gemms[pt.label][1]) for pt in points)
    return Measured(device=str(device), name=device_name(device), threads=torch.get_num_threads(), matmul_n=n,
                    matmul_search=tried, read_bytes=nbytes, copy_bytes=nbytes, cache_bytes=cache,
                    budget_s=seconds, rounds=rounds, points=measured)
