"""Context parallelism: ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"), each rank
holding 1/cp of the sequence, with the zig-zag layout that balances causal work (Llama 3; picotron, torchtitan).

Rank r keeps its queries and passes its keys/values around a ring of point-to-point messages: at step s it holds
the K, V block of rank r − s, computes its queries' attention to it — a partial output and its logsumexp — and
folds that into what it has by the online-softmax merge (FlashAttention's rescale):

    lse = logaddexp(lse₁, lse₂)        o = o₁·exp(lse₁ − lse) + o₂·exp(lse₂ − lse)

While it computes on block s it is already sending block s on and receiving block s + 1 (`post`, then `wait`
after the compute): the ring's traffic hides behind attention when a block's compute outlasts its transfer.
Backward goes round the ring again with each K, V block carrying its running dK, dV; after cp steps every block
is home with its gradients summed over every rank's queries (FlashAttention-2's backward, Dao 2023, Alg. 2, per
block, from the saved output and logsumexp: nothing of the T×T scores is kept).

**Zig-zag.** With causal attention and the sequence cut into cp contiguous pieces, rank cp − 1 does cp times the
work of rank 0. Cut it into 2·cp chunks and give rank r chunks r and 2cp − 1 − r: every rank then computes the
same number of unmasked scores, c²(2cp − 1) + c(c + 1) for chunks of c tokens (`causal_work`).

    def attend(q, k, v):                 # on every rank of dist.spawn(attend, 4, q, k, v), (B, H, T, D) each
        mine = lambda t: shard_sequence(t, layout="zigzag")            # (B, H, T/cp, D)
        o = ring_attention(mine(q), mine(k), mine(v), causal=True, layout="zigzag")
        return o                           # equals F.scaled_dot_product_attention(q, k, v)'s rows `positions(...)`

In a model, `ContextParallelAttention(block.attn, group)` takes the block's own projections and attends by the
ring: the block then runs on this rank's tokens (B, T/cp, C) only. `llmlab train --cp` composes it this way.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as td

from llmlab.dist.commlog import post
from llmlab.model import CausalSelfAttention, split_heads

__all__ = ["LAYOUTS", "positions", "shard_sequence", "ring_attention", "causal_work", "ContextParallelAttention"]

LAYOUTS = ("contiguous", "zigzag")


def positions(T: int, rank: int, cp: int, layout: str = "zigzag") -> torch.Tensor:
    """The sequence positions rank `rank` of `cp` holds, in order: (T/cp,) int64."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")
    pieces = 2 * cp if layout == "zigzag" else cp
    if T % pieces:
        raise ValueError(f"sequence length T={T} is not divisible by {pieces}: the {layout} layout over cp={cp} "
                         f"ranks cuts it into {pieces} equal chunks")
    c = T // pieces
    chunks = (rank, 2 * cp - 1 - rank) if layout == "zigzag" else (rank,)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunks])


def shard_sequence(x: torch.Tensor, group=None, layout: str = "zigzag") -> torch.Tensor:
    """This rank's tokens of `x` (B, H, T, D) → (B, H, T/cp, D), the positions `positions(T, rank, cp, layout)`."""
    return x[:, :, positions(x.shape[2], td.get_rank(group), td.get_world_size(group), layout)].contiguous()


def causal_work(T: int, cp: int, layout: str) -> list[int]:
    """Unmasked (query, key) pairs of causal attention each rank computes: how balanced the layout is."""
    return [int((positions(T, r, cp, layout) + 1).sum()) for r in range(cp)]


def _block(q, k, v, allowed, scale):
    """Attention of q (B, H, Tq, D) to one block k, v (B, H, Tk, D) under `allowed` (Tq, Tk) or None:
    (o (B, H, Tq, D), lse (B, H, Tq)). A query row with no allowed key gets o = 0 and lse = −inf."""
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Tq)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])  # (B, H, Tq, Tk): 0 where masked
    return p @ v, lse


def _merge(o, lse, o_b, lse_b):
    """The online-softmax merge of two partial attentions over disjoint keys; `lse` is finite (the own block
    always holds each query's own position)."""
    new = torch.logaddexp(lse, lse_b)  # (B, H, Tq)
    return o * torch.exp(lse - new)[..., None] + o_b * torch.exp(lse_b - new)[..., None], new


def _ring(block, group, rank, n):
    """Start sending `block` to the right neighbour and receiving the left one's into a new tensor."""
    if n == 1:  # a ring of one: the block is already home
        return block, post((), (), group)
    incoming = torch.empty_like(block)
    return incoming, post([(block, (rank + 1) % n)], [(incoming, (rank - 1) % n)], group)


