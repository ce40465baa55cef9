"""NF4 and QLoRA: store a frozen base model in 4 bits per weight and fine-tune LoRA adapters over it.

Dettmers, Pagnoni, Holtzman & Zettlemoyer 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"
(arXiv:2305.14314), §3. Three pieces, each here:

**4-bit NormalFloat (NF4).** Pretrained weights are close to normal. A 4-bit code then spends its 16 values best
where the weights are dense: at quantiles of N(0, 1) rescaled to [−1, 1], rather than on a uniform grid. Eq. (4)
puts level i halfway between the quantiles Q_X(i/(2^k+1)) and Q_X((i+1)/(2^k+1)); that type has no exact zero,
so NF4 takes 2^(k−1) quantiles for the negative half and 2^(k−1)+1 for the positive half, joins them and keeps
one zero. As the paper's reference code (bitsandbytes' `create_normal_map`) does: 8 positive values Φ⁻¹(p) at
p equally spaced from δ down to ½ (½ itself, zero, left out), 7 negative ones the same way, and 0, all divided
by the largest. δ = ½((1 − 1/30) + (1 − 1/32)) = 0.96770833, the mean of the centres of the outermost of 15
and of 16 equal-probability bins: a finite end, since Q_X(1) = ∞. `nf4_levels()` builds them; `PAPER_NF4` is
the table printed in the paper's Appendix E, and the two agree to 2e-7.

**Blockwise absmax quantization.** Each block of 64 consecutive weights is divided by its absmax c (so it lies
in [−1, 1]) and each value stored as the index of its nearest level, two 4-bit indices per byte:
4 bits + 32/64 for c in fp32 = **4.5 bits per parameter**. Dequantizing: ŵ = level[code] · c.

**Double quantization.** The fp32 constants c are themselves quantized: their mean is subtracted (they are all
positive; centred, a symmetric 8-bit type fits them), then, in blocks of 256, each is divided by its block's
absmax and stored in 8-bit floats (FP8 E4M3, the paper's "8-bit Floats"; bitsandbytes uses its own 8-bit
dynamic code), with one fp32 scale per 256 constants and one fp32 mean per tensor:
4 + 8/64 + 32/(64·256) ≈ **4.127 bits per parameter**. `Blockwise4bit.bits_per_parameter` counts the bytes
actually stored (the 16-entry codebook is the data type's definition, shared, and not counted).

**QLoRA** (eq. 5-6): Y = X · doubleDequant(c₁, c₂, W^NF4) + X L₁ L₂, the base weight kept in NF4 and
dequantized to the compute dtype (bf16) on the fly, in forward and again in backward (`_NF4Matmul`), the LoRA
adapters L₁, L₂ trained in bf16. `NF4Linear` is `llmlab.lora.LoRALinear` over an NF4 base; `qlora` is
`llmlab.lora.apply_lora` making them.

    from llmlab.nf4 import NF4Config, quantize_nf4, qlora, finetune_losses
    q = quantize_nf4(w)                        # 4-bit codes + double-quantized constants
    q.bits_per_parameter, q.dequantize()       # ≈ 4.127 for a large w; ŵ, w's shape
    names = qlora(model.to(torch.bfloat16), r=8, alpha=8)   # every block Linear: NF4 base + LoRA
    finetune_losses("qlora"), finetune_losses("lora-bf16")  # the same fine-tune, 4-bit vs bf16 base
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmlab import validation
from llmlab.data import MarkovSource, SyntheticDataset
from llmlab.lora import LoRALinear, apply_lora, trainable_parameters
from llmlab.model import GPT
from llmlab.quant import run_steps, train_tiny

__all__ = ["PAPER_NF4", "nf4_levels", "int4_levels", "pack_4bit", "unpack_4bit", "NF4Config", "DoubleQuantized",
           "double_quantize", "Blockwise4bit", "quantize_nf4", "compare_codebooks", "FrozenNF4Linear", "NF4Linear",
           "QLORA_TARGETS", "qlora", "FINETUNE_KINDS", "SHIFTED_CONCENTRATION", "finetune_losses"]

# QLoRA, Appendix E: "The exact values of the NF4 data type" (float32, as printed)
PAPER_NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0)

_FP8 = torch.float8_e4m3fn  # the second quantization's 8-bit float: 4 exponent bits, 3 mantissa bits
_FP8_MAX = torch.finfo(_FP8).max  # 448


def nf4_levels() -> torch.Tensor:
    """The 16 NF4 values (16,) fp32, ascending, from −1 to 1 with an exact 0: normal quantiles computed in
    float64 (`torch.special.ndtri` = Φ⁻¹), as the module docstring describes."""
    offset = 0.5 * ((1 - 1 / 30) + (1 - 1 / 32))  # δ: the outermost quantile's probability
    p_pos = torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1]  # (8,) from δ towards ½, ½ excluded
    p_neg = torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1]  # (7,)
    zero = torch.zeros(1, dtype=torch.float64)
    levels = torch.cat([-torch.special.ndtri(p_neg), zero, torch.special.ndtri(p_pos)]).sort().values  # (16,)
    return (levels / levels.max()).float()


def int4_levels() -> torch.Tensor:
    """Uniform symmetric int4 as a codebook (15,) fp32: k/7 for k in [−7, 7], i.e. round(w / (c/7)) with the
    same block absmax c as NF4 (−8 left unused, so the grid is symmetric, as `llmlab.kernels.quantize` leaves
    −128 unused at 8 bits)."""
    return torch.arange(-7, 8, dtype=torch.float32) / 7


def _check_levels(levels: torch.Tensor) -> None:
    if not (isinstance(levels, torch.Tensor) and levels.dim() == 1 and levels.is_floating_point()
            and 2 <= levels.numel() <= 16):
        raise ValueError(f"levels must be a 1-D float tensor of 2 to 16 values (a 4-bit codebook), got "
                         f"{getattr(levels, 'shape', type(levels))}")
    if not (bool((levels[1:] > levels[:-1]).all()) and float(levels.abs().max()) <= 1):
        raise ValueError("levels must be strictly increasing and within [-1, 1] (values of w / absmax)")


def pack_4bit(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte, the first in the high nibble (bitsandbytes' order): (n,) integers in [0, 15]
    -> (⌈n/2⌉,) uint8. An odd n gets a 0 nibble at the end."""
    if not (isinstance(codes, torch.Tensor) and codes.dim() == 1 and not codes.is_floating_point()
            and codes.dtype != torch.bool):
        raise ValueError(f"codes must be a 1-D integer tensor, got {getattr(codes, 'dtype', type(codes))}")
    if codes.numel() and not (0 <= int(codes.min()) and int(codes.max()) <= 15):
        raise ValueError(f"codes must be in [0, 15] (4 bits), got [{int(codes.min())}, {int(codes.max())}]")
    c = codes.to(torch.uint8)
    if c.numel() % 2:
        c = torch.cat([c, c.new_zeros(1)])  # (n + 1,)
    pairs = c.view(-1, 2)  # (⌈n/2⌉, 2)
    return (pairs[:, 0] << 4) | pairs[:, 1]  # (⌈n/2⌉,)


