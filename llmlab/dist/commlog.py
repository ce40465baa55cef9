"""Count what one rank sends and receives, and how long it takes: `CommLog`.

    import torch
    from llmlab.dist import CommLog, ring_all_reduce

    def step():
        t = torch.ones(1000)                      # 4000 bytes
        with CommLog() as log:
            ring_all_reduce(t)
        return log.by_op()

    dist.spawn(step, 4)
    # every rank: {'ring_all_reduce.check': OpStats(calls=1, bytes_sent=120, bytes_received=120, seconds=...),
    #              'ring_all_reduce': OpStats(calls=1, bytes_sent=6000, ...)}     # 2(N−1)/N · 4000 = 6000

A log counts on the rank that entered it (each rank has its own). Two kinds of traffic are counted:

- llmlab's collectives (`llmlab.dist.collectives`) send every message through `post`/`exchange` below, which
  record each point-to-point message (a `"p2p"` event, with its peer) and add it to the collective that issued
  it (a `"collective"` event named after it, e.g. `"ring_all_reduce"`). These bytes are the real messages. The
  small metadata exchange a collective makes first to validate its input (see collectives.py) is counted
  apart, as `"<name>.check"`, so a collective's own bytes can be compared with its formula.
- torch.distributed's own collectives — `all_reduce`, `reduce_scatter_tensor`/`reduce_scatter_single`,
  `all_gather_into_tensor`/`all_gather_single`, `broadcast`, `all_to_all_single` — are wrapped while a log
  with `torch_collectives=True` (the default) is open, and logged as `"torch.all_reduce"` etc. Their messages
  are invisible from Python, so a log counts **the bytes llmlab's ring would move on this rank for the same
  call** (for all-reduce `2S − c[r] − c[r+1]` elements sent, which is 2(N−1)/N·S for S divisible by N; for
  reduce-scatter and all-gather (N−1)/N of the full tensor; for broadcast a pipelined chain from `src`; for
  all-to-all everything but the rank's own chunk). These equal nccl-tests' "bus bytes", so DDP on torch's
  all_reduce and DDP on `ring_all_reduce` report the same 2Ψ. Only calls through the `torch.distributed`
  module attribute (`td.all_reduce(...)`) are seen; a name imported before the log opened is not. For
  `async_op=True` the time is that of the launch only, the bytes are complete.

On a GPU the log synchronises the device before reading the clock at the start and at the end of a collective
(only while a log is open), so its time is the collective's own, not that of kernels queued before it, and real
(it includes the wait).
`log.events` has a start and end time (`time.perf_counter`, shared by all processes of one machine) per
message and per collective, for timelines; `log.by_op()` adds them up; `log.summary()` prints a table.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections import namedtuple
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as td

from llmlab import runtime

__all__ = ["CommLog", "Event", "OpStats", "post", "exchange", "scope", "chunk_sizes"]

OpStats = namedtuple("OpStats", "calls bytes_sent bytes_received seconds")


@dataclass(frozen=True)
class Event:
    """One logged operation on this rank."""

    name: str  # the collective ("ring_all_reduce", "torch.all_reduce") or the message ("send", "recv")
    kind: str  # "collective" or "p2p"
    start: float  # time.perf_counter() when it began
    end: float  # ... and when it was complete
    bytes_sent: int
    bytes_received: int
    peer: int | None = None  # p2p: the other rank, as a rank of the group used
    parent: str | None = None  # p2p issued by a collective: the collective's name


_logs: list[CommLog] = []  # the logs open in this process, innermost last
_local = threading.local()  # .scope: the collective now running on this thread (a _Scope), if any


class _Scope:
    def __init__(self, name: str):
        self.name, self.sent, self.received = name, 0, 0


def _append(event: Event, torch_wrapped: bool = False) -> None:
    for log in _logs:
        if log.torch_collectives or not torch_wrapped:
            log.events.append(event)


def _sync(tensor) -> None:
    if isinstance(tensor, torch.Tensor):
        runtime.synchronize(tensor.device)


@contextmanager
def scope(name: str, tensor=None):
    """Mark the messages sent inside as belonging to collective `name` (the outermost scope wins)."""
    if getattr(_local, "scope", None) is not None or not _logs:
        yield
        return
    _sync(tensor)
    _local.scope, start = _Scope(name), time.perf_counter()
    try:
        yield
        _sync(tensor)
    finally:
        s, _local.scope = _local.scope, None
        _append(Event(name, "collective", start, time.perf_counter(), s.sent, s.received))


class Pending:
    """Point-to-point messages in flight; `wait()` completes them and logs them."""

    def __init__(self, works, messages, start):
        self.works, self.messages, self.start = works, messages, start

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        if not _logs:
            return
        _sync(self.messages[0][1] if self.messages else None)
        end, s = time.perf_counter(), getattr(_local, "scope", None)
        for kind, tensor, peer in self.messages:
            nbytes = tensor.numel() * tensor.element_size()
            sent, received = (nbytes, 0) if kind == "send" else (0, nbytes)
            if s is not None:
                s.sent, s.received = s.sent + sent, s.received + received
            _append(Event(kind, "p2p", self.start, end, sent, received, peer, s.name if s else None))


def _global(group, rank: int) -> int:
    return rank if group is None else td.get_global_rank(group, rank)


def post(sends=(), recvs=(), group=None, tag: int = 0) -> Pending:
    """Start sends `[(tensor, dst), ...]` and receives `[(tensor, src), ...]` together, without waiting.

    `dst`/`src` are ranks of `group` (the default group when None). The messages go out in one
    `torch.distributed.batch_isend_irecv`, which NCCL runs as one group, so a ring where every rank sends
    right and receives left cannot deadlock. The tensors must stay untouched until `wait()`. `tag` tells apart
    messages between the same two ranks in flight at once (gloo matches a receive by peer and tag).
    """
    messages = [("send", t, dst) for t, dst in sends] + [("recv", t, src) for t, src in recvs]
    ops = [td.P2POp(td.isend if kind == "send" else td.irecv, t, _global(group, peer), group, tag)
           for kind, t, peer in messages]
    if _logs:
        _sync(messages[0][1] if messages else None)
    start = time.perf_counter()
    return Pending(td.batch_isend_irecv(ops) if ops else [], messages, start)


def exchange(sends=(), recvs=(), group=None) -> None:
    """`post(...)` and wait: the step of a ring (send right, receive left) or of a tree."""
    post(sends, recvs, group).wait()


# -- torch.distributed's collectives, counted as llmlab's ring would move them --------------------------------
def chunk_sizes(numel: int, world_size: int) -> list[int]:
    """Sizes of `torch.tensor_split(flat, world_size)`: the first `numel % world_size` chunks get one more.

    The ring collectives (`llmlab.dist.collectives`) split a tensor so; the log counts torch's collectives as
    that ring would move them."""
    q, extra = divmod(numel, world_size)
    return [q + (i < extra) for i in range(world_size)]


def _ring_bytes(name: str, a: dict) -> tuple[int, int]:
    """(bytes sent, bytes received) on this rank by llmlab's ring for torch collective `name` called with `a`."""
    group = a.get("group")
    n, r = td.get_world_size(group), td.get_rank(group)
    if n == 1:
        return 0, 0
    if name == "all_reduce":
        t = a["tensor"]
        c = chunk_sizes(t.numel(), n)
        return ((2 * t.numel() - c[r] - c[(r + 1) % n]) * t.element_size(),
                (2 * t.numel() - c[(r - 1) % n] - c[r]) * t.element_size())
    if name in ("reduce_scatter_tensor", "reduce_scatter_single"):  # each rank keeps 1/N of the input
        t = a["input"]
        return (n - 1) * t.nbytes // n, (n - 1) * t.nbytes // n
    if name in ("all_gather_into_tensor", "all_gather_single"):  # each rank receives all chunks but its own
        t = a["output_tensor"]
        return (n - 1) * t.nbytes // n, (n - 1) * t.nbytes // n
    if name == "broadcast":  # a pipelined chain src → src+1 → ... → src-1
        t = a["tensor"]
        src = a.get("group_src")
        if src is None:
            src = a["src"] if group is None else td.get_group_rank(group, a["src"])
        position = (r - src) % n
        return (t.nbytes if position < n - 1 else 0), (t.nbytes if position > 0 else 0)
    # all_to_all_single: everything but the chunk a rank sends itself
    out, inp = a["output"], a["input"]
    row_out = out.nbytes // max(1, out.shape[0]) if out.dim() else out.nbytes
    row_in = inp.nbytes // max(1, inp.shape[0]) if inp.dim() else inp.nbytes
    own_in = a["input_split_sizes"][r] * row_in if a.get("input_split_sizes") else inp.nbytes // n
    own_out = a["output_split_sizes"][r] * row_out if a.get("output_split_sizes") else out.nbytes // n
    return inp.nbytes - own_in, out.nbytes - own_out


