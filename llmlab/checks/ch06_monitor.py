"""Check 6.4 (re-exported by llmlab.checks.ch06): a training monitor's update/weight ratio.

    from llmlab.checks import ch06 as check
    check.update_monitor(UpdateMonitor)    # 6.4

The learner's class mirrors the update/weight ratio of `llmlab.monitor.Monitor`: `UpdateMonitor()` has `history`
(metric name → [(step, value), ...]) and `update_ratios` (parameter name → [(step, ratio), ...]);
`watch(model, **_)` keeps the parameters that require grad and copies their weights; `log(step, metrics)` records
every metric of `metrics`, adds "update_ratio" = √(Σ‖Δθ‖² / Σ‖θ_before‖²) over all watched tensors, appends each
tensor's ‖Δθ‖/‖θ_before‖ (NaN for a tensor that was all zeros) to `update_ratios`, and copies the weights again, so
that the next log measures the updates since this one. The cs231n notes (Karpathy, "Neural Networks Part 3",
https://cs231n.github.io/neural-networks-3/#ratio) put a healthy ratio "somewhere around 1e-3".

Every call trains fresh small models (`_Net`, odd random sizes) for a few updates with both the learner's monitor and
llmlab's `Monitor(peak=None)` watching the same model, and compares every metric the two recorded. The loop logs,
as the Trainer does, the loss, the LR and the gradient norm (`llmlab.train.grad_norm`) every `interval` updates,
right after `optimizer.step()` (the gradients are still in `.grad`). The cases, in order:

1. SGD with a large learning rate and weight decay (the weights shrink by lr·wd ≥ 2% per update), float32, every
   update logged, no all-zero tensor: ‖θ_after‖ differs from ‖θ_before‖ and lr·g from the update, so ratios
   measured against the wrong weights or read off the gradient show here first;
2. AdamW with a frozen first layer (requires_grad=False), a parameter the forward never uses (no .grad) and the
   LayerNorm's bias at its initial zeros;
3. SGD with momentum, logging every 2 or 3 updates (the ratio then spans the updates since the last log);
4. AdamW on a bfloat16 model (mixed precision's weights: a norm summed in bf16 keeps 3 digits), its weights drawn
   away from 0 (see _TOL);
5. two random draws of all of the above.

It names a ratio of the gradient's norm (or lr × it) instead of the update's, ‖Δθ‖/‖θ_after‖, squared norms, the
global ratio put in every tensor's place, a copy taken after the update (every ratio 0), a copy taken only at watch
(the ratio since the start), the last update only, a frozen parameter watched, an unused one skipped, inf or a
ZeroDivisionError for an all-zero tensor, a norm summed in bfloat16, a global ratio that is the mean of the tensors'
or Σ‖Δθ‖/Σ‖θ‖, and a metric left out of `history`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from torch import nn

from llmlab.checks import Hint, Mismatch, check, fresh_rng, number
from llmlab.monitor import Monitor
from llmlab.train.clip import grad_norm

__all__ = ["update_monitor"]

# Both monitors read the same tensors. θ − θ_before is exact in the parameter's dtype wherever the two weights are
# within a factor 2 of each other (Sterbenz's lemma), so it does not matter where a learner subtracts (in the dtype,
# in float32, in float64) but at weights an update moved across or near zero: in float32 those differ by ≤ 2⁻²⁴ of
# their share of the norm; in bfloat16 by up to 2⁻⁹ ≈ 2e-3 of it, as much as a norm rounded to bf16 (a mistake the
# check names), so the bf16 model's weights are drawn ≥ _AWAY from 0, and its updates (AdamW, lr ≤ 3.2e-3, one
# update per log: each change ≤ lr·|m̂|/√v̂ ≲ lr, plus half a bf16 ulp of the weight, < _AWAY/2) never come near
# it. What rounds then is the sum of squares: in float32 ≤ (n − 1)·2⁻²⁴ ≈ 1e-4 relative for n ≤ 1,600 values in
# the worst case, half that on the norm, and ≤ 4e-7 measured (torch sums in blocks; tests/test_checks_ch06.py
# runs the references at a tenth of this tolerance). So 2e-4 relative. Every named mistake differs by ≥ 10× that
# somewhere in the first case or in the case made for it (the same test runs each at 10× this tolerance), but a
# norm summed in bf16, which rounds by ≤ 2⁻⁹ ≈ 10× it.
_TOL = 2e-4
_AWAY = 0.05

_FORMULA = ("watch: params = {n: p for n, p in model.named_parameters() if p.requires_grad}, then copy their "
            "weights; log: for each tensor d² = ‖θ − θ_before‖², w² = ‖θ_before‖² (vector_norm(…, dtype="
            "torch.float32)), update_ratios[n].append((step, √(d²/w²) or NaN when w² = 0)); update_ratio = "
            "√(Σd²/Σw²); history[k].append((step, float(v))) for every metric and update_ratio; then copy the "
            "weights again")
_UPDATE = Hint(
    nudge="look at what your ratio's numerator measures: is it how far the weights moved, and since when?",
    idea="the update is the change of the weights themselves, θ now − θ at the last log (a copy taken in watch and "
         "again at the end of every log): with momentum, weight decay or Adam it is not lr·g, and a copy taken "
         "after the step has nothing left to compare",
    formula=_FORMULA)
_NORM = Hint(
    nudge="look at what you divide by and how you combine the norms",
    idea="each tensor's ratio is ‖Δθ‖ / ‖θ_before‖, two plain L2 norms (no squares left), of that tensor alone; the "
         "global update_ratio treats all watched tensors as one vector: √(Σ‖Δθ‖² / Σ‖θ_before‖²)",
    formula=_FORMULA)
_PARAMS = Hint(
    nudge="look at which parameters you watch",
    idea="llmlab's Monitor watches every parameter that requires grad — those the optimizer may move — whether or "
         "not it got a gradient this update (an unused one moved 0); a frozen one (requires_grad=False) never "
         "moves and is left out, of update_ratios and of the global ratio",
    formula=_FORMULA)
_ZERO = Hint(
    nudge="look at a tensor whose weights were all zeros before the update (a LayerNorm's bias at initialisation)",
    idea="‖θ_before‖ = 0 gives the tensor no scale to compare with: its ratio is undefined, and llmlab records NaN "
         "(the global ratio still counts its ‖Δθ‖²)",
    formula=_FORMULA)
_DTYPE = Hint(
    nudge="look at the dtype your norms are summed in on a bfloat16 model",
    idea="vector_norm of a bfloat16 tensor returns bfloat16: about 3 significant digits; sum in float32 at least",
    formula=_FORMULA)
_HISTORY = Hint(
    nudge="look at what log keeps in history",
    idea="history keeps every metric log is given (the Trainer's loss, lr, grad_norm, …) as (step, value) pairs, "
         "and the update_ratio beside them",
    formula=_FORMULA)


@dataclass(frozen=True)
class _Case:
    optimizer: str  # "SGD" or "AdamW"
    lr: float
    weight_decay: float
    momentum: float  # SGD's
    interval: int  # log every `interval` updates
    logs: int
    frozen: bool  # the first layer has requires_grad=False
    unused: bool  # a parameter the forward never uses
    zero: bool  # the LayerNorm's bias left at its initial zeros
    dtype: torch.dtype

    def __str__(self) -> str:
        options = f"lr={self.lr:.3g}, weight_decay={self.weight_decay:g}" + (
            f", momentum={self.momentum:g}" if self.momentum else "")
        every = "every update" if self.interval == 1 else f"every {self.interval} updates"
        return f"{self.optimizer}({options}) on a {str(self.dtype).removeprefix('torch.')} model, logging {every}"


def _cases(rng: random.Random) -> list[_Case]:
    """The cases of the module docstring, in its order."""
    f32 = torch.float32
    cases = [_Case("SGD", rng.uniform(0.2, 0.5), rng.uniform(0.1, 0.3), 0.0, 1, 3, False, False, False, f32),
             _Case("AdamW", 10 ** rng.uniform(-3, -2), rng.choice((0.0, 0.1)), 0.0, 1, 3, True, True, True, f32),
             _Case("SGD", 10 ** rng.uniform(-2, -1), rng.choice((0.0, 0.01)), 0.9, rng.choice((2, 3)), 2, False,
                   True, True, f32),
             _Case("AdamW", 10 ** rng.uniform(-3, -2.5), 0.0, 0.0, 1, 2, False, False, False, torch.bfloat16)]
    for _ in range(2):
        adam = rng.random() < 0.5
        cases.append(_Case("AdamW" if adam else "SGD", 10 ** (rng.uniform(-3.5, -2) if adam else rng.uniform(-2.5, 0)),
                           rng.choice((0.0, 0.01, 0.1)), 0.0 if adam else rng.choice((0.0, 0.9)), rng.randint(1, 3),
                           rng.randint(2, 3), rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5, f32))
    return cases


class _Net(nn.Module):
    """inp → LayerNorm → tanh → head, and optionally `spare`, a parameter the forward never uses (no .grad)."""

    def __init__(self, d_in: int, hidden: int, d_out: int, unused: bool):
        super().__init__()
        self.inp, self.norm, self.head = nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.Linear(hidden, d_out)
        self.spare = nn.Parameter(torch.randn(hidden)) if unused else None

    def forward(self, x):  # (B, d_in)
        return self.head(torch.tanh(self.norm(self.inp(x))))  # (B, d_out)


def _model(case: _Case, rng: random.Random) -> _Net:
    model = _Net(rng.randrange(3, 30, 2), rng.randrange(5, 40, 2), rng.randrange(1, 12, 2), case.unused)
    if not case.zero:
        with torch.no_grad():
            model.norm.bias.normal_(0.0, 0.1)  # else it stays at LayerNorm's zeros: ‖θ_before‖ = 0, ratio NaN
    if case.frozen:
        model.inp.requires_grad_(False)  # a frozen layer: watched by nobody
    if case.dtype == torch.bfloat16:  # every weight ≥ _AWAY from 0: each update's change is exact in bf16 (_TOL)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.where(p < 0, -1.0, 1.0) * p.abs().clamp(min=_AWAY))
    return model.to(case.dtype)


def _optimizer(case: _Case, params):
    if case.optimizer == "SGD":
        return torch.optim.SGD(params, lr=case.lr, momentum=case.momentum, weight_decay=case.weight_decay)
    return torch.optim.AdamW(params, lr=case.lr, weight_decay=case.weight_decay)


def _norm(t: torch.Tensor) -> float:
    return torch.linalg.vector_norm(t.double()).item()


def _div(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


class _Seen:
    """What the check itself saw of one log, per watched tensor (float64 norms of the parameter's-dtype
    differences), from which a named mistake's numbers are computed."""

    def __init__(self, now, last, start, pre, grads, lr):
        self.d = {n: _norm(now[n] - last[n]) for n in now}  # ‖θ − θ_last log‖
        self.w = {n: _norm(last[n]) for n in now}  # ‖θ_last log‖
        self.candidates = {
            "grad norm": {n: _div(grads[n], self.w[n]) for n in now if grads[n] is not None},
            "lr times grad": {n: _div(lr * grads[n], self.w[n]) for n in now if grads[n] is not None},
            "norm after": {n: _div(self.d[n], _norm(now[n])) for n in now},
            "squared": {n: _div(self.d[n] ** 2, self.w[n] ** 2) for n in now},
            "copy after": {n: _div(0.0, _norm(now[n])) for n in now},
            "copy at watch": {n: _div(_norm(now[n] - start[n]), _norm(start[n])) for n in now},
            "last update": {n: _div(_norm(now[n] - pre[n]), _norm(pre[n])) for n in now},
            "global": {n: self.ratio() for n in now},
        }
        if any(t.dtype == torch.bfloat16 for t in now.values()):  # in float32 this is the right ratio
            self.candidates["bf16 norm"] = {n: _div(torch.linalg.vector_norm(now[n] - last[n]).item(),
                                                    torch.linalg.vector_norm(last[n]).item()) for n in now}

    def ratio(self) -> float:
        return _div(math.sqrt(sum(v * v for v in self.d.values())), math.sqrt(sum(v * v for v in self.w.values())))

    def global_candidates(self) -> dict[str, float]:
        ratios = [_div(self.d[n], self.w[n]) for n in self.d]
        return {"mean of ratios": sum(ratios) / len(ratios),
                "norms summed": _div(sum(self.d.values()), sum(self.w.values())),
                "squared global": self.ratio() ** 2}


