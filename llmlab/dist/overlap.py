"""Overlapping communication with computation: all-reduce a layer's gradient while the next layer computes.

In a backward pass the last layer's gradient is ready first. A serial implementation waits for its
all-reduce before computing the next layer's gradient; DDP instead starts the all-reduce asynchronously
(gradient buckets, `async_op=True` on a separate stream) and keeps computing, waiting only at the end. When
communication is shorter than computation, all of it but the last layer's hides behind compute.

This module runs that pattern on real ranks with stand-in layers (a `batch × dim` by `dim × dim` matmul and a
`dim × dim` "gradient" per layer, tens of ms each on a laptop core) and records every compute and
communication span on every rank (an `llmlab.timeline.Timeline`, one lane per rank, spans "compute" and "comm"):

    from llmlab import dist, plots
    from llmlab.dist import overlap
    from llmlab.timeline import Timeline

    with dist.Cluster(2) as cluster:
        runs = overlap.compare(cluster)            # serial and async, in interleaved rounds
    print(runs.timings["serial"], runs.comparison().says("async", "serial"))
    plots.plot_timeline(Timeline.merge(r.timeline for r in runs["async"]), split_kinds=True)

A run's time is its slowest rank's `total`; `compare` runs the modes in rounds, in an order rotated from round to
round (`llmlab.timing`'s method, carried over to ranks), and keeps each mode's times as a `timing.Timing` and
their per-round ratio as a `timing.Comparison`. `runs[mode]` is the ranks of that mode's typical round (the one
nearest its median), for drawing.

`comm="torch"` uses `torch.distributed.all_reduce(..., async_op=True)` (a comm span runs from the call to the
moment gloo/NCCL completes it, read from the Work's future, so it includes time queued behind the previous
all-reduce); `comm="ring"` runs llmlab's `ring_all_reduce` on one background thread, the way DDP runs its
communication on its own stream. Speed-ups are measured, not promised: on a 2-core CPU compute and gloo's
threads compete for the same cores.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as td

from llmlab import timing, validation
from llmlab.dist.collectives import ring_all_reduce
from llmlab.timeline import Span, Timeline

__all__ = ["RankRun", "Overlap", "run_layers", "compare", "MODES", "COMMS"]

MODES = ("serial", "async")
COMMS = ("torch", "ring")


@dataclass
class RankRun:
    """What one rank did in one run."""

    rank: int
    mode: str
    comm: str
    total: float  # seconds from the common start until every all-reduce had finished
    timeline: Timeline  # this rank's spans: "compute" and "comm", item = the layer, seconds since the common start
    grads: list[torch.Tensor] | None = None  # the all-reduced gradients, when keep_grads=True


def run_layers(mode: str = "async", comm: str = "torch", n_layers: int = 8, dim: int = 1024, batch: int = 128,
               group=None, seed: int = 0, keep_grads: bool = False) -> RankRun:
    """On every rank of `group`: n_layers × (compute, all-reduce its gradient), serially or overlapped."""
    validation.one_of("mode", mode, MODES)
    validation.one_of("comm", comm, COMMS)
    for name, value in (("n_layers", n_layers), ("dim", dim), ("batch", batch)):
        validation.integer(name, value, low=1)
    rank = td.get_rank(group)
    weights = torch.randn(n_layers, dim, dim, generator=torch.Generator().manual_seed(seed)) / dim ** 0.5
    h = torch.randn(batch, dim, generator=torch.Generator().manual_seed(seed + 1 + rank))  # this rank's data
    spans, lock = [], threading.Lock()

    def record(kind, layer, start, end):
        with lock:  # comm spans may be recorded on gloo's or the helper's thread
            spans.append(Span(rank, kind, layer, start - t0, end - t0))

    def ring(grad, layer):  # on the helper thread: one all-reduce after the other, in layer order
        start = time.perf_counter()
        ring_all_reduce(grad, group=group, check=False)
        record("comm", layer, start, time.perf_counter())

    def on_done(layer, start):
        return lambda future: record("comm", layer, start, time.perf_counter())

    grads, pending = [], []
    helper = ThreadPoolExecutor(1) if comm == "ring" and mode == "async" else None
    td.barrier(group)
    t0 = time.perf_counter()
    for layer in range(n_layers):
        start = time.perf_counter()
        h = torch.tanh(h @ weights[layer])  # (batch, dim)
        grad = h.T @ h / batch  # (dim, dim): this layer's "weight gradient"
        record("compute", layer, start, time.perf_counter())
        grads.append(grad)
        start = time.perf_counter()
        if mode == "serial" and comm == "ring":
            ring_all_reduce(grad, group=group, check=False)
            record("comm", layer, start, time.perf_counter())
        elif mode == "serial":
            td.all_reduce(grad, group=group)
            record("comm", layer, start, time.perf_counter())
        elif comm == "ring":
            pending.append(helper.submit(ring, grad, layer))
        else:
            work = td.all_reduce(grad, group=group, async_op=True)
            pending.append(work.get_future().then(on_done(layer, start)))
    for p in pending:  # wait for every all-reduce
        if helper:
            p.result()  # a concurrent.futures.Future
        else:
            p.wait()  # a torch.futures.Future
    total = time.perf_counter() - t0
    if helper:
        helper.shutdown()
    return RankRun(rank, mode, comm, total, Timeline(tuple(sorted(spans, key=lambda s: (s.start, s.kind))), "rank"),
                   grads if keep_grads else None)


@dataclass(frozen=True)
class Overlap:
    """`compare`'s answer: every round's ranks per mode, and each mode's time per round (its slowest rank's)."""

    rounds: dict[str, list[list[RankRun]]]  # mode → per round, the RankRun of every rank
    timings: dict[str, timing.Timing]  # mode → seconds per run, over the rounds

    def __getitem__(self, mode: str) -> list[RankRun]:
        """The ranks of `mode`'s typical round: the one whose time is nearest the mode's median."""
        t = self.timings[mode]
        typical = min(range(len(t.samples)), key=lambda k: abs(t.samples[k] - t.seconds))
        return self.rounds[mode][typical]

    def comparison(self, impl: str = "async", peer: str = "serial") -> timing.Comparison:
        """`impl`'s time against `peer`'s, round by round (below 1: `impl` is faster)."""
        a, b = self.timings[impl], self.timings[peer]
        return timing.Comparison(a, b, tuple(x / y for x, y in zip(a.samples, b.samples, strict=True)))


def compare(cluster, modes=MODES, warmup: int = 1, rounds: int = 5, timeout: float = 120.0, **kwargs) -> Overlap:
    """Run `run_layers` in each mode on every rank of `cluster` (a `dist.Cluster`), `rounds` times each.

    `warmup` untimed runs first (thread pools, allocator, gloo buffers). The modes alternate within a round, in an
    order rotated from round to round, so a busy spell of the machine hits both. `kwargs` go to `run_layers`.
    """
    modes = tuple(modes)
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"modes={modes!r} must be a non-empty selection of {MODES}")
    validation.integer("rounds", rounds, low=1)
    validation.integer("warmup", warmup, low=0)
    for _ in range(warmup):
        cluster.run(_run, "serial", {**kwargs, "n_layers": 1}, timeout=timeout)
    load = timing.Load.now()
    ran = {mode: [] for mode in modes}
    for k in range(rounds):
        for j in range(len(modes)):
            mode = modes[(k + j) % len(modes)]
            ran[mode].append(cluster.run(_run, mode, kwargs, timeout=timeout))
    load = load.busier(timing.Load.now())
    return Overlap(ran, {mode: timing.Timing.from_samples([max(r.total for r in ranks) for ranks in per_round],
                                                          load=load) for mode, per_round in ran.items()})


def _run(mode, kwargs):
    return run_layers(mode, **kwargs)
