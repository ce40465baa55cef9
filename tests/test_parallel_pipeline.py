"""Pipeline schedules: simulated bubbles equal (p-1)/(m+p-1); real runs on ranks equal the unsplit model; the
simulated device time and the bubble summarised over steps (no timing asserted)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from llmlab import dist
from llmlab.dist import Grid
from llmlab.parallel import pipeline
from llmlab.timeline import Span, Timeline


@given(p=st.integers(1, 8), m=st.integers(1, 16), kind=st.sampled_from(pipeline.SCHEDULES))
def test_simulated_bubble_equals_formula(p, m, kind):
    t = pipeline.simulate(kind, p, m, t_forward=1.0, t_backward=2.0)
    assert t.idle == pytest.approx(pipeline.bubble_fraction(p, m))
    assert len(t.spans) == 2 * p * m and t.lanes == tuple(range(p)) and t.kinds == ("F", "B")
    peaks = pipeline.peak_in_flight(t)
    if kind == "gpipe":
        assert peaks == [m] * p
    else:
        assert all(peak <= min(p - s, m) for s, peak in enumerate(peaks))


def test_1f1b_phases():
    plans = pipeline.schedule("1f1b", 4, 6)
    first = "".join(a.kind for a in plans[0])
    assert first == "FFF" + "FB" * 3 + "BBB"  # warm-up p-1, steady, cool-down
    assert "".join(a.kind for a in plans[3]) == "FB" * 6  # the last stage never waits to start backward


def _model():
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(16, 16), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers).double()


def _run_stage(p, kind, micro_batches):

    grid = Grid(pp=p, ranks=range(p))  # every rank takes part in creating the groups
    if not grid.member:
        return None
    torch.manual_seed(1)
    batch, target = torch.randn(12, 16, dtype=torch.float64), torch.randn(12, 16, dtype=torch.float64)
    stage = pipeline.partition(_model(), p)[grid.pp_rank]
    out = pipeline.pipeline_step(stage, batch, target, torch.nn.functional.mse_loss, micro_batches, kind,
                                 grid.pp_group)
    out["grads"] = [prm.grad for prm in stage.parameters()]
    return out


@pytest.fixture(scope="module")
def cluster(clusters):
    return clusters(4)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", pipeline.SCHEDULES)
def test_real_pipeline_equals_unsplit_model(cluster, p, kind):
    m = 6
    results = [r for r in cluster.run(_run_stage, p, kind, m) if r is not None]
    torch.manual_seed(1)
    batch, target = torch.randn(12, 16, dtype=torch.float64), torch.randn(12, 16, dtype=torch.float64)
    model = _model()
    loss = torch.nn.functional.mse_loss(model(batch), target)
    loss.backward()
    # the reference sliced by rank: stage s holds the layers partition gives it
    for s, ref_stage in enumerate(pipeline.partition(model, p)):
        for got, ref in zip(results[s]["grads"], ref_stage.parameters(), strict=True):
            # float64: the micro-batch sums differ from the full batch's only by rounding (~1e-16 relative)
            torch.testing.assert_close(got, ref.grad, rtol=1e-12, atol=1e-14)
    assert results[-1]["loss"] == pytest.approx(loss.item(), rel=1e-12)
    peaks = [r["peak_in_flight"] for r in results]
    assert peaks == ([m] * p if kind == "gpipe" else [min(p - s, m) for s in range(p)])
    timeline = Timeline.merge(r["timeline"] for r in results)
    assert len(timeline.spans) == 2 * p * m and timeline.lanes == tuple(range(p)) and 0 <= timeline.idle < 1
    assert pipeline.peak_in_flight(timeline) == peaks  # the recorded spans say what the stages counted


def test_1f1b_holds_fewer_activation_bytes_than_gpipe(cluster):
    gpipe, ofob = (cluster.run(_run_stage, 2, kind, 6)[:2] for kind in pipeline.SCHEDULES)
    assert ofob[0]["peak_activation_bytes"] * 3 == gpipe[0]["peak_activation_bytes"]  # 2 of 6 held vs 6
    assert ofob[0]["peak_activation_bytes"] > 0


def test_simulated_compute_is_identity_and_sleeps_in_each_pass(monkeypatch):
    slept = []
    monkeypatch.setattr(pipeline.time, "sleep", slept.append)  # records the waits instead of waiting
    stage = torch.nn.Sequential(torch.nn.Linear(4, 4), pipeline.SimulatedCompute(0.006, 0.012)).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    y = stage(x)
    assert slept == [0.006] and torch.equal(y, stage[0](x))
    y.sum().backward()
    assert slept == [0.006, 0.012]
    ref = torch.nn.Linear(4, 4).double()
    ref.load_state_dict(stage[0].state_dict())
    ref(x).sum().backward()
    assert torch.equal(stage[0].weight.grad, ref.weight.grad)  # the gradient passes through unchanged


def _timeline(spans):
    return Timeline(tuple(Span(lane, "F", 0, start, end) for lane, start, end in spans), lane_name="stage")


def test_measured_bubble_is_the_median_idle_share_of_the_steps():
    steps = [_timeline([(0, 0, 1), (1, 1, 2)]),  # each stage idle half the time: 0.5
             _timeline([(0, 0, 3), (1, 1, 4)]),  # 1/4
             _timeline([(0, 0, 1), (1, 0, 1)])]  # 0
    b = pipeline.measured_bubble(steps)
    assert b.ratios == pytest.approx((0.5, 0.25, 0.0)) and b.ratio == pytest.approx(0.25)
    assert b.impl.samples == pytest.approx((1.0, 1.0, 0.0))  # mean idle seconds per stage
    assert b.peer.samples == pytest.approx((2.0, 4.0, 1.0))  # the makespans
    assert b.load is not None and b.spread == pytest.approx((0.375 - 0.125) / (2 * 0.25))


@pytest.mark.parametrize("call,match", [
    (lambda: pipeline.SimulatedCompute(-0.001, 0.0), "forward_s=-0.001"),
    (lambda: pipeline.SimulatedCompute(0.0, "1"), "backward_s='1'"),
    (lambda: pipeline.measured_bubble([]), "timelines must be a non-empty list of Timeline"),
    (lambda: pipeline.schedule("zero-bubble", 2, 2), "kind='zero-bubble'"),
    (lambda: pipeline.schedule("gpipe", 0, 2), "stages=0"),
    (lambda: pipeline.simulate("gpipe", 2, 2, t_forward=0), "t_forward=0"),
    (lambda: pipeline.partition(_model(), 13), r"stages=13 must be an int in \[1, 12\] \(at most one stage"),
    (lambda: pipeline.partition([torch.nn.Linear(2, 2)], 1), "layers must be a torch.nn.Sequential"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_batch_not_divisible_is_a_clear_error_on_the_ranks():
    def bad():
        import torch.distributed as td

        stage = pipeline.partition(_model(), 1)[0]
        return pipeline.pipeline_step(stage, torch.randn(10, 16, dtype=torch.float64),
                                      torch.randn(10, 16, dtype=torch.float64), torch.nn.functional.mse_loss, 4,
                                      group=td.group.WORLD)

    with pytest.raises(dist.RankError, match="batch of 10 rows must split into micro_batches=4"):
        dist.spawn(bad, 1, timeout=30)


class _Narrowing(torch.nn.Module):
    """A stage whose output loses a column after the first call: not the same shape for every micro-batch."""

    def __init__(self):
        super().__init__()
        self.linear, self.calls = torch.nn.Linear(16, 16).double(), 0

    def forward(self, x):
        self.calls += 1
        y = self.linear(x)  # (rows, 16)
        return y if self.calls == 1 else y[:, :-1]  # (rows, 15) from the second micro-batch on


def _narrowing_pipeline():
    import torch.distributed as td  # on the rank: the spawned function is pickled by value

    stage = _Narrowing() if td.get_rank() == 0 else torch.nn.Sequential(torch.nn.Linear(16, 16).double())
    batch, target = torch.randn(4, 16, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64)
    return pipeline.pipeline_step(stage, batch, target, torch.nn.functional.mse_loss, 2, "gpipe", group=td.group.WORLD)


def test_a_stage_that_changes_shape_between_micro_batches_is_a_clear_error():
    with pytest.raises(dist.RankError, match="stage 0 gave micro-batch 1 an output of shape"):
        dist.spawn(_narrowing_pipeline, 2, timeout=60)