_TENSOR_MISTAKES = {  # mistake: (what it is, its hint)
    "grad norm": ("the ratio of the gradient's norm, ‖g‖/‖θ‖: the update/weight ratio divides the change of the "
                  "weights, θ − θ_before, by the weights", _UPDATE),
    "lr times grad": ("lr·‖g‖/‖θ‖, the step plain SGD would take: with momentum, weight decay or Adam the update is "
                      "not lr·g; measure θ − θ_before itself", _UPDATE),
    "norm after": ("‖Δθ‖/‖θ_after‖: divide by the weights from before the update, ‖θ_before‖ (the copy)", _NORM),
    "squared": ("‖Δθ‖²/‖θ‖², the squared ratio: take the square root (of each sum of squares)", _NORM),
    "copy after": ("every ratio is 0: the copy was taken after the update, so θ − θ_before is 0; compare first, then "
                   "copy the weights for the next log", _UPDATE),
    "copy at watch": ("the ratio since watch, not since the last log: copy the weights again at the end of every "
                      "log", _UPDATE),
    "last update": ("the last update's ratio only: llmlab's ratio spans every update since the last log (the copy "
                    "taken at the end of log, not before each step)", _UPDATE),
    "global": ("the global ratio of all tensors in every tensor's place: each tensor's ratio is its own ‖Δθ‖/‖θ‖",
               _NORM),
    "bf16 norm": ("a norm summed in bfloat16 (about 3 digits): pass dtype=torch.float32 to vector_norm (or .float() "
                  "first)", _DTYPE),
}
_GLOBAL_MISTAKES = {
    "mean of ratios": "the mean of the tensors' ratios: the global ratio is of all tensors as one vector, "
                      "√(Σ‖Δθ‖² / Σ‖θ‖²)",
    "norms summed": "Σ‖Δθ‖ / Σ‖θ‖, the norms summed: sum the squares, √(Σ‖Δθ‖² / Σ‖θ‖²)",
    "squared global": "the squared global ratio, Σ‖Δθ‖² / Σ‖θ‖²: take the square root",
}


