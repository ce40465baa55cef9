"""Check 8.2 (re-exported by llmlab.checks.ch08): the top-2 router with capacity, checked against
`llmlab.moe.route(logits, 2, capacity_factor)`.

    from llmlab.checks import ch08 as check
    check.top2_router(top2_route)               # 8.2

The learner's `top2_route(logits, capacity_factor)` takes (T, E) router logits and returns a `llmlab.moe.Routing`
(or any object with its fields): probs (T, E), the fp32 softmax; expert (T, 2), most probable first; gate (T, 2),
the two probabilities renormalised to sum to 1 (GShard, before any drop); capacity = ⌈2T/E · capacity_factor⌉
(None: dropless); kept (K,), the assignments a = j·T + t (token t's j-th choice) that got a slot — slots going to
all first choices in token order, then all second choices — grouped by expert, in that priority order within each;
counts (E,), kept per expert; load (E,), assignments per expert before capacity; balance_loss, the Switch
Transformer's N·Σᵢ fᵢ·Pᵢ with fᵢ = loadᵢ/(2T); z_loss, ST-MoE's mean logsumexp(logits)².

Each call draws odd token counts and 2–16 experts, capacity factors where the capacity binds hard (0.3) and not at
all, exactly integral capacities, skewed routers (a bias per expert: the popular experts fill up), a dropless case
and one token on two experts; every row's three largest logits are kept ≥ 1e-5 apart, so that no fp32 rounding of
the softmax can change which experts a token picks. It compares every field, then the gradient of
Σ gate·w·kept + balance_loss + z_loss with respect to the logits. A wrong answer is named: the capacity's rounding
or missing k, no capacity, slots handed out in another order, kept not grouped by expert, gates not renormalised
or renormalised after the drop, a balance loss counting kept assignments or first choices, fᵢ from the
probabilities, no factor N, and a router detached from the logits.
"""

from __future__ import annotations

import math
import random

import torch

from llmlab.checks import Hint, Mismatch, assert_close, check, fresh_rng
from llmlab.moe import Routing, route

__all__ = ["top2_router", "FIELDS"]

FIELDS = ("probs", "expert", "gate", "kept", "counts", "load", "capacity", "balance_loss", "z_loss")
_GAP = 1e-5  # the least distance between a row's three largest logits (see the module docstring)

_FORMULA = ("probs = softmax(logits.float()); top_p, expert = probs.topk(2); gate = top_p / top_p.sum(-1); choice = "
            "expert.T.reshape(-1) (assignment a = j·T + t); load = bincount(choice, E); balance = E·Σ (load/(2T))·"
            "probs.mean(0); z = logsumexp(logits)².mean(); order = argsort(choice, stable=True); capacity = "
            "ceil(2T/E·capacity_factor); each assignment's place in its expert's queue = arange(2T) − (load.cumsum() − "
            "load)[choice[order]]; kept = order[place < capacity]; counts = load.clamp(max=capacity)")
_BALANCE = Hint(
    nudge="look at fᵢ in the balance loss: what it counts, and what it divides by",
    idea="fᵢ is the fraction of routing decisions that went to expert i, counted from the chosen experts before any "
         "drop (no gradient): both choices of every token count, out of all 2·T assignments; the gradient comes "
         "through Pᵢ, the mean router probability",
    formula=_FORMULA)
