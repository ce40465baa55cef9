"""The cluster calculator: how long one training step takes on a cluster, split into compute and communication.

For a model (a `GPTConfig`), a global batch of `batch_tokens` tokens per step, `gpus` GPUs of one spec-sheet type and
a parallel layout dp × tp × pp (data, Megatron tensor, pipeline; dp·tp·pp = gpus), one step costs

    compute        6·N·batch_tokens / (gpus · rate)            rate = mfu × the roofline's attainable FLOP/s of the
                                                               layer's weight GEMMs on one GPU (the bf16 peak once
                                                               they are compute-bound, which big ones are)
    dp all-reduce  all-reduce of the gradients one GPU holds, N/(tp·pp) × bytes_per_param, over the dp ranks,
                   as the cluster's `network` allows (below)
    tp all-reduce  4 per layer per micro-batch (Megatron: 2 forward, 2 backward) of the (micro_tokens, n_embd)
                   activations, ring over tp ranks, for the n_layer/pp layers of one stage
    pp send        activations (forward) and their gradients (backward) across each stage boundary, one message each
    pp bubble      the idle share of a GPipe / 1F1B pipeline: (p−1)/(m+p−1) of the step, i.e. (p−1)/m × the busy time

Every collective is priced by `llmlab.dist.cost`'s α-β model over a link of `cost.LINKS`: `link` carries what crosses
nodes (data-parallel gradients, pipeline activations), `tp_link` what stays inside one (tensor parallelism, and the
in-node phases of the hierarchical all-reduce). Nothing is assumed to overlap, so the total is an upper bound as far
as overlap goes (`StepTime.comm_hidden` says what overlap could hide at best); the links run at line rate, the least
a transfer can take, so the total is an estimate, not a bound either way. `mfu` is the efficiency of the arithmetic
alone; the end-to-end MFU (`StepTime.mfu`) adds communication and bubble. A published end-to-end figure (throughput
measured over whole steps) is not an `mfu`: `arithmetic_mfu` finds the `mfu` that reproduces it.

The network across nodes (`network`, a key of `NETWORKS`; `allreduce_time` prices a data-parallel group of n GPUs,
g of them in each node, m = n/g nodes, S bytes of gradient on each GPU):

    "nic-per-node"  one NIC per node. One ring through all n GPUs, entering and leaving each node once: every step
                    of the ring waits for its slowest hop, the NIC, and each hop carries 2(n−1)/n·S, so
                    t = 2(n−1)·α + 2(n−1)/n·S·β·r, with r the rings of concurrent data-parallel groups (one per
                    tensor-parallel rank in a node) that share the one NIC.
    "nic-per-gpu"   one NIC per GPU on its own rail, as in DGX/HGX A100 and H100 nodes (8 GPUs, 8 NICs).
                    Hierarchical: reduce-scatter inside the node over `tp_link` (each GPU then holds S/g summed
                    over its node), ring all-reduce of that S/g across the m nodes on each GPU's own NIC (g rings
                    side by side, one per NIC), all-gather inside the node:
                    t = 2·[(g−1)·α' + (g−1)/g·S·β'] + 2(m−1)·α + 2(m−1)/m·(S/g)·β.
                    With g = 1 it is the flat ring; with one node (m = 1) both are a ring inside the node.

NCCL does not run these three phases by name, but its rings put the same S/g on each NIC: it builds one ring (and
tree) per NIC and keeps each on its own NIC from node to node ("NCCL tries to use the same NICs when communicating
between nodes, to allow for a network design where each NIC on a node connects to a different network switch
(network rail)": NCCL user guide, Environment Variables, NCCL_CROSS_NIC,
https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-cross-nic); it splits the data over them
through NVLink, which pays only when NVLink is at least as fast as the NICs together (S. Jeaugey, NCCL maintainer,
https://github.com/NVIDIA/nccl/issues/412 and /issues/601). The hierarchical scheme itself is Jia et al. 2018,
"Highly Scalable Deep Learning Training System with Mixed-Precision" (arXiv:1807.11205), and Horovod's
HOROVOD_HIERARCHICAL_ALLREDUCE. A flat ring over one NIC per node is what the same GPUs would get with a single NIC.

    from llmlab.hardware import cluster
    t = cluster.step_time(cluster.PRESETS["gpt3-175b-1024xA100"])
    t.compute, t.comm, t.days, t.gpu_hours
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from llmlab import flops, validation
from llmlab.dist import cost
from llmlab.hardware import roofline
from llmlab.hardware.specs import SPECS
from llmlab.memory.planner import num_params
from llmlab.model import GPTConfig
from llmlab.parallel.pipeline import bubble_fraction

__all__ = ["ClusterConfig", "StepTime", "PRESETS", "NETWORKS", "MEGATRON_GPT3", "preset", "step_time",
           "allreduce_time", "allreduce_phases", "link_step_times", "network_step_times", "arithmetic_mfu",
           "step_from_throughput", "TP_ALLREDUCES_PER_LAYER"]

TP_ALLREDUCES_PER_LAYER = 4  # Megatron-LM: attention and MLP each all-reduce once forward (g) and once backward (f)

# the networks across nodes `allreduce_time` prices (see the module docstring), key → name
NETWORKS = {"nic-per-gpu": "one NIC per GPU (hierarchical)", "nic-per-node": "one NIC per node (flat ring)"}


def _finite(name: str, value, low: float = 0, *, above: bool = True) -> float:
    """`value` as a finite real number > low (>= low with above=False), else ValueError naming it."""
    if above:
        validation.number(name, value, above=low)
    else:
        validation.number(name, value, low=low)
    if math.isinf(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    return value


def _link(name: str, key) -> str:
    return validation.one_of(name, key, cost.LINKS, hint="(a key of llmlab.dist.cost.LINKS)")


def _config(config) -> ClusterConfig:
    if not isinstance(config, ClusterConfig):
        raise ValueError(f"config={config!r:.80} must be a ClusterConfig (e.g. cluster.preset('7b-64xH100'))")
    return config


@dataclass(frozen=True)
class ClusterConfig:
    """One training run on one cluster (see the module docstring for what each part costs). The layout must fit
    the nodes: gpus_per_node divides gpus (or one node holds them all), and tp divides gpus_per_node, so that a
    tensor-parallel group sits inside one node and its all-reduces run on tp_link."""

    model: GPTConfig
    tokens: float  # training tokens in all
    batch_tokens: int  # global batch per optimizer step, in tokens
    gpu: str  # a key of llmlab.hardware.SPECS
    gpus: int
    link: str  # a key of llmlab.dist.cost.LINKS: data-parallel and pipeline traffic (across nodes)
    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batches: int = 1  # per data-parallel rank and step (pipeline micro-batches or accumulation steps)
    tp_link: str = "nvlink4"  # inside one node: tensor-parallel traffic, the data-parallel phases inside a node
    mfu: float = 0.4  # fraction of the attainable FLOP/s the arithmetic reaches
    bytes_per_param: int = 2  # gradients in bf16
    bytes_per_activation: int = 2  # activations in bf16
    network: str = "nic-per-gpu"  # a key of NETWORKS: how the nodes reach the network
    gpus_per_node: int = 8  # DGX/HGX nodes

    def __post_init__(self):
        if not isinstance(self.model, GPTConfig):
            raise ValueError(f"model={self.model!r} must be a GPTConfig")
        if self.gpu not in SPECS:
            raise ValueError(f"gpu={self.gpu!r} is not on the spec sheet; choose from {', '.join(SPECS)}")
        for name in ("link", "tp_link"):
            _link(name, getattr(self, name))
        validation.one_of("network", self.network, NETWORKS)
        for name in ("gpus", "dp", "tp", "pp", "micro_batches", "batch_tokens", "bytes_per_param",
                     "bytes_per_activation", "gpus_per_node"):
            validation.integer(name, getattr(self, name), low=1)
        if self.dp * self.tp * self.pp != self.gpus:
            raise ValueError(f"dp·tp·pp = {self.dp}·{self.tp}·{self.pp} = {self.dp * self.tp * self.pp} "
                             f"!= gpus={self.gpus}")
        if self.model.n_head % self.tp:
            raise ValueError(f"tp={self.tp} does not divide n_head={self.model.n_head}")
        if self.pp > self.model.n_layer:
            raise ValueError(f"pp={self.pp} > n_layer={self.model.n_layer}: a stage needs at least one layer")
        if self.batch_tokens % (self.dp * self.micro_batches):
            raise ValueError(f"batch_tokens={self.batch_tokens} is not divisible by dp·micro_batches = "
                             f"{self.dp}·{self.micro_batches}")
        node = min(self.gpus, self.gpus_per_node)  # a job smaller than a node uses part of one
        if self.gpus % node:
            raise ValueError(f"gpus_per_node={self.gpus_per_node} does not divide gpus={self.gpus}: the nodes would "
                             "not all be full")
        if node % self.tp:
            raise ValueError(f"tp={self.tp} does not divide gpus_per_node={self.gpus_per_node}: a tensor-parallel "
                             "group must sit inside one node, whose link (tp_link) carries its all-reduces")
        if self.dp % self.dp_per_node:
            raise ValueError(f"dp={self.dp} data-parallel ranks do not fill nodes of gpus_per_node="
                             f"{self.gpus_per_node} evenly: {self.dp_per_node} of them share a node at tp={self.tp}")
        _finite("tokens", self.tokens)
        validation.number("mfu", self.mfu, above=0, high=1, hint="(a fraction of the attainable FLOP/s)")

    @property
    def dp_per_node(self) -> int:
        """g: the ranks of one data-parallel group inside one node. Megatron numbers ranks tensor-parallel first,
        then data-parallel, so a node of G GPUs holds G/tp consecutive data-parallel ranks (1 once tp fills it)."""
        return min(self.dp, max(1, self.gpus_per_node // self.tp))

    @property
    def rings_per_nic(self) -> int:
        """r: the data-parallel groups whose all-reduces cross one NIC at once — every group with a GPU in the node
        under "nic-per-node" (one per tensor-parallel rank there), 1 under "nic-per-gpu"."""
        if self.network == "nic-per-gpu":
            return 1
        return max(1, min(self.gpus, self.gpus_per_node) // self.dp_per_node)

    @property
    def n_params(self) -> int:
        return num_params(self.model)

    @property
    def micro_tokens(self) -> int:
        """Tokens of one micro-batch on one data-parallel rank."""
        return self.batch_tokens // (self.dp * self.micro_batches)

    @property
    def steps(self) -> float:
        return self.tokens / self.batch_tokens

    def with_(self, **changes) -> ClusterConfig:
        """This config with some fields changed (checked again)."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"{sorted(unknown)} are not ClusterConfig fields")
        return replace(self, **changes)


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step by part, and what they add up to over the run."""

    config: ClusterConfig
    compute: float
    dp_allreduce: float
    tp_allreduce: float
    pp_send: float
    pp_bubble: float
    attainable_flops: float  # the roofline's FLOP/s for the layer's GEMMs on one GPU (before mfu)

    @property
    def comm(self) -> float:
        return self.dp_allreduce + self.tp_allreduce + self.pp_send

    @property
    def total(self) -> float:
        return self.compute + self.comm + self.pp_bubble

    @property
    def comm_hidden(self) -> float:
        """The most a perfect overlap of communication with compute could save per step."""
        return min(self.comm, self.compute)

    @property
    def days(self) -> float:
        return self.config.steps * self.total / flops.SECONDS_PER_DAY

    @property
    def gpu_hours(self) -> float:
        return self.config.steps * self.total * self.config.gpus / 3600

    @property
    def mfu(self) -> float:
        """End-to-end model-FLOPs utilisation: 6·N·batch_tokens per step over the GPUs' bf16 peak."""
        c = self.config
        return flops.mfu(flops.training_flops(c.n_params, c.batch_tokens), self.total, c.gpus,
                         SPECS[c.gpu].peak_flops("bf16"))

    def parts(self) -> dict[str, float]:
        return {"compute": self.compute, "DP all-reduce": self.dp_allreduce, "TP all-reduce": self.tp_allreduce,
                "PP send": self.pp_send, "PP bubble": self.pp_bubble}


