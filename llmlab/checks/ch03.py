"""Checks for chapter 3's exercises (solutions/03_memory.ipynb): ZeRO-1's sharded AdamW step, activation
checkpointing from scratch, and 8-bit saved-tensor hooks.

    from llmlab.checks import ch03 as check
    check.adamw_shard_step(adamw_shard_step)    # 3.1, on 2, 3 and 4 gloo ranks
    check.checkpoint(checkpoint)                # 3.2
    check.pack_hooks(pack_8bit, unpack_8bit)    # 3.3

**3.1 runs on real ranks.** The learner's function travels to the ranks by value (cloudpickle) and runs inside a
ZeRO-1 training loop that the check provides: every rank computes the gradient of a small float64 MLP on its rows
of the batch, the check all-reduces and averages it into a flat, zero-padded buffer of P = N·⌈Ψ/N⌉ elements,
the learner's function updates this rank's shard [lo, hi) of the parameters and Adam moments, and the check
all-gathers the shards into every rank's parameters. After a few steps the parameters must equal
`torch.optim.AdamW` run on the whole batch in one process. World sizes 2, 3 and 4 run on subgroups of one
`llmlab.dist.Cluster(4)`, started by the first check that needs it and reused (closed when Python exits, or by
`close()`); Ψ is chosen so that N does not divide it, so the last rank's shard holds padding. When the answer
matches a known mistake (no bias correction, L2 instead of decoupled weight decay, ε inside the square root, the
moments rebound instead of updated in place...) the check names it.

**3.2 and 3.3 run here**, on the CPU, on blocks of the chapter's GPT (`llmlab.model`), with fresh random sizes.
3.2 demands *bit-identical* outputs and gradients with dropout on, fewer saved bytes than the plain run (counted
by `llmlab.memory.measure.SavedActivations`), and the random stream left where the plain run leaves it. 3.3 checks
the round trip of single tensors against the min-max quantization bound (half an 8-bit step of the tensor's
range), then trains one step of the tiny GPT under the hooks: forward unchanged, saved bytes at most
`MAX_BYTES_RATIO` of fp32, gradients within `GRAD_ERROR_FACTOR` × the error of llmlab's own 8-bit compression.
"""

from __future__ import annotations

import dataclasses
import math
import random

import torch
import torch.distributed as td

from llmlab import checks, dist
from llmlab.checks import Mismatch, assert_close, check, fresh_rng
from llmlab.data import MarkovSource, SyntheticDataset
from llmlab.memory import checkpoint as library
from llmlab.memory import compress, measure
from llmlab.memory.measure import is_parameter
from llmlab.model import GPT, Block, GPTConfig

__all__ = ["adamw_shard_step", "checkpoint", "pack_hooks", "close", "WORLD_SIZES", "MAX_BYTES_RATIO",
           "GRAD_ERROR_FACTOR", "stored_bytes"]

WORLD_SIZES = (2, 3, 4)
TIMEOUT_S = 60.0  # one call on the ranks; a correct answer takes well under a second
# 3.3: 8-bit codes are 1/4 of fp32; per-group scales add a little (two fp32 per 128 values: +1.6%), token ids and
# masks stay as they are. 35% leaves room for groups as small as 32 values; 16-bit storage (50%) fails.
MAX_BYTES_RATIO = 0.35
# 3.3: a correct 8-bit min-max scheme moves the gradients by about as much as llmlab's own (groups of 128). Measured
# on the tiny GPT (relative to that): groups of 128 1×, one group per tensor ≈ 2.1×; 4× leaves room for any group
# size, while truncated codes (≈ 5×) or a missing offset are outside (and caught by the round trip first).
GRAD_ERROR_FACTOR = 4.0

_groups: dict = {}  # on the ranks: world size -> the dist.Grid of ranks 0 … world-1



close = checks.close_clusters  # stop the checks' ranks now (they also stop at interpreter exit)


def _ranks():
    return checks.cluster(max(WORLD_SIZES))


# --- 3.1: ZeRO-1's sharded AdamW step ----------------------------------------------------------------------------

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


@check("3.1", "ZeRO-1's sharded AdamW step",
       hint="work on this rank's slice only: g = flat_grad[lo:hi]; then, all in place on the (hi − lo,) tensors: "
            "shard.mul_(1 − lr·weight_decay); exp_avg = β1·exp_avg + (1 − β1)·g; exp_avg_sq = β2·exp_avg_sq + "
            "(1 − β2)·g²; m̂ = exp_avg / (1 − β1^step), v̂ = exp_avg_sq / (1 − β2^step); shard −= lr·m̂ / (√v̂ + ε)")
