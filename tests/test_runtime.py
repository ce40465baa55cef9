"""The runtime tier: device, backend, Triton mode, presets, seeding; and the cost of `import llmlab`."""

import ast
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from llmlab import runtime


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_cpu_tier_on_this_machine():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    t = runtime.tier()
    assert t.name == "cpu" and not t.is_gpu
    assert runtime.device() == torch.device("cpu")
    assert runtime.backend(4) == "gloo"
    assert "cpu tier" in runtime.describe()


def test_forced_cpu_and_bad_device_setting():
    out = _python("from llmlab import runtime; print(runtime.tier().name, runtime.backend(2))",
                  LLMLAB_DEVICE="cpu")
    assert out.stdout.split() == ["cpu", "gloo"], out.stderr
    bad = _python("from llmlab import runtime; runtime.tier()", LLMLAB_DEVICE="tpu")
    assert bad.returncode != 0 and "LLMLAB_DEVICE='tpu'" in bad.stderr


def test_triton_is_interpreted_before_any_kernel_is_defined():
    code = ("import os; os.environ.pop('TRITON_INTERPRET', None); import llmlab.kernels; "
            "from llmlab import runtime; print(os.environ.get('TRITON_INTERPRET'), runtime.triton_interpreted())")
    out = _python(code, LLMLAB_DEVICE="cpu")
    assert out.stdout.split() == ["1", "True"], out.stderr


def test_kernels_work_when_triton_is_imported_before_them():
    # torch imports triton by itself (its compiler, fused optimizers) before the chapter's first kernel: triton's own
    # tl.zeros/tl.max are then defined compiled and every interpreted kernel fails, unless `import llmlab` chose the
    # interpreter first
    code = ("import os; os.environ.pop('TRITON_INTERPRET', None); import torch, llmlab, triton.language; "
            "from llmlab.kernels import quantize; x = torch.randn(5, 7); "
            "q, s = quantize.quantize_int8(x); rq, rs = quantize.reference(x); "
            "print(torch.equal(q, rq) and torch.equal(s, rs))")
    out = _python(code, LLMLAB_DEVICE="cpu")
    assert out.stdout.split() == ["True"], out.stderr[-2000:]


def test_cpu_known_without_torch(monkeypatch):
    monkeypatch.setenv("LLMLAB_DEVICE", "cpu")
    assert runtime._cpu_without_torch()
    monkeypatch.setenv("LLMLAB_DEVICE", "cuda")
    assert not runtime._cpu_without_torch()  # forced GPU: torch decides
    monkeypatch.delenv("LLMLAB_DEVICE")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert runtime._cpu_without_torch()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(runtime, "_GPU_DEVICE_FILES", ("/nonexistent/nvidiactl",))
    assert runtime._cpu_without_torch()
    monkeypatch.setattr(runtime, "_GPU_DEVICE_FILES", (__file__,))  # a device file that exists: ask torch
    assert not runtime._cpu_without_torch()


def test_presets():
    cpu = runtime.preset("cpu")
    assert cpu.model == "tiny" and cpu.world_size >= 2
    assert runtime.preset("cpu", batch_size=3).batch_size == 3
    assert runtime.preset().name == ("gpu" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="preset 'tpu' unknown"):
        runtime.preset("tpu")
    with pytest.raises(ValueError, match="world_size=0"):
        runtime.backend(0)


def test_seed_everything_repeats_every_generator():
    import random

    import numpy as np

    def draw():
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()

    runtime.seed_everything(123)
    a = draw()
    runtime.seed_everything(123)
    assert draw() == a
    with pytest.raises(ValueError, match="seed=-1"):
        runtime.seed_everything(-1)


def test_import_llmlab_is_fast_and_loads_no_jupyter():
    code = ("import sys, time; t = time.perf_counter(); import llmlab, llmlab.dist; dt = time.perf_counter() - t; "
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'IPython', 'ipykernel', 'ipywidgets', 'jupyter_client', 'nbformat', 'nbclient', "
            "'matplotlib', 'triton'}); print(dt, heavy)")
    t0 = time.perf_counter()
    out = _python(code)
    wall = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    seconds, heavy = out.stdout.split(maxsplit=1)
    assert heavy.strip() == "[]", f"import llmlab pulled in {heavy}"
    assert float(seconds) < 2.0 and wall < 10.0  # wall includes the interpreter's own start


@pytest.fixture
def smoke(monkeypatch):
    """Smoke mode with two stand-in GPUs, in this process (tier() is cached: cleared before and after)."""
    monkeypatch.setenv("LLMLAB_GPU_SMOKE", "2")
    monkeypatch.delenv("LLMLAB_DEVICE", raising=False)
    runtime.tier.cache_clear()
    yield
    runtime.tier.cache_clear()


