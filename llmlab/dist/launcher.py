"""Start real torch.distributed ranks from a notebook or a script, and get their results back.

    from llmlab import dist

    def hello():
        import torch, torch.distributed as td
        t = torch.tensor([td.get_rank() + 1.0])
        td.all_reduce(t)
        return t.item()

    dist.spawn(hello, 4)                 # [10.0, 10.0, 10.0, 10.0]
    with dist.Cluster(4) as cluster:     # ranks stay alive between calls: pay start-up once
        cluster.run(hello)
        cluster.run(hello, timeout=10)

Each rank is a fresh Python process (`python -m llmlab.dist._worker`, the spawn start method, so CUDA is
safe) joined into one process group (gloo on CPU, NCCL with one GPU per rank) through a TCPStore that the
caller hosts on a port the OS picks, so two launches never collide. The function and its arguments travel by
value with cloudpickle: a function defined in a notebook cell works.

Failures come back to the caller, never as a hang:
- an exception on a rank is raised as `RankError` carrying the rank, the original exception and its traceback;
- a rank killed by a signal (or exiting) is raised as `RankCrashed`, naming the signal;
- a call that does not finish within `timeout` seconds raises `TimeoutError` showing every rank's Python stack
  at that moment (faulthandler, so a rank blocked inside a C call such as gloo's recv still shows it).
After a failure that leaves ranks stuck, the cluster stops them; its next `run` starts fresh ranks.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from datetime import timedelta
from multiprocessing.connection import Connection, wait

from llmlab import runtime, validation

__all__ = ["Cluster", "spawn", "RankError", "RankCrashed"]

_GRACE_S = 3.0  # how long the other ranks get to finish after one rank failed
_STACK_WAIT_S = 2.0  # how long a rank gets to write its stack after SIGUSR1


class RankError(RuntimeError):
    """An exception raised on one rank, re-raised in the caller.

    Attributes: `rank`, `exc_type` (class name), `exception` (the original exception object, or None when
    it could not be pickled back), `remote_traceback` (the rank's formatted traceback).
    """

    def __init__(self, rank, world_size, exc_type, message, remote_traceback, exception=None, note="",
                 headline=None):
        self.rank, self.world_size = rank, world_size
        self.exc_type, self.exception, self.remote_traceback = exc_type, exception, remote_traceback
        text = headline or f"rank {rank} of {world_size} raised {exc_type}: {message}"
        if note:
            text += f"\n{note}"
        super().__init__(f"{text}\n\n--- traceback on rank {rank} ---\n{remote_traceback.rstrip()}")


class RankCrashed(RankError):
    """A rank's process died (killed by a signal, or exited) before returning; `signal` is its number."""

    def __init__(self, rank, world_size, returncode, output_tail, note=""):
        self.returncode = returncode
        self.signal = -returncode if returncode is not None and returncode < 0 else None
        if self.signal is not None:
            how = f"killed by signal {signal.Signals(self.signal).name} ({self.signal})"
        else:
            how = f"exited with code {returncode}"
        super().__init__(rank, world_size, "RankCrashed", how, f"last output of rank {rank}:\n"
                         f"{output_tail or '(none)'}", note=note,
                         headline=f"rank {rank} of {world_size} crashed: its process was {how}")


def _check_env(env) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and k and "=" not in k and isinstance(v, str)
                                            for k, v in env.items()):
        raise ValueError(f"env={env!r} must be a dict of environment variable names to str values")
    return dict(env)


def _ranks(ranks) -> str:
    """'rank 3' or 'ranks 0, 2' (diagnose.hang reads either)."""
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _pack(fn, args) -> bytes:
    """cloudpickle `fn` and `args` once, naming the piece that cannot travel to the ranks."""
    import cloudpickle  # on the ranks only: `import llmlab.dist` stays light in the parent

    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__} {fn!r:.60}")
    for i, piece in enumerate((fn, *args)):
        try:
            cloudpickle.dumps(piece)
        except Exception as e:
            what = "fn" if i == 0 else f"argument {i} ({type(piece).__name__})"
            raise TypeError(f"{what} cannot be sent to the ranks: {e}") from e
    return cloudpickle.dumps((fn, tuple(args)))


