"""Check 8.5 (re-exported by llmlab.checks.ch08): an MoE layer balanced without an auxiliary loss (Wang et al.
2024; DeepSeek-V3 §2.1.2), checked against `llmlab.moe.MoELayer(balance="bias", scores="sigmoid")` and its
`update_bias`.

    from llmlab.checks import ch08 as check
    check.bias_balance(AuxFreeMoE)               # 8.5

The learner's `AuxFreeMoE(dim, hidden, num_experts, k, rate)` is an nn.Module named as MoELayer's parts are: `gate`
(nn.Linear(dim, E, bias=False)), `experts` (an nn.ModuleList of `llmlab.moe.Expert(dim, hidden)`), and the buffer
`expert_bias` (E,), zero at the start, in the state_dict and never trained. `route(x)` of tokens (T, dim) returns
(expert, gate), both (T, k): the scores s = sigmoid(gate(x)) in fp32, each token's k experts the top k of s + bias
(largest first, as `torch.topk` gives them), their gates the chosen *unbiased* scores renormalised to sum to 1.
`forward(x)` of x (..., dim) returns the output in x's shape, Σⱼ gateⱼ·expert_{e_j}(x) per token, and, in training
mode only, adds its loads (assignments per expert) to the step's. `update_bias()`, after a step, moves bᵢ by
γ·sign(mean load − loadᵢ) with the step's summed loads, and starts the next step's count from zero.

Each call runs MoELayers of odd sizes (1 to 301 tokens, 3 to 16 experts, k from 2 up to E − 1, DeepSeek-V3's γ =
1e-3 and `llmlab.moe_balance.BalanceSetup`'s collapse setup with γ = 2e-2) beside the learner's layer with the same
weights, from a random bias, for a few steps of one or two training forwards and an evaluation forward each: every
forward's experts, gates and output are compared with the layer's, the gradients to the router's weight and to x,
and every step's new bias with the layer's after `update_bias()`. Three crafted steps have loads equal to their
mean (those biases must not move), one beside an evaluation forward and one after a step whose loads lean the other
way, so that counting the evaluation forward, or every step so far, changes the update. Every token's k + 1 largest
biased scores are kept ≥ `GAP` apart, so that no fp32 rounding can change which experts it picks, or their order. A
wrong answer is named: the bias in the gates, the bias left out of the choice, gates not renormalised, softmax
scores, the experts in another order, detached gates, a bias that is a trained Parameter; the update's sign
flipped, the update by the load itself instead of its sign, loads counted per token (first choices) instead of per
assignment, counted in evaluation too, not started again after an update, and a bias that moves when its load
equals the mean."""

from __future__ import annotations

import random

import torch
import torch.nn as nn

from llmlab.checks import Hint, Mismatch, assert_close, check, fresh_rng
from llmlab.moe import MoELayer
from llmlab.moe_balance import BalanceSetup

__all__ = ["bias_balance", "GAP"]

GAP = 1e-5  # the least distance between a token's k + 1 largest biased scores (see the module docstring)
_DIM, _HIDDEN = 8, 12  # the layers' model width and expert width: small, the routing is what is checked

_FORMULA = ("__init__: self.gate = nn.Linear(dim, E, bias=False); self.experts = nn.ModuleList(Expert(dim, hidden) "
            "for each expert); register_buffer('expert_bias', torch.zeros(E)) and a (non-persistent) long buffer of "
            "the step's loads. route: s = self.gate(x).float().sigmoid(); expert = (s + self.expert_bias).topk(k, "
            "dim=-1).indices; top = s.gather(1, expert); gate = top / top.sum(-1, keepdim=True). forward: y = Σ over "
            "experts e of index_add_ of gate · experts[e](x[tokens routed to e]); if self.training: loads += "
            "torch.bincount(expert.flatten(), minlength=E). update_bias (under torch.no_grad()): expert_bias += rate · "
            "torch.sign(loads.float().mean() − loads); loads.zero_()")
_ROUTE = Hint(
    nudge="look at where the bias enters your router: in the choice of the experts, in their gates, or both",
    idea="the bias only decides which k experts a token goes to (top k of score + bias); the gates are the chosen "
         "experts' own sigmoid scores, without the bias, renormalised over the k, so the bias never changes what "
         "an expert's output is weighted by and no gradient reaches it",
    formula=_FORMULA)
