"""Check 6.1 (re-exported by llmlab.checks.ch06): warmup and cosine decay as a PyTorch LR scheduler.

    from llmlab.checks import ch06 as check
    check.warmup_cosine(WarmupCosine)    # 6.1

The learner's class is a `torch.optim.lr_scheduler.LRScheduler`: `WarmupCosine(optimizer, warmup, total,
min_lr_ratio=0.0, last_epoch=-1)`, whose `get_lr()` gives every param group the LR of update `last_epoch` from
that group's own base LR (`self.base_lrs`): llmlab's `warmup_cosine_lr(last_epoch, base, warmup, total,
min_lr_ratio·base)`, or the same with the ramp from LR 0 at update 0 (base·step/warmup: the material's formula and
Hugging Face's `get_linear_schedule_with_warmup`), either start held through a run.

Every call drives a plain SGD over 1–3 param groups of different LRs (no gradients: only the LRs are read) through
each run of `_runs`: the usual shape first (two groups), then the edge cases — no warmup, warmup = total − 1 (nothing
left to decay over), warmup = total, min_lr_ratio 0 and 1 — and fresh random ones. It reads every group's lr as the
optimizer would take it, at update 0 (the scheduler's __init__ has stepped once) and after each
`optimizer.step(); scheduler.step()`, up to three updates past the end of the run, and compares it with the
reference. Then it resumes the run at a random update k both ways torch's schedulers resume, and each must go on as
the uninterrupted run did: a fresh scheduler that loads the `state_dict()` saved at k (through torch.save, as a
checkpoint holds it) after its optimizer loaded its own, and a fresh one built with `last_epoch=k − 1` on an
optimizer that loaded its state. Last, each bad argument (a negative warmup, total < 1, warmup > total, a warmup
or a total that is a float, min_lr_ratio outside [0, 1]) must raise a ValueError naming it.

It names a schedule one update late (LR 0 at update 0, then the cosine started and ended one update late: last_epoch
− 1) or one early (`_step_count`, which is last_epoch + 1), a ramp one update past warmup, a decay to 0 instead of
min_lr_ratio·base, a cosine spread over the whole run, a decay one update too long (over total − warmup, as Hugging
Face's cosine schedules), the LR rising again after the end, every group given group 0's LR, the base read from
group["lr"] (the schedule compounding), a schedule that restarts when resumed (a counter of its own, not
last_epoch), a state_dict torch.save cannot pickle, a division by zero where no decay span is left, and an argument
accepted, or refused with another error than a ValueError naming it.
"""

from __future__ import annotations

import io
import math
import random
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LRScheduler

from llmlab.checks import Hint, Mismatch, check, fresh_rng, number
from llmlab.train.schedule import warmup_cosine_lr

__all__ = ["warmup_cosine"]

# An LR computed in float32 (a torch.tensor, a NumPy float32) is right: float32's eps is 2⁻²³ ≈ 1.19e-7, and the
# formula takes about six rounded operations (a division, π·progress, cos, 1 + cos, a product, a sum), each off by
# ≤ eps/2 of a term no larger than the base LR, so ≤ 3.6e-7 of it in all; 1e-6 (of the LR, or of the base near a
# floor of 0, where 1 + cos cancels) is ~3× that. Every named mistake differs by far more at some update of the first
# run (10 warmup updates of 100, a floor of 0.05, spans < 300 updates): ≥ 1/40 of the base on the ramp, the floor
# itself for a decay to 0, ≥ 1e-3 of the base mid-decay for a decay one update too long or over the whole run, and
# ≥ 1e-4 of it three updates past the end for an LR rising again; tests/test_checks_ch06.py measures each.
_TOL = 1e-6


@dataclass(frozen=True)
class _Run:
    warmup: int
    total: int
    ratio: float  # min_lr_ratio
    lrs: tuple[float, ...]  # each param group's base LR
    resume: int  # the update the run is resumed at, 1 … total + 2

    def __str__(self) -> str:
        lrs = ", ".join(f"{lr:.3g}" for lr in self.lrs)
        return (f"WarmupCosine(optimizer, warmup={self.warmup}, total={self.total}, min_lr_ratio={self.ratio:.3g}) "
                f"on param groups of lr {lrs}")


