"""Checks for chapter 2's exercises (solutions/02_parallelism.ipynb): DDP's gradient averaging and Megatron's
column-parallel linear layer (forward and backward); fp16 training with a dynamic loss scaler (2.3), the 1F1B
schedule (2.4), bucketed DDP (2.5), the interleaved 1F1B schedule (2.6) and FP8 with tile scales (2.7) have modules of
their own, ch02_precision, ch02_pipeline, ch02_ddp, ch02_interleaved and ch02_fp8, imported here.

    from llmlab.checks import ch02 as check
    check.average_gradients(average_gradients)            # 2.1, on 4 ranks
    check.column_parallel_linear(column_parallel_linear)  # 2.2, on 4 ranks
    check.fp16_training(LossScaler, fp16_step)            # 2.3, against llmlab.precision.MixedPrecision
    check.pipeline_1f1b(one_f_one_b, step_time)           # 2.4, against llmlab.parallel.schedules
    check.bucketed_ddp(BucketedDDP)                       # 2.5, on 4 ranks, against llmlab.parallel.ddp
    check.interleaved_1f1b(interleaved_1f1b)              # 2.6, simulated, against llmlab.parallel.schedules
    check.fp8_quantization(saturating_cast, quantize_tiles, fp8_matmul)  # 2.7, against llmlab.fp8

The multi-rank checks (2.1, 2.2, 2.5) run the learner's function — defined in a notebook, it travels to the ranks by
value with cloudpickle — on the ranks of one gloo `llmlab.dist.Cluster(4)`, started on first use, reused by every later
check and closed when the interpreter exits (the cluster and its process groups are defined in `ch02_ddp`). Every
case keeps all four ranks busy, split into process groups: one group of 4, two groups of 2, a group of 3 next to a
group of 1. So a function that ignores its `group` argument does not hang waiting for ranks that never come: it
reduces over the wrong ranks, and the check says so. A `NotImplementedError` raised on the ranks comes back as a
`RankError` that the checker base reports as "not attempted yet".

Inputs are fresh random ones on every run, in float64 for 2.2 (so the tolerance can be tight) and in float32 and
float64 for 2.1; shapes include odd sizes and a 0-d tensor. When an answer matches a known mistake (the sum
instead of the mean, the backward all-reduce forgotten...) the check says so.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as td

from llmlab import checks
from llmlab.checks import Hint, Mismatch, assert_close, check, fresh_rng
from llmlab.checks.ch02_ddp import PARTITIONS, TIMEOUT_S, WORLD_SIZE, bucketed_ddp, cluster, my_group
from llmlab.checks.ch02_fp8 import fp8_quantization
from llmlab.checks.ch02_interleaved import interleaved_1f1b
from llmlab.checks.ch02_pipeline import pipeline_1f1b
from llmlab.checks.ch02_precision import fp16_training

__all__ = ["average_gradients", "column_parallel_linear", "fp16_training", "pipeline_1f1b", "bucketed_ddp",
           "interleaved_1f1b", "fp8_quantization", "cluster", "close_cluster", "WORLD_SIZE", "PARTITIONS"]

close_cluster = checks.close_clusters


# --- on the ranks -------------------------------------------------------------------------------------------

def _gradients(shapes, dtype, seed: int, rank: int):
    """Rank `rank`'s gradients for one case of 2.1: a tensor per shape, N(0, 1), from (seed, rank)."""

    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    return [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for shape in shapes]


def _average_on_rank(fn, partition, cases):
    group, members = my_group(partition)
    out = []
    for shapes, dtype, seed in cases:
        grads = _gradients(shapes, dtype, seed, td.get_rank())
        returned = fn(grads, group)
        out.append(grads if returned is None else returned)
    return {"rank": td.get_rank(), "members": members, "results": out}


