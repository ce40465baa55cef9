"""`llmlab bench allreduce`: llmlab's ring and tree all-reduce against `torch.distributed.all_reduce`.

All three run on the same ranks in one run, over a sweep of message sizes (1 KiB … 64 MiB of fp32 by default),
the way nccl-tests measures a collective, with `llmlab.timing`'s method carried over to ranks:

- **warm-up first, for every size**: each implementation is checked (is the sum right?) and calibrated at every
  size before any timed repeat, so no size pays for a first call;
- **interleaved repeats**: a repeat is one whole sweep — every size, and at each size ring, tree and torch in an
  order rotated from repeat to repeat, the sizes upwards in one repeat and downwards in the next. A busy spell of
  the machine then hits one repeat of every size and implementation, not every repeat of one size: a sweep measured
  size after size can show a small message slower than a large one only because the machine was busier then;
- **the collective's span**: the ranks leave a barrier and each runs a short burst of back-to-back calls; the burst
  lasts from the moment the *last* rank started it to the moment the last rank finished (the ranks of a
  `dist.Cluster` run on one machine and share its monotonic clock). A rank the OS runs late after the barrier is
  then not counted as the collective's time, while one that falls behind during it is: a call takes as long as its
  slowest rank. Small messages are called several times per burst (enough for about `span_s` seconds), so the
  clock's resolution does not dominate;
- **each size's figure** is `timing.Timing.from_samples` over the repeats: the median, its spread (±, half the
  interquartile range) and the machine's load; ring vs tree at a size is a `timing.Comparison` of per-repeat ratios,
  so `faster(i)` says "not conclusive" when the repeats disagree;
- **bus bandwidth** as nccl-tests defines it: algbw = S / t, busbw = algbw · 2(n−1)/n (`cost.bus_bandwidth`).

From the times it fits the α-β model (`cost.fit_alpha_beta`): α and β per algorithm, and one α, β for ring and
tree together — the model's premise is one link, two algorithms — from which the model predicts where the
tree stops being faster (`cost.crossover_bytes`); `residuals()` says where the model misses. The measured crossover
is read off the curves. Both crossovers are also found in every repeat alone (each repeat is a whole sweep), and
the quartiles of those are their uncertainty; `crossover_says()` compares them in a sentence chosen by the numbers:

    from llmlab.dist import allreduce_bench
    run = allreduce_bench.measure(sizes=[1024, 65536, 4 << 20], world_size=4)   # or cluster=an open dist.Cluster(4)
    run.timings["ring"][0], run.faster(0), run.residuals(), print(run.crossover_says())
    print(llmlab.tables.format_table(run.rows()))

`bench()` is what `llmlab bench allreduce` runs (4 ranks, every default size). Claim C12 (ring bandwidth-
optimal, tree latency-optimal) is measured with it in `llmlab.claims.ch04`. On a GPU machine with ≥ 2 GPUs the
ranks use NCCL and CUDA tensors; on a CPU they are gloo processes, timing loopback TCP and the cores the ranks
share.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as td

from llmlab import dist, runtime, timing, validation
from llmlab.dist import cost
from llmlab.dist.collectives import ring_all_reduce, tree_all_reduce

__all__ = ["DEFAULT_SIZES", "CLAIM_SIZES", "IMPLS", "AllReduceRun", "measure", "measure_pieces", "PiecesRun",
           "paired", "bench", "recent", "format_bytes"]

DEFAULT_SIZES = tuple(1024 * 4**k for k in range(9))  # 1 KiB, 4 KiB, … 64 MiB
# C12's and chapter 4's: 16× apart where the time is latency (flat: more sizes there add only chances for noise to
# look like a fall), 4× apart around the crossover, up to 16 MiB: past it on gloo, in seconds rather than a minute
CLAIM_SIZES = (1024, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
IMPLS = ("ring", "tree", "torch")
_MODEL = {"ring": "ring_all_reduce", "tree": "tree_all_reduce", "torch": "ring_all_reduce"}  # gloo's is a ring
_MAX_CALLS = 64  # back-to-back calls in one timed burst, at most
_CALIBRATE = 3  # calls timed to decide a burst's length: their fastest, so one call the OS delayed does not decide
_recent: dict[int, AllReduceRun] = {}  # world size → the last run measured in this process


def format_bytes(nbytes: float) -> str:
    """A message size the way the tables write it: 1024 → '1 KiB', 3 << 20 → '3 MiB' (3 significant digits)."""
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if nbytes >= 1024**power:
            return f"{nbytes / 1024**power:.3g} {unit}"
    return f"{nbytes:.3g} B"


def _quartile_bounds(values) -> tuple[float, float]:
    """The lower and upper quartile of `values`, each picked outward from the data (no interpolation), so that
    0 and inf — a crossover below or above the measured sizes — keep their meaning."""
    ordered = sorted(values)
    last = len(ordered) - 1
    return ordered[math.floor(last / 4)], ordered[math.ceil(3 * last / 4)]


def _link_fit(points: dict[str, list[tuple[float, float]]], n: int) -> cost.Fit:
    """One α and β for `points` ({impl: [(bytes, seconds), ...]}) of several algorithms on `n` ranks: least squares
    on relative errors, like `cost.fit_alpha_beta`, over the rows of all of them, with α, β ≥ 0."""
    design = []
    for impl, pts in points.items():
        a, b = cost.COLLECTIVES[_MODEL[impl]]
        design += [[a(n) / t, b(n) * s / t] for s, t in pts]  # row · (α, β) ≈ 1
    design = np.array(design)  # (rows, 2)
    coef = np.linalg.lstsq(design, np.ones(len(design)), rcond=None)[0]
    if (coef < 0).any():  # the best non-negative fit then has one of them at 0: fit the other alone
        keep = int(coef[1] > coef[0])
        coef = np.zeros(2)
        coef[keep] = max(0.0, np.linalg.lstsq(design[:, keep:keep + 1], np.ones(len(design)), rcond=None)[0][0])
    return cost.Fit(float(coef[0]), float(coef[1]), float(np.sqrt(np.mean((design @ coef - 1) ** 2))))


def _crossing(sizes, ring, tree) -> float | None:
    """Where the ring's times fall below the tree's for good, interpolated on log-log axes; None when not inside
    `sizes` (the ring faster everywhere, or the tree still faster at the largest size)."""
    gap = [math.log(r / t) for r, t in zip(ring, tree, strict=True)]
    if gap[-1] >= 0 or all(g < 0 for g in gap):
        return None
    i = max(k for k, g in enumerate(gap) if g >= 0)  # the last size where the tree was not slower
    lo, hi = math.log(sizes[i]), math.log(sizes[i + 1])
    return math.exp(lo + (hi - lo) * gap[i] / (gap[i] - gap[i + 1]))


@dataclass(frozen=True)
class AllReduceRun:
    """Seconds per all-reduce call, by implementation and message size: a `timing.Timing` per size whose samples
    are the repeats (each the slowest rank's span, see the module's docstring), in the same order for every size
    and implementation (sample k of every Timing comes from repeat k)."""

    world_size: int
    backend: str
    sizes: tuple[int, ...]  # bytes per rank's buffer (nccl-tests' "size")
    timings: dict[str, tuple[timing.Timing, ...]]  # impl → one Timing per size

    @property
    def repeats(self) -> int:
        return len(self.timings[IMPLS[0]][0].samples)

    @property
    def seconds(self) -> dict[str, tuple[float, ...]]:
        """impl → the median seconds per call at each size."""
        return {impl: tuple(t.seconds for t in ts) for impl, ts in self.timings.items()}

    @property
    def load(self) -> timing.Load | None:
        return self.timings[IMPLS[0]][0].load

    def points(self, impl: str, repeat: int | None = None) -> list[tuple[int, float]]:
        """[(bytes, seconds), ...] of `impl`: the medians, or repeat number `repeat` alone."""
        return [(s, t.seconds if repeat is None else t.samples[repeat]) for s, t in zip(self.sizes, self.timings[impl],
                                                                                        strict=True)]

    def busbw(self, impl: str) -> tuple[float, ...]:
        """nccl-tests' bus bandwidth of `impl` at each size (from the median time), bytes per second."""
        return tuple(cost.bus_bandwidth(s, t, self.world_size) for s, t in self.points(impl))

    def fit(self, impl: str) -> cost.Fit:
        """α (s per message) and β (s per byte) of `impl` alone; torch's is fitted with the ring's model."""
        return cost.fit_alpha_beta(self.points(impl), self.world_size, _MODEL[impl])

    def link_fit(self, repeat: int | None = None) -> cost.Fit:
        """One α and β for ring and tree together (their medians, or one repeat's times): the link both algorithms
        run over, as the α-β model sees it."""
        return _link_fit({impl: self.points(impl, repeat) for impl in ("ring", "tree")}, self.world_size)

    def residuals(self) -> dict[str, tuple[float, ...]]:
        """{"ring": …, "tree": …}: (model − measured) / measured at each size, the model being `link_fit`'s α and
        β: +0.3 means the model predicts 30% more time than was measured there."""
        link, n = self.link_fit(), self.world_size
        model = {"ring": cost.ring_allreduce_time, "tree": cost.tree_allreduce_time}
        return {impl: tuple(model[impl](s, n, link.alpha, link.beta) / t - 1 for s, t in self.points(impl))
                for impl in model}

    def link(self) -> cost.Link:
        """This machine's link as the α-β model sees it (`link_fit`), for `cost`'s formulas and the widget."""
        f = self.link_fit()
        return cost.Link(f.alpha, f.beta, f"this machine ({self.world_size} {self.backend} ranks, fitted)",
                         "α and β fitted to ring and tree all-reduce timings by llmlab.dist.allreduce_bench")

    def measured(self) -> dict[str, list[tuple[int, float]]]:
        """{label: [(bytes, seconds), ...]} per implementation: the points `widgets.allreduce_cost_explorer` draws."""
        return {f"{impl} (measured, {self.world_size} ranks)": self.points(impl) for impl in IMPLS}

    def comparison(self, impl: str, peer: str, index: int) -> timing.Comparison:
        """`impl` against `peer` at `self.sizes[index]`, repeat by repeat (their ratio is impl time / peer time)."""
        return paired(self.timings[impl][index], self.timings[peer][index])

    def faster(self, index: int) -> str:
        """'ring', 'tree' or 'not conclusive': which of the two was faster at `self.sizes[index]`, by the
        per-repeat ratios (`timing.Comparison.direction`)."""
        verdict = self.comparison("ring", "tree", index).direction()
        return {"faster": "ring", "slower": "tree"}.get(verdict, verdict)

    def crossover(self, repeat: int | None = None) -> float | None:
        """The measured size above which the ring stays faster than the tree, interpolated on log-log axes, on the
        median curves (or on one repeat's). None when there is no such size inside the measured range: the ring is
        faster everywhere, or the tree is still faster at the largest size."""
        ring, tree = (self.points(impl, repeat) for impl in ("ring", "tree"))
        return _crossing(self.sizes, [t for _, t in ring], [t for _, t in tree])

    def crossover_range(self) -> tuple[float, float]:
        """The quartiles of the crossovers measured in each repeat alone: its uncertainty. A repeat without a
        crossover in range counts as 0 (the ring faster everywhere) or inf (the tree faster at the largest size)."""
        found = []
        for k in range(self.repeats):
            c = self.crossover(k)
            ring_wins_last = self.timings["ring"][-1].samples[k] < self.timings["tree"][-1].samples[k]
            found.append(c if c is not None else 0.0 if ring_wins_last else math.inf)
        return _quartile_bounds(found)

    def predicted_crossover(self, repeat: int | None = None) -> float:
        """Where the α-β model puts the crossover, with the link's fitted α and β: n(n−1−⌈log₂n⌉)·α/β."""
        link = self.link_fit(repeat)
        return cost.crossover_bytes(self.world_size, link.alpha, link.beta)

    def predicted_range(self) -> tuple[float, float]:
        """The quartiles of the crossovers the model predicts from each repeat's fit alone: its uncertainty."""
        return _quartile_bounds(self.predicted_crossover(k) for k in range(self.repeats))

    def crossover_says(self) -> str:
        """The measured and the predicted crossover, each with its range over the repeats, and which is larger —
        'not conclusive' when the two ranges overlap."""
        (m_lo, m_hi), (p_lo, p_hi) = self.crossover_range(), self.predicted_range()
        measured, predicted = self.crossover(), self.predicted_crossover()

        def span(lo, hi):
            return f"{_bound(lo, self.sizes)}–{_bound(hi, self.sizes)}"

        on_medians = (f"the median curves do not cross between {format_bytes(self.sizes[0])} and "
                      f"{format_bytes(self.sizes[-1])}" if measured is None else format_bytes(measured))
        told = (f"measured {on_medians} (repeats' quartiles {span(m_lo, m_hi)}); the α-β model with the fitted "
                f"link predicts {format_bytes(predicted)} (repeats' quartiles {span(p_lo, p_hi)})")
        if m_lo <= p_hi and p_lo <= m_hi:
            return f"crossover {told}: the ranges overlap, so which is larger is not conclusive here."
        if p_hi < m_lo:
            factor = m_lo / p_hi if p_hi > 0 else math.inf
            return f"crossover {told}: the model places it lower than measured, by {factor:.3g}× at least."
        return f"crossover {told}: the model places it higher than measured, by {p_lo / m_hi:.3g}× at least."

    def rows(self) -> list[dict]:
        """The bench table: ring and tree vs torch per size (median ms, spreads, per-repeat ratio), then the fits,
        then the crossover."""
        rows = []
        for i, nbytes in enumerate(self.sizes):
            for impl in ("ring", "tree"):
                c = self.comparison(impl, "torch", i)
                rows.append({"impl": impl, "peer": "torch", "size": nbytes, **c.row(),
                             "impl_spread": c.impl.spread, "peer_spread": c.peer.spread,
                             "impl_busbw_GBs": self.busbw(impl)[i] / 1e9,
                             "peer_busbw_GBs": self.busbw("torch")[i] / 1e9})
        fits = {impl: self.fit(impl) for impl in IMPLS} | {"ring+tree (one link)": self.link_fit()}
        for name, f in fits.items():
            rows.append({"impl": name, "peer": "α-β fit", "alpha_us": f.alpha * 1e6,
                         "inv_beta_GBs": 1 / f.beta / 1e9 if f.beta else math.inf, "fit_rms": f.residual})
        measured, predicted = self.crossover(), self.predicted_crossover()
        (m_lo, m_hi), (p_lo, p_hi) = self.crossover_range(), self.predicted_range()
        rows.append({"impl": "ring/tree crossover, measured", "peer": "α-β model", "crossover_B": measured,
                     "crossover_range_B": [m_lo, m_hi], "peer_crossover_B": predicted,
                     "peer_crossover_range_B": [p_lo, p_hi],
                     "ratio": measured / predicted if measured is not None and predicted > 0 else None})
        return rows