class _Rank:
    """The caller's handle on one rank process: its connection, output and stack file."""

    def __init__(self, rank: int, boot: dict, env: dict):
        here, there = socket.socketpair()
        env = dict(env, LLMLAB_WORKER_FD=str(there.fileno()))
        self.rank = rank
        self.output = deque(maxlen=40)
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "llmlab.dist._worker"], env=env, pass_fds=[there.fileno()],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        there.close()
        self.conn = Connection(here.detach())
        self.conn.send(boot)
        self.stack_file = boot["stack_file"]
        self._reader = threading.Thread(target=self._forward_output, daemon=True, name=f"rank{rank}-out")
        self._reader.start()

    def _forward_output(self):
        """Print the rank's stdout/stderr in the caller (a notebook cell shows it), prefixed by its rank."""
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.output.append(line)
            print(f"[rank {self.rank}] {line}", file=sys.stdout, flush=True)

    def tail(self) -> str:
        self._reader.join(timeout=1.0)
        return "\n".join(self.output)

    def returncode(self, wait_s: float = 2.0):
        try:
            return self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None

    def dump_stack(self) -> str:
        """Ask the rank (via SIGUSR1 → faulthandler) where its Python threads are, and read the answer."""
        if self.proc.poll() is not None:
            return f"(process already ended with code {self.proc.returncode})"
        size0 = os.path.getsize(self.stack_file)
        self.proc.send_signal(signal.SIGUSR1)
        deadline, last = time.monotonic() + _STACK_WAIT_S, -1
        while time.monotonic() < deadline:
            time.sleep(0.05)
            size = os.path.getsize(self.stack_file)
            if size > size0 and size == last:  # written and no longer growing
                break
            last = size
        with open(self.stack_file) as f:
            f.seek(size0)
            return f.read().rstrip() or "(no stack written)"

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.conn.close()
        self._reader.join(timeout=1.0)


def _stop(ranks: list[_Rank], polite: bool) -> None:
    """End every rank and reap it: ask them to close first when `polite`, kill what remains."""
    if polite:
        for r in ranks:
            try:
                r.conn.send(("close",))
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        for r in ranks:
            r.returncode(max(0.0, deadline - time.monotonic()))
    for r in ranks:
        r.kill()


