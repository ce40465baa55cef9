"""Out of memory: predict it from the memory model, rank the remedies, and check the prediction under a budget.

The material's §7.1 lists four remedies for an OOM — a smaller batch, gradient checkpointing, a smaller model,
ZeRO. Ranked beside them here: memory-efficient attention, which drops the T² attention matrices (Rabe & Staats
2021, "Self-attention Does Not Need O(n²) Memory"; Dao et al. 2022, "FlashAttention"; `GPTConfig(flash=True)`
runs `torch.nn.functional.scaled_dot_product_attention`), ZeRO's three stages (Rajbhandari et al. 2020), CPU
offload of the gradients and optimizer state (ZeRO-Offload, Ren et al. 2021) and selective recompute of the attention
core (Korthikanti et al. 2022 §5, `GPTConfig(recompute="selective")`). The planner (`llmlab.memory.planner`,
after Rajbhandari et al. 2020 and Korthikanti et al. 2022) says what each one saves before anything runs, and the
ranking puts the cheapest first (`COSTS`: what a remedy costs, in an order that is a convention, not a time estimate;
the FLOPs a recompute adds; then the saving). A GPU's budget is a fraction of its capacity in bytes, which vendors
label in binary gigabytes (an "80 GB" A100 holds 80 GiB: `SPECS[...].memory_bytes`):

    from llmlab.diagnose import oom
    from llmlab.hardware import SPECS
    report = oom.diagnose(GPTConfig.preset("gpt2"), batch_size=16, budget_bytes=0.9 * SPECS["A100 SXM"].memory_bytes,
                          data=8)
    report.fits, report.over_bytes
    report.remedies        # [Remedy(name, change, cost, price, plan, saving, fits, step, extra_flops), ...]

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
out of memory where the forward fit, the first GPU run of this module.) `measure_zero_config` runs the same step
with `llmlab.memory.zero.ZeRO` on real gloo ranks, each under the budget; `measure_remedies` runs every remedy that
runs on a CPU, with and without the budget; `snapshot_step` records the step's every
allocation and free (`runtime.memory_history`: CUDA's memory snapshot, the profiler's on a CPU).

Claim C18 (the remedies' savings are predictable) is measured with this module in `llmlab.claims.ch07`.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from llmlab import dist, flops, runtime, validation
from llmlab.memory import checkpoint, measure, planner, zero
from llmlab.model import GPT, GPTConfig

__all__ = ["MemoryBudgetExceeded", "COSTS", "Remedy", "OOMReport", "offloaded", "remedies", "diagnose",
           "forward_bytes", "binary_size", "enforced_budget", "StepMemory", "measure_step", "measure_config",
           "measure_remedies", "measure_zero_config", "snapshot_step"]

# What a remedy costs, cheapest first: `remedies` ranks by this, then by the FLOPs a recompute adds, then by saving.
# The order between these classes is a convention (what a remedy changes: nothing, the messages, the work, the
# training), not an estimate of time: whether ZeRO-3's extra all-gathers or offload's PCIe traffic and CPU Adam step
# cost more than a recompute's few percent of FLOPs depends on the links, the CPU and the overlap (Ren et al. 2021
# discuss the CPU step as offload's bottleneck). Within "compute", the FLOPs a recompute adds do order the remedies.
COSTS = (
    "nothing",  # the same computation, in less memory
    "communication, same volume",  # ZeRO-1/2: reduce-scatter + all-gather, 2Ψ as DP's all-reduce (ZeRO paper §7)
    "communication, more",  # ZeRO-3: 3Ψ; offload: gradients and parameters over PCIe, the Adam step on the CPU
    "compute",  # recomputed forwards, or more and smaller passes
    "the training itself",  # fewer samples per update, or another model
)


def binary_size(nbytes: float) -> str:
    """`nbytes` in the binary unit that reads best (bytes, KiB, MiB, GiB: 2¹⁰, 2²⁰, 2³⁰ bytes), as torch's CUDA
    out-of-memory message and nvidia-smi write memory: '512 bytes', '10.17 MiB', '76.10 GiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} bytes"


class MemoryBudgetExceeded(RuntimeError):
    """The CPU stand-in for `torch.cuda.OutOfMemoryError`: an allocation would pass the enforced budget."""

    def __init__(self, requested: int, in_use: int, budget: float):
        self.requested, self.in_use, self.budget = requested, in_use, budget
        super().__init__(f"Out of memory (enforced budget). Tried to allocate {binary_size(requested)}; "
                         f"{binary_size(in_use)} already in use of a budget of {binary_size(budget)}")

    def __reduce__(self):  # pickled by its fields, so a rank's error reaches the caller (dist.spawn) intact
        return type(self), (self.requested, self.in_use, self.budget)


