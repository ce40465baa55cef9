"""Check 4.4 (solutions/04_communication.ipynb): choosing an all-reduce algorithm by its α-β time.

    from llmlab.checks import ch04 as check
    check.choose_allreduce(ring_allreduce_time, tree_allreduce_time, crossover_bytes, choose_allreduce)   # 4.4

The learner writes the α-β time of the two all-reduces llmlab implements (llmlab.dist.collectives: the ring of
4.5, the tree of 4.6 with its data in segments or in one message), the size where ring and tree cross, and
`choose_allreduce`, which returns the faster algorithm and its time, as NCCL's tuner picks an algorithm for each
call from a cost model of its own. Each function is compared with llmlab.dist.cost on fixed cases first, chosen so
that each named mistake shows in one of them before anything else does, then on fresh random ones: n = 1, 2, 3,
powers of two and not, up to 1024; 0 bytes to 10 GB, most within a factor of 30 of the crossover, on either side;
α and β of a link of cost.LINKS, each scaled by 0.5–2. A wrong choice is named by the rule that explains every
choice the answer made: the slower algorithm, the one with fewer messages, the one with fewer bytes, or the
pipelined tree where the unsegmented one was asked for.
"""

from __future__ import annotations

import math
import random

from llmlab.checks import Hint, Mismatch, check, fresh_rng, number
from llmlab.dist import cost

__all__ = ["choose_allreduce", "cost_cases"]

NAMES = ("ring", "tree")

# (nbytes, n, alpha, beta), in the order they are tried. 0 bytes on 8 ranks names a latency term's slip alone; 1e5
# bytes on 5 ranks (⌈log₂5⌉ = 3 ≠ log₂5) a depth not rounded up, whole chunks per step, 2·S·β for the ring, and the
# tree's choice against the ring both ways (the pipelined tree's crossover is 675 kB there, the unsegmented one's
# 61 kB); one rank takes 0 s; α = 0 leaves the bandwidth terms alone; a GiB on 8 NVLink ranks is bandwidth-bound
# (the ring wins), 4 KiB on 12 ranks latency-bound (the tree wins), 3 bytes on 3 ranks a near tie the ring wins
_FIXED = [(0, 8, 5e-6, 1e-10), (100_000, 5, 2.7e-6, 1 / 50e9), (1_000_000, 1, 5e-6, 1e-10),
          (64_000_000, 2, 0.0, 1 / 25e9), (2**30, 8, 0.6e-6, 1 / 450e9), (4096, 12, 2.7e-6, 1 / 25e9),
          (3, 3, 1e-6, 1 / 31.5e9)]


def cost_cases(rng: random.Random | None = None) -> list[tuple[int, int, float, float]]:
    """The (nbytes, n, alpha, beta) the 4.4 check tries: the fixed cases, then 9 fresh ones."""

    rng = rng or fresh_rng()
    cases = list(_FIXED)
    for _ in range(9):
        n = rng.choice([1, 2, 3]) if rng.random() < 0.25 else \
            rng.choice([rng.randint(4, 16), rng.randint(17, 1024), 2 ** rng.randint(2, 10)])
        link = cost.LINKS[rng.choice(sorted(cost.LINKS))]
        alpha, beta = link.alpha * rng.uniform(0.5, 2), link.beta * rng.uniform(0.5, 2)
        crossover = cost.crossover_bytes(n, alpha, beta, pipelined=rng.random() < 0.5)
        if 0 < crossover < 1e10 and rng.random() < 0.8:  # either side of where the choice flips
            nbytes = round(crossover * 10 ** rng.uniform(-1.5, 1.5))
        else:
            nbytes = round(10 ** rng.uniform(0, 10))  # 1 byte … 10 GB
        cases.append((nbytes, n, alpha, beta))
    return cases