def _runs(rng: random.Random) -> list[_Run]:
    """The usual shape (two groups: a group slip shows at once), the edge cases, then fresh random runs."""

    def lrs(n: int) -> tuple[float, ...]:
        return tuple(10 ** rng.uniform(-5, -2) for _ in range(n))

    shapes = [(10, 100, 0.05, 2),  # warmup, then a cosine to a floor
              (0, 50, 0.1, 1),  # no warmup: the cosine starts at update 0
              (9, 10, 0.1, 2),  # warmup = total − 1: no decay span, the one update after warmup is at the floor
              (20, 20, 0.1, 1),  # warmup = total: the run never decays; the floor after it
              (5, 40, 0.0, 3),  # min_lr_ratio = 0
              (1, 30, 1.0, 2)]  # min_lr_ratio = 1: constant after a one-update warmup
    for _ in range(3):
        warmup = rng.randint(1, 40)
        shapes.append((warmup, warmup + rng.randint(2, 200), rng.uniform(0.01, 0.3), rng.randint(1, 3)))
    return [_Run(w, t, r, lrs(n), rng.randint(1, t + 2)) for w, t, r, n in shapes]


def _want(run: _Run, step: int, base: float, from_zero: bool) -> float:
    """The reference: the LR of update `step` for a group of base LR `base` (the ramp from 0 if `from_zero`)."""
    if from_zero and step < run.warmup:
        return base * step / run.warmup
    return warmup_cosine_lr(step, base, run.warmup, run.total, run.ratio * base)


