"""llmlab.diagnose.divergence: each check catches its fault and stays quiet on a healthy run."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from llmlab.data import MarkovSource, SyntheticDataset
from llmlab.diagnose import divergence as dv
from llmlab.model import GPT, GPTConfig

warnings.filterwarnings("ignore", message="Full backward hook is firing")  # the root GPT's inputs are token ids


@pytest.fixture
def setup(one_thread):
    torch.manual_seed(0)
    config = GPTConfig.preset("tiny")
    data = SyntheticDataset(MarkovSource(config.vocab_size, seed=0), batch_size=8, block_size=32)
    return GPT(config), data


def test_nonfinite_watch_finds_overflowing_attention(setup):
    model, data = setup
    x, y = data.get_batch(0)
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.weight.mul_(1e4)  # q·kᵀ overflows fp16's 65504
    model = model.half()
    with dv.NonFiniteWatch(model) as watch:
        model(x, y)[1].backward()
    assert watch.first_forward.module == "transformer.h.1.attn"
    assert watch.check_grads() and not watch.healthy


def test_nonfinite_watch_finds_backward_only_nan():
    class Norm(torch.nn.Module):
        def forward(self, x):
            return (x * x).sum(-1).sqrt()  # (2,) finite at 0; its gradient 0.5/√0 · 0 = inf · 0 is NaN

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), Norm())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    with dv.NonFiniteWatch(model) as watch:
        model(torch.randn(2, 3, requires_grad=True)).sum().backward()
    assert watch.first_forward is None
    assert watch.first_backward.module == "1"


def test_nonfinite_watch_quiet_when_healthy(setup):
    model, data = setup
    with dv.NonFiniteWatch(model) as watch:
        model(*data.get_batch(0))[1].backward()
    assert watch.healthy and watch.check_grads() == []


def test_lr_range_test(setup):
    model, data = setup
    before = [p.clone() for p in model.parameters()]
    r = dv.lr_range_test(model, data.get_batch, steps=40)
    assert r.diverged_at is not None and r.best_lr < r.diverged_at  # AdamW on the tiny GPT blows up near lr≈1
    assert r.too_high(1.0) and not r.too_high(r.suggested_lr)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # a copy was trained


def test_overfit_one_batch(setup):
    model, data = setup
    x, y = data.get_batch(0)
    assert dv.overfit_one_batch(model, x[:4], y[:4], steps=100).passed

    def softmax_first(m, x, y):  # the planted bug: probabilities fed to cross_entropy
        logits = m(x)[0]
        return F.cross_entropy(F.softmax(logits, -1).flatten(0, 1), y.flatten())

    assert not dv.overfit_one_batch(model, x[:4], y[:4], steps=100, loss_fn=softmax_first).passed


def test_check_targets(setup):
    _, data = setup
    x, y = data.get_batch(0)
    assert dv.check_targets(x, y) == []
    assert "not shifted" in dv.check_targets(x, x)[0]
    wrong = torch.roll(x, 1, dims=1)
    assert "wrong way" in dv.check_targets(x, wrong)[0]
    with pytest.raises(ValueError, match="x"):
        dv.check_targets(x[0], y)


def test_check_loss():
    assert dv.check_loss(F.cross_entropy) == []
    assert dv.check_loss(lambda z, t: F.cross_entropy(F.log_softmax(z, -1), t)) == []  # log_softmax is idempotent
    assert "softmax applied before" in dv.check_loss(lambda z, t: F.cross_entropy(F.softmax(z, -1), t))[0]
    assert "summed" in dv.check_loss(lambda z, t: F.cross_entropy(z, t, reduction="sum"))[0]
    with pytest.raises(ValueError, match="vocab_size"):
        dv.check_loss(F.cross_entropy, vocab_size=1)


def test_initial_loss_near_ln_v(setup):
    model, data = setup
    loss, ln_v = dv.initial_loss(model, *data.get_batch(0), vocab_size=64)
    assert abs(loss / ln_v - 1) < 0.05  # GPT-2 init (std 0.02) gives near-uniform logits: within 5% of ln V
