"""Check 2.7 (llmlab.checks.ch02.fp8_quantization): the answers it is tried with — the solution's, llmlab's own and
DeepSeek-V3's order of the product (partial sums per 128 products, scaled afterwards) must pass; each planted
mistake must be named. `FP8_ANSWERS` joins chapter 2's `ANSWERS` (tests/test_checks_ch02.py), which
tests/test_checks_answers.py runs once and tools/flake.py N times. Measured: `tools/flake.py -n 300 -k ch02.fp8`, 0
failures; and each of these answers judged 300 times on its own: the 3 references passed 300/300, each of the 17
mistakes was named 300/300."""

import torch
import torch.nn.functional as F
from check_answers import Mistake, Reference
from grading import not_attempted

from llmlab import fp8
from llmlab.checks import ch02

E4M3 = torch.float8_e4m3fn


# --- the solution's answer ------------------------------------------------------------------------------------

def saturating_cast(v, dtype):
    fmax = torch.finfo(dtype).max
    return v.float().clamp(-fmax, fmax).to(dtype)


def expand(scales, shape, rows):
    m, k = shape
    return scales.repeat_interleave(rows, 0)[:m].repeat_interleave(128, 1)[:, :k]  # (M, K)


def tile_amax(x, rows):
    m, k = x.shape
    padded = F.pad(x.abs(), (0, -k % 128, 0, -m % rows))  # (⌈M/rows⌉·rows, ⌈K/128⌉·128)
    return padded.reshape(padded.shape[0] // rows, rows, -1, 128).amax(dim=(1, 3))  # (⌈M/rows⌉, ⌈K/128⌉)


def quantize_tiles(x, rows=1, fmax=448.0, dtype=E4M3, zero_scale=1.0):
    scales = tile_amax(x, rows) / fmax
    scales = torch.where(scales > 0, scales, torch.full_like(scales, zero_scale))
    return saturating_cast(x / expand(scales, x.shape, rows), dtype), scales


def fp8_matmul(x_q, x_s, w_q, w_s):
    a = x_q.float() * expand(x_s, x_q.shape, 1)  # (M, K)
    b = w_q.float() * expand(w_s, w_q.shape, 128)  # (N, K)
    return a @ b.t()  # (M, N)


# --- the other right answers ----------------------------------------------------------------------------------

def llmlab_cast(v, dtype):
    return fp8.cast(v, "e4m3" if dtype == E4M3 else "e5m2")


def llmlab_quantize(x, rows=1):
    return fp8.quantize(x, "e4m3", "tile" if rows == 1 else "block")


def llmlab_matmul(x_q, x_s, w_q, w_s):
    return fp8.dequantize(x_q, x_s, "tile") @ fp8.dequantize(w_q, w_s, "block").t()  # (M, N)


def deepseek_matmul(x_q, x_s, w_q, w_s):
    """DeepSeek-V3's order: each 128-wide slice of K summed over the codes alone (exact products), then scaled by
    the tile's and the block's scales and added to the fp32 output."""
    m, n = x_q.shape[0], w_q.shape[0]
    w_scales = w_s.repeat_interleave(128, 0)[:n]  # (N, ⌈K/128⌉): each output row's block scales
    y = torch.zeros(m, n)  # (M, N)
    for t in range(x_s.shape[1]):
        part = x_q[:, t * 128:(t + 1) * 128].float() @ w_q[:, t * 128:(t + 1) * 128].float().t()  # (M, N)
        y += part * x_s[:, t:t + 1] * w_scales[:, t]
    return y


# --- the mistakes ---------------------------------------------------------------------------------------------

def per_tensor(x, rows=1):
    _, s = quantize_tiles(x, rows)
    scale = x.abs().max() / 448.0
    return saturating_cast(x / scale, E4M3), torch.full_like(s, scale.item())


def inverted(x, rows=1):
    amax = tile_amax(x, rows)
    scales = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))  # the multiplier, stored as the scale
    return saturating_cast(x * expand(scales, x.shape, rows), E4M3), scales


def multiplies(x, rows=1):
    _, scales = quantize_tiles(x, rows)
    return saturating_cast(x * expand(scales, x.shape, rows), E4M3), scales


