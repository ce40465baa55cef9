"""The GEMM on each kind of device: the tile shapes its autotuner tries (Hopper, another GPU, the interpreter), and
the spec sheet's peak its speed is measured against.

A config is (BLOCK_M, BLOCK_N, BLOCK_K) — the tile of C a program computes and the step along K — with the
software pipeline's depth (`num_stages`: how many K-steps of A and B tiles are in flight in shared memory) and
the warps per program (`num_warps`). Each config compiles once per dtype (about 0.5 s on an H200 node) and is then
timed at every new (M, N, K), so the lists are short: the shapes that win on each chip, not a sweep.

**Hopper (H100, H200: compute capability 9.x).** Triton issues `wgmma`, the warpgroup matrix-multiply: a
warpgroup of 4 warps computes a 64-row slab of the tile from A and B in shared memory. 128×256 with 8 warps is
two warpgroups of 64×256 each, the shape cuBLAS and Triton's tutorials (03, 09) use for large products; 256×128
is its transpose. A stage of 128×256×64 in bf16 holds (128·64 + 64·256) · 2 B = 48 KB, so 4 stages (192 KB) fit
the 227 KB a program may take. Small products need smaller tiles to fill the chip: 1024³ is 32 tiles of 128×256
for 132 SMs, 128 of 64×128. Measured on an H200 (triton 3.6, each config alone, cold L2), from a wider list of 15:
128×256×64 with 4 stages won at 2048³ (0.98 of cuBLAS) and 8192³ (0.94), with 3 stages at 4096³ (0.98), 64×128×64
at 1024³ (0.88); 256×128 and 128×128 came within 10–15% and stay for other shapes (M ≫ N, mid sizes).

**Other GPUs (Ampere, Ada, …).** The tutorial's (`get_cuda_autotune_config`) list, shortened: shared memory is
smaller (164 KB on A100, 100 KB on consumer cards), `mma.sync` works per warp, and 4 warps on 128×128 or 64×256
are the usual winners; a config that does not fit is skipped by the autotuner after its compile fails.

**fp32 inputs** in TF32 (on the tensor cores) take half the BLOCK_K of a 16-bit config: the same bytes per stage,
so the same fit in shared memory (`llmlab.kernels.gemm.matmul` also hands Hopper K-major operands for TF32). IEEE
fp32 (`torch.backends.cuda.matmul.allow_tf32` off, PyTorch's default) runs on the CUDA cores: two small tiles.

**Interpreter (CPU tier).** One small config: every program is run in NumPy, so only correctness is measured.

**The peak** (`spec_for`, `peak_flops`): the `llmlab.hardware.SPECS` row of a CUDA device (`for_device`), and its
dense rate for what the tensor cores multiply — the bf16 column for bf16 and fp16 (equal on these parts), the tf32
column for TF32, the CUDA cores' fp32 column for IEEE fp32.
"""

from __future__ import annotations

import functools

import torch
import triton

from llmlab import runtime
from llmlab.hardware.specs import Spec, for_device  # the datasheet table: data, no imports

__all__ = ["HOPPER", "OTHER_GPU", "IEEE_FP32", "INTERPRETER", "PRECISIONS", "GROUP_M", "kind", "configs", "describe",
           "spec_for", "peak_flops"]

PRECISIONS = ("bf16", "fp16", "tf32", "fp32")  # what the dot multiplies: fp32 is IEEE, TF32 the tensor cores' cut
GROUP_M = 8  # rows of tiles per group of the grouped ordering: consecutive programs share B's tiles in L2

# (BLOCK_M, BLOCK_N, BLOCK_K for 16-bit inputs, num_stages, num_warps)
HOPPER = (
    (128, 256, 64, 4, 8),  # large products: two warpgroups of 64×256, 4 stages of 48 KB (192 KB)
    (128, 256, 64, 3, 8),  # the same 3 deep (4096³ on H200)
    (256, 128, 64, 3, 8),  # transposed: for M ≫ N
    (128, 128, 64, 4, 8),  # mid sizes: twice the tiles of 128×256
    (64, 128, 64, 4, 4),  # small products: 1024³ is 128 such tiles for 132 SMs
    (128, 64, 64, 4, 4),
)
OTHER_GPU = (
    (128, 256, 64, 3, 8),
    (128, 128, 32, 4, 4),
    (64, 256, 32, 4, 4),
    (128, 64, 32, 4, 4),
    (64, 128, 32, 4, 4),
    (64, 64, 32, 5, 2),
)
# IEEE fp32 (TF32 not allowed) runs on the CUDA cores, not the tensor cores, where large tiles mostly lengthen
# compilation (about 4 s a config for 128×256 on an H200 node, against about 2 s for a wgmma tile): two small ones
IEEE_FP32 = ((64, 128, 64, 4, 4), (128, 64, 64, 4, 4))
INTERPRETER = triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4})


@functools.cache
def kind(device: torch.device) -> str:
    """'interpreter' (Triton runs in NumPy), 'hopper' (a CUDA GPU of compute capability 9.x) or 'other-gpu', for
    tensors on `device`. Asks Triton's driver which target it compiles for, so no CUDA call is made here."""
    if runtime.triton_interpreted():
        return "interpreter"
    target = triton.runtime.driver.active.get_current_target()  # GPUTarget(backend, arch, warp_size)
    return "hopper" if target.backend == "cuda" and target.arch // 10 == 9 else "other-gpu"


def configs(where: str, precision: str) -> list[triton.Config]:
    """The autotuner's configs for `where` (a `kind`) and `precision` ('bf16', 'fp16', 'tf32' or 'fp32': IEEE)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; choose from {', '.join(map(repr, PRECISIONS))}")
    if where == "interpreter":
        return [INTERPRETER]
    if where not in ("hopper", "other-gpu"):
        raise ValueError(f"where={where!r}; choose from 'interpreter', 'hopper', 'other-gpu'")
    shapes = IEEE_FP32 if precision == "fp32" else HOPPER if where == "hopper" else OTHER_GPU
    k_scale = 1 if precision in ("bf16", "fp16") else 2  # 4-byte elements: half the K-step, the same bytes a stage
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k // k_scale, "GROUP_M": GROUP_M},
                          num_stages=s, num_warps=w)
            for m, n, k, s, w in shapes]


def describe(config: triton.Config) -> str:
    """'128×256×64, 3 stages, 8 warps': a config as a bench row shows it."""
    kw = config.kwargs
    return f"{kw['BLOCK_M']}×{kw['BLOCK_N']}×{kw['BLOCK_K']}, {config.num_stages} stages, {config.num_warps} warps"


def spec_for(device: torch.device) -> Spec | None:
    """The spec sheet's row for a CUDA `device` (`hardware.specs.for_device`); None for a CPU (smoke mode's
    stand-in included): no tensor-core peak."""
    return for_device(runtime.device_properties(device).name) if device.type == "cuda" else None


def peak_flops(spec: Spec | None, precision: str) -> float | None:
    """The dense peak FLOP/s of `spec` for `precision` ('bf16', 'fp16', 'tf32' or 'fp32'); None where unknown."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; choose from {', '.join(map(repr, PRECISIONS))}")
    if spec is None:
        return None
    column = {"fp16": "bf16"}.get(precision, precision)  # fp16 and bf16 share the tensor cores' rate
    return None if getattr(spec, f"{column}_tflops") is None else spec.peak_flops(column)