def _cosine(base: float, floor: float, progress: float) -> float:
    return floor + (base - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _mistakes(run: _Run, step: int, base: float, previous: float | None, from_zero: bool):
    """(the mistake's key, the LR it gives group `base` at update `step`, what it is) where it differs from the
    reference at all; `previous` is the group's LR at the update before."""

    w, t, s, floor = run.warmup, run.total, step, run.ratio * base
    span = t - 1 - w
    if s >= w and span <= 0:  # a guard that leaves progress below 1 where no update is left to decay over
        for progress in (min((s - w) / max(1, span), 1.0), *((min((s - w) / span, 1.0),) if span else ())):
            yield ("no span guarded", _cosine(base, floor, progress),
                   f"no update is left to decay over (total − 1 − warmup = {span}), and the definition sets "
                   "progress = 1 then, so every update from warmup on is at the floor; a guard such as max(1, total "
                   "− 1 − warmup), or a negative span divided by, leaves progress below 1: test span ≤ 0 and set "
                   "progress = 1")
    if s >= 1:
        yield ("one late", warmup_cosine_lr(s - 1, base, w, t, floor),
               "the schedule runs one update late — LR 0 at update 0 and the cosine started (and ended) one update "
               "after warmup: last_epoch is already 0 when the optimizer takes update 0 (LRScheduler's __init__ "
               "calls step() once), so update last_epoch is the one about to be taken; do not subtract 1")
    yield ("one early", warmup_cosine_lr(s + 1, base, w, t, floor),
           "the schedule runs one update early: the LR of update last_epoch + 1 (self._step_count counts the "
           "__init__'s step too); update last_epoch is the one about to be taken")
    if s == w > 0:
        yield ("ramp too long", base * (s + 1) / w,
               "the ramp runs one update too long: update warmup is above the base LR (base·(warmup + 1)/warmup); "
               "the ramp is updates 0 … warmup − 1 (step < warmup), and update warmup starts the cosine at the base")
    if s >= w and floor > 0:
        yield ("decay to 0", warmup_cosine_lr(s, base, w, t, 0.0),
               "the LR decays to 0, not to the floor min_lr_ratio·base: lr = floor + (base − floor)·½(1 + "
               "cos(π·progress))")
    for done, span in ((s - w, t - 1), (s - w, t), (s, t - 1), (s, t)):
        if s >= w and span > 0:
            yield ("cosine over total", _cosine(base, floor, min(done / span, 1.0)),
                   "the cosine is spread over the whole run (divided by total): it runs over the updates after "
                   "warmup only, so progress = (step − warmup)/(total − 1 − warmup)")
    if w <= s < t:
        yield ("decay too long", _cosine(base, floor, min((s - w) / (t - w), 1.0)),
               "the decay is one update too long, so the last update (total − 1) ends above the floor: it spans "
               "updates warmup … total − 1, so divide by total − 1 − warmup (Hugging Face's cosine schedules divide "
               "by total − warmup and reach the floor one update after the run)")
    if s >= t > w + 1:
        yield ("no clamp", _cosine(base, floor, (s - w) / (t - 1 - w)),
               "after the last update the LR rises again along the cosine: clamp progress at 1, so the LR stays at "
               "the floor")
    if previous is not None:
        yield ("compounded", _want(run, s, previous, from_zero),
               "this is the schedule applied to the group's LR of the update before, group['lr'], which the "
               "scheduler has already set: compute each LR from the group's base LR, self.base_lrs[i]")


def _group_slip(run: _Run, step: int, group: int, got: float, from_zero: bool) -> bool:
    return group > 0 and math.isclose(got, _want(run, step, run.lrs[0], from_zero), rel_tol=_TOL,
                                      abs_tol=_TOL * run.lrs[0])


_FORMULA = ("__init__: raise ValueError naming a bad argument (warmup an int ≥ 0, total an int ≥ 1, warmup ≤ total, "
            "0 ≤ min_lr_ratio ≤ 1), store them, then super().__init__(optimizer, last_epoch); get_lr: s = "
            "self.last_epoch, and for each base in self.base_lrs, floor = min_lr_ratio·base; for s < warmup "
            "base·(s + 1)/warmup (or base·s/warmup); else span = total − 1 − warmup, progress = min((s − warmup)/span, "
            "1) (1 when span ≤ 0) and floor + (base − floor)·½(1 + cos(π·progress))")
_STEP = Hint(
    nudge="look at which update your get_lr computes the LR of, and where your ramp ends",
    idea="LRScheduler's __init__ calls step() once, so last_epoch is 0 when the optimizer takes update 0, and each "
         "scheduler.step() after an optimizer.step() adds 1: get_lr returns the LRs of update last_epoch; the ramp "
         "covers updates 0 … warmup − 1, and the cosine starts at the base LR at update warmup",
    formula=_FORMULA)
_DECAY = Hint(
    nudge="look at progress, the fraction of the decay done: where it starts, where it reaches 1, what it does after "
          "the run, and what the cosine ends at",
    idea="progress is 0 at update warmup and 1 at the last update, total − 1, and stays 1 after it; the cosine takes "
         "the LR from the base down to min_lr_ratio·base, not to 0",
    formula=_FORMULA)
_NO_SPAN = Hint(
    nudge="look at what your decay does when no update is left to decay over, total − 1 − warmup ≤ 0",
    idea="with no decay span there is nothing to divide by: the decay counts as done, so test the span before "
         "dividing and take progress = 1, which puts the LR at the floor",
    formula=_FORMULA)
_GROUPS = Hint(
    nudge="look at which base LR each param group's LR is computed from",
    idea="self.base_lrs holds each group's LR from before the schedule (LRScheduler reads it from the group's "
         "'initial_lr'), in the order of optimizer.param_groups; group['lr'] holds the last update's, already "
         "scheduled: group i's LR comes from base_lrs[i] alone",
    formula=_FORMULA)
_RESUME = Hint(
    nudge="look at where your scheduler keeps its place in the run, and whether a checkpoint can hold it",
    idea="a resumed run builds a fresh scheduler, then loads the state_dict() saved in the checkpoint (every "
         "attribute but the optimizer, pickled by torch.save) or passes last_epoch; torch keeps the place in "
         "last_epoch, so compute the LR from it, not from a counter of your own, and keep plain values (numbers, "
         "lists) as attributes, no lambda or generator",
    formula=_FORMULA)
_ARGS = Hint(
    nudge="look at what your __init__ does with an argument that makes no schedule",
    idea="check each argument before super().__init__ and raise ValueError with its name and value, e.g. "
         "ValueError(f'warmup={warmup} must be an int >= 0'); warmup = 0, warmup = total, and min_lr_ratio 0 or 1 "
         "are valid",
    formula=_FORMULA)
_HINTS = {"one late": _STEP, "one early": _STEP, "ramp too long": _STEP, "decay to 0": _DECAY,
          "cosine over total": _DECAY, "decay too long": _DECAY, "no clamp": _DECAY, "no span guarded": _NO_SPAN,
          "no span divided": _NO_SPAN, "group 0": _GROUPS, "compounded": _GROUPS, "not resumable": _RESUME,
          "not saveable": _RESUME, "valid refused": _ARGS, "not refused": _ARGS, "not ValueError": _ARGS,
          "unnamed": _ARGS}


def _optimizer(run: _Run) -> torch.optim.SGD:
    """SGD over one 1-element parameter per group, at the group's base LR (no gradients: a step moves nothing)."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in run.lrs]
    return torch.optim.SGD(groups, lr=run.lrs[0])


def _build(cls, optimizer, run: _Run, how: str, **extra) -> LRScheduler:
    try:
        scheduler = cls(optimizer, warmup=run.warmup, total=run.total, min_lr_ratio=run.ratio, **extra)
    except ValueError as e:
        raise Mismatch(f"{how}: raised ValueError ({e}), but these arguments make a schedule: warmup may be 0 (no "
                       "warmup) or total (all warmup), min_lr_ratio 0 (a decay to 0) or 1 (none)",
                       mistake="valid refused", hint=_ARGS) from None
    if not isinstance(scheduler, LRScheduler):
        raise Mismatch(f"{how}: built a {type(scheduler).__name__}, not a torch.optim.lr_scheduler.LRScheduler: "
                       "subclass it, so that torch steps, saves and restores it")
    return scheduler


def _follow(scheduler, optimizer, run: _Run, first: int, how: str, from_zero: bool | None) -> bool | None:
    """Compare every group's LR at updates first … total + 2 (an optimizer.step() and a scheduler.step() between
    two), as the optimizer would take them; returns which start of the ramp the answer uses (decided at update 0)."""

    previous = None
    for step in range(first, run.total + 3):
        if step > first:
            optimizer.step()
            scheduler.step()
        got = [number(g["lr"], f"{how}: param group {i}'s lr at update {step}")
               for i, g in enumerate(optimizer.param_groups)]
        if step == 0 and run.warmup:
            from_zero = math.isclose(got[0], 0.0, abs_tol=_TOL * run.lrs[0])  # base·step/warmup: LR 0 at update 0
        for i, (lr, base) in enumerate(zip(got, run.lrs, strict=True)):
            want = _want(run, step, base, bool(from_zero))
            if math.isclose(lr, want, rel_tol=_TOL, abs_tol=_TOL * base):
                continue
            differs = (f"{how}: param group {i}'s lr at update {step} is {lr:.6g}, expected {want:.6g} (relative "
                       f"difference {abs(lr - want) / max(abs(want), base):.2g})")
            if first > 0:  # the same run went right unresumed
                again = math.isclose(lr, _want(run, step - first, base, bool(from_zero)), rel_tol=_TOL,
                                     abs_tol=_TOL * base)
                raise Mismatch(differs + (
                    f": that is update {step - first}'s LR, the schedule started again: it counts updates with a "
                    "counter of its own, which a fresh scheduler (or one built with last_epoch) sets back; compute "
                    "the LR from self.last_epoch, which LRScheduler sets, saves and restores" if again else
                    ": the resumed schedule does not go on as the uninterrupted one did; keep its place in the run "
                    "in self.last_epoch"), mistake="not resumable", hint=_RESUME)
            if _group_slip(run, step, i, lr, bool(from_zero)):
                raise Mismatch(f"{differs}: that is group 0's LR: every group was given the schedule of group 0's "
                               "base LR; each follows its own, self.base_lrs[i]", mistake="group 0", hint=_GROUPS)
            known = next(((key, text) for key, value, text in
                          _mistakes(run, step, base, None if previous is None else previous[i], bool(from_zero))
                          if math.isclose(lr, value, rel_tol=_TOL, abs_tol=_TOL * base)), None)
            if known:
                raise Mismatch(f"{differs}: {known[1]}", mistake=known[0], hint=_HINTS[known[0]])
            raise Mismatch(differs)
        previous = got
    return from_zero


def _saved(scheduler, how: str) -> dict:
    """The scheduler's state_dict() as a checkpoint gives it back: through torch.save and torch.load."""
    buffer = io.BytesIO()
    try:
        torch.save(scheduler.state_dict(), buffer)
    except Exception as e:  # pickle's errors: AttributeError, TypeError, PicklingError
        raise Mismatch(f"{how}: torch.save(scheduler.state_dict()) raised {type(e).__name__} ({e}): the state_dict "
                       "holds every attribute of the scheduler, and a checkpoint must pickle it; keep plain values "
                       "there (numbers, lists) and compute the LR from self.last_epoch", mistake="not saveable",
                       hint=_RESUME) from None
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)  # our own bytes: whatever the learner's attributes are


