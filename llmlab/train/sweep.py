"""Warmup length × peak learning rate, swept on the tiny GPT: does warmup let a higher peak LR train stably, and
does it reach a lower loss? (Chapter 6, §6.1, and claim C16.)

The material (§6.1) says to warm up linearly over the first 500–1000 steps. That count belongs to long runs — the
Transformer warmed up over 4000 of its 100,000 steps (Vaswani et al. 2017, §5.3), GPT-3 over 375M of its 300B tokens
(Brown et al. 2020, §B) — and what it is for can be tested on a short one: a run here is `steps` updates, and the
warmups swept are counts of updates in it.

Each cell (warmup, peak LR) is trained once per seed — the seed sets the model's initialisation, the Markov source
and the batches (`TrainConfig.seed`) — with AdamW, no clipping (so that warmup alone acts), warmup then a cosine to
lr/10. A run's loss is the mean of its last `tail` updates' losses. Warmup is compared with none *paired by seed*:
"lower" or "higher" only when every seed's difference has the same sign, else "not conclusive". A run is **stable**
when no update after the first pushed its loss more than `RISE` nats above its starting loss (a fresh model's, about
ln V): at too high an LR the first full-size updates throw the model above a uniform guess.

    from llmlab.train.sweep import warmup_sweep
    sweep = warmup_sweep()            # 36 short runs; warmup_sweep.recent() reuses the last sweep
    sweep.rows()                      # a table: per peak LR, each warmup's loss (mean ± half-range over seeds)
    print(sweep.findings())           # the sentences, printed from the numbers

Run the tests: `.venv/bin/pytest tests/test_train_sweep.py`.
"""

from __future__ import annotations

import contextvars
import math
import statistics
from dataclasses import dataclass

from tqdm.auto import tqdm

from llmlab import timing, validation
from llmlab.train.trainer import TrainConfig, Trainer

__all__ = ["RISE", "Run", "WarmupSweep", "warmup_sweep"]

# nats above the starting loss that count as "the loss went up": batch-to-batch noise at initialisation is ~0.02
# nats (a fresh model predicts nearly uniformly on every batch), a throw-off by a too-large first step is 0.1–1
RISE = 0.1
_PROGRESS = contextvars.ContextVar("progress", default=True)  # warmup_sweep's progress=, outside the remembered key


@dataclass(frozen=True)
class Run:
    final: float  # mean loss of the last `tail` updates (nats/token)
    rise: float  # the highest loss after update 0 minus update 0's loss: > RISE means the run was thrown up


