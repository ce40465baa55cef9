"""A tiny GPT, shaped like nanoGPT, that every chapter trains, shards, checkpoints and quantizes.

The model is GPT-2's architecture at any size: token + position embeddings, `n_layer` pre-norm
transformer blocks (causal self-attention, then an MLP, each wrapped in a residual connection), a final
LayerNorm and a language-model head that shares its weight with the token embedding. Module names follow
nanoGPT (and so GPT-2's checkpoints), so later code can target them by name::

    transformer.wte, transformer.wpe, transformer.drop
    transformer.h[i].ln_1, .attn.c_attn, .attn.c_proj, .ln_2, .mlp.c_fc, .mlp.c_proj
    transformer.ln_f, lm_head (tied to transformer.wte)

Usage::

    from llmlab.model import GPT, GPTConfig
    config = GPTConfig.preset("tiny")              # or "mini", "small", "medium", "gpt2"; fields overridable
    model = GPT(config)
    logits, loss = model(idx, targets)             # idx, targets: LongTensor (B, T); loss is a scalar
    model.num_params()                             # parameters, position embeddings excluded

Attention is written out (q @ k^T / sqrt(d), causal mask, softmax, dropout, @ v) so its FLOPs and head
split are visible; `GPTConfig(flash=True)` uses `F.scaled_dot_product_attention` instead, which computes
the same thing with a fused kernel where one exists. `GPTConfig(recompute="selective")` is Korthikanti et
al.'s selective activation recomputation (2022, "Reducing Activation Recomputation in Large Transformer
Models", §5; Megatron-LM's `--recompute-granularity selective`): the attention core (q·kᵀ, mask, softmax,
dropout, ·v) runs under `torch.utils.checkpoint`, so its B·nh·T² tensors are rebuilt in backward instead of
kept; q, k and v are kept as the recompute's input. Whole-block checkpointing is `llmlab.memory.checkpoint`.

Shape names in comments: B batch, T sequence length, C = n_embd, nh = n_head, hs = C // nh, V = vocab_size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from llmlab import validation
from llmlab.presets import from_preset

__all__ = ["GPTConfig", "PRESETS", "RECOMPUTE", "GPT", "Block", "CausalSelfAttention", "MLP"]

# What the model itself recomputes in backward: nothing, or the attention core ("selective").
RECOMPUTE = ("none", "selective")


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT. `dropout` applies to embeddings, attention weights and residual branches;
    `bias` adds biases to every Linear and LayerNorm; `flash` picks the fused attention kernel; `recompute`
    is one of RECOMPUTE ("selective": the attention core is recomputed in backward, not saved)."""

    vocab_size: int
    block_size: int  # the longest sequence the model accepts (number of position embeddings)
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True
    flash: bool = False
    recompute: str = "none"

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            validation.positive_int(name, getattr(self, name))
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if validation.number("dropout", self.dropout, low=0) >= 1:
            raise ValueError(f"dropout={self.dropout!r} must be in [0, 1)")
        for name in ("bias", "flash"):
            validation.boolean(name, getattr(self, name))
        validation.one_of("recompute", self.recompute, RECOMPUTE,
                          hint="(whole blocks are checkpointed by llmlab.memory.checkpoint)")

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        """The named preset (see `PRESETS`) with any fields overridden, e.g. `preset("tiny", dropout=0.1)`."""
        return from_preset(cls, PRESETS, name, **overrides)