# Every answer is a handful of float64 products and sums, ~1e-16 relative from the reference in another order;
# 1e-9 leaves a wide margin, and the 0 s of one rank and the 0-byte crossovers need abs_tol. Each named mistake is
# off by a whole term (α or S·β times a step count, a factor N or a level) in the fixed case that names it, 3% or
# more (the smallest: the ring's 2·S·β for 2(N−1)/N·S·β on 5 ranks, 3.2%). Ring and tree tie within it only at 0
# bytes on 2 or 3 ranks, on one rank and at the crossover itself (either name passes there); the closest fixed
# choice, 3 bytes on 3 ranks, is 1.6e-5 apart
def _close(got: float, want: float) -> bool:
    return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-18)


def _depth(n: int, rounding=math.ceil) -> float:
    """The tree's levels, ⌈log₂n⌉ as llmlab.dist.cost counts them; `rounding` a learner's other reading of it."""
    return rounding(math.log2(n)) if n > 1 else 0


def _args(nbytes, n, alpha, beta, pipelined=None) -> str:
    flag = "" if pipelined is None else f", pipelined={pipelined}"
    return f"nbytes={nbytes:.6g}, n={n}, alpha={alpha:.3g}, beta={beta:.3g}{flag}"


def _compare(got: float, want: float, what: str, diagnosis: list, hints: dict, unit: str = " s") -> None:
    """Pass if `got` is `want`; else name the first (value, key, text) of `diagnosis` that `got` equals."""
    if _close(got, want):
        return
    known = next(((key, text) for value, key, text in diagnosis if _close(got, value)), None)
    message = f"{what} = {got:.6g}{unit}, expected {want:.6g}{unit}"
    if known:
        raise Mismatch(f"{message}: {known[1]}", mistake=known[0], hint=hints[known[0]])
    raise Mismatch(message)


# --- the ring ---------------------------------------------------------------------------------------------------

_RING_FORMULA = ("2(N−1) steps (N−1 of reduce-scatter, N−1 of all-gather), each one message of S/N bytes: "
                 "t = 2(N−1)·α + 2(N−1)/N · S · β")
_RING_HINTS = {
    "reduce-scatter only": Hint(
        nudge="look at how many phases your ring time counts: an all-reduce is more than its reduce-scatter",
        idea="after the reduce-scatter each rank holds one summed chunk; an all-gather of as many steps then brings "
             "every summed chunk to every rank, so the latency term and the bytes term both double",
        formula=_RING_FORMULA),
    "whole S per step": Hint(
        nudge="look at the size of the message each ring step sends",
        idea="the ring cuts the buffer into N chunks and each step sends one of them, S/N bytes, so the bytes term "
             "is just under 2·S·β, whatever the number of ranks",
        formula=_RING_FORMULA),
    "N steps": Hint(
        nudge="count the steps of each phase of the ring on N ranks",
        idea="a chunk starts on one rank and needs one hop for each of the N−1 others, so each phase takes N−1 "
             "steps, not N",
        formula=_RING_FORMULA),
    "N chunks": Hint(
        nudge="count the chunks each rank sends in one phase of the ring",
        idea="each of the N−1 steps sends one chunk of S/N bytes, so a phase sends (N−1)/N of the buffer, not all "
             "of it: the bytes term is 2(N−1)/N·S·β, below 2·S·β",
        formula=_RING_FORMULA),
    "latency over N": Hint(
        nudge="look at how often your ring time pays the latency α",
        idea="every step is one message, and every message pays the whole latency α whatever its size: α is "
             "multiplied by the number of steps, never divided by N",
        formula=_RING_FORMULA),
}


def _ring_diagnosis(nbytes, n, alpha, beta) -> list[tuple[float, str, str]]:
    return [
        (cost.reduce_scatter_time(nbytes, n, alpha, beta), "reduce-scatter only",
         "half: that is the reduce-scatter alone; an all-reduce adds an all-gather of as many steps"),
        (2 * (n - 1) * (alpha + nbytes * beta), "whole S per step",
         "each step sends one chunk of S/N bytes, not all S"),
        (2 * n * alpha + 2 * nbytes * beta, "N steps", "N−1 steps per phase, not N"),
        (2 * (n - 1) * alpha + 2 * nbytes * beta, "N chunks",
         "the bytes term is 2(N−1)/N·S·β: each phase sends N−1 chunks of S/N bytes, not N"),
        (2 * (n - 1) * (alpha + nbytes * beta / n) / n, "latency over N",
         "the latency is paid once per step: 2(N−1)·α"),
    ]


