"""Exercise 3.2's check: activation checkpointing as a `torch.autograd.Function`, run here on the CPU.

The learner's `checkpoint(fn, *inputs)` runs chains of 1–3 blocks, dropout on, fresh random odd sizes, next to the
plain run and to llmlab's own `llmlab.memory.checkpoint.checkpoint`, in four settings:

1. blocks of the chapter's GPT (`llmlab.model.Block`): one input, one output;
2. random "mixer" blocks `block(x, cond, p) -> (y, aux)`: a second tensor input (requiring grad or not), a float
   (the dropout probability) and two outputs, the second a scalar auxiliary loss (as an MoE block's balance loss);
3. the mixers under CPU autocast (bfloat16), with the backward outside it, as a training step runs it;
4. the mixers on data: no input requires grad (the first layers of a model), yet every parameter needs its gradient.

The outputs and every gradient must equal the plain run's bit for bit, the checkpointed forward must keep no
floating-point tensor for backward besides the blocks' inputs (every saved tensor is seen by
`torch.autograd.graph.saved_tensors_hooks`), as llmlab's keeps none, and the random generator must end where the plain
run leaves it. A known mistake is named: activations kept, the recompute's random state or autocast not restored,
inputs not detached, parameters without gradients, the wrong number of gradients returned, no anchor.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F

from llmlab.checks import Hint, Mismatch, assert_close, check, fresh_rng
from llmlab.memory import checkpoint as library
from llmlab.memory import measure
from llmlab.model import Block, GPTConfig


class _Mixer(torch.nn.Module):
    """A random block with two tensor inputs, a float and two outputs: y = x + W_o·dropout(gelu(W·LN(x) + U·cond), p),
    aux = mean of the squared hidden activations."""

    def __init__(self, d: int, hidden: int, k: int):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, hidden)
        self.cond = torch.nn.Linear(k, hidden, bias=False)
        self.out = torch.nn.Linear(hidden, d)

    def forward(self, x, cond, p: float):  # x (B, T, d), cond (B, T, k)
        a = F.dropout(F.gelu(self.fc(self.ln(x)) + self.cond(cond)), p, self.training)  # (B, T, hidden)
        return x + self.out(a), a.pow(2).mean()  # (B, T, d), ()


@dataclasses.dataclass
class _Case:
    what: str  # for the messages
    blocks: list
    x0: torch.Tensor  # (B, T, d)
    conds: list  # one (B, T, k) tensor per mixer block; None for GPT blocks (one input)
    x_grad: bool
    cond_grad: list
    p: float
    coeff: torch.Tensor  # the loss is Σ coeff·y + Σ aux_coeff·aux
    aux_coeff: list
    autocast: bool
    seed: int  # the dropout masks'


def _blocks(seed: int, n: int, make) -> list:
    """n blocks `make()`, their parameters drawn from `seed` (the global generator is left as it was)."""
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        return [make() for _ in range(n)]  # training mode: dropout on
    finally:
        torch.set_rng_state(state)


def _cases(rng) -> list[_Case]:
    cases = []
    n, B, T, p = rng.randint(1, 3), rng.randint(1, 3), rng.choice([1, 17, 33]), rng.choice([0.1, 0.3])
    config = GPTConfig.preset("tiny", dropout=p)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    blocks = _blocks(rng.randrange(2**31), n, functools.partial(Block, config))
    cases.append(_Case(f"{n} GPT block{'s' * (n > 1)} (dropout {p:g}) on x of shape {(B, T, config.n_embd)}", blocks,
                       torch.randn(B, T, config.n_embd, generator=gen), [None] * n, True, [False] * n, p,
                       torch.randn(B, T, config.n_embd, generator=gen), [0.0] * n, False, rng.randrange(2**31)))
    for setting in ("mixer", "autocast", "data"):
        n, B, T = rng.randint(2, 3), rng.randint(1, 3), rng.choice([5, 9, 13])
        d, hidden, k = rng.randrange(9, 34, 2), rng.randrange(17, 66, 2), rng.randrange(3, 10, 2)
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        blocks = _blocks(rng.randrange(2**31), n, functools.partial(_Mixer, d, hidden, k))
        data = setting == "data"
        cond_grad = [False] * n if data else [rng.random() < 0.5 for _ in range(n - 1)] + [True]
        p = rng.choice([0.1, 0.2, 0.5])
        what = (f"{n} mixer blocks block(x, cond, p) -> (y, aux) (x of shape {(B, T, d)}, hidden {hidden}, cond of "
                f"shape {(B, T, k)}, p = {p:g}"
                + {"mixer": f"; cond requires grad: {cond_grad})",
                   "autocast": ") under torch.autocast('cpu', dtype=torch.bfloat16)",
                   "data": ") on data: neither x nor cond requires grad"}[setting])
        cases.append(_Case(what, blocks, torch.randn(B, T, d, generator=gen),
                           [torch.randn(B, T, k, generator=gen) for _ in range(n)], not data, cond_grad, p,
                           torch.randn(B, T, d, generator=gen), [rng.uniform(0.5, 2.0) for _ in range(n)],
                           setting == "autocast", rng.randrange(2**31)))
    return cases


class _Kept:
    """The floating-point tensors saved for backward during each `around(inputs)` that are neither parameters nor
    (views of) those inputs: their bytes, each storage once. (A saved integer tensor — the 5 KB CPU random state,
    say — is allowed: it is no activation.)"""

    def __init__(self):
        self._counter = measure.StorageCounter()

    @property
    def bytes(self) -> int:
        return self._counter.bytes

    @contextmanager
    def around(self, inputs):
        allowed = {measure.storage_key(t) for t in inputs if isinstance(t, torch.Tensor)}

        def pack(t):
            if t.is_floating_point() and not measure.is_parameter(t) and measure.storage_key(t) not in allowed:
                self._counter.add(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield


def _run(case: _Case, using, count: bool = False) -> dict:
    """Forward the case's chain (each block through `using(block, *inputs)`, or plainly) from fresh leaf copies of
    its inputs and backward its loss; returns what the check compares. With `count`, only the forward, under the
    saved-tensor hooks that count what it keeps (`_Kept`): a separate run, since autograd hands a saved tensor
    that went through a hook back as another tensor object, and a wrong answer's gradients may depend on which."""

    for b in case.blocks:
        b.zero_grad(set_to_none=True)
    x = case.x0.clone().requires_grad_(case.x_grad)
    conds = [c if c is None else c.clone().requires_grad_(g) for c, g in zip(case.conds, case.cond_grad, strict=True)]
    kept = _Kept()
    torch.manual_seed(case.seed)
    h, auxes = x, []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.autocast):
        for b, c in zip(case.blocks, conds, strict=True):
            inputs = (h,) if c is None else (h, c, case.p)
            with kept.around(inputs) if count else nullcontext():
                out = b(*inputs) if using is None else using(b, *inputs)
            if c is None and not isinstance(out, torch.Tensor):
                raise Mismatch(f"{case.what}: checkpoint(block, x) returned {type(out).__name__}, expected the "
                               "block's output tensor")
            if c is not None and not (isinstance(out, tuple | list) and len(out) == 2
                                      and all(isinstance(t, torch.Tensor) for t in out)):
                raise Mismatch(f"{case.what}: checkpoint(block, x, cond, p) returned {type(out).__name__}, expected "
                               "what the block returns, a tuple (y, aux) of tensors: Checkpoint.apply returns all of "
                               "forward's outputs")
            h, aux = (out, None) if c is None else out
            auxes.append(aux)
    if count:
        return {"kept": kept.bytes}
    connected = h.requires_grad and all(a.requires_grad for a in auxes if a is not None)
    if connected:
        loss = (h.float() * case.coeff).sum() + sum(w * a.float() for w, a in zip(case.aux_coeff, auxes,
                                                                                    strict=True) if a is not None)
        loss.backward()
    named = [("the output y", h.detach())] + [(f"block {i}'s aux", a.detach()) for i, a in enumerate(auxes)
                                               if a is not None]
    grads = [("dL/dx", x.grad)] + [(f"dL/dcond of block {i}", c.grad) for i, c in enumerate(conds) if c is not None]
    grads += [(f"block {i}'s {name}", p.grad) for i, b in enumerate(case.blocks) for name, p in b.named_parameters()]
    return {"outputs": named, "grads": grads, "rng_after": torch.get_rng_state(), "connected": connected}


