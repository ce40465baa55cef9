"""Learning-rate schedules: linear warmup, then cosine decay to a floor (or a constant LR).

Warmup (Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", §2.2) raises the LR
linearly over the first `warmup` updates, so that Adam's second-moment estimates and the early, large gradients
settle before the full LR applies. Cosine decay (Loshchilov & Hutter 2017, "SGDR: Stochastic Gradient Descent
with Warm Restarts", eq. 5, without the restarts) then lowers it to `min_lr` along half a cosine.

Steps count optimizer updates from 0: update s is taken with `lr(s)`. The material's formula (§6.1)

    base_lr * min(step / warmup, 1)                 # material_warmup_lr: lr(0) = 0

gives update 0 a learning rate of exactly 0, as Hugging Face's `get_linear_schedule_with_warmup` does
(`current_step / max(1, num_warmup_steps)`, transformers' src/transformers/optimization.py): update 0 moves no
weight, while AdamW still folds its gradient into its moments. This module's warmup starts one update later on the
same line,

    base_lr * min((step + 1) / warmup, 1)           # warmup_cosine_lr: lr(0) = base_lr / warmup

so update 0 already moves the weights and update warmup-1 is the first at the full LR, still `warmup` updates of
ramp. Both are linear warmups; they differ by one update of the ramp (and `warmup=0` divides by zero in the
material's formula as written, where Hugging Face's max(1, ·) guards it).

    from llmlab.train.schedule import LRSchedule
    schedule = LRSchedule(base_lr=1e-3, total_steps=200, warmup=20, min_lr=1e-4)   # decay="cosine"
    schedule.lr(0), schedule.lr(19), schedule.lr(199)                               # 5e-05, 1e-3, 1e-4
    torch.optim.lr_scheduler.LambdaLR(opt, schedule)                                # multiplier lr(s)/base_lr

Run the tests: `.venv/bin/pytest tests/test_train_schedule.py`. Claim C16 (warm up over the first steps) is measured
by a sweep of warmup length × peak LR, `llmlab.train.sweep`, in `llmlab.claims.ch06`.
"""

from __future__ import annotations

import math

from llmlab import validation

__all__ = ["DECAYS", "WARMUP_FORMULAS", "warmup_cosine_lr", "material_warmup_lr", "LRSchedule"]

DECAYS = ("cosine", "constant")
WARMUP_FORMULAS = ("shifted", "material")  # (step + 1) / warmup, and the material's step / warmup


def _check(base_lr: float, total_steps: int, warmup: int, min_lr: float) -> None:
    validation.positive("base_lr", base_lr)
    validation.integer("total_steps", total_steps, low=1)
    validation.integer("warmup", warmup, low=0)
    if warmup > total_steps:
        raise ValueError(f"warmup={warmup} must be <= total_steps={total_steps}")
    validation.number("min_lr", min_lr, 0, base_lr, hint="(base_lr is the top)")


def warmup_cosine_lr(step: int, base_lr: float, warmup: int, total_steps: int, min_lr: float = 0.0) -> float:
    """The LR of update `step` (0-based): linear warmup to `base_lr` over updates 0..warmup-1, then half a
    cosine from `base_lr` (update `warmup`) down to `min_lr` (update total_steps-1, the last); `min_lr` after.
    Where no update is left to decay over (warmup >= total_steps - 1) progress is 1: the updates from `warmup` on
    are at `min_lr` (with warmup = total_steps - 1, update `warmup` is the last, and the last is at `min_lr`).

    Warmup uses (step + 1) / warmup, so update 0 already moves the weights (see the module docstring).
    """
    _check(base_lr, total_steps, warmup, min_lr)
    validation.integer("step", step, low=0)
    if step < warmup:
        return base_lr * (step + 1) / warmup
    span = total_steps - 1 - warmup  # updates warmup..total_steps-1 carry the decay
    progress = min((step - warmup) / span, 1.0) if span > 0 else 1.0
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def material_warmup_lr(step: int, base_lr: float, warmup: int) -> float:
    """The material's formula verbatim, `base_lr * min(step / warmup, 1)`: 0 at update 0."""
    _check(base_lr, max(warmup, 1), warmup, 0.0)
    validation.integer("step", step, low=0)
    return base_lr * min(step / warmup, 1.0) if warmup else base_lr


class LRSchedule:
    """A learning rate per update: warmup (`warmup_formula` "shifted" or the material's), then `decay`
    ("cosine" to `min_lr` at the last update, or "constant" at `base_lr`).

    A pure function of the step, so resuming needs only the step; `state_dict()` records the parameters so
    that a resumed run can check it uses the same schedule. Calling it, `schedule(step)`, gives the multiplier
    lr(step) / base_lr that `torch.optim.lr_scheduler.LambdaLR` expects.
    """

    def __init__(self, base_lr: float, total_steps: int, warmup: int = 0, decay: str = "cosine",
                 min_lr: float = 0.0, warmup_formula: str = "shifted"):
        _check(base_lr, total_steps, warmup, min_lr)
        if decay not in DECAYS:
            raise ValueError(f"decay={decay!r}; choose from {DECAYS}")
        if warmup_formula not in WARMUP_FORMULAS:
            raise ValueError(f"warmup_formula={warmup_formula!r}; choose from {WARMUP_FORMULAS}")
        self.base_lr, self.total_steps, self.warmup = float(base_lr), total_steps, warmup
        self.decay, self.min_lr, self.warmup_formula = decay, float(min_lr), warmup_formula

    def lr(self, step: int) -> float:
        """The learning rate of update `step` (0-based)."""
        if self.warmup_formula == "material" and step < self.warmup:
            return material_warmup_lr(step, self.base_lr, self.warmup)
        if self.decay == "constant":
            return self.base_lr * min((step + 1) / self.warmup, 1.0) if self.warmup else self.base_lr
        return warmup_cosine_lr(step, self.base_lr, self.warmup, self.total_steps, self.min_lr)

    def __call__(self, step: int) -> float:
        return self.lr(step) / self.base_lr

    def lrs(self) -> list[float]:
        """lr(s) for every update s of the run (what the chapter plots)."""
        return [self.lr(s) for s in range(self.total_steps)]

    def state_dict(self) -> dict:
        return dict(base_lr=self.base_lr, total_steps=self.total_steps, warmup=self.warmup, decay=self.decay,
                    min_lr=self.min_lr, warmup_formula=self.warmup_formula)

    def __repr__(self) -> str:
        return "LRSchedule(" + ", ".join(f"{k}={v!r}" for k, v in self.state_dict().items()) + ")"
