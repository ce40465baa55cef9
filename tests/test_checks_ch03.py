"""Chapter 3's exercise checks (llmlab.checks.ch03): each passes the reference answer, reports an unwritten answer
(a NotImplementedError, raised on the ranks for 3.1) as not attempted, and fails a plausible wrong answer with a
message naming the mistake and the hint. 3.1 runs on ch03's one Cluster(4), shared by the tests here."""


import math
import random

import pytest
import torch
import torch.distributed as td
from check_answers import Mistake, Reference
from grading import not_attempted
from llmlab.kernels import attention

from llmlab.checks import ch03
from llmlab.checks.ch03 import flash, hooks8
from llmlab.memory.checkpoint import checkpoint as library_checkpoint
from llmlab.memory.measure import is_parameter


@pytest.fixture(scope="module", autouse=True)
def cluster():
    yield
    ch03.close()


def unwritten(*args):
    raise NotImplementedError("Exercise 3.x")


# --- 3.1: a ZeRO-1 step ----------------------------------------------------------------------------------------

def zero1_step(params, state, step, lr, betas, eps, weight_decay, group=None):
    n, r = td.get_world_size(group), td.get_rank(group)
    numel = sum(p.numel() for p in params)
    S = -(-numel // n)
    lo, hi = r * S, (r + 1) * S
    pad = params[0].new_zeros(n * S - numel)
    if not state:
        flat = torch.cat([p.detach().reshape(-1) for p in params] + [pad])
        state["master"] = flat[lo:hi].to(torch.promote_types(flat.dtype, torch.float32), copy=True)
        state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(state["master"]), torch.zeros_like(state["master"])
    master, m, v = state["master"], state["exp_avg"], state["exp_avg_sq"]
    g = params[0].new_empty(S)
    td.reduce_scatter_single(g, torch.cat([p.grad.reshape(-1) for p in params] + [pad]), group=group)
    g = g.div_(n).to(master.dtype)
    b1, b2 = betas
    master.mul_(1 - lr * weight_decay)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    master.addcdiv_(m / (1 - b1**step), (v / (1 - b2**step)).sqrt().add_(eps), value=-lr)
    full = params[0].new_empty(n * S)
    td.all_gather_single(full, master.to(full.dtype), group=group)
    with torch.no_grad():
        offset = 0
        for p in params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def zero1_with_lists(params, state, step, lr, betas, eps, weight_decay, group=None):
    """Also right: the list collectives, the step count kept in state, the moments updated as torch's AdamW does."""
    n, r = td.get_world_size(group), td.get_rank(group)
    numel = sum(p.numel() for p in params)
    S = (numel + n - 1) // n
    flat_grad = torch.nn.functional.pad(torch.cat([p.grad.flatten() for p in params]), (0, n * S - numel))
    if "m" not in state:
        flat = torch.nn.functional.pad(torch.cat([p.detach().flatten() for p in params]), (0, n * S - numel))
        state.update(step=0, master=flat[r * S:(r + 1) * S].clone(), m=flat.new_zeros(S), v=flat.new_zeros(S))
    state["step"] += 1
    g = flat_grad.new_empty(S)
    td.reduce_scatter(g, list(flat_grad.chunk(n)), group=group)
    g /= n
    b1, b2 = betas
    t, master = state["step"], state["master"]
    master.mul_(1 - lr * weight_decay)
    state["m"].lerp_(g, 1 - b1)
    state["v"].mul_(b2).add_((1 - b2) * g * g)
    denom = (state["v"].sqrt() / (1 - b2**t) ** 0.5).add_(eps)
    master.addcdiv_(state["m"], denom, value=-lr / (1 - b1**t))
    shards = [torch.empty_like(master) for _ in range(n)]
    td.all_gather(shards, master, group=group)
    torch.nn.utils.vector_to_parameters(torch.cat(shards)[:numel], params)


def make_zero1(no_padding=False, no_mean=False, no_bias_correction=False, full_state=False, no_all_gather=False,
               inclusive_hi=False, size_plus_one=False, view=False, all_reduce=False, l2=False, eps_inside=False,
               no_eps=False, rebind_moments=False, no_copy_back=False, master_from_zero=False):
    """zero1_step with one planted mistake."""
    def step_fn(params, state, step, lr, betas, eps, weight_decay, group=None):
        n, r = td.get_world_size(group), td.get_rank(group)
        numel = sum(p.numel() for p in params)
        S = numel // n + 1 if size_plus_one else -(-numel // n)
        lo = 0 if master_from_zero else r * S
        hi = lo + S - 1 if inclusive_hi else lo + S
        pad = params[0].new_zeros(0 if no_padding else n * S - numel)
        if not state:
            flat = torch.cat([p.detach().reshape(-1) for p in params] + [pad])
            state["master"] = flat.clone() if full_state else flat[lo:hi] if view else flat[lo:hi].clone()
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(state["master"]), torch.zeros_like(state["master"])
        master, m, v = state["master"], state["exp_avg"], state["exp_avg_sq"]
        if full_state:  # full-size state, of which only this rank's slice is used
            master, m, v = master[lo:hi], m[lo:hi], v[lo:hi]
        flat_grad = torch.cat([p.grad.reshape(-1) for p in params] + [pad])
        if all_reduce:
            td.all_reduce(flat_grad, group=group)
            g = flat_grad[lo:hi].clone()
        else:
            g = flat_grad.new_empty(S)
            td.reduce_scatter_single(g, flat_grad, group=group)
        if not no_mean:
            g /= n
        b1, b2 = betas
        if l2:
            g = g + weight_decay * master
        else:
            master.mul_(1 - lr * weight_decay)
        if rebind_moments:
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
        else:
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
        m_hat, v_hat = (m, v) if no_bias_correction else (m / (1 - b1**step), v / (1 - b2**step))
        denom = v_hat.sqrt() if no_eps else (v_hat + eps).sqrt() if eps_inside else v_hat.sqrt() + eps
        master.sub_(lr * m_hat / denom)
        if no_copy_back:
            return
        if no_all_gather:  # only this rank's own shard goes back into its parameters
            full = torch.cat([p.detach().reshape(-1) for p in params] + [pad])
            full[lo:hi] = master
        else:
            full = flat_grad.new_empty(n * S)
            td.all_gather_single(full, master.contiguous(), group=group)
        with torch.no_grad():
            offset = 0
            for p in params:
                p.copy_(full[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
    return step_fn


# --- 3.2: activation checkpointing ------------------------------------------------------------------------------

def make_checkpoint(restore_rng=True, fork=True, autocast=True, detach=True, enable_grad=True, grad_only_inputs=False,
                    anchor=True, forward_grad=False, save_output=False, grads_for_fn=1, save_every_input=False,
                    p_grad=False):
    """The reference Checkpoint with one planted mistake (or none)."""
    class Checkpoint(torch.autograd.Function):
        @staticmethod
        def forward(ctx, fn, anchor, *inputs):
            ctx.fn, ctx.rng = fn, torch.get_rng_state()
            ctx.autocast = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
            ctx.tensor_at = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor) or save_every_input]
            ctx.others = [None if i in ctx.tensor_at else a for i, a in enumerate(inputs)]
            with torch.set_grad_enabled(forward_grad):  # True: the mistake of recording the block's graph
                out = fn(*inputs)
            extra = ([out] if isinstance(out, torch.Tensor) else list(out)) if save_output else []
            ctx.save_for_backward(*(inputs[i] for i in ctx.tensor_at), *extra)
            return out

        @staticmethod
        def backward(ctx, *grad_outputs):
            inputs = list(ctx.others)
            for i, t in zip(ctx.tensor_at, ctx.saved_tensors[:len(ctx.tensor_at)], strict=True):
                inputs[i] = t.detach().requires_grad_(t.requires_grad) if detach else t.requires_grad_(t.requires_grad)
            enabled, dtype = ctx.autocast
            with (torch.random.fork_rng(devices=[], enabled=fork),
                  torch.autocast("cpu", dtype=dtype, enabled=enabled and autocast)):
                if restore_rng:
                    torch.set_rng_state(ctx.rng)
                with torch.set_grad_enabled(enable_grad):
                    outputs = ctx.fn(*inputs)
            outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
            pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if o.requires_grad or not enable_grad]
            if grad_only_inputs:  # the mistake: gradients of the inputs only, none for the parameters
                wrt = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
                found = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs]))
                grads = [next(found) if isinstance(a, torch.Tensor) and a.requires_grad else None for a in inputs]
            else:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                grads = [a.grad if isinstance(a, torch.Tensor) else torch.zeros(()) if p_grad else None
                         for a in inputs]
            return (None,) * (grads_for_fn + 1) + tuple(grads)

    return lambda fn, *inputs: Checkpoint.apply(fn, torch.empty(0, requires_grad=True) if anchor else None, *inputs)


