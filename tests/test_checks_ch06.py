"""Chapter 6's exercise checks (llmlab.checks.ch06): each passes a right answer, reports an unwritten one as not
attempted, and fails each plausible wrong answer with a message naming the mistake — a scheduler one update
late, a decay to 0, a schedule that restarts when resumed, per-tensor clipping, the norm after clipping, clipping
before unscaling — and the hint.

The wrong answers are the right one with one thing changed (a `mistake` argument), so each test shows the one
slip its message names.
"""

import copy
import math

import pytest
import torch
from check_answers import Mistake, Reference
from grading import cases_taken, not_attempted
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from llmlab import validation
from llmlab.checks import ch06, ch06_monitor, ch06_schedule
from llmlab.monitor import Monitor
from llmlab.train.clip import clip_grad_norm
from llmlab.train.schedule import LRSchedule


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny tensors: one thread is faster, and steadier when other processes share the cores."""


def unwritten(*args):
    raise NotImplementedError("Exercise 6.x")


# --- 6.1 ----------------------------------------------------------------------------------------------------

def lr(step, base, warmup, total, ratio, mistake=None, shift=1):
    """Linear warmup then cosine decay to ratio·base, written out; `mistake` changes one thing. `shift` 1: llmlab's
    ramp, (step + 1)/warmup; 0: the ramp from LR 0 at update 0, step/warmup (the material's, Hugging Face's)."""
    if step < warmup or (mistake == "ramp too long" and step == warmup > 0):
        return base * (step + shift) / warmup
    start = 0 if mistake == "over total" else warmup
    span = total - (0 if mistake == "one too long" else 1) - start
    if mistake == "unguarded":
        progress = min((step - start) / span, 1.0)
    elif mistake == "span at least 1":  # a guard against dividing by 0 that leaves progress 0 where no span is left
        progress = min((step - start) / max(1, span), 1.0)
    else:
        progress = (step - start) / span if span > 0 else 1.0
        progress = progress if mistake == "no clamp" else min(progress, 1.0)
    floor = 0.0 if mistake == "to zero" else ratio * base
    return floor + (base - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine(mistake=None, shift=1):
    """The solution's WarmupCosine class; `mistake` changes one thing ("float32": right, the LRs computed in
    float32 tensors)."""

    class WarmupCosine(LRScheduler):
        def __init__(self, optimizer, warmup, total, min_lr_ratio=0.0, last_epoch=-1):
            bad = [(not isinstance(warmup, int) or warmup < 0, f"warmup={warmup!r} must be an int >= 0"),
                   (not isinstance(total, int) or total < 1, f"total={total!r} must be an int >= 1"),
                   (warmup > total or (mistake == "too strict" and warmup == total),
                    f"warmup={warmup} must be <= total={total}"),
                   (not 0.0 <= min_lr_ratio <= 1.0, f"min_lr_ratio={min_lr_ratio!r} must be in [0, 1]")]
            for wrong, message in bad[:3] if mistake == "ratio unchecked" else bad:
                if mistake == "assert":
                    assert not wrong, message
                elif wrong:
                    raise ValueError("bad argument" if mistake == "unnamed" else message)
            self.warmup, self.total, self.min_lr_ratio = warmup, total, min_lr_ratio
            if mistake == "own counter":
                self.t = 0  # the update about to be taken: a counter of its own, beside last_epoch
            if mistake == "lambda":  # the schedule kept as a lambda: in state_dict(), which torch.save cannot pickle
                self.schedule = lambda step, base: lr(step, base, warmup, total, min_lr_ratio, shift=shift)
            super().__init__(optimizer, last_epoch)

        def get_lr(self):
            step = {"one late": self.last_epoch - 1, "one early": self._step_count}.get(mistake, self.last_epoch)
            if mistake == "own counter":
                step, self.t = self.t, self.t + 1
            bases = {"group 0": [self.base_lrs[0]] * len(self.base_lrs),
                     "compounded": [g["lr"] for g in self.optimizer.param_groups]}.get(mistake, self.base_lrs)
            if mistake == "lambda":
                return [self.schedule(step, base) for base in bases]
            if mistake == "float32":
                return [float32_lr(step, base, self.warmup, self.total, self.min_lr_ratio) for base in bases]
            return [lr(step, base, self.warmup, self.total, self.min_lr_ratio, mistake=mistake, shift=shift)
                    for base in bases]

    return WarmupCosine


def float32_lr(step, base, warmup, total, ratio):
    """The definition computed in float32 throughout (torch tensors): right, within float32's rounding."""
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    peak, floor = f32(base), f32(ratio * base)
    if step < warmup:
        return peak * (step + 1) / warmup
    span = total - 1 - warmup
    progress = f32(min((step - warmup) / span, 1.0) if span > 0 else 1.0)
    return floor + (peak - floor) * 0.5 * (1 + torch.cos(math.pi * progress))


