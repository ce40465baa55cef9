"""dist.Grid on real gloo ranks: every layout of 1–4 ranks (dp × pp × tp), each rank's coordinates and groups
against the layout enumerated here independently, an all-reduce on each group summing exactly its ranks, grids
over some ranks only, and the sizes it refuses."""

import itertools

import pytest

from llmlab import dist
from llmlab.dist import Grid


def _layouts(world):
    """Every (dp, pp, tp) whose product is `world`."""
    return [(dp, pp, tp) for dp, pp, tp in itertools.product(range(1, world + 1), repeat=3) if dp * pp * tp == world]


def _expected(dp, pp, tp, ranks):
    """{global rank: (dp_rank, pp_rank, tp_rank)}, tp fastest: enumerated in nested loops, not by formula."""
    order = iter(ranks)
    return {next(order): (d, p, t) for d in range(dp) for p in range(pp) for t in range(tp)}


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
    out = {"coords": (grid.dp_rank, grid.pp_rank, grid.tp_rank), "neighbours": (grid.prev_pp_rank, grid.next_pp_rank),
           "stage_ends": (grid.is_first_stage, grid.is_last_stage),
           "layout": {r: grid.coords(r) for r in grid.ranks}}
    assert all(grid.rank_at(dp=d, pp=p, tp=t) == r for r, (d, p, t) in out["layout"].items())
    for axis in ("dp", "pp", "tp"):
        group = getattr(grid, f"{axis}_group")
        out[axis] = {"ranks": getattr(grid, f"{axis}_ranks"), "size": td.get_world_size(group),
                     "rank": td.get_rank(group), "sum": _group_sum(group), "world": group is td.group.WORLD}
    return out


def _on_ranks(world):
    """On every rank: every layout of the whole world, then grids over some ranks, then refused sizes."""
    import torch.distributed as td

    seen = {layout: _observe(Grid(dp=layout[0], pp=layout[1], tp=layout[2])) for layout in _layouts(world)}
    subsets = {(1, 3): (2, 1, 1), (0, 1, 2): (1, 1, 3), (0, 2): (1, 2, 1)} if world == 4 else {}
    for ranks, (dp, pp, tp) in subsets.items():
        seen[ranks] = _observe(Grid(dp=dp, pp=pp, tp=tp, ranks=ranks))
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


def _check(dp, pp, tp, ranks, per_rank):
    expected = _expected(dp, pp, tp, ranks)
    for rank, got in per_rank.items():
        if rank not in expected:
            assert got == f"rank {rank} is not in this grid (ranks {list(ranks)}): it has no coordinates or groups " \
                          "(check grid.member)"
            continue
        d, p, t = expected[rank]
        assert got["coords"] == (d, p, t), (dp, pp, tp, rank)
        assert got["layout"] == expected  # Grid.coords of every rank, the same arithmetic on every rank
        members = {"dp": [r for r, c in expected.items() if c[1:] == (p, t)],
                   "pp": [r for r, c in expected.items() if (c[0], c[2]) == (d, t)],
                   "tp": [r for r, c in expected.items() if c[:2] == (d, p)]}
        for axis, want in members.items():
            seen = got[axis]
            assert list(seen["ranks"]) == sorted(want), (axis, dp, pp, tp, rank)
            assert seen["size"] == len(want) and seen["rank"] == (d, p, t)[("dp", "pp", "tp").index(axis)]
            assert seen["sum"] == sum(want)  # the all-reduce reached exactly this group's ranks
            assert seen["world"] == (len(want) == len(per_rank))  # a group of every rank is the default group
        stages = members["pp"]
        assert got["stage_ends"] == (p == 0, p == pp - 1)
        assert got["neighbours"] == (stages[p - 1] if p else None, stages[p + 1] if p < pp - 1 else None)


def test_every_layout_matches_the_enumerated_one(ranks):
    world, results = ranks
    assert [rank for rank, _, _ in results] == list(range(world))
    for layout in _layouts(world):
        _check(*layout, range(world), {rank: seen[layout] for rank, seen, _ in results})
    if world == 4:
        assert {(2, 1, 2), (2, 2, 1), (1, 1, 4), (4, 1, 1)} <= set(_layouts(4))  # dp2×tp2, pp2×dp2, …
        for subset, layout in {(1, 3): (2, 1, 1), (0, 1, 2): (1, 1, 3), (0, 2): (1, 2, 1)}.items():
            _check(*layout, subset, {rank: seen[subset] for rank, seen, _ in results})


def test_capstone_layout_rank_g_is_tp_rank_g_mod_tp_of_replica_g_div_tp(ranks):
    world, results = ranks
    for tp in (t for t in (1, 2, 4) if world % t == 0):
        for rank, seen, _ in results:
            assert seen[(world // tp, 1, tp)]["coords"] == (rank // tp, 0, rank % tp)


def test_bad_sizes_are_refused_on_the_ranks(ranks):
    world, results = ranks
    for _, _, refused in results:
        assert refused[0] == f"dp × pp × tp = {world + 1} × 1 × 1 = {world + 1} must equal the world size {world}"
        assert refused[1].startswith("dp × pp × tp = 2 × 2 × 2 = 8 must equal")
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
