"""Check 2.4 (solutions/02_parallelism.ipynb): the 1F1B pipeline schedule and the time of the step it takes.

    from llmlab.checks import ch02 as check
    check.pipeline_1f1b(one_f_one_b, step_time)    # 2.4, against llmlab.parallel.schedules

The learner writes the schedule as data (`one_f_one_b(p, m)`: each rank's list of `Action("F" | "B", i)`) and
the simulation that times any such schedule (`step_time(plans, t_forward, t_backward)`). The check compares the
schedule with `schedules.schedule("1f1b", p, m)` on p = 1 … 8 ranks and m = 1 … 16 micro-batches (m < p
included), and the time — given llmlab's GPipe and 1F1B schedules, so that a wrong schedule does not hide a wrong
simulation — with the end of `schedules.run`'s timeline, at random forward and backward times.
"""

from __future__ import annotations

import math

from llmlab.checks import Hint, Mismatch, check, fresh_rng, number
from llmlab.parallel import schedules
from llmlab.parallel.schedules import Action

__all__ = ["pipeline_1f1b"]

_FORMULA = ("rank r of p warms up with w = min(p − r − 1, m) forwards F0 … F(w−1); then, for i = 0 … m − w − 1, "
            "F(w + i) and B(i); then it cools down with B(m − w) … B(m − 1). Time: run each rank's actions in order; "
            "an action starts when its rank is free and its inputs are done — F(i) on rank r needs F(i) on r − 1, "
            "B(i) on rank r needs F(i) on r and B(i) on r + 1 — and ends t_forward or t_backward later; the step "
            "ends when the last action does")
_HINTS = {
    "warm-up": Hint(
        nudge="count the forwards each rank runs before its first backward: how many micro-batches must be in "
              "flight below it before a gradient can come back?",
        idea="the first backward on rank r can start only once micro-batch 0 has gone through the ranks after it "
             "and back, so rank r first runs one forward for each rank after it (all m, if m is fewer)",
        formula=_FORMULA),
    "gpipe": Hint(
        nudge="your schedule runs every forward before any backward: that is GPipe's order, not 1F1B's",
        idea="1F1B starts the backwards early: after its warm-up forwards a rank alternates one forward and one "
             "backward, so it keeps at most p − r micro-batches' activations, not m",
        formula=_FORMULA),
    "waits": Hint(
        nudge="look at when an action may start in your simulation: only when its rank is free, or also when the "
              "actions it needs on the neighbouring ranks are done?",
        idea="a forward needs the same micro-batch's forward on the rank before; a backward needs its own forward "
             "and the backward on the rank after; an action starts at the latest of those and of its rank's last end",
        formula=_FORMULA),
}


def _as_actions(plan, what: str) -> list[Action]:
    if not isinstance(plan, list | tuple):
        raise Mismatch(f"{what}: got {type(plan).__name__}, expected a list of Action")
    actions = []
    for a in plan:
        if isinstance(a, tuple) and not isinstance(a, Action) and len(a) == 2:
            a = Action(*a)  # ("F", 0) reads as Action("F", 0)
        if not (isinstance(a, Action) and a.kind in ("F", "B") and a.chunk == 0):
            raise Mismatch(f"{what}: holds {a!r:.60}, expected Action('F' or 'B', micro_batch)")
        actions.append(a)
    return actions


def _order(a: Action) -> tuple[str, int]:
    return a.kind, a.micro_batch


