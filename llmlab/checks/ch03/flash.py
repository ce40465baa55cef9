"""Exercise 3.4's check: the online-softmax attention forward (FlashAttention-2's Algorithm 1) in plain PyTorch.

The learner's `flash_forward(q, k, v, causal, block)` → (o, lse) runs on fresh random float64 q, k, v (B, H, T, D)
of odd sizes — T not a multiple of `block`, T a multiple, T < block, T = 1, odd D — causal and not, and on scores of
magnitude ~10³, where exp without the running max overflows. o must equal `F.scaled_dot_product_attention`'s and lse
`torch.logsumexp` of the scaled (masked) scores. One larger causal case runs under `_Largest`, a TorchDispatchMode
that sees every tensor any op creates: none may hold more than a block of scores (B, H, block, block) or the output
plus a block of padding (B, H, T + block, D); and under `torch.utils.flop_counter.FlopCounterMode`, which counts its
matmul FLOPs: causal must do at most `CAUSAL_FLOPS` of what the same inputs cost it non-causal (the key blocks wholly
after a query block are skipped, not computed and masked). When the answer matches a known mistake the check names
it: the scale 1/√D missing, the causal mask hiding the diagonal or missing, no running max, no rescale of l and acc
when the max grows, acc divided by l inside the loop, lse without the max (or in base 2), the whole T×T matrix or a
strip of it built, the future key blocks not skipped.

llmlab's own online softmax is `llmlab.kernels.attention` (kernels/attention.py): the Triton kernel, one program per
block of queries, and `reference`, the same loop in PyTorch tiled by keys only — it holds (B, H, T, block) strips, so
this check names it a strip (tests/test_checks_ch03.py), while its values meet the tolerance here.
"""

from __future__ import annotations

import dataclasses
import math
import random

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from llmlab.checks import Hint, Mismatch, assert_close, check, fresh_rng

# Causal attention over n key blocks visits n(n+1)/2 of the n² (query, key) block pairs: 0.58 of them or fewer for the
# n ≥ 6 blocks of the tiling case. 0.8 leaves room for one wholly masked block per query block; computing every block
# and masking (1.0) is outside.
CAUSAL_FLOPS = 0.8
# Tolerance, per unit of the largest |score| (at least 1): float64 (ε = 2⁻⁵²). A score computed in another order (q·kᵀ
# then × 1/√D, or q × 1/√D first; SDPA scales q and k by √(1/√D) each) differs by a few ε·|s|, which exp turns into a
# relative error of the weights, and the online softmax reassociates the exp/sum over blocks: measured on 150 random
# cases per variant (scale folded into q, exp2, a normalised running output), the error of o and of lse stays below
# 2.4·ε·max(1, |s|); 2⁻⁴⁰ ≈ 9e-13 is 4,096 ε, and every named mistake is off by more than 1e-3.
TOL = 2.0**-40


class _Largest(TorchDispatchMode):
    """While active, records the largest tensor any op returns, by the elements of memory it holds (its storage: a
    view or an expand counts what it really keeps, not its shape)."""

    def __init__(self):
        super().__init__()
        self.elements, self.shape = 0, ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                elements = t.untyped_storage().nbytes() // t.element_size()
                if elements > self.elements:
                    self.elements, self.shape = elements, tuple(t.shape)
        return out


@dataclasses.dataclass(frozen=True)
class _Case:
    what: str
    B: int
    H: int
    T: int
    D: int
    block: int
    causal: bool
    sigma: float = 1.0  # q and k are N(0, σ²): σ = 30 gives scores of ~10³
    seed: int = 0

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed)
        q, k, v = (torch.randn(self.B, self.H, self.T, self.D, generator=gen, dtype=torch.float64)
                   for _ in range(3))  # (B, H, T, D) each
        return q * self.sigma, k * self.sigma, v


