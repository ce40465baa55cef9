"""The int8 quantize/dequantize Triton kernels (under the interpreter on CPU): codes equal PyTorch's exactly,
ties round to even, dequantization is within half a step, zero rows, every element written, bad input."""


import pytest
import torch
from llmlab.kernels import quantize

from llmlab import runtime

DEVICE = runtime.device()
DTYPES = quantize.SUPPORTED_DTYPES
SHAPES = [(1, 1), (3, 7), (17, 1000), (2, 3, 1500), (5,)]  # 1500 > 1024: a row in two blocks


def quantize_poisoned(x):
    """quantize_int8 into outputs filled with values it never writes: -128 (not a code) and NaN."""
    q = torch.full(x.shape, -128, dtype=torch.int8, device=x.device)
    scale = torch.full(x.shape[:-1], float("nan"), device=x.device)
    assert quantize.quantize_int8(x, q_out=q, scale_out=scale) == (q, scale)
    assert not (q == -128).any() and not scale.isnan().any(), "an element was never written"
    return q, scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_codes_and_scales_equal_the_reference_exactly(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])).to(DEVICE, dtype)  # wide range
    q, scale = quantize_poisoned(x)
    ref_q, ref_scale = quantize.reference(x)
    # The same IEEE operations (max, division, round half to even): integers and scales identical, no tolerance.
    assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale)
    assert q.shape == x.shape and scale.shape == x.shape[:-1]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dequantize_equals_reference_and_is_within_half_a_step(shape, dtype):
    x = torch.randn(shape).to(DEVICE, dtype)
    q, scale = quantize.quantize_int8(x)
    out = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    assert quantize.dequantize_int8(q, scale, dtype, out=out) is out
    assert torch.equal(out, quantize.reference_dequantize(q, scale, dtype))  # q·s in fp32, one rounding
    # |x − q·s| ≤ s/2 for q the integer nearest the exact x/s; but q rounds the fp32 quotient x/s, which is off by
    # up to half its ulp, 2⁻²⁴·|x/s|: near a tie k + ½ that can pick the other integer, adding ≤ 2⁻²⁴·|x| (about 1
    # element in 10⁶ lands there). q·s is rounded to fp32 (≤ 2⁻²⁴·|x̂|), then to `dtype` (≤ u·|x̂|; the same rounding
    # for fp32).
    unit_roundoff = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    err = (x.double() - out.double()).abs()
    bound = (scale.double()[..., None] / 2 + 2.0**-24 * (x.double().abs() + out.double().abs())
             + unit_roundoff * out.double().abs())
    assert (err <= bound).all()


def test_ties_round_to_even():
    # max|x| = 127 gives s = 1 exactly, so x / s is x: every .5 is a tie, rounded to the even neighbour.
    x = torch.tensor([[0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 126.5, -126.5, 127.0]], device=DEVICE)
    q, scale = quantize.quantize_int8(x)
    assert scale.item() == 1.0
    assert q.tolist() == [[0, 2, 2, 4, 0, -2, -2, 126, -126, 127]]
    assert torch.equal(q, torch.round(x).to(torch.int8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_rows_get_scale_zero_and_no_nan(dtype):
    x = torch.randn(4, 9).to(DEVICE, dtype)
    x[1] = 0
    x[3] = -0.0
    q, scale = quantize_poisoned(x)
    assert scale[1] == 0 and scale[3] == 0 and (q[1] == 0).all() and (q[3] == 0).all()
    out = quantize.dequantize_int8(q, scale, dtype)
    assert not out.isnan().any() and (out[1] == 0).all()


def test_extremes_and_subnormals():
    """The largest finite values and bf16/fp32 subnormals (which the interpreter widens by hand)."""
    for dtype in DTYPES:
        finfo = torch.finfo(dtype)
        x = torch.tensor([[finfo.max, -finfo.max, 1.0], [finfo.tiny / 4, -finfo.tiny / 8, 0.0]]).to(DEVICE, dtype)
        q, scale = quantize.quantize_int8(x)
        ref_q, ref_scale = quantize.reference(x)
        assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale), dtype
        assert q[0].tolist()[:2] == [127, -127] and q[1, 0] != 0


def test_empty_rows_and_non_contiguous_input():
    q, scale = quantize.quantize_int8(torch.empty(3, 0, device=DEVICE))
    assert q.shape == (3, 0) and torch.equal(scale, torch.zeros(3, device=DEVICE))
    x = torch.randn(40, 30, device=DEVICE).t()  # (30, 40), column-major: copied to rows first
    assert not x.is_contiguous()
    assert all(torch.equal(a, b) for a, b in zip(quantize.quantize_int8(x), quantize.reference(x), strict=True))


def ones(*shape, **kwargs):
    return torch.ones(*shape, device=DEVICE, **kwargs)


INT8 = dict(dtype=torch.int8)


@pytest.mark.parametrize("call,match", [
    (lambda: quantize.quantize_int8([1.0]), "x must be a torch.Tensor, got list"),
    (lambda: quantize.quantize_int8(ones(())), "x must have at least one dimension"),
    (lambda: quantize.quantize_int8(ones(2, 2, dtype=torch.float64)), "x.dtype=torch.float64 is not supported"),
    (lambda: quantize.quantize_int8(ones(2, 3), q_out=ones(2, 3)), r"q_out must be a contiguous \(2, 3\) torch.int8"),
    (lambda: quantize.quantize_int8(ones(2, 3), scale_out=ones(3)), r"scale_out must be a contiguous \(2,\)"),
    (lambda: quantize.dequantize_int8(ones(2, 3), ones(2)), "q must be an int8 tensor"),
    (lambda: quantize.dequantize_int8(ones(2, 3, **INT8), ones(3)), r"scale must be fp32 of shape .* = \(2,\)"),
    (lambda: quantize.dequantize_int8(ones(2, 3, **INT8), ones(2).half()), "scale must be fp32"),
    (lambda: quantize.dequantize_int8(ones(2, 3, **INT8), ones(2), torch.int32), "dtype=torch.int32 is not"),
    (lambda: quantize.dequantize_int8(ones(2, 3, **INT8), torch.ones(2, device="meta")), "scale is on meta but q"),
])
def test_bad_input_is_refused_with_the_argument_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_bench_reports_both_kernels():
    rows = quantize.bench(sizes=[(8, 64)], dtype=torch.float32)
    assert [r["impl"].split()[1] for r in rows] == ["quantize", "dequantize"]
    assert all(r["impl_ms"] > 0 and r["peer_ms"] > 0 and r["impl_GB/s"] > 0 for r in rows)