def llmlab_schedule(optimizer, warmup, total, min_lr_ratio=0.0, last_epoch=-1):
    """llmlab's own LRSchedule (a peak of 1: the multiplier of each group's base LR) under torch's LambdaLR."""
    validation.number("min_lr_ratio", min_lr_ratio, 0, 1)  # LRSchedule names it min_lr
    schedule = LRSchedule(base_lr=1.0, total_steps=total, warmup=warmup, min_lr=min_lr_ratio)
    return LambdaLR(optimizer, schedule, last_epoch=last_epoch)


SCHEDULE_MISTAKES = {  # mistake: (what the message says, a word of the hint, the ramp starts it is planted on)
    "one late": (r"update 11 is .*: the schedule runs one update late — LR 0 at update 0", "last_epoch is 0", (1,)),
    "one early": (r"the schedule runs one update early: .*self._step_count", "last_epoch is 0", (1, 0)),
    "ramp too long": (r"update 10 is .*the ramp runs one update too long", "updates 0 … warmup − 1", (1,)),
    "to zero": (r"the LR decays to 0, not to the floor min_lr_ratio·base", "not to 0", (1, 0)),
    "over total": (r"the cosine is spread over the whole run \(divided by total\)", "progress = min((s − warmup)",
                   (1, 0)),
    "one too long": (r"the decay is one update too long, so the last update \(total − 1\) ends above the floor",
                     "total − 1 − warmup", (1, 0)),
    "no clamp": (r"update 10[0-2] .*after the last update the LR rises again along the cosine: clamp progress",
                 "stays 1 after it", (1, 0)),
    "group 0": (r"param group 1's lr at update [01] is .*: that is group 0's LR", "base_lrs[i]", (1, 0)),
    "compounded": (r"param group 0's lr at update 1 is .*the schedule applied to the group's LR of the update before",
                   "base_lrs[i]", (1, 0)),
    "own counter": (r"resumed at update \d+ by building it with last_epoch=\d+ .*: that is update 0's LR, the "
                    r"schedule started again: it counts updates with a counter of its own", "self.last_epoch", (1, 0)),
    "lambda": (r"at update \d+: torch.save\(scheduler.state_dict\(\)\) raised \w+ .*keep plain values", "no lambda",
               (1, 0)),
    "span at least 1": (r"warmup=9, total=10, .* is \S+, expected .*: no update is left to decay over \(total − "
                        r"1 − warmup = 0\).* max\(1, total − 1 − warmup\)", "test the span before dividing", (1, 0)),
    "unguarded": (r"warmup=9, total=10, .*: divided by zero: no update is left to decay over",
                  "test the span before dividing", (1, 0)),
    "too strict": (r"warmup=20, total=20, .*raised ValueError \(warmup=20 must be <= total=20\), but these arguments "
                   "make a schedule", "warmup = total", (1,)),
    "ratio unchecked": (r"WarmupCosine\(optimizer, warmup=1, total=\d+, min_lr_ratio=-[\d.]+\) was accepted: .*raise "
                        "ValueError naming min_lr_ratio", "raise ValueError", (1,)),
    "assert": (r"WarmupCosine\(optimizer, warmup=-\d, .*\) raised AssertionError \(warmup=-\d must be an int >= 0.*\), "
               "expected a ValueError naming warmup", "raise ValueError", (1,)),
    "unnamed": (r"raised ValueError\('bad argument'\), which does not say which argument is wrong: name warmup",
                "raise ValueError", (1,)),
}


# --- 6.2 ----------------------------------------------------------------------------------------------------