def _cases(rng: random.Random) -> list[_Case]:
    def sizes(**fixed):
        block = fixed.pop("block", rng.choice([4, 5, 8, 16]))
        return {"B": rng.choice([1, 2]), "H": rng.choice([1, 2, 3]), "D": rng.choice([1, 3, 5, 7, 9]),
                "block": block, "seed": rng.randrange(2**31), **fixed}

    def ragged(block: int, lo: int, hi: int) -> int:  # lo·block < T < hi·block, not a multiple of block
        return rng.choice([t for t in range(lo * block + 1, hi * block) if t % block])

    b = [rng.choice([4, 5, 8, 16]) for _ in range(4)]
    tiling_block = rng.choice([8, 12])
    return [
        _Case("causal, T not a multiple of block", **sizes(block=b[0], T=ragged(b[0], 2, 5), causal=True)),
        _Case("not causal, T not a multiple of block", **sizes(block=b[1], T=ragged(b[1], 2, 5), causal=False)),
        _Case("causal, T a multiple of block", **sizes(block=b[2], T=b[2] * rng.choice([2, 3]), causal=True)),
        _Case("T < block", **sizes(block=16, T=rng.randrange(2, 16), causal=rng.random() < 0.5)),
        _Case("T = 1", **sizes(T=1, causal=rng.random() < 0.5)),
        _Case("scores of magnitude ~10³ (q, k ~ N(0, 30²))",
              **sizes(block=b[3], T=ragged(b[3], 2, 4), causal=rng.random() < 0.5, sigma=30.0)),
        _Case("the tiling case", **sizes(block=tiling_block, T=ragged(tiling_block, 5, 7), B=rng.choice([1, 2]),
                                         H=rng.choice([2, 3]), D=rng.choice([3, 5]), causal=True)),
    ]


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    """The whole (B, H, T, T) scaled scores, −inf after the row when causal (the check's own, not the answer's)."""
    s = q @ k.transpose(-1, -2) * scale  # (B, H, T, T)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return s


