"""The caller's handle on one rank process (`RankProcess`), and `stop`: no rank, and no process it started, outlives it.

Used by `launcher.Cluster`: a rank is `python -u -m llmlab.dist._worker`, started as the leader of its own session
and process group (so the processes it starts share its group), talking to the caller over a private socket pair;
its output is printed in the caller prefixed `[rank N]`, and its Python stack can be asked for at any moment
(SIGUSR1 → faulthandler → an unlinked temporary file). Stopping a rank SIGKILLs its whole process group: a process
group, unlike PR_SET_CHILD_SUBREAPER, needs nothing of the caller (a notebook kernel would have to reap every
orphan of the machine's ranks) and still reaches a rank's children after the rank itself died; a child that leaves
the group (setsid(), setpgid()) is not followed.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from multiprocessing.connection import Connection

from llmlab.dist.failures import RankCrashed

__all__ = ["RankProcess", "stop"]

_STACK_WAIT_S = 2.0  # how long a rank gets to write its stack after SIGUSR1
_CLOSE_WAIT_S = 5.0  # how long ranks asked to close get to exit before they are killed
# what libstdc++ and c10 print when a C++ exception kills a process (gloo's "enforce fail" on a size mismatch)
_ABORT_TEXT = re.compile(r"terminate called after throwing |\s*what\(\): |Exception raised from |frame #\d+: ")


class RankProcess:
    """The caller's handle on one rank process: its connection, output and stack file."""

    def __init__(self, rank: int, boot: dict, env: dict):
        here, there = socket.socketpair()
        self.stack = tempfile.TemporaryFile()  # unlinked; the rank's faulthandler writes its stacks here
        boot = dict(boot, rank=rank, stack_fd=self.stack.fileno())
        env = dict(env, LLMLAB_WORKER_FD=str(there.fileno()))
        self.rank = rank
        self.output = deque(maxlen=40)
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "llmlab.dist._worker"], env=env,
            pass_fds=[there.fileno(), boot["stack_fd"], boot["progress_fd"]],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)  # its own session and process group, whose id is its pid: see _kill_group()
        there.close()
        self.conn = Connection(here.detach())
        self.conn.send(boot)
        self._reader = threading.Thread(target=self._forward_output, daemon=True, name=f"rank{rank}-out")
        self._reader.start()

    def _forward_output(self):
        """Print the rank's stdout/stderr in the caller (a notebook cell shows it), prefixed by its rank; a C++
        runtime's dying words are kept for the `RankCrashed` error (which says them once, with the rank's exit
        code) rather than printed raw in the cell."""
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.output.append(line)
            if not _ABORT_TEXT.match(line):
                print(f"[rank {self.rank}] {line}", file=sys.stdout, flush=True)

    def tail(self) -> str:
        self._reader.join(timeout=1.0)
        return "\n".join(self.output)

    def returncode(self, wait_s: float = 2.0):
        try:
            return self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None

    def crashed(self, world_size: int) -> RankCrashed:
        """The error for this rank's dead process; the processes it started are killed (they are orphans now)."""
        code = self.returncode()
        if code is not None:
            self._kill_group()
        return RankCrashed(self.rank, world_size, code, self.tail())

    def dump_stack(self) -> str:
        """Ask the rank (via SIGUSR1 → faulthandler) where its Python threads are, and read the answer."""
        if self.proc.poll() is not None:
            return f"(process already ended with code {self.proc.returncode})"
        fd = self.stack.fileno()
        size0 = os.fstat(fd).st_size
        self.proc.send_signal(signal.SIGUSR1)
        deadline, size, last = time.monotonic() + _STACK_WAIT_S, size0, -1
        while time.monotonic() < deadline:
            time.sleep(0.05)
            size = os.fstat(fd).st_size
            if size > size0 and size == last:  # written and no longer growing
                break
            last = size
        return os.pread(fd, size - size0, size0).decode(errors="replace").rstrip() or "(no stack written)"

    def _kill_group(self):
        """SIGKILL the rank's process group: the rank and every process it started that stayed in the group. (The
        group outlives the rank while such a process lives, so its id, the rank's pid, is not reused meanwhile.)"""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # the group is empty: the rank and its children ended
            pass

    def kill(self):
        """End the rank and its processes, and reap it."""
        self._kill_group()
        self.proc.wait()
        self.conn.close()
        self.stack.close()
        self._reader.join(timeout=1.0)


def stop(ranks: list[RankProcess], polite: bool) -> None:
    """End every rank and its processes, and reap it: ask them to close first when `polite`, then kill the groups."""
    if polite:
        for r in ranks:
            try:
                r.conn.send(("close",))
            except OSError:
                pass
        deadline = time.monotonic() + _CLOSE_WAIT_S
        for r in ranks:
            r.returncode(max(0.0, deadline - time.monotonic()))
    for r in ranks:
        r.kill()