_HINTS = {
    "order": Hint(
        nudge="look at the order of each token's two experts",
        idea="the first column is the expert with the larger router probability, the second the runner-up: take "
             "the top 2 sorted from the largest down",
        formula=_FORMULA),
    "raw gates": Hint(
        nudge="look at what each token's two gates add up to",
        idea="the two chosen probabilities are renormalised over the pair, so that a token's gates sum to 1 (GShard "
             "does so for k ≥ 2)",
        formula=_FORMULA),
    "gates after drop": Hint(
        nudge="look at the gate of a token whose other choice was dropped",
        idea="the gates are renormalised over the two chosen experts before capacity is applied: a dropped choice "
             "loses its share of the token (the residual connection carries it), it does not hand it to the other",
        formula=_FORMULA),
    "capacity": Hint(
        nudge="look at how you compute the capacity: what it counts, and how it rounds",
        idea="every expert has room for its fair share of the 2·T assignments (k = 2 per token), times the capacity "
             "factor, rounded up to a whole slot: one queue per expert, shared by first and second choices",
        formula=_FORMULA),
    "priority": Hint(
        nudge="look at the order in which your router hands out an expert's slots",
        idea="first come, first served in GShard's priority: every token's first choice, in token order, then every "
             "token's second choice, one queue per expert shared by both; an assignment past the capacity-th place "
             "of its queue is dropped",
        formula=_FORMULA),
    "grouped": Hint(
        nudge="look at the order of the kept assignments you return",
        idea="the layer runs each expert on a block of consecutive rows: kept lists expert 0's assignments, then "
             "expert 1's, …, each block in priority order (choice-major a = j·T + t); a stable sort by expert does it",
        formula=_FORMULA),
    "f from P": _BALANCE, "first choices only": _BALANCE, "f over T": _BALANCE, "f after capacity": _BALANCE,
    "no factor N": Hint(
        nudge="look at the factor in front of the sum in the balance loss",
        idea="the sum is multiplied by the number of experts, so that uniform routing (fᵢ = Pᵢ = 1/E) gives a loss "
             "of 1 whatever the number of experts",
        formula=_FORMULA),
    "z-loss": Hint(
        nudge="look at your z-loss: of which quantity it takes the square, and what it averages over",
        idea="ST-MoE's z-loss penalises large router logits: per token the log of the softmax's denominator, "
             "logsumexp of the logits, squared, then the mean over tokens",
        formula=_FORMULA),
    "detached": Hint(
        nudge="look at where your router's outputs lose their connection to the logits",
        idea="the router learns through the gates, the balance loss and the z-loss, so the probabilities must stay "
             "in the autograd graph; only the counts (load, fᵢ) carry no gradient",
        formula=_FORMULA),
}


