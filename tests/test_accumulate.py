"""Gradient accumulation: the large-batch gradient only with the loss divided by k (C13), and DDP-style no_sync
moving 1/k of the bytes for the same gradient.

Tolerance: float64 throughout, so accumulated and large-batch gradients differ only by summation order: the
sums here have at most n·k·m = 96 terms of size O(1), giving errors ≲ 96·u·Σ|g| ≈ 1e-14 relative
(u = 2⁻⁵³ ≈ 1.1e-16). rtol=1e-10, atol=1e-12 leaves a wide margin and still catches any real difference
(a missing 1/k is a factor of 4).
"""

import pytest
import torch

from llmlab.accumulate import accumulate_gradients, data_parallel_accumulate, demo_batches

K, M = 4, 8  # micro-batches, rows per micro-batch
TOL = dict(rtol=1e-10, atol=1e-12)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def _data(rows):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 6, generator=g, dtype=torch.float64), torch.randn(rows, 1, generator=g,
                                                                               dtype=torch.float64)


def mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)  # the mean over the micro-batch


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _large_batch_grads(rows):
    model = _model()
    mse(model, _data(rows)).backward()
    return _grads(model)


def test_only_the_divided_loss_gives_the_large_batch_gradient():
    x, y = _data(K * M)
    micro = list(zip(x.split(M), y.split(M), strict=True))  # K × (M, 6), (M, 1)
    large = _large_batch_grads(K * M)
    model = _model()
    loss = accumulate_gradients(model, mse, micro)
    assert all(torch.allclose(g, ref, **TOL) for g, ref in zip(_grads(model), large, strict=True))
    assert loss == pytest.approx(mse(_model(), (x, y)).item(), rel=1e-12)
    accumulate_gradients(model, mse, micro, scale=False)  # starts from zero gradients again
    assert all(torch.allclose(g, K * ref, **TOL) for g, ref in zip(_grads(model), large, strict=True))


def test_the_material_snippet_is_the_unscaled_version():
    x, y = _data(K * M)
    model = _model()
    for inputs, targets in zip(x.split(M), y.split(M), strict=True):  # §4.2, steps left out
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
    snippet = _grads(model)
    accumulate_gradients(model, mse, list(zip(x.split(M), y.split(M), strict=True)), scale=False)
    assert all(torch.allclose(a, b, **TOL) for a, b in zip(snippet, _grads(model), strict=True))


def test_demo_batches_are_reproducible_and_checked():
    a, b = demo_batches(0, 3), demo_batches(0, 3, rows=8)
    assert len(a) == 3 and all(torch.equal(x1, x2) and torch.equal(y1, y2)
                               for (x1, y1), (x2, y2) in zip(a, b, strict=True))
    assert a[0][0].shape == (8, 32) and a[0][1].shape == (8, 1)
    with pytest.raises(ValueError, match="micro_batches=0 must be a positive int"):
        demo_batches(0, 0)
    with pytest.raises(ValueError, match="rows=True must be a positive int"):
        demo_batches(0, 2, rows=True)


def test_empty_batches_is_an_error():
    with pytest.raises(ValueError, match="batches is empty"):
        accumulate_gradients(_model(), mse, [])


def _data_parallel(no_sync):
    import torch.distributed as td

    from llmlab.dist import CommLog

    rank, n = td.get_rank(), td.get_world_size()
    x, y = _data(n * K * M)
    mine = slice(rank * K * M, (rank + 1) * K * M)  # this rank's share of the global batch
    micro = list(zip(x[mine].split(M), y[mine].split(M), strict=True))
    model = _model()
    with CommLog() as log:
        data_parallel_accumulate(model, mse, micro, no_sync=no_sync)
    return _grads(model), log.bytes_sent, log.by_op()["ring_all_reduce"].calls


@pytest.fixture(scope="module")
def cluster(clusters):
    return clusters(3)


def test_no_sync_moves_one_kth_of_the_bytes_for_the_same_gradient(cluster):
    synced, skipped = cluster.run(_data_parallel, False), cluster.run(_data_parallel, True)
    large = _large_batch_grads(3 * K * M)  # one process, the whole global batch
    for (g_sync, bytes_sync, calls_sync), (g_skip, bytes_skip, calls_skip) in zip(synced, skipped, strict=True):
        assert (calls_sync, calls_skip) == (K, 1)
        assert bytes_skip * K == bytes_sync  # the same all-reduce, 1 time instead of K
        for a, b, ref in zip(g_sync, g_skip, large, strict=True):
            assert torch.allclose(a, b, **TOL) and torch.allclose(b, ref, **TOL)
    # every rank ends with the very same gradient (the all-reduce's result is identical everywhere)
    assert all(torch.equal(a, b) for g, _, _ in skipped[1:] for a, b in zip(g, skipped[0][0], strict=True))
