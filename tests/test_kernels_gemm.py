"""The Triton GEMM under the interpreter: any shape, strides, dtypes, fused epilogue, and bad input; its configs per
device, the peak it is measured against, and the GPU bench's code (run on the CPU)."""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from llmlab.kernels import gemm, gemm_configs

from llmlab import hardware, runtime, timing

# Error bound of C = A @ B computed with an fp32 accumulator and rounded once to the output dtype, against
# the float64 product of the same (already rounded) inputs:
#   |C - C64| <= u_out * |C64| + K * u_fp32 * (|A| @ |B|)
# u_out is the unit roundoff of the output dtype (half an ulp: 2^-24 fp32, 2^-11 fp16, 2^-8 bf16); K * u_fp32
# bounds the fp32 summation error (the classic gamma_K). The fused epilogue adds at most one more fp32
# rounding per operation, far below these terms; relu/gelu are at most ~1.13-Lipschitz, hence the 1.2.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def assert_gemm_close(c, a, b, bias=None, activation=None):
    ref = gemm.reference(a.double(), b.double(), None if bias is None else bias.double(), activation)
    k = a.shape[1]
    abs_prod = a.double().abs() @ b.double().abs() + (0 if bias is None else bias.double().abs())
    slope = 1.0 if activation is None else 1.2
    u = UNIT_ROUNDOFF[c.dtype]
    # a result in the output's subnormal range is rounded to a fixed spacing, not a relative one: add half of it
    subnormal = u * torch.finfo(c.dtype).smallest_normal
    bound = u * ref.abs() + slope * (k + 2) * 2.0**-24 * abs_prod + subnormal
    err = (c.double() - ref).abs()
    assert not torch.isnan(c).any(), "some element of C was never written (still NaN)"
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"error {err.max().item():.3g} exceeds the bound by {worst:.2f}x"


def poisoned(m, n, dtype, device="cpu"):
    return torch.full((m, n), float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", gemm.DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (2, 3, 5), (31, 37, 41), (64, 64, 64), (97, 13, 130),
                                   (7, 200, 3)])
def test_matches_float64_reference(m, n, k, dtype):
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    assert_gemm_close(gemm.matmul(a, b, out=poisoned(m, n, dtype)), a, b)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 90), n=st.integers(1, 90), k=st.integers(1, 90), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from(gemm.DTYPES))
def test_any_shape(m, n, k, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)
    assert_gemm_close(gemm.matmul(a, b, out=poisoned(m, n, dtype)), a, b)


@pytest.mark.parametrize("dtype", gemm.DTYPES, ids=str)
def test_transposed_and_strided_inputs(dtype):
    a = torch.randn(45, 70).to(dtype).t()  # (70, 45), column-major
    b = torch.randn(45, 60).to(dtype)[:, ::2]  # (45, 30), stride 2 along columns
    assert not a.is_contiguous() and not b.is_contiguous()
    assert_gemm_close(gemm.matmul(a, b), a, b)


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("dtype", gemm.DTYPES, ids=str)
def test_fused_bias_and_activation(activation, dtype):
    a, b, bias = torch.randn(33, 47).to(dtype), torch.randn(47, 29).to(dtype), torch.randn(29).to(dtype)
    c = gemm.matmul(a, b, bias=bias, activation=activation, out=poisoned(33, 29, dtype))
    assert_gemm_close(c, a, b, bias, activation)


def test_empty_dimensions():
    assert gemm.matmul(torch.randn(0, 4), torch.randn(4, 3)).shape == (0, 3)
    c = gemm.matmul(torch.randn(5, 0), torch.randn(0, 3), bias=torch.ones(3))
    assert torch.equal(c, torch.ones(5, 3))  # an empty sum is 0, plus the bias


@pytest.mark.parametrize("a,b,kwargs,match", [
    (torch.randn(3, 4), torch.randn(5, 2), {}, r"inner dimensions differ.*a.shape\[1\]=4 != b.shape\[0\]=5"),
    (torch.randn(4), torch.randn(4, 2), {}, "a must be 2-D"),
    (torch.randn(3, 4), torch.randn(2, 4, 2), {}, "b must be 2-D"),
    (torch.randn(3, 4), torch.randn(4, 2).half(), {}, "a.dtype=torch.float32 and b.dtype=torch.float16"),
    (torch.randn(3, 4).double(), torch.randn(4, 2).double(), {}, "a.dtype=torch.float64 not supported"),
    (torch.randn(3, 4), torch.randn(4, 2), {"bias": torch.randn(3)}, r"bias must be a tensor of shape \(2"),
    (torch.randn(3, 4), torch.randn(4, 2), {"activation": "swish"}, "activation='swish'"),
    ([[1.0]], torch.randn(1, 1), {}, "a must be a torch.Tensor"),
])
def test_bad_input(a, b, kwargs, match):
    with pytest.raises(ValueError, match=match):
        gemm.matmul(a, b, **kwargs)


def test_tensors_on_different_devices():
    a = torch.randn(3, 4)
    b = torch.randn(4, 2, device="meta")
    with pytest.raises(ValueError, match="a is on cpu and b on meta"):
        gemm.matmul(a, b)


def test_bench_reports_both_implementations():
    (row,) = gemm.bench(sizes=[16], dtypes=[torch.float32])
    assert row["size"] == 16 and row["impl_TFLOP/s"] > 0 and row["peer_TFLOP/s"] > 0
    # each figure from its own median; the ratio is the median of the per-round ratios (llmlab.timing), with its spread
    assert row["impl_TFLOP/s"] == pytest.approx(2 * 16**3 / row["impl_ms"] / 1e9)
    assert row["peer_TFLOP/s"] == pytest.approx(2 * 16**3 / row["peer_ms"] / 1e9)
    assert row["ratio"] > 0 and row["spread"] >= 0 and "load" in row