class OneInput(torch.autograd.Function):
    """The checkpoint of one input and one output: right for a GPT block, refused for block(x, cond, p)."""

    @staticmethod
    def forward(ctx, fn, anchor, x):
        ctx.fn, ctx.rng = fn, torch.get_rng_state()
        ctx.save_for_backward(x)
        return fn(x)

    @staticmethod
    def backward(ctx, grad_out):
        x = ctx.saved_tensors[0].detach().requires_grad_()
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.set_rng_state(ctx.rng)
            out = ctx.fn(x)
        torch.autograd.backward(out, grad_out)
        return None, None, x.grad


class OneGradient(torch.autograd.Function):
    """Several inputs, but a backward that takes one gradient: a TypeError for the block's two outputs."""

    @staticmethod
    def forward(ctx, fn, anchor, *inputs):
        ctx.fn, ctx.rng, ctx.others = fn, torch.get_rng_state(), inputs[1:]
        ctx.save_for_backward(inputs[0])
        return fn(*inputs)

    @staticmethod
    def backward(ctx, grad_out):
        x = ctx.saved_tensors[0].detach().requires_grad_()
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.set_rng_state(ctx.rng)
            out = ctx.fn(x, *ctx.others)
        torch.autograd.backward(out, grad_out)
        return None, None, x.grad, *(None for _ in ctx.others)