def clip(parameters, max_norm, mistake=None):
    """Global-norm clipping, written out; `mistake` changes one thing."""
    parameters = list(parameters) if mistake != "generator twice" else parameters
    if mistake == "no skip":
        grads = [p.grad for p in parameters]
    else:
        grads = [p.grad for p in parameters if p.grad is not None]
        if mistake == "zero fill":
            for p in parameters:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
    norm = math.sqrt(sum(g.square().sum().item() for g in grads))
    if mistake == "generator twice":
        grads = [p.grad for p in parameters if p.grad is not None]  # the generator is spent: no gradients
    for i, g in enumerate(grads):
        if mistake == "per tensor":
            g.mul_(min(1.0, max_norm / (g.norm().item() + 1e-6)))
            continue
        c = max_norm / (norm + 1e-6) if mistake == "always" else min(1.0, max_norm / (norm + 1e-6))
        if mistake == "rebind":
            g = g * c  # the mistake: a new tensor bound to the loop variable only
        elif mistake == "replace":
            [p for p in parameters if p.grad is not None][i].grad = g * c
        else:
            g.mul_(c)
    if mistake == "after":
        return math.sqrt(sum(g.square().sum().item() for g in grads))
    return {"squared": norm * norm}.get(mistake, norm)


CLIP_MISTAKES = {
    "per tensor": "each tensor was clipped by its own norm: the norm is global",
    "always": r"the gradients were rescaled \(×\d.*, up\) although their norm is under max_norm",
    "after": r"returned \S+, expected \S+: the norm after clipping: return the norm the gradients had before",
    "squared": "the squared norm: take the square root",
    "no skip": r"parameter 1 has .grad None .* your code raised AttributeError: .*NoneType.*; skip such parameters",
    "zero fill": "parameter 1 had .grad None and now has a gradient: skip parameters whose .grad is None",
    "rebind": r"the gradients are unchanged although their norm exceeds max_norm: scale each .grad in place",
    "replace": r"parameter 0's .grad is a new tensor: scale the existing one in place",
    "generator twice": r"\(a generator\).*: the norm is right but the gradients were not scaled: .* make it a list",
}


def stacked(parameters, max_norm):  # right, except that torch.stack refuses an empty list
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.stack([g.norm() for g in grads]).norm()
    for g in grads:
        g.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


# --- 6.3 ----------------------------------------------------------------------------------------------------

def scaled_step(model, optimizer, scaler, loss_fn, batches, max_norm, mistake=None):
    """One update in the right order; `mistake` changes one thing."""
    if mistake != "no zeroing":
        optimizer.zero_grad(set_to_none=True)
    k = 1 if mistake == "no 1/k" else len(batches)
    for batch in batches:
        scaler.scale_loss(loss_fn(model, batch) / k).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if mistake == "clip first":
        clip_grad_norm(model.parameters(), max_norm)
    if mistake == "no unscale":
        found_inf = not all(torch.isfinite(g).all() for g in grads)
    else:
        found_inf = scaler.unscale_(grads)
    if mistake != "no update":
        scaler.update(found_inf)
    if found_inf and mistake != "step anyway":
        return None if mistake == "returns None" else False
    if mistake != "clip first":
        clip_grad_norm(model.parameters(), max_norm)
    optimizer.step()
    return None if mistake == "returns None" else True


STEP_MISTAKES = {
    "clip first": "what clipping the still-scaled gradients gives: .* unscale first",
    "no unscale": "the gradients were never unscaled: the update used S·g",
    "no 1/k": r"the gradient is k× the mean over the micro-batches: divide each micro-batch's loss by k",
    "no zeroing": r"stale gradients in .grad: the gradients the model held before were added in: zero them first",
    "step anyway": r"one micro-batch holding a NaN: the weights are now inf/NaN: the optimizer stepped",
    "no update": r"the loss scale is still \d+, expected \d+: call scaler.update\(found_inf\) every update",
    "returns None": r"returned None, expected True",
}


# --- 6.4 ----------------------------------------------------------------------------------------------------

