"""Check 2.6 (solutions/02_parallelism.ipynb): Megatron-LM's interleaved 1F1B schedule, v model chunks per rank.

    from llmlab.checks import ch02 as check
    check.interleaved_1f1b(interleaved_1f1b)    # 2.6, against llmlab.parallel.schedules

The learner writes the schedule as data: `interleaved_1f1b(p, v, m)` → each rank's list of `Action("F" | "B", i,
c)`, the forward or backward of micro-batch i on the rank's chunk c, which is model stage c·p + r on rank r. On
fresh sizes — p = 1 … 6 ranks, v = 1 … 4 chunks (v = 1 is plain 1F1B; p = 1 only with it, as llmlab's and
Megatron's interleaved schedule needs p ≥ 2), m a multiple of p — the check first runs any answer in llmlab's
simulator (`schedules.run`) at random forward and backward times: every rank must run each (chunk, micro-batch)
forward and backward once, the schedule must not deadlock (an action starts only once what it needs has run) and
its bubble must be (p − 1)/(v·m + p − 1) of the step ((p − 1)/(v·m) of the ideal time). Then it compares the
schedule action by action with `schedules.schedule("interleaved", p, m, v)` ("1f1b" at v = 1), naming the mistake
where it recognises one. With v ≥ 2 and m not a multiple of p the answer must raise ValueError, as llmlab's does.
"""

from __future__ import annotations

import math
from collections import Counter

from llmlab.checks import Hint, Mismatch, check, fresh_rng
from llmlab.parallel import schedules
from llmlab.parallel.schedules import Action

__all__ = ["interleaved_1f1b"]

_FORMULA = ("rank r's k-th forward is micro-batch (k // pv)·p + k mod p of chunk (k mod pv) // p; its k-th backward "
            "is the same micro-batch of chunk v − 1 − (k mod pv) // p. It warms up with w = min((p − r − 1)·2 + "
            "(v − 1)·p, v·m) forwards (p − r − 1 at v = 1: plain 1F1B), then runs forward w + k and backward k for "
            "k = 0 … v·m − w − 1, then the backwards still owed; with v ≥ 2 and m not a multiple of p it raises "
            "ValueError")
_HINTS = {
    "chunk order": Hint(
        nudge="list your forwards on one rank: which micro-batch and chunk come second, and where does chunk 1 of "
              "rank 0 get its input from?",
        idea="chunk c of rank r is stage c·p + r, so chunk 1 of rank 0 follows chunk 0 of the last rank: a rank "
             "sends a group of p micro-batches through chunk 0, then the same group through chunk 1, …, then the "
             "next group — not one micro-batch through all of its chunks",
        formula=_FORMULA),
    "backward order": Hint(
        nudge="which chunk does a micro-batch's first backward run on: the chunk its forward ran first, or last?",
        idea="the gradient comes back from the last stage: the backwards visit the chunks in reverse, so the k-th "
             "backward is the k-th forward's micro-batch on chunk v − 1 − c instead of c",
        formula=_FORMULA),
    "warm-up": Hint(
        nudge="count the forwards each rank runs before its first backward: how many are in flight before the "
              "first gradient, chunk v − 1's, can come back?",
        idea="the last rank's first backward needs micro-batch 0 through all v chunks: (v − 1)·p forwards first; "
             "each rank before it runs 2 more per rank after it, Megatron's (p − r − 1)·2; with one chunk (v = 1) "
             "the schedule is plain 1F1B, whose warm-up is p − r − 1",
        formula=_FORMULA),
    "ignores v": Hint(
        nudge="count one rank's actions: how many forwards does a rank holding v chunks run in a step?",
        idea="each chunk is a stage of its own: a rank runs every micro-batch through each of its v chunks, forward "
             "and backward, 2·v·m actions, each an Action(kind, micro_batch, chunk)",
        formula=_FORMULA),
    "multiple": Hint(
        nudge="what does your function do when v ≥ 2 and m is not a multiple of p?",
        idea="the interleaved order sends micro-batches through each chunk in groups of p, so Megatron-LM and "
             "llmlab refuse an m that p does not divide",
        formula="with v ≥ 2 and m % p != 0, raise ValueError (saying m must be a multiple of p)"),
}


def _reference(p: int, v: int, m: int) -> list[list[Action]]:
    return schedules.schedule("1f1b", p, m) if v == 1 else schedules.schedule("interleaved", p, m, v)


def _name(a: Action) -> str:
    return f"{a.kind}(micro-batch {a.micro_batch}, chunk {a.chunk})"


def _as_actions(plan, what: str) -> list[Action]:
    if not isinstance(plan, list | tuple):
        raise Mismatch(f"{what}: got {type(plan).__name__}, expected a list of Action")
    actions = []
    for a in plan:
        if isinstance(a, tuple) and not isinstance(a, Action) and len(a) in (2, 3):
            a = Action(*a)  # ("F", 0, 1) reads as Action("F", 0, 1)
        if not (isinstance(a, Action) and a.kind in ("F", "B") and isinstance(a.micro_batch, int)
                and isinstance(a.chunk, int)):
            raise Mismatch(f"{what}: holds {a!r:.60}, expected Action('F' or 'B', micro_batch, chunk)")
        actions.append(a)
    return actions