# --- the tree ---------------------------------------------------------------------------------------------------

_TREE_FORMULA = ("d = ⌈log₂N⌉ levels (0 on one rank, which sends nothing); pipelined: t = 2·d·α + 2·S·β (reduce up, "
                 "broadcast down, the segments in flight on every level at once); unsegmented: t = 2·d·(α + S·β)")
_TREE_HINTS = {
    "tree one phase": Hint(
        nudge="look at how many phases your tree time counts",
        idea="the reduce up the tree leaves the sum on the root alone; a broadcast back down the same levels brings "
             "it to every rank, so both terms double",
        formula=_TREE_FORMULA),
    "one rank": Hint(
        nudge="look at your tree's time on one rank",
        idea="a tree of one rank has no edge: nothing is sent, so both terms are 0, the bytes term too",
        formula=_TREE_FORMULA),
    "not pipelined": Hint(
        nudge="look at how often the pipelined tree pays S·β",
        idea="cut in segments, the levels work at once: while a parent adds segment k its children send segment "
             "k+1, so once the pipeline is full each phase moves S bytes in the time of one level, not d levels",
        formula=_TREE_FORMULA),
    "pipelined ignored": Hint(
        nudge="look at what your tree time does with pipelined=False",
        idea="unsegmented, each level waits until the level below has sent it the whole S bytes: every one of the "
             "2·d hops pays α + S·β",
        formula=_TREE_FORMULA),
    "depth not rounded up": Hint(
        nudge="look at the tree's depth when N is not a power of two",
        idea="a level is whole or absent: a tree over 5 ranks needs as many levels as one over 8, and the model "
             "counts log₂N rounded up",
        formula=_TREE_FORMULA),
}


def _tree(nbytes, n, alpha, beta, pipelined, depth) -> float:
    """The tree's time with `depth` levels, without the one-rank case."""
    return 2 * depth * alpha + 2 * nbytes * beta if pipelined else 2 * depth * (alpha + nbytes * beta)


def _tree_diagnosis(nbytes, n, alpha, beta, pipelined) -> list[tuple[float, str, str]]:
    want = cost.tree_allreduce_time(nbytes, n, alpha, beta, pipelined)
    diagnosis = [(want / 2, "tree one phase", "half: that is the reduce up the tree alone; the broadcast back down "
                                              "is missing")]
    if n == 1:
        diagnosis.append((2 * nbytes * beta, "one rank", "one rank sends nothing: 0 s"))
    if pipelined:
        diagnosis.append((_tree(nbytes, n, alpha, beta, False, _depth(n)), "not pipelined",
                          "that is the unsegmented tree, S·β on every level; pipelined, the segments are in flight on "
                          "every level at once and each phase pays S·β once"))
    else:
        diagnosis.append((_tree(nbytes, n, alpha, beta, True, _depth(n)), "pipelined ignored",
                          "that is the pipelined tree; with pipelined=False every hop waits for all S bytes"))
    for rounding, text in ((lambda x: x, "log₂N not rounded"), (math.floor, "log₂N rounded down")):
        diagnosis.append((_tree(nbytes, n, alpha, beta, pipelined, _depth(n, rounding)), "depth not rounded up",
                          f"{text}: the tree has ⌈log₂{n}⌉ = {_depth(n)} levels"))
    return diagnosis


# --- the crossover ----------------------------------------------------------------------------------------------

_CROSS_FORMULA = ("with d = ⌈log₂N⌉, set the ring's time equal to the tree's and solve for S: pipelined "
                  "S* = N·(N−1−d)·α/β; unsegmented S* = (N−1−d)·α / ((d − (N−1)/N)·β); 0.0 when N−1−d ≤ 0 (N ≤ 3)")
