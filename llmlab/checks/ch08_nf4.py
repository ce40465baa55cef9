"""Check 8.4 (re-exported by llmlab.checks.ch08): NF4 with double quantization (QLoRA), checked against
`llmlab.nf4.quantize_nf4` and `Blockwise4bit.dequantize`.

    from llmlab.checks import ch08 as check
    check.nf4(nf4_quantize, nf4_dequantize)     # 8.4

The learner's `nf4_quantize(w)` takes a weight of any shape and floating dtype and returns a
`llmlab.nf4.Blockwise4bit`: w flattened in order, cut into blocks of 64 (the last one padded with zeros), each
block divided by its absmax c and every value coded as the index of the nearest of the 16 NF4 levels
(`llmlab.nf4.nf4_levels()`), two 4-bit codes per byte, the first in the high nibble (`codes`, (⌈n/2⌉,) uint8);
the constants c double-quantized (`absmax`, a `llmlab.nf4.DoubleQuantized`): their mean subtracted, then in
blocks of 256 each divided by its block's max |c − mean| / 448 and cast to FP8 E4M3. `nf4_dequantize(q)` gives
back ŵ = level[code] · ĉ, ĉ = fp8 code · scale + mean, fp32 in w's shape.

Each call draws Gaussian weights of odd sizes: a whole number of blocks, a ragged last block and an odd count of
codes, a single partial block, bf16 weights with outliers (a few values 20 times the rest), all-zero blocks, more
than 256 blocks (a second, ragged block of constants) and a 65,536-weight matrix (4.127 bits per parameter). Every
w/c is kept at least `MARGIN` from a midpoint between two levels (such values are set to 0, a level), so that no
fp32 rounding of the division can change a code. It compares every field of the record with llmlab's, the bits
per parameter, and the learner's dequantization of llmlab's record. A wrong answer is named: absmax per tensor,
uniform int4 levels, the nearest level by index or the level above, the nibbles swapped, codes not packed, a
ragged last block dropped or refused, a zero block divided by 0, no double quantization, constants not offset by
their mean, and a dequantization that forgets the mean.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

from llmlab.checks import Hint, Mismatch, assert_close, check, fresh_rng
from llmlab.nf4 import Blockwise4bit, DoubleQuantized, NF4Config, int4_levels, nf4_levels, quantize_nf4, unpack_4bit

__all__ = ["nf4", "nf4_weight", "MARGIN"]

MARGIN = 1e-4  # the least distance of every w/c from a midpoint between two NF4 levels (see the module docstring)
_B, _GROUP, _FP8_MAX = 64, 256, 448.0  # QLoRA's block of weights, block of constants, FP8 E4M3's largest value

_FORMULA = ("flat = w.reshape(-1).float(); blocks = F.pad(flat, (0, -n % 64)).view(-1, 64); c = blocks.abs()."
            "amax(1); x = blocks / where(c > 0, c, 1); codes = bucketize(x, (levels[1:] + levels[:-1]) / 2)[:n]; "
            "packed = codes[0::2] << 4 | codes[1::2] (an odd n padded with a 0 code); mean = c.mean(); groups of 256 "
            "of c − mean (padded with 0); scale = max|·| / 448 (1 where 0); fp8 = ((c − mean) / scale).to(torch."
            "float8_e4m3fn); Blockwise4bit(packed, DoubleQuantized(fp8, scale, mean.reshape(1), 256), levels, "
            "w.shape, 64). Dequantize: ĉ = fp8.float() · scale per constant + mean; ŵ = levels[code] · ĉ of its block")
_CODES = Hint(
    nudge="look at how you turn a block's values into 4-bit codes: what you divide by, and which level you pick",
    idea="each block of 64 is divided by its own largest magnitude, so it lies in [−1, 1]; each value then takes "
         "the index of the NF4 level nearest to it in value (the levels are not evenly spaced: compare with the "
         "midpoints between neighbouring levels)",
    formula=_FORMULA)
_HINTS = {
    "per tensor": _CODES, "uniform": _CODES, "by index": _CODES, "level above": _CODES,
    "nibbles": Hint(
        nudge="look at the order of the two codes in a byte",
        idea="bitsandbytes' layout, as llmlab.nf4.pack_4bit: the first code of a pair in the high nibble (<< 4), the "
             "second in the low one",
        formula=_FORMULA),
    "unpacked": Hint(
        nudge="look at how many bytes your codes take",
        idea="a 4-bit code is half a byte: two codes share a uint8, which is what makes 4 bits per weight",
        formula=_FORMULA),
    "ragged": Hint(
        nudge="look at the last block of a weight whose size 64 does not divide",
        idea="the last block is shorter: pad the flattened weight with zeros to a whole number of blocks (zeros do "
             "not change a block's absmax), quantize, and keep the first n codes; an odd n pads the last byte",
        formula=_FORMULA),
    "zero block": Hint(
        nudge="look at a block whose 64 values are all zero",
        idea="its absmax is 0 and w / 0 is NaN; divide such a block by 1 instead: every value is 0, an NF4 level",
        formula=_FORMULA),
    "no double quant": Hint(
        nudge="look at how you store the block constants",
        idea="QLoRA's double quantization stores the fp32 absmax constants themselves in 8 bits (FP8 E4M3), in "
             "blocks of 256 with an fp32 scale each and one fp32 mean: 8/64 bits per weight instead of 32/64",
        formula=_FORMULA),
    "no mean": Hint(
        nudge="look at what you subtract from the constants before their second quantization",
        idea="the absmax constants are all positive; their mean is subtracted first, so that the centred values "
             "use both signs of the symmetric FP8 type, and dequantization adds it back",
        formula=_FORMULA),
}


def _normalized(flat: torch.Tensor, block: int) -> torch.Tensor:
    """(n,) each value over its block's absmax (a zero block over 1), in fp32."""
    n = flat.numel()
    blocks = F.pad(flat.float(), (0, -n % block)).view(-1, block)  # (n_blocks, block)
    c = blocks.abs().amax(dim=1, keepdim=True)  # (n_blocks, 1)
    return (blocks / torch.where(c > 0, c, torch.ones_like(c))).view(-1)[:n]  # (n,)