@dataclass(frozen=True)
class WarmupSweep:
    warmups: tuple[int, ...]  # warmups[0] == 0: the baseline, no warmup
    lrs: tuple[float, ...]  # peak learning rates, ascending
    seeds: tuple[int, ...]
    steps: int
    tail: int
    runs: dict  # (warmup, lr, seed) -> Run

    def finals(self, warmup: int, lr: float) -> list[float]:
        return [self.runs[warmup, lr, s].final for s in self.seeds]

    def mean(self, warmup: int, lr: float) -> float:
        return statistics.fmean(self.finals(warmup, lr))

    def stable(self, warmup: int, lr: float) -> bool:
        """No seed's loss rose more than RISE above where it started."""
        return all(self.runs[warmup, lr, s].rise <= RISE for s in self.seeds)

    def highest_stable_lr(self, warmup: int) -> float | None:
        """The highest peak LR below which every LR swept was stable with this warmup (None: not even the lowest)."""
        best = None
        for lr in self.lrs:
            if not self.stable(warmup, lr):
                break
            best = lr
        return best

    @staticmethod
    def direction(differences: list[float]) -> str:
        """'lower' / 'higher' when every paired difference has that sign, else 'not conclusive'."""
        if max(differences) < 0:
            return "lower"
        if min(differences) > 0:
            return "higher"
        return "not conclusive"

    def effect(self, warmup: int, lr: float) -> list[float]:
        """Per seed: this warmup's loss minus no warmup's, at the same peak LR."""
        return [a - b for a, b in zip(self.finals(warmup, lr), self.finals(0, lr), strict=True)]

    def best(self, warmups) -> tuple[int, float]:
        """The (warmup, lr) cell of the lowest mean loss among `warmups`."""
        return min(((w, lr) for w in warmups for lr in self.lrs), key=lambda cell: self.mean(*cell))

    def rows(self) -> list[dict]:
        """One row per peak LR: each warmup's loss (mean ± half the range over seeds, † where unstable) and how it
        compares with no warmup."""
        rows = []
        for lr in self.lrs:
            row = {"peak LR": f"{lr:.0e}"}
            for w in self.warmups:
                finals = self.finals(w, lr)
                diverged = sum(not math.isfinite(f) for f in finals)
                row[f"warmup {w}"] = (f"diverged ({diverged}/{len(finals)} seeds)" if diverged else
                                      f"{statistics.fmean(finals):.3f} ±{(max(finals) - min(finals)) / 2:.3f}"
                                      + ("" if self.stable(w, lr) else " †"))
                if w:
                    row[f"warmup {w} vs none"] = self.direction(self.effect(w, lr))
            rows.append(row)
        return rows

    def compare_best(self) -> tuple[tuple[int, float], tuple[int, float], list[float], str]:
        """The best cell without warmup, the best with, the per-seed differences (with − without), the direction."""
        none, warm = self.best([0]), self.best(self.warmups[1:])
        differences = [a - b for a, b in zip(self.finals(*warm), self.finals(*none), strict=True)]
        return none, warm, differences, self.direction(differences)

    def findings(self) -> str:
        """What the sweep shows, in sentences printed from its numbers."""
        runs = f"{len(self.runs)} runs of {self.steps} updates (tiny GPT, AdamW, no clipping, seeds " \
               f"{', '.join(map(str, self.seeds))})"
        if not any(math.isfinite(r.final) for r in self.runs.values()):
            return (f"All {runs} diverged (a loss of inf or NaN), at every peak LR swept "
                    f"({', '.join(f'{lr:.0e}' for lr in self.lrs)}), with and without warmup: the sweep says nothing "
                    "about warmup; sweep lower learning rates.")
        if not any(run.rise <= RISE for run in self.runs.values()):
            return (f"All {runs} were thrown more than {RISE} nats above their starting loss (or diverged), at every "
                    f"peak LR swept ({', '.join(f'{lr:.0e}' for lr in self.lrs)}), with and without warmup: no run "
                    "trained, so the sweep says nothing about warmup; sweep lower learning rates.")
        none, warm, differences, direction = self.compare_best()
        stable = {w: self.highest_stable_lr(w) for w in self.warmups}
        said = ", ".join(f"{'none' if w == 0 else w}: {'none' if lr is None else f'{lr:.0e}'}"
                         for w, lr in stable.items())
        per_lr = "; ".join(f"at {lr:.0e} " + ", ".join(f"warmup {w} {self.direction(self.effect(w, lr))}"
                                                      for w in self.warmups[1:]) for lr in self.lrs)
        spread = f"{min(differences):+.3f} … {max(differences):+.3f}"
        verdict = {"lower": "lower with warmup on every seed", "higher": "higher with warmup on every seed"}.get(
            direction, "not conclusive: both best cells diverged on some seed" if any(map(math.isnan, differences))
            else "not conclusive: the seeds disagree")
        return (f"{runs}. Highest peak LR at which the loss never rose more than {RISE} "
                f"nats above its start, by warmup — {said}. Lowest loss without warmup: {self._loss(none)} at LR "
                f"{none[1]:.0e}; with warmup: {self._loss(warm)} (warmup {warm[0]}, LR {warm[1]:.0e}); per seed "
                f"the warmed-up best minus the unwarmed best is {spread}: {verdict}. Loss with warmup against none, "
                f"per peak LR (paired by seed): {per_lr}.")

    def _loss(self, cell: tuple[int, float]) -> str:
        """A cell's mean loss, or how many of its seeds diverged."""
        diverged = sum(not math.isfinite(f) for f in self.finals(*cell))
        return f"{self.mean(*cell):.3f}" if not diverged else f"diverged ({diverged}/{len(self.seeds)} seeds)"

    def helps(self) -> bool | None:
        """True when warmup both reached a lower loss on every seed and trained stably at a higher peak LR than no
        warmup did; False when it did neither; None when the sweep does not decide."""
        _, _, _, direction = self.compare_best()
        none_lr = self.highest_stable_lr(0)
        higher = any((lr or 0) > (none_lr or 0) for lr in map(self.highest_stable_lr, self.warmups[1:]))
        if direction == "lower" and higher:
            return True
        if direction == "higher" and not higher:
            return False
        return None


