"""Pipeline schedules as data (llmlab.parallel.schedules): every generator over p, v, m runs each action once, in an
order that respects the dependencies and the in-order matching of point-to-point messages, and simulates without
deadlock; the simulated bubbles equal the papers' formulas exactly (interleaved 1F1B: (p-1)/(v·m) of the ideal
time; ZB-H1: (p-1)(t_F+t_B-t_W) per rank, a third of 1F1B's at t_F = t_B = t_W)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmlab.parallel import schedules


def _sizes(kind):
    """(p, m, v) strategies for `kind`: interleaved needs p >= 2, v >= 2 and m a multiple of p."""
    if kind == "interleaved":
        return st.tuples(st.integers(2, 6), st.integers(1, 4), st.integers(2, 4)).map(lambda t: (t[0], t[0] * t[1],
                                                                                                 t[2]))
    return st.tuples(st.integers(1, 7), st.integers(1, 16), st.just(1))


def _kind_and_sizes():
    return st.sampled_from(schedules.KINDS).flatmap(lambda k: st.tuples(st.just(k), _sizes(k)))


def _receives(plans):
    """What each rank receives from each other, in the order its schedule asks for it (the mirror of `_sends`)."""
    p, v = len(plans), 1 + max(a.chunk for plan in plans for a in plan)
    got = {}
    for d, plan in enumerate(plans):
        for a in plan:
            stage = a.chunk * p + d
            if a.kind == "F" and stage > 0:
                got.setdefault(((stage - 1) % p, d), []).append(("F", stage - 1, a.micro_batch))
            if a.kind == "B" and stage < p * v - 1:
                got.setdefault(((stage + 1) % p, d), []).append(("B", stage + 1, a.micro_batch))
    return got


def _sends(plans):
    """What each rank sends to each other, in the order it sends: {(src, dst): [(kind, stage, micro-batch), …]}:
    ("F", c, i) the activation stage c computed for micro-batch i, ("B", c, i) the gradient of stage c's input."""
    p, v = len(plans), 1 + max(a.chunk for plan in plans for a in plan)
    sent = {}
    for s, plan in enumerate(plans):
        for a in plan:
            stage = a.chunk * p + s
            if (a.kind == "F" and stage < p * v - 1) or (a.kind == "B" and stage > 0):
                dst = (stage + (1 if a.kind == "F" else -1)) % p
                sent.setdefault((s, dst), []).append((a.kind, stage, a.micro_batch))
    return sent


@given(case=_kind_and_sizes())
def test_every_action_once_in_dependency_order_without_deadlock(case):
    kind, (p, m, v) = case
    plans = schedules.schedule(kind, p, m, v)
    kinds = ("F", "B", "W") if kind == "zb-h1" else ("F", "B")
    assert len(plans) == p
    for plan in plans:  # each rank: every (kind, micro-batch, chunk) exactly once
        assert sorted((a.kind, a.micro_batch, a.chunk) for a in plan) == sorted(
            (k, i, c) for k in kinds for i in range(m) for c in range(v))
        at = {(a.kind, a.micro_batch, a.chunk): n for n, a in enumerate(plan)}
        for i in range(m):
            for c in range(v):  # on the rank: a micro-batch's forward, then its B, then its W
                assert at["F", i, c] < at["B", i, c] < at.get(("W", i, c), len(plan))
    # point-to-point messages between two ranks are matched in the order they were sent (NCCL's rule; gloo's with
    # one tag): each rank must ask for its messages in the order the sender sends them
    assert _receives(plans) == _sends(plans)
    t = schedules.simulate(kind, p, m, virtual_stages=v)  # raises RuntimeError on a deadlock
    assert len(t.spans) == len(kinds) * p * v * m and t.lanes == tuple(range(p))
    done = {}
    for s in range(p):  # a lane's spans are its plan's actions in order: map them back to model stages
        spans = t.on(s)
        assert len(spans) == len(plans[s])
        for a, span in zip(plans[s], spans, strict=True):
            assert (span.kind, span.item) == (a.kind, a.micro_batch)
            done[a.chunk * p + s, a.kind, a.micro_batch] = span
    for (stage, k, i), span in done.items():  # every action starts after what it needs has ended
        for n in schedules._needs(schedules.Action(k, i), stage, p * v - 1):
            assert done[n].end <= span.start


@given(p=st.integers(2, 8), k=st.integers(1, 4), v=st.integers(2, 4), t_f=st.floats(0.1, 3), t_b=st.floats(0.1, 6))
def test_interleaved_bubble_is_p_minus_1_over_v_m_of_the_ideal(p, k, v, t_f, t_b):
    m = k * p
    t = schedules.simulate("interleaved", p, m, t_f, t_b, virtual_stages=v)
    ideal = m * (t_f + t_b)  # one rank's work: the step without a bubble
    # float sums of up to ~100 times t/v: exact to ~1e-14 relative; the formulas hold exactly, at any t_f, t_b
    assert (t.makespan - ideal) / ideal == pytest.approx(schedules.bubble_ratio(p, m, v), rel=1e-9, abs=1e-12)
    assert t.idle == pytest.approx(schedules.bubble_fraction(p, m, v), rel=1e-9, abs=1e-12)
    one_f_one_b = schedules.simulate("1f1b", p, m, t_f, t_b)
    assert (one_f_one_b.makespan - ideal) == pytest.approx(v * (t.makespan - ideal))  # v times smaller


def test_bubble_fraction_and_ratio_are_one_figure_in_two_normalisations():
    assert schedules.bubble_ratio(4, 8) == 3 / 8 and schedules.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert schedules.bubble_ratio(4, 8, 2) == 3 / 16 and schedules.bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)


