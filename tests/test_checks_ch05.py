"""Chapter 5's exercise checks (llmlab.checks.ch05): each passes a right answer, reports an unwritten one as not
attempted, and fails each named mistake — the FP32 column, a forward-only step, MFU left out; a flat ring over the
NIC where each GPU has its own and the hierarchical all-reduce where a node has one, the whole gradient across the
nodes, Gb/s read as GB/s, NVLink's two directions added, the rings' (k−1)/k left out, the latency left out, a phase
or two left out, a ring across the nodes over every GPU, the links swapped; communication overlapped, TP all-reduces
miscounted, links swapped, hours for days, a flat ring where each GPU has its own NIC, the hierarchical all-reduce
where a node has one, a shared NIC priced as free, a one-node ring on the NIC's link; the pipeline's bubble missing,
taken of the whole step, put on the DP all-reduce, its sends missing or summed over every boundary, a stage's layers
or gradients counted for the whole model — with its message and the hint; answers computed in float32 pass."""

import random

import numpy as np
import pytest
from check_answers import Mistake, Reference
from grading import not_attempted

from llmlab.checks import ch05
from llmlab.dist import cost
from llmlab.hardware import SPECS, cluster


def unwritten(*args):
    raise NotImplementedError("Exercise 5.x")


# --- 5.1 ----------------------------------------------------------------------------------------------------

def compute_seconds(n_params, tokens, gpus, gpu, mfu, column="bf16_tflops", flops_per_token=6, use_mfu=True):
    peak = getattr(SPECS[gpu], column) * 1e12
    return flops_per_token * n_params * tokens / (gpus * peak * (mfu if use_mfu else 1.0))


# --- 5.2 ----------------------------------------------------------------------------------------------------

PHASES = ("reduce-scatter", "across nodes", "all-gather")


def hierarchical(nbytes, nodes, per_node, nvlink_gbs, nic_gbps, nvlink_alpha, nic_alpha, network="nic-per-gpu",
                 nvlink_per_s=0.5e9, nic_per_s=1e9 / 8, factor=True, latency=True, shard=True, across_all=False,
                 phases=PHASES, flat=None, swap=False, flat_factor=True):
    """The exercise's solution; each keyword after `network` plants a mistake: bytes/s per unit of each figure, the
    rings' (k−1)/k, the α's, S/g across the nodes, a ring across over all n GPUs, the phases kept, a flat ring (True)
    or the hierarchical one (False) whatever the network, the links swapped, the flat ring's 2(n−1)/n alone."""
    node, nic = (nvlink_alpha if latency else 0, nvlink_gbs * nvlink_per_s), (nic_alpha if latency else 0,
                                                                               nic_gbps * nic_per_s)
    if swap:
        node, nic = nic, node
    g, m = per_node, nodes

    def ring_pass(size, k, link, factor=factor):
        return (k - 1) * link[0] + ((k - 1) / k if factor else 1) * size / link[1]

    if (network == "nic-per-node" if flat is None else flat) and m > 1:
        return 2 * ring_pass(nbytes, g * m, nic, factor and flat_factor)
    parts = {"reduce-scatter": ring_pass(nbytes, g, node), "all-gather": ring_pass(nbytes, g, node),
             "across nodes": 2 * ring_pass(nbytes / g if shard else nbytes, g * m if across_all else m, nic)}
    return sum(parts[phase] for phase in phases)


def hierarchical32(nbytes, nodes, per_node, nvlink_gbs, nic_gbps, nvlink_alpha, nic_alpha, network="nic-per-gpu"):
    """The right formula computed in float32 throughout (NumPy keeps float32 against Python scalars)."""
    f = np.float32
    return hierarchical(f(nbytes), nodes, per_node, f(nvlink_gbs), f(nic_gbps), f(nvlink_alpha), f(nic_alpha),
                        network, nvlink_per_s=f(0.5e9), nic_per_s=f(1e9 / 8))


def test_a_mistake_that_fits_two_explanations_names_both():
    with pytest.raises(ch05.Mismatch, match="expected 2 s: one — or: two"):
        ch05._compare(1.0, 2.0, "x", [(1.0, "one"), (3.0, "three"), (1.0, "two")])


