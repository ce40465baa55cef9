"""Exercise 3.1's check: a whole ZeRO-1 step, on real ranks.

The learner's `zero1_step(params, state, step, lr, betas, eps, weight_decay, group)` travels to the ranks by value
(cloudpickle) and is called after each backward of a small float64 MLP, every rank on its own rows of the batch. It
must flatten the gradients into one buffer, pad it to P = N·S elements (S = ⌈Ψ/N⌉), reduce-scatter and average it,
run AdamW on this rank's master shard with shard-sized moments kept in `state`, and all-gather the updated shards
into every rank's parameters. Beside it, on the same ranks and rows, llmlab's own `ZeRO(model, stage=1)`
(`llmlab.memory.zero`; tests/test_memory_zero.py shows it trains like `torch.optim.AdamW` on the whole batch) trains
an identical MLP: the reference.

World sizes 1–4 run on subgroups of one `llmlab.dist.Cluster(4)` (`_common.cluster()`), one call per world; for
N > 1, Ψ is drawn so that N does not divide it and the last rank's shard holds padding. After every step each rank's
parameters must equal every other rank's and ZeRO's; after the last, every tensor in `state` must hold at most S
elements of memory (really sharded), and the step must not all-reduce (ZeRO-1 reduce-scatters: each rank receives
only its shard). When the answer matches a known mistake the check names it: no padding, an off-by-one slice, a sum
instead of the mean, no bias correction, L2 instead of decoupled weight decay, ε inside the square root, the moments
rebound instead of updated in place, no all-gather, full-size state, a slice that keeps the whole buffer alive.
"""

from __future__ import annotations

import dataclasses
import random
import re

import torch
import torch.distributed as td

from llmlab import dist
from llmlab.checks import Hint, Mismatch, assert_close, check, fresh_rng, not_attempted
from llmlab.checks.ch03._common import TIMEOUT_S, WORLD_SIZES, cluster
from llmlab.dist.commlog import CommLog
from llmlab.memory.zero import ZeRO

_groups: dict = {}  # on the ranks: world size -> the dist.Grid of ranks 0 … world-1


@dataclasses.dataclass(frozen=True)
class _ZeroCase:
    world: int
    sizes: tuple[int, int, int]  # MLP in -> hidden -> out
    rows: int  # batch rows per rank
    steps: int
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    seed: int

    @property
    def num_params(self) -> int:  # Ψ
        d_in, d_h, d_out = self.sizes
        return d_in * d_h + d_h + d_h * d_out + d_out

    @property
    def shard(self) -> int:  # S = ⌈Ψ/N⌉
        return -(-self.num_params // self.world)

    @property
    def padded(self) -> int:  # P = N·S
        return self.world * self.shard


def _zero_cases(rng: random.Random) -> list[_ZeroCase]:
    cases = []
    for world in WORLD_SIZES:
        while True:
            sizes = (rng.randint(2, 9), rng.randint(3, 17), rng.randint(1, 5))
            # ε of 1e-6 or 1e-5: Adam's m̂/(√v̂ + ε) does not change when the gradient is scaled, except through ε,
            # so a sum over ranks instead of the mean moves a parameter by ~lr·ε/|g|·(1 − 1/N) ≥ 5e-9 (|g| ≤ 1),
            # ten times the tolerance below; a smaller ε would hide that mistake
            case = _ZeroCase(world, sizes, rng.randint(1, 3), 3, rng.choice([1e-2, 3e-2]),
                             rng.choice([(0.9, 0.999), (0.8, 0.95)]), rng.choice([1e-6, 1e-5]),
                             rng.choice([0.1, 0.3]), rng.randrange(2**31))
            if world == 1 or case.num_params % world:  # the last rank's shard holds padding
                cases.append(case)
                break
    return cases


class _MLP(torch.nn.Module):
    """The case's float64 MLP, tanh(x W1ᵀ + b1) W2ᵀ + b2, its parameters drawn from the case's seed."""

    def __init__(self, case: _ZeroCase):
        super().__init__()
        gen = torch.Generator().manual_seed(case.seed)
        d_in, d_h, d_out = case.sizes
        for name, shape in (("w1", (d_h, d_in)), ("b1", (d_h,)), ("w2", (d_out, d_h)), ("b2", (d_out,))):
            setattr(self, name, torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64) * 0.5))

    def forward(self, x):  # (rows, in) -> (rows, out)
        return torch.tanh(x @ self.w1.T + self.b1) @ self.w2.T + self.b2


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def _batch(case: _ZeroCase, step: int):
    """The whole batch of `step`: x (world·rows, in), y (world·rows, out)."""

    gen = torch.Generator().manual_seed(case.seed + 7919 * step)
    n = case.world * case.rows
    return (torch.randn(n, case.sizes[0], generator=gen, dtype=torch.float64),
            torch.randn(n, case.sizes[2], generator=gen, dtype=torch.float64))


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])  # (Ψ,) a copy


