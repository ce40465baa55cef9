"""Checks for chapter 4's exercises (solutions/04_communication.ipynb): the ring's two halves, accumulation under
data parallelism, the choice between ring and tree by their α-β time (its own module, ch04_cost, imported here), the
whole ring all-reduce and the tree all-reduce.

    from llmlab.checks import ch04 as check
    check.ring_reduce_scatter(ring_reduce_scatter)    # 4.1, on 2–5 gloo ranks
    check.ring_all_gather(ring_all_gather)            # 4.2, on 2–5 gloo ranks
    check.accumulate_step(accumulate_step)            # 4.3, on 2–5 gloo ranks
    check.choose_allreduce(ring_allreduce_time, tree_allreduce_time,  # 4.4
                           crossover_bytes, choose_allreduce)
    check.ring_all_reduce(ring_all_reduce)            # 4.5, on 2–5 gloo ranks
    check.tree_all_reduce(tree_all_reduce)            # 4.6, on 2–5 gloo ranks

**Multi-rank checks.** The learner's function travels to real ranks by value (it is defined in a notebook:
cloudpickle sends its code) and runs there on every world size from 2 to 5: one `dist.Cluster` of 5 gloo
processes, started by the first check that needs it and reused by the others (stopped when Python exits, or by
`close()`). World size n < 5 runs on the subgroup of ranks 0 … n−1, so a rank of the group is also its global
rank; world size 5 on the default group. Each case is a fresh random size — 1 and n−1 elements (fewer than
ranks: some chunks are empty), sizes not divisible by n, a 2-D tensor, a large one — with integer values in
float32, so every correct order of summation gives the same bits and answers are compared exactly.

**Diagnosis.** Every world size also runs a *tagged* case: rank r's element in chunk c is 2^r · (1 + c · 2^n),
so any sum of distinct ranks' shares of one chunk, m · (1 + c · 2^n) with m < 2^n a bitmask of ranks, says which
chunk it is and whose shares it holds. A wrong answer is then named precisely: "rank 2 ended with chunk 3" (an
off-by-one chunk index), "chunk 2 holds the shares of ranks 1, 2 only" (a step missing), "a share added twice".
In the all-gather, chunk c of rank r's input is filled with tags naming (r, c), so a misplaced or missing chunk
is named the same way. The all-reduce (4.5) is tagged as the reduce-scatter, and every chunk of every rank's result
must decode to that chunk with every rank's share; it also runs bf16, float64 and random floats (compared within a
bound on the roundings of its additions), a 0-d and a transposed tensor, op="avg", and counts the messages each rank
sends (`llmlab.dist.CommLog`): 2(N−1), each one chunk.

**Accumulation under data parallelism (4.3)** runs on the same ranks: each wraps the same small float64 MLP in
`llmlab.parallel.ddp.DataParallel` (one bucket, or one per parameter tensor), plants stale gradients in `.grad`, and
calls the learner's update on its own k micro-batches with plain SGD. Every rank's weights must move as one
single-process SGD step on the large batch of all ranks' micro-batches (`llmlab.accumulate.accumulate_gradients`),
the optimizer must step once, a `CommLog` around the update must see exactly the bytes that one synchronised backward
of a fresh wrapper sends (one all-reduce of the gradients, not k), and `.grad` must be empty afterwards. Because SGD
moves the weights by −lr·gradient, a wrong update is named by the gradient it used: k× (no 1/k), with the stale
gradients in it, divided by N too, or this rank's own (its last backward under no_sync too: the ranks diverge).

A learner's `NotImplementedError` raised on a rank comes back as a `RankError` and reads "not attempted yet"
(`llmlab.checks`). A function that deadlocks (a rank waiting for a message nobody sends) is stopped
after `TIMEOUT_S` and reported as such; the next check starts fresh ranks.
"""

from __future__ import annotations

import functools
import math
import numbers
import random
import re

import torch
import torch.distributed as td

from llmlab import checks, dist
from llmlab.accumulate import accumulate_gradients
from llmlab.checks import Hint, Mismatch, assert_close, check, fresh_rng, number
from llmlab.checks.ch04_cost import choose_allreduce
from llmlab.dist import RankError
from llmlab.dist.collectives import chunk_sizes
from llmlab.dist.commlog import CommLog
from llmlab.parallel.ddp import DataParallel

__all__ = ["ring_reduce_scatter", "ring_all_gather", "accumulate_step", "choose_allreduce", "ring_all_reduce",
           "tree_all_reduce", "close", "WORLD_SIZES", "TIMEOUT_S"]

WORLD_SIZES = (2, 3, 4, 5)
TIMEOUT_S = 30.0  # the reference answers all cases in well under a second; more means a rank is stuck
_groups: dict = {}  # on the ranks: world size → the dist.Grid of ranks 0 … n-1


close = checks.close_clusters  # stop the checks' ranks now (they also stop at interpreter exit)


class LearnerError(RuntimeError):
    """Raised on a rank when the learner's function failed there; says in which case."""


def _group(n: int):
    """On a rank: (is this rank in the world of size n, its process group)."""
    if not _groups:  # every rank builds every grid once, in the same order
        _groups.update({k: dist.Grid(dp=k, ranks=range(k)) for k in WORLD_SIZES})
    grid = _groups[n]
    return grid.member, grid.dp_group if grid.member else None


def _on_ranks(body, fn, cases, what: str, chunk_hint: Hint, ring: bool = True) -> list[list]:
    """Run `body(fn, cases)` on every rank; return the per-rank lists of per-case results. `chunk_hint` is the
    exercise's hint for a chunk sent where its neighbour receives another (gloo stops a rank on it). `ring=False`
    (4.3, whose ranks communicate only through collectives) reads a message of the wrong size, or ranks that never
    finish, as collectives that did not match across the ranks, with `chunk_hint` the hint of both."""

    try:
        return checks.cluster(max(WORLD_SIZES)).run(body, fn, cases, timeout=TIMEOUT_S)
    except RankError as e:
        if e.exc_type == "NotImplementedError":
            raise  # "not attempted yet"
        if e.exc_type == "RankCrashed":
            sizes = re.search(r"(\d+) vs (\d+)\. Received data size doesn't match", str(e))
            if sizes:  # gloo aborts a process that receives more bytes than it posted a buffer for
                raise Mismatch(f"gloo stopped rank {e.rank}: a message of {sizes[1]} bytes arrived where it expected "
                               f"{sizes[2]}" + (", so at some step a rank received into another chunk than the one "
                                                "its left neighbour sent" if ring else ": " + _UNMATCHED),
                               mistake="chunk index" if ring else "collectives", hint=chunk_hint) from None
            raise Mismatch(f"rank {e.rank}'s process crashed while running your {what}: {str(e).splitlines()[0]}") \
                from None
        message = str(e.exception) if e.exception is not None else str(e).splitlines()[0]
        raise Mismatch(f"on rank {e.rank}, {message}") from None
    except TimeoutError:
        raise Mismatch(f"your {what} did not finish within {TIMEOUT_S:g} s: "
                       + ("some rank waits for a message nobody sends (or sends one nobody receives)" if ring else
                          _UNMATCHED), mistake="deadlock" if ring else "collectives",
                       hint=_DEADLOCK if ring else chunk_hint) from None


_UNMATCHED = ("the ranks' collectives did not match: some rank called one that the other ranks of its group do "
              "not (a collective on another group than the model's, whose other ranks run other cases)")
