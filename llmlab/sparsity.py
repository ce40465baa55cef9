"""2:4 structured sparsity: in every group of 4 consecutive weights, 2 are zero.

Ampere and later tensor cores can skip the zeros of a 2:4-sparse operand, which is where the "2× with
sparsity" figures of the spec sheets come from. The speed-up needs (1) weights pruned to exactly this
pattern, usually followed by fine-tuning to recover accuracy, and (2) kernels that use the sparse
instructions (cuSPARSELt, `torch.sparse.to_sparse_semi_structured`). A dense kernel multiplying a pruned
matrix does the same work as before: half its multiplications are by zero.

    from llmlab import sparsity
    w24 = sparsity.prune_2_4(w)        # keep the 2 largest |w| of every 4 along the input dimension
    sparsity.is_2_4(w24)               # True

Claim C3 (tensor cores and the spec sheets' sparse peaks) is measured in `llmlab.claims.ch01`.
"""

from __future__ import annotations

import torch

__all__ = ["two_four_mask", "prune_2_4", "is_2_4"]


def _groups(w: torch.Tensor) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) or w.dim() < 1:
        raise ValueError(f"w must be a tensor with at least one dimension, got {type(w).__name__}")
    if w.shape[-1] % 4:
        raise ValueError(f"w.shape[-1]={w.shape[-1]} must be divisible by 4 for 2:4 sparsity")
    return w.reshape(*w.shape[:-1], w.shape[-1] // 4, 4)  # (..., K/4, 4)


def two_four_mask(w: torch.Tensor) -> torch.Tensor:
    """A boolean mask keeping the 2 largest-magnitude entries of every 4 along the last dimension."""
    groups = _groups(w)  # (..., K/4, 4)
    keep = groups.abs().topk(2, dim=-1).indices  # (..., K/4, 2)
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return mask.reshape(w.shape)


def prune_2_4(w: torch.Tensor) -> torch.Tensor:
    return w * two_four_mask(w)


def is_2_4(w: torch.Tensor) -> bool:
    """Every group of 4 along the last dimension has at most 2 non-zeros."""
    return bool(((_groups(w) != 0).sum(-1) <= 2).all())
