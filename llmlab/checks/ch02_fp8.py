"""Check 2.7 (solutions/02_parallelism.ipynb): FP8 with fine-grained tile scales, and the matmul that reads it back.

    from llmlab.checks import ch02 as check
    check.fp8_quantization(saturating_cast, quantize_tiles, fp8_matmul)    # 2.7, against llmlab.fp8

The learner writes DeepSeek-V3's fine-grained FP8 (DeepSeek-AI 2024, §3.3.1-3.3.2, Fig. 7), which `llmlab.fp8`
implements:

- `saturating_cast(v, dtype)`: v rounded to torch.float8_e4m3fn or torch.float8_e5m2, what lies beyond ±max (±inf
  included) becoming ±max, NaN staying NaN — `fp8.cast`;
- `quantize_tiles(x, rows)`: x (M, K) fp32 as E4M3 codes (M, K) and fp32 scales (⌈M/rows⌉, ⌈K/128⌉), one per
  rows×128 tile (rows=1: activations' 1×128 tiles; rows=128: weights' 128×128 blocks): s = amax/448 of the tile, 1
  for an all-zero tile, q = saturating_cast(x/s) — `fp8.quantize(x, "e4m3", "tile" | "block")`;
- `fp8_matmul(x_q, x_s, w_q, w_s)`: y = X·Wᵀ (M, N) fp32 for x in 1×128 tiles and W (N, K) in 128×128 blocks,
  each operand dequantized with its scales and the products summed in fp32.

Every case is fresh: N(0, 1) values with a few outlier channels 10²-10⁵ times larger (the activations FP8 has to
survive), odd sizes whose last tile is short, an all-zero tile planted. The cast is compared with `fp8.cast` on
values from 10⁻⁵ to 10⁶ and the edges (±max, the rounding band above it, ±inf, NaN); the codes and scales with
`fp8.quantize`'s bit for bit (the recipe is exact: an fp32 amax, one fp32 division by 448, one rounding to E4M3);
the product with the float64 product of `fp8.dequantize`'s operands, within the bound of fp32 arithmetic derived
at `_product_bound`. Known mistakes are named: no saturation, E5M2 instead of E4M3, one scale for the whole tensor,
the scale inverted, the last (short) tile dropped, an all-zero tile divided by 0, the codes multiplied without their
scales, the sums in 16-bit precision.
"""

from __future__ import annotations

import random

import torch

from llmlab import fp8
from llmlab.checks import Hint, Mismatch, check, fresh_rng

__all__ = ["fp8_quantization"]

BLOCK = 128  # a tile's width (and a weight block's height): DeepSeek-V3's
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
U32 = 2.0**-24  # fp32's unit roundoff

_QUANTIZE = ("pad |x| with zeros to whole tiles (F.pad(x.abs(), (0, -K % 128, 0, -M % rows))), reshape to "
             "(⌈M/rows⌉, rows, ⌈K/128⌉, 128) and take the amax over dims 1 and 3; scales = amax / 448 "
             "(torch.finfo(torch.float8_e4m3fn).max), 1 where that is 0; expand them to (M, K) with repeat_interleave "
             "(rows along dim 0, 128 along dim 1) cut to x's shape, and return (saturating_cast(x / expanded, "
             "torch.float8_e4m3fn), scales)")
_MATMUL = ("dequantize each operand: a = x_q.float() × x_s expanded to (M, K) (each scale over its 1×128 tile), b = "
           "w_q.float() × w_s expanded to (N, K) (each over its 128×128 block), both cut to shape; return a @ b.T, "
           "fp32 operands and an fp32 result")
