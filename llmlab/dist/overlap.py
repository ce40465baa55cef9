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
        runs = overlap.compare(cluster)            # {"serial": [RankRun per rank], "async": [...]}
    for mode, ranks in runs.items():
        print(mode, max(r.total for r in ranks))
    plots.plot_timeline(Timeline.merge(r.timeline for r in runs["async"]), split_kinds=True)

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

from llmlab import validation
from llmlab.dist.collectives import ring_all_reduce
from llmlab.timeline import Span, Timeline

__all__ = ["RankRun", "run_layers", "compare", "MODES", "COMMS"]

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


def compare(cluster, modes=MODES, warmup: int = 1, timeout: float = 120.0, **kwargs) -> dict[str, list[RankRun]]:
    """Run `run_layers` in each mode on every rank of `cluster` (a `dist.Cluster`); {mode: [RankRun per rank]}.

    `warmup` untimed runs first (thread pools, allocator, gloo buffers). `kwargs` go to `run_layers`.
    """
    for _ in range(warmup):
        cluster.run(_run, "serial", {**kwargs, "n_layers": 1}, timeout=timeout)
    return {mode: cluster.run(_run, mode, kwargs, timeout=timeout) for mode in modes}


def _run(mode, kwargs):
    return run_layers(mode, **kwargs)
