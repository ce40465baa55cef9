"""Mixture of Experts: a router sends each token to k of E expert MLPs, so a token uses k/E of their weights.

Shazeer et al. 2017 ("Outrageously Large Neural Networks", the sparsely-gated MoE), Lepikhin et al. 2020
(GShard: top-2, capacity, expert parallelism), Fedus et al. 2021 (Switch Transformer: top-1, the balance
loss), Zoph et al. 2022 (ST-MoE: the router z-loss). For T tokens x (T, C) and E experts:

1. **Router.** logits = x·W_g (a Linear C → E, no bias); p = softmax(logits) (T, E), in at least float32
   (Switch §2.4, "selective precision"). Each token takes its top k experts. k = 1 (Switch) keeps the raw
   probability p_e as the gate: renormalising one value would make it 1 and the router would get no gradient
   from the task. k ≥ 2 (GShard) renormalises the k chosen probabilities to sum to 1.
2. **Balance loss** (Switch eq. 4–6): N·Σᵢ fᵢ·Pᵢ, with Pᵢ = mean router probability of expert i and fᵢ = the
   fraction of the T·k token→expert assignments routed to i (before capacity; for k = 1, Switch's fᵢ). It is 1
   when the routing is uniform, up to N when it collapses onto one expert, and it trains the router through Pᵢ.
   **z-loss** (ST-MoE eq. 5): mean over tokens of logsumexp(logits)², which keeps the logits small.
   `aux_loss` = balance_coef·balance + z_coef·z (defaults 1e-2, Switch; 1e-3, ST-MoE): add it to the loss.
3. **Capacity.** Every expert has capacity = ⌈k·T/E · capacity_factor⌉ slots: the "tokens" of ⌈tokens/E·cf⌉ are the
   k·T assignments (GShard's 2T/E for top-2 at cf = 1; Switch's T/E·cf for k = 1), one queue per expert shared
   by all k choices. Slots go first come, first served: all first choices in token order, then all second
   choices (GShard's priority, so a token's first choice never loses its place to another's second). An
   assignment past capacity is dropped: it adds 0 to that token's output, and a token whose choices are all
   dropped gets output 0 — GShard and Switch rely on the residual connection (x + MoE(x)) to carry it on, so
   the caller adds the residual. `capacity_factor=None` is dropless. `layer.routing.drop_rate` reports it.
4. **Experts** are MLPs C → hidden → GELU → C (the transformer's MLP). The kept assignments are sorted by
   expert (a stable argsort: priority order inside each expert); the tokens are permuted into that order once
   (one `index_select`), every projection is one segment matmul (expert e's weight on its block of consecutive
   rows, `llmlab.moe_dispatch.grouped_mlp`), and one `index_add` sums the gated results back into the tokens:
   a loop over the E experts, never over tokens. `grouped_gemm=True` runs each projection instead as one launch
   of the Triton grouped GEMM for every expert (`llmlab.moe_dispatch.grouped_gemm_mlp`,
   `llmlab.kernels.grouped_gemm`), the same maths.
5. **Expert parallelism** (`group=`, as in GShard): rank r of N owns experts r·E/N … (r+1)·E/N − 1; the router is
   replicated. Each rank routes its own tokens (capacity from its own T), then an all-to-all sends each rank the
   rows for its experts, they compute, and a second all-to-all brings the results home: two all-to-alls forward,
   and two backward (the backward of an all-to-all is the reverse all-to-all), so each expert's gradient sums
   every rank's tokens. A tiny exchange of the E/N row counts per peer comes first (logged as "moe.counts").
   The all-to-alls are llmlab's point-to-point `dist.all_to_all` (block sizes differ per pair of ranks;
   `llmlab.moe_dispatch.expert_parallel`). Rank r computes exactly what the single-process layer computes on
   rank r's tokens; the router's gradient comes from the rank's tokens only, so the caller all-reduces it (as
   DDP does for replicated weights).
6. **Balancing without an auxiliary loss** (`balance="bias"`; Wang et al. 2024, "Auxiliary-loss-free load
   balancing"; DeepSeek-V3 §2.1.2, eq. 16): a bias bᵢ per expert (the buffer `expert_bias`, saved in the
   state_dict) is added to the scores for the *choice* of the top k only; the gates are the chosen experts'
   unbiased scores, renormalised. After each optimizer step `update_bias()` moves every bᵢ by γ·sign(mean load −
   loadᵢ) (γ = `bias_rate`, DeepSeek-V3's 1e-3), the loads summed over the step's forwards: an overloaded
   expert's bias falls, so fewer tokens choose it next step, and no gradient reaches the router for it. Keep
   the layer's weights in float32 (bf16 through autocast): `.to(torch.bfloat16)` would make the bias bf16 too,
   whose spacing (2⁻⁹ ≈ 2e-3 at 0.25, 4e-3 at 0.5) rounds γ = 1e-3 steps to double or to nothing.
   `balance="aux-loss"` (the default) adds step 2's balance loss to aux_loss, `"none"` neither (the z-loss
   stays: it keeps the logits small and balances nothing). `scores="sigmoid"` scores expert i by sigmoid(logitᵢ)
   (DeepSeek-V3 eq. 15) instead of the softmax; the gates are then the chosen scores normalised over the k (for
   k ≥ 2, as for the softmax), and the balance loss's Pᵢ is the mean of the scores normalised over all E (V3
   eq. 20). Either way the bias adds to scores in [0, 1], so γ means the same on both.
7. **Fine-grained and shared experts** (DeepSeekMoE, Dai et al. 2024, §3.1–3.2): `granularity` m splits each
   of the E experts into m of hidden/m, and a token takes m·k of them: the coarse layer's parameters and expert
   FLOPs (4·C·H·k per token), with many more combinations of experts. `shared` s of those m·k slots go to
   shared experts every token passes through, without a router: m·E − s routed experts, top m·k − s. The s
   shared experts of hidden H/m are one MLP of hidden s·H/m (`shared_experts`, as DeepSeek-V2's code holds
   them), added with gate 1. The router grows from E to m·E − s outputs: its 2·C·(m·E − s) FLOPs per token are
   the only ones the split adds.

The course text's snippet (§8.2), `selected = topk(gate_scores, k=2); return sum(experts[i](x) * scores[i]
for i in selected)`, runs every selected expert on the whole batch x (in a batch the tokens' choices differ,
so that is nearly every expert on every token: no compute is saved), takes top-k of unnormalised scores
without a softmax or renormalised gates, and has no capacity and no balance loss (without which the router
collapses onto a few experts, Shazeer et al. 2017 §4).

    from llmlab.moe import MoELayer
    layer = MoELayer(dim=64, hidden=256, num_experts=8, k=2, capacity_factor=1.25)
    y, aux_loss = layer(x)                       # x (..., 64) -> y (..., 64); loss = task + aux_loss
    layer.routing.drop_rate                      # of the last forward
    free = MoELayer(64, 256, 8, k=2, capacity_factor=None, balance="bias", scores="sigmoid")
    ...; optimizer.step(); free.update_bias()    # after every step: bᵢ += γ·sign(mean load − loadᵢ)
    fine = MoELayer(64, 256, 8, k=2, granularity=4, shared=1)   # 31 routed experts of 64, top 7, + 1 shared
    ep = MoELayer.from_layer(layer, group)       # on every rank: this rank's experts, the router replicated

Claim C20 (active parameters per token) is measured in `llmlab.claims.ch08`; `llmlab bench moe` (`bench`, its
timing pieces in `llmlab.moe_bench`) times the layer against dense MLPs, the snippet, the loop, and expert-parallel
on gloo ranks; on a GPU it judges the target `GPU_TARGET` (≤ 1.15× the dense MLP of equal active FLOPs).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as td
import torch.nn as nn

from llmlab import moe_bench, runtime, validation
from llmlab.moe_bench import fwd_bwd
from llmlab.moe_dispatch import expert_parallel, grouped_gemm_mlp, grouped_mlp
from llmlab.timing import compare

__all__ = ["BALANCE", "SCORES", "GPU_TARGET", "Expert", "Routing", "route", "MoELayer", "loop_reference",
           "every_expert", "speed_target", "bench"]

BALANCE = ("aux-loss", "bias", "none")  # how the layer keeps its experts' loads even (steps 2 and 6)
SCORES = ("softmax", "sigmoid")  # how the router turns logits into scores (steps 1 and 6)


class Expert(nn.Module):
    """One expert: dim -> hidden -> GELU -> dim, named like `llmlab.model.MLP` (c_fc, c_proj)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


