"""Check 8.3 (re-exported by llmlab.checks.ch08): LSQ as a torch.autograd.Function, checked against
`llmlab.quant.LSQQuantizer`.

    from llmlab.checks import ch08 as check
    check.lsq(LSQ, lsq_init_step)               # 8.3

The learner writes `LSQ`, a torch.autograd.Function with `LSQ.apply(v, step, q_n, q_p)` (Esser et al. 2020,
"Learned Step Size Quantization"): v̂ = round(clamp(v/s, −Q_N, Q_P))·s for a step s of any shape that broadcasts
against v (one step per tensor, (1,), or one per channel); its backward passes dL/dv̂ straight through where v
lands on the grid and 0 where it was clipped, and gives the step, per element, eq. 3's
round(v/s) − v/s inside, −Q_N below and Q_P above, times dL/dv̂, summed over the N elements sharing a step and
multiplied by the paper's step size gradient scale g = 1/√(N·Q_P). And `lsq_init_step(v, q_p, ch_axis=None)`,
the paper's initial step 2·mean|v|/√Q_P per tensor, shape (1,), or per channel along `ch_axis`, shaped to
broadcast, kept ≥ fp32 eps for an all-zero channel.

Each call draws signed and unsigned grids of 2 to 8 bits, per-tensor and per-channel steps (along the first, the
middle and the last axis), odd shapes and one element alone, with `lsq_inputs`: v/s off rounding ties and off the
half step past each end of the grid, where LSQ's paper and PyTorch draw the clipping line half a step apart
(`llmlab.quant`'s module docstring) — there both conventions give the same gradients. The reference is an
LSQQuantizer with the same grid and step: its forward value, dL/dv and dL/dstep. A wrong step gradient is named
when it is a known mistake's: no g, g without Q_P, g with Q_N, N counting the whole tensor instead of one step's
elements, a flipped sign, eq. 3's inside term left out (what differentiating through a straight-through round
gives) or its −v/s, the clipped terms left out, or +Q_N below the grid.
"""

from __future__ import annotations

import math
import random

import torch

from llmlab.checks import Hint, Mismatch, assert_close, check, fresh_rng
from llmlab.quant import LSQQuantizer

__all__ = ["lsq", "lsq_inputs"]

_EPS = torch.finfo(torch.float32).eps

_FORMULA = ("forward: x = v/s; q = round(x).clamp(−Q_N, Q_P); save v and s; return q·s. backward: x = v/s; "
            "q = round(x); below, above = q < −Q_N, q > Q_P; inside = neither; g = 1/√(v.numel()/s.numel()·Q_P); "
            "d_step = where(inside, q − x, where(below, −Q_N, Q_P)); return grad·inside, "
            "(grad·d_step·g).sum_to_size(s.shape), None, None. init: 2·|v|.mean(over all dims but ch_axis, "
            "keepdim)/√Q_P, clamped to ≥ torch.finfo(torch.float32).eps")
_STEP_SCALE = Hint(
    nudge="look at the factor that scales the step's gradient",
    idea="LSQ scales the step's gradient down by the square root of the number of values sharing that step times "
         "the positive end of the grid, so that the step learns at the pace of the weights",
    formula=_FORMULA)
_STEP_TERMS = Hint(
    nudge="look at what each element contributes to the step's gradient, inside the grid and beyond it",
    idea="v̂ = round(v/s)·s, with the round passed straight through, has dv̂/ds = round(v/s) − v/s inside the "
         "grid (the rounding error: a naive STE that treats round as the identity makes it 0) and the grid's end "
         "beyond it: −Q_N below, Q_P above",
    formula=_FORMULA)