def _tensor(x, shape: tuple, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise Mismatch(f"{what}: got {type(x).__name__}, expected a tensor of shape {shape}")
    if tuple(x.shape) != shape:
        raise Mismatch(f"{what}: got shape {tuple(x.shape)}, expected {shape}")
    if x.dtype != torch.float64:
        raise Mismatch(f"{what}: got dtype {x.dtype}, expected torch.float64: create m, l, acc and the outputs in q's "
                       "dtype (q.new_zeros, q.new_full, torch.empty_like(q))")
    return x.detach()


def _call(fn, q, k, v, causal: bool, block: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The learner's (o, lse), checked for type, shape and dtype; q, k, v must come back unchanged."""
    originals = [t.clone() for t in (q, k, v)]
    result = fn(q, k, v, causal=causal, block=block)
    if not isinstance(result, tuple | list) or len(result) != 2:
        raise Mismatch(f"{where}: flash_forward returned {type(result).__name__}, expected the pair (o, lse)")
    if not all(torch.equal(a, b) for a, b in zip((q, k, v), originals, strict=True)):
        raise Mismatch(f"{where}: q, k or v changed: compute on new tensors, never in place on the inputs")
    B, H, T, D = q.shape
    return _tensor(result[0], (B, H, T, D), f"{where}: o"), _tensor(result[1], (B, H, T), f"{where}: lse")


def _close(got, want, tol: float) -> bool:
    return bool(torch.isclose(got, want, rtol=0, atol=tol, equal_nan=True).all())


def _first_max_inputs(case: _Case):
    """q, k, v where every row's largest score is its key 0's (q > 0, k₀ = 3, other keys small): the running max is
    set by the first key block and never grows, so nothing needs rescaling."""
    gen = torch.Generator().manual_seed(case.seed + 1)
    shape = (case.B, case.H, case.T, case.D)
    q = torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5  # (B, H, T, D), all positive
    k = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.1  # (B, H, T, D)
    k[:, :, 0] = 3.0
    return q, k, torch.randn(shape, generator=gen, dtype=torch.float64)


def _diagnose_o(fn, case: _Case, q, k, v, got, want, tol: float) -> None:
    where, scale = case.what, 1 / math.sqrt(case.D)
    if case.causal and case.T > 1:
        strict = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(case.T, case.T, dtype=torch.bool)
                                                .tril(-1))  # (B, H, T, D): row i sees keys j < i
        if _close(got[:, :, 1:], strict[:, :, 1:], tol):
            raise Mismatch(f"{where}: o equals attention in which row i sees keys j < i only (row 0 sees nothing): "
                           "the causal mask hides the diagonal — mask col > row, not col ≥ row", mistake="diagonal")
        if _close(got, F.scaled_dot_product_attention(q, k, v), tol):
            raise Mismatch(f"{where}: o equals non-causal attention: the causal mask is missing — in the diagonal "
                           "block, set s to −inf where col > row", mistake="no mask")
    if not got.isfinite().all() and want.isfinite().all():
        largest = _scores(q, k, case.causal, scale).max().item()
        if largest > 709:  # exp(709.8) is float64's largest finite value
            raise Mismatch(f"{where}: o has nan or inf, and the scores reach {largest:.0f}: exp of a score above 709 "
                           "overflows float64 — subtract the running row max m before exp: p = exp(s − m_new)",
                           mistake="no max")
    if _close(got, F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, scale=1.0), tol):
        raise Mismatch(f"{where}: o equals softmax(q·kᵀ)·v: the scale 1/√D is missing (D = {case.D})",
                       mistake="scale")
    if case.T > case.block and _close(_call(fn, q, k, v, case.causal, case.T, where)[0], want, tol):
        first_max = _first_max_inputs(case)
        o, _ = _call(fn, *first_max, case.causal, case.block, where)
        if _close(o, F.scaled_dot_product_attention(*first_max, is_causal=case.causal), tol):
            raise Mismatch(f"{where}: o is right with one key block (block = T) and right when every row's max lies "
                           "in its first key block, wrong when a later block raises the max: l and acc are not "
                           "rescaled by exp(m_old − m_new) when the max grows", mistake="no rescale")
        raise Mismatch(f"{where}: o is right with one key block (block = T), wrong with several even when every "
                       "row's max lies in its first key block (nothing to rescale): the key blocks are summed wrong — "
                       "keep acc unnormalised (Σ exp(s − m)·v) and divide by l once, after the last key block; "
                       "dividing inside the loop divides the earlier blocks again at every step",
                       mistake="divided in loop")
    assert_close(got, want, what=f"{where}: o against F.scaled_dot_product_attention", rtol=0, atol=tol)


def _diagnose_lse(case: _Case, q, k, got, want, tol: float) -> None:
    where, scale = case.what, 1 / math.sqrt(case.D)
    s = _scores(q, k, case.causal, scale)  # (B, H, T, T)
    if _close(got, want - s.amax(-1), tol):
        raise Mismatch(f"{where}: lse equals log l without the row max: l sums exp(s − m), so log Σ exp(s) = "
                       "m + log l", mistake="lse without max")
    if _close(got, want / math.log(2), tol):
        raise Mismatch(f"{where}: lse is in base 2 (log₂ Σ exp(s)): return the natural log, m + torch.log(l)",
                       mistake="base 2")
    if _close(got, torch.logsumexp(_scores(q, k, case.causal, 1.0), -1), tol):
        raise Mismatch(f"{where}: lse equals logsumexp(q·kᵀ): the scale 1/√D is missing (D = {case.D})",
                       mistake="scale")
    assert_close(got, want, what=f"{where}: lse against torch.logsumexp of the scores", rtol=0, atol=tol)


