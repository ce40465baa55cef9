"""Checks for chapter 6's exercises (solutions/06_tuning.ipynb): the LR schedule as a PyTorch scheduler, clipping,
one whole update, and a training monitor's update/weight ratio.

    from llmlab.checks import ch06 as check
    check.warmup_cosine(WarmupCosine)           # 6.1: an LRScheduler subclass -> each group's LR (ch06_schedule)
    check.clip_grad_norm(clip_grad_norm)        # 6.2: (parameters, max_norm) -> the norm before clipping
    check.scaled_step(scaled_step)              # 6.3: (model, optimizer, scaler, loss_fn, batches, max_norm) -> stepped
    check.update_monitor(UpdateMonitor)         # 6.4: a monitor class -> its update/weight ratios (ch06_monitor)

**6.1** is in `llmlab.checks.ch06_schedule` (its docstring says what it runs and names).

**6.2** compares with `torch.nn.utils.clip_grad_norm_` on float32 parameter lists of odd shapes (0-d included),
clipped and under the max, with some `.grad` None, with none at all, and passed as a generator (as
`model.parameters()` is). It names per-tensor clipping, rescaling under the max, the norm after clipping (or
squared, or the per-tensor norms summed), a None gradient not skipped or filled in, gradients replaced instead of
scaled in place or not changed at all, and a generator iterated twice.

**6.3** compares with the same update built from llmlab's parts (`llmlab.accumulate.accumulate_gradients`,
`llmlab.precision.DynamicLossScaler`, `llmlab.train.clip.clip_grad_norm`) on small float64 models with SGD: clipped,
unclipped, stale gradients in `.grad`, and a micro-batch holding a NaN (the step is skipped, the scale backs off).
It names clipping the still-scaled gradients, never unscaling, the missing 1/k, stale gradients added in, a step on
non-finite gradients, and a scale never updated.

**6.4** is in `llmlab.checks.ch06_monitor` (its docstring says what it runs and names).
"""

from __future__ import annotations

import math
import random

import torch

from llmlab.accumulate import accumulate_gradients
from llmlab.checks import Hint, Mismatch, assert_close, check, fresh_rng
from llmlab.checks.ch04 import accumulation_case, micro_batch_mse
from llmlab.checks.ch06_monitor import update_monitor
from llmlab.checks.ch06_schedule import warmup_cosine
from llmlab.precision import DynamicLossScaler
from llmlab.train.clip import clip_grad_norm as clip
from llmlab.train.clip import grad_norm

__all__ = ["warmup_cosine", "clip_grad_norm", "scaled_step", "update_monitor"]

_EPS = 1e-6  # torch's guard in the clipping coefficient max_norm / (norm + 1e-6)


def _number(value, what: str) -> float:
    try:  # a float, an int, a 0-d tensor or a NumPy scalar
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise Mismatch(f"{what} returned {value!r}; expected a number") from None


# --- 6.2: clipping by the global norm -------------------------------------------------------------------------

def _clip_cases(rng: random.Random) -> list[dict]:
    """Parameter lists: `shapes`, indices whose .grad is None, global norm / max_norm (`ratio`), `max_norm`."""
    cases = [dict(shapes=[(7,), (3, 5), (2, 1, 4)], none=(), ratio=4.0, max_norm=1.0),  # clipped
             dict(shapes=[(6,), (2, 3)], none=(), ratio=0.4, max_norm=1.0),  # under the max: left as they are
             dict(shapes=[(5,), (4, 3), (1,), ()], none=(1,), ratio=3.0, max_norm=0.5),  # a parameter without grad
             dict(shapes=[(3,), (2, 2)], none=(0, 1), ratio=0.0, max_norm=1.0),  # no gradient at all: norm 0
             dict(shapes=[(9,), (3, 3)], none=(), ratio=2.5, max_norm=2.0, generator=True)]  # model.parameters()
    for _ in range(4):
        n = rng.randint(1, 6)
        cases.append(dict(shapes=[tuple(rng.randint(1, 9) for _ in range(rng.randint(0, 3))) for _ in range(n)],
                          none=tuple(i for i in range(1, n) if rng.random() < 0.3),  # parameter 0 always has one
                          ratio=rng.choice([rng.uniform(1.5, 20), rng.uniform(0.05, 0.7)]),
                          max_norm=10 ** rng.uniform(-2, 1)))
    return cases


