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

Failures come back to the caller, never as a hang (the classes are in `failures`):
- an exception on a rank is raised as `RankError` carrying the rank, the original exception and its traceback;
- a rank whose process dies (exits, or is killed: SIGKILL is the out-of-memory killer's signal) is raised as
  `RankCrashed` naming it, even when its peers then fail with "Connection reset by peer": after the first failure
  the caller waits a short grace for the others and reports the root cause first (`failures.root_cause`);
- a call that does not finish within `timeout` seconds raises `TimeoutError`, and with `stall_timeout=T` a rank that
  neither returns nor calls `dist.heartbeat()` for T seconds raises `RankHang` (a TimeoutError); both show every
  rank's Python stack at that moment (faulthandler, so a rank blocked inside a C call such as gloo's recv shows it).
After a failure that leaves ranks stuck, the cluster stops them; its next `run` starts fresh ranks.

No process or file is left behind: each rank leads its own process group, and stopping a rank SIGKILLs the group,
so processes the rank started go with it (a child that leaves the group with setsid() or setpgid() is not
followed); a rank kills its group when the caller's end of its socket closes, so a caller that dies — even by
SIGKILL, even when a Cluster was started from another thread — takes its ranks along; the ranks' stack and progress
files are unlinked temporary files shared by descriptor, so nothing is left on disk after a kill.
"""

from __future__ import annotations

import math
import os
import pickle
import sys
import time
import weakref
from datetime import timedelta
from multiprocessing.connection import wait

from llmlab import runtime, validation
from llmlab.dist import progress
from llmlab.dist.failures import RankCrashed, RankError, RankHang, is_connection_error, root_cause
from llmlab.dist.processes import RankProcess, stop

__all__ = ["Cluster", "spawn", "RankError", "RankCrashed", "RankHang"]

_GRACE_S = 3.0  # how long the other ranks get to finish after one rank failed
_TICK_S = 0.25  # how often a waiting caller looks at the ranks' processes and progress counters


def _seconds(name: str, value) -> float | None:
    """A time limit: None (no limit) or a positive number of seconds."""
    return None if value is None else float(validation.positive(name, value, hint="(seconds, or None: no limit)"))


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
        self._ranks: list[RankProcess] = []
        self._store = None
        self._progress: progress.Counters | None = None
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
        self._progress = progress.Counters(self.world_size)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(self.threads_per_rank), **self.env}
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this machine
        boot = dict(world_size=self.world_size, store_port=self._store.port, backend=self.backend,
                    sys_path=[p or os.getcwd() for p in sys.path], threads=self.threads_per_rank,
                    progress_fd=self._progress.fd, start_timeout=self.start_timeout, pg_timeout=1800.0)
        for rank in range(self.world_size):
            self._ranks.append(RankProcess(rank, boot, env))
        self._finalizer = weakref.finalize(self, stop, list(self._ranks), False)
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
        """Stop every rank and the processes it started (none is left behind) and release the store."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        stop(self._ranks, polite)
        self._ranks = []
        self._store = None
        if self._progress is not None:
            self._progress.close()
            self._progress = None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def pids(self) -> list[int]:
        return [r.proc.pid for r in self._ranks]

    # -- calls -------------------------------------------------------------------------------------------
    def run(self, fn, *args, timeout: float | None = 60.0, stall_timeout: float | None = None) -> list:
        """Run `fn(*args)` on every rank; return the per-rank results in rank order.

        `timeout` limits the length of the call (TimeoutError), `stall_timeout` the time a rank may go without
        returning or calling `dist.heartbeat()` (RankHang), counted from the call's start or the rank's last
        heartbeat; None means no limit. Either way the error shows every rank's stack and the ranks are stopped.
        """
        timeout, stall_timeout = _seconds("timeout", timeout), _seconds("stall_timeout", stall_timeout)
        payload = _pack(fn, args)
        if not self.alive:
            self.start()
        for r in self._ranks:
            r.conn.send(("run", payload))
        try:
            return self._collect(timeout, stall_timeout)
        except BaseException:
            if not self.alive or isinstance(sys.exc_info()[1], KeyboardInterrupt):
                self.close(polite=False)
            raise

    def _collect(self, timeout: float | None, stall_timeout: float | None) -> list:
        n = self.world_size
        results, failed = [None] * n, {}  # failed: rank -> its RankError (or RankCrashed)
        pending = {r.conn: r for r in self._ranks}
        start = time.monotonic()
        deadline = math.inf if timeout is None else start + timeout
        tick = _TICK_S if stall_timeout is None else min(_TICK_S, stall_timeout / 4)
        counts, moved, stalled = self._progress.read(), [start] * n, []  # moved: when each counter last changed
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            if stall_timeout is not None and not failed:
                counts, moved = self._progress_since(counts, moved, now)
                stalled = sorted(r.rank for r in pending.values() if now - moved[r.rank] >= stall_timeout)
                if stalled:
                    break
            for conn in wait(list(pending), timeout=min(tick, deadline - now)):
                r = pending.pop(conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    failed[r.rank] = r.crashed(n)
                    continue
                if msg[0] == "ok":
                    results[r.rank] = pickle.loads(msg[1])
                    continue
                _, payload, exc_type, message, tb = msg
                exc = pickle.loads(payload) if payload is not None else None
                failed[r.rank] = RankError(r.rank, n, exc_type, message, tb, exception=exc)
            for conn, r in list(pending.items()):  # died, but a process it started still holds its connection
                if r.proc.poll() is not None and not conn.poll():
                    del pending[conn]
                    failed[r.rank] = r.crashed(n)
            if failed:  # give the other ranks a moment: they may be blocked on the failed one, or dying too
                deadline = min(deadline, time.monotonic() + _GRACE_S)
        if not pending and not failed:
            return results
        notes, stacks = [], {}
        if pending:
            stacks = {r.rank: r.dump_stack() for r in self._ranks if r.proc.poll() is None}
            self.close(polite=False)
            where = "\n\n".join(f"--- rank {rank} ---\n{stack}" for rank, stack in stacks.items())
            notes.append(f"{_ranks(r.rank for r in pending.values())} of {n} had not finished"
                         + ("" if failed or stalled else f" within timeout={timeout:g}s")
                         + "; the cluster's ranks were stopped and its next run() starts new ones"
                         + f"\n\nwhere every rank was:\n{where}")
        if stalled:
            raise RankHang(stalled, n, stall_timeout, stacks, "\n".join(notes))
        if not failed:
            raise TimeoutError("\n".join(notes))
        first, *others = root_cause(failed)
        if others:
            lost = all(is_connection_error(failed[rank]) for rank in others)
            notes.insert(0, f"{_ranks(others)} failed too" + (" (lost connections: a consequence)" if lost else ""))
        err = failed[first]
        err.note = "\n".join(notes)
        raise err from err.exception

    def _progress_since(self, counts: list[int], moved: list[float], now: float):
        """The ranks' heartbeat counters now, and when each last changed (`now` for those that moved)."""
        latest = self._progress.read()
        return latest, [now if c != was else t for c, was, t in zip(latest, counts, moved, strict=True)]


def spawn(fn, world_size: int, *args, timeout: float | None = 60.0, stall_timeout: float | None = None,
          backend: str | None = None, start_timeout: float = 120.0, env: dict[str, str] | None = None) -> list:
    """Start `world_size` ranks, run `fn(*args)` on each, stop them; return the results in rank order.

    `timeout` bounds the call itself (not process start-up, which `start_timeout` bounds; None: no limit);
    `stall_timeout=T` raises RankHang when a rank neither returns nor calls `dist.heartbeat()` for T seconds
    (see `Cluster.run`); `env` adds environment variables for the ranks (see `Cluster`).
    """
    cluster = Cluster(world_size, backend=backend, start_timeout=start_timeout, env=env)
    try:  # run() checks fn, args and the time limits before starting any rank
        return cluster.run(fn, *args, timeout=timeout, stall_timeout=stall_timeout)
    finally:
        cluster.close()