@dataclass(frozen=True)
class Routing:
    """Where T tokens go. Assignment a = j·T + t is token t's j-th choice (choice-major, the priority order)."""

    probs: torch.Tensor  # (T, E) router probabilities (sigmoid scores: normalised over the E)
    expert: torch.Tensor  # (T, k) chosen experts, most probable first
    gate: torch.Tensor  # (T, k) their gate weights
    kept: torch.Tensor  # (K,) kept assignments, grouped by expert, in priority order within each
    counts: torch.Tensor  # (E,) kept assignments per expert
    load: torch.Tensor  # (E,) assignments per expert before capacity
    capacity: int | None  # slots per expert; None = dropless
    balance_loss: torch.Tensor  # () N·Σ f·P
    z_loss: torch.Tensor  # () mean logsumexp(logits)²

    @property
    def token(self) -> torch.Tensor:
        return self.kept % self.probs.shape[0]  # (K,)

    @property
    def kept_gate(self) -> torch.Tensor:
        return self.gate.T.reshape(-1)[self.kept]  # (K,)

    @property
    def dropped(self) -> torch.Tensor:
        """(T, k) bool: which choices lost their slot."""
        keep = torch.zeros(self.gate.numel(), dtype=torch.bool, device=self.kept.device).index_fill_(0, self.kept, True)
        return ~keep.view(self.gate.shape[1], -1).T

    @property
    def drop_rate(self) -> float:
        return 1 - self.kept.numel() / self.gate.numel()

    def detach(self) -> Routing:
        return replace(self, **{f.name: getattr(self, f.name).detach() for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})


