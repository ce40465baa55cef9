"""Multi-rank llmlab: a launcher for real torch.distributed ranks (see `launcher`), and joining torchrun.

    from llmlab import dist
    dist.spawn(fn, 4)                  # run fn on 4 fresh ranks, get 4 results
    with dist.Cluster(4) as c:         # ranks kept alive between calls
        c.run(fn)
    dist.init_from_env()               # inside a script started by torchrun
"""

from llmlab.dist.launcher import Cluster, RankCrashed, RankError, spawn
from llmlab.dist.torchrun import init_from_env

__all__ = ["Cluster", "RankCrashed", "RankError", "spawn", "init_from_env"]