def _attainable(c: ClusterConfig) -> float:
    """FLOP/s the roofline allows one layer's weight GEMMs on one GPU: total FLOPs / total time, each GEMM at
    min(peak, intensity × bandwidth). Column-parallel GEMMs (qkv, mlp up) are split along n, row-parallel ones
    (attn out, mlp down) along k, as Megatron splits them."""
    spec = SPECS[c.gpu]
    peak, bandwidth = spec.peak_flops("bf16"), spec.hbm_gbs * 1e9
    work = seconds = 0.0
    for p in roofline.model_gemms(c.model, c.micro_tokens, c.bytes_per_activation):
        column = p.label.startswith(("qkv", "mlp up"))
        n, k = (p.n // c.tp, p.k) if column else (p.n, p.k // c.tp)
        f = roofline.gemm_flops(p.m, n, k)
        work += f
        seconds += f / roofline.attainable(roofline.gemm_intensity(p.m, n, k, p.bytes_per_element), peak, bandwidth)
    return work / seconds


def allreduce_time(nbytes: float, n: int, per_node: int, network: str, link: str, node_link: str = "nvlink4",
                   rings_per_nic: int = 1) -> float:
    """Seconds to all-reduce `nbytes` held by each of `n` GPUs, `per_node` of them in each node, across nodes on
    `link` and inside them on `node_link` (keys of cost.LINKS), for `network` (a key of NETWORKS; the formulas are
    in the module docstring). `rings_per_nic`: the rings that share one NIC under "nic-per-node"."""
    nic, node = cost.LINKS[_link("link", link)], cost.LINKS[_link("node_link", node_link)]
    return sum(allreduce_phases(nbytes, n, per_node, network, nic, node, rings_per_nic).values())


def allreduce_phases(nbytes: float, n: int, per_node: int, network: str, nic: cost.Link, node: cost.Link,
                     rings_per_nic: int = 1) -> dict[str, float]:
    """`allreduce_time` phase by phase, over links given by their α and β (`cost.Link`s, e.g. one made from a spec
    sheet's figure): {"reduce-scatter", "across nodes", "all-gather": seconds} for the hierarchical all-reduce of
    "nic-per-gpu" across nodes, {"flat ring": seconds} for "nic-per-node"'s, {"ring in the node": seconds} in one
    node under either."""
    _finite("nbytes", nbytes, above=False)
    validation.one_of("network", network, NETWORKS)
    validation.integer("n", n, low=1, hint="(the ranks of the all-reduce)")
    validation.integer("per_node", per_node, low=1, hint="(its ranks in one node)")
    validation.integer("rings_per_nic", rings_per_nic, low=1)
    for name, value in (("nic", nic), ("node", node)):
        if not isinstance(value, cost.Link):
            raise ValueError(f"{name}={value!r:.80} must be a cost.Link (e.g. cost.LINKS['rdma100'])")
    g = min(n, per_node)
    if n % g:
        raise ValueError(f"n={n} ranks do not fill nodes of per_node={per_node} evenly")
    m = n // g
    if m == 1:  # one node: no NIC on the way, a ring over the node's link
        return {"ring in the node": cost.ring_allreduce_time(nbytes, n, node.alpha, node.beta)}
    if network == "nic-per-node":  # every ring step waits for the NIC, which the r rings share
        return {"flat ring": cost.ring_allreduce_time(nbytes, n, nic.alpha, nic.beta * rings_per_nic)}
    return {"reduce-scatter": cost.reduce_scatter_time(nbytes, g, node.alpha, node.beta),  # S/g summed on each GPU
            "across nodes": cost.ring_allreduce_time(nbytes / g, m, nic.alpha, nic.beta),  # on each GPU's own NIC
            "all-gather": cost.all_gather_time(nbytes, g, node.alpha, node.beta)}


def step_time(config: ClusterConfig) -> StepTime:
    """The time of one optimizer step of `config`, part by part (see the module docstring)."""
    c = _config(config)
    rate = _attainable(c)
    compute = flops.training_flops(c.n_params, c.batch_tokens) / (c.gpus * rate * c.mfu)
    link, tp_link = cost.LINKS[c.link], cost.LINKS[c.tp_link]
    grads = c.n_params / (c.tp * c.pp) * c.bytes_per_param  # bytes of gradient one GPU holds
    dp = allreduce_time(grads, c.dp, c.dp_per_node, c.network, c.link, c.tp_link, c.rings_per_nic)
    activation = c.micro_tokens * c.model.n_embd * c.bytes_per_activation  # one (micro_tokens, n_embd) tensor
    layers = c.model.n_layer / c.pp  # on one stage
    tp = TP_ALLREDUCES_PER_LAYER * layers * c.micro_batches * cost.ring_allreduce_time(
        activation, c.tp, tp_link.alpha, tp_link.beta)
    # a stage other than the first and last receives and sends each micro-batch forward and backward; the
    # messages of the busiest stage are on its critical path: 2 forward + 2 backward (1 + 1 at p = 2)
    boundaries = min(2, c.pp - 1)
    pp_send = 2 * boundaries * c.micro_batches * (link.alpha + activation * link.beta)
    busy = compute + tp + pp_send
    f = bubble_fraction(c.pp, c.micro_batches)  # idle share of the whole pipelined step
    return StepTime(config=c, compute=compute, dp_allreduce=dp, tp_allreduce=tp, pp_send=pp_send,
                    pp_bubble=busy * f / (1 - f), attainable_flops=rate)


def link_step_times(config: ClusterConfig, links=None) -> dict[str, StepTime]:
    """`step_time` of `config` with its cross-node `link` replaced by each key of `links` (default cost.LINKS):
    the chapter's C15 comparison, for a whole step rather than the all-reduce alone."""
    _config(config)
    if links is None:
        links = list(cost.LINKS)
    if isinstance(links, str) or not links:
        raise ValueError(f"links={links!r} must be a non-empty list of link keys, e.g. ['rdma100', 'rdma200'] "
                         "(None: every link)")
    return {key: step_time(config.with_(link=_link("links", key))) for key in links}


def network_step_times(config: ClusterConfig) -> dict[str, StepTime]:
    """`step_time` of `config` under each network of NETWORKS: {network key: StepTime}, side by side."""
    _config(config)
    return {key: step_time(config.with_(network=key)) for key in NETWORKS}


def step_from_throughput(config: ClusterConfig, flops_per_gpu: float, flops_per_param_token: float = 6) -> float:
    """Seconds per step of `config` that a throughput measured end to end implies: flops_per_param_token · N ·
    batch_tokens FLOPs per step (6 without activation recomputation, 8 with it) at `flops_per_gpu` FLOP/s on each
    of the GPUs."""
    _config(config)
    _finite("flops_per_gpu", flops_per_gpu)
    _finite("flops_per_param_token", flops_per_param_token)
    return flops_per_param_token * config.n_params * config.batch_tokens / (config.gpus * flops_per_gpu)


def arithmetic_mfu(config: ClusterConfig, step_seconds: float) -> float:
    """The `mfu` of the arithmetic alone for which `step_time(config).total` is `step_seconds` (a step measured end
    to end, communication and bubble included): the model's other parts do not depend on mfu, and the step is
    (compute + tp + pp_send) / (1 − bubble share) + dp, so compute = (step − dp)(1 − bubble share) − tp − pp_send."""
    _config(config)
    _finite("step_seconds", step_seconds)
    t = step_time(config)
    f = bubble_fraction(config.pp, config.micro_batches)
    compute = (step_seconds - t.dp_allreduce) * (1 - f) - t.tp_allreduce - t.pp_send
    if compute <= 0:
        raise ValueError(f"step_seconds={step_seconds:.4g} leaves no time for compute: the model's communication and "
                         f"bubble alone take {(t.tp_allreduce + t.pp_send) / (1 - f) + t.dp_allreduce:.4g} s")
    mfu = config.mfu * t.compute / compute
    if mfu > 1:
        raise ValueError(f"step_seconds={step_seconds:.4g} would need the arithmetic at {mfu:.0%} of the attainable "
                         "FLOP/s")
    return mfu


def _gpt(n_layer: int, n_head: int, n_embd: int, vocab_size: int, block_size: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                     bias=False)


# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
# (arXiv:2104.04473), §5.1's estimate of GPT-3's training time: with P = 175B parameters, T = 300B tokens, n = 1024
# A100s and batch size 1536 they "achieve X = 140 teraFLOP/s per GPU", so training takes 8·T·P/(n·X) (their eq. 4)
# = 34 days. X is end to end — FLOPs over the measured time of whole iterations, every all-reduce, send and pipeline
# bubble in it — and counts activation recomputation's extra forward pass: 4 passes of 2·N FLOPs per token, 8·N (the
# FLOPs of their eq. 3). They state no share of the peak for this run: 140/312 = 44.9% is our arithmetic (their
# Table 1's 140 TFLOP/s, 45% row is another model size). The layout below is llmlab's assumption.
MEGATRON_GPT3 = {"flops_per_gpu": 140e12, "flops_per_param_token": 8, "days": 34}

# GPT-3 (Brown et al. 2020: 300B tokens, batch 1536 × 2048 = 3.1M tokens) on 128 DGX A100 nodes in llmlab's assumed
# layout, Megatron-LM's recipe (Narayanan et al. 2021: tensor parallelism inside a node, pipeline across nodes):
# tensor parallel 8 inside a node over NVLink 3, 8 pipeline stages, 16-way data parallel, one 200 Gb/s HDR NIC per
# GPU across nodes (NVIDIA DGX A100 datasheet: 8 single-port ConnectX-6 HDR for the compute network), one sequence
# per micro-batch. Its arithmetic mfu is not 140/312, which is end to end: it is the one for which this model's step is
# their measured one (`arithmetic_mfu`), set below
_GPT3 = ClusterConfig(
    model=GPTConfig(**flops.GPT3_CONFIG), tokens=300e9, batch_tokens=1536 * 2048, gpu="A100 SXM", gpus=1024,
    link="rdma200", dp=16, tp=8, pp=8, micro_batches=96, tp_link="nvlink3", network="nic-per-gpu")

PRESETS: dict[str, ClusterConfig] = {
    "gpt3-175b-1024xA100": _GPT3.with_(mfu=arithmetic_mfu(_GPT3, step_from_throughput(
        _GPT3, MEGATRON_GPT3["flops_per_gpu"], MEGATRON_GPT3["flops_per_param_token"]))),
    # C15's step (llmlab.dist.cost.C15_STEP): a LLaMA-7B-shaped model, 2^20 tokens per step, plain data
    # parallelism over 8 nodes of 8 H100, one 100 Gb/s NIC per GPU (a NIC per GPU as in DGX H100 nodes, whose
    # datasheet gives each GPU a 400 Gb/s ConnectX-7)
    "7b-64xH100": ClusterConfig(
        model=_gpt(n_layer=32, n_head=32, n_embd=4096, vocab_size=32000, block_size=4096), tokens=1e12,
        batch_tokens=cost.C15_STEP["tokens"], gpu=cost.C15_STEP["gpu"], gpus=64, link="rdma100", dp=64,
        mfu=cost.C15_STEP["mfu"], network="nic-per-gpu", gpus_per_node=cost.C15_STEP["node_gpus"]),
    # GPT-2 small on one 8-GPU node, 0.5M tokens per step (GPT-3 paper's batch for 125M), 10B tokens
    "gpt2-8xH100": ClusterConfig(
        model=GPTConfig.preset("gpt2"), tokens=10e9, batch_tokens=512 * 1024, gpu="H100 SXM", gpus=8,
        link="nvlink4", dp=8),
}


def preset(name: str, **changes) -> ClusterConfig:
    """The named preset (see `PRESETS`) with any fields changed, e.g. `preset("gpt2-8xH100", link="pcie4")`."""
    if name not in PRESETS:
        raise ValueError(f"name={name!r} is not a preset; choose from {list(PRESETS)}")
    return PRESETS[name].with_(**changes)