class Cluster:
    """`world_size` ranks that stay alive between calls (`run`), so a notebook pays process start once.

    Use as a context manager, or call `close()`; ranks are also stopped when the Cluster is garbage
    collected or the interpreter exits. The ranks inherit this process's environment, plus `env` (e.g.
    ``{"NCCL_DEBUG": "INFO"}`` or ``{"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}``), read when they start.
    """

    def __init__(self, world_size: int, *, backend: str | None = None, start_timeout: float = 120.0,
                 threads_per_rank: int | None = None, env: dict[str, str] | None = None):
        self.world_size = validation.integer("world_size", world_size, low=1)
        self.env = _check_env(env)
        self.backend = backend or runtime.backend(world_size)
        validation.one_of("backend", self.backend, ("gloo", "nccl"))
        self.start_timeout = float(validation.positive("start_timeout", start_timeout, hint="(seconds)"))
        self.threads_per_rank = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        self._ranks: list[_Rank] = []
        self._store = None
        self._tmp = None
        self._finalizer = None

    # -- lifecycle ---------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self._ranks) and all(r.proc.poll() is None for r in self._ranks)

    def start(self) -> Cluster:
        """Start the ranks and wait until every one has joined the process group."""
        if self.alive:
            return self
        self.close()

        import torch.distributed as td  # on the ranks only: `import llmlab.dist` stays light in the parent

        self._store = td.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=self.start_timeout),
                                  wait_for_workers=False)
        self._tmp = tempfile.TemporaryDirectory(prefix="llmlab-cluster-")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(self.threads_per_rank), **self.env}
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this machine
        sys_path = [p or os.getcwd() for p in sys.path]
        main_thread = threading.current_thread() is threading.main_thread()
        for rank in range(self.world_size):
            boot = dict(rank=rank, world_size=self.world_size, store_port=self._store.port,
                        backend=self.backend, sys_path=sys_path, threads=self.threads_per_rank,
                        stack_file=os.path.join(self._tmp.name, f"stack-{rank}.txt"),
                        start_timeout=self.start_timeout, pg_timeout=1800.0,
                        parent_pid=os.getpid(), die_with_parent=main_thread)
            open(boot["stack_file"], "w").close()
            self._ranks.append(_Rank(rank, boot, env))
        self._finalizer = weakref.finalize(self, _stop, list(self._ranks), False)
        try:
            self._await_ready()
        except BaseException:
            self.close(polite=False)
            raise
        return self

    def _await_ready(self):
        pending = {r.conn: r for r in self._ranks}
        deadline = time.monotonic() + self.start_timeout
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"{_ranks(r.rank for r in pending.values())} did not join the process group within "
                                   f"start_timeout={self.start_timeout:g}s")
            for conn in ready:
                r = pending.pop(conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    raise RankCrashed(r.rank, self.world_size, r.returncode(), r.tail(),
                                      note="(while joining the process group)") from None
                if msg[0] == "failed":
                    raise RankError(r.rank, self.world_size, "StartupError",
                                    "could not join the process group", msg[1])

    def close(self, polite: bool = True) -> None:
        """Stop every rank (no process is left behind) and release the store."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        _stop(self._ranks, polite)
        self._ranks = []
        self._store = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def pids(self) -> list[int]:
        return [r.proc.pid for r in self._ranks]

    # -- calls -------------------------------------------------------------------------------------------
    def run(self, fn, *args, timeout: float = 60.0) -> list:
        """Run `fn(*args)` on every rank; return the per-rank results in rank order."""
        timeout = float(validation.positive("timeout", timeout, hint="(seconds)"))
        payload = _pack(fn, args)
        if not self.alive:
            self.start()
        for r in self._ranks:
            r.conn.send(("run", payload))
        try:
            return self._collect(timeout)
        except BaseException:
            if not self.alive or isinstance(sys.exc_info()[1], KeyboardInterrupt):
                self.close(polite=False)
            raise

    def _collect(self, timeout: float) -> list:
        n = self.world_size
        results, failed = [None] * n, {}  # failed: rank -> a function building its error from a note
        pending = {r.conn: r for r in self._ranks}
        deadline = time.monotonic() + timeout
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                r = pending.pop(conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    code, tail = r.returncode(), r.tail()
                    failed[r.rank] = lambda note, r=r, c=code, t=tail: RankCrashed(r.rank, n, c, t, note)
                    continue
                if msg[0] == "ok":
                    results[r.rank] = pickle.loads(msg[1])
                    continue
                _, payload, exc_type, message, tb = msg
                exc = pickle.loads(payload) if payload is not None else None
                failed[r.rank] = lambda note, r=r, t=exc_type, m=message, tb=tb, e=exc: RankError(
                    r.rank, n, t, m, tb, exception=e, note=note)
            if failed:  # give the other ranks a moment: they may be blocked on the failed one
                deadline = min(deadline, time.monotonic() + _GRACE_S)
        if not pending and not failed:
            return results
        notes = []
        if pending:
            stacks = "\n\n".join(f"--- rank {r.rank} ---\n{r.dump_stack()}" for r in self._ranks
                                 if r.proc.poll() is None)
            self.close(polite=False)
            notes.append(f"{_ranks(r.rank for r in pending.values())} of {n} had not finished"
                         + ("" if failed else f" within timeout={timeout:g}s")
                         + "; the cluster's ranks were stopped and its next run() starts new ones"
                         + f"\n\nwhere every rank was:\n{stacks}")
        if not failed:
            raise TimeoutError("\n".join(notes))
        first, *others = sorted(failed)
        if others:
            notes.insert(0, f"{_ranks(others)} failed too")
        err = failed[first]("\n".join(notes))
        raise err from err.exception


def spawn(fn, world_size: int, *args, timeout: float = 60.0, backend: str | None = None,
          start_timeout: float = 120.0, env: dict[str, str] | None = None) -> list:
    """Start `world_size` ranks, run `fn(*args)` on each, stop them; return the results in rank order.

    `timeout` bounds the call itself (not process start-up, which `start_timeout` bounds); `env` adds
    environment variables for the ranks (see `Cluster`).
    """
    cluster = Cluster(world_size, backend=backend, start_timeout=start_timeout, env=env)
    try:
        return cluster.run(fn, *args, timeout=timeout)  # checks fn and args before starting any rank
    finally:
        cluster.close()
