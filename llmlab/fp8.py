"""FP8 training as it is done today: E4M3/E5M2 casts, fine-grained scales, an FP8 Linear, and what they cost.

An 8-bit float has a sign, e exponent bits and m mantissa bits (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning", §3; both formats run on H100 tensor cores at twice the BF16 rate):

| format | e, m | bias | largest        | smallest normal | smallest subnormal | step within a binade |
|--------|------|------|----------------|-----------------|--------------------|----------------------|
| E4M3   | 4, 3 | 7    | 448 (no inf)   | 2⁻⁶             | 2⁻⁹                | 2⁻³ of its bottom    |
| E5M2   | 5, 2 | 15   | 57344          | 2⁻¹⁴            | 2⁻¹⁶               | 2⁻² of its bottom    |

Rounding is to nearest, ties to even, so a stored value is within a relative 2⁻⁽ᵐ⁺¹⁾ (1/16 for E4M3, 1/8 for E5M2)
of the value, or, below the smallest normal, within half a subnormal step. `cast` *saturates*: what lies beyond
the largest value becomes ±max (torch's plain `.to(torch.float8_e5m2)` gives ±inf there; E4M3 has no inf).

So few bits hold only with a **scale**: x is stored as q = cast(x / s) and read back as q·s, with s = amax / max
so that the largest |x| a scale covers lands on the format's largest value. What one scale covers decides how an
outlier hurts (`GRANULARITIES`; DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §3.3.1-3.3.2, Fig. 7):

- "tensor": one scale for everything — one outlier sets it for all;
- "row": one per row (per token);
- "tile": one per 1×128 tile of a row — DeepSeek-V3's activations;
- "block": one per 128×128 block — DeepSeek-V3's weights (the same blocks serve W and Wᵀ, forward and backward).

Sizes that are not multiples of 128 get a short last tile; an all-zero tile gets the scale 1 (its codes are 0).

`FP8Linear` (an nn.Linear) runs every matmul of forward and backward in FP8 with fp32 accumulation:
y = Q(x)·Q(W)ᵀ, dX = Q(dY)·Q(W), dW = Q(dYᵀ)·Q(Xᵀ)ᵀ (`_FP8LinearFunction`); `convert_to_fp8(model)` swaps a
model's Linears for it, the head and embeddings kept, as DeepSeek-V3 keeps them in higher precision.

    from llmlab import fp8
    q, s = fp8.quantize(x, "e4m3", "tile")             # x (M, N) -> q (M, N) float8_e4m3fn, s (M, ⌈N/128⌉) fp32
    x_hat = fp8.dequantize(q, s, "tile")               # (M, N) fp32, |x_hat − x| ≲ |x|/16 + s·2⁻¹⁰
    fp8.convert_to_fp8(model)                          # every Linear but the head, in place
    fp8.outlier_errors(magnitude=1e5)                  # {'tensor': 0.44, 'row': 0.19, 'tile': 0.05}
    fp8.train_losses("fp8", steps=30)                  # the tiny GPT's loss curve, beside "fp32" and "bf16"

On a CPU (and wherever the blockwise FP8 GEMM is unavailable) a product is computed as the fp32 matmul of the
dequantized operands: FP8 products with fp32 sums, at fp32's speed. (Hopper's FP8 tensor cores keep only about
14 bits of their running sum; DeepSeek-V3 moves the partial sums to fp32 on the CUDA cores every 128 products,
§3.3.2, which these sums stand for.) On an
H100/H200 with torch's blockwise `torch._scaled_mm` (CUDA ≥ 12.9) the forward and dX products run on the FP8
tensor cores (`_blockwise_gemm_applies` says when); `llmlab bench fp8` times that against bf16.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmlab import quant, runtime, timing, validation

__all__ = ["FP8Format", "E4M3", "E5M2", "FORMATS", "GRANULARITIES", "cast", "quantize", "dequantize", "FP8Recipe",
           "fp8_linear", "FP8Linear", "convert_to_fp8", "outlier_errors", "TRAIN_PRECISIONS", "train_losses",
           "bench"]


@dataclass(frozen=True)
class FP8Format:
    """One 8-bit float format's facts (Micikevicius et al. 2022, §3), as `torch.finfo` gives them too."""

    name: str
    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float  # the largest finite value
    min_normal: float  # 2^(1 − bias)
    min_subnormal: float  # 2^(1 − bias − mantissa_bits)

    @property
    def unit_roundoff(self) -> float:
        """The largest relative error of rounding a normal value to nearest: half a step, 2^−(m+1)."""
        return 2.0 ** -(self.mantissa_bits + 1)


