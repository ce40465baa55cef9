"""Multi-rank llmlab: a launcher for real torch.distributed ranks (see `launcher`), and joining torchrun.

    from llmlab import dist
    dist.spawn(fn, 4)                  # run fn on 4 fresh ranks, get 4 results
    with dist.Cluster(4) as c:         # ranks kept alive between calls
        c.run(fn)
    dist.init_from_env()               # inside a script started by torchrun

On the ranks: the process grid (`Grid(dp=, tp=, pp=)`, built once on every rank: this rank's coordinates and
its data-, tensor- and pipeline-parallel groups), collectives built from point-to-point messages (`collectives`:
ring_all_reduce, tree_all_reduce, ring_reduce_scatter, ring_all_gather, tree_broadcast, all_to_all), a log of the
bytes they move (`CommLog`), their α-β cost model (`cost`) and overlap of communication with computation
(`overlap`). Those load torch, so they are imported on first use: `import llmlab.dist` stays cheap.
"""

import importlib

from llmlab.dist.launcher import Cluster, RankCrashed, RankError, spawn
from llmlab.dist.torchrun import init_from_env

_LAZY = {name: "llmlab.dist.collectives" for name in ("ring_all_reduce", "tree_all_reduce", "ring_reduce_scatter",
                                                       "ring_all_gather", "tree_broadcast", "all_to_all",
                                                       "chunk_sizes")}
_LAZY["CommLog"] = "llmlab.dist.commlog"
_LAZY["Grid"] = "llmlab.dist.grid"

__all__ = ["Cluster", "RankCrashed", "RankError", "spawn", "init_from_env", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llmlab.dist' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
