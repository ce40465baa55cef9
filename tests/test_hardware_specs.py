"""The spec sheet's internal consistency: sparse = 2× dense, ridge points, per-direction links, errors."""

import pytest

from llmlab.hardware import SPECS, cpu_peak_tflops, spec


def test_every_row_is_sourced_and_positive():
    for s in SPECS.values():
        assert s.source, s.name
        assert s.fp32_tflops > 0 and s.bf16_tflops >= s.fp32_tflops and s.memory_gb > 0 and s.hbm_gbs > 0


def test_sparse_peaks_are_twice_dense():
    for s in SPECS.values():
        if s.bf16_sparse_tflops is not None:
            assert s.bf16_sparse_tflops == pytest.approx(2 * s.bf16_tflops, rel=0.002), s.name


def test_ridge_points():
    a100 = spec("A100 SXM")
    assert a100.ridge_point() == pytest.approx(312e12 / 2039e9)
    assert a100.ridge_point("fp32") == pytest.approx(19.5e12 / 2039e9)
    assert spec("H100 SXM").link_gbs_per_direction == 450


def test_cpu_peak_formula():
    assert cpu_peak_tflops(cores=1, ghz=1.0, fp32_lanes=8, fma_units=2) == pytest.approx(0.032)


def test_bad_names_and_precisions():
    with pytest.raises(ValueError, match="no spec for 'V100'"):
        spec("V100")
    with pytest.raises(ValueError, match="precision='int8'"):
        spec("H100 SXM").peak_flops("int8")
    with pytest.raises(ValueError, match="MI250 has no bf16_sparse figure"):
        spec("MI250").peak_flops("bf16_sparse")
