"""Chapter 4's exercise checks (llmlab.checks.ch04): each passes a right answer, reports an unwritten one as
not attempted (for the ring, a NotImplementedError raised on the ranks), and fails a plausible wrong answer with a
message naming the mistake — an off-by-one chunk index, a missing step or phase, a missing division, whole tensors
sent where a chunk is, a copy where the work is in place; for the tree, a missing broadcast, a share overwritten by
a child's sum, the whole tensor where segments are, a ring's neighbours; for accumulation under data parallelism
(4.3), every micro-batch synchronised (by its bytes), no 1/k, stale gradients, the last backward under no_sync too
(the ranks diverge), a division by N, a step per micro-batch, gradients left behind, the wrong loss returned; for the
α-β times (4.4), a phase, a step or a chunk miscounted, a depth not rounded up, segments that do not pipeline, the
crossover's algebra, a choice by the wrong rule — and the hint.

The ring answers below are written the way a learner would, with `exchange` (send right and receive left
together), and run on the checks' own 5 gloo ranks, which the module fixture stops at the end.
"""


import contextlib
import math
import os
from functools import partial

import pytest
import torch
import torch.distributed as td
from check_answers import Mistake, Reference
from grading import fails, not_attempted, passes

from llmlab import checks
from llmlab.checks import ch04
from llmlab.dist import cost
from llmlab.dist.commlog import exchange


@pytest.fixture(scope="module", autouse=True)
def ranks():
    yield
    ch04.close()


def unwritten(*args):
    raise NotImplementedError("Exercise 4.x")


# --- 4.1 ----------------------------------------------------------------------------------------------------

def reduce_scatter(tensor, group=None, shift=0, add_own=True, received_shift=0):
    """The ring reduce-scatter; `shift` moves every chunk index (an off-by-one), `received_shift` only the chunk
    received and added (a learner's off-by-one of issue 27), `add_own=False` forgets to add this rank's share to
    what it receives."""
    rank, n = td.get_rank(group), td.get_world_size(group)
    chunks = tensor.reshape(-1).tensor_split(n)
    right, left = (rank + 1) % n, (rank - 1) % n
    running = chunks[(rank - 1 + shift) % n].clone()
    for step in range(n - 1):
        c = (rank - step - 2 + shift + received_shift) % n
        incoming = torch.empty_like(chunks[c])
        exchange(sends=[(running, right)], recvs=[(incoming, left)], group=group)
        running = incoming + chunks[c] if add_own else incoming
    return running


def in_place(tensor, group=None):
    """Right sums, but added into the caller's tensor."""
    rank, n = td.get_rank(group), td.get_world_size(group)
    chunks = tensor.reshape(-1).tensor_split(n)
    for step in range(n - 1):
        c = (rank - step - 2) % n
        incoming = torch.empty_like(chunks[c])
        exchange(sends=[(chunks[(c + 1) % n], (rank + 1) % n)], recvs=[(incoming, (rank - 1) % n)], group=group)
        chunks[c].add_(incoming)
    return chunks[rank].clone()


def test_a_deadlock_and_an_error_on_the_ranks_fail_with_a_message(capsys, monkeypatch):
    def receive_only(tensor, group=None):  # every rank waits for a message nobody sends
        n = td.get_world_size(group)
        exchange(recvs=[(torch.empty(1), (td.get_rank(group) - 1) % n)], group=group)

    monkeypatch.setattr(ch04, "TIMEOUT_S", 3.0)
    fails(ch04.ring_reduce_scatter, receive_only, match="did not finish within 3 s", hint="exchange")
    fails(ch04.ring_reduce_scatter, lambda t, g=None: t.no_such_method(),
          match="on rank 0, your function raised AttributeError: .*no_such_method.*world size 2",
          hint="rank r should end with chunk r")
    passes(ch04.ring_reduce_scatter, reduce_scatter, capsys=capsys)  # the ranks were restarted


# --- 4.2 ----------------------------------------------------------------------------------------------------

