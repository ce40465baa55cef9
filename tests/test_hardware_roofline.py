"""Roofline maths against hand computations, measured points, and the plot."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from llmlab import plots  # noqa: E402
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
    measured = roofline.measure_point(points[0], repeats=2)
    assert measured.measured_flops > 0 and measured.bytes_per_element == 4  # fp32 on the CPU


def test_plot_draws_one_roof_per_device():
    ax = plots.roofline({"a": (100e12, 1e12), "b": (10e12, 1e11)},
                       [roofline.Point("x", 64, 64, 64, measured_flops=1e9), roofline.Point("y", 1, 64, 64)])
    assert len(ax.get_lines()) >= 3


@pytest.mark.parametrize("call", [lambda: roofline.gemm_flops(0, 1, 1), lambda: roofline.attainable(1, -1, 1),
                                  lambda: roofline.model_gemms(GPTConfig.preset("tiny"), tokens=0)])
def test_bad_input(call):
    with pytest.raises(ValueError, match="must be a positive number"):
        call()
