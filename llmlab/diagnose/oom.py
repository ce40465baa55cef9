"""Out of memory: predict it from the memory model, rank the remedies, and check the prediction under a budget.

The material's §7.1 lists four remedies for an OOM — a smaller batch, gradient checkpointing, a smaller model,
ZeRO — and the planner (`llmlab.memory.planner`, after Rajbhandari et al. 2020 and Korthikanti et al. 2022) says
what each one saves before anything runs:

    from llmlab.diagnose import oom
    report = oom.diagnose(GPTConfig.preset("gpt2"), batch_size=16, budget_bytes=80e9, data=8)
    report.fits, report.over_bytes
    report.remedies        # [Remedy(name, plan, saving, fits), ...], largest predicted saving first

**The budget, measured.** A CPU has no allocator to run out of, so `enforced_budget` makes one: a saved-tensor
hook (`llmlab.memory.measure.StorageCounter`) counts every byte autograd keeps for backward on top of the model
state already resident, and raises `MemoryBudgetExceeded` — a `RuntimeError` worded like
`torch.cuda.OutOfMemoryError` — the moment the total passes the budget. `measure_step` runs one training step
under it (on CUDA, under the real allocator capped by `torch.cuda.set_per_process_memory_fraction`) and returns
what the step held at the end of its forward pass: model state + saved activations + the logits. For a step after
the first (the optimizer's moments exist, `zero_grad(set_to_none=False)` keeps the gradients) that is the
planner's `total - recompute`. The budget covers the forward on both devices (the cap is lifted for the backward):
with checkpointing, backward briefly adds one block's recomputed activations (`Plan.recompute`) and the gradients of
the activations, transients the planner's forward count leaves out. (On an H200 the backward under the same cap ran
out of memory where the forward fit, the first GPU run of this module.)

Claim C18 (the remedies' savings are predictable) is measured with this module in `llmlab.claims.ch07`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from llmlab import runtime, validation
from llmlab.memory import checkpoint, measure, planner
from llmlab.model import GPT, GPTConfig

__all__ = ["MemoryBudgetExceeded", "Remedy", "OOMReport", "remedies", "diagnose", "forward_bytes",
           "enforced_budget", "StepMemory", "measure_step", "measure_config"]


class MemoryBudgetExceeded(RuntimeError):
    """The CPU stand-in for `torch.cuda.OutOfMemoryError`: an allocation would pass the enforced budget."""

    def __init__(self, requested: int, in_use: int, budget: float):
        self.requested, self.in_use, self.budget = requested, in_use, budget
        super().__init__(f"Out of memory (enforced budget). Tried to allocate {requested / 2**20:.2f} MiB; "
                         f"{in_use / 2**20:.2f} MiB already in use of a budget of {budget / 2**20:.2f} MiB")


@dataclass(frozen=True)
class Remedy:
    """One way out of an OOM: the plan it gives, what it saves against the original plan, and whether it fits."""

    name: str
    change: str  # what to change, in words
    plan: planner.Plan
    saving: float  # bytes: original total - this plan's total
    fits: bool


@dataclass(frozen=True)
class OOMReport:
    """`diagnose`'s answer: the plan, the budget, and the remedies ranked by predicted saving."""

    plan: planner.Plan
    budget_bytes: float
    remedies: list[Remedy]

    @property
    def fits(self) -> bool:
        return self.plan.fits(self.budget_bytes)

    @property
    def over_bytes(self) -> float:
        """How far the plan is over the budget (negative: the headroom left)."""
        return self.plan.total - self.budget_bytes

    def summary(self) -> str:
        gb = 1e9 if self.budget_bytes >= 1e9 else 1e6
        unit = "GB" if gb == 1e9 else "MB"
        head = (f"planned {self.plan.total / gb:.3g} {unit} of a {self.budget_bytes / gb:.3g} {unit} budget: "
                + ("fits" if self.fits else f"OOM, {self.over_bytes / gb:.3g} {unit} over"))
        lines = [head] + [f"  {'fits' if r.fits else 'OOM '}  saves {r.saving / gb:8.3g} {unit}  {r.name}: "
                          f"{r.change}" for r in self.remedies]
        return "\n".join(lines)


