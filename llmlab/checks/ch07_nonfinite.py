"""Check 7.4 (re-exported by llmlab.checks.ch07): find the module where a NaN or inf is born.

    from llmlab.checks import ch07 as check
    check.first_nonfinite(first_nonfinite)    # 7.4

The learner's `first_nonfinite(model, x) -> str | None` runs `model(x)` once and returns the name (as
`model.named_modules()` gives it, "" for the model itself) of the first module to finish its forward with a
non-finite output from finite inputs, or None where no module does (every output finite, or the input already held
a NaN). The answer is `llmlab.diagnose.divergence.NonFiniteWatch`'s `first_forward` on the same model and input; the
model must keep no hook of the learner's afterwards.

Every run builds fresh models of random odd sizes — a residual MLP (`_Net`: blocks with a LayerScale-like gain,
the block's own parameter, and an output temperature, the model's own) and llmlab's tiny GPT (tokens in, a tuple
(logits, None) out) — and plants, in turn: an inf in a random leaf's weight or bias (float32), a NaN in another,
a NaN in a block's gain (the block's own operation, no child's, makes it), a NaN in the model's temperature (the
model itself is the culprit), an fp16 input that overflows, an inf or NaN in a random parameter of the GPT, no
fault at all, and a NaN in the input itself.
"""

from __future__ import annotations

import torch
from torch import nn

from llmlab.checks import Hint, Mismatch, check, fresh_rng
from llmlab.diagnose.divergence import NonFiniteWatch
from llmlab.model import GPT, GPTConfig

__all__ = ["first_nonfinite"]

FP16_TRIES = 50  # fp16 inputs drawn until one overflows a module (one in two does: their scale is near fp16's max)

_HINTS = {
    "inputs": Hint(
        nudge="look at the input the check gave your function: is it finite?",
        idea="a module whose inputs already hold a NaN or inf only passes it on: the culprit is where the first "
             "non-finite value is born, from finite inputs, and when the model's input holds one, no module is",
        formula="blame a module only when finite(inputs) and not finite(outputs); return None when none is"),
    "container": Hint(
        nudge="look at which module you name when several have a non-finite output: is it the first, or the last?",
        idea="a forward hook fires when its module finishes, so children fire before the module that contains "
             "them; once the culprit is found, every container around it also has finite inputs and a non-finite "
             "output, and the model itself finishes last",
        formula="keep the first name only: if first is None and finite(inputs) and not finite(outputs): first = name"),
    "inf": Hint(
        nudge="look at how you test a tensor for a bad value",
        idea="an overflow gives inf, not NaN (an fp16 value past 65504, an inf weight times a number); the NaN comes "
             "a module later (inf − inf in a LayerNorm), so testing for NaN alone blames the wrong module",
        formula="finite(tensors) = all(bool(torch.isfinite(t).all()) for t in tensors if isinstance(t, torch.Tensor) "
                "and t.is_floating_point())"),
    "leaves": Hint(
        nudge="look at which modules you watch: all of them, or only those without children?",
        idea="a module's own forward computes too (a block's residual add and gain, a model's division by its "
             "temperature): a module with children can make a NaN from children whose outputs were all finite",
        formula="register a forward hook on every module of model.named_modules(), the model itself (name '') "
                "included"),
    "hooks": Hint(
        nudge="look at what your function leaves on the model when it returns",
        idea="a hook stays registered until its handle's remove() is called, and it runs at every later forward: "
             "remove every hook you registered, also when the forward raises",
        formula="handles = [m.register_forward_hook(...) for ...]; try: model(x) finally: for h in handles: "
                "h.remove()"),
    "first": Hint(
        nudge="look at the order your hooks see the modules in, and at what each one tests",
        idea="the culprit is the first module, in the order the forward finishes them, whose inputs are all finite "
             "and whose output is not",
        formula="hook(module, inputs, output): outputs = output if it is a tuple else (output,); if first is None "
                "and finite(inputs) and not finite(outputs): first = name"),
}


