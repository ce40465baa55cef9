"""Check 7.2 (re-exported by llmlab.checks.ch07): diagnose an out-of-memory from a planner report.

    from llmlab.checks import ch07 as check
    check.fix_oom(fix_oom)    # 7.2

The learner's `fix_oom(plan, config, batch_size, budget_bytes, data) -> (dominant, remedy, bytes_after)` gets
`plan = planner.plan(config, batch_size, data=data)` (mixed-precision Adam, ZeRO stage 0 on `data` ranks) of a
configuration that does not fit `budget_bytes`, and returns the plan's largest component (a `Plan` field name), the
first remedy of `oom.remedies`' ranking whose plan fits, and that plan's total bytes (None, None where none fits).
The answer is `oom.remedies(config, batch_size, budget_bytes, data=data)` itself: its first remedy that fits.

Every run draws random GPT configurations (odd sizes; with and without flash attention, dropout and biases; odd and
even micro-batches; 2–64 data ranks) until each remedy that can be the answer is the answer of one of them, and sets
the budgets from oom's own remedies: **generous** (every remedy fits: the cheapest wins, so a ranking by saving is
seen), **tight** (just under the remedies ranked before one remedy, and above it: that remedy is the answer, so its
bytes are checked), **exact** (the budget is a remedy's total: it fits) and **none** (below every remedy).
"""

from __future__ import annotations

import math
from dataclasses import fields

from llmlab.checks import Hint, Mismatch, check, fresh_rng, number
from llmlab.diagnose import oom
from llmlab.memory import planner
from llmlab.model import GPTConfig

__all__ = ["fix_oom", "REMEDIES", "COMPONENTS"]

COMPONENTS = tuple(f.name for f in fields(planner.Plan))  # params, grads, optimizer_state, activations, ...
# oom.remedies' remedies, in the order it lists them (before ranking): what a learner's answer may name
REMEDIES = ("memory-efficient attention", "ZeRO-1", "ZeRO-2", "ZeRO-3", "CPU offload", "selective recompute",
            "gradient checkpointing", "gradient accumulation", "smaller batch", "smaller model")
# The remedies that can be the answer: ZeRO-1 never is (ZeRO-2 ranks before it, at the same cost, and saves more),
# nor, in 2000 random configurations, was selective recompute (flash attention, which costs nothing, saves more),
# nor a smaller batch where gradient accumulation (its bytes, at a lower cost) is offered
ANSWERABLE = ("memory-efficient attention", "ZeRO-2", "ZeRO-3", "CPU offload", "gradient checkpointing",
              "gradient accumulation", "smaller batch", "smaller model")
# Data ranks: powers of two only, so that every byte count of a plan (integers, and Ψ·b/N) is a binary fraction
# that float64 holds exactly, and so is every sum of them (< 2⁴⁷ bytes, ≤ 6 fractional bits): a right answer's
# bytes equal oom's, and "fits" at a budget equal to a remedy's total is decided without rounding
DATA_RANKS = (2, 4, 16, 32, 64)
RTOL = 1e-12  # the bytes are exact (above); this only forgives a sum taken as total − saving in another order
MAX_CONFIGS = 5000  # random configurations drawn to cover ANSWERABLE; ~40 suffice (0.6 ms each)

_REST = "activations + recompute + logits (what ZeRO and offload leave on the GPU)"
_STATE = "plan.params + plan.grads + plan.optimizer_state"


def _remedy_hint(name: str, idea: str, formula: str) -> Hint:
    return Hint(nudge=f"look at {name}: the bytes you compute after it, whether you offer it here, and where your "
                      "ranking puts it",
                idea=idea, formula=formula)


