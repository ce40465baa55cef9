"""Chapter 2's exercise checks (llmlab.checks.ch02): each passes the reference answer, reports an unwritten answer
(a NotImplementedError, raised on the ranks for the multi-rank checks) as not attempted, and fails a plausible wrong
answer with a message naming the mistake and the hint. The multi-rank checks share ch02's one Cluster(4)."""



import pytest
import torch
import torch.distributed as td
import torch.nn.functional as F
from check_answers import Mistake, Reference
from grading import fails, not_attempted, passes
from test_checks_ch02_fp8 import FP8_ANSWERS

from llmlab.checks import ch02, ch02_ddp
from llmlab.parallel import schedules
from llmlab.parallel.ddp import DataParallel, buckets
from llmlab.parallel.schedules import Action
from llmlab.precision import DynamicLossScaler


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


def via_llmlab(x, w, b, group=None):  # llmlab's own f passes too
    from llmlab.parallel.tensor import copy_to_parallel

    return F.linear(copy_to_parallel(x, group), w, b)


def gathered(x, w, b, group=None):
    from llmlab.parallel.tensor import gather_from_parallel

    return gather_from_parallel(column_parallel_linear(x, w, b, group), group)


# --- 2.3 ----------------------------------------------------------------------------------------------------

class LossScaler:
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale, self.growth_factor, self.backoff_factor = init_scale, growth_factor, backoff_factor
        self.growth_interval, self.clean_steps = growth_interval, 0

    def scale_loss(self, loss):
        return loss.float() * self.scale

    def unscale_(self, grads):
        found_inf = False
        for g in grads:
            g.div_(self.scale)
            found_inf |= not torch.isfinite(g).all().item()
        return found_inf

    def update(self, found_inf):
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0


def fp16_step(model, masters, optimizer, scaler, loss):
    scaler.scale_loss(loss).backward()
    params = list(model.parameters())
    for p, m in zip(params, masters, strict=True):
        m.grad = p.grad.float()
        p.grad = None
    found_inf = scaler.unscale_([m.grad for m in masters])
    scaler.update(found_inf)
    if not found_inf:
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(params, masters, strict=True):
                p.copy_(m)
    optimizer.zero_grad(set_to_none=True)
    return not found_inf


def zeroes_first(model, masters, optimizer, scaler, loss):  # the gradients cleared before backward: also right
    model.zero_grad(set_to_none=True)
    scaler.scale_loss(loss).backward()
    for p, m in zip(model.parameters(), masters, strict=True):
        m.grad = p.grad.float()
    found_inf = scaler.unscale_([m.grad for m in masters])
    scaler.update(found_inf)
    if found_inf:
        return False
    optimizer.step()
    with torch.no_grad():
        for p, m in zip(model.parameters(), masters, strict=True):
            p.data = m.half()
    return True


class GrowsOnOverflow(LossScaler):
    def update(self, found_inf):
        self.clean_steps += 1  # counts the overflow steps too: one can land on the growth
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0
        elif found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0


class GrowsAStepLate(LossScaler):
    def update(self, found_inf):
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
        elif self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0
        else:
            self.clean_steps += 1


class KeepsCounting(LossScaler):
    def update(self, found_inf):
        if found_inf:
            self.scale *= self.backoff_factor
        else:
            super().update(False)


class UnscalesTwice(LossScaler):
    def unscale_(self, grads):
        super().unscale_(grads)
        return super().unscale_(grads)


class NeverUnscales(LossScaler):
    def unscale_(self, grads):
        return not all(torch.isfinite(g).all() for g in grads)


def _finish(model, masters, optimizer, scaler, found_inf, step_anyway=False, copy_back=True):
    scaler.update(found_inf)
    if step_anyway or not found_inf:
        optimizer.step()
        if copy_back:
            with torch.no_grad():
                for p, m in zip(model.parameters(), masters, strict=True):
                    p.copy_(m)
    optimizer.zero_grad()
    return not found_inf


def _backward(model, masters, scaler, loss, clear=True):
    scaler.scale_loss(loss).backward()
    for p, m in zip(model.parameters(), masters, strict=True):
        m.grad = p.grad.float()
        if clear:
            p.grad = None
    return scaler.unscale_([m.grad for m in masters])


