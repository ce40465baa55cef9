"""FLOP counts against hand counts and against PyTorch's own FLOP counter on the real model."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from llmlab import flops
from llmlab.model import GPT, GPTConfig


def test_hand_count_of_one_block():
    cfg = GPTConfig.preset("tiny", n_layer=1, vocab_size=10, block_size=8, n_embd=16, n_head=2)
    B, T, C, V = 3, 8, 16, 10
    hand = (2 * B * T * C * 3 * C  # qkv
            + 2 * B * 2 * T * T * (C // 2)  # scores, 2 heads of 8
            + 2 * B * 2 * T * (C // 2) * T  # p @ v
            + 2 * B * T * C * C  # output projection
            + 2 * B * T * C * 4 * C * 2  # mlp up and down
            + 2 * B * T * C * V)  # lm head
    assert flops.forward_flops(cfg, B, T) == hand
    assert flops.training_step_flops(cfg, B, T) == 3 * hand
    assert flops.training_step_flops(cfg, B, T, recompute=True) == 4 * hand
    for name in ("none", "selective", 1):  # GPTConfig.recompute's names are not this switch: refused, not counted 4×
        with pytest.raises(ValueError, match="recompute="):
            flops.training_step_flops(cfg, B, T, recompute=name)


@pytest.mark.parametrize("preset,B,T", [("tiny", 2, 64), ("mini", 1, 37)])
def test_counts_equal_pytorch_flop_counter(preset, B, T):
    """Forward and backward FLOPs of the real model, counted by torch's dispatcher, match ours exactly."""
    model = GPT(GPTConfig.preset(preset))
    idx = torch.randint(0, model.config.vocab_size, (B, T))
    with FlopCounterMode(display=False) as fwd:
        logits, _ = model(idx)
    assert fwd.get_total_flops() == flops.forward_flops(model.config, B, T)
    with FlopCounterMode(display=False) as step:
        _, loss = model(idx, idx)
        loss.backward()
    # both operands of every matmul need a gradient (each is a parameter or an activation computed from
    # the embeddings), so backward does dX and dW for each: exactly 2x the forward, 3x in all
    assert step.get_total_flops() == flops.training_step_flops(model.config, B, T)


def test_six_nd_and_the_gpt3_claim():
    assert flops.training_flops(175e9, 300e9) == pytest.approx(3.15e23)
    # GPT-3 paper: 3.14e23 FLOPs; 1000 A100s (312 TFLOP/s bf16 dense) for 34 days needs 34% MFU
    assert flops.implied_mfu(3.14e23, gpus=1000, days=34, peak_flops=312e12) == pytest.approx(0.3426, abs=1e-3)
    days = flops.training_days(3.14e23, gpus=1000, peak_flops=312e12, mfu=0.3426)
    assert days == pytest.approx(34, rel=1e-3)


def test_six_nd_misses_the_attention_terms():
    cfg = GPTConfig.preset("gpt2")
    T = cfg.block_size
    per_token = flops.training_step_flops(cfg, 1, T) / T
    n = cfg.n_layer * 12 * cfg.n_embd**2 + cfg.n_embd * cfg.vocab_size  # weight matmuls' parameters
    attention = 3 * cfg.n_layer * 4 * T * cfg.n_embd  # scores + weighted sum, forward and backward
    assert per_token == 6 * n + attention


@pytest.mark.parametrize("call,match", [
    (lambda: flops.training_flops(0, 1e9), "n_params=0"),
    (lambda: flops.training_days(1e20, gpus=8, peak_flops=1e15, mfu=1.5), "mfu=1.5"),
    (lambda: flops.training_days(1e20, gpus=-1, peak_flops=1e15, mfu=0.5), "gpus=-1"),
    (lambda: flops.implied_mfu(1e20, gpus=8, days=0, peak_flops=1e15), "days=0"),
    (lambda: flops.forward_flops(GPTConfig.preset("tiny"), 0), "batch_size=0"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
