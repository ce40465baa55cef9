"""Check 7.3 (re-exported by llmlab.checks.ch07): find a hang from the per-rank stacks.

    from llmlab.checks import ch07 as check
    print(check.example_hang())    # a message like those the check asks about
    check.find_hang(find_hang)     # 7.3

The learner's `find_hang(message) -> (waiting, culprits)` reads the text of the `TimeoutError` that
`llmlab.dist.spawn`/`Cluster.run` raise when ranks hang (its first line names the ranks that had not finished, then
one `--- rank r ---` section of Python stacks per rank still running) and returns `waiting`, {rank: the collective
it waits in}, and `culprits`, the sorted ranks in no collective: those that returned (named finished, or without a
section) and those elsewhere in the program. The answer is `llmlab.diagnose.hang.diagnose_hang` on the same text.

The messages are written as the launcher writes them, with the stacks faulthandler dumps (checked against a real
hang on gloo ranks in tests/test_checks_ch07.py): every section has the launcher's watcher thread first, then the
thread running the function, innermost frame first, down to the worker's `main`. Every run draws new world sizes
(2–8), ranks, line numbers and paths, in the cases a hang comes in: ranks that returned under `dist.spawn` (no
section) or a `Cluster` (an idle stack); ranks elsewhere — in a data loader (torch, but not torch.distributed), a
model's forward, a queue, or asleep in the function itself; ranks waiting in torch's collectives (behind the
`wrapper` of c10d_logger), in `all_gather_object` (which waits inside `all_gather`) or in llmlab's
`ring_all_reduce` (which waits in commlog's `wait`); all ranks stuck in one collective, ranks in different
collectives, and one collective called from different lines.
"""

from __future__ import annotations

import random
import sysconfig

from llmlab.checks import Hint, Mismatch, check, fresh_rng
from llmlab.diagnose.hang import _function_frames, _is_comm, diagnose_hang

__all__ = ["find_hang", "example_hang", "last_hang", "HELPERS"]

# the helpers a communication stack passes through, never the collective called (hang's list, for the learner)
HELPERS = ("wrapper", "counted", "wait", "exchange", "post", "scope")

_STDLIB = sysconfig.get_paths()["stdlib"]
_SITE = "/opt/venv/lib/python3.11/site-packages"
_C10D, _LOGGER = f"{_SITE}/torch/distributed/distributed_c10d.py", f"{_SITE}/torch/distributed/c10d_logger.py"
_LLMLAB = "/work/course/llmlab"
# Each collective as a rank waiting in it shows it, innermost frame first: (file, line, function)
_COLLECTIVES = {
    "all_reduce": [(_C10D, 3252, "all_reduce"), (_LOGGER, 83, "wrapper")],
    "broadcast": [(_C10D, 2890, "broadcast"), (_LOGGER, 83, "wrapper")],
    "barrier": [(_C10D, 4697, "barrier"), (_LOGGER, 83, "wrapper")],
    "reduce_scatter_tensor": [(_C10D, 4407, "reduce_scatter_tensor"), (_LOGGER, 83, "wrapper")],
    "all_gather_into_tensor": [(_C10D, 3922, "all_gather_into_tensor"), (_LOGGER, 83, "wrapper")],
    "all_gather_object": [(_C10D, 3711, "all_gather"), (_LOGGER, 83, "wrapper"), (_C10D, 3087, "all_gather_object"),
                          (_LOGGER, 83, "wrapper")],
    "ring_all_reduce": [(f"{_LLMLAB}/dist/commlog.py", 119, "wait"),
                        (f"{_LLMLAB}/dist/collectives.py", 186, "_ring_step"),
                        (f"{_LLMLAB}/dist/collectives.py", 209, "_ring_reduce_scatter_flat"),
                        (f"{_LLMLAB}/dist/collectives.py", 276, "ring_all_reduce")],
}
# Where a rank that is in no collective can be, innermost frame first, above the program's own frame
_ELSEWHERE = {
    "data loader": [(f"{_SITE}/torch/utils/data/dataloader.py", 1328, "_next_data"),
                    (f"{_SITE}/torch/utils/data/dataloader.py", 733, "__next__")],
    "forward": [(f"{_SITE}/torch/nn/modules/linear.py", 125, "forward"),
                (f"{_SITE}/torch/nn/modules/module.py", 1762, "_call_impl"),
                (f"{_SITE}/torch/nn/modules/module.py", 1751, "_wrapped_call_impl")],
    "queue": [(f"{_STDLIB}/threading.py", 327, "wait"), (f"{_STDLIB}/queue.py", 171, "get")],
    "asleep": [],  # time.sleep is C code: the function's own line is the innermost frame
}
_WORKER = f"{_LLMLAB}/dist/_worker.py"
_WATCHER = [(_WORKER, 42, "watch"), (f"{_STDLIB}/threading.py", 982, "run"),
            (f"{_STDLIB}/threading.py", 1045, "_bootstrap_inner"), (f"{_STDLIB}/threading.py", 1002, "_bootstrap")]