def _values(fn, case: _Case) -> None:
    q, k, v = case.inputs()
    s = _scores(q, k, case.causal, 1 / math.sqrt(case.D))  # (B, H, T, T)
    tol = TOL * max(1.0, s[s.isfinite()].abs().max().item())
    where = f"{case.what} (B={case.B}, H={case.H}, T={case.T}, D={case.D}, block={case.block}, causal={case.causal})"
    case = dataclasses.replace(case, what=where)
    o, lse = _call(fn, q, k, v, case.causal, case.block, where)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)  # (B, H, T, D)
    if not _close(o, want, tol):
        _diagnose_o(fn, case, q, k, v, o, want, tol)
    want_lse = torch.logsumexp(s, -1)  # (B, H, T)
    if not _close(lse, want_lse, tol):
        _diagnose_lse(case, q, k, lse, want_lse, tol)


def _watched(fn, case: _Case, causal: bool) -> tuple[_Largest, int]:
    q, k, v = case.inputs()
    with FlopCounterMode(display=False) as flops, _Largest() as largest:
        fn(q, k, v, causal=causal, block=case.block)
    return largest, flops.get_total_flops()


def _tiling(fn, case: _Case) -> None:
    B, H, T, D, n = case.B, case.H, case.T, case.D, case.block
    largest, causal_flops = _watched(fn, case, causal=True)
    allowed = B * H * max(n * n, (T + n) * D)
    where = f"{case.what} (B={B}, H={H}, T={T}, D={D}, block={n})"
    if largest.elements > allowed:
        big = sum(size >= T for size in largest.shape) >= 2
        found = (f"{where}: your function created a tensor of shape {largest.shape}, {largest.elements:,} elements; a "
                 f"block of scores (B, H, block, block) holds {B * H * n * n:,}, the output (B, H, T + block, D) "
                 f"{B * H * (T + n) * D:,}")
        if big:
            raise Mismatch(f"{found}: you built the whole T×T score matrix (or a T×T mask) — compute s for one block "
                           "of queries against one block of keys at a time", mistake="whole")
        raise Mismatch(f"{found}: a strip of the score matrix — every key against a block of queries, or a block of "
                       "keys against every query (as llmlab.kernels.attention.reference does); loop over blocks of "
                       "keys inside the loop over blocks of queries", mistake="strip")
    _, full_flops = _watched(fn, case, causal=False)
    if full_flops and causal_flops > CAUSAL_FLOPS * full_flops:
        raise Mismatch(f"{where}: causal, your matmuls did {causal_flops:,} FLOPs, {causal_flops / full_flops:.0%} of "
                       f"the {full_flops:,} they do non-causal: the key blocks wholly after a query block's last row "
                       "were computed and masked — skip them (loop j only up to the diagonal block)",
                       mistake="no skip")


@check("3.4", "the online-softmax attention forward", hint=Hint(
    nudge="compare, for one block of queries, what your m, l and acc hold after each block of keys with the softmax "
          "over all the keys seen so far",
    idea="per query row keep a running max m (from −inf), a running sum l of exp(s − m) and an unnormalised "
         "acc = Σ exp(s − m)·v; when a key block raises the max, multiply l and acc by exp(m_old − m_new) before "
         "adding the block; divide by l only after the last key block, and lse = m + log l",
    formula="for each query block (rows i … i+block−1) and each key block j — all of them, or, causal, those up to "
            "the diagonal one: s = q_i·k_jᵀ / √D, with −inf where col > row in the diagonal block; "
            "m_new = torch.maximum(m, s.amax(-1)); α = exp(m − m_new); p = exp(s − m_new[..., None]); "
            "l = α·l + p.sum(-1); acc = α[..., None]·acc + p @ v_j; m = m_new. Then o_i = acc / l[..., None] and "
            "lse_i = m + log l"))
def flash_forward(fn):
    """`fn(q, k, v, causal, block)` → (o, lse): softmax(q·kᵀ/√D)·v (B, H, T, D) and its rows' logsumexp (B, H, T), by
    blocks of `block` queries and keys with the online softmax, never holding the (T, T) score matrix."""

    cases = _cases(fresh_rng())
    for case in cases:
        _values(fn, case)
    _tiling(fn, cases[-1])