def test_the_reference_prices_the_spec_sheets_nvlink_as_llmlab_does():
    assert ch05.nvlink("H100 SXM")[:2] == cost.LINKS["nvlink4"][:2]
    assert ch05.nvlink("A100 SXM")[:2] == cost.LINKS["nvlink3"][:2]
    assert ch05.nvlink("B200").beta == 1 / 900e9  # 1800 GB/s both directions
    assert ch05.link_quote("rdma100") == (100, "Gb/s per direction")
    want, split, _ = ch05._hierarchical_reference(14e9, 8, 8, "H100 SXM", "rdma100", "nic-per-gpu")
    assert want == pytest.approx(cluster.allreduce_time(14e9, 64, 8, "nic-per-gpu", "rdma100", "nvlink4"), rel=1e-15)
    assert want == pytest.approx(0.30, abs=0.005)  # issue 19's arithmetic (tests/test_hardware_cluster.py)
    assert split.startswith("reduce-scatter 0.0272") and " + across nodes 0.245" in split
    with pytest.raises(ValueError, match="gpu='MI250X' is not one of the NVLink GPUs"):
        ch05.nvlink("MI250X")
    with pytest.raises(ValueError, match="key='nvlink9' is not a link"):
        ch05.link_quote("nvlink9")


def test_the_allreduce_cases_cover_the_edges():
    fixed = ch05._hierarchical_cases(random.Random(0))[:5]
    assert [(nodes, per_node, network) for _, nodes, per_node, _, _, network in fixed] == [
        (8, 8, "nic-per-gpu"), (8, 8, "nic-per-node"), (16, 1, "nic-per-gpu"), (1, 8, "nic-per-gpu"),
        (3, 4, "nic-per-gpu")]
    drawn = [case for seed in range(20) for case in ch05._hierarchical_cases(random.Random(seed))[5:]]
    assert {1, 2} <= {nodes for _, nodes, *_ in drawn} and any(nodes % 2 and nodes > 1 for _, nodes, *_ in drawn)
    assert {per_node for _, _, per_node, *_ in drawn} == {1, 2, 4, 8}
    assert {gpu for *_, gpu, _, _ in drawn} == {"A100 SXM", "H100 SXM", "H200 SXM", "B200"}
    assert {nic for *_, nic, _ in drawn} == set(cost.NETWORK_LINKS)
    assert {network for *_, network in drawn} == set(cluster.NETWORKS)


# --- 5.3 ----------------------------------------------------------------------------------------------------

def dp_allreduce(c, grads, link, node, network=None, shared=True, node_on_link=False):
    """The DP all-reduce as the exercise text describes it; `network` overrides the config's, `node_on_link` prices
    a one-node ring on the NIC's link (planted mistakes)."""
    g, m = c.dp_per_node, c.dp // c.dp_per_node
    if m == 1:  # one node: a ring on the node's link
        ring_link = link if node_on_link else node
        return cost.ring_allreduce_time(grads, c.dp, ring_link.alpha, ring_link.beta)
    if (network or c.network) == "nic-per-node":
        return cost.ring_allreduce_time(grads, c.dp, link.alpha, link.beta * (c.rings_per_nic if shared else 1))
    return (cost.reduce_scatter_time(grads, g, node.alpha, node.beta) + cost.all_gather_time(grads, g, node.alpha,
                                                                                              node.beta)
            + cost.ring_allreduce_time(grads / g, m, link.alpha, link.beta))