_HINTS = {
    "function": Hint(
        nudge="look at what you passed the check: the class itself, a torch.autograd.Function subclass",
        idea="an autograd Function has two static methods, forward(ctx, …) and backward(ctx, grad), and is called "
             "with LSQ.apply(v, step, q_n, q_p)",
        formula=_FORMULA),
    "no clamp": Hint(
        nudge="look at the values of v/s that lie beyond the integer grid",
        idea="the quantised integers are limited to [−Q_N, Q_P], so v/s is clamped to that range (before or after "
             "it is rounded: the bounds are integers)",
        formula=_FORMULA),
    "STE through the clip": Hint(
        nudge="look at dL/dv where v was clipped",
        idea="the straight-through estimator replaces the rounding's gradient only; the clamp keeps its own, which "
             "is 0 beyond the grid",
        formula=_FORMULA),
    "no step gradient": Hint(
        nudge="look at what your backward returns for the step",
        idea="backward returns one gradient per input of forward, in order: dL/dv, then dL/dstep — of the step's "
             "shape, summed over the elements that share it — then None for the two grid ends",
        formula=_FORMULA),
    "no g": _STEP_SCALE, "no Q_P in g": _STEP_SCALE, "g from Q_N": _STEP_SCALE, "N whole tensor": _STEP_SCALE,
    "sign": _STEP_TERMS, "no inside term": _STEP_TERMS, "round only": _STEP_TERMS, "no clipped terms": _STEP_TERMS,
    "below sign": _STEP_TERMS,
    "init abs": Hint(
        nudge="look at which mean your initial step takes",
        idea="the step starts at twice the mean *magnitude* of v over √Q_P: v's own mean is near 0 for weights",
        formula=_FORMULA),
    "init eps": Hint(
        nudge="look at the initial step of a channel whose values are all zero",
        idea="a zero step divides by zero in v/s: keep it at least fp32's eps, as llmlab's quantizer (and PyTorch's "
             "observers) do",
        formula=_FORMULA),
}


def _step_shape(shape: tuple[int, ...], ch_axis: int | None) -> tuple[int, ...]:
    """(1,) per tensor; per channel, v's number of dims with the channels at ch_axis and 1 elsewhere."""
    if ch_axis is None:
        return (1,)
    return tuple(n if d == ch_axis % len(shape) else 1 for d, n in enumerate(shape))


def lsq_inputs(shape, q_n: int, q_p: int, ch_axis: int | None = None, seed: int | None = None):
    """(v, step) for the LSQ check on the grid [−q_n, q_p]: v Gaussian (for an unsigned grid, q_n = 0, mostly
    positive, a few values below 0), each channel its own size when `ch_axis` is given, and the step around LSQ's
    initialisation 2·mean|v|/√Q_P times 0.3-1.5 (so some values are clipped), shaped by `_step_shape`. Every v/step
    is kept 0.01 or more from a rounding tie k + ½ and outside the half step just past each end of the grid, where
    LSQ's paper and PyTorch's op draw the clipping line differently (llmlab.quant's module docstring): there both
    conventions give the same gradients. With more than one element, the largest |v/step| is made an outlier 1.3
    steps beyond the grid, so something is clipped, and on a signed grid the lowest one below it if none is."""
    g = torch.Generator().manual_seed(seed if seed is not None else random.randrange(2**31))
    s_shape = _step_shape(tuple(shape), ch_axis)
    size = (0.1 + 2 * torch.rand(s_shape, generator=g))  # each channel's scale
    v = torch.randn(shape, generator=g) * size
    if q_n == 0:  # an unsigned grid quantizes non-negative activations: a few values below 0 get clipped
        v = v.abs() - 0.1 * size * torch.rand(shape, generator=g)
    dims = [d for d in range(v.dim()) if s_shape[d] == 1] if ch_axis is not None else list(range(v.dim()))
    mean = v.abs().mean(dim=dims, keepdim=True).reshape(s_shape)
    step = (2 * mean / math.sqrt(q_p) * (0.3 + 1.2 * torch.rand(s_shape, generator=g))).clamp(min=1e-3)
    t = v / step  # in grid units
    near_tie = ((t - t.floor()) - 0.5).abs() < 0.01
    t = torch.where(near_tie, t + 0.02, t)
    t = torch.where((t > q_p) & (t < q_p + 0.51), t + 0.52, t)  # past the top: clearly clipped
    t = torch.where((t < -q_n) & (t > -q_n - 0.51), t - 0.52, t)
    if t.numel() > 1:  # outliers beyond the grid, so clipping is always exercised
        flat = t.view(-1)
        i = int(flat.abs().argmax())
        flat[i] = q_p + 1.3 if flat[i] > 0 else -q_n - 1.3
        if q_n > 0 and not (flat < -q_n).any():  # one below a signed grid too: "+Q_N below" passed 1 run in 300
            lowest = flat.argsort()[:2].tolist()
            flat[lowest[0] if lowest[0] != i else lowest[1]] = -q_n - 1.3
    return (t * step).contiguous(), step.contiguous()


