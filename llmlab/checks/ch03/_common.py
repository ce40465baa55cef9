"""What chapter 3's checks share: the world sizes 3.1 runs on, its time limit on the ranks, and the one
`llmlab.dist.Cluster` those ranks belong to (started by the first check that needs it, stopped by `close()`)."""

from __future__ import annotations

from llmlab import checks

WORLD_SIZES = (1, 2, 3, 4)
# one world's call on the ranks: a right answer takes well under a second there, so a call still running after
# this long waits in a collective that not every rank of the group calls (the check says so)
TIMEOUT_S = 15.0

close = checks.close_clusters  # stop the checks' ranks now (they also stop at interpreter exit)


def cluster():
    """The gloo cluster of max(WORLD_SIZES) ranks; smaller worlds run on its subgroups."""
    return checks.cluster(max(WORLD_SIZES))