class _RingAttention(torch.autograd.Function):
    """Ring attention forward (online-softmax merge over the ring's K, V blocks) and FlashAttention-2's backward
    (Dao 2023, Alg. 2) per block, with dK, dV travelling with their block back to its owner."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, spans):
        rank, n = td.get_rank(group), td.get_world_size(group)
        T, scale = q.shape[2] * n, 1 / math.sqrt(q.shape[-1])
        pos = [positions(T, r, n, layout) for r in range(n)]  # every rank's positions, (T/cp,) each
        kv, o, lse = torch.stack((k, v)), None, None  # (2, B, H, Tk, D): one message per step
        for step in range(n):
            src = (rank - step) % n  # whose K, V this rank holds now
            if step < n - 1:
                incoming, pending = _ring(kv, group, rank, n)  # block step + 1 arrives while this one is used
            start = time.perf_counter()
            allowed = pos[rank][:, None] >= pos[src][None, :] if causal else None  # (Tq, Tk)
            if allowed is None or allowed.any():
                o_b, lse_b = _block(q, kv[0], kv[1], allowed, scale)
                o, lse = (o_b, lse_b) if o is None else _merge(o, lse, o_b, lse_b)
            if spans is not None:
                spans.append(("attention", step, start, time.perf_counter()))
            if step < n - 1:
                pending.wait()
                kv = incoming
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.group, ctx.causal, ctx.layout, ctx.pos = group, causal, layout, pos
        return o

    @staticmethod
    def backward(ctx, grad_o):
        q, k, v, o, lse = ctx.saved_tensors
        group, rank, n = ctx.group, td.get_rank(ctx.group), td.get_world_size(ctx.group)
        scale = 1 / math.sqrt(q.shape[-1])
        delta = (grad_o * o).sum(-1, keepdim=True)  # (B, H, Tq, 1): rowsum(dO ∘ O), Alg. 2 line 4
        grad_q = torch.zeros_like(q)
        block = torch.stack((k, v, torch.zeros_like(k), torch.zeros_like(v)))  # (4, B, H, Tk, D): K, V, dK, dV
        for step in range(n):
            src = (rank - step) % n
            kb, vb, dk, dv = block.unbind(0)
            allowed = ctx.pos[rank][:, None] >= ctx.pos[src][None, :] if ctx.causal else None  # (Tq, Tk)
            if allowed is None or allowed.any():
                s = (q @ kb.transpose(-2, -1)) * scale  # (B, H, Tq, Tk), recomputed
                if allowed is not None:
                    s = s.masked_fill(~allowed, float("-inf"))
                p = torch.exp(s - lse[..., None])  # (B, H, Tq, Tk): the final softmax's probabilities
                dv += p.transpose(-2, -1) @ grad_o  # (B, H, Tk, D), into the travelling block
                ds = p * (grad_o @ vb.transpose(-2, -1) - delta)  # (B, H, Tq, Tk)
                grad_q += (ds @ kb) * scale  # (B, H, Tq, D)
                dk += (ds.transpose(-2, -1) @ q) * scale  # (B, H, Tk, D)
            incoming, pending = _ring(block, group, rank, n)  # the n-th pass brings each block home
            pending.wait()
            block = incoming
        return grad_q, block[2], block[3], None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, causal: bool = True,
                   layout: str = "zigzag", spans: list | None = None) -> torch.Tensor:
    """softmax(q·kᵀ/√D)·v over the whole sequence, from this rank's tokens q, k, v (B, H, T/cp, D) in `layout`;
    returns this rank's rows of the output, (B, H, T/cp, D). `spans`: a list that gets one
    ("attention", step, start, end) per ring step (time.perf_counter), to lay beside a CommLog's messages."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")
    if q.dim() != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"q, k, v must be (B, H, T/cp, D) of one shape; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    return _RingAttention.apply(q, k, v, group, causal, layout, spans)


class ContextParallelAttention(torch.nn.Module):
    """A GPT block's causal self-attention on this rank's tokens (B, T/cp, C) in the zig-zag layout, its
    projections those of `attn` (shared, not copied: LoRA or fake quantization on them stays), the attention itself
    the ring over `group`. Attention dropout has no place in the ring's blocks: `attn`'s must be 0."""

    def __init__(self, attn: CausalSelfAttention, group=None):
        super().__init__()
        if attn.attn_dropout.p:
            raise ValueError(f"attn has attention dropout p={attn.attn_dropout.p}: ring attention applies none")
        self.attn, self.group = attn, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, t, C = x.shape  # t = T/cp tokens of this rank
        q, k, v = split_heads(self.attn.c_attn(x), self.attn.n_head)  # 3 × (B, nh, t, hs)
        y = ring_attention(q, k, v, self.group, causal=True, layout="zigzag")  # (B, nh, t, hs)
        y = y.transpose(1, 2).contiguous().view(B, t, C)  # (B, t, C)
        return self.attn.resid_dropout(self.attn.c_proj(y))  # (B, t, C)