class _Block(nn.Module):
    """A pre-norm residual MLP block with a per-channel gain (its own parameter, as a LayerScale)."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.ln, self.up, self.act, self.down = (nn.LayerNorm(width), nn.Linear(width, hidden), nn.GELU(),
                                                 nn.Linear(hidden, width))
        self.gain = nn.Parameter(torch.full((width,), 0.5))

    def forward(self, x):  # (B, width)
        return x + self.gain * self.down(self.act(self.up(self.ln(x))))  # (B, width)


class _Net(nn.Module):
    """inp → blocks → norm → head, divided by a temperature (the model's own parameter)."""

    def __init__(self, d_in: int, width: int, hidden: int, depth: int, d_out: int):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(_Block(width, hidden) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, d_out)
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, x):  # (B, d_in)
        h = self.inp(x)  # (B, width)
        for block in self.blocks:
            h = block(h)  # (B, width)
        return self.head(self.norm(h)) / self.temperature  # (B, d_out)


@check("7.4", "find a NaN's first module", hint=_HINTS["first"])
def first_nonfinite(fn):
    """`fn(model, x) -> name or None`: see the module docstring."""
    rng = fresh_rng()
    with torch.random.fork_rng(devices=[]):  # the learner's random state is left as it was
        torch.manual_seed(rng.randrange(1 << 30))
        for what, model, x in _cases(rng):
            _judge(fn, what, model, x)


def _net(rng) -> tuple[_Net, torch.Tensor]:
    """A fresh _Net of odd random sizes and its float32 input (B, d_in)."""
    d_in, width, hidden, d_out = (rng.randrange(3, 40, 2) for _ in range(4))
    x = torch.randn(rng.randrange(1, 10, 2), d_in)  # (B, d_in)
    return _Net(d_in, width, hidden, rng.randint(1, 4), d_out).eval(), x


def _plant(rng, model: nn.Module, value: float, names=None) -> str:
    """Set one random element of one random parameter of `model` (among `names`) to `value`; return its name."""
    params = dict(model.named_parameters())
    name = rng.choice(sorted(names if names is not None else params))
    with torch.no_grad():
        flat = params[name].view(-1)
        flat[rng.randrange(flat.numel())] = value
    return name


def _leaf_params(model: nn.Module) -> list[str]:
    return [f"{m}.{p}" for m, module in model.named_modules() if not list(module.children())
            for p, _ in module.named_parameters(recurse=False)]


def _cases(rng):
    """(what was planted, model, input) of every case, in the order of the module docstring."""
    model, x = _net(rng)
    where = _plant(rng, model, rng.choice((1, -1)) * float("inf"), _leaf_params(model))
    yield f"an inf in {where} (float32)", model, x
    model, x = _net(rng)
    yield f"a NaN in {_plant(rng, model, float('nan'), _leaf_params(model))} (float32)", model, x
    model, x = _net(rng)
    block = rng.randrange(len(model.blocks))
    yield f"a NaN in {_plant(rng, model, float('nan'), [f'blocks.{block}.gain'])} (float32)", model, x
    model, x = _net(rng)
    yield f"a NaN in {_plant(rng, model, float('nan'), ['temperature'])} (float32)", model, x
    yield _overflow(rng)
    T, B = rng.randrange(5, 32, 2), rng.randrange(1, 6, 2)
    gpt = GPT(GPTConfig.preset("tiny", block_size=T)).eval()
    value = rng.choice((float("inf"), float("-inf"), float("nan")))
    idx = torch.randint(0, gpt.config.vocab_size, (B, T))  # (B, T) token ids
    yield f"{value} in {_plant(rng, gpt, value)} of llmlab's tiny GPT (tokens {tuple(idx.shape)} in)", gpt, idx
    model, x = _net(rng)
    yield "no fault", model, x
    model, x = _net(rng)
    x.view(-1)[rng.randrange(x.numel())] = float("nan")
    yield "a NaN in the input itself", model, x


