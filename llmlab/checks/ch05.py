"""Checks for chapter 5's exercises (solutions/05_hardware.ipynb): a step's compute, its all-reduce, a run's days.

    from llmlab.checks import ch05 as check
    check.compute_seconds(compute_seconds)                           # 5.1
    check.hierarchical_allreduce(hierarchical_allreduce_time)        # 5.2
    check.training_time(training_time)                               # 5.3

Each check compares the learner's answer with llmlab's own (llmlab.flops, llmlab.hardware.cluster's all-reduce
phases and step_time) on the material's cases first — GPT-3 on 1024 A100s, a 7B model's gradients over H100 NVLink
and "100 Gbps RDMA" — then on fresh random ones. When an answer matches a known mistake it says so: the spec sheet's
FP32 column instead of bf16 dense, 2·N instead of 6·N, MFU left out; Gb/s read as GB/s, NVLink's total of both
directions used as one direction, the rings' (k−1)/k factors left out, the latency left out, a flat ring over the
NIC where each GPU has its own (or the reverse), the whole gradient sent across the nodes instead of one GPU's shard,
a ring across the nodes over every GPU, a phase or both of the node's left out, the links swapped; communication
assumed hidden behind compute, Megatron's TP all-reduces miscounted, the links swapped, a flat ring priced where each
GPU has a NIC of its own (or the reverse), one NIC's sharing left out, a ring inside one node priced on the NIC's
link; the pipeline's bubble left out or taken as a share of the busy time, put on the gradient all-reduce too, its
stage sends left out or summed over every boundary, a stage's TP all-reduces or gradients counted for the whole
model. Where one wrong answer fits two mistakes, both are named. An answer computed in float32 passes (the tolerance
is argued at REL_TOL).
"""

from __future__ import annotations

import math
import random

from llmlab import flops
from llmlab.checks import Hint, Mismatch, check, fresh_rng, number
from llmlab.dist import cost
from llmlab.hardware import SPECS, cluster
from llmlab.model import GPTConfig
from llmlab.parallel.pipeline import bubble_fraction

__all__ = ["compute_seconds", "hierarchical_allreduce", "training_time", "link_quote", "nvlink", "training_cases"]

# bytes per second, in one direction, that one unit of a quoted link figure stands for
_BYTES_PER_S = {"GB/s per direction": 1e9, "GB/s both directions": 0.5e9, "Gb/s per direction": 1e9 / 8}
_NODE_LINKS = ("nvlink4", "nvlink3", "pcie5", "pcie4")  # inside one 8-GPU node
_NETWORK_LINKS = ("rdma100", "rdma200", "ib_ndr400")  # across nodes
_ACCELERATORS = ("A100 SXM", "H100 SXM", "H100 PCIe", "H200 SXM", "B200", "MI250X", "MI250")
_HGX = ("A100 SXM", "H100 SXM", "H200 SXM", "B200")  # sold in 8-GPU NVLink (NVSwitch) nodes, a NIC per GPU


# float32 has eps = 1.19e-7: each rounded operation errs by at most eps/2 relative, and an answer here takes ~20
# multiplications, divisions and sums of positive terms (nothing cancels), so a float32 computation is within
# 20 · 6e-8 ≈ 1.2e-6 of the float64 one; 1e-5 leaves an 8× margin. Every named mistake differs by far more in at
# least one fixed case (tests/test_checks_ch05.py measures the margin): the smallest, 5.2's missing latency, is
# 1.5e-4 of the time in C15's case and most of it in the 4 MB case; 1e-15 s lets a 0 s all-reduce be 0
REL_TOL = 1e-5


def _close(got: float, want: float) -> bool:
    return math.isclose(got, want, rel_tol=REL_TOL, abs_tol=1e-15)


def _compare(got: float, want: float, what: str, mistakes: list[tuple[float, str]], unit: str = " s",
             split: str = "") -> None:
    """Pass if `got` is `want`; else raise Mismatch naming every mistake whose value `got` equals (`split`: what
    `want` is made of, shown after it)."""
    if _close(got, want):
        return
    known = [text for value, text in mistakes if _close(got, value)]
    off = f" ({got / want - 1:+.2g} relative)" if want and abs(got / want - 1) < 1e-3 else ""  # a near miss
    raise Mismatch(f"{what} = {got:.9g}{unit}, expected {want:.9g}{unit}{off}" + (f" ({split})" if split else "")
                   + (": " + " — or: ".join(known) if known else ""))


