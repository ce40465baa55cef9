"""Checks for chapter 8's exercises (solutions/08_frontier.ipynb): LoRA, the top-2 router, LSQ's step gradient.

    from llmlab.checks import ch08 as check
    check.lora_linear(LoRA)                     # 8.1: a class LoRA(base, r, alpha), an nn.Module
    check.top2_router(top2_route)               # 8.2: logits (T, E) -> (expert, gate, balance_loss)
    check.lsq(lsq_fake_quantize)                # 8.3: (v, step, bits) -> v̂, differentiable in v and step

Each check compares the learner's answer with llmlab's own (`llmlab.lora`'s maths, `llmlab.moe.route`,
PyTorch's `torch._fake_quantize_learnable_per_tensor_affine`, the op `llmlab.quant.LSQQuantizer` is tested
against) on fresh random inputs and odd sizes, and names the known mistakes: both LoRA matrices zero (the course
text's snippet: it never learns), a missing α/r, unrenormalised gates, fᵢ taken from the router probabilities,
LSQ without its gradient scale g = 1/√(N·Q_P) or without a straight-through round.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmlab.checks import Hint, Mismatch, assert_close, check, fresh_rng
from llmlab.moe import route

__all__ = ["lora_linear", "top2_router", "lsq", "lsq_inputs"]


def _tensor(value, what: str):
    if not isinstance(value, torch.Tensor):
        raise Mismatch(f"{what}: got {type(value).__name__}, expected a torch.Tensor")
    return value


# --- 8.1: LoRA's forward with the paper's initialisation -----------------------------------------------------

def _lora_cases(rng: random.Random) -> list[tuple[int, int, int, float]]:
    cases = [(16, 24, 4, 8.0),  # α ≠ r: a missing α/r shows
             (7, 5, 1, 1.0),  # r = 1, odd sizes
             (64, 192, 8, 16.0)]  # the tiny GPT's attn.c_attn (64 -> 3·64)
    n_in, n_out = rng.randint(3, 40), rng.randint(3, 40)
    r = rng.randint(1, min(n_in, n_out, 8))
    cases.append((n_in, n_out, r, float(rng.choice([r, 2 * r]))))  # α = r or 2r, as LoRA is used
    return cases


def _parameter(layer, name: str, shape: tuple[int, ...], what: str):
    p = getattr(layer, name, None)
    if not isinstance(p, nn.Parameter):
        raise Mismatch(f"{what}: self.{name} is {type(p).__name__}, expected an nn.Parameter of shape {shape}")
    if tuple(p.shape) != shape:
        raise Mismatch(f"{what}: self.{name} has shape {tuple(p.shape)}, expected {shape}")
    return p


_LORA_FORMULA = ("draw lora_A (r, in) at random — nn.init.kaiming_uniform_(A, a=math.sqrt(5)) as loralib does, or "
                 "a Gaussian — and set lora_B (out, r) to zero, so ΔW = BA = 0 at the start while dL/dB = "
                 "(α/r)·g(Ax)ᵀ ≠ 0; with both zero (the course text's snippet) Ax = 0 and Bᵀg = 0, so neither ever "
                 "gets a gradient. forward: base(x) + (α/r) · (x @ A.T) @ B.T, with the base Linear frozen "
                 "(requires_grad_(False))")
_LORA_INIT = Hint(
    nudge="look at how you initialise lora_A and lora_B: which of the two is random, and which is zero?",
    idea="ΔW = BA must be 0 at the start, so one of the two matrices is zero; but each one's gradient flows through "
         "the other (dL/dB through Ax, dL/dA through Bᵀg), so the other must be random: the paper draws A at random "
         "and puts the zero in B",
    formula=_LORA_FORMULA)
_LORA_FROZEN = Hint(
    nudge="look at which parameters require a gradient once your __init__ has run",
    idea="only lora_A and lora_B train; the base layer's weight and bias stay frozen, so the pretrained weights "
         "never change and only the low-rank update is learnt",
    formula=_LORA_FORMULA)
_LORA_SCALE = Hint(
    nudge="look at the factor your forward multiplies the LoRA path by",
    idea="the low-rank update BAx is scaled by α over the rank, so that a change of r does not change how large "
         "the update is for the same α",
    formula=_LORA_FORMULA)


@check("8.1", "LoRA's forward with the paper's initialisation", hint=Hint(
    nudge="look at how you initialise lora_A and lora_B, and at what your forward adds to the base layer's output",
    idea="at the start the LoRA path must add nothing (BA = 0) and still give both matrices a gradient; the forward "
         "adds that low-rank path, scaled, to the output of the frozen base layer",
    formula=_LORA_FORMULA))
def lora_linear(cls):
    """`cls(base, r, alpha)`: a module around the nn.Linear `base` with parameters lora_A (r, in), lora_B (out, r)."""

    for n_in, n_out, r, alpha in _lora_cases(fresh_rng()):
        what = f"LoRA(nn.Linear({n_in}, {n_out}), r={r}, alpha={alpha:g})"
        base = nn.Linear(n_in, n_out)
        w0, b0 = base.weight.detach().clone(), base.bias.detach().clone()
        layer = cls(base, r, alpha)
        if not isinstance(layer, nn.Module):
            raise Mismatch(f"{what} is a {type(layer).__name__}, expected an nn.Module")
        A = _parameter(layer, "lora_A", (r, n_in), what)
        B = _parameter(layer, "lora_B", (n_out, r), what)
        trainable = [name for name, p in layer.named_parameters() if p.requires_grad]
        if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
            raise Mismatch(f"{what}: the base layer's weight or bias is trainable (trainable: {trainable}); LoRA "
                           "freezes them: base.requires_grad_(False)", mistake="base trainable", hint=_LORA_FROZEN)
        if sorted(trainable) != ["lora_A", "lora_B"]:
            raise Mismatch(f"{what}: the trainable parameters are {trainable}, expected exactly lora_A and lora_B",
                           mistake="trainable parameters", hint=_LORA_FROZEN)

        x = torch.randn(3, 5, n_in)  # (batch, tokens, in): a forward must take any leading dims
        y = layer(x)
        y = _tensor(y, f"{what}(x)")
        want = F.linear(x, w0, b0)  # (3, 5, out)
        if B.detach().count_nonzero() and A.detach().count_nonzero():
            raise Mismatch(f"{what}: lora_B is not zero at initialisation, so ΔW = BA ≠ 0 and the model is no longer "
                           "the pretrained one before training starts", mistake="B not zero", hint=_LORA_INIT)
        # default fp32 tolerances: with B = 0 the LoRA path adds exact zeros (or W + 0·A, merged), so a right answer
        # is the base layer's F.linear to within its summation order, a few ulp
        assert_close(y, want, what=f"{what}(x) at initialisation (must equal the base layer's output: ΔW = BA = 0)")

        (y * torch.randn_like(y)).sum().backward()
        if A.detach().count_nonzero() == 0:
            if B.detach().count_nonzero() == 0:
                raise Mismatch(f"{what}: lora_A and lora_B are both all zeros (the course text's snippet): Ax = 0 and "
                               "Bᵀg = 0, so neither ever receives a gradient and the model never learns",
                               mistake="both zero", hint=_LORA_INIT)
            raise Mismatch(f"{what}: lora_A is all zeros, so Ax = 0 and lora_B never receives a gradient; the paper "
                           "draws A at random and puts the zero in B", mistake="A zero", hint=_LORA_INIT)
        if B.grad is None or B.grad.count_nonzero() == 0:
            raise Mismatch(f"{what}: lora_B received no gradient from a backward pass through the LoRA path",
                           mistake="B no gradient")
        if A.detach().unique().numel() < min(2, A.numel()):
            raise Mismatch(f"{what}: every entry of lora_A is {A.flatten()[0].item():g}: draw it at random",
                           mistake="A constant", hint=_LORA_INIT)

        with torch.no_grad():  # now a non-zero update: the output must be W₀x + b + (α/r)·BAx
            B.copy_(torch.randn_like(B))
            y = layer(x)
        u = x @ A.detach().T @ B.detach().T  # (3, 5, out): BAx
        # the two sides sum ~in + r products of O(1) values in different orders: ~1e-6 apart in fp32
        try:
            assert_close(y, want + (alpha / r) * u, what=f"{what}(x) with a random lora_B", rtol=1e-5, atol=1e-5)
        except Mismatch as e:
            for scale, why in ((1.0, "the LoRA path is not scaled: multiply BAx by α/r"),
                               (alpha, "the scale is α; it is α/r"), (r / alpha, "the scale is r/α; it is α/r")):
                if torch.allclose(y, want + scale * u, rtol=1e-5, atol=1e-5):
                    raise Mismatch(f"{e}: {why}", mistake="scale", hint=_LORA_SCALE) from None
            raise

        _trains_and_merges(cls, n_in, n_out, r, alpha, what)


def _trains_and_merges(cls, n_in: int, n_out: int, r: int, alpha: float, what: str) -> None:
    """A few AdamW steps towards a rank-r change of the base layer: the loss must fall, the frozen weight stay, and
    folding (α/r)·BA into the weight must give what the module computes."""

    base = nn.Linear(n_in, n_out)
    w0, b0 = base.weight.detach().clone(), base.bias.detach().clone()
    layer = cls(base, r, alpha)
    x = torch.randn(64, n_in)  # (64, in)
    target = F.linear(x, w0 + 0.5 * torch.randn(n_out, r) @ torch.randn(r, n_in) / math.sqrt(n_in), b0)  # (64, out)
    optimizer = torch.optim.AdamW([layer.lora_A, layer.lora_B], lr=1e-2)
    losses = []
    for _ in range(20):
        loss = (layer(x) - target).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # measured over 500 draws per case, the reference ends at ≤ 0.91 of its first loss in the slowest case (7 → 5,
    # r = 1, α/r = 1; median 0.69; 0.9 failed it in 1 call of 300) and ≤ 0.82 in the random ones; an answer whose
    # LoRA path gets no gradient, or a wrong one, stays at 1 or climbs: "falls by 1%" separates the two
    if not losses[-1] < 0.99 * losses[0]:
        raise Mismatch(f"{what}: 20 AdamW steps fitting a rank-{r} change of the weight took the loss from "
                       f"{losses[0]:.4g} to {losses[-1]:.4g}: it does not learn", mistake="does not learn")
    if not torch.equal(base.weight.detach(), w0):
        raise Mismatch(f"{what}: training changed the frozen base weight", mistake="base changed", hint=_LORA_FROZEN)
    merged = F.linear(x, w0 + (alpha / r) * layer.lora_B.detach() @ layer.lora_A.detach(), b0)  # W₀ + (α/r)·BA
    with torch.no_grad():
        y = layer(x)
    assert_close(y, merged, what=f"{what} after training vs the merged Linear W₀ + (α/r)·BA", rtol=1e-5, atol=1e-5)


# --- 8.2: the top-2 router with the Switch balance loss -------------------------------------------------------

def _router_cases(rng: random.Random) -> list[tuple[int, int, float]]:
    cases = [(1, 2, 1.0),  # one token, two experts: both chosen
             (7, 3, 2.0), (64, 8, 1.0), (257, 16, 3.0)]
    cases += [(rng.randint(2, 300), rng.randint(2, 32), rng.uniform(0.3, 3.0)) for _ in range(2)]
    return cases


def _balance_variants(logits, expert) -> dict[str, tuple[str, object]]:
    """Balance losses a plausible mistake computes, from the (T, E) logits and (T, 2) chosen experts: the mistake's
    key → (what it is, its value)."""

    T, E = logits.shape
    p = logits.float().softmax(-1)  # (T, E)
    P = p.mean(0)  # (E,)
    load = torch.bincount(expert.flatten(), minlength=E).float()  # (E,) both choices
    first = torch.bincount(expert[:, 0], minlength=E).float()  # (E,) first choices only
    return {"f from P": ("fᵢ taken from the router probabilities (E·Σ Pᵢ²): fᵢ is the fraction of assignments "
                         "routed to expert i, a count", E * (P * P).sum()),
            "first choices only": ("fᵢ counts first choices only (as for k = 1); here fᵢ is the fraction of all 2·T "
                                   "assignments, both choices", E * (first / T * P).sum()),
            "f over T": ("twice the expected value: fᵢ divides expert i's load by the 2·T assignments, not by T",
                         E * (load / T * P).sum()),
            "no factor N": ("the factor N (the number of experts) is missing, so uniform routing does not give 1",
                            (load / (2 * T) * P).sum())}


_ROUTER_FORMULA = ("p = softmax(logits) (in fp32); take the top 2 of p per token, most probable first; gates = the "
                   "two probabilities divided by their sum (GShard renormalises for k ≥ 2); balance = N·Σᵢ fᵢ·Pᵢ with "
                   "N = E, Pᵢ = mean over tokens of pᵢ, fᵢ = (assignments to expert i, both choices counted) / (2·T) "
                   "— a count, with no gradient")
_BALANCE_F = Hint(
    nudge="look at fᵢ in the balance loss: what it counts, and what it divides by",
    idea="fᵢ is the fraction of routing decisions that went to expert i, counted from the chosen experts (no "
         "gradient): both choices of every token count, out of all the assignments; the gradient comes through Pᵢ, "
         "the mean router probability",
    formula=_ROUTER_FORMULA)
_ROUTER_HINTS = {
    "order": Hint(
        nudge="look at the order of each token's two experts",
        idea="the first column is the expert with the larger router probability, the second the runner-up: take "
             "the top 2 sorted from the largest down",
        formula=_ROUTER_FORMULA),
    "raw gates": Hint(
        nudge="look at what each token's two gates add up to",
        idea="the two chosen probabilities are renormalised over the pair, so that a token's gates sum to 1 (GShard "
             "does so for k ≥ 2)",
        formula=_ROUTER_FORMULA),
    "f from P": _BALANCE_F, "first choices only": _BALANCE_F, "f over T": _BALANCE_F,
    "no factor N": Hint(
        nudge="look at the factor in front of the sum in the balance loss",
        idea="the sum is multiplied by the number of experts, so that uniform routing (fᵢ = Pᵢ = 1/E) gives a loss "
             "of 1 whatever the number of experts",
        formula=_ROUTER_FORMULA),
    "detached": Hint(
        nudge="look at where your router's outputs lose their connection to the logits",
        idea="the router learns through both the gates and the balance loss, so the probabilities must stay in the "
             "autograd graph; only the counts fᵢ carry no gradient",
        formula=_ROUTER_FORMULA),
}


@check("8.2", "the top-2 router with the balance loss", hint=Hint(
    nudge="look at the three outputs in turn: which two experts each token picks, how its two gates are normalised, "
          "and what the balance loss counts",
    idea="each token goes to the two experts of largest router probability, with gates that share its weight "
         "between them; the balance loss multiplies, expert by expert, the fraction of assignments by the mean "
         "probability",
    formula=_ROUTER_FORMULA))
def top2_router(fn):
    """`fn(logits)` for (T, E) logits: (expert (T, 2) int64, gate (T, 2), balance_loss ()), as llmlab.moe.route."""

    for T, E, spread in _router_cases(fresh_rng()):
        what = f"top2_route(logits of shape ({T}, {E}))"
        logits = (torch.randn(T, E) * spread).requires_grad_(True)  # (T, E)
        ref_logits = logits.detach().clone().requires_grad_(True)
        ref = route(ref_logits, 2, None)
        answer = fn(logits)
        if not isinstance(answer, tuple | list) or len(answer) != 3:
            raise Mismatch(f"{what} returned {type(answer).__name__}; expected a triple (expert, gate, balance_loss)")
        expert, gate, balance = (_tensor(a, f"{what}[{i}]") for i, a in enumerate(answer))
        if expert.shape != (T, 2):
            raise Mismatch(f"{what}: expert has shape {tuple(expert.shape)}, expected ({T}, 2)")
        if not torch.equal(expert.long(), ref.expert):
            if torch.equal(expert.long().sort(-1).values, ref.expert.sort(-1).values):
                raise Mismatch(f"{what}: the right two experts, in the wrong order: put the most probable first",
                               mistake="order", hint=_ROUTER_HINTS["order"])
            row = int((expert.long() != ref.expert).any(-1).nonzero()[0])
            raise Mismatch(f"{what}: token {row} goes to experts {expert[row].tolist()}, expected "
                           f"{ref.expert[row].tolist()} (the two largest router probabilities)")
        top = ref.probs.detach().gather(1, ref.expert)  # (T, 2) unrenormalised
        if gate.shape == (T, 2) and torch.allclose(gate.detach().float(), top, rtol=1e-5, atol=1e-6) and not \
                torch.allclose(top, ref.gate.detach(), rtol=1e-5, atol=1e-6):  # with E = 2 the two coincide
            raise Mismatch(f"{what}: the gates are the raw probabilities (token 0's sum to "
                           f"{gate[0].sum().item():.4g}): renormalise the two so each token's gates sum to 1",
                           mistake="raw gates", hint=_ROUTER_HINTS["raw gates"])
        # default fp32 tolerances: softmax, top-2 and a division, the same fp32 operations as route's up to order
        assert_close(gate, ref.gate, what=f"{what}: gate")
        if balance.dim() != 0:
            raise Mismatch(f"{what}: balance_loss has shape {tuple(balance.shape)}, expected a scalar")
        # a wrong value (outside assert_close's default tolerance, below) is named when it is a known variant's;
        # deciding by the answer, not by how far the variant lies from the reference (once 1e-4 of it), names a
        # variant that lands 1e-5 … 1e-4 away too — two near-equal router probabilities did so in 1 call of 130
        if not torch.isclose(balance.detach().float(), ref.balance_loss.detach(), rtol=1.3e-6, atol=1e-5):
            for key, (why, value) in _balance_variants(logits.detach(), ref.expert).items():
                if torch.isclose(balance.detach().float(), value, rtol=1e-5, atol=1e-7):
                    raise Mismatch(f"{what}: balance_loss = {balance.item():.6g}, expected "
                                   f"{ref.balance_loss.item():.6g}: {why}", mistake=key, hint=_ROUTER_HINTS[key])
        assert_close(balance, ref.balance_loss, what=f"{what}: balance_loss")  # E sums of T fp32 values: a few ulp

        weights = torch.randn(T, 2)  # an arbitrary loss of the gates, plus the balance loss
        (ref.gate * weights).sum().add(ref.balance_loss).backward()
        if not balance.requires_grad or not gate.requires_grad:
            raise Mismatch(f"{what}: {'balance_loss' if not balance.requires_grad else 'gate'} has no gradient w.r.t. "
                           "the logits: the router learns through both (don't detach the probabilities)",
                           mistake="detached", hint=_ROUTER_HINTS["detached"])
        (gate * weights).sum().add(balance).backward()
        grad_close = dict(rtol=1e-4, atol=1e-6)  # fp32 softmax gradients, summed in other orders
        if not torch.allclose(logits.grad, ref_logits.grad, **grad_close):
            _diagnose_balance_gradient(logits.grad, logits.detach(), ref, weights, grad_close, what)
        assert_close(logits.grad, ref_logits.grad, what=f"{what}: d(gate·w + balance_loss)/dlogits", **grad_close)


def _diagnose_balance_gradient(grad, logits, ref, weights, grad_close, what: str) -> None:
    """Name the mistake whose gradient the answer has. With near-uniform routing a wrong balance loss can equal
    the right one in value (E·Σ Pᵢ² = 1 + O((p₀ − p₁)²) for two experts) while its gradient still differs."""

    for key, (why, _) in _balance_variants(logits, ref.expert).items():
        x = logits.clone().requires_grad_(True)  # (T, E)
        routing = route(x, 2, None)
        (routing.gate * weights).sum().add(_balance_variants(x, routing.expert)[key][1]).backward()
        if torch.allclose(grad, x.grad, **grad_close):
            raise Mismatch(f"{what}: balance_loss has the gradient of a different loss: {why}", mistake=key,
                           hint=_ROUTER_HINTS[key])


# --- 8.3: LSQ's forward and its step-size gradient -------------------------------------------------------------

def lsq_inputs(shape, bits: int, seed: int | None = None):
    """(v, step) for the LSQ check: v Gaussian, step around LSQ's initialisation 2·mean|v|/√Q_P (times 0.3-1.5, so
    some values are clipped), with every v/step kept 0.01 or more from a rounding tie k + ½ and outside the
    half step just past each end of the grid, where LSQ's paper and PyTorch's op draw the clipping line
    differently (llmlab.quant's module docstring): there both conventions give the same gradients. With more
    than one element, the largest |v| is made an outlier 1.3 steps beyond the grid, so something is clipped."""

    g = torch.Generator().manual_seed(seed if seed is not None else random.randrange(2**31))
    q_min, q_max = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    v = torch.randn(shape, generator=g) * (0.1 + 2 * torch.rand((), generator=g))
    step = 2 * v.abs().mean() / math.sqrt(q_max) * (0.3 + 1.2 * torch.rand((), generator=g))
    step = step.clamp(min=1e-3).reshape(1)  # (1,)
    t = v / step  # in grid units
    near_tie = ((t - t.floor()) - 0.5).abs() < 0.01
    t = torch.where(near_tie, t + 0.02, t)
    t = torch.where((t > q_max) & (t < q_max + 0.51), t + 0.52, t)  # past the top: clearly clipped
    t = torch.where((t < q_min) & (t > q_min - 0.51), t - 0.52, t)
    if t.numel() > 1:  # at least one outlier beyond the grid, so clipping is always exercised
        t.view(-1)[t.abs().argmax()] = q_max + 1.3 if t.view(-1)[t.abs().argmax()] > 0 else q_min - 1.3
    return (t * step).contiguous(), step


def _lsq_cases(rng: random.Random):
    cases = [((33, 17), 4), ((5,), 2), ((64, 96), 8), ((48, 40), 3)]
    cases.append(((rng.randint(1, 80), rng.randint(1, 80)), rng.choice([2, 3, 4, 5, 8])))
    return cases + [((1,), 4)]  # one element last: there g = 1/√Q_P, and a missing g and 1/√N look alike


_LSQ_FORMULA = ("v̂ = round(clamp(v/s, −Q_N, Q_P))·s with Q_N = 2^(b−1), Q_P = 2^(b−1) − 1; round straight "
                "through ((round(x) − x).detach() + x) so dv̂/dv = 1 inside and 0 where clipped; and scale the step's "
                "gradient by g = 1/√(N·Q_P), N = v.numel(): use s_g = s·g + (s − s·g).detach() in place of s (its "
                "value is s, its gradient g times s's), or write a torch.autograd.Function")
_LSQ_STEP_SCALE = Hint(
    nudge="look at the factor that scales the step's gradient",
    idea="LSQ scales the step's gradient down by the square root of the number of values times the positive end "
         "of the grid, so that the step learns at the pace of the weights; the forward keeps the value s",
    formula=_LSQ_FORMULA)
_LSQ_HINTS = {
    "no clamp": Hint(
        nudge="look at the values of v/s that lie beyond the integer grid",
        idea="the quantised integers are limited to [−Q_N, Q_P], so v/s is clamped to that range before it is "
             "rounded",
        formula=_LSQ_FORMULA),
    "no STE": Hint(
        nudge="look at the gradient that flows back through your rounding",
        idea="round has a zero gradient almost everywhere; the straight-through estimator passes dL/dv̂ through it "
             "unchanged, as if the rounding were the identity",
        formula=_LSQ_FORMULA),
    "STE through the clip": Hint(
        nudge="look at dL/dv where v was clipped",
        idea="the straight-through estimator replaces the rounding's gradient only; the clamp keeps its own, which "
             "is 0 beyond the grid",
        formula=_LSQ_FORMULA),
    "step detached": Hint(
        nudge="look at whether v̂ depends on the step s through autograd",
        idea="v̂ = q·s with q computed from v/s: s must stay in the graph in both places, so that LSQ's gradient for "
             "it (rounded minus unrounded inside the grid, the grid's end outside) reaches it",
        formula=_LSQ_FORMULA),
    "no g": _LSQ_STEP_SCALE, "no Q_P in g": _LSQ_STEP_SCALE, "g from Q_N": _LSQ_STEP_SCALE,
    "sign": Hint(
        nudge="look at the sign of the step's gradient",
        idea="inside the grid dv̂/ds is q − v/s, the rounded value minus the unrounded one, and beyond it the grid's "
             "end: a straight-through round of v/s, multiplied back by s, gives exactly that",
        formula=_LSQ_FORMULA),
}


@check("8.3", "LSQ's forward with its step-size gradient", hint=Hint(
    nudge="look at the three things LSQ defines: the forward value v̂, the gradient to v, and the gradient to the "
          "step",
    idea="the forward rounds v/s onto the clipped integer grid and multiplies back by s; the gradient passes "
         "straight through the rounding (not through the clip) to v, and reaches s scaled down by a fixed factor",
    formula=_LSQ_FORMULA))
def lsq(fn):
    """`fn(v, step, bits)`: signed per-tensor LSQ of v with the (1,) learnable step, as
    torch._fake_quantize_learnable_per_tensor_affine(v, step, 0, −Q_N, Q_P, grad_factor=1/√(N·Q_P))."""

    for shape, bits in _lsq_cases(fresh_rng()):
        q_min, q_max = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        v, step = lsq_inputs(shape, bits)
        what = f"lsq_fake_quantize(v of shape {shape}, step={step.item():.4g}, bits={bits})"
        n = v.numel()
        g = 1.0 / math.sqrt(n * q_max)
        grad = torch.randn(shape)  # dL/dv̂
        v_ref, s_ref = v.clone().requires_grad_(True), step.clone().requires_grad_(True)
        out_ref = torch._fake_quantize_learnable_per_tensor_affine(v_ref, s_ref, torch.zeros(1), q_min, q_max, g)
        out_ref.backward(grad)
        v_in, s_in = v.clone().requires_grad_(True), step.clone().requires_grad_(True)
        out = _tensor(fn(v_in, s_in, bits), what)
        if out.shape != v.shape:
            raise Mismatch(f"{what}: the output has shape {tuple(out.shape)}, expected {tuple(v.shape)}")
        clipped = (out_ref.detach() != v_ref.detach().div(step).round().mul(step))
        if clipped.any() and torch.allclose(out.detach(), v.div(step).round().mul(step)):
            raise Mismatch(f"{what}: values beyond the grid are not clipped ({int(clipped.sum())} of {n} should be): "
                           f"clamp v/s to [−Q_N, Q_P] = [{q_min}, {q_max}]", mistake="no clamp",
                           hint=_LSQ_HINTS["no clamp"])
        # integers times s: exact, or 1 ulp off where the answer's s is s·g + (s − s·g) rounded (default fp32 tol);
        # v/s is kept 0.01 from every rounding tie, so that ulp never changes an integer
        assert_close(out, out_ref, what=f"{what}: v̂")
        if not out.requires_grad:
            raise Mismatch(f"{what}: v̂ has no gradient at all", mistake="no gradient")
        out.backward(grad)

        inside = clipped.logical_not()
        if v_in.grad is None or v_in.grad.count_nonzero() == 0 and inside.any():
            raise Mismatch(f"{what}: dL/dv is zero everywhere: torch.round's gradient is 0 almost everywhere; pass "
                           "the gradient straight through it (STE): (round(x) − x).detach() + x", mistake="no STE",
                           hint=_LSQ_HINTS["no STE"])
        if clipped.any() and torch.equal(v_in.grad, grad):
            raise Mismatch(f"{what}: dL/dv passes the gradient where v was clipped too; it is 0 there (clamp's "
                           "gradient)", mistake="STE through the clip", hint=_LSQ_HINTS["STE through the clip"])
        assert_close(v_in.grad, v_ref.grad, what=f"{what}: dL/dv")  # dL/dv̂ or 0: exact
        if s_in.grad is None:
            raise Mismatch(f"{what}: step received no gradient: v̂ must depend on it (v̂ = q·s, q from v/s)",
                           mistake="step detached", hint=_LSQ_HINTS["step detached"])
        got, want = s_in.grad.double(), s_ref.grad.double()
        # Tolerance: the step's gradient is g·Σ dL/dv̂·(q − v/s) inside (±Q clipped). Each term is a difference of
        # two numbers of size ≤ |v/s| + 1, computed in fp32 (PyTorch as (q·s − v)/s, fused), so terms can differ
        # by ~2⁻²³·|dL/dv̂|·(|v/s| + 1) even when they cancel; tree sums of N terms add ~log2(N)·2⁻²⁴ of the sum of
        # those magnitudes. Both stay under 1e-6 of g·Σ|dL/dv̂|·(|v/s| + 1); 1e-5 of it leaves slack and is still far
        # below any wrong factor (a missing g is off by √(N·Q_P) ≥ √3 here).
        atol = 1e-5 * g * (grad.double().abs() * (v.double().abs() / step.double() + 1)).sum().item()
        if (got - want).abs().item() <= atol:
            continue
        factors = [(1 / g, "no g", f"it is 1/g = √(N·Q_P) = {1 / g:.4g}× PyTorch's: the gradient scale g = "
                                   "1/√(N·Q_P) is missing"),
                   (math.sqrt(q_max), "no Q_P in g",
                    f"it is √Q_P = {math.sqrt(q_max):.4g}× PyTorch's: g = 1/√(N·Q_P), not 1/√N"),
                   (-1.0, "sign", "its sign is flipped"),
                   (math.sqrt(q_max / -q_min), "g from Q_N",
                    "g takes Q_N; LSQ's is 1/√(N·Q_P), with the positive end Q_P")]
        known = next(((key, why) for f, key, why in factors if abs(f - 1) > 1e-9
                      and abs(got - f * want).item() <= 1e-6 * abs(f * want).item() + atol * abs(f)), None)
        differs = (f"{what}: dL/dstep = {got.item():.6g}, expected {want.item():.6g} (PyTorch's op, "
                   f"grad_factor g = {g:.4g}; tolerance {atol:.2g})")
        if known:
            raise Mismatch(f"{differs}: {known[1]}", mistake=known[0], hint=_LSQ_HINTS[known[0]])
        raise Mismatch(differs)