_IDLE = [(f"{_STDLIB}/multiprocessing/connection.py", 395, "_recv"),
         (f"{_STDLIB}/multiprocessing/connection.py", 430, "_recv_bytes"),
         (f"{_STDLIB}/multiprocessing/connection.py", 250, "recv")]  # a Cluster's rank between runs

_HINTS = {
    "thread": Hint(
        nudge="look at which thread of a rank's section you read",
        idea="each section lists several threads; the launcher's watcher thread comes first and is never in a "
             "collective: the one that matters runs the function, down to _worker.py's main",
        formula='thread = the block of the section that holds a frame `File ".../_worker.py", line N in main`; read '
                "its frames from the top (innermost) down"),
    "call name": Hint(
        nudge="look at which frame you take the collective's name from",
        idea="the communication frames at the top of the stack are the collective and the helpers it passes "
             "through (a decorator's wrapper, commlog's wait, private _functions), innermost first; the collective "
             "the program called is the outermost of them that is no helper",
        formula="comm = the frames from the top while the file is communication code; call = the last function in "
                "comm that is not in check.HELPERS and does not start with '_'"),
    "comm frames": Hint(
        nudge="look at how you decide that a frame is communication code",
        idea="a rank waits in a collective when its innermost frames are in torch.distributed or in llmlab's "
             "commlog.py or collectives.py; torch's data loader or a module's forward is torch, but no collective",
        formula="is_comm(file) = '/torch/distributed/' in file or file.endswith(('llmlab/dist/commlog.py', "
                "'llmlab/dist/collectives.py')); a rank waits when is_comm holds for its innermost frame"),
    "returned": Hint(
        nudge="look at the message's first line: which ranks does it say had not finished?",
        idea="a rank that returned from the function is not in that list, and under dist.spawn its process has "
             "exited, so it has no section: it is a culprit all the same — it never called the collective",
        formula="unfinished = the ranks in 'ranks 0, 2 of 3 had not finished'; every rank of range(world_size) "
                "not in it is a culprit"),
    "elsewhere": Hint(
        nudge="look at the ranks whose innermost frame is not communication code",
        idea="a rank still running but in no collective is where the others wait for: a culprit, wherever in the "
             "program it is",
        formula="for an unfinished rank whose innermost frame is not communication code: culprits.append(rank)"),
}


@check("7.3", "find a hang", hint=Hint(
    nudge="print the message the check names and read it rank by rank, as the check's message says",
    idea="the first line says which ranks had not finished; each section's thread that runs the function shows, "
         "from the top, where the rank is: in communication code (then waiting, in the outermost collective that is "
         "no helper) or elsewhere",
    formula="waiting = {rank: collective} for the unfinished ranks whose innermost frame is communication code; "
            "culprits = sorted(every other rank)"))
def find_hang(fn):
    """`fn(message) -> (waiting, culprits)`: see the module docstring."""
    rng = fresh_rng()
    for case in _cases(rng):
        _last[0] = _message(rng, *case)
        _judge(fn, _last[0])
    _last[0] = None


_last: list[str | None] = [None]  # the message of the case being judged (a failed one stays)


def last_hang() -> str | None:
    """The message of the case the last find_hang check failed on (None after a pass): print it to see it."""
    return _last[0]


def example_hang(seed: int | None = None) -> str:
    """A hang message like those the check gives `find_hang` (`seed`: the same one every time)."""
    rng = random.Random(seed)
    return _message(rng, *_cases(rng)[1])


