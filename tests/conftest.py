"""Fixtures the test modules share."""

import pytest
import torch


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
