"""Pipeline parallelism: a model cut into stages on ranks, micro-batches handed on with point-to-point.

A batch is split into m micro-batches. Stage s (rank s of p) runs its layers on each micro-batch, sends the
activation to stage s+1, and later receives the gradient of that activation back from s+1, runs backward and
sends the gradient of its input to s-1. Which rank runs what when is a schedule, kept as data in
`llmlab.parallel.schedules` (re-exported here): GPipe (Huang et al. 2019), 1F1B (PipeDream-Flush; Narayanan et
al. 2021, §2.2.1), interleaved 1F1B with v model chunks per rank (§2.2.2) and the zero-bubble ZB-H1 (Qi et al.
2023, simulated only). With every stage equally fast, GPipe and 1F1B leave each rank idle (p-1)/(m+p-1) of the
step, interleaving (p-1)/(v·m+p-1) (the paper's (p-1)/(v·m) of the ideal time; see `schedules` for both forms).
GPipe holds the activations of all m micro-batches at once, 1F1B at most p-s on stage s: memory bounded by p.

`simulate` computes the timeline of a schedule from per-micro-batch times; `pipeline_step` runs it for real on
ranks and records its own timeline (an `llmlab.timeline.Timeline` of forward "F" and backward "B" spans, one lane
per rank); `llmlab.plots.plot_timeline` draws either one. `measured_bubble` summarises the bubble of several real
steps (median and spread, as `llmlab.timing` judges any figure). `SimulatedCompute` stands in for a stage's device
time where the ranks share a few CPU cores (see its docstring for why a measured bubble needs it there).

    from llmlab import dist
    from llmlab.parallel import pipeline

    def step(seq, batch, target):               # on every rank of dist.spawn(step, p, ...)
        stage = pipeline.partition(seq, td.get_world_size())[td.get_rank()]
        return pipeline.pipeline_step(stage, batch, target, torch.nn.functional.mse_loss, micro_batches=4)

    def interleaved(seq, batch, target, v):     # rank s holds pieces s, s+p, s+2p, …: its v chunks
        p, s = td.get_world_size(), td.get_rank()
        chunks = pipeline.partition(seq, p * v)[s::p]
        return pipeline.pipeline_step(chunks, batch, target, torch.nn.functional.mse_loss, 4, "interleaved")

Under torchrun, call `dist.init_from_env()` first and the same function on every rank.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as td

from llmlab import timing, validation
from llmlab.memory.measure import SavedActivations
from llmlab.parallel.schedules import (
    KINDS,
    SCHEDULES,
    Action,
    bubble_fraction,
    bubble_ratio,
    peak_in_flight,
    schedule,
    simulate,
    zb_h1_bubble_fraction,
)
from llmlab.timeline import Span, Timeline

__all__ = ["SCHEDULES", "KINDS", "Action", "schedule", "simulate", "bubble_ratio", "bubble_fraction",
           "zb_h1_bubble_fraction", "peak_in_flight", "partition", "SimulatedCompute", "measured_bubble",
           "pipeline_step"]

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


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)  # what an activation with a gradient can be


def _send(t: torch.Tensor, dst: int, group, header: bool) -> list:
    """Send a tensor, after its dtype and shape when `header` (isend: never blocks, so no schedule can deadlock on
    it). The header tells the receiver what to allocate: its chunk may hold no parameters to take a dtype from."""
    works = []
    if header:
        head = torch.tensor([_DTYPES.index(t.dtype), *t.shape], dtype=torch.long)  # (1 + t.dim(),)
        works += [td.isend(x, dst, group=group) for x in (torch.tensor([head.numel()]), head)]
    return works + [td.isend(t.contiguous(), dst, group=group)]


def _recv_header(src: int, group) -> tuple[list[int], torch.dtype]:
    size = torch.empty(1, dtype=torch.long)
    td.recv(size, src, group=group)
    head = torch.empty(int(size), dtype=torch.long)  # (1 + dim,): dtype index, then the shape
    td.recv(head, src, group=group)
    return head[1:].tolist(), _DTYPES[int(head[0])]


def _recv(into: torch.Tensor, src: int, group) -> torch.Tensor:
    td.recv(into, src, group=group)
    return into


def _chunks(stage, kind: str) -> list[torch.nn.Module]:
    """This rank's model chunks: `stage` itself, or for "interleaved" the list of its v >= 2 chunks."""
    if kind == "interleaved":
        if not isinstance(stage, list | tuple | torch.nn.ModuleList) or len(stage) < 2 or not all(
                isinstance(c, torch.nn.Module) for c in stage):
            raise ValueError(f"stage must be a list of this rank's v >= 2 model chunks for kind='interleaved', got "
                             f"{type(stage).__name__}")
        return list(stage)
    if not isinstance(stage, torch.nn.Module):
        raise ValueError(f"stage must be a torch.nn.Module for kind={kind!r}, got {type(stage).__name__}")
    return [stage]