@pytest.mark.parametrize("num_pid_m,num_pid_n,group_m", [(8, 8, 4), (5, 3, 4), (1, 7, 8), (6, 2, 1)])
def test_program_tile_covers_every_tile_once(num_pid_m, num_pid_n, group_m):
    tiles = [gemm.program_tile(pid, num_pid_m, num_pid_n, group_m) for pid in range(num_pid_m * num_pid_n)]
    assert sorted(tiles) == [(m, n) for m in range(num_pid_m) for n in range(num_pid_n)]
    if group_m == 1:
        assert tiles == [(m, n) for m in range(num_pid_m) for n in range(num_pid_n)]  # row-major


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tf32", [(torch.bfloat16, False), (torch.float16, False), (torch.float32, False),
                                        (torch.float32, True)], ids=["bf16", "fp16", "fp32", "tf32"])
def test_compiled_kernel_on_gpu(dtype, tf32):
    # the compiled kernel (autotuned over this GPU's configs): masked edges (no size a multiple of 16), a
    # column-major A and the fused epilogue; against the interpreter tests' float64 bound, or for TF32 (inputs cut
    # to 10 mantissa bits) the GPU bench's relative Frobenius tolerance
    device = runtime.device()
    a = torch.randn(61, 97, device=device).to(dtype).t()  # (97, 61), column-major
    b, bias = torch.randn(61, 130, device=device).to(dtype), torch.randn(130, device=device).to(dtype)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        c = gemm.matmul(a, b, bias=bias, activation="gelu", out=poisoned(97, 130, dtype, device))
    finally:
        torch.set_float32_matmul_precision(before)
    if not tf32:
        assert_gemm_close(c, a, b, bias, "gelu")
    else:
        exact = gemm.reference(a.double(), b.double(), bias.double(), "gelu")  # (97, 130)
        assert torch.linalg.norm(c.double() - exact) / torch.linalg.norm(exact) <= gemm.TOLERANCE["tf32"]


@pytest.mark.parametrize("precision", gemm_configs.PRECISIONS)
def test_hopper_configs_fit_wgmma_and_shared_memory(precision):
    configs = gemm_configs.configs("hopper", precision)
    assert len(configs) <= 8  # each config compiles per dtype: a short list keeps the GPU bench in its time box
    for c in configs:
        m, n, k = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        assert m % (64 * (c.num_warps // 4)) == 0, "each warpgroup (4 warps) of wgmma computes 64-row slabs"
        itemsize = 2 if precision in ("bf16", "fp16") else 4
        assert (m * k + k * n) * itemsize * c.num_stages <= 227 * 1024, "Hopper: 227 KB of shared memory"


def test_configs_by_device():
    assert gemm_configs.kind(torch.device("cpu")) == "interpreter"  # this tier: Triton interpreted
    (c,) = gemm_configs.configs("interpreter", "fp32")
    assert c.kwargs == {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}
    wide, narrow = (gemm_configs.configs("other-gpu", p) for p in ("bf16", "tf32"))
    assert [c.kwargs["BLOCK_K"] for c in wide] == [2 * c.kwargs["BLOCK_K"] for c in narrow]  # TF32: half the K-step
    assert gemm_configs.describe(wide[0]) == "128×256×64, 3 stages, 8 warps"
    with pytest.raises(ValueError, match="where='tpu'"):
        gemm_configs.configs("tpu", "fp32")
    with pytest.raises(ValueError, match="precision='fp8'"):
        gemm_configs.configs("hopper", "fp8")


def test_peak_flops():
    h200 = hardware.for_device("NVIDIA H200")
    assert gemm_configs.peak_flops(h200, "bf16") == gemm_configs.peak_flops(h200, "fp16") == 989e12
    assert gemm_configs.peak_flops(h200, "tf32") == 495e12 and gemm_configs.peak_flops(h200, "fp32") == 67e12
    assert gemm_configs.peak_flops(hardware.for_device("AMD Instinct MI250X"), "tf32") is None  # no TF32 there
    assert gemm_configs.peak_flops(None, "bf16") is None
    with pytest.raises(ValueError, match="precision='fp8'"):
        gemm_configs.peak_flops(h200, "fp8")


def test_gpu_sweep_runs_on_the_cpu(monkeypatch):
    # the GPU tier's bench, on the CPU (as under LLMLAB_GPU_SMOKE): timed, checked against float64, TF32 restored;
    # shorter timings than a bench's (the figures are not what is tested here)
    monkeypatch.setattr(gemm, "compare", functools.partial(timing.compare, min_rounds=3, budget_s=0.05))
    before = torch.get_float32_matmul_precision()
    (row,) = gemm.sweep(sizes=[16], dtypes=[torch.float32])
    assert torch.get_float32_matmul_precision() == before
    assert row["precision"] == "tf32" and row["check"] == "ok" and row["rel_err"] <= row["tol"]
    assert row["of_torch"] == row["of_torch_eager"] == pytest.approx(1 / row["ratio"])  # a CPU launches nothing
    assert row["of_peak"] is None and row["peak_of"] == ""  # a CPU has no spec-sheet entry
    assert row["config"] == "32×32×32, 3 stages, 4 warps"