_DEADLOCK = Hint(
    nudge="look at each step's messages: does every rank that waits for a message have a left neighbour that sends "
          "it at the same step?",
    idea="every rank must take the same number of steps, and at each of them both send and receive; a send and a "
         "receive posted one after the other can wait for each other round the whole ring",
    formula="at every step each rank sends to its right neighbour AND receives from its left one, posted together: "
            "exchange(sends=[(t, right)], recvs=[(buf, left)], group=group)")

_COLLECTIVES = Hint(
    nudge="look at the collectives your update calls: does every rank of the group call each of them, in the same "
          "order, on the group it was given?",
    idea="a collective completes only when every rank of its group has called it; the model's all-reduces run on "
         "model.group, and the ranks outside it are busy with other cases",
    formula="communicate only through the last micro-batch's backward, which DataParallel all-reduces on its own "
            "group: call no torch.distributed function yourself")


def _call(fn, args, case_text: str):
    """The learner's call on a rank; its exceptions name the case (NotImplementedError passes untouched)."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except Exception as e:
        raise LearnerError(f"your function raised {type(e).__name__}: {e} ({case_text})") from e


# --- tags: a value that says which chunk and whose shares ---------------------------------------------------

def _tag(rank: int, chunk: int, n: int) -> int:
    return (1 << rank) * (1 + chunk * (1 << n))


def _untag(value: float, n: int) -> tuple[int, tuple[int, ...]] | None:
    """(chunk, ranks) if `value` is a sum of distinct ranks' tags of one chunk, else None."""
    if not math.isfinite(value) or value != int(value) or value <= 0:  # NaN, inf: a buffer never received into
        return None
    v = int(value)
    m = v % (1 << n)
    if m == 0 or (v >> n) % m:
        return None
    chunk = (v >> n) // m
    return (chunk, tuple(r for r in range(n) if m >> r & 1)) if chunk < n else None


def _chunk_of(numel: int, n: int):
    """(numel,) int tensor: the chunk of `torch.tensor_split(range(numel), n)` each element falls in."""

    return torch.repeat_interleave(torch.arange(n), torch.tensor(chunk_sizes(numel, n)))


def _ranks_text(ranks) -> str:
    return ", ".join(map(str, ranks))


# --- 4.1: ring reduce-scatter -------------------------------------------------------------------------------

def _rs_input(case: dict, rank: int):
    """Rank `rank`'s input of a reduce-scatter case: tags or random integers, float32, of case['shape']."""

    n, shape = case["n"], case["shape"]
    numel = math.prod(shape)
    if case["tagged"]:
        return ((1 << rank) * (1 + _chunk_of(numel, n) * (1 << n))).float().view(shape)
    g = torch.Generator().manual_seed(case["seed"] * 31 + rank)
    return torch.randint(-8, 9, shape, generator=g).float()


def _rs_cases(rng: random.Random) -> list[dict]:
    cases = []
    for n in WORLD_SIZES:
        seed = rng.randrange(1 << 30)
        not_divisible = rng.choice([k for k in range(n + 1, 60) if k % n])
        # equal chunks first, tagged: a chunk index off by one is named from its tags there, before a later
        # case's unequal chunks make gloo stop a rank on a message of the wrong size (see _on_members)
        shapes = [(3 * n,), (3 * n + 1,), (1,), (n - 1,), (not_divisible,), (3, rng.randint(2, 9)),
                  (rng.randint(1000, 5000),)]
        cases += [{"n": n, "shape": s, "tagged": i == 0, "seed": seed + i} for i, s in enumerate(shapes)]
    return cases


def _on_members(run_case, right, cases) -> list:
    """On a rank: `run_case(case, group, rank)` per case whose group holds this rank, else None — up to the first
    case that some rank got wrong (`right(case, rank, result)` is False), where every rank stops.

    A wrong answer in a later case can crash a rank (gloo aborts a process that receives more bytes than it
    posted a buffer for), which costs a restart of all the ranks; the first wrong case is all the check reports.
    """
    out = []
    for case in cases:
        member, group = _group(case["n"])
        rank = td.get_rank(group) if member else None
        out.append(run_case(case, group, rank) if member else None)
        wrong = torch.tensor([float(member and not right(case, rank, out[-1]))])
        td.all_reduce(wrong, op=td.ReduceOp.MAX)  # every rank of the world: all stop after the same case
        if wrong.item():
            break
    return out


def _stopped_early(per_rank, cases, what: str) -> None:
    """Raise if the ranks stopped early (a case some rank found wrong) although every case compared here passed."""
    if len(per_rank[0]) < len(cases):
        case = cases[len(per_rank[0]) - 1]
        raise Mismatch(f"world size {case['n']}: your {what} gave a wrong answer on some rank in a case that "
                       "looks right from here")


def _answer(got):  # what the learner returned, as the caller gets it: a tensor's copy or the type's name
    return got.detach().clone() if isinstance(got, torch.Tensor) else type(got).__name__


def _reduce_scatter_case(fn, case, group, rank):
    x = _rs_input(case, rank)
    given = x.clone()
    got = _call(fn, (given, group), f"world size {case['n']}, rank {rank}, input of shape {case['shape']}")
    return _answer(got), not torch.equal(given, x)


def _rs_right(case, rank, result) -> bool:
    got, changed = result
    want = sum(_rs_input(case, r) for r in range(case["n"])).reshape(-1).tensor_split(case["n"])[rank]
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want) and not changed


def _run_reduce_scatter(fn, cases) -> list:
    return _on_members(functools.partial(_reduce_scatter_case, fn), _rs_right, cases)


def _rs_diagnosis(got, case: dict, rank: int) -> str | None:
    """What an off-by-one or a missing step looks like in a tagged case's answer, in words."""
    n = case["n"]
    decoded = [_untag(v, n) for v in got.reshape(-1).tolist()]
    if any(d is None for d in decoded):
        return ("its values are not sums of distinct ranks' shares of one chunk: a rank added its share of one "
                "chunk to the running sum of another, added a share twice, or used a buffer before it arrived")
    chunks = {c for c, _ in decoded}
    if chunks != {rank}:
        c = sorted(chunks - {rank})[0]
        return (f"rank {rank} ended with (part of) chunk {c}, not chunk {rank}: the chunk index is off by "
                f"{(c - rank) % n}")
    missing = sorted(set(range(n)) - set(decoded[0][1]))
    if missing:
        return (f"chunk {rank} on rank {rank} holds the shares of ranks {_ranks_text(decoded[0][1])} only, not of "
                f"{_ranks_text(missing)}: a ring reduce-scatter takes N−1 = {n - 1} steps, and after receiving a "
                "chunk each rank adds its own share before passing it on")
    return None


_RS_FORMULA = ("rank r should end with chunk r of torch.tensor_split(tensor.flatten(), N), summed over all ranks: "
               "at step s = 0 … N−2 it sends its running sum of chunk (r−s−1) mod N to rank r+1, receives chunk "
               "(r−s−2) mod N from rank r−1 and adds its own share of it; post each step's send and receive "
               "together (exchange), and leave the input tensor unchanged")
_CHUNK_INDEX = Hint(
    nudge="look at the index of the chunk you receive into and add at step s: it must be the chunk your left "
          "neighbour sends at that step",
    idea="rank r−1 sends at step s the sum it built at step s−1 (at step 0, its own share of chunk r−2), so the "
         "chunk arriving at rank r is always one lower than the one rank r sends at the same step, and after the "
         "last step rank r holds chunk r",
    formula=_RS_FORMULA)


@check("4.1", "ring reduce-scatter", hint=Hint(
    nudge="compare what each rank ends with against chunk r of the sum: which chunk is it, and whose shares does "
          "it hold?",
    idea="each step passes a running sum one rank to the right, and the receiver adds its own share of that chunk "
         "before passing it on: N−1 steps visit every rank once, in new tensors (the input stays as it was)",
    formula=_RS_FORMULA))
