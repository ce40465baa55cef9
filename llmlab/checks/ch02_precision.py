"""Check 2.3 (solutions/02_parallelism.ipynb): fp16 training with fp32 master weights and a dynamic loss scaler.

    from llmlab.checks import ch02 as check
    check.fp16_training(LossScaler, fp16_step)    # 2.3, against llmlab.precision.MixedPrecision

The learner writes the recipe of Micikevicius et al. 2018 (§3) that `llmlab.precision` implements:
`LossScaler(init_scale, growth_factor, backoff_factor, growth_interval)` with `.scale`, `scale_loss(loss)`,
`unscale_(grads)` → found_inf and `update(found_inf)` (DynamicLossScaler's, and torch.amp.GradScaler's, rule), and
`fp16_step(model, masters, optimizer, scaler, loss)` → True if the optimizer stepped: the scaled backward through
the fp16 model, its gradients copied into the fp32 masters and unscaled there, the step skipped on inf/NaN, else
the optimizer's step and the masters copied back into the fp16 model; then the scale updated.

Each case trains a small MLP of random widths on fresh random batches twice, step by step: the learner's
`fp16_step` on an fp16 copy with its fp32 masters and an AdamW over them, and `llmlab.precision.MixedPrecision`
on another copy with a `DynamicLossScaler` of the same settings. The loss is 2⁻¹⁰ × the mean squared error, so
that unscaled fp16 gradients would sit among fp16's subnormals. Some steps are planted overflows — a huge loss
(× 2¹⁰⁰ in fp32: the fp16 gradients become inf) or a NaN loss — and the default init_scale 2¹⁶, which is inf in
fp16, overflows by itself. After every step the check compares: the masters' gradients when `optimizer.step()`
runs (seen by a step pre-hook, and whether it runs at all), the value returned, the scale, the masters and the
fp16 model's weights; gradients left in the fp16 model show in the next step's. The scripted cases come first, so
each known mistake is met where the check can name it: the scale grown on an overflow step, grown one step late,
the count of clean steps not restarted after an overflow, the optimizer stepped on an overflow step, the gradients
not unscaled, unscaled twice or in fp16, copied without `.float()`, the masters not copied back, the fp16
gradients left behind by a skipped step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmlab.checks import Hint, Mismatch, assert_close, check, fresh_rng, number
from llmlab.precision import DynamicLossScaler, MixedPrecision

__all__ = ["fp16_training"]

LOSS_FACTOR = 2.0**-10  # the loss's own scale: unscaled, its fp16 gradients would be subnormal or 0
HUGE = 2.0**100  # a planted overflow: the loss × HUGE is finite in fp32, its gradient is inf in fp16
KINDS = {"c": "a clean loss", "h": "a huge loss (× 2^100)", "n": "a NaN loss"}  # the steps of a case's plan

_FORMULA = ("scaler.scale_loss(loss).backward() (loss.float() × S); for each fp16 parameter p and its master m: "
            "m.grad = p.grad.float(), p.grad = None; found_inf = scaler.unscale_(the masters' grads) (each × 1/S "
            "in place, then: any inf or NaN?); scaler.update(found_inf); if not found_inf: optimizer.step(), then "
            "p.copy_(m) for each pair under torch.no_grad(); optimizer.zero_grad(); return not found_inf")
_HINTS = {
    "update": Hint(
        nudge="take the two kinds of step in turn: what must happen to the scale and the count of clean steps on an "
              "overflow step, and what on a clean one?",
        idea="an overflow shrinks the scale and restarts the count of clean steps; only a run of growth_interval "
             "clean steps in a row grows it, after which the count restarts",
        formula="in update(found_inf): on an overflow step multiply the scale by backoff_factor and reset the "
                "count to 0 — never grow; on a clean step add 1 to the count, and when it reaches growth_interval "
                "multiply the scale by growth_factor and reset the count to 0"),
    "skip": Hint(
        nudge="follow an overflow step through your fp16_step: which of its parts must not run when the gradients "
              "hold inf or NaN?",
        idea="an overflow step is skipped: no optimizer step and no copy back, only the scale backs off; and its "
             "gradients are cleared, or the next backward adds to them",
        formula=_FORMULA),
    "grads": Hint(
        nudge="look at the masters' .grad when optimizer.step() runs: by what factor do they differ from the fp16 "
              "model's .grad, and in which precision was that division done?",
        idea="the fp16 gradients are those of the scaled loss, S × the true ones: copy them into fp32 (.float()) "
             "and divide them by S there, once — in fp16 the small ones would underflow",
        formula=_FORMULA),
    "copy back": Hint(
        nudge="after optimizer.step(), which copy of the weights has changed: the fp32 masters, the fp16 model, or "
              "both?",
        idea="the optimizer updates the fp32 masters only; the next forward runs on the fp16 model, so every step "
             "that ran ends by copying each master into its fp16 parameter",
        formula=_FORMULA),
}


@dataclass(frozen=True)
class _Case:
    sizes: tuple[int, int, int]  # the MLP: Linear(sizes[0], sizes[1]), tanh, Linear(sizes[1], sizes[2])
    rows: int  # the batch
    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    plan: str  # per step, a key of KINDS
    lr: float  # AdamW's
    seed: int

    @property
    def scaler_args(self) -> dict:
        return dict(init_scale=self.init_scale, growth_factor=self.growth_factor, backoff_factor=self.backoff_factor,
                    growth_interval=self.growth_interval)

    def __str__(self):
        kinds = ", ".join(f"{k} {text}" for k, text in KINDS.items())
        return (f"'{self.plan}' ({kinds}; init_scale={self.init_scale:g}, growth_factor={self.growth_factor:g}, "
                f"backoff_factor={self.backoff_factor:g}, growth_interval={self.growth_interval})")


def _cases(rng: random.Random) -> list[_Case]:
    def case(init, growth, backoff, interval, plan):
        sizes = (rng.randint(2, 9), rng.randint(3, 16), rng.randint(1, 5))
        return _Case(sizes, rng.randint(2, 12), init, growth, backoff, interval, plan, rng.uniform(3e-3, 3e-2),
                     rng.randrange(2**31))

    cases = [case(2.0**16, 2.0, 0.5, 2000, "cccc"),  # the defaults: 2^16 is inf in fp16, the first step overflows
             case(2.0**8, 2.0, 0.5, 3, "ccccccccc"),  # growth every 3 clean steps
             case(2.0**8, 2.0, 0.5, 3, "hcccnccccchhccc"),  # an overflow restarts the count: step 10 comes 3 after
             case(2.0**4, 4.0, 0.25, 1, "cncnhcc")]  # growth_interval 1: grow after every clean step
    for _ in range(4):  # the scales powers of 2 (so ÷ S is exact); a long run of growth overflows by itself
        p_overflow = rng.choice([0.1, 0.3])
        plan = "".join(rng.choice("hn") if rng.random() < p_overflow else "c" for _ in range(rng.randint(8, 20)))
        cases.append(case(2.0 ** rng.randint(0, 12), rng.choice([2.0, 4.0]), rng.choice([0.5, 0.25]),
                          rng.randint(1, 5), plan))
    return cases


def _model(case: _Case) -> torch.nn.Sequential:
    """The case's fp32 MLP: the same weights each time, from the case's seed."""
    n_in, hidden, n_out = case.sizes
    model = torch.nn.Sequential(torch.nn.Linear(n_in, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, n_out))
    gen = torch.Generator().manual_seed(case.seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model


def _loss(model, case: _Case, step: int) -> torch.Tensor:
    """Step `step`'s loss of the fp16 `model`: LOSS_FACTOR × the MSE on the step's batch, made huge or NaN on a
    planted overflow step."""
    gen = torch.Generator().manual_seed(case.seed * 7919 + step + 1)
    x = torch.randn(case.rows, case.sizes[0], generator=gen).half()  # (rows, in)
    y = torch.randn(case.rows, case.sizes[2], generator=gen).half()  # (rows, out)
    loss = LOSS_FACTOR * F.mse_loss(model(x), y)  # fp16, ×2⁻¹⁰ exact
    kind = case.plan[step]
    return loss.float() * HUGE if kind == "h" else loss * float("nan") if kind == "n" else loss


class _Run:
    """One of the two copies of a case's training: its fp16 model, fp32 masters and AdamW, whose step pre-hook
    keeps the masters' gradients each time optimizer.step() runs."""

    def __init__(self, case: _Case, scaler=None):
        model = _model(case)
        if scaler is None:  # llmlab's: MixedPrecision makes the masters and halves the model
            self.mp = MixedPrecision(model, lambda ps: torch.optim.AdamW(ps, lr=case.lr),
                                     scaler=DynamicLossScaler(**case.scaler_args))
            self.masters, self.optimizer, scaler = self.mp.masters, self.mp.optimizer, self.mp.scaler
        else:  # the learner's: the same, made here as MixedPrecision makes them
            self.masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
            self.optimizer = torch.optim.AdamW(self.masters, lr=case.lr)
            model.half()
        self.model, self.scaler = model, scaler
        self.steps: list[list] = []  # per optimizer.step() this training step: the masters' .grad then
        self.optimizer.register_step_pre_hook(lambda *_: self.steps.append(
            [None if m.grad is None else m.grad.clone() for m in self.masters]))