_HINTS = {
    "saturate": Hint(
        nudge="cast 1e5 and float('inf') to each of the two formats with your function: what comes back?",
        idea="beyond ±max the plain .to() gives inf in E5M2 (and NaN in E4M3 on PyTorch versions whose conversion "
             "does not saturate): clamp to ±max first, so that an overflow costs precision, not the whole value",
        formula="v.float().clamp(-m, m).to(dtype) with m = torch.finfo(dtype).max (448 for E4M3, 57344 for E5M2); "
                "clamp keeps NaN"),
    "e5m2": Hint(
        nudge="which FP8 dtype are your codes, and which largest value do your scales map a tile's amax to?",
        idea="DeepSeek-V3 stores every tensor in E4M3, one mantissa bit more than E5M2 (half the rounding error): "
             "with a scale per tile, the tile's own range is all the format has to span",
        formula="scales = amax / torch.finfo(torch.float8_e4m3fn).max (448); codes = saturating_cast(x / scales, "
                "torch.float8_e4m3fn)"),
    "per tensor": Hint(
        nudge="how many different scales does your function return for an x with one outlier channel?",
        idea="one scale per rows×128 tile, from that tile's own amax: an outlier then raises only its own tile's "
             "scale, and the small values elsewhere keep E4M3's precision",
        formula=_QUANTIZE),
    "inverted": Hint(
        nudge="multiply one of your codes by its scale: do you get the value of x back?",
        idea="the scale is what a code is multiplied by to read the value back, amax/448 (small for a tile of "
             "small values); x is divided by it to make the codes",
        formula=_QUANTIZE),
    "last tile": Hint(
        nudge="take K = 300: how many 1×128 tiles has a row, and which scale covers its columns 256…299?",
        idea="a row has ⌈K/128⌉ tiles (a weight ⌈M/128⌉ rows of blocks): the last one is short, and gets a scale of "
             "its own from its own values",
        formula=_QUANTIZE),
    "zero tile": Hint(
        nudge="what is amax / 448 for a tile of zeros, and what is 0 divided by it?",
        idea="an all-zero tile has amax 0: its scale would be 0 and its codes 0/0 = NaN. Any nonzero scale gives it "
             "codes 0; llmlab gives it 1, and so must yours",
        formula="scales = torch.where(scales > 0, scales, torch.ones_like(scales)), before dividing x by them"),
    "scales": Hint(
        nudge="compare your y with X·Wᵀ computed from the dequantized operands: by what factor is it off?",
        idea="a code times its scale is the value: every element of x_q is multiplied by its tile's scale, "
             "x_s[i, k // 128], and every element of w_q by its block's, w_s[n // 128, k // 128], before the products",
        formula=_MATMUL),
    "accumulate": Hint(
        nudge="which dtype do your dequantized operands, and the sums of the product, have?",
        idea="a code holds 4 significant bits, but a sum of K products needs many more: dequantize to fp32 and sum "
             "in fp32 (DeepSeek-V3 moves the tensor cores' partial sums to fp32 every 128 products for this reason)",
        formula=_MATMUL),
}


def _per_element(scales: torch.Tensor, shape: tuple[int, int], rows: int) -> torch.Tensor:
    """Each scale over its rows×128 tile, cut to shape: (M, K)."""
    m, k = shape
    return scales.repeat_interleave(rows, 0)[:m].repeat_interleave(BLOCK, 1)[:, :k]  # (M, K)


def _values(gen: torch.Generator, m: int, k: int, zero: tuple[int, int] | None, rows: int) -> torch.Tensor:
    """x (m, k) fp32: N(0, 1) with 1-3 outlier channels 10²-10⁵ times larger; the tile `zero` (tile row, tile
    column) of rows×128 set to 0."""
    x = torch.randn(m, k, generator=gen)  # (m, k)
    loud = torch.randperm(k, generator=gen)[:int(torch.randint(1, 4, (), generator=gen))]  # (≤ 3,) channels
    x[:, loud] *= 10.0 ** (2 + 3 * torch.rand(len(loud), generator=gen))  # (m, ≤ 3): each ×10² … ×10⁵
    if zero is not None:
        i, j = zero
        x[i * rows:(i + 1) * rows, j * BLOCK:(j + 1) * BLOCK] = 0.0
    return x


