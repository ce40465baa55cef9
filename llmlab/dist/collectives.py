"""Collectives built from point-to-point messages only: ring and tree all-reduce, reduce-scatter, all-gather,
broadcast and all-to-all.

    import torch, torch.distributed as td
    from llmlab import dist

    def demo():
        t = torch.arange(10.0) * (td.get_rank() + 1)
        dist.ring_all_reduce(t)                   # in place: t = Σ over ranks, equal on every rank
        return t

    dist.spawn(demo, 4)       # or, in a script started by `torchrun --nproc-per-node 4`: dist.init_from_env(); demo()

Every message goes through `commlog.post`/`exchange` (a `torch.distributed.batch_isend_irecv`), so a
`CommLog` counts each byte, and the same code runs on gloo (CPU) and NCCL (GPU), on any process group:
`group=` is honoured everywhere and "rank" means the rank *in that group* (`td.get_rank(group)`), including
`tree_broadcast`'s `src` (torch's own `broadcast` takes a global rank there).

**Chunks.** A tensor of S elements is flattened and cut like `torch.tensor_split(flat, N)`: N chunks whose
sizes differ by at most one, the first S mod N one larger (`chunk_sizes`). S not divisible by N, S < N (empty
chunks, never sent) and S = 0 all work. `ring_reduce_scatter` returns chunk `rank` of that split, reduced;
`ring_all_gather` is its inverse and returns the flat concatenation in rank order (`.view(-1, *shape[1:])`
restores a dim-0 concatenation).

**Ring all-reduce** = reduce-scatter then all-gather, 2(N−1) steps. At step s of the reduce-scatter rank r sends
its running sum of chunk r−s−1 to the right and receives chunk r−s−2 from the left, adding its own share; after
N−1 steps it holds the full sum of chunk r. The all-gather then passes the finished chunks around. Each rank
sends 2(N−1)/N·S elements whatever N is: bandwidth-optimal. Latency: 2(N−1) messages.

**Tree all-reduce**: a binary tree (heap order: rank r's children are 2r+1 and 2r+2) reduces to rank 0, which
broadcasts back down; 2·⌈log₂N⌉ message hops, latency-optimal. The data is cut into segments of
`segment_bytes` so that levels work at once (a pipeline): time ≈ 2⌈log₂N⌉α + 2Sβ for large S. One tree wastes
bandwidth: leaves only send, and interior ranks receive twice what they send. NCCL's **double binary tree**
(`double=True`) sends half the data down a second tree in which the first tree's leaves are interior (here
the mirror image, rank r ↔ N−1−r): every rank is interior in at most one tree, so each rank's links carry
about the same load. The result is reduced in a fixed order and broadcast from the root, so it is bitwise
identical on every rank (for both rings and trees).

**op**: "sum" or "avg" (sum / N, divided once on the rank that finished the sum). "avg" of an integer tensor
is refused (ValueError) rather than silently floored: sum, then divide as you mean to.

**Validation before communicating.** A wrong input must be an error, not a hang. With `check=True` (default)
every rank first sends one 5-integer record (valid?, numel, dtype, op, src) around a ring: N−1 messages of 40
bytes per rank ("<name>.check" in a CommLog), costing (N−1)·α — µs on NVLink, up to milliseconds on gloo with
more ranks than cores, which is why benchmarks pass `check=False`. Then every rank raises the *same* error
when any rank passed a non-tensor (TypeError) or the ranks disagree on dtype, numel, op or src (ValueError
naming both ranks' values). With `check=False` inputs are only checked locally. `all_to_all` always exchanges
shapes first (receivers need them).
"""

from __future__ import annotations

import itertools
import zlib

import torch
import torch.distributed as td

from llmlab import runtime, validation
from llmlab.dist.commlog import chunk_sizes, exchange, post, scope

__all__ = ["chunk_sizes", "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce", "tree_all_reduce",
           "tree_broadcast", "all_to_all", "OPS"]