def _same(a, b) -> bool:
    return (a is None) == (b is None) and (a is None or (a.shape == b.shape and torch.equal(a, b)))


def _all_same(got: dict, want: dict) -> bool:
    return all(_same(a, b) for (_, a), (_, b) in zip(got["grads"], want["grads"], strict=True))


@contextmanager
def _changed(case: _Case, **changes):
    """The case with some settings changed (dropout off, autocast off) while the block runs."""
    before = {key: getattr(case, key) for key in changes if key != "train"}
    for key, value in changes.items():
        if key == "train":
            for b in case.blocks:
                b.train(value)
        else:
            setattr(case, key, value)
    try:
        yield case
    finally:
        for b in case.blocks:
            b.train()
        for key, value in before.items():
            setattr(case, key, value)


# What torch says when a Function goes wrong in a known way -> what the learner did
_ERRORS = (
    (r"returned an incorrect number of gradients \(expected (\d+), got (\d+)\)",
     "backward returned {1} gradients for the {0} inputs of forward: return one per input of forward, in order — None "
     "for fn, None for the anchor, then one per input of the block (its .grad, None for the float p)"),
    (r"returned a gradient different than None at position (\d+), but the corresponding forward input was not",
     "backward returned a tensor for input {0} of forward, which is not a tensor (fn, or the float p): return None "
     "there"),
    (r"save_for_backward can only save variables",
     "ctx.save_for_backward takes tensors only, and the block's inputs include the float p: save the tensor inputs "
     "and keep the others (and where each went) on ctx"),
    (r"backward through the graph a second time",
     "the inputs were not detached: the recompute ran on the saved tensors themselves, so its graph reached back into "
     "the blocks before, and the nested backward ran through them once already — recompute on fresh leaves, "
     "saved.detach().requires_grad_(saved.requires_grad)"),
    (r"element (\d+) of tensors does not require grad",
     "the recompute recorded no graph: a Function's backward runs with grad disabled, so run fn again inside "
     "`with torch.enable_grad():`, on inputs that require grad"),
    (r"forward\(\) takes (\d+) positional arguments? but (\d+) were given",
     "the block takes several inputs (x, cond, p), and Checkpoint.apply passes every one of them to forward: "
     "forward(ctx, fn, anchor, *inputs)"),
    (r"backward\(\) takes (\d+) positional arguments? but (\d+) were given",
     "the block returns several outputs, and backward gets one gradient for each: backward(ctx, *grad_outputs)"),
)


