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
check on random shapes and norm types. Run them: `.venv/bin/pytest tests/test_train_clip.py`. Claim C17 (clipping
against explosion) is measured in `llmlab.claims.ch06`.
"""

from __future__ import annotations

import math

import torch

from llmlab import validation

__all__ = ["grad_norm", "clip_grad_norm", "scale_to_norm"]

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
    validation.positive("max_norm", max_norm)
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = grad_norm(parameters, norm_type, error_if_nonfinite)
    scale_to_norm(_grads(parameters), total, max_norm)
    return total


def scale_to_norm(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Clip `grads` whose global norm `total` (a 0-d tensor) is already known — e.g. summed over the shards of
    many ranks: multiply each in place by min(1, max_norm / (total + 1e-6)), as `clip_grad_norm` does."""
    validation.number("max_norm", max_norm, above=0)
    coefficient = (max_norm / (total + _EPS)).clamp(max=1.0)  # (): 1 when already within the bound
    for g in grads:
        g.mul_(coefficient.to(g.device))  # torch multiplies by the clamped coefficient, 1 or not