@dataclass(frozen=True)
class Remedy:
    """One way out of an OOM: the plan it gives, what it saves against the original plan, and whether it fits."""

    name: str
    change: str  # what to change, in words
    cost: str  # one of COSTS
    price: str  # what exactly is paid, in words, with its source
    plan: planner.Plan
    saving: float  # bytes: original total - this plan's total
    fits: bool
    # the step it plans: config, batch_size, checkpointing, ZeRO stage and data ranks (None: the same step, with
    # the state elsewhere — offload); `measure_remedies` runs it
    step: dict | None = None
    extra_flops: float = 0.0  # the matmul FLOPs its recompute adds, as a fraction of the step's


@dataclass(frozen=True)
class OOMReport:
    """`diagnose`'s answer: the plan, the budget, and the remedies ranked cheapest first (see `remedies`)."""

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
        """The verdict and the ranked remedies, in binary units (as `MemoryBudgetExceeded` and nvidia-smi)."""
        scale, unit = (2**30, "GiB") if self.budget_bytes >= 2**30 else (2**20, "MiB")
        head = (f"planned {self.plan.total / scale:.3g} {unit} of a {self.budget_bytes / scale:.3g} {unit} budget: "
                + ("fits" if self.fits else f"OOM, {self.over_bytes / scale:.3g} {unit} over"))
        lines = [head] + [f"  {'fits' if r.fits else 'OOM '}  saves {r.saving / scale:8.3g} {unit} → "
                          f"{r.plan.total / scale:8.3g} {unit}  {r.name}: {r.change}  [costs {r.cost}]"
                          for r in self.remedies]
        return "\n".join(lines)


def offloaded(plan: planner.Plan) -> planner.Plan:
    """`plan` with the gradients and the optimizer state in CPU memory, as ZeRO-Offload keeps them (Ren et al.
    2021: the 16-bit parameters, forward and backward stay on the GPU; gradients, fp32 master weights, Adam's moments
    and the optimizer step go to the CPU). The gradient buckets in flight to the CPU are left out, as the planner
    leaves out communication buffers."""
    return replace(plan, grads=0.0, optimizer_state=0.0)


