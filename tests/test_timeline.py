"""llmlab.timeline: spans on lanes, merged across ranks, their makespan and idle share (a pipeline's bubble)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmlab.timeline import Span, Timeline


def test_makespan_lanes_kinds_and_idle():
    t = Timeline((Span(0, "F", 0, 0.0, 1.0), Span(1, "F", 0, 1.0, 2.0), Span(0, "B", 0, 2.5, 3.0)), "stage")
    assert (t.start, t.end, t.makespan) == (0.0, 3.0, 3.0)
    assert t.lanes == (0, 1) and t.kinds == ("F", "B")
    assert [s.kind for s in t.on(0)] == ["F", "B"] and t.busy(0) == 1.5 and t.busy(1) == 1.0
    assert t.idle == pytest.approx(1 - 2.5 / 6)


def test_spans_at_the_same_time_count_once():
    # compute and communication overlapped on one rank: busy from 0 to 3, not 1 + 2 + 1.5
    t = Timeline((Span(0, "compute", 0, 0.0, 1.0), Span(0, "comm", 0, 1.0, 3.0), Span(0, "compute", 1, 1.0, 2.5)))
    assert t.busy(0) == 3.0 and t.idle == 0.0
    gap = Timeline((Span(0, "compute", 0, 0.0, 1.0), Span(0, "comm", 0, 0.5, 1.0), Span(0, "compute", 1, 2.0, 3.0)))
    assert gap.busy(0) == 2.0 and gap.idle == pytest.approx(1 / 3)


@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0, 100), st.floats(0, 10)), min_size=1, max_size=30))
def test_busy_is_at_most_the_sum_and_idle_in_0_1(raw):
    t = Timeline(tuple(Span(lane, "x", i, start, start + length) for i, (lane, start, length) in enumerate(raw)))
    for lane in t.lanes:
        assert t.busy(lane) <= sum(s.duration for s in t.on(lane)) + 1e-9
        assert t.busy(lane) <= t.makespan + 1e-9
    assert -1e-9 <= t.idle <= 1


def test_merge_joins_the_ranks_timelines():
    ranks = [Timeline((Span(r, "F", 0, r * 1.0, r + 1.0),), "stage") for r in range(3)]
    merged = Timeline.merge(iter(ranks))
    assert merged.lanes == (0, 1, 2) and merged.lane_name == "stage" and merged.makespan == 3.0
    assert merged.idle == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="different lane names"):
        Timeline.merge([ranks[0], Timeline((Span(0, "comm", 0, 0.0, 1.0),), "rank")])
    with pytest.raises(ValueError, match="at least one Timeline"):
        Timeline.merge([])


def test_no_time_passed_is_not_idle():
    assert Timeline((Span(0, "F", 0, 1.0, 1.0),)).idle == 0.0


@pytest.mark.parametrize("make,match", [
    (lambda: Span(-1, "F", 0, 0.0, 1.0), "lane=-1"),
    (lambda: Span(True, "F", 0, 0.0, 1.0), "lane=True"),
    (lambda: Span(0, "F", 0, 2.0, 1.0), "end=1.0 must be >= start=2.0"),
    (lambda: Timeline(()), "at least one Span"),
    (lambda: Timeline([Span(0, "F", 0, 0.0, 1.0)]), "tuple of Span"),
    (lambda: Timeline(((0, "F", 0, 0.0, 1.0),)), "tuple of Span"),
])
def test_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()
