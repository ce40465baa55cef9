"""Join the process group of a script started by `torchrun` (or any launcher that sets the env:// variables).

    # train.py
    from llmlab import dist
    rank, world_size = dist.init_from_env()

    torchrun --standalone --nproc-per-node 4 train.py           # one node
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
             --rdzv-endpoint HOST:29500 train.py                  # two nodes
"""

from __future__ import annotations

import os

from llmlab import runtime

_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Initialise torch.distributed from RANK/WORLD_SIZE/... and return (rank, world_size).

    The backend is NCCL when this node has a GPU for each of its ranks (LOCAL_WORLD_SIZE), else gloo;
    under NCCL each rank uses cuda:LOCAL_RANK. Calling it again in the same process returns the same pair.
    """
    import torch  # torch loads in seconds: `import llmlab.dist` stays light
    import torch.distributed as td  # torch loads in seconds: `import llmlab.dist` stays light

    if td.is_initialized():
        return td.get_rank(), td.get_world_size()
    missing = [k for k in _REQUIRED if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env: {', '.join(missing)} not set: this process was not started by "
                           "torchrun (try `torchrun --standalone --nproc-per-node 2 script.py`, or use "
                           "llmlab.dist.spawn from a notebook)")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    backend = backend or runtime.backend(local_world)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        os.environ["LLMLAB_RANK_DEVICE"] = "cpu"
    td.init_process_group(backend)
    return td.get_rank(), td.get_world_size()
