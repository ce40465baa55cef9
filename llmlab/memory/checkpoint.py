"""Activation checkpointing, from scratch: keep a segment's input, recompute its insides in backward.

Chen, Xu, Zhang & Guestrin 2016, "Training Deep Nets with Sublinear Memory Cost". A network of n layers
saves every layer's activations for backward: memory grows as n. Cut it into k segments and, in the forward
pass, keep only each segment's *input*; in the backward pass, run the segment's forward again (with grad on)
just before its backward needs the activations. Memory is then

    k segment inputs  +  one segment's full activations (n/k layers), during its recompute,

smallest near k = √n, at the price of one extra forward of the checkpointed layers. A forward costs about
a third of forward + backward (2ND of 6ND FLOPs), so recomputing everything adds ≈ 33% (8ND instead of 6ND).

Two things make recompute exact:
- **the RNG**: dropout draws random masks. `checkpoint` saves the CPU (and CUDA) generator state before the
  forward and restores it for the recompute (inside `torch.random.fork_rng`, so the RNG stream after
  backward is unchanged): the same masks, so gradients equal the uncheckpointed run bit for bit;
- **autocast**: the recompute runs under the same autocast state as the forward, so it computes in the same
  precision.

    from llmlab.memory.checkpoint import checkpoint, checkpoint_sequential, checkpointed
    y = checkpoint(block, x)                               # one segment
    y = checkpoint_sequential(blocks, segments=4, x=x)     # n modules in 4 segments (the last not checkpointed)
    with checkpointed(model.transformer.h):                # every GPT block checkpointed, state_dict unchanged
        model(idx, targets)[1].backward()

This is the "reentrant" design (the backward runs a nested `torch.autograd.backward`), like
torch.utils.checkpoint with `use_reentrant=True`: it supports `.backward()`, not `torch.autograd.grad` with
respect to the parameters inside. The RNG state (a 5 KB CPU tensor, 16 bytes per CUDA device) is kept
outside autograd's saved tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from llmlab import runtime, timing, validation
from llmlab.memory import measure
from llmlab.model import GPT, GPTConfig

__all__ = ["checkpoint", "checkpoint_sequential", "checkpointed", "segment_sweep", "STEP_NAMES", "StepTimes",
           "step_times", "bench_every_block", "bench"]


class _Checkpoint(torch.autograd.Function):
    """forward(fn, anchor, *args) = fn(*args) run without saving; backward recomputes and backprops it."""

    @staticmethod
    def forward(ctx, fn, anchor, *args):
        # An autograd.Function's forward always runs with grad disabled: nothing inside fn is saved.
        ctx.fn = fn
        ctx.devices = sorted({a.get_device() for a in args if isinstance(a, torch.Tensor) and a.is_cuda})
        ctx.cpu_rng = torch.get_rng_state()  # taken before fn draws anything
        ctx.cuda_rng = runtime.cuda_rng_states(ctx.devices)
        ctx.autocast = {kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                        for kind in ("cpu", *(("cuda",) if ctx.devices else ()))}
        ctx.tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_at))  # the segment's input: all that is kept
        return fn(*args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        args = list(ctx.others)
        for i, saved in zip(ctx.tensor_at, ctx.saved_tensors, strict=True):
            args[i] = saved.detach().requires_grad_(saved.requires_grad)  # a fresh leaf to backprop into
        with torch.random.fork_rng(devices=ctx.devices), ExitStack() as stack:
            torch.set_rng_state(ctx.cpu_rng)
            runtime.set_cuda_rng_states(ctx.cuda_rng, ctx.devices)
            for kind, (enabled, dtype) in ctx.autocast.items():
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())
            outputs = ctx.fn(*args)  # the forward again, this time saving its activations
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if o.requires_grad and g is not None]
        if pairs:  # fills the .grad of args and of the parameters fn used
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = [a.grad if isinstance(a, torch.Tensor) else None for a in args]
        return (None, None, *grads)


def checkpoint(fn: Callable, *args):
    """`fn(*args)`, keeping only `args` (and the RNG state) for backward; the backward recomputes fn.

    `fn` returns a tensor or a tuple of tensors; non-tensor `args` are passed through (use functools.partial
    for keyword arguments). With grad disabled it is just `fn(*args)`.
    """
    if not callable(fn):
        raise ValueError(f"fn must be callable (a module or function), got {type(fn).__name__}")
    if not torch.is_grad_enabled():
        return fn(*args)
    # The anchor requires grad so the output does too, even when no input does (the first segment's input is
    # often data): otherwise autograd would never call backward and fn's parameters would get no gradient.
    anchor = torch.empty(0, requires_grad=True)
    return _Checkpoint.apply(fn, anchor, *args)


def _run(modules: Sequence[Callable]) -> Callable:
    def run(x):
        for module in modules:
            x = module(x)
        return x
    return run


def checkpoint_sequential(modules: Iterable[Callable], segments: int, x: torch.Tensor) -> torch.Tensor:
    """Run `modules` in order on `x`, cut into `segments` consecutive segments of (nearly) equal length.

    The first segments - 1 are checkpointed; the last runs normally, as in torch.utils.checkpoint's
    checkpoint_sequential: its activations are the first the backward needs, so recomputing them would be
    pure waste. Saved for backward: segments - 1 segment inputs + the last segment's activations; `segments=1`
    checkpoints nothing.
    """
    modules = list(modules)
    if not modules:
        raise ValueError("modules is empty: checkpoint_sequential needs at least one module")
    validation.integer("segments", segments, 1, len(modules), hint="(at most one segment per module)")
    n = len(modules)
    bounds = [round(i * n / segments) for i in range(segments + 1)]  # segment i is modules[bounds[i]:bounds[i+1]]
    for start, end in zip(bounds[:-2], bounds[1:-1], strict=True):
        x = checkpoint(_run(modules[start:end]), x)
    return _run(modules[bounds[-2]:])(x)


@contextmanager
def checkpointed(modules: Iterable[torch.nn.Module], using: Callable = checkpoint):
    """Inside the `with` block, calling any of `modules` runs it under `using` (this module's `checkpoint`).

    Each module's `forward` is wrapped on the instance and restored on exit, so module names and the
    state_dict stay as they are: `with checkpointed(model.transformer.h): ...` checkpoints every GPT block.
    A backward after the block still recomputes correctly (it calls the original forward). `using` may be
    another implementation with the same signature, e.g.
    `functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)`.
    """
    modules = list(modules)
    bad = [type(m).__name__ for m in modules if not isinstance(m, torch.nn.Module)]
    if bad:
        raise ValueError(f"modules must be torch.nn.Module instances, got {bad[0]}")
    if not callable(using):
        raise ValueError(f"using must be a checkpoint function, got {type(using).__name__}")
    own = [m.__dict__.get("forward") for m in modules]  # an instance-level forward someone else set, if any
    for m in modules:
        m.forward = functools.partial(using, m.forward)
    try:
        yield
    finally:
        for m, previous in zip(modules, own, strict=True):
            del m.forward
            if previous is not None:
                m.forward = previous


# --- measured: saved bytes vs segments, step time (`llmlab bench checkpoint`; claim C9, llmlab.claims.ch03) ---

def _torch_checkpoint() -> Callable:
    return functools.partial(torch_checkpoint, use_reentrant=False)


def segment_sweep(segments: Sequence[int] = (1, 2, 4, 8, 16), n_layer: int = 16, batch_size: int = 4,
                  preset: str = "tiny") -> list[dict]:
    """Saved-activation bytes of `n_layer` GPT blocks run by checkpoint_sequential in k segments, next to
    Chen et al.'s count: (k - 1) segment inputs I + the last segment's n/k blocks × one block's bytes A (I is
    x's bytes, A what one block saves without checkpointing). Recomputing an earlier segment in backward
    holds no more (fewer inputs, one segment's activations), so with equal segments this is also the peak.
    (k - 1)·I + (n/k)·A is smallest at k ≈ √(n·A/I): √n when A ≈ I; a tiny block saves A ≈ 20·I at T = 64,
    so the minimum shows once n > 20 (e.g. n_layer=64: k = 32 beats both 16 and 64)."""

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset, n_layer=n_layer))
    blocks, T, C = list(model.transformer.h), model.config.block_size, model.config.n_embd
    x = torch.randn(batch_size, T, C, requires_grad=True)  # (B, T, C): what the first block receives
    _, per_block = measure.saved_activation_bytes(blocks[0], x)
    rows = []
    for k in segments:
        _, saved = measure.saved_activation_bytes(checkpoint_sequential, blocks, k, x)
        last = n_layer - round((k - 1) * n_layer / k)  # blocks in the last, uncheckpointed segment
        predicted = (k - 1) * measure.tensor_bytes(x) + last * per_block
        rows.append({"segments": k, "saved_bytes": saved, "predicted_bytes": predicted})
    return rows


def _gpt_steps(preset: str | None, batch_size: int | None):
    """A GPT of `preset` (this tier's by default) on this tier's device, and step(using, backward, count): one
    forward (+ backward) with every block under `using` (None: not checkpointed); with `count`, the bytes saved
    for backward (the counting hook runs Python per saved tensor, so timed steps do not count)."""

    p, device = runtime.preset(), runtime.device()
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset or p.model)).to(device)
    B, T = batch_size or p.batch_size, model.config.block_size
    idx = torch.randint(0, model.config.vocab_size, (B, T), device=device)  # (B, T)

    def step(using: Callable | None, backward: bool = True, count: bool = False) -> int | None:
        with ExitStack() as stack:
            if using is not None:
                stack.enter_context(checkpointed(model.transformer.h, using))
            saved = stack.enter_context(measure.SavedActivations()) if count else None
            loss = model(idx, idx)[1]
        if backward:  # the recompute calls the blocks' own forward: it needs no wrapping
            loss.backward()
        model.zero_grad(set_to_none=True)
        return saved.bytes if count else None

    return device, f"{preset or p.model} GPT ({model.config.n_layer} blocks) B={B} T={T}", step


STEP_NAMES = ("no checkpointing", "llmlab checkpoint", "torch.utils.checkpoint", "forward only")


@dataclass(frozen=True)
class StepTimes:
    """What `step_times` measured: the GPT it ran (`size`), one interleaved `timing.Rounds` of STEP_NAMES, and
    the MB saved for backward by each step."""

    size: str
    rounds: timing.Rounds
    saved_MB: dict[str, float]

    @property
    def overhead(self) -> timing.Comparison:
        """Every block checkpointed against no checkpointing: the step-time ratio (1.33 = the material's +33%)."""
        return self.rounds.ratio("llmlab checkpoint", "no checkpointing")

    @property
    def forward_share(self) -> timing.Comparison:
        """A forward alone over a forward + backward: what one more forward costs, in steps."""
        return self.rounds.ratio("forward only", "no checkpointing")


@timing.remembered
def step_times(preset: str | None = None, batch_size: int | None = None) -> StepTimes:
    """A training step of a GPT `preset` (this tier's model, device and batch size by default) with no
    checkpointing, with every block under this module's `checkpoint` and under torch.utils.checkpoint, and a
    forward alone, all four timed in the same interleaved rounds (`llmlab.timing.interleave`): a busy spell of
    the machine hits all of them, so the ratios between them hold where the times do not.

    `step_times.recent()` is the last such measurement (`timing.remembered`): chapter 3's cell and claim C9
    show one measurement, not two taken at different moments."""
    if batch_size is not None:
        validation.positive_int("batch_size", batch_size)
    device, size, step = _gpt_steps(preset, batch_size)
    wrappers = dict(zip(STEP_NAMES, (None, checkpoint, _torch_checkpoint()), strict=False))  # the three steps
    fns = {**{name: functools.partial(step, using) for name, using in wrappers.items()},
           "forward only": functools.partial(step, None, backward=False)}
    # Rounds of ≥ 80 ms per step kind: a few steps each, so a moment of other work on the machine averages out
    rounds = timing.interleave(fns, device=device, warmup=2, min_rounds=7, max_rounds=30, budget_s=3.0,
                               min_round_s=0.08)
    saved = {name: step(using, count=True) / 1e6 for name, using in wrappers.items()}
    return StepTimes(size, rounds, saved)


def bench_every_block(preset: str | None = None, batch_size: int | None = None) -> list[dict]:
    """`step_times` as bench rows: every block checkpointed against no checkpointing and against
    torch.utils.checkpoint (ratios of the same rounds, with their spread and the load), the saved-activation MB
    of both; the first row also has `forward_share` (and its spread)."""
    t = step_times.recent(preset, batch_size)
    rows = [{"impl": "checkpoint every block", "peer": peer, "size": t.size,
             **t.rounds.ratio("llmlab checkpoint", peer).row(), "saved_MB": t.saved_MB["llmlab checkpoint"],
             "peer_saved_MB": t.saved_MB[peer]} for peer in ("no checkpointing", "torch.utils.checkpoint")]
    rows[0].update(forward_share=t.forward_share.ratio, forward_share_spread=t.forward_share.spread)
    return rows


def bench(preset: str | None = None, batch_size: int | None = None) -> list[dict]:
    """Step time and saved bytes with every block checkpointed, vs no checkpointing and vs
    torch.utils.checkpoint (non-reentrant); then saved bytes vs number of segments (`segment_sweep`)."""
    rows = bench_every_block(preset, batch_size)
    for r in segment_sweep():
        rows.append({"impl": f"checkpoint_sequential k={r['segments']}", "peer": "Chen et al. count",
                     "size": "16 tiny blocks B=4 T=64", "saved_MB": r["saved_bytes"] / 1e6,
                     "peer_saved_MB": r["predicted_bytes"] / 1e6, "ratio": r["saved_bytes"] / r["predicted_bytes"]})
    return rows