def steps_on_overflow(model, masters, optimizer, scaler, loss):
    found_inf = _backward(model, masters, scaler, loss)
    return _finish(model, masters, optimizer, scaler, found_inf, step_anyway=True)


def never_copies_back(model, masters, optimizer, scaler, loss):
    found_inf = _backward(model, masters, scaler, loss)
    return _finish(model, masters, optimizer, scaler, found_inf, copy_back=False)


def clears_only_when_stepping(model, masters, optimizer, scaler, loss):
    found_inf = _backward(model, masters, scaler, loss, clear=False)
    if not found_inf:
        model.zero_grad()
    return _finish(model, masters, optimizer, scaler, found_inf)


def without_float(model, masters, optimizer, scaler, loss):
    scaler.scale_loss(loss).backward()
    for p, m in zip(model.parameters(), masters, strict=True):
        m.grad = p.grad  # fp16 into an fp32 tensor's .grad: torch refuses
    return True


def unscales_in_fp16(model, masters, optimizer, scaler, loss):
    scaler.scale_loss(loss).backward()
    for p, m in zip(model.parameters(), masters, strict=True):
        p.grad.div_(scaler.scale)  # in fp16: the small gradients lose their bits among the subnormals
        m.grad = p.grad.float()
        p.grad = None
    return _finish(model, masters, optimizer, scaler, not all(torch.isfinite(m.grad).all() for m in masters))


def returns_nothing(model, masters, optimizer, scaler, loss):
    fp16_step(model, masters, optimizer, scaler, loss)


class UnwrittenScaler:
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        raise NotImplementedError("Exercise 2.3")


# --- 2.5 ----------------------------------------------------------------------------------------------------

class BucketedDDP:
    def __init__(self, module, bucket_bytes, group=None):
        self.group, self.world_size = group, td.get_world_size(group)
        self.buckets, current, size = [], [], 0
        for p in reversed(list(module.parameters())):
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > bucket_bytes:
                self.buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self.buckets.append(current)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready, self.pending = [0] * len(self.buckets), []
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, p):
        i = self.bucket_of[p]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):
            self._launch(i)

    def _launch(self, i):
        flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])
        self.pending.append((i, flat, td.all_reduce(flat, group=self.group, async_op=True)))

    def finish(self):
        for i, flat, handle in self.pending:
            handle.wait()
            flat /= self.world_size
            self._copy_back(i, flat)
        self.ready, self.pending = [0] * len(self.buckets), []

    def _copy_back(self, i, flat):
        for p, piece in zip(self.buckets[i], flat.split([q.numel() for q in self.buckets[i]]), strict=True):
            p.grad.copy_(piece.view_as(p))


class LlmlabDDP(DataParallel):  # llmlab's own DDP passes too: it finishes in an autograd-engine callback
    def __init__(self, module, bucket_bytes, group=None):
        super().__init__(module, bucket_mb=bucket_bytes / 2**20, group=group)

    def finish(self):
        pass


class SumsDDP(BucketedDDP):
    def finish(self):
        for i, flat, handle in self.pending:
            handle.wait()
            self._copy_back(i, flat)
        self.ready, self.pending = [0] * len(self.buckets), []


class ForwardOrderDDP(BucketedDDP):
    def __init__(self, module, bucket_bytes, group=None):
        super().__init__(module, bucket_bytes, group)
        self.buckets = buckets(list(module.parameters())[::-1], bucket_bytes / 2**20)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}


class WaitsInTheHook(BucketedDDP):
    def _launch(self, i):
        super()._launch(i)
        self.pending[-1][2].wait()


class BlockingDDP(BucketedDDP):
    def _launch(self, i):
        flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])
        td.all_reduce(flat, group=self.group)
        flat /= self.world_size
        self._copy_back(i, flat)

    def finish(self):
        self.ready = [0] * len(self.buckets)


