"""Exercise 3.1's check: ZeRO-1's sharded AdamW step, on real ranks.

The learner's function travels to the ranks by value (cloudpickle) and runs inside a ZeRO-1 training loop that the
check provides: every rank computes the gradient of a small float64 MLP on its rows of the batch, the check
all-reduces and averages it into a flat, zero-padded buffer of P = N·⌈Ψ/N⌉ elements, the learner's function updates
this rank's shard [lo, hi) of the parameters and Adam moments, and the check all-gathers the shards into every
rank's parameters. After a few steps the parameters must equal `torch.optim.AdamW` run on the whole batch in one
process. World sizes 2, 3 and 4 run on subgroups of one `llmlab.dist.Cluster(4)` (`_common.cluster()`); Ψ is chosen
so that N does not divide it, so the last rank's shard holds padding. When the answer matches a known mistake (no
bias correction, L2 instead of decoupled weight decay, ε inside the square root, the moments rebound instead of
updated in place...) the check names it.
"""

from __future__ import annotations

import dataclasses
import random

import torch
import torch.distributed as td

from llmlab import dist
from llmlab.checks import Hint, Mismatch, assert_close, check, fresh_rng
from llmlab.checks.ch03._common import TIMEOUT_S, WORLD_SIZES, cluster

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
    def num_params(self) -> int:
        d_in, d_h, d_out = self.sizes
        return d_in * d_h + d_h + d_h * d_out + d_out


def _zero_cases(rng: random.Random) -> list[_ZeroCase]:
    cases = []
    for world in WORLD_SIZES:
        while True:
            sizes = (rng.randint(2, 9), rng.randint(3, 17), rng.randint(1, 5))
            case = _ZeroCase(world, sizes, rng.randint(1, 3), 3, rng.choice([1e-2, 3e-2]),
                             rng.choice([(0.9, 0.999), (0.8, 0.95)]), rng.choice([1e-8, 1e-6]),
                             rng.choice([0.1, 0.3]), rng.randrange(2**31))
            if case.num_params % world:  # the last rank's shard holds padding
                cases.append(case)
                break
    return cases


def _mlp(case: _ZeroCase):
    """The case's MLP parameters, float64 leaves [W1 (h, in), b1 (h,), W2 (out, h), b2 (out,)], from its seed."""

    gen = torch.Generator().manual_seed(case.seed)
    d_in, d_h, d_out = case.sizes
    shapes = [(d_h, d_in), (d_h,), (d_out, d_h), (d_out,)]
    return [(torch.randn(s, generator=gen, dtype=torch.float64) * 0.5).requires_grad_() for s in shapes]


def _mlp_loss(params, x, y):
    w1, b1, w2, b2 = params
    return torch.nn.functional.mse_loss(torch.tanh(x @ w1.T + b1) @ w2.T + b2, y)


def _batch(case: _ZeroCase, step: int):
    """The whole batch of `step`: x (world·rows, in), y (world·rows, out)."""

    gen = torch.Generator().manual_seed(case.seed + 7919 * step)
    n = case.world * case.rows
    return (torch.randn(n, case.sizes[0], generator=gen, dtype=torch.float64),
            torch.randn(n, case.sizes[2], generator=gen, dtype=torch.float64))


def _group(world: int):
    """On a rank: the group of ranks 0 … world-1 (its dist.Grid built once, by every rank), None outside it."""
    if world not in _groups:
        _groups[world] = dist.Grid(dp=world, ranks=range(world))
    return _groups[world].dp_group if _groups[world].member else None


