"""Check 8.1 (re-exported by llmlab.checks.ch08): a whole LoRA layer, checked against `llmlab.lora.LoRALinear`.

    from llmlab.checks import ch08 as check
    check.lora_layer(LoRA)                      # 8.1

The learner's class `LoRA(base, r, alpha)` is an nn.Module around the nn.Linear `base` (Hu et al. 2021, eq. 3):
`base` frozen in place, parameters lora_A (r, in) random and lora_B (out, r) zero (the paper's §4.1
initialisation), `delta_weight()` = (α/r)·B·A, a forward `base(x) + (α/r)·x·Aᵀ·Bᵀ`, `merge()` folding ΔW into
the base weight (the forward then skips the LoRA path) and `unmerge()` taking it out again; merging a merged layer,
or unmerging an unmerged one, must not change the weight (llmlab's raises).

Each case (odd sizes, r = 1, α ≠ r, a float64 Linear without bias) builds the learner's layer and, once the
initialisation has been judged, llmlab's LoRALinear around a copy of the same Linear with the same A and a random
B in both; then it compares ΔW, the output, the gradients to A, B and x, the merged weight and output, a second
merge, the unmerged weight and output, and a second unmerge.
"""

from __future__ import annotations

import copy
import math
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmlab.checks import Hint, Mismatch, assert_close, check, fresh_rng
from llmlab.lora import LoRALinear

__all__ = ["lora_layer"]

_FORMULA = ("__init__: self.base = base.requires_grad_(False); self.scale = alpha / r; lora_A = nn.Parameter (r, in), "
            "drawn with nn.init.kaiming_uniform_(A, a=math.sqrt(5)) (loralib) or a Gaussian (the paper); lora_B = "
            "nn.Parameter(torch.zeros(out, r)), both with the base weight's dtype and device; self.merged = False. "
            "delta_weight: (B @ A)·scale. forward: base(x), plus (x @ A.T) @ B.T · scale unless merged. merge: "
            "refuse if merged, else with torch.no_grad(): base.weight += delta_weight(); merged = True. unmerge: "
            "the reverse, −=")
_HINTS = {
    "init": Hint(
        nudge="look at how you initialise lora_A and lora_B: which of the two is random, and which is zero?",
        idea="ΔW = BA must be 0 at the start, so one of the two matrices is zero; but each one's gradient flows "
             "through the other (dL/dB through Ax, dL/dA through Bᵀg), so the other must be random: the paper draws "
             "A at random and puts the zero in B",
        formula=_FORMULA),
    "frozen": Hint(
        nudge="look at which parameters require a gradient once your __init__ has run",
        idea="only lora_A and lora_B train; the base layer's weight and bias stay frozen, in the very nn.Linear the "
             "layer was given, so the pretrained weights never change and only the low-rank update is learnt",
        formula=_FORMULA),
    "dtype": Hint(
        nudge="look at the dtype and device you create lora_A and lora_B with",
        idea="the LoRA path is added to the base layer's output, so its matrices live where the base weight does "
             "and in its dtype (a float64 or bf16 model gets float64 or bf16 A and B)",
        formula=_FORMULA),
    "scale": Hint(
        nudge="look at the factor your layer multiplies B·A (or the LoRA path) by",
        idea="the low-rank update is scaled by α over the rank, so that a change of r does not change how large "
             "the update is for the same α",
        formula=_FORMULA),
    "merge": Hint(
        nudge="look at what merge() adds to the base weight",
        idea="merge folds exactly the update the forward adds, the scaled (α/r)·B·A, into the frozen weight, so that "
             "the merged Linear alone computes what the layer computed",
        formula=_FORMULA),
    "graph": Hint(
        nudge="look at whether merge() and unmerge() run under autograd",
        idea="an in-place update of a weight with a value computed from A and B records that computation in the "
             "autograd graph: the weight stops being a frozen leaf. Folding the update in is not part of training",
        formula=_FORMULA),
    "merged forward": Hint(
        nudge="look at what your forward computes once the layer is merged",
        idea="after merge() the base weight already holds ΔW: the forward must skip the LoRA path (a flag set by "
             "merge, cleared by unmerge), or it adds the update twice",
        formula=_FORMULA),
    "twice": Hint(
        nudge="look at what a second merge() (or unmerge()) in a row does to the weight",
        idea="merging a merged layer would fold ΔW in a second time: keep a flag, and refuse (llmlab raises "
             "RuntimeError) or do nothing when it is already in the state asked for",
        formula=_FORMULA),
    "unmerge": Hint(
        nudge="look at what unmerge() does to the base weight",
        idea="unmerge takes out exactly what merge put in, W ← W − (α/r)·B·A, and clears the flag so the forward "
             "adds the LoRA path again",
        formula=_FORMULA),
}