def adamw_shard_step(fn):
    """`fn(flat_grad, lo, hi, shard, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay)`: AdamW on this rank's
    shard. flat_grad (P,) is the averaged gradient of all the (padded, flattened) parameters; shard, exp_avg and
    exp_avg_sq (hi − lo,) this rank's slice of the parameters and of Adam's moments, updated in place (or the new
    shard returned); step counts from 1."""

    cases = _zero_cases(fresh_rng())
    per_rank = _ranks().run(_zero1_on_rank, fn, cases, timeout=TIMEOUT_S)
    tol = dict(rtol=1e-9, atol=1e-12)  # float64, the same operations up to their order: ~1e-15 apart
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


# --- 3.2: activation checkpointing from scratch ---------------------------------------------------------------

def _blocks(config, n: int, seed: int):
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    blocks = [Block(config) for _ in range(n)]  # training mode: dropout on
    torch.set_rng_state(state)
    return blocks


def _run_blocks(blocks, x0, coeff, seed: int, using):
    """Forward the blocks (each through `using(block, x)`, or plainly) from a fresh leaf copy of x0, backward
    Σ coeff·y; returns what the check compares."""


    for b in blocks:
        b.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    torch.manual_seed(seed)
    with measure.SavedActivations() as saved:
        h = x
        for b in blocks:
            h = b(h) if using is None else using(b, h)
    if not isinstance(h, torch.Tensor):
        raise Mismatch(f"checkpoint(block, x) returned {type(h).__name__}, expected the block's output tensor")
    connected = h.requires_grad
    if connected:
        (h * coeff).sum().backward()
    return {"y": h.detach(), "x_grad": x.grad, "grads": [p.grad for b in blocks for p in b.parameters()],
            "names": [f"block {i}'s {n}" for i, b in enumerate(blocks) for n, _ in b.named_parameters()],
            "saved": saved.bytes, "rng_after": torch.get_rng_state(), "connected": connected}


def _same(a, b) -> bool:
    return a is not None and b is not None and a.shape == b.shape and torch.equal(a, b)


@check("3.2", "activation checkpointing",
       hint="in forward (an autograd.Function's forward runs with grad off, so nothing inside fn is saved): keep "
            "ctx.fn = fn, ctx.rng = torch.get_rng_state() (before fn draws its dropout masks), "
            "ctx.save_for_backward(x), return fn(x); in backward: x = saved x .detach().requires_grad_(); inside "
            "`with torch.random.fork_rng(), torch.enable_grad():` restore torch.set_rng_state(ctx.rng) and run "
            "out = ctx.fn(x); then torch.autograd.backward(out, grad_out) (which also fills the parameters' "
            ".grad) and return None, x.grad")
