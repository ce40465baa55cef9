"""Check 2.5 (solutions/02_parallelism.ipynb): bucketed DDP from gradient hooks — and the ranks that chapter 2's
multi-rank checks (2.1, 2.2, 2.5) share.

    from llmlab.checks import ch02 as check
    check.bucketed_ddp(BucketedDDP)    # 2.5, on 4 ranks, against llmlab.parallel.ddp

The learner writes `BucketedDDP(module, bucket_bytes, group)`, the heart of PyTorch's DistributedDataParallel (Li
et al. 2020, §3.2.3) and of `llmlab.parallel.ddp.DataParallel`, whose interface it mirrors: `.buckets`, the
parameters cut into buckets of at most `bucket_bytes` in reverse registration order; a hook on every parameter
that launches a bucket's asynchronous all-reduce once all its gradients are in; `finish()`, after backward, that
waits for them and leaves the mean over the group's ranks in every `.grad`.

On each rank of the group the check builds the same small float64 MLP of random odd sizes, wraps it, and runs two
steps (the same wrapper; `model.zero_grad()` between them), each on this rank's own random batch: `loss.backward()`,
then `finish()`. It compares `.buckets` with `llmlab.parallel.ddp.buckets`, the all-reduces with the buckets —
every bucket's flat buffer launched with `async_op=True` while `backward()` still runs, and none waited on before
the last one is launched (the check wraps `torch.distributed.all_reduce` on the ranks to see when each is launched
and waited on) — and every `.grad` with the mean over the group of the ranks' own gradients, computed here in
float64. The caps drawn make every parameter its own bucket, put everything in one, fill a bucket to exactly the
cap, and cut at random.

The shared ranks: one gloo `llmlab.dist.Cluster(4)` (`cluster()`), and in every call all four ranks busy, split
into process groups by `PARTITIONS` — one group of 4, two groups of 2, a group of 3 next to a group of 1 — so that
an answer that ignores its `group` argument reduces over the wrong ranks (and the check says so) instead of
hanging. They live here, not in `ch02`, because `ch02` imports this module (so this one cannot import it).
"""

from __future__ import annotations

import contextlib
import inspect
import random
from dataclasses import dataclass

import torch
import torch.distributed as td

from llmlab import checks, dist
from llmlab.checks import Hint, Mismatch, assert_close, check, fresh_rng, unwritten
from llmlab.parallel import ddp

__all__ = ["bucketed_ddp", "cluster", "WORLD_SIZE", "PARTITIONS", "TIMEOUT_S"]

WORLD_SIZE = 4
# the process groups the multi-rank checks run in: all four ranks take part in every case
PARTITIONS = ((0, 1, 2, 3),), ((0, 1), (2, 3)), ((0, 1, 2), (3,))
TIMEOUT_S = 60.0  # one call on the ranks; a correct answer takes milliseconds
STEPS = 2  # backward passes per case on one wrapper: the second finds whatever the first left behind


def cluster():
    """The checks' Cluster of WORLD_SIZE ranks (shared with other chapters' checks; see checks.cluster)."""
    return checks.cluster(WORLD_SIZE)


_groups: dict = {}  # on a rank: partition -> (this rank's process group, the global ranks in it)


def my_group(partition):
    """This rank's group of `partition`: one dist.Grid per part, built once per rank process by every rank."""
    if partition not in _groups:
        grids = [dist.Grid(dp=len(ranks), ranks=ranks) for ranks in partition]  # every part's, on every rank
        mine = next(grid for grid in grids if grid.member)
        _groups[partition] = (mine.dp_group, list(mine.dp_ranks))
    return _groups[partition]


# --- the cases: a small float64 MLP, each rank's batches ------------------------------------------------------

@dataclass(frozen=True)
class _Case:
    sizes: tuple[int, ...]  # the MLP's widths: Linear(sizes[0], sizes[1]), tanh, Linear(sizes[1], sizes[2]), ...
    biases: tuple[bool, ...]  # per Linear
    rows: int  # each rank's batch
    bucket_bytes: int
    seed: int


