"""The spec sheet: its internal consistency (sparse = 2× dense, TF32 = BF16 / 2, FP8 = 2× BF16), ridge points,
per-direction links, the row of a device by its driver's name, errors."""

import pytest

from llmlab.hardware import SPECS, cpu_peak_tflops, for_device, spec


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


def test_ridge_points_by_generation_as_chapter_5_reads_them():
    a100, h100, h200, b200 = (spec(n).ridge_point() for n in ("A100 SXM", "H100 SXM", "H200 SXM", "B200"))
    assert a100 < h100  # compute grew faster than bandwidth
    assert h200 < h100  # the same compute, faster memory: lower
    assert b200 == pytest.approx(h100, rel=0.05)  # both raised: near the H100's


def test_cpu_peak_formula():
    assert cpu_peak_tflops(cores=1, ghz=1.0, fp32_lanes=8, fma_units=2) == pytest.approx(0.032)


def test_bad_names_and_precisions():
    with pytest.raises(ValueError, match="no spec for 'V100'"):
        spec("V100")
    with pytest.raises(ValueError, match="precision='int8'"):
        spec("H100 SXM").peak_flops("int8")
    with pytest.raises(ValueError, match="MI250 has no bf16_sparse figure"):
        spec("MI250").peak_flops("bf16_sparse")


@pytest.mark.parametrize("name,row", [("NVIDIA H200", "H200 SXM"), ("NVIDIA H100 80GB HBM3", "H100 SXM"),
                                     ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA A100-SXM4-80GB", "A100 SXM"),
                                     ("NVIDIA A100-PCIE-40GB", "A100 PCIe"), ("NVIDIA H100 NVL", None),
                                     ("NVIDIA GeForce RTX 4090", None),
                                     ("AMD Instinct MI250X", "MI250X (one of 2 dies)")])
def test_a_device_finds_its_own_row(name, row):
    found = for_device(name)
    assert (found.name if found else None) == row


def test_memory_capacity_is_in_binary_gigabytes():
    """An "80 GB" A100 is 81920 MiB = 80 GiB (nvidia-smi), 7% more than 80·10⁹ bytes; every row's capacity is its
    label read as GiB, or the driver's total a little under it (H100 81559 MiB, H200 143771 MiB, B200 183359 MiB)."""
    assert SPECS["A100 SXM"].memory_bytes == SPECS["A100 PCIe"].memory_bytes == 80 * 2**30 == 81920 * 2**20
    assert SPECS["H200 SXM"].memory_bytes == 143771 * 2**20 and SPECS["B200"].memory_bytes == 183359 * 2**20
    for s in SPECS.values():
        assert isinstance(s.memory_bytes, int) and s.memory_gb * 1e9 < s.memory_bytes <= s.memory_gb * 2**30, s.name


def test_one_die_of_a_two_die_package_gets_half_of_it():
    package, die = SPECS["MI250X"], for_device("AMD Instinct MI250X")
    assert die.bf16_tflops == package.bf16_tflops / 2 and die.memory_gb == 64 and die.hbm_gbs == package.hbm_gbs / 2
    assert die.memory_bytes == 64 * 2**30
    assert die.dies == 1 and die.ridge_point() == pytest.approx(package.ridge_point())


def test_tf32_and_fp8_columns():
    for name in ("A100 SXM", "A100 PCIe", "H100 SXM", "H100 PCIe", "H200 SXM", "B200"):
        s = SPECS[name]
        assert s.tf32_tflops == pytest.approx(s.bf16_tflops / 2, rel=0.01)  # NVIDIA's datasheets: TF32 = BF16 / 2
        if name.startswith("A100"):
            assert s.fp8_tflops is None  # Ampere has no FP8
        else:  # 1979 for 2 × 989: the datasheets round each figure on its own
            assert s.fp8_tflops == pytest.approx(2 * s.bf16_tflops, rel=0.002)
        assert s.peak_flops("tf32") / s.peak_flops("fp32") < s.peak_flops("bf16") / s.peak_flops("fp32")
    assert SPECS["A100 SXM"].peak_flops("bf16") / SPECS["A100 SXM"].peak_flops("tf32") == 2  # not 16×
    with pytest.raises(ValueError, match="MI250X has no tf32 figure"):
        SPECS["MI250X"].peak_flops("tf32")
