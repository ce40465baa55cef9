"""Pipeline schedules as data — which action each rank runs, in which order — and their simulated timelines.

p ranks run m micro-batches through a model cut into stages. Each schedule is a list per rank of `Action`s: a
forward "F", a backward "B" and, where the backward is split in two, its weight-gradient half "W".

- "gpipe" (Huang et al. 2019): every forward, then every backward.
- "1f1b" (PipeDream-Flush; Narayanan et al. 2021, §2.2.1): rank s warms up with p-s-1 forwards, then alternates
  one forward and one backward, then cools down with the remaining backwards.
- "interleaved" (Narayanan et al. 2021, §2.2.2): each rank holds v model chunks ("virtual stages"): the model is
  cut into p·v stages and stage c·p + s lives on rank s, as its chunk c. Micro-batches go through the chunks in
  groups of p, 1F1B-fashion, with a longer warm-up (Megatron-LM's order: m must be a multiple of p).
- "zb-h1" (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §3.1, ZB-H1): the backward split into B, the
  gradient of the stage's input (what the stage before waits for), and W, the gradients of its weights (which
  nobody waits for). Rank s runs 1F1B's warm-up, then defers the W of its first s micro-batches and runs them at
  the end, where 1F1B idles waiting for backwards to come back.

The bubble. With equal stages and a forward and a backward of t_f and t_b per micro-batch on a rank, 1F1B's
idle time per rank is the paper's t_pb = (p-1)·(t_f+t_b) against the ideal t_id = m·(t_f+t_b): a bubble of
(p-1)/m *of the ideal time* (Narayanan et al. 2021, §2.2.1). Interleaving divides it by v: (p-1)/(v·m) (§2.2.2),
because each chunk takes 1/v of the rank's time. `bubble_ratio` is that ratio (bubble over ideal); what a timeline
measures (`Timeline.idle`) is the bubble's share of the whole step, bubble / (ideal + bubble):

    bubble_fraction = (p-1) / (v·m + p-1)      ((p-1)/(m+p-1) for GPipe and 1F1B, v = 1)

ZB-H1 leaves (p-1)·(t_F + t_B - t_W) idle per rank (Qi et al. 2023, §3.1; exact for m >= p and t_W <= t_F, t_B),
with t_B + t_W = t_b; at the paper's t_F = t_B = t_W that is (p-1)·t_F, a third of 1F1B's (p-1)·3·t_F
(`zb_h1_bubble_fraction`). `simulate` computes a schedule's timeline from the action times; the tests check these
formulas against it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmlab import validation
from llmlab.timeline import Span, Timeline

__all__ = ["SCHEDULES", "KINDS", "Action", "schedule", "simulate", "run", "bubble_ratio", "bubble_fraction",
           "zb_h1_bubble_fraction", "peak_in_flight"]

SCHEDULES = ("gpipe", "1f1b")  # one stage per rank, the backward in one action: bubble (p-1)/(m+p-1)
KINDS = SCHEDULES + ("interleaved", "zb-h1")


@dataclass(frozen=True)
class Action:
    kind: str  # "F" forward, "B" backward (input gradient only where the schedule has W), "W" weight gradients
    micro_batch: int
    chunk: int = 0  # which of the rank's model chunks: on rank s of p, chunk c is stage c·p + s


def _check(kind, stages, micro_batches, virtual_stages) -> None:
    validation.one_of("kind", kind, KINDS)
    validation.integer("stages", stages, low=1)
    validation.integer("micro_batches", micro_batches, low=1)
    validation.integer("virtual_stages", virtual_stages, low=1)
    if kind == "interleaved":
        if stages < 2:
            raise ValueError(f"stages={stages!r} must be >= 2 for the interleaved schedule (on one rank there is "
                             "nothing to interleave)")
        if virtual_stages < 2:
            raise ValueError(f"virtual_stages={virtual_stages!r} must be >= 2 for the interleaved schedule "
                             "(1 chunk per rank is 1F1B)")
        if micro_batches % stages:
            raise ValueError(f"micro_batches={micro_batches!r} must be a multiple of stages={stages!r} for the "
                             "interleaved schedule (micro-batches go through the chunks in groups of p, as in "
                             "Megatron-LM)")
    elif virtual_stages != 1:
        raise ValueError(f"virtual_stages={virtual_stages!r} must be 1 for kind={kind!r} (only 'interleaved' "
                         "gives a rank several chunks)")


def _one_f_one_b(rank: int, p: int, m: int) -> list[Action]:
    warmup = min(p - rank - 1, m)
    plan = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        plan += [Action("F", warmup + i), Action("B", i)]
    return plan + [Action("B", i) for i in range(m - warmup, m)]  # cool-down


def _interleaved(rank: int, p: int, m: int, v: int) -> list[Action]:
    """Megatron-LM's order: the k-th forward of a rank is micro-batch (k // pv)·p + k % p of chunk (k % pv) // p
    (groups of p micro-batches, chunk by chunk); its k-th backward is the same micro-batch of chunk v-1-that. The
    warm-up, 2·(p-rank-1) + (v-1)·p forwards, fills the pipeline until the first backward can come back."""
    total = m * v

    def nth(k: int, kind: str) -> Action:
        chunk = (k % (p * v)) // p
        return Action(kind, (k // (p * v)) * p + k % p, chunk if kind == "F" else v - 1 - chunk)

    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    plan = [nth(k, "F") for k in range(warmup)]
    for k in range(total - warmup):
        plan += [nth(warmup + k, "F"), nth(k, "B")]
    return plan + [nth(k, "B") for k in range(total - warmup, total)]


def _zb_h1(rank: int, p: int, m: int) -> list[Action]:
    """1F1B with each backward split into B and W; rank s defers the W of its first s micro-batches to the end."""
    plan, f, b, w = [], 0, 0, 0
    for _ in range(min(p - rank - 1, m)):  # warm-up, as 1F1B's
        plan.append(Action("F", f))
        f += 1
    while f < m:  # steady state: F, B, and W once s of them wait
        plan += [Action("F", f), Action("B", b)]
        f, b = f + 1, b + 1
        if b > rank:
            plan.append(Action("W", w))
            w += 1
    while b < m:  # cool-down: B, and W once s of them wait
        plan.append(Action("B", b))
        b += 1
        if b > rank:
            plan.append(Action("W", w))
            w += 1
    return plan + [Action("W", i) for i in range(w, m)]  # the deferred Ws fill what 1F1B left idle


def schedule(kind: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Each rank's actions in the order it runs them (a list per rank of `stages`). `virtual_stages` (v, the
    model chunks per rank) is for "interleaved" only, which needs v >= 2 and micro_batches a multiple of stages."""
    _check(kind, stages, micro_batches, virtual_stages)
    p, m = stages, micro_batches
    if kind == "gpipe":
        return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]
    if kind == "1f1b":
        return [_one_f_one_b(s, p, m) for s in range(p)]
    if kind == "interleaved":
        return [_interleaved(s, p, m, virtual_stages) for s in range(p)]
    return [_zb_h1(s, p, m) for s in range(p)]