# --- 5.1: the compute time of a training step ------------------------------------------------------------------

@check("5.1", "compute time of a training step", hint=Hint(
    nudge="compare your FLOP count and the peak you divide by: which spec-sheet column does bf16 training run at?",
    idea="the step's FLOPs (forward and backward: 6 per parameter per token) over what the GPUs deliver: their "
         "count × the bf16 tensor-core peak × the MFU",
    formula="6·N·tokens FLOPs (forward 2·N per token, backward 4·N) over gpus × the bf16 dense tensor-core peak "
            "(SPECS[gpu].bf16_tflops × 1e12 FLOP/s, not the FP32 column) × mfu"))
def compute_seconds(fn):
    """`fn(n_params, tokens, gpus, gpu, mfu)`: seconds of arithmetic in one step (gpu a key of SPECS)."""

    rng = fresh_rng()
    gpt3 = cluster.PRESETS["gpt3-175b-1024xA100"]  # its mfu: the arithmetic's, fitted to Megatron's measured step
    cases = [(175e9, gpt3.batch_tokens, gpt3.gpus, gpt3.gpu, gpt3.mfu),  # GPT-3's step (3.1M tokens), 1024 A100s
             (7e9, 2**20, 64, "H100 SXM", 0.4),  # C15's step: a 7B model, 2^20 tokens, 64 H100s
             (1.3e9, 2**19, 1, "MI250X", 1.0)]  # one GPU at the peak
    cases += [(rng.uniform(1e8, 1e12), rng.choice([2**17, 2**19, 2**20, 2**22]) * rng.randint(1, 4),
               rng.choice([1, 8, 64, 512, 2048]), rng.choice(_ACCELERATORS), rng.uniform(0.25, 0.6))
              for _ in range(6)]
    for n_params, tokens, gpus, gpu, mfu in cases:
        what = f"compute_seconds(n_params={n_params:.4g}, tokens={tokens}, gpus={gpus}, gpu={gpu!r}, mfu={mfu:.3g})"
        got = number(fn(n_params, tokens, gpus, gpu, mfu), what)
        spec = SPECS[gpu]
        want = flops.training_days(flops.training_flops(n_params, tokens), gpus, spec.peak_flops("bf16"), mfu) \
            * flops.SECONDS_PER_DAY
        ratio = spec.bf16_tflops / spec.fp32_tflops
        mistakes = [
            (want * ratio, f"{ratio:.3g}× too long: that is the FP32 column ({spec.fp32_tflops:g} TFLOP/s on the SIMT "
                           f"cores, the one the material's table prints); training runs in bf16 on the tensor cores, "
                           f"{spec.bf16_tflops:g} TFLOP/s dense"),
            (want / 3, "a third: 2·N·tokens is the forward pass only; the backward pass costs twice the forward, so a "
                       "training step is 6·N·tokens"),
            (want / 6, "6× too short: a step is 6·N·tokens FLOPs, not N·tokens"),
            (want * mfu, f"that is the time at 100% of the peak: the GPUs reach mfu = {mfu:.3g} of it, so divide by "
                         "mfu too"),
            (want / 2, "half: that is the 2:4-sparse tensor figure, which dense training does not reach"),
            (want * 1e12, "1e12× too long: the spec sheet is in TFLOP/s, so multiply by 1e12 for FLOP/s"),
        ]
        _compare(got, want, what, mistakes)


# --- 5.2: a hierarchical all-reduce across nodes, from the spec sheets' figures ---------------------------------

def link_quote(key: str) -> tuple[float, str]:
    """How LINKS[key]'s bandwidth is quoted: (figure, unit). NVLink as spec sheets do (both directions added: 900
    GB/s for NVLink 4 = SPECS["H100 SXM"].link_gbs), networks as NICs are sold (Gb/s per direction), PCIe per
    direction in GB/s after the 128b/130b line code, from the lane rate (31.5 GB/s for 4.0 x16; GPU datasheets print
    the raw sum of both directions instead, 64 GB/s)."""

    if key not in cost.LINKS:
        raise ValueError(f"key={key!r} is not a link; choose from {', '.join(cost.LINKS)}")
    unit = "GB/s both directions" if key.startswith("nvlink") else \
        "Gb/s per direction" if key in _NETWORK_LINKS else "GB/s per direction"
    return round(1 / cost.LINKS[key].beta / _BYTES_PER_S[unit], 6), unit  # rounded: 900.0, not 900.0000000001


