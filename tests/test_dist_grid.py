"""dist.Grid on real gloo ranks: every layout of 1–4 ranks (dp × pp × cp × tp), each rank's coordinates and groups
against the layout enumerated here independently, an all-reduce on each group summing exactly its ranks, grids
over some ranks only, and the sizes it refuses."""

import itertools

import pytest

from llmlab import dist
from llmlab.dist import Grid

AXES = ("dp", "pp", "cp", "tp")


def _layouts(world):
    """Every (dp, pp, cp, tp) whose product is `world`."""
    return [s for s in itertools.product(range(1, world + 1), repeat=4) if s[0] * s[1] * s[2] * s[3] == world]


def _expected(sizes, ranks):
    """{global rank: (dp_rank, pp_rank, cp_rank, tp_rank)}, tp fastest: enumerated in nested loops, not by
    formula."""
    order = iter(ranks)
    return {next(order): c for c in itertools.product(*(range(n) for n in sizes))}


def _group_sum(group):
    import torch
    import torch.distributed as td

    t = torch.tensor([float(td.get_rank())], dtype=torch.float64)
    td.all_reduce(t, group=group)
    return t.item()


def _observe(grid):
    """What this rank sees of `grid`: coordinates, group ranks, group sizes and ranks by torch, all-reduce sums."""
    import torch.distributed as td

    if not grid.member:
        try:
            return grid.tp_group  # outside the grid: refused, never the default group
        except ValueError as e:
            return str(e)
    out = {"coords": tuple(getattr(grid, f"{a}_rank") for a in AXES),
           "neighbours": (grid.prev_pp_rank, grid.next_pp_rank),
           "stage_ends": (grid.is_first_stage, grid.is_last_stage),
           "layout": {r: grid.coords(r) for r in grid.ranks}}
    assert all(grid.rank_at(**dict(zip(AXES, c, strict=True))) == r for r, c in out["layout"].items())
    for axis in AXES:
        group = getattr(grid, f"{axis}_group")
        out[axis] = {"ranks": getattr(grid, f"{axis}_ranks"), "size": td.get_world_size(group),
                     "rank": td.get_rank(group), "sum": _group_sum(group), "world": group is td.group.WORLD}
    return out


SUBSETS = {(1, 3): (2, 1, 1, 1), (0, 1, 2): (1, 1, 1, 3), (0, 2): (1, 2, 1, 1), (0, 1, 3): (1, 1, 3, 1)}


def _on_ranks(world):
    """On every rank: every layout of the whole world, then grids over some ranks, then refused sizes."""
    import torch.distributed as td

    seen = {sizes: _observe(Grid(**dict(zip(AXES, sizes, strict=True)))) for sizes in _layouts(world)}
    for ranks, sizes in SUBSETS.items() if world == 4 else ():
        seen[ranks] = _observe(Grid(**dict(zip(AXES, sizes, strict=True)), ranks=ranks))
    refused = []
    for kwargs in (dict(dp=world + 1), dict(dp=2, tp=2, pp=2), dict(dp=1, ranks=[world]), dict(dp=2, ranks=[0, 0]),
                   dict(dp=2, ranks=[1, 0])):
        try:
            Grid(**kwargs)
        except ValueError as e:
            refused.append(str(e))
    return td.get_rank(), seen, refused


@pytest.fixture(scope="module", params=[1, 2, 3, 4])
def ranks(request):
    world = request.param
    return world, dist.spawn(_on_ranks, world, world, timeout=120)


def _check(sizes, ranks, per_rank):
    expected = _expected(sizes, ranks)
    for rank, got in per_rank.items():
        if rank not in expected:
            assert got == f"rank {rank} is not in this grid (ranks {list(ranks)}): it has no coordinates or groups " \
                          "(check grid.member)"
            continue
        coords = expected[rank]
        assert got["coords"] == coords, (sizes, rank)
        assert got["layout"] == expected  # Grid.coords of every rank, the same arithmetic on every rank
        for i, axis in enumerate(AXES):  # a group: the ranks whose other coordinates are this rank's
            want = [r for r, c in expected.items() if c[:i] + c[i + 1:] == coords[:i] + coords[i + 1:]]
            seen = got[axis]
            assert list(seen["ranks"]) == sorted(want), (axis, sizes, rank)
            assert seen["size"] == len(want) and seen["rank"] == coords[i]
            assert seen["sum"] == sum(want)  # the all-reduce reached exactly this group's ranks
            assert seen["world"] == (len(want) == len(per_rank))  # a group of every rank is the default group
        stages, p, pp = got["pp"]["ranks"], coords[1], sizes[1]
        assert got["stage_ends"] == (p == 0, p == pp - 1)
        assert got["neighbours"] == (stages[p - 1] if p else None, stages[p + 1] if p < pp - 1 else None)


