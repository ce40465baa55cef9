"""Overlap of all-reduce with compute: same results as serial, well-formed timelines. Speed is reported by the
chapter and the bench, never asserted here."""

import pytest
import torch

from llmlab import timing
from llmlab.dist import overlap
from llmlab.timeline import Timeline

SMALL = dict(n_layers=4, dim=128, batch=16, keep_grads=True)


@pytest.fixture(scope="module")
def cluster(clusters):
    return clusters(2)


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
    ranks = runs[comm][mode]
    assert [r.rank for r in ranks] == [0, 1]
    for r in ranks:
        assert (r.mode, r.comm) == (mode, comm)
        assert r.timeline.lanes == (r.rank,) and r.timeline.lane_name == "rank"
        compute = sorted((s for s in r.timeline.spans if s.kind == "compute"), key=lambda s: s.item)
        comm_spans = sorted((s for s in r.timeline.spans if s.kind == "comm"), key=lambda s: s.item)
        assert [s.item for s in compute] == [s.item for s in comm_spans] == list(range(SMALL["n_layers"]))
        assert all(0 <= s.start <= s.end <= r.total for s in r.timeline.spans)
        for c, a in zip(compute, comm_spans, strict=True):
            assert a.start >= c.end  # a gradient is reduced only once it exists
        for earlier, later in zip(compute, compute[1:], strict=False):
            assert later.start >= earlier.end  # one layer after the other
        if mode == "serial":  # serial: the next layer waits for this layer's all-reduce
            for a, c in zip(comm_spans, compute[1:], strict=False):
                assert c.start >= a.end


def test_the_ranks_timelines_merge_into_one(runs):
    merged = Timeline.merge(r.timeline for r in runs["torch"]["async"])
    assert merged.lanes == (0, 1) and merged.kinds == ("compute", "comm")
    assert len(merged.spans) == 2 * 2 * SMALL["n_layers"]  # a compute and a comm span per layer on each rank
    assert merged.end <= max(r.total for r in runs["torch"]["async"])


def test_rounds_make_timings_a_comparison_and_a_typical_round(runs):
    for result in runs.values():
        assert set(result.timings) == set(overlap.MODES)
        assert all(len(t.samples) == 5 and t.load is not None for t in result.timings.values())
        assert result.comparison().ratios == tuple(
            a / s for a, s in zip(result.timings["async"].samples, result.timings["serial"].samples, strict=True))


def test_the_typical_round_is_the_one_nearest_the_median():
    ranks = [[overlap.RankRun(0, "serial", "torch", t, None)] for t in (3.0, 1.0, 2.2)]
    result = overlap.Overlap({"serial": ranks}, {"serial": timing.Timing.from_samples([3.0, 1.0, 2.2])})
    assert result["serial"][0].total == 2.2


@pytest.mark.parametrize("kwargs,match", [(dict(mode="overlapped"), "mode="), (dict(comm="nccl"), "comm="),
                                          (dict(dim=0), "dim="), (dict(n_layers=2.5), "n_layers=")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        overlap.run_layers(**kwargs)
