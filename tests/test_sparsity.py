"""2:4 pruning keeps the two largest magnitudes of every group of four."""

import pytest
import torch

from llmlab import sparsity


def test_keeps_two_largest_of_each_four():
    w = torch.tensor([[0.1, -3.0, 2.0, 0.5, 4.0, 0.0, -0.25, 0.5]])
    assert sparsity.prune_2_4(w).tolist() == [[0.0, -3.0, 2.0, 0.0, 4.0, 0.0, 0.0, 0.5]]


def test_random_weights_are_half_zero_and_2_4():
    w = torch.randn(37, 64)
    w24 = sparsity.prune_2_4(w)
    assert sparsity.is_2_4(w24) and not sparsity.is_2_4(w)
    assert (w24 == 0).float().mean().item() == 0.5
    kept = w24 != 0
    assert torch.equal(w24[kept], w[kept])  # kept entries unchanged
    # every dropped entry is no larger than the smaller kept entry of its group
    groups, mask = w.abs().reshape(37, 16, 4), kept.reshape(37, 16, 4)
    smallest_kept = groups.masked_fill(~mask, float("inf")).amin(-1)
    largest_dropped = groups.masked_fill(mask, -1.0).amax(-1)
    assert (largest_dropped <= smallest_kept).all()


def test_bad_input():
    with pytest.raises(ValueError, match=r"w.shape\[-1\]=6 must be divisible by 4"):
        sparsity.prune_2_4(torch.randn(3, 6))
    with pytest.raises(ValueError, match="w must be a tensor"):
        sparsity.two_four_mask([1.0, 2.0, 3.0, 4.0])