def ring_reduce_scatter(fn):
    """`fn(tensor, group)` on every rank of `group`: this rank's chunk of the sum over ranks (1-D, new)."""

    cases = _rs_cases(fresh_rng())
    per_rank = _on_ranks(_run_reduce_scatter, fn, cases, "reduce-scatter", _CHUNK_INDEX)
    for i, case in enumerate(cases[:len(per_rank[0])]):  # the ranks stop after the first wrong case
        n = case["n"]
        total = sum(_rs_input(case, r) for r in range(n)).reshape(-1)  # (S,) exact: small integers
        for rank in range(n):
            got, changed = per_rank[rank][i]
            what = f"world size {n}, input of shape {case['shape']}: rank {rank}'s chunk"
            if not isinstance(got, torch.Tensor):
                raise Mismatch(f"{what}: got {got}, expected a tensor")
            want = total.tensor_split(n)[rank]  # (S/N,)
            if case["tagged"] and not (got.shape == want.shape and torch.equal(got, want)):
                known = _rs_diagnosis(got, case, rank)
                if known:
                    off = "holds the shares of" not in known  # a wrong chunk, not a missing step
                    raise Mismatch(f"{what}: {known}", mistake="chunk index" if off else None,
                                   hint=_CHUNK_INDEX if off else None)
            if got.shape != want.shape:
                sizes = [len(c) for c in total.tensor_split(n)]
                raise Mismatch(f"{what}: got shape {tuple(got.shape)}, expected {tuple(want.shape)} (a 1-D chunk of "
                               f"torch.tensor_split: sizes {sizes} for {total.numel()} elements on {n} ranks)")
            assert_close(got, want, what=what, rtol=0, atol=0)  # integer values: every order of sums is exact
            if changed:
                raise Mismatch(f"{what} is right, but the input tensor was changed: a reduce-scatter leaves its "
                               "input as it was (add into new tensors, e.g. received + chunk, not chunk.add_)")
    _stopped_early(per_rank, cases, "reduce-scatter")


# --- 4.2: ring all-gather -----------------------------------------------------------------------------------

def _ag_input(case: dict, rank: int):
    """Rank `rank`'s chunk: element j is 1000·(rank + 1) + j (j < 1000), or random integers, float32."""

    numel = case["sizes"][rank]
    if case["tagged"]:
        return (1000 * (rank + 1) + torch.arange(numel)).float()
    g = torch.Generator().manual_seed(case["seed"] * 31 + rank)
    return torch.randint(-8, 9, (numel,), generator=g).float()


def _ag_cases(rng: random.Random) -> list[dict]:
    cases = []
    for n in WORLD_SIZES:
        seed = rng.randrange(1 << 30)
        # equal chunks first, tagged: a chunk index off by one sends a chunk of the right size there, so the answer
        # is named from its tags before a later case's unequal chunks can crash gloo (see _on_members)
        totals = [3 * n, 3 * n + 1, 1, n - 1, rng.choice([k for k in range(n + 1, 60) if k % n]),
                  rng.randint(1000, 5000)]
        for i, total in enumerate(totals):
            cases.append({"n": n, "sizes": chunk_sizes(total, n), "tagged": i == 0, "seed": seed + i})
        cases.append({"n": n, "sizes": [rng.randint(0, 40) for _ in range(n)], "tagged": True, "seed": seed + 9})
    return cases


def _all_gather_case(fn, case, group, rank):
    return _answer(_call(fn, (_ag_input(case, rank), list(case["sizes"]), group),
                         f"world size {case['n']}, rank {rank}, chunk sizes {case['sizes']}"))


def _ag_right(case, rank, got) -> bool:
    want = torch.cat([_ag_input(case, r) for r in range(case["n"])])
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)


def _run_all_gather(fn, cases) -> list:
    return _on_members(functools.partial(_all_gather_case, fn), _ag_right, cases)


def _ag_diagnosis(got, case: dict, rank: int) -> tuple[str, str]:
    """(what is wrong, the mistake's key): the first wrong chunk of rank `rank`'s output, what it holds instead,
    and the step at which it should have arrived."""
    n, sizes = case["n"], case["sizes"]
    for c, part in enumerate(got.split(sizes)):
        want = _ag_input(case, c)
        if part.equal(want):
            continue
        step = (rank - c - 1) % n
        values = part.tolist()
        tags = [v for v in values if math.isfinite(v) and v == int(v) and 1000 <= v < 1000 * (n + 1)]
        owners = {int(v) // 1000 - 1 for v in tags}
        if len(tags) < len(values) and owners <= {c}:  # values no rank sent (the allocator may recycle old tags)
            came, mistake = ("it holds values that are no rank's chunk: an empty buffer, either a part of the output "
                             "that a rank sent before it had received it, or a place nothing was received into"), \
                "chunk index"
        elif owners - {c}:
            came, mistake = (f"it holds (part of) rank {_ranks_text(sorted(owners - {c}))}'s chunk instead: at some "
                             "step the chunk a rank sent and the place its right neighbour received it into were not "
                             "the same chunk"), "chunk index"
        else:
            came, mistake = f"it holds only part of rank {c}'s chunk, or its elements out of place", "chunk offsets"
        return (f"chunk {c} of rank {rank}'s output (elements {sum(sizes[:c])}…{sum(sizes[:c + 1]) - 1}) is wrong: "
                f"{came}; chunk {c} should arrive at rank {rank} at step {step}, from rank {(rank - 1) % n}"), mistake
    return "", ""


_AG_FORMULA = ("start from an output holding your own chunk at its place (offsets from sizes); at step s = 0 … N−2 "
               "send chunk (r−s) mod N of the output to rank r+1 and receive chunk (r−s−1) mod N from rank r−1 into "
               "its place; chunks may differ in size (use sizes), and empty ones need no message")
_AG_HINTS = {
    "chunk index": Hint(
        nudge="look at the chunk each rank sends at step s and the place its right neighbour receives it into: they "
              "must be the same chunk, and one that the sender already holds",
        idea="at step 0 each rank sends its own chunk; at every later step it passes on the chunk it received at the "
             "step before, and its right neighbour receives it into that chunk's own place in the output",
        formula=_AG_FORMULA),
    "chunk offsets": Hint(
        nudge="look at where each chunk's place in the output starts and ends: the chunks may differ in size",
        idea="chunk c's place is sizes[c] elements long and starts after the sizes of all the chunks before it; "
             "split the output by sizes rather than into N equal parts",
        formula=_AG_FORMULA),
}


@check("4.2", "ring all-gather", hint=Hint(
    nudge="look at where each chunk must end up: chunk c of every rank's output is rank c's chunk, at the offset "
          "that the sizes before it give",
    idea="each rank puts its own chunk in its place first; then, in N−1 steps, every rank passes on to the right "
         "the chunk it received the step before, so that every chunk travels once round the ring",
    formula=_AG_FORMULA))
def ring_all_gather(fn):
    """`fn(chunk, sizes, group)` on every rank: every rank's chunk concatenated in rank order (1-D, new)."""

    cases = _ag_cases(fresh_rng())
    per_rank = _on_ranks(_run_all_gather, fn, cases, "all-gather", _AG_HINTS["chunk index"])
    for i, case in enumerate(cases[:len(per_rank[0])]):  # the ranks stop after the first wrong case
        n = case["n"]
        want = torch.cat([_ag_input(case, r) for r in range(n)])  # (Σ sizes,)
        for rank in range(n):
            got = per_rank[rank][i]
            what = f"world size {n}, chunk sizes {case['sizes']}: rank {rank}'s output"
            if not isinstance(got, torch.Tensor):
                raise Mismatch(f"{what}: got {got}, expected a tensor")
            if got.shape != want.shape:
                raise Mismatch(f"{what}: got shape {tuple(got.shape)}, expected {tuple(want.shape)} (every rank's "
                               "chunk, concatenated)")
            if case["tagged"] and not torch.equal(got, want):
                known, mistake = _ag_diagnosis(got, case, rank)
                if known:
                    raise Mismatch(f"{what}: {known}", mistake=mistake, hint=_AG_HINTS[mistake])
            assert_close(got, want, what=what, rtol=0, atol=0)  # copies: exact
    _stopped_early(per_rank, cases, "all-gather")


# --- 4.3: gradient accumulation under data parallelism: k micro-batches, one all-reduce, one step ------------

def accumulation_case(rng: random.Random, ranks: int = 1):
    """k micro-batches of a random regression for each of `ranks` ranks (rank r's are batches[r·k:(r+1)·k]) and a
    function building the same fresh float64 model each time (also the cases of chapter 6's 6.3, which accumulates,
    unscales and clips on one rank)."""

    k, rows, d_in = rng.randint(2, 6), rng.randint(1, 6), rng.randint(2, 9)
    seed = rng.randrange(1 << 30)

    def model():
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(d_in, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2)).double()

    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(ranks * k * rows, d_in, generator=g, dtype=torch.float64)  # (ranks·k·rows, d_in)
    y = torch.randn(ranks * k * rows, 2, generator=g, dtype=torch.float64)  # (ranks·k·rows, 2)
    batches = list(zip(x.split(rows), y.split(rows), strict=True))  # ranks·k micro-batches
    return k, model, batches