def nvlink(gpu: str) -> cost.Link:
    """The NVLink of an 8-GPU HGX/DGX node of `gpu` (a key of SPECS) as a cost.Link: β from the spec sheet's
    `link_gbs` (both directions of all links added, so half of it each way), α NCCL's NVLink latency."""

    if gpu not in _HGX:
        raise ValueError(f"gpu={gpu!r} is not one of the NVLink GPUs {', '.join(_HGX)}")
    spec = SPECS[gpu]
    return cost.Link(cost.LINKS["nvlink4"].alpha, 1 / (spec.link_gbs_per_direction * 1e9), spec.link, spec.source)


def _hierarchical_cases(rng: random.Random):
    """(nbytes, nodes, per_node, gpu, nic, network) of the 5.2 check: the material's and C15's first, then fresh."""

    gpt3 = cluster.PRESETS["gpt3-175b-1024xA100"]
    cases = [(14e9, 8, 8, "H100 SXM", "rdma100", "nic-per-gpu"),  # C15: a 7B model's bf16 gradients, 8 nodes of 8
             (14e9, 8, 8, "H100 SXM", "rdma100", "nic-per-node"),  # the same with one NIC per node: a flat ring
             (gpt3.n_params / (gpt3.tp * gpt3.pp) * 2, gpt3.dp, 1, gpt3.gpu, gpt3.link, "nic-per-gpu"),  # GPT-3's dp
             (14e9, 1, 8, "B200", "ib_ndr400", "nic-per-gpu"),  # the same in one node of B200s: no NIC on the way
             (4e6, 3, 4, "H200 SXM", "ib_ndr400", "nic-per-gpu")]  # 3 nodes of 4 GPUs, so few bytes latency counts
    for _ in range(8):
        nodes = rng.choice([1, 2, 2 * rng.randint(1, 31) + 1, rng.randint(64, 512)])  # odd: 3 … 63
        cases.append((10 ** rng.uniform(5, 11.6), nodes, rng.choice([1, 2, 4, 8]), rng.choice(_HGX),
                      rng.choice(_NETWORK_LINKS), rng.choice(list(cluster.NETWORKS))))
    return cases


