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

import torch

from llmlab.dist.collectives import ring_all_reduce

__all__ = ["accumulate_gradients", "data_parallel_accumulate"]


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