def _overflow(rng):
    """A _Net in fp16 and a finite fp16 input of values near fp16's largest (65504) that overflows a module."""
    for _ in range(FP16_TRIES):
        model, x = _net(rng)
        model = model.half()
        scale = rng.uniform(2e4, 6e4)
        x = (x * scale).clamp(-65000, 65000).half()  # (B, d_in): finite in fp16
        if _expected(model, x) is not None:
            return f"an fp16 input up to {float(x.abs().max()):.0f} (fp16's largest is 65504)", model, x
    raise RuntimeError(f"no fp16 input of {FP16_TRIES} overflowed")  # one in two does: never seen


def _expected(model: nn.Module, x: torch.Tensor) -> str | None:
    with NonFiniteWatch(model, backward=False) as watch, torch.no_grad():
        model(x)
    culprit = watch.first_forward
    return None if culprit is None else "" if culprit.module == "(model)" else culprit.module


def _output_of(model: nn.Module, x: torch.Tensor, name: str) -> list[torch.Tensor]:
    """The floating-point tensors module `name` outputs in a forward of `model` on `x`."""
    seen = []
    module = model.get_submodule(name)
    handle = module.register_forward_hook(lambda m, i, out: seen.extend(out if isinstance(out, tuple) else (out,)))
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    return [t for t in seen if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _hooks(model: nn.Module) -> dict[str, int]:
    return {name: len(m._forward_hooks) + len(m._forward_pre_hooks) for name, m in model.named_modules()}


def _label(name: str | None) -> str:
    return "None" if name is None else "the model itself ('')" if name == "" else repr(name)


def _judge(fn, what: str, model: nn.Module, x: torch.Tensor) -> None:
    want = _expected(model, x)
    before = _hooks(model)
    got = fn(model, x.clone())
    left = [n or "(model)" for n, k in _hooks(model).items() if k > before[n]]
    if left:
        raise Mismatch(f"after your function returned, {len(left)} module(s) still hold a hook of yours ({left[0]} "
                       "among them)", mistake="hooks", hint=_HINTS["hooks"])
    if got is not None and not isinstance(got, str):
        raise Mismatch(f"your function returned {type(got).__name__} {got!r:.60}, expected a module's name (a str, as "
                       "model.named_modules() gives it) or None")
    names = dict(model.named_modules())
    if got is not None and got not in names:
        raise Mismatch(f"{got!r:.60} is not the name of a module of the model (model.named_modules() names them: "
                       f"{', '.join(repr(n) for n in list(names)[:4])}, …)")
    if got == want:
        return
    case = f"with {what}, the culprit is {_label(want)}" + (f" ({type(names[want]).__name__})" if want else "")
    if want is None and not bool(torch.isfinite(x).all()):
        raise Mismatch(f"{case}: the input already holds a NaN, so no module made one, and you said {_label(got)}",
                       mistake="inputs", hint=_HINTS["inputs"])
    if want is not None and got is not None and (got == "" or want.startswith(got + ".")):
        raise Mismatch(f"{case}, and you said {_label(got)}, which contains it: it finished later",
                       mistake="container", hint=_HINTS["container"])
    if want is not None:
        out = _output_of(model, x, want)
        if not any(bool(t.isnan().any()) for t in out):
            raise Mismatch(f"{case}, and you said {_label(got)}: its output holds inf, and no NaN", mistake="inf",
                           hint=_HINTS["inf"])
        if list(names[want].children()):
            raise Mismatch(f"{case}, and you said {_label(got)}: its children's outputs are finite, and its own "
                           "forward makes the NaN", mistake="leaves", hint=_HINTS["leaves"])
    raise Mismatch(f"{case}, and you said {_label(got)}", mistake="first", hint=_HINTS["first"])