OPS = ("sum", "avg")
_MAX_DIMS = 8  # all_to_all sends shapes of up to this many dims
_DTYPES = {zlib.crc32(str(d).encode()): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


# -- checks ----------------------------------------------------------------------------------------------------
def _members(name: str, group) -> tuple[int, int]:
    if not td.is_initialized():
        raise RuntimeError(f"{name}: torch.distributed is not initialised; run under dist.spawn, a dist.Cluster "
                           "or torchrun (then dist.init_from_env())")
    rank, n = td.get_rank(group), td.get_world_size(group)
    if rank < 0:
        raise ValueError(f"{name}: this process (global rank {td.get_rank()}) is not a member of group")
    return rank, n


def _check_local(name: str, arg: str, tensor, op: str | None, src=None, n: int = 0) -> None:
    if src is not None:
        validation.integer(f"{name}: src", src, 0, n - 1, hint="(a rank of the group)")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(tensor).__name__}")
    if op is not None:
        validation.one_of(f"{name}: op", op, OPS)
    if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"{name}: op='avg' needs a floating-point {arg}, got {tensor.dtype}; an integer average "
                         "would round: use op='sum' and divide as you mean to")


def _code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())  # the same on every rank (Python's hash() is not)


def _meta_device(tensor, group) -> torch.device:
    """Where the metadata goes: beside the tensor, or where the backend wants it when there is no tensor."""
    if isinstance(tensor, torch.Tensor):
        return tensor.device
    return runtime.group_device(group)


def _first_difference(values: list, what: str, show=str) -> str | None:
    bad = next((i for i, v in enumerate(values) if v != values[0]), None)
    return None if bad is None else f"{what} {show(values[0])} on rank 0 but {show(values[bad])} on rank {bad}"


def _agree(name: str, arg: str, tensor, group, rank: int, n: int, op=None, src=None,
           same_numel: bool = True) -> list[int]:
    """Every rank learns every rank's (valid, numel, dtype, op, src) and raises the same error if they differ.

    Returns the numel of every rank's tensor."""
    is_tensor = isinstance(tensor, torch.Tensor)
    row = [int(is_tensor), tensor.numel() if is_tensor else -1, _code(tensor.dtype) if is_tensor else -1,
           OPS.index(op) if op in OPS else -1, src if isinstance(src, int) and not isinstance(src, bool) else -2]
    table = torch.tensor(row * n, dtype=torch.int64, device=_meta_device(tensor, group))  # (n·5,): mine at `rank`
    with scope(f"{name}.check"):
        _ring_all_gather_flat(table, [5] * n, rank, n, group)
    rows = table.view(n, 5).tolist()
    invalid = [i for i in range(n) if rows[i][0] == 0]
    if invalid:
        mine = f" ({arg} here is {type(tensor).__name__})" if not is_tensor else ""
        raise TypeError(f"{name}: {arg} must be a torch.Tensor on every rank, but rank(s) {invalid} passed "
                        f"something else{mine}")
    cols = list(zip(*rows, strict=True))
    if op is not None and -1 in cols[3]:
        raise ValueError(f"{name}: op must be one of {', '.join(map(repr, OPS))} on every rank; rank(s) "
                         f"{[i for i in range(n) if cols[3][i] == -1]} passed another (here op={op!r})")
    problem = (_first_difference(cols[2], f"{arg} has dtype", lambda c: _DTYPES.get(c, f"dtype #{c}"))
               or (same_numel and _first_difference(cols[1], f"{arg} has", lambda k: f"{k} elements"))
               or _first_difference(cols[3], "op is", lambda i: repr(OPS[i]))
               or _first_difference(cols[4], "src is", str))
    if problem:
        raise ValueError(f"{name}: the ranks disagree: {problem}")
    _check_local(name, arg, tensor, op, src, n)  # the same verdict on every rank now that they agree
    return list(cols[1])


def _prepare(name, arg, tensor, group, op, check, src=None):
    rank, n = _members(name, group)
    if check:
        _agree(name, arg, tensor, group, rank, n, op=op, src=src)
    else:
        _check_local(name, arg, tensor, op, src, n)
    flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)  # (S,)
    return rank, n, flat


def _write_back(tensor, flat):
    if flat.data_ptr() != tensor.data_ptr():  # `flat` is a contiguous copy of a strided tensor
        tensor.copy_(flat.view(tensor.shape))
    return tensor


def _one(t: torch.Tensor, peer: int) -> list:
    return [(t, peer)] if t.numel() else []  # empty chunks are never sent: both ends know the size


# -- ring ------------------------------------------------------------------------------------------------------
# A ring step's chunk travels in pieces of at most this size (see _ring_step): NCCL's default buffer (NCCL_BUFFSIZE).
# Measured on 4 gloo ranks of a 2-core CPU (chapter 4), 1 MiB pieces cost more α than they hid additions (ring busbw
# 0.58× torch's at 16 MiB, against 0.80× with the 4 MiB chunk whole): the addition (tens of GB/s) is cheap next to
# the link (about 1 GB/s), so only chunks over 4 MiB are cut.
PIECE_BYTES = 4 << 20


