"""llmlab.timing: warm-up, interleaved adaptive rounds, the median and its spread, the load, a direction."""

import pytest
import torch

from llmlab import timing


class Clock:
    """A fake `time.perf_counter`: each timed function moves it on by its next duration."""

    def __init__(self, monkeypatch):
        self.now = 0.0
        monkeypatch.setattr(timing.time, "perf_counter", lambda: self.now)

    def takes(self, *seconds, log=None, name=None):
        durations = iter(seconds)

        def fn():
            self.now += next(durations)
            if log is not None:
                log.append(name)
        return fn


def test_synchronize_waits_only_for_cuda(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    for device in (None, "cpu", torch.device("cpu")):
        timing.synchronize(device)  # nothing queued on a CPU: no-op
    assert waited == []
    timing.synchronize("cuda:0")
    assert waited == ["cuda:0"]


def rounds(**kw):
    """interleave's arguments for a fake clock: one call per round (no calibration), no time budget."""
    return {"min_round_s": 0, "budget_s": 1e9} | kw


def test_the_figure_is_the_median_of_the_rounds_and_the_spread_half_their_iqr(monkeypatch):
    clock = Clock(monkeypatch)
    # 2 warm-up calls and the calibration call (untimed: 100, 100, 5), then 5 rounds
    t = timing.measure(clock.takes(100, 100, 5, 3, 1, 9, 2, 4), warmup=2, **rounds(min_rounds=5, max_rounds=5))
    assert t.samples == (3, 1, 9, 2, 4) and t.calls == 1
    assert t.seconds == 3 and t.ms == 3000
    assert t.spread == pytest.approx((4 - 2) / (2 * 3))  # quartiles of 1, 2, 3, 4, 9 are 2 and 4
    assert not t.conclusive and str(t) == "3 s ±33%"
    assert "not conclusive" in t.note() and "±33%" in t.note() and "load" in t.note()


def test_rounds_rotate_the_order_so_none_always_runs_first(monkeypatch):
    clock, order = Clock(monkeypatch), []
    fns = {n: clock.takes(*[1] * 6, log=order, name=n) for n in "abc"}
    timing.interleave(fns, warmup=1, **rounds(min_rounds=3, max_rounds=3))
    assert order[:6] == ["a", "a", "b", "b", "c", "c"]  # warm-up and calibration, each in turn
    assert order[6:] == list("abc") + list("bca") + list("cab")


def test_a_busy_spell_that_hits_both_leaves_the_ratio_alone(monkeypatch):
    clock = Clock(monkeypatch)
    impl = clock.takes(9, 9, 2, 2, 6, 2, 2)  # round 3 ran while the machine was busy: everything took 3×
    peer = clock.takes(9, 9, 1, 1, 3, 1, 1)
    c = timing.compare(impl, peer, **rounds(min_rounds=5, max_rounds=5))
    assert c.ratios == (2, 2, 2, 2, 2) and c.ratio == 2 and c.spread == 0
    assert c.impl.samples == (2, 2, 6, 2, 2) and c.impl.ms == 2000 and c.peer.ms == 1000
    assert c.direction() == "slower" and c.direction(threshold=3) == "faster"
    assert c.says("A", "B").startswith("A takes 2.00× the time of B (±0%, 5 rounds, load ")
    assert c.says("A", "B").endswith("slower here.")
    assert set(c.row()) == {"impl_ms", "peer_ms", "ratio", "spread", "load"} and c.row()["ratio"] == 2


def test_a_ratio_whose_rounds_straddle_the_threshold_is_not_conclusive():
    wide = timing.Comparison(timing.Timing((1,)), timing.Timing((1,)), (0.7, 0.9, 1.05, 1.2, 1.4))
    assert wide.direction() == "not conclusive"
    assert wide.says("A", "B").endswith("not conclusive on this machine now.")
    assert timing.Comparison(timing.Timing((1,)), timing.Timing((1,)), (0.5, 0.6, 0.62, 0.7)).direction() == "faster"


def test_a_side_the_rounds_agree_on_with_a_wide_spread_is_stated_without_its_size():
    wide = timing.Comparison(timing.Timing((1,)), timing.Timing((1,)), (1.1, 1.2, 1.44, 1.9, 2.5))
    assert wide.direction() == "slower" and not wide.conclusive
    assert wide.says("A", "B").endswith("slower here in three rounds of four or more, by an amount these rounds "
                                        "cannot pin down.")


def test_rounds_are_added_until_the_spread_is_small(monkeypatch):
    clock = Clock(monkeypatch)
    steady = timing.measure(clock.takes(*[1] * 40), **rounds(min_rounds=4, max_rounds=30))
    assert len(steady.samples) == 4  # no spread at all: the minimum number of rounds
    noisy = timing.measure(clock.takes(*[1, 3] * 20), **rounds(min_rounds=4, max_rounds=30))
    assert len(noisy.samples) == 30  # never settles: every round allowed
    budget = timing.measure(clock.takes(*[1, 3] * 20), **rounds(min_rounds=4, max_rounds=30, budget_s=10))
    assert len(budget.samples) == 6  # rounds of 1, 3, 1, 3, 1, 3 s: the sixth ends past 10 s


def test_paired_ratios_that_settle_stop_the_rounds_even_when_both_wander(monkeypatch):
    clock = Clock(monkeypatch)
    wander = [1, 5, 2, 8, 3, 9, 1, 4] * 4
    c = timing.compare(clock.takes(1, *[2 * w for w in wander]), clock.takes(1, *wander), **rounds(min_rounds=5))
    assert len(c.ratios) == 5 and c.ratio == 2 and not c.impl.conclusive


def test_a_quick_function_is_called_several_times_per_round(monkeypatch):
    clock = Clock(monkeypatch)
    t = timing.measure(clock.takes(*[1e-4] * 200), warmup=0, min_round_s=1e-3, min_rounds=3, max_rounds=3)
    assert t.calls == 10 and t.seconds == pytest.approx(1e-4)


def test_real_work_is_timed_with_the_load():
    t = timing.measure(lambda: torch.ones(64).sum(), min_rounds=3)
    assert 0 < t.seconds < 1 and t.load.cores >= 1 and t.load.average >= 0
    assert str(t.load).startswith("load ") and " on " in str(t.load)


def test_load_keeps_the_busier_reading():
    quiet, busy = timing.Load(0.5, 2), timing.Load(3.0, 2)
    assert quiet.busier(busy) is busy and busy.busier(quiet) is busy and quiet.busier(None) is quiet
    assert str(busy) == "load 3.0 on 2 cores" and str(timing.Load(1.0, 1)) == "load 1.0 on 1 core"


def test_timings_measured_elsewhere_are_judged_alike():
    t = timing.Timing.from_samples([0.010, 0.011, 0.030, 0.010], load=timing.Load(4.0, 2))
    assert t.seconds == pytest.approx(0.0105) and str(t).startswith("10.5 ms ±")
    with pytest.raises(ValueError, match="samples is empty"):
        timing.Timing.from_samples([])
    with pytest.raises(ValueError, match="must be durations in seconds"):
        timing.Timing.from_samples([0.1, -1])


@pytest.mark.parametrize("call, match", [
    (lambda: timing.measure(print, min_rounds=0), "min_rounds=0 must be an integer >= 1"),
    (lambda: timing.measure(print, warmup=-1), "warmup=-1 must be an integer >= 0"),
    (lambda: timing.measure(print, min_rounds=5, max_rounds=3), "max_rounds=3 must be an integer >= 5"),
    (lambda: timing.measure(print, budget_s="1"), "budget_s='1' must be a number >= 0"),
    (lambda: timing.interleave({}), "fns={} must be a non-empty dict"),
    (lambda: timing.interleave({"a": 3}), "must be a non-empty dict of {name: function}"),
    (lambda: timing.measure(print, group="world"), "group='world' must be 'auto', None or a torch.distributed"),
    (lambda: timing.measure(print, group=object()), "names a process group, but torch.distributed is not init"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_remembered_measures_at_every_call_and_recent_reuses_the_last():
    calls = []

    @timing.remembered
    def measured(x, scale=1):
        calls.append(x)
        return len(calls) * scale

    assert measured.recent(5) == 1  # nothing measured yet with these arguments: measures
    assert measured.recent(5) == 1 and calls == [5]  # reused, not measured again
    assert measured(5) == 2 and measured.recent(5) == 2  # a call re-measures; recent follows it
    assert measured.recent(5, scale=3) == 9 and measured.recent(6) == 4  # other arguments, other results
    assert measured.__name__ == "measured"


def _timed_collectives(trials: int, slow_rank: int, group):
    """On every rank: `trials` timings of a function that all-reduces, where rank `slow_rank` is slowed by a random
    sleep (so its calls per round, its spread and its clock differ from its peers') and every rank has a budget
    and round length of its own. Returns (rounds, calls) of each trial."""
    import random
    import time

    import torch.distributed as td

    rank = td.get_rank()
    rng = random.Random()  # fresh noise on every run and rank
    x = torch.ones(3)

    def step():
        if rank == slow_rank:
            time.sleep(rng.uniform(0, 3e-4))
        td.all_reduce(x)  # every rank must call this as often as its peers do

    seen = []
    for trial in range(trials):
        # every tenth trial has time to run all its rounds (a spread of 0 is never reached), so the rounds vary
        # however loaded the machine is; the others stop on a budget of their own or on their spread
        full = trial % 10 == 0
        t = timing.measure(step, warmup=1, min_rounds=2, max_rounds=12,
                           budget_s=1.0 if full else rng.uniform(0, 4e-3),
                           target_spread=0.0 if full else rng.choice([0.0, 0.05, 1.0]),
                           min_round_s=rng.uniform(0, 3e-3), group=group)
        seen.append((len(t.samples), t.calls))
    return seen


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_timing_a_collective_agree_on_calls_and_rounds_so_none_hangs(clusters, world_size):
    """Issue 27: a DDP step timed on every rank deadlocked when one rank stopped its rounds early. 300 timings of a
    collective-bearing function, one rank slow and noisy, every clock and budget its own: the ranks must run the
    same rounds of the same calls every time (a disagreement would be a hang, caught by the timeout)."""
    cluster = clusters(world_size)
    seen = cluster.run(_timed_collectives, 300, world_size - 1, "auto", timeout=240)
    assert all(s == seen[0] for s in seen), [sum(a != b for a, b in zip(s, seen[0], strict=True)) for s in seen]
    assert len({calls for _, calls in seen[0]}) > 1, "the calls per round never varied: the test tests nothing"
    assert len({rounds for rounds, _ in seen[0]}) > 1, "the rounds never varied: the test tests nothing"


def _sleepy_timing(trials: int, group):
    import time

    import torch.distributed as td

    slow = 1e-3 * (1 + 3 * td.get_rank())  # rank 0 sleeps 1 ms, rank 1 4 ms: 8 ms rounds of 4+ calls and of 2
    return [timing.measure(lambda: time.sleep(slow), warmup=0, min_rounds=1, max_rounds=3, budget_s=0,
                           min_round_s=8e-3, group=group).calls for _ in range(trials)]


def test_alone_each_rank_decides_for_itself_and_with_its_group_they_agree(clusters):
    """What the agreement changes: with group=None a slower rank calls its function fewer times per round than its
    peer (harmless here, a deadlock with a collective inside); by default the ranks take the most any asked for."""
    alone = clusters(2).run(_sleepy_timing, 3, None)
    agreed = clusters(2).run(_sleepy_timing, 3, "auto")
    assert alone[0] != alone[1], alone
    assert agreed[0] == agreed[1], agreed