# --- 3.3: 8-bit saved-tensor hooks ------------------------------------------------------------------------------

def make_hooks(group=128, add_low=True, rounding=True, dtype=torch.uint8, pad_with_zero=False, params=False):
    """8-bit min-max hooks in groups of `group` values (None: one group per tensor), with optional mistakes."""
    def pack(t):
        if not t.is_floating_point() or (is_parameter(t) and not params):
            return t
        x = t.detach().reshape(-1).float()
        n = x.numel()
        size = group or n
        if n % size:
            fill = torch.zeros(size - n % size) if pad_with_zero else x[-1:].expand(size - n % size)
            x = torch.cat([x, fill])
        g = x.view(-1, size)  # (groups, G)
        low = g.amin(dim=1, keepdim=True)
        step = (g.amax(dim=1, keepdim=True) - low) / 255
        step = torch.where(step > 0, step, torch.ones_like(step))
        q = (g - low) / step
        codes = (q.round() if rounding else q).to(dtype)
        return codes, low, step, t.shape, t.dtype, n

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        codes, low, step, shape, dtype, n = packed
        x = codes.float() * step + (low if add_low else 0)
        return x.reshape(-1)[:n].view(shape).to(dtype)

    return pack, unpack


def in_place_pack(t):
    if t.is_floating_point():
        t.mul_(1.0001)  # the mistake under test: the forward pass still uses t
    return t


def test_the_round_trip_bound_allows_the_references_fp32_rounding():
    """Draws on which the reference, one group per tensor, landed above (max − min)/510·(1 + 1e-6), the bound before
    fp32's rounding was derived into it (1 call in ~30 failed): within hooks8._bound now."""
    pack, unpack = make_hooks(group=None)
    for seed in (17, 93, 128):  # values in [5, 15); randn (n,); a transposed view
        for what, t in hooks8._round_trip_cases(random.Random(seed)):
            if t.is_floating_point():
                err = (unpack(pack(t)).double() - t.double()).abs()
                assert (err <= hooks8._bound(t)).all(), (seed, what)


def test_stored_bytes_counts_each_tensor_once_and_pass_through_as_the_original():
    t = torch.randn(4, 8)
    assert ch03.stored_bytes(t, t) == 128
    assert ch03.stored_bytes((t.t(), t), t) == 128  # a view of the same memory: once
    codes = torch.zeros(32, dtype=torch.uint8)
    assert ch03.stored_bytes({"c": codes, "meta": (torch.zeros(2), t.shape, "x")}, t) == 32 + 8


# --- 3.4: the online-softmax attention forward ------------------------------------------------------------------

