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
    assert t.compute == pytest.approx(6 * c.n_params * c.batch_tokens / (1024 * peak * c.mfu), rel=REL)


def test_dp_allreduce_is_the_ring_formula():
    c = cluster.preset("gpt3-175b-1024xA100")  # tp 8 fills each node: one rank per node of each dp group, g = 1
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


def test_c15_preset_is_hierarchical_over_a_nic_per_gpu():
    t = cluster.step_time(cluster.preset("7b-64xH100"))
    nv, nic, S = cost.LINKS["nvlink4"], cost.LINKS["rdma100"], t.config.n_params * 2
    inside = 2 * (7 * nv.alpha + 7 / 8 * S * nv.beta)  # reduce-scatter + all-gather over the node's 8 GPUs
    across = 2 * 7 * nic.alpha + 2 * 7 / 8 * S / 8 * nic.beta  # ring over 8 nodes of S/8, each GPU's own NIC
    assert t.dp_allreduce == pytest.approx(inside + across, rel=REL)
    flat = cluster.step_time(t.config.with_(network="nic-per-node"))
    assert flat.dp_allreduce == pytest.approx(cost.gradient_allreduce_times(t.config.n_params, 64)["rdma100"], rel=REL)
    assert cluster.network_step_times(t.config) == {"nic-per-gpu": t, "nic-per-node": flat}
    times = cluster.link_step_times(t.config)
    assert set(times) == set(cost.LINKS)
    assert times["nvlink4"].total < times["pcie4"].total < times["rdma100"].total


def test_the_issues_arithmetic_for_7b_on_8_nodes():
    """Issue 19: 14 GB of bf16 gradients, 8 nodes of 8 H100, 100 Gb/s per GPU: ≈ 0.245 s across the nodes (2·7/8 ·
    14/8 GB at 12.5 GB/s) + ≈ 0.054 s of NVLink inside them (2·7/8 · 14 GB at 450 GB/s) ≈ 0.3 s; a flat ring at
    one NIC's speed 2·63/64 · 14 GB / 12.5 GB/s ≈ 2.2 s."""
    hierarchical = cluster.allreduce_time(14e9, 64, 8, "nic-per-gpu", "rdma100", "nvlink4")
    flat = cluster.allreduce_time(14e9, 64, 8, "nic-per-node", "rdma100", "nvlink4")
    assert hierarchical == pytest.approx(2 * 7 / 8 * 14e9 / 8 / 12.5e9 + 2 * 7 / 8 * 14e9 / 450e9, rel=1e-3)  # + α
    assert hierarchical == pytest.approx(0.30, abs=0.005) and flat == pytest.approx(2.2, abs=0.01)


@pytest.mark.parametrize("link", cost.NETWORK_LINKS)
@pytest.mark.parametrize("n", [2, 5, 64])
def test_one_gpu_per_node_makes_both_networks_the_flat_ring(link, n):
    nic = cost.LINKS[link]
    ring = cost.ring_allreduce_time(3e9, n, nic.alpha, nic.beta)
    for network in cluster.NETWORKS:
        assert cluster.allreduce_time(3e9, n, 1, network, link, "nvlink4") == pytest.approx(ring, rel=REL)


@pytest.mark.parametrize("node_link", cost.NODE_LINKS)
def test_one_node_is_a_ring_on_the_node_link_under_both(node_link):
    node = cost.LINKS[node_link]
    for network in cluster.NETWORKS:
        got = cluster.allreduce_time(3e9, 8, 8, network, "rdma100", node_link, rings_per_nic=4)
        assert got == pytest.approx(cost.ring_allreduce_time(3e9, 8, node.alpha, node.beta), rel=REL)


def test_a_shared_nic_divides_its_bandwidth():
    c = cluster.preset("gpt3-175b-1024xA100", network="nic-per-node")  # 8 tp ranks: 8 dp rings leave each node
    assert (c.dp_per_node, c.rings_per_nic) == (1, 8)
    nic, S = cost.LINKS["rdma200"], c.n_params / 64 * 2
    assert cluster.step_time(c).dp_allreduce == pytest.approx(2 * 15 * nic.alpha + 2 * 15 / 16 * S * nic.beta * 8,
                                                              rel=REL)
    assert cluster.preset("gpt3-175b-1024xA100").rings_per_nic == 1  # a NIC per GPU: shared by no other ring


