"""Check 8.5 (re-exported by llmlab.checks.ch08): auxiliary-loss-free load balancing (Wang et al. 2024; DeepSeek-V3
§2.1.2), checked against `llmlab.moe.MoELayer(balance="bias", scores="sigmoid")` and its `update_bias`.

    from llmlab.checks import ch08 as check
    check.bias_balance(bias_route, update_bias) # 8.5

The learner's `bias_route(logits, bias, k)` takes (T, E) router logits and the (E,) expert bias and returns
(expert, gate), both (T, k): the scores s = sigmoid(logits) in fp32, each token's k experts the top k of s + bias
(largest first, as `torch.topk` gives them), their gates the chosen *unbiased* scores renormalised to sum to 1, in
the autograd graph of the logits. `update_bias(bias, expert, rate)` takes the bias, the experts (N, k) chosen in
one training step (all its forwards) and γ, and returns bᵢ + γ·sign(mean load − loadᵢ), loadᵢ the number of the
step's assignments to expert i.

Each call runs MoELayers of odd sizes (1 to 301 tokens, 3 to 16 experts, k from 2 up to E − 1, DeepSeek-V3's
γ = 1e-3 and `llmlab.moe_balance.BalanceSetup`'s collapse setup with γ = 2e-2) for a few steps of one or two
forwards each, from a random bias large enough to change many tokens' choices: every forward's experts and gates
are compared with the layer's routing, the gradient of Σ gate·w with the logits' through `llmlab.moe.route`, and
every step's new bias with the layer's after `update_bias()`. Two crafted steps have loads equal to their mean
(those biases must not move). Every token's k + 1 largest biased scores are kept ≥ `GAP` apart, so that no fp32
rounding can change which experts it picks, or their order. A wrong answer is named: the bias in the gates, the
bias left out of the choice, gates not renormalised, softmax scores, the experts in another order, detached gates;
the update's sign flipped, the update by the load itself instead of its sign, loads counted per token (first
choices) instead of per assignment, and a bias that moves when its load equals the mean.
"""

from __future__ import annotations

import random

import torch

from llmlab.checks import Hint, Mismatch, assert_close, check, fresh_rng
from llmlab.moe import MoELayer, route
from llmlab.moe_balance import BalanceSetup

__all__ = ["bias_balance", "GAP"]

GAP = 1e-5  # the least distance between a token's k + 1 largest biased scores (see the module docstring)
_DIM = 8  # the layers' model width: the router is all this check looks at

_FORMULA = ("bias_route: s = logits.float().sigmoid(); expert = (s + bias).topk(k, dim=-1).indices; top = s.gather(1, "
            "expert); gate = top / top.sum(-1, keepdim=True). update_bias: load = torch.bincount(expert.flatten(), "
            "minlength=E); return bias + rate · torch.sign(load.float().mean() − load)")
_ROUTE = Hint(
    nudge="look at where the bias enters your router: in the choice of the experts, in their gates, or both",
    idea="the bias only decides which k experts a token goes to (top k of score + bias); the gates are the chosen "
         "experts' own sigmoid scores, without the bias, renormalised over the k, so the bias never changes what "
         "an expert's output is weighted by and no gradient reaches it",
    formula=_FORMULA)
_UPDATE = Hint(
    nudge="look at which way, and by how much, your update moves an overloaded expert's bias",
    idea="after a step every bias moves by exactly γ: down for an expert above the mean load (fewer tokens choose "
         "it next step), up for one below, not at all for one at the mean; the load counts every assignment, all k "
         "choices of every token of the step",
    formula=_FORMULA)