_PLANNED = "the planner's own total for the changed configuration: planner.plan("
_HINTS = {
    "memory-efficient attention": _remedy_hint(
        "memory-efficient attention", "flash attention keeps no T×T attention matrix, only a logsumexp per head and "
        "position: the activations change, so plan the changed configuration; it is offered only where "
        "config.flash is False, and it costs nothing, so it ranks first",
        f"{_PLANNED}replace(config, flash=True), batch_size, data=data).total"),
    "ZeRO-1": _remedy_hint(
        "ZeRO-1", "stage 1 shards the optimizer state over the N = data ranks; gradients and parameters stay whole",
        f"plan.params + plan.grads + plan.optimizer_state / data + {_REST}"),
    "ZeRO-2": _remedy_hint(
        "ZeRO-2", "stage 2 shards the gradients as well as the optimizer state over the N = data ranks; only the "
        "parameters stay whole",
        f"plan.params + (plan.grads + plan.optimizer_state) / data + {_REST}"),
    "ZeRO-3": _remedy_hint(
        "ZeRO-3", "stage 3 shards the parameters too: each of the N = data ranks holds 1/N of the whole model state",
        f"({_STATE}) / data + {_REST}"),
    "CPU offload": _remedy_hint(
        "CPU offload", "ZeRO-Offload moves the gradients and the optimizer state to CPU memory; the 16-bit "
        "parameters, the forward and the backward stay on the GPU",
        f"plan.params + {_REST} (oom.offloaded(plan).total)"),
    "selective recompute": _remedy_hint(
        "selective recompute", "the attention core is recomputed in backward instead of kept; offered only where "
        "config.flash is False (flash keeps no core to drop)",
        f'{_PLANNED}replace(config, recompute="selective"), batch_size, data=data).total'),
    "gradient checkpointing": _remedy_hint(
        "gradient checkpointing", "every block keeps only its input and one block is rebuilt at a time in backward: "
        "the planner's checkpointing=True",
        f"{_PLANNED}config, batch_size, data=data, checkpointing=True).total"),
    "gradient accumulation": _remedy_hint(
        "gradient accumulation", "two micro-batches of half the batch per step hold the memory of half the batch; "
        "offered only for an even batch_size (the same samples per step)",
        f"{_PLANNED}config, batch_size // 2, data=data).total, where batch_size is even"),
    "smaller batch": _remedy_hint(
        "smaller batch", "half the micro-batch holds the memory of half the batch, but it changes the training "
        "(fewer samples per update): offered for any batch_size > 1, and ranked last with a smaller model",
        f"{_PLANNED}config, batch_size // 2, data=data).total, where batch_size > 1"),
    "smaller model": _remedy_hint(
        "smaller model", "half the blocks: less model state and fewer activations, but another model, so it ranks "
        "last with a smaller batch; offered where n_layer > 1",
        f"{_PLANNED}replace(config, n_layer=config.n_layer // 2), batch_size, data=data).total"),
}
_RANK_RULE = ("sort by oom.COSTS.index(cost) first; within 'compute' by the FLOPs the remedy adds (gradient "
              "accumulation none, then selective recompute, then gradient checkpointing); otherwise the larger saving "
              "(the fewer bytes after) first; the answer is the first remedy whose bytes after are ≤ budget_bytes")
_MISTAKE_HINTS = {
    "dominant": Hint(
        nudge="look at the first thing you return: the plan's largest component",
        idea="the plan has six components, model state and the rest: params, grads, optimizer_state, activations, "
             "recompute and logits; any of them can dominate",
        formula="parts = plan.breakdown(); dominant = max(parts, key=parts.get)"),
    "bytes after": Hint(
        nudge="look at the third thing you return: the bytes the plan holds after the remedy",
        idea="the answer is the total the GPU holds once the remedy is applied, not what the remedy saves",
        formula="bytes_after = the remedy's plan's total, e.g. (plan.params + plan.grads + plan.optimizer_state) / "
                f"data + {_REST} for ZeRO-3"),
    "ranking": Hint(
        nudge="look at how you order the remedies before taking the first that fits",
        idea="the answer is the cheapest remedy that fits, not the one that saves the most: what a remedy costs "
             "comes first (oom.COSTS), and only within one cost the saving",
        formula=_RANK_RULE),
    "fits": Hint(
        nudge="look at how you decide that a remedy fits the budget",
        idea="a plan fits when it needs no more than the budget: a total equal to the budget fits (Plan.fits)",
        formula="fits = bytes_after <= budget_bytes"),
    "offered": Hint(
        nudge="look at which remedies you offer for this configuration",
        idea="a remedy is offered only where it changes something: flash attention and selective recompute where "
             "config.flash is False, gradient accumulation for an even batch, a smaller batch for batch_size > 1, a "
             "smaller model for n_layer > 1, and none that saves nothing (bytes after ≥ the plan's total)",
        formula="drop a remedy whose conditions do not hold, and any whose bytes after are not below plan.total"),
}


@check("7.2", "diagnose an OOM", hint=Hint(
    nudge="read the message: it names the case (configuration, batch, data ranks, budget) and what differs",
    idea="price every remedy from the plan (ZeRO and offload from its components, the others with planner.plan on "
         "the changed configuration), rank them cheapest first, and take the first whose bytes fit",
    formula=_RANK_RULE))