def _cases(rng) -> list[tuple]:
    """(world size, style, {rank: place}) of each case, a place being ("waits", collective, line),
    ("elsewhere", kind, line) or ("returned",): every kind of rank, collective and message at least once."""
    torch_collectives = [c for c, frames in _COLLECTIVES.items() if "torch" in frames[0][0]]
    cases = []  # in this order: torch's collectives first, llmlab's after, so a misread thread shows first
    for style, others in (("spawn", "returned"), ("cluster", "returned"), ("cluster", "elsewhere")):
        n = rng.randint(2, 8)
        late = rng.sample(range(n), rng.randint(1, n - 1))
        collective, line = rng.choice(torch_collectives), rng.randint(10, 400)
        kinds = rng.sample(list(_ELSEWHERE), len(_ELSEWHERE))  # every kind, over the case's late ranks and the next
        places = {r: ("waits", collective, line) for r in range(n)}
        for i, r in enumerate(late):
            places[r] = ("returned",) if others == "returned" else ("elsewhere", kinds[i % len(kinds)], line - 3)
        cases.append((n, style, places))
    for collective in _COLLECTIVES:  # each collective, stuck on every rank or on all but one, elsewhere
        n, line = rng.randint(2, 8), rng.randint(10, 400)
        places = {r: ("waits", collective, line) for r in range(n)}
        if rng.random() < 0.5:
            places[rng.randrange(n)] = ("elsewhere", rng.choice(list(_ELSEWHERE)), line + 2)
        cases.append((n, rng.choice(("spawn", "cluster")), places))
    n = rng.randint(3, 8)  # different collectives, and one collective from different lines (out of step)
    first, second = rng.sample(list(_COLLECTIVES), 2)
    cases.append((n, "cluster", {r: ("waits", first if r % 2 else second, 40 + r % 2) for r in range(n)}))
    cases.append((n, "spawn", {r: ("waits", first, 40 + 7 * (r % 3)) for r in range(n)}))
    # every kind of elsewhere at least once, whatever the first cases drew
    cases.append((len(_ELSEWHERE) + 1, "spawn", {0: ("waits", "all_reduce", 12), **{
        r + 1: ("elsewhere", kind, 30 + r) for r, kind in enumerate(_ELSEWHERE)}}))
    return cases


def _message(rng, n: int, style: str, places: dict) -> str:
    """The launcher's TimeoutError text for ranks at `places`, as `dist.spawn` ("spawn": a rank that returned has
    exited, no section) or `Cluster.run` ("cluster": it waits for the next run) would raise it."""
    user = rng.choice(("/home/student/train.py", "/tmp/ipykernel_4711/2389415.py", "<dynamic-code>"))
    function, llmlab = rng.choice(("step", "train_step", "buggy_step")), rng.choice((_LLMLAB, "/srv/lab/llmlab"))
    unfinished = [r for r in range(n) if places[r][0] != "returned"]
    sections = []
    for r in range(n):
        place = places[r]
        if place[0] == "returned" and style == "spawn":
            continue
        if place[0] == "waits":
            frames = [*_COLLECTIVES[place[1]], (user, place[2], function)]
        elif place[0] == "elsewhere":
            frames = [*_ELSEWHERE[place[1]], (user, place[2], function)]
        else:
            frames = _IDLE
        frames = [*frames, (_WORKER, 102 if place[0] != "returned" else 95, "main"), (_WORKER, 120, "<module>"),
                  ("<frozen runpy>", 88, "_run_code"), ("<frozen runpy>", 198, "_run_module_as_main")]
        sections.append(f"--- rank {r} ---\n" + _thread(rng, "Thread", _WATCHER, llmlab) + "\n\n"
                        + _thread(rng, "Current thread", frames, llmlab))
    ranks = ("rank " if len(unfinished) == 1 else "ranks ") + ", ".join(map(str, unfinished))
    timeout = rng.choice((5, 10, 30))
    return (f"{ranks} of {n} had not finished within timeout={timeout}s; the cluster's ranks were stopped and its "
            "next run() starts new ones\n\nwhere every rank was:\n" + "\n\n".join(sections))


def _thread(rng, title: str, frames, llmlab: str) -> str:
    head = f"{title} 0x{rng.getrandbits(48):016x} (most recent call first):"
    lines = [f'  File "{file.replace(_LLMLAB, llmlab)}", line {line} in {func}'
             for file, line, func in frames]
    return "\n".join([head, *lines])


