"""The hang detector of a process that trains alone (`llmlab train` with --nproc 1, or one rank under torchrun):
`Watchdog(T)` ends the process when no update finished for T seconds — the stack of every thread written to a file,
one line on stderr naming it, exit code 2. It limits the time between updates, never the length of the run.
(Spawned ranks are watched by their launcher instead: `llmlab.dist.spawn(..., stall_timeout=T)` raises RankHang.)

    with Watchdog(600) as beat:     # counts from here
        for _ in range(steps):
            step()
            beat()                  # an update finished: T more seconds

The watchdog is a daemon thread waiting on an event; Python switches threads every few milliseconds, and torch's
kernels release the interpreter lock, so it runs whatever the main thread is stuck in (a kernel, a collective,
a Python loop); only C code that holds the lock forever would silence it.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import threading

from llmlab import validation

__all__ = ["Watchdog"]


class Watchdog:
    """Exit with code 2 and one line on stderr (`prog: error: ...`) when `beat()` is not called for `seconds`."""

    def __init__(self, seconds: float, prog: str = "python -m llmlab.train"):
        self.seconds = float(validation.positive("seconds", seconds, hint="(the longest wait for an update)"))
        self.prog = prog
        self._beat, self._done = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._watch, name="llmlab-train-watchdog", daemon=True)

    def beat(self) -> None:
        """An update finished: the wait starts again."""
        self._beat.set()

    def __enter__(self):
        self._thread.start()
        return self.beat

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._beat.set()  # wake the thread so that it sees `_done`
        self._thread.join()

    def _watch(self) -> None:
        while self._beat.wait(self.seconds):
            if self._done.is_set():
                return
            self._beat.clear()
        fd, path = tempfile.mkstemp(prefix="llmlab-train-hang-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(f"no update finished for {self.seconds:g} s; the stack of every thread (the main thread's "
                    "shows where training stopped):\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        print(f"{self.prog}: error: no update finished for {self.seconds:g} s (--timeout); the stack of every "
              f"thread is in {path}", file=sys.stderr, flush=True)
        os._exit(2)  # the main thread is stuck: it cannot be unwound