def training_time(c, overlap=False, tp_per_layer=4, per_micro_batch=True, shard_grads=True, swap=False,
                  per_day=86_400, network=None, shared=True, node_on_link=False, bubble="busy", sends="busiest",
                  stage_grads=True, stage_layers=True):
    """The exercise's solution; each argument but `c` plants a mistake. bubble: "busy" (idle (p−1)/m of the busy
    time), "share" (f·busy, f the share of the whole step), "none", "all" (the DP all-reduce in the bubble too);
    sends: "busiest" (a middle stage's two boundaries), "all" (p−1 boundaries), "none"."""
    link, tp_link = cost.LINKS[c.link], cost.LINKS[c.tp_link]
    if swap:
        link, tp_link = tp_link, link
    compute = compute_seconds(c.n_params, c.batch_tokens, c.gpus, c.gpu, c.mfu)
    grads = c.n_params / (c.tp if shard_grads else 1) / (c.pp if stage_grads else 1) * c.bytes_per_param
    dp = dp_allreduce(c, grads, link, tp_link, network, shared, node_on_link)
    activation = c.micro_tokens * c.model.n_embd * c.bytes_per_activation
    layers = c.model.n_layer / (c.pp if stage_layers else 1)
    rings = tp_per_layer * layers * (c.micro_batches if per_micro_batch else 1)
    tp = rings * cost.ring_allreduce_time(activation, c.tp, tp_link.alpha, tp_link.beta)
    boundaries = {"busiest": min(2, c.pp - 1), "all": c.pp - 1, "none": 0}[sends]
    busy = compute + tp + 2 * boundaries * c.micro_batches * (link.alpha + activation * link.beta)
    idle = {"busy": (c.pp - 1) / c.micro_batches, "share": (c.pp - 1) / (c.micro_batches + c.pp - 1),
            "none": 0, "all": (c.pp - 1) / c.micro_batches}[bubble]
    if overlap:  # max(compute, communication): the sends and all-reduces hidden, the bubble forgotten
        step = max(compute, dp + busy - compute)
    else:
        step = busy * (1 + idle) + dp * (1 + idle if bubble == "all" else 1)
    return step, c.tokens / c.batch_tokens * step / per_day


def training_time32(c):
    """The right step and days computed in float32 throughout, by the exercise text's formulas."""
    f = np.float32

    def ring(nbytes, n, link):
        return f(2 * (n - 1)) * f(link.alpha) + f(2 * (n - 1) / n) * nbytes * f(link.beta)

    link, node = cost.LINKS[c.link], cost.LINKS[c.tp_link]
    compute = f(6) * f(c.n_params) * f(c.batch_tokens) / (f(c.gpus) * f(SPECS[c.gpu].bf16_tflops) * f(1e12) * f(c.mfu))
    grads, g, m = f(c.n_params) / f(c.tp * c.pp) * f(c.bytes_per_param), c.dp_per_node, c.dp // c.dp_per_node
    if m == 1:
        dp = ring(grads, c.dp, node)
    elif c.network == "nic-per-node":
        dp = ring(grads, c.dp, link) + f(2 * (c.dp - 1) / c.dp) * grads * f(link.beta) * f(c.rings_per_nic - 1)
    else:
        dp = ring(grads, g, node) + ring(grads / f(g), m, link)  # reduce-scatter + all-gather = one ring's time
    activation = f(c.micro_tokens) * f(c.model.n_embd) * f(c.bytes_per_activation)
    tp = f(4 * c.model.n_layer / c.pp * c.micro_batches) * ring(activation, c.tp, node)
    sends = f(2 * min(2, c.pp - 1) * c.micro_batches) * (f(link.alpha) + activation * f(link.beta))
    step = (compute + tp + sends) * (f(1) + f(c.pp - 1) / f(c.micro_batches)) + dp
    return step, f(c.tokens) / f(c.batch_tokens) * step / f(86_400)


def comm_free(c):
    return compute_seconds(c.n_params, c.batch_tokens, c.gpus, c.gpu, c.mfu), 1.0


def test_training_cases_are_compute_bound_and_cover_the_pipeline():
    configs = [c for seed in range(20) for c in ch05.training_cases(random.Random(seed))]
    for c in configs:
        t = cluster.step_time(c)
        # the exercise prices compute at the bf16 peak: step_time's roofline rate must be exactly that
        assert t.attainable_flops == pytest.approx(SPECS[c.gpu].peak_flops("bf16"), rel=1e-12)
        assert c.dp % c.dp_per_node == 0  # the data-parallel ranks fill their nodes
    first = cluster.step_time(configs[0])  # every part non-zero, so each named mistake shows in the first case
    assert min(first.compute, first.dp_allreduce, first.tp_allreduce, first.pp_send, first.pp_bubble) > 0
    assert configs[0].micro_batches > 2 and configs[0].pp > 3  # the busiest stage has two boundaries of p − 1
    assert [c.pp for c in configs[5:7]] == [2, 1]  # one boundary; no pipeline
    assert {1, 2, 4, 8, 12} <= {c.pp for c in configs}
    # the fixed cases name each network mistake: a NIC per GPU with 8 per node, one NIC per node (alone, then shared)
    assert [(c.network, c.dp_per_node, c.rings_per_nic) for c in configs[1:4]] == [
        ("nic-per-gpu", 8, 1), ("nic-per-node", 8, 1), ("nic-per-node", 1, 8)]
    assert {c.network for c in configs} == set(cluster.NETWORKS)
    one_node = configs[4]  # a one-node ring priced on `link` shows: link is a NIC, tp_link NVLink
    assert one_node.dp == one_node.dp_per_node > 1 and one_node.tp > 1 and one_node.link in cost.NETWORK_LINKS


