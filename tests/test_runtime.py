"""The runtime tier: device, backend, Triton mode, presets, seeding; and the cost of `import llmlab`."""

import os
import subprocess
import sys
import time

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
