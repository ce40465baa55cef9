"""Multi-rank llmlab: a launcher for real torch.distributed ranks (see `launcher`), and joining torchrun.

    from llmlab import dist
    dist.spawn(fn, 4)                  # run fn on 4 fresh ranks, get 4 results
    with dist.Cluster(4) as c:         # ranks kept alive between calls
        c.run(fn)
    dist.spawn(train, 4, timeout=None, stall_timeout=600)   # no limit on length; RankHang if a rank stalls
    dist.heartbeat()                   # on a rank, after each step (a no-op elsewhere)
    dist.init_from_env()               # inside a script started by torchrun

Failures name their rank: `RankError` (an exception), `RankCrashed` (a dead process, even when its peers then lose
their connections), `RankHang` (no heartbeat for stall_timeout), each with a one-line `headline`.

On the ranks: the process grid (`Grid(dp=, tp=, pp=)`, built once on every rank: this rank's coordinates and
its data-, tensor- and pipeline-parallel groups), collectives built from point-to-point messages (`collectives`:
ring_all_reduce, tree_all_reduce, ring_reduce_scatter, ring_all_gather, tree_broadcast, all_to_all), a log of the
bytes they move (`CommLog`), their α-β cost model (`cost`) and overlap of communication with computation
(`overlap`). Those load torch, so they are imported on first use: `import llmlab.dist` stays cheap.
"""

import importlib

from llmlab.dist.failures import RankCrashed, RankError, RankHang
from llmlab.dist.launcher import Cluster, spawn
from llmlab.dist.progress import heartbeat
from llmlab.dist.torchrun import init_from_env

_LAZY = {name: "llmlab.dist.collectives" for name in ("ring_all_reduce", "tree_all_reduce", "ring_reduce_scatter",
                                                       "ring_all_gather", "tree_broadcast", "all_to_all",
                                                       "chunk_sizes")}
_LAZY["CommLog"] = "llmlab.dist.commlog"
_LAZY["Grid"] = "llmlab.dist.grid"

__all__ = ["Cluster", "RankCrashed", "RankError", "RankHang", "spawn", "heartbeat", "init_from_env", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llmlab.dist' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