def _cases(rng: random.Random) -> list[tuple[int, int, int, float, torch.dtype, bool]]:
    """(in, out, r, α, dtype, bias) of every case."""
    cases = [(16, 24, 4, 8.0, torch.float32, True),  # α ≠ r: a wrong scale shows
             (7, 5, 1, 1.0, torch.float32, True),  # r = 1, odd sizes
             (64, 192, 8, 16.0, torch.float32, True),  # the tiny GPT's attn.c_attn (64 -> 3·64)
             (9, 13, 3, 6.0, torch.float64, False)]  # a float64 Linear without bias: A and B follow its dtype
    n_in, n_out = rng.randrange(3, 41, 2), rng.randrange(3, 41, 2)
    r = rng.randint(1, min(n_in, n_out, 8))
    cases.append((n_in, n_out, r, float(rng.choice([r, 2 * r, 3 * r])), torch.float32, True))
    return cases


def _parameter(layer, name: str, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> nn.Parameter:
    p = getattr(layer, name, None)
    if not isinstance(p, nn.Parameter):
        raise Mismatch(f"{what}: self.{name} is {type(p).__name__}, expected an nn.Parameter of shape {shape}")
    if tuple(p.shape) != shape:
        raise Mismatch(f"{what}: self.{name} has shape {tuple(p.shape)}, expected {shape}")
    if p.dtype != dtype:
        raise Mismatch(f"{what}: self.{name} is {p.dtype}, the base weight {dtype}: create A and B with the base "
                       "weight's dtype and device", mistake="dtype", hint=_HINTS["dtype"])
    return p


def _scale_mistake(got, want_of, s: float, alpha: float, r: int, close: dict) -> str | None:
    """The wrong scale `got` was computed with, from `want_of(scale)`, or None."""
    for scale, why in ((1.0, "the update is not scaled: multiply B·A by α/r"), (alpha, "the scale is α; it is α/r"),
                       (r / alpha, "the scale is r/α; it is α/r")):
        if abs(scale - s) > 1e-9 * s and torch.allclose(got, want_of(scale), **close):
            return why
    return None


@check("8.1", "a LoRA layer with merge and unmerge", hint=Hint(
    nudge="look at the five parts in turn: the parameters __init__ makes, ΔW, the forward, merge and unmerge",
    idea="a frozen Linear plus a scaled low-rank path whose B starts at zero; merge folds that scaled update into "
         "the Linear's weight and the forward then skips the path; unmerge takes it out again",
    formula=_FORMULA))
def lora_layer(cls):
    """`cls(base, r, alpha)`: see the module docstring."""
    for n_in, n_out, r, alpha, dtype, bias in _cases(fresh_rng()):
        _judge(cls, n_in, n_out, r, alpha, dtype, bias)


def _judge(cls, n_in: int, n_out: int, r: int, alpha: float, dtype: torch.dtype, bias: bool) -> None:
    what = f"LoRA(nn.Linear({n_in}, {n_out}{'' if bias else ', bias=False'}, {str(dtype)[6:]}), r={r}, alpha={alpha:g})"
    s = alpha / r
    base = nn.Linear(n_in, n_out, bias=bias, dtype=dtype)
    w0 = base.weight.detach().clone()  # (out, in)
    b0 = base.bias.detach().clone() if bias else None
    layer = cls(base, r, alpha)
    if not isinstance(layer, nn.Module):
        raise Mismatch(f"{what} is a {type(layer).__name__}, expected an nn.Module")
    if not any(m is base for m in layer.modules()):
        raise Mismatch(f"{what}: the layer does not hold the nn.Linear it was given (a copy, or none): keep it, "
                       "frozen in place, as self.base = base", mistake="frozen", hint=_HINTS["frozen"])
    A = _parameter(layer, "lora_A", (r, n_in), dtype, what)
    B = _parameter(layer, "lora_B", (n_out, r), dtype, what)
    trainable = [name for name, p in layer.named_parameters() if p.requires_grad]
    if any(p.requires_grad for p in base.parameters()):
        raise Mismatch(f"{what}: the base layer's weight or bias is trainable (trainable: {trainable}); LoRA freezes "
                       "them: base.requires_grad_(False)", mistake="frozen", hint=_HINTS["frozen"])
    if sorted(trainable) != ["lora_A", "lora_B"]:
        raise Mismatch(f"{what}: the trainable parameters are {trainable}, expected exactly lora_A and lora_B",
                       mistake="frozen", hint=_HINTS["frozen"])

    x = torch.randn(3, 5, n_in, dtype=dtype)  # (batch, tokens, in): a forward must take any leading dims
    y = layer(x)
    plain = F.linear(x, w0, b0)  # (3, 5, out)
    if A.detach().count_nonzero() == 0:
        both = B.detach().count_nonzero() == 0
        raise Mismatch(f"{what}: " + ("lora_A and lora_B are both all zeros (the course text's snippet): Ax = 0 and "
                                      "Bᵀg = 0, so neither ever receives a gradient and the model never learns"
                                      if both else "lora_A is all zeros, so Ax = 0 and lora_B never receives a "
                                      "gradient; the paper draws A at random and puts the zero in B"),
                       mistake="init", hint=_HINTS["init"])
    if B.detach().count_nonzero():
        raise Mismatch(f"{what}: lora_B is not zero at initialisation, so ΔW = BA ≠ 0 and the model is no longer the "
                       "pretrained one before training starts", mistake="init", hint=_HINTS["init"])
    if A.detach().unique().numel() < min(2, A.numel()):
        raise Mismatch(f"{what}: every entry of lora_A is {A.flatten()[0].item():g}: draw it at random",
                       mistake="init", hint=_HINTS["init"])
    # default tolerances: with B = 0 the LoRA path adds exact zeros, so a right answer is the base layer's own
    # F.linear, to within its summation order (a few ulp)
    assert_close(y, plain, what=f"{what}(x) at initialisation (must equal the base layer's output: ΔW = BA = 0)")

    with torch.no_grad():  # from here on both layers hold the same random A (of loralib's size) and B
        A.copy_(torch.empty_like(A).uniform_(-1, 1) / math.sqrt(n_in))
        B.copy_(torch.randn_like(B))
    ref = LoRALinear(copy.deepcopy(base), r, alpha)
    with torch.no_grad():
        ref.lora_A.copy_(A)
        ref.lora_B.copy_(B)
    # fp32 sums of at most in + r products of O(1) values (α/r ≤ 3) in other orders than llmlab's (a forward
    # through W₀ + ΔW, say): over 500 draws of every case they came within 0.4 of 1e-5 + 1e-5·|y|; twice that
    # leaves room and is far below a wrong scale (a factor ≥ 1.5 on an O(1) update)
    close = dict(rtol=2e-5, atol=2e-5)
    delta = getattr(layer, "delta_weight", None)
    if not callable(delta):
        raise Mismatch(f"{what}: the layer has no method delta_weight() returning ΔW = (α/r)·B·A")
    got_delta = delta()
    if isinstance(got_delta, torch.Tensor) and got_delta.shape == (n_out, n_in) and not torch.allclose(
            got_delta.detach(), ref.delta_weight().detach(), **close):
        why = _scale_mistake(got_delta.detach(), lambda c: c * B.detach() @ A.detach(), s, alpha, r, close)
        if why:
            raise Mismatch(f"{what}: delta_weight(): {why}", mistake="scale", hint=_HINTS["scale"])
    assert_close(got_delta, ref.delta_weight(), what=f"{what}.delta_weight() (ΔW = (α/r)·B·A)", **close)

    xa, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y, want = layer(xa), ref(xr)  # (3, 5, out) each
    if isinstance(y, torch.Tensor) and y.shape == want.shape and not torch.allclose(y.detach(), want.detach(),
                                                                                      **close):
        u = x @ A.detach().T @ B.detach().T  # (3, 5, out): BAx
        why = _scale_mistake(y.detach(), lambda c: plain + c * u, s, alpha, r, close)
        if why:
            raise Mismatch(f"{what}(x) with random lora_A and lora_B: {why}", mistake="scale", hint=_HINTS["scale"])
    assert_close(y, want, what=f"{what}(x) with random lora_A and lora_B, against llmlab.lora.LoRALinear", **close)
    g = torch.randn_like(want)  # dL/dy
    (y * g).sum().backward()
    (want * g).sum().backward()
    # each gradient sums ≤ 15·192 products (dL/dA: over tokens and outputs) in another order than llmlab's; fp32
    # rounding of such sums stayed ≤ 1e-6 of the gradient's largest entry over 300 draws of every case: 1e-5 of it
    for name, got, ref_grad in (("lora_A", A.grad, ref.lora_A.grad), ("lora_B", B.grad, ref.lora_B.grad),
                                ("x", xa.grad, xr.grad)):
        if got is None:
            raise Mismatch(f"{what}: {name} received no gradient from a backward pass through the layer")
        assert_close(got, ref_grad, what=f"{what}: dL/d{name}", rtol=1e-5, atol=1e-5 * ref_grad.abs().max().item())

    _merges(layer, ref, base, x, y.detach(), w0, what, close)


def _merges(layer, ref: LoRALinear, base: nn.Linear, x, y, w0, what: str, close: dict) -> None:
    """merge, merge again, unmerge, unmerge again: the weight and the output after each, against llmlab's."""
    delta = ref.delta_weight().detach()  # (out, in)
    layer.merge()
    ref.merge()
    if base.weight.requires_grad or base.weight.grad_fn is not None:
        raise Mismatch(f"{what}: after merge() the base weight requires a gradient or is in the autograd graph "
                       f"(requires_grad={base.weight.requires_grad}, grad_fn={type(base.weight.grad_fn).__name__}): "
                       "fold ΔW in under torch.no_grad()", mistake="graph", hint=_HINTS["graph"])
    merged = base.weight.detach().clone()  # (out, in): unmerge changes the weight in place
    if not torch.allclose(merged, ref.base.weight, **close):
        if torch.equal(merged, w0):
            raise Mismatch(f"{what}: merge() left the base weight as it was: add ΔW to it, in place "
                           "(self.base.weight += …), so that the merged Linear computes the update", mistake="merge",
                           hint=_HINTS["merge"])
        if torch.allclose(merged, w0 + delta / ref.scale, **close):
            raise Mismatch(f"{what}: merge() adds B·A to the base weight without its scale α/r", mistake="merge",
                           hint=_HINTS["merge"])
    assert_close(merged, ref.base.weight, what=f"{what}: the base weight after merge() (W₀ + (α/r)·B·A)", **close)
    with torch.no_grad():
        y_merged = layer(x)
    if torch.allclose(y_merged, y + F.linear(x, delta), **close):
        raise Mismatch(f"{what}: after merge() the output adds the update twice, once in the weight and once on the "
                       "LoRA path: skip the LoRA path while merged", mistake="merged forward",
                       hint=_HINTS["merged forward"])
    # merged: one (in)-long fp32 sum with W₀ + ΔW rounded once, against the unmerged output's two sums
    assert_close(y_merged, y, what=f"{what}: the merged layer's output against the unmerged one's", **close)

    _again(layer, "merge", base, what)
    layer.unmerge()
    ref.unmerge()
    # (W₀ + ΔW) − ΔW rounds twice: each element within one unit in the last place of |W₀ + ΔW| of W₀ (llmlab's too)
    ulp = torch.finfo(w0.dtype).eps * merged.abs()
    back = base.weight.detach().clone()
    if not bool(((back - w0).abs() <= ulp + 1e-30).all()):
        why = ("unmerge() adds ΔW again; it subtracts it" if torch.allclose(back, w0 + 2 * delta, **close)
               else "unmerge() left the merged weight as it was" if torch.equal(back, merged)
               else "unmerge() does not take out exactly the ΔW that merge() put in")
        raise Mismatch(f"{what}: after unmerge() the base weight is not W₀ again, to within float rounding: {why}",
                       mistake="unmerge", hint=_HINTS["unmerge"])
    with torch.no_grad():
        y_back = layer(x)
    if torch.allclose(y_back, F.linear(x, back, ref.base.bias), **close) and not torch.allclose(y_back, y, **close):
        raise Mismatch(f"{what}: after unmerge() the output is the base layer's alone: the forward still skips the "
                       "LoRA path (clear the merged flag)", mistake="unmerge", hint=_HINTS["unmerge"])
    assert_close(y_back, y, what=f"{what}: the output after merge() then unmerge() against the one before", **close)
    _again(layer, "unmerge", base, what)


def _again(layer, method: str, base: nn.Linear, what: str) -> None:
    """A second merge() (unmerge()) in a row: refused, or a no-op; never a change of the weight."""
    before = base.weight.detach().clone()
    try:
        getattr(layer, method)()
    except NotImplementedError:
        raise
    except Exception:  # refused, as llmlab's RuntimeError does
        pass
    if not torch.equal(base.weight.detach(), before):
        raise Mismatch(f"{what}: a second {method}() in a row changed the base weight again ({method} "
                       f"{'adds' if method == 'merge' else 'subtracts'} ΔW twice): refuse, or do nothing, when the "
                       f"layer is already {method}d", mistake="twice", hint=_HINTS["twice"])
