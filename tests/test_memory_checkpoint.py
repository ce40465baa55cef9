"""Tests for llmlab.memory.checkpoint: exact gradients (dropout and autocast included), saved bytes vs the
number of segments as Chen et al. count them, and agreement with torch.utils.checkpoint."""

import contextlib
import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import checkpoint_sequential as torch_checkpoint_sequential

from llmlab.memory import measure
from llmlab.memory.checkpoint import (
    STEP_NAMES,
    StepTimes,
    bench_every_block,
    checkpoint,
    checkpoint_sequential,
    checkpointed,
    segment_sweep,
    step_times,
)
from llmlab.model import GPT, GPTConfig
from llmlab.timing import Load, Rounds, Timing

TORCH_NON_REENTRANT = functools.partial(torch_checkpoint, use_reentrant=False)


def gpt_run(using=None, autocast=False, dropout=0.1):
    """Loss, parameter gradients, saved bytes and the next random number of one seeded training step of a
    tiny GPT with dropout, every block under `using` (None: no checkpointing)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", dropout=dropout, n_layer=3))
    idx, targets = torch.randint(0, 64, (4, 32)), torch.randint(0, 64, (4, 32))
    torch.manual_seed(1)  # the dropout masks are drawn from here
    with checkpointed(model.transformer.h, using) if using else contextlib.nullcontext(), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), measure.SavedActivations() as saved:
        loss = model(idx, targets)[1]
    loss.backward()  # outside the checkpointed block: the recompute still runs the original forward
    return loss, {n: p.grad for n, p in model.named_parameters()}, saved.bytes, torch.rand(1)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_gradients_equal_the_uncheckpointed_run_bit_for_bit(one_thread, autocast):
    """Dropout draws its masks again in the recompute: with the RNG state restored they are the same masks,
    and under autocast the recompute runs in bf16 again, so every gradient is identical, not just close.
    The RNG stream after backward is unchanged (fork_rng), so training continues as without checkpointing."""
    loss, grads, plain_bytes, after = gpt_run(autocast=autocast)
    loss_c, grads_c, ckpt_bytes, after_c = gpt_run(checkpoint, autocast=autocast)
    assert torch.equal(loss, loss_c)
    for name, g in grads.items():
        assert torch.equal(g, grads_c[name]), name
    assert torch.equal(after, after_c)
    assert ckpt_bytes < plain_bytes / 4


def test_same_gradients_and_saved_bytes_as_torch_checkpoint(one_thread):
    """Each checkpointed block keeps its input I = B·T·C fp32 instead of its activations A, so the saving is
    3·(A - I) for 3 blocks, A measured on one block alone (dropout masks included)."""
    _, _, plain, _ = gpt_run()
    _, grads, ours, _ = gpt_run(checkpoint)
    _, grads_t, theirs, _ = gpt_run(TORCH_NON_REENTRANT)
    for name, g in grads.items():
        assert torch.equal(g, grads_t[name]), name
    assert ours == theirs
    block = GPT(GPTConfig.preset("tiny", dropout=0.1)).transformer.h[0]
    x = torch.randn(4, 32, 64, requires_grad=True)  # (B, T, C)
    _, per_block = measure.saved_activation_bytes(block, x)
    assert plain - ours == 3 * (per_block - measure.tensor_bytes(x))


def test_saved_bytes_fall_with_segments_as_chen_et_al_count(one_thread):
    """checkpoint_sequential of n = 8 blocks in k segments keeps (k - 1) segment inputs + the last segment's
    n/k blocks' activations; measured equals that count exactly (all blocks save the same bytes)."""
    rows = segment_sweep(segments=(1, 2, 4, 8), n_layer=8, batch_size=2)
    for r in rows:
        assert r["saved_bytes"] == r["predicted_bytes"], r
    saved = [r["saved_bytes"] for r in rows]
    assert saved == sorted(saved, reverse=True)
    assert saved[-1] < saved[0] / 4