def _margins(want, mistakes):
    """Each named mistake's relative distance from the right answer (0 where it does not apply)."""
    return [abs(value - want) / want if want else 0.0 for value, _ in mistakes]


def test_no_named_mistake_is_within_float32_rounding_of_the_answer():
    """The tolerance admits float32 (tests: the float32 references below pass); no named mistake may be that close
    in a fixed case, or a wrong answer could pass as float32 rounding: each is either exactly the answer there (it
    does not apply) or at least 5× the tolerance away."""
    for case in ch05._hierarchical_cases(random.Random(0))[:5]:
        want, _, mistakes = ch05._hierarchical_reference(*case)
        assert all(d < 1e-12 or d > 5 * ch05.REL_TOL for d in _margins(want, mistakes)), case
    for c in ch05.training_cases(random.Random(0))[:5]:
        t = cluster.step_time(c)
        assert all(d < 1e-12 or d > 5 * ch05.REL_TOL for d in _margins(t.total, ch05._step_mistakes(c, t))), c


def test_a_rejection_shows_the_digits_that_differ():
    with pytest.raises(ch05.Mismatch, match=r"= 0.0816771 s, expected 0.0816751 s \(\+2.4e-05 relative\)"):
        ch05._compare(0.0816771, 0.0816751, "x", [])
    ch05._compare(float(np.float32(0.0816751)), 0.0816751, "x", [])  # float32 rounding passes


# --- the tables: tests/test_checks_answers.py runs each once, tools/flake.py N times ------------------------------

