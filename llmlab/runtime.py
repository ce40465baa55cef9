"""Where llmlab runs: the runtime tier, decided once, that every chapter and library function asks.

| tier      | device          | process-group backend | Triton                          |
|-----------|-----------------|-----------------------|---------------------------------|
| cpu       | cpu             | gloo                  | interpreter (TRITON_INTERPRET=1) |
| gpu       | cuda:0          | nccl (one rank per GPU) or gloo | compiled              |
| multi-gpu | cuda:LOCAL_RANK | nccl (torchrun)       | compiled                        |

Set `LLMLAB_DEVICE=cpu` to force the CPU tier on a GPU machine (what CI and the notebooks' tests do when
they must behave as on a laptop).

Usage::

    from llmlab import runtime
    print(runtime.describe())          # one line: tier, device, backend, Triton mode, versions
    p = runtime.preset()               # problem sizes for this tier (or runtime.preset("gpu"))
    runtime.seed_everything(0)
"""

from __future__ import annotations

import functools
import os
import random
import sys
import warnings
from dataclasses import dataclass, replace
from importlib import metadata

__all__ = [
    "Tier",
    "Preset",
    "tier",
    "device",
    "backend",
    "configure_triton",
    "triton_interpreted",
    "preset",
    "seed_everything",
    "describe",
]


@dataclass(frozen=True)
class Tier:
    name: str  # "cpu" | "gpu" | "multi-gpu"
    n_gpus: int
    gpu_name: str | None

    @property
    def is_gpu(self) -> bool:
        return self.name != "cpu"


@functools.lru_cache(maxsize=1)
def tier() -> Tier:
    """The tier of this process: CPU unless CUDA is usable (and LLMLAB_DEVICE is not 'cpu')."""
    forced = os.environ.get("LLMLAB_DEVICE", "").lower()
    if forced not in ("", "cpu", "cuda", "gpu"):
        raise ValueError(f"LLMLAB_DEVICE={forced!r}: expected 'cpu' or 'cuda'")
    import torch  # torch loads in seconds: `import llmlab` stays light

    if forced == "cpu" or not torch.cuda.is_available():
        if forced in ("cuda", "gpu"):
            raise RuntimeError("LLMLAB_DEVICE=cuda but torch.cuda.is_available() is False")
        return Tier("cpu", 0, None)
    n = torch.cuda.device_count()
    return Tier("gpu" if n == 1 else "multi-gpu", n, torch.cuda.get_device_name(0))


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def device():
    """The torch.device this process computes on: cuda:LOCAL_RANK on GPU tiers, else cpu."""
    import torch  # torch loads in seconds: `import llmlab` stays light

    t = tier()
    if not t.is_gpu or os.environ.get("LLMLAB_RANK_DEVICE") == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", _local_rank() % t.n_gpus)


def backend(world_size: int = 1) -> str:
    """The process-group backend for `world_size` ranks on this machine.

    NCCL needs one GPU per rank, so more ranks than GPUs fall back to gloo (on CPU tensors).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    t = tier()
    return "nccl" if t.is_gpu and world_size <= t.n_gpus else "gloo"


_GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")  # NVIDIA's driver, AMD's ROCm


def _cpu_without_torch() -> bool:
    """Whether this is the CPU tier for sure, decided without importing torch (which takes seconds)."""
    forced = os.environ.get("LLMLAB_DEVICE", "").lower()
    no_gpu = os.environ.get("CUDA_VISIBLE_DEVICES") == "" or not any(map(os.path.exists, _GPU_DEVICE_FILES))
    return forced == "cpu" or (forced == "" and no_gpu)


def configure_triton(probe_torch: bool = True) -> bool:
    """Choose compiled or interpreted Triton; returns whether Triton runs interpreted.

    On the CPU tier this sets TRITON_INTERPRET=1 (unless the user set it). Triton reads the variable when
    `triton` is first imported (its own `tl.zeros`, `tl.max`, … are @jit functions, defined then) and when a
    kernel is decorated, and torch may import triton on its own (its compiler and fused optimizers do, during
    training). So `import llmlab` calls this with `probe_torch=False`: it decides from the environment and the
    GPU device files alone, cheaply, before anything imports triton. `llmlab.kernels` calls it again on import
    (`probe_torch=True`: asks torch whether CUDA works) for machines where only torch can tell.
    """
    if "TRITON_INTERPRET" not in os.environ and (_cpu_without_torch() or probe_torch and not tier().is_gpu):
        os.environ["TRITON_INTERPRET"] = "1"
        if "triton" in sys.modules:
            warnings.warn("triton was imported before llmlab chose its interpreter: Triton kernels will fail on "
                          "this CPU; set TRITON_INTERPRET=1 before starting Python, or import llmlab first",
                          RuntimeWarning, stacklevel=2)
    return triton_interpreted()


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class Preset:
    """Problem sizes chosen per tier: seconds on a 2-core CPU, a full chip on a GPU."""

    name: str
    model: str  # a llmlab.model.GPTConfig preset
    batch_size: int
    block_size: int
    train_steps: int
    world_size: int  # ranks a chapter spawns for its multi-rank demos
    gemm_sizes: tuple[int, ...]
    allreduce_max_bytes: int


PRESETS = {
    "cpu": Preset("cpu", model="tiny", batch_size=16, block_size=64, train_steps=200, world_size=2,
                  gemm_sizes=(16, 33, 64), allreduce_max_bytes=4 << 20),
    "gpu": Preset("gpu", model="small", batch_size=32, block_size=256, train_steps=2000, world_size=1,
                  gemm_sizes=(1024, 2048, 4096), allreduce_max_bytes=256 << 20),
}


def preset(name: str | None = None, **overrides) -> Preset:
    """The size preset for `name` ('cpu' or 'gpu'; default: this tier's), with fields overridden."""
    if name is None:
        name = "gpu" if tier().is_gpu else "cpu"
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} unknown; choose from {sorted(PRESETS)}")
    p = PRESETS[name]
    if name == "gpu":
        p = replace(p, world_size=max(1, tier().n_gpus))
    return replace(p, **overrides) if overrides else p


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and all CUDA devices) generators."""
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative int")
    import numpy as np  # only when seeding: `import llmlab` stays light
    import torch  # torch loads in seconds: `import llmlab` stays light

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def describe() -> str:
    """One line saying where this is running, for the top of every chapter."""
    import torch  # torch loads in seconds: `import llmlab` stays light

    t = tier()
    where = f"{t.n_gpus}× {t.gpu_name}" if t.is_gpu else f"CPU ({os.cpu_count()} cores)"
    triton_mode = "interpreted" if (triton_interpreted() or not t.is_gpu) else "compiled"
    return (f"llmlab {metadata.version('llmlab')} · {t.name} tier · {where} · device {device()} · "
            f"backend {backend(max(1, t.n_gpus))} · Triton {triton_mode} · torch {torch.__version__}")