def _arguments(warmups=(0, 10, 30), lrs=(1e-3, 3e-3, 1e-2, 3e-2), seeds=(0, 1, 2), steps=100, tail=10,
               batch_size=8, block_size=16) -> tuple:
    """The sweep's arguments checked, as one hashable tuple (lists become tuples, the LRs ascending), before any run
    starts: a bad argument is refused at once, not after minutes of training."""
    def values(name, value) -> tuple:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise ValueError(f"{name}={value!r} must be a sequence (a tuple or a list)")
        if not (value := tuple(value)):
            raise ValueError(f"{name}={value!r} must not be empty")
        return value

    def once(name, value: tuple) -> None:  # after the values are checked (numbers, so hashable)
        if len(set(value)) != len(value):
            raise ValueError(f"{name}={value!r} holds a value twice")

    warmups, lrs, seeds = values("warmups", warmups), values("lrs", lrs), values("seeds", seeds)
    validation.integer("steps", steps, low=2)  # update 0's loss, and at least one after it
    for w in warmups:
        validation.integer("warmups", w, 0, steps, hint=f"(a count of updates in a run of steps={steps})")
    if warmups[0] != 0 or len(warmups) < 2:
        raise ValueError(f"warmups={warmups!r} must start with 0 (the baseline) and hold another, distinct length")
    for lr in lrs:
        validation.number("lrs", lr, above=0)
        if not math.isfinite(lr):
            raise ValueError(f"lrs={lr!r} must be a finite learning rate")
    for seed in seeds:
        validation.integer("seeds", seed, low=0)
    for name, value in (("warmups", warmups), ("lrs", lrs), ("seeds", seeds)):
        once(name, value)
    validation.integer("tail", tail, 1, steps, hint=f"(updates at the end of a run of steps={steps})")
    validation.positive_int("batch_size", batch_size)
    validation.positive_int("block_size", block_size)
    return warmups, tuple(sorted(lrs)), seeds, steps, tail, batch_size, block_size


@timing.remembered
def _sweep(warmups: tuple[int, ...], lrs: tuple[float, ...], seeds: tuple[int, ...], steps: int, tail: int,
           batch_size: int, block_size: int) -> WarmupSweep:
    runs = {}
    cells = [(w, lr, seed) for w in warmups for lr in lrs for seed in seeds]
    # no disable= when the bar is wanted: an explicit one would override TQDM_DISABLE (`llmlab site` sets it)
    off = {} if _PROGRESS.get() else {"disable": True}
    for w, lr, seed in tqdm(cells, desc="warmup × peak LR", unit="run", leave=False, **off):
        config = TrainConfig.preset("tiny", steps=steps, warmup=w, lr=lr, min_lr=lr / 10, grad_clip=None,
                                    batch_size=batch_size, block_size=block_size, seed=seed)
        trainer = Trainer(config=config, progress=False)
        loss = [h["loss"] for h in trainer.fit()]
        if not all(math.isfinite(v) for v in loss):  # diverged: worse than any finite loss
            runs[w, lr, seed] = Run(final=math.inf, rise=math.inf)
        else:
            runs[w, lr, seed] = Run(final=statistics.fmean(loss[-tail:]), rise=max(loss[1:]) - loss[0])
    return WarmupSweep(warmups, lrs, seeds, steps, tail, runs)


def warmup_sweep(warmups: tuple[int, ...] = (0, 10, 30), lrs: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 3e-2),
                 seeds: tuple[int, ...] = (0, 1, 2), steps: int = 100, tail: int = 10, batch_size: int = 8,
                 block_size: int = 16, progress: bool = True) -> WarmupSweep:
    """Train the tiny GPT for every (warmup, peak LR, seed); see the module docstring. `warmup_sweep.recent(...)`
    returns the last sweep with these arguments in this process (chapter 6's cell, then claim C16). Sequences may
    be tuples or lists; the arguments are checked before the first run. `progress=False`: no progress bar (a
    notebook's saved output keeps a tqdm bar's first frame, "0%"); it is not part of what `recent` matches."""
    arguments = _arguments(warmups, lrs, seeds, steps, tail, batch_size, block_size)
    token = _PROGRESS.set(validation.one_of("progress", progress, (True, False)))
    try:
        return _sweep(*arguments)
    finally:
        _PROGRESS.reset(token)


def _recent(*args, **kwargs) -> WarmupSweep:
    return _sweep.recent(*_arguments(*args, **kwargs))


warmup_sweep.recent = _recent