_CROSS_HINTS = {
    "crossover without N": Hint(
        nudge="look at the bytes terms you set equal: the ring's and the pipelined tree's",
        idea="the ring sends 2(N−1)/N·S·β, the tree 2·S·β: they differ by 2·S·β/N, and dividing the latency gap by "
             "that brings a factor N into S*",
        formula=_CROSS_FORMULA),
    "crossover inverted": Hint(
        nudge="look at the units of your crossover: it is a number of bytes",
        idea="α is seconds, β seconds per byte: α/β is bytes, β/α is not. Solve latency gap = bytes gap for S",
        formula=_CROSS_FORMULA),
    "crossover pipelined ignored": Hint(
        nudge="look at what your crossover does with pipelined=False",
        idea="the unsegmented tree pays 2·d·S·β, not 2·S·β: its gap to the ring's bytes term is 2(d − (N−1)/N)·S·β",
        formula=_CROSS_FORMULA),
    "crossover depth": Hint(
        nudge="look at the tree's depth in your crossover when N is not a power of two",
        idea="the tree has ⌈log₂N⌉ whole levels, as in tree_allreduce_time: its latency gap to the ring is "
             "2(N−1−⌈log₂N⌉)·α, and none at all for N ≤ 3",
        formula=_CROSS_FORMULA),
}


def _crossover(n, alpha, beta, pipelined, depth) -> float:
    """The crossover with `depth` levels (a learner's, for the depth mistakes)."""
    steps = n - 1 - depth  # the ring's extra latency steps, per phase
    if steps <= 0:
        return 0.0
    return steps * alpha / ((1 / n if pipelined else depth - (n - 1) / n) * beta)


def _cross_diagnosis(n, alpha, beta, pipelined) -> list[tuple[float, str, str]]:
    steps = n - 1 - _depth(n)
    diagnosis = []
    if pipelined and steps > 0:
        diagnosis.append((steps * alpha / beta, "crossover without N", f"S* = N·(N−1−⌈log₂N⌉)·α/β: the factor "
                                                                      f"N = {n} is missing"))
    if steps > 0 and alpha > 0:
        gap = 1 / n if pipelined else _depth(n) - (n - 1) / n
        diagnosis.append((steps * beta / (gap * alpha), "crossover inverted", "β/α is not a size; α/β is bytes"))
    if not pipelined:
        diagnosis.append((cost.crossover_bytes(n, alpha, beta), "crossover pipelined ignored",
                          "that is the pipelined tree's crossover"))
    for rounding, text in ((lambda x: x, "log₂N not rounded"), (math.floor, "log₂N rounded down")):
        diagnosis.append((_crossover(n, alpha, beta, pipelined, _depth(n, rounding)), "crossover depth",
                          f"{text}: the tree has ⌈log₂{n}⌉ = {_depth(n)} levels"))
    return diagnosis


# --- the choice -------------------------------------------------------------------------------------------------

_CHOOSE_FORMULA = ("times = {'ring': ring_allreduce_time(S, N, α, β), 'tree': tree_allreduce_time(S, N, α, β, "
                   "pipelined)}; name = min(times, key=times.get); return name, times[name]")