def _stepped(value, what: str) -> bool:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, bool):
        raise Mismatch(f"{what}: returned {value!r:.60}; expected True if the optimizer stepped, False if the step "
                       "was skipped")
    return value


def _run_step(fp16_step, ours: _Run, case: _Case, step: int, what: str) -> bool:
    try:
        return _stepped(fp16_step(ours.model, ours.masters, ours.optimizer, ours.scaler,
                                  _loss(ours.model, case, step)), what)
    except RuntimeError as e:
        if "assign a gradient with dtype" not in str(e):
            raise
        raise Mismatch(f"{what}: your code raised RuntimeError: {str(e).split('.')[0]} — the masters are fp32 and "
                       "the model's gradients fp16: copy them into the masters with .float()", mistake="float",
                       hint=_HINTS["grads"]) from None


def _check_optimizer_steps(got: list, want: list, scale: float, what: str) -> None:
    """The masters' gradients at each optimizer.step() of this training step: the learner's against llmlab's."""
    if len(got) > len(want):
        if not want:
            raise Mismatch(f"{what}: optimizer.step() ran on an overflow step, with inf/NaN in the gradients: an "
                           "overflow step must be skipped", mistake="steps on overflow", hint=_HINTS["skip"])
        raise Mismatch(f"{what}: optimizer.step() ran {len(got)} times; once per clean step")
    if len(got) < len(want):
        raise Mismatch(f"{what}: optimizer.step() did not run, but every gradient was finite: only a step whose "
                       "unscaled gradients hold inf or NaN is skipped", mistake="skips", hint=_HINTS["skip"])
    for grads, wanted in zip(got, want, strict=True):
        for i, (g, w) in enumerate(zip(grads, wanted, strict=True)):
            where = f"{what}: master {i}'s .grad when optimizer.step() ran"
            if g is None:
                raise Mismatch(f"{where} is None: copy the fp16 model's gradients into the masters' .grad",
                               mistake="grads", hint=_HINTS["grads"])
            try:
                # exact: the same fp16 backward, .float() exact, and ÷ S the same exact exponent shift as × 1/S
                # (every scale is a power of 2); a named mistake is off by a factor S or loses fp16 subnormal bits
                assert_close(g, w, what=where, rtol=0, atol=0)
            except Mismatch as e:
                raise Mismatch(f"{e}{_grads_diagnosis(g, w, scale)}", mistake="grads", hint=_HINTS["grads"]) \
                    from None


