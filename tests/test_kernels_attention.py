"""FlashAttention-2 in Triton under the interpreter: values, log-sum-exp and gradients against SDPA on odd sizes,
causal and not, every dtype; the tiled reference; bytes saved for backward linear in T; bad input; the GPU bench's
code run on the CPU."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from llmlab.kernels import attention as fa

from llmlab import runtime
from llmlab.memory.measure import saved_activation_bytes

# Bounds on the error against float64 SDPA of the same (already rounded) inputs, relative to the result's norm.
# float64: both sides accumulate in float64 in another order: a few ulps (2^-52 ≈ 2.2e-16) times the few dozen
# terms of a row, 1e-12 leaves 10^3x. float32: each output is a sum of Tk ≤ 64 products of fp32 roundings (2^-24
# ≈ 6e-8 each) and exp/log in fp32; the backward chains three such products: 2e-5 leaves > 20x over the 1e-6
# measured. fp16/bf16: rounding O and the gradients to the dtype moves each element by up to u (2^-11, 2^-8) and
# p is rounded to the dtype before its dot with V: about 2u relative in norm, measured 3e-4 (fp16) and 2e-3
# (bf16) — 4u leaves 2x–4x.
REL_TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 4 * 2.0**-11, torch.bfloat16: 4 * 2.0**-8}


def sdpa(q, k, v, causal, scale=None):
    """SDPA with the causal mask written out (top-left aligned, also for Tq != Tk)."""
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril() if causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def rel(actual, expected):
    """|actual − expected| / max(|expected|, 1) (Frobenius). Inputs are standard normal, so the terms summed are of
    unit size and rounding is relative to them, not to the result: with one key dQ is 0 exactly (the softmax is
    constant), SDPA returns ±1e-16 of cancellation noise there, and dividing by that norm would call noise an error
    of 200 %. Below unit size the check is absolute, at the same tolerance."""
    diff, norm = (actual.double() - expected).norm().item(), expected.norm().item()
    return diff / max(norm, 1.0)


def inputs(B, H, Tq, Tk, d, dtype):
    q = torch.randn(B, H, Tq, d, dtype=torch.float64).to(dtype).requires_grad_()  # (B, H, Tq, d)
    k, v = (torch.randn(B, H, Tk, d, dtype=torch.float64).to(dtype).requires_grad_() for _ in range(2))
    return q, k, v


def check_against_sdpa(B, H, Tq, Tk, d, dtype, causal, scale=None):
    q, k, v = inputs(B, H, Tq, Tk, d, dtype)
    o = fa.attention(q, k, v, causal=causal, scale=scale)  # (B, H, Tq, d)
    g = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), g)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact = sdpa(*wide, causal, scale)
    exact_grads = torch.autograd.grad(exact, wide, g.double())
    assert o.dtype == dtype and o.shape == (B, H, Tq, d)
    tol = REL_TOL[dtype]
    for name, a, b in (("O", o, exact), *zip(("dQ", "dK", "dV"), grads, exact_grads, strict=True)):
        assert rel(a, b) <= tol, f"{name}: relative error {rel(a, b):.2e} > {tol:.1e}"


@pytest.mark.parametrize("dtype", fa.DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,H,Tq,Tk,d", [(2, 3, 37, 37, 24), (1, 2, 20, 45, 16), (1, 1, 45, 20, 8),
                                         (1, 2, 1, 1, 5), (1, 1, 33, 33, 64)])
def test_values_and_gradients_match_sdpa(B, H, Tq, Tk, d, dtype, causal):
    check_against_sdpa(B, H, Tq, Tk, d, dtype, causal)


@settings(max_examples=20, deadline=None)
@given(Tq=st.integers(1, 40), Tk=st.integers(1, 40), d=st.integers(1, 40), causal=st.booleans(),
       scale=st.one_of(st.none(), st.floats(0.05, 2.0)))
def test_any_size_and_scale(Tq, Tk, d, causal, scale):
    check_against_sdpa(1, 2, Tq, Tk, d, torch.float64, causal, scale)


@pytest.mark.parametrize("causal", [False, True])
def test_log_sum_exp_and_the_reference(causal):
    q, k, v = (t.detach() for t in inputs(2, 2, 29, 29, 12, torch.float64))
    s = q @ k.transpose(-1, -2) / math.sqrt(12)  # (B, H, T, T)
    if causal:
        s = s.masked_fill(torch.ones(29, 29, dtype=torch.bool).triu(1), -math.inf)
    o, lse = fa.forward(q, k, v, causal=causal)
    ref_o, ref_lse = fa.reference(q, k, v, causal=causal, block=8)
    exact = sdpa(q, k, v, causal)
    for name, a, b in (("O", o, exact), ("L", lse, s.logsumexp(-1)), ("reference O", ref_o, exact),
                       ("reference L", ref_lse, s.logsumexp(-1))):
        assert rel(a, b) <= REL_TOL[torch.float64], name


def test_strided_inputs_are_accepted():
    """q, k, v as views of one (B, T, 3, H, d) projection, transposed: the launcher makes them contiguous."""
    qkv = torch.randn(2, 19, 3, 2, 8, dtype=torch.float64)  # (B, T, 3, H, d)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, d), non-contiguous
    assert rel(fa.attention(q, k, v, causal=True), sdpa(q, k, v, True)) <= REL_TOL[torch.float64]


def test_saved_bytes_grow_linearly_with_tokens():
    """FlashAttention keeps O and L for backward (T·d + T numbers per head); attention written out keeps the
    (T, T) probabilities: doubling T doubles the one and quadruples the other."""
    def saved(fn, T):
        q, k, v = (torch.randn(1, 2, T, 16, requires_grad=True) for _ in range(3))
        return saved_activation_bytes(fn, q, k, v, causal=True, exclude=(q, k, v))[1]

    for T in (32, 64):
        assert saved(fa.attention, T) == 2 * (T * 16 + T) * 4  # O (fp32) and L (fp32), 2 heads
    assert saved(fa.written_out, 128) / saved(fa.written_out, 64) > 3.5


@pytest.mark.parametrize("call, match", [
    (lambda q: fa.attention(q[0], q, q), "q must be 4-D"),
    (lambda q: fa.attention(q, q.int(), q), r"k.dtype=torch.int32 not supported"),
    (lambda q: fa.attention(q, q.float(), q), "k is torch.float32 on cpu, q is torch.float64"),
    (lambda q: fa.attention(q, q, q[:, :, :3]), "k .* and v .* must have the same shape"),
    (lambda q: fa.attention(q, q[:, :1], q[:, :1]), "must agree in batch, heads and head dim"),
    (lambda q: fa.attention(q, q[:, :, :0], q[:, :, :0]), "k and v have no tokens"),
    (lambda q: fa.attention(q, q, q, causal=1), "causal=1 must be True or False"),
    (lambda q: fa.attention(q, q, q, scale=-1.0), "scale=-1.0 must be a positive finite number"),
    (lambda q: fa.attention(q, q, q, scale=math.nan), "scale=nan must be a positive finite number"),
    (lambda q: fa.attention(torch.zeros(1, 1, 2, 300), torch.zeros(1, 1, 2, 300), torch.zeros(1, 1, 2, 300)),
     "head dim 300 must be between 1 and 256"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.randn(1, 2, 5, 4, dtype=torch.float64))


def test_no_query_tokens():
    q, k, v = torch.randn(1, 2, 0, 4, requires_grad=True), *inputs(1, 2, 0, 3, 4, torch.float32)[1:]
    o = fa.attention(q, k, v)
    assert o.shape == (1, 2, 0, 4)
    o.sum().backward()
    assert k.grad.abs().sum() == 0


def test_cpu_bench_reports_linear_saved_bytes_and_small_errors():
    rows = fa.bench(sizes=(32, 64))
    assert [r["size"] for r in rows] == [32, 64]
    assert rows[1]["impl_saved_bytes"] == 2 * rows[0]["impl_saved_bytes"]
    assert rows[1]["peer_saved_bytes"] > 3.5 * rows[0]["peer_saved_bytes"]
    assert all(r["max_err_out"] < 1e-5 and r["max_err_grads"] < 1e-4 for r in rows)  # fp32: see REL_TOL


def test_gpu_sweep_runs_on_the_cpu(monkeypatch):
    """The GPU bench's code, on the CPU under smoke mode's tiny sizes (bf16, interpreted)."""
    monkeypatch.setenv("LLMLAB_GPU_SMOKE", "1")
    runtime.tier.cache_clear()
    try:
        rows = fa.bench(sizes=(32,))
    finally:
        monkeypatch.delenv("LLMLAB_GPU_SMOKE")
        runtime.tier.cache_clear()
    assert {r["impl"] for r in rows} == {"flash attention forward (triton)", "flash attention backward (triton)"}
    assert all(r["rel_err_out"] < 4 * 2.0**-8 and r["of_sdpa"] > 0 and r["meets"] in ("yes", "no") for r in rows)