def _check_schedule(one_f_one_b, p: int, m: int) -> None:
    got, want = one_f_one_b(p, m), schedules.schedule("1f1b", p, m)
    what = f"one_f_one_b(p={p}, m={m})"
    if not isinstance(got, list | tuple) or len(got) != p:
        raise Mismatch(f"{what}: got {type(got).__name__} of length {len(got) if hasattr(got, '__len__') else '?'}, "
                       f"expected a list of {p} plans, one per rank")
    for rank in range(p):
        plan, where = _as_actions(got[rank], f"{what}, rank {rank}'s plan"), f"{what}, rank {rank}"
        if plan == want[rank]:
            continue
        if sorted(plan, key=_order) != sorted(want[rank], key=_order):
            raise Mismatch(f"{where}: runs {len(plan)} actions; every rank runs each forward F0 … F{m - 1} and each "
                           f"backward B0 … B{m - 1} once ({2 * m} actions)")
        before = next((i for i, a in enumerate(plan) if a.kind == "B"), len(plan))  # forwards before a backward
        warmup = min(p - rank - 1, m)
        expected = min(p - rank, m)  # the warm-up's forwards, then the steady state's first forward (if any is left)
        if plan == schedules.schedule("gpipe", p, m)[rank]:
            raise Mismatch(f"{where}: every forward before any backward (GPipe's order); 1F1B warms up with "
                           f"{warmup} forwards on this rank", mistake="gpipe", hint=_HINTS["gpipe"])
        if before != expected:
            raise Mismatch(f"{where}: {before} forwards before its first backward, expected min(p − r, m) = "
                           f"{expected}: a warm-up of min(p − r − 1, m) = {warmup}, then the steady state's first "
                           "forward", mistake="warm-up", hint=_HINTS["warm-up"])
        first = next(i for i, (a, b) in enumerate(zip(plan, want[rank], strict=True)) if a != b)
        raise Mismatch(f"{where}: action {first} is {plan[first].kind}{plan[first].micro_batch}, 1F1B runs "
                       f"{want[rank][first].kind}{want[rank][first].micro_batch} there (after the warm-up: one "
                       "forward, one backward, in micro-batch order)")


def _check_time(step_time, kind: str, p: int, m: int, t_f: float, t_b: float) -> None:
    plans = schedules.schedule(kind, p, m)
    want = schedules.run(plans, {"F": t_f, "B": t_b}).end
    what = f"step_time(schedule {kind!r} on p={p} ranks, m={m}, t_forward={t_f:.4g}, t_backward={t_b:.4g})"
    got = number(step_time([list(plan) for plan in plans], t_f, t_b), what)
    # a sum of at most 2m + 2p durations, each rounded once in float64: 1e-9 relative leaves room to spare
    if math.isclose(got, want, rel_tol=1e-9):
        return
    alone = m * (t_f + t_b)  # a rank's own work, never waiting for another rank
    if math.isclose(got, alone, rel_tol=1e-9) and not math.isclose(alone, want, rel_tol=1e-9):
        raise Mismatch(f"{what}: got {got:.6g} = m·(t_forward + t_backward), one rank's work with no waiting; the "
                       f"step takes {want:.6g}", mistake="waits", hint=_HINTS["waits"])
    raise Mismatch(f"{what}: got {got:.6g}, expected {want:.6g} (the end of the last action)",
                   mistake="waits", hint=_HINTS["waits"])


@check("2.4", "the 1F1B schedule and the step it takes", hint=Hint(
    nudge="compare your schedule's first rank with the last: how many forwards does each run before its first "
          "backward, and in your simulation when may each action start?",
    idea="1F1B keeps each rank's in-flight micro-batches few: a warm-up of forwards, then one forward and one "
         "backward in turn, then the last backwards; the simulation starts an action once its rank and its inputs "
         "from the neighbouring ranks are ready",
    formula=_FORMULA))
def pipeline_1f1b(one_f_one_b, step_time):
    """`one_f_one_b(p, m)` → each rank's list of Action; `step_time(plans, t_forward, t_backward)` → the step's
    length (when the last action ends)."""
    rng = fresh_rng()
    sizes = [(1, 1), (1, 3), (2, 1), (3, 3), (4, 2), (8, 3),
             *((rng.randint(2, 8), rng.randint(1, 16)) for _ in range(6))]
    for p, m in sizes:
        _check_schedule(one_f_one_b, p, m)
    for kind, (p, m) in [("1f1b", (4, 8)), ("gpipe", (3, 5)), ("1f1b", (1, 4)),
                         *(("1f1b", (rng.randint(2, 6), rng.randint(1, 12))) for _ in range(3))]:
        t_f = rng.uniform(0.5, 2.0)
        _check_time(step_time, kind, p, m, t_f, t_f * rng.uniform(1.0, 3.0))