def unpack_4bit(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `pack_4bit`: (⌈n/2⌉,) uint8 -> the first n codes (n,) uint8."""
    if not (isinstance(packed, torch.Tensor) and packed.dim() == 1 and packed.dtype == torch.uint8):
        raise ValueError(f"packed must be a 1-D uint8 tensor, got {getattr(packed, 'dtype', type(packed))}")
    validation.integer("n", n, 2 * packed.numel() - 1 if packed.numel() else 0, 2 * packed.numel(),
                       hint=f"(codes held by {packed.numel()} bytes)")
    return torch.stack([packed >> 4, packed & 15], dim=1).view(-1)[:n]  # (n,)


@dataclass(frozen=True)
class NF4Config:
    """How a weight is stored: blocks of `block_size` weights share one absmax (QLoRA: 64); `double_quant`
    stores those constants in 8 bits, in blocks of `absmax_block_size` (QLoRA: 256)."""

    block_size: int = 64
    double_quant: bool = True
    absmax_block_size: int = 256

    def __post_init__(self):
        validation.positive_int("block_size", self.block_size)
        validation.boolean("double_quant", self.double_quant)
        validation.positive_int("absmax_block_size", self.absmax_block_size)


@dataclass(frozen=True)
class DoubleQuantized:
    """Positive constants c (n,) in 8 bits: `codes` (n,) FP8 E4M3 of (c − mean)/scale, `scale` (⌈n/B⌉,) fp32,
    one per block of B = `block_size` constants (its block's max |c − mean| / 448), `mean` (1,) fp32."""

    codes: torch.Tensor
    scale: torch.Tensor
    mean: torch.Tensor
    block_size: int

    def dequantize(self) -> torch.Tensor:
        """ĉ = code · scale + mean, (n,) fp32."""
        n = self.codes.numel()
        scale = self.scale.repeat_interleave(self.block_size)[:n]  # (n,) each constant's block scale
        return self.codes.float() * scale + self.mean  # (n,)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.mean))


def double_quantize(c: torch.Tensor, block_size: int = 256) -> DoubleQuantized:
    """QLoRA's second quantization of the absmax constants `c` (n,) fp32: subtract their mean, then blockwise
    absmax to FP8 E4M3 (PyTorch's cast: round to nearest, ties to even)."""
    if not (isinstance(c, torch.Tensor) and c.dim() == 1 and c.numel() and c.dtype == torch.float32):
        raise ValueError(f"c must be a non-empty 1-D fp32 tensor, got {getattr(c, 'shape', type(c))}")
    validation.positive_int("block_size", block_size)
    mean = c.mean().reshape(1)  # (1,)
    centred = c - mean  # (n,)
    n, pad = c.numel(), -c.numel() % block_size
    blocks = F.pad(centred, (0, pad)).view(-1, block_size)  # (⌈n/B⌉, B): zeros do not widen a block's range
    scale = blocks.abs().amax(dim=1) / _FP8_MAX  # (⌈n/B⌉,)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a block of equal constants: every code 0
    codes = (blocks / scale[:, None]).view(-1)[:n].to(_FP8)  # (n,) in [−448, 448]
    return DoubleQuantized(codes, scale, mean, block_size)


@dataclass(frozen=True)
class Blockwise4bit:
    """A tensor in 4-bit codes: `codes` (⌈n/2⌉,) uint8, two indices into `levels` per byte; `absmax` the
    (n_blocks,) fp32 constant of each block of `block_size` weights, or those constants double-quantized;
    `levels` the codebook in [−1, 1] (NF4's 16, or `int4_levels()`); `shape` the original shape."""

    codes: torch.Tensor
    absmax: torch.Tensor | DoubleQuantized
    levels: torch.Tensor
    shape: torch.Size
    block_size: int

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def absmax_values(self) -> torch.Tensor:
        """Each block's constant as dequantization uses it, (n_blocks,) fp32."""
        return self.absmax.dequantize() if isinstance(self.absmax, DoubleQuantized) else self.absmax

    @property
    def nbytes(self) -> int:
        """Bytes stored: the packed codes and the block constants (the shared codebook is not counted)."""
        a = self.absmax
        return self.codes.numel() + (a.nbytes if isinstance(a, DoubleQuantized) else a.numel() * a.element_size())

    @property
    def bits_per_parameter(self) -> float:
        return 8 * self.nbytes / self.numel

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """ŵ = levels[code] · c of its block, computed in fp32 and rounded once to `dtype`; w's shape."""
        n, B = self.numel, self.block_size
        values = self.levels[unpack_4bit(self.codes, n).long()]  # (n,) in [−1, 1]
        blocks = F.pad(values, (0, -n % B)).view(-1, B)  # (n_blocks, B)
        return (blocks * self.absmax_values()[:, None]).view(-1)[:n].view(self.shape).to(dtype)


def quantize_nf4(w: torch.Tensor, config: NF4Config = NF4Config(), levels: torch.Tensor | None = None
                 ) -> Blockwise4bit:
    """Blockwise absmax quantization of `w` (any shape, flattened in order, the last block padded with zeros)
    to the nearest of `levels` (default: NF4's), with the block constants double-quantized if
    `config.double_quant`. The codes are taken against the exact fp32 constants, as bitsandbytes does."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.numel() == 0:
        raise ValueError(f"w must be a non-empty floating-point tensor, got {getattr(w, 'dtype', type(w))}")
    if not isinstance(config, NF4Config):
        raise ValueError(f"config must be an NF4Config, got {type(config).__name__}")
    levels = nf4_levels() if levels is None else levels
    _check_levels(levels)
    flat = w.detach().reshape(-1).float()  # (n,)
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("w holds an inf or NaN: absmax quantization has no code for them")
    n, B = flat.numel(), config.block_size
    blocks = F.pad(flat, (0, -n % B)).view(-1, B)  # (n_blocks, B)
    absmax = blocks.abs().amax(dim=1)  # (n_blocks,)
    normalized = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))[:, None]  # (n_blocks, B)
    levels = levels.to(device=w.device, dtype=torch.float32)
    midpoints = (levels[1:] + levels[:-1]) / 2  # (L − 1,): the nearest level's index is how many lie below
    codes = torch.bucketize(normalized.view(-1)[:n], midpoints)  # (n,) a tie goes to the lower level
    kept = double_quantize(absmax, config.absmax_block_size) if config.double_quant else absmax
    return Blockwise4bit(pack_4bit(codes), kept, levels, w.shape, B)


def compare_codebooks(w: torch.Tensor, config: NF4Config = NF4Config(double_quant=False)) -> list[dict]:
    """NF4 against uniform int4 on the same blocks and block absmax: one row each with the round-trip RMSE,
    the largest error and the bits per parameter stored. On normal weights NF4's error is the smaller."""
    rows = []
    for name, levels in (("NF4", nf4_levels()), ("int4 (uniform)", int4_levels())):
        q = quantize_nf4(w, config, levels)
        err = (q.dequantize() - w.detach().float()).double()  # w's shape
        rows.append({"codebook": name, "rmse": err.pow(2).mean().sqrt().item(), "max_abs": err.abs().max().item(),
                     "bits_per_parameter": q.bits_per_parameter})
    return rows


class _NF4Matmul(torch.autograd.Function):
    """QLoRA eq. (5)-(6)'s base term: y = X · doubleDequant(c₁, c₂, W^NF4)ᵀ + b (Dettmers et al. 2023), with
    the weight dequantized to X's dtype in forward and again in backward, so only the 4-bit codes stay
    resident between the two: dX = dY · Ŵ. W and b are frozen: no gradient for them."""

    @staticmethod
    def forward(ctx, x, weight: Blockwise4bit, bias):
        ctx.weight = weight
        return F.linear(x, weight.dequantize(x.dtype), bias)  # (..., out)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        return grad @ ctx.weight.dequantize(grad.dtype), None, None  # (..., out) @ (out, in) -> (..., in)


class FrozenNF4Linear(nn.Module):
    """A frozen nn.Linear kept as NF4: x Ŵᵀ + b, Ŵ dequantized to x's dtype on the fly (`_NF4Matmul`).

    The codes and constants are buffers of raw bytes (uint8 / int32 views of the FP8 and fp32 values):
    `model.to(dtype)` casts floating-point buffers, and these must keep their bits; `.to(device)` moves them.
    The bias stays in the linear's dtype, frozen."""

    def __init__(self, linear: nn.Linear, config: NF4Config = NF4Config()):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        q = quantize_nf4(linear.weight, config)
        self.in_features, self.out_features, self.config = linear.in_features, linear.out_features, config
        self.register_buffer("codes", q.codes)  # (⌈n/2⌉,) uint8
        self.register_buffer("levels_bits", q.levels.view(torch.int32))  # (16,)
        if config.double_quant:
            a = q.absmax
            self.register_buffer("absmax_codes", a.codes.view(torch.uint8))  # (n_blocks,) FP8 bytes
            self.register_buffer("absmax_scale_bits", a.scale.view(torch.int32))  # (⌈n_blocks/256⌉,)
            self.register_buffer("absmax_mean_bits", a.mean.view(torch.int32))  # (1,)
        else:
            self.register_buffer("absmax_bits", q.absmax.view(torch.int32))  # (n_blocks,)
        self.bias = None if linear.bias is None else linear.bias.requires_grad_(False)

    def quantized(self) -> Blockwise4bit:
        """The weight as a `Blockwise4bit`, read from the buffers (wherever they now are)."""
        if self.config.double_quant:
            absmax = DoubleQuantized(self.absmax_codes.view(_FP8), self.absmax_scale_bits.view(torch.float32),
                                     self.absmax_mean_bits.view(torch.float32), self.config.absmax_block_size)
        else:
            absmax = self.absmax_bits.view(torch.float32)
        return Blockwise4bit(self.codes, absmax, self.levels_bits.view(torch.float32),
                             torch.Size((self.out_features, self.in_features)), self.config.block_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NF4Matmul.apply(x, self.quantized(), self.bias)  # (..., out)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.quantized().bits_per_parameter:.3f} bits/weight"


class NF4Linear(LoRALinear):
    """QLoRA's layer: `llmlab.lora.LoRALinear` whose frozen base is a `FrozenNF4Linear`, so
    h = x Ŵᵀ + b + (α/r)·dropout(x) Aᵀ Bᵀ with Ŵ from 4-bit codes; A and B in the linear's dtype (bf16 for
    QLoRA: cast the model before quantizing it). The float weight is not kept."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0,
                 config: NF4Config = NF4Config()):
        if not isinstance(config, NF4Config):
            raise ValueError(f"config must be an NF4Config, got {type(config).__name__}")
        super().__init__(base, r, alpha, dropout)  # checks, A (r, in) and B (out, r) = 0 as LoRA's
        self.base = FrozenNF4Linear(base, config)

    def merge(self) -> None:
        raise RuntimeError("merge(): an NF4 base cannot absorb ΔW without re-quantizing it, which would add "
                           "rounding error to the fine-tune; keep the adapters separate (as QLoRA does)")


# Every Linear of every block, as QLoRA applies adapters to all of a transformer's linear layers (§4).
QLORA_TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def qlora(model: nn.Module, r: int = 8, alpha: float = 8.0, targets=QLORA_TARGETS, dropout: float = 0.0,
          config: NF4Config = NF4Config()) -> list[str]:
    """`llmlab.lora.apply_lora` with `NF4Linear` layers: every Linear named by `targets` becomes an NF4 base
    plus LoRA adapters, everything else is frozen. Returns the names replaced. Cast the model to its compute
    dtype (bf16) first: the adapters take the linear's dtype."""
    if not isinstance(config, NF4Config):
        raise ValueError(f"config must be an NF4Config, got {type(config).__name__}")
    return apply_lora(model, targets, r, alpha, dropout, layer=functools.partial(NF4Linear, config=config))


FINETUNE_KINDS = ("lora-bf16", "qlora")
# The shifted task: the pretraining chain's successors (same seed) with their odds redrawn from Dirichlet(0.3),
# peakier than the pretraining's Dirichlet(1): the same tokens may follow each token, with new probabilities.
SHIFTED_CONCENTRATION = 0.3


def finetune_losses(kind: str, steps: int = 40, pretrain_steps: int = 60, r: int = 8, alpha: float = 8.0,
                    lr: float = 1e-2, seed: int = 0, batch_size: int = 8, block_size: int = 32,
                    device: str | torch.device = "cpu", base: GPT | None = None) -> list[float]:
    """The loss of every step of a fine-tune of the tiny GPT on a shifted task, with LoRA over a bf16 base
    ("lora-bf16") or over its NF4 copy ("qlora"), adapters on `QLORA_TARGETS`, trained in bf16 with AdamW.

    The start is the same for both: the tiny GPT trained `pretrain_steps` fp32 steps on the Markov source of
    `seed` (`llmlab.quant.train_tiny`, deterministic, in memory), cast to bf16; the adapters are drawn from the
    same seed. The shifted task is that chain with new odds (`SHIFTED_CONCENTRATION`), on batches of its own.
    The two curves differ only by the base weight's storage: bf16 or NF4.

    `base`, a GPT already pretrained on the Markov source of `seed` (a chapter's own), is the start instead: a
    copy of it is cast and fine-tuned (`base` itself is left as it is) and `pretrain_steps` is not used."""
    validation.one_of("kind", kind, FINETUNE_KINDS)
    validation.positive_int("steps", steps)
    validation.positive_int("pretrain_steps", pretrain_steps)
    if base is None:
        model = train_tiny(None, pretrain_steps, seed, 3e-3, batch_size, block_size, device)[0]
    elif isinstance(base, GPT):
        validation.integer("block_size", block_size, 1, base.config.block_size, hint="(the base's context length)")
        model = copy.deepcopy(base).to(device)
    else:
        raise ValueError(f"base must be an llmlab GPT or None, got {type(base).__name__}")
    model = model.to(torch.bfloat16)
    torch.manual_seed(seed)  # the same A for both kinds
    if kind == "qlora":
        qlora(model, r, alpha)
    else:
        apply_lora(model, QLORA_TARGETS, r, alpha)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=lr)
    data = SyntheticDataset(MarkovSource(model.config.vocab_size, seed=seed, concentration=SHIFTED_CONCENTRATION),
                            batch_size, block_size, seed=seed + 1)
    return run_steps(model, optimizer, data, steps, device)