def _hierarchical_reference(nbytes: float, nodes: int, per_node: int, gpu: str, nic_key: str, network: str):
    """(seconds, its phases in words, [(seconds with a plausible mistake, the mistake in words), ...]) of a case."""

    node, nic = nvlink(gpu), cost.LINKS[nic_key]
    g, m, n = per_node, nodes, nodes * per_node

    def phases(node=node, nic=nic, network=network):
        return cluster.allreduce_phases(nbytes, n, g, network, nic, node)

    def total(**links):
        return sum(phases(**links).values())

    def ring(size, k, link, passes=2, factor=True):  # passes 1: reduce-scatter or all-gather; 2: all-reduce
        return passes * ((k - 1) * link.alpha + ((k - 1) / k if factor else 1) * size * link.beta)

    p, other = phases(), next(key for key in cluster.NETWORKS if key != network)
    want = sum(p.values())
    split = " + ".join(f"{phase} {seconds:.6g} s" for phase, seconds in p.items())
    figure = SPECS[gpu].link_gbs
    mistakes = [
        (total(nic=nic._replace(beta=nic.beta / 8)), f"{link_quote(nic_key)[0]:g} Gb/s is gigabits per second: "
                                                     "divide by 8 for bytes"),
        (total(node=node._replace(beta=node.beta / 2)), f"{figure:g} GB/s adds both directions of the {gpu}'s "
                                                        f"links; a ring sends one way, at {figure / 2:g} GB/s"),
        (total(node=node._replace(alpha=0), nic=nic._replace(alpha=0)), "the latency is missing: every step of each "
                                                                        "ring costs α, (k−1) of them per pass"),
        (total(node=nic, nic=node), "the links are swapped: inside a node the GPUs talk over NVLink, across nodes "
                                    "over the NICs"),
    ]
    if m > 1 and network == "nic-per-node":
        mistakes += [
            (total(network=other), "that is the hierarchical all-reduce of a NIC per GPU; with one NIC per node "
                                   f"every step of one ring through all {n} GPUs waits for it"),
            (ring(nbytes, n, nic, factor=False), f"the bandwidth term is 2·S/B: a ring of n = {n} sends 2(n−1)/n·S "
                                                 "through each link (n−1 chunks of S/n per pass)"),
        ]
        return want, split, mistakes
    inside = ring(nbytes, g, node, passes=1)  # the reduce-scatter's time, the all-gather's too
    mistakes += [
        (2 * ring(nbytes, g, node, 1, factor=False) + ring(nbytes / g, m, nic, factor=False),
         "the bandwidth terms lack (k−1)/k: a ring pass on k GPUs sends k−1 chunks of size/k from each, "
         "(k−1)/k of the bytes — 2(k−1)/k for the all-reduce across the nodes"),
        (want - inside, "a phase is missing: the reduce-scatter inside the node before the ring across nodes and the "
                        "all-gather after it each take (g−1)·α′ + (g−1)/g·S/B′"),
        (want - 2 * inside, "the phases inside the node are missing: reduce-scatter there first, so that each GPU "
                            "holds S/g summed over its node, and all-gather at the end"),
    ]
    if m > 1:
        mistakes += [
            (total(network=other), f"that is one flat ring through all {n} GPUs at the NIC's speed, the time with one "
                                   "NIC per node; with a NIC per GPU reduce-scatter in the node, all-reduce each "
                                   "GPU's S/g across the nodes on its own NIC, all-gather"),
            (2 * inside + ring(nbytes, m, nic), f"the full S crosses the nodes: after the reduce-scatter each GPU "
                                                f"holds S/g, its 1/{g} shard, and only that goes on its NIC"),
            (2 * inside + ring(nbytes / g, n, nic), f"the ring across the nodes has one GPU of each node: m = {m} "
                                                    f"ranks, not all n = {n}"),
            (want - p["across nodes"], "the all-reduce across the nodes is missing: after the reduce-scatter each "
                                       "GPU's shard is summed over its own node only"),
        ]
    return want, split, mistakes


@check("5.2", "a hierarchical all-reduce across nodes", hint=Hint(
    nudge="price the phases one by one — reduce-scatter inside the node, the ring across the nodes, all-gather — "
          "and look at the bytes each moves and the units you turned each figure into",
    idea="inside a node the rings run on NVLink at half the spec sheet's figure (it adds both directions); after the "
         "reduce-scatter each GPU holds S/per_node, and only that shard crosses the network, on the GPU's own NIC, "
         "whose Gb/s are bits; with one NIC per node a single ring through every GPU waits on it at each step",
    formula="g = per_node, m = nodes, B′ = nvlink_gbs·1e9/2 and B = nic_gbps·1e9/8 bytes/s: t = 2·[(g−1)·α′ + "
            "(g−1)/g·S/B′] + 2(m−1)·α + 2(m−1)/m·(S/g)/B (reduce-scatter + ring across + all-gather); "
            "'nic-per-node' across nodes: one ring over n = g·m GPUs, 2(n−1)·α + 2(n−1)/n·S/B"))
def hierarchical_allreduce(fn):
    """`fn(nbytes, nodes, per_node, nvlink_gbs, nic_gbps, nvlink_alpha, nic_alpha, network)`: seconds of the
    all-reduce of `nbytes` on each GPU of `nodes` nodes of `per_node` GPUs."""

    for nbytes, nodes, per_node, gpu, nic_key, network in _hierarchical_cases(fresh_rng()):
        nic_gbps, nvlink_alpha, nic_alpha = link_quote(nic_key)[0], nvlink(gpu).alpha, cost.LINKS[nic_key].alpha
        what = (f"hierarchical_allreduce_time(nbytes={nbytes:.6g}, nodes={nodes}, per_node={per_node}, "
                f"nvlink_gbs={SPECS[gpu].link_gbs:g}, nic_gbps={nic_gbps:g}, nvlink_alpha={nvlink_alpha:g}, "
                f"nic_alpha={nic_alpha:g}, network={network!r}) [{gpu} nodes, {cost.LINKS[nic_key].name}]")
        got = number(fn(nbytes, nodes, per_node, SPECS[gpu].link_gbs, nic_gbps, nvlink_alpha, nic_alpha, network),
                     what)
        want, split, mistakes = _hierarchical_reference(nbytes, nodes, per_node, gpu, nic_key, network)
        _compare(got, want, what, mistakes, split=split)


