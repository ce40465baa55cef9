"""The process grid: the ranks laid out as data parallel × pipeline × context parallel × tensor parallel, and
their groups.

    grid = Grid(dp=2, tp=2)              # on every rank, once, after the default group exists (4 ranks)
    grid.dp_rank, grid.tp_rank           # this rank's coordinates
    grid.tp_group, grid.tp_ranks         # its tensor-parallel group and the global ranks in it
    td.all_reduce(t, group=grid.dp_group)

Layout (as picotron's process-group manager, github.com/huggingface/picotron, and Megatron): tensor parallel is
the fastest axis, then context parallel (`cp`: the ranks that split each sequence, llmlab.parallel.context), then
pipeline, then data parallel, so the ranks of one tensor-parallel group are neighbours (one node, the fastest
links) and the i-th of `ranks` sits at

    i = ((dp_rank · pp + pp_rank) · cp + cp_rank) · tp + tp_rank

With pp = cp = 1, global rank g is tensor-parallel rank g % tp of data-parallel replica g // tp: the layout
`llmlab train`'s saved checkpoints record. Each group lists its ranks in increasing order, so a rank's
coordinate on an axis is its rank in that axis's group (`td.get_rank(grid.tp_group) == grid.tp_rank`).

`torch.distributed.new_group` is collective: every rank of the world must create every group, in the same order,
even a group it is not in. `Grid` does that (tensor-parallel groups, then context, pipeline, data parallel), so it
must be built on every rank with the same arguments. A group that spans the whole world is the default group
(`td.group.WORLD`), not a new one. `ranks=` lays the grid over some ranks only (increasing global ranks, e.g. the
first 2 of a 4-rank cluster): the others still build it (`grid.member` is False there) and have no coordinates
or groups.

A group is made once per line of ranks and reused by every later grid that has that line (until the default group
is replaced): gloo gives each group its own threads and sockets, which stay until the process ends, so a
long-lived rank (a chapter's cluster, the checks' cluster, a test session's) that built a grid per call grew to
hundreds of groups, their threads taking about 30% of a core while idle (430 of them: 393 s of CPU in
21 min). Every rank asks for the same lines in the same order, so every rank makes the same groups and skips the
same ones.
"""

from __future__ import annotations

import itertools

import torch.distributed as td

from llmlab import validation

__all__ = ["Grid"]

AXES = ("dp", "pp", "cp", "tp")  # slowest to fastest
_MADE: dict = {"world": None, "groups": {}}  # the default group they belong to, and line of ranks -> group


def _group_of(line: tuple[int, ...], world: int):
    """The process group of the global ranks `line`: the default group for the whole world, else the one made for
    this line before (with this default group), else a new one (collective: see the module docstring)."""
    if line == tuple(range(world)):
        return td.group.WORLD
    if _MADE["world"] is not td.group.WORLD:  # first use, or the default group was destroyed and made anew
        _MADE.update(world=td.group.WORLD, groups={})
    if line not in _MADE["groups"]:
        _MADE["groups"][line] = td.new_group(list(line))
    return _MADE["groups"][line]


