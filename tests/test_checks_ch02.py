"""Chapter 2's exercise checks (llmlab.checks.ch02): each passes the reference answer, reports an unwritten answer
(a NotImplementedError, raised on the ranks for the multi-rank checks) as not attempted, and fails a plausible wrong
answer with a message naming the mistake and the hint. The multi-rank checks share ch02's one Cluster(4)."""


import pytest
import torch
import torch.distributed as td
import torch.nn.functional as F
from grading import fails, not_attempted, passes

from llmlab.checks import ch02


@pytest.fixture(scope="module", autouse=True)
def cluster():
    yield ch02.cluster()
    ch02.close_cluster()


def unwritten(*args):
    raise NotImplementedError("Exercise 2.x")


# --- 2.1 ----------------------------------------------------------------------------------------------------

def average_gradients(grads, group=None):
    n = td.get_world_size(group)
    for g in grads:
        td.all_reduce(g, group=group)
        g.div_(n)


def averaged_copies(grads, group=None):  # one flat buffer, one all-reduce, a new list returned: also right
    flat = torch.cat([g.reshape(-1) for g in grads])
    td.all_reduce(flat, group=group)
    flat /= td.get_world_size(group)
    return [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)]


def summed(grads, group=None):
    for g in grads:
        td.all_reduce(g, group=group)


def ignores_group(grads, group=None):
    for g in grads:
        td.all_reduce(g)
        g.div_(td.get_world_size())


def divides_by_world(grads, group=None):
    for g in grads:
        td.all_reduce(g, group=group)
        g.div_(td.get_world_size())


def divides_a_copy(grads, group=None):
    for g in grads:
        td.all_reduce(g, group=group)
        g = g / td.get_world_size(group)  # noqa: PLW2901 - the mistake under test: the gradient stays the sum


def test_average_gradients(capsys):
    passes(ch02.average_gradients, average_gradients, capsys=capsys)
    passes(ch02.average_gradients, averaged_copies, capsys=capsys)
    not_attempted(ch02.average_gradients, unwritten, capsys=capsys)
    hint = "divide it by the group's size"
    fails(ch02.average_gradients, summed, match="that is the sum over the group: divide by its size", hint=hint)
    fails(ch02.average_gradients, divides_a_copy, match="that is the sum over the group", hint="`g = g / n`")
    fails(ch02.average_gradients, ignores_group, match="group of 2 .* the mean over all 4 ranks, not over the 2 of "
                                                       "this group: pass group=group", hint=hint)
    fails(ch02.average_gradients, divides_by_world, match="group of 2 .* divided by 4, the whole world's size",
          hint=hint)
    fails(ch02.average_gradients, lambda grads, group=None: [g.clone() for g in grads],
          match="this rank's own gradient, unchanged", hint=hint)
    fails(ch02.average_gradients, lambda grads, group=None: grads[:1], match="expected the list of", hint=hint)


def test_a_failure_on_the_ranks_leaves_the_checks_usable(capsys):
    def crashes(grads, group=None):
        raise ZeroDivisionError("oops")

    fails(ch02.average_gradients, crashes, match="raised ZeroDivisionError: oops", hint="divide it by")
    passes(ch02.average_gradients, average_gradients, capsys=capsys)


# --- 2.2 ----------------------------------------------------------------------------------------------------

class CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        td.all_reduce(grad, group=ctx.group)
        return grad, None


def column_parallel_linear(x, weight, bias, group=None):
    return F.linear(CopyToParallel.apply(x, group), weight, bias)


def forgets_the_backward_all_reduce(x, weight, bias, group=None):
    return F.linear(x, weight, bias)


class AveragingCopy(CopyToParallel):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        td.all_reduce(grad, group=ctx.group)
        return grad / td.get_world_size(ctx.group), None


class WorldCopy(CopyToParallel):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        td.all_reduce(grad)  # the world, not the group
        return grad, None


def test_column_parallel_linear(capsys):
    passes(ch02.column_parallel_linear, column_parallel_linear, capsys=capsys)
    from llmlab.parallel.tensor import copy_to_parallel  # llmlab's own f passes too

    passes(ch02.column_parallel_linear, lambda x, w, b, group=None: F.linear(copy_to_parallel(x, group), w, b),
           capsys=capsys)
    not_attempted(ch02.column_parallel_linear, unwritten, capsys=capsys)
    hint = "the input gradient on each rank is only its shard's contribution"
    fails(ch02.column_parallel_linear, forgets_the_backward_all_reduce,
          match="dL/dx: .* the backward all-reduce is missing", hint=hint)
    fails(ch02.column_parallel_linear, lambda x, w, b, group=None: F.linear(AveragingCopy.apply(x, group), w, b),
          match="sum divided by 4: f's backward sums", hint=hint)
    fails(ch02.column_parallel_linear, lambda x, w, b, group=None: F.linear(WorldCopy.apply(x, group), w, b),
          match="group of 2 .* 2× the right one, summed over all 4 ranks", hint=hint)
    fails(ch02.column_parallel_linear, lambda x, w, b, group=None: F.linear(CopyToParallel.apply(x, group), w),
          match="the output slice: .* values differ", hint=hint)  # the bias forgotten

    def gathered(x, w, b, group=None):
        from llmlab.parallel.tensor import gather_from_parallel

        return gather_from_parallel(column_parallel_linear(x, w, b, group), group)

    fails(ch02.column_parallel_linear, gathered, match="the whole layer's; return this rank's slice", hint=hint)
    fails(ch02.column_parallel_linear, lambda x, w, b, group=None: column_parallel_linear(x, w, b, group).detach(),
          match="does not require grad", hint=hint)


# --- 2.3 ----------------------------------------------------------------------------------------------------

def update_scale(scale, tracker, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, 0
    tracker += 1
    if tracker == growth_interval:
        return scale * growth_factor, 0
    return scale, tracker


def grows_on_overflow(scale, tracker, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    tracker += 1  # counts the overflow steps too: one can land on the growth
    if tracker == growth_interval:
        return scale * growth_factor, 0
    return (scale * backoff_factor, 0) if found_inf else (scale, tracker)


def grows_a_step_late(scale, tracker, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, 0
    if tracker == growth_interval:
        return scale * growth_factor, 0
    return scale, tracker + 1


def keeps_counting(scale, tracker, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, tracker
    return update_scale(scale, tracker, False, growth_factor, backoff_factor, growth_interval)


def test_update_scale(capsys):
    passes(ch02.update_scale, update_scale, capsys=capsys)
    from llmlab.precision import DynamicLossScaler

    def ours(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
        s = DynamicLossScaler(scale, growth_factor, backoff_factor, growth_interval)
        s.load_state_dict({"scale": scale, "clean_steps": tracker})
        s.update(found_inf)
        return s.scale, s.clean_steps

    passes(ch02.update_scale, ours, capsys=capsys)  # llmlab's own scaler
    not_attempted(ch02.update_scale, unwritten, capsys=capsys)
    hint = "never grow"
    fails(ch02.update_scale, grows_on_overflow, match="found_inf=True: .* the scale grew on an overflow step",
          hint=hint)
    fails(ch02.update_scale, grows_a_step_late, match="grow now, when the counter reaches growth_interval", hint=hint)
    fails(ch02.update_scale, keeps_counting, match="restart from 0 after an overflow", hint=hint)
    fails(ch02.update_scale, lambda *args: 1.0, match="expected the pair", hint=hint)
