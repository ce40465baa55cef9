"""`llmlab doctor`: can this machine run every chapter? Each check prints one line; the last line says.

    $ llmlab doctor
      ok    tier        llmlab 0.1.0 · cpu tier · CPU (2 cores) · device cpu · backend gloo · Triton …
      ok    versions    python 3.11.7 · torch 2.13.0+cpu · triton 3.9.0 · numpy 2.4.6 · …
      ok    devices     cpu: AMD EPYC, 2 threads
      ok    speed       matmul 0.15 TFLOP/s fp32 (n=2048) · memory copy 17 GB/s
      ok    all-reduce  2 gloo ranks: all_reduce(sum) of [1, 2] gave 3 on every rank (3.1 s)
      ok    triton      vector_add (interpreted) equals its reference for float32, float16, bfloat16
    doctor: all checks passed — every chapter can run here (cpu tier)

A check is a function returning (ok, text). One that raises is reported as failed with its error, and the
others still run; the exit code is non-zero when any check failed, since a chapter needs each of them.
"""

from __future__ import annotations

import platform
import time
import traceback
from importlib import metadata

import torch
import torch.distributed as td

from llmlab import dist, hardware, runtime
from llmlab.kernels import vector_add

__all__ = ["CHECKS", "main"]

PACKAGES = ("torch", "triton", "numpy", "jupyterlab", "ipywidgets", "nbclient")


def check_tier() -> tuple[bool, str]:
    return True, runtime.describe()


def check_versions() -> tuple[bool, str]:
    found, missing = [f"python {platform.python_version()}"], []
    for package in PACKAGES:
        try:
            found.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            missing.append(package)
    text = " · ".join(found)
    if missing:
        return False, f"{text} · not installed: {', '.join(missing)} (run `make setup`)"
    return True, text


def check_devices() -> tuple[bool, str]:
    devices = [f"cpu: {hardware.device_name('cpu')}, {torch.get_num_threads()} threads"]
    for i in range(runtime.device_count()):
        props = runtime.device_properties(i)
        devices.append(f"gpu {i}: {props.name}, {props.total_memory / 2**30:.0f} GiB")
    return True, " · ".join(devices)


def check_speed() -> tuple[bool, str]:
    m = hardware.measure(seconds=1.0)
    return True, (f"matmul {m.matmul_flops / 1e12:.3g} TFLOP/s fp32 (n={m.matmul_n}) · "
                  f"memory copy {m.copy_bandwidth / 1e9:.3g} GB/s ({m.device})")


def _all_reduce_rank() -> list[float]:
    """On each rank: all-reduce (sum) a tensor of rank + 1; every rank must get 1 + 2 + … + world_size."""

    device = runtime.device()  # an NCCL rank's GPU; a gloo rank's CPU
    t = torch.full((4,), td.get_rank() + 1.0, device=device)
    td.all_reduce(t)
    return t.tolist()


def check_all_reduce(world_size: int | None = None) -> tuple[bool, str]:
    """All-reduce on every GPU of the machine (NCCL), or on 2 gloo ranks without GPUs."""

    world_size = world_size or max(2, runtime.tier().n_gpus)
    start = time.perf_counter()
    results = dist.spawn(_all_reduce_rank, world_size, timeout=60)
    seconds = time.perf_counter() - start
    expected = world_size * (world_size + 1) / 2
    backend = runtime.backend(world_size)
    if all(r == [expected] * 4 for r in results):
        return True, (f"{world_size} {backend} ranks: all_reduce(sum) of {list(range(1, world_size + 1))} "
                      f"gave {expected:g} on every rank ({seconds:.1f} s)")
    return False, f"{world_size} {backend} ranks: all_reduce(sum) gave {results}, expected {expected:g} each"


def check_triton() -> tuple[bool, str]:
    mode = "interpreted" if runtime.triton_interpreted() else "compiled"
    gen = torch.Generator().manual_seed(0)
    wrong = []
    for dtype in vector_add.SUPPORTED_DTYPES:
        # 1000 is not a multiple of the block size, so the masked tail is exercised too.
        x, y = (torch.randn(1000, generator=gen).to(runtime.device(), dtype) for _ in range(2))
        got, want = vector_add.add(x, y), vector_add.reference(x, y)
        if not torch.equal(got, want):  # one rounding of one addition: exact, as PyTorch's is
            wrong.append(f"{dtype}: max |error| {(got.float() - want.float()).abs().max().item():.3g}")
    names = ", ".join(str(d).removeprefix("torch.") for d in vector_add.SUPPORTED_DTYPES)
    if wrong:
        return False, f"vector_add ({mode}) differs from its reference: {'; '.join(wrong)}"
    return True, f"vector_add ({mode}) equals its reference for {names}"


CHECKS = [
    ("tier", check_tier),
    ("versions", check_versions),
    ("devices", check_devices),
    ("speed", check_speed),
    ("all-reduce", check_all_reduce),
    ("triton", check_triton),
]


def main() -> int:
    """Run every check in CHECKS, print a line for each and a verdict; 0 when all passed, else 1."""
    failed = []
    for name, check in CHECKS:
        try:
            ok, text = check()
        except Exception as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            ok, text = False, f"{type(e).__name__}: {e} (raised at {where.filename}:{where.lineno})"
        if not ok:
            failed.append(name)
        print(f"  {'ok  ' if ok else 'FAIL'}  {name:<10}  {text}", flush=True)

    tier = runtime.tier().name
    if failed:
        print(f"doctor: {len(failed)} check{'s' if len(failed) > 1 else ''} failed ({', '.join(failed)}) — "
              f"the chapters that need {'them' if len(failed) > 1 else 'it'} will not run here ({tier} tier)")
        return 1
    print(f"doctor: all checks passed — every chapter can run here ({tier} tier)")
    return 0