def all_gather(chunk, sizes, group=None, shift=0):
    rank, n = td.get_rank(group), td.get_world_size(group)
    out = torch.empty(sum(sizes), dtype=chunk.dtype)
    parts = out.split(sizes)
    parts[rank].copy_(chunk)
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        exchange(sends=[(parts[(rank - step + shift) % n], right)], recvs=[(parts[(rank - step - 1) % n], left)],
                 group=group)
    return out


def test_an_off_by_one_all_gather_is_named_without_restarting_the_ranks():
    """The ranks stop after the first wrong case (equal chunks, tagged), before a case of unequal chunks makes gloo
    abort a rank that receives more bytes than it posted: the same processes answer the next call (a restart of
    the 5 ranks costs seconds, which made this mistake 300× slower than the others to check)."""
    ranks = checks.cluster(max(ch04.WORLD_SIZES))
    pids = ranks.run(os.getpid)
    fails(ch04.ring_all_gather, lambda c, s, g=None: all_gather(c, s, g, shift=-1),
          match=r"chunk \d of rank \d's output", hint="send chunk (r−s) mod N")
    assert ranks.run(os.getpid) == pids


def test_a_wrong_answer_holding_nan_or_inf_is_diagnosed():
    """A buffer never received into (torch.empty) can hold NaN or inf: the diagnosis names it instead of raising
    "cannot convert float NaN to integer" (it did, for an off-by-one all-gather, in 3 calls of 150)."""
    case = {"n": 2, "sizes": [3, 3], "tagged": True, "seed": 0}
    got = torch.cat([ch04._ag_input(case, 0), torch.tensor([float("nan"), float("inf"), 1.0])])
    text, mistake = ch04._ag_diagnosis(got, case, 0)
    assert "it holds values that are no rank's chunk: an empty buffer" in text and mistake == "chunk index"
    assert ch04._untag(float("nan"), 2) is None and ch04._untag(float("inf"), 2) is None


# --- 4.3 ----------------------------------------------------------------------------------------------------

def accumulate_step(model, loss_fn, batches, optimizer, sync="last", divide=None, zero_first=True, zero_after=True,
                    step_each=False, returns="mean"):
    """One update of a DataParallel model on k micro-batches; the options make a learner's mistakes: `sync="every"`
    (no no_sync), `"forward"` (no_sync around the forward only), `"never"` (the last backward under no_sync too),
    `divide` (the loss divided by k by default), `zero_first`/`zero_after`, `step_each` (step inside the loop),
    `returns="sum"` or `None`."""
    k = len(batches)
    if zero_first:
        optimizer.zero_grad()
    losses = []
    for i, batch in enumerate(batches):
        quiet = sync == "never" or (sync == "last" and i < k - 1)
        with model.no_sync() if quiet or sync == "forward" else contextlib.nullcontext():
            loss = loss_fn(model, batch)
        with model.no_sync() if quiet else contextlib.nullcontext():
            (loss / (k if divide is None else divide)).backward()
        losses.append(loss.item())
        if step_each:
            optimizer.step()
    if not step_each:
        optimizer.step()
    if zero_after:
        optimizer.zero_grad()
    return {"mean": sum(losses) / k, "sum": sum(losses), None: None}[returns]


def mean_over_ranks(model, loss_fn, batches, optimizer, group=True):
    """Right weights, but the loss returned is averaged over the ranks: an all-reduce of its own, on the model's
    group (`group=False`: on the default group, which the ranks outside the model's do not call)."""
    loss = torch.tensor(accumulate_step(model, loss_fn, batches, optimizer), dtype=torch.float64)
    td.all_reduce(loss, group=model.group if group else None)
    return loss.item() / td.get_world_size(model.group if group else None)


def enumerated_step(model, loss_fn, batches, optimizer):
    """Another right answer: model.zero_grad() keeping zero tensors, the last micro-batch told by its index, the
    losses divided by k before they are added up."""
    model.zero_grad(set_to_none=False)
    total = 0.0
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss = loss_fn(model, batch) / len(batches)
            loss.backward()
        total += loss.item()
    optimizer.step()
    model.zero_grad(set_to_none=False)
    return total