class LaunchesAtTheCap(BucketedDDP):  # a bucket goes out when it holds bucket_bytes: the partial last one never does
    def __init__(self, module, bucket_bytes, group=None):
        super().__init__(module, bucket_bytes, group)
        self.cap = bucket_bytes

    def _on_grad(self, p):
        i = self.bucket_of[p]
        self.ready[i] += 1
        if sum(q.numel() * q.element_size() for q in self.buckets[i][:self.ready[i]]) >= self.cap:
            self._launch(i)


class DropsTheLastBucket(BucketedDDP):  # forgot `if current: buckets.append(current)`, hooks only on bucketed ones
    def __init__(self, module, bucket_bytes, group=None):
        self.group, self.world_size = group, td.get_world_size(group)
        self.buckets, current, size = [], [], 0
        for p in reversed(list(module.parameters())):
            if current and size + p.numel() * p.element_size() > bucket_bytes:
                self.buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready, self.pending = [0] * len(self.buckets), []
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._on_grad)


class NeverCopiesBack(BucketedDDP):
    def _copy_back(self, i, flat):
        pass


class AllInFinish(BucketedDDP):  # no hooks: every bucket all-reduced after backward
    def _on_grad(self, p):
        pass

    def finish(self):
        for i in range(len(self.buckets)):
            self._launch(i)
        super().finish()


class OnePerParameter(BucketedDDP):
    def _launch(self, i):
        for q in self.buckets[i]:
            self.pending.append((None, q.grad, td.all_reduce(q.grad, group=self.group, async_op=True)))

    def _copy_back(self, i, flat):
        pass


class IgnoresTheGroup(BucketedDDP):
    def _launch(self, i):
        flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])
        self.pending.append((i, flat, td.all_reduce(flat, async_op=True)))

    def finish(self):
        self.world_size = td.get_world_size()
        super().finish()


class NeverResets(BucketedDDP):
    def finish(self):
        for i, flat, handle in self.pending:
            handle.wait()
            flat /= self.world_size
            self._copy_back(i, flat)
        self.pending = []


class UnwrittenDDP:
    def __init__(self, module, bucket_bytes, group=None):
        raise NotImplementedError("Exercise 2.5")

    def finish(self):
        raise NotImplementedError("Exercise 2.5")


# --- the tables: tests/test_checks_answers.py runs each once, tools/flake.py N times ------------------------------

AVERAGE_HINT = "divide it by the group's size"
COLUMN_HINT = "the input gradient on each rank is only its shard's contribution"
def one_f_one_b(p, m):
    return schedules.schedule("1f1b", p, m)


def step_time(plans, t_forward, t_backward):
    return schedules.run(plans, {"F": t_forward, "B": t_backward}).end


def cooldown_reversed(p, m):  # the right warm-up and steady state, the last backwards in reverse order
    plans = one_f_one_b(p, m)
    for plan in plans:
        tail = next(i for i in range(len(plan)) if all(a.kind == "B" for a in plan[i:]))
        plan[tail:] = plan[tail:][::-1]
    return plans


def warm_up_one_more(p, m):  # p − r forwards before the first backward, not p − r − 1
    plans = []
    for rank in range(p):
        w = min(p - rank, m)
        plans.append([Action("F", i) for i in range(w)]
                     + [a for i in range(m - w) for a in (Action("F", w + i), Action("B", i))]
                     + [Action("B", i) for i in range(m - w, m)])
    return plans


