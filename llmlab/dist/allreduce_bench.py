"""`llmlab bench allreduce`: llmlab's ring and tree all-reduce against `torch.distributed.all_reduce`.

All three run on the same ranks in one run, message size by message size (1 KiB … 64 MiB of fp32 by default),
the way nccl-tests measures a collective:

- **interleaved repeats**: every repeat times ring, tree and torch once each, in a rotating order, so a slow
  spell of the machine hits all three alike;
- **slowest rank**: the ranks leave a barrier together and each times a short run of back-to-back calls; a call
  takes as long as its slowest rank (the collective is not done before every rank is), so the time kept for a
  repeat is the maximum over ranks. Small messages are called several times per timed run (enough for about
  `span_s` seconds), so the clock's resolution and the barrier's stragglers do not dominate;
- **medians** over the repeats;
- **bus bandwidth** as nccl-tests defines it: algbw = S / t, busbw = algbw · 2(n−1)/n (`cost.bus_bandwidth`).

From the times it fits the α-β model (`cost.fit_alpha_beta`): α and β per algorithm, and one α, β for ring and
tree together — the model's premise is one link, two algorithms — from which the model predicts where the
tree stops being faster (`cost.crossover_bytes`); the measured crossover is read off the curves:

    from llmlab.dist import allreduce_bench
    run = bench.measure(sizes=[1024, 65536, 4 << 20], world_size=4)   # or cluster=an open dist.Cluster(4)
    run.crossover(), run.predicted_crossover(), run.link_fit()
    print(llmlab.tables.format_table(run.rows()))

`bench()` is what `llmlab bench allreduce` runs (4 ranks, every default size). Claim C12 (ring bandwidth-
optimal, tree latency-optimal) is measured with it in `llmlab.claims.ch04`. On a GPU machine with ≥ 2 GPUs the
ranks use NCCL and CUDA tensors; on a CPU they are gloo processes, timing loopback TCP and the cores the ranks
share.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as td

from llmlab import dist, runtime, validation
from llmlab.dist import cost
from llmlab.dist.collectives import ring_all_reduce, tree_all_reduce

__all__ = ["DEFAULT_SIZES", "CLAIM_SIZES", "IMPLS", "AllReduceRun", "measure", "bench", "recent", "format_bytes"]

DEFAULT_SIZES = tuple(1024 * 4**k for k in range(9))  # 1 KiB, 4 KiB, … 64 MiB
CLAIM_SIZES = DEFAULT_SIZES[:8]  # C12's: up to 16 MiB, past the crossover on gloo, in seconds rather than a minute
IMPLS = ("ring", "tree", "torch")
_MODEL = {"ring": "ring_all_reduce", "tree": "tree_all_reduce", "torch": "ring_all_reduce"}  # gloo's is a ring
_MAX_CALLS = 64  # back-to-back calls in one timed run, at most
_recent: dict[int, AllReduceRun] = {}  # world size → the last run measured in this process


def format_bytes(nbytes: float) -> str:
    """A message size the way the tables write it: 1024 → '1 KiB', 3 << 20 → '3 MiB' (3 significant digits)."""
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if nbytes >= 1024**power:
            return f"{nbytes / 1024**power:.3g} {unit}"
    return f"{nbytes:.3g} B"


@dataclass(frozen=True)
class AllReduceRun:
    """Median slowest-rank seconds per all-reduce call, by implementation and message size."""

    world_size: int
    backend: str
    sizes: tuple[int, ...]  # bytes per rank's buffer (nccl-tests' "size")
    seconds: dict[str, tuple[float, ...]]  # impl → one median per size
    repeats: int

    def points(self, impl: str) -> list[tuple[int, float]]:
        """[(bytes, seconds), ...] of `impl`, for fitting or plotting."""
        return list(zip(self.sizes, self.seconds[impl], strict=True))

    def busbw(self, impl: str) -> tuple[float, ...]:
        """nccl-tests' bus bandwidth of `impl` at each size, bytes per second."""
        return tuple(cost.bus_bandwidth(s, t, self.world_size) for s, t in self.points(impl))

    def fit(self, impl: str) -> cost.Fit:
        """α (s per message) and β (s per byte) of `impl` alone; torch's is fitted with the ring's model."""
        return cost.fit_alpha_beta(self.points(impl), self.world_size, _MODEL[impl])

    def link_fit(self) -> cost.Fit:
        """One α and β for ring and tree together: the link both algorithms run over, as the α-β model sees it.

        Least squares on relative errors, like `cost.fit_alpha_beta`, over the rows of both algorithms.
        """
        n, design = self.world_size, []
        for impl in ("ring", "tree"):
            a, b = cost.COLLECTIVES[_MODEL[impl]]
            design += [[a(n) / t, b(n) * s / t] for s, t in self.points(impl)]  # row · (α, β) ≈ 1
        design = np.array(design)  # (2·sizes, 2)
        coef = np.linalg.lstsq(design, np.ones(len(design)), rcond=None)[0]
        if (coef < 0).any():  # the best non-negative fit then has one of them at 0: fit the other alone
            keep = int(coef[1] > coef[0])
            coef = np.zeros(2)
            coef[keep] = max(0.0, np.linalg.lstsq(design[:, keep:keep + 1], np.ones(len(design)), rcond=None)[0][0])
        return cost.Fit(float(coef[0]), float(coef[1]), float(np.sqrt(np.mean((design @ coef - 1) ** 2))))

    def link(self) -> cost.Link:
        """This machine's link as the α-β model sees it (`link_fit`), for `cost`'s formulas and the widget."""
        f = self.link_fit()
        return cost.Link(f.alpha, f.beta, f"this machine ({self.world_size} {self.backend} ranks, fitted)",
                         "α and β fitted to ring and tree all-reduce timings by llmlab.dist.allreduce_bench")

    def measured(self) -> dict[str, list[tuple[int, float]]]:
        """{label: [(bytes, seconds), ...]} per implementation: the points `widgets.allreduce_cost_explorer` draws."""
        return {f"{impl} (measured, {self.world_size} ranks)": self.points(impl) for impl in IMPLS}

    def faster(self, nbytes_index: int) -> str:
        """'ring' or 'tree': which of the two was faster at `self.sizes[nbytes_index]`."""
        return "ring" if self.seconds["ring"][nbytes_index] < self.seconds["tree"][nbytes_index] else "tree"

    def crossover(self) -> float | None:
        """The measured size above which the ring stays faster than the tree, interpolated on log-log axes.

        None when there is no such size inside the measured range: the ring is faster everywhere, or the tree is
        still faster at the largest size.
        """
        gap = [math.log(r / t) for r, t in zip(self.seconds["ring"], self.seconds["tree"], strict=True)]
        if gap[-1] >= 0 or all(g < 0 for g in gap):
            return None
        i = max(k for k, g in enumerate(gap) if g >= 0)  # the last size where the tree was not slower
        lo, hi = math.log(self.sizes[i]), math.log(self.sizes[i + 1])
        return math.exp(lo + (hi - lo) * gap[i] / (gap[i] - gap[i + 1]))

    def predicted_crossover(self) -> float:
        """Where the α-β model puts the crossover, with the link's fitted α and β: n(n−1−⌈log₂n⌉)·α/β."""
        link = self.link_fit()
        return cost.crossover_bytes(self.world_size, link.alpha, link.beta)

    def rows(self) -> list[dict]:
        """The bench table: ring and tree vs torch per size, then the fits, then the crossover."""
        rows = []
        for i, nbytes in enumerate(self.sizes):
            peer_s = self.seconds["torch"][i]
            for impl in ("ring", "tree"):
                impl_s = self.seconds[impl][i]
                rows.append({"impl": impl, "peer": "torch", "size": nbytes, "impl_ms": impl_s * 1e3,
                             "peer_ms": peer_s * 1e3, "ratio": impl_s / peer_s,
                             "impl_busbw_GBs": self.busbw(impl)[i] / 1e9,
                             "peer_busbw_GBs": self.busbw("torch")[i] / 1e9})
        fits = {impl: self.fit(impl) for impl in IMPLS} | {"ring+tree (one link)": self.link_fit()}
        for name, f in fits.items():
            rows.append({"impl": name, "peer": "α-β fit", "alpha_us": f.alpha * 1e6,
                         "inv_beta_GBs": 1 / f.beta / 1e9 if f.beta else math.inf, "fit_rms": f.residual})
        measured, predicted = self.crossover(), self.predicted_crossover()
        rows.append({"impl": "ring/tree crossover, measured", "peer": "α-β model", "crossover_B": measured,
                     "peer_crossover_B": predicted,
                     "ratio": measured / predicted if measured is not None and predicted > 0 else None})
        return rows


