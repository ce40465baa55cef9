"""Timing primitives every measurement in the library shares: wait for a device, time a function, compare two.

- `synchronize(device)`: wait for the device's queued work (CUDA kernels run asynchronously).
- `median_seconds(fn, ...)`: the median wall time of `fn()` over repeated runs, after warm-up runs.
- `compare(impl, peer, ...)`: an implementation and its peer timed alternately, their medians and their ratio.

A base module: it imports only the standard library and torch. The benches (`llmlab bench NAME`), the claims
and the chapters all time with it; the next issue (#16) builds its interleaved, load-aware measurement on it.
"""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["synchronize", "median_seconds", "compare"]


def synchronize(device) -> None:
    """Wait for `device`'s queued work (CUDA kernels run asynchronously); nothing to wait for on the CPU."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, *, device=None, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of `fn()` over `repeats` runs, after `warmup` untimed runs.

    GPU work is asynchronous: on a CUDA `device` the clock is read only after `torch.cuda.synchronize`, so
    the time is the kernel's, not the launch's. The median ignores the odd run slowed by the OS.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    if warmup < 0:
        raise ValueError(f"warmup={warmup} must be >= 0")
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare(impl, peer, *, device=None, repeats: int = 5) -> dict:
    """Time `impl()` and `peer()` alternately (so a slow spell of the machine hits both) and compare medians.

    Returns {"impl_ms", "peer_ms", "ratio"} with ratio = impl time / peer time.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    impl()  # warm-up: first-call compilation, allocator growth
    peer()
    impl_s, peer_s = [], []
    for _ in range(repeats):
        impl_s.append(median_seconds(impl, device=device, repeats=1, warmup=0))
        peer_s.append(median_seconds(peer, device=device, repeats=1, warmup=0))
    i, p = statistics.median(impl_s), statistics.median(peer_s)
    return {"impl_ms": i * 1e3, "peer_ms": p * 1e3, "ratio": i / p}
