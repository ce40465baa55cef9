"""Chapter 6's claims (§6, tuning), measured: the material's warmup formula wastes update 0 (C16), and gradient
clipping by global norm against a spike (C17)."""

from __future__ import annotations

import torch

from llmlab.claims import Measurement, here, register
from llmlab.data import MarkovSource, SyntheticDataset
from llmlab.model import GPT, GPTConfig
from llmlab.train.clip import clip_grad_norm
from llmlab.train.trainer import TrainConfig, Trainer

__all__ = ["warmup", "clipping"]


def _c16_run(warmup: int, warmup_formula: str) -> tuple[float, float]:
    """Train the tiny GPT briefly; return (how far update 0 moved the weights, the final loss)."""
    config = TrainConfig.preset("tiny", steps=30, batch_size=8, block_size=16, lr=1e-2, warmup=warmup,
                                warmup_formula=warmup_formula, min_lr=1e-3, seed=0)
    trainer = Trainer(config=config, progress=False)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.step()
    moved = max((p.detach() - b).abs().max().item() for p, b in zip(trainer.model.parameters(), before,
                                                                         strict=True))
    trainer.fit()
    return moved, sum(h["loss"] for h in trainer.history[-5:]) / 5  # mean of the last 5: less batch noise


@register("C16", chapter=6)
def warmup() -> Measurement:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only adds spinning (tests/conftest.py one_thread)
    try:
        runs = {name: _c16_run(steps, formula) for name, steps, formula in
                (("material", 10, "material"), ("shifted", 10, "shifted"), ("none", 0, "shifted"))}
    finally:
        torch.set_num_threads(threads)
    wasted = runs["material"][0] == 0.0 and runs["shifted"][0] > 0.0
    return Measurement(
        value={"update 0 moved weights by (material)": runs["material"][0],
               "update 0 moved weights by (ours)": runs["shifted"][0],
               "final loss, material warmup": runs["material"][1], "final loss, our warmup": runs["shifted"][1],
               "final loss, no warmup": runs["none"][1]},
        unit="max |Δw|, nats",
        text=(f"with base_lr·min(step/warmup, 1) update 0 has LR 0 and moves no weight (max |Δw| = "
              f"{runs['material'][0]:g}); with (step+1)/warmup it moves them by {runs['shifted'][0]:.2g}. "
              f"Tiny GPT, 30 AdamW steps at peak LR 1e-2, warmup 10 then cosine: final loss "
              f"{runs['material'][1]:.3f} (material), {runs['shifted'][1]:.3f} (ours), "
              f"{runs['none'][1]:.3f} without warmup"),
        device=here(), verdict="holds with conditions" if wasted else "holds")


SPIKE_STEP, SPIKE_FACTOR, SPIKE_STEPS = 10, 1e3, 14  # a batch whose gradient is 1000× too large, at update 10


def _spike_run(max_norm: float | None) -> tuple[float, float, list[float]]:
    """Train the tiny GPT with SGD; at SPIKE_STEP its loss (hence gradient) is multiplied by SPIKE_FACTOR.
    Returns (our clip vs torch's on that spike's gradients: max |difference|, the spike's gradient norm,
    the loss per update)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", block_size=16))
    data = SyntheticDataset(MarkovSource(64, seed=0), batch_size=8, block_size=16, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, diff, spike_norm = [], 0.0, 0.0
    for step in range(SPIKE_STEPS):
        loss = model(*data.next_batch())[1]
        losses.append(loss.item())
        (loss * (SPIKE_FACTOR if step == SPIKE_STEP else 1.0)).backward()
        if step == SPIKE_STEP:
            copies = [p.grad.clone() for p in model.parameters()]
            theirs = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
            for t, g in zip(theirs, copies, strict=True):
                t.grad = g
            spike_norm = torch.nn.utils.clip_grad_norm_(theirs, max_norm or 1.0).item()
            ours = clip_grad_norm(model.parameters(), max_norm or 1.0)
            diff = max([abs(ours.item() - spike_norm)] + [(p.grad - t.grad).abs().max().item()
                                                           for p, t in zip(model.parameters(), theirs, strict=True)])
            if max_norm is None:  # the unclipped run keeps the spike's gradient
                for p, g in zip(model.parameters(), copies, strict=True):
                    p.grad = g
        elif max_norm is not None:
            clip_grad_norm(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return diff, spike_norm, losses


@register("C17", chapter=6)
def clipping() -> Measurement:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only adds spinning (tests/conftest.py one_thread)
    try:
        diff, spike_norm, clipped = _spike_run(1.0)
        _, _, unclipped = _spike_run(None)
    finally:
        torch.set_num_threads(threads)
    before, after_clipped, after_unclipped = clipped[SPIKE_STEP], clipped[-1], unclipped[-1]
    # fp32: the same formula as torch's, so the two agree to rounding of the per-tensor norms (≤ a few ulp).
    equal = diff <= 1e-6 * max(spike_norm, 1.0)
    tamed = after_clipped < after_unclipped
    return Measurement(
        value={"max |ours − torch|": diff, "spike gradient norm": spike_norm, "loss before the spike": before,
               "loss after, clipped": after_clipped, "loss after, unclipped": after_unclipped},
        unit="", text=(f"our clip_grad_norm equals torch's to {diff:.1g}. A batch with a {SPIKE_FACTOR:g}× gradient "
                       f"(norm {spike_norm:.3g}) at update {SPIKE_STEP} of SGD on the tiny GPT: loss "
                       f"{before:.3f} before; {SPIKE_STEPS - 1 - SPIKE_STEP} updates later {after_clipped:.3f} "
                       f"with max_norm=1.0, {after_unclipped:.3f} without. With a loss scaler, unscale first"),
        device=here(), verdict="holds with conditions" if equal and tamed else "misleading")