# --- 5.3: a cluster's step time and training days -----------------------------------------------------------

def _compute_bound(config) -> bool:
    """Is every weight GEMM of `config` compute-bound on its GPU, so that step_time's rate is the bf16 peak?"""

    return math.isclose(cluster.step_time(config).attainable_flops, SPECS[config.gpu].peak_flops("bf16"),
                        rel_tol=1e-12)


def _random_config(rng: random.Random):
    shapes = [(32, 32, 4096), (40, 40, 5120), (60, 56, 7168), (80, 64, 8192), (96, 96, 12288)]
    n_layer, n_head, n_embd = rng.choice(shapes)  # every n_head divisible by every tp drawn below
    model = GPTConfig(vocab_size=rng.choice([32000, 50257]), block_size=rng.choice([2048, 4096]), n_layer=n_layer,
                      n_head=n_head, n_embd=n_embd, bias=False)
    dp, tp = rng.choice([2, 4, 16, 64, 256]), rng.choice([1, 2, 4, 8])  # dp divides into nodes of 8 at every tp
    pp = rng.choice([1, 2, 4, 8, 12])  # ≤ every n_layer drawn; 12 leaves a fraction of a layer per stage on average
    micro_batches = rng.choice([1, 2, 4, 8, 16])
    return cluster.ClusterConfig(
        model=model, tokens=rng.uniform(1e11, 2e12), batch_tokens=dp * micro_batches * rng.choice([2048, 4096, 8192]),
        gpu=rng.choice(_ACCELERATORS), gpus=dp * tp * pp, link=rng.choice(_NETWORK_LINKS + ("pcie5",)), dp=dp, tp=tp,
        pp=pp, micro_batches=micro_batches, tp_link=rng.choice(_NODE_LINKS), mfu=rng.uniform(0.3, 0.55),
        bytes_per_param=rng.choice([2, 4]), network=rng.choice(list(cluster.NETWORKS)))


def training_cases(rng: random.Random | None = None) -> list:
    """The ClusterConfigs the 5.3 check runs (every GEMM compute-bound): GPT-3 in Megatron's layout, dp 16 × tp 8 ×
    pp 8 on 1024 A100s (every part non-zero, first), C15's 7B step on 64 H100s, each with one NIC per GPU and with one
    per node, the 7B step as dp 4 × tp 2 in one node, whose `link` (its 100 Gb/s NIC) differs from its `tp_link`
    (NVLink 4, so a one-node ring priced on `link` shows), GPT-3 with 2 stages (one boundary each) and with none, then
    fresh random ones."""

    rng = rng or fresh_rng()
    gpt3 = cluster.preset("gpt3-175b-1024xA100")
    cases = [gpt3, cluster.preset("7b-64xH100"), cluster.preset("7b-64xH100", network="nic-per-node"),
             gpt3.with_(network="nic-per-node"), cluster.preset("7b-64xH100", gpus=8, dp=4, tp=2),
             gpt3.with_(dp=64, pp=2, micro_batches=24), gpt3.with_(dp=128, pp=1, micro_batches=12)]
    while len(cases) < 13:
        config = _random_config(rng)
        if _compute_bound(config):  # else step_time's rate is below the peak the exercise text prices it at
            cases.append(config)
    return cases


def _describe(c) -> str:
    return (f"{c.n_params / 1e9:.3g}B parameters on {c.gpus}× {c.gpu} (dp={c.dp} over {c.link}, {c.network}, "
            f"{c.dp_per_node} per node of {c.gpus_per_node}; tp={c.tp} over {c.tp_link}; pp={c.pp}), {c.batch_tokens} "
            f"tokens per "
            f"step in {c.micro_batches} micro-batch(es), mfu={c.mfu:.3g}, {c.bytes_per_param}-byte gradients, "
            f"{c.tokens:.3g} tokens")


