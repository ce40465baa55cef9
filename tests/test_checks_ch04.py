"""Chapter 4's exercise checks (llmlab.checks.ch04): each passes a right answer, reports an unwritten one as
not attempted (for the ring, a NotImplementedError raised on the ranks), and fails a plausible wrong answer with a
message naming the mistake — an off-by-one chunk index, a missing step, a missing division — and the hint.

The ring answers below are written the way a learner would, with `exchange` (send right and receive left
together), and run on the checks' own 5 gloo ranks, which the module fixture stops at the end.
"""


import os

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

def accumulate(model, loss_fn, batches):
    model.zero_grad()
    for batch in batches:
        (loss_fn(model, batch) / len(batches)).backward()


def snippet(model, loss_fn, batches):  # the material's loop: no division
    model.zero_grad()
    for batch in batches:
        loss_fn(model, batch).backward()


def no_zeroing(model, loss_fn, batches):
    for batch in batches:
        (loss_fn(model, batch) / len(batches)).backward()


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

    Reference(ch04.accumulate, accumulate),
    Mistake(ch04.accumulate, snippet, match=r"is \d× the large-batch gradient: .* divided by k", hint="/ k"),
    Mistake(ch04.accumulate, no_zeroing, match="gradient of an earlier backward", hint="zero the gradients"),

    Reference(ch04.ring_time, cost.ring_allreduce_time),
    Mistake(ch04.ring_time, cost.reduce_scatter_time, match="the reduce-scatter alone", hint="2(N−1)"),
    Mistake(ch04.ring_time, lambda s, n, a, b: 2 * (n - 1) * (a + s * b), match="S/N bytes, not all S",
            hint="2(N−1)"),
    Mistake(ch04.ring_time, lambda s, n, a, b: "fast", match="expected a number", hint="2(N−1)"),
]


@pytest.mark.parametrize("check", [ch04.ring_reduce_scatter, ch04.ring_all_gather, ch04.accumulate, ch04.ring_time])
def test_an_unwritten_answer_is_not_attempted(check, capsys):
    not_attempted(check, unwritten, capsys=capsys)