_WRAPPED = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
            "all_gather_single", "broadcast", "all_to_all_single")
_originals: dict = {}


def _counting(name: str, fn):
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def counted(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        sent, received = _ring_bytes(name, bound.arguments)
        _sync(args[0] if args else None)
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        if not bound.arguments.get("async_op"):
            _sync(args[0] if args else None)
        _append(Event(f"torch.{name}", "collective", start, time.perf_counter(), sent, received), True)
        return result

    return counted


def _wrap_torch() -> None:
    for name in _WRAPPED:
        if hasattr(td, name) and name not in _originals:
            _originals[name] = getattr(td, name)
            setattr(td, name, _counting(name, _originals[name]))


def _unwrap_torch() -> None:
    for name, fn in _originals.items():
        setattr(td, name, fn)
    _originals.clear()


class CommLog:
    """Bytes and time of every collective and message on this rank while the `with` block runs.

    `torch_collectives=False` leaves torch.distributed's own collectives alone (only llmlab's are logged).
    Logs nest: an outer log also sees what an inner one sees.
    """

    def __init__(self, torch_collectives: bool = True):
        self.torch_collectives = bool(torch_collectives)
        self.events: list[Event] = []

    def __enter__(self) -> CommLog:
        _logs.append(self)
        if any(log.torch_collectives for log in _logs):
            _wrap_torch()
        return self

    def __exit__(self, *exc) -> None:
        _logs.remove(self)
        if not any(log.torch_collectives for log in _logs):
            _unwrap_torch()

    def _top(self) -> list[Event]:
        """Collectives, and messages sent outside any collective: together they count every byte once."""
        return [e for e in self.events if e.kind == "collective" or e.parent is None]

    @property
    def bytes_sent(self) -> int:
        return sum(e.bytes_sent for e in self._top())

    @property
    def bytes_received(self) -> int:
        return sum(e.bytes_received for e in self._top())

    def by_op(self) -> dict[str, OpStats]:
        """name → OpStats(calls, bytes_sent, bytes_received, seconds), in the order first seen."""
        out: dict[str, OpStats] = {}
        for e in self._top():
            c = out.get(e.name, OpStats(0, 0, 0, 0.0))
            out[e.name] = OpStats(c.calls + 1, c.bytes_sent + e.bytes_sent, c.bytes_received + e.bytes_received,
                                  c.seconds + e.end - e.start)
        return out

    def summary(self) -> str:
        """A table of `by_op()` with a total line; bytes in MiB."""
        rows = self.by_op()
        lines = [f"{'op':<28}{'calls':>7}{'sent MiB':>12}{'recv MiB':>12}{'seconds':>11}"]
        for name, s in rows.items():
            lines.append(f"{name:<28}{s.calls:>7}{s.bytes_sent / 2**20:>12.4f}{s.bytes_received / 2**20:>12.4f}"
                         f"{s.seconds:>11.4f}")
        total = OpStats(*(sum(col) for col in zip(*rows.values(), strict=True))) if rows else OpStats(0, 0, 0, 0)
        lines.append(f"{'total':<28}{total.calls:>7}{total.bytes_sent / 2**20:>12.4f}"
                     f"{total.bytes_received / 2**20:>12.4f}{total.seconds:>11.4f}")
        return "\n".join(lines)