def test_checkpoint_sequential_matches_torch(one_thread):
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)])
    x = torch.randn(5, 16, requires_grad=True)
    results = []
    for run in (lambda: layers(x), lambda: checkpoint_sequential(layers, 3, x),
                lambda: torch_checkpoint_sequential(layers, 3, x, use_reentrant=False)):
        layers.zero_grad()
        x.grad = None
        out, nbytes = measure.saved_activation_bytes(run)
        out.sum().backward()
        results.append((nbytes, [p.grad.clone() for p in layers.parameters()], x.grad.clone()))
    (plain, g0, x0), (ours, g1, x1), (theirs, g2, x2) = results
    assert ours == theirs < plain
    assert torch.equal(x0, x1) and torch.equal(x1, x2)
    assert all(torch.equal(a, b) and torch.equal(b, c) for a, b, c in zip(g0, g1, g2, strict=True))


def test_segments_one_is_the_plain_run_and_bad_segments_are_refused():
    layers = [nn.Linear(4, 4) for _ in range(3)]
    x = torch.randn(2, 4, requires_grad=True)
    _, plain = measure.saved_activation_bytes(lambda: layers[2](layers[1](layers[0](x))))
    _, one = measure.saved_activation_bytes(checkpoint_sequential, layers, 1, x)
    assert one == plain
    for bad in (0, 4, True, 1.5):
        with pytest.raises(ValueError, match=rf"segments={bad!r} must be an int in \[1, 3\] \(at most one segment"):
            checkpoint_sequential(layers, bad, x)
    with pytest.raises(ValueError, match="modules is empty"):
        checkpoint_sequential([], 1, x)


def test_several_inputs_and_outputs_non_tensor_args_and_inputs_without_grad(one_thread):
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)

    def fn(a, b, scale):
        return lin(a) * scale, (a * b).sin()

    a = torch.randn(4, 3)  # no grad needed: the parameters inside must still get theirs
    b = torch.randn(4, 3, requires_grad=True)
    grads = []
    for run in (fn, functools.partial(checkpoint, fn)):
        lin.zero_grad()
        b.grad = None
        y, z = run(a, b, 2.0)
        (y.sum() + z.sum()).backward()
        grads.append((lin.weight.grad.clone(), b.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_without_grad_it_is_a_plain_call():
    lin = nn.Linear(3, 3)
    with torch.no_grad():
        y = checkpoint(lin, torch.randn(2, 3))
    assert y.grad_fn is None


def test_checkpointed_restores_the_modules_forward():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    own = functools.partial(nn.Linear.forward, b)  # b already has an instance-level forward
    b.forward = own
    with checkpointed([a, b]):
        assert isinstance(a.forward, functools.partial) and b.forward is not own
    assert "forward" not in a.__dict__ and b.forward is own


def test_bench_every_block_times_and_counts_against_both_peers(one_thread):
    rows = bench_every_block("tiny", 2)
    assert [r["peer"] for r in rows] == ["no checkpointing", "torch.utils.checkpoint"]
    assert rows[0]["saved_MB"] < rows[0]["peer_saved_MB"]  # only each block's input is kept
    assert rows[1]["saved_MB"] == rows[1]["peer_saved_MB"]  # torch's checkpoint keeps the same inputs
    assert all(r["ratio"] > 0 and r["spread"] >= 0 and r["load"] for r in rows)
    assert 0 < rows[0]["forward_share"] and rows[0]["forward_share_spread"] >= 0
    first = step_times.recent("tiny", 2)
    assert step_times.recent("tiny", 2) is first  # the chapter's measurement is what claim C9 shows
    assert step_times("tiny", 2) is not first  # a re-run cell measures afresh


def test_step_times_ratios_are_of_the_same_rounds():
    load = Load(1.0, 2)
    samples = ((10.0, 20.0), (13.0, 30.0), (14.0, 32.0), (3.0, 8.0))  # seconds of two rounds, STEP_NAMES' order
    rounds = Rounds({name: Timing(s, 1, load) for name, s in zip(STEP_NAMES, samples, strict=True)}, load)
    t = StepTimes("tiny", rounds, {})
    assert t.overhead.ratios == (1.3, 1.5) and t.forward_share.ratios == (0.3, 0.4)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="fn must be callable"):
        checkpoint(3, torch.ones(1))
    with pytest.raises(ValueError, match="modules must be torch.nn.Module"):
        with checkpointed([lambda x: x]):
            pass
    with pytest.raises(ValueError, match="using must be a checkpoint function"):
        with checkpointed([nn.Linear(1, 1)], using="yes"):
            pass
