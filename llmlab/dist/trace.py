"""Watching collectives work: which chunk every rank holds at every ring step, and who sends how much to whom.

**The ring, step by step** (`ring_steps` on every rank, then `ring_states`; `llmlab.plots.ring_steps` draws
it). The real `ring_all_reduce` runs on a tensor of N elements, one per chunk, whose values say where they came
from: rank r puts 2^r · (1 + c · 2^N) in chunk c. A sum over a set R of ranks is m · (1 + c · 2^N) with
m = Σ_{r∈R} 2^r < 2^N, so every message decodes to (which chunk, which ranks' shares are summed in it):
m = v mod 2^N, c = ⌊v / 2^N⌋ / m. Every message the ring sends goes through `llmlab.dist.collectives.post`;
`ring_steps` wraps it for the duration of one call and keeps a copy of what was sent and received at each step
(N elements are one piece per step: a larger tensor would travel in several pieces per step).
Nothing about the ring's indexing is assumed here: the figure is decoded from the messages of a real run.

    from llmlab import dist, plots
    from llmlab.dist import trace
    per_rank = dist.spawn(trace.ring_steps, 4)     # [rank 0's steps, rank 1's, ...]
    plots.ring_steps(per_rank, trace.ring_states(per_rank))

**Traffic** (`traffic` on every rank, then `traffic_matrix`; `llmlab.plots.traffic` draws it): the bytes
each rank sent to each other rank during one all-reduce (ring, tree or double binary tree), from a `CommLog`'s
point-to-point events.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as td

from llmlab import runtime
from llmlab.dist import collectives
from llmlab.dist.collectives import ring_all_reduce, tree_all_reduce
from llmlab.dist.commlog import CommLog

__all__ = ["Step", "ring_steps", "ring_states", "ALGORITHMS", "traffic", "traffic_matrix"]


@dataclass(frozen=True)
class Step:
    """One step of the ring on one rank: what it sent right and received from the left."""

    index: int  # 0 … 2(N−1)−1; the first N−1 are the reduce-scatter, the rest the all-gather
    sent_to: int
    sent_chunk: int
    sent_ranks: tuple[int, ...]  # the ranks whose shares are summed in what was sent
    received_from: int
    received_chunk: int
    received_ranks: tuple[int, ...]


def _decode(value: int, n: int) -> tuple[int, tuple[int, ...]]:
    """(chunk, ranks) of a message element: value = m · (1 + chunk · 2^n), m the bitmask of the ranks."""
    m = value % (1 << n)
    if m == 0:
        raise ValueError(f"value {value} does not decode: no rank's share in it")
    return (value >> n) // m, tuple(r for r in range(n) if m >> r & 1)


@contextmanager
def _recording(messages: list):
    """Keep a copy of what every message pair `post`ed by llmlab's collectives sends and receives, taken when it is
    complete (its `wait()`), before the ring adds to what arrived, while the block runs."""

    original = collectives.post

    def post(sends=(), recvs=(), group=None, tag=0):
        pending = original(sends, recvs, group, tag)
        wait = pending.wait

        def recorded_wait():
            wait()
            messages.append(([(peer, t.clone()) for t, peer in sends], [(peer, t.clone()) for t, peer in recvs]))

        pending.wait = recorded_wait
        return pending

    collectives.post = post
    try:
        yield
    finally:
        collectives.post = original


def ring_steps(group=None) -> list[Step]:
    """On every rank of `group`: run `ring_all_reduce` on N tagged elements and return this rank's 2(N−1) steps."""

    rank, n = td.get_rank(group), td.get_world_size(group)
    if n > 29:  # tags reach 2^(2n + ⌈log₂n⌉), which must fit in an int64
        raise ValueError(f"ring_steps tags chunks with int64 values: at most 29 ranks, got {n}")
    chunk = torch.arange(n, dtype=torch.int64, device=runtime.device())
    x = (1 << rank) * (1 + chunk * (1 << n))  # (n,): one element per chunk, tagged with its chunk and rank
    messages = []
    with _recording(messages):
        ring_all_reduce(x, group=group, check=False)  # check=True would add its own metadata messages
    steps = []
    for i, (sends, recvs) in enumerate(messages):
        (to, sent), (frm, got) = sends[0], recvs[0]  # one element each way per step
        c_out, r_out = _decode(int(sent.item()), n)
        c_in, r_in = _decode(int(got.item()), n)
        steps.append(Step(i, to, c_out, r_out, frm, c_in, r_in))
    full = (1 << n) - 1
    if not bool((x == full * (1 + chunk * (1 << n))).all()):
        raise RuntimeError(f"rank {rank}: the traced ring all-reduce gave a wrong result {x.tolist()}")
    return steps


def ring_states(per_rank: list[list[Step]]) -> np.ndarray:
    """(2(N−1)+1, N, N) array: [step, rank, chunk] = bitmask of the ranks summed in that rank's copy of the chunk.

    Step 0 is the start (every rank holds only its own share of every chunk); after each step a rank's copy
    of the chunk it received is the received sum plus its own share (reduce-scatter) or the received full
    sum (all-gather, where the received sum already contains every share).
    """
    n = len(per_rank)
    steps = len(per_rank[0])
    state = np.zeros((steps + 1, n, n), dtype=np.int64)
    state[0] = (1 << np.arange(n))[:, None]  # [rank, chunk]: just rank's own share
    for s in range(steps):
        state[s + 1] = state[s]
        for rank, trace in enumerate(per_rank):
            step = trace[s]
            mask = sum(1 << r for r in step.received_ranks)
            state[s + 1, rank, step.received_chunk] = mask | (1 << rank)
    return state


# --- traffic -------------------------------------------------------------------------------------------------

ALGORITHMS = ("ring", "tree", "double tree")


def traffic(algorithm: str, nbytes: int = 1 << 20, group=None) -> dict[int, int]:
    """On every rank: {peer: bytes this rank sent it} during one `algorithm` all-reduce of `nbytes` of fp32."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} must be one of {ALGORITHMS}")
    x = torch.ones(nbytes // 4, device=runtime.device())  # (nbytes/4,) fp32
    with CommLog(torch_collectives=False) as log:
        if algorithm == "ring":
            ring_all_reduce(x, group=group, check=False)
        else:
            tree_all_reduce(x, group=group, double=algorithm == "double tree", check=False)
    sent: dict[int, int] = {}
    for e in log.events:
        if e.kind == "p2p" and e.bytes_sent:
            sent[e.peer] = sent.get(e.peer, 0) + e.bytes_sent
    return sent


def traffic_matrix(per_rank: list[dict[int, int]]) -> np.ndarray:
    """(N, N) bytes: [src, dst] = what rank src sent rank dst (from `traffic` on every rank)."""
    n = len(per_rank)
    m = np.zeros((n, n), dtype=np.int64)
    for src, sent in enumerate(per_rank):
        for dst, nbytes in sent.items():
            m[src, dst] = nbytes
    return m
