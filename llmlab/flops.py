"""How much arithmetic training a transformer takes, counted matmul by matmul, and what it means in GPU-days.

A matmul (m, k) @ (k, n) costs 2·m·n·k FLOPs (one multiply and one add per term). A GPT forward pass is a list
of such matmuls (`forward_matmuls`); its backward pass costs twice the forward, because every Y = X·W needs
both dX = dY·Wᵀ and dW = Xᵀ·dY, each as large as the forward product. So a training step is 3× the forward,
4× with activation recomputation (one more forward during backward).

The shortcut C ≈ 6·N·D (N parameters, D training tokens) is that count with two terms dropped: the attention
score and weighted-sum matmuls (2·2·T·C per token per layer forward, growing with context length T) and
anything that is not a weight matmul. For GPT-3 at T = 2048 the attention terms add about 3%.

    from llmlab import flops
    flops.training_flops(175e9, 300e9)                          # 3.15e23: GPT-3's compute
    flops.training_days(3.15e23, gpus=1024, peak_flops=312e12, mfu=0.45)
    flops.implied_mfu(3.14e23, gpus=1000, days=34, peak_flops=312e12)   # 0.34
"""

from __future__ import annotations

from dataclasses import dataclass

from llmlab import validation

SECONDS_PER_DAY = 86_400.0


@dataclass(frozen=True)
class Matmul:
    """`count` matmuls of shape (m, k) @ (k, n)."""

    name: str
    m: int
    n: int
    k: int
    count: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.count


def forward_matmuls(config, batch_size: int, seq_len: int | None = None) -> list[Matmul]:
    """Every matmul of one GPT forward pass (llmlab.model's architecture) on a (batch_size, seq_len) batch."""
    seq_len = config.block_size if seq_len is None else seq_len
    validation.positive_int("batch_size", batch_size)
    validation.positive_int("seq_len", seq_len)
    B, T, C, L, H, V = batch_size, seq_len, config.n_embd, config.n_layer, config.n_head, config.vocab_size
    hd = C // H
    return [
        Matmul("attn qkv projection", B * T, 3 * C, C, L),
        Matmul("attn scores q·kᵀ", T, T, hd, B * H * L),
        Matmul("attn weighted sum p·v", T, hd, T, B * H * L),
        Matmul("attn output projection", B * T, C, C, L),
        Matmul("mlp up (c_fc)", B * T, 4 * C, C, L),
        Matmul("mlp down (c_proj)", B * T, C, 4 * C, L),
        Matmul("lm head", B * T, V, C, 1),
    ]


def forward_flops(config, batch_size: int, seq_len: int | None = None) -> int:
    return sum(mm.flops for mm in forward_matmuls(config, batch_size, seq_len))


def training_step_flops(config, batch_size: int, seq_len: int | None = None, recompute: bool = False) -> int:
    """Forward + backward (2× forward) of one step; + one more forward with activation recomputation."""
    if not isinstance(recompute, bool):  # a GPTConfig.recompute name is not this switch: "none" would count 4×
        raise ValueError(f"recompute={recompute!r} must be True (every layer's forward run again) or False; for "
                         "selective recompute of the attention core see llmlab.memory.planner.recompute_flops")
    return (4 if recompute else 3) * forward_flops(config, batch_size, seq_len)


def training_flops(n_params: float, tokens: float) -> float:
    """The 6·N·D estimate of the FLOPs to train N parameters on D tokens."""
    validation.positive("n_params", n_params)
    validation.positive("tokens", tokens)
    return 6.0 * n_params * tokens


def training_days(flops: float, gpus: int, peak_flops: float, mfu: float) -> float:
    """Days of wall-clock to do `flops` on `gpus` devices, each at `mfu` × `peak_flops` FLOP/s."""
    validation.positive("flops", flops)
    validation.positive("gpus", gpus)
    validation.positive("peak_flops", peak_flops)
    validation.number("mfu", mfu, above=0, high=1, hint="(a fraction of the peak)")
    return flops / (gpus * peak_flops * mfu) / SECONDS_PER_DAY


def implied_mfu(flops: float, gpus: int, days: float, peak_flops: float) -> float:
    """The model-FLOPs utilisation that doing `flops` on `gpus` devices in `days` days requires."""
    validation.positive("flops", flops)
    validation.positive("gpus", gpus)
    validation.positive("days", days)
    validation.positive("peak_flops", peak_flops)
    return flops / (gpus * days * SECONDS_PER_DAY * peak_flops)


def mfu(flops_per_step: float, step_seconds: float, gpus: int, peak_flops: float) -> float:
    """Measured MFU: useful FLOPs per second over the devices' combined peak."""
    validation.positive("flops_per_step", flops_per_step)
    validation.positive("step_seconds", step_seconds)
    validation.positive("gpus", gpus)
    validation.positive("peak_flops", peak_flops)
    return flops_per_step / step_seconds / (gpus * peak_flops)


# --- the course text's figures (§1); its claims C1, C2 are measured in llmlab.claims.ch01 ----------------------

GPT3 = dict(n_params=175e9, tokens=300e9, paper_flops=3.14e23)  # Brown et al. 2020, Table D.1: 3.14e23 FLOPs
GPT3_CONFIG = dict(vocab_size=50257, block_size=2048, n_layer=96, n_head=96, n_embd=12288)
CLAIMED_GPUS, CLAIMED_DAYS = 1000, 34  # "≈ 1000 A100 for 34 days"
# MFU that large dense runs reported (Chowdhery et al. 2022, PaLM, Table 3; GPT-3 itself ran on V100s)
REPORTED_MFU = {"GPT-3": 0.213, "Gopher": 0.325, "MT-NLG": 0.302, "PaLM": 0.462}