# A ladder of sizes. "tiny" trains in seconds on a 2-core CPU; "gpt2" is GPT-2 small (124M parameters; its
# vocabulary 50257 padded to 50304, a multiple of 64, as nanoGPT does). "medium" is this workbook's middle
# rung, not GPT-2 medium. Parameter counts (all / without position embeddings) are in tests/test_model.py.
PRESETS = {
    "tiny": GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_embd=64),
    "mini": GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128),
    "small": GPTConfig(vocab_size=512, block_size=256, n_layer=6, n_head=6, n_embd=384),
    "medium": GPTConfig(vocab_size=1024, block_size=512, n_layer=8, n_head=8, n_embd=512),
    "gpt2": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: nn.Dropout,
                     flash: bool = False, recompute: str = "none") -> torch.Tensor:
    """softmax(q·kᵀ/√hs + causal mask)·v for q, k, v of shape (B, nh, T, hs); returns (B, nh, T, hs).

    With `recompute="selective"` (and grad enabled) it runs under torch.utils.checkpoint (non-reentrant; the
    RNG state is restored for the recompute, so dropout draws the same mask): autograd keeps q, k, v and
    nothing of the B·nh·T² insides. Shared by `CausalSelfAttention` and the tensor-parallel attention (which
    runs it on its share of heads).
    """
    if recompute == "selective" and torch.is_grad_enabled():
        return torch_checkpoint(causal_attention, q, k, v, dropout, flash, use_reentrant=False)  # (B, nh, T, hs)
    if flash:
        p = dropout.p if dropout.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hs)
    T, hs = q.shape[-2], q.shape[-1]
    att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)  # (B, nh, T, T): 2·B·nh·T²·hs FLOPs
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()  # (T, T): row t sees <= t
    att = att.masked_fill(~causal, float("-inf"))  # (B, nh, T, T)
    att = F.softmax(att, dim=-1)  # (B, nh, T, T): each row sums to 1
    att = dropout(att)
    return att @ v  # (B, nh, T, hs): another 2·B·nh·T²·hs FLOPs


def split_heads(qkv: torch.Tensor, n_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T, 3·C') fused projections -> q, k, v each (B, n_head, T, C'/n_head)."""
    B, T, three_c = qkv.shape
    c = three_c // 3
    q, k, v = qkv.split(c, dim=2)  # 3 × (B, T, C')
    return tuple(t.view(B, T, n_head, c // n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends only to positions <= t."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.flash, self.recompute = config.flash, config.recompute
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # Split C into n_head heads of size hs; each head attends independently.
        q, k, v = split_heads(self.c_attn(x), self.n_head)  # 3 × (B, nh, T, hs)
        y = causal_attention(q, k, v, self.attn_dropout, self.flash, self.recompute)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


class MLP(nn.Module):
    """The position-wise feed-forward network: C -> 4C -> GELU -> C."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(x))  # (B, T, C)


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT(nn.Module):
    """A decoder-only transformer language model (see the module docstring)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise ValueError(f"config={config!r} must be a GPTConfig (e.g. GPTConfig.preset('tiny'))")
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: the output projection is the token embedding (one V × C matrix, used twice).
        self.transformer.wte.weight = self.lm_head.weight

        # GPT-2's init: N(0, 0.02) everywhere, biases zero; the projections that write into the residual
        # stream (2 per block) get std 0.02/sqrt(2·n_layer) so the stream's variance doesn't grow with depth.
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = True) -> int:
        """Number of parameters (the tied wte/lm_head matrix counted once).

        With `non_embedding=True` (nanoGPT's convention) the position embeddings are left out; the token
        embeddings stay in, because through weight tying they are also the output layer's weights.
        """
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits (B, T, V) for token ids `idx` (B, T); with `targets` (B, T) also the mean cross-entropy
        over positions whose target is not -1 (else loss is None)."""
        self._check_tokens("idx", idx, low=0)
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"idx has length T={T} > block_size={self.config.block_size}")
        if targets is not None:
            self._check_tokens("targets", targets, low=-1)
            if targets.shape != idx.shape:
                raise ValueError(f"targets shape {tuple(targets.shape)} != idx shape {tuple(idx.shape)}")

        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C) + (T, C) -> (B, T, C)
        x = self.transformer.drop(x)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)  # (B, T, C)
        x = self.transformer.ln_f(x)  # (B, T, C)
        logits = self.lm_head(x)  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(B * T, -1), targets.view(B * T).long(), ignore_index=-1)  # scalar
        return logits, loss

    def _check_tokens(self, name: str, t: torch.Tensor, low: int) -> None:
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.int32):
            kind = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be an int64 or int32 tensor of token ids, got {kind}")
        if t.dim() != 2:
            raise ValueError(f"{name} must have shape (B, T), got {tuple(t.shape)}")
        if t.device.type != "meta" and t.numel() and ((t < low) | (t >= self.config.vocab_size)).any():
            raise ValueError(f"{name} has values outside [{low}, vocab_size={self.config.vocab_size})")
