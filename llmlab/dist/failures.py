"""How a multi-rank call fails, as the caller sees it: `RankError`, `RankCrashed`, `RankHang`, and the root cause.

    try:
        dist.spawn(train, 4, timeout=None, stall_timeout=600)
    except (dist.RankError, dist.RankHang) as e:
        sys.exit(f"error: {e.headline}")          # one line, e.g. "rank 2 of 4 was killed by SIGKILL — out of memory?"

- `RankError`: an exception raised on one rank (its type, message, the exception object and its traceback).
- `RankCrashed` (a RankError): a rank's process ended without answering — exited, or killed by a signal.
- `RankHang` (a TimeoutError): some rank neither returned nor called `heartbeat()` for `stall_timeout` seconds.

When one rank dies in a collective, its peers fail a moment later with "Connection reset by peer" or "Connection
closed by peer": those errors are consequences. `root_cause` orders the failures of one call so the dead process
comes first, then exceptions that are not lost connections, then lost connections; within each kind, the lowest rank.
"""

from __future__ import annotations

import re
import signal

__all__ = ["RankError", "RankCrashed", "RankHang", "root_cause", "is_connection_error"]

# what gloo, NCCL, the TCPStore and Python say when the peer at the other end of a socket went away
_CONNECTION = re.compile(r"connection (reset|closed|refused|lost|aborted)|(reset|closed) by peer|broken pipe|"
                         r"socket closed|remote process exited|ECONNRESET|EPIPE", re.I)
_CONNECTION_TYPES = {"ConnectionError", "ConnectionResetError", "ConnectionAbortedError", "BrokenPipeError",
                     "DistNetworkError"}


def _first_line(text: str, limit: int = 200) -> str:
    line = next((s.strip() for s in str(text).splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[:limit - 1] + "…"


class RankError(RuntimeError):
    """An exception raised on one rank, re-raised in the caller.

    Attributes: `rank`, `world_size`, `exc_type` (class name), `message`, `exception` (the original exception
    object, or None when it could not be pickled back), `remote_traceback` (the rank's formatted traceback),
    `headline` (one line fit for a command line's error, e.g. "rank 1 of 4 raised ValueError: bad shape") and
    `note` (what the launcher adds: other failed ranks, where every rank was).
    """

    def __init__(self, rank, world_size, exc_type, message, remote_traceback, exception=None, note="",
                 headline=None):
        self.rank, self.world_size = rank, world_size
        self.exc_type, self.exception, self.remote_traceback = exc_type, exception, remote_traceback
        self.message, self.note = str(message), note
        self.headline = headline or f"rank {rank} of {world_size} raised {exc_type}: {_first_line(message)}"
        self._summary = headline or f"rank {rank} of {world_size} raised {exc_type}: {message}"
        super().__init__(self.headline)

    def __str__(self) -> str:
        text = self._summary + (f"\n{self.note}" if self.note else "")
        return f"{text}\n\n--- traceback on rank {self.rank} ---\n{self.remote_traceback.rstrip()}"


class RankCrashed(RankError):
    """A rank's process ended without answering: `returncode` (negative: killed by a signal), `signal` (its number,
    or None when the process exited). SIGKILL is what the kernel's out-of-memory killer sends, so it says so."""

    def __init__(self, rank, world_size, returncode, output_tail, note=""):
        self.returncode = returncode
        self.signal = -returncode if returncode is not None and returncode < 0 else None
        if self.signal == signal.SIGKILL:
            how = "was killed by SIGKILL — out of memory?"
        elif self.signal is not None:
            name = signal.Signals(self.signal).name if self.signal in signal.valid_signals() else self.signal
            how = f"was killed by {name} ({signal.strsignal(self.signal) or 'signal ' + str(self.signal)})"
        elif returncode is None:
            how = "closed its connection to the caller without answering (its process is still running)"
        else:
            how = f"exited with code {returncode} without answering"
        super().__init__(rank, world_size, "RankCrashed", how,
                         f"last output of rank {rank}:\n{output_tail or '(none)'}", note=note,
                         headline=f"rank {rank} of {world_size} {how}")


class RankHang(TimeoutError):
    """Some rank neither returned nor called `heartbeat()` for `stall_timeout` seconds (see `Cluster.run`).

    Attributes: `ranks` (those that made no progress), `world_size`, `stall_timeout`, `stacks` (rank → its Python
    stack at that moment, every live rank) and `headline` (one line, e.g. "no step finished for 600 s on rank 1
    of 4 (no heartbeat() and no return)"). The message carries every rank's stack, as `diagnose.hang` reads them.
    """

    def __init__(self, ranks, world_size, stall_timeout, stacks, note):
        self.ranks, self.world_size, self.stall_timeout = list(ranks), world_size, stall_timeout
        self.stacks = dict(stacks)
        who = ("rank " if len(self.ranks) == 1 else "ranks ") + ", ".join(map(str, self.ranks))
        self.headline = (f"no step finished for {stall_timeout:g} s on {who} of {world_size} "
                         "(no heartbeat() and no return)")
        super().__init__(f"{self.headline}\n{note}")


def is_connection_error(error: RankError) -> bool:
    """Whether a rank's exception says it lost a peer (the usual consequence of another rank's death)."""
    return error.exc_type in _CONNECTION_TYPES or bool(_CONNECTION.search(error.message))


def root_cause(errors: dict[int, RankError]) -> list[int]:
    """The failed ranks of one call, most likely root cause first: crashed processes, then exceptions other than
    lost connections, then lost connections; the lowest rank first within each."""
    def kind(rank):
        e = errors[rank]
        return 0 if isinstance(e, RankCrashed) else 2 if is_connection_error(e) else 1

    return sorted(errors, key=lambda rank: (kind(rank), rank))
