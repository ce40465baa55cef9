"""The check of exercise 4.6 (solutions/04_communication.ipynb): the tree all-reduce, pipelined in segments.

    from llmlab.checks import ch04_tree
    ch04_tree.tree_all_reduce(tree_all_reduce)        # 4.6, on 2–5 gloo ranks, against llmlab.dist.tree_all_reduce

It runs the learner's function on the same persistent ranks and cases as 4.5's ring (`ch04._ar_cases`: tagged
tensors, uneven and empty pieces, a 0-d and a transposed tensor, bf16, float64, random floats, op="avg"), each with
a random number of segments, and shares 4.5's verdict on type, shape, dtype, place and values. What is the tree's
own: the diagnosis of a tagged case — each element's value says whose shares it holds (`ch04._untag`), so a missing
broadcast (rank r ends with its subtree's sum) or a share overwritten by a child's sum is named — and the messages:
a rank exchanges only with its parent (r−1)//2 and its children 2r+1, 2r+2, one message per non-empty segment each
way, the way `llmlab.dist.tree_all_reduce` does (its binary tree in heap order, `collectives._Tree`).
"""

from __future__ import annotations

import functools
import math
import random

import torch

from llmlab.checks import Hint, Mismatch, ch04, check, fresh_rng
from llmlab.dist.collectives import chunk_sizes

__all__ = ["tree_all_reduce", "close"]

close = ch04.close  # stop the checks' ranks (shared with 4.1, 4.2 and 4.5)

_FORMULA = ("parent = (r−1)//2 (none at r = 0), children = [c for c in (2r+1, 2r+2) if c < N]; flat = tensor.view(-1) "
            "(a contiguous copy for a transposed tensor), pieces = flat.tensor_split(segments); reduce: for each "
            "piece, for each child exchange(recvs=[(buf, child)]) into a new buffer and piece.add_(buf), then "
            "exchange(sends=[(piece, parent)]) unless r = 0; for 'avg' rank 0 divides flat by N; broadcast: for each "
            "piece exchange(recvs=[(piece, parent)]) unless r = 0, then exchange(sends=[(piece, c) for c in "
            "children]); copy back if flat was a copy; return tensor")
HINTS = {
    **{key: Hint(nudge=hint.nudge, idea=hint.idea, formula=_FORMULA) for key, hint in ch04._AR_HINTS.items()
       if key in ("return", "not in place")},
    "avg": Hint(
        nudge="look at what op='avg' must give: the mean over the ranks",
        idea="divide once, where the whole sum first exists: at the root, after the reduce, before the broadcast "
             "copies it down",
        formula=_FORMULA),
    "broadcast": Hint(
        nudge="look at what the ranks other than 0 end with: the sum of whose shares?",
        idea="after the reduce only the root holds the whole sum; each rank below holds its subtree's. A second "
             "pass, the broadcast, copies the root's result down the same tree, parent to children",
        formula=_FORMULA),
    "overwritten": Hint(
        nudge="look at the shares missing from the result: whose are they, and where did a rank receive into?",
        idea="a rank with children must keep its own share: receive each child's partial sum into a new buffer "
             "and add it, rather than receiving straight into the piece it holds",
        formula=_FORMULA),
    "segments": Hint(
        nudge="count your messages: one per segment, or one for the whole tensor?",
        idea="the tensor goes up and down the tree in `segments` pieces (tensor_split), one message each, so "
             "that while a parent adds segment k its children already send segment k+1 — the levels work at once",
        formula=_FORMULA),
    "neighbours": Hint(
        nudge="look at who your ranks exchange messages with: a tree's neighbours, or a ring's?",
        idea="in a binary tree in heap order rank r talks only to its parent (r−1)//2 and its children 2r+1 and "
             "2r+2; a ring's neighbours r±1 are another algorithm",
        formula=_FORMULA),
}


def _parent(rank: int) -> int | None:
    return (rank - 1) // 2 if rank else None


def _children(rank: int, n: int) -> list[int]:
    return [c for c in (2 * rank + 1, 2 * rank + 2) if c < n]


def _subtree(rank: int, n: int) -> tuple[int, ...]:
    """The ranks of rank's subtree, itself included, sorted."""
    below = [rank]
    for child in _children(rank, n):
        below += _subtree(child, n)
    return tuple(sorted(below))


def _cases(rng: random.Random) -> list[dict]:
    """4.5's cases, each with a number of segments: 1 (the whole tensor at once) up to more than it has elements."""
    return [{**case, "segments": rng.choice([1, 2, 3, 5, 8])} for case in ch04._ar_cases(rng)]