def pipeline_step(stage, batch: torch.Tensor | None, target: torch.Tensor | None, loss_fn, micro_batches: int,
                  kind: str = "1f1b", group=None) -> dict:
    """One training step's forward and backward of this rank's `stage`, by `kind`'s schedule ("gpipe", "1f1b",
    "interleaved"; `schedules.schedule`).

    For "interleaved", `stage` is the list of this rank's v chunks: chunk c of rank s is model stage c·p + s
    (`partition(layers, p * v)[s::p]`), and `micro_batches` must be a multiple of p (Narayanan et al. 2021, §2.2.2).
    Activations go from the rank holding stage k to the one holding k+1 (rank s to s+1, and rank p-1 to rank 0
    between chunks), gradients back. Each pair of ranks receives its messages in the order they were sent
    (point-to-point's rule on gloo and NCCL), which these schedules keep (the tests check it on their data).

    Rank 0 of `group` needs `batch` (B, ...) and the last rank `target`; both are split into
    `micro_batches` equal micro-batches. The loss is the mean over micro-batches, so the gradients equal
    those of the unsplit model on the whole batch. Gradients accumulate in the chunks' parameters (no
    optimizer step). Returns this rank's timeline (`Timeline.merge` joins the ranks'), its peak number and bytes
    of micro-batches held (a micro-batch counts once per chunk that holds it), and the loss on the last rank.
    """
    if kind == "zb-h1":
        raise ValueError("kind='zb-h1' is simulated only (schedules.simulate): its split backward is not run here")
    chunks = _chunks(stage, kind)
    rank, p, v = td.get_rank(group), td.get_world_size(group), len(chunks)
    plan = schedule(kind, p, micro_batches, v)[rank]
    to_global = (lambda r: td.get_global_rank(group, r)) if group is not None else (lambda r: r)
    before, after = to_global((rank - 1) % p), to_global((rank + 1) % p)  # the ranks of stages k-1 and k+1
    first, last = rank == 0, rank == p - 1  # hold model stage 0 (in chunk 0) / stage p·v-1 (in chunk v-1)
    if first and (batch is None or batch.shape[0] % micro_batches):
        raise ValueError(f"batch of {None if batch is None else batch.shape[0]} rows must split into "
                         f"micro_batches={micro_batches}")
    if last and target is None:
        raise ValueError("the last stage needs the target")
    # copies, not views: a view shares the whole batch's storage, which SavedActivations counts in full
    inputs = [c.clone() for c in batch.chunk(micro_batches)] if first else None
    targets = target.chunk(micro_batches) if last else None
    held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (chunk, micro-batch) -> (input, output)
    held_bytes: dict[tuple[int, int], int] = {}  # (chunk, micro-batch) -> bytes autograd saved for its backward
    pending, spans, total_loss = [], [], 0.0
    peak = peak_bytes = 0
    # One message per activation or gradient: every micro-batch has the shape of the first (equal chunks), so only a
    # chunk's first forward sends its shape (and dtype), and a gradient has the shape of the activation it belongs
    # to. Each message costs a wake-up of the receiver; on a busy CPU that is the larger part of a send's latency.
    received = [None] * v  # per chunk: (shape, dtype) of the activations it receives
    shape_out = [None] * v  # per chunk: the shape of those it sends
    for a in plan:
        c, key = a.chunk, (a.chunk, a.micro_batch)
        starts, ends = first and c == 0, last and c == v - 1  # this chunk is the model's first / last stage
        if a.kind == "F":  # each action's clock starts once its input is here: waiting is the bubble
            if starts:
                x = inputs[a.micro_batch]
            else:
                if received[c] is None:
                    received[c] = _recv_header(before, group)
                shape, dtype = received[c]
                x = _recv(torch.empty(shape, dtype=dtype), before, group).requires_grad_()
            start = time.perf_counter()
            with SavedActivations() as saved:  # what autograd keeps for this micro-batch's backward
                y = chunks[c](x)
            if ends:
                y = loss_fn(y, targets[a.micro_batch]) / micro_batches
                total_loss += y.item()
            else:
                if shape_out[c] is not None and y.shape != shape_out[c]:
                    raise ValueError(f"stage {c * p + rank} gave micro-batch {a.micro_batch} an output of shape "
                                     f"{tuple(y.shape)} after micro-batch 0's {tuple(shape_out[c])}: a stage must "
                                     "give every micro-batch the same shape")
                pending += _send(y.detach(), after, group, header=shape_out[c] is None)
                shape_out[c] = y.shape
            held[key], held_bytes[key] = (x, y), saved.bytes
            peak = max(peak, len(held))
            peak_bytes = max(peak_bytes, sum(held_bytes.values()))
        else:
            x, y = held.pop(key)
            del held_bytes[key]
            grad = None if ends else _recv(torch.empty_like(y), after, group)
            start = time.perf_counter()
            y.backward(grad)
            if not starts:
                pending += _send(x.grad, before, group, header=False)
        spans.append(Span(rank, a.kind, a.micro_batch, start, time.perf_counter()))
    for work in pending:
        work.wait()
    return {"timeline": Timeline(tuple(spans), lane_name="stage"), "peak_in_flight": peak,
            "peak_activation_bytes": peak_bytes, "loss": total_loss if last else None}