def _needs(a: Action, stage: int, last: int) -> list[tuple[int, str, int]]:
    """The (stage, kind, micro-batch) actions that `a`, run on model stage `stage` of 0…`last`, waits for."""
    if a.kind == "F":
        return [(stage - 1, "F", a.micro_batch)] if stage > 0 else []
    if a.kind == "B":
        return [(stage, "F", a.micro_batch)] + ([(stage + 1, "B", a.micro_batch)] if stage < last else [])
    return [(stage, "B", a.micro_batch)]  # W: the weight gradients need the gradient of the stage's output


def simulate(kind: str, stages: int, micro_batches: int, t_forward: float = 1.0, t_backward: float = 2.0,
             virtual_stages: int = 1, t_weight: float | None = None, t_send: float = 0.0) -> Timeline:
    """The timeline of `schedule(kind, …)` (one lane per rank) when a rank takes t_forward for a micro-batch's
    forward and t_backward for its backward: with v chunks, each chunk's takes 1/v of that. For "zb-h1", the
    backward's W takes t_weight of t_backward (default half: the paper's t_F = t_B = t_W at t_backward = 2·t_forward)
    and B the rest.

    An action starts when its rank is free and its inputs are there: F of stage c needs F of stage c-1, B of stage
    c needs F of c and B of c+1, W needs B (the same micro-batch). What comes from another stage arrives t_send after
    it was computed (default 0: instantaneous, as the formulas assume; a real run's messages take some time, which
    interleaving pays v times as often). A schedule that cannot go on raises RuntimeError (none of these does: the
    tests run every size)."""
    validation.positive("t_forward", t_forward)
    validation.positive("t_backward", t_backward)
    validation.number("t_send", t_send, low=0)
    plans = schedule(kind, stages, micro_batches, virtual_stages)
    if t_weight is not None and kind != "zb-h1":
        raise ValueError(f"t_weight={t_weight!r} is for kind='zb-h1' only (the other schedules do not split the "
                         "backward)")
    if kind == "zb-h1":
        t_weight = validation.number("t_weight", t_backward / 2 if t_weight is None else t_weight, above=0,
                                     hint=f"and < t_backward={t_backward!r}")
        if t_weight >= t_backward:
            raise ValueError(f"t_weight={t_weight!r} must be < t_backward={t_backward!r} (B takes the rest)")
    v = virtual_stages
    took = {"F": t_forward / v, "B": (t_backward - (t_weight or 0.0)) / v, "W": (t_weight or 0.0) / v}
    return run(plans, took, v, t_send, name=kind)