ANSWERS = [
    Reference(ch02.average_gradients, average_gradients),
    Reference(ch02.average_gradients, averaged_copies),
    Mistake(ch02.average_gradients, summed, match="that is the sum over the group: divide by its size",
            hint=AVERAGE_HINT),
    Mistake(ch02.average_gradients, divides_a_copy, match="that is the sum over the group", hint="`g = g / n`"),
    Mistake(ch02.average_gradients, ignores_group,
            match="group of 2 .* the mean over all 4 ranks, not over the 2 of this group: pass group=group",
            hint=AVERAGE_HINT),
    Mistake(ch02.average_gradients, divides_by_world, match="group of 2 .* divided by 4, the whole world's size",
            hint=AVERAGE_HINT),
    Mistake(ch02.average_gradients, lambda grads, group=None: [g.clone() for g in grads],
            match="this rank's own gradient, unchanged", hint=AVERAGE_HINT),
    Mistake(ch02.average_gradients, lambda grads, group=None: grads[:1], match="expected the list of",
            hint=AVERAGE_HINT),

    Reference(ch02.column_parallel_linear, column_parallel_linear),
    Reference(ch02.column_parallel_linear, via_llmlab),
    Mistake(ch02.column_parallel_linear, forgets_the_backward_all_reduce,
            match="dL/dx: .* the backward all-reduce is missing", hint=COLUMN_HINT),
    Mistake(ch02.column_parallel_linear, lambda x, w, b, group=None: F.linear(AveragingCopy.apply(x, group), w, b),
            match="sum divided by 4: f's backward sums", hint=COLUMN_HINT),
    Mistake(ch02.column_parallel_linear, lambda x, w, b, group=None: F.linear(WorldCopy.apply(x, group), w, b),
            match="group of 2 .* 2× the right one, summed over all 4 ranks", hint=COLUMN_HINT),
    Mistake(ch02.column_parallel_linear, lambda x, w, b, group=None: F.linear(CopyToParallel.apply(x, group), w),
            match="the output slice: .* values differ", hint=COLUMN_HINT),  # the bias forgotten
    Mistake(ch02.column_parallel_linear, gathered, match="the whole layer's; return this rank's slice",
            hint=COLUMN_HINT),
    Mistake(ch02.column_parallel_linear, lambda x, w, b, group=None: column_parallel_linear(x, w, b, group).detach(),
            match="does not require grad", hint=COLUMN_HINT),

    Reference(ch02.fp16_training, LossScaler, fp16_step),
    Reference(ch02.fp16_training, DynamicLossScaler, fp16_step),  # llmlab's own scaler
    Reference(ch02.fp16_training, LossScaler, zeroes_first),
    Mistake(ch02.fp16_training, GrowsOnOverflow, fp16_step, match="step 10 of .* the scale grew on an overflow step",
            hint="never grow"),
    Mistake(ch02.fp16_training, GrowsAStepLate, fp16_step,
            match="grow now, when the count reaches growth_interval, not one step later", hint="never grow"),
    Mistake(ch02.fp16_training, KeepsCounting, fp16_step, match="must restart from 0 after an overflow",
            hint="never grow"),
    Mistake(ch02.fp16_training, LossScaler, steps_on_overflow, match=r"optimizer.step\(\) ran on an overflow step",
            hint="no optimizer step and no copy back"),
    Mistake(ch02.fp16_training, UnscalesTwice, fp16_step, match="the gradients were unscaled twice",
            hint="divide them by S there, once"),
    Mistake(ch02.fp16_training, NeverUnscales, fp16_step, match="× the right one: unscale the gradients",
            hint="divide them by S there, once"),
    Mistake(ch02.fp16_training, LossScaler, unscales_in_fp16, match="it is unscaled in fp16",
            hint="divide them by S there, once"),
    Mistake(ch02.fp16_training, LossScaler, without_float, match=r"copy them into the masters with .float\(\)",
            hint="(.float())"),
    Mistake(ch02.fp16_training, LossScaler, never_copies_back,
            match="the fp16 model still holds its weights from before the step", hint="copying each master"),
    Mistake(ch02.fp16_training, LossScaler, clears_only_when_stepping,
            match="the fp16 model's .grad still held the last step's gradients", hint="the next backward adds"),
    Mistake(ch02.fp16_training, LossScaler, returns_nothing, match="returned None; expected True if the optimizer",
            hint="where does your step part from the recipe"),
    Reference(ch02.pipeline_1f1b, one_f_one_b, step_time),
    Mistake(ch02.pipeline_1f1b, lambda p, m: schedules.schedule("gpipe", p, m), step_time,
            match="GPipe's order", hint="alternates one forward"),
    Mistake(ch02.pipeline_1f1b, warm_up_one_more, step_time,
            match=r"forwards before its first backward, expected min\(p − r, m\) = \d+: a warm-up of",
            hint="one forward for each rank after it"),
    Mistake(ch02.pipeline_1f1b, cooldown_reversed, step_time, match=r"action \d+ is B\d+, 1F1B runs B\d+ there",
            hint="1F1B"),
    Mistake(ch02.pipeline_1f1b, one_f_one_b, lambda plans, tf, tb: max(len(plan) for plan in plans) / 2 * (tf + tb),
            match="one rank's work with no waiting", hint="a forward needs the same micro-batch's forward"),
    Mistake(ch02.pipeline_1f1b, lambda p, m: [plan[:-1] for plan in one_f_one_b(p, m)], step_time,
            match="every rank runs each forward", hint="1F1B keeps"),

    Reference(ch02.bucketed_ddp, BucketedDDP),
    Reference(ch02.bucketed_ddp, LlmlabDDP),
    Mistake(ch02.bucketed_ddp, SumsDDP, match="the sum over the group's ranks: divide by its size",
            hint="divide by the group's size"),
    Mistake(ch02.bucketed_ddp, ForwardOrderDDP, match="the parameters in registration order; DDP buckets them in "
            "reverse", hint="the last layer's gradients come first"),
    Mistake(ch02.bucketed_ddp, WaitsInTheHook, match="was waited on before the next bucket was launched",
            hint="wait only in finish()"),
    Mistake(ch02.bucketed_ddp, BlockingDDP, match="launched with async_op=False", hint="wait only in finish()"),
    Mistake(ch02.bucketed_ddp, LaunchesAtTheCap,
            match=r"\d+ of the \d+ buckets were all-reduced during backward|none of the \d+ buckets",
            hint="the last bucket is partial"),
    Mistake(ch02.bucketed_ddp, DropsTheLastBucket, match="the last, partial bucket is missing",
            hint="the last bucket is partial"),
    Mistake(ch02.bucketed_ddp, NeverCopiesBack, match="this rank's own gradient: the all-reduced buffers never "
            "reached .grad", hint="write every slice back"),
    Mistake(ch02.bucketed_ddp, AllInFinish, match="launched in finish\\(\\), after backward: none overlapped",
            hint="wait only in finish()"),
    Mistake(ch02.bucketed_ddp, OnePerParameter, match="one per parameter", hint="the last bucket is partial"),
    Mistake(ch02.bucketed_ddp, IgnoresTheGroup, match="group of 2 .* the mean over all 4 ranks, not over the 2",
            hint="divide by the group's size"),
    Mistake(ch02.bucketed_ddp, NeverResets, match="backward 2 of 2: none of the .* reset by the first finish",
            hint="the last bucket is partial"),
]


