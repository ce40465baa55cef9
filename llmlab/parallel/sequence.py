"""Sequence parallelism (Megatron-SP; Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", §4.2.2): what tensor parallelism leaves whole, cut along the sequence.

Plain tensor parallelism (`llmlab.parallel.tensor`) splits the matmuls of a block, but the layer norms, the
dropouts and the residual adds still run on the whole (B, T, C) on every rank: 10·sbh of the paper's 34·sbh
bytes of activations per layer are not divided by t. Sequence parallelism cuts those along T: rank r holds tokens
[r·T/t, (r+1)·T/t) between the tensor-parallel regions. Megatron's f and g (an identity and an all-reduce) become
the paper's g and ḡ (Fig. 5), which are conjugates:

    g: forward all-gather along T,      backward reduce-scatter along T   (before a column-parallel linear:
                                                                          `gathered_linear`)
    ḡ: forward reduce-scatter along T,  backward all-gather along T       (after a row-parallel linear)

An all-reduce *is* a reduce-scatter followed by an all-gather, so a block sends exactly the bytes plain tensor
parallelism sends, in the same four collectives' worth per direction; nothing is computed twice. The gathered
input of a column-parallel linear is what its backward needs for dW; keeping it would undo the saving, so
`gathered_linear` saves only this rank's shard and all-gathers it again in backward (as Megatron-LM's
`LinearWithGradAccumulationAndAsyncCommunication` does with sequence parallelism): one more all-gather in the
backward, for T/t instead of T tokens kept.

The collectives are llmlab's own ring (`llmlab.dist.collectives`, point-to-point messages that a `CommLog`
counts), run along T by moving T to the front: (B, T, C) → (T, B, C) is what the ring cuts into rank chunks.

    def block(x):                                  # on every rank of dist.spawn(block, 2, x)
        par = ParallelBlock(full_block, sequence_parallel=True)
        y = par(scatter_sequence(x))                # (B, T/t, C): this rank's tokens in and out
        return gather_sequence(y)                   # equals full_block(x) on every rank

`activation_bytes` is the paper's Table 2: activation memory per layer with and without it.
"""

from __future__ import annotations

import torch
import torch.distributed as td
import torch.nn.functional as F

from llmlab.dist.collectives import ring_all_gather, ring_reduce_scatter

__all__ = ["scatter_sequence", "gather_sequence", "reduce_scatter_sequence", "gathered_linear", "activation_bytes"]


def _world(group) -> tuple[int, int]:
    return td.get_rank(group), td.get_world_size(group)


def _shard_tokens(T: int, n: int) -> int:
    if T % n:
        raise ValueError(f"sequence length T={T} is not divisible by the tensor-parallel world size {n}: "
                         f"sequence parallelism gives every rank T/{n} tokens")
    return T // n


def _all_gather_t(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/t, C) on every rank → (B, T, C), the shards in rank order."""
    rank, n = _world(group)
    B, t_local, C = x.shape
    front = x.transpose(0, 1).contiguous()  # (T/t, B, C): a rank's tokens are one contiguous chunk
    full = ring_all_gather(front, group, sizes=[front.numel()] * n)  # (T·B·C,)
    return full.view(n * t_local, B, C).transpose(0, 1)  # (B, T, C)


def _reduce_scatter_t(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, C) partial sums on every rank → this rank's (B, T/t, C) of their sum."""
    rank, n = _world(group)
    B, T, C = x.shape
    t_local = _shard_tokens(T, n)
    front = x.transpose(0, 1).contiguous()  # (T, B, C): chunk r of the flat tensor is rank r's tokens
    mine = ring_reduce_scatter(front, group, check=False)  # (T/t·B·C,); shapes agree: every rank runs this layer
    return mine.view(t_local, B, C).transpose(0, 1).contiguous()  # (B, T/t, C)


def _own_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's T/t tokens of (B, T, C) that every rank holds whole → (B, T/t, C)."""
    rank, n = _world(group)
    t_local = _shard_tokens(x.shape[1], n)
    return x[:, rank * t_local:(rank + 1) * t_local].contiguous()  # (B, T/t, C)


class _ScatterSequence(torch.autograd.Function):
    """Keep this rank's T/t tokens of a tensor every rank holds whole; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_t(grad, ctx.group), None


class _GatherSequence(torch.autograd.Function):
    """All-gather along T for what follows replicated (the final norm and the head, the same on every rank):
    backward keeps this rank's tokens of the gradient, which every rank holds whole and equal. (Before a
    tensor-parallel matmul the gradient is partial instead and must be reduce-scattered: `gathered_linear`.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_t(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_tokens(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    """The paper's ḡ: reduce-scatter along T forward, all-gather along T backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_t(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_t(grad, ctx.group), None


class _GatheredLinear(torch.autograd.Function):
    """g fused with a column-parallel linear: Y = all_gather_T(X_r)·Aᵀ + b, saving X_r (B, T/t, in), not the
    gathered X (B, T, in); backward gathers X again for dA and reduce-scatters dX (Korthikanti et al. §4.2.2)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_all_gather_t(x, group), weight, bias)  # (B, T, out/t)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        full = _all_gather_t(x, ctx.group)  # (B, T, in): gathered again rather than kept
        grad_x = _reduce_scatter_t(grad @ weight, ctx.group)  # (B, T/t, in): summed over the ranks' slices
        grad_w = grad.flatten(0, -2).T @ full.flatten(0, -2)  # (out/t, in)
        grad_b = grad.flatten(0, -2).sum(0) if ctx.has_bias else None  # (out/t,)
        return grad_x, grad_w, grad_b, None


def scatter_sequence(x, group=None):
    """This rank's tokens of `x` (B, T, C) → (B, T/t, C); the gradient is gathered back to (B, T, C)."""
    return _ScatterSequence.apply(x, group)


def gather_sequence(x, group=None):
    """The ranks' (B, T/t, C) → (B, T, C) on every rank, for replicated work after the last block; backward keeps
    this rank's tokens of the gradient."""
    return _GatherSequence.apply(x, group)


def reduce_scatter_sequence(x, group=None):
    """ḡ: the ranks' partial (B, T, C) → this rank's (B, T/t, C) of their sum; backward all-gathers."""
    return _ReduceScatterSequence.apply(x, group)


def gathered_linear(x, weight, bias=None, group=None):
    """F.linear(gather_sequence(x), weight, bias), keeping only this rank's shard of x for the backward."""
    return _GatheredLinear.apply(x, weight, bias, group)


def activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                     selective: bool = False) -> float:
    """Activation bytes of one transformer layer, Korthikanti et al. 2022, Table 2 (16-bit activations, 1-byte
    dropout masks): s sequence length, b micro-batch, h hidden size, a heads, t tensor-parallel size;
    `selective`: the attention core (the 5as/h term) is recomputed in backward, not kept.

        no parallelism        sbh·(34 + 5as/h)
        tensor parallel       sbh·(10 + 24/t + 5as/(ht))
        + sequence parallel   sbh·(34/t + 5as/(ht))
    """
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a), ("t", t)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    core = 0.0 if selective else 5 * a * s / (h * t)  # softmax input/output and its dropout mask, split by heads
    split = 34 / t if sequence_parallel else 10 + 24 / t  # 10·sbh: norms, dropouts, residuals; 24·sbh: matmul inputs
    return s * b * h * (split + core)
