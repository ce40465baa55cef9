"""llmlab's point-to-point collectives against torch.distributed's, on real gloo ranks.

One Cluster(5) runs every world size: sizes 2–4 through subgroups of non-consecutive ranks (so group ranks
differ from global ranks), 5 through the default group. Each test sends one function that runs all its
cases on the ranks and returns what went wrong, so the ranks are started once.

Tolerance for floats. Every all-reduce here adds the same N values in some order with N−1 roundings, then
(avg) divides once: by the standard bound for recursive summation, |computed − exact| ≤ γ_N · Σ|xᵢ| with
γ_N = N·u / (1 − N·u), u the unit roundoff (2⁻²⁴ fp32, 2⁻⁸ bf16). Both ours and torch's are held to that
bound against the exact (float64) sum, which any order of summation satisfies; integers are bit-exact.
"""

import hashlib
import re

import pytest
import torch

from llmlab import dist
from llmlab.dist import Grid

GROUP_RANKS = {2: [1, 3], 3: [0, 2, 4], 4: [1, 2, 3, 4], 5: [0, 1, 2, 3, 4]}
WORLD_SIZES = sorted(GROUP_RANKS)
DTYPES = (torch.float32, torch.bfloat16, torch.int64)
LARGE = 2**20 + 3  # 4 MiB of fp32: several tree segments
_groups: dict = {}  # on the ranks: world size → its dist.Grid, built once per rank process


@pytest.fixture(scope="module")
def cluster(clusters):
    return clusters(5)


def _sizes(n: int) -> list[int]:
    return sorted({0, 1, 2, 7, n - 1, 1009, LARGE})


def _group(n):
    """(group, my group rank) on the ranks of GROUP_RANKS[n]; (None, None) elsewhere."""
    import torch.distributed as td

    if not _groups:  # every rank builds every subgroup's grid, in the same order
        _groups.update({k: Grid(dp=k, ranks=ranks) for k, ranks in GROUP_RANKS.items() if k < td.get_world_size()})
    if td.get_rank() not in GROUP_RANKS[n]:
        return None, None
    if n not in _groups:
        return None, td.get_rank()  # the default group, passed as group=None
    return _groups[n].dp_group, _groups[n].dp_rank