@settings(max_examples=60, deadline=None)
@given(nbytes=st.floats(1e3, 1e11), g=st.sampled_from([1, 2, 4, 8]), m=st.integers(1, 64),
       link=st.sampled_from(cost.NETWORK_LINKS), node_link=st.sampled_from(cost.NODE_LINKS[:2]))
def test_hierarchical_never_slower_than_the_flat_ring(nbytes, g, m, link, node_link):
    """With a node link at least as fast as the NIC (NVLink against any network here), the hierarchical all-reduce
    takes at most the flat ring's time (the two are equal on bandwidth when the links are equal), and each is
    monotonic: more bytes or a slower NIC never make it faster."""
    args = (g * m, g, "nic-per-gpu", link, node_link)
    hierarchical = cluster.allreduce_time(nbytes, *args)
    assert hierarchical <= cluster.allreduce_time(nbytes, g * m, g, "nic-per-node", link, node_link) * (1 + REL)
    assert cluster.allreduce_time(nbytes * 2, *args) >= hierarchical
    slower = cost.NETWORK_LINKS[max(0, cost.NETWORK_LINKS.index(link) - 1)]  # slowest first
    assert cluster.allreduce_time(nbytes, g * m, g, "nic-per-gpu", slower, node_link) >= hierarchical


def test_allreduce_phases_add_up_to_allreduce_time_over_links_given_by_alpha_and_beta():
    nv, nic = cost.LINKS["nvlink4"], cost.LINKS["rdma100"]
    phases = cluster.allreduce_phases(14e9, 64, 8, "nic-per-gpu", nic, nv)
    assert list(phases) == ["reduce-scatter", "across nodes", "all-gather"]
    assert phases["reduce-scatter"] == phases["all-gather"] == cost.all_gather_time(14e9, 8, nv.alpha, nv.beta)
    assert phases["across nodes"] == cost.ring_allreduce_time(14e9 / 8, 8, nic.alpha, nic.beta)  # S/g on each NIC
    assert sum(phases.values()) == cluster.allreduce_time(14e9, 64, 8, "nic-per-gpu", "rdma100", "nvlink4")
    assert list(cluster.allreduce_phases(14e9, 64, 8, "nic-per-node", nic, nv)) == ["flat ring"]
    assert list(cluster.allreduce_phases(14e9, 8, 8, "nic-per-gpu", nic, nv)) == ["ring in the node"]
    b200 = cost.Link(nv.alpha, 1 / 900e9, "NVLink 5", "B200 spec sheet: 1800 GB/s both directions")
    assert cluster.allreduce_phases(14e9, 64, 8, "nic-per-gpu", nic, b200)["reduce-scatter"] == pytest.approx(
        phases["reduce-scatter"] / 2, rel=1e-3)  # twice NVLink 4's bandwidth; α is 0.02% of the phase
    with pytest.raises(ValueError, match="nic='rdma100' must be a cost.Link"):
        cluster.allreduce_phases(14e9, 64, 8, "nic-per-gpu", "rdma100", nv)


def test_allreduce_time_names_a_bad_argument():
    with pytest.raises(ValueError, match="network='infiniband'"):
        cluster.allreduce_time(1e9, 16, 8, "infiniband", "rdma100")
    with pytest.raises(ValueError, match="n=12 ranks do not fill nodes of per_node=8"):
        cluster.allreduce_time(1e9, 12, 8, "nic-per-gpu", "rdma100")
    with pytest.raises(ValueError, match="node_link='nvlink9'"):
        cluster.allreduce_time(1e9, 16, 8, "nic-per-gpu", "rdma100", "nvlink9")


def test_gpt3_arithmetic_mfu_reproduces_megatrons_measured_step():
    """The preset's mfu is the arithmetic's: with it the model's whole step is the one Narayanan et al.'s §5.1
    estimate implies (140 TFLOP/s per GPU counting 8·N per token), so the run takes their 34 days (eq. 4), not 34 days
    plus communication."""
    c = cluster.preset("gpt3-175b-1024xA100")
    m = cluster.MEGATRON_GPT3
    measured = cluster.step_from_throughput(c, m["flops_per_gpu"], m["flops_per_param_token"])
    t = cluster.step_time(c)
    assert t.total == pytest.approx(measured, rel=1e-9)
    assert round(t.days) == m["days"]
    assert m["flops_per_gpu"] / SPECS["A100 SXM"].peak_flops("bf16") == pytest.approx(0.449, abs=0.0005)  # 140/312
    assert t.mfu == pytest.approx(6 / 8 * m["flops_per_gpu"] / SPECS["A100 SXM"].peak_flops("bf16"), rel=1e-3)
    assert t.mfu < c.mfu < 1  # end to end below the arithmetic alone
    other = c.with_(mfu=0.3)
    assert cluster.arithmetic_mfu(other, cluster.step_time(other).total) == pytest.approx(0.3, rel=1e-9)
    with pytest.raises(ValueError, match="step_seconds=1 leaves no time for compute"):
        cluster.arithmetic_mfu(c, 1.0)