def _answer(got, n: int) -> tuple[dict, list]:
    """The learner's (waiting, culprits), or Mismatch saying what is wrong with their form."""
    if not isinstance(got, tuple | list) or len(got) != 2:
        raise Mismatch(f"your function returned {type(got).__name__} {got!r:.80}, expected a tuple (waiting, culprits)")
    waiting, culprits = got
    if not isinstance(waiting, dict) or not all(isinstance(r, int) and isinstance(c, str) for r, c in waiting.items()):
        raise Mismatch(f"waiting={waiting!r:.80} must be a dict {{rank (int): collective (str)}}")
    try:
        culprits = sorted(culprits)
    except TypeError:
        raise Mismatch(f"culprits={culprits!r:.80} must be a list of ranks (ints)") from None
    if not all(isinstance(r, int) for r in culprits) or len(set(culprits)) != len(culprits):
        raise Mismatch(f"culprits={culprits!r:.80} must be a list of distinct ranks (ints)")
    strangers = sorted({*waiting, *culprits} - set(range(n)))
    if strangers:
        raise Mismatch(f"rank {strangers[0]} is not a rank of this world of {n}")
    both = sorted(set(waiting) & set(culprits))
    if both:
        raise Mismatch(f"rank {both[0]} is both waiting and a culprit: a rank is one or the other")
    return waiting, culprits


def _judge(fn, message: str) -> None:
    report = diagnose_hang(message)
    waiting, culprits = _answer(fn(message), report.world_size)
    show = "(print(check.last_hang()) shows this case's message)"
    for p in report.places:
        said = ("waiting in " + waiting[p.rank]) if p.rank in waiting else \
            "a culprit" if p.rank in culprits else "neither waiting nor a culprit"
        if p.state == "waiting":
            if waiting.get(p.rank) == p.call:
                continue
            if p.rank in waiting:
                raise Mismatch(f"rank {p.rank} waits in {p.call}, not {waiting[p.rank]}: its stack runs from the top "
                               f"through {_comm_frames(message, p.rank)} {show}", mistake="call name",
                               hint=_HINTS["call name"])
            llmlab = p.call == "ring_all_reduce"
            raise Mismatch(f"rank {p.rank} waits in {p.call} (called from {p.where}), and you said it is {said}: "
                           + ("its innermost frame is in llmlab's commlog.py, communication code " if llmlab else
                              "the thread that runs the function starts inside torch.distributed; the first thread of "
                              "its section is the launcher's watcher ") + show,
                           mistake="comm frames" if llmlab else "thread", hint=_HINTS["comm frames" if llmlab else
                                                                                   "thread"])
        if p.rank in culprits:
            continue
        if p.state == "finished":
            raise Mismatch(f"rank {p.rank} returned without calling the collective (the first line does not name it "
                           f"among the ranks that had not finished), and you said it is {said} {show}",
                           mistake="returned", hint=_HINTS["returned"])
        if p.rank in waiting:
            raise Mismatch(f"rank {p.rank} is in no collective: the innermost frame of the thread that runs the "
                           f"function is {_frames(message, p.rank)[0]}, not torch.distributed's or llmlab.dist's, and "
                           f"you said it waits in {waiting[p.rank]} {show}", mistake="comm frames",
                           hint=_HINTS["comm frames"])
        raise Mismatch(f"rank {p.rank} is in no collective (at {p.where}): a culprit, and you said it is {said} {show}",
                       mistake="elsewhere", hint=_HINTS["elsewhere"])


def _frames(message: str, rank: int) -> list:
    """The frames of the thread that runs the function in `rank`'s section of `message`, innermost first."""
    section = message.split(f"--- rank {rank} ---\n", 1)[1].split("\n\n--- rank", 1)[0]
    return _function_frames(section)


def _comm_frames(message: str, rank: int) -> str:
    """`rank`'s communication frames, innermost first: 'all_reduce (distributed_c10d.py:3252) ← wrapper (…)'."""
    frames = _frames(message, rank)
    return " ← ".join(str(f) for f in frames[:next(i for i, f in enumerate(frames) if not _is_comm(f.file))])