def micro_batch_mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)  # the mean over the micro-batch


_BUCKETS_MB = {"one bucket": 25.0, "a bucket per tensor": 1e-4}  # 1e-4 MB ≈ 105 B: no two neighbouring tensors fit


def _dp_cases(rng: random.Random) -> list[dict]:
    """One case per world size: the ranks' micro-batches, stale gradients per rank, SGD's lr, the bucket size."""
    cases = []
    for n in WORLD_SIZES:
        k, make_model, batches = accumulation_case(rng, ranks=n)
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        stale = [[torch.randn(p.shape, generator=g, dtype=torch.float64) for p in make_model().parameters()]
                 for _ in range(n)]  # per rank, per parameter: what an earlier backward left in .grad
        buckets = rng.choice(sorted(_BUCKETS_MB))
        cases.append({"n": n, "k": k, "make_model": make_model, "batches": batches, "stale": stale,
                      "lr": rng.uniform(0.05, 0.5), "buckets": buckets})
    return cases


def _dp_text(case: dict, rank: int) -> str:
    rows = len(case["batches"][0][0])
    return (f"world size {case['n']}, {case['k']} micro-batches of {rows} row{'s' * (rows > 1)} per rank, "
            f"{case['buckets']}, rank {rank}")


def _my_batches(case: dict, rank: int) -> list:
    k = case["k"]
    return case["batches"][rank * k:(rank + 1) * k]


def _dp_model(case: dict, group) -> DataParallel:
    return DataParallel(case["make_model"](), bucket_mb=_BUCKETS_MB[case["buckets"]], group=group)


def _accumulate_case(fn, case, group, rank):
    """On a rank: the learner's update of a wrapped model holding stale gradients. Returns (its answer, the weights
    after it, the gradients left after it, optimizer steps, bytes sent, bytes one synchronised backward sends)."""
    model, mine = _dp_model(case, group), _my_batches(case, rank)
    for p, stale in zip(model.parameters(), case["stale"][rank], strict=True):
        p.grad = stale.clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=case["lr"])
    steps = []
    optimizer.register_step_post_hook(lambda *_: steps.append(1))
    with CommLog() as log:
        got = _call(fn, (model, micro_batch_mse, mine, optimizer), _dp_text(case, rank))
    probe = _dp_model(case, group)  # a fresh wrapper: what one synchronised backward sends on this rank
    with CommLog() as one:
        micro_batch_mse(probe, mine[0]).backward()
    weights = [p.detach().clone() for p in model.parameters()]
    left = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    answer = got if isinstance(got, numbers.Real) else _answer(got)
    return answer, weights, left, len(steps), log.bytes_sent, one.bytes_sent


def _sgd_update(case: dict, batches: list) -> list:
    """How one single-process SGD step on the mean loss over `batches` moves each parameter (llmlab's reference)."""
    model = case["make_model"]()
    start = [p.detach().clone() for p in model.parameters()]
    accumulate_gradients(model, micro_batch_mse, batches)  # the gradient of the mean loss: equal micro-batches
    torch.optim.SGD(model.parameters(), lr=case["lr"]).step()
    return [p.detach() - s for p, s in zip(model.parameters(), start, strict=True)]


def _dp_updates(case: dict, rank: int) -> dict[str, list]:
    """The update a right answer makes, and the updates of the mistakes the check names. Plain SGD moves a weight
    by −lr·gradient, so a gradient k× too large moves it k× as far, and stale gradients add −lr·their mean."""
    n, k, lr = case["n"], case["k"], case["lr"]
    right = _sgd_update(case, case["batches"])  # every rank's micro-batches: the large batch
    stale = [sum(rank_stale[i] for rank_stale in case["stale"]) / n for i in range(len(right))]  # DDP averages them
    return {"right": right,
            "never averaged": _sgd_update(case, _my_batches(case, rank)),
            "no 1/k": [k * u for u in right],
            "no zeroing": [u - lr * s for u, s in zip(right, stale, strict=True)],
            "divided by N": [u / n for u in right]}


def _update_tol(want) -> dict:
    """float64: the ranks' average sums the n·k micro-batches' gradients in another order than the single process,
    a few units of 2^-53 of the largest term each; 1e-9 of the update's largest entry is ~10^6 times that, and every
    mistake named is off by a factor (k, 1/N) or by terms of the gradient's own size (stale, another rank's)."""
    return dict(rtol=1e-9, atol=1e-9 * want.abs().max().item())


def _same(xs, ys) -> bool:
    return all(torch.allclose(x, y, **_update_tol(y)) for x, y in zip(xs, ys, strict=True))


_DP_FORMULA = ("optimizer.zero_grad(); for each of the first k−1 micro-batches, inside `with model.no_sync():`, "
               "(loss_fn(model, batch) / k).backward(); then (loss_fn(model, batches[-1]) / k).backward() outside it "
               "(this backward all-reduces the accumulated gradients, once); optimizer.step(); optimizer.zero_grad(); "
               "return the mean of the k losses' .item()")
_ONE_SYNC = Hint(
    nudge="count what your update sends: how many of its backward passes communicate?",
    idea="DataParallel all-reduces the gradients at the end of every backward that runs outside model.no_sync(); "
         "the gradients add up in .grad locally all the same, so only the last backward needs to average them",
    formula=_DP_FORMULA)
