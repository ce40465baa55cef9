"""hardware.measure: positive, finite, plausible numbers within its time budget; bad budgets refused."""

import math
import time

import pytest
import torch

from llmlab import hardware, runtime


def test_measure_this_device():
    start = time.perf_counter()
    m = hardware.measure(seconds=0.4)
    elapsed = time.perf_counter() - start
    assert m.device == str(runtime.device()) and m.name and m.threads >= 1
    for value in (m.matmul_flops, m.copy_bandwidth):
        assert math.isfinite(value) and value > 0
    assert m.matmul_n >= 256 and m.copy_bytes >= 64 << 20
    if m.device == "cpu":
        # Bounds no CPU comes near: the largest servers reach a few fp32 TFLOP/s and under 1 TB/s of DRAM.
        assert m.matmul_flops < 10e12
        assert m.copy_bandwidth < 2e12
    assert elapsed < 0.4 * 5 + 2, "measure overran its budget by far"  # first call also pays allocation
    assert "TFLOP/s" in str(m) and "GB/s" in str(m)


@pytest.mark.gpu
def test_measure_gpu():
    m = hardware.measure("cuda", seconds=0.5)
    assert m.name == torch.cuda.get_device_name(0)
    assert 1e12 < m.matmul_flops < 1e15 and 1e11 < m.copy_bandwidth < 2e13


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), float("inf"), "1", None, True])
def test_bad_seconds(seconds):
    with pytest.raises(ValueError, match="seconds="):
        hardware.measure(seconds=seconds)


def test_device_name():
    assert hardware.device_name("cpu")
    assert hardware.device_name() == hardware.device_name(runtime.device())