def _clip_params(case: dict, seed: int) -> list:
    """float32 parameters with random gradients of global norm ratio·max_norm; the first gradient is 3× the others'
    norm, so that when clipped (ratio ≥ 1.5, ≤ 6 tensors) it alone exceeds max_norm and per-tensor clipping shows."""

    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in case["shapes"]]
    grads = []
    for i, p in enumerate(params):
        if i not in case["none"]:
            grad = torch.randn(p.shape, generator=g)
            p.grad = grad / torch.linalg.vector_norm(grad) * (1.0 if grads else 3.0)
            grads.append(p.grad)
    if grads:
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in grads]))  # ()
        for grad in grads:
            grad.mul_(case["ratio"] * case["max_norm"] / total)
    return params


def _norms(grads) -> list[float]:
    return [torch.linalg.vector_norm(x).item() for x in grads]


def _all_close(xs, ys) -> bool:
    # float32: torch sums the squares of ≤ 6·729 values pairwise, ≲ log2(n)·2⁻²⁴ ≈ 1e-6 relative in any order (all
    # terms positive: no cancellation), and so does the coefficient max_norm / (norm + 1e-6) that scales every
    # gradient; the mistakes are off by ≥ 5% (the ratios drawn stay ≥ 1.5 or ≤ 0.7, away from the clip at 1)
    return all(torch.allclose(x, y, rtol=1e-5, atol=0.0) for x, y in zip(xs, ys, strict=True))


_CLIP_FORMULA = ("norm = √(Σ over every parameter whose .grad is not None of (g²).sum()) — one norm for all "
                 "gradients together; if norm > max_norm multiply every such .grad in place by max_norm / (norm + "
                 "1e-6) (g.mul_(c)), else leave them; return the norm from before; list(parameters) first if you "
                 "loop twice")
_NORM = Hint(
    nudge="look at the number you return: which norm it is, of which gradients, and computed when",
    idea="return the global L2 norm of the gradients as they were before clipping: the square root of the sum of "
         "every gradient's squared entries, all the tensors together",
    formula=_CLIP_FORMULA)
_NONE = Hint(
    nudge="look at what your code does with a parameter whose .grad is None",
    idea="a parameter without a gradient took no part in the loss, or is frozen: leave it out of the norm and leave "
         "its .grad None (with no gradient at all, the norm is 0 and nothing is scaled)",
    formula=_CLIP_FORMULA)
_IN_PLACE = Hint(
    nudge="look at how you change each .grad: after your call, does the parameter still hold the same gradient "
          "tensor, with new values?",
    idea="clipping changes the values of the existing gradient tensors in place; assigning a new tensor, to the "
         "parameter or to a loop variable, leaves the old one as it was for everyone who holds it",
    formula=_CLIP_FORMULA)
_FACTOR = Hint(
    nudge="look at the factor you scale each gradient by, and at when you apply it",
    idea="one factor for all the gradients, computed from the global norm, and applied only when that norm exceeds "
         "max_norm: gradients under the max are left as they are, never scaled up",
    formula=_CLIP_FORMULA)
_CLIP_HINTS = {"norm": _NORM, "norm after": _NORM, "squared norm": _NORM, "norms summed": _NORM,
               "no gradients": _NONE, "None not skipped": _NONE, "None filled": _NONE,
               "new tensor": _IN_PLACE, "not scaled": _IN_PLACE,
               "generator twice": Hint(
                   nudge="look at how many times your code loops over parameters",
                   idea="parameters may be a generator, as model.parameters() is, and a generator is used up by the "
                        "first loop over it: a second loop sees no parameters at all",
                   formula=_CLIP_FORMULA),
               "per tensor": _FACTOR, "rescaled up": _FACTOR}