def _resume(cls, run: _Run, scheduler, optimizer, from_zero: bool | None) -> None:
    """Resume `run` at update k both ways; `scheduler` and `optimizer` have just been driven to update k."""

    k, states = run.resume, (optimizer.state_dict(), _saved(scheduler, f"{run}, at update {run.resume}"))
    how = f"{run}, resumed at update {k} by load_state_dict of the state_dict() saved there"
    fresh = _optimizer(run)
    resumed = _build(cls, fresh, run, how)  # before the optimizer loads its state: __init__ sets the groups' LRs
    fresh.load_state_dict(states[0])
    resumed.load_state_dict(states[1])
    _follow(resumed, fresh, run, k, how, from_zero)
    how = f"{run}, resumed at update {k} by building it with last_epoch={k - 1} on the optimizer's loaded state"
    fresh = _optimizer(run)
    fresh.load_state_dict(states[0])  # holds each group's 'initial_lr', which last_epoch ≥ 0 requires
    restarted = _build(cls, fresh, run, how, last_epoch=k - 1)
    _follow(restarted, fresh, run, k, how, from_zero)


def _drive(cls, run: _Run) -> None:
    """The run from update 0 to total + 2, unresumed; then again to update run.resume, and resumed there both
    ways."""

    optimizer = _optimizer(run)
    from_zero = _follow(_build(cls, optimizer, run, str(run)), optimizer, run, 0, str(run), None)
    optimizer = _optimizer(run)
    scheduler = _build(cls, optimizer, run, str(run))
    for _ in range(run.resume):
        optimizer.step()
        scheduler.step()
    _resume(cls, run, scheduler, optimizer, from_zero)