E4M3 = FP8Format("e4m3", torch.float8_e4m3fn, 4, 3, 7, 448.0, 2.0**-6, 2.0**-9)  # 1.75·2⁸; S.1111.111 is NaN
E5M2 = FP8Format("e5m2", torch.float8_e5m2, 5, 2, 15, 57344.0, 2.0**-14, 2.0**-16)  # 1.75·2¹⁵; IEEE-like, ±inf
FORMATS = {f.name: f for f in (E4M3, E5M2)}
GRANULARITIES = ("tensor", "row", "tile", "block")  # what one scale covers: see the module's docstring


def _format(fmt: str | FP8Format) -> FP8Format:
    if isinstance(fmt, FP8Format):
        return fmt
    validation.one_of("fmt", fmt, tuple(FORMATS))
    return FORMATS[fmt]


def cast(x: torch.Tensor, fmt: str | FP8Format = "e4m3") -> torch.Tensor:
    """x rounded to the FP8 format `fmt` ('e4m3', 'e5m2' or an FP8Format), to nearest with ties to even,
    *saturating*: beyond ±max (±inf included) it is ±max. NaN stays NaN. float64 goes through fp32 first, as
    torch's own conversion does."""
    f = _format(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    return x.float().clamp(-f.max, f.max).to(f.dtype)


def _spans(granularity: str, shape: tuple[int, int], block: int) -> tuple[int, int]:
    """The (rows, columns) of an (M, N) matrix that one scale covers."""
    m, n = shape
    return {"tensor": (m, n), "row": (1, n), "tile": (1, block), "block": (block, block)}[granularity]


def _scales(x: torch.Tensor, f: FP8Format, spans: tuple[int, int]) -> torch.Tensor:
    """amax / max of every span of x (M, N), fp32; 1 where that is 0 (an all-zero span, or an amax so small that
    the division underflows): (⌈M/rows⌉, ⌈N/cols⌉)."""
    (m, n), (r, c) = x.shape, spans
    padded = F.pad(x.abs(), (0, -n % c, 0, -m % r))  # (⌈M/r⌉·r, ⌈N/c⌉·c): zeros raise no amax
    amax = padded.reshape(padded.shape[0] // r, r, padded.shape[1] // c, c).amax(dim=(1, 3))  # (⌈M/r⌉, ⌈N/c⌉)
    scales = amax / f.max
    return torch.where(scales > 0, scales, torch.ones_like(scales))


def _per_element(scales: torch.Tensor, shape: tuple[int, int], spans: tuple[int, int]) -> torch.Tensor:
    """Each scale repeated over the span it covers, cut to shape: (M, N)."""
    (m, n), (r, c) = shape, spans
    return scales.repeat_interleave(r, dim=0)[:m].repeat_interleave(c, dim=1)[:, :n]  # (M, N)


def _quantize(x: torch.Tensor, f: FP8Format, granularity: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` without the argument checks, for the Linear's own calls."""
    x = x.float()  # (M, N): scales and the division in fp32
    spans = _spans(granularity, x.shape, block)
    scales = _scales(x, f, spans)  # (⌈M/r⌉, ⌈N/c⌉)
    return cast(x / _per_element(scales, x.shape, spans), f), scales  # (M, N) fp8: |x / s| ≤ max, saturated


def _check_granularity(granularity: str, block: int) -> None:
    validation.one_of("granularity", granularity, GRANULARITIES)
    validation.positive_int("block", block)


def quantize(x: torch.Tensor, fmt: str | FP8Format = "e4m3", granularity: str = "tile",
             block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, N) as FP8 codes and fp32 scales, x ≈ q·s: s = amax/max over each span `granularity` names ('tensor',
    'row', 'tile': 1×block, 'block': block×block), q = cast(x / s). Returns (q (M, N) in `fmt`'s dtype, scales of
    shape (1, 1), (M, 1), (M, ⌈N/block⌉) or (⌈M/block⌉, ⌈N/block⌉)). x must be finite: an inf has no scale."""
    f = _format(fmt)
    _check_granularity(granularity, block)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2 or not x.numel():
        raise ValueError(f"x must be a non-empty 2-D floating-point tensor (M, N), got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x has inf or NaN values: no scale makes them representable")
    return _quantize(x, f, granularity, block)


def dequantize(q: torch.Tensor, scales: torch.Tensor, granularity: str = "tile", block: int = 128,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q·s (in fp32, then `dtype`) for codes q (M, N) and the scales `quantize` gave with the same granularity."""
    _check_granularity(granularity, block)
    if not isinstance(q, torch.Tensor) or q.dtype not in (E4M3.dtype, E5M2.dtype) or q.dim() != 2:
        raise ValueError(f"q must be a 2-D float8_e4m3fn or float8_e5m2 tensor, got "
                         f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    spans = _spans(granularity, q.shape, block)
    expected = (-(-q.shape[0] // spans[0]), -(-q.shape[1] // spans[1]))
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != expected:
        raise ValueError(f"scales must have shape {expected} for a {tuple(q.shape)} q with granularity="
                         f"{granularity!r}, got {tuple(getattr(scales, 'shape', ()))}")
    return (q.float() * _per_element(scales.float(), q.shape, spans)).to(dtype)  # (M, N)


@dataclass(frozen=True)
class FP8Recipe:
    """The formats of an FP8 Linear's operands and the tile edge. The default is DeepSeek-V3's (§3.3.2: E4M3 for
    every tensor): with a scale per 1×128 tile the gradient's range is the tile's, which E4M3 spans, and E4M3's
    extra mantissa bit halves the rounding error. `grad="e5m2"` is Micikevicius et al.'s recipe (E5M2's range for
    the gradients, which per-tensor scaling needs)."""

    activation: str = "e4m3"
    weight: str = "e4m3"
    grad: str = "e4m3"
    block: int = 128

    def __post_init__(self):
        for name in ("activation", "weight", "grad"):
            validation.one_of(name, getattr(self, name), tuple(FORMATS))
        validation.positive_int("block", self.block)


def _blockwise_gemm_applies(a_q: torch.Tensor, a_granularity: str, b_q: torch.Tensor, b_granularity: str,
                            block: int) -> bool:
    """Whether a @ bᵀ can run as torch's blockwise FP8 GEMM (cuBLASLt's 1×128 × 128×128 scaling on SM90, CUDA
    ≥ 12.9, no fast accumulation): a CUDA Hopper device, E4M3 operands in those granularities, and the sizes its
    scale layout asks for (rows a multiple of 128; the contraction of 512, so that its scale rows align to 16 bytes)."""
    if a_q.device.type != "cuda" or not hasattr(torch, "_scaled_mm") or block != 128:
        return False
    if (a_granularity, b_granularity) != ("tile", "block") or not a_q.dtype == b_q.dtype == E4M3.dtype:
        return False
    (m, k), n = a_q.shape, b_q.shape[0]
    return runtime.capability(a_q.device)[0] == 9 and m % 128 == 0 and n % 128 == 0 and k % 512 == 0


def _blockwise_operands(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor):
    """The arguments of torch's blockwise FP8 GEMM for a @ bᵀ, a (M, K) in 1×128 tiles, b (N, K) in 128×128 blocks:
    mat_a (M, K) row-major, mat_b = bᵀ (K, N) column-major, scale_a (M, K/128) outer-dim-major (each column
    contiguous), scale_b (K/128, N/128) — the layout of torch's own blockwise test and of its users' calls."""
    return a_q.contiguous(), b_q.contiguous().t(), a_s.t().contiguous().t(), b_s.contiguous().t()


def _matmul(a: tuple[torch.Tensor, torch.Tensor, str], b: tuple[torch.Tensor, torch.Tensor, str],
            block: int) -> torch.Tensor:
    """a @ bᵀ accumulated in fp32, for quantized operands a = (q, scales, granularity) of shape (M, K) and b of
    (N, K): (M, N) fp32. The FP8 tensor cores where `_blockwise_gemm_applies` (their output rounded once to bf16,
    as DeepSeek-V3's GEMMs write BF16), else the fp32 matmul of the dequantized operands."""
    (a_q, a_s, a_g), (b_q, b_s, b_g) = a, b
    if _blockwise_gemm_applies(a_q, a_g, b_q, b_g, block):
        mat_a, mat_b, scale_a, scale_b = _blockwise_operands(a_q, a_s, b_q, b_s)
        return torch._scaled_mm(mat_a, mat_b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16).float()
    return dequantize(a_q, a_s, a_g, block) @ dequantize(b_q, b_s, b_g, block).t()  # (M, N): fp32 sums


class _FP8LinearFunction(torch.autograd.Function):
    """y = Q(x)·Q(W)ᵀ + b, DeepSeek-V3's fine-grained FP8 scheme (DeepSeek-AI 2024, §3.3.1-3.3.2, Fig. 7; the
    formats of Micikevicius et al. 2022): x in 1×128 tiles, W in 128×128 blocks, each product accumulated in fp32.

    Backward, both products again in FP8 with fp32 accumulation:
        dX = Q(dY)·Q(W)       dY in 1×128 tiles along N (this product's sum); the forward's W blocks, transposed
        dW = Q(dYᵀ)·Q(Xᵀ)ᵀ    dY and x in 128×1 tiles: along M, the sum of this product
        db = Σ_rows dY        in fp32, unquantized
    x is kept in its own precision for backward (DeepSeek-V3 keeps it in FP8 to save memory; the 128×1 tiles then
    come from re-quantizing it)."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe):
        block = recipe.block
        x_q, x_s = _quantize(x, FORMATS[recipe.activation], "tile", block)  # (M, K) fp8, (M, ⌈K/128⌉)
        w_q, w_s = _quantize(weight, FORMATS[recipe.weight], "block", block)  # (N, K) fp8, (⌈N/128⌉, ⌈K/128⌉)
        y = _matmul((x_q, x_s, "tile"), (w_q, w_s, "block"), block)  # (M, N) fp32
        if bias is not None:
            y = y + bias.float()  # (M, N)
        ctx.save_for_backward(x, w_q, w_s)
        ctx.recipe, ctx.weight_dtype, ctx.bias_dtype = recipe, weight.dtype, getattr(bias, "dtype", None)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, w_q, w_s = ctx.saved_tensors
        recipe, block = ctx.recipe, ctx.recipe.block
        g = grad.float()  # (M, N)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            g_q, g_s = _quantize(g, FORMATS[recipe.grad], "tile", block)  # (M, N), tiles along N
            dx = _matmul((g_q, g_s, "tile"), (w_q.t(), w_s.t(), "block"), block).to(x.dtype)  # (M, K)
        if ctx.needs_input_grad[1]:
            gt_q, gt_s = _quantize(g.t(), FORMATS[recipe.grad], "tile", block)  # (N, M), tiles along M
            xt_q, xt_s = _quantize(x.t(), FORMATS[recipe.activation], "tile", block)  # (K, M), tiles along M
            dw = _matmul((gt_q, gt_s, "tile"), (xt_q, xt_s, "tile"), block).to(ctx.weight_dtype)  # (N, K)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = g.sum(dim=0).to(ctx.bias_dtype)  # (N,)
        return dx, dw, db, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               recipe: FP8Recipe = FP8Recipe()) -> torch.Tensor:
    """F.linear(x, weight, bias) with every matmul of forward and backward in FP8 (`_FP8LinearFunction`):
    x (..., K), weight (N, K), bias (N,) or None -> (..., N) in x's dtype."""
    if not isinstance(recipe, FP8Recipe):
        raise ValueError(f"recipe={recipe!r} must be an FP8Recipe")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor (out_features, in_features), got "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x must be a floating-point tensor (..., {weight.shape[1]}) for a weight of shape "
                         f"{tuple(weight.shape)}, got {tuple(getattr(x, 'shape', ()))}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"bias must be None or a tensor of shape ({weight.shape[0]},), got "
                         f"{tuple(getattr(bias, 'shape', ()))}")
    if not x.numel():
        raise ValueError(f"x of shape {tuple(x.shape)} has no rows: there is nothing to scale")
    y = _FP8LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, bias, recipe)  # (M, N)
    return y.reshape(*x.shape[:-1], weight.shape[0])  # (..., N)


class FP8Linear(nn.Linear):
    """An nn.Linear whose forward and backward matmuls run in FP8 (`fp8_linear`, with `recipe`); its weight and
    bias stay fp32 Parameters (the master weights the optimizer updates)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 recipe: FP8Recipe = FP8Recipe()):
        super().__init__(in_features, out_features, bias, device, dtype)
        if not isinstance(recipe, FP8Recipe):
            raise ValueError(f"recipe={recipe!r} must be an FP8Recipe")
        self.recipe = recipe

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: FP8Recipe = FP8Recipe()) -> FP8Linear:
        """An FP8Linear holding `linear`'s own weight and bias Parameters (no copy, no fresh initialisation)."""
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta", recipe=recipe)
        new.weight, new.bias = linear.weight, linear.bias  # the meta placeholders drew no random numbers
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.recipe)  # (..., out_features)

    def extra_repr(self) -> str:
        r = self.recipe
        return f"{super().extra_repr()}, fp8: x {r.activation} 1×{r.block}, W {r.weight} {r.block}×{r.block}, " \
               f"dY {r.grad}"


def convert_to_fp8(model: nn.Module, recipe: FP8Recipe = FP8Recipe(), skip: tuple[str, ...] = ("lm_head",)
                   ) -> nn.Module:
    """Replace, in place, every nn.Linear of `model` by an FP8Linear holding its Parameters; return the model.
    Kept in their precision: Linears named in `skip` (the output head, by its last name) and any whose weight is an
    Embedding's (a tied head) — DeepSeek-V3 (§3.3) keeps the embedding and the output head out of FP8."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(recipe, FP8Recipe):
        raise ValueError(f"recipe={recipe!r} must be an FP8Recipe")
    if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
        raise ValueError(f"skip={skip!r} must be a tuple of module names")
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    names = [name for name, m in model.named_modules() if type(m) is nn.Linear and name
             and name.rpartition(".")[2] not in skip and id(m.weight) not in tied]
    if not names:
        raise ValueError(f"model ({type(model).__name__}) has no nn.Linear inside it to convert (the head and "
                         "embeddings are kept; a bare Linear: use FP8Linear.from_linear(linear))")
    for name in names:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, FP8Linear.from_linear(model.get_submodule(name), recipe))
    return model


def outlier_errors(magnitude: float = 100.0, tokens: int = 256, channels: int = 4096, outliers: int = 4,
                   fmt: str = "e4m3", seed: int = 0) -> dict[str, float]:
    """The relative quantization error ‖x̂ − x‖/‖x‖ of the ordinary channels of an activation x (tokens, channels)
    of N(0, 1) values whose `outliers` channels (drawn at random) are `magnitude` times larger, quantized to
    `fmt` per tensor, per row (token) and per 1×128 tile: {granularity: error}.

    The ordinary channels are where an outlier does its harm: it sets the scale of whatever shares it, and pushes
    the other values down the format's range, towards and below its smallest normal, where the relative error
    grows. E4M3 spans 448/2⁻⁶ ≈ 2¹⁵ of normal range, so ×100 costs nothing at any granularity; from ×10⁴ on,
    per-tensor and per-row scales lose the small values, while a tile keeps them unless it holds an outlier."""
    validation.positive("magnitude", magnitude)
    validation.positive_int("tokens", tokens)
    validation.positive_int("channels", channels)
    validation.integer("outliers", outliers, 0, channels - 1, hint="(some channels must stay ordinary)")
    f = _format(fmt)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, channels, generator=g)  # (tokens, channels)
    loud = torch.randperm(channels, generator=g)[:outliers]  # (outliers,)
    x[:, loud] *= magnitude
    ordinary = torch.ones(channels, dtype=torch.bool)
    ordinary[loud] = False
    errors = {}
    for granularity in ("tensor", "row", "tile"):
        x_hat = dequantize(*_quantize(x, f, granularity, 128), granularity)  # (tokens, channels)
        errors[granularity] = ((x_hat - x)[:, ordinary].norm() / x[:, ordinary].norm()).item()
    return errors


TRAIN_PRECISIONS = ("fp32", "bf16", "fp8")


def train_losses(precision: str, steps: int = 30, seed: int = 0, lr: float = 3e-3, batch_size: int = 8,
                 block_size: int = 32, device: str | torch.device = "cpu") -> list[float]:
    """The tiny GPT trained `steps` AdamW steps in `precision` — 'fp32', 'bf16' (autocast) or 'fp8'
    (`convert_to_fp8`: every Linear but the tied head) — from the same initial weights and batches for every
    precision and `seed` (`llmlab.quant.tiny_losses`, the loop QAT uses); the loss of every step."""
    validation.one_of("precision", precision, TRAIN_PRECISIONS)
    return quant.tiny_losses(convert_to_fp8 if precision == "fp8" else None, steps, seed, lr, batch_size,
                             block_size, device, precision="bf16" if precision == "bf16" else "fp32")


# --- `llmlab bench fp8` ---------------------------------------------------------------------------------------

def _relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx.double() - exact).norm() / exact.norm()).item()


def _accuracy_rows(m: int, k: int, n: int) -> list[dict]:
    """FP8Linear's forward and gradients against the float64 linear on random (m, k) inputs and an (n, k) weight."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5  # (m, k), (n, k)
    dy = torch.randn(m, n, generator=g)  # (m, n): the gradient arriving from above
    x_, w_ = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = fp8_linear(x_, w_)  # (m, n)
    y.backward(dy)
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    size = f"{m}x{k}x{n}"
    return [{"impl": f"fp8 linear {what} (E4M3, 1×128 / 128×128)", "peer": f"float64 {what}", "size": size,
             "rel_error": _relative_error(got, exact), "timing": "timing needs a GPU"}
            for what, got, exact in (("y", y, x64 @ w64.t()), ("dX", x_.grad, dy64 @ w64),
                                     ("dW", w_.grad, dy64.t() @ x64))]


def _timed_rows(sizes, device) -> list[dict]:
    """FP8 (quantizing x and W, then the GEMM) against the bf16 linear, and the FP8 GEMM alone against the bf16
    matmul, on (s, s) activations and an (s, s) weight per size s: two rows each, with the path the GEMM took."""
    rows = []
    for s in sizes:
        x = torch.randn(s, s, device=device, dtype=torch.bfloat16)  # (s, s) activations
        w = torch.randn(s, s, device=device) / s**0.5  # (s, s) fp32 master weight
        w16 = w.to(torch.bfloat16)  # (s, s)
        a, b = (*_quantize(x, E4M3, "tile", 128), "tile"), (*_quantize(w, E4M3, "block", 128), "block")
        path = "torch._scaled_mm blockwise" if _blockwise_gemm_applies(a[0], "tile", b[0], "block", 128) \
            else "dequantize + fp32 matmul"
        pairs = (("fp8 linear forward (quantize x, W + GEMM)", functools.partial(fp8_linear, x, w),
                  "bf16 F.linear", functools.partial(F.linear, x, w16)),
                 ("fp8 GEMM alone (operands quantized before)", functools.partial(_matmul, a, b, 128),
                  "bf16 matmul", functools.partial(torch.matmul, x, w16.t())))
        for impl, fn, peer, peer_fn in pairs:
            with torch.no_grad():
                c = timing.compare(fn, peer_fn, device=device)
            rows.append({"impl": impl, "peer": peer, "size": f"{s}x{s}x{s}", "path": path, **c.row(),
                         "impl_TFLOP/s": 2 * s**3 / c.impl.seconds / 1e12,
                         "peer_TFLOP/s": 2 * s**3 / c.peer.seconds / 1e12})
    return rows


def bench(sizes=None, steps: int = 30) -> list[dict]:
    """`llmlab bench fp8`. On a GPU: the FP8 linear's forward (quantizing both operands, then the GEMM) and the
    FP8 GEMM alone against bf16 on square `sizes` (default 1024 to 8192; 256 under smoke mode), to find where FP8
    wins. On a CPU, no timing (an FP8 product runs as an fp32 matmul there: its time says nothing of FP8):
    FP8Linear's forward and gradients against float64 on a ragged 250×1000×300, the outlier experiment at ×10² and
    ×10⁵, and `steps` training steps of the tiny GPT in fp8 and bf16 against fp32 (the last step's loss gap)."""
    t = runtime.tier()
    if t.is_gpu:
        sizes = sizes or ((256,) if t.smoke else (1024, 2048, 4096, 8192))
        return _timed_rows([validation.positive_int("sizes", s) for s in sizes], runtime.device())
    validation.positive_int("steps", steps)
    rows = _accuracy_rows(250, 1000, 300)
    for magnitude in (1e2, 1e5):
        e = outlier_errors(magnitude)
        rows.append({"impl": "E4M3, 1×128 tiles", "peer": "E4M3, per tensor",
                     "size": f"256x4096, 4 outlier channels ×{magnitude:g}", "rel_error": e["tile"],
                     "peer_rel_error": e["tensor"], "row_rel_error": e["row"], "ratio": e["tile"] / e["tensor"],
                     "timing": "timing needs a GPU"})
    fp32 = train_losses("fp32", steps)
    for precision in ("fp8", "bf16"):
        losses = train_losses(precision, steps)
        rows.append({"impl": f"{precision} training", "peer": "fp32 training", "size": f"tiny GPT, {steps} steps",
                     "loss": losses[-1], "peer_loss": fp32[-1], "loss_gap": losses[-1] - fp32[-1],
                     "timing": "timing needs a GPU"})
    return rows