def test_a_collective_on_another_group_than_the_models_fails_with_a_message(capsys, monkeypatch):
    """The ranks outside a case's group run the next cases meanwhile: a collective on the default group meets
    theirs (gloo stops a rank on a message of the wrong size) or waits for ever (stopped after TIMEOUT_S)."""
    monkeypatch.setattr(ch04, "TIMEOUT_S", 3.0)
    fails(ch04.accumulate_step, partial(mean_over_ranks, group=False), match="the ranks' collectives did not match",
          hint="call no torch.distributed function yourself")
    monkeypatch.undo()  # new ranks build their groups first: more than 3 s on a busy machine
    passes(ch04.accumulate_step, accumulate_step, capsys=capsys)


# --- 4.4 ----------------------------------------------------------------------------------------------------

def ring_time(nbytes, n, alpha, beta):
    return 2 * (n - 1) * (alpha + nbytes / n * beta)


def tree_time(nbytes, n, alpha, beta, pipelined=True, depth=lambda n: math.ceil(math.log2(n)), one_rank=True,
              phases=2):
    """The tree's time; `depth` a reading of its levels, `one_rank=False` forgets that one rank sends nothing,
    `phases=1` forgets the broadcast."""
    if n == 1 and one_rank:
        return 0.0
    levels = depth(n) if n > 1 else 0
    return phases * (levels * alpha + nbytes * beta if pipelined else levels * (alpha + nbytes * beta))


def crossover(n, alpha, beta, pipelined=True, depth=lambda n: math.ceil(math.log2(n)), with_n=True):
    """The size where ring and tree cross; `depth` a reading of the tree's levels, `with_n=False` drops the N of the
    pipelined tree's bytes gap."""
    levels = depth(n) if n > 1 else 0
    if n - 1 - levels <= 0:
        return 0.0
    gap = (1 / n if with_n else 1.0) if pipelined else levels - (n - 1) / n
    return (n - 1 - levels) * alpha / (gap * beta)


def choose(nbytes, n, alpha, beta, pipelined=True, pick=min, seconds_of="chosen", tree_pipelined=None):
    """The faster of ring and tree by `pick` over their times; `seconds_of="other"` returns the other's time,
    `tree_pipelined` prices that tree whatever `pipelined` says."""
    times = {"ring": ring_time(nbytes, n, alpha, beta),
             "tree": tree_time(nbytes, n, alpha, beta, pipelined if tree_pipelined is None else tree_pipelined)}
    name = pick(times, key=times.get)
    return name, times[name] if seconds_of == "chosen" else times["tree" if name == "ring" else "ring"]


def fewer_messages(nbytes, n, alpha, beta, pipelined=True):
    name = "tree" if math.ceil(math.log2(max(n, 1))) < n - 1 else "ring"
    return name, ring_time(nbytes, n, alpha, beta) if name == "ring" else tree_time(nbytes, n, alpha, beta, pipelined)


def cost_choose(nbytes, n, alpha, beta, pipelined=True):
    """llmlab's own times, the faster of them."""
    times = {"ring": cost.ring_allreduce_time(nbytes, n, alpha, beta),
             "tree": cost.tree_allreduce_time(nbytes, n, alpha, beta, pipelined)}
    return min(times.items(), key=lambda item: item[1])


def times(ring=ring_time, tree=tree_time, cross=crossover, pick=choose):
    """4.4's four answers, the right ones unless one is given."""
    return ring, tree, cross, pick


# --- 4.5 ----------------------------------------------------------------------------------------------------

