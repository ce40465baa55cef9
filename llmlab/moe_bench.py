"""The timing side of `llmlab bench moe` (`llmlab.moe.bench`): sizes per tier, one training step, and the
expert-parallel row measured on gloo ranks.

A step is forward, `square().mean()` of the output (plus aux_loss) and backward, gradients accumulating as in a
training step without an optimizer. The expert-parallel row runs the layer over two all-to-alls each way on every
rank of a gloo cluster, against the single-process layer on the same rank's tokens (ideal 1: both compute about
the same assignments), both timed in the same rounds; `comm_ms` is the step's time in communication.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as td

from llmlab import dist, runtime
from llmlab.dist.commlog import CommLog
from llmlab.timing import Comparison, Load, Timing

__all__ = ["SIZES", "sizes", "fwd_bwd", "expert_parallel_row"]

SIZES = {"cpu": dict(dim=128, hidden=512, experts=8, tokens=1024), "gpu": dict(dim=768, hidden=3072, experts=8,
                                                                            tokens=8192),
         "smoke": dict(dim=32, hidden=64, experts=4, tokens=64)}  # LLMLAB_GPU_SMOKE: the GPU branch in seconds


def sizes(overrides: dict | None, ranks: bool = False) -> dict:
    """This tier's `SIZES`, with `overrides`. The expert-parallel row's gloo ranks compute on the CPU on every
    tier (`ranks=True`): the CPU's sizes for them on a GPU; smoke mode's tiny ones everywhere under smoke mode."""
    t = runtime.tier()
    return {**SIZES["smoke" if t.smoke else "gpu" if t.is_gpu and not ranks else "cpu"], **(overrides or {})}


def fwd_bwd(fn, x):
    """One forward and backward of `fn` (a layer returning (y, aux_loss), or a function returning y) on `x`."""
    def step():
        out = fn(x)
        (out[0] + out[1] if isinstance(out, tuple) else out).square().mean().backward()
    return step


def _expert_parallel_rounds(layer, tokens: int, rounds: int) -> tuple[dict, list]:
    """On each rank: one step of `layer`'s expert-parallel share and one of `layer` itself (every expert here) on
    this rank's tokens/N tokens, per round, alternating which goes first. Returns each one's seconds per round,
    and the seconds of each expert-parallel step spent communicating (CommLog: the all-to-alls, the counts)."""
    n, rank = td.get_world_size(), td.get_rank()
    torch.manual_seed(1 + rank)
    x = torch.randn(tokens // n, layer.dim, requires_grad=True)  # (T/N, C): this rank's tokens
    steps = {"expert-parallel": fwd_bwd(type(layer).from_layer(layer, td.group.WORLD), x), "single": fwd_bwd(layer, x)}
    for step in [*steps.values()] * 2:  # warm-up: thread pool, allocator, gloo's buffers
        step()
    seconds, comm = {name: [] for name in steps}, []
    for r in range(rounds):
        for name in list(steps)[::1 if r % 2 == 0 else -1]:
            with CommLog(torch_collectives=False) as log:
                start = time.perf_counter()
                steps[name]()
                seconds[name].append(time.perf_counter() - start)
            if name == "expert-parallel":
                comm.append(sum(op.seconds for op in log.by_op().values()))
    return seconds, comm


def expert_parallel_row(layer, tokens: int, cluster=None, rounds: int = 7) -> dict:
    """`layer` (a single-process dropless `llmlab.moe.MoELayer`, sent to every rank) expert-parallel over the
    ranks of `cluster` (a live gloo `dist.Cluster` whose world size divides the experts; default: 2 fresh ranks)
    against itself on one rank's share of `tokens`; a round lasts as long as its slowest rank."""
    if cluster is None:
        with dist.Cluster(2, backend="gloo") as fresh:
            return expert_parallel_row(layer, tokens, fresh, rounds)
    load = Load.now()
    ranks = cluster.run(_expert_parallel_rounds, layer, tokens, rounds)
    load = load.busier(Load.now())
    ep, single = (Timing.from_samples([max(r[0][name][i] for r in ranks) for i in range(rounds)], load=load)
                  for name in ("expert-parallel", "single"))
    c = Comparison(ep, single, tuple(a / b for a, b in zip(ep.samples, single.samples, strict=True)))
    n = cluster.world_size
    return {"impl": f"MoE expert-parallel, {n} gloo ranks", "peer": "single-process layer, same tokens per rank",
            "size": f"T={tokens} C={layer.dim} H={layer.hidden} E={layer.num_experts} k={layer.k}, T/{n} per rank",
            **c.row(), "direction": c.direction() if c.conclusive else "not conclusive", "note": c.note(),
            "ideal": 1, "comm_ms": 1e3 * statistics.median(max(r[1][i] for r in ranks) for i in range(rounds))}