def _learners_run(case: _Case, fn, count: bool = False) -> dict:
    try:
        return _run(case, fn, count)
    except (RuntimeError, TypeError) as e:
        for pattern, text in _ERRORS:
            found = re.search(pattern, str(e))
            if found:
                raise Mismatch(f"{case.what}: {type(e).__name__}: {text.format(*found.groups())}",
                               mistake=pattern) from None
        raise


def _compare(case: _Case, got: dict, plain: dict, fn) -> None:
    where = case.what
    for (name, a), (_, b) in zip(got["outputs"], plain["outputs"], strict=True):
        if not _same(a, b):
            assert_close(a, b, what=f"{where}: {name} of checkpoint(block, …)", rtol=0, atol=0)
            raise Mismatch(f"{where}: {name} differs from the plain block's in its bits")
    missing = [name for (name, g), (_, want) in zip(got["grads"], plain["grads"], strict=True)
               if g is None and want is not None]
    if missing and not missing[0].startswith("block "):
        raise Mismatch(f"{where}: {missing[0]} is None: backward must return the gradient of every input that "
                       "requires grad — the .grad of its fresh leaf in the recomputed graph", mistake="input grad")
    if missing:
        raise Mismatch(f"{where}: {missing[0]} got no gradient: backprop the recomputed outputs with "
                       "torch.autograd.backward(outputs, grad_outputs), which fills the parameters' .grad "
                       "(torch.autograd.grad with respect to the inputs alone does not)", mistake="parameter grad")
    differ = [name for (name, a), (_, b) in zip(got["grads"], plain["grads"], strict=True) if not _same(a, b)]
    if differ:
        listed = f"{', '.join(differ[:3])}{' …' * (len(differ) > 3)}"
        x_got, x_want = got["grads"][0][1], plain["grads"][0][1]
        if x_want is not None and torch.equal(x_got, 2 * x_want):
            raise Mismatch(f"{where}: dL/dx is twice the plain run's: the inputs were not detached — the recompute "
                           "ran on the saved x itself, so the nested backward already added its gradient to x, and "
                           "the returned gradient added it again; recompute on a fresh leaf, "
                           "saved.detach().requires_grad_(saved.requires_grad)", mistake="not detached")
        if case.autocast:
            with _changed(case, autocast=False):
                if _all_same(_run(case, fn), _run(case, None)):
                    raise Mismatch(f"{where}: the gradients of {listed} differ from the plain run's, and without "
                                   "autocast they are equal: the backward runs outside the forward's autocast, so "
                                   "the recompute computed in float32 what the forward computed in bfloat16 — keep "
                                   "torch.is_autocast_enabled('cpu') and torch.get_autocast_dtype('cpu') in forward "
                                   "and recompute under torch.autocast('cpu', dtype=…, enabled=…)", mistake="autocast")
        with _changed(case, train=False):  # dropout off: does the answer hold then?
            if _all_same(_run(case, fn), _run(case, None)):
                raise Mismatch(f"{where}: the gradients of {listed} differ from the plain run's, and with dropout "
                               "off they are equal: gradients differ only where dropout is on — the recompute draws "
                               "new dropout masks; save torch.get_rng_state() in forward and restore it before "
                               "recomputing", mistake="rng")
        name, a, b = next((n, a, b) for (n, a), (_, b) in zip(got["grads"], plain["grads"], strict=True)
                          if not _same(a, b))
        assert_close(a, b, what=f"{where}: {name}", rtol=0, atol=0)
        raise Mismatch(f"{where}: {name} differs from the plain run's in its bits")