_CHOOSE_HINTS = {
    "choice pipelined ignored": Hint(
        nudge="look at which tree your choice prices when pipelined=False",
        idea="pass pipelined on to tree_allreduce_time: the unsegmented tree is slower, and the ring wins from a "
             "smaller size on",
        formula=_CHOOSE_FORMULA),
    "slower": Hint(
        nudge="look at which of the two times your choice keeps",
        idea="the choice is the algorithm that finishes first: the smaller time, the tree below the crossover and "
             "the ring above it",
        formula=_CHOOSE_FORMULA),
    "fewer messages": Hint(
        nudge="look at large buffers: does your choice still pick the tree there?",
        idea="the tree's fewer latencies win only while α dominates; for large buffers the bytes term dominates and "
             "the ring sends fewer bytes. Compare the whole times, α and β terms together",
        formula=_CHOOSE_FORMULA),
    "fewer bytes": Hint(
        nudge="look at small buffers on many ranks: does your choice still pick the ring there?",
        idea="the ring sends the fewest bytes but pays 2(N−1) latencies to the tree's 2⌈log₂N⌉: for small buffers "
             "on N > 3 ranks the tree is faster. Compare the whole times, α and β terms together",
        formula=_CHOOSE_FORMULA),
    "other's seconds": Hint(
        nudge="look at the seconds you return with the name",
        idea="the seconds are the time of the algorithm you chose, the smaller of the two",
        formula=_CHOOSE_FORMULA),
    "unsegmented seconds": Hint(
        nudge="look at which tree your choice prices when pipelined=True",
        idea="pass pipelined on to tree_allreduce_time: pipelined=True is the segmented tree, 2·d·α + 2·S·β",
        formula=_CHOOSE_FORMULA),
}


def _times(nbytes, n, alpha, beta, pipelined) -> dict[str, float]:
    return {"ring": cost.ring_allreduce_time(nbytes, n, alpha, beta),
            "tree": cost.tree_allreduce_time(nbytes, n, alpha, beta, pipelined)}


def _faster(times: dict[str, float]) -> str | None:
    """The faster of two times, None for a tie (either name is right)."""
    return None if _close(times["ring"], times["tree"]) else min(times, key=times.get)


# The rules a wrong choice may follow: each gives the name it picks in a case, or None where it says nothing
_RULES = [
    ("choice pipelined ignored", lambda s, n, a, b, p: _faster(_times(s, n, a, b, True)),
     "every choice you made compares the ring with the pipelined tree; pipelined=False asks for the unsegmented "
     "one, 2⌈log₂N⌉·(α + S·β)"),
    ("slower", lambda s, n, a, b, p: None if _faster(_times(s, n, a, b, p)) is None
     else max((t, k) for k, t in _times(s, n, a, b, p).items())[1],
     "every choice you made is the slower algorithm: keep the smaller time"),
    ("fewer messages", lambda s, n, a, b, p: None if n - 1 == _depth(n) else "tree" if _depth(n) < n - 1 else "ring",
     "every choice you made is the algorithm with fewer messages (the tree once N > 3), whatever the size: that "
     "wins only while latency dominates"),
    ("fewer bytes", lambda s, n, a, b, p: None if n == 1 else "ring",
     "every choice you made is the ring, which sends the fewest bytes: that wins only while bandwidth dominates"),
]


def _choice_answer(answer, what: str) -> tuple[str, float]:
    if not isinstance(answer, tuple | list) or len(answer) != 2:
        raise Mismatch(f"{what} returned {answer!r:.80}; expected a pair (name, seconds), e.g. ('ring', 0.012)")
    name, seconds = answer
    if name not in NAMES:
        raise Mismatch(f"{what} returned the name {name!r:.40}; expected 'ring' or 'tree' (and the pair is "
                       "(name, seconds))")
    return name, number(seconds, f"{what}'s seconds")


def _wrong_choice(choices: list, index: int) -> tuple[str, str] | None:
    """(key, text) of the first rule that picks what the answer picked in choices[index] and agrees with every
    choice it made (choices: ((nbytes, n, alpha, beta, pipelined), name) pairs)."""
    case, name = choices[index]
    for key, rule, text in _RULES:
        if rule(*case) == name and all(rule(*c) in (None, got) for c, got in choices):
            return key, text
    return None


