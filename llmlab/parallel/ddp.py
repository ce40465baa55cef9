"""Data parallelism from scratch: every rank holds the whole model, sees its own slice of the batch, and the
gradients are averaged across ranks before the optimizer step — overlapped with the backward pass.

What `DataParallel` does (the design of PyTorch's DistributedDataParallel; Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", §3):
1. at construction, broadcast rank 0's parameters and buffers so every replica starts identical;
2. group the parameters into *buckets* of about `bucket_mb` MB, in reverse order of registration (roughly
   the order in which backward produces their gradients);
3. a hook on every parameter fires when its gradient is complete; when all gradients of a bucket are in,
   the bucket is flattened and its all-reduce is launched asynchronously — while backward goes on computing
   the gradients of earlier layers (communication overlapped with computation);
4. at the end of backward (an autograd-engine callback), wait for every bucket, divide by the world size
   and copy the averages back into `.grad`.
`no_sync()` skips 3–4 for gradient accumulation: only the last micro-batch's backward communicates.

Why not the course text's `nn.DataParallel(model, device_ids=[0,1,2,3])`: it is one process driving all
GPUs from one Python thread — it re-copies the model to every GPU on each forward, scatters inputs and
gathers outputs through GPU 0, and is bound by the GIL; PyTorch recommends DistributedDataParallel (one
process per GPU, as here) even on a single machine.

    def train(batch):                                   # on each rank of dist.spawn(train, 4, batch)
        model = DataParallel(GPT(GPTConfig.preset("tiny")))
        x, y = batch[rank::world]                       # this rank's slice
        model(x, y)[1].backward()                       # gradients are averaged when backward returns
        opt.step()

Under torchrun: `dist.init_from_env()` first; nothing else changes. Claim C5 (nn.DataParallel) is measured
against torch's DDP in `llmlab.claims.ch02`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as td

__all__ = ["DataParallel", "buckets"]


def buckets(params: list[torch.nn.Parameter], bucket_mb: float) -> list[list[torch.nn.Parameter]]:
    """Parameters in reverse order, cut into groups of at most `bucket_mb` MB (a larger one gets its own)."""
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb={bucket_mb} must be > 0")
    limit, out, current, size = bucket_mb * 2**20, [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > limit:
            out.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    return out + ([current] if current else [])


class DataParallel(torch.nn.Module):
    """Wrap `module` so that `loss.backward()` leaves the gradients averaged over the ranks of `group`.

    `all_reduce(tensor, group)` is the collective used per bucket: torch.distributed's by default (launched
    with async_op=True, so it overlaps the rest of backward), or any function with that signature — e.g.
    `llmlab.dist.ring_all_reduce` (run when the bucket is ready, synchronously).
    """

    def __init__(self, module: torch.nn.Module, bucket_mb: float = 25.0, group=None, all_reduce=None):
        super().__init__()
        if not td.is_initialized():
            raise RuntimeError("DataParallel needs torch.distributed initialised (dist.spawn, Cluster or "
                               "dist.init_from_env under torchrun)")
        self.module, self.group, self.custom_all_reduce = module, group, all_reduce
        self.world_size = td.get_world_size(group)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = buckets(self.params, bucket_mb)
        self._bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        self._sync = True
        self._ready: list[set] = []
        self._works: list = []
        self._flat: list[torch.Tensor | None] = []
        src = td.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                td.broadcast(t.data, src, group=group)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)
        self._reset()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside this context accumulates local gradients without communicating."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _reset(self) -> None:
        self._ready = [set() for _ in self.buckets]
        self._works = [None] * len(self.buckets)
        self._flat = [None] * len(self.buckets)
        self._queued = False

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self._sync:
            return
        if not self._queued:  # once per backward: finish when the autograd engine is done
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        i = self._bucket_of[p]
        self._ready[i].add(p)
        if len(self._ready[i]) == len(self.buckets[i]):
            self._launch(i)

    def _launch(self, i: int) -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]])  # (bucket numel,)
        self._flat[i] = flat
        if self.custom_all_reduce is not None:
            self.custom_all_reduce(flat, group=self.group)
        else:
            self._works[i] = td.all_reduce(flat, group=self.group, async_op=True)

    def _finish(self) -> None:
        missing = [i for i, flat in enumerate(self._flat) if flat is None]
        if missing:
            unused = [n for n, p in self.module.named_parameters() if p.requires_grad
                      and self._bucket_of[p] in missing and p not in self._ready[self._bucket_of[p]]]
            self._reset()
            raise RuntimeError(f"parameters {unused[:5]} got no gradient in this backward, so their buckets "
                               "never all-reduced; every trainable parameter must take part in the loss")
        for i, bucket in enumerate(self.buckets):
            if self._works[i] is not None:
                self._works[i].wait()
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(self._flat[i][offset:offset + n].view_as(p.grad)).div_(self.world_size)
                offset += n
        self._reset()
