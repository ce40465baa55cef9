"""Gradient accumulation: k micro-batches, one optimizer step, the gradient of the large batch.

The material's snippet (§4.2) calls `loss.backward()` on every micro-batch and steps every
`accumulation_steps`, but never divides the loss. Gradients add up in `.grad`, so after k micro-batches

    Σᵢ ∇ mean-loss(microᵢ) = k · ∇ mean-loss(large batch)        (equal-sized micro-batches)

k times too large (as if the learning rate were k× higher). Dividing each micro-batch loss by k fixes it:

    accumulate_gradients(model, loss_fn, batches)                # scale=True: the large-batch gradient
    accumulate_gradients(model, loss_fn, batches, scale=False)   # the snippet: k× that

With data parallelism every rank accumulates over its own micro-batches and the ranks average their gradients
with an all-reduce. DDP all-reduces after every backward unless the inner steps run under `model.no_sync()`;
then only the last micro-batch communicates, and k micro-batches cost one all-reduce instead of k.
`data_parallel_accumulate` does both so a `CommLog` can measure it (C13 in CLAIMS.md):

    def step(no_sync):                              # on every rank: dist.spawn(step, 4, True)
        with CommLog() as log:
            data_parallel_accumulate(model, loss_fn, my_batches, no_sync=no_sync)
        return log.bytes_sent                       # no_sync=True: 1/k of no_sync=False
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmlab import claims
from llmlab.dist.collectives import ring_all_reduce

__all__ = ["accumulate_gradients", "data_parallel_accumulate", "NoSyncBytes", "measure_no_sync"]


def _check(batches) -> list:
    batches = list(batches)
    if not batches:
        raise ValueError("batches is empty: give at least one micro-batch")
    return batches


def accumulate_gradients(model: torch.nn.Module, loss_fn, batches, scale: bool = True) -> float:
    """Zero the gradients, then run backward on each micro-batch; return the mean micro-batch loss.

    `loss_fn(model, batch)` returns the scalar mean loss of one micro-batch. With `scale=True` each loss is
    divided by k = len(batches) before backward, so `.grad` ends as the gradient of the mean loss over all
    micro-batches (equal to the large-batch gradient when the micro-batches are equally sized; weight them
    by size otherwise). `scale=False` is the material's snippet: k times that.
    """
    batches = _check(batches)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for batch in batches:
        loss = loss_fn(model, batch)
        (loss / len(batches) if scale else loss).backward()  # gradients add up in .grad
        total += loss.item()
    return total / len(batches)


def _flat_grads(params) -> torch.Tensor:
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]  # unused: zero gradient
    return torch.cat([g.reshape(-1) for g in grads])  # (Ψ,): one bucket, one all-reduce


def _set_grads(params, flat: torch.Tensor) -> None:
    for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
        p.grad = g.view_as(p).clone()


def data_parallel_accumulate(model: torch.nn.Module, loss_fn, batches, group=None, no_sync: bool = True,
                             all_reduce=ring_all_reduce) -> float:
    """Accumulate over this rank's micro-batches and average the gradients over the ranks of `group`.

    `no_sync=True`: the inner micro-batches only accumulate locally; one all-reduce after the last (what DDP
    does under `model.no_sync()`). `no_sync=False`: each micro-batch's gradient is all-reduced as soon as it
    is computed, k all-reduces (DDP's default). Either way `.grad` ends as the gradient of the mean loss over
    every rank's micro-batches (up to summation order). All parameters' gradients travel as one flat bucket
    through `all_reduce(tensor, group=group, op="avg")` (llmlab's ring by default). Returns this rank's mean
    micro-batch loss.
    """
    batches = _check(batches)
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    total, averaged = 0.0, None
    for i, batch in enumerate(batches):
        loss = loss_fn(model, batch)
        (loss / len(batches)).backward()
        total += loss.item()
        if not no_sync:  # DDP's default: communicate this micro-batch's gradient now
            mine = all_reduce(_flat_grads(params), group=group, op="avg")  # (Ψ,)
            averaged = mine if averaged is None else averaged.add_(mine)
            model.zero_grad(set_to_none=True)
        elif i == len(batches) - 1:  # no_sync: one all-reduce of the accumulated gradient
            averaged = all_reduce(_flat_grads(params), group=group, op="avg")
    _set_grads(params, averaged)
    return total / len(batches)


# --- C13: the material's snippet, and what no_sync saves, measured ----------------------------------------------

@dataclass(frozen=True)
class NoSyncBytes:
    """What `measure_no_sync` found: bytes one rank sent per optimizer step, with and without no_sync."""

    world_size: int
    micro_batches: int
    gradient_bytes: int  # Ψ: the flat gradient bucket, bytes
    sent_every_step: int  # bytes sent by one rank with no_sync=False (k all-reduces), from a CommLog
    sent_no_sync: int  # ... with no_sync=True (one all-reduce)
    max_grad_difference: float  # |grad(no_sync) − grad(every step)|, max over parameters and ranks


DEMO_MICRO_BATCHES = 4  # k of the C13 demonstration


def _demo_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).double()


def _demo_batches(seed: int, micro_batches: int, rows: int = 8) -> list:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(micro_batches * rows, 32, generator=g, dtype=torch.float64)  # (k·rows, 32)
    y = torch.randn(micro_batches * rows, 1, generator=g, dtype=torch.float64)  # (k·rows, 1)
    return list(zip(x.split(rows), y.split(rows), strict=True))  # k × ((rows, 32), (rows, 1))


def _mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _no_sync_on_rank(micro_batches: int) -> tuple[int, int, int, float]:
    import torch.distributed as td

    from llmlab.dist.commlog import CommLog

    batches = _demo_batches(100 + td.get_rank(), micro_batches)  # this rank's micro-batches
    sent, grads = [], []
    for no_sync in (False, True):
        model = _demo_model()
        with CommLog() as log:
            data_parallel_accumulate(model, _mse, batches, no_sync=no_sync)
        sent.append(log.by_op()["ring_all_reduce"].bytes_sent)  # the gradients' bytes, not the input checks
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))  # (Ψ,)
    psi = grads[0].numel() * grads[0].element_size()
    return psi, sent[0], sent[1], (grads[0] - grads[1]).abs().max().item()


_measured: list[NoSyncBytes] = []  # what measure_no_sync found in this process, latest last


def measure_no_sync(cluster=None, world_size: int = 2, micro_batches: int = DEMO_MICRO_BATCHES) -> NoSyncBytes:
    """Accumulate `micro_batches` micro-batches per rank with and without no_sync, on real ranks, and count the
    bytes each rank sent (CommLog). Runs on `cluster` (an open gloo `dist.Cluster`: the demo model is on the CPU)
    or on `world_size` new gloo ranks."""
    from llmlab import dist

    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r} must be an int >= 1")
    if cluster is None:
        per_rank = dist.spawn(_no_sync_on_rank, world_size, micro_batches, backend="gloo")  # CPU tensors
    else:
        per_rank = cluster.run(_no_sync_on_rank, micro_batches)
    n = len(per_rank)
    result = NoSyncBytes(n, micro_batches, per_rank[0][0], max(r[1] for r in per_rank),
                         max(r[2] for r in per_rank), max(r[3] for r in per_rank))
    _measured.append(result)
    return result


@claims.register("C13", chapter=4)
def _claim_snippet_scaling() -> claims.Measurement:
    k = DEMO_MICRO_BATCHES
    batches = _demo_batches(0, k)
    x, y = (torch.cat(parts) for parts in zip(*batches, strict=True))  # the large batch: (k·8, 32), (k·8, 1)
    large = _demo_model()
    _mse(large, (x, y)).backward()
    reference = torch.cat([p.grad.reshape(-1) for p in large.parameters()])  # (Ψ,)
    found = {}
    for scale in (True, False):
        model = _demo_model()
        accumulate_gradients(model, _mse, batches, scale=scale)
        found[scale] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    divided_error = ((found[True] - reference).norm() / reference.norm()).item()
    snippet_ratio = (found[False].norm() / reference.norm()).item()  # ‖snippet's gradient‖ / ‖large-batch's‖
    comm = _measured[-1] if _measured else measure_no_sync()  # the chapter's run, or a new one
    wrong = abs(snippet_ratio / k - 1) < 1e-6 and divided_error < 1e-9  # float64: only summation order differs
    return claims.Measurement(
        value={"snippet gradient / large-batch gradient": snippet_ratio, "divided: relative error": divided_error,
               "bytes per step, every micro-batch": comm.sent_every_step, "bytes per step, no_sync": comm.sent_no_sync},
        unit="×, fraction, bytes",
        text=(f"k = {k} micro-batches: the snippet's accumulated gradient is {snippet_ratio:.4g}× the large-batch "
              f"gradient; with the loss divided by k it equals it (relative error {divided_error:.1g}). With data "
              f"parallelism on {comm.world_size} ranks, one rank sends {comm.sent_every_step / 1e3:.4g} kB per step "
              f"when every one of {comm.micro_batches} micro-batches is all-reduced and "
              f"{comm.sent_no_sync / 1e3:.4g} kB under no_sync ({comm.sent_every_step / comm.sent_no_sync:.3g}× less), "
              f"the same gradient to {comm.max_grad_difference:.1g}"),
        device=claims.here(), verdict="wrong" if wrong else "holds with conditions")