@pytest.mark.parametrize("check", [ch02.average_gradients, ch02.column_parallel_linear])
def test_an_unwritten_answer_is_not_attempted(check, capsys):
    not_attempted(check, unwritten, capsys=capsys)


@pytest.mark.parametrize("answers", [(UnwrittenScaler, fp16_step), (LossScaler, unwritten)])
def test_an_unwritten_fp16_answer_is_not_attempted(answers, capsys):
    not_attempted(ch02.fp16_training, *answers, capsys=capsys)


def test_an_unwritten_pipeline_answer_is_not_attempted(capsys):
    not_attempted(ch02.pipeline_1f1b, unwritten, step_time, capsys=capsys)


def test_an_unwritten_ddp_class_is_not_attempted_without_the_ranks(capsys, monkeypatch):
    monkeypatch.setattr(ch02_ddp, "cluster", lambda: pytest.fail("the ranks were asked"))  # decided from the source
    not_attempted(ch02.bucketed_ddp, UnwrittenDDP, capsys=capsys)


# --- 2.6 ----------------------------------------------------------------------------------------------------

def interleaved_1f1b(p, v, m):  # the solution's answer
    if v > 1 and m % p:
        raise ValueError(f"m={m} must be a multiple of p={p} for the interleaved schedule")
    return _interleaved(p, v, m)