def checkpoint(fn):
    """`fn(block, x)` → block(x), keeping only x (and the random state) for backward and recomputing block(x) in
    backward; x is (B, T, C) and requires grad."""


    rng = fresh_rng()
    # T = 1 and a single block; then sizes where one block's input (≥ 16 KB) is far more than the slack below
    for n_blocks, B, T, p in ((1, 1, 1, 0.5), (3, rng.randint(2, 3), rng.choice([33, 47]), 0.2),
                              (2, rng.randint(2, 4), 64, 0.1)):
        config = GPTConfig.preset("tiny", dropout=p)
        seeds = rng.randrange(2**31), rng.randrange(2**31)
        blocks = _blocks(config, n_blocks, seeds[0])
        gen = torch.Generator().manual_seed(seeds[1])
        x0 = torch.randn(B, T, config.n_embd, generator=gen)  # (B, T, C)
        coeff = torch.randn(B, T, config.n_embd, generator=gen)  # the loss is Σ coeff·y
        where = f"{n_blocks} GPT block{'s' * (n_blocks > 1)} (dropout {p:g}) on x of shape {(B, T, config.n_embd)}"
        plain = _run_blocks(blocks, x0, coeff, seeds[1], None)
        ours = _run_blocks(blocks, x0, coeff, seeds[1], library.checkpoint)
        got = _run_blocks(blocks, x0, coeff, seeds[1], fn)
        if not _same(got["y"], plain["y"]):
            assert_close(got["y"], plain["y"], what=f"{where}: the output of checkpoint(block, x)", rtol=0, atol=0)
            raise Mismatch(f"{where}: the output differs from block(x) in its bits")
        if not got["connected"]:
            raise Mismatch(f"{where}: the output does not require grad, so no backward can run: return "
                           "Checkpoint.apply(fn, x) (an autograd.Function), not fn(x) under torch.no_grad()")
        if got["x_grad"] is None:
            raise Mismatch(f"{where}: x.grad is None: backward must return the gradient with respect to x "
                           "(None for fn, then x.grad of the recomputed graph)")
        missing = [name for name, g in zip(got["names"], got["grads"], strict=True) if g is None]
        if missing:
            raise Mismatch(f"{where}: {missing[0]} got no gradient: backprop the recomputed output with "
                           "torch.autograd.backward(out, grad_out), which fills the parameters' .grad (torch.autograd"
                           ".grad with respect to x alone does not)")
        pairs = [("dL/dx", got["x_grad"], plain["x_grad"])] + list(zip(got["names"], got["grads"], plain["grads"],
                                                                        strict=True))
        differ = [name for name, a, b in pairs if not _same(a, b)]
        if differ:
            for b in blocks:
                b.eval()  # dropout off: does the answer hold then?
            calm = [_run_blocks(blocks, x0, coeff, seeds[1], u) for u in (None, fn)]
            for b in blocks:
                b.train()
            if all(_same(a, b) for a, b in zip([calm[1]["x_grad"], *calm[1]["grads"]],
                                               [calm[0]["x_grad"], *calm[0]["grads"]], strict=True)):
                raise Mismatch(f"{where}: the gradients of {', '.join(differ[:3])}{' …' * (len(differ) > 3)} differ "
                               "from the plain run's, and with dropout off they are equal: gradients differ only "
                               "where dropout is on — the recompute draws new dropout masks; save "
                               "torch.get_rng_state() in forward and restore it before recomputing")
            name, a, b = next((name, a, b) for name, a, b in pairs if not _same(a, b))
            assert_close(a, b, what=f"{where}: {name}", rtol=0, atol=0)
            raise Mismatch(f"{where}: {name} differs from the plain run's in its bits")
        if not torch.equal(got["rng_after"], plain["rng_after"]):
            raise Mismatch(f"{where}: after backward the random generator is not where the plain run leaves it: the "
                           "recompute rewound it (torch.set_rng_state) and left it there, so the next dropout masks "
                           "would repeat old ones; recompute inside `with torch.random.fork_rng():`, which puts the "
                           "state back when it ends")
        slack = n_blocks * 6144  # a segment may keep a little more than its input (the 5 KB CPU RNG state, say)
        if got["saved"] >= plain["saved"] or got["saved"] > ours["saved"] + slack:
            raise Mismatch(f"{where}: your checkpointed blocks saved {got['saved']:,} bytes for backward; keeping "
                           f"only each block's input takes {ours['saved']:,}, the plain run saves {plain['saved']:,}: "
                           "save only x in forward (ctx.save_for_backward(x)) and run fn without recording a graph "
                           "(an autograd.Function's forward already does)")


# --- 3.3: 8-bit saved-tensor hooks ----------------------------------------------------------------------------

def _tensors_in(obj, depth: int = 0):
    """Every tensor inside what a pack hook returned: tuples, lists, dicts, dataclasses, objects' attributes."""

    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 4 or obj is None or isinstance(obj, str | bytes | int | float | bool | torch.dtype | torch.Size):
        return
    elif isinstance(obj, tuple | list | set):
        for item in obj:
            yield from _tensors_in(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item, depth + 1)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors_in(getattr(obj, f.name), depth + 1)
    elif hasattr(obj, "__dict__"):
        for item in vars(obj).values():
            yield from _tensors_in(item, depth + 1)


def stored_bytes(packed, original) -> int:
    """Bytes a pack hook's result `packed` keeps for the saved tensor `original`: each tensor in it once, by its
    elements (a tensor sharing `original`'s memory, kept as it is, counts as `original`'s elements)."""

    total, seen = 0, set()
    mine = measure.storage_key(original)
    for t in _tensors_in(packed):
        key = measure.storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        total += (original if key == mine else t).numel() * (original if key == mine else t).element_size()
    return total