def _plans(answer, p: int, v: int, m: int, what: str) -> list[list[Action]]:
    if not isinstance(answer, list | tuple) or len(answer) != p:
        size = len(answer) if hasattr(answer, "__len__") else "?"
        raise Mismatch(f"{what}: got {type(answer).__name__} of length {size}, expected a list of {p} plans, one "
                       "per rank")
    return [_as_actions(plan, f"{what}, rank {rank}'s plan") for rank, plan in enumerate(answer)]


def _runs_each_once(plan: list[Action], want: list[Action], v: int, m: int, where: str) -> None:
    got, expected = Counter(plan), Counter(want)
    if got == expected:
        return
    if v > 1 and {a.chunk for a in plan} == {0} and set(plan) == {Action(k, i) for k in "FB" for i in range(m)}:
        raise Mismatch(f"{where}: runs {len(plan)} actions, each micro-batch's forward and backward on chunk 0 "
                       f"only, as plain 1F1B; with v = {v} chunks per rank it runs each (chunk, micro-batch) forward "
                       f"and backward once: 2·v·m = {len(want)} actions", mistake="ignores v", hint=_HINTS["ignores v"])
    extra, missing = got - expected, expected - got
    if extra:
        a = next(iter(extra))
        twice = a in expected
        raise Mismatch(f"{where}: runs {_name(a)} {'more than once' if twice else 'which does not exist'}; each "
                       f"rank runs every forward and backward of chunks 0 … {v - 1} and micro-batches 0 … {m - 1} "
                       f"once ({len(want)} actions)")
    raise Mismatch(f"{where}: never runs {_name(next(iter(missing)))}; each rank runs every forward and backward of "
                   f"chunks 0 … {v - 1} and micro-batches 0 … {m - 1} once ({len(want)} actions)")


def _simulation(plans: list[list[Action]], p: int, v: int, m: int, t_f: float, t_b: float) -> str:
    """What llmlab's simulator says of `plans`: '' when its bubble is interleaved 1F1B's, else why not."""
    try:
        timeline = schedules.run(plans, {"F": t_f / v, "B": t_b / v}, v, name="yours")
    except RuntimeError:
        return "it deadlocks in llmlab's simulator (every rank waits for an action another rank has not run)"
    want = schedules.bubble_fraction(p, m, v)
    # the step's end is a float sum of ≤ 2·v·m + 2·p action times, ~1e-14 relative; the formula holds exactly
    # at any t_forward and t_backward (tests/test_parallel_schedules.py)
    if math.isclose(timeline.idle, want, rel_tol=1e-9, abs_tol=1e-12):
        return ""
    return (f"its bubble in llmlab's simulator is {timeline.idle:.4f} of the step, interleaved 1F1B's is "
            f"(p − 1)/(v·m + p − 1) = {want:.4f}")


def _leading(plan: list[Action]) -> int:
    """The forwards before the first backward: the warm-up w and, where w < v·m, the steady state's first forward."""
    return next((i for i, a in enumerate(plan) if a.kind == "B"), len(plan))


