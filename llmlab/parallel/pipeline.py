"""Pipeline parallelism: a model cut into stages on ranks, micro-batches handed on with point-to-point.

A batch is split into m micro-batches. Stage s (rank s of p) runs its layers on each micro-batch, sends the
activation to stage s+1, and later receives the gradient of that activation back from s+1, runs backward and
sends the gradient of its input to s-1. Two schedules of the same work:

- GPipe (Huang et al. 2019): every forward, then every backward. A stage holds the activations of all m
  micro-batches at once.
- 1F1B (PipeDream-Flush; Narayanan et al. 2021, §2.2): stage s warms up with p-s-1 forwards, then alternates
  one forward and one backward, then cools down with the remaining backwards. It holds at most p-s
  micro-batches' activations: memory bounded by p, not m.

Both leave each stage idle for the same "bubble": (p-1) of the (m+p-1) slots of the pipeline, so the bubble
fraction is (p-1)/(m+p-1) when every stage takes the same time per micro-batch. `simulate` computes the
timeline of a schedule from per-micro-batch times; `pipeline_step` runs it for real on ranks and records
its own timeline (an `llmlab.timeline.Timeline` of forward "F" and backward "B" spans, one lane per stage);
`llmlab.plots.plot_timeline` draws either one. `measured_bubble` summarises the bubble of several real steps (median
and spread, as `llmlab.timing` judges any figure). `SimulatedCompute` stands in for a stage's device time where the
ranks share a few CPU cores (see its docstring for why a measured bubble needs it there).

    from llmlab import dist
    from llmlab.parallel import pipeline

    def step(seq, batch, target):               # on every rank of dist.spawn(step, p, ...)
        stage = pipeline.partition(seq, td.get_world_size())[td.get_rank()]
        return pipeline.pipeline_step(stage, batch, target, torch.nn.functional.mse_loss, micro_batches=4)

Under torchrun, call `dist.init_from_env()` first and the same function on every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as td

from llmlab import timing, validation
from llmlab.memory.measure import SavedActivations
from llmlab.timeline import Span, Timeline

__all__ = ["SCHEDULES", "Action", "schedule", "simulate", "bubble_fraction", "peak_in_flight", "partition",
           "SimulatedCompute", "measured_bubble", "pipeline_step"]

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    micro_batch: int


def peak_in_flight(timeline: Timeline) -> list[int]:
    """Per stage of a pipeline's `timeline`: the most micro-batches whose forward had run but not yet their
    backward (whose activations the stage held at once)."""
    peaks = []
    for stage in timeline.lanes:
        live = peak = 0
        for s in timeline.on(stage):
            live += 1 if s.kind == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """(p-1)/(m+p-1): the pipeline bubble with equal time per stage."""
    _check_sizes(stages, micro_batches)
    return (stages - 1) / (micro_batches + stages - 1)


def _check_sizes(stages, micro_batches) -> None:
    validation.integer("stages", stages, low=1)
    validation.integer("micro_batches", micro_batches, low=1)


def schedule(kind: str, stages: int, micro_batches: int) -> list[list[Action]]:
    """Each stage's actions in the order it runs them."""
    _check_sizes(stages, micro_batches)
    validation.one_of("kind", kind, SCHEDULES)
    m = micro_batches
    plans = []
    for s in range(stages):
        if kind == "gpipe":
            plans.append([Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)])
            continue
        warmup = min(stages - s - 1, m)
        plan = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: one forward, one backward
            plan += [Action("F", warmup + i), Action("B", i)]
        plan += [Action("B", i) for i in range(m - warmup, m)]  # cool-down
        plans.append(plan)
    return plans


