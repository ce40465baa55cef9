"""A hung collective (the material's §7.3): where every rank waits, read from the launcher's per-rank stacks.

- `diagnose_hang(error)` reads the `TimeoutError` of `dist.spawn`/`Cluster.run` (it carries every rank's Python
  stack at the moment of the timeout) and says which ranks wait in which collective, called from which line,
  and which ranks are elsewhere or already returned — the usual causes named: a rank that skipped a collective,
  ranks that called different collectives or are out of step, or one collective stuck on mismatched shapes.
- `debug_detail()` starts ranks with TORCH_DISTRIBUTED_DEBUG=DETAIL, so that a mismatched collective raises
  instead of hanging.

    from llmlab import dist
    from llmlab.diagnose import hang

    try:
        dist.spawn(buggy_step, 2, timeout=10)
    except TimeoutError as e:
        print(hang.diagnose_hang(e))     # "rank 0 waits in all_reduce (…:12); rank 1 returned without calling it"
    with hang.debug_detail():
        dist.spawn(buggy_step, 2)        # RankError: "Detected mismatch between collectives ..."

Under torchrun: `TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun ...`, and `py-spy dump --pid` on each rank for stacks.
"""

from __future__ import annotations

import os
import re
import sysconfig
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["Frame", "RankPlace", "HangReport", "diagnose_hang", "debug_detail"]

_FRAME = re.compile(r'File "(?P<file>.+)", line (?P<line>\d+) in (?P<func>\S+)')
_SECTION = re.compile(r"^--- rank (\d+) ---$", re.M)
_UNFINISHED = re.compile(r"ranks? ([\d, ]+) of (\d+) had not finished")
_GENERIC = {"wrapper", "counted", "wait", "exchange", "post", "scope"}  # decorators and helpers, not the call
_STDLIB = sysconfig.get_paths()["stdlib"]


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.function} ({os.path.basename(self.file)}:{self.line})"


@dataclass(frozen=True)
class RankPlace:
    rank: int
    state: str  # "waiting" (inside a collective or p2p call), "elsewhere", "finished" or "unknown"
    call: str | None  # the collective or p2p function it waits in
    where: Frame | None  # the caller of that function, or where in the program the rank is

    def __str__(self) -> str:
        if self.state == "waiting":
            return f"rank {self.rank} waits in {self.call}, called from {self.where}"
        if self.state == "elsewhere":
            return f"rank {self.rank} is in no collective: at {self.where}"
        return f"rank {self.rank} {'had returned from the function' if self.state == 'finished' else 'shows no stack'}"


@dataclass(frozen=True)
class HangReport:
    world_size: int
    places: list[RankPlace]
    verdict: str

    def __str__(self) -> str:
        return "\n".join([str(p) for p in self.places] + [self.verdict])


def _is_library(file: str) -> bool:
    return file.startswith(_STDLIB) or any(s in file for s in ("site-packages", "dist-packages", "<frozen"))


def _is_comm(file: str) -> bool:
    return "/torch/distributed/" in file or file.endswith(("llmlab/dist/commlog.py", "llmlab/dist/collectives.py"))


def _function_frames(stack: str) -> list[Frame]:
    """The frames of the thread running the rank's function, innermost first, down to the worker's loop."""
    threads = re.split(r"^(?:Current thread|Thread) 0x", stack, flags=re.M)
    parsed = [[Frame(m["file"], int(m["line"]), m["func"]) for m in _FRAME.finditer(t)] for t in threads]
    for frames in parsed:
        ends = [i for i, f in enumerate(frames) if f.file.endswith("_worker.py") and f.function == "main"]
        if ends:
            return frames[:ends[0]]
    return next((f for f in parsed if f), [])