_HINTS = {"bias in gates": _ROUTE, "no bias": _ROUTE,
          "raw gates": Hint(
              nudge="look at what each token's k gates add up to",
              idea="DeepSeek-V3 (eq. 13) normalises the chosen sigmoid scores over the k chosen experts, so that a "
                   "token's gates sum to 1 (sigmoid scores, unlike softmax probabilities, do not)",
              formula=_FORMULA),
          "softmax": Hint(
              nudge="look at how you turn the logits into scores",
              idea="DeepSeek-V3 scores each expert with a sigmoid of its logit (eq. 15), independently of the "
                   "others, not with a softmax over the experts",
              formula=_FORMULA),
          "order": Hint(
              nudge="look at the order of each token's k experts",
              idea="the first column is the expert with the largest biased score, then the next: torch.topk's order",
              formula=_FORMULA),
          "detached": Hint(
              nudge="look at whether your gates are still connected to the logits",
              idea="the router learns from the task through the gates: keep them in the autograd graph (only the "
                   "bias, which only picks, carries no gradient)",
              formula=_FORMULA),
          "sign": _UPDATE, "by load": _UPDATE, "per token": _UPDATE, "at the mean": _UPDATE}


def _layer(E: int, k: int, rate: float, gen: torch.Generator) -> MoELayer:
    """A sigmoid-scored, bias-balanced, dropless MoELayer whose bias starts random: ±0.3, as large as the spread of
    sigmoid scores, so it changes many tokens' choices."""
    layer = MoELayer(_DIM, _DIM, E, k, None, balance="bias", scores="sigmoid", bias_rate=rate)
    layer.expert_bias.copy_((torch.rand(E, generator=gen) - 0.5) * 0.6)
    return layer


def _tokens(layer: MoELayer, T: int, gen: torch.Generator, scale: float) -> torch.Tensor:
    """(T, dim) tokens, each redrawn until its k + 1 largest biased scores are ≥ GAP apart."""
    x = torch.randn(T, _DIM, generator=gen) * scale  # (T, C)
    k = min(layer.k + 1, layer.num_experts)
    while True:
        with torch.no_grad():
            top = (layer.gate(x).sigmoid() + layer.expert_bias).topk(k, dim=-1).values  # (T, k + 1)
        close = (top[:, :-1] - top[:, 1:]).min(-1).values < GAP  # (T,)
        if not close.any():
            return x
        x[close] = torch.randn(int(close.sum()), _DIM, generator=gen) * scale


def _cases(rng: random.Random) -> list[tuple[int, int, int, float, int, int]]:
    """(T, E, k, γ, steps, forwards per step) of every case."""
    s = BalanceSetup()
    # first a case of many tokens: a mistake that one token's choice cannot tell apart (the bias left out, or the
    # experts in reverse order, give the same two experts on three) is named there
    cases = [(45, 5, 2, 1e-3, 3, 2),  # two forwards a step (gradient accumulation): their loads add up
             (s.tokens, s.experts, s.k, s.bias_rate, 3, 1),  # llmlab.moe_balance's collapse setup
             (301, 16, 6, 2e-2, 2, 1),
             (1, 3, 2, 1e-3, 2, 1)]  # one token
    for _ in range(2):
        E = rng.randint(3, 16)
        cases.append((rng.randrange(3, 302, 2), E, rng.randint(2, E - 1), rng.choice([1e-3, 2e-2]), 2,
                      rng.randint(1, 2)))
    return cases


@check("8.5", "auxiliary-loss-free balancing with an expert bias", hint=Hint(
    nudge="look at the two pieces in turn: which experts a token picks and with what gates, then how the bias moves",
    idea="the bias is added to the sigmoid scores only to pick the top k; the gates are the unbiased scores of "
         "those k, renormalised; after a step each bias moves by γ towards the mean load",
    formula=_FORMULA))
