"""DataParallel from scratch equals single-process training on the full batch and torch's DDP."""

import pytest
import torch

from llmlab.dist import Grid
from llmlab.parallel.ddp import DataParallel, buckets

STEPS, BATCH = 3, 8


def _model():
    from llmlab.model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", n_layer=2, block_size=16)).double()


def _batches():
    from llmlab.data import MarkovSource, SyntheticDataset

    data = SyntheticDataset(MarkovSource(64), batch_size=BATCH, block_size=16, seed=3)
    return [data.get_batch(s) for s in range(STEPS)]


def _train(world, wrap, bucket_mb=25.0):
    """STEPS of SGD on this rank's rows of each batch, on the first `world` ranks; returns the final
    parameters and the number of all-reduces logged."""

    from llmlab.dist import CommLog

    grid = Grid(dp=world, ranks=range(world))  # every rank takes part in creating the groups
    if not grid.member:
        return None
    group, rank = grid.dp_group, grid.dp_rank
    model = _model()
    if rank > 0:  # a different start on the other ranks: the broadcast from rank 0 must make them equal
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    if wrap == "ours":
        model = DataParallel(model, bucket_mb=bucket_mb, group=group)
    elif wrap == "torch":
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb, process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with CommLog() as log:
        for x, y in _batches():
            rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
            loss = model(x[rows], y[rows])[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
    calls = log.by_op().get("torch.all_reduce")
    return [p.detach() for p in model.parameters()], calls.calls if calls else 0


@pytest.fixture(scope="module")
def cluster(clusters):
    return clusters(4)


@pytest.fixture(scope="module")
def reference():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for x, y in _batches():
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [2, 4])
def test_equals_full_batch_training_and_torch_ddp(cluster, world_size, reference):
    ours = cluster.run(_train, world_size, "ours", timeout=120)
    theirs = cluster.run(_train, world_size, "torch", timeout=120)
    for rank in range(world_size):
        for got, ddp, ref in zip(ours[rank][0], theirs[rank][0], reference, strict=True):
            # float64: averaging per-rank means differs from the full-batch mean by rounding only
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(got, ddp, rtol=1e-10, atol=1e-12)


def test_bucket_size_changes_the_number_of_all_reduces_not_the_result(cluster, reference):
    small = cluster.run(_train, 2, "ours", 0.01, timeout=120)  # 10 KB buckets
    large = cluster.run(_train, 2, "ours", 100.0, timeout=120)  # one bucket
    n_buckets = len(buckets([p for p in _model().parameters()], 0.01))
    assert large[0][1] == STEPS and small[0][1] == STEPS * n_buckets > STEPS
    for got, ref in zip(small[0][0], reference, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_no_sync_skips_communication(cluster):
    def accumulate():
        import torch.distributed as td

        from llmlab.dist import CommLog

        model = DataParallel(_model())
        (x, y), = _batches()[:1]
        with CommLog() as log:
            with model.no_sync():
                model(x[:2], y[:2])[1].backward()
            model(x[2:4], y[2:4])[1].backward()
        return log.by_op()["torch.all_reduce"].calls, td.get_rank()

    assert [r[0] for r in cluster.run(accumulate, timeout=120)] == [1] * 4


def test_bad_input():
    with pytest.raises(ValueError, match="bucket_mb=0"):
        buckets([torch.nn.Parameter(torch.ones(2))], 0)
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        DataParallel(torch.nn.Linear(2, 2))
