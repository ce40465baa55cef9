"""The cluster calculator (llmlab.hardware.cluster) against hand computations, llmlab.flops and the α-β model."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmlab import flops
from llmlab.dist import cost
from llmlab.hardware import SPECS, cluster
from llmlab.parallel.pipeline import bubble_fraction

# float sums in a different order than the hand formula: a few ulps
REL = 1e-12


def test_compute_is_6n_tokens_over_gpus_peak_mfu():
    c = cluster.preset("gpt3-175b-1024xA100")
    t = cluster.step_time(c)
    peak = SPECS["A100 SXM"].peak_flops("bf16")
    assert t.attainable_flops == peak  # 2048-token micro-batches: every GEMM is compute-bound
    assert t.compute == pytest.approx(6 * c.n_params * c.batch_tokens / (1024 * peak * 0.45), rel=REL)


def test_dp_allreduce_is_the_ring_formula():
    c = cluster.preset("gpt3-175b-1024xA100")
    link, n, S = cost.LINKS["rdma200"], 16, c.n_params / 64 * 2  # 175B / (tp·pp) bf16 gradients per GPU
    assert cluster.step_time(c).dp_allreduce == pytest.approx(
        2 * (n - 1) * link.alpha + 2 * (n - 1) / n * S * link.beta, rel=REL)


def test_tp_allreduce_and_bubble_by_hand():
    c = cluster.preset("gpt3-175b-1024xA100")
    t = cluster.step_time(c)
    link, n = cost.LINKS["nvlink3"], 8
    S = 2048 * 12288 * 2  # one (micro_tokens, n_embd) bf16 activation
    one = 2 * (n - 1) * link.alpha + 2 * (n - 1) / n * S * link.beta
    assert t.tp_allreduce == pytest.approx(4 * (96 / 8) * 96 * one, rel=REL)  # 4 per layer, 12 layers, 96 micro
    busy = t.compute + t.tp_allreduce + t.pp_send
    assert t.pp_bubble == pytest.approx(busy * 7 / 96, rel=REL)  # (p − 1)/m of the busy time
    f = bubble_fraction(8, 96)
    assert t.pp_bubble / (busy + t.pp_bubble) == pytest.approx(f, rel=REL)


@pytest.mark.parametrize("name", list(cluster.PRESETS))
def test_one_gpu_days_are_flops_training_days(name):
    c = cluster.preset(name, gpus=1, dp=1, tp=1, pp=1, micro_batches=1)
    t = cluster.step_time(c)
    assert t.comm == 0 and t.pp_bubble == 0  # a ring of one rank sends nothing
    want = flops.training_days(flops.training_flops(c.n_params, c.tokens), 1, t.attainable_flops, c.mfu)
    assert t.days == pytest.approx(want, rel=REL)
    assert t.gpu_hours == pytest.approx(t.days * 24, rel=REL)


def test_small_micro_batches_fall_under_the_roof():
    c = cluster.preset("gpt2-8xH100", batch_tokens=8, dp=8)  # one token per GPU: matrix-vector products
    t = cluster.step_time(c)
    assert t.attainable_flops < SPECS["H100 SXM"].peak_flops("bf16") / 100


def test_c15_preset_matches_cost_c15_step():
    t = cluster.step_time(cluster.preset("7b-64xH100"))
    want = cost.gradient_allreduce_times(t.config.n_params, 64)["rdma100"]
    assert t.dp_allreduce == pytest.approx(want, rel=REL)
    times = cluster.link_step_times(t.config)
    assert set(times) == set(cost.LINKS)
    assert times["nvlink4"].total < times["pcie4"].total < times["rdma100"].total


@pytest.mark.parametrize("change, match", [
    (dict(gpu="TPU"), "gpu='TPU'"), (dict(link="carrier pigeon"), "link='carrier pigeon'"),
    (dict(tp_link="x"), "tp_link='x'"), (dict(dp=8), "dp·tp·pp = 8·8·8 = 512 != gpus=1024"),
    (dict(tp=7, dp=1, pp=1, gpus=7), "tp=7 does not divide n_head=96"), (dict(mfu=1.5), "mfu=1.5"),
    (dict(pp=128, dp=1, gpus=1024), "pp=128 > n_layer=96"), (dict(micro_batches=0), "micro_batches=0"),
    (dict(batch_tokens=1000), "batch_tokens=1000 is not divisible"), (dict(tokens=-1), "tokens=-1"),
    (dict(model=1), "model=1"), (dict(wat=1), "wat"),
])
def test_bad_input_names_the_argument(change, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        cluster.preset("gpt3-175b-1024xA100", **change)


def test_unknown_preset():
    with pytest.raises(ValueError, match="name='x'"):
        cluster.preset("x")


_ORDERED = sorted(cost.LINKS, key=lambda k: (cost.LINKS[k].beta, cost.LINKS[k].alpha))


@settings(max_examples=40, deadline=None)
@given(i=st.integers(0, len(_ORDERED) - 2), tp_link=st.sampled_from(_ORDERED),
       name=st.sampled_from(list(cluster.PRESETS)))
def test_more_bandwidth_never_slows_a_step(i, tp_link, name):
    slow, fast = _ORDERED[i + 1], _ORDERED[i]
    if cost.LINKS[fast].alpha > cost.LINKS[slow].alpha:  # faster and lower latency, or not comparable
        return
    c = cluster.preset(name, tp_link=tp_link)
    assert cluster.step_time(c.with_(link=fast)).total <= cluster.step_time(c.with_(link=slow)).total
    assert cluster.step_time(c.with_(tp_link=fast)).total <= cluster.step_time(c.with_(tp_link=slow)).total


@settings(max_examples=40, deadline=None)
@given(mfu=st.floats(0.05, 0.95), more=st.floats(1.0, 2.0), name=st.sampled_from(list(cluster.PRESETS)))
def test_higher_mfu_never_slows_a_step(mfu, more, name):
    c = cluster.preset(name, mfu=mfu)
    assert cluster.step_time(c.with_(mfu=min(1.0, mfu * more))).total <= cluster.step_time(c).total


@settings(max_examples=30, deadline=None)
@given(m=st.sampled_from([8, 16, 32, 48, 96]))
def test_more_micro_batches_shrink_the_bubble_share(m):
    c = cluster.preset("gpt3-175b-1024xA100", micro_batches=m)
    t = cluster.step_time(c)
    assert t.pp_bubble / t.total <= bubble_fraction(8, m) + REL
