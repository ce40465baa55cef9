"""One rank of a `llmlab.dist.Cluster`: joins the process group, then runs the functions it is sent.

Started by the launcher as `python -u -m llmlab.dist._worker` with one end of a private socket pair in
LLMLAB_WORKER_FD, as the leader of its own session and process group; never run by hand. The protocol, over a
multiprocessing Connection:

    parent → worker   {"rank", "world_size", "store_port", "backend", "sys_path", "stack_fd", "progress_fd", ...}
    worker → parent   ("ready", pid)               or ("failed", traceback) when joining failed
    parent → worker   ("run", cloudpickled (fn, args))
    worker → parent   ("ok", cloudpickled result)  or ("err", pickled exception or None, type, message, tb)
    parent → worker   ("close",)

When the caller dies (even by SIGKILL, whichever of its threads started the rank), its end of the socket closes:
a watcher thread sees the hang-up and SIGKILLs this rank's process group — the rank and every process it started
that stayed in its group. (PR_SET_PDEATHSIG would fire when the *thread* that started the rank ends, and would kill
the rank alone, orphaning its children.) The rank's stack file and progress counters are unlinked files the caller
passes as descriptors, so nothing is left on disk.
"""

from __future__ import annotations

import faulthandler
import os
import select
import signal
import sys
import threading
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

import cloudpickle

from llmlab.dist import progress


def _exit_with_caller(conn: Connection) -> None:
    """SIGKILL this rank's process group (itself and its children) as soon as the caller's end of `conn` closes."""
    def watch():
        hangup = select.poll()
        hangup.register(conn.fileno(), getattr(select, "POLLRDHUP", 0))  # POLLHUP and POLLERR come regardless
        hangup.poll()
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="exit-with-caller").start()


def _join(boot: dict):
    """Set the torch.distributed environment of this rank and join the group on the parent's store."""
    rank, world_size = boot["rank"], boot["world_size"]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(boot["store_port"]))
    import torch  # after the rank's environment is set (device, backend)
    import torch.distributed as dist  # after the rank's environment is set (device, backend)

    from llmlab import runtime  # after the rank's environment is set (device, backend)

    torch.set_num_threads(boot["threads"])
    if boot["backend"] == "nccl":
        runtime.set_device(rank)
    else:
        os.environ["LLMLAB_RANK_DEVICE"] = "cpu"
    store = dist.TCPStore("127.0.0.1", boot["store_port"], is_master=False,
                          timeout=timedelta(seconds=boot["start_timeout"]))
    dist.init_process_group(boot["backend"], store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=boot["pg_timeout"]))
    return dist


def _error_message(exc: BaseException):
    try:
        payload = cloudpickle.dumps(exc)
        cloudpickle.loads(payload)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        payload = None
    return ("err", payload, type(exc).__name__, str(exc), traceback.format_exc())


def main() -> None:
    conn = Connection(int(os.environ["LLMLAB_WORKER_FD"]))
    _exit_with_caller(conn)
    boot = conn.recv()
    sys.path[:0] = [p for p in boot["sys_path"] if p not in sys.path]
    faulthandler.register(signal.SIGUSR1, file=boot["stack_fd"], all_threads=True)
    progress.attach(boot["progress_fd"], boot["rank"])
    try:
        dist = _join(boot)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the launcher went away
            break
        if msg[0] == "close":
            break
        try:
            fn, args = cloudpickle.loads(msg[1])
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            reply = _error_message(exc)
        else:
            try:
                reply = ("ok", cloudpickle.dumps(result))
            except Exception as exc:
                reply = _error_message(TypeError(
                    f"the result of the function on rank {boot['rank']} ({type(result).__name__}) "
                    f"cannot be sent back to the caller: {exc}"))
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(reply)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