def fix_oom(fn):
    """`fn(plan, config, batch_size, budget_bytes, data) -> (dominant, remedy, bytes_after)`: see the module
    docstring."""
    rng = fresh_rng()
    for case in _cases(rng):
        _judge(fn, *case)


def _random_config(rng) -> GPTConfig:
    head = rng.choice((1, 2, 3, 4, 6, 8, 12, 16))
    return GPTConfig(n_layer=rng.randint(1, 24), n_head=head, n_embd=head * rng.choice((8, 16, 24, 40, 64, 96, 128)),
                     block_size=rng.choice((17, 63, 128, 255, 511, 1024, 2047)),
                     vocab_size=rng.choice((97, 511, 5003, 50257)), dropout=rng.choice((0.0, 0.1)),
                     bias=rng.random() < 0.5, flash=rng.random() < 0.3)


def _cases(rng) -> list[tuple]:
    """(config, batch_size, data, budget, kind) to ask, in order: generous budgets first (a wrong ranking shows
    there, whatever the bytes), then one tight budget per answerable remedy, one exact, one where none fits."""
    generous, tight, exact, none = {}, {}, [], []
    for _ in range(MAX_CONFIGS):
        config, batch, data = _random_config(rng), rng.randint(1, 16), rng.choice(DATA_RANKS)
        ranked = oom.remedies(config, batch, 1.0, data=data)  # the ranking; the budget only sets .fits
        if not ranked:
            continue
        base = planner.plan(config, batch, data=data).total
        highest = max(r.plan.total for r in ranked)
        # flash=True: ZeRO-2 ranks first and ZeRO-1 next; flash=False: flash attention ranks first
        generous.setdefault(config.flash, (config, batch, data, highest + rng.uniform(0.05, 0.95) * (base - highest),
                                           "generous"))
        above = base  # the fewest bytes of the remedies ranked before this one (and the plan's own)
        for r in ranked:
            if r.plan.total < above and r.name not in tight:
                tight[r.name] = (config, batch, data, r.plan.total + rng.uniform(0.05, 0.95) * (above - r.plan.total),
                                 "tight")
                exact = exact or [(config, batch, data, r.plan.total, "exact")]
            above = min(above, r.plan.total)
        lowest = min(r.plan.total for r in ranked)
        none = none or [(config, batch, data, lowest * rng.uniform(0.3, 0.95), "none")]
        if len(generous) == 2 and all(name in tight for name in ANSWERABLE):
            break
    return [*generous.values(), *tight.values(), *exact, *none]


def _describe(config: GPTConfig, batch: int, data: int, budget: float) -> str:
    return (f"GPTConfig(n_layer={config.n_layer}, n_head={config.n_head}, n_embd={config.n_embd}, "
            f"block_size={config.block_size}, vocab_size={config.vocab_size}, dropout={config.dropout}, "
            f"bias={config.bias}, flash={config.flash}) with batch_size={batch} on data={data} ranks and a budget of "
            f"{budget:.6g} bytes ({oom.binary_size(budget)})")


def _answer(got) -> tuple[str, str | None, float | None]:
    """The learner's answer as (dominant, remedy, bytes_after), or Mismatch saying what is wrong with its form."""
    if not isinstance(got, tuple | list) or len(got) != 3:
        raise Mismatch(f"your function returned {type(got).__name__} {got!r:.80}, expected a tuple (dominant, remedy, "
                       "bytes_after)")
    dominant, remedy, after = got
    if dominant not in COMPONENTS:
        raise Mismatch(f"dominant={dominant!r:.60} is not a component of the plan: one of {', '.join(COMPONENTS)}",
                       mistake="dominant", hint=_MISTAKE_HINTS["dominant"])
    if remedy is not None and remedy not in REMEDIES:
        raise Mismatch(f"remedy={remedy!r:.60} is not one of oom's remedies: {', '.join(REMEDIES)} (or None)")
    if (remedy is None) != (after is None):
        raise Mismatch(f"remedy={remedy!r} with bytes_after={after!r}: both are None when no remedy fits, and neither "
                       "when one does")
    return dominant, remedy, None if after is None else number(after, "bytes_after")