def _run_clip(fn, case: dict, params: list, what: str):
    """The learner's call; a crash on a None gradient, or on no gradient at all, is named."""
    try:
        return fn((p for p in params) if case.get("generator") else params, case["max_norm"])
    except NotImplementedError:
        raise
    except Exception as e:
        error = f"your code raised {type(e).__name__}: {e}"
        if len(case["none"]) == len(params):
            raise Mismatch(f"{what}: no parameter has a gradient and {error}; the norm of no gradients is 0 (torch "
                           "returns tensor(0.)) and nothing is scaled", mistake="no gradients",
                           hint=_CLIP_HINTS["no gradients"]) from None
        if case["none"] and "NoneType" in str(e):
            raise Mismatch(f"{what}: parameter {case['none'][0]} has .grad None (it took no part in the loss, or is "
                           f"frozen) and {error}; skip such parameters, as torch does", mistake="None not skipped",
                           hint=_CLIP_HINTS["None not skipped"]) from None
        raise


@check("6.2", "clipping by the global norm", hint=Hint(
    nudge="look at which norm you compute (of which gradients, before or after clipping) and at how you change each "
          ".grad",
    idea="one norm of all the gradients together, as if they were one vector, decides one factor that scales every "
         "gradient in place, and only when that norm exceeds max_norm; parameters without a gradient are left out, "
         "and the norm returned is the one from before",
    formula=_CLIP_FORMULA))
def clip_grad_norm(fn):
    """`fn(parameters, max_norm)`: clip the gradients in place by their global L2 norm; return the norm before."""

    rng = fresh_rng()
    for case in _clip_cases(rng):
        params = _clip_params(case, rng.randrange(1 << 30))
        theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for t, p in zip(theirs, params, strict=True):
            t.grad = None if p.grad is None else p.grad.clone()
        want = torch.nn.utils.clip_grad_norm_(theirs, case["max_norm"]).item()
        shapes = ", ".join(str(tuple(p.shape)) for p in params)
        what = (f"clip_grad_norm(parameters of shapes {shapes}{' (a generator)' if case.get('generator') else ''}, "
                f"max_norm={case['max_norm']:.4g})" + (f" with .grad None at {list(case['none'])}" if case["none"]
                                                        else "") + f", gradient norm {want:.4g}")
        held = [p.grad for p in params]  # the gradient tensors themselves: clipping scales them in place
        before = [None if x is None else x.clone() for x in held]
        grads_before = [x for x in before if x is not None]
        norm = _number(_run_clip(fn, case, params, what), what)
        grads = [p.grad for p in params if p.grad is not None]
        # torch's fp32 norm vs the answer's (fp32 or float64, any order): ≲ 1e-6 apart (see _all_close)
        if not math.isclose(norm, want, rel_tol=1e-5):
            known = {("norm after", "the norm after clipping: return the norm the gradients had before (torch does; it "
                      "is what a training log records)"): math.sqrt(sum(n * n for n in _norms(grads)))
                     if case["ratio"] > 1 else math.nan,
                     ("squared norm", "the squared norm: take the square root of the sum of squares"): want * want,
                     ("norms summed", "the per-tensor norms added up: the global norm is √(Σᵢ ‖gᵢ‖²), the norm of all "
                      "gradients as one vector"): sum(_norms(grads_before))}
            found = next((k for k, value in known.items() if math.isclose(norm, value, rel_tol=1e-5)), None)
            if found:
                raise Mismatch(f"{what}: returned {norm:.6g}, expected {want:.6g}: {found[1]}", mistake=found[0],
                               hint=_CLIP_HINTS[found[0]])
            raise Mismatch(f"{what}: returned {norm:.6g}, expected {want:.6g}", mistake="norm",
                           hint=_CLIP_HINTS["norm"])
        for i, (p, x) in enumerate(zip(params, held, strict=True)):
            if x is None and p.grad is not None:
                raise Mismatch(f"{what}: parameter {i} had .grad None and now has a gradient: skip parameters whose "
                               ".grad is None (an optimizer would otherwise update a frozen parameter)",
                               mistake="None filled", hint=_CLIP_HINTS["None filled"])
            if x is not None and p.grad is not x:
                raise Mismatch(f"{what}: parameter {i}'s .grad is a new tensor: scale the existing one in place "
                               "(p.grad.mul_(c)), as torch does — other code holds references to it (DDP's "
                               "gradient buckets are views of .grad)", mistake="new tensor",
                               hint=_CLIP_HINTS["new tensor"])
        wants = [t.grad for t in theirs if t.grad is not None]
        if _all_close(grads, wants):
            continue
        if case["ratio"] > 1 and _all_close(grads, grads_before):
            if case.get("generator"):
                raise Mismatch(f"{what}: the norm is right but the gradients were not scaled: parameters is a "
                               "generator here (model.parameters() is one), so a second loop over it sees nothing; "
                               "make it a list first", mistake="generator twice", hint=_CLIP_HINTS["generator twice"])
            raise Mismatch(f"{what}: the gradients are unchanged although their norm exceeds max_norm: scale each "
                           ".grad in place, g.mul_(c) — `g = g * c` only rebinds a local name", mistake="not scaled",
                           hint=_CLIP_HINTS["not scaled"])
        coefficient = case["max_norm"] / (want + _EPS)
        per_tensor = [x * min(1.0, case["max_norm"] / (n + _EPS)) for x, n in zip(grads_before, _norms(grads_before),
                                                                                   strict=True)]
        if case["ratio"] > 1 and _all_close(grads, per_tensor):
            raise Mismatch(f"{what}: each tensor was clipped by its own norm: the norm is global, over all gradients "
                           "together, and every gradient is scaled by the same max_norm / (norm + 1e-6), which keeps "
                           "the direction of the whole update", mistake="per tensor", hint=_CLIP_HINTS["per tensor"])
        if case["ratio"] < 1 and _all_close(grads, [x * coefficient for x in grads_before]):
            raise Mismatch(f"{what}: the gradients were rescaled (×{coefficient:.3g}, up) although their norm is "
                           "under max_norm: scale only when the norm exceeds it, by min(1, max_norm / (norm + 1e-6))",
                           mistake="rescaled up", hint=_CLIP_HINTS["rescaled up"])
        for i, (x, y) in enumerate(zip(grads, wants, strict=True)):
            assert_close(x, y, what=f"{what}: gradient {i}", rtol=1e-5, atol=0.0)  # tolerance: see _all_close


