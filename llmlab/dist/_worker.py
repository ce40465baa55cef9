"""One rank of a `llmlab.dist.Cluster`: joins the process group, then runs the functions it is sent.

Started by the launcher as `python -u -m llmlab.dist._worker` with one end of a private socket pair in
LLMLAB_WORKER_FD; never run by hand. The protocol, over a multiprocessing Connection:

    parent → worker   {"rank", "world_size", "store_port", "backend", "sys_path", "stack_file", ...}
    worker → parent   ("ready", pid)               or ("failed", traceback) when joining failed
    parent → worker   ("run", cloudpickled (fn, args))
    worker → parent   ("ok", cloudpickled result)  or ("err", pickled exception or None, type, message, tb)
    parent → worker   ("close",)
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

import cloudpickle


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this rank when the launcher dies, even while it is stuck in a C call."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _join(boot: dict):
    """Set the torch.distributed environment of this rank and join the group on the parent's store."""
    rank, world_size = boot["rank"], boot["world_size"]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(boot["store_port"]))
    import torch  # after the rank's environment is set (device, backend)
    import torch.distributed as dist  # after the rank's environment is set (device, backend)

    torch.set_num_threads(boot["threads"])
    if boot["backend"] == "nccl":
        torch.cuda.set_device(rank)
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
    boot = conn.recv()
    if boot["die_with_parent"]:
        _die_with_parent(boot["parent_pid"])
    sys.path[:0] = [p for p in boot["sys_path"] if p not in sys.path]
    stack_file = open(boot["stack_file"], "w")  # noqa: SIM115 - kept open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
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