def _time_on_rank(sizes, repeats: int, span_s: float) -> dict[str, list[list[float]]]:
    """On every rank: {impl: [seconds per call of each repeat] per size}, as this rank saw them."""

    device, n = runtime.device(), td.get_world_size()
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    out = {impl: [] for impl in IMPLS}
    for nbytes in sizes:
        x = torch.full((nbytes // 4,), float(td.get_rank() + 1), device=device)  # (S/4,) fp32
        ops = {"ring": lambda x=x: ring_all_reduce(x, check=False),  # benchmarks skip the input check (N−1 α)
               "tree": lambda x=x: tree_all_reduce(x, check=False),
               "torch": lambda x=x: td.all_reduce(x)}
        warm = []
        for impl, op in ops.items():  # first call: is it right? second: how long does one take?
            x.fill_(td.get_rank() + 1)
            op()
            if not bool((x == n * (n + 1) / 2).all()):
                raise RuntimeError(f"{impl} all-reduce of {nbytes} B gave a wrong sum on rank {td.get_rank()}")
            x.zero_()  # zeros from now on: sums stay 0 however often they are repeated
            sync()
            start = time.perf_counter()
            op()
            sync()
            warm.append(time.perf_counter() - start)
        slowest = torch.tensor(warm, dtype=torch.float64, device=device)
        td.all_reduce(slowest, op=td.ReduceOp.MAX)  # every rank must make the same number of calls
        calls = [min(_MAX_CALLS, max(1, math.ceil(span_s / w))) for w in slowest.tolist()]
        per_repeat = {impl: [] for impl in IMPLS}
        for rep in range(repeats):
            for k in range(len(IMPLS)):
                impl = IMPLS[(rep + k) % len(IMPLS)]  # rotate the order from repeat to repeat
                count = calls[IMPLS.index(impl)]
                td.barrier()
                sync()
                start = time.perf_counter()
                for _ in range(count):
                    ops[impl]()
                sync()
                per_repeat[impl].append((time.perf_counter() - start) / count)
        for impl in IMPLS:
            out[impl].append(per_repeat[impl])
    return out


def _check_sizes(sizes) -> tuple[int, ...]:
    sizes = tuple(sizes)
    if len(sizes) < 2:
        raise ValueError(f"sizes={sizes!r}: give at least 2 message sizes (bytes) to fit α and β")
    for i, s in enumerate(sizes):
        if validation.integer(f"sizes[{i}]", s, low=4, hint="(bytes)") % 4:
            raise ValueError(f"sizes[{i}]={s} must be a multiple of 4 bytes (a whole number of fp32 elements)")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"sizes={sizes!r} repeats a size")
    return tuple(sorted(sizes))


def measure(sizes=DEFAULT_SIZES, world_size: int = 4, *, cluster=None, repeats: int = 5, span_s: float = 0.02,
            timeout: float = 600.0) -> AllReduceRun:
    """Time ring, tree and torch all-reduce of fp32 buffers of each of `sizes` bytes on `world_size` ranks.

    `cluster`: an open `dist.Cluster` to run on (its world size is used); without one, a Cluster of
    `world_size` ranks is started and stopped here. `repeats` timed repeats per size and implementation;
    `span_s`: how long one timed run of back-to-back calls should last at least (small messages).
    """

    sizes = _check_sizes(sizes)
    validation.integer("repeats", repeats, low=1)
    validation.positive("span_s", span_s, hint="(seconds)")
    own = cluster is None
    if own:
        validation.integer("world_size", world_size, low=2, hint="(one rank has nothing to all-reduce)")
        cluster = dist.Cluster(world_size)
    elif cluster.world_size < 2:
        raise ValueError(f"cluster has {cluster.world_size} rank; an all-reduce needs at least 2")
    try:
        per_rank = cluster.run(_time_on_rank, sizes, repeats, span_s, timeout=timeout)
    finally:
        if own:
            cluster.close()
    seconds = {impl: tuple(statistics.median(max(times) for times in zip(*(r[impl][i] for r in per_rank),
                                                                         strict=True))
                           for i in range(len(sizes)))
               for impl in IMPLS}  # per size: per repeat the slowest rank, then the median over repeats
    run = AllReduceRun(cluster.world_size, cluster.backend, sizes, seconds, repeats)
    _recent[run.world_size] = run
    return run


def recent(world_size: int = 4) -> AllReduceRun | None:
    """The last run on `world_size` ranks measured in this process (e.g. by a chapter), if any."""
    return _recent.get(world_size)


def bench(sizes=None, world_size: int = 4, repeats: int = 5) -> list[dict]:
    """`llmlab bench allreduce`: `measure(...)` on `world_size` ranks (every DEFAULT_SIZES), as table rows."""
    return measure(DEFAULT_SIZES if sizes is None else sizes, world_size, repeats=repeats).rows()