def bias_balance(bias_route, update_bias):
    """`bias_route(logits, bias, k)` -> (expert, gate); `update_bias(bias, expert, rate)` -> the new bias: see the
    module docstring."""
    rng = fresh_rng()
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    for T, E, k, rate, steps, forwards in _cases(rng):
        layer = _layer(E, k, rate, gen)
        for step in range(steps):
            bias = layer.expert_bias.clone()  # (E,) as this step's forwards use it
            chosen = []
            for f in range(forwards):
                x = _tokens(layer, T, gen, rng.uniform(0.5, 3.0))
                what = (f"bias_route(logits of shape ({T}, {E}), bias, k={k}) at step {step}"
                        + (f", forward {f}" if forwards > 1 else ""))
                chosen.append(_judge_route(bias_route, layer, x, what))
            experts = torch.cat(chosen)  # (forwards·T, k)
            what = f"update_bias(bias of {E} experts, expert of shape {tuple(experts.shape)}, rate={rate:g})"
            layer.update_bias()
            _judge_update(update_bias, bias, experts, rate, layer.expert_bias, what)
    _judge_at_the_mean(update_bias)


def _judge_route(bias_route, layer: MoELayer, x: torch.Tensor, what: str) -> torch.Tensor:
    """One forward of `layer` on `x` against the learner's routing of its logits; returns the layer's experts."""
    k, bias = layer.k, layer.expert_bias.clone()
    with torch.no_grad():
        logits = layer.gate(x)  # (T, E)
    layer(x)  # training mode: the layer adds this forward's loads to its step
    want = layer.routing
    leaf = logits.clone().requires_grad_(True)
    answer = bias_route(leaf, bias.clone(), k)
    if not (isinstance(answer, tuple) and len(answer) == 2 and all(isinstance(t, torch.Tensor) for t in answer)):
        raise Mismatch(f"{what} returned {type(answer).__name__}, expected a tuple (expert, gate) of two tensors")
    expert, gate = answer
    T = logits.shape[0]
    if expert.shape != (T, k) or gate.shape != (T, k):
        raise Mismatch(f"{what}: expert has shape {tuple(expert.shape)} and gate {tuple(gate.shape)}, expected "
                       f"({T}, {k}) each")
    score = logits.sigmoid()  # (T, E)
    if not torch.equal(expert.long(), want.expert):
        unbiased = score.topk(k, dim=-1).indices  # (T, k)
        if torch.equal(expert.long(), unbiased) and not torch.equal(unbiased, want.expert):
            raise Mismatch(f"{what}: the experts are the top k of the scores alone; the bias is added to the scores "
                           "to choose them", mistake="no bias", hint=_HINTS["no bias"])
        if torch.equal(expert.long().sort(-1).values, want.expert.sort(-1).values):
            raise Mismatch(f"{what}: the right experts, in another order: the largest biased score first (torch."
                           "topk's order)", mistake="order", hint=_HINTS["order"])
        assert_close(expert.long(), want.expert, what=f"{what}: expert (the top k of sigmoid(logits) + bias)",
                     rtol=0, atol=0)
    variants = {"bias in gates": ("the gates include the bias: they are the chosen experts' unbiased scores",
                                  (score + bias).gather(1, want.expert)),
                "raw gates": ("the gates are the raw sigmoid scores: renormalise them over the k chosen",
                              score.gather(1, want.expert)),
                "softmax": ("the gates come from a softmax over the experts; the scores are sigmoid(logits)",
                            logits.exp().gather(1, want.expert))}
    for key, (why, top) in variants.items():
        value = top if key == "raw gates" else top / top.sum(-1, keepdim=True)  # (T, k)
        if not torch.allclose(value, want.gate, rtol=1e-4) and torch.allclose(gate.detach().float(), value,
                                                                               rtol=1e-5, atol=1e-6):
            raise Mismatch(f"{what}: {why}", mistake=key, hint=_HINTS[key])
    # default fp32 tolerances: a sigmoid, k ≤ 6 values summed and a division, the ops llmlab's route runs, up to order
    assert_close(gate, want.gate, what=f"{what}: gate (the chosen unbiased scores, renormalised)")
    if not gate.requires_grad:
        raise Mismatch(f"{what}: gate has no gradient w.r.t. the logits", mistake="detached", hint=_HINTS["detached"])
    weights = torch.randn(T, k)  # (T, k): an arbitrary loss of the gates
    (gate * weights).sum().backward()
    ref_leaf = logits.clone().requires_grad_(True)
    (route(ref_leaf, k, None, bias=bias, scores="sigmoid").gate * weights).sum().backward()
    # fp32 sigmoid gradients through a k-term normalisation, summed in other orders
    assert_close(leaf.grad, ref_leaf.grad, what=f"{what}: d(Σ gate·w)/dlogits", rtol=1e-4, atol=1e-6)
    return want.expert