def _zero_tile(rng: random.Random, m: int, k: int, rows: int) -> tuple[int, int]:
    return rng.randrange(-(-m // rows)), rng.randrange(-(-k // BLOCK))


# --- saturating_cast --------------------------------------------------------------------------------------------

def _cast_inputs(rng: random.Random) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    n = rng.randint(100, 300)
    spread = torch.randn(n, generator=gen) * 10.0 ** (11 * torch.rand(n, generator=gen) - 5)  # (n,): 1e-5 … 1e6
    edges = [0.0, 448.0, 449.0, 463.9, 464.0, 470.0, 480.0, 500.0, 57344.0, 60000.0, 61440.0, 65536.0, 1e5,
             float("inf")]  # E4M3's and E5M2's max, the bands above them that round to max or beyond, and inf
    edges = torch.tensor(edges + [-e for e in edges[1:]] + [float("nan")])
    return torch.cat([spread, edges])[torch.randperm(n + len(edges), generator=gen)]  # (n + 28,) in random order


def _check_cast(saturating_cast, v: torch.Tensor, dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    what = f"saturating_cast(v, torch.{name}) on {len(v)} values from 1e-5 to 1e6, ±max, ±inf and NaN"
    got = saturating_cast(v.clone(), dtype)
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(v.shape):
        raise Mismatch(f"{what}: got {type(got).__name__} of shape {tuple(getattr(got, 'shape', ()))}, expected a "
                       f"tensor of shape {tuple(v.shape)}")
    if got.dtype != dtype:
        raise Mismatch(f"{what}: got dtype {got.dtype}, expected torch.{name}: cast to the dtype asked for")
    want = fp8.cast(v, "e4m3" if dtype == E4M3 else "e5m2")
    g, w = got.float(), want.float()  # (n,): FP8 values are exact in fp32
    same = (g == w) | (g.isnan() & w.isnan())
    if bool(same.all()):
        return
    i = int((~same).nonzero()[0])
    head = f"{what}: {int((~same).sum())} values differ; first v = {v[i].item():g} gives {g[i].item():g}, " \
           f"expected {w[i].item():g}"
    if not bool(g[i].isfinite()) and bool(w[i].isfinite()):
        fmax = torch.finfo(dtype).max
        raise Mismatch(f"{head}: beyond ±{fmax:g} the cast must saturate to ±{fmax:g}, not give {g[i].item():g}",
                       mistake="saturate", hint=_HINTS["saturate"])
    raise Mismatch(f"{head} (round to nearest, ties to even, as .to({name}) does inside the range)",
                   hint=_HINTS["saturate"])


# --- quantize_tiles ---------------------------------------------------------------------------------------------

def _pair(got, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(got, tuple | list) or len(got) != 2 or not all(isinstance(t, torch.Tensor) for t in got):
        raise Mismatch(f"{what}: got {type(got).__name__} {got!r:.60}, expected the pair (codes, scales) of tensors")
    return got[0], got[1]


def _check_layout(q, s, want_s, x, rows: int, what: str) -> None:
    """The codes' dtype and shape, the scales' shape and dtype."""
    (m, k), tiles = x.shape, tuple(want_s.shape)
    if q.dtype == E5M2:
        raise Mismatch(f"{what}: the codes are float8_e5m2; DeepSeek-V3's recipe stores them in E4M3 "
                       "(torch.float8_e4m3fn)", mistake="e5m2", hint=_HINTS["e5m2"])
    if q.dtype != E4M3:
        raise Mismatch(f"{what}: the codes have dtype {q.dtype}, expected torch.float8_e4m3fn")
    floor = (m // rows, k // BLOCK)
    short = " (the last, short tile dropped?)" if tuple(q.shape) in ((m, k // BLOCK * BLOCK),
                                                                      (m // rows * rows, k)) else ""
    if tuple(q.shape) != (m, k):
        raise Mismatch(f"{what}: the codes have shape {tuple(q.shape)}, expected x's, {(m, k)}{short}",
                       mistake="last tile" if short else None, hint=_HINTS["last tile"] if short else None)
    if tuple(s.shape) != tiles:
        if tuple(s.shape) in ((), (1,), (1, 1)) and tiles != (1, 1):
            raise Mismatch(f"{what}: one scale for the whole tensor; expected one per {rows}×{BLOCK} tile, "
                           f"{tiles}", mistake="per tensor", hint=_HINTS["per tensor"])
        if tuple(s.shape) == floor or tuple(s.shape) in ((floor[0], tiles[1]), (tiles[0], floor[1])):
            raise Mismatch(f"{what}: scales of shape {tuple(s.shape)}, expected {tiles}: ⌈M/{rows}⌉ × ⌈K/{BLOCK}⌉ "
                           "tiles — the last, short tile has a scale too", mistake="last tile",
                           hint=_HINTS["last tile"])
        per_row = rows > 1 and s.dim() == 2 and s.shape[0] == m
        blocks = " (one per 1×128 tile; rows=128 asks one per 128×128 block)" if per_row else ""
        raise Mismatch(f"{what}: scales of shape {tuple(s.shape)}, expected {tiles}{blocks}")
    if s.dtype != torch.float32:
        raise Mismatch(f"{what}: scales of dtype {s.dtype}, expected torch.float32")


def _scale_diagnosis(s: torch.Tensor, want: torch.Tensor, x: torch.Tensor, nonzero: torch.Tensor) -> tuple:
    """What the learner's scales are, where they are not llmlab's: (text, mistake key) or ('', None)."""
    got, amax = s.double()[nonzero], (want.double() * 448.0)[nonzero]  # the tiles' amax (×448 exact in float64)
    if not bool(got.isfinite().all()):
        return "", None
    # a diagnosis, not the verdict: a formula the learner used matches to fp32 rounding (~1e-7), another is off by
    # a factor (448, 1/amax², 128) or by the one-ulp difference the last test names
    close = lambda value: bool(torch.allclose(got, value, rtol=1e-5, atol=0))  # noqa: E731
    known = [(torch.full_like(got, x.abs().max().item() / 448.0), "every tile's scale is the whole tensor's amax/448: "
              "one scale per tensor, so an outlier sets it for all", "per tensor"),
             (448.0 / amax, "they are 448/amax, the reciprocals of amax/448: the scale is what a code is multiplied "
              "by to read x back", "inverted"),
             (amax / 57344.0, "they are amax/57344, scaled to E5M2's largest value; E4M3's is 448", "e5m2"),
             (amax, "they are the tiles' amax: divide it by E4M3's largest value, 448, so that the largest |x| of a "
              "tile becomes ±448", None)]
    for value, text, mistake in known:
        if close(value) and not close(want.double()[nonzero]):
            return text, mistake
    if close(want.double()[nonzero]):
        return ("within an fp32 rounding of amax/448 but not equal: compute amax / 448 as one fp32 division (not a "
                "multiplication by 1/448), as llmlab does"), None
    return "", None


def _check_quantize(quantize_tiles, x: torch.Tensor, rows: int, zero: tuple[int, int] | None) -> None:
    (m, k), granularity = x.shape, "tile" if rows == 1 else "block"
    planted = "" if zero is None else f", the {rows}×{BLOCK} tile {zero} all zeros"
    what = (f"quantize_tiles(x, rows={rows}) for x of shape {(m, k)} (outlier channels up to "
            f"{x.abs().max().item():.3g}{planted})")
    want_q, want_s = fp8.quantize(x, "e4m3", granularity)  # (M, K), (⌈M/rows⌉, ⌈K/128⌉)
    q, s = _pair(quantize_tiles(x.clone(), rows), what)
    _check_layout(q, s, want_s, x, rows, what)
    nonzero = torch.ones_like(want_s, dtype=torch.bool)  # (⌈M/rows⌉, ⌈K/128⌉): False at the planted zero tile
    if zero is not None:
        nonzero[zero] = False
    if not torch.equal(s[nonzero], want_s[nonzero]):
        i = tuple(int(t) for t in (s != want_s).logical_and(nonzero).nonzero()[0])
        text, mistake = _scale_diagnosis(s, want_s, x, nonzero)
        raise Mismatch(f"{what}: the scale of tile {i} is {s[i].item():.6g}, llmlab's (amax/448) "
                       f"{want_s[i].item():.6g}" + (f": {text}" if text else ""), mistake=mistake,
                       hint=_HINTS.get(mistake))
    if zero is not None and s[zero].item() != 1.0:
        nan = int(q.float().isnan().sum())
        raise Mismatch(f"{what}: the all-zero tile {zero} has the scale {s[zero].item():g}"
                       + (f" and {nan} NaN codes (0/0)" if nan else "") + "; an all-zero tile gets the scale 1",
                       mistake="zero tile", hint=_HINTS["zero tile"])
    g, w = q.float(), want_q.float()  # (M, K): E4M3 values are exact in fp32
    differs = (g != w) & ~(g.isnan() & w.isnan())
    if bool(differs.any()):
        i = tuple(int(t) for t in differs.nonzero()[0])
        per_element = _per_element(want_s, (m, k), rows)  # (M, K)
        times = torch.equal(g, fp8.cast(x * per_element).float())
        raise Mismatch(f"{what}: {int(differs.sum())} of {m * k} codes differ from llmlab's; first at {i}: "
                       f"{g[i].item():g}, expected {w[i].item():g} (x = {x[i].item():.6g}, scale "
                       f"{per_element[i].item():.6g})"
                       + (": the codes are x × scale; x is divided by its scale" if times else ""),
                       mistake="inverted" if times else None, hint=_HINTS["inverted"] if times else None)


def _quantize_cases(rng: random.Random) -> list[tuple[int, int, int]]:
    """(rows, M, K): the scripted sizes first (a short last tile, one value, whole tiles), then random ones."""
    return [(1, 3, 300), (1, 1, 1), (128, 130, 200), (1, 64, 256), (128, 256, 384),
            (1, rng.randint(1, 40), rng.randint(129, 700)), (1, rng.randint(1, 40), rng.randint(1, 127)),
            (128, rng.randint(1, 300), rng.randint(1, 400)), (128, rng.randint(129, 300), rng.randint(129, 400))]


# --- fp8_matmul -------------------------------------------------------------------------------------------------

def _product_bound(sums: torch.Tensor, k: int) -> torch.Tensor:
    """How far an fp32 computation of y = â·b̂ᵀ may lie from the float64 product of llmlab's dequantized operands
    â (M, K), b̂ (N, K), given sums = Σ_k |â_k||b̂_k| (M, N): (M, N).

    Each term â_k·b̂_k meets at most K + 5 fp32 roundings of relative 2⁻²⁴: two where the learner dequantizes
    (q·s, for each operand; a product of two E4M3 codes is exact), or two where a partial sum is scaled by s_x and
    by s_w instead (DeepSeek-V3's order), at most K − 1 additions in any order, one more adding a partial sum to
    the output, and llmlab's own two roundings of q·s to fp32 in the reference. So |y − y_ref| ≤ (K + 5)·2⁻²⁴
    Σ_k |â_k||b̂_k|, and 1.01 covers the second-order terms ((K + 5)·2⁻²⁴ < 10⁻⁴ at the check's K ≤ 700). On the
    cases of 300 fresh runs, the fp32 answers (dequantize then multiply, and DeepSeek-V3's order) came within 0.39
    of the bound, while bf16 operands and sums (relative 2⁻⁹ per rounding) exceeded it 36× or more on some element
    of every case with K > 1."""
    return 1.01 * (k + 5) * U32 * sums  # (M, N)


def _check_matmul(fp8_matmul, x: torch.Tensor, w: torch.Tensor, planted: str) -> None:
    (m, k), n = x.shape, w.shape[0]
    what = f"fp8_matmul for x of shape {(m, k)} (outlier channels up to {x.abs().max().item():.3g}{planted}), W " \
           f"{(n, k)}"
    x_q, x_s = fp8.quantize(x, "e4m3", "tile")  # (M, K), (M, ⌈K/128⌉)
    w_q, w_s = fp8.quantize(w, "e4m3", "block")  # (N, K), (⌈N/128⌉, ⌈K/128⌉)
    a = fp8.dequantize(x_q, x_s, "tile").double()  # (M, K): llmlab's q·s, fp32 rounded once, in float64
    b = fp8.dequantize(w_q, w_s, "block").double()  # (N, K)
    want = a @ b.t()  # (M, N): float64, ~K·2⁻⁵³ from exact
    y = fp8_matmul(x_q.clone(), x_s.clone(), w_q.clone(), w_s.clone())
    if not isinstance(y, torch.Tensor) or tuple(y.shape) != (m, n):
        raise Mismatch(f"{what}: got {type(y).__name__} of shape {tuple(getattr(y, 'shape', ()))}, expected y = "
                       f"X·Wᵀ of shape {(m, n)}")
    if y.dtype in (torch.bfloat16, torch.float16):
        raise Mismatch(f"{what}: y is {y.dtype}: dequantize to fp32, sum in fp32 and return fp32",
                       mistake="accumulate", hint=_HINTS["accumulate"])
    if y.dtype != torch.float32:
        raise Mismatch(f"{what}: y has dtype {y.dtype}, expected torch.float32")
    sums = a.abs() @ b.abs().t()  # (M, N): Σ_k |â_k||b̂_k|, what every rounding error is relative to
    got, bound = y.double(), _product_bound(sums, k)  # (M, N), (M, N)
    err = (got - want).abs()  # (M, N); NaN where y is NaN
    bad = ~(err <= bound)
    if not bool(bad.any()):
        return
    i = tuple(int(t) for t in bad.nonzero()[0])
    head = (f"{what}: {int(bad.sum())} of {m * n} values lie beyond fp32's rounding of the float64 product of the "
            f"dequantized operands; first at {i}: got {got[i].item():.6g}, expected {want[i].item():.6g}")
    codes = x_q.double() @ w_q.double().t()  # (M, N): the codes' product, no scales
    divided = (x_q.double() / _per_element(x_s.double(), (m, k), 1)) @ \
        (w_q.double() / _per_element(w_s.double(), (n, k), BLOCK)).t()  # (M, N): the scales divided out
    # a diagnosis: the scales left out or divided change y by factors of 10⁻⁸ … 10⁸, far beyond 1e-3
    close = lambda value: bool(torch.allclose(got, value, rtol=1e-3, atol=1e-6 * value.abs().max().item()))  # noqa: E731
    if close(codes):
        raise Mismatch(f"{head}: y is the product of the codes alone; multiply them by their scales",
                       mistake="scales", hint=_HINTS["scales"])
    if close(divided):
        raise Mismatch(f"{head}: y is the product of the codes divided by their scales; a code times its scale is "
                       "the value", mistake="scales", hint=_HINTS["scales"])
    relative = (err / sums)[bad]  # the error against Σ|â||b̂|, where it is too large
    # 16-bit arithmetic rounds by 2⁻⁹ (bf16) or 2⁻¹¹ (fp16) of what it holds: its errors stay below 2⁻⁴ of Σ|â||b̂|
    # at these K, while a wrong scale or tile is off by the size of the values themselves
    if bool(relative.isfinite().all()) and relative.max().item() <= 2.0**-4:
        raise Mismatch(f"{head}: errors up to {relative.max().item():.2g} of Σ|a||b|, those of 16-bit arithmetic "
                       f"(fp32's bound here: {(k + 5) * U32:.2g}): dequantize and sum in fp32",
                       mistake="accumulate", hint=_HINTS["accumulate"])
    raise Mismatch(f"{head} (x's scale per 1×128 tile of a row, W's per 128×128 block)", hint=_HINTS["scales"])


def _matmul_cases(rng: random.Random) -> list[tuple[int, int, int]]:
    """(M, K, N): the scripted sizes first (short last tiles, one value, whole tiles), then random ones."""
    return [(3, 300, 5), (1, 1, 1), (130, 200, 129), (128, 256, 128),
            (rng.randint(1, 200), rng.randint(1, 500), rng.randint(1, 260)),
            (rng.randint(1, 64), rng.randint(129, 700), rng.randint(129, 300))]


@check("2.7", "FP8 with 1×128 tile scales and the scaled matmul", hint=Hint(
    nudge="quantize a small x of shape (2, 300) by hand with llmlab.fp8.quantize(x, 'e4m3', 'tile') beside yours: "
          "where do the codes or the scales part?",
    idea="each 1×128 tile of a row (each 128×128 block for rows=128) gets its own scale, amax/448, 1 for a tile of "
         "zeros; the codes are x divided by their tile's scale, saturated and cast to E4M3; the product reads each "
         "operand back as code × scale and sums in fp32",
    formula=f"{_QUANTIZE}; fp8_matmul: {_MATMUL}"))
def fp8_quantization(saturating_cast, quantize_tiles, fp8_matmul):
    """`saturating_cast(v, dtype)` → v in the FP8 dtype, saturated; `quantize_tiles(x, rows)` → (codes, scales)
    with one scale per rows×128 tile; `fp8_matmul(x_q, x_s, w_q, w_s)` → X·Wᵀ in fp32."""
    rng = fresh_rng()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ~10⁵-element ops: with a second thread on a shared CPU the check took 1 s, alone 0.07 s
    try:
        v = _cast_inputs(rng)
        for dtype in (E4M3, E5M2):
            _check_cast(saturating_cast, v, dtype)
        for rows, m, k in _quantize_cases(rng):
            gen = torch.Generator().manual_seed(rng.randrange(2**31))
            zero = _zero_tile(rng, m, k, rows) if m * k > 1 else None
            _check_quantize(quantize_tiles, _values(gen, m, k, zero, rows), rows, zero)
        for m, k, n in _matmul_cases(rng):
            gen = torch.Generator().manual_seed(rng.randrange(2**31))
            zero = _zero_tile(rng, m, k, 1) if m * k > 1 else None
            w = torch.randn(n, k, generator=gen) / k**0.5  # (N, K)
            planted = "" if zero is None else f", the 1×128 tile {zero} all zeros"
            _check_matmul(fp8_matmul, _values(gen, m, k, zero, 1), w, planted)
    finally:
        torch.set_num_threads(threads)
