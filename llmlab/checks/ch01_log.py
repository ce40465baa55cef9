"""Exercise 1.5's check, the MFU a training log shows (solutions/01_compute.ipynb); chapter 1's checks re-export it.

    from llmlab.checks import ch01 as check
    check.mfu_from_log(mfu_from_log)                   # 1.5
    log, cfg, peak_flops, warmup = check.sample_log()  # a log such as the check reads, to try a parser on

Each log is written as `llmlab train` prints its steps (llmlab.train.capstone.launch: step, loss, lr, grad_norm),
with the two figures an MFU needs in place of its tok/s: the step's batch (sequences of cfg.block_size tokens) and
its time in milliseconds, which the Trainer measures (`step_time_s`) but the capstone does not print. Around the
step lines are lines that are not steps (a note, evaluations, a save, the final summary); the warm-up steps are
slow (the first compiles), and so are a few later ones (a save, a data-loader stall). The right answer is
llmlab.flops' per-matmul count of a training step (`training_step_flops`, the chapter's PaLM definition) over the
median time of the steps after warm-up (`flops.mfu`), on one device.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, replace

from llmlab import flops
from llmlab.checks import Hint, Mismatch, check, fresh_rng, number
from llmlab.hardware import SPECS
from llmlab.model import PRESETS, GPTConfig
from llmlab.train.schedule import warmup_cosine_lr

__all__ = ["mfu_from_log", "sample_log"]

# GPT shapes trained on one GPU (GPT-2's vocabulary padded to 50304, as nanoGPT does), and the workbook's small
# presets, trained on a CPU
GPU_MODELS = {
    "GPT-2 small": PRESETS["gpt2"],
    "GPT-2 medium": GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "GPT-2 XL": GPTConfig(vocab_size=50304, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
    "1.3B": GPTConfig(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=2048),
    "7B": GPTConfig(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096),
}
CPU_MODELS = {name: PRESETS[name] for name in ("tiny", "mini", "small", "medium")}
CENTI_MS_PER_S = 100_000  # the log prints milliseconds with 2 decimals: a step's time is a whole number of 0.01 ms


@dataclass(frozen=True)
class Log:
    """One training log and what it was written from."""

    text: str
    cfg: GPTConfig
    peak_flops: float
    warmup: int  # the first `warmup` steps are warm-up
    batch: int  # sequences per step
    centi_ms: tuple[int, ...]  # every step's time, in the log's 0.01 ms
    model: str
    device: str

    @property
    def kept(self) -> tuple[int, ...]:
        return self.centi_ms[self.warmup:]


def _step_times(rng: random.Random, base: int, warmup: int, kept: int) -> list[int]:
    """Step times in 0.01 ms around `base`: `warmup` slow ones first, then `kept` steady ones, all different (so that
    each named mistake lands on another value), of which a few are slow outliers."""
    lo, hi = round(base * 0.96), round(base * 1.04)  # ±4% jitter: ≥ 400 values for a base ≥ 50 ms, ≥ kept
    steady = rng.sample(range(lo, hi + 1), kept)
    for i in rng.sample(range(kept), rng.randint(2, max(2, kept // 20))):  # a save, a stall: 2.5–8× a step
        steady[i] = round(base * rng.uniform(2.5, 8))
    first = round(base * rng.uniform(8, 40))  # step 1 compiles kernels and warms the allocator
    settling = [hi + 1 + round(hi * rng.uniform(0.01, 1) * 0.8 ** i) for i in range(1, warmup)]  # all above steady
    return [first, *settling, *steady]


def _log_text(rng: random.Random, log: Log) -> str:
    """The lines `llmlab train` would print for `log`'s steps, with the lines around them that are not steps."""
    cfg, steps = log.cfg, len(log.centi_ms)
    peak_lr, lr_warmup, floor = rng.choice([6e-4, 3e-4, 1.5e-4]), rng.randint(1, steps // 2), rng.uniform(2.5, 3.5)
    lines = [f"note: {log.model} on {log.device}, {log.batch} sequences of {cfg.block_size} tokens per step"]
    for step, centi in enumerate(log.centi_ms, start=1):
        loss = floor + (math.log(cfg.vocab_size) - floor) * math.exp(-step / 40) + rng.gauss(0, 0.02)
        lr = warmup_cosine_lr(step - 1, peak_lr, lr_warmup, steps, peak_lr / 10)
        lines.append(f"step {step:5d}  loss {loss:.4f}  lr {lr:.2e}  grad_norm {rng.uniform(0.2, 2):.3f}  "
                     f"batch {log.batch}  {centi / 100:.2f} ms")
        if step % 50 == 0:
            lines.append(f"eval  step {step:5d}  val loss {loss + rng.uniform(0, 0.1):.4f}")
        if step == steps // 2:
            lines.append(f"saved step {step} to runs/ch01/step-{step}")
    seconds = sum(log.centi_ms) / CENTI_MS_PER_S
    lines.append(f"final loss {loss:.4f} after {steps} updates | world 1 = dp 1 × tp 1, zero 0 | {seconds:.1f} s")
    return "\n".join(lines) + "\n"


def _log(rng: random.Random, model: str, device: str) -> Log:
    """A fresh log of `model` training on `device` at an MFU of 15–60%, 50 ms to 3 s per step."""
    cpu = device == "laptop CPU"
    cfg = (CPU_MODELS if cpu else GPU_MODELS)[model]
    if not cpu:
        cfg = replace(cfg, block_size=rng.choice([512, 1024, 2048, 4096]))
    peak = SPECS[device].peak_flops("fp32" if cpu else "bf16")
    mfu, seconds = rng.uniform(0.15, 0.6), rng.uniform(0.05, 0.5 if cpu else 3.0)
    per_sequence = flops.training_step_flops(cfg, 1)
    batch = max(1, round(seconds * peak * mfu / per_sequence))
    base = max(5000, round(batch * per_sequence / (peak * mfu) * CENTI_MS_PER_S))  # ≥ 50 ms
    warmup, kept = rng.choice([2, 3, 5, 10, 20]), rng.randrange(21, 152, 2)  # odd: one middle step
    log = Log("", cfg, peak, warmup, batch, tuple(_step_times(rng, base, warmup, kept)), model, device)
    return replace(log, text=_log_text(rng, log))


def _logs(rng: random.Random) -> list[Log]:
    gpus = [name for name in SPECS if name != "laptop CPU"]
    cases = [_log(rng, "GPT-2 small", "A100 SXM")]
    cases += [_log(rng, rng.choice(list(GPU_MODELS)), rng.choice(gpus)) for _ in range(4)]
    return cases + [_log(rng, rng.choice(list(CPU_MODELS)), "laptop CPU")]


def sample_log() -> tuple[str, GPTConfig, float, int]:
    """A fresh log such as the check reads: (log_text, cfg, peak_flops, warmup)."""
    log = _log(fresh_rng(), "GPT-2 small", "A100 SXM")
    return log.text, log.cfg, log.peak_flops, log.warmup


def _close(got: float, want: float) -> bool:
    """The median is one of the printed times (exact) and the rest is a handful of float64 products and quotients
    (~1e-15 relative in another order); 1e-9 is far below the smallest gap between two named answers: one warm-up
    step kept moves the median half a 0.01 ms step of at most 3.1 s, 1.6e-6 relative."""
    return math.isclose(got, want, rel_tol=1e-9, abs_tol=0.0)


def _diagnoses(log: Log, want: float) -> dict[float, str]:
    """The answer each known mistake gives on `log` → what that mistake is."""
    median, T = statistics.median(log.kept), log.cfg.block_size
    matmuls = flops.forward_matmuls(log.cfg, log.batch)
    attention = sum(mm.flops for mm in matmuls if mm.name.startswith(("attn scores", "attn weighted")))
    six_n = 1 - attention / sum(mm.flops for mm in matmuls)  # the share of the count 6·N per token is
    slow = sum(t > 2 * median for t in log.kept)
    return {
        want * median / statistics.mean(log.kept): f"that is the mean step time: the {slow} slow steps after "
                                                   "warm-up (a save, a data-loader stall) pull it up; take the median",
        want * median / statistics.median(log.centi_ms): f"the {log.warmup} warm-up steps are kept (step 1 "
                                                         f"took {log.centi_ms[0] / 100:.0f} ms): drop them first",
        want * median / statistics.mean(log.centi_ms): "that is the mean over every step, warm-up included: drop the "
                                                       "warm-up steps and take the median of the rest",
        want * median / statistics.median(log.centi_ms[log.warmup - 1:]): f"step {log.warmup} is kept: steps 1 to "
                                                                           "warmup are warm-up, off by one",
        want * six_n: "the attention matmuls are missing: that is 6·N FLOPs per token; the chapter's count adds "
                      "12·L·C·T (q·kᵀ and p·v, forward and backward)",
        want / 3: "a third: that is the forward pass only; a training step is 3× the forward (backward is 2×)",
        want * six_n / 3: "that is 2·N FLOPs per token, the forward's weight matmuls only: training is 3× the "
                          "forward, and the attention matmuls count too",
        want / 1000: "1000× too small: the step times are in milliseconds; divide by 1000 for seconds",
        want / T: f"{T}× too small: batch counts sequences, each cfg.block_size = {T} tokens",
        want * 100: "100× too large: return a fraction (0.41), not a percentage",
    }


@check("1.5", "MFU from a training log", hint=Hint(
    nudge="print the step time your code takes from the log, and the tokens and FLOPs per step: which steps does it "
          "keep, in which unit, and does it count the attention?",
    idea="keep only the step lines, drop the first `warmup` of them, take the median of their times (a few slow steps "
         "must not move it) in seconds; a step trains batch × cfg.block_size tokens at the chapter's per-matmul FLOPs "
         "per token; MFU is the FLOP/s this gives over peak_flops",
    formula="MFU = (batch · T / s) · (6·N + 12·L·C·T) / peak_flops, with s the median of the kept steps' ms / 1000, "
            "N = 12·L·C² + V·C (the matmuls' weights: the blocks' and the LM head's), T = cfg.block_size, L, C, V "
            "cfg.n_layer, cfg.n_embd, cfg.vocab_size; a fraction, not a percentage"))
def mfu_from_log(fn):
    for log in _logs(fresh_rng()):
        cfg = log.cfg
        what = (f"mfu_from_log(<{len(log.centi_ms)} steps, batch {log.batch}: {log.model} on {log.device}>, "
                f"GPTConfig(n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, block_size={cfg.block_size}, "
                f"vocab_size={cfg.vocab_size}), peak_flops={log.peak_flops:.4g}, warmup={log.warmup})")
        got = number(fn(log.text, cfg, log.peak_flops, warmup=log.warmup), what)
        median_s = statistics.median(log.kept) / CENTI_MS_PER_S
        want = flops.mfu(flops.training_step_flops(cfg, log.batch), median_s, 1, log.peak_flops)
        if _close(got, want):
            continue
        known = next((d for value, d in _diagnoses(log, want).items() if _close(got, value)), None)
        raise Mismatch(f"{what} = {got:.6g}, expected {want:.6g} (median step {median_s * 1000:.2f} ms of steps "
                       f"{log.warmup + 1}–{len(log.centi_ms)})" + (f": {known}" if known else ""))