def _logits(rng: random.Random, T: int, E: int, spread: float, skew: float) -> torch.Tensor:
    """(T, E) logits: Gaussian times `spread`, plus a per-expert bias of size `skew` (a few popular experts), with
    each row's three largest values redrawn until they are ≥ _GAP apart."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    bias = torch.randn(E, generator=gen) * skew  # (E,)
    logits = torch.randn(T, E, generator=gen) * spread + bias  # (T, E)
    while True:
        top = logits.topk(min(3, E), dim=-1).values  # (T, ≤ 3)
        close = (top[:, :-1] - top[:, 1:]).min(-1).values < _GAP  # (T,)
        if not close.any():
            return logits
        logits[close] = torch.randn(int(close.sum()), E, generator=gen) * spread + bias


def _capacity_factor(rng: random.Random, T: int, E: int) -> float:
    """A factor whose 2T/E·cf lies ≥ 0.05 from an integer and from a half: no float order of the product can
    change its ceiling, and ⌈⌉, ⌊⌋ and round() all differ or tell apart."""
    while True:
        cf = round(rng.uniform(0.3, 2.5), 3)
        frac = (2 * T / E * cf) % 1
        if 0.05 < frac < 0.95 and abs(frac - 0.5) > 0.05:
            return cf


def _cases(rng: random.Random) -> list[tuple[torch.Tensor, float | None]]:
    """(logits, capacity_factor) of every case."""
    cases = [(1, 2, 1.0, 1.0, 0.0),  # one token, two experts: both chosen, one slot each
             (7, 3, 1.0, 2.0, 0.0),  # 14/3 = 4.67 slots: ⌈⌉ 5, ⌊⌋ 4
             (45, 4, 2.0, 1.0, 1.5),  # 2·45/4·2 = 45 exactly (E a power of 2, cf dyadic: exact in any order)
             (257, 16, 0.35, 1.0, 1.0),  # capacity binds hard: 2·257/16·0.35 = 11.24 slots of ~32 asked; round 11
             (33, 4, None, 1.0, 2.0)]  # dropless
    for _ in range(2):
        T, E = rng.randrange(3, 302, 2), rng.randint(2, 16)
        cases.append((T, E, _capacity_factor(rng, T, E), rng.uniform(0.3, 3.0), rng.choice([0.0, 1.0, 2.0])))
    return [(_logits(rng, T, E, spread, skew), cf) for T, E, cf, spread, skew in cases]


def _kept_by(choice: torch.Tensor, priority: torch.Tensor, capacity: int, E: int) -> torch.Tensor:
    """The assignments that get a slot when each expert's `capacity` slots go in `priority` order (a permutation
    of the 2T assignments, first served first): grouped by expert, in that order within each."""
    ordered = priority[torch.argsort(choice[priority], stable=True)]  # (2T,) by expert, priority within
    load = torch.bincount(choice, minlength=E)  # (E,)
    place = torch.arange(choice.numel()) - (load.cumsum(0) - load)[choice[ordered]]  # (2T,) place in its queue
    return ordered[place < capacity]


def _priority_variants(ref: Routing) -> dict[str, tuple[str, torch.Tensor]]:
    """Kept sets a plausible mistake gives, from the reference routing: key → (what it does, its kept assignments)."""
    T, E = ref.probs.shape
    choice = ref.expert.T.reshape(-1)  # (2T,) expert of assignment a = j·T + t
    a = torch.arange(2 * T)  # (2T,)
    first, second = a[:T], a[T:]
    by_choice = torch.cat([_kept_by(choice[:T], first, ref.capacity, E),
                           T + _kept_by(choice[T:], first, ref.capacity, E)])  # a queue per choice
    return {
        "token-major": ("the slots go token by token (token 0's two choices, then token 1's, …); GShard serves every "
                        "first choice before any second one", _kept_by(choice, a.view(2, T).T.reshape(-1),
                                                                       ref.capacity, E)),
        "second first": ("the slots go to second choices before first ones", _kept_by(
            choice, torch.cat([second, first]), ref.capacity, E)),
        "by probability": ("the slots go to the most probable assignments first; GShard serves them in token order, "
                           "every first choice before any second one", _kept_by(
                               choice, torch.argsort(-ref.probs.detach().gather(1, ref.expert).T.reshape(-1),
                                                     stable=True), ref.capacity, E)),
        "per choice": ("first and second choices have a queue of `capacity` slots each; they share one queue per "
                       "expert", by_choice),
    }


def _balance_variants(probs: torch.Tensor, expert: torch.Tensor, counts: torch.Tensor) -> dict[str, tuple]:
    """Balance losses a plausible mistake computes, from the (T, E) probabilities (with their graph), the (T, 2)
    chosen experts and the kept counts: key → (what it is, its value)."""
    T, E = probs.shape
    P = probs.mean(0)  # (E,)
    load = torch.bincount(expert.flatten(), minlength=E).float()  # (E,) both choices
    first = torch.bincount(expert[:, 0], minlength=E).float()  # (E,) first choices only
    return {"f from P": ("fᵢ taken from the router probabilities (E·Σ Pᵢ²): fᵢ is the fraction of assignments "
                         "routed to expert i, a count", E * (P * P).sum()),
            "first choices only": ("fᵢ counts first choices only (as for k = 1); here fᵢ is the fraction of all 2·T "
                                   "assignments, both choices", E * (first / T * P).sum()),
            "f over T": ("twice the expected value: fᵢ divides expert i's load by the 2·T assignments, not by T",
                         E * (load / T * P).sum()),
            "f after capacity": ("fᵢ counts the kept assignments; it counts every assignment, before capacity (the "
                                 "router must see the demand it puts on each expert, dropped or not)",
                         E * (counts.float() / (2 * T) * P).sum()),
            "no factor N": ("the factor N (the number of experts) is missing, so uniform routing does not give 1",
                            (load / (2 * T) * P).sum())}


def _loss(gate, balance, z, weights: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """What the gradient check backpropagates: the kept gates times random weights, plus both auxiliary losses."""
    return (gate * weights * keep).sum() + balance + z


@check("8.2", "the top-2 router with capacity and the balance loss", hint=Hint(
    nudge="look at the fields in turn: the two experts and their gates, the capacity, which assignments keep a "
          "slot and in what order, and the two losses",
    idea="each token goes to its two most probable experts with gates renormalised over the pair; every expert has "
         "⌈2T/E·cf⌉ slots, served to all first choices in token order, then all second choices; the balance loss "
         "multiplies, expert by expert, the fraction of assignments by the mean probability",
    formula=_FORMULA))
def top2_router(fn):
    """`fn(logits, capacity_factor)`: a Routing (see the module docstring), as llmlab.moe.route(logits, 2, cf)."""
    for logits, cf in _cases(fresh_rng()):
        _judge(fn, logits, cf)


def _field(answer, name: str, what: str):
    if not hasattr(answer, name):
        raise Mismatch(f"{what} returned {type(answer).__name__}, with no field {name!r}: return a "
                       f"llmlab.moe.Routing({', '.join(FIELDS)})")
    value = getattr(answer, name)
    if name != "capacity" and not isinstance(value, torch.Tensor):
        raise Mismatch(f"{what}.{name}: got {type(value).__name__}, expected a torch.Tensor")
    return value


def _judge(fn, logits: torch.Tensor, cf: float | None) -> None:
    T, E = logits.shape
    what = f"top2_route(logits of shape ({T}, {E}), capacity_factor={cf})"
    x = logits.clone().requires_grad_(True)  # (T, E)
    ref_logits = logits.clone().requires_grad_(True)
    ref = route(ref_logits, 2, cf)
    answer = fn(x, cf)
    got = {name: _field(answer, name, what) for name in FIELDS}
    assert_close(got["probs"], ref.probs, what=f"{what}.probs (the softmax, in fp32)")  # the same fp32 ops: ulps
    expert = got["expert"]
    if expert.shape != (T, 2) or not torch.equal(expert.long(), ref.expert):
        if expert.shape == (T, 2) and torch.equal(expert.long().sort(-1).values, ref.expert.sort(-1).values):
            raise Mismatch(f"{what}: the right two experts, in the wrong order: put the most probable first",
                           mistake="order", hint=_HINTS["order"])
        assert_close(expert.long(), ref.expert, what=f"{what}.expert (the two most probable)", rtol=0, atol=0)

    keep = ~ref.dropped  # (T, 2): a dropped choice's gate is never used; left as it is or zeroed, both pass
    gate = got["gate"]
    if gate.shape != (T, 2):
        raise Mismatch(f"{what}.gate has shape {tuple(gate.shape)}, expected ({T}, 2)")
    top = ref.probs.detach().gather(1, ref.expert)  # (T, 2) not renormalised
    after = top * keep / (top * keep).sum(-1, keepdim=True).clamp(min=1e-30)  # over the kept choices only
    for key, variant, why in (("raw gates", top, "the gates are the raw probabilities: renormalise the two so each "
                                                 "token's gates sum to 1"),
                              ("gates after drop", after, "a token with one choice dropped gives all its weight to "
                                                          "the other: renormalise before the drop, not after")):
        if not torch.allclose(variant * keep, ref.gate.detach() * keep, rtol=1e-4) and torch.allclose(
                gate.detach().float() * keep, variant * keep, rtol=1e-5, atol=1e-6):
            raise Mismatch(f"{what}: {why}", mistake=key, hint=_HINTS[key])
    # default fp32 tolerances: softmax, top-2 and a division, the same fp32 operations as route's up to order
    assert_close(gate * keep, ref.gate * keep, what=f"{what}.gate (where the choice kept its slot)")

    _capacity_and_slots(got, ref, cf, what)
    _losses(got, ref, x, ref_logits, keep, what)


def _capacity_and_slots(got: dict, ref: Routing, cf: float | None, what: str) -> None:
    T, E = ref.probs.shape
    capacity = got["capacity"]
    if cf is None and capacity is not None:
        raise Mismatch(f"{what}: capacity is {capacity!r}; with capacity_factor=None the router is dropless: capacity "
                       "None, every assignment kept", mistake="capacity", hint=_HINTS["capacity"])
    if cf is not None and capacity != ref.capacity:
        x = 2 * T / E * cf
        known = {math.floor(x): "it rounds down; round up (math.ceil): a fraction of a slot is a slot",
                 round(x): "it rounds to the nearest; round up (math.ceil)",
                 math.ceil(T / E * cf): "it counts the T tokens; with k = 2 there are 2·T assignments to seat",
                 None: "it is None: capacity_factor is given, so every expert has ⌈2T/E·cf⌉ slots"}
        why = known.get(capacity, "")
        raise Mismatch(f"{what}: capacity = {capacity!r}, expected ⌈2·{T}/{E}·{cf}⌉ = {ref.capacity}"
                       + (f": {why}" if why else ""), mistake="capacity", hint=_HINTS["capacity"])
    kept = got["kept"].long()
    if not torch.equal(kept, ref.kept):
        mine = set(kept.tolist())
        if len(mine) == kept.numel() and mine == set(ref.kept.tolist()):
            experts = ref.expert.T.reshape(-1)[kept]  # (K,) the expert of each kept assignment, in the answer's order
            if bool((experts[1:] >= experts[:-1]).all()):
                raise Mismatch(f"{what}: the right assignments are kept, grouped by expert, but not in priority order "
                               "within an expert: first choices in token order, then second choices (a = j·T + t "
                               "ascending)", mistake="priority", hint=_HINTS["priority"])
            raise Mismatch(f"{what}: the right assignments are kept, in another order: kept must be grouped by "
                           "expert (expert 0's first), each expert's in priority order, a = j·T + t",
                           mistake="grouped", hint=_HINTS["grouped"])
        if ref.capacity is not None and mine == set(range(2 * T)):
            raise Mismatch(f"{what}: every assignment is kept, but only {ref.kept.numel()} of {2 * T} fit: "
                           f"capacity {ref.capacity} per expert, in one queue that first and second choices share, is "
                           "not applied", mistake="capacity", hint=_HINTS["capacity"])
        if ref.capacity is not None:  # the variant whose kept list the answer's is, else one whose kept set
            variants = _priority_variants(ref).values()
            named = [why for why, v in variants if torch.equal(v, kept)] or [
                why for why, v in variants if set(v.tolist()) == mine]
            if named:
                raise Mismatch(f"{what}: {kept.numel()} assignments kept, {len(mine - set(ref.kept.tolist()))} of "
                               f"them the wrong ones: {named[0]}", mistake="priority", hint=_HINTS["priority"])
        assert_close(kept, ref.kept, what=f"{what}.kept", rtol=0, atol=0)
    for name in ("counts", "load"):
        assert_close(got[name].long(), getattr(ref, name), what=f"{what}.{name}", rtol=0, atol=0)


def _losses(got: dict, ref: Routing, x: torch.Tensor, ref_logits: torch.Tensor, keep: torch.Tensor,
            what: str) -> None:
    balance, z = got["balance_loss"], got["z_loss"]
    for name, value in (("balance_loss", balance), ("z_loss", z)):
        if value.dim() != 0:
            raise Mismatch(f"{what}.{name} has shape {tuple(value.shape)}, expected a scalar (a 0-d tensor)")
    # a wrong value (outside assert_close's default tolerance, below) is named when it is a known variant's;
    # deciding by the answer, not by how far the variant lies from the reference (once 1e-4 of it), names a
    # variant that lands 1e-5 … 1e-4 away too — two near-equal router probabilities did so in 1 call of 130
    if not torch.isclose(balance.detach().float(), ref.balance_loss.detach(), rtol=1.3e-6, atol=1e-5):
        for key, (why, value) in _balance_variants(ref.probs.detach(), ref.expert, ref.counts).items():
            if torch.isclose(balance.detach().float(), value, rtol=1e-5, atol=1e-7):
                raise Mismatch(f"{what}: balance_loss = {balance.item():.6g}, expected {ref.balance_loss.item():.6g}: "
                               f"{why}", mistake=key, hint=_HINTS[key])
    assert_close(balance, ref.balance_loss, what=f"{what}.balance_loss")  # E sums of T fp32 values: a few ulp
    # a mean of T ≤ 301 fp32 squares in another order: pairwise sums stay within ~log2(T)·2⁻²⁴ ≈ 5e-7 of it
    if not torch.isclose(z.detach().float(), ref.z_loss.detach(), rtol=1e-5, atol=1e-6):
        raise Mismatch(f"{what}: z_loss = {z.item():.6g}, expected {ref.z_loss.item():.6g}, the mean over tokens of "
                       "logsumexp(logits)²", mistake="z-loss", hint=_HINTS["z-loss"])

    weights = torch.randn(keep.shape)  # (T, 2): an arbitrary loss of the kept gates, plus both auxiliary losses
    _loss(ref.gate, ref.balance_loss, ref.z_loss, weights, keep).backward()
    detached = [name for name in ("gate", "balance_loss", "z_loss") if not got[name].requires_grad]
    if detached:
        raise Mismatch(f"{what}: {detached[0]} has no gradient w.r.t. the logits: the router learns through the "
                       "gates and both losses (don't detach the probabilities)", mistake="detached",
                       hint=_HINTS["detached"])
    _loss(got["gate"], balance, z, weights, keep).backward()
    grad_close = dict(rtol=1e-4, atol=1e-6)  # fp32 softmax gradients, summed in other orders
    broken = ~torch.isfinite(x.grad).all(-1)  # (T,): tokens whose logits got a NaN or inf gradient
    if broken.any() and torch.isfinite(ref_logits.grad).all() and not (broken & keep.any(-1)).any():
        # only tokens that lost both choices: their gates, renormalised after the drop, are 0/0 (the forward may
        # hide it, a dropped gate is never used; its gradient cannot) — the flake hunt met this 1 run in 300
        raise Mismatch(f"{what}: the gradient is NaN for the {int(broken.sum())} token(s) whose two choices were both "
                       "dropped: renormalised after the drop, their gates divide 0 by 0; renormalise before the drop, "
                       "not after", mistake="gates after drop", hint=_HINTS["gates after drop"])
    if not torch.allclose(x.grad, ref_logits.grad, **grad_close):
        _diagnose_balance_gradient(x.grad, ref_logits.detach(), ref, weights, keep, grad_close, what)
    assert_close(x.grad, ref_logits.grad, what=f"{what}: d(Σ gate·w·kept + balance_loss + z_loss)/dlogits",
                 **grad_close)


def _diagnose_balance_gradient(grad, logits, ref: Routing, weights, keep, grad_close, what: str) -> None:
    """Name the balance mistake whose gradient the answer has. With near-uniform routing a wrong balance loss can
    equal the right one in value (E·Σ Pᵢ² = 1 + O((p₀ − p₁)²) for two experts) while its gradient still differs."""
    for key in _balance_variants(ref.probs.detach(), ref.expert, ref.counts):
        x = logits.clone().requires_grad_(True)  # (T, E)
        r = route(x, 2, None)  # the same probabilities, gates and z-loss: capacity plays no part in them
        why, wrong = _balance_variants(r.probs, r.expert, ref.counts)[key]
        _loss(r.gate, wrong, r.z_loss, weights, keep).backward()
        if torch.allclose(grad, x.grad, **grad_close):
            raise Mismatch(f"{what}: balance_loss has the gradient of a different loss: {why}", mistake=key,
                           hint=_HINTS[key])
