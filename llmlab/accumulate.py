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
`data_parallel_accumulate` does both so a `CommLog` can measure it (C13 in CLAIMS.md, measured with the demo
model and batches below in `llmlab.claims.ch04`):

    def step(no_sync):                              # on every rank: dist.spawn(step, 4, True)
        with CommLog() as log:
            data_parallel_accumulate(model, loss_fn, my_batches, no_sync=no_sync)
        return log.bytes_sent                       # no_sync=True: 1/k of no_sync=False
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as td

from llmlab import dist, validation
from llmlab.dist.collectives import ring_all_reduce
from llmlab.dist.commlog import CommLog

__all__ = ["accumulate_gradients", "data_parallel_accumulate", "NoSyncBytes", "DEMO_MICRO_BATCHES", "demo_model",
           "demo_batches", "demo_loss", "measure_no_sync", "recent_no_sync"]


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


# --- the demonstration of C13: the material's snippet, and what no_sync saves ------------------------------------

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


def demo_model() -> torch.nn.Module:
    """The demonstration's model: a small float64 MLP, 32 → 64 → 1, the same weights on every call (seed 0)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).double()


def demo_batches(seed: int, micro_batches: int, rows: int = 8) -> list:
    """`micro_batches` micro-batches (x, y) of `rows` random float64 examples each for `demo_model`, drawn with
    generator seed `seed`."""
    validation.positive_int("micro_batches", micro_batches)
    validation.positive_int("rows", rows)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(micro_batches * rows, 32, generator=g, dtype=torch.float64)  # (k·rows, 32)
    y = torch.randn(micro_batches * rows, 1, generator=g, dtype=torch.float64)  # (k·rows, 1)
    return list(zip(x.split(rows), y.split(rows), strict=True))  # k × ((rows, 32), (rows, 1))


def demo_loss(model, batch):
    """The demonstration's loss: mean squared error of `model` on one (x, y) batch."""
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _no_sync_on_rank(micro_batches: int) -> tuple[int, int, int, float]:
    batches = demo_batches(100 + td.get_rank(), micro_batches)  # this rank's micro-batches
    sent, grads = [], []
    for no_sync in (False, True):
        model = demo_model()
        with CommLog() as log:
            data_parallel_accumulate(model, demo_loss, batches, no_sync=no_sync)
        sent.append(log.by_op()["ring_all_reduce"].bytes_sent)  # the gradients' bytes, not the input checks
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))  # (Ψ,)
    psi = grads[0].numel() * grads[0].element_size()
    return psi, sent[0], sent[1], (grads[0] - grads[1]).abs().max().item()


_measured: list[NoSyncBytes] = []  # what measure_no_sync found in this process, latest last


def measure_no_sync(cluster=None, world_size: int = 2, micro_batches: int = DEMO_MICRO_BATCHES) -> NoSyncBytes:
    """Accumulate `micro_batches` micro-batches per rank with and without no_sync, on real ranks, and count the
    bytes each rank sent (CommLog). Runs on `cluster` (an open gloo `dist.Cluster`: the demo model is on the CPU)
    or on `world_size` new gloo ranks."""

    validation.positive_int("micro_batches", micro_batches)
    if cluster is None:
        per_rank = dist.spawn(_no_sync_on_rank, world_size, micro_batches, backend="gloo")  # CPU tensors
    else:
        per_rank = cluster.run(_no_sync_on_rank, micro_batches)
    n = len(per_rank)
    result = NoSyncBytes(n, micro_batches, per_rank[0][0], max(r[1] for r in per_rank),
                         max(r[2] for r in per_rank), max(r[3] for r in per_rank))
    _measured.append(result)
    return result


def recent_no_sync() -> NoSyncBytes | None:
    """The last `measure_no_sync` result in this process (e.g. the chapter's run), if any."""
    return _measured[-1] if _measured else None
