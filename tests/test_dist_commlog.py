"""CommLog on 2–4 gloo ranks: bytes per collective and per message, torch collectives counted as the ring would
move them, timestamps that nest, and the double binary tree's balanced load."""

import pytest
import torch

from llmlab.dist import Grid

_groups: dict = {}  # on the ranks: world size n → the dist.Grid of ranks 0 … n-1 (4: the default group, None)


@pytest.fixture(scope="module")
def cluster(clusters):
    return clusters(4)


def _group(n):
    if not _groups:  # every rank builds every grid, in the same order
        _groups.update({k: Grid(dp=k, ranks=range(k)) for k in (2, 3)})
    if n not in _groups:
        return None
    return _groups[n].dp_group if _groups[n].member else False


def _ring_and_torch(n, size):
    import torch.distributed as td

    from llmlab.dist import CommLog, ring_all_reduce

    group = _group(n)
    if group is False:
        return None
    with CommLog() as log:
        ring_all_reduce(torch.ones(size), group=group)
        td.all_reduce(torch.ones(size), group=group)
    ops = log.by_op()
    return td.get_rank(group), ops, log.bytes_sent, log.bytes_received, td.all_reduce.__module__


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("size", [1024, 1021])
def test_torch_all_reduce_is_counted_as_the_ring_moves_it(cluster, n, size):
    results = [r for r in cluster.run(_ring_and_torch, n, size) if r is not None]
    assert len(results) == n
    for _, ops, sent, received, module in results:
        assert list(ops) == ["ring_all_reduce.check", "ring_all_reduce", "torch.all_reduce"]
        assert ops["torch.all_reduce"].calls == 1
        assert ops["torch.all_reduce"].bytes_sent == ops["ring_all_reduce"].bytes_sent
        assert ops["torch.all_reduce"].bytes_received == ops["ring_all_reduce"].bytes_received
        assert sent == sum(s.bytes_sent for s in ops.values())
        assert received == sum(s.bytes_received for s in ops.values())
        assert module == "torch.distributed.distributed_c10d"  # unwrapped again once the log closed
    if size % n == 0:
        assert all(r[1]["torch.all_reduce"].bytes_sent == 2 * (n - 1) * size * 4 // n for r in results)


def _torch_collectives(n):
    import torch.distributed as td

    from llmlab.dist import CommLog

    group = _group(n)
    if group is False:
        return None
    rank, S = td.get_rank(group), 12 * n  # elements
    with CommLog() as log:
        td.reduce_scatter_tensor(torch.zeros(S // n), torch.ones(S), group=group)
        td.all_gather_into_tensor(torch.zeros(S), torch.ones(S // n), group=group)
        td.broadcast(torch.ones(S), src=td.get_global_rank(group, 1) if group else 1, group=group)
        splits = [rank + j + 1 for j in range(n)]  # rows I send to j
        recv = [j + rank + 1 for j in range(n)]  # rows j sends me
        td.all_to_all_single(torch.zeros(sum(recv), 2), torch.ones(sum(splits), 2), recv, splits, group=group)
    return rank, {k: (v.bytes_sent, v.bytes_received) for k, v in log.by_op().items()}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_torch_collectives_are_counted(cluster, n):
    results = sorted(r for r in cluster.run(_torch_collectives, n) if r is not None)
    S = 12 * n * 4  # bytes
    for rank, ops in results:
        assert ops["torch.reduce_scatter_tensor"] == ((n - 1) * S // n,) * 2
        assert ops["torch.all_gather_into_tensor"] == ((n - 1) * S // n,) * 2
        position = (rank - 1) % n  # in the chain from src = 1
        assert ops["torch.broadcast"] == (S if position < n - 1 else 0, S if position > 0 else 0)
        own = (2 * rank + 1) * 2 * 4  # the rows a rank sends itself
        sent = sum(rank + j + 1 for j in range(n)) * 2 * 4 - own
        assert ops["torch.all_to_all_single"] == (sent, sent)
    for name in results[0][1]:  # what one rank sends, another receives
        assert sum(ops[name][0] for _, ops in results) == sum(ops[name][1] for _, ops in results), name


def _events(n):
    import torch.distributed as td

    from llmlab.dist import CommLog, ring_all_gather

    group = _group(n)
    if group is False:
        return None
    with CommLog(torch_collectives=False) as outer:
        with CommLog() as inner:
            out = ring_all_gather(torch.full((3,), float(td.get_rank(group))), group=group)
        td.all_reduce(torch.ones(4), group=group)  # the outer log ignores torch collectives
    return td.get_rank(group), out.tolist(), outer.events, inner.events, outer.summary()


def test_events_are_well_formed_and_logs_nest(cluster):
    n = 3
    for rank, out, outer, inner, summary in (r for r in cluster.run(_events, n) if r is not None):
        assert out == [0.0] * 3 + [1.0] * 3 + [2.0] * 3
        assert outer == inner  # the inner log saw the same; the torch all_reduce after it was not logged
        (collective,) = [e for e in outer if e.name == "ring_all_gather"]
        messages = [e for e in outer if e.parent == "ring_all_gather"]
        assert len(messages) == 2 * (n - 1)  # one send and one receive per step
        for e in messages:
            assert e.kind == "p2p" and collective.start <= e.start <= e.end <= collective.end
            assert e.peer == ((rank + 1) % n if e.name == "send" else (rank - 1) % n)  # right, from the left
            assert (e.bytes_sent, e.bytes_received) == ((12, 0) if e.name == "send" else (0, 12))
        assert collective.bytes_sent == collective.bytes_received == (n - 1) * 12
        assert "ring_all_gather" in summary and summary.splitlines()[-1].startswith("total")


def _loose_messages():
    import torch.distributed as td

    from llmlab.dist import CommLog
    from llmlab.dist.commlog import exchange

    rank, n = td.get_rank(), td.get_world_size()
    got = torch.empty(5)
    with CommLog() as log:
        exchange(sends=[(torch.full((5,), float(rank)), (rank + 1) % n)], recvs=[(got, (rank - 1) % n)])
    return got[0].item(), {k: tuple(v)[:3] for k, v in log.by_op().items()}, log.bytes_sent


def test_messages_outside_a_collective_are_logged_by_kind(cluster):
    for rank, (got, ops, sent) in enumerate(cluster.run(_loose_messages)):
        assert got == (rank - 1) % 4
        assert ops == {"send": (1, 20, 0), "recv": (1, 0, 20)} and sent == 20


def _tree_load(double):
    from llmlab.dist import CommLog, tree_all_reduce

    with CommLog() as log:
        tree_all_reduce(torch.ones(1000), double=double, check=False)
    return log.bytes_sent


def test_double_binary_tree_balances_the_load(cluster):
    S = 4000  # bytes
    # one tree (0 → 1, 2; 1 → 3): interior ranks send up and to two children, leaves only up
    assert cluster.run(_tree_load, False) == [2 * S, 2 * S, S, S]
    # two mirrored trees with half the data each: every rank is interior in one of them, so all send 1.5·S
    assert cluster.run(_tree_load, True) == [1.5 * S] * 4


def test_the_clock_is_read_after_the_device_is_synchronised(monkeypatch):
    # on a GPU, kernels queued before a collective must not count as its time: the log synchronises the device
    # before reading the clock at the start, and again at the end (here _sync is recorded, as there is no GPU)
    from llmlab.dist import commlog

    calls = []
    monkeypatch.setattr(commlog, "_sync", lambda t: calls.append(("sync", t)))
    monkeypatch.setattr(commlog.time, "perf_counter", lambda: calls.append(("clock", None)) or 0.0)
    x = torch.ones(3)  # (3,)
    with commlog.CommLog() as log, commlog.scope("op", x):
        calls.append(("body", None))
    assert calls == [("sync", x), ("clock", None), ("body", None), ("sync", x), ("clock", None)]
    assert [e.name for e in log.events] == ["op"]