def _check_choices(choose, cases) -> None:
    choices = []
    for nbytes, n, alpha, beta in cases:
        for pipelined in (True, False):
            what = f"choose_allreduce({_args(nbytes, n, alpha, beta, pipelined)})"
            choices.append(((nbytes, n, alpha, beta, pipelined),
                            _choice_answer(choose(nbytes, n, alpha, beta, pipelined), what)))
    for index, (case, (name, seconds)) in enumerate(choices):
        times, best = _times(*case), _faster(_times(*case))
        what = f"choose_allreduce({_args(*case)}) = ({name!r}, {seconds:.6g} s)"
        if best not in (None, name):
            known = _wrong_choice([(c, got) for c, (got, _) in choices], index)
            message = (f"{what}, but the {best} is faster here: ring {times['ring']:.6g} s, tree "
                       f"{times['tree']:.6g} s")
            if known:
                raise Mismatch(f"{message}: {known[1]}", mistake=known[0], hint=_CHOOSE_HINTS[known[0]])
            raise Mismatch(f"{message}: return the faster of the two")
        nbytes, n, alpha, beta, pipelined = case
        other = cost.tree_allreduce_time(nbytes, n, alpha, beta, not pipelined)
        _compare(seconds, times[name], f"{what}: the {name}'s time", [
            (times["tree" if name == "ring" else "ring"], "other's seconds",
             "that is the other algorithm's time; return the time of the one you chose"),
            (other, "choice pipelined ignored" if not pipelined else "unsegmented seconds",
             f"that is the {'pipelined' if not pipelined else 'unsegmented'} tree's time; pipelined={pipelined}"),
        ], _CHOOSE_HINTS)


@check("4.4", "choosing an all-reduce algorithm by its α-β time", hint=Hint(
    nudge="compute each algorithm's time on its own — the ring's, the tree's pipelined and unsegmented — and see "
          "which one differs",
    idea="the ring pays 2(N−1) latencies and sends 2(N−1)/N·S bytes per rank; the tree pays 2⌈log₂N⌉ latencies "
         "and sends S up and S down, once when pipelined, once per level when not; the crossover is the size where "
         "their times are equal, and the choice is the smaller time",
    formula="ring 2(N−1)·α + 2(N−1)/N·S·β; tree (d = ⌈log₂N⌉, 0 s on one rank) 2·d·α + 2·S·β pipelined, "
            "2·d·(α + S·β) not; crossover N·(N−1−d)·α/β pipelined, (N−1−d)·α/((d − (N−1)/N)·β) not, 0.0 when "
            "N−1−d ≤ 0; choose: the name of the smaller time, and that time"))
def choose_allreduce(ring, tree, crossover, choose):
    """`ring(nbytes, n, alpha, beta)`, `tree(nbytes, n, alpha, beta, pipelined)`: seconds of each all-reduce;
    `crossover(n, alpha, beta, pipelined)`: the bytes where they are equal; `choose(nbytes, n, alpha, beta,
    pipelined)`: ("ring" | "tree", seconds) of the faster."""

    cases = cost_cases()
    for nbytes, n, alpha, beta in cases:
        what = f"ring_allreduce_time({_args(nbytes, n, alpha, beta)})"
        _compare(number(ring(nbytes, n, alpha, beta), what), cost.ring_allreduce_time(nbytes, n, alpha, beta), what,
                 _ring_diagnosis(nbytes, n, alpha, beta), _RING_HINTS)
    for nbytes, n, alpha, beta in cases:
        for pipelined in (True, False):
            what = f"tree_allreduce_time({_args(nbytes, n, alpha, beta, pipelined)})"
            _compare(number(tree(nbytes, n, alpha, beta, pipelined), what),
                     cost.tree_allreduce_time(nbytes, n, alpha, beta, pipelined), what,
                     _tree_diagnosis(nbytes, n, alpha, beta, pipelined), _TREE_HINTS)
    for _, n, alpha, beta in cases:
        for pipelined in (True, False):
            what = f"crossover_bytes(n={n}, alpha={alpha:.3g}, beta={beta:.3g}, pipelined={pipelined})"
            _compare(number(crossover(n, alpha, beta, pipelined), what),
                     cost.crossover_bytes(n, alpha, beta, pipelined), what, _cross_diagnosis(n, alpha, beta, pipelined),
                     _CROSS_HINTS, unit=" bytes")
    _check_choices(choose, cases)