COMPUTE_HINT, ALLREDUCE_HINT, TRAINING_HINT = "not the FP32 column", "2(m−1)/m·(S/g)/B", "nothing overlaps"
ANSWERS = [
    Reference(ch05.compute_seconds, compute_seconds),
    Mistake(ch05.compute_seconds, lambda *a: compute_seconds(*a, column="fp32_tflops"),
            match=r"16× too long: that is the FP32 column \(19.5 TFLOP/s .*312 TFLOP/s dense", hint=COMPUTE_HINT),
    Mistake(ch05.compute_seconds, lambda *a: compute_seconds(*a, flops_per_token=2),
            match="a third: 2·N·tokens is the forward pass only", hint=COMPUTE_HINT),
    Mistake(ch05.compute_seconds, lambda *a: compute_seconds(*a, use_mfu=False),
            match="the time at 100% of the peak: .* divide by mfu too", hint=COMPUTE_HINT),
    Mistake(ch05.compute_seconds, lambda *a: compute_seconds(*a, column="bf16_sparse_tflops"),
            match="the 2:4-sparse tensor figure", hint=COMPUTE_HINT),
    Mistake(ch05.compute_seconds, lambda *a: "slow", match="got str 'slow', expected a number", hint=COMPUTE_HINT),

    Reference(ch05.hierarchical_allreduce, hierarchical),
    Reference(ch05.hierarchical_allreduce, hierarchical32),
    *[Mistake(ch05.hierarchical_allreduce, lambda *a, m=mistake: hierarchical(*a, **m), match=match,
              hint=ALLREDUCE_HINT)
      for mistake, match in [
          (dict(flat=True), "that is one flat ring through all 64 GPUs at the NIC's speed, the time with one NIC per "
                            "node"),
          (dict(flat=False), "that is the hierarchical all-reduce of a NIC per GPU; with one NIC per node"),
          (dict(shard=False), "the full S crosses the nodes: after the reduce-scatter each GPU holds S/g, its 1/8 "
                              "shard"),
          (dict(nic_per_s=1e9), "100 Gb/s is gigabits per second: divide by 8 for bytes"),
          (dict(nvlink_per_s=1e9), "900 GB/s adds both directions of the H100 SXM's links; a ring sends one way, "
                                   "at 450 GB/s"),
          (dict(factor=False), r"the bandwidth terms lack \(k−1\)/k"),
          (dict(latency=False), "the latency is missing"),
          (dict(phases=PHASES[1:]), "a phase is missing: the reduce-scatter inside the node"),
          (dict(phases=PHASES[:2]), "a phase is missing: the reduce-scatter inside the node"),
          (dict(phases=PHASES[1:2]), "the phases inside the node are missing"),
          (dict(phases=PHASES[::2]), "the all-reduce across the nodes is missing"),
          (dict(across_all=True), "the ring across the nodes has one GPU of each node: m = 8 ranks, not all n = 64"),
          (dict(swap=True), "the links are swapped"),
      ]],
    Mistake(ch05.hierarchical_allreduce, lambda *a: hierarchical(*a, flat_factor=False),
            match=r"the bandwidth term is 2·S/B: a ring of n = 64", hint=ALLREDUCE_HINT),
    Mistake(ch05.hierarchical_allreduce, lambda *a: (1.0, 2.0, 3.0), match="got tuple", hint=ALLREDUCE_HINT),

    Reference(ch05.training_time, training_time),
    Reference(ch05.training_time, training_time32),
    *[Mistake(ch05.training_time, lambda c, m=mistake: training_time(c, **m), match=match, hint=TRAINING_HINT)
      for mistake, match in [
          (dict(overlap=True), r"max\(compute, communication\) assumes a perfect overlap"),
          (dict(tp_per_layer=0), "the TP all-reduces are missing: 4 per layer per micro-batch"),
          (dict(tp_per_layer=2), "half the TP all-reduce time: Megatron all-reduces twice forward and twice backward"),
          (dict(per_micro_batch=False), "the TP all-reduces counted once per step: .* of the 96 micro-batches"),
          (dict(shard_grads=False, stage_grads=False),
           r"the gradients of the whole model: with tp=8 and pp=8 each GPU holds N/\(tp·pp\)"),
          (dict(stage_grads=False), r"with pp=8 a GPU holds the gradients of its stage alone: N/\(tp·pp\), not N/tp"),
          (dict(stage_layers=False), "a stage holds n_layer/pp = 12 layers: its TP all-reduces are those of its"),
          (dict(bubble="none"), r"the pipeline bubble is missing: with p=8 stages and m=96 micro-batches each GPU "
                                r"idles \(p−1\)/m of its busy time"),
          (dict(bubble="share"), r"\(p−1\)/\(m\+p−1\) = 0.068 is the bubble's share of the whole pipelined step"),
          (dict(bubble="all"), "the gradient all-reduce happens once, after the pipeline has drained"),
          (dict(sends="none"), "the sends across the stage boundaries are missing"),
          (dict(sends="all"), "the sends of all 7 boundaries: they run on different stages at once"),
          (dict(swap=True), r"the links are swapped: gradients cross nodes over config.link \(rdma200\)"),
          (dict(per_day=3600), "the training = .* days: that is hours"),
          (dict(network="nic-per-node", shared=False),
           "that is one flat ring over the 64 dp ranks at one NIC's speed, the time with one NIC per node; with a NIC "
           "per GPU the all-reduce is hierarchical: .* g = config.dp_per_node = 8 GPUs"),
          (dict(network="nic-per-gpu"), "that is the hierarchical all-reduce of one NIC per GPU; this config has one "
                                        "NIC per node"),
          (dict(shared=False), r"the NIC is shared: config.rings_per_nic = 8 data-parallel rings"),
          (dict(node_on_link=True), r"all 4 dp ranks share one node of 8 GPUs: their ring runs on tp_link \(nvlink4\)"),
      ]],
    Mistake(ch05.training_time, lambda c: training_time(c)[0], match="expected a pair", hint=TRAINING_HINT),
    Mistake(ch05.training_time, comm_free, match="that is the compute alone", hint=TRAINING_HINT),
]


@pytest.mark.parametrize("check", [ch05.compute_seconds, ch05.hierarchical_allreduce, ch05.training_time])
def test_an_unwritten_answer_is_not_attempted(check, capsys):
    not_attempted(check, unwritten, capsys=capsys)