_DP_HINTS = {
    "every micro-batch": _ONE_SYNC, "extra bytes": _ONE_SYNC,
    "never averaged": Hint(
        nudge="compare the ranks' weights after your update: are they still one model?",
        idea="under no_sync nothing is communicated; the last micro-batch's backward must run outside it, so that "
             "DataParallel averages the accumulated gradients over the ranks before the step",
        formula=_DP_FORMULA),
    "no 1/k": Hint(
        nudge="look at how much each micro-batch's backward adds to .grad: the k of them are added up",
        idea="the large-batch gradient is the mean of the k micro-batches' gradients, not their sum, so each "
             "backward must contribute its gradient weighted 1/k",
        formula=_DP_FORMULA),
    "no zeroing": Hint(
        nudge="look at what .grad holds before your first backward: backward adds to whatever is already there",
        idea="gradients from an earlier backward stay in .grad until they are cleared, so clear them before the "
             "first micro-batch — zeroing after the step alone leaves whatever came before the call",
        formula=_DP_FORMULA),
    "divided by N": Hint(
        nudge="look at what you divide each loss by",
        idea="DataParallel already averages the gradients over the ranks (it divides their sum by the world size); "
             "your division is for the k micro-batches only",
        formula=_DP_FORMULA),
    "steps": Hint(
        nudge="count your optimizer.step() calls: one update, one step",
        idea="accumulation gathers k micro-batches' gradients for ONE step: step once, after the last backward",
        formula=_DP_FORMULA),
    "not cleared": Hint(
        nudge="look at what .grad holds when your update returns",
        idea="zero the gradients after the step too, as the material's loop does, so that nothing of this update "
             "is left in .grad (set_to_none also frees their memory until the next backward)",
        formula=_DP_FORMULA),
    "loss": Hint(
        nudge="look at what your function returns: the mean loss over this rank's micro-batches",
        idea="keep each micro-batch's loss.item() (the loss before the division by k) and return their mean, "
             "a float",
        formula=_DP_FORMULA),
}
_DP_MISTAKES = {
    "never averaged": "they moved as one SGD step on this rank's own micro-batches alone: its gradients were never "
                      "averaged with the other ranks', so the ranks now hold different models — the last backward "
                      "ran under no_sync too; run it outside, so that it all-reduces",
    "no 1/k": "they moved k× as far as one step on the large batch: the k micro-batches' gradients were summed; "
              "divide each micro-batch's loss by k before backward",
    "no zeroing": "they moved by the large batch's gradient plus the stale gradients the model held before the "
                  "update: zero the gradients first (optimizer.zero_grad())",
    "divided by N": "they moved 1/N as far as one step on the large batch: each loss was divided by the world size "
                    "as well, but DataParallel already averages over the ranks; divide by k only",
}


def _dp_verdict(case: dict, rank: int, result) -> None:
    """Raise Mismatch if rank `rank`'s update of `case` is wrong: its steps, weights, bytes, leftover gradients,
    returned loss. The same verdict on the ranks (where they stop after the first wrong case) and in the check."""
    got, weights, left, steps, sent, one_sync = result
    k, what = case["k"], _dp_text(case, rank)
    if steps != 1:
        inside = ": once per micro-batch, inside the loop; step once, after the last backward" if steps == k else ""
        raise Mismatch(f"{what}: the optimizer stepped {steps} times in one update{inside}", mistake="steps",
                       hint=_DP_HINTS["steps"])
    start = [p.detach() for p in case["make_model"]().parameters()]
    moved = [w - s for w, s in zip(weights, start, strict=True)]
    updates = _dp_updates(case, rank)
    if not _same(moved, updates["right"]):
        known = next((m for m in _DP_MISTAKES if _same(moved, updates[m])), None)
        if known:
            raise Mismatch(f"{what}: the weights are wrong: {_DP_MISTAKES[known]}", mistake=known,
                           hint=_DP_HINTS[known])
        for (name, _), mine, want in zip(case["make_model"]().named_parameters(), moved, updates["right"],
                                         strict=True):
            assert_close(mine, want, what=f"{what}: the update of {name}", **_update_tol(want))
    if sent != one_sync:
        every = sent == k * one_sync
        raise Mismatch(f"{what}: the weights are right, but the update sent {sent} bytes, "
                       + (f"{k}× the {one_sync} of one synchronisation of the gradients: every micro-batch's "
                          "backward all-reduced them; run the first k−1 backward passes inside `with "
                          "model.no_sync():` (the backward, not only the forward)" if every else
                          f"where one synchronisation of the gradients sends {one_sync}: the update communicates "
                          "the gradients once, in the last backward, and nothing else (the loss it returns is "
                          "this rank's own)"),
                       mistake="every micro-batch" if every else "extra bytes",
                       hint=_DP_HINTS["every micro-batch" if every else "extra bytes"])
    if any(g is not None and bool(g.any()) for g in left):
        raise Mismatch(f"{what}: the update is right, but its gradients are still in .grad: zero them after the step",
                       mistake="not cleared", hint=_DP_HINTS["not cleared"])
    if isinstance(got, str):
        raise Mismatch(f"{what}: your function returned {got}, expected a float, this rank's mean micro-batch loss",
                       mistake="loss", hint=_DP_HINTS["loss"])
    value = number(got, f"{what}: the loss returned")
    model = case["make_model"]()
    losses = [micro_batch_mse(model, b).item() for b in _my_batches(case, rank)]  # at the weights before the step
    want = sum(losses) / k
    # float64: the same k losses, added in another order (or divided by k first): a few units of 2^-53
    if not math.isclose(value, want, rel_tol=1e-12, abs_tol=1e-15):
        told = {k * want: f"the sum of the {k} losses, not their mean",
                losses[-1]: "the last micro-batch's loss alone, not the mean of all k"}
        known = next((text for v, text in told.items() if math.isclose(value, v, rel_tol=1e-12)), None)
        raise Mismatch(f"{what}: returned {value:.12g}, expected {want:.12g}, the mean of this rank's {k} "
                       "micro-batch losses" + (f": that is {known}" if known else ""), mistake="loss",
                       hint=_DP_HINTS["loss"])


def _dp_right(case, rank, result) -> bool:
    try:
        _dp_verdict(case, rank, result)
    except Mismatch:
        return False
    return True


def _run_accumulate(fn, cases) -> list:
    return _on_members(functools.partial(_accumulate_case, fn), _dp_right, cases)


@check("4.3", "gradient accumulation under data parallelism", hint=Hint(
    nudge="look at each part of your update: what .grad holds at the start, how much each backward adds, which "
          "backward communicates, how often the optimizer steps",
    idea="start from zeroed gradients; k backward passes of loss/k add up the mean gradient locally, the first k−1 "
         "under model.no_sync() and the last outside it, so that DataParallel all-reduces it once; then one step",
    formula=_DP_FORMULA))
def accumulate_step(fn):
    """`fn(model, loss_fn, batches, optimizer)` on every rank: one update of a DataParallel model on this rank's k
    micro-batches, one all-reduce of the gradients; returns this rank's mean micro-batch loss."""

    cases = _dp_cases(fresh_rng())
    per_rank = _on_ranks(_run_accumulate, fn, cases, "update", _COLLECTIVES, ring=False)
    for i, case in enumerate(cases[:len(per_rank[0])]):  # the ranks stop after the first wrong case
        for rank in range(case["n"]):
            _dp_verdict(case, rank, per_rank[rank][i])
    _stopped_early(per_rank, cases, "update")


# --- 4.5: the whole ring all-reduce -------------------------------------------------------------------------

def _ar_input(case: dict, rank: int):
    """Rank `rank`'s input of an all-reduce case in case['dtype']: 4.1's tags or small integers, or random normal
    floats; of case['shape'], as the transpose of a contiguous tensor when case['transposed'] (2-D cases)."""

    shape = case["shape"][::-1] if case["transposed"] else case["shape"]
    if case["floats"]:
        g = torch.Generator().manual_seed(case["seed"] * 31 + rank)
        x = torch.randn(shape, generator=g, dtype=torch.float64)
    else:
        x = _rs_input({**case, "shape": shape}, rank)
    x = x.to(case["dtype"])
    return x.t() if case["transposed"] else x