_UPDATE = Hint(
    nudge="look at which way, and by how much, your update moves an overloaded expert's bias, and from which loads",
    idea="after a step every bias moves by exactly γ: down for an expert above the mean load (fewer tokens choose "
         "it next step), up for one below, not at all for one at the mean; the load counts every assignment, all k "
         "choices of every token of the step's training forwards, and starts from zero at each step",
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
              nudge="look at whether your gates are still connected to the router's weight",
              idea="the router learns from the task through the gates: keep them in the autograd graph (only the "
                   "bias, which only picks, carries no gradient)",
              formula=_FORMULA),
          "parameter": Hint(
              nudge="look at what kind of tensor your expert bias is",
              idea="no gradient trains the bias: the update rule alone moves it. As an nn.Parameter the optimizer "
                   "would hold it (weight decay, Adam's moments) and a backward give it a gradient; a buffer is "
                   "saved in the state_dict and moved with .to() all the same",
              formula=_FORMULA),
          "sign": _UPDATE, "by load": _UPDATE, "per token": _UPDATE, "at the mean": _UPDATE, "eval": _UPDATE,
          "not reset": _UPDATE}


def _layer(E: int, k: int, rate: float, gen: torch.Generator) -> MoELayer:
    """A sigmoid-scored, bias-balanced, dropless MoELayer whose bias starts random: ±0.3, as large as the spread of
    sigmoid scores, so it changes many tokens' choices."""
    layer = MoELayer(_DIM, _HIDDEN, E, k, None, balance="bias", scores="sigmoid", bias_rate=rate)
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
    """(T, E, k, γ, steps, training forwards per step) of every case."""
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


@check("8.5", "an MoE layer balanced by an expert bias, without an auxiliary loss", hint=Hint(
    nudge="look at the pieces in turn: which experts a token picks and with what gates, the output, which loads you "
          "count, and how the bias moves",
    idea="the bias is added to the sigmoid scores only to pick the top k; the gates are the unbiased scores of "
         "those k, renormalised; training forwards add up the step's loads, and after the step each bias moves by "
         "γ towards the mean load",
    formula=_FORMULA))
def bias_balance(cls):
    """`cls(dim, hidden, num_experts, k, rate)`: see the module docstring."""
    rng = fresh_rng()
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    for T, E, k, rate, steps, forwards in _cases(rng):
        layer = _layer(E, k, rate, gen)
        name = f"AuxFreeMoE({_DIM}, {_HIDDEN}, num_experts={E}, k={k}, rate={rate:g})"
        mine = _build(cls, layer, name)
        since = torch.zeros(E, dtype=torch.long)  # (E,) the loads since the first step: a count never reset
        for step in range(steps):
            bias = layer.expert_bias.clone()  # (E,) as this step's forwards use it
            chosen = [_judge_forward(mine, layer, _tokens(layer, T, gen, rng.uniform(0.5, 3.0)),
                                     f"{name} on {T} tokens at step {step}" + (f", forward {f}" * (forwards > 1)),
                                     gradients=step == f == 0)  # once per case: the graph is the same each step
                      for f in range(forwards)]
            evaluated = _evaluate(mine, layer, _tokens(layer, T, gen, 1.0))
            experts = torch.cat(chosen)  # (forwards·T, k)
            since += torch.bincount(experts.flatten(), minlength=E)
            layer.update_bias()
            with torch.no_grad():
                mine.update_bias()
            _judge_update(mine.expert_bias.detach(), bias, experts, rate, layer.expert_bias,
                          f"{name}.update_bias() after step {step} ({len(chosen)} training forward"
                          f"{'s' * (len(chosen) > 1)} of {T} tokens and one evaluation forward)",
                          evaluated=evaluated, since=since)
            with torch.no_grad():  # the next step starts from llmlab's bias: one update's rounding at a time
                mine.expert_bias.copy_(layer.expert_bias)
    _judge_crafted(cls)