def _input(seed: int, rank: int, size, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype.is_floating_point:
        return torch.randn(size, generator=g).to(dtype)
    return torch.randint(-1000, 1000, size if isinstance(size, tuple) else (size,), generator=g, dtype=dtype)


def _unit_roundoff(dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _reduction_error(name, got, exact, abs_sum, n, dtype):
    """None if `got` is within the summation bound of `exact` (see the module docstring), else a description."""
    if not dtype.is_floating_point:
        return None if torch.equal(got.double(), exact) else f"{name}: integers differ from the exact sum"
    nu = n * _unit_roundoff(dtype)
    bound = nu / (1 - nu) * abs_sum  # (S,)
    err = (got.double() - exact).abs()
    worst = (err - bound).max().item() if err.numel() else -1.0
    return None if worst <= 0 else f"{name}: error exceeds γ_N·Σ|x| by {worst:.3g}"


def _digest(t: torch.Tensor) -> str:
    raw = t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else t.dtype).numpy().tobytes()
    return hashlib.sha1(raw).hexdigest()


def _all_reduce_cases(n, op):
    import torch.distributed as td

    from llmlab.dist import ring_all_gather, ring_all_reduce, ring_reduce_scatter, tree_all_reduce

    group, rank = _group(n)
    if group is None and rank is None:
        return None
    algos = {"ring": ring_all_reduce, "tree": tree_all_reduce,
             "double_tree": lambda t, **kw: tree_all_reduce(t, double=True, **kw),
             "tree_small_segments": lambda t, **kw: tree_all_reduce(t, segment_bytes=256, **kw),  # pipelined
             "ring_small_pieces": lambda t, **kw: ring_all_reduce(t, piece_bytes=12, **kw)}  # 1–3 elements a piece
    problems, digests = [], []
    for size in _sizes(n):
        for dtype in DTYPES:
            if op == "avg" and not dtype.is_floating_point:
                continue
            inputs = [_input(size, r, size, dtype) for r in range(n)]  # every rank's input, known everywhere
            exact = torch.stack([x.double() for x in inputs]).sum(0) if size else torch.zeros(0, dtype=torch.float64)
            abs_sum = sum(x.double().abs() for x in inputs) if size else torch.zeros(0, dtype=torch.float64)
            if op == "avg":
                exact, abs_sum = exact / n, abs_sum / n
            case = f"n={n} size={size} {dtype} op={op}"
            reference = inputs[rank].clone()
            td.all_reduce(reference, group=group)
            if op == "avg":
                reference /= n
            results = {}
            for name, algo in algos.items():
                if name in ("tree_small_segments", "ring_small_pieces") and size == LARGE:
                    continue  # 16k segments or pieces: slow, and pipelining is covered by the smaller sizes
                x = inputs[rank].clone()
                out = algo(x, group=group, op=op)
                if out is not x:
                    problems.append(f"{case} {name}: did not return its input tensor")
                results[name] = x
                problems.append(_reduction_error(f"{case} {name}", x, exact, abs_sum, n, dtype))
            problems.append(_reduction_error(f"{case} torch.all_reduce", reference, exact, abs_sum, n, dtype))
            if "ring_small_pieces" in results and not torch.equal(results["ring_small_pieces"], results["ring"]):
                problems.append(f"{case}: the ring in pieces differs from the ring in whole chunks (same adds, "
                                "same order: the bits must agree)")
            if not dtype.is_floating_point and not torch.equal(results["ring"], reference):
                problems.append(f"{case}: ring differs from torch.all_reduce")
            shard = ring_reduce_scatter(inputs[rank], group=group, op=op)  # (size/n,)
            if not torch.equal(shard, torch.tensor_split(results["ring"], n)[rank]):
                problems.append(f"{case}: reduce-scatter is not chunk {rank} of the ring all-reduce")
            problems.append(_reduction_error(f"{case} reduce_scatter", shard, torch.tensor_split(exact, n)[rank],
                                             torch.tensor_split(abs_sum, n)[rank], n, dtype))
            if not torch.equal(ring_all_gather(shard, group=group), results["ring"]):
                problems.append(f"{case}: all_gather(reduce_scatter(x)) != ring_all_reduce(x)")
            if not torch.equal(inputs[rank], _input(size, rank, size, dtype)):
                problems.append(f"{case}: reduce-scatter changed its input")
            digests.append({k: _digest(v) for k, v in results.items()})
    return [p for p in problems if p], digests


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_reduce_and_reduce_scatter_match_torch(cluster, n, op):
    results = [r for r in cluster.run(_all_reduce_cases, n, op, timeout=120) if r is not None]
    assert len(results) == n
    problems = [p for problems, _ in results for p in problems]
    assert not problems, "\n".join(problems[:20])
    digests = [d for _, d in results]
    assert all(d == digests[0] for d in digests), "ranks hold different bits after an all-reduce"


def _gather_broadcast_a2a_cases(n):
    import torch.distributed as td

    from llmlab.dist import all_to_all, chunk_sizes, ring_all_gather, tree_broadcast

    group, rank = _group(n)
    if group is None and rank is None:
        return None
    problems = []
    for size in _sizes(n):
        for dtype in DTYPES:
            case = f"n={n} size={size} {dtype}"
            sizes = chunk_sizes(size, n)
            chunks = [_input(size, r, sizes[r], dtype) for r in range(n)]
            expected = torch.cat(chunks)
            if not torch.equal(ring_all_gather(chunks[rank], group=group), expected):
                problems.append(f"{case}: all_gather (sizes exchanged)")
            if not torch.equal(ring_all_gather(chunks[rank], group=group, sizes=sizes), expected):
                problems.append(f"{case}: all_gather (sizes given)")
            if len(set(sizes)) == 1:
                gathered = [torch.empty_like(chunks[rank]) for _ in range(n)]
                td.all_gather(gathered, chunks[rank], group=group)
                if not torch.equal(torch.cat(gathered), expected):
                    problems.append(f"{case}: torch.all_gather disagrees")
            for src in {0, n - 1}:
                x = _input(size, rank, size, dtype)
                tree_broadcast(x, src=src, group=group, segment_bytes=1024 if size < LARGE else 1 << 20)
                reference = _input(size, rank, size, dtype)
                td.broadcast(reference, src=GROUP_RANKS[n][src], group=group)
                if not (torch.equal(x, reference) and torch.equal(x, _input(size, src, size, dtype))):
                    problems.append(f"{case}: broadcast from {src}")
        # all-to-all: the chunk from j to i has (i + 2j + size) % 4 rows of 3, so some are empty
        rows = lambda i, j, size=size: (i + 2 * j + size) % 4
        for dtype in DTYPES:
            send = [_input(size, rank * n + i, (rows(i, rank), 3), dtype) for i in range(n)]
            got = all_to_all(send, group=group)
            want = [_input(size, j * n + rank, (rows(rank, j), 3), dtype) for j in range(n)]
            if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
                problems.append(f"n={n} size={size} {dtype}: all_to_all")
    return problems


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_gather_broadcast_all_to_all_are_exact(cluster, n):
    results = [r for r in cluster.run(_gather_broadcast_a2a_cases, n, timeout=120) if r is not None]
    assert len(results) == n
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems[:20])