def _close(got: float, want: float) -> bool:
    return (math.isnan(got) and math.isnan(want)) or math.isclose(got, want, rel_tol=_TOL, abs_tol=1e-12)


def _pairs(record, what: str) -> list[tuple[int, float]]:
    """A learner's [(step, value), ...] as a list of (int, float)."""
    if not isinstance(record, list | tuple):
        raise Mismatch(f"{what} is {type(record).__name__} {record!r:.60}, expected a list of (step, value) pairs")
    pairs = []
    for item in record:
        if not isinstance(item, list | tuple) or len(item) != 2:
            raise Mismatch(f"{what} holds {item!r:.60}, expected (step, value) pairs")
        pairs.append((item[0], number(item[1], f"{what}'s value at step {item[0]!r}")))
    return pairs


def _table(monitor, attribute: str) -> dict:
    table = getattr(monitor, attribute, None)
    if not isinstance(table, dict):
        raise Mismatch(f"your monitor's {attribute} is {type(table).__name__}, expected a dict of name → "
                       f"[(step, value), ...] (set it in __init__, as llmlab's Monitor does)")
    return table


def _compare_ratios(mine: dict, ref: Monitor, seen: list[_Seen], steps: list[int], model: _Net, case: _Case):
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    extra, missing = sorted(mine.keys() - ref.update_ratios.keys()), sorted(ref.update_ratios.keys() - mine.keys())
    where = f"with {case}"
    if extra and set(extra) <= set(frozen):
        raise Mismatch(f"{where}, update_ratios has {extra[0]!r}, which is frozen (requires_grad=False): only the "
                       "parameters that require grad are watched", mistake="frozen watched", hint=_PARAMS)
    if missing == ["spare"]:
        raise Mismatch(f"{where}, update_ratios has no 'spare', a parameter that requires grad but took no part in "
                       "the loss (its .grad is None): it is watched all the same (it moved 0)",
                       mistake="unused skipped", hint=_PARAMS)
    if not mine:
        raise Mismatch(f"{where}, update_ratios is empty after {len(steps)} logs: watch every parameter that requires "
                       "grad (p.requires_grad) — at watch no parameter has a .grad yet", mistake="nothing watched",
                       hint=_PARAMS)
    if extra or missing:
        raise Mismatch(f"{where}, update_ratios names {sorted(mine)}, expected {sorted(ref.update_ratios)} (the "
                       "parameters that require grad, as model.named_parameters() names them)", hint=_PARAMS)
    pairs = {n: _pairs(mine[n], f"update_ratios[{n!r}]") for n in ref.update_ratios}
    for name, got in pairs.items():
        if [s for s, _ in got] != steps:
            raise Mismatch(f"{where}, update_ratios[{name!r}] has the steps {[s for s, _ in got]}, expected "
                           f"{steps} (one (step, ratio) pair per log, with the step log was given)")
    for i, step in enumerate(steps):
        got = {n: pairs[n][i][1] for n in pairs}
        want = {n: ratios[i][1] for n, ratios in ref.update_ratios.items()}
        wrong = [n for n in want if not _close(got[n], want[n])]
        if not wrong:
            continue
        name = wrong[0]
        head = (f"{where}, at the log of update {step} update_ratios[{name!r}] = {got[name]:.6g}, expected "
                f"{want[name]:.6g} (llmlab.monitor.Monitor's)")
        if all(seen[i].w[n] == 0 for n in wrong):
            raise Mismatch(f"{head}: this tensor was all zeros before the update, so its ratio is undefined; llmlab "
                           "records NaN (math.nan)", mistake="zero tensor", hint=_ZERO)
        scaled = [n for n in want if seen[i].w[n] > 0]  # an all-zero tensor's NaN says nothing of the mistake
        for mistake, values in seen[i].candidates.items():
            if all(n in values and _close(got[n], values[n]) for n in scaled):
                text, hint = _TENSOR_MISTAKES[mistake]
                raise Mismatch(f"{head}: {text}", mistake=mistake, hint=hint)
        raise Mismatch(head, hint=_NORM)