def _column_inputs(case):
    """The full layer and input of one case of 2.2, the same on every rank: (x, weight, bias, coefficients)."""

    lead, n_in, n_out, bias, seed = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, n_in, generator=gen, dtype=torch.float64)  # (..., in)
    weight = torch.randn(n_out, n_in, generator=gen, dtype=torch.float64)  # (out, in), as in nn.Linear
    b = torch.randn(n_out, generator=gen, dtype=torch.float64) if bias else None  # (out,)
    coeff = torch.randn(*lead, n_out, generator=gen, dtype=torch.float64)  # dL/dY of the loss Σ coeff·Y
    return x, weight, b, coeff


def _column_on_rank(fn, partition, cases):
    group, members = my_group(partition)
    n, r = len(members), members.index(td.get_rank())
    out = []
    for case in cases:
        x, weight, bias, coeff = _column_inputs(case)
        rows = slice(r * weight.shape[0] // n, (r + 1) * weight.shape[0] // n)  # this rank's output features
        x = x.requires_grad_()
        w = weight[rows].clone().requires_grad_()  # (out/N, in)
        b = None if bias is None else bias[rows].clone().requires_grad_()  # (out/N,)
        y = fn(x, w, b, group)  # (..., out/N): this rank's slice of Y
        result = {"y": y}
        if hasattr(y, "shape") and tuple(y.shape) == tuple(coeff[..., rows].shape) and y.requires_grad:
            (y * coeff[..., rows]).sum().backward()  # the loss Σ coeff·Y, this rank's share of it
            result.update(x_grad=x.grad, w_grad=w.grad, b_grad=None if b is None else b.grad)
        out.append(_detached(result))
    return {"rank": td.get_rank(), "members": members, "results": out}


def _detached(result: dict) -> dict:
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in result.items()}


# --- 2.1: gradient averaging for data parallelism -----------------------------------------------------------

def _average_cases(rng: random.Random):
    seed = lambda: rng.randrange(2**31)  # noqa: E731
    cases = [([(5, 3), (7,), ()], torch.float32, seed()),  # odd sizes and a 0-d tensor (a scalar gain)
             ([(1,), (13, 1, 2), (64, 64)], torch.float64, seed())]
    shapes = [tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 4))]
    cases.append((shapes, rng.choice([torch.float32, torch.float64]), seed()))
    return cases


def _tolerances(dtype) -> dict:
    """Tolerances of 2.1's averages against the float64 mean rounded once to `dtype`.

    The all-reduce sums at most 4 values in `dtype`, in an order of gloo's choosing: ≤ 3 roundings, each ≤ ½ eps of
    a partial sum ≤ Σ|gₖ| ≤ 4·max|g|, so ≤ 6 eps·max|g| on the sum and ≤ 1.5 eps·max|g| on a mean of 4; the
    division and the reference's own rounding add ½ eps of the mean each. atol = 16 eps covers max|g| up to 10
    (N(0, 1) draws, ~16,000 per call: beyond 6σ has probability ~3e-5 per call, beyond 10σ never), rtol 4 eps
    the rounding relative to the mean. A named mistake is off by a factor of 4/3 or more."""

    return dict(rtol=4 * torch.finfo(dtype).eps, atol=4 * 4 * torch.finfo(dtype).eps)


def _run(driver, fn, partition, cases):
    return cluster().run(driver, fn, partition, cases, timeout=TIMEOUT_S)


@check("2.1", "averaging gradients over the ranks", hint=Hint(
    nudge="look at what each rank's .grad holds after your function: the sum over ranks, or the mean, and the same "
          "tensor as before?",
    idea="every gradient is summed over the group by an all-reduce and then divided by the group's size, both in "
         "place on the .grad tensor itself",
    formula="all-reduce each gradient over the group (torch.distributed.all_reduce(g, group=group), a sum, in "
            "place) and divide it by the group's size, td.get_world_size(group) — in place (g.div_(n)); "
            "`g = g / n` makes a new tensor and leaves the gradient as it was"))