def _strided_and_scalar(n):
    from llmlab.dist import ring_all_reduce, tree_all_reduce

    group, rank = _group(n)
    if group is None and rank is None:
        return None
    base = torch.arange(24.0).view(4, 6) * (rank + 1)
    out = []
    for algo in (ring_all_reduce, tree_all_reduce):
        strided = base.clone().t()  # (6, 4), not contiguous: reduced through a copy, written back
        out.append(algo(strided, group=group) is strided and torch.equal(strided, base.t() / (rank + 1) * 10))
        scalar = torch.tensor(float(rank + 1))  # 0-d
        out.append(torch.equal(algo(scalar, group=group), torch.tensor(10.0)))
    return out


def test_strided_and_0d_tensors(cluster):
    results = [r for r in cluster.run(_strided_and_scalar, 4) if r is not None]
    assert results == [[True] * 4] * 4


# -- bad input: the same clear error on every rank, quickly, and no rank left stuck -----------------------
def _bad_input(n, case):
    from llmlab.dist import (
        all_to_all,
        ring_all_gather,
        ring_all_reduce,
        ring_reduce_scatter,
        tree_all_reduce,
        tree_broadcast,
    )

    group, rank = _group(n)
    if group is None and rank is None:
        return "not a member"
    odd = rank == n - 1  # the rank that gets the bad input
    x = torch.ones(10)
    if case == "not_a_tensor":
        ring_all_reduce([1.0] * 10 if odd else x, group=group)
    elif case == "dtype":
        tree_all_reduce(x.bfloat16() if odd else x, group=group)
    elif case == "numel":
        ring_reduce_scatter(torch.ones(11) if odd else x, group=group)
    elif case == "op":
        ring_all_reduce(x, group=group, op="max" if odd else "sum")
    elif case == "op_mismatch":
        ring_all_reduce(x, group=group, op="avg" if odd else "sum")
    elif case == "op_everywhere":
        ring_all_reduce(x, group=group, op="mean")
    elif case == "avg_int":
        ring_all_reduce(x.long(), group=group, op="avg")
    elif case == "gather_dtype":
        ring_all_gather(x.double() if odd else x, group=group)
    elif case == "src":
        tree_broadcast(x, src=1 if odd else 0, group=group)
    elif case == "src_range":
        tree_broadcast(x, src=n, group=group)
    elif case == "a2a_length":
        all_to_all([x] * (n - 1 if odd else n), group=group)
    elif case == "a2a_dtype":
        all_to_all([x.long() if odd else x] * n, group=group)
    elif case == "piece_bytes":
        ring_all_reduce(x, group=group, piece_bytes=0)
    elif case == "unchecked_not_a_tensor":
        ring_all_reduce("x", group=group, check=False)
    return "no error"