def _step_mistakes(c, t) -> list[tuple[float, str]]:
    """What a step time with one of the plausible mistakes comes to, and the mistake in words."""

    link = cost.LINKS[c.link]
    grads = c.n_params / (c.tp * c.pp) * c.bytes_per_param

    def with_dp_of(nbytes):  # the step with the DP all-reduce of `nbytes` in place of a GPU's gradients
        return t.total - t.dp_allreduce + cluster.allreduce_time(nbytes, c.dp, c.dp_per_node, c.network, c.link,
                                                                 c.tp_link, c.rings_per_nic)

    def with_tp(seconds):  # the step with `seconds` of TP all-reduce in place of the right ones (the bubble grows)
        return t.total + (seconds - t.tp_allreduce) / (1 - bubble_fraction(c.pp, c.micro_batches))

    swapped = cluster.step_time(c.with_(link=c.tp_link, tp_link=c.link)).total
    flat = cost.ring_allreduce_time(grads, c.dp, link.alpha, link.beta)  # one ring at one NIC's full speed
    rest = t.total - t.dp_allreduce  # the step without its DP all-reduce
    mistakes = [
        (t.compute, "that is the compute alone: this model overlaps nothing, so the DP and TP all-reduces (and the "
                    "pipeline's sends and bubble) add to it"),
        (max(t.compute, t.comm), "max(compute, communication) assumes a perfect overlap; the library's model "
                                 "(no overlap) adds them"),
        (with_tp(0), "the TP all-reduces are missing: 4 per layer per micro-batch"),
        (t.total - t.dp_allreduce, "the gradient all-reduce over the dp ranks is missing"),
        (with_tp(t.tp_allreduce / 2), "half the TP all-reduce time: Megatron all-reduces twice forward and twice "
                                      "backward per layer, 4 in all"),
        (with_tp(t.tp_allreduce / c.micro_batches),
         f"the TP all-reduces counted once per step: they happen in every one of the {c.micro_batches} micro-batches"),
        (with_dp_of(c.n_params * c.bytes_per_param), f"the gradients of the whole model: with tp={c.tp} and "
                                                     f"pp={c.pp} each GPU holds N/(tp·pp) of them, and only those "
                                                     "cross the dp ring"),
        (swapped, f"the links are swapped: gradients cross nodes over config.link ({c.link}), the TP all-reduces "
                  f"stay in the node on config.tp_link ({c.tp_link})"),
    ]
    if c.pp > 1:
        mistakes += _pipeline_mistakes(c, t, with_dp_of, with_tp)
    if c.dp == c.dp_per_node:
        mistakes.append((rest + flat, f"all {c.dp} dp ranks share one node of {c.gpus_per_node} GPUs: their ring runs "
                                      f"on tp_link ({c.tp_link}), no NIC is on the way"))
    elif c.network == "nic-per-gpu":
        mistakes.append((rest + flat, f"that is one flat ring over the {c.dp} dp ranks at one NIC's speed, the time "
                                      "with one NIC per node; with a NIC per GPU the all-reduce is hierarchical: "
                                      f"reduce-scatter over the g = config.dp_per_node = {c.dp_per_node} GPUs of a "
                                      f"node on tp_link, a ring all-reduce of S/g across the {c.dp // c.dp_per_node} "
                                      "nodes on link, all-gather on tp_link"))
    else:
        mistakes.append((rest + cluster.step_time(c.with_(network="nic-per-gpu")).dp_allreduce,
                         "that is the hierarchical all-reduce of one NIC per GPU; this config has one NIC per node "
                         "(config.network = 'nic-per-node'): one ring over the dp ranks through it"))
        if c.rings_per_nic > 1:
            mistakes.append((rest + flat, f"the NIC is shared: config.rings_per_nic = {c.rings_per_nic} data-parallel "
                                          "rings (one per tensor-parallel rank in the node) cross the node's one NIC "
                                          "at once, so each gets 1/r of its bandwidth"))
    return mistakes