def _compare_history(mine: dict, ref: Monitor, seen: list[_Seen], case: _Case):
    where = f"with {case}"
    for key in ref.history:
        if key not in mine:
            what = ("the global ratio: record it beside the metrics log was given" if key == "update_ratio" else
                    "a metric log was given: record every one, as llmlab's Monitor does")
            raise Mismatch(f"{where}, history has no {key!r}, {what}", mistake="history", hint=_HISTORY)
    for key, want in ref.history.items():
        got = _pairs(mine[key], f"history[{key!r}]")
        if [s for s, _ in got] != [s for s, _ in want]:
            raise Mismatch(f"{where}, history[{key!r}] has the steps {[s for s, _ in got]}, expected "
                           f"{[s for s, _ in want]}", mistake="history", hint=_HISTORY)
        for i, ((step, value), (_, expected)) in enumerate(zip(got, want, strict=True)):
            if _close(value, expected):
                continue
            head = f"{where}, history[{key!r}] at update {step} is {value:.6g}, expected {expected:.6g}"
            if key != "update_ratio":
                raise Mismatch(f"{head}, the value log was given", mistake="history", hint=_HISTORY)
            known = next((m for m, v in seen[i].global_candidates().items() if _close(value, v)), None)
            if known:
                raise Mismatch(f"{head}: {_GLOBAL_MISTAKES[known]}", mistake=known, hint=_NORM)
            raise Mismatch(f"{head}: the global ratio is √(Σ‖Δθ‖² / Σ‖θ_before‖²) over every watched tensor",
                           hint=_NORM)