def remedies(config: GPTConfig, batch_size: int, budget_bytes: float, *, zero_ranks: int = 8,
             **plan_kwargs) -> list[Remedy]:
    """Each remedy of §7.1 applied alone to `planner.plan(config, batch_size, **plan_kwargs)`, largest predicted
    saving first. `zero_ranks` is the data-parallel degree ZeRO shards over when the plan has `data=1`.

    - smaller batch: half the micro-batch (fewer samples per step);
    - gradient accumulation: half the micro-batch, two of them per step (the same samples per step, twice the
      steps' passes — memory of the small batch, optimisation of the large one);
    - gradient checkpointing (Chen et al. 2016): every block keeps only its input;
    - ZeRO: the next stage (Rajbhandari et al. 2020), over the plan's data ranks (or `zero_ranks`);
    - smaller model: half the blocks.
    """
    validation.positive("budget_bytes", budget_bytes, hint="(bytes)")
    validation.integer("zero_ranks", zero_ranks, low=2, hint="(ZeRO shards over data ranks)")
    base = planner.plan(config, batch_size, **plan_kwargs)
    options: list[tuple[str, str, Callable[[], planner.Plan]]] = []
    if batch_size > 1:
        half = batch_size // 2
        options.append(("smaller batch", f"batch_size {batch_size} → {half}",
                        lambda: planner.plan(config, half, **plan_kwargs)))
        if batch_size % 2 == 0:
            options.append(("gradient accumulation", f"2 micro-batches of {half} per step (same {batch_size} "
                            "samples)", lambda: planner.plan(config, half, **plan_kwargs)))
    if not plan_kwargs.get("checkpointing"):
        options.append(("gradient checkpointing", "checkpoint every block",
                        lambda: planner.plan(config, batch_size, **{**plan_kwargs, "checkpointing": True})))
    stage, data = plan_kwargs.get("stage", 0), plan_kwargs.get("data", 1)
    if stage < 3:
        n = data if data > 1 else zero_ranks
        options.append(("ZeRO", f"stage {stage} → {stage + 1} over {n} data ranks",
                        lambda: planner.plan(config, batch_size, **{**plan_kwargs, "stage": stage + 1, "data": n})))
    if config.n_layer > 1:
        small = replace(config, n_layer=config.n_layer // 2)
        options.append(("smaller model", f"n_layer {config.n_layer} → {small.n_layer}",
                        lambda: planner.plan(small, batch_size, **plan_kwargs)))
    out = []
    for name, change, make in options:
        p = make()
        out.append(Remedy(name, change, p, base.total - p.total, p.fits(budget_bytes)))
    return sorted(out, key=lambda r: -r.saving)


def diagnose(config: GPTConfig, batch_size: int, budget_bytes: float, *, zero_ranks: int = 8,
             **plan_kwargs) -> OOMReport:
    """Does training `config` with micro-batches of `batch_size` fit `budget_bytes` per GPU (`plan_kwargs` go
    to `planner.plan`: stage, data, tensor, pipeline, checkpointing, precision, ...), and what would each remedy
    save? The budget is what the training may use: a GPU's memory minus the CUDA context (≈ 0.5 GB) and a margin
    for what the planner leaves out (temporaries of backward, fragmentation)."""
    plan = planner.plan(config, batch_size, **plan_kwargs)
    return OOMReport(plan, budget_bytes, remedies(config, batch_size, budget_bytes, zero_ranks=zero_ranks,
                                                  **plan_kwargs))


def forward_bytes(plan: planner.Plan) -> float:
    """What a step holds at the end of its forward pass, by the plan: everything but backward's recompute."""
    return plan.total - plan.recompute


# --- the budget, enforced --------------------------------------------------------------------------------------

def _check_budget(budget_bytes) -> None:
    if budget_bytes is not None:
        validation.positive("budget_bytes", budget_bytes, hint="(bytes, or None: no budget)")


class _Budget:
    """Counts saved-tensor bytes on top of `resident`; raises MemoryBudgetExceeded past `budget`."""

    def __init__(self, budget: float, resident: int):
        self.budget, self.resident = budget, resident
        self.counter = measure.StorageCounter()
        self.peak = resident

    @property
    def in_use(self) -> int:
        return self.resident + self.counter.bytes

    def add(self, nbytes: int) -> None:
        """Account `nbytes` more (e.g. the logits, which autograd does not save but the loop holds)."""
        if self.in_use + nbytes > self.budget:
            raise MemoryBudgetExceeded(nbytes, self.in_use, self.budget)
        self.resident += nbytes
        self.peak = max(self.peak, self.in_use)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not measure.is_parameter(t):
            before = self.in_use
            added = self.counter.add(t)
            if before + added > self.budget:
                raise MemoryBudgetExceeded(added, before, self.budget)
            self.peak = max(self.peak, self.in_use)
        return t


@contextmanager
def enforced_budget(budget_bytes: float | None, resident_bytes: int = 0):
    """A memory budget on the CPU: inside the block, every tensor autograd saves for backward is counted (each
    storage once, parameters left out) on top of `resident_bytes`, and `MemoryBudgetExceeded` is raised as soon
    as the total passes `budget_bytes` (None: count, never raise). Yields the counter (`.in_use`, `.peak`,
    `.add(nbytes)`)."""
    _check_budget(budget_bytes)
    budget_bytes = math.inf if budget_bytes is None else budget_bytes
    validation.integer("resident_bytes", resident_bytes, low=0)
    if resident_bytes > budget_bytes:
        raise MemoryBudgetExceeded(resident_bytes, 0, budget_bytes)
    budget = _Budget(budget_bytes, resident_bytes)
    with torch.autograd.graph.saved_tensors_hooks(budget.pack, lambda t: t):
        yield budget


@contextmanager
def _cuda_budget(device: torch.device, budget_bytes: float | None):
    """The real allocator, capped: torch.cuda.OutOfMemoryError past `budget_bytes` (the fraction is of the whole
    device, so what is already allocated counts against it, like the CPU budget's resident bytes)."""
    total = runtime.device_properties(device).total_memory
    budget_bytes = total if budget_bytes is None else budget_bytes
    runtime.empty_cache(device)
    runtime.set_memory_fraction(min(1.0, budget_bytes / total), device)
    try:
        yield
    finally:
        runtime.set_memory_fraction(1.0, device)


@dataclass(frozen=True)
class StepMemory:
    """What `measure_step` saw: `error` is None when the step fit; bytes are those of the end of the forward."""

    state_bytes: int  # parameters + gradients + optimizer state, resident
    activation_bytes: int  # saved for backward (CPU budget; on CUDA: the allocator's peak above the state)
    logits_bytes: int
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def total(self) -> int:
        return self.state_bytes + self.activation_bytes + self.logits_bytes


def measure_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                 budget_bytes: float | None = None, *, checkpointing: bool = False) -> StepMemory:
    """One training step of llmlab's GPT `model` on (x, y) (B, T) under a memory budget; an OOM is caught and
    returned in `.error` (MemoryBudgetExceeded on CPU, torch.cuda.OutOfMemoryError on CUDA), not raised.
    Run it on a step after the first, so the optimizer's state and the gradients are resident."""
    if not isinstance(model, GPT):
        raise ValueError(f"model must be a llmlab.model.GPT, got {type(model).__name__}")
    _check_budget(budget_bytes)
    state = measure.model_state_bytes(model, optimizer).total
    blocks = model.transformer.h if checkpointing else []
    saved = logits_bytes = 0
    optimizer.zero_grad(set_to_none=False)  # the gradients stay resident, as the planner counts them
    try:
        if x.device.type == "cuda":
            with _cuda_budget(x.device, budget_bytes), measure.peak_allocated(x.device) as peak:
                with checkpoint.checkpointed(blocks):
                    logits, loss = model(x, y)  # (B, T, V), scalar
                logits_bytes = measure.tensor_bytes(logits)
                saved = runtime.memory_allocated(x.device) - peak.start - logits_bytes
            loss.backward()  # outside the cap, as on the CPU: the budget is the forward's (what the planner counts)
        else:
            with enforced_budget(budget_bytes, state) as budget, checkpoint.checkpointed(blocks):
                logits, loss = model(x, y)  # (B, T, V), scalar
                saved, logits_bytes = budget.counter.bytes, measure.tensor_bytes(logits)
                budget.add(logits_bytes)
            loss.backward()
        optimizer.step()
    except (MemoryBudgetExceeded, runtime.OutOfMemoryError) as e:
        return StepMemory(state, saved, logits_bytes, e)
    return StepMemory(state, saved, logits_bytes)


def measure_config(config: GPTConfig, batch_size: int, budget_bytes: float | None = None, *,
                   checkpointing: bool = False, device: torch.device | str = "cpu", seed: int = 0) -> StepMemory:
    """Build `config`'s GPT with fp32 AdamW on `device`, take one unbudgeted step (so AdamW's moments exist),
    then `measure_step` under `budget_bytes` — the planner's precision="fp32", optimizer="adamw" setting."""
    torch.manual_seed(seed)
    model = GPT(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1), device=device)  # (B, T+1)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()  # (B, T) each: the targets are the next tokens
    model(x, y)[1].backward()
    opt.step()
    return measure_step(model, opt, x, y, budget_bytes, checkpointing=checkpointing)
