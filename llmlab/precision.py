"""Mixed-precision training: half-precision compute, fp32 master weights, dynamic loss scaling.

The recipe of Micikevicius et al. 2018 ("Mixed Precision Training", §3):
1. keep an fp32 *master* copy of the weights; the optimizer updates it;
2. run forward and backward in fp16 on an fp16 copy of the weights (tensor cores, half the bytes);
3. multiply the loss by a scale S before backward, so that small gradients — which would underflow fp16's
   smallest subnormal 2⁻²⁴ ≈ 6e-8 and become 0 — are lifted into range; divide the gradients by S (in fp32)
   before the update;
4. choose S dynamically: when a gradient overflows (inf/NaN) skip the step and halve S; after
   `growth_interval` clean steps double it. torch.amp.GradScaler uses the same rule (init 2¹⁶, ×2 every 2000
   clean steps, ×0.5 on overflow), which the tests check step by step.

bf16 has fp32's exponent range, so it needs no loss scaling: `autocast("bf16")` runs matmuls in bf16 on fp32
weights (torch.autocast), the usual recipe on A100/H100 and on CPUs.

    from llmlab import precision
    mp = precision.MixedPrecision(model, lambda params: torch.optim.AdamW(params, lr=1e-3))
    loss = model(x, y)[1]
    mp.backward(loss)          # scaled backward through the fp16 model
    stepped = mp.step()        # unscale into the fp32 masters, skip on overflow, copy back to fp16

`step_times` times a training step in the three precisions in the same interleaved rounds (`llmlab.timing`).
Claims C7 (≈3× speed) and C8 (loss scaling) are measured in `llmlab.claims.ch02`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from llmlab import runtime, timing, validation
from llmlab.data import MarkovSource, SyntheticDataset
from llmlab.model import GPT, GPTConfig

__all__ = ["DynamicLossScaler", "MixedPrecision", "autocast", "representation", "PRECISIONS", "LABELS", "StepTimes",
           "step_times", "bench"]

PRECISIONS = ("fp32", "bf16", "fp16")


class DynamicLossScaler:
    """Dynamic loss scaling (Micikevicius et al. 2018, §3.2), the update rule of torch.amp.GradScaler."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        if not init_scale > 0:
            raise ValueError(f"init_scale={init_scale} must be > 0")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor={growth_factor} must be > 1")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor={backoff_factor} must be in (0, 1)")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"growth_interval={growth_interval!r} must be an int >= 1")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.clean_steps = 0  # clean steps since the last change of scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss × scale, computed in fp32. The gradient entering an fp16 graph is then the scale itself, so a
        scale above fp16's max (65504, e.g. the default 2¹⁶) overflows at once: the first step is skipped
        and the scale backs off — the same happens with torch.amp.GradScaler."""
        return loss.float() * self.scale

    def unscale_(self, grads: list[torch.Tensor]) -> bool:
        """Divide `grads` by the scale in place; return whether any of them is inf or NaN."""
        found_inf = False
        for g in grads:
            g.mul_(1.0 / self.scale)
            found_inf |= not bool(torch.isfinite(g).all())
        return found_inf

    def update(self, found_inf: bool) -> None:
        """Back off on overflow; grow after `growth_interval` clean steps in a row."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


class MixedPrecision:
    """An fp16 (or bf16) model for forward/backward, fp32 master weights for the optimizer.

    `make_optimizer(params)` builds the optimizer over the fp32 masters. With fp16 a DynamicLossScaler is
    used (pass `scaler=None` to see what happens without one); with bf16 no scaling is needed.
    """

    def __init__(self, model: torch.nn.Module, make_optimizer, dtype: torch.dtype = torch.float16,
                 scaler: DynamicLossScaler | None | str = "auto"):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype={dtype} must be torch.float16 or torch.bfloat16")
        self.model, self.dtype = model, dtype
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        model.to(dtype)
        self.optimizer = make_optimizer(self.masters)
        if scaler == "auto":
            scaler = DynamicLossScaler() if dtype == torch.float16 else None
        self.scaler = scaler
        self.skipped = 0

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale_loss(loss) if self.scaler else loss).backward()

    def step(self) -> bool:
        """Move the half gradients into the fp32 masters, unscale, step unless they overflowed; True if stepped."""
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        grads = [m.grad for m in self.masters if m.grad is not None]
        found_inf = self.scaler.unscale_(grads) if self.scaler else not all(torch.isfinite(g).all() for g in grads)
        if self.scaler:
            self.scaler.update(found_inf)
        if found_inf:
            self.skipped += 1
        else:
            self.optimizer.step()
            with torch.no_grad():
                for p, m in zip(self.params, self.masters, strict=True):
                    p.copy_(m)  # rounds the fp32 master to the model's half precision
        self.optimizer.zero_grad(set_to_none=True)
        return not found_inf


