"""Chapter 4's claims (§4, communication), measured: ring all-reduce bandwidth-optimal, tree latency-optimal
(C12), and the gradient-accumulation snippet that never divides its loss (C13)."""

from __future__ import annotations

import math

import torch

from llmlab import accumulate
from llmlab.claims import Measurement, here, register
from llmlab.dist import allreduce_bench

__all__ = ["ring_bandwidth_tree_latency", "snippet_scaling"]


@register("C12", chapter=4)
def ring_bandwidth_tree_latency() -> Measurement:
    run = allreduce_bench.recent(4)
    if run is None or run.sizes[0] > 4096 or run.sizes[-1] < allreduce_bench.CLAIM_SIZES[-1]:
        run = allreduce_bench.measure(allreduce_bench.CLAIM_SIZES, world_size=4)  # none spanning small to large
    small, large = run.faster(0), run.faster(-1)
    lo, hi = allreduce_bench.format_bytes(run.sizes[0]), allreduce_bench.format_bytes(run.sizes[-1])
    link, measured, predicted = run.link_fit(), run.crossover(), run.predicted_crossover()
    ring_vs_torch = run.seconds["torch"][-1] / run.seconds["ring"][-1]  # busbw ratio = inverse time ratio
    if measured is not None:
        where = (f"crossover measured at {allreduce_bench.format_bytes(measured)}, the α-β model predicts "
                 f"{allreduce_bench.format_bytes(predicted)}")
    else:
        where = f"no crossover between {lo} and {hi} (the model predicts {allreduce_bench.format_bytes(predicted)})"
    order = small == "tree" and large == "ring"
    close = measured is not None and predicted > 0 and 1 / 3 <= measured / predicted <= 3
    shared = (f"{run.world_size} ranks sharing this machine's cores and one loopback stack are not the separate "
              "links the model assumes")
    if not order:
        why = f"; here the {small} won at {lo} and the {large} at {hi}: {shared}"
    elif not close:
        why = f"; the one-link model misplaces the crossover: {shared}"
    else:
        why = ""
    return Measurement(
        value={"crossover measured (B)": measured if measured is not None else math.nan,
               "crossover predicted (B)": predicted, "alpha (s)": link.alpha, "beta (s/B)": link.beta,
               "ring busbw / torch busbw at the largest size": ring_vs_torch},
        unit="bytes, s, s/B, ×",
        text=(f"{run.world_size} {run.backend} ranks, {lo}–{hi}: tree faster at {lo}? "
              f"{'yes' if small == 'tree' else 'no'}; ring faster at {hi}? {'yes' if large == 'ring' else 'no'}; "
              f"fitted α = {link.alpha * 1e6:.3g} µs, 1/β = {(1 / link.beta if link.beta else math.inf) / 1e9:.3g} "
              f"GB/s; {where}; ring busbw = {ring_vs_torch:.2f}× torch's at {hi}{why}"),
        device=here(), verdict="holds" if order and close else "holds with conditions")


@register("C13", chapter=4)
def snippet_scaling() -> Measurement:
    k = accumulate.DEMO_MICRO_BATCHES
    batches = accumulate.demo_batches(0, k)
    x, y = (torch.cat(parts) for parts in zip(*batches, strict=True))  # the large batch: (k·8, 32), (k·8, 1)
    large = accumulate.demo_model()
    accumulate.demo_loss(large, (x, y)).backward()
    reference = torch.cat([p.grad.reshape(-1) for p in large.parameters()])  # (Ψ,)
    found = {}
    for scale in (True, False):
        model = accumulate.demo_model()
        accumulate.accumulate_gradients(model, accumulate.demo_loss, batches, scale=scale)
        found[scale] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # (Ψ,)
    divided_error = ((found[True] - reference).norm() / reference.norm()).item()
    snippet_ratio = (found[False].norm() / reference.norm()).item()  # ‖snippet's gradient‖ / ‖large-batch's‖
    comm = accumulate.recent_no_sync() or accumulate.measure_no_sync()  # the chapter's run, or a new one
    wrong = abs(snippet_ratio / k - 1) < 1e-6 and divided_error < 1e-9  # float64: only summation order differs
    return Measurement(
        value={"snippet gradient / large-batch gradient": snippet_ratio, "divided: relative error": divided_error,
               "bytes per step, every micro-batch": comm.sent_every_step, "bytes per step, no_sync": comm.sent_no_sync},
        unit="×, fraction, bytes",
        text=(f"k = {k} micro-batches: the snippet's accumulated gradient is {snippet_ratio:.4g}× the large-batch "
              f"gradient; with the loss divided by k it equals it (relative error {divided_error:.1g}). With data "
              f"parallelism on {comm.world_size} ranks, one rank sends {comm.sent_every_step / 1e3:.4g} kB per step "
              f"when every one of {comm.micro_batches} micro-batches is all-reduced and "
              f"{comm.sent_no_sync / 1e3:.4g} kB under no_sync ({comm.sent_every_step / comm.sent_no_sync:.3g}× less), "
              f"the same gradient to {comm.max_grad_difference:.1g}"),
        device=here(), verdict="wrong" if wrong else "holds with conditions")