def _bad_arguments(rng: random.Random) -> list[tuple[dict, tuple[str, ...]]]:
    """(arguments, the names a ValueError may give): each makes no schedule."""
    total = rng.randint(5, 100)
    return [(dict(warmup=-rng.randint(1, 5), total=total, min_lr_ratio=0.1), ("warmup",)),
            (dict(warmup=0, total=-rng.randint(0, 3), min_lr_ratio=0.1), ("total",)),
            (dict(warmup=total + rng.randint(1, 5), total=total, min_lr_ratio=0.1), ("warmup", "total")),
            (dict(warmup=total / rng.choice((10, 20, 40)), total=total, min_lr_ratio=0.1), ("warmup",)),  # a fraction
            (dict(warmup=0, total=float(total), min_lr_ratio=0.1), ("total",)),
            (dict(warmup=1, total=total, min_lr_ratio=-rng.uniform(0.01, 1)), ("min_lr_ratio",)),
            (dict(warmup=1, total=total, min_lr_ratio=1 + rng.uniform(0.01, 1)), ("min_lr_ratio",))]


def _refuses(cls, arguments: dict, names: tuple[str, ...]) -> None:
    given = ", ".join(f"{name}={round(value, 3)!r}" for name, value in arguments.items())  # 37.0 stays a float
    what = f"WarmupCosine(optimizer, {given})"
    try:
        cls(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3), **arguments)
    except ValueError as e:
        if not any(name in str(e) for name in names):
            raise Mismatch(f"{what} raised ValueError({str(e)!r}), which does not say which argument is wrong: name "
                           f"{' or '.join(names)} in the message", mistake="unnamed", hint=_ARGS) from None
        return
    except NotImplementedError:
        raise
    except Exception as e:  # an assert (skipped under python -O), a TypeError, or a failure further on
        raise Mismatch(f"{what} raised {type(e).__name__} ({e}), expected a ValueError naming {' or '.join(names)}",
                       mistake="not ValueError", hint=_ARGS) from None
    raise Mismatch(f"{what} was accepted: these arguments make no schedule; raise ValueError naming "
                   f"{' or '.join(names)}", mistake="not refused", hint=_ARGS)


@check("6.1", "warmup and cosine decay as a PyTorch LR scheduler", hint=Hint(
    nudge="compare your LR with the expected one at the update named: is that update on the warmup ramp, on the "
          "cosine, or past the end of the run, and which param group is it?",
    idea="update last_epoch of each group climbs linearly to its base LR over updates 0 … warmup − 1; after it a "
         "cosine takes the LR from the base at update warmup down to min_lr_ratio·base at the last update, total − "
         "1, and holds it there",
    formula=_FORMULA))
def warmup_cosine(cls):
    """`cls(optimizer, warmup, total, min_lr_ratio=0.0, last_epoch=-1)`: an LRScheduler whose get_lr gives each
    param group the LR of update last_epoch, as warmup_cosine_lr defines it from the group's base LR."""

    rng = fresh_rng()
    for run in _runs(rng):
        try:
            _drive(cls, run)
        except ZeroDivisionError:
            if run.total - 1 - run.warmup > 0 and run.warmup > 0:
                raise
            zero = "warmup=0 means no warmup: the ramp is only for step < warmup, and the cosine starts at update 0" \
                if run.warmup == 0 else ("no update is left to decay over (total − 1 − warmup ≤ 0): progress is "
                                         "then 1, so the updates from warmup on are at the floor")
            raise Mismatch(f"{run}: divided by zero: {zero}", mistake="no span divided", hint=_NO_SPAN) from None
    for arguments, names in _bad_arguments(rng):
        _refuses(cls, arguments, names)