def autocast(precision: str, device: torch.device | str = "cpu"):
    """A context running matmuls in `precision` ('fp32': no-op, 'bf16' or 'fp16') on fp32 weights."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; choose from {PRECISIONS}")
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def representation(value: float) -> dict[str, dict]:
    """How `value` is stored in fp32, fp16 and bf16: the stored value, its relative error, and whether it
    overflowed to inf or underflowed to 0 (what the chapter's precision explorer shows)."""
    if not math.isfinite(value):
        raise ValueError(f"value={value!r} must be finite")
    out = {}
    for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        stored = torch.tensor(value, dtype=torch.float64).to(dtype).item()
        info = torch.finfo(dtype)
        out[name] = {"stored": stored, "rel_error": abs(stored - value) / abs(value) if value else 0.0,
                     "overflow": math.isinf(stored), "underflow": value != 0 and stored == 0,
                     "subnormal": 0 < abs(stored) < info.tiny, "max": info.max, "tiny": info.tiny,
                     "eps": info.eps}
    return out


# --- measured: step time per precision (`llmlab bench precision`; claim C7 uses it, in llmlab.claims.ch02) ---

LABELS = {"fp32": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 + loss scaler"}  # what each step runs


def _step(precision: str, preset: str, batch_size: int):
    """One training step of a fresh GPT `preset` in `precision` on this tier's device, as a function."""

    device = runtime.device()
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset)).to(device)
    data = SyntheticDataset(MarkovSource(model.config.vocab_size), batch_size, model.config.block_size)
    x, y = (t.to(device) for t in data.get_batch(0))
    if precision == "fp16":
        mp = MixedPrecision(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4), dtype=torch.float16)

        def step():
            mp.backward(model(x, y)[1])
            mp.step()
        return step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        with autocast(precision, device):
            loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


@dataclass(frozen=True)
class StepTimes:
    """What `step_times` measured: the GPT and batch it ran (`size`) and one interleaved `timing.Rounds` of the
    PRECISIONS' training steps."""

    size: str
    rounds: timing.Rounds

    def versus_fp32(self, precision: str) -> timing.Comparison:
        """`precision`'s step against the fp32 step of the same rounds: `.ratio` is its time / fp32's (the speed-up
        is 1 / ratio), `.direction()` says 'faster', 'slower' or 'not conclusive'."""
        validation.one_of("precision", precision, PRECISIONS[1:])
        return self.rounds.ratio(precision, "fp32")


@timing.remembered
def step_times(preset: str | None = None, batch_size: int | None = None) -> StepTimes:
    """A training step of the GPT `preset` (this tier's model and batch size by default) in fp32, in bf16
    autocast and in fp16 with the loss scaler and fp32 masters, all three timed in the same interleaved rounds
    (`llmlab.timing.interleave`): one fp32 figure serves both comparisons, and a busy spell of the machine hits the
    three steps alike, so their ratios hold where the times do not.

    `step_times.recent()` is the last such measurement (`timing.remembered`): chapter 2's cell and claim C7 show
    one measurement, not two taken at different moments."""
    p = runtime.preset()
    preset = preset or p.model
    batch_size = validation.positive_int("batch_size", batch_size) if batch_size is not None else p.batch_size
    steps = {name: _step(name, preset, batch_size) for name in PRECISIONS}  # fp32 first: the peer of both
    # rounds of >= 50 ms per step kind, so that a moment of other work on the machine averages out
    rounds = timing.interleave(steps, device=runtime.device(), warmup=1, min_rounds=5, max_rounds=20, budget_s=2.0,
                               min_round_s=0.05)
    return StepTimes(f"{preset} GPT, B={batch_size}", rounds)


def bench(preset: str | None = None, batch_size: int | None = None) -> list[dict]:
    """Training-step time of the GPT in bf16 (autocast) and fp16 (+ loss scaler, fp32 masters) against fp32, from
    `step_times`: the three interleaved round by round, one fp32 figure for both rows."""
    t = step_times.recent(preset, batch_size)
    rows = []
    for name in PRECISIONS[1:]:
        c = t.versus_fp32(name)
        rows.append({"impl": f"{LABELS[name]} step", "peer": "fp32 step", "size": t.size, **c.row(),
                     "speed-up": 1 / c.ratio})
    return rows