@pytest.mark.parametrize("change, match", [
    (dict(gpu="TPU"), "gpu='TPU'"), (dict(link="carrier pigeon"), "link='carrier pigeon'"),
    (dict(tp_link="x"), "tp_link='x'"), (dict(dp=8), "dp·tp·pp = 8·8·8 = 512 != gpus=1024"),
    (dict(tp=7, dp=1, pp=1, gpus=7), "tp=7 does not divide n_head=96"), (dict(mfu=1.5), "mfu=1.5"),
    (dict(pp=128, dp=1, gpus=1024), "pp=128 > n_layer=96"), (dict(micro_batches=0), "micro_batches=0"),
    (dict(batch_tokens=1000), "batch_tokens=1000 is not divisible"), (dict(tokens=-1), "tokens=-1"),
    (dict(model=1), "model=1"), (dict(wat=1), "wat"), (dict(network="ethernet"), "network='ethernet'"),
    (dict(gpus_per_node=0), "gpus_per_node=0"),
    (dict(tp=1, dp=12, pp=4, gpus=48, micro_batches=1, batch_tokens=12 * 2048),
     "dp=12 data-parallel ranks do not fill nodes of gpus_per_node=8 evenly"),
    # layouts a node cannot hold: nodes left part-full, a tensor-parallel group across nodes
    (dict(tp=1, dp=12, pp=1, gpus=12, micro_batches=1, batch_tokens=12 * 2048),
     "gpus_per_node=8 does not divide gpus=12"),
    (dict(gpus_per_node=6), "gpus_per_node=6 does not divide gpus=1024"),
    (dict(tp=16, dp=8, gpus_per_node=8, network="nic-per-node"), "tp=16 does not divide gpus_per_node=8"),
    (dict(tokens=float("inf")), "tokens=inf must be a finite number"), (dict(link=["rdma100"]), "link=['rdma100']"),
])
def test_bad_input_names_the_argument(change, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        cluster.preset("gpt3-175b-1024xA100", **change)


@pytest.mark.parametrize("layout, match", [
    (dict(dp=16, tp=4, gpus_per_node=6), "gpus_per_node=6 does not divide gpus=64"),
    (dict(dp=8, pp=8, micro_batches=8, gpus_per_node=12), "gpus_per_node=12 does not divide gpus=64"),
    (dict(dp=4, tp=16), "tp=16 does not divide gpus_per_node=8"),
])
def test_a_layout_no_node_holds_is_refused(layout, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        cluster.preset("7b-64xH100", **layout)
    cluster.preset("7b-64xH100", gpus=4, dp=4)  # a job smaller than one node uses part of it


_C15 = cluster.PRESETS["7b-64xH100"]


@pytest.mark.parametrize("call, match", [
    (lambda: cluster.arithmetic_mfu(_C15, float("inf")), "step_seconds=inf must be a finite number"),
    (lambda: cluster.arithmetic_mfu("7b", 2.0), "config='7b' must be a ClusterConfig"),
    (lambda: cluster.step_time(None), "config=None must be a ClusterConfig"),
    (lambda: cluster.network_step_times(None), "config=None must be a ClusterConfig"),
    (lambda: cluster.step_from_throughput(_C15, float("inf")), "flops_per_gpu=inf must be a finite number"),
    (lambda: cluster.link_step_times(_C15, []), "links=[] must be a non-empty list"),
    (lambda: cluster.link_step_times(_C15, "rdma100"), "links='rdma100' must be a non-empty list"),
    (lambda: cluster.link_step_times(_C15, ["rdma100", "x"]), "links='x' must be one of"),
    *[(lambda nbytes=nbytes: cluster.allreduce_time(nbytes, 64, 8, "nic-per-gpu", "rdma100"), f"nbytes={nbytes!r}")
      for nbytes in (True, None, "1e9", -1, float("nan"), float("inf"))],
    (lambda: cluster.allreduce_time(1e9, 64, 8, "nic-per-gpu", ["rdma100"]), "link=['rdma100'] must be one of"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        call()


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
