"""llmlab.monitor: history, TensorBoard events read back, headless live plot, profiler split, GPU stats."""

import pytest
import torch

from llmlab import dist
from llmlab.monitor import Monitor, gpu_stats, profile_step


def test_history_keeps_every_step():
    with Monitor() as monitor:
        for step in range(5):
            monitor.log(step, {"loss": 10.0 - step, "lr": 0.1 * step})
    assert monitor.history["loss"] == [(s, 10.0 - s) for s in range(5)]
    assert [v for _, v in monitor.history["lr"]] == pytest.approx([0.1 * s for s in range(5)])


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="step"):
        Monitor().log(-1, {"loss": 1.0})
    with pytest.raises(ValueError, match="metrics"):
        Monitor().log(0, [1.0])
    with pytest.raises(ValueError, match="every_s"):
        Monitor(every_s=-1)


def test_tensorboard_events_read_back(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'llmlab[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Monitor(logdir=tmp_path) as monitor:
        for step in range(0, 30, 3):
            monitor.log(step, {"loss": 1.0 / (step + 1), "grad_norm": float(step)})
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == list(range(0, 30, 3))
    # events store float32: compare at float32's resolution (~6e-8 relative)
    assert [e.value for e in loss] == pytest.approx([1.0 / (s + 1) for s in range(0, 30, 3)], rel=1e-6)
    assert [e.value for e in acc.Scalars("grad_norm")] == [float(s) for s in range(0, 30, 3)]


def test_live_plot_and_memory_headless():
    with Monitor(live=True, every_s=0.0, memory=True) as monitor:  # outside IPython draw() is a no-op
        for step in range(3):
            monitor.log(step, {"loss": 1.0})
    assert all(v > 0 for _, v in monitor.history["memory_bytes"])
    assert len(monitor.figure().axes) == 2


def _profiled_all_reduce():
    import torch.distributed as td

    torch.set_num_threads(1)
    x, g = torch.randn(256, 256), torch.randn(1_000_000)

    def step():
        for _ in range(3):
            x @ x  # compute: aten::mm
            td.all_reduce(g)  # communication: c10d::allreduce_

    return {k: v for k, v in profile_step(step).items() if k != "table"}


def test_profiler_splits_compute_and_communication():
    for split in dist.spawn(_profiled_all_reduce, 2):
        assert split["compute"] > 0 and split["communication"] > 0
        # the parts cover the wall time; ops may overlap with the backend's thread, so allow 5% over
        assert split["compute"] + split["communication"] + split["other"] <= split["wall"] * 1.05


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_gpu_stats_none_on_cpu():
    assert gpu_stats() is None


def test_logged_durations_are_judged_as_timings():
    with Monitor() as monitor:
        for step, seconds in enumerate([0.5, 0.010, 0.011, 0.012, 0.010, 0.011]):  # a slow first step
            monitor.log(step, {"loss": 1.0, "step_time_s": seconds})
    t = monitor.timed()
    assert t.seconds == pytest.approx(0.0110, rel=1e-9) and t.samples[0] == 0.5 and t.load is not None
    assert t.conclusive and t.note() == "" and str(t).startswith("11 ms ±")
    with pytest.raises(ValueError, match="name='comm_s': no such durations logged \\(logged: loss, step_time_s\\)"):
        monitor.timed("comm_s")
    assert [ax.get_title() for ax in monitor.figure().axes] == ["loss (nats/token)", "step_time_s (s)"]