def _round_trip_cases(rng: random.Random):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    n = rng.choice([1000, 1531, 4097])
    return [
        ("a (n,) fp32 tensor, n not a multiple of 128", torch.randn(n, generator=gen)),
        ("a (3, 50, 7) fp32 tensor of values in [5, 15)", torch.rand(3, 50, 7, generator=gen) * 10 + 5),
        ("a transposed (48, 64) view (not contiguous)", torch.randn(64, 48, generator=gen).t()),
        ("a constant tensor (max = min)", torch.full((300,), 2.5)),
        ("a (5,) tensor, smaller than a group", torch.randn(5, generator=gen)),
        ("a 0-d tensor", torch.tensor(-3.25)),
        ("a (2, 257) bf16 tensor", torch.randn(2, 257, generator=gen).to(torch.bfloat16)),
        ("int64 token ids", torch.randint(0, 50000, (4, 33), generator=gen)),
        ("a bool mask", torch.rand(17, 17, generator=gen) > 0.5),
    ]


def _bound(t):
    """Half an 8-bit step of t's range (the error of min-max rounding), plus the output dtype's own rounding."""

    x = t.detach().double()
    bound = (x.max() - x.min()) / (2 * 255) * (1 + 1e-6) + 1e-12
    if t.dtype != torch.float32 and t.dtype != torch.float64:
        bound = bound + x.abs() * torch.finfo(t.dtype).eps  # rebuilding in bf16/fp16 rounds once more
    return bound


def _round_trip(pack, unpack):
    for what, t in _round_trip_cases(fresh_rng()):
        original = t.clone()
        out = unpack(pack(t))
        if not torch.equal(t, original):
            raise Mismatch(f"{what}: pack changed the tensor it was given (it is still used by the forward pass): "
                           "compute on a copy (t.float(), t.reshape(...) - low), never in place on t")
        if not isinstance(out, torch.Tensor):
            raise Mismatch(f"{what}: unpack returned {type(out).__name__}, expected a tensor")
        if out.shape != t.shape or out.dtype != t.dtype:
            raise Mismatch(f"{what}: unpack gave shape {tuple(out.shape)} and {out.dtype}, expected "
                           f"{tuple(t.shape)} and {t.dtype}: keep both in what pack returns and restore them")
        if not t.is_floating_point():
            if not torch.equal(out, t):
                raise Mismatch(f"{what}: came back changed; integer and bool tensors (token ids, masks) must be "
                               "returned by pack as they are")
            continue
        got, x = out.detach().double(), t.detach().double()
        if torch.isnan(got).any():
            extra = (" — a constant group has max − min = 0, so (x − min) / step is 0 / 0; use step = 1 (any "
                     "nonzero) where max == min" if "constant" in what else "")
            raise Mismatch(f"{what}: unpack gave NaN{extra}")
        err, bound = (got - x).abs(), _bound(t)
        if (err > bound).any():
            k = int((err - bound).argmax()) if err.dim() == 0 else int((err - bound).flatten().argmax())
            worst = float(err.flatten()[k])
            diagnosis = ""
            span = float(x.max() - x.min())
            shifted = torch.rand(1024) + 10  # values in [10, 11): x̂ must follow the offset
            if (unpack(pack(shifted)) - shifted).abs().mean() > 5:
                diagnosis = ": x̂ misses the minimum: rebuild x̂ = low + code·step, not code·step"
            elif (err <= span / 255 * (1 + 1e-6) + 1e-12).all():
                diagnosis = (": errors up to a whole step: round the codes (torch.round) before casting — "
                             ".to(torch.uint8) truncates")
            raise Mismatch(f"{what}: |x̂ − x| reaches {worst:.4g}, above half an 8-bit step of the range, "
                           f"(max − min) / 510 = {span / 510:.4g}{diagnosis}")
    t = torch.randn(8192)
    ratio = stored_bytes(pack(t), t) / (t.numel() * 4)
    if ratio > MAX_BYTES_RATIO:
        codes = max(_tensors_in(pack(t)), key=lambda c: c.numel(), default=None)
        kind = f" (its largest tensor is {codes.dtype}: store the codes as torch.uint8)" if codes is not None else ""
        raise Mismatch(f"a (8192,) fp32 tensor packs into {ratio:.0%} of its bytes{kind}; 8-bit codes take 25%, "
                       f"with the scales at most {MAX_BYTES_RATIO:.0%}")