def _ar_cases(rng: random.Random) -> list[dict]:
    f32, f64, bf16 = torch.float32, torch.float64, torch.bfloat16
    cases = []
    for n in WORLD_SIZES:
        seed = rng.randrange(1 << 30)
        not_divisible = rng.choice([k for k in range(n + 1, 60) if k % n])
        # equal chunks first, tagged: a chunk index off by one is named from its tags there (see _rs_cases); then
        # uneven chunks, fewer elements than ranks (empty chunks), a 0-d tensor, a transposed one, bf16 and float64
        kinds = [((3 * n,), f32, "tagged", "sum"), ((2, 3 * n + 1), f64, "tagged", "sum"),
                 ((1,), f32, "integers", "sum"), ((n - 1,), bf16, "integers", "sum"), ((), f64, "integers", "avg"),
                 ((3, rng.randint(2, 9)), bf16, "floats", "avg"),
                 ((rng.randint(2, 9), rng.randint(2, 9)), f32, "transposed", "sum"),
                 ((not_divisible,), f32, "integers", "avg"), ((rng.randint(1000, 5000),), f64, "floats", "sum")]
        cases += [_distinct({"n": n, "shape": shape, "dtype": dtype, "tagged": values == "tagged",
                             "floats": values in ("floats", "transposed"), "transposed": values == "transposed",
                             "op": op, "seed": seed + i}) for i, (shape, dtype, values, op) in enumerate(kinds)]
    return cases


def _distinct(case: dict) -> dict:
    """`case` with its seed moved on until the sum over ranks differs from every rank's own input, so that a rank
    left holding its input (sums made in a copy) is told from a sum that is not divided (op='avg'): with a 0-d
    tensor of small integers on 2 ranks they coincide whenever the other rank draws 0."""
    while not (case["floats"] or case["tagged"]):  # random floats and tags never coincide
        inputs = [_ar_input(case, r) for r in range(case["n"])]
        total = sum(x.double() for x in inputs)
        if not any(torch.equal(x.double(), total) for x in inputs):
            break
        case = {**case, "seed": case["seed"] + 1000}
    return case


def _ar_text(case: dict) -> str:
    shape = "a transposed (not contiguous) " if case["transposed"] else "a "
    segments = f", segments={case['segments']}" if "segments" in case else ""
    return (f"world size {case['n']}, op={case['op']!r}{segments}, {shape}{str(case['dtype'])[6:]} tensor of shape "
            f"{case['shape']}")


