"""Checks for chapter 5's exercises (solutions/05_hardware.ipynb): a step's compute, its all-reduce, a run's days.

    from llmlab.checks import ch05 as check
    check.compute_seconds(compute_seconds)                  # 5.1
    check.allreduce_seconds(gradient_allreduce_seconds)     # 5.2
    check.training_time(training_time)                      # 5.3

Each check compares the learner's answer with llmlab's own (llmlab.flops, llmlab.dist.cost's α-β model,
llmlab.hardware.cluster.step_time) on the material's cases first — GPT-3 on 1024 A100s, a 7B model over "A100 NVLink
600 GB/s" and "100 Gbps RDMA" — then on fresh random ones. When an answer matches a known mistake it says so: the
spec sheet's FP32 column instead of bf16 dense, 2·N instead of 6·N, MFU left out; Gb/s read as GB/s, NVLink's
total of both directions used as one direction, a per-direction figure halved, the ring's 2(n−1)/n factor left out,
the wrong bytes per gradient; communication assumed hidden behind compute, Megatron's TP all-reduces miscounted,
the links swapped, a flat ring priced where each GPU has a NIC of its own (or the reverse), one NIC's sharing left
out, a ring inside one node priced on the NIC's link; the pipeline's bubble left out or taken as a share of the busy
time, put on the gradient all-reduce too, its stage sends left out or summed over every boundary, a stage's TP
all-reduces or gradients counted for the whole model. Where one wrong answer fits two mistakes (it can, e.g. fp32
gradients counted as bf16 over a quoted bidirectional link), both are named. An answer computed in float32 passes
(the tolerance is argued at REL_TOL).
"""

from __future__ import annotations

import math
import random

import torch

from llmlab import flops
from llmlab.checks import Hint, Mismatch, check, fresh_rng, number
from llmlab.dist import cost
from llmlab.hardware import SPECS, cluster
from llmlab.model import GPTConfig
from llmlab.parallel.pipeline import bubble_fraction

__all__ = ["compute_seconds", "allreduce_seconds", "training_time", "UNITS", "link_quote", "training_cases"]

# bytes per second, in one direction, that one unit of a quoted link figure stands for
_BYTES_PER_S = {"GB/s per direction": 1e9, "GB/s both directions": 0.5e9, "Gb/s per direction": 1e9 / 8}
UNITS = tuple(_BYTES_PER_S)
_NODE_LINKS = ("nvlink4", "nvlink3", "pcie5", "pcie4")  # inside one 8-GPU node
_NETWORK_LINKS = ("rdma100", "rdma200", "ib_ndr400")  # across nodes
_ACCELERATORS = ("A100 SXM", "H100 SXM", "H100 PCIe", "H200 SXM", "B200", "MI250X", "MI250")


# float32 has eps = 1.19e-7: each rounded operation errs by at most eps/2 relative, and an answer here takes ~20
# multiplications, divisions and sums of positive terms (nothing cancels), so a float32 computation is within
# 20 · 6e-8 ≈ 1.2e-6 of the float64 one; 1e-5 leaves an 8× margin. Every named mistake differs by far more in at
# least one fixed case (tests/test_checks_ch05.py measures the margin): the smallest, 5.2's missing latency, is
# 1.0e-4 of the time in the material's NVLink case and about a third of it in the 1M-parameter case; 1e-15 s lets a
# 0 s all-reduce be 0
REL_TOL = 1e-5


def _close(got: float, want: float) -> bool:
    return math.isclose(got, want, rel_tol=REL_TOL, abs_tol=1e-15)


def _compare(got: float, want: float, what: str, mistakes: list[tuple[float, str]], unit: str = " s") -> None:
    """Pass if `got` is `want`; else raise Mismatch naming every mistake whose value `got` equals."""
    if _close(got, want):
        return
    known = [text for value, text in mistakes if _close(got, value)]
    off = f" ({got / want - 1:+.2g} relative)" if want and abs(got / want - 1) < 1e-3 else ""  # a near miss
    raise Mismatch(f"{what} = {got:.9g}{unit}, expected {want:.9g}{unit}{off}" + (": " + " — or: ".join(known)
                                                                                  if known else ""))


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


# --- 5.2: the gradient all-reduce over a link, from the vendor's figure ---------------------------------------

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