# --- 6.3: one update with accumulation, a loss scaler and clipping ----------------------------------------------

def _step_cases(rng: random.Random) -> list[dict]:
    cases = []
    # unclipped first: there max_norm > k·‖g‖, so a wrong magnitude (k×, S×) is not hidden by the clip
    for kind in ("unclipped", "clipped", "overflow", rng.choice(["clipped", "unclipped"])):
        k, make_model, batches = accumulation_case(rng)
        if kind == "overflow":  # a micro-batch holding a NaN: a corrupt sample, or in fp16 an overflow upstream
            x = batches[rng.randrange(k)][0]
            x[rng.randrange(len(x)), 0] = float("nan")
        model = make_model()
        accumulate_gradients(model, micro_batch_mse, batches)
        norm = grad_norm(model.parameters()).item()  # the true gradient's norm, to put max_norm around it
        max_norm = {"clipped": norm / rng.uniform(2, 5), "unclipped": norm * (k + rng.uniform(1, 3))}.get(kind, 1.0)
        cases.append(dict(kind=kind, k=k, make_model=make_model, batches=batches, norm=norm, max_norm=max_norm,
                          lr=rng.uniform(0.05, 0.5), scale=2.0 ** rng.randint(8, 16), stale=not cases))
    return cases


def _setup(case: dict):
    """A fresh model (with the case's stale gradients), its SGD optimizer and a loss scaler."""

    model = case["make_model"]()
    if case["stale"]:  # a backward the caller ran before, whose scaled gradients are still in .grad
        DynamicLossScaler(case["scale"]).scale_loss(micro_batch_mse(model, case["batches"][0])).backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=case["lr"])
    return model, optimizer, DynamicLossScaler(case["scale"], growth_interval=1)  # grows after every clean update