def make_flash(no_rescale=False, lse_without_max=False, diagonal_hidden=False, no_scale=False, divide_in_loop=False,
               no_skip=False, no_max=False, no_mask=False, base2=False):
    """flash_forward by blocks of queries and keys (the solution's), with one planted mistake (or none)."""
    def flash_forward(q, k, v, causal, block):
        B, H, T, D = q.shape
        scale = 1.0 if no_scale else 1 / math.sqrt(D)
        o, lse = torch.empty_like(q), q.new_empty(B, H, T)
        for i in range(0, T, block):
            q_i = q[:, :, i:i + block]  # (B, H, bq, D)
            bq = q_i.shape[2]
            rows = torch.arange(i, i + bq)[:, None]  # (bq, 1)
            m, denom, acc = q.new_full((B, H, bq), -math.inf), q.new_zeros(B, H, bq), q.new_zeros(B, H, bq, D)
            for j in range(0, min(T, i + block) if causal and not no_skip else T, block):
                s = q_i @ k[:, :, j:j + block].transpose(-1, -2) * scale  # (B, H, bq, bk)
                if causal and j >= i and not no_mask:
                    cols = torch.arange(j, j + s.shape[-1])[None, :]  # (1, bk)
                    s = s.masked_fill(cols >= rows if diagonal_hidden else cols > rows, -math.inf)
                m_new = torch.zeros_like(m) if no_max else torch.maximum(m, s.amax(-1))  # (B, H, bq)
                alpha = torch.ones_like(m) if no_rescale else torch.exp(m - m_new)
                p = torch.exp(s - m_new[..., None])  # (B, H, bq, bk)
                denom = denom * alpha + p.sum(-1)
                acc = acc * alpha[..., None] + p @ v[:, :, j:j + block]  # (B, H, bq, D)
                if divide_in_loop:
                    acc = acc / denom[..., None]
                m = m_new
            o[:, :, i:i + block] = acc if divide_in_loop else acc / denom[..., None]
            lse[:, :, i:i + block] = (torch.log(denom) if lse_without_max else
                                      (m + torch.log(denom)) / math.log(2) if base2 else m + torch.log(denom))
        return o, lse
    return flash_forward


def flash_normalised(q, k, v, causal, block):
    """Also right: exp2 with log2(e) folded into the scale on q, and an output kept normalised at every key block
    (acc·(α·denom/denom_new) + p·v/denom_new), as some write FlashAttention's forward."""
    B, H, T, D = q.shape
    o, lse = torch.empty_like(q), q.new_empty(B, H, T)
    for i in range(0, T, block):
        q_i = q[:, :, i:i + block] * (math.log2(math.e) / math.sqrt(D))  # (B, H, bq, D)
        rows = torch.arange(i, i + q_i.shape[2])[:, None]
        m2, denom, out = q.new_full(q_i.shape[:3], -math.inf), q.new_zeros(q_i.shape[:3]), torch.zeros_like(q_i)
        for j in range(0, min(T, i + block) if causal else T, block):
            s2 = q_i @ k[:, :, j:j + block].transpose(-1, -2)  # (B, H, bq, bk) scores × log2 e
            if causal:
                s2 = s2.masked_fill(torch.arange(j, j + s2.shape[-1])[None, :] > rows, -math.inf)
            m_new = torch.maximum(m2, s2.amax(-1))
            p = torch.exp2(s2 - m_new[..., None])
            denom_new = denom * torch.exp2(m2 - m_new) + p.sum(-1)
            kept = torch.exp2(m2 - m_new) * denom / denom_new  # (B, H, bq) the share of the blocks before
            out = out * kept[..., None] + (p @ v[:, :, j:j + block]) / denom_new[..., None]  # (B, H, bq, D)
            m2, denom = m_new, denom_new
        o[:, :, i:i + block] = out
        lse[:, :, i:i + block] = (m2 + torch.log2(denom)) * math.log(2)
    return o, lse