def _grads_diagnosis(got: torch.Tensor, want: torch.Tensor, scale: float) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return ""
    known = {f"S = {scale:g} × the right one: unscale the gradients (÷ S)": want * scale,
             f"the right one ÷ S = {scale:g}: the gradients were unscaled twice": want / scale,
             "unscaled in fp16: the small ones lost bits among fp16's subnormals — copy them into fp32 (.float()) "
             "first, then divide by S": ((want * scale).half() / scale).float()}
    for text, value in known.items():
        if torch.equal(got, value) and not torch.equal(value, want):
            return f": it is {text}"
    return ""


def _check_scale(got: float, want: float, before: float, clean_steps: int, since_growth: int, found_inf: bool,
                 interval: int, what: str) -> None:
    if got == want:  # powers of 2: exact
        return
    head = f"{what}: the scale is {got:g} after it, DynamicLossScaler's {want:g}"
    if found_inf and got > before:
        text = "the scale grew on an overflow step — an inf/NaN gradient means the scale is too large"
    elif found_inf and got == before:
        text = "the scale did not back off on an overflow step"
    elif not found_inf and got < before:
        text = "the scale shrank on a clean step"
    elif not found_inf and want > before and got == before:
        text = (f"this is the growth_interval-th ({interval}) clean step in a row — grow now, when the count "
                "reaches growth_interval, not one step later")
    elif not found_inf and got > before and since_growth + 1 == interval:
        text = (f"it grew {clean_steps + 1} clean step(s) after the last overflow: the count of clean steps must "
                "restart from 0 after an overflow")
    elif not found_inf and got > before:
        text = f"it grew after {clean_steps + 1} clean step(s) in a row; growth_interval is {interval}"
    else:
        text = "the update rule differs"
    raise Mismatch(f"{head}: {text}", mistake="update", hint=_HINTS["update"])