def _reference(case: dict, mistake: str | None = None):
    """llmlab's update (or one with `mistake`): (how it moved each parameter, the scale after it, whether it
    stepped)."""

    model, optimizer, scaler = _setup(case)
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    stale = [None if p.grad is None else p.grad.clone() for p in params]
    accumulate_gradients(model, lambda m, b: scaler.scale_loss(micro_batch_mse(m, b)), case["batches"],
                         scale=mistake != "no 1/k")  # zeroes .grad first; then S·∇(mean loss) (k× without 1/k)
    if mistake == "no zeroing":
        for p, s in zip(params, stale, strict=True):
            if s is not None:
                p.grad += s
    grads = [p.grad for p in params if p.grad is not None]
    if mistake == "clip first":
        clip(params, case["max_norm"])
    if mistake == "no unscale":
        found_inf = not all(bool(torch.isfinite(g).all()) for g in grads)
    else:
        found_inf = scaler.unscale_(grads)
    scaler.update(found_inf)
    if not found_inf:
        if mistake != "clip first":
            clip(params, case["max_norm"])
        optimizer.step()
    return [p.detach() - s for p, s in zip(params, start, strict=True)], scaler.scale, not found_inf


def _update_tol(want) -> dict:
    """Tolerances for one tensor's update: 1e-6 of its largest entry. The models are float64, but scale_loss
    multiplies in float32, so S·loss/k (S times the loss, then divided by k) rounds the factor S/k reaching the
    gradients to float32 (≤ 6e-8 of each one) where S·(loss/k) does not; both orders are right. Relative to the
    largest entry, not to each: with stale gradients added in, an entry can cancel to near 0. The mistakes are off
    by a factor of 2 or more (k×, S× clipped to max_norm > k·‖g‖, S× smaller) or in direction (stale gradients) in
    the unclipped case, which comes first (in a clipped one a wrong magnitude shows only through the 1e-6 guard)."""
    return dict(rtol=1e-6, atol=1e-6 * want.abs().max().item())


def _same(xs, ys) -> bool:
    return all(torch.allclose(x, y, **_update_tol(y)) for x, y in zip(xs, ys, strict=True))


_STEP_MISTAKES = {
    "clip first": "the update is what clipping the still-scaled gradients gives: .grad holds S·g until it is "
                  "unscaled, so the clip compares S·‖g‖ with max_norm and shrinks every update ~S×; unscale first "
                  "(scaler.unscale_), then clip",
    "no unscale": "the gradients were never unscaled: the update used S·g; divide them by the scale "
                  "(found_inf = scaler.unscale_(grads)) before clipping and stepping",
    "no 1/k": "the gradient is k× the mean over the micro-batches: divide each micro-batch's loss by k "
              "(scaler.scale_loss(loss / k)) before backward",
    "no zeroing": "the gradients the model held before were added in: zero them first (optimizer.zero_grad())",
}


_STEP_FORMULA = ("zero the gradients; for each of the k micro-batches backward scaler.scale_loss(loss_fn(model, "
                 "batch) / k); found_inf = scaler.unscale_(grads); scaler.update(found_inf); if found_inf return "
                 "False (no clip, no step); else clip the unscaled gradients to max_norm, optimizer.step() and return "
                 "True")
_UNSCALE = Hint(
    nudge="look at what .grad holds when you clip and step: is the loss scale still in it?",
    idea="backward of the scaled loss leaves S·g in .grad; scaler.unscale_ divides S out (and says whether any "
         "gradient is inf or NaN), and both the clip and the step must see the true gradients",
    formula=_STEP_FORMULA)
_ACCUMULATE = Hint(
    nudge="look at the gradient your micro-batch loop leaves in .grad: whose micro-batches it holds, and at what "
          "weight",
    idea="start from zeroed gradients, and let each of the k backward passes add 1/k of its micro-batch's scaled "
         "gradient, so that .grad holds S times the gradient of the mean loss",
    formula=_STEP_FORMULA)