def _cases(rng: random.Random) -> list[tuple[tuple[int, ...], int, bool, int | None]]:
    """(shape, bits, signed, ch_axis) of every case."""
    cases = [((33, 17), 4, True, None), ((5,), 2, True, None),
             ((64, 96), 8, True, 0),  # a Linear's weight, one step per output row
             ((48, 40), 3, False, None),  # unsigned: post-ReLU activations
             ((7, 9, 5), 4, True, 1), ((11, 6), 5, False, -1)]
    shape = (rng.randrange(1, 80, 2), rng.randrange(1, 80, 2))
    cases.append((shape, rng.choice([2, 3, 4, 5, 8]), rng.random() < 0.7, rng.choice([None, 0, 1])))
    return cases + [((1,), 4, True, None)]  # one element last: there g = 1/√Q_P, and a missing g and 1/√N look alike


def _grid(bits: int, signed: bool) -> tuple[int, int]:
    """(Q_N, Q_P) of llmlab's quantizer: [−Q_N, Q_P] = [−2^(b−1), 2^(b−1) − 1] signed, [0, 2^b − 1] unsigned."""
    quantizer = LSQQuantizer(bits, signed)
    return -quantizer.q_min, quantizer.q_max


def _reference(v, step, bits: int, signed: bool, ch_axis: int | None, grad):
    """llmlab's LSQQuantizer on v with this step: (v̂, dL/dv, dL/dstep in step's shape)."""
    quantizer = LSQQuantizer(bits, signed, per_channel=ch_axis is not None, ch_axis=ch_axis or 0)
    quantizer.init_step(v)  # materialises a per-channel step's shape; its value is replaced below
    with torch.no_grad():
        quantizer.step.copy_(step.reshape(-1))
    v_ref = v.clone().requires_grad_(True)
    out = quantizer(v_ref)
    out.backward(grad)
    return out.detach(), v_ref.grad, quantizer.step.grad.reshape(step.shape)


def _terms(v, step, grad, q_n: int, q_p: int) -> dict[str, torch.Tensor]:
    """In float64 and the step's shape: eq. 3's sums over the elements sharing each step, before g — inside
    (round(x) − x), inside round(x) alone, below (−Q_N) and above (Q_P), each times dL/dv̂."""
    v, step, grad = v.double(), step.double(), grad.double()
    x = v / step
    q = x.round()
    below, above = q < -q_n, q > q_p
    inside = ~(below | above)

    def total(t):
        return t.sum_to_size(step.shape)

    return {"inside": total(grad * (q - x) * inside), "round": total(grad * q * inside),
            "below": total(grad * -q_n * below), "above": total(grad * q_p * above)}


@check("8.3", "LSQ as an autograd Function, with its step-size gradient", hint=Hint(
    nudge="look at the three things LSQ defines: the forward value v̂, the gradient to v, and the gradient to the "
          "step",
    idea="the forward rounds v/s onto the clipped integer grid and multiplies back by s; the gradient passes "
         "straight through the rounding (not through the clip) to v, and reaches s through eq. 3, summed and "
         "scaled down by a fixed factor",
    formula=_FORMULA))
def lsq(cls, init_step):
    """`cls.apply(v, step, q_n, q_p)` and `init_step(v, q_p, ch_axis=None)`: see the module docstring."""
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        raise Mismatch(f"LSQ is {cls!r:.60}, expected a subclass of torch.autograd.Function (class "
                       "LSQ(torch.autograd.Function) with static forward and backward)", mistake="function",
                       hint=_HINTS["function"])
    rng = fresh_rng()
    for shape, bits, signed, ch_axis in _cases(rng):
        _judge(cls, shape, bits, signed, ch_axis)
    _judge_init(init_step, rng)