def test_every_layout_matches_the_enumerated_one(ranks):
    world, results = ranks
    assert [rank for rank, _, _ in results] == list(range(world))
    for sizes in _layouts(world):
        _check(sizes, range(world), {rank: seen[sizes] for rank, seen, _ in results})
    if world == 4:
        assert {(2, 1, 1, 2), (2, 2, 1, 1), (1, 1, 1, 4), (4, 1, 1, 1), (2, 1, 2, 1), (1, 1, 2, 2)} <= set(_layouts(4))
        for subset, sizes in SUBSETS.items():
            _check(sizes, subset, {rank: seen[subset] for rank, seen, _ in results})


def test_capstone_layout_rank_g_is_tp_rank_g_mod_tp_of_replica_g_div_tp(ranks):
    world, results = ranks
    for tp in (t for t in (1, 2, 4) if world % t == 0):
        for rank, seen, _ in results:
            assert seen[(world // tp, 1, 1, tp)]["coords"] == (rank // tp, 0, 0, rank % tp)


def test_context_parallel_ranks_are_neighbours_between_tp_and_pp(ranks):
    """With tp = 1 global rank g is context-parallel rank g % cp of replica g // cp: a sequence's ranks adjacent."""
    world, results = ranks
    for cp in (c for c in (2, 4) if world % c == 0):
        for rank, seen, _ in results:
            assert seen[(world // cp, 1, cp, 1)]["coords"] == (rank // cp, 0, rank % cp, 0)


def test_bad_sizes_are_refused_on_the_ranks(ranks):
    world, results = ranks
    for _, _, refused in results:
        assert refused[0] == (f"dp × pp × cp × tp = {world + 1} × 1 × 1 × 1 = {world + 1} must equal the world size "
                              f"{world}")
        assert refused[1].startswith("dp × pp × cp × tp = 2 × 2 × 1 × 2 = 8 must equal")
        assert all("must be increasing global ranks" in e for e in refused[2:])
        assert len(refused) == 5


@pytest.mark.parametrize("kwargs, name", [(dict(dp=0), "dp=0"), (dict(tp=-1), "tp=-1"), (dict(pp=1.5), "pp=1.5"),
                                          (dict(dp=True), "dp=True"), (dict(tp="2"), "tp='2'")])
def test_a_size_that_is_not_a_positive_int_is_named(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} must be a positive int"):
        Grid(**kwargs)


def test_grid_needs_the_default_group():
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        Grid(dp=1)


def test_import_llmlab_dist_does_not_load_the_grid():
    import subprocess
    import sys

    code = "import sys, llmlab.dist; print('llmlab.dist.grid' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]


def _rebuilt_grids():
    """Grids with the same lines built again and again, as a long-lived rank does (a chapter's cluster runs a cell
    many times): the threads of this process before and after, whether the groups are the very same objects,
    and an all-reduce on the last grid's groups."""
    import os

    import torch
    import torch.distributed as td

    def threads():
        return len(os.listdir("/proc/self/task"))

    first = [Grid(dp=2, ranks=range(2)), Grid(tp=3)]  # (ranks 0, 1) as a subgroup, then every split of 3 ranks
    before = threads()
    for _ in range(20):
        again = [Grid(dp=2, ranks=range(2)), Grid(tp=3), Grid(dp=3)]
    after = threads()  # before the all-reduce below: only the grids are counted
    same = all(a._groups.get(axis) is b._groups.get(axis) for a, b in zip(first, again, strict=False)
               for axis in AXES)
    total = torch.ones(1)
    if again[0].member:
        td.all_reduce(total, group=again[0].dp_group)
    return before, after, same, total.item()


def test_a_grid_built_again_reuses_its_groups_and_threads(clusters):
    """Each new gloo group starts threads that live as long as the process: a grid per call grew a test session's
    rank to 430 gloo threads, taking ~30% of a core while idle. The same lines of ranks reuse their groups."""
    results = clusters(3).run(_rebuilt_grids)
    for rank, (before, after, same, total) in enumerate(results):
        assert same, f"rank {rank}: a grid built again made new groups"
        assert after == before, f"rank {rank}: {after - before} more threads after 20 grids built again"
        assert total == (2 if rank < 2 else 1)  # the reused subgroup still reaches exactly ranks 0 and 1
