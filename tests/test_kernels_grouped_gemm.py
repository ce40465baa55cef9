"""The Triton grouped GEMM under the interpreter: groups of any size (0 included, none a multiple of the block), odd
K and N, strides, fp32/fp16/bf16/fp64 against the float64 loop of matmuls and against `torch._grouped_mm`, the weight
gradient kernel, autograd (gradcheck), the bench's rows (the GPU sweep's code run on the CPU), and bad input."""

import functools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from llmlab.kernels import gemm_configs
from llmlab.kernels import grouped_gemm as gg
from test_kernels_gemm import assert_gemm_close, poisoned

from llmlab import bench, runtime, timing

BLOCK = gemm_configs.INTERPRETER.kwargs["BLOCK_M"]  # the interpreter's tile: 32 rows, 32 columns, 32 along K


def ends(sizes) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0).to(torch.int32)  # (G,)


def operands(sizes, k, n, dtype, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), k, generator=g).to(dtype)  # (M, K)
    w = torch.randn(len(sizes), k, n, generator=g).to(dtype)  # (G, K, N)
    b = torch.randn(len(sizes), n, generator=g).to(dtype) if bias else None  # (G, N)
    return x, w, b


def assert_fp64_close(c, ref, abs_prod, k):
    # float64 accumulates K products, each sum rounded by 2^-53: (K + 2)·2^-53·(|A| @ |B|), plus rounding C itself
    bound = (k + 2) * 2.0**-53 * abs_prod + 2.0**-53 * ref.abs()
    assert ((c - ref).abs() <= bound).all(), f"error {(c - ref).abs().max().item():.3g} exceeds the fp64 bound"


def assert_grouped_close(y, x, w, offsets, bias=None):
    """Each group's rows of y against its own float64 product: the GEMM's error bound (test_kernels_gemm), group
    by group — so a row computed with another group's weights, or never written (NaN), fails."""
    for g, (s, e) in enumerate(gg._bounds(offsets)):
        b = None if bias is None else bias[g]
        if y.dtype == torch.float64:
            ref = gg.reference(x[s:e], w[g:g + 1], torch.tensor([e - s]), None if b is None else b[None])
            abs_prod = x[s:e].abs() @ w[g].abs() + (0 if b is None else b.abs())
            assert_fp64_close(y[s:e], ref, abs_prod, x.shape[1])
        else:
            assert_gemm_close(y[s:e], x[s:e], w[g], b)


def assert_wgrad_close(dw, x, dy, offsets):
    for g, (s, e) in enumerate(gg._bounds(offsets)):  # dW[g] = X_gᵀ @ dY_g: a GEMM whose K is the group's size
        if dw.dtype == torch.float64:
            assert_fp64_close(dw[g], x[s:e].T @ dy[s:e], x[s:e].T.abs() @ dy[s:e].abs(), e - s)
        else:
            assert_gemm_close(dw[g], x[s:e].T, dy[s:e])


GROUPS = {  # group sizes: rows of X per group, in order
    "one group": [45],
    "empty first, middle and last": [0, 7, 0, 33, 0],
    "one row each": [1, 1, 1, 1, 1, 1, 1],  # every row its own tile: the grid bound is tight (M + G·31) // 32 = G
    "block + 1 each": [BLOCK + 1] * 5,  # 2 tiles each: tight again
    "uneven": [3, 70, 31, 64, 2],
}


@pytest.mark.parametrize("dtype", gg.DTYPES, ids=str)
@pytest.mark.parametrize("sizes", GROUPS.values(), ids=GROUPS.keys())
def test_forward_and_weight_grad_match_float64(sizes, dtype, seed=0):
    k, n = 37, 29  # odd, neither a multiple of the block
    x, w, b = operands(sizes, k, n, dtype, seed)
    offsets = ends(sizes)
    y = gg.grouped_mm(x, w, offsets, b, out=poisoned(x.shape[0], n, dtype))
    assert_grouped_close(y, x, w, offsets, b)
    dy = torch.randn(x.shape[0], n, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    dw = gg.grouped_weight_grad(x, dy, offsets, out=torch.full((len(sizes), k, n), float("nan"), dtype=dtype))
    assert_wgrad_close(dw, x, dy, offsets)


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(0, 70), min_size=1, max_size=6), k=st.integers(1, 70), n=st.integers(1, 70),
       bias=st.booleans(), seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(gg.DTYPES))