def simulate(kind: str, stages: int, micro_batches: int, t_forward: float = 1.0,
             t_backward: float = 2.0) -> Timeline:
    """The timeline of `schedule(kind, …)` when each forward takes t_forward and each backward t_backward.

    An action starts when its stage is free and its input is there: F(s, i) needs F(s-1, i), B(s, i) needs
    B(s+1, i) (and F(s, i)). Sends are taken as instantaneous.
    """
    validation.positive("t_forward", t_forward)
    validation.positive("t_backward", t_backward)
    plans = schedule(kind, stages, micro_batches)
    done: dict[tuple[int, str, int], float] = {}
    position, free_at, spans = [0] * stages, [0.0] * stages, []
    while any(position[s] < len(plans[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if position[s] == len(plans[s]):
                continue
            a = plans[s][position[s]]
            need = [(s - 1, "F", a.micro_batch)] if a.kind == "F" and s > 0 else []
            if a.kind == "B":
                need = [(s, "F", a.micro_batch)] + ([(s + 1, "B", a.micro_batch)] if s < stages - 1 else [])
            if all(n in done for n in need):
                start = max([free_at[s]] + [done[n] for n in need])
                end = start + (t_forward if a.kind == "F" else t_backward)
                done[(s, a.kind, a.micro_batch)] = free_at[s] = end
                spans.append(Span(s, a.kind, a.micro_batch, start, end))
                position[s] += 1
                progressed = True
        if not progressed:  # cannot happen for these schedules; guards a wrong one against looping forever
            raise RuntimeError(f"schedule {kind!r} deadlocks: {[plans[s][position[s]] for s in range(stages)]}")
    return Timeline(tuple(spans), lane_name="stage")


def partition(layers: torch.nn.Sequential, stages: int) -> list[torch.nn.Sequential]:
    """Cut `layers` into `stages` consecutive pieces of (nearly) equal length."""
    if not isinstance(layers, torch.nn.Sequential):
        raise ValueError(f"layers must be a torch.nn.Sequential, got {type(layers).__name__}")
    validation.integer("stages", stages, 1, len(layers), hint="(at most one stage per layer)")
    bounds = torch.linspace(0, len(layers), stages + 1).round().long().tolist()
    return [layers[bounds[i]:bounds[i + 1]] for i in range(stages)]


class _Wait(torch.autograd.Function):
    """Identity on values; sleeps `forward_s` in the forward pass and `backward_s` in the backward pass."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SimulatedCompute(torch.nn.Module):
    """A stand-in for a stage's device time: identity on values, it takes `forward_s` seconds in each forward
    and `backward_s` in each backward by sleeping, as a rank's process waits while its own GPU computes.

    Stages on ranks that share a few CPU cores contend for them when they compute, so a stage's time would include
    time taken by the other stages (and by any other program): the measured bubble would mix the schedule's idle
    time with the machine's. A sleeping stage takes no core, so each stage has, in effect, its own processor, as
    (p-1)/(m+p-1) assumes; the sends, receives and the schedule stay real. Put it after a stage's layers:
    `torch.nn.Sequential(stage, SimulatedCompute(0.005, 0.010))`."""

    def __init__(self, forward_s: float, backward_s: float):
        super().__init__()
        self.forward_s = validation.number("forward_s", forward_s, low=0)
        self.backward_s = validation.number("backward_s", backward_s, low=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Wait.apply(x, self.forward_s, self.backward_s)  # (same shape as x)

    def extra_repr(self) -> str:
        return f"forward_s={self.forward_s}, backward_s={self.backward_s}"


def measured_bubble(timelines) -> timing.Comparison:
    """The bubble of a pipeline measured over several steps (rounds), one merged `Timeline` per step: the stages'
    mean idle seconds (`impl`) against the step's makespan (`peer`), and their ratio per step — the idle share
    `Timeline.idle` — whose median is `.ratio`, with its spread, `.note()` and the machine's load."""
    timelines = list(timelines)
    if not timelines or not all(isinstance(t, Timeline) for t in timelines):
        raise ValueError(f"timelines must be a non-empty list of Timeline, got {timelines!r}")
    load = timing.Load.now()
    idle = timing.Timing.from_samples([t.idle * t.makespan for t in timelines], load=load)
    makespan = timing.Timing.from_samples([t.makespan for t in timelines], load=load)
    return timing.Comparison(idle, makespan, tuple(t.idle for t in timelines))


def _send(t: torch.Tensor, dst: int, group, header: bool) -> list:
    """Send a tensor, after its shape when `header` (isend: never blocks, so no schedule can deadlock on it)."""
    works = []
    if header:
        shape = torch.tensor([t.dim(), *t.shape], dtype=torch.long)
        works += [td.isend(x, dst, group=group) for x in (torch.tensor([shape.numel()]), shape)]
    return works + [td.isend(t.contiguous(), dst, group=group)]


def _recv_shape(src: int, group) -> list[int]:
    size = torch.empty(1, dtype=torch.long)
    td.recv(size, src, group=group)
    shape = torch.empty(int(size), dtype=torch.long)
    td.recv(shape, src, group=group)
    return shape[1:].tolist()


def _recv(into: torch.Tensor, src: int, group) -> torch.Tensor:
    td.recv(into, src, group=group)
    return into


def pipeline_step(stage: torch.nn.Module, batch: torch.Tensor | None, target: torch.Tensor | None, loss_fn,
                  micro_batches: int, kind: str = "1f1b", group=None) -> dict:
    """One training step's forward and backward of this rank's `stage`, by `kind`'s schedule.

    Rank 0 of `group` needs `batch` (B, ...) and the last rank `target`; both are split into
    `micro_batches` equal micro-batches. The loss is the mean over micro-batches, so the gradients equal
    those of the unsplit model on the whole batch. Gradients accumulate in `stage`'s parameters (no
    optimizer step). Returns this rank's timeline (`Timeline.merge` joins the ranks'), its peak number and bytes
    of micro-batches held, and the loss on the last rank.
    """
    rank, p = td.get_rank(group), td.get_world_size(group)
    first, last = rank == 0, rank == p - 1
    to_global = (lambda r: td.get_global_rank(group, r)) if group is not None else (lambda r: r)
    dtype = next(stage.parameters()).dtype
    if first and (batch is None or batch.shape[0] % micro_batches):
        raise ValueError(f"batch of {None if batch is None else batch.shape[0]} rows must split into "
                         f"micro_batches={micro_batches}")
    if last and target is None:
        raise ValueError("the last stage needs the target")
    # copies, not views: a view shares the whole batch's storage, which SavedActivations counts in full
    inputs = [c.clone() for c in batch.chunk(micro_batches)] if first else None
    targets = target.chunk(micro_batches) if last else None
    held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # micro-batch -> (input, output) kept for backward
    held_bytes: dict[int, int] = {}  # micro-batch -> bytes of activations autograd saved for its backward
    pending, spans, total_loss = [], [], 0.0
    peak = peak_bytes = 0
    # One message per activation or gradient: every micro-batch has the shape of the first (equal chunks), so only
    # the first forward sends its shape, and a gradient has the shape of the activation it belongs to. Each message
    # costs a wake-up of the receiver; on a busy CPU that is the larger part of a send's latency.
    shape_in = shape_out = None  # of the activations this stage receives / sends
    for a in schedule(kind, p, micro_batches)[rank]:
        if a.kind == "F":  # each action's clock starts once its input is here: waiting is the bubble
            if first:
                x = inputs[a.micro_batch]
            else:
                if shape_in is None:
                    shape_in = _recv_shape(to_global(rank - 1), group)
                x = _recv(torch.empty(shape_in, dtype=dtype), to_global(rank - 1), group).requires_grad_()
            start = time.perf_counter()
            with SavedActivations() as saved:  # what autograd keeps for this micro-batch's backward
                y = stage(x)
            if last:
                y = loss_fn(y, targets[a.micro_batch]) / micro_batches
                total_loss += y.item()
            else:
                if shape_out is not None and y.shape != shape_out:
                    raise ValueError(f"stage {rank} gave micro-batch {a.micro_batch} an output of shape "
                                     f"{tuple(y.shape)} after micro-batch 0's {tuple(shape_out)}: a stage must give "
                                     "every micro-batch the same shape")
                pending += _send(y.detach(), to_global(rank + 1), group, header=shape_out is None)
                shape_out = y.shape
            held[a.micro_batch], held_bytes[a.micro_batch] = (x, y), saved.bytes
            peak = max(peak, len(held))
            peak_bytes = max(peak_bytes, sum(held_bytes.values()))
        else:
            x, y = held.pop(a.micro_batch)
            del held_bytes[a.micro_batch]
            grad = None if last else _recv(torch.empty_like(y), to_global(rank + 1), group)
            start = time.perf_counter()
            y.backward(grad)
            if not first:
                pending += _send(x.grad, to_global(rank - 1), group, header=False)
        spans.append(Span(rank, a.kind, a.micro_batch, start, time.perf_counter()))
    for work in pending:
        work.wait()
    return {"timeline": Timeline(tuple(spans), lane_name="stage"), "peak_in_flight": peak,
            "peak_activation_bytes": peak_bytes, "loss": total_loss if last else None}