def all_reduce(tensor, group=None, op="sum", received_shift=0, gather=True, divide=True, copy=False):
    """The ring all-reduce, in place; `received_shift` moves the chunk received and added in the reduce-scatter (an
    off-by-one), `gather=False` stops after the reduce-scatter, `divide=False` forgets avg's division, `copy` works
    on tensor.reshape(-1).clone() and returns that copy, reshaped."""
    rank, n = td.get_rank(group), td.get_world_size(group)
    right, left = (rank + 1) % n, (rank - 1) % n
    flat = tensor.reshape(-1).clone() if copy else tensor.contiguous().view(-1)  # (S,)
    chunks = flat.tensor_split(n)
    for step in range(n - 1):
        c = (rank - step - 2 + received_shift) % n
        incoming = torch.empty_like(chunks[c])
        exchange(sends=[(chunks[(rank - step - 1) % n], right)], recvs=[(incoming, left)], group=group)
        chunks[c].add_(incoming)
    if op == "avg" and divide:
        chunks[rank].div_(n)
    for step in range(n - 1 if gather else 0):
        exchange(sends=[(chunks[(rank - step) % n], right)], recvs=[(chunks[(rank - step - 1) % n], left)],
                 group=group)
    if copy:
        return flat.view(tensor.shape)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view(tensor.shape))
    return tensor


def whole_tensors(tensor, group=None, op="sum"):
    """Right sums, by passing every rank's whole tensor round the ring: N−1 messages of S elements."""
    rank, n = td.get_rank(group), td.get_world_size(group)
    passing, total = tensor.clone(), tensor.clone()
    for _ in range(n - 1):
        incoming = torch.empty_like(passing)
        exchange(sends=[(passing, (rank + 1) % n)], recvs=[(incoming, (rank - 1) % n)], group=group)
        total += incoming
        passing = incoming
    return tensor.copy_(total / n if op == "avg" else total)


def flat_reshaped(tensor, group=None, op="sum"):
    """Right for a contiguous tensor; of a transposed one, reshape(-1) is a copy, and the sums stay in it."""
    flat = tensor.reshape(-1)
    all_reduce(flat, group, op)
    return tensor


# --- 4.6 ----------------------------------------------------------------------------------------------------

def tree_all_reduce(tensor, group=None, op="sum", segments=1, broadcast=True, keep_own=True, segmented=True,
                    copy=False):
    """The tree all-reduce in place; `broadcast=False` stops after the reduce, `keep_own=False` receives each child's
    sum straight into the piece (over the rank's own share), `segmented=False` sends the whole tensor at once,
    `copy` returns a reshaped copy."""
    rank, n = td.get_rank(group), td.get_world_size(group)
    parent = (rank - 1) // 2 if rank else None
    children = [c for c in (2 * rank + 1, 2 * rank + 2) if c < n]
    flat = tensor.reshape(-1).clone() if copy else tensor.contiguous().view(-1)  # (S,)
    pieces = flat.tensor_split(segments if segmented else 1)
    for piece in pieces:
        for child in children:
            incoming = torch.empty_like(piece) if keep_own else piece
            exchange(recvs=[(incoming, child)], group=group)
            if keep_own:
                piece.add_(incoming)
        if parent is not None:
            exchange(sends=[(piece, parent)], group=group)
    if op == "avg" and parent is None:
        flat.div_(n)
    for piece in pieces if broadcast else ():
        if parent is not None:
            exchange(recvs=[(piece, parent)], group=group)
        exchange(sends=[(piece, c) for c in children], group=group)
    if copy:
        return flat.view(tensor.shape)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view(tensor.shape))
    return tensor


# --- the tables: tests/test_checks_answers.py runs each once, tools/flake.py N times ------------------------------

