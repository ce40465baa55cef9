"""One way to time anything, on a GPU node or on a laptop that is busy with other things too.

Every timed figure of the library — a chapter's cell, a claim's verdict, a bench row — is measured by
`interleave` (or its shorthands: `measure` for one function, `compare` for an implementation and its peer):

1. **warm-up**: each function runs `warmup` times untimed (first-call compilation, allocator growth, caches);
2. **calibration**: a function quicker than `min_round_s` is called several times in a row per round, so that the
   clock's resolution and the loop's own overhead do not count;
3. **interleaved rounds**: a round times every function once, in an order rotated from round to round. A busy spell
   of the machine (another program, a browser tab, the OS) then hits all of them, and none always runs first;
4. **adaptive**: rounds are added until every function's spread — or, for a comparison, the spread of the
   per-round ratios — is at most `target_spread`, or the time `budget_s` is spent (at least `min_rounds`, at most
   `max_rounds` rounds).

**The statistic is the median of the rounds**, and a comparison's ratio is the median of the per-round ratios.
Why the median and not the minimum (`timeit`'s choice): the minimum is the luckiest round, and on a machine whose
load changes it may come from a moment the peer never saw, so two minima need not share their conditions; the
median of *paired* ratios compares rounds that ran side by side, and half the rounds may be hit by a busy spell
before it moves. The median is also what a learner's machine does now, not what it did once.

**The spread** is half the interquartile range over the median, printed `±8%` (as `torch.utils.benchmark`'s
`Measurement` keeps its IQR). It travels with the figure, with the machine's state while it was measured
(`Load`: the 1-minute load average and the cores this process may use). A figure whose spread exceeds
`MAX_SPREAD` is not conclusive: its `note()` says so, to be printed beside it, and `Comparison.direction` answers
"not conclusive" instead of "faster" or "slower" when the ratio's interquartile range straddles the threshold.

**On several ranks, the ranks decide alike.** A function timed on every rank of a process group may hold a
collective (a DDP step's all-reduce), and a collective must be called as often on every rank, or the ranks wait
for one another for ever. So where torch.distributed is initialised (`group="auto"`, the default), `interleave`
agrees across the group's ranks on every choice it makes from a clock: the calls per round (the most any rank
asked for) and when to stop (once a rank has spent `budget_s`, or once every rank's spread has settled), with
one small all-reduce after each round, outside the timed span. Rounds, calls and the order are then the same on
every rank; each rank keeps its own seconds. Pass `group=None` to time on one rank alone (its peers not
calling), or a process group to agree within it.

Measurements that must run elsewhere (every rank of a cluster times its own rounds) build their figures from
their samples with `Timing.from_samples`, so they are summarised, and their spread judged, the same way.

    from llmlab import timing
    t = timing.measure(lambda: a @ b)            # Timing: t.seconds, t.spread, str(t) == "4.1 ms ±2%"
    c = timing.compare(new, old)                 # Comparison: c.ratio (new time / old time), c.direction()
    print(c.says("the fused kernel", "the reference"))
    r = timing.interleave({"b=4": f4, "b=16": f16, "b=64": f64})   # Rounds: r["b=16"], r.ratio("b=16", "b=4")
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

from llmlab import runtime

__all__ = ["MAX_SPREAD", "Load", "Timing", "Comparison", "Rounds", "synchronize", "agree_max", "interleave",
           "measure", "compare", "remembered"]

MAX_SPREAD = 0.2  # a figure whose rounds spread more than ±20% around their median is not conclusive


def synchronize(device) -> None:
    """Wait for `device`'s queued work (CUDA kernels run asynchronously); nothing to wait for on the CPU."""
    if device is not None:
        runtime.synchronize(device)


@dataclass(frozen=True)
class Load:
    """How busy the machine was: the 1-minute load average (runnable threads, this process's own included) and
    the cores this process may use. NaN where the OS has no load average (Windows)."""

    average: float
    cores: int

    @classmethod
    def now(cls) -> Load:
        try:
            average = os.getloadavg()[0]
        except (AttributeError, OSError):  # no load average on this OS
            average = math.nan
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return cls(average, cores)

    def busier(self, other: Load | None) -> Load:
        """The busier of two readings (taken before and after a measurement)."""
        return self if other is None or not other.average > self.average else other

    def __str__(self) -> str:
        return f"load {self.average:.1f} on {self.cores} core{'s' * (self.cores != 1)}"


def _quartiles(values) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def _spread(values) -> float:
    """Half the interquartile range over the median (0 for a single value)."""
    q1, q2, q3 = _quartiles(values)
    return (q3 - q1) / (2 * q2) if q2 > 0 else math.inf