def _judge(fn, config: GPTConfig, batch: int, data: int, budget: float, kind: str) -> None:
    plan = planner.plan(config, batch, data=data)
    where = _describe(config, batch, data, budget)
    dominant, remedy, after = _answer(fn(plan, config, batch, budget, data))
    parts = plan.breakdown()
    largest = max(parts, key=parts.get)
    if dominant != largest:
        raise Mismatch(f"for {where}, the plan's largest component is {largest} ({parts[largest]:.6g} bytes), not "
                       f"{dominant} ({parts[dominant]:.6g})", mistake="dominant", hint=_MISTAKE_HINTS["dominant"])
    ranked = oom.remedies(config, batch, budget, data=data)
    want = next((r for r in ranked if r.fits), None)
    if remedy == (want and want.name):
        if want is not None and not math.isclose(after, want.plan.total, rel_tol=RTOL):
            if math.isclose(after, want.saving, rel_tol=RTOL):
                raise Mismatch(f"for {where}, {remedy} is the answer, but bytes_after={after:.6g} is what it "
                               f"saves; the plan after it holds {want.plan.total:.6g} bytes", mistake="bytes after",
                               hint=_MISTAKE_HINTS["bytes after"])
            raise Mismatch(f"for {where}, {remedy} is the answer, but the plan after it holds {want.plan.total:.6g} "
                           f"bytes, not {after:.6g}", mistake=f"remedy: {remedy}", hint=_HINTS[remedy])
        return
    offered = {r.name: r for r in ranked}
    if remedy is not None and remedy not in offered:
        raise Mismatch(f"for {where}, {remedy} is not a remedy: {_why_not(remedy, config, batch)}", mistake="offered",
                       hint=_MISTAKE_HINTS["offered"])
    if remedy is not None and not offered[remedy].fits:
        raise Mismatch(f"for {where}, {remedy} does not fit: the plan after it holds {offered[remedy].plan.total:.6g} "
                       f"bytes (you said {after:.6g})" + _answer_is(want), mistake=f"remedy: {remedy}",
                       hint=_HINTS[remedy])
    # the learner passed over `want`, which fits and ranks before their answer (or they found nothing that fits)
    yours = f"your {remedy}" if remedy else "your answer, that none fits"
    if kind == "exact":
        raise Mismatch(f"for {where}, {want.name} fits exactly: the plan after it holds {want.plan.total:.6g} bytes, "
                       f"the budget itself, and it ranks before {yours}", mistake="fits", hint=_MISTAKE_HINTS["fits"])
    if kind == "generous" and remedy is not None:
        yours = offered[remedy]
        if yours.cost == want.cost:  # the same cost: the larger saving first (or fewer FLOPs, in 'compute')
            why = (f"both cost {want.cost!r}, and {want.name} " + (
                f"adds fewer FLOPs ({want.extra_flops:.1%} of the step's, against {yours.extra_flops:.1%})"
                if want.extra_flops != yours.extra_flops else
                f"saves more: {want.saving:.6g} bytes, against {yours.saving:.6g}"))
        else:
            why = f"it costs {want.cost!r}, {remedy} costs {yours.cost!r}"
        most = " — yours is the one that saves the most" if yours.saving == max(r.saving for r in ranked) else ""
        raise Mismatch(f"for {where}, every remedy fits, and the first in the ranking is {want.name}, not {remedy}: "
                       f"{why}{most}", mistake="ranking", hint=_MISTAKE_HINTS["ranking"])
    raise Mismatch(f"for {where}, {want.name} fits: the plan after it holds {want.plan.total:.6g} bytes (costs "
                   f"{want.cost!r}), and it ranks before {yours}", mistake=f"remedy: {want.name}",
                   hint=_HINTS[want.name])


def _answer_is(want) -> str:
    return f"; the answer is {want.name}, which leaves {want.plan.total:.6g}" if want else "; no remedy fits"


def _why_not(remedy: str, config: GPTConfig, batch: int) -> str:
    """Why `remedy` is not among oom's remedies for this configuration."""
    if remedy in ("memory-efficient attention", "selective recompute") and config.flash:
        return "the configuration already uses flash attention (config.flash is True)"
    if remedy == "gradient accumulation" and batch % 2:
        return f"batch_size={batch} is odd: it does not split into two equal micro-batches"
    if remedy in ("gradient accumulation", "smaller batch") and batch == 1:
        return "batch_size=1 has no smaller batch"
    if remedy == "smaller model" and config.n_layer == 1:
        return "n_layer=1 has no smaller model"
    return "it saves nothing here (the plan after it holds at least the plan's own total)"
