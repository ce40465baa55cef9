"""Training that does not converge: the four checks of the material's §7.2, each a function.

- **Is the learning rate reasonable?** `lr_range_test` (Smith 2017, "Cyclical Learning Rates for Training Neural
  Networks", §3.3): train a copy of the model for a few steps with the LR growing exponentially, and see where the
  loss stops falling and where it blows up.
- **Do gradients go NaN?** `NonFiniteWatch`: forward hooks on every module find the first one whose inputs are
  finite and whose output is not; backward hooks the first whose output gradient is finite and whose input
  gradient is not (the same idea as `torch.autograd.detect_anomaly`, by module name rather than by op).
- **Is the data right?** `check_targets`: language-model targets are the inputs shifted left by one token.
- **Is the loss right?** `check_loss` feeds a loss function logits whose correct loss is known (uniform: ln V;
  confident and right: ≈ 0); `initial_loss` compares a fresh model's loss with ln V (Karpathy 2019, "A Recipe for
  Training Neural Networks": "verify loss @ init"); `overfit_one_batch` (same recipe) trains on one batch until the
  loss is near zero — a model, loss or loop that cannot do that has a bug, whatever the data.

`loss_fn(model, x, y) -> loss` is how these tools call a model (default: llmlab's GPT, `model(x, y)[1]`).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmlab import validation

__all__ = ["gpt_loss", "NonFinite", "NonFiniteWatch", "LRRangeResult", "lr_range_test", "OverfitResult",
           "overfit_one_batch", "check_targets", "check_loss", "initial_loss"]


def gpt_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of llmlab's GPT on (x, y) (B, T): `model(x, y)[1]`, a scalar."""
    return model(x, y)[1]


def _finite(ts) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts if isinstance(t, torch.Tensor) and t.is_floating_point())


def _tensors(out) -> list:
    return list(out) if isinstance(out, tuple | list) else [out]


@dataclass(frozen=True)
class NonFinite:
    """Where non-finite values first appeared: `phase` "forward" or "backward", the module's name and type."""

    phase: str
    module: str
    kind: str

    def __str__(self) -> str:
        what = "output" if self.phase == "forward" else "input gradient"
        return f"{self.phase}: {self.module} ({self.kind}) made a non-finite {what} from finite inputs"


