"""Overlapping communication with computation: all-reduce a layer's gradient while the next layer computes.

In a backward pass the last layer's gradient is ready first. A serial implementation waits for its
all-reduce before computing the next layer's gradient; DDP instead starts the all-reduce asynchronously
(gradient buckets, `async_op=True` on a separate stream) and keeps computing, waiting only at the end. When
communication is shorter than computation, all of it but the last layer's hides behind compute.

This module runs that pattern on real ranks with stand-in layers (a `batch × dim` by `dim × dim` matmul and a
`dim × dim` "gradient" per layer, tens of ms each on a laptop core) and records every compute and
communication span on every rank:

    from llmlab import dist
    from llmlab.dist import overlap

    with dist.Cluster(2) as cluster:
        runs = overlap.compare(cluster)            # {"serial": [Timeline per rank], "async": [...]}
    for mode, timelines in runs.items():
        print(mode, max(t.total for t in timelines))
    overlap.plot_timeline(runs["async"])

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
from dataclasses import dataclass, field

import torch
import torch.distributed as td

from llmlab.dist.collectives import ring_all_reduce

__all__ = ["Span", "Timeline", "run_layers", "compare", "plot_timeline", "MODES", "COMMS"]

MODES = ("serial", "async")
COMMS = ("torch", "ring")


@dataclass(frozen=True)
class Span:
    kind: str  # "compute" or "comm"
    layer: int
    start: float  # seconds since the ranks started together
    end: float


@dataclass
class Timeline:
    """What one rank did in one run."""

    rank: int
    mode: str
    comm: str
    total: float  # seconds from the common start until every all-reduce had finished
    spans: list[Span] = field(default_factory=list)
    grads: list[torch.Tensor] | None = None  # the all-reduced gradients, when keep_grads=True


def run_layers(mode: str = "async", comm: str = "torch", n_layers: int = 8, dim: int = 1024, batch: int = 128,
               group=None, seed: int = 0, keep_grads: bool = False) -> Timeline:
    """On every rank of `group`: n_layers × (compute, all-reduce its gradient), serially or overlapped."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {MODES}")
    if comm not in COMMS:
        raise ValueError(f"comm={comm!r} must be one of {COMMS}")
    for name, value in (("n_layers", n_layers), ("dim", dim), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    rank = td.get_rank(group)
    weights = torch.randn(n_layers, dim, dim, generator=torch.Generator().manual_seed(seed)) / dim ** 0.5
    h = torch.randn(batch, dim, generator=torch.Generator().manual_seed(seed + 1 + rank))  # this rank's data
    spans, lock = [], threading.Lock()

    def record(kind, layer, start, end):
        with lock:  # comm spans may be recorded on gloo's or the helper's thread
            spans.append(Span(kind, layer, start - t0, end - t0))

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
    return Timeline(rank, mode, comm, total, sorted(spans, key=lambda s: (s.start, s.kind)),
                    grads if keep_grads else None)


def compare(cluster, modes=MODES, warmup: int = 1, timeout: float = 120.0, **kwargs) -> dict[str, list[Timeline]]:
    """Run `run_layers` in each mode on every rank of `cluster` (a `dist.Cluster`); {mode: [Timeline per rank]}.

    `warmup` untimed runs first (thread pools, allocator, gloo buffers). `kwargs` go to `run_layers`.
    """
    for _ in range(warmup):
        cluster.run(_run, "serial", {**kwargs, "n_layers": 1}, timeout=timeout)
    return {mode: cluster.run(_run, mode, kwargs, timeout=timeout) for mode in modes}


def _run(mode, kwargs):
    return run_layers(mode, **kwargs)


def plot_timeline(timelines: list[Timeline], ax=None, title: str | None = None):
    """One row per rank: compute bars above, communication bars below; returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.8 + 0.7 * len(timelines)))
    colors = {"compute": "tab:blue", "comm": "tab:orange"}
    for t in timelines:
        for kind, offset in (("compute", -0.35), ("comm", 0.05)):  # y grows downwards (inverted below)
            bars = [(s.start * 1e3, (s.end - s.start) * 1e3) for s in t.spans if s.kind == kind]
            ax.broken_barh(bars, (t.rank + offset, 0.3), color=colors[kind], edgecolor="white",
                           label=kind if t.rank == timelines[0].rank else None)
    ax.set_yticks([t.rank for t in timelines], [f"rank {t.rank}" for t in timelines])
    ax.set_xlabel("ms since the common start")
    ax.invert_yaxis()
    if timelines:
        t = timelines[0]
        ax.set_title(title or f"{t.mode} ({t.comm}): {max(x.total for x in timelines) * 1e3:.0f} ms")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    return ax