def _pipeline_mistakes(c, t, with_dp_of, with_tp) -> list[tuple[float, str]]:
    """The step with one of the plausible pipeline mistakes (c.pp > 1), and the mistake in words."""

    link = cost.LINKS[c.link]
    f = bubble_fraction(c.pp, c.micro_batches)  # the bubble's share of the pipelined step, (p−1)/(m+p−1)
    busy = t.compute + t.tp_allreduce + t.pp_send
    message = c.micro_batches * (link.alpha + c.micro_tokens * c.model.n_embd * c.bytes_per_activation * link.beta)
    mistakes = [
        (t.total - t.pp_bubble, f"the pipeline bubble is missing: with p={c.pp} stages and m={c.micro_batches} "
                                "micro-batches each GPU idles (p−1)/m of its busy time"),
        (t.total - t.pp_bubble + busy * f, f"(p−1)/(m+p−1) = {f:.3g} is the bubble's share of the whole pipelined "
                                           "step, busy time included; of the busy time alone it is (p−1)/m"),
        (t.total + t.dp_allreduce * f / (1 - f), "the gradient all-reduce happens once, after the pipeline has "
                                                 "drained: no bubble on it"),
        (t.total - t.pp_send / (1 - f), "the sends across the stage boundaries are missing: every micro-batch's "
                                        "activation goes forward and its gradient back"),
        (t.total + (2 * (c.pp - 1) * message - t.pp_send) / (1 - f),
         f"the sends of all {c.pp - 1} boundaries: they run on different stages at once; the step waits for the "
         "busiest stage's, a middle stage's two boundaries"),
        (with_tp(t.tp_allreduce * c.pp), f"a stage holds n_layer/pp = {c.model.n_layer / c.pp:g} "
                                                          "layers: its TP all-reduces are those of its layers alone"),
        (with_dp_of(c.n_params / c.tp * c.bytes_per_param), f"with pp={c.pp} a GPU holds the gradients of its "
                                                            "stage alone: N/(tp·pp), not N/tp"),
    ]
    return mistakes


@check("5.3", "step time and training days of a cluster", hint=Hint(
    nudge="compute the parts of the step on their own — compute, the data-parallel all-reduce, the "
          "tensor-parallel all-reduces, the pipeline's sends and bubble — and see which one differs",
    idea="the pipeline's busy time is compute + TP all-reduces + stage sends; the bubble idles (p−1)/m of it; the "
         "DP all-reduce comes after, and its time depends on how its ranks sit on nodes and NICs; the TP all-reduces "
         "happen 4 times per layer of a stage per micro-batch, and days follow from the number of steps",
    formula="step = busy · (1 + (p−1)/m) + DP all-reduce (nothing overlaps), busy = compute + TP + PP send: compute "
            "= 6·N·batch_tokens / (gpus · bf16 peak · mfu); DP = all-reduce of S = N/(tp·pp) × bytes_per_param "
            "bytes over the dp ranks, "
            "g = config.dp_per_node in each of m = dp/g nodes: one node → a ring on tp_link; 'nic-per-gpu' → "
            "reduce-scatter and all-gather over g on tp_link + a ring of S/g over m on link; 'nic-per-node' → one "
            "ring over dp on link with β × config.rings_per_nic; TP = 4 · (n_layer/pp) · micro_batches rings over tp "
            "ranks on config.tp_link of A = micro_tokens × n_embd × bytes_per_activation bytes; PP send = 2 · "
            "min(2, p−1) · micro_batches messages of A on link, α + A·β each; days = (tokens / "
            "batch_tokens) · step / 86,400"))
def training_time(fn):
    """`fn(config)` for a ClusterConfig: (seconds per step, days of training)."""

    for c in training_cases():
        what = f"training_time({_describe(c)})"
        answer = fn(c)
        if not isinstance(answer, tuple | list) or len(answer) != 2:
            raise Mismatch(f"{what} returned {answer!r}; expected a pair (seconds per step, days)")
        step, days = number(answer[0], f"{what}'s step time"), number(answer[1], f"{what}'s days")
        t = cluster.step_time(c)
        _compare(step, t.total, f"{what}: the step", _step_mistakes(c, t))
        _compare(days, t.days, f"{what}: the training", [
            (t.days * 24, "that is hours: a day has 24 h (86,400 s)"),
            (t.days * flops.SECONDS_PER_DAY, "that is seconds: divide by 86,400 for days"),
            (t.days * c.batch_tokens, "steps = tokens / batch_tokens: you counted a step per token"),
            (t.days * c.gpus, "that is GPU-days (× gpus); the run's wall-clock days are steps × step / 86,400"),
        ], unit=" days")
