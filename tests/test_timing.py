"""llmlab.timing: synchronize, the median of repeated runs, an implementation compared with its peer."""

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


def test_median_seconds_is_the_median_of_the_timed_runs(monkeypatch):
    clock = Clock(monkeypatch)
    # 2 warm-up runs (100 s, untimed), then 5 timed ones
    assert timing.median_seconds(clock.takes(100, 100, 3, 1, 9, 2, 4), repeats=5, warmup=2) == 3
    assert timing.median_seconds(clock.takes(7), repeats=1, warmup=0) == 7


def test_median_seconds_of_real_work_is_positive():
    assert 0 < timing.median_seconds(lambda: torch.ones(64).sum(), repeats=3) < 1


def test_compare_alternates_and_reports_the_ratio(monkeypatch):
    clock, order = Clock(monkeypatch), []
    impl = clock.takes(50, 2, 2, 3, log=order, name="impl")  # a slow first call, warm-up
    peer = clock.takes(50, 1, 1, 1, log=order, name="peer")
    result = timing.compare(impl, peer, repeats=3)
    assert result == {"impl_ms": 2000.0, "peer_ms": 1000.0, "ratio": 2.0}
    assert order == ["impl", "peer"] * 4  # warm-up, then alternately


@pytest.mark.parametrize("call, match", [
    (lambda: timing.median_seconds(print, repeats=0), "repeats=0 must be >= 1"),
    (lambda: timing.median_seconds(print, warmup=-1), "warmup=-1 must be >= 0"),
    (lambda: timing.compare(print, print, repeats=0), "repeats=0 must be >= 1"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()
