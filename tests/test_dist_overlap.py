"""Overlap of all-reduce with compute: same results as serial, well-formed timelines. Speed is reported by the
chapter and the bench, never asserted here."""

import matplotlib
import pytest
import torch

from llmlab import dist
from llmlab.dist import overlap

matplotlib.use("Agg")
SMALL = dict(n_layers=4, dim=128, batch=16, keep_grads=True)


@pytest.fixture(scope="module")
def cluster():
    with dist.Cluster(2) as c:
        yield c


@pytest.fixture(scope="module")
def runs(cluster):
    return {comm: overlap.compare(cluster, comm=comm, **SMALL) for comm in overlap.COMMS}


@pytest.mark.parametrize("comm", overlap.COMMS)
def test_async_gives_the_serial_results(runs, comm):
    serial, overlapped = runs[comm]["serial"], runs[comm]["async"]
    for s, a in zip(serial, overlapped, strict=True):
        assert len(s.grads) == len(a.grads) == SMALL["n_layers"]
        # the same all-reduce of the same tensors: bitwise equal (with 2 ranks, even torch's vs the ring's)
        assert all(torch.equal(x, y) for x, y in zip(s.grads, a.grads, strict=True))
        assert all(torch.equal(x, y) for x, y in zip(s.grads, runs["torch"]["serial"][s.rank].grads, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(serial[0].grads, serial[1].grads, strict=True))


@pytest.mark.parametrize("comm", overlap.COMMS)
@pytest.mark.parametrize("mode", overlap.MODES)
def test_timelines_are_well_formed(runs, comm, mode):
    timelines = runs[comm][mode]
    assert [t.rank for t in timelines] == [0, 1]
    for t in timelines:
        assert (t.mode, t.comm) == (mode, comm)
        compute = sorted((s for s in t.spans if s.kind == "compute"), key=lambda s: s.layer)
        comm_spans = sorted((s for s in t.spans if s.kind == "comm"), key=lambda s: s.layer)
        assert [s.layer for s in compute] == [s.layer for s in comm_spans] == list(range(SMALL["n_layers"]))
        assert all(0 <= s.start <= s.end <= t.total for s in t.spans)
        for c, a in zip(compute, comm_spans, strict=True):
            assert a.start >= c.end  # a gradient is reduced only once it exists
        for earlier, later in zip(compute, compute[1:], strict=False):
            assert later.start >= earlier.end  # one layer after the other
        if mode == "serial":  # serial: the next layer waits for this layer's all-reduce
            for a, c in zip(comm_spans, compute[1:], strict=False):
                assert c.start >= a.end


def test_plot_has_a_row_per_rank(runs):
    ax = overlap.plot_timeline(runs["torch"]["async"])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert len(ax.collections) == 4  # compute and comm bars for each rank
    assert "async (torch)" in ax.get_title()


@pytest.mark.parametrize("kwargs,match", [(dict(mode="overlapped"), "mode="), (dict(comm="nccl"), "comm="),
                                          (dict(dim=0), "dim="), (dict(n_layers=2.5), "n_layers=")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        overlap.run_layers(**kwargs)