class Grid:
    """`dp` × `pp` × `cp` × `tp` ranks (positive ints whose product is the number of ranks: the world size, or
    `len(ranks)`); see the module docstring for the layout. Build it on every rank with the same arguments."""

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, *, cp: int = 1, ranks=None):
        for name, size in (("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp)):
            validation.positive_int(name, size)
        if not td.is_initialized():
            raise RuntimeError("Grid needs torch.distributed initialised first (dist.spawn, a dist.Cluster, or "
                               "dist.init_from_env() under torchrun)")
        world = td.get_world_size()
        where = f"the world size {world}"
        if ranks is None:
            ranks = tuple(range(world))
        else:
            ranks = tuple(ranks)
            if not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world for r in ranks) \
                    or any(a >= b for a, b in zip(ranks, ranks[1:], strict=False)):
                raise ValueError(f"ranks={list(ranks)} must be increasing global ranks (ints in [0, {world - 1}]), "
                                 "each once")
            where = f"the {len(ranks)} ranks {list(ranks)}"
        if dp * pp * cp * tp != len(ranks):
            raise ValueError(f"dp × pp × cp × tp = {dp} × {pp} × {cp} × {tp} = {dp * pp * cp * tp} must equal "
                             f"{where}")
        self.dp, self.pp, self.cp, self.tp, self.ranks = dp, pp, cp, tp, ranks
        self.rank = td.get_rank()
        self.member = self.rank in ranks
        self._coords = self.coords(self.rank) if self.member else None
        self._groups, self._members = {}, {}
        for axis in reversed(AXES):  # tp, cp, pp, dp: the same order on every rank
            for line in self._lines(axis):
                group = _group_of(line, world)
                if self.rank in line:
                    self._groups[axis], self._members[axis] = group, line

    def __repr__(self) -> str:
        where = (", ".join(f"{a}_rank={c}" for a, c in zip(AXES, self._coords, strict=True)) if self.member
                 else "not a member")
        return f"Grid(dp={self.dp}, pp={self.pp}, cp={self.cp}, tp={self.tp}) on rank {self.rank}: {where}"

    # --- the layout: pure arithmetic, the same on every rank ---------------------------------------------------

    def rank_at(self, *, dp: int = 0, pp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The global rank at these coordinates (each in [0, size of its axis))."""
        i = 0
        for name, value in (("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp)):  # slowest to fastest
            validation.integer(name, value, low=0, high=getattr(self, name) - 1)
            i = i * getattr(self, name) + value
        return self.ranks[i]

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(dp_rank, pp_rank, cp_rank, tp_rank) of global rank `rank` (ValueError if it is not in the grid)."""
        if rank not in self.ranks:
            raise ValueError(f"rank={rank!r} is not in this grid (ranks {list(self.ranks)})")
        i, out = self.ranks.index(rank), []
        for axis in reversed(AXES):  # fastest first: the last digit of i in the mixed radix (dp, pp, cp, tp)
            i, c = divmod(i, getattr(self, axis))
            out.append(c)
        return tuple(reversed(out))

    def _lines(self, axis: str) -> list[tuple[int, ...]]:
        """Every group along `axis`: the ranks whose other coordinates are equal, in a fixed order."""
        others = [a for a in AXES if a != axis]
        out = []
        for fixed in itertools.product(*(range(getattr(self, a)) for a in others)):
            at = dict(zip(others, fixed, strict=True))
            out.append(tuple(self.rank_at(**at, **{axis: k}) for k in range(getattr(self, axis))))
        return out

    # --- this rank: coordinates, groups, neighbours ------------------------------------------------------------

    def _mine(self) -> tuple[int, int, int, int]:
        if not self.member:
            raise ValueError(f"rank {self.rank} is not in this grid (ranks {list(self.ranks)}): it has no "
                             "coordinates or groups (check grid.member)")
        return self._coords

    @property
    def dp_rank(self) -> int:
        return self._mine()[0]

    @property
    def pp_rank(self) -> int:
        return self._mine()[1]

    @property
    def cp_rank(self) -> int:
        return self._mine()[2]

    @property
    def tp_rank(self) -> int:
        return self._mine()[3]

    @property
    def dp_group(self):
        """The data-parallel group of this rank: the ranks holding the same model shard (a replica each)."""
        self._mine()
        return self._groups["dp"]

    @property
    def pp_group(self):
        """The pipeline group of this rank: one rank per stage."""
        self._mine()
        return self._groups["pp"]

    @property
    def cp_group(self):
        """The context-parallel group of this rank: the ranks that split each sequence of the same rows."""
        self._mine()
        return self._groups["cp"]

    @property
    def tp_group(self):
        """The tensor-parallel group of this rank: the ranks that split each layer."""
        self._mine()
        return self._groups["tp"]

    @property
    def dp_ranks(self) -> tuple[int, ...]:
        """The global ranks of `dp_group`, in group-rank order."""
        self._mine()
        return self._members["dp"]

    @property
    def pp_ranks(self) -> tuple[int, ...]:
        self._mine()
        return self._members["pp"]

    @property
    def cp_ranks(self) -> tuple[int, ...]:
        self._mine()
        return self._members["cp"]

    @property
    def tp_ranks(self) -> tuple[int, ...]:
        self._mine()
        return self._members["tp"]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def next_pp_rank(self) -> int | None:
        """The global rank of the next pipeline stage (None on the last)."""
        return None if self.is_last_stage else self.pp_ranks[self.pp_rank + 1]

    @property
    def prev_pp_rank(self) -> int | None:
        """The global rank of the previous pipeline stage (None on the first)."""
        return None if self.is_first_stage else self.pp_ranks[self.pp_rank - 1]
