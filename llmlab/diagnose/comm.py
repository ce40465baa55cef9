"""Communication bottlenecks (the material's §7.3): the share of a step spent communicating, and the straggler
rank. A hung collective is `llmlab.diagnose.hang`'s.

- **Share.** `comm_share(step_fn)` runs on every rank: it times `step_fn` (one training step) under the profiler
  (`llmlab.monitor.profile_step`) and a `CommLog` (bytes and seconds per collective) and returns a `CommShare`;
  `comm_verdict(shares)` combines the ranks' answers into a verdict and remedies ranked by what they would save.
- **Straggler.** `rank_timing(step_fn)` on every rank splits its step into work and time inside collectives: in
  synchronous training the fast ranks wait there for the slow one, so their collective time is long and the
  straggler's short. `find_straggler(timings, reference=quiet)` names the slow rank and by how much — only when it
  stands out beyond the noise: beyond its own steps' spread, and beyond `work_spread(quiet)`, how far apart the
  ranks' work was in a run with nothing planted (on a busy machine ranks doing equal work differ by tens of percent).

    from llmlab import dist
    from llmlab.diagnose import comm

    with dist.Cluster(4) as cluster:                     # step: a function of no argument, one training step
        print(comm.comm_verdict(cluster.run(comm.comm_share, step)))
        quiet = cluster.run(comm.rank_timing, step)        # the noise: the same step, nothing wrong
        print(comm.find_straggler(cluster.run(comm.rank_timing, suspect_step), reference=quiet))

In one process (no group) `comm_share(step)` still splits compute from the rest. Under torchrun:
`dist.init_from_env()`, call `comm_share`/`rank_timing` on every rank, gather the results on rank 0
(`td.all_gather_object`) and pass the list to `comm_verdict`/`find_straggler`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as td

from llmlab import timing, validation
from llmlab.dist.commlog import CommLog
from llmlab.monitor import profile_step

__all__ = ["CommShare", "comm_share", "Remedy", "CommVerdict", "comm_verdict", "RankTiming", "rank_timing",
           "Straggler", "find_straggler", "work_spread"]

# Below ~256 KiB a message costs mostly latency: the α·β crossover (n½ = α/β) is 270 KB for NVLink 4 and 135 KB
# for InfiniBand NDR (llmlab.dist.cost.LINKS), ~100 KB for gloo over TCP loopback (α ≈ 50 µs, ~2 GB/s).
_LATENCY_BYTES = 256 * 2**10
_ACCUMULATE = 4  # micro-batches per all-reduce in the gradient-accumulation remedy


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _rank() -> int:
    return td.get_rank() if td.is_initialized() else 0


def _check_steps(step_fn, steps, warmup) -> None:
    if not callable(step_fn):
        raise ValueError(f"step_fn={step_fn!r} must be callable (one training step, no arguments)")
    validation.integer("steps", steps, low=1)
    validation.integer("warmup", warmup, low=0)


# -- compute vs communication --------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommShare:
    """One rank's step, in seconds per step (means over the measured steps)."""

    rank: int
    wall: float
    compute: float  # the profiler's op time outside collectives
    communication: float  # time inside collectives, waiting included
    other: float  # no op: Python, sleeping, waiting on async collectives (DDP buckets)
    calls: float  # collectives per step
    bytes_sent: float  # per step, as CommLog counts them (nccl-tests' bus bytes)
    walls: tuple[float, ...] = ()  # each measured step's wall seconds
    works: tuple[float, ...] = ()  # each measured step's seconds outside collectives

    def wall_timing(self) -> timing.Timing:
        """The step's wall time over the measured steps: median, spread and load (`timing.Timing`)."""
        return timing.Timing.from_samples(self.walls or (self.wall,), load=timing.Load.now())

    @property
    def share(self) -> float:
        return self.communication / self.wall if self.wall > 0 else 0.0

    def timing(self) -> RankTiming:
        """This step as `find_straggler` reads it: work outside collectives, time inside them."""
        return RankTiming(self.rank, max(self.wall - self.communication, 0.0), self.communication, self.works)

    def __str__(self) -> str:
        parts = " + ".join(f"{k} {_ms(v)} ({v / max(self.wall, 1e-12):.0%})" for k, v in
                           (("compute", self.compute), ("communication", self.communication), ("other", self.other)))
        return (f"rank {self.rank}: step {_ms(self.wall)} = {parts}; {self.calls:g} collectives, "
                f"{self.bytes_sent / 2**20:.2f} MiB sent per step")