def _judge(cls, shape, bits: int, signed: bool, ch_axis: int | None) -> None:
    q_n, q_p = _grid(bits, signed)
    v, step = lsq_inputs(shape, q_n, q_p, ch_axis)
    what = (f"LSQ.apply(v of shape {shape}, step of shape {tuple(step.shape)}, q_n={q_n}, q_p={q_p})"
            f" ({'per channel, ch_axis=' + str(ch_axis) if ch_axis is not None else 'per tensor'})")
    grad = torch.randn(shape)  # dL/dv̂
    out_ref, v_grad_ref, s_grad_ref = _reference(v, step, bits, signed, ch_axis, grad)
    v_in, s_in = v.clone().requires_grad_(True), step.clone().requires_grad_(True)
    out = cls.apply(v_in, s_in, q_n, q_p)
    if not isinstance(out, torch.Tensor):
        raise Mismatch(f"{what} returned {type(out).__name__}, expected a tensor")
    if out.shape != v.shape:
        raise Mismatch(f"{what}: the output has shape {tuple(out.shape)}, expected {tuple(v.shape)}")
    unclipped = v.div(step).round().mul(step)
    clipped = out_ref != unclipped
    if clipped.any() and torch.allclose(out.detach(), unclipped):
        raise Mismatch(f"{what}: values beyond the grid are not clipped ({int(clipped.sum())} of {v.numel()} should "
                       f"be): clamp v/s to [−Q_N, Q_P] = [{-q_n}, {q_p}]", mistake="no clamp",
                       hint=_HINTS["no clamp"])
    # integers times s: the same fp32 product as llmlab's, exact up to 1 ulp where v/s is computed as v·(1/s)
    # (llmlab) or v/s; v/s is kept 0.01 from every rounding tie, so that ulp never changes an integer
    assert_close(out, out_ref, what=f"{what}: v̂")
    if not out.requires_grad:
        raise Mismatch(f"{what}: v̂ has no gradient at all")
    out.backward(grad)

    if v_in.grad is not None and clipped.any() and torch.equal(v_in.grad, grad):
        raise Mismatch(f"{what}: dL/dv passes the gradient where v was clipped too; it is 0 there (the clamp's "
                       "gradient)", mistake="STE through the clip", hint=_HINTS["STE through the clip"])
    if v_in.grad is None:
        raise Mismatch(f"{what}: v received no gradient: backward's first result is dL/dv")
    assert_close(v_in.grad, v_grad_ref, what=f"{what}: dL/dv", rtol=0, atol=0)  # dL/dv̂ or 0: exact
    if s_in.grad is None:
        raise Mismatch(f"{what}: step received no gradient", mistake="no step gradient",
                       hint=_HINTS["no step gradient"])
    _judge_step_grad(s_in.grad, s_grad_ref, v, step, grad, q_n, q_p, what)


def _judge_step_grad(got, want, v, step, grad, q_n: int, q_p: int, what: str) -> None:
    if got.shape != step.shape:
        raise Mismatch(f"{what}: dL/dstep has shape {tuple(got.shape)}, expected the step's {tuple(step.shape)}",
                       mistake="no step gradient", hint=_HINTS["no step gradient"])
    n = v.numel() // step.numel()
    g = 1.0 / math.sqrt(n * q_p)
    got, want = got.double(), want.double()
    # Tolerance: a step's gradient is g·Σ dL/dv̂·(q − v/s) inside (±Q clipped) over its N elements. Each term is a
    # difference of two numbers of size ≤ |v/s| + 1, computed in fp32 (llmlab as (q·s − v)/s), so terms can differ
    # by ~2⁻²³·|dL/dv̂|·(|v/s| + 1) even when they cancel; tree sums of N terms add ~log2(N)·2⁻²⁴ of the sum of
    # those magnitudes. Both stay under 1e-6 of g·Σ|dL/dv̂|·(|v/s| + 1); 1e-5 of it leaves slack and is still far
    # below any wrong factor or term (a missing g is off by √(N·Q_P) ≥ √3 here).
    atol = 1e-5 * g * (grad.double().abs() * (v.double().abs() / step.double() + 1)).sum_to_size(step.shape)
    if bool(((got - want).abs() <= atol).all()):
        return
    t = _terms(v, step, grad, q_n, q_p)
    clipped = t["below"] + t["above"]
    variants = {  # key → (what it is, the step's gradient it gives)
        "no g": (f"the gradient scale g = 1/√(N·Q_P) = {g:.4g} is missing", want / g),
        "no Q_P in g": ("g = 1/√(N·Q_P), not 1/√N", want * math.sqrt(q_p)),
        "g from Q_N": ("g takes Q_N; LSQ's is 1/√(N·Q_P), with the positive end Q_P",
                       want * math.sqrt(q_p / q_n) if q_n else None),
        "N whole tensor": (f"N counts all {v.numel()} elements; it is the {n} that share one step",
                           want * math.sqrt(n / v.numel()) if step.numel() > 1 else None),
        "sign": ("its sign is flipped: inside the grid the term is round(v/s) − v/s", -want),
        "no inside term": ("inside the grid every element adds 0: eq. 3's round(v/s) − v/s is missing (a "
                           "straight-through round, differentiated as the identity, gives that 0)", g * clipped),
        "round only": ("inside the grid the term is round(v/s); it is round(v/s) − v/s", g * (t["round"] + clipped)),
        "no clipped terms": ("clipped elements add 0; they add −Q_N below the grid and Q_P above it", g * t["inside"]),
        "below sign": ("below the grid the term is +Q_N; it is −Q_N", g * (t["inside"] - t["below"] + t["above"])),
    }
    differs = (f"{what}: dL/dstep = {got.flatten()[:3].tolist()}{'…' if got.numel() > 3 else ''}, expected "
               f"{want.flatten()[:3].tolist()} (llmlab's LSQQuantizer, g = {g:.4g})")
    # the variant nearest the answer, in units of its tolerance: with one step (a scalar gradient) another variant
    # lands within the tolerance of a mistake's value by chance (first-listed-wins named the wrong one 1 run in 100)
    near = {key: float(((got - value).abs() / (1e-6 * value.abs() + atol)).max())
            for key, (why, value) in variants.items()
            if value is not None and not bool(((value - want).abs() <= atol).all())}
    key = min(near, key=near.get, default=None)
    if key is not None and near[key] <= 1:
        raise Mismatch(f"{differs}: {variants[key][0]}", mistake=key, hint=_HINTS[key])
    assert_close(got, want, what=f"{what}: dL/dstep", rtol=0, atol=atol.max().item())


