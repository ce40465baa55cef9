"""Moving a mixture of experts' rows (`llmlab.moe`): to their experts and through them, grouped, and across ranks.

The layer permutes its tokens by expert once (one `index_select` of the kept assignments, grouped by expert:
its backward is one `index_add`) and un-permutes once (one `index_add` of the gated results). In between,
`grouped_mlp` runs each expert on its block of consecutive rows — a view, no copy — so that every projection is
one **segment matmul**: E matmuls, expert e's weight on its own block, and the same for the gradients.

Why segments and not one padded batched matmul (each expert's group padded to the largest, the weights stacked,
one `torch.baddbmm` per projection): the padding computes max/mean − 1 of the FLOPs for nothing (≈ 10% for 1,024
random tokens on 8 experts, without bound for a skewed router), and with the weights held as E `Expert` modules
a bmm must stack them, a copy of every weight and its gradient each step. Measured on the 2-core CPU, forward +
backward, as multiples of the dense MLP of one expert's size (ideal 2): the whole layer at the bench's size
(T=1024 C=128 H=512 E=8), one thread, CPU time: 2.26–2.42× with segments, 3.1–3.5× with padded bmm; at T=256
C=64 H=256, 3.1× against 4.7×; at T=4096 C=256 H=1024, 1.99× against 2.53×. Two threads, interleaved rounds:
the padded bmm layer takes 1.26–1.43× the segment layer's time. A hand-written autograd Function for the segment
loop (buffers written in place, no concatenation) was no faster than autograd's graph of the E `Expert` calls
(3–5% slower), so the layer keeps autograd's. The floor is the experts themselves: the segment MLP alone, without
routing or permutation, takes 2.17× the dense MLP on one thread and 2.3× on two — E matmuls of ~T·k/E rows run
slower than one of T·k rows (on two threads, 8 of 256 rows took 1.3× the time of one of 2,048 here), and E
experts write E times the weight gradients. A GPU would favour a grouped GEMM kernel (one launch for all experts).

`grouped_gemm_mlp` is that: each projection one launch of the Triton grouped GEMM (`llmlab.kernels.grouped_gemm`)
for every expert's rows, bias fused, the weight gradient a second kernel — `MoELayer(..., grouped_gemm=True)`. The
experts stay E `Expert` modules, so each step stacks their weights ((E, H, C) → a transposed view (E, C, H): the
kernel reads any strides) and the stack's backward splits the gradient back: one copy of the weights each way.
Triton is imported on the first such call, not with this module (`import llmlab.moe` stays free of it).

Expert parallelism (`expert_parallel`): the rows, grouped by global expert, go to the ranks owning their experts
in one all-to-all (`AllToAll`, llmlab's point-to-point `dist.all_to_all`), are grouped there by local expert, run
through `grouped_mlp` (or `grouped_gemm_mlp`), and come home in a second all-to-all; backward is the reverse
all-to-all of each.
"""

from __future__ import annotations

import torch

from llmlab.dist.collectives import all_to_all
from llmlab.dist.commlog import scope

__all__ = ["grouped_mlp", "grouped_gemm_mlp", "AllToAll", "expert_parallel"]


def _check_counts(experts, rows: torch.Tensor, counts: list[int]) -> None:
    if sum(counts) != rows.shape[0] or len(counts) != len(experts):
        raise ValueError(f"counts={counts} must give one count per expert ({len(experts)}) summing to the "
                         f"{rows.shape[0]} rows")


def grouped_mlp(experts, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """`experts` (a sequence of `llmlab.moe.Expert`) on `rows` (K, C) grouped by expert: expert e on the next
    counts[e] rows. One segment matmul per projection: each expert's matmuls on its own block, a view of `rows`."""
    _check_counts(experts, rows, counts)
    return torch.cat([expert(block) for expert, block in zip(experts, rows.split(counts), strict=True)])  # (K, C)


def grouped_gemm_mlp(experts, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """`grouped_mlp` through the Triton grouped GEMM: both projections of every expert, each in one launch
    (`llmlab.kernels.grouped_gemm.grouped_linear`, differentiable). `counts` as `grouped_mlp`'s, checked on the host
    (no synchronisation: the offsets are copied to the device once). Under autocast the rows and weights are cast
    to its dtype, as autocast casts an `nn.Linear`'s."""
    # imported here, the one place that needs it: `import llmlab.moe` must not import triton (half a second)
    from llmlab.kernels.grouped_gemm import grouped_linear

    _check_counts(experts, rows, counts)
    where = rows.device.type
    dtype = torch.get_autocast_dtype(where) if torch.is_autocast_enabled(where) else rows.dtype
    offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(rows.device, torch.int32)  # (E,) block ends

    def linear(x, name):  # x (K, in) -> (K, out): every expert's nn.Linear `name` on its own rows
        w = torch.stack([getattr(e, name).weight for e in experts]).to(dtype).transpose(1, 2)  # (E, in, out) view
        b = torch.stack([getattr(e, name).bias for e in experts]).to(dtype)  # (E, out)
        return grouped_linear(x.to(dtype), w, offsets, b, check_offsets=False)  # offsets checked above

    return linear(experts[0].gelu(linear(rows, "c_fc")), "c_proj")  # (K, C); every expert's GELU is the same


class AllToAll(torch.autograd.Function):
    """All-to-all of row blocks (llmlab's `dist.all_to_all`): rows split by `send_counts` go to ranks 0…N−1, the
    blocks received come back concatenated in source-rank order. Backward is the reverse all-to-all: the
    gradient of each received block goes back to the rank that sent it."""

    @staticmethod
    def forward(ctx, rows, send_counts, group):
        received = all_to_all(list(rows.split(send_counts)), group)
        ctx.group, ctx.received_counts = group, [b.shape[0] for b in received]
        return torch.cat(received)

    @staticmethod
    def backward(ctx, grad):
        return torch.cat(all_to_all(list(grad.contiguous().split(ctx.received_counts)), ctx.group)), None, None


def expert_parallel(experts, rows: torch.Tensor, counts: torch.Tensor, group, mlp=grouped_mlp) -> torch.Tensor:
    """Rows (K, C) grouped by global expert, `counts` (E,) per expert -> the ranks owning their experts (rank r:
    experts r·E/N … (r+1)·E/N − 1, `experts` being this rank's) -> those experts (`mlp`: `grouped_mlp` or
    `grouped_gemm_mlp`) -> back, in the same order."""
    n, local = counts.numel() // len(experts), len(experts)
    send = counts.view(n, local)  # (N, E/N): row d = rows for each of rank d's experts
    with scope("moe.counts"):  # the receivers need the per-expert split of what arrives
        recv = torch.stack(all_to_all(list(send), group))  # (N, E/N): row s = what rank s sends me
    arrived = AllToAll.apply(rows, send.sum(1).tolist(), group)  # (R, C): by source rank, then expert
    expert = torch.arange(local, device=rows.device).repeat(n).repeat_interleave(recv.flatten())  # (R,)
    order = torch.argsort(expert, stable=True)  # (R,) group the arrivals by local expert
    y = mlp(experts, arrived.index_select(0, order), recv.sum(0).tolist())  # (R, C) by local expert
    back = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))  # (R,)
    return AllToAll.apply(y.index_select(0, back), recv.sum(1).tolist(), group)  # (K, C): home, in `rows` order