def comm_share(step_fn: Callable[[], object], steps: int = 3, warmup: int = 1) -> CommShare:
    """Run `step_fn()` `warmup` times, then `steps` times under the profiler and a CommLog; on every rank.

    Communication on gloo ranks is the larger of the profiler's collective ops and CommLog's time per collective:
    the profiler sees only a collective's launch — `c10d::allreduce_` returns once the work is queued and the rank
    then blocks in a wait that no op accounts for (measured: 0.1 ms of a 15 ms all-reduce) — while CommLog times
    each call from entry to return. On NCCL ranks it is the profiler's NCCL kernel time (a kernel spins until its
    peers arrive, so the wait is in it); CommLog's time there also holds the compute kernels still queued when
    the collective was called. Async collectives (DDP's buckets) show only their launch; their wait is "other".
    """

    _check_steps(step_fn, steps, warmup)
    nccl = td.is_initialized() and td.get_backend() == "nccl"
    for _ in range(warmup):
        step_fn()
    wall = compute = comm = calls = sent = 0.0
    walls, works = [], []
    for _ in range(steps):
        with CommLog() as log:
            split = profile_step(step_fn)
        ops = log.by_op().values()
        step_comm = split["communication"] if nccl else max(split["communication"], sum(s.seconds for s in ops))
        # on gloo an op that waits for a collective inside it (an autograd node whose gradient hook all-reduces,
        # as DataParallel's does) holds that wait in its self time too: compute is at most the time outside
        step_compute = split["compute"] if nccl else min(split["compute"], max(split["wall"] - step_comm, 0.0))
        wall, compute, comm = wall + split["wall"], compute + step_compute, comm + step_comm
        walls.append(split["wall"])
        works.append(max(split["wall"] - step_comm, 0.0))
        calls, sent = calls + sum(s.calls for s in ops), sent + log.bytes_sent
    other = max(wall - compute - comm, 0.0)
    return CommShare(_rank(), wall / steps, compute / steps, comm / steps, other / steps, calls / steps, sent / steps,
                     tuple(walls), tuple(works))


@dataclass(frozen=True)
class Remedy:
    name: str
    saving: float | None  # estimated seconds saved per step, an upper bound; None: depends on the hardware
    why: str

    def __str__(self) -> str:
        saves = "depends on the link" if self.saving is None else f"saves up to {_ms(self.saving)} per step"
        return f"{self.name}: {saves} — {self.why}"


@dataclass(frozen=True)
class CommVerdict:
    """`comm_verdict`'s answer: the ranks' mean split, how bound the step is, and the remedies ranked."""

    shares: list[CommShare]
    remedies: list[Remedy]
    straggler: Straggler | None  # None for one rank

    @property
    def share(self) -> float:
        wall = statistics.mean(s.wall for s in self.shares)
        return statistics.mean(s.communication for s in self.shares) / wall if wall > 0 else 0.0

    @property
    def bound(self) -> str:
        # over half the step: communication sets the step time; under 20% even hiding it all saves < 20%,
        # and the compute (kernels, batch size) is the better target
        if self.share >= 0.5:
            return "communication-bound"
        return "communication is significant" if self.share >= 0.2 else "compute-bound: communication is not it"

    @property
    def waiting_for_straggler(self) -> bool:
        """Is there a straggler that accounts for over half of the other ranks' time inside collectives?"""
        st = self.straggler
        if st is None or st.rank is None:
            return False
        return st.slow_by > 0.5 * statistics.median(w for i, w in enumerate(st.wait) if i != st.rank)

    def __str__(self) -> str:
        wall = statistics.mean(s.wall for s in self.shares)
        other = statistics.mean(s.other for s in self.shares) / wall
        lines = [f"communication is {self.share:.0%} of the step ({_ms(self.share * wall)} of {_ms(wall)}, mean "
                 f"over {len(self.shares)} ranks): {self.bound}"]
        if other >= 0.3:
            lines.append(f"{other:.0%} of the step is in no op: Python, sleeping or waiting on async collectives")
        if self.waiting_for_straggler:
            lines.append(f"first fix the straggler, the others' communication is mostly waiting: {self.straggler}")
        return "\n".join(lines + ["remedies, largest estimated saving first:"]
                         + [f"  {i}. {r}" for i, r in enumerate(self.remedies, 1)] + [str(s) for s in self.shares])


