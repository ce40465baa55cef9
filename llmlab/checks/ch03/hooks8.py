"""Exercise 3.3's check: 8-bit saved-tensor hooks, run here on the CPU.

It checks the round trip of single tensors against the min-max quantization bound (half an 8-bit step of the
tensor's range), then trains one step of the tiny GPT (`llmlab.model`) under the hooks: forward unchanged, saved
bytes at most `MAX_BYTES_RATIO` of fp32, gradients within `GRAD_ERROR_FACTOR` × the error of llmlab's own 8-bit
compression (`llmlab.memory.compress`). `stored_bytes` counts what a pack hook's result keeps.
"""

from __future__ import annotations

import dataclasses
import math
import random

import torch

from llmlab.checks import Hint, Mismatch, check, fresh_rng
from llmlab.data import MarkovSource, SyntheticDataset
from llmlab.memory import compress, measure
from llmlab.memory.measure import is_parameter
from llmlab.model import GPT, GPTConfig

# 8-bit codes are 1/4 of fp32; per-group scales add a little (two fp32 per 128 values: +1.6%), token ids and masks
# stay as they are. 35% leaves room for groups as small as 32 values; 16-bit storage (50%) fails.
MAX_BYTES_RATIO = 0.35
# A correct 8-bit min-max scheme moves the gradients by about as much as llmlab's own (groups of 128). Measured on
# the tiny GPT (relative to that): groups of 128 1×, one group per tensor ≈ 2.1×; 4× leaves room for any group
# size, while truncated codes (≈ 5×) or a missing offset are outside (and caught by the round trip first).
GRAD_ERROR_FACTOR = 4.0


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


# fp32's unit roundoff: each fp32 operation returns its exact result times (1 + δ), |δ| ≤ U (round to nearest)
U = 2.0**-24


def _bound(t, steps: float = 0.5):
    """The error a min-max 8-bit round trip of t may show, elementwise: `steps` 8-bit steps of t's range (½ for
    rounded codes, 1 for truncated ones), plus what computing in fp32 adds, plus the output dtype's rounding.

    Where fp32 rounding enters (span = max − min of t, which bounds every group's range): step = (max − low) / 255
    is two operations, so it is span/255·(1 ± 2U); the code's real value q = (x − low) / step two more, so q is off
    by ≤ 4U·q ≤ 4U·255, which moves x̂ by 4U·255·step ≈ 4U·span; rebuilding x̂ = low + code·step rounds the
    product (≤ U·255·step ≈ U·span) and the sum (≤ U·|x̂| ≤ U·(|x| + span)). Beyond the exact steps·span/255 that is
    at most 6U·span + U·|x|: the check allows 8U·span + 2U·|x|, room for one or two more operations in another
    arrangement (q = (x − low)·(255/span), say), each adding ≲ U·span. Measured over 900 calls of the reference
    (groups of 128, of 32, one per tensor): the largest excess over span/510 was 0.64·U·(span + |x|), a third of
    what is allowed; with the bound span/510·(1 + 1e-6) used before, one group per tensor failed 11 calls of 300.
    A bf16 or fp16 tensor is rebuilt in fp32 and cast back: half a unit in its last place, eps/2·|x̂|, allowed as
    eps·(|x| + span/510)."""

    x = t.detach().double()
    span = x.max() - x.min()
    bound = steps * span / 255 + 8 * U * span + 2 * U * x.abs()
    if t.dtype != torch.float32 and t.dtype != torch.float64:
        bound = bound + torch.finfo(t.dtype).eps * (x.abs() + span / 510)
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
            elif (err <= _bound(t, steps=1)).all():
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


@check("3.3", "8-bit saved-tensor hooks", hint=Hint(
    nudge="check what your pack hook does with each kind of tensor, and whether unpack gives back the shape and "
          "dtype it was given",
    idea="pack quantises each float tensor in groups to 8-bit codes with each group's low value and step "
         "(parameters and integer tensors pass through); unpack rebuilds low + code·step and restores the shape "
         "and dtype",
    formula="pack: pass parameters (measure.is_parameter(t)) and integer/bool tensors through; for a float t, "
            "flatten it (t.detach().reshape(-1).float()), pad it to a multiple of the group size G with copies of "
            "its last value (zeros could widen the last group's range), view it as (groups, G), low = min, "
            "step = (max − low) / 255 per group "
            "(1 where max == low), codes = ((x − low) / step).round().to(torch.uint8); return (codes, low, step, "
            "t.shape, t.dtype, t.numel()). unpack: x̂ = low + codes.float()·step, flattened, cut to numel, "
            "reshaped, cast back to the dtype"))
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