def _allreduce_cases(rng: random.Random):
    cases = [(7e9, torch.bfloat16, 8, "nvlink3"),  # the material's "A100 NVLink 600 GB/s", one node
             (7e9, torch.bfloat16, 64, "rdma100"),  # its "at least 100 Gbps RDMA", 8 nodes (C15)
             (1.3e9, torch.bfloat16, 8, "pcie4"),  # a figure already per direction: halving it is a mistake
             (1e6, torch.float32, 16, "ib_ndr400"),  # 4-byte gradients; so few bytes that latency is a third
             (1.3e9, torch.float32, 1, "ib_ndr400")]  # one rank: nothing to send
    for _ in range(8):
        key = rng.choice(_NODE_LINKS + _NETWORK_LINKS)
        n = rng.randint(2, 8) if key in _NODE_LINKS else rng.choice([2, rng.randint(3, 64), rng.randint(65, 2048)])
        cases.append((float(rng.randint(10**8, 2 * 10**11)), rng.choice([torch.bfloat16, torch.float16,
                                                                        torch.float32]), n, key))
    return cases


def _allreduce_reference(n_params: float, dtype, n: int, bandwidth: float, unit: str, alpha: float):
    """(seconds, [(seconds with a plausible mistake, the mistake in words), ...]) of one 5.2 case."""

    size, per_s = dtype.itemsize, bandwidth * _BYTES_PER_S[unit]  # bytes per element; bytes/s in one direction

    def ring(nbytes=n_params * size, bytes_per_s=per_s):
        return cost.ring_allreduce_time(nbytes, n, alpha, 1 / bytes_per_s)

    want, latency = ring(), cost.ring_allreduce_time(0, n, alpha, 0)
    mistakes = [(ring(n_params * wrong), f"the gradients are {dtype}: {size} bytes per element, not {wrong}")
                for wrong in (2, 4) if wrong != size]
    if unit.startswith("Gb/s"):
        mistakes.append((ring(bytes_per_s=8 * per_s), f"{bandwidth:g} Gb/s is gigabits per second: divide by 8 "
                                                      f"for bytes ({bandwidth:g} Gb/s = {bandwidth / 8:g} GB/s)"))
    if unit.endswith("both directions"):
        mistakes.append((ring(bytes_per_s=2 * per_s), f"{bandwidth:g} GB/s adds both directions; in a ring "
                                                      f"each link carries one direction's traffic, at "
                                                      f"{bandwidth / 2:g} GB/s"))
    if unit == "GB/s per direction":
        mistakes.append((ring(bytes_per_s=per_s / 2), f"{bandwidth:g} GB/s is already one direction's bandwidth "
                                                      "(unit 'GB/s per direction'): only a figure of both "
                                                      "directions is halved"))
    mistakes += [
        (latency + n_params * size / per_s, "the bandwidth term is S/B: a ring all-reduce sends 2(n−1)/n · S per "
                                            "rank (n−1 chunks of S/n in each of its two phases)"),
        (latency + 2 * n_params * size / per_s, "the bandwidth term is 2·S/B: the factor is 2(n−1)/n, which only "
                                                "approaches 2 for large n"),
        (want - latency, f"the latency is missing: 2(n−1) = {2 * (n - 1)} messages of α = {alpha:g} s each"),
        (ring(bytes_per_s=per_s / 1e9), "a GB is 1e9 bytes (a Gb 1e9 bits): convert the figure to bytes per second"),
    ]
    return want, mistakes


@check("5.2", "gradient all-reduce time over a link", hint=Hint(
    nudge="look at the bytes and the bandwidth you use: in which units, and in one direction or both?",
    idea="turn the gradient into bytes and the link's figure into bytes per second in one direction, then use the "
         "ring all-reduce's α-β time: 2(n−1) steps of S/n bytes",
    formula="S = n_params × grad_dtype.itemsize bytes; B = the bandwidth of one direction in bytes/s (Gb/s ÷ 8 → "
            "GB/s; a figure of both directions ÷ 2; GB/s × 1e9); ring all-reduce: 2(n−1)·α + 2(n−1)/n · S/B"))
def allreduce_seconds(fn):
    """`fn(n_params, grad_dtype, n, bandwidth, unit, alpha)`: seconds of a ring all-reduce of the gradients."""

    for n_params, dtype, n, key in _allreduce_cases(fresh_rng()):
        bandwidth, unit = link_quote(key)
        alpha = cost.LINKS[key].alpha
        what = (f"gradient_allreduce_seconds(n_params={n_params:.4g}, grad_dtype={dtype}, n={n}, "
                f"bandwidth={bandwidth:g}, unit={unit!r}, alpha={alpha:g}) [{cost.LINKS[key].name}]")
        got = number(fn(n_params, dtype, n, bandwidth, unit, alpha), what)
        want, mistakes = _allreduce_reference(n_params, dtype, n, bandwidth, unit, alpha)
        _compare(got, want, what, mistakes)


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
