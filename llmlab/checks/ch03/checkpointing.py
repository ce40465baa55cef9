"""Exercise 3.2's check: activation checkpointing from scratch, run here on the CPU.

The learner's `checkpoint(block, x)` runs on blocks of the chapter's GPT (`llmlab.model`) with dropout on and fresh
random sizes. It must give *bit-identical* outputs and gradients to the plain run, save fewer bytes for backward
(counted by `llmlab.memory.measure.SavedActivations`) — about what `llmlab.memory.checkpoint` keeps — and leave the
random stream where the plain run leaves it.
"""

from __future__ import annotations

import torch

from llmlab.checks import Hint, Mismatch, assert_close, check, fresh_rng
from llmlab.memory import checkpoint as library
from llmlab.memory import measure
from llmlab.model import Block, GPTConfig


def _blocks(config, n: int, seed: int):
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    blocks = [Block(config) for _ in range(n)]  # training mode: dropout on
    torch.set_rng_state(state)
    return blocks


def _run_blocks(blocks, x0, coeff, seed: int, using):
    """Forward the blocks (each through `using(block, x)`, or plainly) from a fresh leaf copy of x0, backward
    Σ coeff·y; returns what the check compares."""

    for b in blocks:
        b.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    torch.manual_seed(seed)
    with measure.SavedActivations() as saved:
        h = x
        for b in blocks:
            h = b(h) if using is None else using(b, h)
    if not isinstance(h, torch.Tensor):
        raise Mismatch(f"checkpoint(block, x) returned {type(h).__name__}, expected the block's output tensor")
    connected = h.requires_grad
    if connected:
        (h * coeff).sum().backward()
    return {"y": h.detach(), "x_grad": x.grad, "grads": [p.grad for b in blocks for p in b.parameters()],
            "names": [f"block {i}'s {n}" for i, b in enumerate(blocks) for n, _ in b.named_parameters()],
            "saved": saved.bytes, "rng_after": torch.get_rng_state(), "connected": connected}


def _same(a, b) -> bool:
    return a is not None and b is not None and a.shape == b.shape and torch.equal(a, b)


@check("3.2", "activation checkpointing", hint=Hint(
    nudge="compare what your forward keeps with what your backward needs to run fn again: the input, fn, and the "
          "random state",
    idea="the forward keeps only the input (and fn and the RNG state) and runs fn without a graph; the backward "
         "runs fn again with grad on, from the same random state, and backpropagates through that recomputation",
    formula="in forward (an autograd.Function's forward runs with grad off, so nothing inside fn is saved): keep "
            "ctx.fn = fn, ctx.rng = torch.get_rng_state() (before fn draws its dropout masks), "
            "ctx.save_for_backward(x), return fn(x); in backward: x = saved x .detach().requires_grad_(); inside "
            "`with torch.random.fork_rng(), torch.enable_grad():` restore torch.set_rng_state(ctx.rng) and run "
            "out = ctx.fn(x); then torch.autograd.backward(out, grad_out) (which also fills the parameters' "
            ".grad) and return None, x.grad"))
def checkpoint(fn):
    """`fn(block, x)` → block(x), keeping only x (and the random state) for backward and recomputing block(x) in
    backward; x is (B, T, C) and requires grad."""

    rng = fresh_rng()
    # T = 1 and a single block; then sizes where one block's input (≥ 16 KB) is far more than the slack below
    for n_blocks, B, T, p in ((1, 1, 1, 0.5), (3, rng.randint(2, 3), rng.choice([33, 47]), 0.2),
                              (2, rng.randint(2, 4), 64, 0.1)):
        config = GPTConfig.preset("tiny", dropout=p)
        seeds = rng.randrange(2**31), rng.randrange(2**31)
        blocks = _blocks(config, n_blocks, seeds[0])
        gen = torch.Generator().manual_seed(seeds[1])
        x0 = torch.randn(B, T, config.n_embd, generator=gen)  # (B, T, C)
        coeff = torch.randn(B, T, config.n_embd, generator=gen)  # the loss is Σ coeff·y
        where = f"{n_blocks} GPT block{'s' * (n_blocks > 1)} (dropout {p:g}) on x of shape {(B, T, config.n_embd)}"
        plain = _run_blocks(blocks, x0, coeff, seeds[1], None)
        ours = _run_blocks(blocks, x0, coeff, seeds[1], library.checkpoint)
        got = _run_blocks(blocks, x0, coeff, seeds[1], fn)
        if not _same(got["y"], plain["y"]):
            assert_close(got["y"], plain["y"], what=f"{where}: the output of checkpoint(block, x)", rtol=0, atol=0)
            raise Mismatch(f"{where}: the output differs from block(x) in its bits")
        if not got["connected"]:
            raise Mismatch(f"{where}: the output does not require grad, so no backward can run: return "
                           "Checkpoint.apply(fn, x) (an autograd.Function), not fn(x) under torch.no_grad()")
        if got["x_grad"] is None:
            raise Mismatch(f"{where}: x.grad is None: backward must return the gradient with respect to x "
                           "(None for fn, then x.grad of the recomputed graph)")
        missing = [name for name, g in zip(got["names"], got["grads"], strict=True) if g is None]
        if missing:
            raise Mismatch(f"{where}: {missing[0]} got no gradient: backprop the recomputed output with "
                           "torch.autograd.backward(out, grad_out), which fills the parameters' .grad (torch.autograd"
                           ".grad with respect to x alone does not)")
        pairs = [("dL/dx", got["x_grad"], plain["x_grad"])] + list(zip(got["names"], got["grads"], plain["grads"],
                                                                        strict=True))
        differ = [name for name, a, b in pairs if not _same(a, b)]
        if differ:
            for b in blocks:
                b.eval()  # dropout off: does the answer hold then?
            calm = [_run_blocks(blocks, x0, coeff, seeds[1], u) for u in (None, fn)]
            for b in blocks:
                b.train()
            if all(_same(a, b) for a, b in zip([calm[1]["x_grad"], *calm[1]["grads"]],
                                               [calm[0]["x_grad"], *calm[0]["grads"]], strict=True)):
                raise Mismatch(f"{where}: the gradients of {', '.join(differ[:3])}{' …' * (len(differ) > 3)} differ "
                               "from the plain run's, and with dropout off they are equal: gradients differ only "
                               "where dropout is on — the recompute draws new dropout masks; save "
                               "torch.get_rng_state() in forward and restore it before recomputing")
            name, a, b = next((name, a, b) for name, a, b in pairs if not _same(a, b))
            assert_close(a, b, what=f"{where}: {name}", rtol=0, atol=0)
            raise Mismatch(f"{where}: {name} differs from the plain run's in its bits")
        if not torch.equal(got["rng_after"], plain["rng_after"]):
            raise Mismatch(f"{where}: after backward the random generator is not where the plain run leaves it: the "
                           "recompute rewound it (torch.set_rng_state) and left it there, so the next dropout masks "
                           "would repeat old ones; recompute inside `with torch.random.fork_rng():`, which puts the "
                           "state back when it ends")
        slack = n_blocks * 6144  # a segment may keep a little more than its input (the 5 KB CPU RNG state, say)
        if got["saved"] >= plain["saved"] or got["saved"] > ours["saved"] + slack:
            raise Mismatch(f"{where}: your checkpointed blocks saved {got['saved']:,} bytes for backward; keeping "
                           f"only each block's input takes {ours['saved']:,}, the plain run saves {plain['saved']:,}: "
                           "save only x in forward (ctx.save_for_backward(x)) and run fn without recording a graph "
                           "(an autograd.Function's forward already does)")