def flash_keys_outer(q, k, v, causal, block):
    """Also right: FlashAttention-1's loop order, key blocks outside and query blocks inside, with m, denom and acc
    kept for every row ((B, H, T) and (B, H, T, D): the output's size, no (T, T) tensor)."""
    B, H, T, D = q.shape
    m, denom, acc = q.new_full((B, H, T), -math.inf), q.new_zeros(B, H, T), torch.zeros_like(q)
    for j in range(0, T, block):
        k_j, v_j = k[:, :, j:j + block], v[:, :, j:j + block]  # (B, H, bk, D)
        for i in range(j if causal else 0, T, block):  # causal: query blocks before this key block see none of it
            s = q[:, :, i:i + block] @ k_j.transpose(-1, -2) / math.sqrt(D)  # (B, H, bq, bk)
            if causal:
                cols, rows = torch.arange(j, j + s.shape[-1]), torch.arange(i, i + s.shape[-2])
                s = s.masked_fill(cols[None, :] > rows[:, None], -math.inf)
            m_i = m[:, :, i:i + block]
            m_new = torch.maximum(m_i, s.amax(-1))
            alpha, p = torch.exp(m_i - m_new), torch.exp(s - m_new[..., None])
            denom[:, :, i:i + block] = denom[:, :, i:i + block] * alpha + p.sum(-1)
            acc[:, :, i:i + block] = acc[:, :, i:i + block] * alpha[..., None] + p @ v_j
            m[:, :, i:i + block] = m_new
    return acc / denom[..., None], m + torch.log(denom)


def written_out(q, k, v, causal, block):
    """Right values from the whole (T, T) matrix: softmax(q·kᵀ/√D)·v and torch.logsumexp."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def keys_tiled_only(q, k, v, causal, block):
    """llmlab's own PyTorch reference of the Triton kernel: the online softmax over key blocks, every query at once."""
    return attention.reference(q, k, v, causal, block=block)


def test_llmlabs_reference_meets_the_flash_tolerance():
    """The tolerance holds llmlab's own online softmax (kernels/attention.py's `reference`, tiled by keys) to SDPA
    and torch.logsumexp on the check's cases, scores of ~10³ included."""
    for seed in range(8):
        for case in flash._cases(random.Random(seed)):
            q, k, v = case.inputs()
            s = flash._scores(q, k, case.causal, 1 / math.sqrt(case.D))
            tol = flash.TOL * max(1.0, s[s.isfinite()].abs().max().item())
            o, lse = attention.reference(q, k, v, case.causal, block=case.block)
            want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
            assert flash._close(o, want, tol) and flash._close(lse, torch.logsumexp(s, -1), tol), case


def test_largest_counts_the_memory_a_tensor_holds_not_its_shape():
    with flash._Largest() as largest:
        torch.zeros(3).expand(1000, 3)  # a view: 3 elements of memory
        torch.ones(4, 2) @ torch.ones(2, 6)  # 8, 12, then the product: 24
    assert (largest.elements, largest.shape) == (24, (4, 6))


# --- the tables: tests/test_checks_answers.py runs each once, tools/flake.py N times ------------------------------

