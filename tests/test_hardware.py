"""hardware.measure: plausible numbers within its time budget, the figures of Measured from constructed rounds (no
clock), points and functions alongside; bad arguments refused."""

import math
import warnings

import pytest
import torch

from llmlab import hardware, invariants, runtime, timing
from llmlab.hardware import roofline


def test_measure_this_device():
    m = hardware.measure(seconds=0.4)
    assert m.device == str(runtime.device()) and m.name and m.threads >= 1
    for value in (m.matmul_flops, m.copy_bandwidth):
        assert math.isfinite(value) and value > 0
    assert m.matmul_n >= 256 and m.copy_bytes >= 64 << 20
    if m.device == "cpu":
        # Bounds no CPU comes near: the largest servers reach a few fp32 TFLOP/s and under 1 TB/s of DRAM.
        assert m.matmul_flops < 10e12
        assert m.copy_bandwidth < 2e12
    assert "TFLOP/s" in str(m) and "GB/s" in str(m)


def test_matmul_peak_alone():
    flops, n, t = hardware.matmul_peak(seconds=0.1)
    assert n >= 1024 and flops == 2 * n**3 / t.seconds  # the same n×n product as measure's flat roof
    assert 0 < flops < (10e12 if runtime.device().type == "cpu" else 1e15)  # as in test_measure_this_device
    with pytest.raises(ValueError, match="seconds="):
        hardware.matmul_peak(seconds=0)


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


def _measured(seconds: dict, points=(), cache=32 << 20) -> hardware.Measured:
    """A Measured built from constructed rounds ({name: per-round seconds}), no clock involved."""
    rounds = timing.Rounds({k: timing.Timing.from_samples(v) for k, v in seconds.items()}, timing.Load(0.5, 2))
    points = tuple(pt.timed(rounds[pt.label], 4) for pt in points)
    return hardware.Measured(device="cpu", name="test", threads=1, matmul_n=1000, matmul_search=((1000, 0.02),),
                             read_bytes=100 << 20, copy_bytes=100 << 20, cache_bytes=cache, budget_s=1.0,
                             rounds=rounds, points=points)


def test_measured_figures_and_rates_from_rounds():
    # the peak: 2e9 FLOP in 20 ms = 100 GFLOP/s; a step of 1e9 FLOP in 20, 25, 40 ms against 20, 20, 40 ms of peak
    m = _measured({"matmul": [0.02, 0.02, 0.04], "read": [0.01] * 3, "copy": [0.04] * 3, "step": [0.02, 0.025, 0.04]})
    assert m.matmul_flops == pytest.approx(100e9) and m.roof == (m.matmul_flops, m.read_bandwidth)
    assert m.read_bandwidth == pytest.approx((100 << 20) / 0.01) and m.read_by == "sum of 100 MiB"
    assert m.copy_bandwidth == pytest.approx(2 * (100 << 20) / 0.04)  # read + write counted
    mfu = m.rate("step", 1e9)  # per round: 0.5, 0.4, 0.5 of the peak
    assert mfu.value == pytest.approx(0.5) and mfu.direction(1.0) == "below" and mfu.direction(0.3) == "above"
    assert m.rate("step", 1e9, peer="step", peer_flops=1e9).value == pytest.approx(1.0)
    with pytest.raises(ValueError, match="name="):
        m.rate("nothing", 1e9)
    assert "1 thread," in str(m) and "read + write counted" in str(m)


def test_a_point_beyond_the_cache_that_reads_faster_sets_the_slope():
    gemv = roofline.Point("gemv", 1, 8192, 8192, 4)  # 256 MiB of operands, beyond a 32 MiB cache
    seconds = {"matmul": [0.02] * 3, "read": [0.02] * 3, "copy": [0.04] * 3, "gemv": [0.02] * 3}
    m = _measured(seconds, [gemv])
    assert m.read_by == "gemv" and m.read_bandwidth == pytest.approx(gemv.operand_bytes / 0.02)
    with warnings.catch_warnings():
        warnings.simplefilter("error", invariants.InvariantWarning)
        assert m.check_roof()
    assert "stream from main memory" in m.place(m.points[0])
    # in a cache larger than its operands it reads from the cache: the sum sets the slope, the point beats it
    cached = _measured(seconds, [gemv], cache=512 << 20)
    assert cached.read_by == "sum of 100 MiB" and "above main memory's sloped roof" in cached.place(cached.points[0])


def test_measure_with_points_alongside_and_threads():
    before = torch.get_num_threads()
    calls = []
    m = hardware.measure(seconds=0.2, points=[roofline.Point("small", 8, 8, 8, 4)],
                         alongside={"noop": lambda: calls.append(1)}, threads=1)
    assert m.threads == 1 and torch.get_num_threads() == before and calls
    assert set(m.rounds.timings) == {"matmul", "read", "copy", "small", "noop"}
    assert m.points[0].measured_flops > 0 and m.matmul_search[-1][0] == m.matmul_n


@pytest.mark.parametrize("kwargs, match", [({"threads": 0}, "threads="), ({"points": [1]}, "points="),
                                           ({"alongside": {"matmul": print}}, "distinct"),
                                           ({"alongside": {"x": 1}}, "alongside=")])
def test_bad_measure_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hardware.measure(seconds=0.1, **kwargs)