def _remedies(compute: float, comm: float, calls: float, nbytes: float) -> list[Remedy]:
    per_call = nbytes / calls if calls else 0.0
    options = [
        Remedy("overlap", min(compute, comm), "launch each bucket's all-reduce asynchronously while backward goes "
               "on (DataParallel's default); hides at most the smaller of compute and communication"),
        Remedy(f"gradient accumulation with no_sync() over {_ACCUMULATE} micro-batches, or a {_ACCUMULATE}× larger "
               "micro-batch", comm * (1 - 1 / _ACCUMULATE), "one all-reduce per "
               f"{_ACCUMULATE} micro-batches' samples (the material: a larger batch, fewer synchronisations)")]
    if per_call >= _LATENCY_BYTES:
        options.append(Remedy("compression (bf16 gradients, PowerSGD)", comm / 2, f"{per_call / 2**20:.2f} MiB "
                              "per collective is bandwidth-bound: half the bytes, about half the time"))
    elif calls > 1:
        options.append(Remedy("fewer, larger messages (bucket the gradients)", comm * (1 - 1 / calls),
                              f"{calls:g} collectives of {per_call / 2**10:.0f} KiB per step: below ~256 KiB "
                              "each costs mostly latency"))
    options.sort(key=lambda r: -r.saving)
    rate = f"{nbytes / comm / 1e9:.2f} GB/s" if comm > 0 else "no traffic"
    return options + [Remedy("a faster link (NVLink in a node, InfiniBand across nodes)", None,
                             f"measured {rate} per rank (waiting included); check latency and packet loss too")]


def comm_verdict(shares: list[CommShare]) -> CommVerdict:
    """Combine every rank's `CommShare` (the list `cluster.run(comm_share, step)` returns) into a verdict."""
    if not isinstance(shares, list | tuple) or not shares or not all(isinstance(s, CommShare) for s in shares):
        raise ValueError(f"shares must be a non-empty list of CommShare (one per rank), got {shares!r:.80}")
    mean = {k: statistics.mean(getattr(s, k) for s in shares) for k in ("compute", "communication", "calls",
                                                                         "bytes_sent")}
    straggler = find_straggler([s.timing() for s in shares]) if len(shares) > 1 else None
    remedies = _remedies(mean["compute"], mean["communication"], mean["calls"], mean["bytes_sent"])
    return CommVerdict(list(shares), remedies, straggler)


# -- the straggler -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankTiming:
    rank: int
    compute: float  # seconds per step outside collectives: computation, data loading, Python, sleeping (median)
    wait: float  # seconds per step inside collectives: the transfer, plus waiting for the slowest rank (median)
    steps: tuple[float, ...] = ()  # each measured step's seconds outside collectives

    @property
    def work(self) -> timing.Timing:
        """This rank's work per step over the measured steps: median and spread (`timing.Timing`)."""
        return timing.Timing.from_samples(self.steps or (self.compute,))


def rank_timing(step_fn: Callable[[], object], steps: int = 5, warmup: int = 1) -> RankTiming:
    """On every rank: time `steps` calls of `step_fn` (after `warmup`), the time inside collectives by a CommLog.
    Medians over the steps (`timing.Timing.from_samples`), so that one step the OS stalled does not make a
    straggler; each step's work is kept too, for its spread."""

    _check_steps(step_fn, steps, warmup)
    for _ in range(warmup):
        step_fn()
    compute, wait = [], []
    for _ in range(steps):
        with CommLog() as log:
            start = time.perf_counter()
            step_fn()
            wall = time.perf_counter() - start
        inside = sum(s.seconds for s in log.by_op().values())
        compute.append(max(wall - inside, 0.0))
        wait.append(inside)
    return RankTiming(_rank(), timing.Timing.from_samples(compute).seconds, timing.Timing.from_samples(wait).seconds,
                      tuple(compute))


@dataclass(frozen=True)
class Straggler:
    """`find_straggler`'s answer; `rank` is None unless a rank stands out (then `conclusive` says whether the
    slowest rank was over the threshold but within the noise: 'not conclusive')."""

    rank: int | None
    slowest: int
    slow_by: float  # seconds per step above the other ranks' median
    baseline: float  # the other ranks' median work per step
    compute: list[float]
    wait: list[float] | None
    threshold: float
    noise: float | None = None  # work_spread of the reference run (seconds), when one was given
    conclusive: bool = True  # False: over the threshold, but not beyond the noise
    min_seconds: float = 2e-3  # the least excess named (find_straggler's min_seconds)

    def __str__(self) -> str:
        s, rel = self.slowest, self.slow_by / self.baseline if self.baseline > 0 else float("inf")
        noise = "" if self.noise is None else f"the {_ms(self.noise)} the ranks' work spread with nothing planted"
        if self.rank is None:  # no rank is named by noise, not even as "the slowest"
            over = (f"the slowest rank's work is {_ms(self.slow_by)} (+{rel:.0%}) above the others' median "
                    f"{_ms(self.baseline)}")
            if self.conclusive:  # under the relative threshold, the absolute floor, or both: name the ones it failed
                under = ([f"the threshold (+{self.threshold:.0%})"] if self.slow_by <= self.threshold * self.baseline
                         else []) + ([f"the {_ms(self.min_seconds)} floor (min_seconds)"]
                                     if self.slow_by <= self.min_seconds else [])
                return f"no straggler: {over}, under " + " and ".join(under)
            return (f"not conclusive: {over}, over the threshold (+{self.threshold:.0%}) but within "
                    + (f"{noise} or " if noise else "") + "its own steps' spread")
        text = (f"rank {s} is the straggler: {_ms(self.compute[s])} of work per step vs {_ms(self.baseline)} on the "
                f"other ranks (median), {_ms(self.slow_by)} slower (+{rel:.0%})")
        text += f", beyond {noise}" if noise else ""
        if self.wait is not None:
            others = statistics.median(w for i, w in enumerate(self.wait) if i != s)
            text += f"; the others wait {_ms(others)} per step inside collectives, rank {s} {_ms(self.wait[s])}"
        return text