def _group(world: int):
    """On a rank: the group of ranks 0 … world-1 (its dist.Grid built once, by every rank), None outside it."""
    if world not in _groups:
        _groups[world] = dist.Grid(dp=world, ranks=range(world))
    return _groups[world].dp_group if _groups[world].member else None


def _tensors(obj, path: str):
    """(path, tensor) for every tensor in `obj`, looking into dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, f"{path}[{key!r}]")
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{path}[{i}]")


def _case_on_rank(fn, case: _ZeroCase):
    """`case` trained with the learner's zero1_step and with llmlab's ZeRO-1 side by side; this rank's view."""

    groups = {w: _group(w) for w in WORLD_SIZES}  # every rank creates every group, first thing, in order
    group = groups[case.world]
    if group is None:
        return None
    r = td.get_rank(group)
    model = _MLP(case)
    zero = ZeRO(_MLP(case), stage=1, lr=case.lr, betas=case.betas, eps=case.eps, weight_decay=case.weight_decay,
                group=group)
    params, state, ops = list(model.parameters()), {}, set()
    mine = slice(r * case.rows, (r + 1) * case.rows)
    history, reference = [], []  # (Ψ,) parameters after each step: the learner's, ZeRO's
    for t in range(1, case.steps + 1):
        x, y = _batch(case, t)
        model.zero_grad(set_to_none=True)
        _loss(model, x[mine], y[mine]).backward()
        with CommLog() as log:
            fn(params, state, t, case.lr, case.betas, case.eps, case.weight_decay, group)
        ops.update(log.by_op())
        history.append(_flat(params))
        zero.zero_grad()
        _loss(zero, x[mine], y[mine]).backward()
        zero.step()
        reference.append(_flat(zero.params))
    kept = [(path, t.numel(), t.untyped_storage().nbytes() // t.element_size()) for path, t in _tensors(state, "state")]
    return {"rank": r, "history": history, "reference": reference, "ops": sorted(ops), "state": kept,
            "nan": any(bool(torch.isnan(t).any()) for _, t in _tensors(state, "") if t.is_floating_point())}


# Known mistakes in the AdamW update, each a variant that the whole-batch run below reproduces.
_VARIANTS = {
    "sum": "the gradient is the sum over the ranks, not their mean: reduce-scatter adds every rank's slice, so "
           "divide what it returns by N (Adam hides a scaled gradient except through ε, so the parameters are "
           "close but not equal)",
    "no bias correction": "the moments are used without bias correction: divide exp_avg by (1 − β1^step) and "
                          "exp_avg_sq by (1 − β2^step) before the update (step counts from 1)",
    "L2": "that is Adam with L2 regularisation (weight_decay·param added to the gradient); AdamW decays the "
          "parameter itself, decoupled from the moments: master.mul_(1 − lr·weight_decay)",
    "no decay": "the weight decay is missing: AdamW first multiplies the parameter by (1 − lr·weight_decay)",
    "decay without lr": "the parameter is multiplied by (1 − weight_decay): AdamW's decay is scaled by the learning "
                        "rate, (1 − lr·weight_decay)",
    "decay after": "the weight decay is applied after the Adam update; AdamW (and torch.optim.AdamW) decays the "
                   "old parameter, first: master.mul_(1 − lr·weight_decay), then the update",
    "eps inside": "ε is inside the square root: AdamW divides by √v̂ + ε, not √(v̂ + ε)",
    "no eps": "ε is missing: AdamW divides by √v̂ + ε (without it the padding's 0 / 0 is NaN)",
    "fresh moments": "the moments start from zero at every step: keep them in `state` and update them in place "
                     "(exp_avg.mul_(β1).add_(g, alpha=1 − β1)); `exp_avg = …` rebinds a local name, so what `state` "
                     "holds never changes",
}


def _variant(case: _ZeroCase, kind: str):
    """The whole-batch trajectory of AdamW with the mistake `kind`: flat parameters (Ψ,) after the last step."""

    model = _MLP(case)
    params = list(model.parameters())
    (b1, b2), lr, wd, eps = case.betas, case.lr, case.weight_decay, case.eps
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t in range(1, case.steps + 1):
        for p in params:
            p.grad = None
        _loss(model, *_batch(case, t)).backward()
        if kind == "fresh moments":
            m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
        with torch.no_grad():
            for p, mi, vi in zip(params, m, v, strict=True):
                g = p.grad * case.world if kind == "sum" else p.grad
                g = g + wd * p if kind == "L2" else g
                if kind not in ("L2", "no decay", "decay after"):
                    p.mul_(1 - (wd if kind == "decay without lr" else lr * wd))
                mi.mul_(b1).add_(g, alpha=1 - b1)
                vi.mul_(b2).addcmul_(g, g, value=1 - b2)
                m_hat, v_hat = (mi, vi) if kind == "no bias correction" else (mi / (1 - b1**t), vi / (1 - b2**t))
                denom = {"eps inside": (v_hat + eps).sqrt(), "no eps": v_hat.sqrt()}.get(kind, v_hat.sqrt() + eps)
                p.sub_(lr * m_hat / denom)
                if kind == "decay after":
                    p.mul_(1 - lr * wd)
    return _flat(params)


def _trajectory_diagnosis(case: _ZeroCase, got, nan: bool, wrong: list[int]) -> str:
    if torch.equal(got, _flat(_MLP(case).parameters())):
        return (": the parameters never changed: copy the all-gathered (P,) buffer back into them, "
                "p.copy_(full[offset:offset + p.numel()].view_as(p)) under torch.no_grad()")
    if nan or torch.isnan(got).any():
        return (": NaN appeared — the padding's gradient and moments are 0, so the update m̂ / (√v̂ + ε) needs ε "
                "added to √v̂ (0 / 0 is NaN)")
    for kind, text in _VARIANTS.items():
        if kind == "sum" and case.world == 1:
            continue  # one rank: the sum is the mean
        if torch.allclose(got, _variant(case, kind), rtol=1e-7, atol=1e-10):
            return f": {text}"
    if len(wrong) < case.world:
        return (f" — rank r owns flat elements [r·S, (r+1)·S) = [r·{case.shard}, (r+1)·{case.shard}): its master "
                "starts as that slice of the flattened parameters, and reduce-scatter gives it that slice of the "
                "gradient")
    return ""


def _error_diagnosis(case: _ZeroCase, message: str) -> str | None:
    """What a size error on the ranks says about the answer, or None when it is no known mistake."""
    found = re.search(r"\((\d+) vs\. (\d+)\)|tensor a \((\d+)\) must match the size of tensor b \((\d+)\)", message)
    if not found:
        return None
    sizes = {int(s) for s in found.groups() if s is not None}
    psi, S, P = case.num_params, case.shard, case.padded
    if P != psi and psi in sizes:
        return (f"Ψ = {psi} is not a multiple of N = {case.world}: pad the flat buffer with P − Ψ = {P - psi} zeros "
                f"to P = N·⌈Ψ/N⌉ = {P}, so that reduce-scatter and all-gather cut it into N shards of S = {S}")
    if sizes in ({S - 1, S}, {S + 1, S}):
        return (f"a shard is one element off: rank r's slice is [lo, hi) = [r·S, (r+1)·S), hi excluded, S = ⌈Ψ/N⌉ "
                f"= {S} elements (here {sorted(sizes)} met)")
    return None


def _run_world(fn, case: _ZeroCase, where: str) -> list[dict]:
    """The case on its ranks: every member rank's result, or Mismatch naming a known mistake that raised there."""
    try:
        per_rank = cluster().run(_case_on_rank, fn, case, timeout=TIMEOUT_S)
    except dist.RankError as e:
        if not_attempted(e):
            raise
        first = re.sub(r"^\[rank\d+\]:\[[^\]]*\]\s*", "", e.message.strip().splitlines()[0] if e.message else "")
        named = _error_diagnosis(case, e.message)
        if named is None:
            raise
        raise Mismatch(f"{where}: rank {e.rank}'s zero1_step raised {e.exc_type} ({first}): {named}") from None
    except TimeoutError:
        raise Mismatch(f"{where}: the ranks had not finished after {TIMEOUT_S:g} s: some rank waits in a "
                       "collective that another rank of the group never calls — pass group=group to every "
                       "collective (the check runs a world of N ranks on a subgroup), and let every rank call the "
                       "same collectives in the same order") from None
    return [r for r in per_rank if r is not None]


def _check_state(case: _ZeroCase, results: list[dict], where: str) -> None:
    """Every tensor `state` keeps on a rank holds at most S elements of memory: the optimizer state is sharded."""
    S, psi, n = case.shard, case.num_params, case.world
    for r in results:
        if not r["state"]:
            raise Mismatch(f"{where}: rank {r['rank']}'s state holds no tensor after the step: keep this rank's "
                           "master shard and its moments in `state` (the same dict comes back at every step)")
        for path, numel, stored in r["state"]:
            if numel > S and numel >= psi and n > 1:
                mistake, problem = "full state", (
                    f"holds {numel} elements, the whole model's: that is plain data parallelism's state; ZeRO-1 "
                    f"keeps only this rank's shard, S = ⌈Ψ/N⌉ = {S} elements, of the master and of each moment")
            elif numel == S + 1:
                mistake, problem = "shard size", (
                    f"holds {numel} elements, one more than the shard's S = ⌈Ψ/N⌉ = {S}: compute it as -(-Ψ // N), "
                    "not Ψ // N + 1 (the two differ when N divides Ψ)")
            elif numel > S:
                mistake, problem = "shard size", f"holds {numel} elements, more than the shard's S = ⌈Ψ/N⌉ = {S}"
            elif stored > S:
                mistake, problem = "view", (
                    f"is a view of a {stored}-element buffer: its {numel} elements keep the whole storage alive, so "
                    f"the rank holds {stored} values, not S = {S} — copy the slice (flat[lo:hi].clone(), or "
                    ".to(dtype, copy=True))")
            else:
                continue
            raise Mismatch(f"{where}: on rank {r['rank']}, {path} {problem}", mistake=mistake)


@check("3.1", "A ZeRO-1 step: reduce-scatter, sharded AdamW, all-gather", hint=Hint(
    nudge="follow one rank through the step: how many elements each buffer holds (Ψ, P = N·S, S = ⌈Ψ/N⌉), which "
          "collective fills it, and what `state` keeps from one step to the next",
    idea="flatten the gradients into one buffer padded with zeros to P = N·⌈Ψ/N⌉ and reduce-scatter it (each rank "
         "receives the sum of its slice; divide by N); run AdamW — decoupled weight decay, bias-corrected moments — "
         "on this rank's master shard, with moments of the shard's size, all kept in `state`; then all-gather every "
         "rank's shard and copy the first Ψ values back into the parameters",
    formula="S = -(-Ψ // N), lo = rank·S; at step 1 state['master'] = flat_params[lo:lo+S] copied, moments "
            "zeros(S); every step: g = (S,) from td.reduce_scatter_single(g, cat(grads + [zeros(N·S − Ψ)]), "
            "group=group), g /= N; master.mul_(1 − lr·wd); m = β1·m + (1 − β1)·g; v = β2·v + (1 − β2)·g² (in place); "
            "master −= lr·(m / (1 − β1^step)) / (√(v / (1 − β2^step)) + ε); td.all_gather_single(full, master, "
            "group=group) into a (N·S,) buffer; copy full[:Ψ] back into the parameters under torch.no_grad()"))
def zero1_step(fn):
    """`fn(params, state, step, lr, betas, eps, weight_decay, group)`: one ZeRO-1 AdamW step on this rank of `group`,
    after backward left this rank's gradient in every p.grad; `state` is this rank's dict (empty at step 1, the same
    dict at every later step), step counts from 1. Run on 1, 2, 3 and 4 gloo ranks against llmlab's ZeRO-1."""

    # float64, the same operations up to their order (ZeRO's flat buffer holds the parameters in reverse order, and
    # its AdamW groups the bias corrections differently): the averaged gradients differ by ~2⁻⁵³ of their terms
    # (~1e-16), which Adam's m̂/(√v̂ + ε) magnifies by at most 1/ε (≤ 1e6) where g ≈ 0: lr·1e6·1e-16 ≤ 3e-12 on a
    # parameter; elsewhere ~1e-15 apart. rtol 1e-9 of a parameter (~0.5) covers that; every named mistake moves
    # the parameters by ≥ 5e-9 (a sum instead of the mean, see _zero_cases), most by ~lr = 1e-2.
    tol = dict(rtol=1e-9, atol=1e-12)
    for case in _zero_cases(fresh_rng()):
        psi, n, S = case.num_params, case.world, case.shard
        where = (f"{n} rank{'s' * (n > 1)}, an MLP {case.sizes[0]} → {case.sizes[1]} → {case.sizes[2]} (Ψ = {psi} "
                 f"parameters, shards of S = {S}{', the last padded' if case.padded > psi else ''}), lr={case.lr:g}, "
                 f"betas={case.betas}, eps={case.eps:g}, weight_decay={case.weight_decay:g}")
        results = _run_world(fn, case, where)
        for t in range(case.steps):
            first = results[0]["history"][t]
            for r in results[1:]:
                if not torch.equal(r["history"][t], first):
                    differ = sorted({int(k) // S for k in (r["history"][t] != first).nonzero()})
                    raise Mismatch(f"{where}: after step {t + 1} rank {r['rank']}'s parameters differ from rank 0's "
                                   f"(in the shards of ranks {', '.join(map(str, differ))}): each rank updated only "
                                   "its own shard — all-gather every rank's updated master shard into a (P,) buffer "
                                   "and copy all of it back into the parameters, on every rank", mistake="all-gather")
            want = results[0]["reference"][t]
            if torch.allclose(first, want, **tol):
                continue
            wrong = sorted({int(k) // S for k in (~torch.isclose(first, want, **tol)).nonzero()})
            ranks = f"rank{'s' * (len(wrong) > 1)} {', '.join(map(str, wrong))}"
            diagnosis = _trajectory_diagnosis(case, results[0]["history"][-1], any(r["nan"] for r in results), wrong)
            try:
                assert_close(first, want, what=f"{where}: the parameters after step {t + 1}, against llmlab's ZeRO-1",
                             **tol)
            except Mismatch as e:
                raise Mismatch(f"{e}; the shards of {ranks} differ{diagnosis}") from None
        _check_state(case, results, where)
        if any("torch.all_reduce" in r["ops"] for r in results):
            raise Mismatch(f"{where}: your step all-reduced: ZeRO-1 reduce-scatters the gradient, so each rank "
                           "receives only its shard's sum (Ψ·(N−1)/N values sent per rank, half an all-reduce's) — "
                           "td.reduce_scatter_single(out, flat, group=group) with out of shape (S,)",
                           mistake="all-reduce")
