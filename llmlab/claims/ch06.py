"""Chapter 6's claims (§6, tuning), measured: warming up linearly over the first steps (C16), and gradient clipping
by global norm against a spike (C17).

C16 reads `llmlab.train.sweep.warmup_sweep.recent()`, the last sweep of warmup length × peak LR (chapter 6's cell
made it): the cell and this row show the same runs, not a second sweep taken at another moment."""

from __future__ import annotations

import torch

from llmlab.claims import UNDECIDED, Measurement, here, register
from llmlab.data import MarkovSource, SyntheticDataset
from llmlab.model import GPT, GPTConfig
from llmlab.train.clip import clip_grad_norm
from llmlab.train.sweep import warmup_sweep

__all__ = ["warmup", "clipping"]


def _lr(value: float | None) -> str:
    return "none" if value is None else f"{value:.0e}"


@register("C16", chapter=6)
def warmup() -> Measurement:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only adds spinning (tests/conftest.py one_thread)
    try:
        sweep = warmup_sweep.recent()  # what chapter 6's cell showed (measured here if none)
    finally:
        torch.set_num_threads(threads)
    none, warm, differences, direction = sweep.compare_best()
    stable = {w: sweep.highest_stable_lr(w) for w in sweep.warmups}
    lowest = sweep.lrs[0]
    at_lowest = {w: sweep.direction(sweep.effect(w, lowest)) for w in sweep.warmups[1:]}
    helps = sweep.helps()
    return Measurement(
        value={"best loss, no warmup": sweep.mean(*none), "best loss, warmup": sweep.mean(*warm),
               "largest per-seed gain of the warmed-up best": -min(differences),
               "smallest per-seed gain of the warmed-up best": -max(differences),
               "highest stable peak LR, no warmup": stable[0] or 0.0,
               "highest stable peak LR, warmup": max(v or 0.0 for w, v in stable.items() if w)},
        unit="nats/token, LR",
        text=(f"tiny GPT, {sweep.steps} AdamW updates, no clipping; warmup {', '.join(map(str, sweep.warmups))} × "
              f"peak LR {_lr(sweep.lrs[0])}…{_lr(sweep.lrs[-1])}, seeds {len(sweep.seeds)}: the loss stayed down up "
              f"to LR {_lr(stable[0])} without warmup, {' / '.join(_lr(stable[w]) for w in sweep.warmups[1:])} with "
              f"warmup {' / '.join(map(str, sweep.warmups[1:]))}; best loss {sweep.mean(*none):.3f} without "
              f"(LR {_lr(none[1])}), {sweep.mean(*warm):.3f} with (warmup {warm[0]}, LR {_lr(warm[1])}): "
              f"{'lower on every seed' if direction == 'lower' else direction}; at LR {_lr(lowest)} warmup "
              f"{' / '.join(f'{w}: {d}' for w, d in at_lowest.items())}. The ramp's start, LR 0 at update 0 (the "
              f"material's formula, Hugging Face's get_linear_schedule_with_warmup) or lr/warmup (llmlab's), is a "
              f"convention; 500–1000 steps is a length for long runs"),
        device=here(), verdict={True: "holds with conditions", False: "wrong", None: UNDECIDED}[helps])


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