def _gpt_step(hooks, seed: int):
    """One forward + backward of the tiny GPT (fp32, no dropout) under `hooks` (pack, unpack) or none, with the
    bytes the saved tensors would take and do take (parameters left out); returns loss, gradients, bytes."""


    state = torch.get_rng_state()
    torch.manual_seed(seed)
    model = GPT(GPTConfig.preset("tiny"))
    torch.set_rng_state(state)
    x, y = SyntheticDataset(MarkovSource(model.config.vocab_size, seed=seed % 1000), 4, 64, seed=seed).get_batch(0)
    counts = {"original": 0, "stored": 0, "parameters packed": 0}
    if hooks is None:
        loss = model(x, y)[1]
    else:
        pack, unpack = hooks

        def counting(t):
            packed = pack(t)
            if not measure.is_parameter(t):
                counts["original"] += t.numel() * t.element_size()
                counts["stored"] += stored_bytes(packed, t)
            elif measure.storage_key(t) not in {measure.storage_key(k) for k in _tensors_in(packed)}:
                counts["parameters packed"] += 1
            return packed

        with torch.autograd.graph.saved_tensors_hooks(counting, unpack):
            loss = model(x, y)[1]
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return loss.detach(), grads, counts


@check("3.3", "8-bit saved-tensor hooks",
       hint="pack: pass parameters (measure.is_parameter(t)) and integer/bool tensors through; for a float t, "
            "flatten it (t.detach().reshape(-1).float()), pad it to a multiple of the group size G with copies of "
            "its last value (zeros could widen the last group's range), view it as (groups, G), low = min, "
            "step = (max − low) / 255 per group "
            "(1 where max == low), codes = ((x − low) / step).round().to(torch.uint8); return (codes, low, step, "
            "t.shape, t.dtype, t.numel()). unpack: x̂ = low + codes.float()·step, flattened, cut to numel, "
            "reshaped, cast back to the dtype")
def pack_hooks(pack, unpack):
    """`pack(t)` → anything holding t in 8 bits (per-group min-max codes); `unpack(packed)` → the tensor rebuilt,
    in t's shape and dtype. Used as `torch.autograd.graph.saved_tensors_hooks(pack, unpack)`."""


    _round_trip(pack, unpack)
    seed = fresh_rng().randrange(2**31)
    loss, exact, _ = _gpt_step(None, seed)
    got_loss, got, counts = _gpt_step((pack, unpack), seed)
    where = "one step of the tiny GPT (fp32, batch 4 × 64) under your hooks"
    if not torch.equal(got_loss, loss):
        raise Mismatch(f"{where}: the loss changed ({got_loss.item():.6g} vs {loss.item():.6g}): the forward pass "
                       "must be exact — pack must not modify the tensor it is given")
    if counts["parameters packed"]:
        raise Mismatch(f"{where}: pack compressed {counts['parameters packed']} parameter(s) (a Linear saves its "
                       "weight, as weight.t(), for backward): the full-precision parameter is held anyway, so that "
                       "saves no memory and only adds error; return parameters as they are "
                       "(llmlab.memory.measure.is_parameter(t) says which)")
    ratio = counts["stored"] / counts["original"]
    if ratio > MAX_BYTES_RATIO:
        half = " — that is 16-bit storage, not 8-bit" if 0.45 <= ratio <= 0.55 else ""
        raise Mismatch(f"{where}: the saved tensors keep {ratio:.0%} of their {counts['original']:,} bytes{half}; "
                       f"8-bit codes with per-group scales need at most {MAX_BYTES_RATIO:.0%}")

    def library_pack(t):  # llmlab's own 8-bit compression of one saved tensor, for the error to compare with
        if is_parameter(t) or not t.is_floating_point() or t.numel() < 128:
            return t
        return compress.quantize(t)

    def library_unpack(packed):
        return packed if isinstance(packed, torch.Tensor) else compress.dequantize(packed)

    _, reference, _ = _gpt_step((library_pack, library_unpack), seed)
    err = ((got - exact).norm() / exact.norm()).item()
    ref = ((reference - exact).norm() / exact.norm()).item()
    if not math.isfinite(err) or err > GRAD_ERROR_FACTOR * ref:
        raise Mismatch(f"{where}: the gradients moved by {err:.3g} (relative, all parameters), llmlab's 8-bit "
                       f"compression (groups of 128) by {ref:.3g}; allowed: {GRAD_ERROR_FACTOR:g}× that")