def _zero1_on_rank(fn, cases):
    """ZeRO-1 training of each case's MLP with the learner's shard update `fn`; this rank's view of the result."""

    groups = {w: _group(w) for w in WORLD_SIZES}  # every rank creates every group, first thing, in order
    out = []
    for case in cases:
        group = groups[case.world]
        if group is None:
            out.append(None)
            continue
        n, r = case.world, td.get_rank(group)
        params = _mlp(case)
        psi = case.num_params
        S = -(-psi // n)  # shard size ⌈Ψ/N⌉
        P = n * S  # the padded flat size
        lo, hi = r * S, (r + 1) * S
        shard = torch.cat([p.detach().reshape(-1) for p in params] + [torch.zeros(P - psi, dtype=torch.float64)])[
            lo:hi].clone()  # (S,) this rank's fp64 "master" slice
        exp_avg, exp_avg_sq = torch.zeros(S, dtype=torch.float64), torch.zeros(S, dtype=torch.float64)
        returned = None  # what fn returned, when it is not None or the new shard
        history = []  # (Ψ,) parameters after each step
        for t in range(1, case.steps + 1):
            x, y = _batch(case, t)
            mine = slice(r * case.rows, (r + 1) * case.rows)
            for p in params:
                p.grad = None
            _mlp_loss(params, x[mine], y[mine]).backward()
            flat_grad = torch.cat([p.grad.reshape(-1) for p in params]
                                  + [torch.zeros(P - psi, dtype=torch.float64)])  # (P,)
            td.all_reduce(flat_grad, group=group)
            flat_grad /= n  # the average gradient, everywhere
            result = fn(flat_grad, lo, hi, shard, exp_avg, exp_avg_sq, t, case.lr, case.betas, case.eps,
                        case.weight_decay)
            if isinstance(result, torch.Tensor) and tuple(result.shape) == (S,):
                if result is not shard:  # a returned shard is taken as the new one
                    shard.copy_(result.detach())
            elif result is not None:
                returned = (f"a tensor of shape {tuple(result.shape)}" if isinstance(result, torch.Tensor)
                            else f"{type(result).__name__} {result!r:.40}")
            full = torch.empty(P, dtype=torch.float64)
            td.all_gather_into_tensor(full, shard.contiguous(), group=group)  # the all-gather (given)
            with torch.no_grad():
                offset = 0
                for p in params:
                    p.copy_(full[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
            history.append(full[:psi].clone())
        out.append({"rank": r, "lo": lo, "hi": hi, "S": S, "returned": returned, "history": history,
                    "exp_avg": exp_avg,
                    "exp_avg_sq": exp_avg_sq, "nan": bool(torch.isnan(shard).any())})
    return out


def _reference(case: _ZeroCase):
    """torch.optim.AdamW on the whole batch in one process: ([flat parameters (Ψ,) after each step], exp_avg (Ψ,),
    exp_avg_sq (Ψ,) after the last)."""

    params = _mlp(case)
    opt = torch.optim.AdamW(params, lr=case.lr, betas=case.betas, eps=case.eps, weight_decay=case.weight_decay,
                            foreach=False)
    flat = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts])  # noqa: E731
    history = []
    for t in range(1, case.steps + 1):
        opt.zero_grad(set_to_none=True)
        _mlp_loss(params, *_batch(case, t)).backward()
        opt.step()
        history.append(flat(params))
    return history, flat(opt.state[p]["exp_avg"] for p in params), flat(opt.state[p]["exp_avg_sq"] for p in params)


# Known mistakes, each a variant of the update that the whole-batch run below reproduces.
_VARIANTS = {
    "no bias correction": "the moments are used without bias correction: divide exp_avg by (1 − β1^step) and "
                          "exp_avg_sq by (1 − β2^step) before the update (step counts from 1)",
    "L2": "that is Adam with L2 regularisation (weight_decay·param added to the gradient); AdamW decays the "
          "parameter itself, decoupled from the moments: shard.mul_(1 − lr·weight_decay)",
    "no decay": "the weight decay is missing: AdamW first multiplies the parameter by (1 − lr·weight_decay)",
    "decay without lr": "the parameter is multiplied by (1 − weight_decay): AdamW's decay is scaled by the learning "
                        "rate, (1 − lr·weight_decay)",
    "decay after": "the weight decay is applied after the Adam update; AdamW (and torch.optim.AdamW) decays the "
                   "old parameter, first: shard.mul_(1 − lr·weight_decay), then the update",
    "eps inside": "ε is inside the square root: AdamW divides by √v̂ + ε, not √(v̂ + ε)",
    "fresh moments": "exp_avg and exp_avg_sq start from zero at every step: update them in place "
                     "(exp_avg.mul_(β1).add_(g, alpha=1 − β1)); `exp_avg = …` rebinds a local name, so the moments "
                     "never carry over to the next step",
    "decay only": "only the weight decay reached the shard: the Adam update was computed but never written into it "
                  "— `shard = shard − …` rebinds a local name; use shard.addcdiv_(…) (in place) or return the new "
                  "shard",
}


def _variant(case: _ZeroCase, kind: str):
    """The whole-batch trajectory of AdamW with the mistake `kind`: flat parameters (Ψ,)."""

    params = _mlp(case)
    (b1, b2), lr, wd, eps = case.betas, case.lr, case.weight_decay, case.eps
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t in range(1, case.steps + 1):
        for p in params:
            p.grad = None
        _mlp_loss(params, *_batch(case, t)).backward()
        if kind == "fresh moments":
            m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
        with torch.no_grad():
            for p, mi, vi in zip(params, m, v, strict=True):
                g = p.grad + wd * p if kind == "L2" else p.grad
                if kind not in ("L2", "no decay", "decay after"):
                    p.mul_(1 - (wd if kind == "decay without lr" else lr * wd))
                mi.mul_(b1).add_(g, alpha=1 - b1)
                vi.mul_(b2).addcmul_(g, g, value=1 - b2)
                m_hat, v_hat = (mi, vi) if kind == "no bias correction" else (mi / (1 - b1**t), vi / (1 - b2**t))
                denom = (v_hat + eps).sqrt() if kind == "eps inside" else v_hat.sqrt() + eps
                if kind != "decay only":
                    p.sub_(lr * m_hat / denom)
                if kind == "decay after":
                    p.mul_(1 - lr * wd)
    return torch.cat([p.detach().reshape(-1) for p in params])


def _zero_diagnosis(case: _ZeroCase, got, nan: bool) -> str:
    if torch.equal(got, _mlp_flat_init(case)):
        return (": the parameters never changed: update `shard` in place (shard.mul_, shard.addcdiv_, or "
                "shard.copy_(new)) or return the new shard; `shard = ...` only rebinds a local name")
    if nan or torch.isnan(got).any():
        return (": NaN appeared in a shard — the padding's gradient and moments are 0, so the update m̂ / (√v̂ + ε) "
                "needs ε added to √v̂ (0 / 0 is NaN)")
    for kind, text in _VARIANTS.items():
        if torch.allclose(got, _variant(case, kind), rtol=1e-7, atol=1e-10):
            return f": {text}"
    return ""


def _mlp_flat_init(case: _ZeroCase):
    return torch.cat([p.detach().reshape(-1) for p in _mlp(case)])


@check("3.1", "ZeRO-1's sharded AdamW step", hint=Hint(
    nudge="look at which elements your update touches and whether it changes the shard and the moments in place",
    idea="AdamW on this rank's slice only: decay the weights, update both moments from the slice of the gradient, "
         "correct their bias for the step and move the shard — every tensor changed in place",
    formula="work on this rank's slice only: g = flat_grad[lo:hi]; then, all in place on the (hi − lo,) tensors: "
            "shard.mul_(1 − lr·weight_decay); exp_avg = β1·exp_avg + (1 − β1)·g; exp_avg_sq = β2·exp_avg_sq + "
            "(1 − β2)·g²; m̂ = exp_avg / (1 − β1^step), v̂ = exp_avg_sq / (1 − β2^step); shard −= lr·m̂ / (√v̂ + ε)"))
def adamw_shard_step(fn):
    """`fn(flat_grad, lo, hi, shard, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay)`: AdamW on this rank's
    shard. flat_grad (P,) is the averaged gradient of all the (padded, flattened) parameters; shard, exp_avg and
    exp_avg_sq (hi − lo,) this rank's slice of the parameters and of Adam's moments, updated in place (or the new
    shard returned); step counts from 1."""

    cases = _zero_cases(fresh_rng())
    per_rank = cluster().run(_zero1_on_rank, fn, cases, timeout=TIMEOUT_S)
    # float64, the same operations up to their order (the gradient averaged over ranks vs one whole-batch mean):
    # the gradients differ by ~2⁻⁵³ of their terms (~1e-16), which Adam's m̂/(√v̂ + ε) magnifies by at most 1/ε
    # where g ≈ 0 (≤ 1e8): lr·1e8·1e-16 ≤ 3e-10 on a parameter, and only for a gradient within ε of 0 (chance
    # ~1e-8 per parameter); elsewhere ~1e-15 apart. rtol 1e-9 of a parameter (~0.5) covers that; every named
    # mistake moves the parameters by ~lr, 1e-2.
    tol = dict(rtol=1e-9, atol=1e-12)
    for i, case in enumerate(cases):
        history, want_m, want_v = _reference(case)
        psi, n = case.num_params, case.world
        results = [r[i] for r in per_rank if r[i] is not None]
        S = results[0]["S"]
        where = (f"{n} ranks, an MLP {case.sizes[0]} → {case.sizes[1]} → {case.sizes[2]} (Ψ = {psi} parameters, "
                 f"shards of {S}, the last padded), lr={case.lr:g}, betas={case.betas}, eps={case.eps:g}, "
                 f"weight_decay={case.weight_decay:g}")
        for r in results:
            if r["returned"] is not None:
                raise Mismatch(f"{where}: rank {r['rank']}'s call returned {r['returned']}; update the shard in "
                               f"place and return None (or return the new shard, of shape ({S},))")
        for t, (got, want) in enumerate(zip(results[0]["history"], history, strict=True), start=1):
            if torch.allclose(got, want, **tol):
                continue
            wrong = sorted({int(k) // S for k in (~torch.isclose(got, want, **tol)).nonzero()})
            ranks = f"rank{'s' * (len(wrong) > 1)} {', '.join(map(str, wrong))}"
            diagnosis = _zero_diagnosis(case, results[0]["history"][-1], any(r["nan"] for r in results))
            if not diagnosis and len(wrong) < n:
                diagnosis = (f": only the shard{'s' * (len(wrong) > 1)} of {ranks} differ{'s' * (len(wrong) == 1)} "
                             "— rank r owns flat elements [lo, hi) = [r·S, (r+1)·S): take the gradient slice "
                             "flat_grad[lo:hi]")
            try:
                assert_close(got, want, what=f"{where}: the parameters after step {t}'s all-gather", **tol)
            except Mismatch as e:
                raise Mismatch(f"{e}; the shards of {ranks} differ{diagnosis}") from None
        for r in results:
            pad = torch.zeros(n * S - psi, dtype=torch.float64)
            for name, got_state, want_state in (("exp_avg", r["exp_avg"], want_m),
                                                ("exp_avg_sq", r["exp_avg_sq"], want_v)):
                mine = torch.cat([want_state, pad])[r["lo"]:r["hi"]]
                if not torch.allclose(got_state, mine, **tol):
                    hint = (" (it is still all zeros: update it in place, e.g. exp_avg.mul_(β1).add_(g, alpha=1 − β1); "
                            "`exp_avg = …` rebinds a local name, and the next step starts from zero again)"
                            if not got_state.any() else "")
                    assert_close(got_state, mine, what=f"{where}: rank {r['rank']}'s {name} after the last step{hint}",
                                 **tol)