def run(plans: list[list[Action]], took: dict[str, float], virtual_stages: int = 1, t_send: float = 0.0,
        name: str = "given") -> Timeline:
    """The timeline of the per-rank action lists `plans` when an action of kind k takes `took[k]`: the loop of
    `simulate`, for any schedule (exercise 2.4 times a learner's 1F1B with it). RuntimeError if it deadlocks."""
    p, v = len(plans), virtual_stages
    done: dict[tuple[int, str, int], float] = {}
    position, free_at, spans = [0] * p, [0.0] * p, []
    while any(position[s] < len(plans[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while position[s] < len(plans[s]):  # run this rank's actions until one waits for another rank
                a = plans[s][position[s]]
                stage = a.chunk * p + s
                need = _needs(a, stage, p * v - 1)
                if not all(n in done for n in need):
                    break
                start = max([free_at[s]] + [done[n] + (t_send if n[0] != stage else 0.0) for n in need])
                done[(stage, a.kind, a.micro_batch)] = free_at[s] = start + took[a.kind]
                spans.append(Span(s, a.kind, a.micro_batch, start, free_at[s]))
                position[s] += 1
                progressed = True
        if not progressed:
            waiting = [plans[s][position[s]] for s in range(p) if position[s] < len(plans[s])]
            raise RuntimeError(f"schedule {name!r} deadlocks: {waiting}")
    return Timeline(tuple(spans), lane_name="stage")


def bubble_ratio(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """(p-1)/(v·m): the bubble over the ideal (bubble-free) time of 1F1B (v = 1) and of interleaved 1F1B with v
    chunks per rank, equal stages (Narayanan et al. 2021, §2.2.1 and §2.2.2)."""
    validation.integer("stages", stages, low=1)
    validation.integer("micro_batches", micro_batches, low=1)
    validation.integer("virtual_stages", virtual_stages, low=1)
    return (stages - 1) / (virtual_stages * micro_batches)


def bubble_fraction(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """(p-1)/(v·m + p-1): the bubble's share of the step, `bubble_ratio` r as r/(1+r); (p-1)/(m+p-1) for GPipe
    and 1F1B (v = 1). This is what `Timeline.idle` measures."""
    r = bubble_ratio(stages, micro_batches, virtual_stages)
    return r / (1 + r)


def zb_h1_bubble_fraction(stages: int, micro_batches: int, t_forward: float = 1.0, t_backward: float = 2.0,
                          t_weight: float | None = None) -> float:
    """ZB-H1's idle share of the step: (p-1)(t_F+t_B-t_W) idle per rank (Qi et al. 2023, §3.1) against the work
    m·(t_F+t_B+t_W), t_B + t_W = t_backward (t_W half of it by default: the paper's t_F = t_B = t_W). It is exact
    (the tests check it against `simulate`) when every rank has its Ws to defer (m >= p) and t_W <= t_F, t_W <= t_B
    (a deferred W fits where 1F1B idles)."""
    validation.integer("stages", stages, low=1)
    validation.integer("micro_batches", micro_batches, low=1)
    validation.positive("t_forward", t_forward)
    validation.positive("t_backward", t_backward)
    t_w = t_backward / 2 if t_weight is None else validation.number("t_weight", t_weight, above=0)
    if t_w >= t_backward:
        raise ValueError(f"t_weight={t_w!r} must be < t_backward={t_backward!r} (B takes the rest)")
    idle = (stages - 1) * (t_forward + t_backward - 2 * t_w)
    return idle / (micro_batches * (t_forward + t_backward) + idle)


def peak_in_flight(timeline: Timeline) -> list[int]:
    """Per lane (rank) of a pipeline's `timeline`: the most micro-batches (of any chunk) whose forward had run but
    not their last backward action (W where the timeline has any, else B): whose activations the rank held at once."""
    release = "W" if "W" in timeline.kinds else "B"
    peaks = []
    for lane in timeline.lanes:
        live = peak = 0
        for s in timeline.on(lane):
            live += 1 if s.kind == "F" else -1 if s.kind == release else 0
            peak = max(peak, live)
        peaks.append(peak)
    return peaks