ANSWERS = [
    Reference(ch04.ring_reduce_scatter, reduce_scatter),
    Mistake(ch04.ring_reduce_scatter, lambda t, g=None: reduce_scatter(t, g, shift=1),
            match=r"rank \d ended with \(part of\) chunk \d, not chunk \d: the chunk index is off by 1\. Hint 1 of 3: "
                  "look at the index of the chunk you receive", hint="rank r should end with chunk r"),
    Mistake(ch04.ring_reduce_scatter, lambda t, g=None: reduce_scatter(t, g, received_shift=1),
            match=r"not sums of distinct ranks' shares of one chunk.* Hint 1 of 3: look at the index of the chunk you "
                  "receive", hint="receives chunk (r−s−2) mod N"),
    Mistake(ch04.ring_reduce_scatter, lambda t, g=None: reduce_scatter(t, g, add_own=False),
            match=r"holds the shares of ranks .* only", hint="adds its own share"),
    Mistake(ch04.ring_reduce_scatter, in_place, match="the input tensor was changed", hint="leave the input"),

    Reference(ch04.ring_all_gather, all_gather),
    Mistake(ch04.ring_all_gather, lambda c, s, g=None: all_gather(c, s, g, shift=-1),
            match=r"(chunk \d of rank \d's output .* is wrong|a message of \d+ bytes arrived where it expected).* "
                  "Hint 1 of 3: look at the chunk each rank sends at step s", hint="send chunk (r−s) mod N"),
    Mistake(ch04.ring_all_gather, lambda c, s, g=None: torch.cat([c] * td.get_world_size(g)),
            match=r"got shape|is wrong", hint="use sizes"),

    Reference(ch04.accumulate_step, accumulate_step),
    Reference(ch04.accumulate_step, enumerated_step),
    Mistake(ch04.accumulate_step, partial(accumulate_step, sync="every"),
            match=r"the weights are right, but the update sent \d+ bytes, \d× the \d+ of one synchronisation",
            hint="outside model.no_sync()"),
    Mistake(ch04.accumulate_step, partial(accumulate_step, sync="forward"),
            match=r"\d× the \d+ of one synchronisation .*the backward, not only the forward", hint="only the last"),
    Mistake(ch04.accumulate_step, partial(accumulate_step, sync="never"),
            match="this rank's own micro-batches alone: .*the ranks now hold different models",
            hint="one model"),
    Mistake(ch04.accumulate_step, partial(accumulate_step, divide=1),
            match="k× as far as one step on the large batch: .*divide each micro-batch's loss by k",
            hint="weighted 1/k"),
    Mistake(ch04.accumulate_step, partial(accumulate_step, zero_first=False),
            match="plus the stale gradients the model held before", hint="before the first micro-batch"),
    Mistake(ch04.accumulate_step, partial(accumulate_step, step_each=True),
            match=r"the optimizer stepped (\d) times in one update: once per micro-batch, inside the loop",
            hint="one update, one step"),
    Mistake(ch04.accumulate_step, lambda m, f, b, o: accumulate_step(m, f, b, o, divide=len(b) * m.world_size),
            match="1/N as far .*DataParallel already averages", hint="k micro-batches only"),
    Mistake(ch04.accumulate_step, partial(accumulate_step, zero_after=False),
            match="its gradients are still in .grad: zero them after the step", hint="as the material's loop does"),
    Mistake(ch04.accumulate_step, mean_over_ranks,
            match=r"sent \d+ bytes, where one synchronisation of the gradients sends \d+: .*nothing else",
            hint="only the last backward"),
    Mistake(ch04.accumulate_step, partial(accumulate_step, returns="sum"),
            match=r"that is the sum of the \d losses, not their mean", hint="return their mean"),
    Mistake(ch04.accumulate_step, partial(accumulate_step, returns=None),
            match="returned NoneType, expected a float", hint="the mean loss"),

    Reference(ch04.choose_allreduce, *times()),
    Reference(ch04.choose_allreduce, cost.ring_allreduce_time, cost.tree_allreduce_time, cost.crossover_bytes,
              cost_choose),
    Mistake(ch04.choose_allreduce, *times(ring=cost.reduce_scatter_time), match="the reduce-scatter alone",
            hint="2(N−1)"),
    Mistake(ch04.choose_allreduce, *times(ring=lambda s, n, a, b: 2 * (n - 1) * (a + s * b)),
            match="S/N bytes, not all S", hint="2(N−1)"),
    Mistake(ch04.choose_allreduce, *times(ring=lambda s, n, a, b: 2 * n * (a + s / n * b)),
            match="N−1 steps per phase, not N", hint="N−1"),
    Mistake(ch04.choose_allreduce, *times(ring=lambda s, n, a, b: 2 * (n - 1) * a + 2 * s * b),
            match="each phase sends N−1 chunks of S/N bytes, not N", hint="2(N−1)/N·S·β"),
    Mistake(ch04.choose_allreduce, *times(ring=lambda s, n, a, b: "fast"), match="got str 'fast', expected a number",
            hint="2(N−1)"),
    Mistake(ch04.choose_allreduce, *times(tree=partial(tree_time, phases=1)),
            match="reduce up the tree alone; the broadcast back down is missing", hint="broadcast"),
    Mistake(ch04.choose_allreduce, *times(tree=partial(tree_time, depth=math.log2)),
            match=r"tree_allreduce_time\(nbytes=100000, n=5.*log₂N not rounded: the tree has ⌈log₂5⌉ = 3 levels",
            hint="rounded up"),
    Mistake(ch04.choose_allreduce, *times(tree=partial(tree_time, depth=lambda n: int(math.log2(n)))),
            match="log₂N rounded down: the tree has ⌈log₂5⌉ = 3 levels", hint="rounded up"),
    Mistake(ch04.choose_allreduce, *times(tree=lambda s, n, a, b, pipelined=True: tree_time(s, n, a, b, False)),
            match=r"pipelined=True\).*that is the unsegmented tree", hint="in flight on every level at once"),
    Mistake(ch04.choose_allreduce, *times(tree=lambda s, n, a, b, pipelined=True: tree_time(s, n, a, b)),
            match=r"pipelined=False\).*that is the pipelined tree", hint="every one of the 2·d hops pays α + S·β"),
    Mistake(ch04.choose_allreduce, *times(tree=partial(tree_time, one_rank=False)),
            match=r"n=1, .* one rank sends nothing: 0 s", hint="no edge"),
    Mistake(ch04.choose_allreduce, *times(cross=partial(crossover, with_n=False)),
            match=r"crossover_bytes\(n=8, .*the factor N = 8 is missing", hint="a factor N"),
    Mistake(ch04.choose_allreduce, *times(cross=lambda n, a, b, pipelined=True: crossover(n, b, a, pipelined)),
            match="β/α is not a size", hint="α/β is bytes"),
    Mistake(ch04.choose_allreduce, *times(cross=lambda n, a, b, pipelined=True: crossover(n, a, b)),
            match=r"pipelined=False\).*that is the pipelined tree's crossover", hint="d − (N−1)/N"),
    Mistake(ch04.choose_allreduce, *times(cross=partial(crossover, depth=math.log2)),
            match="log₂N not rounded: the tree has ⌈log₂5⌉ = 3 levels", hint="whole levels"),
    Mistake(ch04.choose_allreduce, *times(pick=partial(choose, pick=max)),
            match="every choice you made is the slower algorithm", hint="smaller time"),
    Mistake(ch04.choose_allreduce, *times(pick=fewer_messages),
            match=r"the ring is faster here: .* every choice you made is the algorithm with fewer messages",
            hint="Compare the whole times"),
    Mistake(ch04.choose_allreduce, *times(pick=lambda s, n, a, b, pipelined=True: ("ring", ring_time(s, n, a, b))),
            match=r"the tree is faster here: .*every choice you made is the ring", hint="for small buffers"),
    Mistake(ch04.choose_allreduce, *times(pick=partial(choose, tree_pipelined=True)),
            match="compares the ring with the pipelined tree; pipelined=False asks for the unsegmented one",
            hint="pass pipelined on"),
    Mistake(ch04.choose_allreduce, *times(pick=partial(choose, seconds_of="other")),
            match="that is the other algorithm's time", hint="the time of the algorithm you chose"),
    Mistake(ch04.choose_allreduce, *times(pick=lambda s, n, a, b, pipelined=True: choose(s, n, a, b, pipelined)[0]),
            match=r"returned '(ring|tree)'; expected a pair \(name, seconds\)", hint="the name of the smaller time"),
    Mistake(ch04.choose_allreduce, *times(pick=lambda s, n, a, b, pipelined=True: choose(s, n, a, b, pipelined)[::-1]),
            match="returned the name .*; expected 'ring' or 'tree'", hint="the name of the smaller time"),

    Reference(ch04.ring_all_reduce, all_reduce),
    Mistake(ch04.ring_all_reduce, lambda t, g=None, op="sum": all_reduce(t, g, op, gather=False),
            match=r"that is the reduce-scatter alone; the all-gather.* is missing\. Hint 1 of 3: look at the chunks "
                  "other than", hint="all-gather: at step s send chunk (r−s) mod N"),
    Mistake(ch04.ring_all_reduce, whole_tensors,
            match=r"sent a message of \d+ elements, where a ring step sends one chunk.* Hint 1 of 3: look at the size",
            hint="2(N−1)/N·S"),
    Mistake(ch04.ring_all_reduce, lambda t, g=None, op="sum": all_reduce(t, g, op, copy=True),
            match="is a new tensor, not the one your function was given", hint="works in place"),
    Mistake(ch04.ring_all_reduce, flat_reshaped,
            match=r"transposed .* your tensor still holds its own input: .*reshape and contiguous\(\) copy it",
            hint="copy it back"),
    Mistake(ch04.ring_all_reduce, lambda t, g=None, op="sum": all_reduce(t, g, op, divide=False),
            match=r"op='avg'.* is the sum over ranks, not the average: op='avg' divides it by N",
            hint="divide the finished sum by N once"),
    Mistake(ch04.ring_all_reduce, lambda t, g=None, op="sum": all_reduce(t, g, op, received_shift=1),
            match=r"(chunk \d of it holds|chunk \d holds .* although every step sent a chunk|a message of \d+ bytes "
                  r"arrived where it expected).* Hint 1 of 3: look at the chunk indices", hint="receives chunk r−s−2"),
    Mistake(ch04.ring_all_reduce, lambda t, g=None, op="sum": None,
            match="your function returned NoneType, expected the tensor it was given", hint="return tensor"),

    Reference(ch04.tree_all_reduce, tree_all_reduce),
    Mistake(ch04.tree_all_reduce, partial(tree_all_reduce, broadcast=False),
            match=r"rank 1's result holds the sum over its subtree \(ranks 1(, 3)?\) only: .* the broadcast "
                  "from the root is missing", hint="copies the root's result down the same tree"),
    Mistake(ch04.tree_all_reduce, partial(tree_all_reduce, keep_own=False),
            match=r"rank 0's result: element 0 misses the shares of ranks 0(, 1)?, each a rank with children",
            hint="receive each child's partial sum into a new buffer"),
    Mistake(ch04.tree_all_reduce, partial(tree_all_reduce, segmented=False),
            match=r"segments=\d.* is right, but rank \d sent \d messages, not \d+: .*the whole tensor went in one "
                  "message",
            hint="one message each"),
    Mistake(ch04.tree_all_reduce, lambda t, g=None, op="sum", segments=1: all_reduce(t, g, op),
            match=r"is right, but rank \d (exchanged messages with rank \d: in the tree its neighbours are|sent \d "
                  r"messages, not \d)", hint="(r−1)//2"),
    Mistake(ch04.tree_all_reduce, partial(tree_all_reduce, copy=True),
            match="is a new tensor, not the one your function was given", hint="works in place"),
    Mistake(ch04.tree_all_reduce, lambda t, g=None, op="sum", segments=1: tree_all_reduce(t, g, "sum", segments),
            match=r"op='avg'.* is the sum over ranks, not the average", hint="at the root, after the reduce"),
]


@pytest.mark.parametrize("check", [ch04.ring_reduce_scatter, ch04.ring_all_gather, ch04.accumulate_step,
                                   ch04.choose_allreduce, ch04.ring_all_reduce, ch04.tree_all_reduce])
def test_an_unwritten_answer_is_not_attempted(check, capsys):
    not_attempted(check, unwritten, capsys=capsys)