def test_any_groups_and_shapes(sizes, k, n, bias, seed, dtype):
    x, w, b = operands(sizes, k, n, dtype, seed, bias)
    offsets = ends(sizes)
    assert_grouped_close(gg.grouped_mm(x, w, offsets, b, out=poisoned(x.shape[0], n, dtype)), x, w, offsets, b)
    dy = torch.randn(x.shape[0], n, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    assert_wgrad_close(gg.grouped_weight_grad(x, dy, offsets), x, dy, offsets)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_inputs_and_the_transposed_weights_of_backward(dtype):
    sizes, offsets = [20, 0, 45], ends([20, 0, 45])
    x = torch.randn(33, 65).to(dtype).t()  # (65, 33), column-major
    w = torch.randn(3, 50, 33).to(dtype).transpose(1, 2)  # (3, 33, 50) view: what backward's dY @ Wᵀ reads
    assert not x.is_contiguous() and not w.is_contiguous()
    assert_grouped_close(gg.grouped_mm(x, w, offsets), x, w, offsets)
    dy = torch.randn(65, 100).to(dtype)[:, ::2]  # (65, 50), stride 2 along columns
    assert_wgrad_close(gg.grouped_weight_grad(x, dy, offsets), x, dy, offsets)
    assert sum(sizes) == x.shape[0]


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_equals_torch_grouped_mm(dtype, seed=0):
    # torch's own grouped GEMM (offsets in the same convention; it wants rows of 16-byte multiples): an independent
    # implementation, forward and weight gradient. Both accumulate in fp32 and round once to dtype; they may differ
    # by the accumulation order (fp32: ~K·2^-24 relative) and, in bf16, by one rounding of the result (2^-8)
    x, w, _ = operands([9, 0, 40, 15], 24, 40, dtype, seed)
    offsets, dy = ends([9, 0, 40, 15]), torch.randn(64, 40, generator=torch.Generator().manual_seed(seed)).to(dtype)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 * 2.0**-8}[dtype]
    for ours, theirs in ((gg.grouped_mm(x, w, offsets), torch._grouped_mm(x, w, offs=offsets)),
                         (gg.grouped_weight_grad(x, dy, offsets), torch._grouped_mm(x.T, dy, offs=offsets))):
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol * theirs.float().abs().max())


def test_grouped_linear_trains_like_the_loop_of_matmuls(seed=0):
    # float64: dX = dY·Wᵀ (the forward kernel on transposed strides), dW by the second kernel, db by a segment sum,
    # against autograd through the plain loop; both sum the same products in other orders: ~1e-16 relative
    x, w, b = operands([5, 0, 38, 1], 13, 11, torch.float64, seed)
    offsets = ends([5, 0, 38, 1])
    grads = []
    for fn in (gg.grouped_linear, gg.reference):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        y = fn(leaves[0], leaves[1], offsets, leaves[2])
        (y * torch.linspace(-1, 1, 11, dtype=y.dtype)).sum().backward()
        grads.append([y.detach(), *(t.grad for t in leaves)])
    for name, ours, theirs in zip(("y", "x", "w", "b"), *grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12, msg=name)
    assert grads[0][2][1].abs().max() == 0 and grads[0][3][1].abs().max() == 0  # the empty group's: exactly 0


def test_gradcheck(seed=0):
    # backward against finite differences of forward, float64 (gradcheck's eps 1e-6, tolerance 1e-5); fast mode
    # checks the Jacobian along random directions (vᵀJu), 2 forwards per input instead of 2 per element
    x, w, b = (t.requires_grad_() for t in operands([2, 0, 3, 2], 3, 4, torch.float64, seed))
    assert torch.autograd.gradcheck(lambda *a: gg.grouped_linear(*a[:2], ends([2, 0, 3, 2]), a[2]), (x, w, b),
                                    fast_mode=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_float32_and_float16_gradients(dtype, seed=0):
    # the backward's three products against float64, each within the GEMM's bound for its inputs (which are dY,
    # X and W already rounded to dtype)
    x, w, b = operands([17, 0, 40], 21, 35, dtype, seed)
    offsets = ends([17, 0, 40])
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    y = gg.grouped_linear(*leaves[:2], offsets, leaves[2])
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)  # (M, N)
    y.backward(dy)
    assert_grouped_close(leaves[0].grad, dy, w.transpose(1, 2), offsets)
    assert_wgrad_close(leaves[1].grad, x, dy, offsets)
    db = torch.stack([dy[s:e].double().sum(0) for s, e in gg._bounds(offsets)])  # (G, N)
    # summed in fp32 and rounded once to dtype: 2^-11 (fp16) of each sum, plus fp32's M·2^-24 of Σ|dY|
    bound = 2.0**-11 * db.abs() + (dy.shape[0] + 2) * 2.0**-24 * torch.stack(
        [dy[s:e].double().abs().sum(0) for s, e in gg._bounds(offsets)])
    assert ((leaves[2].grad.double() - db).abs() <= bound).all()


