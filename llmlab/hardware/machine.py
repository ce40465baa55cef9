"""Measured here: what the machine under a chapter can do, its matmul FLOP/s and memory bandwidth.

A speed a chapter reports means something only next to what the machine could do at best. Two numbers bound
almost every kernel (the roofline model):

- compute: FLOP/s of a large fp32 matrix multiply, the most compute-dense operation there is;
- memory: bytes per second of a large tensor copy, which does no arithmetic at all.

    from llmlab import hardware
    m = hardware.measure()        # about a second
    print(m)    # cpu · AMD EPYC · 2 threads: matmul 0.071 TFLOP/s fp32 (n=1024), copy 9.5 GB/s (128 MiB)

Both are measured the same way on a laptop CPU and on a GPU (where the clock is read only after
`torch.cuda.synchronize`, see `llmlab.timing`).
"""

from __future__ import annotations

import math
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from llmlab import runtime, validation
from llmlab.timing import measure as time_rounds

__all__ = ["Measured", "device_name", "measure"]


def device_name(device=None) -> str:
    """A human name for `device` (default: this tier's): the GPU's marketing name, or the CPU model."""

    device = runtime.device() if device is None else torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


@dataclass(frozen=True)
class Measured:
    """What `measure` found on one device."""

    device: str  # the torch device, e.g. "cpu" or "cuda:0"
    name: str  # e.g. "AMD EPYC 7B13" or "NVIDIA H200"
    threads: int  # CPU threads torch computes with (torch.get_num_threads())
    matmul_flops: float  # FLOP/s of an fp32 n×n @ n×n matmul, counting 2n³ FLOPs per product
    matmul_n: int  # the n it was measured at
    copy_bandwidth: float  # bytes/s of a tensor copy, counting every byte read and every byte written
    copy_bytes: int  # the size of the tensor copied

    def __str__(self) -> str:
        return (f"{self.device} · {self.name} · {self.threads} threads: "
                f"matmul {self.matmul_flops / 1e12:.3g} TFLOP/s fp32 (n={self.matmul_n}), "
                f"copy {self.copy_bandwidth / 1e9:.3g} GB/s ({self.copy_bytes >> 20} MiB)")


def _matmul(n: int, device):
    """A function computing one n×n @ n×n fp32 product into a preallocated output."""

    a, b = (torch.randn(n, n, device=device) for _ in range(2))
    c = torch.empty(n, n, device=device)
    return lambda: torch.matmul(a, b, out=c)


def _matmul_flops(device, budget: float) -> tuple[float, int]:
    """FLOP/s of an n×n fp32 matmul, n doubled from 1024 (2048 on a GPU) until one product takes a tenth of the
    budget.

    Small matrices under-fill the machine (threads, cores, SMs idle), so n grows until a product is long
    enough to time reliably, or to the largest size a small machine's memory holds. On a GPU this is true
    fp32 unless TF32 was switched on (`torch.set_float32_matmul_precision("high")`); torch's default is off.
    """

    started = time.perf_counter()
    # start where the machine is already well filled: a slow first run (a busy machine) must not stop the
    # search at a size that measures overheads rather than arithmetic
    n, n_max = (2048, 16384) if device.type == "cuda" else (1024, 4096)
    while True:
        product = _matmul(n, device)
        one = time_rounds(product, device=device, min_rounds=1, max_rounds=1).seconds
        if one >= budget / 10 or n >= n_max:
            break
        n *= 2
    rest = max(0.0, budget - (time.perf_counter() - started))
    return 2 * n**3 / time_rounds(product, device=device, min_rounds=3, budget_s=rest, warmup=0).seconds, n


def _copy_bandwidth(device, budget: float) -> tuple[float, int]:
    """Bytes/s of `dst.copy_(src)` for a tensor well beyond any cache (128 MiB on CPU, 1 GiB on GPU).

    A copy reads every byte once and writes it once, so it moves 2 × nbytes; that is the figure compared with
    a memory's rated bandwidth (STREAM's "Copy" counts the same way).
    """

    nbytes = (1 << 30) if device.type == "cuda" else (128 << 20)
    src = torch.ones(nbytes // 4, device=device)  # written once, so every page is really allocated
    dst = torch.zeros_like(src)
    copy = lambda: dst.copy_(src)
    return 2 * nbytes / time_rounds(copy, device=device, min_rounds=3, budget_s=budget).seconds, nbytes


def measure(device=None, seconds: float = 1.0) -> Measured:
    """Measure matmul FLOP/s and copy bandwidth on `device` (default: this tier's) in about `seconds`."""

    if math.isinf(validation.positive("seconds", seconds)):
        raise ValueError(f"seconds={seconds!r} must be a finite positive number")
    seconds = float(seconds)
    device = runtime.device() if device is None else torch.device(device)
    flops, n = _matmul_flops(device, seconds / 2)
    bandwidth, nbytes = _copy_bandwidth(device, seconds / 2)
    return Measured(device=str(device), name=device_name(device), threads=torch.get_num_threads(),
                    matmul_flops=flops, matmul_n=n, copy_bandwidth=bandwidth, copy_bytes=nbytes)
