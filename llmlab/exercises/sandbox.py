"""Where a graded notebook's code runs: a memory limit, every process it started stopped, optionally a sandbox.

A learner's notebook is their code, and ``llmlab grade`` runs it. Three things bound it:

- **Its processes** (:class:`Reaper`). The kernel starts in a session of its own (jupyter_client does that), so
  killing its process group stops what stayed in it; a process can leave the group (``setsid``, a double fork),
  though. While a :class:`Reaper` is open, this process is Linux's *child subreaper*
  (``prctl(PR_SET_CHILD_SUBREAPER)``): a descendant whose parent dies is re-parented here instead of to init, so
  however it detaches it stays a descendant. :meth:`Reaper.stop` SIGKILLs every process that became a descendant
  while the reaper was open, again and again until none is left (one that forks meanwhile is found in the next
  round), and reaps them. Processes that were descendants before it opened, and theirs, are left alone. On
  another OS, or when the kernel asks a daemon of the machine to start something (``at``, ``ssh localhost``),
  a process can still get away; :func:`bubblewrap` closes that.
- **Memory** (:func:`memory_limit`): ``RLIMIT_DATA`` (the heap and private writable mappings; not address space
  only reserved, which CUDA reserves by the terabyte) for the kernel and everything it starts, each process on its
  own: an allocation beyond it raises ``MemoryError`` (torch: "DefaultCPUAllocator: can't allocate memory") in
  that process instead of the machine swapping or its OOM killer picking a victim. A process with
  ``CAP_SYS_RESOURCE`` (root, outside a sandbox) can lift it. Only Linux enforces it for mmap'd memory.
- **What it reaches** (:func:`bubblewrap`, ``llmlab grade --isolate``): Debian's bubblewrap runs the kernel with
  no network, in its own PID namespace (it sees and signals nothing outside, and everything in it dies with the
  sandbox), with every file system read-only except one scratch folder (its HOME and TMPDIR, and the kernel's
  connection sockets; deleted afterwards) and a private /dev/shm, and with no capabilities even as root. It can
  still *read* whatever the grading account can read.
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37  # <linux/prctl.h>
_STOP_SECONDS = 10  # SIGKILL takes effect at once: rounds only outlast this if processes fork faster than we kill


class SandboxUnavailable(RuntimeError):
    """Isolation was asked for and this machine cannot give it; the message says why in one line."""


class Reaper:
    """A context in which every process this one's descendants start stays findable, and is stopped at the end.

    One at a time in a process: a second one open meanwhile would count the first one's kernel as its own.
    """

    def __init__(self):
        self._before: set[tuple[int, float]] = set()
        self._previous: int | None = None

    def __enter__(self) -> Reaper:
        self._before = {_key(p) for p in psutil.Process().children(recursive=True) if _key(p)}
        self._previous = _subreaper(1)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            if self._previous is not None:
                _subreaper(self._previous)

    def stop(self) -> int:
        """SIGKILL and reap every process that became a descendant of this one inside the context; return how many.

        Raises RuntimeError naming them if some still live after a few seconds (a fork bomb outpacing the rounds).
        """
        killed: set[int] = set()
        deadline = time.monotonic() + _STOP_SECONDS
        while True:
            found = self._new_descendants()
            if not found:
                return len(killed)
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not stop {len(found)} processes the notebook started "
                                   f"(pids {sorted(p.pid for p in found)[:10]}) within {_STOP_SECONDS} s")
            for process in found:
                killed.add(process.pid)
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass
            for process in found:
                _reap(process.pid)
            time.sleep(0.01)  # let the killed die, and their orphans be re-parented here

    def _new_descendants(self) -> list[psutil.Process]:
        """Descendants of this process that were not there on entry, nor started by one that was."""
        found, todo = [], psutil.Process().children()
        while todo:
            process = todo.pop()
            key = _key(process)
            if key is None or key in self._before:
                continue  # gone, or there before us: its own children are its business
            found.append(process)
            try:
                todo += process.children()
            except psutil.NoSuchProcess:
                pass
        return found


def memory_limit(nbytes: int):
    """A ``preexec_fn`` that limits a child's memory (RLIMIT_DATA, hard and soft) to `nbytes`."""
    if not (isinstance(nbytes, int) and nbytes > 0):
        raise ValueError(f"memory={nbytes!r} must be a positive number of bytes")

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (nbytes, nbytes))

    return apply


def physical_memory() -> int:
    """This machine's physical memory in bytes."""
    return psutil.virtual_memory().total


def bubblewrap(scratch: Path, cwd: Path) -> list[str]:
    """The bwrap command line (up to its ``--``) that runs a kernel isolated (see the module's docstring).

    `scratch`: the one host folder it may write, which becomes its HOME (scratch/home) and TMPDIR (scratch/tmp)
    and holds the kernel's connection file and sockets; `cwd`: its working directory, read-only. Raises
    SandboxUnavailable when bubblewrap is not installed, or when it is but cannot make a sandbox here (no user
    namespaces, e.g. in some containers).
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "isolate needs bubblewrap (`bwrap`), which is not installed: `apt-get install bubblewrap` "
            "(Debian/Ubuntu), or grade without isolation under an account that holds nothing else"
        )
    for folder in ("home", "tmp"):
        (scratch / folder).mkdir(exist_ok=True)
    options = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--bind", str(scratch), str(scratch),
               "--setenv", "HOME", str(scratch / "home"), "--setenv", "TMPDIR", str(scratch / "tmp"),
               # the kernel's parent is the sandbox's init, pid 1: ipykernel exits when its parent is not the one
               # this names (the grader, outside the PID namespace), or is 1 when this names none
               "--setenv", "JPY_PARENT_PID", "1",
               "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--chdir", str(cwd)]
    probe = subprocess.run([*options, "--", sys.executable, "-c", ""], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
        raise SandboxUnavailable(f"isolate: bubblewrap cannot make a sandbox on this machine: {reason}")
    return [*options, "--"]


def _key(process: psutil.Process) -> tuple[int, float] | None:
    """(pid, start time): a process's identity that survives pid reuse; None when it is gone."""
    try:
        return process.pid, process.create_time()
    except psutil.NoSuchProcess:
        return None


def _reap(pid: int) -> None:
    """Collect `pid`'s exit status if it is a dead child of this process (else leave it to its parent)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _subreaper(value: int) -> int | None:
    """Set whether this process adopts its orphaned descendants; return the previous setting (None: not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    previous = ctypes.c_int(0)
    if libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(previous), 0, 0, 0) != 0 or libc.prctl(
        _PR_SET_CHILD_SUBREAPER, value, 0, 0, 0
    ) != 0:
        raise OSError(ctypes.get_errno(), f"prctl(PR_SET_CHILD_SUBREAPER, {value}) failed")
    return previous.value