def update_monitor(mistake=None):
    """The solution's UpdateMonitor class; `mistake` changes one thing ("float64": right, the subtraction and the
    norms in float64)."""

    def norm(t):
        if mistake == "float64":
            return torch.linalg.vector_norm(t.double()).item()
        return torch.linalg.vector_norm(t, dtype=None if mistake == "bf16 norm" else torch.float32).item()

    class UpdateMonitor:
        def __init__(self):
            self.history, self.update_ratios = {}, {}

        def watch(self, model, **_):
            self.params = {n: p for n, p in model.named_parameters()
                           if (p.requires_grad or mistake == "frozen watched")
                           and (p.grad is not None or mistake != "grad at watch")}
            if mistake == "last update":  # a copy before each update's forward: the last update's ratio only
                model.register_forward_pre_hook(lambda module, args: self.copy_weights())
            self.copy_weights()

        def copy_weights(self):
            with torch.no_grad():
                self.before = {n: p.detach().clone() for n, p in self.params.items()}

        def log(self, step, metrics):
            if mistake == "copy after":
                self.copy_weights()
            moved = size = 0.0
            ratios, norms = {}, []
            with torch.no_grad():
                for name, p in self.params.items():
                    if mistake == "unused skipped" and p.grad is None:
                        continue
                    before = self.before[name]
                    if mistake == "float64":  # the subtraction too: exact, where p − before rounds in bf16
                        p, before = p.double(), before.double()
                    change = {"grad norm": p.grad, "lr times grad": None if p.grad is None else
                              metrics["lr"] * p.grad}.get(mistake, p - before)
                    d2, w2 = norm(change) ** 2, norm(p if mistake == "norm after" else before) ** 2
                    moved, size = moved + d2, size + w2
                    norms.append((d2 ** 0.5, w2 ** 0.5))
                    if mistake == "zero inf":
                        ratios[name] = (torch.tensor(d2) / torch.tensor(w2)).sqrt().item()  # inf or NaN at w = 0
                    elif mistake == "zero divides":
                        ratios[name] = math.sqrt(d2 / w2)
                    else:
                        ratios[name] = (d2 / w2 if mistake == "squared" else math.sqrt(d2 / w2)) if w2 > 0 else math.nan
            overall = math.sqrt(moved / size) if size > 0 else math.nan
            if mistake == "mean of ratios":
                overall = sum(ratios.values()) / len(ratios)
            elif mistake == "norms summed":
                overall = sum(d for d, _ in norms) / sum(w for _, w in norms)
            elif mistake == "squared global":
                overall = moved / size
            for name, ratio in ratios.items():
                self.update_ratios.setdefault(name, []).append((step, overall if mistake == "global" else ratio))
            logged = {"update_ratio": overall} if mistake == "history" else {**metrics, "update_ratio": overall}
            for name, value in logged.items():
                self.history.setdefault(name, []).append((step, float(value)))
            if mistake not in ("copy at watch", "copy after"):
                self.copy_weights()

    return UpdateMonitor


MONITOR_MISTAKES = {  # mistake: (what the message says, a word of the hint)
    "grad norm": (r"SGD\(lr=.* update_ratios\['inp.weight'\] = .*: the ratio of the gradient's norm", "θ now − θ"),
    "lr times grad": (r"lr·‖g‖/‖θ‖, the step plain SGD would take", "not lr·g"),
    "norm after": (r"weight_decay=.* ‖Δθ‖/‖θ_after‖: divide by the weights from before", "‖θ_before‖"),
    "squared": (r"the squared ratio: take the square root", "no squares left"),
    "copy after": (r"every ratio is 0: the copy was taken after the update", "compare first"),
    "copy at watch": (r"at the log of update 2 .* the ratio since watch, not since the last log", "again at the end"),
    "last update": (r"logging every [23] updates, at the log of update [23] .* the last update's ratio only",
                    "θ at the last log"),
    "global": (r"the global ratio of all tensors in every tensor's place", "of that tensor alone"),
    "bf16 norm": (r"on a bfloat16 model.* a norm summed in bfloat16", "dtype=torch.float32"),
    "frozen watched": (r"update_ratios has 'inp\.(weight|bias)', which is frozen \(requires_grad=False\)",
                       "never moves"),
    "unused skipped": (r"update_ratios has no 'spare', a parameter that requires grad", "moved 0"),
    "grad at watch": (r"update_ratios is empty after \d logs: .* at watch no parameter has a .grad yet", "moved 0"),
    "zero inf": (r"= inf, expected nan .* this tensor was all zeros before the update", "records NaN"),
    "zero divides": (r"log raised ZeroDivisionError \(float division by zero\) at update 1", "records NaN"),
    "mean of ratios": (r"history\['update_ratio'\] at update 1 is .*: the mean of the tensors' ratios", "Σ‖Δθ‖²"),
    "norms summed": (r"Σ‖Δθ‖ / Σ‖θ‖, the norms summed", "Σ‖Δθ‖²"),
    "squared global": (r"the squared global ratio", "Σ‖Δθ‖²"),
    "history": (r"history has no 'loss', a metric log was given: record every one", "every metric"),
}