def average_gradients(fn):
    """`fn(grads, group)`: average the list `grads` of this rank's gradients over the ranks of `group`, in place
    (or return the list of averages)."""

    rng = fresh_rng()
    cases = _average_cases(rng)
    for partition in PARTITIONS:
        for r in _run(_average_on_rank, fn, partition, cases):
            members = r["members"]
            for (shapes, dtype, seed), got in zip(cases, r["results"], strict=True):
                everyone = {k: _gradients(shapes, dtype, seed, k) for k in range(WORLD_SIZE)}
                where = (f"rank {r['rank']} in a group of {len(members)} of the {WORLD_SIZE} ranks "
                         f"(ranks {members})")
                if not isinstance(got, list | tuple) or len(got) != len(shapes):
                    raise Mismatch(f"{where}: got {type(got).__name__} {got!r:.80}; expected the list of "
                                   f"{len(shapes)} averaged gradients (or None, having averaged them in place)")
                for i, (tensor, shape) in enumerate(zip(got, shapes, strict=True)):
                    mine = [everyone[k][i] for k in members]
                    want = torch.stack(mine).double().mean(0).to(dtype)
                    what = f"{where}, gradient {i} of shape {shape} ({str(dtype).removeprefix('torch.')})"
                    try:
                        assert_close(tensor, want, what=what, **_tolerances(dtype))
                    except Mismatch as e:
                        raise Mismatch(f"{e}{_average_diagnosis(tensor, everyone, i, members, r['rank'])}") from None


def _average_diagnosis(got, everyone, i, members, rank) -> str:
    if not isinstance(got, torch.Tensor) or got.dtype not in (torch.float32, torch.float64):
        return ""
    got = got.detach().double()
    n, world = len(members), len(everyone)
    group_sum = sum(everyone[k][i].double() for k in members)
    world_sum = sum(everyone[k][i].double() for k in everyone)
    known = {
        "that is the sum over the group: divide by its size": group_sum,
        f"that is the group's sum divided by {world}, the whole world's size: use td.get_world_size(group) "
        f"({n} here)": group_sum / world,
        f"that is the mean over all {world} ranks, not over the {n} of this group: pass group=group to the "
        "all-reduce (and td.get_world_size(group))": world_sum / world,
        f"that is the sum over all {world} ranks: pass group=group to the all-reduce and divide by the group's "
        "size": world_sum,
        "that is this rank's own gradient, unchanged: the all-reduce must act on the tensors in `grads` (in "
        "place), or return the averaged ones": everyone[rank][i].double(),
    }
    for text, value in known.items():
        if value.shape == got.shape and torch.allclose(got, value, rtol=1e-5, atol=1e-6):
            return f": {text}"
    return ""


# --- 2.2: the column-parallel linear layer, forward and backward ---------------------------------------------

def _column_cases(rng: random.Random):
    seed = lambda: rng.randrange(2**31)  # noqa: E731
    cases = [((4,), 8, 12, True, seed()),  # a batch of 4 vectors
             ((2, 3), 5, 24, True, seed()),  # (B, T, in) with an odd in_features
             ((1,), 3, 12, False, seed())]  # no bias
    cases.append(((rng.randint(1, 3), rng.randint(1, 5)), rng.randint(1, 9), 12 * rng.randint(1, 3),
                  rng.random() < 0.5, seed()))
    return cases


@check("2.2", "the column-parallel linear layer, forward and backward", hint=Hint(
    nudge="check the forward and the backward separately: which of them needs communication in a column-parallel "
          "layer?",
    idea="the forward needs none — each rank multiplies the whole input by its shard of the weight; the backward "
         "does: each rank's input gradient is only its shard's part, so f's backward sums it over the ranks",
    formula="forward: every rank holds the whole input x and its shard of the weight, so Y_r = x·W_rᵀ + b_r "
            "(F.linear) — no communication; backward: the input gradient on each rank is only its shard's "
            "contribution (dY_r·W_r), and the full dL/dx is their sum over the ranks: f's backward must all-reduce "
            "the gradient over the group (td.all_reduce(grad, group=ctx.group)); f's forward is the identity"))