def _model(case: _Case) -> torch.nn.Sequential:
    """The case's MLP, the same on every rank and here: N(0, 1) parameters drawn from the case's seed."""
    layers = []
    for n_in, n_out, bias in zip(case.sizes[:-1], case.sizes[1:], case.biases, strict=True):
        layers += [torch.nn.Linear(n_in, n_out, bias=bias, dtype=torch.float64), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1])
    gen = torch.Generator().manual_seed(case.seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return model


def _loss(model, case: _Case, step: int, rank: int) -> torch.Tensor:
    """Global rank `rank`'s loss at `step`: the mean squared error on its own random batch."""
    gen = torch.Generator().manual_seed(case.seed * 7919 + step * 104729 + rank + 1)
    x = torch.randn(case.rows, case.sizes[0], generator=gen, dtype=torch.float64)  # (rows, in)
    y = torch.randn(case.rows, case.sizes[-1], generator=gen, dtype=torch.float64)  # (rows, out)
    return torch.nn.functional.mse_loss(model(x), y)


def _cases(rng: random.Random) -> list[_Case]:
    def mlp(layers: int):
        sizes = tuple(rng.randint(1, 9) for _ in range(layers + 1))
        return sizes, tuple(rng.random() < 0.7 for _ in range(layers)), rng.randint(1, 5), rng.randrange(2**31)

    cases = []
    for cap in ("boundary", "random", "alone", "one"):
        sizes, biases, rows, seed = mlp(3 if cap == "boundary" else rng.randint(2, 3))
        nbytes = [p.numel() * 8 for p in reversed(list(_model(_Case(sizes, biases, 1, 8, 0)).parameters()))]
        bucket_bytes = {"boundary": nbytes[0] + nbytes[1],  # the first bucket exactly full: ≤ the cap, not <
                        "random": 8 * rng.randint(1, sum(nbytes) // 8),
                        "alone": 8 * rng.randint(1, min(nbytes) // 8),  # ≤ the smallest: every parameter alone
                        "one": sum(nbytes) + 8 * rng.randint(0, 50)}[cap]  # everything in one bucket
        cases.append(_Case(sizes, biases, rows, bucket_bytes, seed))
    return cases


# --- on the ranks: torch.distributed.all_reduce watched -------------------------------------------------------

class _Watch:
    """On a rank: what the wrapper's all-reduces did — per call its step (-1 while the wrapper is built), the phase
    it was launched in ("init", "backward", "finish"), async_op, the numel, and when it was first waited on: (the
    phase, how many all-reduces the step had launched by then)."""

    def __init__(self):
        self.phase, self.step, self.launches = "init", -1, []

    def of_step(self, step: int) -> list[dict]:
        return [launch for launch in self.launches if launch["step"] == step]


class _Handle:
    """The learner's handle of an async all-reduce: the real one, its wait() noted in the launch's record."""

    def __init__(self, work, launch: dict, watch: _Watch):
        self._work, self._launch, self._watch = work, launch, watch

    def wait(self, *args, **kwargs):
        if self._launch["waited"] is None:
            self._launch["waited"] = (self._watch.phase, len(self._watch.of_step(self._launch["step"])))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):  # is_completed(), get_future(), ...: the real handle's
        return getattr(self._work, name)


@contextlib.contextmanager
def _watching():
    """Replace torch.distributed.all_reduce (the module attribute the learner calls) by one that logs each call."""
    original, watch = td.all_reduce, _Watch()
    signature = inspect.signature(original)

    def all_reduce(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        launch = dict(step=watch.step, phase=watch.phase, async_op=bool(bound.arguments["async_op"]),
                      numel=bound.arguments["tensor"].numel(), waited=None)
        watch.launches.append(launch)
        work = original(*args, **kwargs)
        return _Handle(work, launch, watch) if work is not None else None

    td.all_reduce = all_reduce
    try:
        yield watch
    finally:
        td.all_reduce = original


def _bucket_indices(wrapper, model) -> list[list[int]] | str:
    """The wrapper's .buckets as lists of parameter indices (registration order), or what is wrong with it."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    buckets = getattr(wrapper, "buckets", None)
    if not isinstance(buckets, list | tuple) or not all(isinstance(b, list | tuple) for b in buckets):
        return f"its .buckets is {type(buckets).__name__} {buckets!r:.60}, expected a list of lists of parameters"
    if not all(id(p) in index for b in buckets for p in b):
        return "its .buckets holds something that is not one of the module's parameters"
    return [[index[id(p)] for p in b] for b in buckets]


def _on_rank(cls, cases):
    """Every case in every partition's group of this rank: per partition, this rank's group and what it saw."""
    out = []
    for partition in PARTITIONS:
        group, members = my_group(partition)
        results = []
        for case in cases:
            model = _model(case)
            with _watching() as watch:
                wrapper = cls(model, case.bucket_bytes, group)
                grads = []
                for step in range(STEPS):
                    watch.step, watch.phase = step, "backward"
                    _loss(model, case, step, td.get_rank()).backward()
                    watch.phase = "finish"
                    wrapper.finish()
                    grads.append([None if p.grad is None else p.grad.detach().clone() for p in model.parameters()])
                    model.zero_grad()
            results.append(dict(buckets=_bucket_indices(wrapper, model), launches=watch.launches, grads=grads))
        out.append({"rank": td.get_rank(), "members": members, "results": results})
    return out


# --- here: the verdict ----------------------------------------------------------------------------------------

_FORMULA = ("__init__: walk list(module.parameters()) in reverse; start a new bucket when adding a parameter would "
            "take a non-empty one over bucket_bytes (p.numel() * p.element_size() each), keep the last partial "
            "bucket, and register p.register_post_accumulate_grad_hook(hook) on every parameter; hook(p): count p "
            "ready in its bucket, and when the bucket's last gradient is in, flat = torch.cat([q.grad.reshape(-1) "
            "for q in bucket]) and keep (flat, td.all_reduce(flat, group=group, async_op=True)) — no wait; finish(): "
            "wait for each handle, flat /= td.get_world_size(group), copy each slice back into its p.grad "
            "(p.grad.copy_(piece.view_as(p))), and reset the counts for the next backward")
_HINTS = {
    "order": Hint(
        nudge="in which order does backward produce the gradients — and in which order did you fill the buckets?",
        idea="the last layer's gradients come first, so DDP buckets the parameters in reverse registration order: "
             "the first bucket fills, and its all-reduce starts, while backward is still at the last layers",
        formula=_FORMULA),
    "cap": Hint(
        nudge="add up the bytes of each of your buckets and compare them with bucket_bytes",
        idea="a bucket takes parameters while its bytes stay ≤ bucket_bytes; the parameter that would take it over "
             "starts the next one (one larger than the cap sits alone), and the last, partial bucket is kept",
        formula=_FORMULA),
    "overlap": Hint(
        nudge="look at when each all-reduce starts and when you wait for it: while backward runs, or after?",
        idea="the point of the buckets is overlap: launch a bucket's all-reduce from the hook of its last gradient "
             "with async_op=True and keep the handle; wait only in finish(), after backward has returned",
        formula=_FORMULA),
    "flush": Hint(
        nudge="count the all-reduces one backward launches and the buckets: is every bucket launched?",
        idea="a bucket is ready when all of its parameters' gradients are in, not when it holds bucket_bytes: the "
             "last bucket is partial and still has to be all-reduced, and a hook must sit on every parameter",
        formula=_FORMULA),
    "mean": Hint(
        nudge="look at what .grad holds after finish(): this rank's gradient, the sum over the ranks, or the mean?",
        idea="after the wait, each bucket's flat buffer holds the sum over the group; divide by the group's size "
             "and write every slice back into its parameter's .grad (torch.cat made a copy, not a view)",
        formula=_FORMULA),
}


@dataclass
class _Reference:
    """What one case should give, computed here: the parameters' names and sizes, llmlab's buckets, and every
    global rank's own gradients at each step (no wrapper)."""

    names: list[str]
    numels: list[int]
    nbytes: list[int]
    buckets: list[list[int]]
    forward_order: list[list[int]]  # the buckets of the parameters taken in registration order: a mistake
    local: list[dict[int, list[torch.Tensor]]]  # per step: global rank -> its gradients

    @classmethod
    def of(cls, case: _Case) -> _Reference:
        model = _model(case)
        params = list(model.parameters())
        index = {id(p): i for i, p in enumerate(params)}
        mb = case.bucket_bytes / 2**20  # ddp.buckets takes MB: exact, a power of 2
        as_indices = lambda bs: [[index[id(p)] for p in b] for b in bs]  # noqa: E731
        local = []
        for step in range(STEPS):
            local.append({})
            for rank in range(WORLD_SIZE):
                model.zero_grad()
                _loss(model, case, step, rank).backward()
                local[step][rank] = [p.grad.clone() for p in params]
        return cls([name for name, _ in model.named_parameters()], [p.numel() for p in params],
                   [p.numel() * p.element_size() for p in params], as_indices(ddp.buckets(params, mb)),
                   as_indices(ddp.buckets(params[::-1], mb)), local)

    def show(self, buckets: list[list[int]]) -> str:
        return "[" + ", ".join("[" + ", ".join(self.names[i] for i in b) + "]" for b in buckets) + "]"


def _where(case: _Case, rank: int, members: list[int]) -> str:
    return (f"rank {rank} in a group of {len(members)} of the {WORLD_SIZE} ranks (ranks {members}), an MLP of widths "
            f"{case.sizes} in float64 with bucket_bytes={case.bucket_bytes}")


def _check_buckets(got, ref: _Reference, case: _Case, where: str) -> None:
    if isinstance(got, str):
        raise Mismatch(f"{where}: {got}", mistake="cap", hint=_HINTS["cap"])
    if got == ref.buckets:
        return
    said = f"{where}: .buckets is {ref.show(got)}, llmlab's is {ref.show(ref.buckets)}"
    if got == ref.forward_order and len(ref.names) > 1:
        raise Mismatch(f"{said}: the parameters in registration order; DDP buckets them in reverse, the order in "
                       "which backward produces their gradients", mistake="order", hint=_HINTS["order"])
    if got == ref.buckets[:-1]:
        raise Mismatch(f"{said}: the last, partial bucket is missing (keep it after the loop)", mistake="flush",
                       hint=_HINTS["flush"])
    over = next((b for b in got if len(b) > 1 and sum(ref.nbytes[i] for i in b) > case.bucket_bytes), None)
    if over is not None:
        raise Mismatch(f"{said}: a bucket of {sum(ref.nbytes[i] for i in over)} bytes holds more than bucket_bytes="
                       f"{case.bucket_bytes}", mistake="cap", hint=_HINTS["cap"])
    raise Mismatch(said, mistake="cap", hint=_HINTS["cap"])


def _check_launches(launches: list[dict], ref: _Reference, step: int, where: str) -> None:
    sizes = sorted(sum(ref.numels[i] for i in b) for b in ref.buckets)
    during = [launch for launch in launches if launch["phase"] == "backward"]
    later = [launch for launch in launches if launch["phase"] == "finish"]
    where = f"{where}, backward {step + 1} of {STEPS}"
    fail = lambda text, mistake: Mismatch(f"{where}: {text}", mistake=mistake, hint=_HINTS[mistake])  # noqa: E731
    if not launches:
        raise fail(f"none of the {len(sizes)} buckets was all-reduced: no td.all_reduce call was seen (the check "
                   "sees the calls made through the module, as td.all_reduce(...))"
                   + (" — were the counts of ready gradients reset by the first finish()?" if step else ""), "flush")
    if any(not launch["async_op"] for launch in launches):
        raise fail("an all-reduce was launched with async_op=False, so backward stops until it is done: launch it "
                   "with async_op=True and wait in finish()", "overlap")
    if not during:
        raise fail(f"every all-reduce ({len(later)}) was launched in finish(), after backward: none overlapped "
                   "backward — launch each bucket's from the hook of its last gradient", "overlap")
    early = next((launch for launch in during if launch["waited"] is not None and launch["waited"][0] == "backward"
                  and launch["waited"][1] < len(during)), None)
    if early is not None:
        raise fail(f"all-reduce {during.index(early) + 1} of {len(during)} was waited on before the next bucket was "
                   "launched — in the hook, so backward stops until it is done: keep the handle and wait in finish()",
                   "overlap")
    launched = sorted(launch["numel"] for launch in during)
    if launched == sizes:
        return
    if launched == sorted(ref.numels) and len(ref.numels) != len(ref.buckets):
        raise fail(f"{len(launched)} all-reduces, one per parameter; the {len(ref.buckets)} buckets each flatten "
                   "their gradients into one buffer (torch.cat) and all-reduce it once", "flush")
    if len(launched) < len(sizes):
        raise fail(f"{len(launched)} of the {len(sizes)} buckets were all-reduced during backward (elements "
                   f"{launched}; the buckets hold {sizes}){' and the rest in finish()' if later else ''}: launch "
                   "every bucket once all its gradients are in, the last, partial one too", "flush")
    raise fail(f"the all-reduces launched during backward carry {launched} elements, the buckets hold {sizes}: one "
               "all-reduce per bucket, of its flattened gradients", "flush")


def _mean(grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.stack(gs).mean(0) for gs in zip(*grads, strict=True)]


def _check_grads(got: list, ref: _Reference, step: int, rank: int, members: list[int], where: str) -> None:
    local = ref.local[step]
    want = _mean([local[k] for k in members])
    where = f"{where}, backward {step + 1} of {STEPS}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g is None:
            raise Mismatch(f"{where}: {ref.names[i]}.grad is None after finish()", mistake="mean",
                           hint=_HINTS["mean"])
        try:
            # float64: a gradient entry is a sum of ≤ 45 products of O(1) values, summed in another order on the
            # ranks than here, and the all-reduce adds ≤ 4 of them: a few ulps, ~1e-15, apart; every named
            # mistake is off by a third of the gradient or more
            assert_close(g, w, what=f"{where}: {ref.names[i]}.grad", rtol=1e-9, atol=1e-12)
        except Mismatch as e:
            raise Mismatch(f"{e}{_grads_diagnosis(got, want, local, members, rank, ref.names)}", mistake="mean",
                           hint=_HINTS["mean"]) from None


def _grads_diagnosis(got, want, local, members, rank, names) -> str:
    n = len(members)
    close = lambda a, b: a is not None and torch.allclose(a, b, rtol=1e-8, atol=1e-10)  # noqa: E731
    group_sum = [w * n for w in want]
    known = [("that is the sum over the group's ranks: divide by its size, td.get_world_size(group)", group_sum),
             (f"that is the group's sum divided by {WORLD_SIZE}, the whole world's size: use "
              f"td.get_world_size(group) ({n} here)", [s / WORLD_SIZE for s in group_sum]),
             (f"that is the mean over all {WORLD_SIZE} ranks, not over the {n} of this group: pass group=group to "
              "the all-reduce", _mean(list(local.values()))),
             ("every .grad is this rank's own gradient: the all-reduced buffers never reached .grad — copy each "
              "bucket's averaged slices back into the parameters' .grad", local[rank])]
    for text, value in known:
        if all(close(g, v) for g, v in zip(got, value, strict=True)):
            return f": {text}"
    mine = [names[i] for i, (g, w, m) in enumerate(zip(got, want, local[rank], strict=True))
            if not close(g, w) and close(g, m)]
    if mine:
        return f": {', '.join(mine)} still hold this rank's own gradient — their bucket's average never reached them"
    return ""


@check("2.5", "bucketed DDP from gradient hooks", hint=Hint(
    nudge="follow one backward: in which order do the gradients arrive, when does each bucket's all-reduce start, "
          "and what does finish() leave in .grad?",
    idea="buckets in reverse registration order up to bucket_bytes; a post-accumulate-grad hook per parameter "
         "launches its bucket's async all-reduce once the bucket is complete; finish() waits, divides by the "
         "group's size and copies the averages back",
    formula=_FORMULA))
def bucketed_ddp(cls):
    """`cls(module, bucket_bytes, group)`: a wrapper with `.buckets` (lists of parameters) and `finish()`, after which
    every parameter's .grad holds the mean of the ranks' gradients over `group`."""
    if inspect.isclass(cls) and any(unwritten(f) for f in vars(cls).values()):
        raise NotImplementedError  # a generated exercise's class: not attempted, without starting the ranks
    cases = _cases(fresh_rng())
    refs = [_Reference.of(case) for case in cases]
    try:
        per_rank = cluster().run(_on_rank, cls, cases, timeout=TIMEOUT_S)
    except TimeoutError:
        raise Mismatch(f"the ranks had not finished after {TIMEOUT_S:g} s: some rank waits in a collective that "
                       "another rank of its group never calls — pass group=group to every collective, and wait "
                       "only for handles of all-reduces you launched", mistake="overlap", hint=_HINTS["overlap"]) \
            from None
    for partition in range(len(PARTITIONS)):
        for r in (rank[partition] for rank in per_rank):
            for case, ref, result in zip(cases, refs, r["results"], strict=True):
                where = _where(case, r["rank"], r["members"])
                _check_buckets(result["buckets"], ref, case, where)
                for step in range(STEPS):
                    _check_launches([x for x in result["launches"] if x["step"] == step], ref, step, where)
                    _check_grads(result["grads"][step], ref, step, r["rank"], r["members"], where)