def _check_weights(ours: _Run, ref: _Run, before: list[torch.Tensor], what: str) -> None:
    # exact: AdamW does the same fp32 operations on the same gradients, and p.copy_(m) rounds to fp16 as MixedPrecision
    for i, (m, w) in enumerate(zip(ours.masters, ref.masters, strict=True)):
        assert_close(m, w, what=f"{what}: master {i}", rtol=0, atol=0)
    for i, (p, w, old) in enumerate(zip(ours.model.parameters(), ref.model.parameters(), before, strict=True)):
        try:
            assert_close(p, w, what=f"{what}: the fp16 model's parameter {i}", rtol=0, atol=0)
        except Mismatch as e:
            if torch.equal(p.detach(), old) and not torch.equal(w.detach(), old):
                raise Mismatch(f"{e}: the fp16 model still holds its weights from before the step — copy the "
                               "masters back into it after optimizer.step()", mistake="copy back",
                               hint=_HINTS["copy back"]) from None
            raise Mismatch(str(e), mistake="copy back", hint=_HINTS["copy back"]) from None


@check("2.3", "fp16 training with a dynamic loss scaler", hint=Hint(
    nudge="run a few steps by hand and print, after each, the scale, whether the optimizer stepped, and a master "
          "weight beside the fp16 one: where does your step part from the recipe?",
    idea="scaled backward in fp16; gradients into fp32 masters and ÷ S there; on inf/NaN skip (the scale backs "
         "off); else step the masters and copy them back to fp16; the scale grows after growth_interval clean steps",
    formula=_FORMULA))
def fp16_training(scaler_cls, fp16_step):
    """`scaler_cls(init_scale, growth_factor, backoff_factor, growth_interval)`, with `.scale`;
    `fp16_step(model, masters, optimizer, scaler, loss)` → True if the optimizer stepped, False if skipped."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny fp16 matmuls: with a second thread one took ~5 ms here, alone ~5 µs
    try:
        for case in _cases(fresh_rng()):
            ref, ours = _Run(case), _Run(case, scaler_cls(**case.scaler_args))
            since_growth = 0  # clean steps since the scale last grew, overflows not counted (a counter never reset)
            for step in range(len(case.plan)):
                before = [p.detach().clone() for p in ours.model.parameters()]
                scale, clean_steps = ref.scaler.scale, ref.scaler.clean_steps
                what = f"step {step} of {case}, at scale {scale:g}"
                ref.steps.clear(), ours.steps.clear()
                ref.mp.backward(_loss(ref.model, case, step))
                want = ref.mp.step()
                leftover = any(p.grad is not None and bool(p.grad.any()) for p in ours.model.parameters())
                got = _run_step(fp16_step, ours, case, step, what)
                try:
                    _check_optimizer_steps(ours.steps, ref.steps, scale, what)
                except Mismatch as e:
                    if not leftover:
                        raise
                    raise Mismatch(f"{e}; the fp16 model's .grad still held the last step's gradients when this "
                                   "step's backward ran, which added to them — clear them on every step, skipped "
                                   "or not", mistake="leftover grads", hint=_HINTS["skip"]) from None
                if got != want:
                    raise Mismatch(f"{what}: fp16_step returned {got}; the step {'ran' if want else 'was skipped'}, "
                                   f"so {want}", mistake="skips", hint=_HINTS["skip"])
                _check_scale(number(ours.scaler.scale, f"{what}: scaler.scale"), ref.scaler.scale, scale, clean_steps,
                             since_growth, not want, case.growth_interval, what)
                _check_weights(ours, ref, before, what)
                since_growth = 0 if ref.scaler.scale > scale else since_growth + int(want)
    finally:
        torch.set_num_threads(threads)