def _place(rank: int, stack: str, finished: bool) -> RankPlace:
    frames = _function_frames(stack)
    if finished or not frames:
        return RankPlace(rank, "finished" if finished else "unknown", None, None)
    inner = next((i for i, f in enumerate(frames) if not _is_comm(f.file)), len(frames))
    if inner == 0:
        where = next((f for f in frames if not _is_library(f.file)), frames[0])
        return RankPlace(rank, "elsewhere", None, where)
    named = [f.function for f in frames[:inner] if f.function not in _GENERIC and not f.function.startswith("_")]
    return RankPlace(rank, "waiting", named[-1] if named else frames[0].function, frames[min(inner, len(frames) - 1)])


def _ranks(ps) -> str:
    return ("ranks " if len(ps) > 1 else "rank ") + ", ".join(str(p.rank) for p in ps)


def _verdict(places: list[RankPlace]) -> str:
    waiting = [p for p in places if p.state == "waiting"]
    if not waiting:
        return "no rank is inside a collective: the hang is in the program itself (a loop, a lock, a data loader)"
    calls: dict[str, list[RankPlace]] = {}
    for p in waiting:
        calls.setdefault(p.call, []).append(p)
    lines = {c: sorted({str(p.where) for p in ps}) for c, ps in calls.items()}
    head = "; ".join(f"{_ranks(ps)} wait in {c}" + (f" ({lines[c][0]})" if len(lines[c]) == 1 else "")
                     for c, ps in calls.items())
    finished = [p for p in places if p.state == "finished"]
    notes = [f"{_ranks(finished)} returned without calling it"] if finished else []
    notes += [f"rank {p.rank} never reached it (at {p.where})" for p in places if p.state == "elsewhere"]
    if len(calls) > 1:
        notes.append("the ranks called different collectives: every rank must issue the same ones in the same order "
                     "(under debug_detail() torch raises, naming the mismatch)")
    elif len(lines[waiting[0].call]) > 1:
        notes.append(f"the ranks call it from different lines ({', '.join(lines[waiting[0].call])}): out of step")
    if notes:
        return f"{head}; " + "; ".join(notes)
    return (f"{head}, from the same line: the program order agrees, so the collective itself is stuck — "
            "mismatched shapes or dtypes, a dead peer or link, or a timeout too short for the data; rerun under "
            "debug_detail() (TORCH_DISTRIBUTED_DEBUG=DETAIL) to have torch compare shapes and dtypes")


def diagnose_hang(error: TimeoutError | str) -> HangReport:
    """Where each rank was when `dist.spawn`/`Cluster.run` timed out: pass the `TimeoutError` (or its text)."""
    if not isinstance(error, TimeoutError | str):
        raise ValueError(f"error must be the TimeoutError raised by dist.spawn/Cluster.run when ranks hang (or "
                         f"its message), got {type(error).__name__}: {str(error)[:120]}")
    text = str(error)
    head, sections = _UNFINISHED.search(text), _SECTION.split(text)[1:]
    if head is None or not sections:
        raise ValueError(f"error has no per-rank stacks (is it the launcher's hang TimeoutError?): {text[:160]!r}")
    unfinished = {int(r) for r in head[1].split(",")}
    stacks = dict(zip(map(int, sections[::2]), sections[1::2], strict=True))
    world_size = int(head[2])
    places = [_place(r, stacks.get(r, ""), r not in unfinished) for r in range(world_size)]
    return HangReport(world_size, places, _verdict(places))


@contextmanager
def debug_detail():
    """Ranks started inside the block (`dist.spawn`, `Cluster.start`) run with TORCH_DISTRIBUTED_DEBUG=DETAIL.

    torch then wraps the process group: before each collective the ranks compare its op, shapes and dtypes over
    a helper gloo group, and a mismatch raises `RuntimeError("Detected mismatch between collectives on ranks
    ...")` on the ranks — a `RankError` in the caller — instead of hanging. It costs an extra exchange per
    collective: for debugging only. A rank that skips a collective still hangs (nothing to compare with).
    Starting the ranks yourself, `dist.Cluster(n, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})` does the same;
    this block also reaches ranks started inside other code (a library function calling `dist.spawn`): it sets
    the variable in this process, which ranks inherit when they start, and restores it after. A Cluster
    started before the block is unaffected.
    """
    old = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
        else:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = old