_SCALE = Hint(
    nudge="look at where, and how often, you call scaler.update",
    idea="the scaler backs off after an overflow and grows after clean updates only if it hears of every update: "
         "tell it once per update, with what unscale_ returned, whether or not the optimizer steps",
    formula=_STEP_FORMULA)
_STEP_HINTS = {
    "clip first": _UNSCALE, "no unscale": _UNSCALE, "no 1/k": _ACCUMULATE, "no zeroing": _ACCUMULATE,
    "step on inf": Hint(
        nudge="look at what your update does when unscale_ reports gradients that are inf or NaN",
        idea="an overflow means this update's gradients are unusable: the scaler still backs off, but the clip "
             "and the optimizer step are skipped, and the update reports that it did not step",
        formula=_STEP_FORMULA),
    "scale not updated": _SCALE, "scale wrong": _SCALE,
}


@check("6.3", "one update: accumulate, unscale, clip, step", hint=Hint(
    nudge="look at the order of the update's parts, and at what .grad holds after each of them: scaled or not, the "
          "mean or the sum, this update's micro-batches alone or more",
    idea="the k backward passes of the scaled losses divided by k leave S times the mean gradient in freshly zeroed "
         ".grad; unscale it before anything reads it, update the scale, and clip and step only when the gradients "
         "are finite",
    formula=_STEP_FORMULA))
def scaled_step(fn):
    """`fn(model, optimizer, scaler, loss_fn, batches, max_norm)`: one update; True if the optimizer stepped."""

    for case in _step_cases(fresh_rng()):
        model, optimizer, scaler = _setup(case)
        start = [p.detach().clone() for p in model.parameters()]
        got = fn(model, optimizer, scaler, micro_batch_mse, case["batches"], case["max_norm"])
        mine = [p.detach() - s for p, s in zip(model.parameters(), start, strict=True)]  # how each one moved
        updates, scale, stepped = _reference(case)
        what = f"{case['k']} micro-batches, loss scale {case['scale']:g}, " + (
            "one micro-batch holding a NaN" if case["kind"] == "overflow" else
            f"max_norm={case['max_norm']:.3g} ({case['kind']}: the gradient norm is {case['norm']:.3g})") + (
            ", stale gradients in .grad" if case["stale"] else "")
        if not all(bool(torch.isfinite(p).all()) for p in mine):
            raise Mismatch(f"{what}: the weights are now inf/NaN: the optimizer stepped on non-finite gradients; "
                           "when unscale_ reports them (found_inf), skip the clip and the step", mistake="step on inf",
                           hint=_STEP_HINTS["step on inf"])
        if not _same(mine, updates):
            known = next((mistake for mistake in _STEP_MISTAKES if _same(mine, _reference(case, mistake)[0])), None)
            if known:
                raise Mismatch(f"{what}: {_STEP_MISTAKES[known]}", mistake=known, hint=_STEP_HINTS[known])
            for (name, _), got_update, want in zip(model.named_parameters(), mine, updates, strict=True):
                assert_close(got_update, want, what=f"{what}: the update of {name}", **_update_tol(want))
        if scaler.scale != scale:
            if scaler.scale == case["scale"]:
                raise Mismatch(f"{what}: the loss scale is still {case['scale']:g}, expected "
                               f"{scale:g}: call scaler.update(found_inf) every update — it backs off (×0.5) after "
                               "an overflow and grows (×2) after clean updates (this scaler after every one)",
                               mistake="scale not updated", hint=_STEP_HINTS["scale not updated"])
            raise Mismatch(f"{what}: the loss scale ended at {scaler.scale:g}, expected {scale:g}: call "
                           "scaler.update(found_inf) once per update, with what unscale_ returned",
                           mistake="scale wrong", hint=_STEP_HINTS["scale wrong"])
        if not isinstance(got, bool) or got != stepped:
            raise Mismatch(f"{what}: returned {got!r}, expected {stepped} (True: the optimizer stepped; False: the "
                           "update was skipped)")