def column_parallel_linear(fn):
    """`fn(x, weight, bias, group)`: x (..., in) the whole input on every rank, weight (out/N, in) and bias (out/N,)
    or None this rank's shard → this rank's slice (..., out/N) of the output, with gradients flowing back."""

    rng = fresh_rng()
    cases = _column_cases(rng)
    for partition in PARTITIONS:
        for r in _run(_column_on_rank, fn, partition, cases):
            members = r["members"]
            n, k = len(members), members.index(r["rank"])
            for case, got in zip(cases, r["results"], strict=True):
                lead, n_in, n_out, has_bias, _ = case
                x, weight, bias, coeff = _column_inputs(case)
                rows = slice(k * n_out // n, (k + 1) * n_out // n)
                where = (f"rank {r['rank']} in a group of {n} of the {WORLD_SIZE} ranks (ranks {members}), "
                         f"x of shape {(*lead, n_in)}, the full layer {n_in} → {n_out}"
                         f"{'' if has_bias else ' without bias'}, this rank's output features {rows.start}:"
                         f"{rows.stop}")
                y_full = torch.nn.functional.linear(x, weight, bias)  # (..., out)
                y = got["y"]
                if isinstance(y, torch.Tensor) and tuple(y.shape) == tuple(y_full.shape) and n > 1:
                    raise Mismatch(f"{where}: the output has shape {tuple(y.shape)}, the whole layer's; return "
                                   f"this rank's slice, of shape {tuple(y_full[..., rows].shape)} (no gather)")
                # float64: y and the gradients are sums of ≤ 36 products of N(0, 1) draws, in another order on the
                # ranks (and summed over ranks by the all-reduce): ≤ 36·2⁻⁵³·Σ|terms| ≲ 1e-13 apart
                tol = dict(rtol=1e-10, atol=1e-10)
                assert_close(y, y_full[..., rows], what=f"{where}: the output slice", **tol)
                if "x_grad" not in got:
                    raise Mismatch(f"{where}: the output does not require grad: it must come from x, weight and "
                                   "bias through differentiable operations (no torch.no_grad, no .detach())")
                x_grad = coeff.flatten(0, -2) @ weight  # (…, in): dL/dx = Σ over all out features
                x_grad = x_grad.view(*lead, n_in)
                if got["x_grad"] is None:
                    raise Mismatch(f"{where}: x.grad is None: the output is not connected to x in the graph")
                try:
                    assert_close(got["x_grad"], x_grad, what=f"{where}: dL/dx", **tol)
                except Mismatch as e:
                    own = (coeff[..., rows].flatten(0, -2) @ weight[rows]).view(*lead, n_in)
                    raise Mismatch(f"{e}{_input_grad_diagnosis(got['x_grad'], x_grad, own, n, len(partition))}") \
                        from None
                dy = coeff[..., rows].reshape(-1, rows.stop - rows.start)  # (rows of x, out/N)
                assert_close(got["w_grad"], dy.T @ x.reshape(-1, n_in), what=f"{where}: the weight shard's gradient",
                             **tol)
                if has_bias:
                    assert_close(got["b_grad"], dy.sum(0), what=f"{where}: the bias shard's gradient", **tol)


def _input_grad_diagnosis(got, full, own, n: int, groups: int) -> str:
    if not isinstance(got, torch.Tensor) or got.shape != full.shape:
        return ""
    close = lambda a, b: torch.allclose(got.double(), b, rtol=1e-8, atol=1e-8)  # noqa: E731
    if close(got, own):
        return (": it equals this rank's shard's contribution alone — the backward all-reduce is missing, so the "
                "input gradient on each rank is only its shard's contribution")
    if close(got, full / n):
        return f": it is the sum divided by {n}: f's backward sums (all-reduce), it does not average"
    if groups > 1 and close(got, full * groups):
        return (f": it is {groups}× the right one, summed over all {WORLD_SIZE} ranks instead of this group's {n}: "
                "pass group=ctx.group (the group given to forward) to the all-reduce")
    return ""