def _duration(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _busy_note(spread: float, load: Load | None) -> str:
    if spread <= MAX_SPREAD:
        return ""
    where = f" ({load})" if load is not None else ""
    return f"measured while the machine was busy{where}: ±{spread:.0%}, its size not conclusive"


@dataclass(frozen=True)
class Timing:
    """One function's rounds: `samples` holds the seconds per call of each round, `calls` the calls per round."""

    samples: tuple[float, ...]
    calls: int = 1
    load: Load | None = None

    @classmethod
    def from_samples(cls, samples, calls: int = 1, load: Load | None = None) -> Timing:
        """A Timing from seconds measured elsewhere (e.g. on the ranks of a cluster), judged like any other."""
        samples = tuple(float(s) for s in samples)
        if not samples:
            raise ValueError("samples is empty: a timing needs at least one round")
        if any(not s >= 0 for s in samples):
            raise ValueError(f"samples={samples!r} must be durations in seconds, >= 0")
        return cls(samples, calls, load)

    @property
    def seconds(self) -> float:
        """The median of the rounds (see the module's docstring for why the median)."""
        return statistics.median(self.samples)

    @property
    def ms(self) -> float:
        return self.seconds * 1e3

    @property
    def spread(self) -> float:
        """Half the interquartile range of the rounds over their median: the `±` printed with the figure."""
        return _spread(self.samples)

    @property
    def conclusive(self) -> bool:
        return self.spread <= MAX_SPREAD

    def note(self) -> str:
        """'' when conclusive; else the sentence to print beside the figure, with the spread and the load."""
        return _busy_note(self.spread, self.load)

    def __str__(self) -> str:
        return f"{_duration(self.seconds)} ±{self.spread:.0%}"


@dataclass(frozen=True)
class Comparison:
    """An implementation timed against its peer in the same rounds; `ratios` are impl time / peer time per round."""

    impl: Timing
    peer: Timing
    ratios: tuple[float, ...]

    @property
    def ratio(self) -> float:
        """impl time / peer time: the median of the per-round ratios (below 1: impl is faster)."""
        return statistics.median(self.ratios)

    @property
    def spread(self) -> float:
        return _spread(self.ratios)

    @property
    def load(self) -> Load | None:
        return self.impl.load

    @property
    def conclusive(self) -> bool:
        return self.spread <= MAX_SPREAD

    def direction(self, threshold: float = 1.0) -> str:
        """'slower' when the ratio's interquartile range lies above `threshold`, 'faster' when below it, else
        'not conclusive' (the rounds disagree about which side of the threshold it is on)."""
        q1, _, q3 = _quartiles(self.ratios)
        return "slower" if q1 > threshold else "faster" if q3 < threshold else "not conclusive"

    def note(self) -> str:
        return _busy_note(self.spread, self.load)

    def says(self, impl: str, peer: str) -> str:
        """A sentence stating what was measured, in the direction the measurement took: e.g. 'fp16 takes 8.3× the
        time of fp32 (±4%, 9 rounds, load 0.4 on 2 cores): slower here.'"""
        how = f"±{self.spread:.0%}, {len(self.ratios)} rounds" + (f", {self.load}" if self.load else "")
        verdict = self.direction()
        if verdict == "not conclusive":
            return f"{impl} takes {self.ratio:.2f}× the time of {peer} ({how}): not conclusive on this machine now."
        if not self.conclusive:  # the quartiles agree on the side, but spread too wide to state by how much
            return (f"{impl} takes {self.ratio:.2f}× the time of {peer} ({how}): {verdict} here in three rounds of "
                    "four or more, by an amount these rounds cannot pin down.")
        return f"{impl} takes {self.ratio:.2f}× the time of {peer} ({how}): {verdict} here."

    def row(self) -> dict:
        """The bench-table fields: impl_ms, peer_ms, ratio, its spread and the load."""
        return {"impl_ms": self.impl.ms, "peer_ms": self.peer.ms, "ratio": self.ratio, "spread": self.spread,
                "load": str(self.load) if self.load else ""}

    def __str__(self) -> str:
        return f"{self.ratio:.3g}× ±{self.spread:.0%}"


@dataclass(frozen=True)
class Rounds:
    """What `interleave` measured: one Timing per function (the same rounds), and the machine's load."""

    timings: dict[str, Timing]
    load: Load

    def __getitem__(self, name: str) -> Timing:
        return self.timings[name]

    def ratio(self, impl: str, peer: str) -> Comparison:
        """impl against peer, round by round."""
        a, b = self.timings[impl], self.timings[peer]
        return Comparison(a, b, tuple(x / y if y > 0 else math.inf for x, y in zip(a.samples, b.samples, strict=True)))


def _check(name, value, low, kind=int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or not value >= low:
        raise ValueError(f"{name}={value!r} must be {'a number' if kind is float else 'an integer'} >= {low}")


def _agreeing(group):
    """The process group whose ranks must decide alike (see the module's docstring), or None to decide alone."""
    if group is None:
        return None
    if isinstance(group, str) and group != "auto":
        raise ValueError(f"group={group!r} must be 'auto', None or a torch.distributed process group")
    td = sys.modules.get("torch.distributed")  # never imported: no group can be initialised (and none is loaded)
    if td is None or not (td.is_available() and td.is_initialized()):
        if isinstance(group, str):
            return None
        raise ValueError("group= names a process group, but torch.distributed is not initialised")
    group = td.group.WORLD if isinstance(group, str) else group
    if td.get_rank(group) < 0:
        raise ValueError(f"group: this process (global rank {td.get_rank()}) is not a member of it")
    return group if td.get_world_size(group) > 1 else None


def _most(values: list[float], group) -> list[float]:
    """Each of `values`' largest value over the ranks of `group` (a MAX all-reduce); `values` itself alone."""
    if group is None:
        return values
    import torch  # loaded already: a group is initialised (_agreeing)
    import torch.distributed as td  # the same

    most = torch.tensor(values, dtype=torch.float64, device=runtime.group_device(group))  # (len(values),)
    td.all_reduce(most, op=td.ReduceOp.MAX, group=group)
    return most.tolist()


def agree_max(values, group="auto") -> list[float]:
    """Each of `values` (numbers this rank measured) replaced by its largest value over the ranks of `group`
    ("auto", None or a process group, as for `interleave`), so that every rank takes the same decision from it."""
    return _most([float(v) for v in values], _agreeing(group))


def interleave(fns: dict, *, device=None, warmup: int = 1, min_rounds: int = 5, max_rounds: int = 30,
               budget_s: float = 1.0, target_spread: float = 0.05, min_round_s: float = 2e-3,
               group="auto") -> Rounds:
    """Time every function of `fns` ({name: fn}) in interleaved rounds; see the module's docstring for the method.

    On a CUDA `device` the clock is read only after `torch.cuda.synchronize` (`runtime.synchronize`), so a round
    is the kernels' time, not their launch's. Rounds stop once every function's spread, or every ratio to the first
    function, is at most `target_spread` (after `min_rounds`), when `budget_s` seconds of rounds are spent, or at
    `max_rounds`. `group`: whose ranks decide the calls per round and the stop alike — "auto" (the default group
    where torch.distributed is initialised, else none), None (this process alone) or a process group; every rank
    of it must then call `interleave` with the same functions and arguments.
    """
    if not isinstance(fns, dict) or not fns or not all(callable(f) for f in fns.values()):
        raise ValueError(f"fns={fns!r} must be a non-empty dict of {{name: function}}")
    _check("warmup", warmup, 0)
    _check("min_rounds", min_rounds, 1)
    _check("max_rounds", max_rounds, min_rounds)
    _check("budget_s", budget_s, 0, float)
    _check("target_spread", target_spread, 0, float)
    _check("min_round_s", min_round_s, 0, float)
    group = _agreeing(group)
    names = list(fns)
    load = Load.now()
    calls = {}
    for name in names:  # warm-up, then one timed call to decide how many calls a round needs
        for _ in range(warmup):
            fns[name]()
        synchronize(device)
        start = time.perf_counter()
        fns[name]()
        synchronize(device)
        one = time.perf_counter() - start
        calls[name] = max(1, min(1000, math.ceil(min_round_s / one))) if one > 0 else 1000
    calls = dict(zip(names, (int(c) for c in _most([calls[n] for n in names], group)), strict=True))
    samples = {name: [] for name in names}
    started = time.perf_counter()
    for r in range(max_rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]  # rotate the order from round to round
            fn, count = fns[name], calls[name]
            synchronize(device)
            start = time.perf_counter()
            for _ in range(count):
                fn()
            synchronize(device)
            samples[name].append((time.perf_counter() - start) / count)
        if r + 1 >= min_rounds:
            alone = all(_spread(s) <= target_spread for s in samples.values())
            first = samples[names[0]]
            paired = len(names) > 1 and all(
                _spread([a / b if b > 0 else math.inf for a, b in zip(s, first, strict=True)]) <= target_spread
                for s in list(samples.values())[1:])
            unsettled, spent = _most([float(not (alone or paired)), float(time.perf_counter() - started >= budget_s)],
                                     group)
            if spent or not unsettled:
                break
    load = load.busier(Load.now())
    return Rounds({name: Timing(tuple(samples[name]), calls[name], load) for name in names}, load)


def measure(fn, **kwargs) -> Timing:
    """One function timed by `interleave` (warm-up, adaptive rounds, median, spread, load)."""
    return interleave({"fn": fn}, **kwargs)["fn"]


def compare(impl, peer, **kwargs) -> Comparison:
    """`impl` against `peer`, interleaved round by round: `.ratio` is impl time / peer time (median per round)."""
    return interleave({"impl": impl, "peer": peer}, **kwargs).ratio("impl", "peer")


def remembered(fn):
    """Decorate a measuring function so that one figure is one measurement: `fn(...)` measures afresh at every
    call (a chapter's cell, re-run, re-measures) and remembers the result for its arguments; `fn.recent(...)`
    returns the result last measured with those arguments in this process, measuring only if there is none. A
    claim that cites a chapter's figure calls `.recent()`, so the claims table shows the number the cell printed,
    not a second measurement taken at another moment."""
    last = {}

    @functools.wraps(fn)
    def measuring(*args, **kwargs):
        last[(args, tuple(sorted(kwargs.items())))] = result = fn(*args, **kwargs)
        return result

    def recent(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        return last[key] if key in last else measuring(*args, **kwargs)

    measuring.recent = recent
    return measuring