# --- the tables: tests/test_checks_answers.py runs each once, tools/flake.py N times ------------------------------

ANSWERS = [
    Reference(ch06.warmup_cosine, warmup_cosine()),
    Reference(ch06.warmup_cosine, warmup_cosine(shift=0)),  # LR 0 at update 0, then the same line
    Reference(ch06.warmup_cosine, warmup_cosine("float32")),
    Reference(ch06.warmup_cosine, llmlab_schedule),  # llmlab's own, the reference
    *[Mistake(ch06.warmup_cosine, warmup_cosine(mistake, shift), match=match, hint=hint)
      for mistake, (match, hint, shifts) in SCHEDULE_MISTAKES.items() for shift in shifts],
    Mistake(ch06.warmup_cosine, lambda optimizer, **_: "sched", match=r"built a str, not a torch.optim.lr_scheduler",
            hint="super().__init__(optimizer, last_epoch)"),

    Reference(ch06.clip_grad_norm, clip),
    Reference(ch06.clip_grad_norm, torch.nn.utils.clip_grad_norm_),
    Reference(ch06.clip_grad_norm, clip_grad_norm),  # llmlab's
    *[Mistake(ch06.clip_grad_norm, lambda ps, max_norm, m=mistake: clip(ps, max_norm, mistake=m), match=match,
              hint="max_norm / (norm + 1e-6)") for mistake, match in CLIP_MISTAKES.items()],
    Mistake(ch06.clip_grad_norm, stacked,
            match=r"no parameter has a gradient and your code raised RuntimeError: .*the norm of no gradients is 0",
            hint="√(Σ"),

    Reference(ch06.scaled_step, scaled_step),
    *[Mistake(ch06.scaled_step, lambda *args, m=mistake: scaled_step(*args, mistake=m), match=match,
              hint="scaler.unscale_(grads)") for mistake, match in STEP_MISTAKES.items()],

    Reference(ch06.update_monitor, update_monitor()),
    Reference(ch06.update_monitor, update_monitor("float64")),
    Reference(ch06.update_monitor, lambda: Monitor(peak=None)),  # llmlab's own, the reference
    *[Mistake(ch06.update_monitor, update_monitor(mistake), match=match, hint=hint)
      for mistake, (match, hint) in MONITOR_MISTAKES.items()],
]


@pytest.mark.parametrize("check", [ch06.clip_grad_norm, ch06.scaled_step])
def test_an_unwritten_answer_is_not_attempted(check, capsys):
    not_attempted(check, unwritten, capsys=capsys)


class UnwrittenScheduler(LRScheduler):  # the generated exercise's class: every method raises
    def __init__(self, optimizer, warmup, total, min_lr_ratio=0.0, last_epoch=-1):
        raise NotImplementedError("Exercise 6.1")

    def get_lr(self):
        raise NotImplementedError("Exercise 6.1")


def test_an_unwritten_scheduler_is_not_attempted(capsys):
    not_attempted(ch06.warmup_cosine, UnwrittenScheduler, capsys=capsys)


class UnwrittenMonitor:  # the generated exercise's class: every method raises
    def __init__(self):
        raise NotImplementedError("Exercise 6.4")


def test_an_unwritten_monitor_is_not_attempted_at_once(capsys, monkeypatch):
    taken = cases_taken(monkeypatch, ch06_monitor)
    not_attempted(ch06.update_monitor, UnwrittenMonitor, capsys=capsys)
    assert len(taken) <= 1


def test_every_lr_mistake_differs_by_far_more_than_the_float32_tolerance():
    """The tolerance accepts float32 answers (ch06_schedule._TOL); each planted slip of the schedule must still be
    seen: on the first run of 200 draws of the check's (where each of them is named), its largest difference over
    the run, relative to the base LR, is ≥ 50× the tolerance."""
    import random

    for seed in range(200):
        run = ch06_schedule._runs(random.Random(seed))[0]
        for mistake in ("ramp too long", "to zero", "over total", "one too long", "no clamp"):
            for shift in SCHEDULE_MISTAKES[mistake][2]:
                for base in run.lrs:
                    args = base, run.warmup, run.total, run.ratio
                    gap = max(abs(lr(s, *args, mistake=mistake, shift=shift) - lr(s, *args, shift=shift))
                              for s in range(run.total + 3))
                    assert gap >= 50 * ch06_schedule._TOL * base, (mistake, shift, run, gap)