def _judge_init(init_step, rng: random.Random) -> None:
    """lsq_init_step against LSQQuantizer.init_step: signed weights per tensor and per row, unsigned activations,
    and a weight with one all-zero row (its step: fp32 eps, not 0)."""
    w = torch.randn(rng.randrange(3, 40, 2), rng.randrange(3, 40, 2)) * rng.uniform(0.01, 2)  # (out, in)
    dead = w.clone()
    dead[rng.randrange(w.shape[0])] = 0  # a pruned row
    x = torch.randn(5, rng.randrange(3, 30, 2), 7).relu()  # (B, T, C) activations
    for v, bits, signed, ch_axis in ((w, 4, True, None), (w, 8, True, 0), (x, 8, False, None), (x, 4, False, -1),
                                     (dead, 4, True, 0)):
        q_n, q_p = _grid(bits, signed)
        what = (f"lsq_init_step(v of shape {tuple(v.shape)}, q_p={q_p}, ch_axis={ch_axis})"
                + (" with an all-zero row" if v is dead else ""))
        quantizer = LSQQuantizer(bits, signed, per_channel=ch_axis is not None, ch_axis=ch_axis or 0)
        quantizer.init_step(v)
        want = quantizer.step.detach().reshape(_step_shape(tuple(v.shape), ch_axis))
        got = init_step(v, q_p, ch_axis) if ch_axis is not None else init_step(v, q_p)
        if not isinstance(got, torch.Tensor):
            raise Mismatch(f"{what} returned {type(got).__name__}, expected a tensor of shape {tuple(want.shape)}")
        if got.shape == want.shape and not torch.allclose(got, want, rtol=1e-5):
            if v is dead and bool((got == 0).any()):
                raise Mismatch(f"{what}: the zero row's step is 0, and v/s divides by it: keep the step ≥ fp32 eps",
                               mistake="init eps", hint=_HINTS["init eps"])
            mean = v.mean(dim=[d for d in range(v.dim()) if want.shape[d] == 1] if ch_axis is not None else None)
            signed_mean = (2 * mean / math.sqrt(q_p)).reshape(want.shape)  # clamped to eps or not
            if any(torch.allclose(got, m, rtol=1e-5) for m in (signed_mean, signed_mean.clamp(min=_EPS))):
                raise Mismatch(f"{what}: the step comes from v's mean; it is twice the mean of |v| over √Q_P",
                               mistake="init abs", hint=_HINTS["init abs"])
        # a mean of ≤ 40·40 fp32 magnitudes in another order, times 2/√Q_P: within ~1e-6 relative
        assert_close(got, want, what=f"{what}: the initial step 2·mean|v|/√Q_P", rtol=1e-5, atol=0)
