"""Chapter 6's exercise checks (llmlab.checks.ch06): each passes a right answer, reports an unwritten one as not
attempted, and fails each plausible wrong answer with a message naming the mistake — a ramp past peak_lr, a
decay to 0, per-tensor clipping, the norm after clipping, clipping before unscaling — and the hint.

The wrong answers are the right one with one thing changed (a `mistake` argument), so each test shows the one
slip its message names.
"""

import math
import time

import pytest
import torch
from check_answers import Mistake, Reference
from grading import not_attempted

from llmlab.checks import ch06
from llmlab.monitor import Monitor
from llmlab.train.clip import clip_grad_norm
from llmlab.train.schedule import material_warmup_lr, warmup_cosine_lr


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny tensors: one thread is faster, and steadier when other processes share the cores."""


def unwritten(*args):
    raise NotImplementedError("Exercise 6.x")


# --- 6.1 ----------------------------------------------------------------------------------------------------

def lr_at(step, peak_lr, warmup, total, min_lr, mistake=None, shift=1):
    """Linear warmup then cosine decay, written out; `mistake` changes one thing. `shift` 1: llmlab's ramp,
    (step + 1)/warmup; 0: the ramp from LR 0 at update 0, step/warmup (the material's, Hugging Face's)."""
    if step < warmup or (mistake == "ramp too long" and step == warmup > 0):
        return peak_lr * (step + shift) / (total if mistake == "over total" else warmup)
    span = total - (0 if mistake == "one too long" else 1) - (0 if mistake == "from zero" else warmup)
    start = 0 if mistake == "from zero" else warmup
    if mistake == "unguarded":
        progress = min((step - start) / span, 1.0)
    elif mistake == "span at least 1":  # a guard against dividing by 0 that leaves progress 0 where no span is left
        progress = min((step - start) / max(1, span), 1.0)
    elif mistake == "zero span only":
        progress = min((step - start) / span, 1.0) if span != 0 else 1.0
    else:
        progress = (step - start) / span if span > 0 else 1.0
        progress = progress if mistake == "no clamp" else min(progress, 1.0)
    floor = 0.0 if mistake == "to zero" else min_lr
    return floor + (peak_lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


LR_MISTAKES = {  # mistake: (what the message says, a word of the hint)
    "ramp too long": (r"step=10, .*the ramp runs one update too long: update warmup is above peak_lr",
                      "(step + 1)/warmup"),
    "over total": (r"the ramp divides by total, not warmup", "(step + 1)/warmup"),
    "from zero": (r"the cosine starts at update 0, not at the end of warmup", "progress = min((step − warmup)"),
    "to zero": (r"the LR decays to 0, not to min_lr", "min_lr + (peak_lr − min_lr)"),
    "one too long": (r"the decay is one update too long, so the last update \(total − 1\) ends above min_lr",
                     "total − 1 − warmup"),
    "no clamp": (r"step=\d+, .*after the last update the LR rises again along the cosine: clamp progress at 1",
                 "), 1)"),
    "unguarded": (r"warmup=9, total=10.*divided by zero: with warmup = total − 1 no update is left to decay over",
                  "1 when total − 1 − warmup ≤ 0"),
    "span at least 1": (r"warmup=9, total=10.* = 0.001, expected 0.0001 \(relative difference 0.9\): with warmup = "
                        r"total − 1 no update is left .* max\(1, total − 1 − warmup\) makes progress 0",
                        "1 when total − 1 − warmup ≤ 0"),
    "zero span only": (r"warmup=20, total=20.*this run is all warmup \(warmup = total\), so total − 1 − warmup is "
                       "negative", "1 when total − 1 − warmup ≤ 0"),
}


def material(step, peak_lr, warmup, total, min_lr):  # the material's own warmup, then llmlab's decay
    return material_warmup_lr(step, peak_lr, warmup) if step < warmup else \
        warmup_cosine_lr(step, peak_lr, warmup, total, min_lr)


def hugging_face(step, peak_lr, warmup, total, min_lr):
    """transformers' get_cosine_with_min_lr_schedule_with_warmup ramp, current_step / max(1, num_warmup_steps),
    (transformers, src/transformers/optimization.py), on llmlab's decay (which ends at update total − 1)."""
    return peak_lr * step / max(1, warmup) if step < warmup else warmup_cosine_lr(step, peak_lr, warmup, total, min_lr)


