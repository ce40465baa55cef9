"""Routing collapse, and the two cures measured: an MoE layer trained without balancing sends most tokens to a few
experts; the Switch balance loss and the aux-loss-free bias (`llmlab.moe`, steps 2 and 6) keep the loads even.

Shazeer et al. 2017 (§4) name the collapse: the gating network "tends to converge to a state where it always
produces large weights for the same few experts. This imbalance is self-reinforcing, as the favored experts are
trained more rapidly and thus are selected even more by the gating network." `balance_run` trains one
`MoELayer` (top-2 of 8, sigmoid scores, dropless, no z-loss: only the balancing differs) to imitate a fixed
random MLP, the teacher, on fresh tokens every step, and records each step's load per expert. The tokens share
one direction (an offset added to Gaussian noise), as a transformer's hidden states do: a router that leans
towards an expert leans so for every token at once, and nothing pulls it back unless a balancing term does.

    from llmlab.moe_balance import balance_run
    runs = {b: balance_run(b, steps=100, seed=0) for b in ("none", "aux-loss", "bias")}
    runs["none"].top_share()[-1]        # share of the assignments on the 2 busiest experts: uniform is 2/8
    runs["bias"].max_violation()[-1]    # max load / mean load − 1 (Wang et al. 2024's MaxVio)
    runs["none"].loads                  # (steps, experts) tokens routed to each expert, every step

Measured on seeds 0–299 of the default setup, 100 steps, the last 10 averaged (tests/test_moe_balance.py runs
seeds 0–4): without balancing the two busiest experts end with 0.65–1.0 of the assignments (median 0.95 on
seeds 0–59; 0.57 at the first step, the shared direction's lean); with the balance loss at most 0.34, with the
bias at most 0.36, against 0.25 for a uniform router, and the busiest expert within 66% of the mean load
(MaxVio). Every run's task loss falls at least 25-fold: two experts are enough for this teacher, so what the
collapse wastes here is the six idle experts (their memory and, across ranks, their devices' time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmlab import validation
from llmlab.moe import BALANCE, SCORES, Expert, MoELayer

__all__ = ["BalanceSetup", "BalanceRun", "balance_run"]


@dataclass(frozen=True)
class BalanceSetup:
    """The collapse experiment's sizes and rates. `offset` scales the direction every token shares (a standard
    normal vector: per coordinate `offset` times the tokens' own noise); `scores` is one of llmlab.moe.SCORES;
    `balance_coef` (α) weighs the balance loss of "aux-loss", `bias_rate` is γ of "bias": 2e-2, twenty times
    DeepSeek-V3's 1e-3, because this run is a hundred steps long, not a hundred thousand, and its router (Adam at
    2e-2) collapses within ten steps, which the bias must undo. `scores` is sigmoid, as DeepSeek-V3's: with the
    softmax the collapsing router's probabilities concentrate (the experts share one unit of mass), the bias
    chases a target that steepens as it goes, and at γ = 1e-2 in 4 of 40 seeds it had not caught up after 100
    steps (MaxVio 1.2–1.9) while γ = 3e-2 oscillated (0.5–0.9). With sigmoid scores at γ = 1e-2, 4 seeds of the
    first 100 were still catching up (MaxVio 0.75–0.92); γ = 2e-2 settles them (0.39–0.46)."""

    dim: int = 16
    hidden: int = 32
    experts: int = 8
    k: int = 2
    tokens: int = 128
    teacher_hidden: int = 64
    offset: float = 1.0
    lr: float = 2e-2
    balance_coef: float = 1e-2
    bias_rate: float = 2e-2
    scores: str = "sigmoid"

    def __post_init__(self):
        for name in ("dim", "hidden", "experts", "tokens", "teacher_hidden"):
            validation.positive_int(name, getattr(self, name))
        validation.integer("k", self.k, 1, self.experts, hint="(experts per token, at most experts)")
        for name in ("offset", "balance_coef", "bias_rate"):
            validation.number(name, getattr(self, name), low=0)
        validation.positive("lr", self.lr)
        validation.one_of("scores", self.scores, SCORES)


@dataclass(frozen=True)
class BalanceRun:
    """One run: `loads` (steps, E) assignments routed to each expert per step (before capacity; the layer is
    dropless), `losses` the task loss (mean squared error to the teacher) per step."""

    balance: str
    setup: BalanceSetup
    loads: torch.Tensor
    losses: list[float]

    def share(self) -> torch.Tensor:
        """(steps, E) each expert's fraction of the step's k·T assignments."""
        return self.loads.double() / self.loads.sum(-1, keepdim=True)

    def top_share(self, n: int = 2) -> torch.Tensor:
        """(steps,) the fraction of the assignments the n busiest experts took: n/E when uniform, 1 when every
        token chose among the same n."""
        validation.integer("n", n, 1, self.loads.shape[1])
        return self.share().sort(-1, descending=True).values[:, :n].sum(-1)

    def max_violation(self) -> torch.Tensor:
        """(steps,) max load / mean load − 1 (Wang et al. 2024's MaxVio): 0 when even, E/k − 1 when collapsed."""
        loads = self.loads.double()  # (steps, E)
        return loads.max(-1).values / loads.mean(-1) - 1


def balance_run(balance: str, steps: int = 100, seed: int = 0, setup: BalanceSetup = BalanceSetup()) -> BalanceRun:
    """Train an MoELayer with `balance` (one of llmlab.moe.BALANCE) for `steps` Adam steps of fresh tokens on
    the teacher task (module docstring); `seed` draws the layer, the teacher, the shared direction and the
    tokens. Runs on the CPU in about a second (100 steps)."""
    validation.one_of("balance", balance, BALANCE)
    validation.positive_int("steps", steps)
    validation.integer("seed", seed, low=0)
    if not isinstance(setup, BalanceSetup):
        raise ValueError(f"setup={setup!r} must be a BalanceSetup")
    s = setup
    torch.manual_seed(seed)
    teacher = Expert(s.dim, s.teacher_hidden)
    layer = MoELayer(s.dim, s.hidden, s.experts, s.k, None, balance=balance, scores=s.scores,
                     balance_coef=s.balance_coef, z_coef=0.0, bias_rate=s.bias_rate)
    shared = torch.randn(s.dim) * s.offset  # (C,) the direction every token shares
    optimizer = torch.optim.Adam(layer.parameters(), lr=s.lr)
    loads, losses = [], []
    for _ in range(steps):
        x = torch.randn(s.tokens, s.dim) + shared  # (T, C)
        with torch.no_grad():
            target = teacher(x)  # (T, C)
        y, aux = layer(x)  # (T, C), ()
        loss = (y - target).square().mean()
        (loss + aux).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if balance == "bias":
            layer.update_bias()
        loads.append(layer.routing.load)
        losses.append(loss.item())
    return BalanceRun(balance, setup, torch.stack(loads), losses)
