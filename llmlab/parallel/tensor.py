"""Tensor parallelism (Megatron-LM; Shoeybi et al. 2019, §3): one layer's matrices split across ranks.

A linear layer Y = X·Aᵀ can be split two ways over N ranks:
- by output columns (`ColumnParallelLinear`): rank r holds rows r of A (out/N of them) and computes its
  slice Y_r = X·A_rᵀ of the output. Forward needs the whole X on every rank; backward sums the ranks'
  contributions to dL/dX.
- by input rows (`RowParallelLinear`): rank r holds columns r of A (in/N of them), takes its slice X_r of
  the input and computes a partial Y = Σ_r X_r·A_rᵀ, summed across ranks.

Megatron's MLP puts the two back to back (column-parallel c_fc, GELU on the slices, row-parallel c_proj), so
the whole MLP needs one all-reduce forward and one backward; attention splits the heads the same way. The
communication is two conjugate functions (the paper's Figure 3):

    f: forward identity,   backward all-reduce      (`copy_to_parallel`, before a column-parallel layer)
    g: forward all-reduce, backward identity        (`reduce_from_parallel`, after a row-parallel layer)

so a transformer block costs exactly two all-reduces forward and two backward. With `sequence_parallel=True`
(`llmlab.parallel.sequence`, Korthikanti et al. 2022) f becomes an all-gather along the sequence and g a
reduce-scatter along it, and everything between the tensor-parallel regions holds only this rank's T/N tokens.

The course text's `ColumnParallelLinear` snippet (§2.2) allocates the full (output_size, input_size) weight,
never calls `super().__init__()` and has no forward: nothing is split and nothing communicates. Here
`ColumnParallelLinear.from_linear(linear)` builds a rank's shard from the full layer, so its output and
gradients can be compared with the layer it came from (claim C6, measured in `llmlab.claims.ch02`).

    def block(x):                                   # on every rank of dist.spawn(block, 2, x)
        layer = ColumnParallelLinear.from_linear(full, gather_output=True)
        return layer(x)                              # equals full(x) on every rank
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as td
import torch.nn.functional as F

from llmlab.model import causal_attention, split_heads
from llmlab.parallel.sequence import gathered_linear, reduce_scatter_sequence

__all__ = ["copy_to_parallel", "reduce_from_parallel", "gather_from_parallel", "scatter_to_parallel",
           "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelSelfAttention", "ParallelBlock"]


class _CopyToParallel(torch.autograd.Function):
    """Megatron's f (Shoeybi et al. 2019, Fig. 3): identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        td.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's g (Shoeybi et al. 2019, Fig. 3): all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        td.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromParallel(torch.autograd.Function):
    """Concatenate the ranks' slices along the last dimension; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(td.get_world_size(group))]
        td.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(td.get_world_size(ctx.group), dim=-1)[td.get_rank(ctx.group)].contiguous(), None


class _ScatterToParallel(torch.autograd.Function):
    """Keep this rank's slice of the last dimension; backward gathers the slices' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.chunk(td.get_world_size(group), dim=-1)[td.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _GatherFromParallel.apply(grad, ctx.group), None


def copy_to_parallel(x, group=None):
    return _CopyToParallel.apply(x, group)


def reduce_from_parallel(x, group=None):
    return _ReduceFromParallel.apply(x, group)


def gather_from_parallel(x, group=None):
    return _GatherFromParallel.apply(x, group)


def scatter_to_parallel(x, group=None):
    return _ScatterToParallel.apply(x, group)


def _shard_size(name: str, size: int, group) -> int:
    n = td.get_world_size(group)
    if size % n:
        raise ValueError(f"{name}={size} is not divisible by the tensor-parallel world size {n}")
    return size // n


def _block(size: int, group) -> torch.Tensor:
    """Indices of this rank's contiguous block of `size` (rank r gets [r·size, (r+1)·size))."""
    r = td.get_rank(group)
    return torch.arange(r * size, (r + 1) * size)


def _load(layer: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Module:
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer.to(weight.dtype)


class ColumnParallelLinear(torch.nn.Module):
    """Y = X·Aᵀ + b with A split by output rows: this rank holds (out_features/N, in_features) of it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group=None, sequence_parallel: bool = False):
        super().__init__()
        if gather_output and sequence_parallel:
            raise ValueError("gather_output=True with sequence_parallel=True: a sequence-parallel layer's output "
                             "feeds a row-parallel layer, which reduce-scatters it; gather it there, not here")
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        local = _shard_size("out_features", out_features, group)
        self.weight = torch.nn.Parameter(torch.empty(local, in_features))
        self.bias = torch.nn.Parameter(torch.zeros(local)) if bias else None
        torch.nn.init.normal_(self.weight, std=0.02)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group=None, gather_output: bool = False, rows=None,
                    sequence_parallel: bool = False):
        """This rank's shard of `linear` (`rows`: which output rows it gets; default the r-th block)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, gather_output, group,
                    sequence_parallel)
        rows = _block(layer.weight.shape[0], group) if rows is None else rows
        return _load(layer, linear.weight[rows], None if linear.bias is None else linear.bias[rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # x: (B, T/N, in), this rank's tokens; g gathers them to (B, T, in)
            return gathered_linear(x, self.weight, self.bias, self.group)  # (B, T, out/N)
        x = copy_to_parallel(x, self.group)  # (..., in): f — gradients from all ranks are summed backward
        y = F.linear(x, self.weight, self.bias)  # (..., out/N)
        return gather_from_parallel(y, self.group) if self.gather_output else y


class RowParallelLinear(torch.nn.Module):
    """Y = X·Aᵀ + b with A split by input columns: this rank holds (out_features, in_features/N) of it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 group=None, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        local = _shard_size("in_features", in_features, group)
        self.weight = torch.nn.Parameter(torch.empty(out_features, local))
        self.bias = torch.nn.Parameter(torch.zeros(out_features)) if bias else None  # added once, after the sum
        torch.nn.init.normal_(self.weight, std=0.02)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group=None, input_is_parallel: bool = True, cols=None,
                    sequence_parallel: bool = False):
        """This rank's shard of `linear` (`cols`: which input columns it gets; default the r-th block)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, input_is_parallel, group,
                    sequence_parallel)
        cols = _block(layer.weight.shape[1], group) if cols is None else cols
        return _load(layer, linear.weight[:, cols], linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_parallel(x, self.group)  # (..., in/N)
        y = F.linear(x, self.weight)  # (..., out): this rank's partial sum
        if self.sequence_parallel:
            y = reduce_scatter_sequence(y, self.group)  # (B, T/N, out): ḡ — this rank's tokens of the sum
        else:
            y = reduce_from_parallel(y, self.group)  # (..., out): g — summed over ranks
        return y + self.bias if self.bias is not None else y


class ParallelMLP(torch.nn.Module):
    """Megatron's MLP: column-parallel c_fc → GELU on this rank's 4C/N slice → row-parallel c_proj."""

    def __init__(self, mlp, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.c_fc = ColumnParallelLinear.from_linear(mlp.c_fc, group, sequence_parallel=sequence_parallel)
        self.c_proj = RowParallelLinear.from_linear(mlp.c_proj, group, sequence_parallel=sequence_parallel)
        self.gelu, self.dropout = copy.deepcopy(mlp.gelu), copy.deepcopy(mlp.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C); one all-reduce each way (or RS+AG)


class ParallelSelfAttention(torch.nn.Module):
    """Causal self-attention with this rank's n_head/N heads: qkv column-parallel, c_proj row-parallel."""

    def __init__(self, attn, group=None, sequence_parallel: bool = False):
        super().__init__()
        C = attn.c_attn.in_features
        self.n_head, self.flash = _shard_size("n_head", attn.n_head, group), attn.flash
        self.recompute = attn.recompute  # "selective": the attention core is recomputed in backward
        mine = _block(C // td.get_world_size(group), group)  # this rank's channels of q, k and v alike
        qkv_rows = torch.cat([mine, C + mine, 2 * C + mine])  # this rank's heads in each of q, k, v
        self.c_attn = ColumnParallelLinear.from_linear(attn.c_attn, group, rows=qkv_rows,
                                                       sequence_parallel=sequence_parallel)
        self.c_proj = RowParallelLinear.from_linear(attn.c_proj, group, cols=mine, sequence_parallel=sequence_parallel)
        self.attn_dropout, self.resid_dropout = copy.deepcopy(attn.attn_dropout), copy.deepcopy(attn.resid_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # (B, T, 3C/N): the whole sequence, also when x holds only T/N of it
        B, T, _ = qkv.shape
        q, k, v = split_heads(qkv, self.n_head)  # 3 × (B, nh/N, T, hs)
        y = causal_attention(q, k, v, self.attn_dropout, self.flash, self.recompute)  # (B, nh/N, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C/N)
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


class ParallelBlock(torch.nn.Module):
    """A transformer block with tensor-parallel attention and MLP; layer norms replicated on every rank.

    With `sequence_parallel=True` the block takes and returns this rank's tokens, (B, T/N, C) (cut them with
    `llmlab.parallel.sequence.scatter_sequence`), and its norms, dropouts and residuals work on those alone.
    The layer norms' weights are then replicated but see different tokens on each rank: their gradients are
    partial sums, to be all-reduced over the tensor-parallel group (`all_reduce_replicated_grads`) — Megatron-LM
    marks them `sequence_parallel` for the same all-reduce.
    """

    def __init__(self, block, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.ln_1, self.ln_2 = copy.deepcopy(block.ln_1), copy.deepcopy(block.ln_2)
        self.attn = ParallelSelfAttention(block.attn, group, sequence_parallel)
        self.mlp = ParallelMLP(block.mlp, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C), or (B, T/N, C) with sequence parallelism
        return x + self.mlp(self.ln_2(x))  # (B, T, C), or (B, T/N, C)

    def all_reduce_replicated_grads(self) -> None:
        """Under sequence parallelism, sum over the group the gradients that each rank computed on its own tokens
        only: the layer norms' and the row-parallel biases'. Call after backward; nothing to do without it."""
        if not self.sequence_parallel:
            return
        params = [*self.ln_1.parameters(), *self.ln_2.parameters()]
        params += [m.bias for m in (self.attn.c_proj, self.mlp.c_proj) if m.bias is not None]
        for p in params:
            if p.grad is not None:
                td.all_reduce(p.grad, group=self.group)
