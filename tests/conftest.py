"""Fixtures the test modules share."""

import pytest
import torch

from llmlab import dist


@pytest.fixture
def one_thread():
    """Run torch on one thread for the test, then restore the setting.

    Tiny matmuls gain little from a second thread, and when other processes share the 2 cores (notebooks,
    rank processes, other tests) OpenMP's spinning threads made small training tests 2-5× slower (measured:
    4 s on one thread vs 8-20 s on two).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def clusters():
    """`clusters(n)`: a live gloo `dist.Cluster(n)`, shared by every test module that asks for n ranks.

    Starting ranks costs seconds (each imports torch); one cluster per world size for the whole run pays that
    once instead of once per module. A test that breaks its cluster (a timeout kills the ranks) leaves it to
    start fresh ranks on its next call, as `Cluster.run` does.
    """
    live: dict[int, dist.Cluster] = {}

    def of(world_size: int) -> dist.Cluster:
        if world_size not in live:
            live[world_size] = dist.Cluster(world_size).start()
        return live[world_size]

    yield of
    for cluster in live.values():
        cluster.close()