def mixed(step, peak_lr, warmup, total, min_lr):  # LR 0 at update 0, then llmlab's ramp: not one line
    return 0.0 if step == 0 < warmup else lr_at(step, peak_lr, warmup, total, min_lr)


def float32(step, peak_lr, warmup, total, min_lr):
    """The definition computed in float32 throughout (torch tensors): right, within float32's rounding."""
    lr = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    peak, floor = lr(peak_lr), lr(min_lr)
    if step < warmup:
        return peak * (step + 1) / warmup
    span = total - 1 - warmup
    progress = lr(min((step - warmup) / span, 1.0) if span > 0 else 1.0)
    return floor + (peak - floor) * 0.5 * (1 + torch.cos(math.pi * progress))


def ramp_first(step, peak_lr, warmup, total, min_lr):
    ramp = (step + 1) / warmup  # computed before asking whether step < warmup
    return peak_lr * ramp if step < warmup else lr_at(step, peak_lr, warmup, total, min_lr)


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
    Reference(ch06.lr_at, lr_at),
    Reference(ch06.lr_at, warmup_cosine_lr),  # llmlab's own, the reference
    Reference(ch06.lr_at, lambda *args: lr_at(*args, shift=0)),  # LR 0 at update 0, then the same line
    Reference(ch06.lr_at, material),  # the material's own warmup, then llmlab's decay
    Reference(ch06.lr_at, hugging_face),
    Reference(ch06.lr_at, float32),
    *[Mistake(ch06.lr_at, lambda *args, m=mistake, s=shift: lr_at(*args, mistake=m, shift=s), match=match, hint=hint)
      for mistake, (match, hint) in LR_MISTAKES.items()
      for shift in ((1,) if mistake == "ramp too long" else (1, 0))],  # the same slips on either ramp (from 0, a
    # ramp one update longer ends at peak_lr·warmup/warmup, which is right unless no decay span is left)
    Mistake(ch06.lr_at, mixed, match=r"lr_at\(step=1, .* = 0.0002, expected 0.0001 \(relative difference 0.1\): "
                                     r"update 0 had LR 0, .* keep to one",
            hint="(step + 1)/warmup"),
    Mistake(ch06.lr_at, ramp_first, match="warmup=0 means no warmup", hint="(step + 1)/warmup"),
    Mistake(ch06.lr_at, lambda *args: "high", match=r"returned 'high'; expected a number", hint="cos(π·progress)"),

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


@pytest.mark.parametrize("check", [ch06.lr_at, ch06.clip_grad_norm, ch06.scaled_step])
def test_an_unwritten_answer_is_not_attempted(check, capsys):
    not_attempted(check, unwritten, capsys=capsys)


class UnwrittenMonitor:  # the generated exercise's class: every method raises
    def __init__(self):
        raise NotImplementedError("Exercise 6.4")


def test_an_unwritten_monitor_is_not_attempted_at_once(capsys):
    start = time.perf_counter()
    not_attempted(ch06.update_monitor, UnwrittenMonitor, capsys=capsys)
    assert time.perf_counter() - start < 1.0


def test_every_lr_mistake_differs_by_far_more_than_the_float32_tolerance():
    """The tolerance accepts float32 answers (ch06._LR_TOL); each planted slip must still be seen: where it changes
    a run at all, its largest difference over the run, relative to peak_lr, is ≥ 50× the tolerance, in every case
    of 200 draws of the check's."""
    import random

    for seed in range(200):
        for peak, warmup, total, floor in ch06._lr_cases(random.Random(seed)):
            for mistake in LR_MISTAKES.keys() - {"unguarded", "zero span only"}:  # these raise, or differ by ~peak
                for shift in (1, 0):
                    gap = max(abs(lr_at(s, peak, warmup, total, floor, mistake=mistake, shift=shift)
                                  - lr_at(s, peak, warmup, total, floor, shift=shift)) for s in range(total + 3))
                    if gap > 1e-12 * peak:  # else this run does not show the slip (no decay to show a floor, ...)
                        assert gap >= 50 * ch06._LR_TOL * peak, (mistake, shift, peak, warmup, total, floor, gap)


def test_a_float32_answer_passes(capsys):
    ch06.lr_at(float32)
    assert "passed" in capsys.readouterr().out


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
