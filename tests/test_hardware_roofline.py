"""Roofline maths against hand computations, measured points, and the plot."""

import matplotlib

matplotlib.use("Agg")

import warnings  # noqa: E402

import pytest  # noqa: E402

from llmlab import invariants, plots, timing  # noqa: E402
from llmlab.hardware import roofline  # noqa: E402
from llmlab.model import GPTConfig  # noqa: E402


def test_gemm_intensity_by_hand():
    # (4, 8) @ (8, 2): 2*4*2*8 = 128 FLOPs on (32 + 16 + 8) * 2 bytes = 112 bytes
    assert roofline.gemm_flops(4, 2, 8) == 128
    assert roofline.gemm_bytes(4, 2, 8) == 112
    assert roofline.gemm_intensity(4, 2, 8) == pytest.approx(128 / 112)
    # square n: 2n^3 / (3 n^2 * 2 bytes) = n / 3
    assert roofline.gemm_intensity(3000, 3000, 3000) == pytest.approx(1000)


def test_attainable_and_bound():
    peak, bw = 100e12, 1e12  # ridge at 100 FLOP/byte
    assert roofline.ridge_point(peak, bw) == 100
    assert roofline.attainable(10, peak, bw) == 10e12 and roofline.bound(10, peak, bw) == "memory"
    assert roofline.attainable(1000, peak, bw) == peak and roofline.bound(1000, peak, bw) == "compute"


def test_model_gemms_and_measured_point():
    points = roofline.model_gemms(GPTConfig.preset("tiny"), tokens=32)
    assert [p.k for p in points] == [64, 64, 64, 256] and all(p.m == 32 for p in points)
    measured = roofline.measure_point(points[0], budget_s=0.05)
    assert measured.measured_flops > 0 and measured.bytes_per_element == 4  # fp32 on the CPU
    assert measured.measured_flops == pytest.approx(roofline.gemm_flops(32, 192, 64) / measured.timing.seconds)


def _timed(label, m, n, k, seconds, spread_samples=(1.0, 1.0, 1.0)):
    """A Point measured at `seconds` per product (rounds spread by the factors in `spread_samples`)."""
    t = timing.Timing.from_samples([seconds * f for f in spread_samples])
    return roofline.Point(label, m, n, k, 4).timed(t, 4)


def _violations(point, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        held = roofline.check_under_roof(point, **kwargs)
    return held, [w for w in caught if issubclass(w.category, invariants.InvariantWarning)]


def test_check_under_roof_slope_flat_and_cache():
    roof = {"peak_flops": 100e9, "bandwidth": 10e9}  # ridge at 10 FLOP/B
    gemv = roofline.Point("gemv", 1, 4096, 4096, 4)  # 0.5 FLOP/B: the slope allows 5 GFLOP/s
    work = roofline.gemm_flops(1, 4096, 4096)
    assert _violations(_timed("gemv", 1, 4096, 4096, work / 4e9), **roof) == (True, [])
    held, caught = _violations(_timed("gemv", 1, 4096, 4096, work / 8e9), **roof)
    assert not held and "sloped roof" in str(caught[0].message)
    # the same point with its operands (64 MiB) in a 128 MiB cache: held to the flat roof only
    assert _violations(_timed("gemv", 1, 4096, 4096, work / 8e9), cache_bytes=128 << 20, **roof) == (True, [])
    assert gemv.operand_bytes == (4096 + 4096 * 4096 + 4096) * 4
    held, caught = _violations(_timed("gemv", 1, 4096, 4096, work / 200e9), cache_bytes=128 << 20, **roof)
    assert not held and "flat roof" in str(caught[0].message)


def test_check_under_roof_allows_for_the_spreads():
    roof = {"peak_flops": 100e9, "bandwidth": 10e9}
    work = roofline.gemm_flops(1, 4096, 4096)
    # 5.5 GFLOP/s against a 5 GFLOP/s slope: over by 10%, within a ±10% point and a ±5% roof
    noisy = _timed("gemv", 1, 4096, 4096, work / 5.5e9, (0.8, 0.9, 1.0, 1.1, 1.2))
    assert noisy.spread == pytest.approx(0.1)
    assert _violations(noisy, bandwidth_spread=0.05, **roof) == (True, [])
    assert not _violations(_timed("gemv", 1, 4096, 4096, work / 5.5e9), **roof)[0]
    with pytest.raises(ValueError, match="no measured_flops"):
        roofline.check_under_roof(roofline.Point("x", 1, 2, 3), **roof)


def test_plot_draws_one_roof_per_device():
    ax = plots.roofline({"a": (100e12, 1e12), "b": (10e12, 1e11)},
                       [roofline.Point("x", 64, 64, 64, measured_flops=1e9), roofline.Point("y", 1, 64, 64)])
    assert len(ax.get_lines()) >= 3
    assert "FLOP/s" in ax.get_ylabel() and "FLOP / byte" in ax.get_xlabel() and ax.get_title()


def test_plot_keeps_every_measured_point_inside_the_axes():
    far = [_timed("slow", 1, 8, 8, 1.0, (0.5, 1.0, 1.5)), roofline.Point("fast", 4096, 4096, 4096, 4,
                                                                        measured_flops=1e16)]
    ax = plots.roofline({"a": (100e12, 1e12)}, far, i_range=(1, 10))
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    for p in far:
        assert x0 < p.intensity < x1
        assert y0 < p.measured_flops * (1 - p.spread) and p.measured_flops * (1 + p.spread) < y1


@pytest.mark.parametrize("call", [lambda: roofline.gemm_flops(0, 1, 1), lambda: roofline.attainable(1, -1, 1),
                                  lambda: roofline.model_gemms(GPTConfig.preset("tiny"), tokens=0)])
def test_bad_input(call):
    with pytest.raises(ValueError, match="must be a positive number"):
        call()