def nf4_weight(shape, dtype: torch.dtype = torch.float32, zero_blocks: int = 0, outliers: int = 0,
               seed: int | None = None) -> torch.Tensor:
    """A weight for the NF4 check: Gaussian (σ drawn in 0.01–0.11), `outliers` values 20 times larger, `zero_blocks`
    blocks of 64 set to zero, in `dtype`; every value whose w/c lies within MARGIN of a midpoint between two NF4
    levels is set to 0 (a level: a block's absmax has |w/c| = 1, beyond the outermost midpoint 0.86, so c stays)."""
    g = torch.Generator().manual_seed(seed if seed is not None else random.randrange(2**31))
    n = math.prod(shape)
    w = torch.randn(n, generator=g) * (0.01 + 0.1 * torch.rand(1, generator=g))  # (n,)
    w[torch.randperm(n, generator=g)[:outliers]] *= 20
    for b in torch.randperm(-(-n // _B), generator=g)[:zero_blocks].tolist():
        w[b * _B:(b + 1) * _B] = 0
    w = w.to(dtype).float()  # the margin is measured on the values the learner is given
    levels = nf4_levels()
    midpoints = (levels[1:] + levels[:-1]) / 2  # (15,)
    near = ((_normalized(w, _B)[:, None] - midpoints).abs() < MARGIN).any(dim=1)  # (n,)
    return w.masked_fill(near, 0).view(shape).to(dtype)


def _cases(rng: random.Random) -> list[tuple[tuple[int, ...], torch.dtype, int, int]]:
    """(shape, dtype, zero blocks, outliers) of every case."""
    cases = [((8, 64), torch.float32, 0, 0),  # 512 weights: 8 whole blocks
             ((33, 31), torch.float32, 1, 0),  # 1023: a ragged last block of 63, an odd count of codes, a zero block
             ((5,), torch.float32, 0, 0),  # one partial block
             ((7, 9, 11), torch.bfloat16, 0, 3),  # 693 bf16 weights (QLoRA quantizes a bf16 model), outliers
             ((130, 129), torch.float32, 2, 5),  # 16,770: 263 blocks, so a second, ragged block of 7 constants
             ((256, 256), torch.float32, 0, 0)]  # 1024 blocks, 4 groups of 256: 4.127 bits per parameter
    shape = (rng.randrange(1, 120, 2), rng.randrange(1, 120, 2))
    cases.append((shape, rng.choice([torch.float32, torch.bfloat16]), rng.randint(0, 2), rng.randint(0, 4)))
    return cases


@check("8.4", "NF4 with double quantization", hint=Hint(
    nudge="look at the three stages in turn: the block absmax, the nearest NF4 level and its packing, and the "
          "second quantization of the constants",
    idea="blocks of 64 divided by their absmax, each value coded by the index of its nearest NF4 level, two codes "
         "a byte; the absmax constants, minus their mean, stored as FP8 in blocks of 256 with a scale each",
    formula=_FORMULA))
def nf4(quantize, dequantize):
    """`quantize(w)` -> a Blockwise4bit, `dequantize(q)` -> ŵ: see the module docstring."""
    for shape, dtype, zero_blocks, outliers in _cases(fresh_rng()):
        w = nf4_weight(shape, dtype, zero_blocks, outliers)
        what = (f"nf4_quantize(w of shape {shape}, {str(dtype)[6:]}"
                + (f", {zero_blocks} all-zero block{'s' * (zero_blocks > 1)}" if zero_blocks else "")
                + (f", {outliers} outliers" if outliers else "") + ")")
        ref = quantize_nf4(w)
        _judge_quantize(quantize, w, ref, what)
        _judge_dequantize(dequantize, ref, what.replace("nf4_quantize", "nf4_dequantize(nf4_quantize", 1) + ")")


def _call(quantize, w: torch.Tensor, what: str):
    try:
        q = quantize(w)
    except RuntimeError as e:
        if w.numel() % _B:
            raise Mismatch(f"{what}: your code raised RuntimeError ({e}) on a weight of {w.numel()} values, which "
                           f"64 does not divide: pad the last block with zeros", mistake="ragged",
                           hint=_HINTS["ragged"]) from e
        raise
    if not isinstance(q, Blockwise4bit):
        raise Mismatch(f"{what} returned {type(q).__name__}, expected a llmlab.nf4.Blockwise4bit(codes, absmax, "
                       "levels, shape, block_size)")
    return q


def _judge_quantize(quantize, w: torch.Tensor, ref: Blockwise4bit, what: str) -> None:
    n = w.numel()
    q = _call(quantize, w, what)
    if q.block_size != _B or tuple(q.shape) != tuple(w.shape):
        raise Mismatch(f"{what}: block_size={q.block_size}, shape={tuple(q.shape)}; expected 64 and {tuple(w.shape)}")
    levels = torch.as_tensor(q.levels)
    if levels.shape != (16,) or not torch.equal(levels.float(), ref.levels):
        raise Mismatch(f"{what}: levels = {levels.flatten()[:4].tolist()}…, expected NF4's 16 (llmlab.nf4."
                       "nf4_levels()), spaced as the quantiles of a normal distribution", mistake="uniform",
                       hint=_HINTS["uniform"])
    codes = q.codes
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise Mismatch(f"{what}: codes is {getattr(codes, 'dtype', type(codes).__name__)}, expected uint8 bytes")
    if codes.shape != ref.codes.shape:
        if codes.numel() == n:
            raise Mismatch(f"{what}: {n} bytes of codes, one per weight; two 4-bit codes share a byte: "
                           f"{ref.codes.numel()} bytes", mistake="unpacked", hint=_HINTS["unpacked"])
        if codes.numel() == n // _B * _B // 2:
            raise Mismatch(f"{what}: {codes.numel()} bytes of codes, for the {n // _B} whole blocks only: the last "
                           f"{n % _B} weights, a ragged block, are dropped", mistake="ragged", hint=_HINTS["ragged"])
        raise Mismatch(f"{what}: codes has shape {tuple(codes.shape)}, expected ({ref.codes.numel()},): ⌈n/2⌉ bytes")
    if not torch.equal(codes, ref.codes):
        _name_codes(unpack_4bit(codes, n), w, ref, what)
    _judge_constants(q, w, ref, what)
    if q.bits_per_parameter != ref.bits_per_parameter:
        raise Mismatch(f"{what}: {q.bits_per_parameter:.4f} bits per parameter stored, expected "
                       f"{ref.bits_per_parameter:.4f} (the packed codes, FP8 constants, an fp32 scale per 256 and "
                       "one fp32 mean)")


def _code_variants(w: torch.Tensor) -> dict[str, tuple[str, torch.Tensor]]:
    """The (n,) codes a plausible mistake gives: key → (what it does, its codes)."""
    flat, n = w.reshape(-1).float(), w.numel()
    x = _normalized(flat, _B)  # (n,)
    plain = NF4Config(double_quant=False)
    return {
        "per tensor": ("the absmax is taken over the whole tensor; QLoRA takes one per block of 64 (an outlier then "
                       "spoils only its block)", unpack_4bit(quantize_nf4(
                           w, NF4Config(block_size=n, double_quant=False)).codes, n)),
        "uniform": ("the levels are evenly spaced (int4); NF4's are the quantiles of a normal distribution, "
                    "llmlab.nf4.nf4_levels()", unpack_4bit(quantize_nf4(w, plain, int4_levels()).codes, n)),
        "by index": ("the code is round((x + 1)/2 · 15), the nearest index as if the levels were evenly spaced "
                     "(torch.linspace(−1, 1, 16)); pick the NF4 level nearest in value",
                     ((x + 1) / 2 * 15).round().clamp(0, 15).to(torch.uint8)),
        "level above": ("each value takes the first level at or above it (bucketize against the levels themselves); "
                        "take the nearest, by the midpoints between levels",
                        torch.bucketize(x, nf4_levels()).clamp(max=15).to(torch.uint8)),
    }


def _name_codes(got: torch.Tensor, w: torch.Tensor, ref: Blockwise4bit, what: str) -> None:
    n = w.numel()
    want = unpack_4bit(ref.codes, n)  # (n,)
    differs = got != want
    head = f"{what}: {int(differs.sum())} of {n} codes differ"
    if torch.equal(unpack_4bit(ref.codes, n + n % 2).view(-1, 2).flip(1).reshape(-1)[:n], got):
        raise Mismatch(f"{head}: the two codes of each byte are swapped; the first goes in the high nibble",
                       mistake="nibbles", hint=_HINTS["nibbles"])
    zero = F.pad(w.reshape(-1), (0, -n % _B)).view(-1, _B).abs().amax(1) == 0  # (n_blocks,)
    in_zero = zero.repeat_interleave(_B)[:n]  # (n,)
    if zero.any() and bool(in_zero[differs].all()):
        raise Mismatch(f"{head}, all in the all-zero block: its absmax is 0 and w/0 is NaN; there every code is "
                       f"that of level 0.0 ({int(want[in_zero][0])})", mistake="zero block", hint=_HINTS["zero block"])
    for key, (why, variant) in _code_variants(w).items():
        if not torch.equal(variant, want) and torch.equal(variant, got):
            raise Mismatch(f"{head}: {why}", mistake=key, hint=_HINTS[key])
    assert_close(got, want, what=f"{what}: the 4-bit codes (unpacked)", rtol=0, atol=0)


def _constants(w: torch.Tensor) -> torch.Tensor:
    """(n_blocks,) the exact fp32 absmax of each block of 64 of `w`."""
    return F.pad(w.reshape(-1).float(), (0, -w.numel() % _B)).view(-1, _B).abs().amax(dim=1)


def _per_constant(scale: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """(n_blocks,) each constant's scale, from one per block of 256 constants."""
    return scale.repeat_interleave(_GROUP)[:n_blocks]


def _judge_constants(q: Blockwise4bit, w: torch.Tensor, ref: Blockwise4bit, what: str) -> None:
    a, r = q.absmax, ref.absmax
    if not isinstance(a, DoubleQuantized):
        raise Mismatch(f"{what}: absmax is {type(a).__name__}, the constants as they are: double-quantize them into "
                       "a llmlab.nf4.DoubleQuantized (8 bits each, not 32)", mistake="no double quant",
                       hint=_HINTS["no double quant"])
    if a.block_size != _GROUP:
        raise Mismatch(f"{what}: absmax.block_size = {a.block_size}, expected QLoRA's 256 constants per scale")
    for name in ("mean", "scale", "codes"):
        got, want = getattr(a, name), getattr(r, name)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            raise Mismatch(f"{what}: absmax.{name} is {getattr(got, 'dtype', type(got).__name__)} of shape "
                           f"{tuple(getattr(got, 'shape', ()))}, expected {want.dtype} of shape {tuple(want.shape)}")
    c = _constants(w)  # (n_blocks,)
    mean = float(r.mean)
    if mean > 0 and abs(float(a.mean)) <= 1e-6 * mean:
        raise Mismatch(f"{what}: absmax.mean = {float(a.mean):g}, expected the constants' mean {mean:.6g}: subtract "
                       "it before the second quantization", mistake="no mean", hint=_HINTS["no mean"])
    # a mean of ≤ 1024 fp32 values in another order than torch's: within log2(1024)·2⁻²⁴ ≈ 6e-7 of it
    assert_close(a.mean, r.mean, what=f"{what}: absmax.mean (the constants' mean)", rtol=1e-6, atol=0)
    groups = F.pad(c, (0, -c.numel() % _GROUP)).view(-1, _GROUP)  # (n_groups, 256)
    uncentred = groups.abs().amax(dim=1) / _FP8_MAX  # (n_groups,): the scale without the mean subtracted
    # max|c − mean| / 448 inherits the mean's rounding (≤ 6e-7·mean, above) and rounds once more
    close = dict(rtol=1e-6, atol=1e-6 * mean / _FP8_MAX)
    if not torch.allclose(a.scale, r.scale, **close) and torch.allclose(a.scale, uncentred, **close):
        raise Mismatch(f"{what}: absmax.scale = max|c| / 448 per block of 256: the constants' mean is not "
                       "subtracted first", mistake="no mean", hint=_HINTS["no mean"])
    assert_close(a.scale, r.scale, what=f"{what}: absmax.scale (max|c − mean| / 448 per 256 constants)", **close)
    x = (c.double() - mean) / _per_constant(r.scale, c.numel()).double()  # (n_blocks,) llmlab's, before rounding
    got, want = a.codes.double(), r.codes.double()  # (n_blocks,)
    # another fp32 order of the mean and scale moves x by ≤ 1e-6·(|x| + mean/scale) (above): a code within 1e-5 of
    # that as near to x as llmlab's rounds the same number, on the other side of a tie
    slack = 1e-5 * (x.abs() + mean / _per_constant(r.scale, c.numel()).double())
    if bool(((got == want) | ((got - x).abs() <= (want - x).abs() + slack)).all()):
        return
    if torch.equal(got, (c / _per_constant(uncentred, c.numel())).to(r.codes.dtype).double()):
        raise Mismatch(f"{what}: absmax.codes are c / scale: the constants' mean is not subtracted first",
                       mistake="no mean", hint=_HINTS["no mean"])
    assert_close(got, want, what=f"{what}: absmax.codes (FP8 E4M3 of (c − mean) / scale)", rtol=0, atol=0)


def _judge_dequantize(dequantize, ref: Blockwise4bit, what: str) -> None:
    n, a = ref.numel, ref.absmax
    got = dequantize(ref)
    want = ref.dequantize()  # w's shape, fp32
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        raise Mismatch(f"{what} returned {getattr(got, 'dtype', type(got).__name__)} of shape "
                       f"{tuple(getattr(got, 'shape', ()))}, expected fp32 of shape {tuple(want.shape)}")
    scale = _per_constant(a.scale, a.codes.numel())  # (n_blocks,)
    size = (a.mean.abs() + a.codes.float().abs() * scale).repeat_interleave(_B)[:n].view(want.shape)  # |terms| of ĉ
    # ŵ = level·(code·scale + mean) is three fp32 roundings of terms ≤ size; another order (level·code·scale +
    # level·mean, say) rounds as often: the two differ by ≤ 6·2⁻²⁴·size ≈ 3.6e-7·size. A wrong level is ≥ 0.04·ĉ off
    atol = 1e-6 * size
    if bool(((got - want).abs() <= atol).all()):
        return
    values = ref.levels[unpack_4bit(ref.codes, n).long()]  # (n,)
    no_mean = (F.pad(values, (0, -n % _B)).view(-1, _B) * (a.codes.float() * scale)[:, None]).view(-1)[:n]
    if bool(((got - no_mean.view(want.shape)).abs() <= atol).all()):
        raise Mismatch(f"{what}: ŵ = level · code · scale: the constants' mean is not added back (ĉ = code · scale "
                       "+ mean)", mistake="no mean", hint=_HINTS["no mean"])
    differs = (~((got - want).abs() <= atol)).view(-1)  # (n,)
    first = int(differs.nonzero()[0])
    raise Mismatch(f"{what}: {int(differs.sum())} of {n} values differ from llmlab's Blockwise4bit.dequantize(); "
                   f"first at flat index {first}: got {got.view(-1)[first].item():.6g}, expected "
                   f"{want.view(-1)[first].item():.6g}")