def paired(a: timing.Timing, b: timing.Timing) -> timing.Comparison:
    """`a` against `b` repeat by repeat (sample k of each from the same repeat): their ratios, a time / b time."""
    return timing.Comparison(a, b, tuple(x / y if y > 0 else math.inf for x, y in zip(a.samples, b.samples,
                                                                                        strict=True)))


def _bound(nbytes: float, sizes) -> str:
    """A crossover bound in words: below or above the measured sizes when it is 0 or inf."""
    if nbytes == 0:
        return f"below {format_bytes(sizes[0])}"
    return f"above {format_bytes(sizes[-1])}" if math.isinf(nbytes) else format_bytes(nbytes)


def _op(impl):
    """The call timed for `impl`: "ring", "tree", "torch", or an int: the ring with pieces of that many bytes.
    Benchmarks skip the collectives' input check (N−1 α)."""
    if isinstance(impl, int):
        return lambda x: ring_all_reduce(x, check=False, piece_bytes=impl)
    return {"ring": lambda x: ring_all_reduce(x, check=False), "tree": lambda x: tree_all_reduce(x, check=False),
            "torch": td.all_reduce}[impl]


def _time_on_rank(sizes, repeats: int, span_s: float, impls=IMPLS) -> dict:
    """On every rank: the calls per burst, {impl: [count per size]}, and the clock at the start and the end of each
    burst, {impl: [[(start, end) of each repeat] per size]}, for each of `impls` (see `_op`)."""

    device, n, rank = runtime.device(), td.get_world_size(), td.get_rank()
    sync = lambda: runtime.synchronize(device)  # a no-op on the CPU
    buffers = [torch.zeros(nbytes // 4, device=device) for nbytes in sizes]  # (S/4,) fp32 each
    ops = {impl: _op(impl) for impl in impls}
    for nbytes, x in zip(sizes, buffers, strict=True):  # every size and implementation: is it right? (warm-up too)
        for impl, op in ops.items():
            x.fill_(rank + 1)
            op(x)
            if not bool((x == n * (n + 1) / 2).all()):
                raise RuntimeError(f"{impl} all-reduce of {nbytes} B gave a wrong sum on rank {rank}")
            x.zero_()  # zeros from now on: sums stay 0 however often they are repeated
    def timed_call(op, x):
        sync()
        start = time.perf_counter()
        op(x)
        sync()
        return time.perf_counter() - start

    # seconds per call of each (size, impl): the fastest of _CALIBRATE calls, or of one where that one took over
    # 4·span_s on some rank (the same number of calls on every rank: a collective must be called by all, so each
    # decision is taken from the slowest rank's figure, timing.agree_max). The
    # fastest: a burst of span_s / fastest calls then averages over several calls even when the OS delays some
    pairs = [(op, x) for x in buffers for op in ops.values()]
    first, one = [timed_call(op, x) for op, x in pairs], []
    for (op, x), t, worst in zip(pairs, first, timing.agree_max(first), strict=True):
        more = [timed_call(op, x) for _ in range(_CALIBRATE - 1)] if worst < 4 * span_s else []
        one.append(min([t, *more]))
    counts = [min(_MAX_CALLS, max(1, math.ceil(span_s / w))) if w > 0 else _MAX_CALLS for w in timing.agree_max(one)]
    calls = {impl: [counts[i * len(impls) + j] for i in range(len(sizes))] for j, impl in enumerate(impls)}
    spans = {impl: [[] for _ in sizes] for impl in impls}
    for rep in range(repeats):
        order = range(len(sizes)) if rep % 2 == 0 else reversed(range(len(sizes)))  # up, then down, then up…
        for i in order:
            for k in range(len(impls)):
                impl = impls[(rep + k) % len(impls)]  # rotate the order from repeat to repeat
                op, x = ops[impl], buffers[i]
                td.barrier()
                sync()
                start = time.perf_counter()
                for _ in range(calls[impl][i]):
                    op(x)
                sync()
                spans[impl][i].append((start, time.perf_counter()))
    return {"calls": calls, "spans": spans}


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


def _summarise(per_rank: list[dict], sizes, load: timing.Load, impls=IMPLS) -> dict[str, tuple[timing.Timing, ...]]:
    """Every rank's bursts → one Timing per implementation and size: per repeat, from the last rank's start to the
    last rank's end, divided by the calls of the burst."""
    calls = per_rank[0]["calls"]
    out = {}
    for impl in impls:
        out[impl] = []
        for i in range(len(sizes)):
            bursts = zip(*(r["spans"][impl][i] for r in per_rank), strict=True)  # per repeat: (start, end) per rank
            samples = [max(end for _, end in ranks) - max(start for start, _ in ranks) for ranks in bursts]
            out[impl].append(timing.Timing.from_samples([s / calls[impl][i] for s in samples], calls[impl][i], load))
        out[impl] = tuple(out[impl])
    return out


def measure(sizes=DEFAULT_SIZES, world_size: int = 4, *, cluster=None, repeats: int = 7, span_s: float = 0.03,
            timeout: float = 600.0) -> AllReduceRun:
    """Time ring, tree and torch all-reduce of fp32 buffers of each of `sizes` bytes on `world_size` ranks.

    `cluster`: an open `dist.Cluster` to run on (its world size is used); without one, a Cluster of
    `world_size` ranks is started and stopped here. `repeats` timed sweeps over every size and implementation;
    `span_s`: how long one timed burst of back-to-back calls should last at least (small messages).
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
    load = timing.Load.now()
    try:
        per_rank = cluster.run(_time_on_rank, sizes, repeats, span_s, timeout=timeout)
    finally:
        if own:
            cluster.close()
    load = load.busier(timing.Load.now())
    run = AllReduceRun(cluster.world_size, cluster.backend, sizes, _summarise(per_rank, sizes, load))
    _recent[run.world_size] = run
    return run


@dataclass(frozen=True)
class PiecesRun:
    """`measure_pieces`' result: the ring's time per piece size (the same repeats for every size: compare two with
    `paired`), and γ, the seconds per byte of a reduce-scatter step's addition on the ranks."""

    nbytes: int
    timings: dict[int, timing.Timing]  # piece_bytes → seconds per all-reduce
    gamma: float  # seconds per byte added: `into.add_(other)` of one chunk, on every rank at once (their median)


def _addition_time(numel: int) -> float:
    """On every rank at once, as in a ring step: seconds for one `add_` of two fp32 vectors of `numel`."""
    into, other = torch.randn(numel, device=runtime.device()), torch.randn(numel, device=runtime.device())  # (numel,)
    return timing.measure(lambda: into.add_(other), device=runtime.device()).seconds


def measure_pieces(nbytes: int, piece_sizes, *, cluster, repeats: int = 7, span_s: float = 0.03) -> PiecesRun:
    """The ring all-reduce of one fp32 buffer of `nbytes` on `cluster`'s ranks with each of `piece_sizes` (bytes per
    piece, `ring_all_reduce(piece_bytes=…)`), timed as `measure` times, and the cost of the ranks' additions (γ,
    for `cost.ring_pieces_time`), measured on the ranks themselves: they, not the caller, add."""
    if validation.integer("nbytes", nbytes, low=4, hint="(bytes)") % 4:
        raise ValueError(f"nbytes={nbytes} must be a multiple of 4 bytes (a whole number of fp32 elements)")
    pieces = tuple(validation.positive_int(f"piece_sizes[{i}]", p) for i, p in enumerate(piece_sizes))
    if len(set(pieces)) != len(pieces) or len(pieces) < 2:
        raise ValueError(f"piece_sizes={piece_sizes!r}: give at least 2 different piece sizes to compare")
    validation.integer("repeats", repeats, low=1)
    chunk = max(1, nbytes // 4 // cluster.world_size)  # elements of one ring step's chunk
    load = timing.Load.now()
    adds = cluster.run(_addition_time, chunk)
    per_rank = cluster.run(_time_on_rank, (nbytes,), repeats, span_s, pieces)
    timings = _summarise(per_rank, (nbytes,), load.busier(timing.Load.now()), pieces)
    return PiecesRun(nbytes, {p: ts[0] for p, ts in timings.items()}, float(np.median(adds)) / (chunk * 4))


def recent(world_size: int = 4) -> AllReduceRun | None:
    """The last run on `world_size` ranks measured in this process (e.g. by a chapter), if any."""
    return _recent.get(world_size)


def bench(sizes=None, world_size: int = 4, repeats: int = 7) -> list[dict]:
    """`llmlab bench allreduce`: `measure(...)` on `world_size` ranks (every DEFAULT_SIZES), as table rows."""
    return measure(DEFAULT_SIZES if sizes is None else sizes, world_size, repeats=repeats).rows()