@check("3.2", "Activation checkpointing as an autograd.Function", hint=Hint(
    nudge="compare what your forward keeps with what your backward needs to run the block again: its inputs, fn, "
          "the random state and the autocast state",
    idea="the forward keeps only the tensor inputs (and fn, the other inputs, the RNG and autocast state) and runs fn "
         "without a graph; the backward runs fn again on fresh leaves, with grad on, from the same random state "
         "and under the same autocast, backpropagates the outputs' gradients through that recomputation and returns "
         "one gradient per input of forward",
    formula="forward(ctx, fn, anchor, *inputs): ctx.fn = fn; ctx.rng = torch.get_rng_state() (before fn draws); "
            "ctx.autocast = torch.is_autocast_enabled('cpu'), torch.get_autocast_dtype('cpu'); save the tensor "
            "inputs with ctx.save_for_backward and keep the others on ctx; return fn(*inputs). backward(ctx, "
            "*grad_outputs): inputs again, each saved tensor as saved.detach().requires_grad_(saved.requires_grad); "
            "under `with torch.random.fork_rng(devices=[]), torch.enable_grad(), torch.autocast('cpu', dtype=…, "
            "enabled=…):` torch.set_rng_state(ctx.rng) and outputs = ctx.fn(*inputs); "
            "torch.autograd.backward(the outputs that require grad, their grad_outputs); return None, None, then each "
            "input's .grad (None for a non-tensor). checkpoint(fn, *inputs): Checkpoint.apply(fn, "
            "torch.empty(0, requires_grad=True), *inputs)"))
def checkpoint(fn):
    """`fn(block, *inputs)` → block(*inputs), keeping only the tensor inputs (and the random and autocast state) for
    backward and recomputing the block in backward; inputs are tensors (requiring grad or not) and floats."""

    # Tolerance 0: a right answer repeats the forward's CPU kernels on the same input bits, with the same dropout
    # masks and the same autocast dtype, so every activation of the recompute has the plain run's bits; and each
    # gradient is the same sum, since in these blocks a tensor feeds at most two ops (x: the residual and the
    # LayerNorm), and IEEE addition of two terms gives the same bits in either order.
    for case in _cases(fresh_rng()):
        plain = _run(case, None)
        got = _learners_run(case, fn)
        if not got["connected"]:
            if not case.x_grad and not any(case.cond_grad):
                raise Mismatch(f"{case.what}: the outputs do not require grad, so backward never reaches the "
                               "blocks and their parameters get no gradient: a Function's output requires grad only "
                               "when one of its tensor inputs does — pass an anchor, torch.empty(0, "
                               "requires_grad=True), to Checkpoint.apply (its gradient is None)", mistake="anchor")
            raise Mismatch(f"{case.what}: the output does not require grad, so no backward can run: return "
                           "Checkpoint.apply(fn, anchor, *inputs) (an autograd.Function), not fn(*inputs) under "
                           "torch.no_grad()")
        _compare(case, got, plain, fn)
        if not torch.equal(got["rng_after"], plain["rng_after"]):
            raise Mismatch(f"{case.what}: after backward the random generator is not where the plain run leaves it: "
                           "the recompute rewound it (torch.set_rng_state) and left it there, so the next dropout "
                           "masks would repeat old ones; recompute inside `with torch.random.fork_rng(devices=[]):`, "
                           "which puts the state back when it ends")
        kept = {name: _run(case, using, count=True)["kept"] for name, using in (("plain", None),
                                                                                ("ours", library.checkpoint))}
        kept["got"] = _learners_run(case, fn, count=True)["kept"]
        if kept["got"] > kept["ours"]:
            raise Mismatch(f"{case.what}: your checkpointed blocks saved {kept['got']:,} bytes of floating-point "
                           f"tensors for backward besides their inputs (llmlab's checkpoint saves {kept['ours']:,}, "
                           f"the plain run {kept['plain']:,}): activations inside the block were saved — save only "
                           "the inputs (ctx.save_for_backward), and run fn without recording a graph (an "
                           "autograd.Function's forward runs with grad off: no torch.enable_grad() there)",
                           mistake="kept")