def test_smoke_mode_is_a_gpu_tier_on_the_cpu(smoke, monkeypatch):
    t = runtime.tier()
    assert (t.name, t.n_gpus, t.is_gpu, t.smoke) == ("multi-gpu-smoke", 2, True, True)
    assert runtime.device() == torch.device("cpu") and runtime.backend(2) == "gloo"  # never NCCL on the CPU
    assert runtime._on_cpu() and runtime._cpu_without_torch()  # Triton interpreted
    p = runtime.preset()
    assert p == runtime.preset("gpu") and p.name == "gpu-smoke" and p.model == "tiny" and p.world_size == 2
    assert max(p.gemm_sizes) <= 64 and p.peak_gemm <= 64  # seconds on a CPU
    assert runtime.preset("cpu") == runtime.PRESETS["cpu"]
    assert "smoke run, no GPU measured" in runtime.describe() and "Triton interpreted" in runtime.describe()
    assert runtime.device_count() == 2 and "smoke" in runtime.device_properties(0).name
    monkeypatch.setenv("LLMLAB_GPU_SMOKE", "yes")
    runtime.tier.cache_clear()
    with pytest.raises(ValueError, match="LLMLAB_GPU_SMOKE='yes'"):
        runtime.tier()


def test_cuda_helpers_have_cpu_counterparts():
    cpu = torch.device("cpu")
    runtime.synchronize(cpu)  # a CPU computes synchronously: returns at once
    runtime.empty_cache(cpu)
    runtime.reset_peak_memory_stats(cpu)
    held = runtime.memory_allocated(cpu)
    block = torch.ones(16 << 20, dtype=torch.uint8)  # 16 MiB, every page written
    assert runtime.max_memory_allocated(cpu) >= max(held, block.numel())  # the resident peak holds the block
    props = runtime.device_properties(cpu)
    assert props.total_memory > props.l2_cache_size >= 0 and props.multi_processor_count >= 1 and props.name
    with pytest.raises(ValueError, match="device='cpu'"):
        runtime.set_memory_fraction(0.5, cpu)
    if not torch.cuda.is_available():
        assert runtime.cuda_rng_states() == [] and runtime.device_count() == 0
        runtime.set_cuda_rng_states([])  # nothing drew from a CUDA generator: nothing to restore


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_helpers_call_cuda_on_a_gpu():
    cuda = torch.device("cuda", 0)
    runtime.reset_peak_memory_stats(cuda)
    start = runtime.memory_allocated(cuda)
    block = torch.ones(1 << 20, device=cuda)  # 4 MiB
    runtime.synchronize(cuda)
    assert runtime.memory_allocated(cuda) - start >= block.numel() * 4
    assert runtime.max_memory_allocated(cuda) >= start + block.numel() * 4
    props = runtime.device_properties(0)
    assert props.name == torch.cuda.get_device_name(0)
    assert props.total_memory > 0 and props.multi_processor_count > 0 and props.l2_cache_size > 0
    states = runtime.cuda_rng_states([0])
    first = torch.rand(3, device=cuda)
    runtime.set_cuda_rng_states(states, [0])
    assert torch.equal(torch.rand(3, device=cuda), first) and runtime.cuda_rng_states()  # initialised: every GPU's
    runtime.set_memory_fraction(1.0, cuda)
    runtime.empty_cache(cuda)
    assert issubclass(runtime.OutOfMemoryError, RuntimeError)


def test_memory_history_on_a_cpu_records_allocations_and_frees(tmp_path):
    """The CPU stand-in: the allocations and frees torch.profiler sees, in CUDA's snapshot shape."""
    keep = torch.ones(8)
    with runtime.memory_history("cpu", path=tmp_path / "snap.pickle") as history:
        block = torch.empty(1 << 20, dtype=torch.uint8)  # 1 MiB
        keep.mul_(keep)  # in place, tensor by tensor: nothing allocated
        small = torch.zeros(1000)  # 4000 bytes
        del block
    assert set(history.snapshot) >= {"segments", "device_traces"} and "CPU" in history.source
    assert [(e["action"], e["size"]) for e in history.trace] == [
        ("alloc", 1 << 20), ("alloc", 4000), ("free_requested", 1 << 20), ("free_completed", 1 << 20)]
    assert history.timeline() == [1 << 20, (1 << 20) + 4000, (1 << 20) + 4000, 4000]
    assert history.peak == (1 << 20) + 4000 and small.numel() == 1000
    assert history.trace[0]["frames"][0]["name"] == "aten::empty" and history.trace[0]["time_us"] > 0
    assert pickle.loads(history.path.read_bytes()) == history.snapshot


def test_memory_history_is_filled_in_when_the_block_raises():
    with pytest.raises(RuntimeError, match="planted"):
        with runtime.memory_history("cpu") as history:
            torch.empty(4096, dtype=torch.uint8)  # allocated and freed at once
            raise RuntimeError("planted")
    assert history.timeline() == [4096, 4096, 0] and history.peak == 4096
    for bad in (0, True):
        with pytest.raises(ValueError, match="max_entries"):
            with runtime.memory_history("cpu", max_entries=bad):
                pass