def _copy(params: dict) -> dict:
    return {n: p.detach().clone() for n, p in params.items()}


def _log(monitor, step: int, metrics: dict, case: _Case):
    try:
        monitor.log(step, dict(metrics))  # a copy: a log may add to the dict it is given
    except ZeroDivisionError as e:
        raise Mismatch(f"with {case}, log raised ZeroDivisionError ({e}) at update {step}: a tensor whose weights were "
                       "all zeros before the update (the LayerNorm's bias at initialisation) has no scale; llmlab "
                       "records NaN for its ratio", mistake="zero tensor", hint=_ZERO) from None


def _run(cls, case: _Case, rng: random.Random):
    model = _model(case, rng)
    x = torch.randn(rng.randrange(3, 16, 2), model.inp.in_features, dtype=case.dtype)  # (B, d_in)
    y = torch.randn(x.shape[0], model.head.out_features, dtype=case.dtype)  # (B, d_out)
    mine, ref = cls(), Monitor(peak=None)  # peak None: no MFU, which needs a device's peak FLOP/s
    mine.watch(model)  # before the optimizer, whose first construction imports torch._dynamo (seconds)
    ref.watch(model)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = _optimizer(case, list(params.values()))
    start = last = _copy(params)
    seen, steps = [], []
    for update in range(1, case.interval * case.logs + 1):
        optimizer.zero_grad(set_to_none=True)
        loss = (model(x) - y).float().square().mean()
        loss.backward()
        norm, pre = grad_norm(params.values()).item(), _copy(params)
        optimizer.step()
        if update % case.interval:
            continue
        now = _copy(params)
        grads = {n: None if p.grad is None else _norm(p.grad) for n, p in params.items()}
        seen.append(_Seen(now, last, start, pre, grads, case.lr))
        steps.append(update)
        metrics = dict(loss=loss.item(), lr=case.lr, grad_norm=norm)
        _log(mine, update, metrics, case)
        ref.log(update, dict(metrics))
        last = now
    _compare_ratios(_table(mine, "update_ratios"), ref, seen, steps, model, case)
    _compare_history(_table(mine, "history"), ref, seen, case)


@check("6.4", "a training monitor: the update/weight ratio", hint=Hint(
    nudge="compare the number named with how far the weights moved since the last log, relative to their size",
    idea="copy the watched weights at watch and at the end of every log; at a log, each tensor's ratio is "
         "‖θ − θ_before‖ / ‖θ_before‖ and the global one treats all tensors as one vector",
    formula=_FORMULA))
def update_monitor(cls):
    """`cls()`: a monitor with `history`, `update_ratios`, `watch(model)` and `log(step, metrics)` (see the module
    docstring), compared with llmlab.monitor.Monitor's numbers on the same runs."""
    rng, threads = fresh_rng(), torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second thread costs more than it gains on a shared CPU (10× here)
    try:
        with torch.random.fork_rng(devices=[]):  # the learner's random state is left as it was
            torch.manual_seed(rng.randrange(1 << 30))
            for case in _cases(rng):
                _run(cls, case, rng)
    finally:
        torch.set_num_threads(threads)