def _all_reduce_case(fn, case, group, rank):
    """On a rank: (the learner's answer, whether it is the very tensor given, the messages logged meanwhile as
    (name, kind, peer, elements))."""
    x = _ar_input(case, rank)
    place = (x.data_ptr(), x.shape, x.stride())
    args = (x, group) if case["op"] == "sum" and "segments" not in case else (x, group, case["op"])
    args += (case["segments"],) if "segments" in case else ()
    with CommLog() as log:
        got = _call(fn, args, f"{_ar_text(case)}, rank {rank}")
    same = isinstance(got, torch.Tensor) and (got.data_ptr(), got.shape, got.stride()) == place
    messages = [(e.name, e.kind, e.peer, (e.bytes_sent + e.bytes_received) // x.element_size()) for e in log.events]
    return _answer(got), same, messages


def _ar_right(case, rank, result, verdict=None) -> bool:
    try:
        (verdict or _ar_verdict)(case, rank, result)
    except Mismatch:
        return False
    return True


def _run_all_reduce(fn, cases, verdict=None) -> list:
    return _on_members(functools.partial(_all_reduce_case, fn), functools.partial(_ar_right, verdict=verdict), cases)


def _ar_expected(case: dict) -> tuple[torch.Tensor, float]:
    """(the exact result, in float64; the largest error a right answer may have) of an all-reduce case."""
    n = case["n"]
    inputs = [_ar_input(case, r).double() for r in range(n)]
    exact, magnitude = sum(inputs), sum(x.abs() for x in inputs)  # of the input's shape
    if case["op"] == "avg":
        exact, magnitude = exact / n, magnitude / n
    if case["op"] == "sum" and not case["floats"]:
        return exact, 0.0  # small integers and tags: every partial sum is exact, in every dtype and order
    # a ring adds each element's N shares one at a time: N−1 roundings of partial sums, each at most u·Σ|x| (u the
    # dtype's unit roundoff, 2^-8 in bf16), one more for avg's division (N if each share is divided first, each
    # u·|x_r|/N); the float64 sum above adds up to (N−1)·2^-53·Σ|x| of its own in float64: 2(N+1)·u·Σ|x| covers it all
    u = torch.finfo(case["dtype"]).eps / 2
    return exact, 2 * (n + 1) * u * magnitude.max().item()


def _ar_sends(messages: list) -> list[tuple[int, int]]:
    """(peer, elements) of each non-empty message sent (empty chunks need none)."""
    return [(peer, k) for name, _, peer, k in messages if name == "send" and k]


def _ar_diagnosis(got, case: dict, sent: int) -> tuple[str, str | None] | None:
    """(what is wrong, the mistake's key) in a tagged case, whose every chunk c must decode as chunk c summed over
    every rank (`_untag`); `sent`: how many messages the rank sent. None if no pattern is recognised."""
    n, everyone = case["n"], tuple(range(case["n"]))
    partial = []  # (chunk, the ranks whose shares it holds) of each chunk summed over some ranks only
    for c, part in enumerate(got.reshape(-1).tensor_split(n)):
        decoded = [_untag(v, n) for v in part.tolist()]
        if None in decoded:
            return (f"chunk {c} of it holds values that are not sums of distinct ranks' shares of one chunk: a rank "
                    "added its share of one chunk to the running sum of another, added a share twice, or used a "
                    "buffer before anything was received into it"), "chunk index"
        other = next((d for d, _ in decoded if d != c), None)
        if other is not None:
            return (f"chunk {c} of it holds (part of) the sum of chunk {other}: a chunk index is off by "
                    f"{(other - c) % n}"), "chunk index"
        short = next((ranks for _, ranks in decoded if ranks != everyone), None)
        if short:
            partial.append((c, short))
    if not partial:
        return None
    c, ranks = partial[0]
    holds = f"chunk {c} holds the shares of ranks {_ranks_text(ranks)} only"
    if len(partial) == n - 1:
        done = (set(everyone) - {p for p, _ in partial}).pop()
        return (f"only chunk {done} of it is summed over all ranks, and {holds}: that is the reduce-scatter alone; "
                "the all-gather, which passes every finished chunk round the ring, is missing"), "reduce-scatter only"
    holds += f", not of {_ranks_text(sorted(set(everyone) - set(ranks)))}"
    if sent == 2 * (n - 1):  # every step sent its chunk (the tagged case's chunks are never empty)
        return (f"{holds}, although every step sent a chunk: at some step a rank received into, or sent, another "
                "chunk than its neighbour's"), "chunk index"
    return f"{holds}: a step is missing (each phase takes N−1 = {n - 1} steps)", None


def _ar_verdict(case: dict, rank: int, result, hints=None, diagnose=None, sent=None) -> None:
    """Raise Mismatch if rank `rank`'s result of `case` is wrong: its type, shape, dtype, place, values, messages.
    The same verdict on the ranks (where they stop after the first wrong case) and in the check. The ring's hints,
    diagnosis of a tagged case and message count by default; 4.6's tree passes its own."""
    hints, sent = hints or _AR_HINTS, sent or _ar_messages
    diagnose = diagnose or (lambda got, case, rank, messages: _ar_diagnosis(got, case, len(_ar_sends(messages))))
    got, same, messages = result
    n, op, x = case["n"], case["op"], _ar_input(case, rank)
    what = f"{_ar_text(case)}: rank {rank}'s result"
    if not isinstance(got, torch.Tensor):
        raise Mismatch(f"{what}: your function returned {got}, expected the tensor it was given, holding the {op}",
                       mistake="return", hint=hints["return"])
    if got.shape != x.shape:
        raise Mismatch(f"{what}: got shape {tuple(got.shape)}, expected {tuple(x.shape)}, the input's own (return "
                       "tensor itself, not a flat view of it)")
    if got.dtype != x.dtype:
        raise Mismatch(f"{what}: got dtype {got.dtype}, expected the input's, {x.dtype}")
    if not same:
        raise Mismatch(f"{what} is a new tensor, not the one your function was given: an all-reduce works in place "
                       "and returns its input", mistake="not in place", hint=hints["not in place"])
    exact, tol = _ar_expected(case)
    if not torch.isclose(got.double(), exact, rtol=0, atol=tol).all():
        if torch.equal(got, x):
            copied = " (it is not contiguous: reshape and contiguous() copy it)" if case["transposed"] else ""
            raise Mismatch(f"{what}: your tensor still holds its own input: the sums went into a copy of it{copied}",
                           mistake="not in place", hint=hints["not in place"])
        if op == "avg" and torch.allclose(got.double(), exact * n, rtol=0, atol=tol * n):
            raise Mismatch(f"{what} is the sum over ranks, not the average: op='avg' divides it by N = {n}",
                           mistake="avg", hint=hints["avg"])
        known = diagnose(got, case, rank, messages) if case["tagged"] else None
        if known:
            raise Mismatch(f"{what}: {known[0]}", mistake=known[1], hint=hints.get(known[1]))
        assert_close(got.double(), exact, what=what, rtol=0, atol=tol)
    sent(case, rank, messages, what)


def _ar_messages(case: dict, rank: int, messages: list, what: str) -> None:
    """Raise Mismatch unless rank `rank` sent its ring's messages: 2(N−1) through exchange, each one chunk, to its
    right neighbour (and received from its left)."""
    n, numel = case["n"], math.prod(case["shape"])
    collectives = sorted({name for name, kind, _, _ in messages if kind == "collective"})
    if collectives:
        raise Mismatch(f"{what} is right, but your function called {', '.join(collectives)}: build the all-reduce "
                       "from exchange's point-to-point messages only")
    sends = _ar_sends(messages)
    strangers = sorted({p for p, _ in sends if p != (rank + 1) % n}
                       | {p for name, _, p, k in messages if name == "recv" and k and p != (rank - 1) % n})
    sizes = chunk_sizes(numel, n)
    biggest = max((k for _, k in sends), default=0)
    if biggest > sizes[0]:  # the first chunk of tensor_split is the largest, ⌈S/N⌉
        ring = 2 * numel - sizes[rank] - sizes[(rank + 1) % n]  # all chunks but one in each phase
        raise Mismatch(f"{what} is right, but rank {rank} sent a message of {biggest} elements, where a ring step "
                       f"sends one chunk, at most ⌈S/N⌉ = {sizes[0]} of the {numel}: {len(sends)} messages of "
                       f"{sum(k for _, k in sends)} elements in all, where the ring sends 2(N−1) = {2 * (n - 1)} "
                       f"chunks, {ring} elements", mistake="whole tensor", hint=_AR_HINTS["whole tensor"])
    if strangers:
        raise Mismatch(f"{what} is right, but rank {rank} exchanged messages with rank {_ranks_text(strangers)}: on "
                       "a ring rank r sends only to r+1 and receives only from r−1 (mod N)")
    steps = 2 * (n - 1)
    if len(sends) > steps or (numel >= n and len(sends) != steps):
        raise Mismatch(f"{what} is right, but rank {rank} sent {len(sends)} messages through exchange, not 2(N−1) = "
                       f"{steps}, one per step of the reduce-scatter and of the all-gather (the check counts "
                       "exchange's messages)")


_AR_FORMULA = ("flat = tensor.view(-1) (on a transposed tensor, a contiguous copy, copied back at the end), chunks = "
               "flat.tensor_split(N); reduce-scatter: at step s = 0 … N−2 send chunk (r−s−1) mod N to rank r+1, "
               "receive chunk (r−s−2) mod N from rank r−1 into a new buffer and add it into that chunk; chunk r is "
               "then the sum (for 'avg' divide it by N once); all-gather: at step s send chunk (r−s) mod N and "
               "receive chunk (r−s−1) mod N straight into its place; return tensor")
_AR_HINTS = {
    "return": Hint(
        nudge="look at your function's last line: what does it return?",
        idea="an all-reduce returns the tensor it was given, now holding the sum, as llmlab.dist.ring_all_reduce "
             "does (torch.distributed.all_reduce leaves it in place too)",
        formula=_AR_FORMULA),
    "reduce-scatter only": Hint(
        nudge="look at the chunks other than the one each rank finished: does anything send them round again?",
        idea="after the N−1 steps of the reduce-scatter each rank holds one finished chunk and partial sums in the "
             "others; N−1 more steps, an all-gather, pass every finished chunk round the ring into its place",
        formula=_AR_FORMULA),
    "whole tensor": Hint(
        nudge="look at the size of each message: a ring step sends one chunk, not the tensor",
        idea="passing whole tensors round the ring sends (N−1)·S elements per rank; the reduce-scatter and the "
             "all-gather send one chunk of about S/N at each of their N−1 steps, 2(N−1)/N·S in all, whatever N is",
        formula=_AR_FORMULA),
    "not in place": Hint(
        nudge="look at where your sums are written: into the tensor you were given, or into a new one?",
        idea="an all-reduce works in place (DDP all-reduces the .grad tensors themselves): write into views of the "
             "tensor (view(-1) and tensor_split give views), and where you had to work on a copy, copy it back",
        formula=_AR_FORMULA),
    "avg": Hint(
        nudge="look at what op='avg' must give: the mean over the ranks",
        idea="divide the finished sum by N once: each rank its finished chunk, before the all-gather passes it on",
        formula=_AR_FORMULA),
    "chunk index": Hint(
        nudge="look at the chunk indices of each step, in both phases: the chunk a rank receives into must be the one "
              "its left neighbour sends at that step",
        idea="in the reduce-scatter rank r sends chunk r−s−1 at step s (its own share at step 0, then the sum it "
             "built the step before) and receives chunk r−s−2; in the all-gather it sends chunk r−s, its finished "
             "chunk at step 0, and receives chunk r−s−1",
        formula=_AR_FORMULA),
}


@check("4.5", "the whole ring all-reduce", hint=Hint(
    nudge="compare every chunk of each rank's result with the sum of that chunk over all ranks: which chunks are "
          "wrong, and what do they hold?",
    idea="a reduce-scatter (N−1 steps, each rank adding its share to the running sum it receives) leaves each rank "
         "one finished chunk; an all-gather (N−1 more steps) passes the finished chunks round; both work on views "
         "of the tensor, so the tensor itself ends holding the sum",
    formula=_AR_FORMULA))
def ring_all_reduce(fn):
    """`fn(tensor, group[, op])` on every rank of `group`: `tensor` itself, holding the sum (or mean) over ranks."""

    cases = _ar_cases(fresh_rng())
    per_rank = _on_ranks(_run_all_reduce, fn, cases, "all-reduce", _AR_HINTS["chunk index"])
    for i, case in enumerate(cases[:len(per_rank[0])]):  # the ranks stop after the first wrong case
        for rank in range(case["n"]):
            _ar_verdict(case, rank, per_rank[rank][i])  # the ranks' own verdict: it raises at the case they stopped at


# --- 4.6: the tree all-reduce, in segments (4.5's cases and verdict, the tree's diagnosis and messages) ------

_TREE_FORMULA = ("parent = (r−1)//2 (none at r = 0), children = [c for c in (2r+1, 2r+2) if c < N]; flat = "
                 "tensor.view(-1) (a contiguous copy for a transposed tensor), pieces = flat.tensor_split(segments); "
                 "reduce: for each "
            "piece, for each child exchange(recvs=[(buf, child)]) into a new buffer and piece.add_(buf), then "
            "exchange(sends=[(piece, parent)]) unless r = 0; for 'avg' rank 0 divides flat by N; broadcast: for each "
            "piece exchange(recvs=[(piece, parent)]) unless r = 0, then exchange(sends=[(piece, c) for c in "
            "children]); copy back if flat was a copy; return tensor")
_TREE_HINTS = {
    **{key: Hint(nudge=hint.nudge, idea=hint.idea, formula=_TREE_FORMULA) for key, hint in _AR_HINTS.items()
       if key in ("return", "not in place")},
    "avg": Hint(
        nudge="look at what op='avg' must give: the mean over the ranks",
        idea="divide once, where the whole sum first exists: at the root, after the reduce, before the broadcast "
             "copies it down",
        formula=_TREE_FORMULA),
    "broadcast": Hint(
        nudge="look at what the ranks other than 0 end with: the sum of whose shares?",
        idea="after the reduce only the root holds the whole sum; each rank below holds its subtree's. A second "
             "pass, the broadcast, copies the root's result down the same tree, parent to children",
        formula=_TREE_FORMULA),
    "overwritten": Hint(
        nudge="look at the shares missing from the result: whose are they, and where did a rank receive into?",
        idea="a rank with children must keep its own share: receive each child's partial sum into a new buffer "
             "and add it, rather than receiving straight into the piece it holds",
        formula=_TREE_FORMULA),
    "segments": Hint(
        nudge="count your messages: one per segment, or one for the whole tensor?",
        idea="the tensor goes up and down the tree in `segments` pieces (tensor_split), one message each, so "
             "that while a parent adds segment k its children already send segment k+1 — the levels work at once",
        formula=_TREE_FORMULA),
    "neighbours": Hint(
        nudge="look at who your ranks exchange messages with: a tree's neighbours, or a ring's?",
        idea="in a binary tree in heap order rank r talks only to its parent (r−1)//2 and its children 2r+1 and "
             "2r+2; a ring's neighbours r±1 are another algorithm",
        formula=_TREE_FORMULA),
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


def _tree_cases(rng: random.Random) -> list[dict]:
    """4.5's cases, each with a number of segments: 1 (the whole tensor at once) up to more than it has elements."""
    return [{**case, "segments": rng.choice([1, 2, 3, 5, 8])} for case in _ar_cases(rng)]


def _tree_diagnosis(got, case: dict, rank: int, messages) -> tuple[str, str | None] | None:
    """(what is wrong, the mistake's key) of a tagged case, whose every element must decode to every rank's share
    (`_untag`); None if no pattern is recognised."""
    n, everyone = case["n"], tuple(range(case["n"]))
    for i, value in enumerate(got.reshape(-1).tolist()):
        decoded = _untag(value, n)
        if decoded is None:
            return (f"element {i} holds a value that is not a sum of distinct ranks' shares: a share was added "
                    "twice, or a buffer used before anything was received into it"), None
        ranks = decoded[1]
        if ranks == everyone:
            continue
        missing = sorted(set(everyone) - set(ranks))
        if all(_children(r, n) for r in missing):
            return (f"element {i} misses the shares of ranks {_ranks_text(missing)}, each a rank with children: "
                    "a child's partial sum was received over the rank's own share"), "overwritten"
        return f"element {i} holds the shares of ranks {_ranks_text(ranks)} only", None
    return None


def _tree_messages(case: dict, rank: int, messages: list, what: str) -> None:
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
        raise Mismatch(f"{what} is right, but rank {rank} exchanged messages with rank {_ranks_text(strangers)}: "
                       f"in the tree its neighbours are {_ranks_text(sorted(neighbours)) or 'none'}",
                       mistake="neighbours", hint=_TREE_HINTS["neighbours"])
    pieces = sum(1 for k in chunk_sizes(math.prod(case["shape"]), case["segments"]) if k)  # non-empty segments
    want = pieces * ((parent is not None) + len(children))  # up to the parent, down to each child
    sends = len(_ar_sends(messages))
    if sends != want:
        whole = sends == (parent is not None) + len(children)
        raise Mismatch(f"{what} is right, but rank {rank} sent {sends} messages, not {want}: one per non-empty "
                       f"segment ({pieces}) up to its parent and down to each of its {len(children)} children"
                       + (": the whole tensor went in one message each way" if whole else ""),
                       mistake="segments" if whole else None, hint=_TREE_HINTS["segments"] if whole else None)


def _tree_verdict(case: dict, rank: int, result, sent=_tree_messages) -> None:
    """4.5's verdict with the tree's hints, diagnosis and messages — after one check of its own, first: a tagged
    result that is exactly the rank's subtree's sum (a leaf's own input) is a missing broadcast, not a result
    computed into a copy, as 4.5's verdict would read a leaf's unchanged tensor."""
    got, n = result[0], case["n"]
    below = _subtree(rank, n)
    if case["tagged"] and below != tuple(range(n)) and isinstance(got, torch.Tensor) and got.numel() and all(
            (decoded := _untag(v, n)) is not None and decoded[1] == below for v in got.reshape(-1).tolist()):
        raise Mismatch(f"{_ar_text(case)}: rank {rank}'s result holds the sum over its subtree (ranks "
                       f"{_ranks_text(below)}) only: the reduce went up the tree, but nothing came back down — "
                       "the broadcast from the root is missing", mistake="broadcast", hint=_TREE_HINTS["broadcast"])
    _ar_verdict(case, rank, result, hints=_TREE_HINTS, diagnose=_tree_diagnosis, sent=sent)


@check("4.6", "the tree all-reduce, in segments", hint=Hint(
    nudge="compare each rank's result with the sum over all ranks: which ranks are wrong, and whose shares do they "
          "hold?",
    idea="a reduce up the binary tree (each rank adds its children's partial sums to its own share and passes "
         "the result to its parent) leaves the sum at the root; a broadcast down the same tree copies it to every "
         "rank; both go piece by piece, so that the levels of the tree work at once",
    formula=_TREE_FORMULA))
def tree_all_reduce(fn):
    """`fn(tensor, group, op, segments)` on every rank of `group`: `tensor` itself, holding the sum (or mean)."""

    cases = _tree_cases(fresh_rng())
    per_rank = _on_ranks(functools.partial(_run_all_reduce, verdict=_tree_verdict), fn, cases, "tree all-reduce",
                              _TREE_HINTS["neighbours"])
    values = functools.partial(_tree_verdict, sent=lambda *args: None)  # every rank's values before anyone's messages
    for i, case in enumerate(cases[:len(per_rank[0])]):  # the ranks stop after the first wrong case
        for verdict in (values, _tree_verdict):
            for rank in range(case["n"]):
                verdict(case, rank, per_rank[rank][i])