def test_memory_history_refuses_nesting_and_a_running_profiler():
    """The inner block would empty the outer one's record (CPU) or switch its recording off (CUDA)."""
    with runtime.memory_history("cpu") as outer:
        kept = torch.empty(4096, dtype=torch.uint8)
        with pytest.raises(RuntimeError, match="cannot nest"):
            with runtime.memory_history("cpu"):
                pass
    assert outer.peak == 4096 and kept.numel() == 4096  # the outer record is intact
    with torch.profiler.profile() as theirs:
        torch.ones(10).sum()
        with pytest.raises(RuntimeError, match="profiler is already running"):
            with runtime.memory_history("cpu"):
                pass
    assert any(e.key == "aten::sum" for e in theirs.key_averages())  # the user's profile kept its events
    with runtime.memory_history("cpu") as after:  # and recording works again
        torch.empty(8, dtype=torch.uint8)
    assert after.peak == 8


def test_memory_history_checks_its_path_on_entry(tmp_path):
    ran = []
    with pytest.raises(ValueError, match="path=.*does not exist"):
        with runtime.memory_history("cpu", path=tmp_path / "missing" / "snap.pickle"):
            ran.append(True)
    assert not ran  # refused before the block ran, not at its end in place of the block's own error
    for bad, match in ((5, "path=5"), (tmp_path, "is a directory")):
        with pytest.raises(ValueError, match=match):
            with runtime.memory_history("cpu", path=bad):
                pass
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda'"):
            with runtime.memory_history("cuda"):
                pass


def test_a_truncated_memory_history_says_so():
    with runtime.memory_history("cpu", max_entries=2) as history:
        a = torch.empty(1000, dtype=torch.uint8)
        b = torch.empty(2000, dtype=torch.uint8)
        del a
    assert history.truncated and history.dropped == 2 and len(history.trace) == 2 and b.numel() == 2000
    with pytest.raises(ValueError, match="truncated.*max_entries"):
        history.timeline()
    with runtime.memory_history("cpu", max_entries=4) as whole:
        torch.empty(1000, dtype=torch.uint8)
    assert not whole.truncated and whole.peak == 1000


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_history_on_cuda_is_the_allocators_snapshot(tmp_path):
    cuda = torch.device("cuda", 0)
    with runtime.memory_history(cuda, path=tmp_path / "snap.pickle") as history:
        block = torch.empty(1 << 20, dtype=torch.uint8, device=cuda)  # 1 MiB (the allocator may round a block up)
        del block
    allocs = [e for e in history.trace if e["action"] == "alloc"]
    assert any(e["size"] >= 1 << 20 for e in allocs) and history.peak >= 1 << 20 and "CUDA" in history.source
    assert set(pickle.loads(history.path.read_bytes())) >= {"segments", "device_traces"}


def _cuda_calls(source: str, where: str, allowed=frozenset()) -> list[str]:
    """`torch.cuda.<name>` uses (but `allowed` names) and `.cuda()` calls in Python `source` (IPython's %/! lines
    left out)."""
    code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    found = []
    for node in ast.walk(ast.parse(code, where)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "cuda"
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "torch"):
            if node.attr not in allowed:
                found.append(f"{where}:{node.lineno} torch.cuda.{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "cuda":
            found.append(f"{where}:{node.lineno} .cuda()")
    return found


# torch.cuda names a module may use itself (runtime.py: all of them), each with why
CUDA_CALLERS = {
    "llmlab/dist/collectives.py": {"current_device"},  # _meta_device: runtime.device() requested of its owner
    "llmlab/dist/allreduce_bench.py": {"synchronize"},  # _time_on_rank: runtime.synchronize requested of its owner
    # the bench's CUDA graph capture: no CPU counterpart (its CPU path, run under smoke mode, replays nothing)
    "kernels/gemm.py": {"Stream", "current_stream", "stream", "CUDAGraph", "graph"},
}


def test_cuda_is_called_only_through_runtime():
    root = Path(__file__).resolve().parent.parent
    found = []
    for path in sorted([*root.glob("llmlab/**/*.py"), *root.glob("kernels/**/*.py")]):
        where = path.relative_to(root).as_posix()
        if where != "llmlab/runtime.py":  # the helpers, with the CPU's counterparts
            found += _cuda_calls(path.read_text(), where, CUDA_CALLERS.get(where, ()))
    for path in sorted([*root.glob("chapters/*.ipynb"), *root.glob("solutions/*.ipynb")]):
        cells = json.loads(path.read_text())["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] == "code":
                found += _cuda_calls("".join(cell["source"]), f"{path.relative_to(root).as_posix()} cell {i}")
    assert not found, f"call CUDA through llmlab.runtime's helpers (they stand in under smoke mode): {found}"