def _diagnosis(got, case: dict, rank: int, messages) -> tuple[str, str | None] | None:
    """(what is wrong, the mistake's key) of a tagged case, whose every element must decode to every rank's share
    (`ch04._untag`); None if no pattern is recognised."""
    n, everyone = case["n"], tuple(range(case["n"]))
    for i, value in enumerate(got.reshape(-1).tolist()):
        decoded = ch04._untag(value, n)
        if decoded is None:
            return (f"element {i} holds a value that is not a sum of distinct ranks' shares: a share was added "
                    "twice, or a buffer used before anything was received into it"), None
        ranks = decoded[1]
        if ranks == everyone:
            continue
        missing = sorted(set(everyone) - set(ranks))
        if all(_children(r, n) for r in missing):
            return (f"element {i} misses the shares of ranks {ch04._ranks_text(missing)}, each a rank with children: "
                    "a child's partial sum was received over the rank's own share"), "overwritten"
        return f"element {i} holds the shares of ranks {ch04._ranks_text(ranks)} only", None
    return None


def _messages(case: dict, rank: int, messages: list, what: str) -> None:
    """Raise Mismatch unless rank `rank` exchanged point-to-point messages with its tree neighbours only, one per
    non-empty segment each way."""
    n = case["n"]
    collectives = sorted({name for name, kind, _, _ in messages if kind == "collective"})
    if collectives:
        raise Mismatch(f"{what} is right, but your function called {', '.join(collectives)}: build the all-reduce "
                       "from exchange's point-to-point messages only")
    parent, children = _parent(rank), _children(rank, n)
    neighbours = set(children) | ({parent} if parent is not None else set())
    strangers = sorted({peer for _, _, peer, k in messages if k and peer not in neighbours})
    if strangers:
        raise Mismatch(f"{what} is right, but rank {rank} exchanged messages with rank {ch04._ranks_text(strangers)}: "
                       f"in the tree its neighbours are {ch04._ranks_text(sorted(neighbours)) or 'none'}",
                       mistake="neighbours", hint=HINTS["neighbours"])
    pieces = sum(1 for k in chunk_sizes(math.prod(case["shape"]), case["segments"]) if k)  # non-empty segments
    want = pieces * ((parent is not None) + len(children))  # up to the parent, down to each child
    sends = len(ch04._ar_sends(messages))
    if sends != want:
        whole = sends == (parent is not None) + len(children)
        raise Mismatch(f"{what} is right, but rank {rank} sent {sends} messages, not {want}: one per non-empty "
                       f"segment ({pieces}) up to its parent and down to each of its {len(children)} children"
                       + (": the whole tensor went in one message each way" if whole else ""),
                       mistake="segments" if whole else None, hint=HINTS["segments"] if whole else None)


def _verdict(case: dict, rank: int, result, sent=_messages) -> None:
    """4.5's verdict with the tree's hints, diagnosis and messages — after one check of its own, first: a tagged
    result that is exactly the rank's subtree's sum (a leaf's own input) is a missing broadcast, not a result
    computed into a copy, as 4.5's verdict would read a leaf's unchanged tensor."""
    got, n = result[0], case["n"]
    below = _subtree(rank, n)
    if case["tagged"] and below != tuple(range(n)) and isinstance(got, torch.Tensor) and got.numel() and all(
            (decoded := ch04._untag(v, n)) is not None and decoded[1] == below for v in got.reshape(-1).tolist()):
        raise Mismatch(f"{ch04._ar_text(case)}: rank {rank}'s result holds the sum over its subtree (ranks "
                       f"{ch04._ranks_text(below)}) only: the reduce went up the tree, but nothing came back down — "
                       "the broadcast from the root is missing", mistake="broadcast", hint=HINTS["broadcast"])
    ch04._ar_verdict(case, rank, result, hints=HINTS, diagnose=_diagnosis, sent=sent)


@check("4.6", "the tree all-reduce, in segments", hint=Hint(
    nudge="compare each rank's result with the sum over all ranks: which ranks are wrong, and whose shares do they "
          "hold?",
    idea="a reduce up the binary tree (each rank adds its children's partial sums to its own share and passes "
         "the result to its parent) leaves the sum at the root; a broadcast down the same tree copies it to every "
         "rank; both go piece by piece, so that the levels of the tree work at once",
    formula=_FORMULA))
def tree_all_reduce(fn):
    """`fn(tensor, group, op, segments)` on every rank of `group`: `tensor` itself, holding the sum (or mean)."""

    cases = _cases(fresh_rng())
    per_rank = ch04._on_ranks(functools.partial(ch04._run_all_reduce, verdict=_verdict), fn, cases, "tree all-reduce",
                              HINTS["neighbours"])
    values = functools.partial(_verdict, sent=lambda *args: None)  # every rank's values before anyone's messages
    for i, case in enumerate(cases[:len(per_rank[0])]):  # the ranks stop after the first wrong case
        for verdict in (values, _verdict):
            for rank in range(case["n"]):
                verdict(case, rank, per_rank[rank][i])