ANSWERS = [
    Reference(ch03.zero1_step, zero1_step),
    Reference(ch03.zero1_step, zero1_with_lists),
    *[Mistake(ch03.zero1_step, make_zero1(**{mistake: True}), match=match, hint="reduce-scatter")
      for mistake, match in [
          ("no_padding", r"Ψ = \d+ is not a multiple of N = \d: pad the flat buffer"),
          ("inclusive_hi", "a shard is one element off"),
          ("size_plus_one", r"one more than the shard's S = ⌈Ψ/N⌉"),
          ("no_mean", "the sum over the ranks, not their mean"),
          ("no_bias_correction", "without bias correction"),
          ("l2", "L2 regularisation"),
          ("eps_inside", "ε is inside the square root"),
          ("no_eps", "ε is missing"),
          ("rebind_moments", "start from zero at every step.* rebinds a local name"),
          ("no_all_gather", r"rank \d's parameters differ from rank 0's .* all-gather every rank's updated"),
          ("no_copy_back", "the parameters never changed: copy the all-gathered"),
          ("master_from_zero", r"the shards? of ranks? [\d, ]+ differ — rank r owns flat elements"),
          ("full_state", "the whole model's: that is plain data parallelism's state"),
          ("view", "is a view of a \\d+-element buffer"),
          ("all_reduce", "your step all-reduced: ZeRO-1 reduce-scatters"),
      ]],

    Reference(ch03.checkpoint, make_checkpoint()),
    Reference(ch03.checkpoint, library_checkpoint),
    *[Mistake(ch03.checkpoint, answer, match=match, hint="torch.get_rng_state()") for answer, match in [
        (make_checkpoint(forward_grad=True), "saved [\\d,]+ bytes .* activations inside the block"),
        (make_checkpoint(save_output=True), "saved [\\d,]+ bytes .* save only the inputs"),
        (lambda fn, *inputs: fn(*inputs), "saved [\\d,]+ bytes .* activations inside the block"),  # no checkpoint
        (lambda fn, *inputs: torch.no_grad()(fn)(*inputs), "the output does not require grad"),
        (make_checkpoint(detach=False), "the inputs were not detached"),
        (make_checkpoint(enable_grad=False), "the recompute recorded no graph.* torch.enable_grad"),
        (make_checkpoint(grad_only_inputs=True), "got no gradient: backprop the recomputed outputs"),
        (make_checkpoint(grads_for_fn=0), r"backward returned \d gradients for the \d inputs of forward"),
        (make_checkpoint(p_grad=True), "which is not a tensor .*: return None there"),
        (make_checkpoint(save_every_input=True), "ctx.save_for_backward takes tensors only"),
        (lambda fn, *inputs: OneInput.apply(fn, torch.empty(0, requires_grad=True), *inputs),
         "several inputs .* forward\\(ctx, fn, anchor, \\*inputs\\)"),
        (lambda fn, *inputs: OneGradient.apply(fn, torch.empty(0, requires_grad=True), *inputs),
         r"backward\(ctx, \*grad_outputs\)"),
        (make_checkpoint(anchor=False), "pass an anchor"),
        (make_checkpoint(restore_rng=False), "gradients differ only where dropout is on"),
        (make_checkpoint(fork=False), "random generator is not where the plain run leaves it"),
        (make_checkpoint(autocast=False), "without autocast they are equal"),
    ]],

    Reference(ch03.pack_hooks, *make_hooks()),
    Reference(ch03.pack_hooks, *make_hooks(group=32)),  # smaller groups: more scales, still < 35%
    Reference(ch03.pack_hooks, *make_hooks(group=None)),  # one group per tensor: min-max still bounds the error
    *[Mistake(ch03.pack_hooks, *hooks, match=match, hint="torch.uint8") for hooks, match in [
        (make_hooks(add_low=False), "x̂ misses the minimum"),
        (make_hooks(rounding=False), "round the codes"),
        (make_hooks(dtype=torch.int16), "store the codes as torch.uint8"),
        (make_hooks(pad_with_zero=True), "above half an 8-bit step"),
        (make_hooks(params=True), "compressed .* parameter.* return parameters as they are"),
        ((lambda t: (t.half(), t.dtype) if t.is_floating_point() else t,
          lambda p: p[0].to(p[1]) if isinstance(p, tuple) else p), "packs into 50% .* torch.float16"),
        ((in_place_pack, lambda p: p), "pack changed the tensor it was given"),
        ((lambda t: t, lambda p: p), "packs into 100% of its bytes"),
    ]],

    Reference(ch03.flash_forward, make_flash()),
    Reference(ch03.flash_forward, flash_normalised),
    Reference(ch03.flash_forward, flash_keys_outer),
    *[Mistake(ch03.flash_forward, answer, match=match, hint="exp(m_old − m_new)") for answer, match in [
        (make_flash(no_rescale=True), "l and acc are not rescaled by exp\\(m_old − m_new\\) when the max grows"),
        (make_flash(divide_in_loop=True), "divide by l once, after the last key block"),
        (make_flash(lse_without_max=True), "lse equals log l without the row max"),
        (make_flash(base2=True), "lse is in base 2"),
        (make_flash(diagonal_hidden=True), "the causal mask hides the diagonal"),
        (make_flash(no_mask=True, no_skip=True), "o equals non-causal attention: the causal mask is missing"),
        (make_flash(no_scale=True), "the scale 1/√D is missing"),
        (make_flash(no_max=True), "exp of a score above 709 overflows float64"),
        (make_flash(no_skip=True), "the key blocks wholly after a query block's last row were computed"),
        (written_out, "you built the whole T×T score matrix"),
        (keys_tiled_only, "a strip of the score matrix"),
    ]],
]


@pytest.mark.parametrize("check, answers", [(ch03.zero1_step, [unwritten]), (ch03.checkpoint, [unwritten]),
                                            (ch03.pack_hooks, [unwritten, unwritten]),
                                            (ch03.flash_forward, [unwritten])])
def test_an_unwritten_answer_is_not_attempted(check, answers, capsys):
    not_attempted(check, *answers, capsys=capsys)