def _split(timings) -> tuple[list[float], list[float] | None, list[tuple[float, ...]]]:
    """Per rank: the work (median), the wait inside collectives (or None), and each step's work."""
    if isinstance(timings, str | bytes) or not hasattr(timings, "__iter__"):
        raise ValueError(f"timings={timings!r:.80} must be a list with one entry per rank")
    compute, wait, steps = [], [], []
    for i, t in enumerate(timings):
        t = t.timing() if isinstance(t, CommShare) else t
        pair = (t.compute, t.wait) if isinstance(t, RankTiming) else tuple(t) if isinstance(t, tuple | list) else (t,)
        if len(pair) not in (1, 2) or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in pair):
            raise ValueError(f"timings[{i}]={t!r} must be seconds, (compute, wait) seconds or a RankTiming")
        if not all(v >= 0 and v < float("inf") for v in pair):
            raise ValueError(f"timings[{i}]={t!r}: times must be finite seconds >= 0")
        compute.append(float(pair[0]))
        wait.append(float(pair[-1]) if len(pair) == 2 else None)
        steps.append(tuple(t.steps) if isinstance(t, RankTiming) and t.steps else (float(pair[0]),))
    if len(compute) < 2:
        raise ValueError(f"timings has {len(compute)} ranks: need at least 2 to compare")
    if len({w is None for w in wait}) > 1:
        raise ValueError("timings mixes step times with (compute, wait) pairs: give every rank the same kind")
    return compute, None if wait[0] is None else wait, steps


def _quartiles(values) -> tuple[float, float]:
    if len(values) == 1:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def work_spread(timings) -> float:
    """How far apart the ranks' work per step lies, in seconds: from the lowest lower quartile of any rank's steps
    to the highest upper quartile. Measured on a run with nothing planted, it is the noise a straggler must exceed."""
    quartiles = [_quartiles(s) for s in _split(timings)[2]]
    return max(q3 for _, q3 in quartiles) - min(q1 for q1, _ in quartiles)


def find_straggler(timings, threshold: float = 0.1, min_seconds: float = 2e-3, reference=None) -> Straggler:
    """The slow rank, from per-rank timings in rank order: (compute, wait) pairs, `RankTiming`s
    (`cluster.run(rank_timing, step)`), `CommShare`s, or seconds of work per rank — not whole step times of
    synchronous training, where every rank's step lasts as long as the slowest one's.

    The slowest rank is named when its work exceeds the other ranks' median by more than `threshold` (10%: a rank
    10% slower slows every synchronous step by 10%) and `min_seconds` (2 ms: timer and scheduler noise, a Linux time
    slice being a few ms), *and* it stands out beyond the noise: the lower quartile of its steps is above the upper
    quartile of every other rank's, and, given a `reference` run of the same step with nothing planted, its excess
    is more than `work_spread(reference)`. Over the threshold but not beyond the noise is 'not conclusive'
    (`conclusive=False`, no rank named): on a busy machine, ranks doing equal work differ by tens of percent."""
    for name, value in (("threshold", threshold), ("min_seconds", min_seconds)):
        if not math.isfinite(validation.number(name, value, low=0)):
            raise ValueError(f"{name}={value!r} must be a finite number >= 0")
    compute, wait, steps = _split(timings)
    noise = None if reference is None else work_spread(reference)
    slowest = max(range(len(compute)), key=compute.__getitem__)
    baseline = statistics.median(c for i, c in enumerate(compute) if i != slowest)
    slow_by = compute[slowest] - baseline
    over = slow_by > threshold * baseline and slow_by > min_seconds
    apart = _quartiles(steps[slowest])[0] > max(_quartiles(s)[1] for i, s in enumerate(steps) if i != slowest)
    beyond = apart and (noise is None or slow_by > noise)
    return Straggler(slowest if over and beyond else None, slowest, slow_by, baseline, compute, wait, threshold, noise,
                     not over or beyond, min_seconds)