def _pieces(sizes: list[int], element_size: int, piece_bytes: int) -> int:
    """How many pieces every chunk is cut into: the same on every rank, as both ends of a message must agree."""
    return max(1, -(-max(sizes) * element_size // piece_bytes))  # ceil


def _ring_step(send: torch.Tensor, recv: torch.Tensor, k: int, right: int, left: int, group, reduce=None) -> None:
    """One ring step: send `send` to the right and receive `recv` from the left, each cut in `k` pieces.

    Two pieces are in flight at once: while piece i+1 travels, piece i is reduced (`reduce(lo, hi)`, the range of
    `recv` that has arrived), so the additions hide behind the transfer and the link does not wait for Python.
    Each piece goes as one send/receive pair (`post`), so a ring cannot deadlock on NCCL either.
    """
    sends, recvs = send.tensor_split(k), recv.tensor_split(k)  # k views each
    bounds = [0, *itertools.accumulate(r.numel() for r in recvs)]
    pending = post(_one(sends[0], right), _one(recvs[0], left), group)
    for i in range(k):
        after = (post(_one(sends[i + 1], right), _one(recvs[i + 1], left), group, tag=(i + 1) % 2)
                 if i + 1 < k else None)
        pending.wait()
        if reduce is not None:
            reduce(bounds[i], bounds[i + 1])
        pending = after


def _ring_reduce_scatter_flat(flat, sizes, rank, n, group, in_place: bool = False,
                              piece_bytes: int = PIECE_BYTES) -> torch.Tensor:
    """The sum over ranks of chunk `rank` of 1-D `flat`: a new tensor, `flat` unchanged; or, `in_place`, the sum
    written into `flat`'s own chunk `rank` (other chunks then hold partial sums) and returned as a view of it.

    Chunk c is summed along the ring in one order, the left neighbour's running sum plus my share (a + b == b + a
    in IEEE arithmetic, so in place or not the bits are the same).
    """
    chunks = flat.split(sizes)  # n views
    if n == 1:
        return chunks[0] if in_place else chunks[0].clone()
    right, left, k = (rank + 1) % n, (rank - 1) % n, _pieces(sizes, flat.element_size(), piece_bytes)
    buffers = [torch.empty(max(sizes), dtype=flat.dtype, device=flat.device) for _ in range(1 if in_place else 2)]
    running = chunks[(rank - 1) % n]  # step 0 sends my own share of chunk rank−1
    for step in range(n - 1):
        c = (rank - step - 2) % n  # the chunk arriving from the left: summed over ranks c+1 … rank−1 so far
        incoming = buffers[step % len(buffers)][:sizes[c]]  # (sizes[c],)
        into, other = (chunks[c], incoming) if in_place else (incoming, chunks[c])
        _ring_step(running, incoming, k, right, left, group,
                   lambda lo, hi, into=into, other=other: into[lo:hi].add_(other[lo:hi]))
        running = into  # ... plus my share; after the last step c == rank
    return running


def _ring_all_gather_flat(out, sizes, rank, n, group, piece_bytes: int = PIECE_BYTES) -> None:
    """Fill every chunk of 1-D `out` from its owner; chunk `rank` is already in place."""
    chunks, k = out.split(sizes), _pieces(sizes, out.element_size(), piece_bytes)
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):  # pass on the chunk received last step; receive the one before it
        _ring_step(chunks[(rank - step) % n], chunks[(rank - step - 1) % n], k, right, left, group)


def ring_reduce_scatter(tensor, group=None, op: str = "sum", *, check: bool = True) -> torch.Tensor:
    """Reduce over ranks and return this rank's chunk: `tensor_split(reduced.flatten(), N)[rank]` (1-D, new).

    `tensor` is left unchanged. N−1 steps; each rank sends (N−1)/N·S elements.
    """
    rank, n, flat = _prepare("ring_reduce_scatter", "tensor", tensor, group, op, check)  # flat: (S,)
    with scope("ring_reduce_scatter", tensor):
        mine = _ring_reduce_scatter_flat(flat, chunk_sizes(flat.numel(), n), rank, n, group)  # (S/N,)
        return mine.div_(n) if op == "avg" else mine


def ring_all_gather(chunk, group=None, *, sizes: list[int] | None = None) -> torch.Tensor:
    """Concatenate every rank's flattened `chunk` in rank order (1-D, new); chunks may differ in size.

    Each rank learns the others' sizes (and that the dtypes agree) from the metadata exchange; pass `sizes`
    (every rank's numel, e.g. `chunk_sizes(S, N)`) when they are known, to skip it.
    """
    name = "ring_all_gather"
    rank, n = _members(name, group)
    if sizes is None:
        sizes = _agree(name, "chunk", chunk, group, rank, n, same_numel=False)
    else:
        _check_local(name, "chunk", chunk, None)
        if len(sizes) != n or sizes[rank] != chunk.numel():
            raise ValueError(f"{name}: sizes={sizes} must list {n} numels, with sizes[{rank}] == "
                             f"chunk.numel() == {chunk.numel()}")
    with scope(name, chunk):
        out = torch.empty(sum(sizes), dtype=chunk.dtype, device=chunk.device)  # (ΣS_i,)
        out.split(sizes)[rank].copy_(chunk.reshape(-1))
        _ring_all_gather_flat(out, sizes, rank, n, group)
        return out


def ring_all_reduce(tensor, group=None, op: str = "sum", *, check: bool = True,
                    piece_bytes: int = PIECE_BYTES) -> torch.Tensor:
    """Reduce `tensor` over the ranks of `group` in place (reduce-scatter, then all-gather); returns it.

    `piece_bytes`: each step's chunk travels in pieces of about this size, two in flight, each reduced while the
    next travels (`_ring_step`); a value at least the chunk's size sends it whole, the unpipelined ring whose
    addition waits for the whole chunk (chapter 4 compares the two with the α-β-γ model, `cost.ring_pieces_time`).
    Every rank must pass the same value.
    """
    validation.positive_int("piece_bytes", piece_bytes, hint="(bytes per piece of a ring step's chunk)")
    rank, n, flat = _prepare("ring_all_reduce", "tensor", tensor, group, op, check)  # flat: (S,)
    with scope("ring_all_reduce", tensor):
        sizes = chunk_sizes(flat.numel(), n)
        mine = _ring_reduce_scatter_flat(flat, sizes, rank, n, group, in_place=True, piece_bytes=piece_bytes)
        if op == "avg":  # mine: a view of my chunk, reduced
            mine.div_(n)
        _ring_all_gather_flat(flat, sizes, rank, n, group, piece_bytes)
        return _write_back(tensor, flat)


# -- trees -----------------------------------------------------------------------------------------------------
class _Tree:
    """A binary tree in heap order over positions 0..n−1; `rank_of(p)` places ranks on positions."""

    def __init__(self, n: int, rank_of):
        self.n, self.rank_of = n, rank_of
        self.position_of = {rank_of(p): p for p in range(n)}

    def parent(self, rank: int):
        p = self.position_of[rank]
        return None if p == 0 else self.rank_of((p - 1) // 2)

    def children(self, rank: int) -> list[int]:
        p = self.position_of[rank]
        return [self.rank_of(c) for c in (2 * p + 1, 2 * p + 2) if c < self.n]


def _segments(flat: torch.Tensor, segment_bytes: int) -> tuple:
    per = max(1, segment_bytes // flat.element_size())
    return flat.split(per) if flat.numel() else ()


def _tree_reduce(parts, rank, group) -> None:
    """Sum every tree's data into its root, segment by segment; `parts` = [(tree, segments)], in place."""
    sends = []
    for k in range(max((len(segs) for _, segs in parts), default=0)):
        for tree, segs in parts:  # every rank walks (segment, tree) in the same order: no deadlock
            if k >= len(segs):
                continue
            seg, kids = segs[k], tree.children(rank)
            incoming = [torch.empty_like(seg) for _ in kids]  # one (len(seg),) buffer per child
            exchange(recvs=list(zip(incoming, kids, strict=True)), group=group)
            for x in incoming:
                seg.add_(x)  # my share + left subtree + right subtree, always in this order
            if tree.parent(rank) is not None:  # send up without waiting: the next segment overlaps it
                sends.append(post(sends=[(seg, tree.parent(rank))], group=group))
    for s in sends:
        s.wait()


def _tree_bcast(parts, rank, group) -> None:
    """Copy every tree root's data down its tree, segment by segment, in place."""
    sends = []
    for k in range(max((len(segs) for _, segs in parts), default=0)):
        for tree, segs in parts:
            if k >= len(segs):
                continue
            if tree.parent(rank) is not None:
                exchange(recvs=[(segs[k], tree.parent(rank))], group=group)
            if tree.children(rank):
                sends.append(post(sends=[(segs[k], c) for c in tree.children(rank)], group=group))
    for s in sends:
        s.wait()


def tree_all_reduce(tensor, group=None, op: str = "sum", *, double: bool = False, segment_bytes: int = 1 << 20,
                    check: bool = True) -> torch.Tensor:
    """Reduce `tensor` in place up a binary tree to rank 0 and broadcast it back down; returns it.

    `double=True`: half the data goes through a mirrored second tree (NCCL's double binary tree, see the
    module docstring). `segment_bytes`: pipeline segment size.
    """
    name = "tree_all_reduce"
    rank, n, flat = _prepare(name, "tensor", tensor, group, op, check)  # flat: (S,)
    with scope(name, tensor):
        trees = [_Tree(n, lambda p: p)] + ([_Tree(n, lambda p: n - 1 - p)] if double else [])
        halves = flat.tensor_split(len(trees))
        parts = [(tree, _segments(half, segment_bytes)) for tree, half in zip(trees, halves, strict=True)]
        _tree_reduce(parts, rank, group)
        if op == "avg":
            for tree, half in zip(trees, halves, strict=True):
                if tree.parent(rank) is None:
                    half.div_(n)  # only the root holds the full sum
        _tree_bcast(parts, rank, group)
        return _write_back(tensor, flat)


def tree_broadcast(tensor, src: int = 0, group=None, *, segment_bytes: int = 1 << 20,
                   check: bool = True) -> torch.Tensor:
    """Copy `tensor` of rank `src` (a rank of `group`) to every rank, in place, down a binary tree."""
    name = "tree_broadcast"
    rank, n, flat = _prepare(name, "tensor", tensor, group, None, check, src=src)  # flat: (S,)
    with scope(name, tensor):
        _tree_bcast([(_Tree(n, lambda p: (p + src) % n), _segments(flat, segment_bytes))], rank, group)
        return _write_back(tensor, flat)


# -- all-to-all ------------------------------------------------------------------------------------------------
def all_to_all(chunks, group=None) -> list[torch.Tensor]:
    """Send `chunks[i]` to rank i; return the list whose item j came from rank j (shapes may differ per pair).

    First every rank sends each peer the dtype and shape of what it will send (N−1 messages of 88 bytes,
    "all_to_all.check"), so receivers can allocate and a mismatch is an error on every rank. Then N−1
    pairwise steps: at step s, send to rank r+s and receive from rank r−s.
    """
    name = "all_to_all"
    rank, n = _members(name, group)
    ok = (isinstance(chunks, list | tuple) and len(chunks) == n and all(isinstance(c, torch.Tensor) for c in chunks)
          and len({(c.dtype, c.device) for c in chunks}) == 1 and all(c.dim() <= _MAX_DIMS for c in chunks))
    headers = torch.zeros(n, 3 + _MAX_DIMS, dtype=torch.int64, device=_meta_device(chunks[0] if ok else None, group))
    if ok:  # row j = (valid, dtype, ndim, shape padded to _MAX_DIMS) of the chunk for rank j
        headers.copy_(torch.tensor([[1, _code(c.dtype), c.dim(), *c.shape, *[0] * (_MAX_DIMS - c.dim())]
                                    for c in chunks]))
    got = torch.empty_like(headers)  # (n, 11): row j = what rank j will send me
    got[rank] = headers[rank]
    with scope(f"{name}.check"):
        _pairwise(list(headers), list(got), rank, n, group)
    rows = got.tolist()
    if not all(r[0] for r in rows):
        bad = [j for j, r in enumerate(rows) if not r[0]]
        raise TypeError(f"{name}: chunks must be a list of {n} tensors (one per rank, one dtype and device, "
                        f"at most {_MAX_DIMS} dims) on every rank; rank(s) {bad} passed something else")
    problem = _first_difference([r[1] for r in rows], "chunks have dtype", lambda c: _DTYPES.get(c, c))
    if problem:
        raise ValueError(f"{name}: the ranks disagree: {problem}")
    with scope(name, chunks[0]):
        out = [torch.empty(r[3:3 + r[2]], dtype=chunks[0].dtype, device=chunks[0].device) for r in rows]
        out[rank] = chunks[rank].clone()
        _pairwise([c.contiguous() for c in chunks], out, rank, n, group)
        return out


def _pairwise(send, recv, rank, n, group) -> None:
    for step in range(1, n):
        dst, src = (rank + step) % n, (rank - step) % n
        exchange(_one(send[dst], dst), _one(recv[src], src), group)