BAD = {
    "not_a_tensor": (TypeError, r"tensor must be a torch.Tensor on every rank, but rank\(s\) \[2\] passed"),
    "dtype": (ValueError, r"tensor has dtype torch.float32 on rank 0 but torch.bfloat16 on rank 2"),
    "numel": (ValueError, r"tensor has 10 elements on rank 0 but 11 elements on rank 2"),
    "op": (ValueError, r"op must be one of 'sum', 'avg' on every rank; rank\(s\) \[2\] passed another"),
    "op_mismatch": (ValueError, r"op is 'sum' on rank 0 but 'avg' on rank 2"),
    "op_everywhere": (ValueError, r"op must be one of 'sum', 'avg'"),
    "avg_int": (ValueError, r"op='avg' needs a floating-point tensor, got torch.int64"),
    "gather_dtype": (ValueError, r"chunk has dtype torch.float32 on rank 0 but torch.float64 on rank 2"),
    "src": (ValueError, r"src is 0 on rank 0 but 1 on rank 2"),
    "src_range": (ValueError, r"tree_broadcast: src=3 must be an int in \[0, 2\] \(a rank of the group\)"),
    "a2a_length": (TypeError, r"chunks must be a list of 3 tensors .* rank\(s\) \[2\] passed"),
    "a2a_dtype": (ValueError, r"chunks have dtype torch.float32 on rank 0 but torch.int64 on rank 2"),
    "piece_bytes": (ValueError, r"piece_bytes=0 must be a positive int \(bytes per piece"),
    "unchecked_not_a_tensor": (TypeError, r"ring_all_reduce: tensor must be a torch.Tensor, got str"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_the_same_clear_error_on_every_rank(cluster, case):
    exc_type, message = BAD[case]
    pids = cluster.pids()
    with pytest.raises(dist.RankError) as info:
        cluster.run(_bad_input, 3, case, timeout=30)
    err = info.value
    assert err.rank == 0 and err.exc_type == exc_type.__name__  # group ranks [0, 2, 4]: the first is global 0
    assert isinstance(err.exception, exc_type)
    assert re.search(message, str(err.exception)), str(err.exception)
    assert "ranks 2, 4 failed too" in str(err)  # every member raised: nobody waited for the others
    assert cluster.pids() == pids  # no rank was stuck, so the launcher did not have to stop any


def _not_a_member():
    import torch.distributed as td

    from llmlab.dist import ring_all_reduce

    if td.get_rank() == 0:  # what torch.distributed.new_group([1, 3]) gives rank 0: the non-member handle
        ring_all_reduce(torch.ones(3), group=td.GroupMember.NON_GROUP_MEMBER)


def test_a_rank_outside_the_group_is_told_so(cluster):
    with pytest.raises(dist.RankError, match=r"global rank 0\) is not a member of group"):
        cluster.run(_not_a_member, timeout=30)


# -- point-to-point only: the bytes each rank sends are the ring's --------------------------------------------
def _ring_bytes(n, size):
    from llmlab.dist import CommLog, ring_all_reduce, ring_reduce_scatter

    group, rank = _group(n)
    if group is None and rank is None:
        return None
    with CommLog() as log:  # torch's collectives are counted too while it is open: none may appear
        ring_all_reduce(torch.ones(size), group=group)
        ring_reduce_scatter(torch.ones(size), group=group)
    p2p = sum(e.bytes_sent for e in log.events if e.kind == "p2p" and e.parent == "ring_all_reduce")
    return rank, {k: v.bytes_sent for k, v in log.by_op().items()}, p2p


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_sends_the_bandwidth_optimal_bytes(cluster, n):
    from llmlab.dist import chunk_sizes

    size = 1009 * 4 + n  # not divisible by n
    for result in cluster.run(_ring_bytes, n, size):
        if result is None:
            continue
        rank, sent, p2p = result
        assert set(sent) == {"ring_all_reduce", "ring_all_reduce.check", "ring_reduce_scatter",
                             "ring_reduce_scatter.check"}, sent  # no torch.distributed collective was used
        c = chunk_sizes(size, n)
        # reduce-scatter sends every chunk but its own, all-gather every chunk but the right neighbour's
        assert sent["ring_all_reduce"] == (2 * size - c[rank] - c[(rank + 1) % n]) * 4 == p2p
        assert abs(sent["ring_all_reduce"] - 2 * (n - 1) / n * size * 4) <= 2 * 4  # the formula, ± one element
        assert sent["ring_reduce_scatter"] == (size - c[rank]) * 4
        assert sent["ring_all_reduce.check"] == (n - 1) * 5 * 8  # N−1 records of 5 int64