@given(p=st.integers(1, 8), m=st.integers(1, 16))
def test_zb_h1_bubble_is_a_third_of_1f1b_at_equal_f_b_w(p, m):
    zb = schedules.simulate("zb-h1", p, m, 1.0, 2.0)  # F = 1, B = W = 1: the paper's assumption
    ofob = schedules.simulate("1f1b", p, m, 1.0, 2.0)
    ideal = 3.0 * m
    if m >= p:  # every rank has Ws to defer into the cool-down
        assert zb.makespan - ideal == pytest.approx((ofob.makespan - ideal) / 3) == pytest.approx(p - 1)
        assert zb.idle == pytest.approx(schedules.zb_h1_bubble_fraction(p, m))
    assert zb.idle <= ofob.idle + 1e-12
    # the same memory as 1F1B at its peak: no rank holds more micro-batches (until their W) than 1F1B's stage 0
    assert max(schedules.peak_in_flight(zb)) == max(schedules.peak_in_flight(ofob)) == min(p, m)


@given(p=st.integers(1, 7), extra=st.integers(0, 8), t_f=st.floats(0.1, 3), t_b=st.floats(0.05, 3),
       share=st.floats(0.01, 1.0))
def test_zb_h1_bubble_formula_at_any_times_with_w_no_longer_than_f_and_b(p, extra, t_f, t_b, share):
    t_w = share * min(t_f, t_b)  # t_W <= t_F and t_W <= t_B: where (p-1)(t_F+t_B-t_W) is exact
    m = p + extra
    zb = schedules.simulate("zb-h1", p, m, t_f, t_b + t_w, t_weight=t_w)
    assert zb.idle == pytest.approx(schedules.zb_h1_bubble_fraction(p, m, t_f, t_b + t_w, t_w), rel=1e-9, abs=1e-12)


@given(case=_kind_and_sizes(), t_f=st.floats(0.1, 3), t_b=st.floats(0.2, 6))
def test_zb_h1_never_idles_more_than_1f1b_and_latency_only_adds_idle(case, t_f, t_b):
    kind, (p, m, v) = case
    if kind == "zb-h1":
        assert schedules.simulate(kind, p, m, t_f, t_b).idle <= schedules.simulate("1f1b", p, m, t_f, t_b).idle + 1e-9
    quick = schedules.simulate(kind, p, m, t_f, t_b, virtual_stages=v)
    slow = schedules.simulate(kind, p, m, t_f, t_b, virtual_stages=v, t_send=0.1 * t_f)
    assert slow.makespan >= quick.makespan - 1e-9
    assert slow.makespan == pytest.approx(quick.makespan) if p == 1 else slow.makespan > quick.makespan


def test_interleaved_order_is_megatron_lms():
    plans = schedules.schedule("interleaved", 2, 4, 2)
    # rank 0: warm-up 2·(p-1) + (v-1)·p = 4 forwards, micro-batches in groups of p = 2 per chunk
    assert [(a.kind, a.micro_batch, a.chunk) for a in plans[0]] == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1),
        ("F", 2, 0), ("B", 0, 1), ("F", 3, 0), ("B", 1, 1), ("F", 2, 1), ("B", 0, 0), ("F", 3, 1), ("B", 1, 0),
        ("B", 2, 1), ("B", 3, 1), ("B", 2, 0), ("B", 3, 0)]
    assert [a.kind for a in plans[1]][:3] == ["F", "F", "F"]  # the last rank warms up (v-1)·p = 2 forwards


def test_zb_h1_defers_the_weight_gradients_of_the_first_s_micro_batches():
    plans = schedules.schedule("zb-h1", 4, 6)
    assert "".join(a.kind for a in plans[0]) == "FFF" + "FBW" * 3 + "BW" * 3  # stage 0 defers none
    last = plans[3]
    assert "".join(a.kind for a in last) == "FB" * 3 + "FBW" * 3 + "WWW"  # stage 3 defers 3, run at the end
    assert [a.micro_batch for a in last if a.kind == "W"] == list(range(6))


@pytest.mark.parametrize("call,match", [
    (lambda: schedules.schedule("interleaved", 2, 3, 2), r"micro_batches=3 must be a multiple of stages=2"),
    (lambda: schedules.schedule("interleaved", 2, 4), r"virtual_stages=1 must be >= 2 for the interleaved"),
    (lambda: schedules.schedule("interleaved", 1, 4, 2), r"stages=1 must be >= 2 for the interleaved"),
    (lambda: schedules.schedule("1f1b", 2, 4, 2), r"virtual_stages=2 must be 1 for kind='1f1b'"),
    (lambda: schedules.schedule("zb-h2", 2, 4), r"kind='zb-h2'"),
    (lambda: schedules.schedule("gpipe", 2, 4, 0), r"virtual_stages=0"),
    (lambda: schedules.simulate("1f1b", 2, 4, t_weight=1.0), r"t_weight=1.0 is for kind='zb-h1' only"),
    (lambda: schedules.simulate("zb-h1", 2, 4, t_backward=2.0, t_weight=2.0), r"t_weight=2.0 must be < t_backward"),
    (lambda: schedules.simulate("zb-h1", 2, 4, t_weight=0), r"t_weight=0 must be a number > 0"),
    (lambda: schedules.simulate("1f1b", 2, 4, t_send=-1), r"t_send=-1"),
    (lambda: schedules.bubble_ratio(2, 4, 0), r"virtual_stages=0"),
    (lambda: schedules.zb_h1_bubble_fraction(2, 0), r"micro_batches=0"),
    (lambda: schedules.zb_h1_bubble_fraction(2, 4, t_weight=3.0), r"t_weight=3.0 must be < t_backward=2.0"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