def remedies(config: GPTConfig, batch_size: int, budget_bytes: float, *, zero_ranks: int = 8,
             **plan_kwargs) -> list[Remedy]:
    """Each remedy applied alone to `planner.plan(config, batch_size, **plan_kwargs)`, cheapest first (`COSTS`,
    then the FLOPs a recompute adds), then largest predicted saving first. `zero_ranks` is the data-parallel degree
    ZeRO shards over when the plan has `data=1`.

    - memory-efficient attention (Rabe & Staats 2021; Dao et al. 2022): `flash=True`, no T² matrix is kept;
    - ZeRO-1, -2, -3: each stage above the plan's (Rajbhandari et al. 2020), over the plan's data ranks (or
      `zero_ranks`);
    - CPU offload: gradients and optimizer state in CPU memory (ZeRO-Offload, Ren et al. 2021; `offloaded`);
    - selective recompute (Korthikanti et al. 2022 §5): the attention core is recomputed, not kept;
    - gradient checkpointing (Chen et al. 2016): every block keeps only its input;
    - gradient accumulation: half the micro-batch, two of them per step (the same samples per step, twice the
      steps' passes — memory of the small batch, optimisation of the large one);
    - smaller batch: half the micro-batch (fewer samples per step);
    - smaller model: half the blocks.

    A remedy whose plan saves nothing here (its saving ≤ 0 bytes: checkpointing a single block keeps its input
    *and* rebuilds the block) is left out. The order between `COSTS` classes is a convention, not a time estimate.
    """
    validation.positive("budget_bytes", budget_bytes, hint="(bytes)")
    validation.integer("zero_ranks", zero_ranks, low=2, hint="(ZeRO shards over data ranks)")
    base = planner.plan(config, batch_size, **plan_kwargs)
    options: list[tuple] = []  # name, change, cost, price, what changes[, the step's FLOPs it adds]
    if not config.flash:
        options.append(("memory-efficient attention", "GPTConfig(flash=True): scaled_dot_product_attention, or "
                        "llmlab.kernels.attention (FlashAttention-2 in Triton, chapter 3: it keeps O and the "
                        "log-sum-exp, O(T), not the T×T scores)", "nothing",
                        "none: the same attention to rounding, and faster on GPUs (fewer reads and writes of GPU "
                        "memory, Dao et al. 2022)", {"config": replace(config, flash=True)}))
    stage, data = plan_kwargs.get("stage", 0), plan_kwargs.get("data", 1)
    n = data if data > 1 else zero_ranks
    for k in range(stage + 1, 4):
        options.append((f"ZeRO-{k}", f"stage {stage} → {k} over {n} data ranks",
                        "communication, same volume" if k < 3 else "communication, more",
                        "reduce-scatter + all-gather: the 2Ψ of DP's all-reduce (Rajbhandari et al. 2020 §7)"
                        if k < 3 else "3Ψ per step, 1.5× DP's 2Ψ: parameters all-gathered in forward and "
                        "backward (Rajbhandari et al. 2020 §7)", {"stage": k, "data": n}))
    options.append(("CPU offload", "gradients and optimizer state to CPU memory (ZeRO-Offload)", "communication, more",
                    "the gradients to the CPU and the updated 16-bit parameters back over PCIe every step "
                    "(2Ψ bytes each way in mixed precision), the optimizer step on the CPU (Ren et al. 2021)", None))
    mode = planner.checkpointing_mode(plan_kwargs.get("checkpointing", False))
    step_flops = flops.training_step_flops(config, batch_size)
    if mode == "none" and not config.flash and config.recompute == "none":
        extra = planner.recompute_flops(config, batch_size, checkpointing="selective") / step_flops
        options.append(("selective recompute", 'GPTConfig(recompute="selective"): the attention core recomputed',
                        "compute", f"q·kᵀ and p·v run again in backward: {extra:.1%} more matmul FLOPs here "
                        "(Korthikanti et al. 2022 §5)", {"config": replace(config, recompute="selective")}, extra))
    if mode != "full":
        extra = planner.recompute_flops(config, batch_size, checkpointing="full") / step_flops
        options.append(("gradient checkpointing", "checkpoint every block", "compute",
                        f"a second forward of every block in backward: {extra:.0%} more matmul FLOPs here "
                        "(Chen et al. 2016)", {"checkpointing": True}, extra))
    if batch_size > 1:
        half = batch_size // 2
        if batch_size % 2 == 0:
            options.append(("gradient accumulation", f"2 micro-batches of {half} per step (same {batch_size} "
                            "samples)", "compute", "the same update from more, smaller passes, each less efficient",
                            {"batch_size": half}))
        options.append(("smaller batch", f"batch_size {batch_size} → {half}", "the training itself",
                        "fewer samples per update: noisier gradients, a learning rate to retune", {"batch_size": half}))
    if config.n_layer > 1:
        small = replace(config, n_layer=config.n_layer // 2)
        options.append(("smaller model", f"n_layer {config.n_layer} → {small.n_layer}", "the training itself",
                        "a smaller, worse model", {"config": small}))
    out = []
    for name, change, cost, price, changed, *added in options:
        step = None
        if changed is None:  # offload: what the GPU keeps changes, not the step
            p = offloaded(base)
        else:
            step = {"config": replace(config, recompute="selective") if mode == "selective" else config,
                    "batch_size": batch_size, "stage": stage, "data": data, "checkpointing": mode == "full",
                    **changed}
            p = planner.plan(step["config"], step["batch_size"], **{**plan_kwargs, **{
                k: step[k] for k in ("checkpointing", "stage", "data")}})
        if base.total - p.total > 0:  # a remedy that saves nothing here is no remedy
            out.append(Remedy(name, change, cost, price, p, base.total - p.total, p.fits(budget_bytes), step,
                              added[0] if added else 0.0))
    return sorted(out, key=lambda r: (COSTS.index(r.cost), r.extra_flops, -r.saving))


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


def _step_under_budget(forward, step, state: int, x: torch.Tensor, y: torch.Tensor, budget_bytes: float | None,
                       blocks) -> StepMemory:
    """`forward(x, y)` under the budget on top of `state` resident bytes, then backward and `step()` outside it."""
    saved = logits_bytes = 0
    try:
        if x.device.type == "cuda":
            with _cuda_budget(x.device, budget_bytes), measure.peak_allocated(x.device) as peak:
                with checkpoint.checkpointed(blocks):
                    logits, loss = forward(x, y)  # (B, T, V), scalar
                logits_bytes = measure.tensor_bytes(logits)
                saved = runtime.memory_allocated(x.device) - peak.start - logits_bytes
            loss.backward()  # outside the cap, as on the CPU: the budget is the forward's (what the planner counts)
        else:
            with enforced_budget(budget_bytes, state) as budget, checkpoint.checkpointed(blocks):
                logits, loss = forward(x, y)  # (B, T, V), scalar
                saved, logits_bytes = budget.counter.bytes, measure.tensor_bytes(logits)
                budget.add(logits_bytes)
            loss.backward()
        step()
    except (MemoryBudgetExceeded, runtime.OutOfMemoryError) as e:
        return StepMemory(state, saved, logits_bytes, e)
    return StepMemory(state, saved, logits_bytes)


def measure_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                 budget_bytes: float | None = None, *, checkpointing: bool | str = False) -> StepMemory:
    """One training step of llmlab's GPT `model` on (x, y) (B, T) under a memory budget; an OOM is caught and
    returned in `.error` (MemoryBudgetExceeded on CPU, torch.cuda.OutOfMemoryError on CUDA), not raised.
    Run it on a step after the first, so the optimizer's state and the gradients are resident.

    `checkpointing` as the planner takes it (`planner.checkpointing_mode`): False / "none", True / "full" (every
    block checkpointed), or "selective" — the attention core recomputed, which is the model's own option: the model
    must have been built with `GPTConfig(recompute="selective")` (`measure_config` builds it so)."""
    if not isinstance(model, GPT):
        raise ValueError(f"model must be a llmlab.model.GPT, got {type(model).__name__}")
    _check_budget(budget_bytes)
    mode = planner.checkpointing_mode(checkpointing)
    if mode == "selective" and model.config.recompute != "selective":
        raise ValueError(f"checkpointing={checkpointing!r}: selective recompute is the model's own option; build it "
                         'with GPTConfig(recompute="selective") (measure_config does)')
    state = measure.model_state_bytes(model, optimizer).total
    optimizer.zero_grad(set_to_none=False)  # the gradients stay resident, as the planner counts them
    return _step_under_budget(model, optimizer.step, state, x, y, budget_bytes,
                              model.transformer.h if mode == "full" else [])