def _interleaved(p, v, m, warmup=None, forward=None, reverse=True):
    """Megatron's interleaved 1F1B, or a mistake: `warmup(p, v, rank)` the forwards before the first backward,
    `forward(p, v, k)` the (micro-batch, chunk) of the k-th forward, `reverse=False` backwards in forward order."""
    def nth(k, kind):
        micro_batch, chunk = forward(p, v, k) if forward else ((k // (p * v)) * p + k % p, (k % (p * v)) // p)
        return Action(kind, micro_batch, v - 1 - chunk if kind == "B" and reverse else chunk)

    plans, total = [], v * m
    for rank in range(p):
        w = warmup(p, v, rank) if warmup else p - rank - 1 if v == 1 else 2 * (p - rank - 1) + (v - 1) * p
        w = min(w, total)
        plans.append([nth(k, "F") for k in range(w)]
                     + [a for k in range(total - w) for a in (nth(w + k, "F"), nth(k, "B"))]
                     + [nth(k, "B") for k in range(total - w, total)])
    return plans


def llmlab_interleaved(p, v, m):
    return schedules.schedule("1f1b", p, m) if v == 1 else schedules.schedule("interleaved", p, m, v)


def test_an_unwritten_interleaved_answer_is_not_attempted(capsys):
    not_attempted(ch02.interleaved_1f1b, unwritten, capsys=capsys)


def rank_major(p, v, m):  # each micro-batch through all of the rank's chunks first, as if it held stages r·v … r·v+v-1
    return _interleaved(p, v, m, forward=lambda p, v, k: (k // v, k % v))


INTERLEAVED_HINT = "micro-batches go through a rank's chunks in groups of p"
INTERLEAVED_ANSWERS = [
    Reference(ch02.interleaved_1f1b, interleaved_1f1b),
    Reference(ch02.interleaved_1f1b, llmlab_interleaved),
    Reference(ch02.interleaved_1f1b, lambda p, v, m: [[(a.kind, a.micro_batch, a.chunk) for a in plan]
                                                      for plan in interleaved_1f1b(p, v, m)]),  # tuples read too
    Mistake(ch02.interleaved_1f1b, rank_major, match="each micro-batch runs through all of the rank's chunks .*"
            "rank-major", hint="chunk 1 of rank 0 follows chunk 0 of the last rank"),
    Mistake(ch02.interleaved_1f1b, lambda p, v, m: _interleaved(p, v, m, reverse=False),
            match="backwards run the chunks in the forwards' order .*; it deadlocks", hint="chunks in reverse"),
    Mistake(ch02.interleaved_1f1b, lambda p, v, m: _interleaved(p, v, m, warmup=lambda p, v, r: p - r - 1
                                                                  + (v - 1) * p),  # the (p − r − 1)·2 halved
            match=r"forwards before its first backward, Megatron.s order runs \d+: a warm-up of min\(\(p − r − 1\)·2",
            hint="Megatron's (p − r − 1)·2"),
    Mistake(ch02.interleaved_1f1b, lambda p, v, m: _interleaved(p, v, m, warmup=lambda p, v, r: p - r - 1),
            match="plain 1F1B's warm-up, which ignores v", hint="Megatron's (p − r − 1)·2"),
    Mistake(ch02.interleaved_1f1b, lambda p, v, m: _interleaved(p, v, m, warmup=lambda p, v, r: 2 * (p - r - 1)
                                                                  + (v - 1) * p),
            match="v=1, .* plain 1F1B, whose warm-up is min\\(p − r − 1, m\\)", hint="plain 1F1B"),
    Mistake(ch02.interleaved_1f1b, lambda p, v, m: schedules.schedule("1f1b", p, m),
            match="on chunk 0 only, as plain 1F1B", hint="2·v·m actions"),
    Mistake(ch02.interleaved_1f1b, _interleaved, match="is not a multiple of p .* raise ValueError",
            hint="refuse an m that p does not divide"),
    Mistake(ch02.interleaved_1f1b, lambda p, v, m: [plan[:-1] for plan in interleaved_1f1b(p, v, m)],
            match="never runs B", hint=INTERLEAVED_HINT),
    Mistake(ch02.interleaved_1f1b, lambda p, v, m: {r: [] for r in range(p)}, match="expected a list of .* plans",
            hint=INTERLEAVED_HINT),
]
ANSWERS += INTERLEAVED_ANSWERS
ANSWERS += FP8_ANSWERS  # 2.7's, in tests/test_checks_ch02_fp8.py