def drops_the_last_tile(x, rows=1):
    m, k = x.shape
    return quantize_tiles(x[:m // rows * rows or m, :k // 128 * 128 or k], rows)


def reciprocal(x, rows=1):
    scales = tile_amax(x, rows) * (1 / 448.0)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return saturating_cast(x / expand(scales, x.shape, rows), E4M3), scales


def codes_alone(x_q, x_s, w_q, w_s):
    return x_q.float() @ w_q.float().t()


def divides(x_q, x_s, w_q, w_s):
    return (x_q.float() / expand(x_s, x_q.shape, 1)) @ (w_q.float() / expand(w_s, w_q.shape, 128)).t()


def in_bf16(x_q, x_s, w_q, w_s):
    a = (x_q.float() * expand(x_s, x_q.shape, 1)).bfloat16()  # (M, K)
    b = (w_q.float() * expand(w_s, w_q.shape, 128)).bfloat16()  # (N, K)
    return (a @ b.t()).float()  # bf16 sums


def test_an_unwritten_answer_is_not_attempted(capsys):
    def unwritten(*args):
        raise NotImplementedError("Exercise 2.7")

    not_attempted(ch02.fp8_quantization, unwritten, quantize_tiles, fp8_matmul, capsys=capsys)
    not_attempted(ch02.fp8_quantization, saturating_cast, quantize_tiles, unwritten, capsys=capsys)


RIGHT = (saturating_cast, quantize_tiles, fp8_matmul)
FP8_HINT = "each 1×128 tile of a row"
FP8_ANSWERS = [
    Reference(ch02.fp8_quantization, *RIGHT),
    Reference(ch02.fp8_quantization, llmlab_cast, llmlab_quantize, llmlab_matmul),
    Reference(ch02.fp8_quantization, saturating_cast, quantize_tiles, deepseek_matmul),
    Mistake(ch02.fp8_quantization, lambda v, dtype: v.to(dtype), quantize_tiles, fp8_matmul,
            match=r"float8_e5m2\) .* gives -?inf, .* must saturate to ±57344", hint="clamp to ±max first"),
    Mistake(ch02.fp8_quantization, saturating_cast,
            lambda x, rows=1: quantize_tiles(x, rows, fmax=57344.0, dtype=torch.float8_e5m2), fp8_matmul,
            match="the codes are float8_e5m2; DeepSeek-V3's recipe stores them in E4M3", hint="E4M3"),
    Mistake(ch02.fp8_quantization, saturating_cast, lambda x, rows=1: quantize_tiles(x, rows, fmax=57344.0),
            fp8_matmul, match="they are amax/57344, scaled to E5M2's largest value", hint="E4M3"),
    Mistake(ch02.fp8_quantization, saturating_cast, per_tensor, fp8_matmul,
            match="every tile's scale is the whole tensor's amax/448: one scale per tensor", hint="own amax"),
    Mistake(ch02.fp8_quantization, saturating_cast,
            lambda x, rows=1: (per_tensor(x)[0], (x.abs().max() / 448.0).reshape(1, 1)), fp8_matmul,
            match="one scale for the whole tensor; expected one per 1×128 tile", hint="own amax"),
    Mistake(ch02.fp8_quantization, saturating_cast, inverted, fp8_matmul,
            match="they are 448/amax, the reciprocals", hint="multiplied by to read the value back"),
    Mistake(ch02.fp8_quantization, saturating_cast, multiplies, fp8_matmul,
            match="the codes are x × scale; x is divided by its scale", hint="multiplied by to read the value back"),
    Mistake(ch02.fp8_quantization, saturating_cast, lambda x, rows=1: quantize_tiles(x, rows, fmax=1.0), fp8_matmul,
            match="they are the tiles' amax: divide it by E4M3's largest value", hint=FP8_HINT),
    Mistake(ch02.fp8_quantization, saturating_cast, reciprocal, fp8_matmul,
            match="within an fp32 rounding of amax/448 but not equal", hint=FP8_HINT),
    Mistake(ch02.fp8_quantization, saturating_cast, drops_the_last_tile, fp8_matmul,
            match=r"the codes have shape \(3, 256\), expected x's, \(3, 300\) \(the last, short tile dropped",
            hint="the last one is short"),
    Mistake(ch02.fp8_quantization, saturating_cast,
            lambda x, rows=1: (quantize_tiles(x, rows)[0], drops_the_last_tile(x, rows)[1]), fp8_matmul,
            match=r"scales of shape \(3, 2\), expected \(3, 3\)", hint="the last one is short"),
    Mistake(ch02.fp8_quantization, saturating_cast, lambda x, rows=1: quantize_tiles(x, rows, zero_scale=0.0),
            fp8_matmul, match=r"the all-zero tile \(\d+, \d+\) has the scale 0 and \d+ NaN codes \(0/0\)",
            hint="0/0 = NaN"),
    Mistake(ch02.fp8_quantization, saturating_cast, lambda x, rows=1: quantize_tiles(x, 1), fp8_matmul,
            match=r"quantize_tiles\(x, rows=128\) .* \(one per 1×128 tile; rows=128 asks one per 128×128 block\)",
            hint=FP8_HINT),
    Mistake(ch02.fp8_quantization, saturating_cast, quantize_tiles, codes_alone,
            match="y is the product of the codes alone; multiply them by their scales", hint="its tile's scale"),
    Mistake(ch02.fp8_quantization, saturating_cast, quantize_tiles, divides,
            match="y is the product of the codes divided by their scales", hint="its tile's scale"),
    Mistake(ch02.fp8_quantization, saturating_cast, quantize_tiles, in_bf16,
            match="those of 16-bit arithmetic .*: dequantize and sum in fp32", hint="sum in fp32"),
    Mistake(ch02.fp8_quantization, saturating_cast, quantize_tiles, lambda *a: in_bf16(*a).bfloat16(),
            match="y is torch.bfloat16: dequantize to fp32, sum in fp32 and return fp32", hint="sum in fp32"),
]