def _judge_update(update_bias, bias: torch.Tensor, experts: torch.Tensor, rate: float, want: torch.Tensor,
                  what: str) -> None:
    got = update_bias(bias.clone(), experts.clone(), rate)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        raise Mismatch(f"{what} returned {getattr(got, 'shape', type(got).__name__)}, expected a tensor of shape "
                       f"{tuple(want.shape)}")
    # b + γ·s rounded once to fp32 (s = ±1 or 0), with γ rounded to fp32 first or not: ≤ 1 ulp of |b| + γ apart.
    # Every wrong update below is ≥ γ ≥ 1e-3 off somewhere, ≫ that ulp (≤ 1.2e-7 for |b| < 1)
    atol = 2 * 2**-24 * (bias.abs() + rate)  # (E,)
    if bool(((got - want).abs() <= atol).all()):
        return
    E = bias.numel()
    load = torch.bincount(experts.flatten(), minlength=E).double()  # (E,)
    first = torch.bincount(experts[:, 0], minlength=E).double()  # (E,) each token counted once
    variants = {"sign": ("its sign is flipped: an expert above the mean load must get a smaller bias",
                         bias - rate * torch.sign(load.mean() - load)),
                "by load": ("the bias moves by γ·(mean load − loadᵢ), the load itself; it moves by γ·sign(…), "
                            "exactly γ", bias + rate * (load.mean() - load)),
                "per token": ("the loads count each token once (its first choice); they count every assignment, "
                              "all k choices", bias + rate * torch.sign(first.mean() - first))}
    for key, (why, value) in variants.items():
        value = value.to(want.dtype)
        if not bool(((value - want).abs() <= atol).all()) and bool(((got - value).abs() <= atol).all()):
            raise Mismatch(f"{what}: {why}", mistake=key, hint=_HINTS[key])
    assert_close(got, want, what=f"{what} (llmlab's MoELayer.update_bias)", rtol=0, atol=float(atol.max()))


def _judge_at_the_mean(update_bias) -> None:
    """Two crafted steps of 3 experts: loads (2, 2, 2), all at the mean, and (3, 2, 1), expert 1 at it."""
    for expert in (torch.tensor([[0, 1], [1, 2], [2, 0]]), torch.tensor([[0, 1], [0, 1], [0, 2]])):
        layer = MoELayer(_DIM, _DIM, 3, 2, None, balance="bias", scores="sigmoid")
        layer.expert_bias.copy_(torch.tensor([0.1, -0.2, 0.05]))
        bias = layer.expert_bias.clone()
        load = torch.bincount(expert.flatten(), minlength=3)  # (3,)
        layer.step_load.copy_(load)
        layer.update_bias()
        got = update_bias(bias.clone(), expert, layer.bias_rate)
        what = f"update_bias(bias, expert with loads {load.tolist()}, rate={layer.bias_rate:g})"
        if isinstance(got, torch.Tensor) and got.shape == (3,):
            at_mean = load * 3 == load.sum()  # (3,)
            if not torch.allclose(got[at_mean], bias[at_mean]):
                raise Mismatch(f"{what}: the bias of an expert whose load equals the mean load moved; sign(0) = 0 "
                               "leaves it", mistake="at the mean", hint=_HINTS["at the mean"])
        _judge_update(update_bias, bias, expert, layer.bias_rate, layer.expert_bias, what)
