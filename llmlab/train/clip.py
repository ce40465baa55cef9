"""Gradient clipping by global norm, written from scratch (Pascanu, Mikolov & Bengio 2013, "On the difficulty
of training recurrent neural networks", §3.2, algorithm 1).

All gradients together are one vector g; its norm is ‖g‖ = ‖(‖g₁‖, ‖g₂‖, …)‖ — the norm of the per-tensor
norms, for any p-norm (and for p = ∞, the largest of the per-tensor maxima). If ‖g‖ exceeds `max_norm`, every
gradient is multiplied by max_norm / ‖g‖: the direction is kept, the step length bounded. One outlier batch
then moves the weights at most as far as a batch with ‖g‖ = max_norm would.

With a loss scaler the gradients in `.grad` are S times too large until they are unscaled, so clip *after*
unscaling (`llmlab.train.Trainer` does: scale → backward → unscale → clip → step); clipping scaled gradients
would compare S·‖g‖ with max_norm and shrink every step by up to S.

    from llmlab.train.clip import clip_grad_norm
    loss.backward()
    total = clip_grad_norm(model.parameters(), max_norm=1.0)   # the norm before clipping, a 0-d tensor
    optimizer.step()

It equals `torch.nn.utils.clip_grad_norm_` (same formula, same 1e-6 guard in the coefficient), which the tests
check on random shapes and norm types. Run them: `.venv/bin/pytest tests/test_train_clip.py`.
"""

from __future__ import annotations

import math

import torch

from llmlab import claims

__all__ = ["grad_norm", "clip_grad_norm"]

_EPS = 1e-6  # torch's guard: the coefficient is max_norm / (‖g‖ + 1e-6), finite when ‖g‖ = 0


def _grads(parameters) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return [p.grad for p in parameters if p.grad is not None]  # a parameter without a gradient is skipped


def _norm_type(norm_type) -> float:
    value = float(norm_type)  # accepts "inf" like torch
    if math.isnan(value) or value <= 0:
        raise ValueError(f"norm_type={norm_type!r} must be > 0 (2.0, 1.0, float('inf'), …)")
    return value


def grad_norm(parameters, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """The p-norm of all gradients of `parameters` taken as one vector, a 0-d tensor (0 when none has one).

    With `error_if_nonfinite=True` a NaN or infinite norm raises RuntimeError (as torch's option does);
    otherwise it is returned, and clipping by it turns the gradients into NaN (or zeros), as torch's does.
    """
    p = _norm_type(norm_type)
    grads = _grads(parameters)
    if not grads:
        return torch.tensor(0.0)
    device = grads[0].device
    norms = torch.stack([torch.linalg.vector_norm(g, p).to(device) for g in grads])  # (n_tensors,)
    total = torch.linalg.vector_norm(norms, p)  # (): ‖(‖g₁‖, ‖g₂‖, …)‖ = ‖g‖; for p = ∞ the largest maximum
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"the total norm of order {p} of the gradients is {total.item()}, so they cannot be "
                           "clipped; set error_if_nonfinite=False to clip anyway (the result is NaN or 0)")
    return total


def clip_grad_norm(parameters, max_norm: float, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the gradients of `parameters` in place so that their global `norm_type`-norm is at most
    `max_norm`; return the norm they had before (a 0-d tensor, as `torch.nn.utils.clip_grad_norm_` does).

    `parameters` is a tensor or an iterable of tensors; those whose `.grad` is None are skipped.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} must be a number > 0")
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = grad_norm(parameters, norm_type, error_if_nonfinite)
    grads = _grads(parameters)
    coefficient = (max_norm / (total + _EPS)).clamp(max=1.0)  # (): 1 when already within the bound
    for g in grads:
        g.mul_(coefficient.to(g.device))  # torch multiplies by the clamped coefficient, 1 or not
    return total


# --- C17: ours equals torch's, and one spike with and without clipping ------------------------------------------

SPIKE_STEP, SPIKE_FACTOR, SPIKE_STEPS = 10, 1e3, 14  # a batch whose gradient is 1000× too large, at update 10


def _spike_run(max_norm: float | None) -> tuple[float, float, list[float]]:
    """Train the tiny GPT with SGD; at SPIKE_STEP its loss (hence gradient) is multiplied by SPIKE_FACTOR.
    Returns (our clip vs torch's on that spike's gradients: max |difference|, the spike's gradient norm,
    the loss per update)."""
    from llmlab.data import MarkovSource, SyntheticDataset
    from llmlab.model import GPT, GPTConfig

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


@claims.register("C17", chapter=6)
def _claim_clipping() -> claims.Measurement:
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
    return claims.Measurement(
        value={"max |ours − torch|": diff, "spike gradient norm": spike_norm, "loss before the spike": before,
               "loss after, clipped": after_clipped, "loss after, unclipped": after_unclipped},
        unit="", text=(f"our clip_grad_norm equals torch's to {diff:.1g}. A batch with a {SPIKE_FACTOR:g}× gradient "
                       f"(norm {spike_norm:.3g}) at update {SPIKE_STEP} of SGD on the tiny GPT: loss "
                       f"{before:.3f} before; {SPIKE_STEPS - 1 - SPIKE_STEP} updates later {after_clipped:.3f} "
                       f"with max_norm=1.0, {after_unclipped:.3f} without. With a loss scaler, unscale first"),
        device=claims.here(), verdict="holds with conditions" if equal and tamed else "misleading")
