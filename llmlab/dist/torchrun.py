"""Join the process group of a script started by `torchrun` (or any launcher that sets the env:// variables).

    # train.py
    from llmlab import dist
    rank, world_size = dist.init_from_env()           # waits at most 60 s for every rank (LLMLAB_INIT_TIMEOUT)

    torchrun --standalone --nproc-per-node 4 train.py           # one node
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
             --rdzv-endpoint HOST:29500 train.py                  # two nodes

The rendezvous is torch's env:// one (a TCPStore at MASTER_ADDR:MASTER_PORT, hosted by torchrun's agent or else by
rank 0), plus a check-in: every rank writes its number into the store and waits for all WORLD_SIZE of them, so a
missing peer ends in a one-line TimeoutError naming the ranks that never came and the address, not in a silent
wait of torch's 30 minutes.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

from llmlab import runtime, validation

__all__ = ["init_from_env"]

_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_DEFAULT_TIMEOUT_S = 60.0
_SHOWN = 8  # missing ranks named in the error; more are counted


def _int_env(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"init_from_env: {name}={value!r} must be an integer") from None


def _timeout(timeout) -> float:
    name = "timeout"
    if timeout is None:
        name, timeout = "LLMLAB_INIT_TIMEOUT", os.environ.get("LLMLAB_INIT_TIMEOUT", _DEFAULT_TIMEOUT_S)
        try:
            timeout = float(timeout)
        except ValueError:
            pass  # named below
    return float(validation.positive(name, timeout, hint="(seconds)"))


def _check_in(rank: int, world_size: int, timeout: float):
    """Reach the rendezvous store, write this rank's check-in and wait for every rank's; the store, or TimeoutError."""
    import torch.distributed as td  # torch loads in seconds: `import llmlab.dist` stays light

    addr, port = os.environ["MASTER_ADDR"], _int_env("MASTER_PORT")
    where, deadline = f"{addr}:{port}", time.monotonic() + timeout
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
    host = rank == 0 and not agent
    try:  # as torch's env:// does, without waiting for the other ranks inside the constructor
        store = td.TCPStore(addr, port, world_size, is_master=host, timeout=timedelta(seconds=timeout),
                            wait_for_workers=False, multi_tenant=host)
    except RuntimeError as e:  # DistNetworkError, DistStoreError
        if host:
            raise RuntimeError(f"init_from_env: rank 0 could not host the rendezvous store on {where}: "
                               f"{str(e).strip().splitlines()[0]}") from None
        raise TimeoutError(f"init_from_env: rank {rank} could not reach the rendezvous store at {where} within "
                           f"{timeout:g}s (WORLD_SIZE={world_size}; {'torchrun' if agent else 'rank 0'} hosts it: "
                           "is it running, and is the address right?)") from None
    keys = [f"llmlab/init_from_env/{r}" for r in range(world_size)]
    store.set(keys[rank], "joined")
    try:
        store.wait(keys, timedelta(seconds=max(0.001, deadline - time.monotonic())))
    except RuntimeError:  # DistStoreError: timed out
        try:
            missing = [r for r in range(world_size) if not store.check([keys[r]])]
        except RuntimeError:  # the store's host went away meanwhile
            missing = []
        named = ", ".join(map(str, missing[:_SHOWN])) + (f", … ({len(missing)} in all)" if len(missing) > _SHOWN
                                                          else "")
        who = (f"{'rank' if len(missing) == 1 else 'ranks'} {named} did not join"
               if missing else "not every rank joined")
        raise TimeoutError(f"init_from_env: rank {rank} waited {timeout:g}s at the rendezvous {where}: {who} "
                           f"(expected WORLD_SIZE={world_size}, {world_size - len(missing)} joined)") from None
    store.set_timeout(td.constants.default_pg_timeout)  # later store waits are torch's, as under env://
    return store


def init_from_env(backend: str | None = None, timeout: float | None = None) -> tuple[int, int]:
    """Initialise torch.distributed from RANK/WORLD_SIZE/... and return (rank, world_size).

    The backend is NCCL when this node has a GPU for each of its ranks (LOCAL_WORLD_SIZE), else gloo;
    under NCCL each rank uses cuda:LOCAL_RANK. Calling it again in the same process returns the same pair.
    `timeout` (seconds; default LLMLAB_INIT_TIMEOUT, else 60) bounds the wait for every rank to reach the
    rendezvous: past it, a TimeoutError names the ranks that did not join and MASTER_ADDR:MASTER_PORT.
    """
    import torch.distributed as td  # torch loads in seconds: `import llmlab.dist` stays light

    if td.is_initialized():
        return td.get_rank(), td.get_world_size()
    missing = [k for k in _REQUIRED if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env: {', '.join(missing)} not set: this process was not started by "
                           "torchrun (try `torchrun --standalone --nproc-per-node 2 script.py`, or use "
                           "llmlab.dist.spawn from a notebook)")
    timeout = _timeout(timeout)
    rank, world_size = _int_env("RANK"), _int_env("WORLD_SIZE")
    if not 0 <= rank < world_size:
        raise ValueError(f"init_from_env: RANK={rank} must be in [0, WORLD_SIZE={world_size})")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = backend or runtime.backend(local_world)
    if backend == "nccl":
        runtime.set_device(_int_env("LOCAL_RANK"))
    else:
        os.environ["LLMLAB_RANK_DEVICE"] = "cpu"
    store = _check_in(rank, world_size, timeout)
    td.init_process_group(backend, store=td.PrefixStore("default_pg", store), rank=rank, world_size=world_size)
    return td.get_rank(), td.get_world_size()