def test_a_float32_answer_passes(capsys):
    ch06.warmup_cosine(warmup_cosine("float32"))
    assert "passed" in capsys.readouterr().out


def test_the_solution_scheduler_drives_adamw_as_llmlabs_schedule_does():
    """The exercise's claim: WarmupCosine drives a real optimizer. AdamW on a small model under the solution's
    scheduler and under llmlab's LRSchedule in LambdaLR takes the same LRs and ends at the same weights."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(16, 4), torch.randn(16, 3)
    ends = []
    for make in (warmup_cosine(), llmlab_schedule):
        net = copy.deepcopy(model)
        optimizer = torch.optim.AdamW([{"params": [net.weight], "lr": 1e-2}, {"params": [net.bias], "lr": 3e-3}])
        scheduler, lrs = make(optimizer, warmup=3, total=12, min_lr_ratio=0.1), []
        for _ in range(12):
            lrs.append([g["lr"] for g in optimizer.param_groups])
            torch.nn.functional.mse_loss(net(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        ends.append((lrs, [p.detach().clone() for p in net.parameters()]))
    for mine, ref in zip(ends[0][0], ends[1][0], strict=True):  # each update's LRs, group by group
        assert mine == pytest.approx(ref, rel=1e-12)
    assert ends[0][0][0] == pytest.approx([1e-2 / 3, 3e-3 / 3])  # update 0 already moves the weights
    for mine, ref in zip(ends[0][1], ends[1][1], strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-7)


def test_the_monitor_tolerance_has_a_margin(monkeypatch):
    """ch06_monitor._TOL (2e-4) has room both ways: the right answers (float32 and float64 sums, llmlab's own) pass
    at a tenth of it, and every named mistake but a norm summed in bf16 (off by ≤ 2⁻⁹, ~10×) is named at 10× it."""
    from check_answers import judge

    from llmlab.checks import ch06_monitor

    monkeypatch.setattr(ch06_monitor, "_TOL", ch06_monitor._TOL / 10)
    for answer in [a for a in ANSWERS if a.check is ch06.update_monitor and isinstance(a, Reference)] * 10:
        assert judge(answer) == ""
    monkeypatch.setattr(ch06_monitor, "_TOL", ch06_monitor._TOL * 100)
    for mistake, (match, hint) in MONITOR_MISTAKES.items():
        if mistake != "bf16 norm":
            assert judge(Mistake(ch06.update_monitor, update_monitor(mistake), match=match, hint=hint)) == ""


def test_the_solution_monitor_follows_a_trainer_as_llmlabs_does():
    """The exercise says `Trainer(monitor=UpdateMonitor())` works: under llmlab's Trainer (which calls watch with
    precision= and devices=, and log after zeroing the gradients, every log_interval updates) the solution records
    what llmlab's Monitor records."""
    from llmlab.train import TrainConfig, Trainer

    mine, ref = update_monitor()(), Monitor(peak=None)

    class Both:  # the Trainer takes one monitor: hand both the same calls
        def watch(self, model, **options):
            mine.watch(model, **options)
            ref.watch(model, **options)

        def log(self, step, metrics):
            mine.log(step, dict(metrics))
            ref.log(step, dict(metrics))

    config = TrainConfig.preset("tiny", steps=6, warmup=2, batch_size=4, block_size=8, log_interval=2)
    Trainer(config=config, monitor=Both(), progress=False).fit()
    assert mine.update_ratios.keys() == ref.update_ratios.keys()
    for name, ratios in ref.update_ratios.items():
        assert [s for s, _ in mine.update_ratios[name]] == [2, 4, 6]
        assert [r for _, r in mine.update_ratios[name]] == pytest.approx([r for _, r in ratios], rel=1e-6, nan_ok=True)
    assert mine.history.keys() == ref.history.keys() >= {"loss", "grad_norm", "update_ratio"}
    for key, values in ref.history.items():
        assert [s for s, _ in mine.history[key]] == [s for s, _ in values]
        assert [v for _, v in mine.history[key]] == pytest.approx([v for _, v in values], rel=1e-6)