class NonFiniteWatch:
    """Inside the `with` block, watch every submodule of `model` for NaN/inf. Afterwards `first_forward` and
    `first_backward` are the first culprits (a `NonFinite`, or None), `bad_grads` the parameters whose gradient
    has a non-finite value (call `check_grads()` after backward).

        with NonFiniteWatch(model) as watch:
            loss = model(x, y)[1]; loss.backward()
        watch.first_forward, watch.first_backward, watch.check_grads()

    Forward: a module's output is blamed only when its inputs were finite, so the culprit is the module where
    the NaN was born, not every one it flowed through (a container is blamed when its children all looked fine:
    the op that overflowed is in its own forward). Backward: `register_full_backward_hook` on every module.
    """

    def __init__(self, model: torch.nn.Module, backward: bool = True):
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model, self.backward = model, backward
        self.first_forward: NonFinite | None = None
        self.first_backward: NonFinite | None = None
        self.bad_grads: list[str] = []
        self._handles: list = []

    def _on_forward(self, name: str):
        def hook(module, inputs, output):
            if self.first_forward is None and _finite(inputs) and not _finite(_tensors(output)):
                self.first_forward = NonFinite("forward", name or "(model)", type(module).__name__)
        return hook

    def _on_backward(self, name: str):
        def hook(module, grad_input, grad_output):
            if self.first_backward is None and _finite(grad_output) and not _finite(grad_input):
                self.first_backward = NonFinite("backward", name or "(model)", type(module).__name__)
        return hook

    def __enter__(self) -> NonFiniteWatch:
        # A module whose inputs need no gradient (the embedding of token ids) gets an empty grad_input, and
        # torch warns about it on every backward; for this watch that is expected (nothing to blame there).
        self._quiet = warnings.catch_warnings()
        self._quiet.__enter__()
        warnings.filterwarnings("ignore", "Full backward hook is firing when gradients are computed with respect to "
                                "module outputs", UserWarning)
        for name, module in self.model.named_modules():
            if isinstance(module, torch.nn.ModuleList | torch.nn.ModuleDict):
                continue  # containers never run their own forward
            self._handles.append(module.register_forward_hook(self._on_forward(name)))
            if self.backward:
                self._handles.append(module.register_full_backward_hook(self._on_backward(name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._quiet.__exit__(*exc)

    def check_grads(self) -> list[str]:
        """Names of the parameters whose .grad holds NaN or inf (also kept in `bad_grads`)."""
        self.bad_grads = [n for n, p in self.model.named_parameters() if p.grad is not None and not _finite([p.grad])]
        return self.bad_grads

    @property
    def healthy(self) -> bool:
        return self.first_forward is None and self.first_backward is None and not self.bad_grads


@dataclass(frozen=True)
class LRRangeResult:
    """The LR range test's curve: `lrs[i]` was used for step i, `losses[i]` its smoothed loss."""

    lrs: list[float]
    losses: list[float]
    diverged_at: float | None  # the first LR where the smoothed loss passed `blowup` × its minimum (or NaN)

    @property
    def best_lr(self) -> float:
        """The LR at the smallest smoothed loss."""
        return self.lrs[min(range(len(self.losses)), key=self.losses.__getitem__)]

    @property
    def suggested_lr(self) -> float:
        """A tenth of `best_lr`: at the minimum the loss is about to turn, so a safe peak LR lies an order of
        magnitude below it (the rule of fastai's `lr_find`, after Smith 2017)."""
        return self.best_lr / 10

    def too_high(self, lr: float) -> bool:
        """Is `lr` past the minimum of the curve, where the loss was already climbing back?"""
        return lr > self.best_lr


def lr_range_test(model: torch.nn.Module, batch_fn: Callable[[int], tuple[torch.Tensor, torch.Tensor]], *,
                  lr_min: float = 1e-5, lr_max: float = 10.0, steps: int = 60, loss_fn: Callable = gpt_loss,
                  optimizer: Callable = torch.optim.AdamW, smoothing: float = 0.7, blowup: float = 4.0
                  ) -> LRRangeResult:
    """Smith 2017's LR range test on a copy of `model` (the model itself is left untouched): step i uses
    lr_min·(lr_max/lr_min)^(i/(steps−1)) on batch `batch_fn(i)`, and the loss is smoothed by an exponential
    moving average (factor `smoothing`, bias-corrected) so that one noisy batch does not end the test. It stops
    early once the smoothed loss exceeds `blowup` × its minimum, or is NaN/inf (fastai's `lr_find` uses 4)."""
    validation.positive("lr_min", lr_min)
    validation.number("lr_max", lr_max, above=lr_min, hint="(lr_min)")
    validation.integer("steps", steps, low=2)
    if validation.number("smoothing", smoothing, low=0) >= 1:
        raise ValueError(f"smoothing={smoothing!r} must be in [0, 1)")
    validation.number("blowup", blowup, above=1)
    trial = copy.deepcopy(model).train()
    opt = optimizer(trial.parameters(), lr=lr_min)
    lrs, losses, avg, diverged = [], [], 0.0, None
    for i in range(steps):
        lr = lr_min * (lr_max / lr_min) ** (i / (steps - 1))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        loss = loss_fn(trial, *batch_fn(i))  # scalar
        loss.backward()
        opt.step()
        avg = smoothing * avg + (1 - smoothing) * loss.item()
        smoothed = avg / (1 - smoothing ** (i + 1))
        lrs.append(lr)
        losses.append(smoothed)
        if not math.isfinite(smoothed) or smoothed > blowup * min(losses):
            diverged = lr
            break
    return LRRangeResult(lrs, losses, diverged)


@dataclass(frozen=True)
class OverfitResult:
    losses: list[float]
    target: float

    @property
    def passed(self) -> bool:
        return math.isfinite(self.losses[-1]) and self.losses[-1] <= self.target


def overfit_one_batch(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, steps: int = 150,
                      lr: float = 1e-2, loss_fn: Callable = gpt_loss, target: float | None = None) -> OverfitResult:
    """Train a copy of `model` with AdamW on the one batch (x, y) for `steps` steps: a healthy model and loss
    memorise it, so the loss must fall to `target` (default: a tenth of its first value). If it cannot, the bug
    is in the model, the loss or the update — not in the data or the hyper-parameters."""
    validation.integer("steps", steps, low=1)
    validation.positive("lr", lr)
    trial = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(trial.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(trial, x, y)  # scalar
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return OverfitResult(losses, losses[0] / 10 if target is None else target)


def check_targets(x: torch.Tensor, y: torch.Tensor) -> list[str]:
    """Problems with language-model targets `y` for inputs `x` (both (B, T) token ids), where each row was cut
    from one token stream: y must be x shifted left by one token (y[:, t] = x[:, t+1]). Empty when fine."""
    for name, t in (("x", x), ("y", y)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a (B, T) tensor of token ids")
    if x.shape != y.shape:
        return [f"targets have shape {tuple(y.shape)}, inputs {tuple(x.shape)}"]
    if x.shape[1] < 2:
        raise ValueError(f"x has T={x.shape[1]}: need T >= 2 to tell a shift")
    if torch.equal(y[:, :-1], x[:, 1:]):
        return []
    if torch.equal(y, x):
        return ["targets equal the inputs: not shifted, so the model learns to copy the token it sees"]
    if torch.equal(y[:, 1:], x[:, :-1]):
        return ["targets are shifted the wrong way (y[:, t] = x[:, t-1]): the model predicts the past"]
    return ["targets are not the inputs shifted by one token"]


def check_loss(loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], vocab_size: int = 64,
               rtol: float = 0.01) -> list[str]:
    """Problems with a classification loss `loss(logits (N, V), targets (N,)) -> scalar`, found on inputs whose
    cross-entropy is known: uniform logits must give ln V, logits confident in the right class (margin 30) ≈ 0,
    and the loss must be the mean over positions. `rtol` (1%) is far above float32 rounding (1e-6) and far below
    every mistake named here. Empty when fine."""
    validation.integer("vocab_size", vocab_size, low=2)
    N, V = 8, vocab_size
    targets = torch.randint(0, V, (N,))  # (N,)
    problems = []
    uniform = float(loss(torch.zeros(N, V), targets))
    if abs(uniform / math.log(V) - 1) > rtol:
        ratio = uniform / math.log(V)
        hint = f" — {ratio:.3g}× ln V: summed over positions instead of averaged?" if abs(ratio - N) < 0.5 else ""
        problems.append(f"uniform logits give loss {uniform:.4g}, expected ln V = {math.log(V):.4g}{hint}")
    confident = float(loss(30.0 * torch.nn.functional.one_hot(targets, V).float(), targets))
    if confident > rtol * math.log(V):
        floor = math.log(V - 1 + math.e) - 1  # cross-entropy of softmax probabilities one-hot on the target
        hint = " — softmax applied before cross_entropy (its floor)" if abs(confident - floor) < 0.05 else ""
        problems.append(f"a perfect prediction still gives loss {confident:.4g}, expected ≈ 0{hint}: the loss "
                        "cannot reach zero, so training stalls")
    return problems


def initial_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, vocab_size: int,
                 loss_fn: Callable = gpt_loss) -> tuple[float, float]:
    """(loss of `model` on (x, y) without grad, ln V). A freshly initialised language model predicts nearly
    uniformly, so the two should agree within a few percent; far above means a bad init or a wrong loss."""
    with torch.no_grad():
        return float(loss_fn(model, x, y)), math.log(vocab_size)