def test_empty_dimensions():
    w, b = torch.randn(2, 4, 3), torch.randn(2, 3)
    assert gg.grouped_mm(torch.randn(0, 4), w, ends([0, 0])).shape == (0, 3)
    assert gg.grouped_mm(torch.randn(5, 4), torch.randn(2, 4, 0), ends([2, 3])).shape == (5, 0)
    y = gg.grouped_mm(torch.randn(5, 0), torch.randn(2, 0, 3), ends([2, 3]), b)  # K = 0: an empty sum, plus bias
    assert torch.equal(y, torch.cat([b[0].expand(2, 3), b[1].expand(3, 3)]))
    assert torch.equal(gg.grouped_weight_grad(torch.randn(0, 4), torch.randn(0, 3), ends([0, 0])), torch.zeros(2, 4, 3))


@pytest.mark.parametrize("call,match", [
    (lambda: gg.grouped_mm(torch.randn(5, 4), torch.randn(4, 3), ends([5])), "w must be 3-D"),
    (lambda: gg.grouped_mm(torch.randn(5), torch.randn(1, 4, 3), ends([5])), "x must be 2-D"),
    (lambda: gg.grouped_mm([[1.0]], torch.randn(1, 1, 1), ends([1])), "x must be a torch.Tensor"),
    (lambda: gg.grouped_mm(torch.randn(5, 4), torch.randn(2, 3, 3), ends([2, 3])),
     r"inner dimensions differ.*x.shape\[1\]=4 != w.shape\[1\]=3"),
    (lambda: gg.grouped_mm(torch.randn(5, 4), torch.randn(2, 4, 3).half(), ends([2, 3])),
     "x.dtype=torch.float32 and w.dtype=torch.float16 differ"),
    (lambda: gg.grouped_mm(torch.randn(5, 4).int(), torch.randn(2, 4, 3).int(), ends([2, 3])),
     "x.dtype=torch.int32 not supported"),
    (lambda: gg.grouped_mm(torch.randn(5, 4), torch.randn(0, 4, 3), ends([])), "w has 0 groups"),
    (lambda: gg.grouped_mm(torch.randn(5, 4), torch.randn(2, 4, 3), [2, 5]), "offsets must be a 1-D int32 or int64"),
    (lambda: gg.grouped_mm(torch.randn(5, 4), torch.randn(2, 4, 3), torch.tensor([2.0, 5.0])),
     "offsets must be a 1-D int32 or int64 tensor .* got 1-D torch.float32"),
    (lambda: gg.grouped_mm(torch.randn(5, 4), torch.randn(2, 4, 3), ends([5])), "offsets has 1 entries; w has 2"),
    (lambda: gg.grouped_mm(torch.randn(5, 4), torch.randn(2, 4, 3), ends([2, 2])),
     r"offsets=\[2, 4\] must be non-decreasing, from ≥ 0, and end at x's 5 rows"),
    (lambda: gg.grouped_mm(torch.randn(2, 4), torch.randn(2, 4, 3), torch.tensor([4, 2])),
     r"offsets=\[4, 2\] must be non-decreasing"),
    (lambda: gg.grouped_mm(torch.randn(5, 4), torch.randn(2, 4, 3), torch.tensor([-1, 5])), r"offsets=\[-1, 5\]"),
    (lambda: gg.grouped_mm(torch.randn(5, 4), torch.randn(2, 4, 3, device="meta"), ends([2, 3])),
     "x is on cpu and w on meta"),
    (lambda: gg.grouped_mm(torch.randn(5, 4), torch.randn(2, 4, 3), ends([2, 3]), bias=torch.randn(3)),
     r"bias must be a \(2, 3\) torch.float32 tensor on cpu \(one row per group\), got \(3,\)"),
    (lambda: gg.grouped_mm(torch.randn(5, 4), torch.randn(2, 4, 3), ends([2, 3]), out=torch.empty(5, 4)),
     r"out must be \(5, 3\)"),
    (lambda: gg.grouped_weight_grad(torch.randn(5, 4), torch.randn(4, 3), ends([2, 3])),
     "must share their rows, dtype and device"),
    (lambda: gg.grouped_weight_grad(torch.randn(5, 4), torch.randn(5, 3), torch.tensor([2, 4])),
     r"offsets=\[2, 4\] must be non-decreasing"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_routed_groups_are_uneven_and_cover_every_row():
    offsets = gg.routed(8, 1000, "cpu")
    sizes = [e - s for s, e in gg._bounds(offsets)]
    assert offsets.dtype == torch.int32 and sum(sizes) == 1000 and max(sizes) > 1.3 * min(sizes)  # skewed router
    assert torch.equal(offsets, gg.routed(8, 1000, "cpu"))  # seeded: the same groups every run


def test_bench_checks_correctness_on_the_cpu():
    assert bench.BENCHES["grouped_gemm"] == "llmlab.kernels.grouped_gemm:bench"
    rows = bench.get("grouped_gemm")(sizes=[(3, 20, 8, 8)])
    assert [(r["impl"], r["dtype"]) for r in rows] == [
        (f"triton grouped_mm {part} (interpreted)", dtype)
        for dtype in ("float32", "bfloat16") for part in ("forward", "weight grad")]
    for row in rows:
        assert row["check"] == "ok" and row["rel_err"] <= row["tol"] and sum(row["groups"]) == 20
    json.dumps(bench.record("grouped_gemm", rows))  # the record is serialisable


def test_gpu_sweep_runs_on_the_cpu(monkeypatch):
    # the GPU tier's bench, on the CPU (as under LLMLAB_GPU_SMOKE): every peer timed or named as not running,
    # checked against float64; shorter timings than a bench's (the figures are not what is tested here)
    monkeypatch.setattr(gg, "compare", functools.partial(timing.compare, min_rounds=3, budget_s=0.05))
    rows = gg.sweep(sizes=[(3, 40, 16, 24)])
    peers = ["loop", *(["torch._grouped_mm"] if hasattr(torch, "_grouped_mm") else [])]
    assert [(r["impl"], r["peer"]) for r in rows] == [(f"triton grouped_mm {part}", peer)
                                                      for part in ("forward", "weight grad") for peer in peers]
    for row in rows:
        if "note" in row:  # torch._grouped_mm may refuse a device or a layout: the row says so
            assert row["note"].startswith("peer did not run: ")
            continue
        assert row["check"] == "ok" and row["ratio"] > 0 and row["impl_TFLOP/s"] > 0 and "load" in row
        assert row["of_peer"] == pytest.approx(1 / row["ratio"]) and row["config"] == "32×32×32, 3 stages, 4 warps"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
def test_compiled_kernels_on_gpu(dtype):
    # the compiled, autotuned kernels: groups not multiples of any tile (and an empty one), odd K and N, bias, the
    # transposed weights of dX and the weight gradient, each against the float64 bound group by group (IEEE fp32:
    # TF32 stays off, PyTorch's default)
    device = runtime.device()
    sizes = [130, 0, 1, 257, 77]
    x, w, b = (t.to(device) for t in operands(sizes, 97, 130, dtype))
    offsets, dy = ends(sizes).to(device), torch.randn(sum(sizes), 130, device=device).to(dtype)
    y = gg.grouped_mm(x, w, offsets, b, out=poisoned(x.shape[0], 130, dtype, device))
    assert_grouped_close(y.cpu(), x.cpu(), w.cpu(), offsets.cpu(), b.cpu())
    dx = gg.grouped_mm(dy, w.transpose(1, 2), offsets)
    assert_grouped_close(dx.cpu(), dy.cpu(), w.transpose(1, 2).cpu(), offsets.cpu())
    assert_wgrad_close(gg.grouped_weight_grad(x, dy, offsets).cpu(), x.cpu(), dy.cpu(), offsets.cpu())
