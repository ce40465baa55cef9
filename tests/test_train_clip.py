"""clip_grad_norm from scratch equals torch.nn.utils.clip_grad_norm_ on random shapes and norm types."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmlab.train.clip import clip_grad_norm, grad_norm


def _params(shapes, scale, seed, with_none):
    g = torch.Generator().manual_seed(seed)
    params = []
    for i, shape in enumerate(shapes):
        p = torch.nn.Parameter(torch.zeros(shape))
        if not (with_none and i == 0):
            p.grad = torch.randn(shape, generator=g) * scale  # shape
        params.append(p)
    return params


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=5),
       norm_type=st.sampled_from([1.0, 2.0, 3.0, 0.5, math.inf]), max_norm=st.floats(0.01, 10.0),
       scale=st.sampled_from([1e-3, 1.0, 100.0]), seed=st.integers(0, 1000), with_none=st.booleans())
def test_equals_torch(shapes, norm_type, max_norm, scale, seed, with_none):
    ours, theirs = _params(shapes, scale, seed, with_none), _params(shapes, scale, seed, with_none)
    n_ours = clip_grad_norm(ours, max_norm, norm_type)
    n_theirs = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type, foreach=False)
    # The same formula as torch's per-tensor path: identical up to a last-bit difference in fp32 (rtol 1e-6).
    torch.testing.assert_close(n_ours, n_theirs, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs, strict=True):
        if b.grad is None:
            assert a.grad is None
        else:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-12)


def test_bounds_norm_and_edge_cases():
    params = _params([(3, 4), (5,)], 10.0, 0, False)
    before = clip_grad_norm(params, 1.0)
    assert before > 1.0
    assert grad_norm(params).item() == pytest.approx(1.0, rel=1e-5)  # 1e-6 guard in the coefficient
    assert clip_grad_norm([torch.nn.Parameter(torch.zeros(2))], 1.0).item() == 0.0  # no gradients at all
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="max_norm"):
            clip_grad_norm(params, bad)
    with pytest.raises(ValueError, match="norm_type"):
        clip_grad_norm(params, 1.0, norm_type=0)


def test_nonfinite_like_torch():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, float("nan"), 2.0])
    with pytest.raises(RuntimeError, match="error_if_nonfinite"):
        clip_grad_norm([p], 1.0, error_if_nonfinite=True)
    q = torch.nn.Parameter(torch.zeros(3))
    q.grad = p.grad.clone()
    assert clip_grad_norm([p], 1.0).isnan() and torch.nn.utils.clip_grad_norm_([q], 1.0).isnan()
    torch.testing.assert_close(p.grad, q.grad, equal_nan=True)