def _batch(config: GPTConfig, batch_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1), device=device)  # (B, T+1)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()  # (B, T) each: the targets are the next tokens


def _device(device) -> torch.device:
    """`device` as a torch.device, refused with a clear error where this build of torch cannot use it."""
    d = runtime.usable_device(device)
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: the memory is measured on 'cpu' or 'cuda'")
    return d


def _after_one_step(config: GPTConfig, batch_size: int, device, seed: int, checkpointing) -> tuple:
    """`config`'s GPT with fp32 AdamW on `device` after one unbudgeted step (AdamW's moments exist), its batch and
    the checkpointing mode to measure with (built with recompute="selective" when that is the mode)."""
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a llmlab.model.GPTConfig, got {type(config).__name__}")
    validation.positive_int("batch_size", batch_size)
    validation.integer("seed", seed, low=0)
    mode = planner.checkpointing_mode(checkpointing)
    device = _device(device)
    if mode == "selective":
        config = replace(config, recompute="selective")
    torch.manual_seed(seed)
    model = GPT(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch(config, batch_size, device)  # (B, T) each
    model(x, y)[1].backward()
    opt.step()
    return model, opt, x, y, mode


def measure_config(config: GPTConfig, batch_size: int, budget_bytes: float | None = None, *,
                   checkpointing: bool | str = False, device: torch.device | str = "cpu", seed: int = 0) -> StepMemory:
    """Build `config`'s GPT with fp32 AdamW on `device`, take one unbudgeted step (so AdamW's moments exist),
    then `measure_step` under `budget_bytes` — the planner's precision="fp32", optimizer="adamw" setting.
    `checkpointing` is the planner's (False/"none", "selective", True/"full"); "selective" builds the GPT with
    `recompute="selective"`, as `planner.plan(config, ..., checkpointing="selective")` counts it."""
    _check_budget(budget_bytes)
    model, opt, x, y, mode = _after_one_step(config, batch_size, device, seed, checkpointing)
    return measure_step(model, opt, x, y, budget_bytes, checkpointing=mode)


def snapshot_step(config: GPTConfig, batch_size: int, budget_bytes: float | None = None, *,
                  checkpointing: bool | str = False, device: torch.device | str = "cpu", seed: int = 0,
                  path=None) -> tuple[StepMemory, runtime.MemoryHistory]:
    """`measure_config`'s step, with its every allocation and free recorded (`runtime.memory_history`: CUDA's
    memory snapshot, or the profiler's stand-in on a CPU; written to `path` if given). The history starts after
    the first step: the model state is already resident, so its timeline is what the step adds on top."""
    _check_budget(budget_bytes)
    model, opt, x, y, mode = _after_one_step(config, batch_size, device, seed, checkpointing)
    with runtime.memory_history(device, path=path) as history:
        step = measure_step(model, opt, x, y, budget_bytes, checkpointing=mode)
    return step, history


def _zero_steps(config: GPTConfig, batch_size: int, budget_bytes: float | None, stages, seed: int) -> dict:
    """On each rank: per ZeRO stage, `config`'s GPT under ZeRO (fp32 AdamW on this rank's shard) after one
    unbudgeted step, then a step of its own micro-batch of `batch_size` without a budget and one under it."""
    out = {}
    for stage in stages:
        torch.manual_seed(seed)
        z = zero.ZeRO(GPT(config), stage)
        x, y = _batch(config, batch_size, "cpu")  # (B, T) each
        z(x, y)[1].backward()
        z.step()  # the moments and this rank's gradient shards exist, as the planner counts them
        out[stage] = tuple(_step_under_budget(z, z.step, z.state_bytes().total, x, y, b, [])
                           for b in (None, budget_bytes))
    return out


def measure_remedies(remedies: list[Remedy], budget_bytes: float) -> dict[str, tuple[StepMemory, StepMemory]]:
    """Run each of `remedies` that runs on a CPU, in fp32 AdamW (the planner's precision="fp32",
    optimizer="adamw" — plan them so to compare): {name: (held, under_budget)}, the step without a budget (what it
    holds in full) and under the enforced `budget_bytes` (whether it fits). One-process remedies run
    `measure_config`; the ZeRO stages run together on their data ranks (`measure_zero_config`, one start of the
    ranks); offload, which moves state from the GPU to the CPU, has nothing to move on a CPU and is left out."""
    _check_budget(budget_bytes)
    out, zeroed = {}, [r for r in remedies if r.step is not None and r.step["stage"] > 0]
    for r in remedies:
        if r.step is not None and r.step["stage"] == 0:
            if r.step["data"] != 1:
                raise ValueError(f"remedy {r.name!r} plans {r.step['data']} data ranks without ZeRO: measure_remedies "
                                 "runs one process (plan with data=1) or ZeRO's ranks")
            run = {k: r.step[k] for k in ("config", "batch_size", "checkpointing")}
            out[r.name] = (measure_config(**run), measure_config(**run, budget_bytes=budget_bytes))
    if zeroed:
        first = zeroed[0].step
        if any(r.step["checkpointing"] for r in zeroed):
            raise ValueError("ZeRO with checkpointing is not measured here: plan the remedies without checkpointing")
        if len({(r.step["config"], r.step["batch_size"], r.step["data"]) for r in zeroed}) > 1:
            raise ValueError("the ZeRO remedies differ in more than their stage: measure them one call each")
        steps = measure_zero_config(first["config"], first["batch_size"], budget_bytes,
                                    stages=[r.step["stage"] for r in zeroed], world_size=first["data"])
        out.update({r.name: steps[r.step["stage"]] for r in zeroed})
    return out


def measure_zero_config(config: GPTConfig, batch_size: int, budget_bytes: float | None = None, *,
                        stages=(1, 2, 3), world_size: int = 2, seed: int = 0, timeout: float = 120.0) -> dict:
    """`measure_config` with `llmlab.memory.zero.ZeRO` at each of `stages` on `world_size` fresh gloo ranks, each
    rank a micro-batch of `batch_size` (the planner's batch_size with data=world_size), in fp32 on the CPU:
    {stage: (held, under_budget)}, the StepMemory of the rank that held the most in a step without a budget
    (what the step holds in full) and in a step under the enforced `budget_bytes` (whether it fits). The ranks
    hold equal shards and equal micro-batches, so they run out of memory together or not at all (one alone would
    leave the others waiting in a collective until `timeout`)."""
    _check_budget(budget_bytes)
    validation.integer("world_size", world_size, low=2, hint="(ZeRO shards over data ranks)")
    validation.positive_int("batch_size", batch_size)
    validation.integer("seed", seed, low=0)
    if isinstance(stages, str | bytes) or not hasattr(stages, "__iter__") or not (stages := tuple(stages)):
        raise ValueError(f"stages={stages!r} must be a non-empty list of ZeRO stages (1, 2, 3)")
    for s in stages:
        validation.integer("stage", s, 1, 3, hint="(a ZeRO stage)")
    ranks = dist.spawn(_zero_steps, world_size, config, batch_size, budget_bytes, tuple(stages), seed,
                       timeout=timeout, backend="gloo")
    # the busiest rank's; under the budget a rank that ran out, if any (the ranks are alike: all or none do)
    return {s: tuple(max((r[s][i] for r in ranks), key=lambda m: (not m.ok, m.total)) for i in (0, 1))
            for s in stages}