def _capacity(k: int, tokens: int, num_experts: int, capacity_factor: float | None) -> int | None:
    return None if capacity_factor is None else math.ceil(k * tokens / num_experts * capacity_factor)


def route(logits: torch.Tensor, k: int, capacity_factor: float | None, *, bias: torch.Tensor | None = None,
          scores: str = "softmax") -> Routing:
    """Top-k routing of (T, E) router logits with capacity (steps 1–3 of the module docstring). `bias` (E,) is
    added to the scores for the choice of the k experts only, not to the gates (step 6); `scores` is one of
    SCORES."""
    T, E = logits.shape
    validation.one_of("scores", scores, SCORES)
    if bias is not None and bias.shape != (E,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({E},): one per expert")
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (T, E), Switch's selective precision
    lse = torch.logsumexp(logits, -1)  # (T,), for the z-loss and the softmax both
    if scores == "softmax":
        score = probs = (logits - lse[:, None]).exp()  # (T, E): on rows of E ≪ 100 faster than softmax's kernel
    else:
        score = logits.sigmoid()  # (T, E) DeepSeek-V3's affinities
        probs = score / score.sum(-1, keepdim=True)  # (T, E)
    expert = (score if bias is None else score + bias).topk(k, dim=-1).indices  # (T, k) the bias picks only
    top = score.gather(1, expert)  # (T, k) the unbiased scores of the chosen experts
    gate = top if k == 1 else top / top.sum(-1, keepdim=True)  # (T, k)
    choice = expert.T.reshape(-1)  # (k·T,) expert of assignment a = j·T + t
    load = torch.bincount(choice, minlength=E)  # (E,)
    balance = E * (load.to(probs.dtype) / (k * T) * probs.mean(0)).sum()  # N·Σ fᵢ·Pᵢ
    z = lse.square().mean()
    order = torch.argsort(choice, stable=True)  # (k·T,) grouped by expert, priority order within
    capacity = _capacity(k, T, E, capacity_factor)
    if capacity is None:
        return Routing(probs, expert, gate, order, load, load, None, balance, z)
    starts = load.cumsum(0) - load  # (E,) where each expert's block begins in `order`
    place = torch.arange(k * T, device=logits.device) - starts[choice[order]]  # (k·T,) place in its queue
    return Routing(probs, expert, gate, order[place < capacity], load.clamp(max=capacity), load, capacity,
                   balance, z)


class MoELayer(nn.Module):
    """A top-k mixture of `num_experts` MLPs (dim -> hidden -> dim); forward returns `(output, aux_loss)`.

    `capacity_factor=None` drops nothing. `group`: expert parallelism over that process group (each rank owns
    routed_experts / world_size experts, `self.experts`, the first being global expert `self.first_expert`).
    `balance` (one of BALANCE) and `scores` (one of SCORES) choose the balancing and the scores (steps 2 and 6);
    `balance_coef` (α) and `z_coef` weigh the balance loss and z-loss in aux_loss, `bias_rate` is γ of
    `update_bias()`. `granularity` m and `shared` s split the experts (step 7): `routed_experts` = m·E − s experts
    of hidden `expert_hidden` = hidden/m, `routed_k` = m·k − s per token, and `shared_experts`. `grouped_gemm=True`:
    the routed experts' projections through the Triton grouped GEMM, one launch each for all of them (else one
    matmul per expert; step 4). After a forward, `self.routing` (a detached `Routing`) says where the tokens went.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, k: int = 2, capacity_factor: float | None = 1.25,
                 group=None, *, balance: str = "aux-loss", scores: str = "softmax", balance_coef: float = 1e-2,
                 z_coef: float = 1e-3, bias_rate: float = 1e-3, granularity: int = 1, shared: int = 0,
                 grouped_gemm: bool = False):
        super().__init__()
        self.dim, self.hidden = validation.positive_int("dim", dim), validation.positive_int("hidden", hidden)
        self.num_experts = validation.positive_int("num_experts", num_experts)
        validation.integer("k", k, 1, num_experts, hint="(experts per token, at most num_experts)")
        if capacity_factor is not None:
            validation.positive("capacity_factor", capacity_factor, hint="(or None: dropless)")
        self.balance, self.scores = validation.one_of("balance", balance, BALANCE), validation.one_of(
            "scores", scores, SCORES)
        validation.number("balance_coef", balance_coef, low=0)
        validation.number("z_coef", z_coef, low=0)
        validation.number("bias_rate", bias_rate, low=0)
        self.granularity = validation.positive_int("granularity", granularity)
        if hidden % granularity:
            raise ValueError(f"hidden={hidden} is not divisible by granularity={granularity} (each expert is split "
                             "into granularity experts of hidden / granularity)")
        self.shared = validation.integer("shared", shared, 0, granularity * k - 1,
                                         hint="(shared experts take that many of the granularity·k slots: one "
                                              "must stay routed)")
        self.grouped_gemm = validation.boolean("grouped_gemm", grouped_gemm)
        self.k, self.capacity_factor, self.group = k, capacity_factor, group
        self.balance_coef, self.z_coef, self.bias_rate = float(balance_coef), float(z_coef), float(bias_rate)
        self.expert_hidden = hidden // granularity
        self.routed_experts, self.routed_k = granularity * num_experts - shared, granularity * k - shared
        self.world_size, rank = 1, 0
        if group is not None:
            if not td.is_initialized() or td.get_rank(group) < 0:
                raise ValueError("group must be a torch.distributed process group this process belongs to")
            self.world_size, rank = td.get_world_size(group), td.get_rank(group)
            if self.routed_experts % self.world_size:
                split = f" (granularity={granularity}, shared={shared}: {self.routed_experts} routed experts)"
                raise ValueError(f"num_experts={num_experts}{split if self.routed_experts != num_experts else ''} "
                                 f"is not divisible by the expert-parallel world size {self.world_size} (each rank "
                                 "owns routed_experts / world_size experts)")
        self.num_local_experts = self.routed_experts // self.world_size
        self.first_expert = rank * self.num_local_experts
        self.gate = nn.Linear(dim, self.routed_experts, bias=False)  # the router, replicated on every rank
        self.experts = nn.ModuleList(Expert(dim, self.expert_hidden) for _ in range(self.num_local_experts))
        # replicated on every rank, like the router
        self.shared_experts = Expert(dim, shared * self.expert_hidden) if shared else None
        biased = balance == "bias"
        self.register_buffer("expert_bias", torch.zeros(self.routed_experts) if biased else None)  # (E,) bᵢ
        # (E,) loads since the last update_bias(); not saved: an update empties it
        self.register_buffer("step_load", torch.zeros(self.routed_experts, dtype=torch.long) if biased else None,
                             persistent=False)
        self.routing: Routing | None = None

    @classmethod
    def from_layer(cls, layer: MoELayer, group) -> MoELayer:
        """This rank's share of the single-process `layer`: a copy of its router (with its bias), its shared
        experts and the routed experts it owns."""
        if not isinstance(layer, MoELayer) or layer.group is not None:
            raise ValueError("layer must be a single-process MoELayer (group=None)")
        new = cls(layer.dim, layer.hidden, layer.num_experts, layer.k, layer.capacity_factor, group,
                  balance=layer.balance, scores=layer.scores, balance_coef=layer.balance_coef, z_coef=layer.z_coef,
                  bias_rate=layer.bias_rate, granularity=layer.granularity, shared=layer.shared,
                  grouped_gemm=layer.grouped_gemm)
        new.gate, new.shared_experts = copy.deepcopy(layer.gate), copy.deepcopy(layer.shared_experts)
        if layer.expert_bias is not None:
            new.expert_bias = layer.expert_bias.clone()  # its dtype too (a copy_ would keep the new float32)
        mine = range(new.first_expert, new.first_expert + new.num_local_experts)
        new.experts = nn.ModuleList(copy.deepcopy(layer.experts[e]) for e in mine)
        return new

    def router(self, tokens: torch.Tensor) -> Routing:
        """The routing of `tokens` (T, dim): this layer's scores, bias, routed_k and capacity."""
        return route(self.gate(tokens), self.routed_k, self.capacity_factor, bias=self.expert_bias,
                     scores=self.scores)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.shape[-1] != self.dim:
            raise ValueError(f"x has last dimension {x.shape[-1]}, the layer expects dim={self.dim}")
        tokens = x.reshape(-1, self.dim)  # (T, C)
        r = self.router(tokens)
        token = r.token  # (K,)
        rows = tokens.index_select(0, token)  # (K, C): permuted by expert, once
        mlp = grouped_gemm_mlp if self.grouped_gemm else grouped_mlp
        if self.group is None:
            y = mlp(self.experts, rows, r.counts.tolist())  # (K, C)
        else:
            y = expert_parallel(self.experts, rows, r.counts, self.group, mlp)  # (K, C)
        gated = y * r.kept_gate.to(y.dtype)[:, None]  # (K, C)
        base = y.new_zeros(tokens.shape) if self.shared_experts is None else self.shared_experts(tokens)  # (T, C)
        out = base.index_add_(0, token, gated)  # (T, C): un-permuted, once
        self.routing = r.detach()
        if self.step_load is not None and self.training:
            self.step_load += r.load  # a recomputed forward (checkpointing) doubles every load: same signs
        aux = self.z_coef * r.z_loss
        if self.balance == "aux-loss":
            aux = self.balance_coef * r.balance_loss + aux
        return out.view(x.shape), aux

    @torch.no_grad()
    def update_bias(self, group=None) -> torch.Tensor:
        """Aux-loss-free balancing's update (Wang et al. 2024 §3, DeepSeek-V3 §2.1.2): bᵢ += γ·sign(mean load −
        loadᵢ), the loads (before capacity) summed over every training forward since the last call, which it
        empties; call it after optimizer.step(). The loads are first summed over `group` (default: the layer's
        expert-parallel group; pass the data-parallel group where replicas route different tokens) so that every
        rank moves its bias alike. Returns those loads (E,)."""
        if self.expert_bias is None:
            raise ValueError(f"update_bias() needs balance='bias'; this layer has balance={self.balance!r}")
        load = self.step_load.clone()  # (E,)
        group = self.group if group is None else group
        if group is not None:
            td.all_reduce(load, group=group)
        # sign(mean − loadᵢ) = sign(Σ load − E·loadᵢ), in integers: exact, also when the mean is not
        self.expert_bias += self.bias_rate * torch.sign(load.sum() - load.numel() * load).to(self.expert_bias.dtype)
        self.step_load.zero_()
        return load


def loop_reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """The definition, one token at a time (slow; for tests and the bench): softmax (or sigmoid) scores, top-k of
    the scores plus the bias, gates the chosen unbiased scores, renormalised for k ≥ 2, `capacity` slots per
    expert handed out to all first choices in token order, then all second choices, and the shared experts."""
    if layer.group is not None:
        raise ValueError("layer must be a single-process MoELayer (group=None)")
    tokens = x.reshape(-1, layer.dim)  # (T, C)
    T, E, k = tokens.shape[0], layer.routed_experts, layer.routed_k
    capacity = _capacity(k, T, E, layer.capacity_factor)
    choices = []
    for t in range(T):
        logits = layer.gate(tokens[t])  # (E,)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (E,)
        score = logits.softmax(0) if layer.scores == "softmax" else logits.sigmoid()  # (E,)
        top_e = (score if layer.expert_bias is None else score + layer.expert_bias).topk(k).indices  # (k,)
        top_s = score[top_e]  # (k,)
        choices.append((top_e.tolist(), top_s if k == 1 else top_s / top_s.sum()))
    out = [tokens.new_zeros(layer.dim) if layer.shared_experts is None else layer.shared_experts(tokens[t])
           for t in range(T)]
    used = [0] * E
    for j in range(k):
        for t in range(T):
            e = choices[t][0][j]
            if capacity is None or used[e] < capacity:
                used[e] += 1
                out[t] = out[t] + choices[t][1][j].to(x.dtype) * layer.experts[e](tokens[t])
    return torch.stack(out).view(x.shape)


def every_expert(layer: MoELayer):
    """The course snippet's way, and the plain reference for the grouped dispatch: every expert on every token,
    weighted by its gate where the token chose it and kept its slot (0 elsewhere), the layer's own routing."""
    def forward(x):
        tokens = x.reshape(-1, layer.dim)  # (T, C)
        r = layer.router(tokens)
        gates = r.gate.masked_fill(r.dropped, 0).to(x.dtype)  # (T, k)
        weights = torch.zeros(tokens.shape[0], layer.routed_experts, dtype=x.dtype, device=x.device).scatter_add(
            1, r.expert, gates)  # (T, E)
        routed = sum(expert(tokens) * weights[:, e:e + 1] for e, expert in enumerate(layer.experts))  # (T, C)
        shared = 0 if layer.shared_experts is None else layer.shared_experts(tokens)  # (T, C)
        return (routed + shared).view(x.shape)
    return forward


# issue 30: on a GPU, the dropless layer's training step ≤ 1.15× the dense MLP's of equal active FLOPs; the CPU
# tier reports the ratio and sets no target (two cores run E small matmuls slower than one large one, whatever the
# kernel: `llmlab.moe_dispatch`'s docstring)
GPU_TARGET = 1.15


def speed_target(c, tier: runtime.Tier, device: torch.device) -> dict:
    """The target fields of the bench's equal-FLOPs row, from its Comparison `c` (layer / dense MLP): on a GPU the
    target and `meets` — 'yes' when the ratio's interquartile range lies below GPU_TARGET, 'no' above it, else 'not
    conclusive'; on smoke mode's CPU stand-in the target, not judged; on the CPU tier no target."""
    if not tier.is_gpu:
        return {"target": "none on the CPU (reported only)"}
    if device.type != "cuda":
        return {"target": f"≤ {GPU_TARGET}× on a GPU", "meets": "not judged: a CPU stands in for the GPU (smoke)"}
    met = {"faster": "yes", "slower": "no"}.get(c.direction(GPU_TARGET), "not conclusive")
    return {"target": f"≤ {GPU_TARGET}× on a GPU", "meets": met}


def bench(sizes: dict | None = None, cluster=None) -> list[dict]:
    """Grouped top-2 MoE forward+backward vs dense MLPs (and the experts alone, without routing or permutation: the
    layer's floor), vs every expert on every token, time and drop rate per capacity factor, expert-parallel on gloo
    ranks (`cluster`, see `moe_bench.expert_parallel_row`) vs the single-process layer, and vs the per-token loop
    at a small size. `sizes` overrides dim, hidden, experts,
    tokens (`moe_bench.sizes`: this tier's; tiny under smoke mode).

    On a GPU the experts run on the Triton grouped GEMM (`grouped_gemm=True`; a row compares it with one matmul
    per expert), and the equal-FLOPs row carries `GPU_TARGET` and whether it `meets` it
    (`speed_target`); on the CPU they run one matmul per expert and that row says it has no target.

    Each row is one `llmlab.timing.compare` (the layer and its peer interleaved round by round): the ratio of
    their times with its spread and the load, `direction` ("faster", "slower" or "not conclusive": the layer
    against its peer; "not conclusive" too when the spread is too wide), `note` ('' unless it is), and where
    there is one the `ideal` ratio that FLOPs alone would give."""

    device, s = runtime.device(), moe_bench.sizes(sizes)
    C, H, E, T, k = s["dim"], s["hidden"], s["experts"], s["tokens"], 2
    torch.manual_seed(0)
    x = torch.randn(T, C, device=device, requires_grad=True)
    # the compiled kernel on a GPU; not on smoke mode's stand-in, which would interpret it at seconds a step (a
    # program costs the interpreter ~0.1 s: chapter 8's size would take hours)
    kernel = device.type == "cuda"
    dropless = MoELayer(C, H, E, k, None, grouped_gemm=kernel).to(device)
    size = f"T={T} C={C} H={H} E={E} k={k}"
    experts = "Triton grouped GEMM" if kernel else "one matmul per expert"

    def timed(impl, peer, v=x, judged=False) -> dict:
        # rounds of ≥ 20 ms: several calls each, so a moment of other work on the machine averages out
        c = compare(fwd_bwd(impl, v), fwd_bwd(peer, v), device=device, warmup=2, min_rounds=7, min_round_s=0.02)
        return {**c.row(), "direction": c.direction() if c.conclusive else "not conclusive", "note": c.note(),
                **(speed_target(c, runtime.tier(), device) if judged else {})}

    for _ in range(3):  # the process's first steps pay for thread-pool start and allocator growth (and compiling)
        fwd_bwd(dropless, x)()
    rows = []
    for hidden, why, ideal in ((H, "1 expert's params", k), (k * H, "equal active FLOPs", 1)):
        r = timed(dropless, Expert(C, hidden).to(device), judged=ideal == 1)
        rows.append({"impl": "MoE grouped, dropless", "peer": f"dense MLP hidden={hidden} ({why})", "size": size,
                     "experts": experts, **r, "ideal": ideal, "tokens_per_s": T / r["impl_ms"] * 1e3})
    dropless(x)  # the experts' floor: their projections alone, on rows already grouped by this routing
    grouped = x.detach().index_select(0, dropless.routing.token).requires_grad_()  # (K, C)
    counts = dropless.routing.counts.tolist()
    mlp = grouped_gemm_mlp if kernel else grouped_mlp
    r = timed(lambda _: mlp(dropless.experts, grouped, counts), Expert(C, H).to(device))
    rows.append({"impl": "experts alone (rows pre-grouped)", "peer": f"dense MLP hidden={H} (1 expert's params)",
                 "size": size, "experts": experts, **r, "ideal": k})
    rows.append({"impl": "MoE grouped, dropless", "peer": "every expert on every token (snippet)", "size": size,
                 **timed(dropless, every_expert(dropless)), "ideal": k / E})
    if kernel:  # what the kernel buys: the same layer with one matmul per expert
        looped = copy.deepcopy(dropless)
        looped.grouped_gemm = False
        rows.append({"impl": "MoE grouped, dropless (Triton grouped GEMM)", "peer": "the same, one matmul per expert",
                     "size": size, **timed(dropless, looped), "ideal": 1})
    for cf in (0.5, 1.0, 1.25, 2.0):
        layer = copy.deepcopy(dropless)
        layer.capacity_factor = cf
        rows.append({"impl": f"MoE grouped, capacity_factor={cf}", "peer": "MoE grouped, dropless", "size": size,
                     **timed(layer, dropless), "drop_rate": layer.routing.drop_rate})
    on_ranks = moe_bench.sizes(sizes, ranks=True)  # gloo ranks compute on the CPU: the layer is sent to each
    torch.manual_seed(0)
    rows.append(moe_bench.expert_parallel_row(MoELayer(on_ranks["dim"], on_ranks["hidden"], on_ranks["experts"], k,
                                                       None), on_ranks["tokens"], cluster))
    small = MoELayer(32, 128, 4, k, None).to(device)  # the loop's row comes last (chapter 8 prints its size)
    rows.append({"impl": "MoE grouped, dropless", "peer": "per-token loop (loop_reference)",
                 "size": f"T=64 C=32 H=128 E=4 k={k}",
                 **timed(small, lambda v: loop_reference(small, v), torch.randn(64, 32, device=device,
                                                                                requires_grad=True))})
    return rows