def _evaluate(mine: nn.Module, layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """A forward of both layers in evaluation mode, which counts no load; returns its experts (T, k)."""
    for m in (mine, layer):
        m.eval()
        with torch.no_grad():
            m(x)
        m.train()
    return layer.routing.expert


def _build(cls, layer: MoELayer, what: str) -> nn.Module:
    """The learner's layer with `layer`'s weights and bias, after judging its parts."""
    E = layer.num_experts
    mine = cls(layer.dim, layer.hidden, E, layer.k, layer.bias_rate)
    if not isinstance(mine, nn.Module):
        raise Mismatch(f"{what} is a {type(mine).__name__}, expected an nn.Module")
    bias = getattr(mine, "expert_bias", None)
    if isinstance(bias, nn.Parameter):
        raise Mismatch(f"{what}: expert_bias is an nn.Parameter, which the optimizer would train; it is a buffer "
                       "(self.register_buffer), moved by update_bias() alone", mistake="parameter",
                       hint=_HINTS["parameter"])
    if not isinstance(bias, torch.Tensor) or bias.shape != (E,) or bias.dtype != torch.float32 or bias.any():
        raise Mismatch(f"{what}: expert_bias is {bias!r:.80}, expected a float32 buffer of {E} zeros "
                       "(self.register_buffer('expert_bias', torch.zeros(num_experts)))")
    missing, unexpected = mine.load_state_dict(layer.state_dict(), strict=False)
    if unexpected:
        raise Mismatch(f"{what}: its state_dict has no {', '.join(unexpected[:3])}: name the parts as MoELayer "
                       "does (gate, experts.<e>.c_fc / c_proj, expert_bias)")
    return mine


def _judge_forward(mine: nn.Module, layer: MoELayer, x: torch.Tensor, what: str, gradients: bool) -> torch.Tensor:
    """One training forward of both layers on `x` (T, C): the learner's route and output (and, if `gradients`,
    the gradients of a loss of it) against the layer's; returns the layer's experts (T, k)."""
    k, bias = layer.k, layer.expert_bias.clone()
    with torch.no_grad():
        logits = layer.gate(x)  # (T, E)
    T = x.shape[0]
    shape = (3, T // 3, x.shape[1]) if T % 3 == 0 and T > 3 else x.shape  # forward takes (..., dim): (B, T/B, C) too
    x_ref, x_mine = x.view(shape).clone().requires_grad_(True), x.view(shape).clone().requires_grad_(True)
    want_y, _ = layer(x_ref)  # x's shape; training: the layer adds this forward's loads to its step
    want = layer.routing
    answer = mine.route(x)
    if not (isinstance(answer, tuple) and len(answer) == 2 and all(isinstance(t, torch.Tensor) for t in answer)):
        raise Mismatch(f"{what}: route(x) returned {type(answer).__name__}, expected a tuple (expert, gate)")
    _judge_route(*answer, logits, bias, want.expert, want.gate, k, what)
    y = mine(x_mine)
    what = f"{what}, x of shape {tuple(shape)}" if len(shape) == 3 else what
    # fp32 MLPs summed in other orders (llmlab runs each expert on one block of rows): within 1e-5 of |y|'s scale
    assert_close(y, want_y, what=f"{what}: the output Σ gate·expert(x)", rtol=1e-5,
                 atol=1e-5 * float(want_y.detach().abs().max()))
    if not gradients:
        return want.expert
    weights = torch.randn_like(want_y)  # (T, C): an arbitrary loss of the output
    (want_y * weights).sum().backward()
    (y * weights).sum().backward()
    grad = mine.gate.weight.grad
    if grad is None or (not grad.any() and layer.gate.weight.grad.any()):
        raise Mismatch(f"{what}: the router's weight gets no gradient from the output: the gates must stay in the "
                       "autograd graph", mistake="detached", hint=_HINTS["detached"])
    # each sums T·k products of fp32 MLP outputs in other orders: 1e-4 of the gradient's largest entry
    for name, got, ref in (("the router's weight", grad, layer.gate.weight.grad), ("x", x_mine.grad, x_ref.grad)):
        assert_close(got, ref, what=f"{what}: d(Σ y·w)/d({name})", rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    mine.zero_grad(), layer.zero_grad()
    return want.expert


def _judge_route(expert, gate, logits, bias, want_expert, want_gate, k: int, what: str) -> None:
    T = logits.shape[0]
    what = f"{what}: route(x)"
    if expert.shape != (T, k) or gate.shape != (T, k):
        raise Mismatch(f"{what}: expert has shape {tuple(expert.shape)} and gate {tuple(gate.shape)}, expected "
                       f"({T}, {k}) each")
    score = logits.sigmoid()  # (T, E)
    if not torch.equal(expert.long(), want_expert):
        unbiased = score.topk(k, dim=-1).indices  # (T, k)
        if torch.equal(expert.long(), unbiased):
            raise Mismatch(f"{what}: the experts are the top k of the scores alone; the bias is added to the scores "
                           "to choose them", mistake="no bias", hint=_HINTS["no bias"])
        if torch.equal(expert.long(), (logits.softmax(-1) + bias).topk(k, dim=-1).indices):
            raise Mismatch(f"{what}: the experts are the top k of a softmax over the experts plus the bias; the scores "
                           "are sigmoid(logits)", mistake="softmax", hint=_HINTS["softmax"])
        if torch.equal(expert.long().sort(-1).values, want_expert.sort(-1).values):
            raise Mismatch(f"{what}: the right experts, in another order: the largest biased score first (torch."
                           "topk's order)", mistake="order", hint=_HINTS["order"])
        assert_close(expert.long(), want_expert, what=f"{what}: expert (the top k of sigmoid(logits) + bias)",
                     rtol=0, atol=0)
    variants = {"bias in gates": ("the gates include the bias: they are the chosen experts' unbiased scores",
                                  (score + bias).gather(1, want_expert)),
                "raw gates": ("the gates are the raw sigmoid scores: renormalise them over the k chosen",
                              score.gather(1, want_expert)),
                "softmax": ("the gates come from a softmax over the experts; the scores are sigmoid(logits)",
                            logits.exp().gather(1, want_expert))}
    for key, (why, top) in variants.items():
        value = top if key == "raw gates" else top / top.sum(-1, keepdim=True)  # (T, k)
        if not torch.allclose(value, want_gate, rtol=1e-4) and torch.allclose(gate.detach().float(), value,
                                                                              rtol=1e-5, atol=1e-6):
            raise Mismatch(f"{what}: {why}", mistake=key, hint=_HINTS[key])
    # default fp32 tolerances: a sigmoid, k ≤ 15 values summed and a division, the ops llmlab's route runs, up to order
    assert_close(gate, want_gate, what=f"{what}: gate (the chosen unbiased scores, renormalised)")


def _sign_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """b + γ·sign(mean − load), in float64: what an update from the loads `load` gives."""
    load = load.double()
    return bias + rate * torch.sign(load.mean() - load)


def _judge_update(got: torch.Tensor, bias: torch.Tensor, experts: torch.Tensor, rate: float, want: torch.Tensor,
                  what: str, evaluated: torch.Tensor | None = None, since: torch.Tensor | None = None) -> None:
    """The learner's bias after update_bias() against `want`, the layer's; `experts` (N, k) are the step's training
    choices, `evaluated` an evaluation forward's, `since` the loads since the first step."""
    if got.shape != want.shape:
        raise Mismatch(f"{what}: expert_bias has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    # b + γ·s rounded once to fp32 (s = ±1 or 0), with γ rounded to fp32 first or not: ≤ 1 ulp of |b| + γ apart.
    # Every wrong update below is ≥ γ ≥ 1e-3 off somewhere, ≫ that ulp (≤ 1.2e-7 for |b| < 1)
    atol = 2 * 2**-24 * (bias.abs() + rate)  # (E,)
    if bool(((got - want).abs() <= atol).all()):
        return
    E = bias.numel()
    load = torch.bincount(experts.flatten(), minlength=E)  # (E,)
    variants = {"sign": ("its sign is flipped: an expert above the mean load must get a smaller bias",
                         bias - rate * torch.sign(load.double().mean() - load)),
                "by load": ("the bias moves by γ·(mean load − loadᵢ), the load itself; it moves by γ·sign(…), "
                            "exactly γ", bias + rate * (load.double().mean() - load)),
                "per token": ("the loads count each token once (its first choice); they count every assignment, "
                              "all k choices", _sign_update(bias, torch.bincount(experts[:, 0], minlength=E), rate))}
    if evaluated is not None:
        variants["eval"] = ("the loads include the evaluation forward's; only training forwards count (model.eval() "
                            "routes without balancing anything)", _sign_update(
                                bias, load + torch.bincount(evaluated.flatten(), minlength=E), rate))
    if bool((load * E == load.sum()).any()):
        variants["at the mean"] = ("the bias of an expert whose load equals the mean load moved; sign(0) = 0 leaves "
                                   "it", bias + rate * torch.where(load * E < load.sum(), 1.0, -1.0))
    if since is not None:
        variants["not reset"] = ("the loads are those of every step so far; update_bias() starts the count again "
                                 "from zero (zero_())", _sign_update(bias, since, rate))
    named = []
    for key, (why, value) in variants.items():
        value = value.to(want.dtype)
        near = atol + 2 * 2**-24 * (value - bias).abs()  # (E,): a move of several γ rounds on its own size
        if not bool(((value - want).abs() <= near).all()) and bool(((got - value).abs() <= near).all()):
            named.append((key, why))
    if named:  # loads alike from step to step can make two mistakes give the same bias: both are named
        raise Mismatch(f"{what}: " + "; or ".join(why for _, why in named), mistake=named[0][0],
                       hint=_HINTS[named[0][0]])
    assert_close(got, want, what=f"{what}: expert_bias (llmlab's MoELayer.update_bias)", rtol=0,
                 atol=float(atol.max()))


def _judge_crafted(cls) -> None:
    """Three crafted steps of 3 experts, the router's weight the identity, each token's logits picking two experts:
    loads (2, 2, 2), all at the mean; (3, 2, 1), expert 1 at it, with an evaluation forward of loads (1, 2, 3) that
    would cancel it; then (1, 2, 3), which the loads of every step so far would cancel."""
    h, m, low = 3.0, 1.0, -3.0  # sigmoid 0.95, 0.73, 0.05: far apart beside biases of ±0.005
    pick = {(0, 1): [h, m, low], (1, 2): [low, h, m], (0, 2): [m, low, h]}  # the experts a token's logits pick
    steps = (([(0, 1), (1, 2), (0, 2)], None), ([(0, 1), (0, 1), (0, 2)], [(1, 2), (1, 2), (0, 2)]),
             ([(1, 2), (1, 2), (0, 2)], None))
    layer = MoELayer(3, _HIDDEN, 3, 2, None, balance="bias", scores="sigmoid")
    with torch.no_grad():
        layer.gate.weight.copy_(torch.eye(3))
        layer.expert_bias.copy_(torch.tensor([1e-3, -2e-3, 5e-4]))
    mine = _build(cls, layer, "AuxFreeMoE(3, 12, num_experts=3, k=2, rate=0.001)")
    since = torch.zeros(3, dtype=torch.long)  # (3,)
    for train, evaluation in steps:
        bias = layer.expert_bias.clone()
        x = torch.tensor([pick[p] for p in train])  # (3, 3): the logits, through the identity
        layer(x)
        mine(x)
        load, experts = layer.routing.load, layer.routing.expert  # (3,), (3, 2)
        evaluated = _evaluate(mine, layer, torch.tensor([pick[p] for p in evaluation])) if evaluation else None
        since += load
        layer.update_bias()
        with torch.no_grad():
            mine.update_bias()
        got = mine.expert_bias.detach()
        what = (f"AuxFreeMoE.update_bias() after a step with loads {load.tolist()}"
                + (f" and an evaluation forward of loads {torch.bincount(evaluated.flatten(), minlength=3).tolist()}"
                   if evaluated is not None else ""))
        at_mean = load * 3 == load.sum()  # (3,)
        if got.shape == (3,) and not torch.allclose(got[at_mean], bias[at_mean]):
            raise Mismatch(f"{what}: the bias of an expert whose load equals the mean load moved; sign(0) = 0 "
                           "leaves it", mistake="at the mean", hint=_HINTS["at the mean"])
        _judge_update(got, bias, experts, layer.bias_rate, layer.expert_bias, what, evaluated, since)
        with torch.no_grad():
            mine.expert_bias.copy_(layer.expert_bias)