def _diagnosis(plan: list[Action], want: list[Action], rank: int, p: int, v: int, m: int) -> tuple[str, str | None]:
    """Why rank `rank`'s `plan`, which runs the right actions, is not Megatron's order: (what, mistake key)."""
    forwards = [(a.micro_batch, a.chunk) for a in plan if a.kind == "F"]
    backwards = [(a.micro_batch, a.chunk) for a in plan if a.kind == "B"]
    want_forwards = [(a.micro_batch, a.chunk) for a in want if a.kind == "F"]
    want_backwards = [(a.micro_batch, a.chunk) for a in want if a.kind == "B"]
    if v > 1 and backwards == forwards:
        return ("its backwards run the chunks in the forwards' order (a micro-batch's chunk 0 first); the gradient "
                "comes back from the last stage, so they run the chunks in reverse", "backward order")
    if forwards != want_forwards:
        if forwards == [(k // v, k % v) for k in range(v * m)]:
            return ("each micro-batch runs through all of the rank's chunks before the next starts: that is the "
                    "order of a rank holding v consecutive stages (rank-major, stage r·v + c); here chunk c of rank "
                    "r is stage c·p + r (chunk-major), so micro-batches go through each chunk in groups of p",
                    "chunk order")
        k = next(k for k, (a, b) in enumerate(zip(forwards, want_forwards, strict=True)) if a != b)
        return (f"its forward {k} is {_name(Action('F', *forwards[k]))}, Megatron's order runs "
                f"{_name(Action('F', *want_forwards[k]))} there (micro-batches in groups of p, chunk by chunk)",
                "chunk order")
    if backwards != want_backwards:
        k = next(k for k, (a, b) in enumerate(zip(backwards, want_backwards, strict=True)) if a != b)
        return (f"its backward {k} is {_name(Action('B', *backwards[k]))}, Megatron's order runs "
                f"{_name(Action('B', *want_backwards[k]))} there (the k-th forward's micro-batch, chunks reversed)",
                "backward order")
    leading, expected = _leading(plan), _leading(want)
    if leading != expected:
        total = v * m
        w = min(p - rank - 1 if v == 1 else (p - rank - 1) * 2 + (v - 1) * p, total)
        then = ", then the steady state's first forward" if w < total else ""
        if v == 1:
            return (f"{leading} forwards before its first backward, plain 1F1B's {expected}: with one chunk per rank "
                    f"the schedule is plain 1F1B, whose warm-up is min(p − r − 1, m) = {w} forwards{then} (Megatron "
                    "runs its non-interleaved schedule then)", "warm-up")
        plain = min(p - rank - 1, total)
        ignores = " (plain 1F1B's warm-up, which ignores v)" if leading == plain + (plain < total) else ""
        return (f"{leading} forwards before its first backward{ignores}, Megatron's order runs {expected}: a warm-up "
                f"of min((p − r − 1)·2 + (v − 1)·p, v·m) = {w} forwards{then}", "warm-up")
    i = next(i for i, (a, b) in enumerate(zip(plan, want, strict=True)) if a != b)
    return (f"its action {i} is {_name(plan[i])}, Megatron's order runs {_name(want[i])} there (after the warm-up: "
            "one forward, then one backward)", None)


def _check_schedule(interleaved_1f1b, p: int, v: int, m: int, t_f: float, t_b: float) -> None:
    what = f"interleaved_1f1b(p={p}, v={v}, m={m})"
    plans, want = _plans(interleaved_1f1b(p, v, m), p, v, m, what), _reference(p, v, m)
    for rank in range(p):
        _runs_each_once(plans[rank], want[rank], v, m, f"{what}, rank {rank}")
    simulated = _simulation(plans, p, v, m, t_f, t_b)
    rank = next((rank for rank in range(p) if plans[rank] != want[rank]), None)
    if rank is None:
        if simulated:  # cannot happen while llmlab's schedule is right: tests/test_parallel_schedules.py
            raise Mismatch(f"{what}: llmlab's own schedule fails: {simulated}")
        return
    text, mistake = _diagnosis(plans[rank], want[rank], rank, p, v, m)
    sentence = f"; {simulated}" if simulated else ""
    raise Mismatch(f"{what}, rank {rank}: {text}{sentence}", mistake=mistake, hint=_HINTS.get(mistake))


def _check_refuses(interleaved_1f1b, p: int, v: int, m: int) -> None:
    what = f"interleaved_1f1b(p={p}, v={v}, m={m})"
    try:
        interleaved_1f1b(p, v, m)
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as e:
        raise Mismatch(f"{what}: raised {type(e).__name__}: {e}; with m not a multiple of p it must raise "
                       "ValueError", mistake="multiple", hint=_HINTS["multiple"]) from None
    raise Mismatch(f"{what}: returned a schedule; m = {m} is not a multiple of p = {p}, which the interleaved order "
                   "needs (groups of p micro-batches per chunk): raise ValueError, as llmlab's does",
                   mistake="multiple", hint=_HINTS["multiple"])


@check("2.6", "the interleaved 1F1B schedule", hint=Hint(
    nudge="compare your rank 0 with llmlab's schedules.schedule('interleaved', 2, 4, 2)[0]: in what order come the "
          "chunks and micro-batches, and how many forwards run before the first backward?",
    idea="micro-batches go through a rank's chunks in groups of p — p forwards on chunk 0, the same p on chunk 1, "
         "…, then the next group; the backwards come in the same order with the chunks reversed; the warm-up fills "
         "the pipeline until the first backward (chunk v − 1's) can come back",
    formula=_FORMULA))
def interleaved_1f1b(interleaved_1f1b):
    """`interleaved_1f1b(p, v, m)` → each rank's list of Action(kind, micro_batch, chunk), Megatron-LM's order."""
    rng = fresh_rng()
    sizes = [(1, 1, 1), (1, 1, 4), (3, 1, 6), (2, 2, 2), (2, 2, 4), (3, 2, 3), (4, 2, 8), (4, 3, 4), (2, 4, 6),
             *((p, 1, p * rng.randint(1, 4)) for p in (rng.randint(2, 6),)),
             *((p, rng.randint(2, 4), p * rng.randint(1, 4)) for p in (rng.randint(2, 6) for _ in range(5)))]
    for p, v, m in sizes:
        t_f = rng.uniform(0.5, 2.0)
        _check_schedule(interleaved_1f1b, p, v, m, t_f, t_f * rng.uniform(1.0, 3.0))
    p = rng.randint(2, 6)
    _check_refuses(interleaved_1f1b, p, rng.randint(2, 4), p * rng.randint(1, 3) + rng.randint(1, p - 1))
