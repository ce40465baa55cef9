"""LoRA: fine-tune a frozen model by training a low-rank update of some of its weight matrices.

Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models" (arXiv:2106.09685), eq. (3): a frozen
weight W₀ (out × in) gets an update ΔW = BA of rank r, with B (out × r) and A (r × in), r ≪ min(in, out):

    h = W₀x + ΔWx = W₀x + BAx        (scaled by α/r: h = W₀x + (α/r)·BAx)

Only A and B are trained: r·(in + out) numbers instead of in·out, and so that much less gradient and
optimizer state. After training, BA folds into W₀ (`merge`), so inference costs nothing extra.

Initialisation is what makes it work. The paper takes A random (Gaussian; the reference implementation,
loralib, uses nn.Linear's Kaiming-uniform) and B = 0, so ΔW = 0 at the start (the model is exactly the
pretrained one) while gradients still flow. With u = Ax and g = dL/dh:

    dL/dB = (α/r) · g uᵀ = (α/r) · g (Ax)ᵀ          dL/dA = (α/r) · Bᵀ g xᵀ

At step 0, B = 0 makes dL/dA = 0, but A ≠ 0 makes dL/dB ≠ 0: B moves first, then A follows. With BOTH
zero — the course text's snippet, `torch.zeros` for A and B — Ax = 0 and Bᵀg = 0, so both gradients are
exactly zero on every step, the optimizer never moves them, and the model never learns anything.

    from llmlab.lora import apply_lora, trainable_parameters
    names = apply_lora(model, targets=("attn.c_attn", "attn.c_proj"), r=8, alpha=8)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-3)

`step_times()` times a forward + backward of the tiny GPT with LoRA against full fine-tuning. Claim C19 (≈90%
saved; the snippet's all-zero A and B) is measured in `llmlab.claims.ch08`.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn

from llmlab import timing, validation
from llmlab.data import MarkovSource, SyntheticDataset
from llmlab.model import GPT, GPTConfig

__all__ = ["LoRALinear", "apply_lora", "trainable_parameters", "lora_state_dict", "step_times"]


class LoRALinear(nn.Module):
    """`base(x) + (α/r) · dropout(x) Aᵀ Bᵀ`: a frozen nn.Linear plus a trainable rank-r update (eq. 3).

    `base`'s weight and bias are frozen in place (requires_grad=False); A (r, in) is Kaiming-uniform as in
    loralib, B (out, r) is zero. Dropout acts on the LoRA path's input only, as in loralib.
    """

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise ValueError(f"base must be an nn.Linear, got {type(base).__name__}")
        out_features, in_features = base.weight.shape
        validation.integer("r", r, 1, min(in_features, out_features),
                           hint=f"(min(in, out) for a {in_features} -> {out_features} Linear)")
        validation.positive("alpha", alpha)
        if validation.number("dropout", dropout, low=0) >= 1:
            raise ValueError(f"dropout={dropout!r} must be in [0, 1)")
        self.base = base.requires_grad_(False)
        self.in_features, self.out_features, self.r, self.alpha = in_features, out_features, r, float(alpha)
        self.scale = self.alpha / r
        like = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(r, in_features, **like))  # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(out_features, r, **like))  # (out, r): ΔW = BA = 0 at start
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # loralib's choice: nn.Linear's own init
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False

    @classmethod
    def from_linear(cls, linear: nn.Linear, r: int, alpha: float, dropout: float = 0.0) -> LoRALinear:
        """The same as `LoRALinear(linear, r, alpha, dropout)` (the name the chapter's exercises use)."""
        return cls(linear, r, alpha, dropout)

    def delta_weight(self) -> torch.Tensor:
        """ΔW = (α/r) · B A, the (out, in) matrix the LoRA path adds to the frozen weight."""
        return (self.lora_B @ self.lora_A) * self.scale  # (out, r) @ (r, in) -> (out, in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.base(x)  # (..., out): W₀x + b, frozen
        if self.merged:
            return h  # ΔW is inside base.weight now
        u = self.dropout(x) @ self.lora_A.T  # (..., in) @ (in, r) -> (..., r): Ax, only r numbers per token
        return h + (u @ self.lora_B.T) * self.scale  # (..., r) @ (r, out) -> (..., out)

    @torch.no_grad()
    def merge(self) -> None:
        """Fold ΔW into the frozen weight, W ← W₀ + (α/r)·BA, for inference at a plain Linear's cost.

        While merged, forward skips the LoRA path, and A and B get no gradients: unmerge before training on.
        """
        if self.merged:
            raise RuntimeError("merge(): this LoRALinear is already merged")
        self.base.weight += self.delta_weight()
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo `merge`: W ← W − (α/r)·BA. Exact only up to float rounding: (W₀ + ΔW) − ΔW rounds twice, so
        an element can differ from W₀ by up to one unit in the last place of |W₀ + ΔW|."""
        if not self.merged:
            raise RuntimeError("unmerge(): this LoRALinear is not merged")
        self.base.weight -= self.delta_weight()
        self.merged = False

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.r}, alpha={self.alpha:g}, merged={self.merged}"


def _matches(name: str, target: str) -> bool:
    """A module name matches a target that is its last dotted components: "attn.c_proj" matches
    "transformer.h.0.attn.c_proj" but not "transformer.h.0.mlp.c_proj"."""
    return name == target or name.endswith("." + target)


def apply_lora(model: nn.Module, targets=("attn.c_attn", "attn.c_proj"), r: int = 8, alpha: float = 8.0,
               dropout: float = 0.0, layer=LoRALinear) -> list[str]:
    """Replace, in place, every nn.Linear whose name ends with one of `targets` by a LoRALinear; freeze
    every other parameter. Returns the names replaced. `layer(linear, r, alpha, dropout)` builds each
    replacement: LoRALinear, or a subclass of it (QLoRA's `llmlab.nf4.NF4Linear`, over a 4-bit base).

    α = r (scale 1) by default, following the paper's advice to set α to the first r tried and leave it.
    Every target must match at least one module, and every module it matches must be an nn.Linear; nothing
    is changed unless all of them do.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    if not callable(layer):
        raise ValueError(f"layer={layer!r} must be LoRALinear or a callable (linear, r, alpha, dropout) -> layer")
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"targets={targets!r} must be one or more non-empty module-name suffixes")
    modules = dict(model.named_modules())
    for target in targets:
        if not any(_matches(name, target) for name in modules):
            linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
            raise ValueError(f"targets entry {target!r} matches no module; the Linear layers are {linears}")
    chosen = {}  # in the model's module order
    for name, module in modules.items():
        target = next((t for t in targets if name and _matches(name, t)), None)
        if target is None:
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(f"targets entry {target!r} matches {name!r}, a {type(module).__name__}, "
                             "not an nn.Linear")
        chosen[name] = module
    replacements = {name: layer(linear, r, alpha, dropout) for name, linear in chosen.items()}
    model.requires_grad_(False)  # everything frozen, then the new A and B (created trainable) are added
    for name, layer in replacements.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    return list(replacements)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that will be trained (requires_grad), each once: what to hand the optimizer."""
    return [p for p in model.parameters() if p.requires_grad]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the LoRA matrices A and B: the fine-tune's whole checkpoint (the base model is unchanged)."""
    return {k: v for k, v in model.state_dict().items() if k.endswith((".lora_A", ".lora_B"))}


@timing.remembered
def step_times(targets: tuple[str, ...] = ("attn.c_attn", "attn.c_proj"), r: int = 8, batch_size: int = 8,
               block_size: int = 64) -> timing.Comparison:
    """A forward + backward of the tiny GPT (on the CPU) with LoRA rank `r` on `targets` (impl), against the same
    GPT fully trainable (peer), in interleaved rounds (`llmlab.timing`): `.ratio` is LoRA's time over full
    fine-tuning's. `step_times.recent()` is the last such measurement (`timing.remembered`): chapter 8's cell
    and claim C19 show one measurement."""
    validation.positive_int("batch_size", batch_size)
    validation.positive_int("block_size", block_size)
    torch.manual_seed(0)
    full = GPT(GPTConfig.preset("tiny", block_size=block_size))
    tuned = GPT(GPTConfig.preset("tiny", block_size=block_size))
    apply_lora(tuned, targets, r=r, alpha=r)
    x, y = SyntheticDataset(MarkovSource(vocab_size=64, seed=0), batch_size=batch_size,
                            block_size=block_size).get_batch(0)  # (B, T) each

    def step(model: nn.Module) -> None:
        model(x, y)[1].backward()
        model.zero_grad(set_to_none=True)

    # Rounds of ≥ 50 ms: a few steps each, so a moment of other work on the machine averages out
    return timing.compare(functools.partial(step, tuned), functools.partial(step, full), warmup=2, min_rounds=7,
                          budget_s=2.0, min_round_s=0.05)
