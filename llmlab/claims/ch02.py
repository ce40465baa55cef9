"""Chapter 2's claims (§2, parallelism), measured: nn.DataParallel against DDP (C5), the column-parallel snippet
(C6), mixed precision's ≈3× speed (C7) and loss scaling against fp16 underflow (C8).

C7's step times are `precision.step_times.recent()`, the last measurement (the chapter's cell made it): the cell
and this claim show the same rounds. Its verdict rests on them, so it reads INCONCLUSIVE when they cannot decide."""

from __future__ import annotations

import torch
import torch.distributed as td

from llmlab import dist, precision, timing
from llmlab.claims import INCONCLUSIVE, Measurement, here, register
from llmlab.data import MarkovSource, SyntheticDataset
from llmlab.model import GPT, GPTConfig
from llmlab.parallel.ddp import DataParallel
from llmlab.parallel.tensor import ColumnParallelLinear

__all__ = ["data_parallel", "column_parallel", "SPEEDUP_BARS", "C7_VERDICTS", "speedup_level", "three_times_faster",
           "loss_scaling"]


def _ddp_gradients(kind: str) -> list[torch.Tensor]:
    """One backward of the tiny GPT on this rank's half of a batch, under `kind` ('ours' or 'torch')."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny")).double()
    wrapped = DataParallel(model) if kind == "ours" else torch.nn.parallel.DistributedDataParallel(model)
    x, y = SyntheticDataset(MarkovSource(64), batch_size=8, block_size=32, rank=td.get_rank(),
                            world_size=td.get_world_size()).get_batch(0)
    wrapped(x, y)[1].backward()
    return [p.grad for p in model.parameters()]


def _both_ddps():
    return _ddp_gradients("ours"), _ddp_gradients("torch")


@register("C5", chapter=2)
def data_parallel() -> Measurement:
    results = dist.spawn(_both_ddps, 2, timeout=120, backend="gloo")  # CPU tensors, on any tier
    diff = max((a - b).abs().max().item() for ours, theirs in results for a, b in zip(ours, theirs, strict=True))
    legacy = torch.nn.DataParallel(torch.nn.Linear(2, 2))
    replicas = len(legacy.device_ids)  # the GPUs nn.DataParallel would copy the model to on every forward
    return Measurement(
        value={"max |our DDP − torch DDP| grad": diff, "nn.DataParallel devices here": replicas}, unit="",
        text=(f"DDP written from scratch on 2 gloo ranks equals torch's DistributedDataParallel to {diff:.1e} "
              f"(float64). nn.DataParallel here has {replicas} device(s) to replicate to: it is one process "
              "that re-copies the model to each GPU every step and is GIL-bound; PyTorch recommends "
              "DistributedDataParallel instead"),
        device=here(), verdict="misleading")


def _column_parallel_matches():
    torch.manual_seed(0)
    full = torch.nn.Linear(16, 8).double()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    y = ColumnParallelLinear.from_linear(full, gather_output=True)(x)
    y.pow(2).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    y_ref = full(x_ref)
    y_ref.pow(2).sum().backward()
    return max((y - y_ref).abs().max().item(), (x.grad - x_ref.grad).abs().max().item())


@register("C6", chapter=2)
def column_parallel() -> Measurement:
    diff = max(dist.spawn(_column_parallel_matches, 2, timeout=120, backend="gloo"))  # CPU tensors
    return Measurement(
        value=diff, unit="max abs difference",
        text=(f"the course's snippet has no super().__init__(), no forward, no split and no communication; "
              f"the completed ColumnParallelLinear (f before, all-gather after) on 2 ranks equals the unsplit "
              f"layer's output and input gradient to {diff:.1e} (float64)"),
        device=here(), verdict="misleading")


# C7's verdict by the best speed-up: below 1.2× misleading, from 1.2× to 2.5× holds with conditions, above holds
SPEEDUP_BARS = (1.2, 2.5)
C7_VERDICTS = ("misleading", "holds with conditions", "holds")


def speedup_level(c: timing.Comparison) -> tuple[int, int]:
    """The lowest and the highest index of C7_VERDICTS that the rounds of `c` (a step's time / the fp32 step's)
    allow: a speed-up 1/ratio is past a bar b where the ratio lies conclusively below 1/b (`Comparison.direction`),
    short of it where conclusively above; the two are equal when the rounds decide."""
    return (sum(c.direction(1 / bar) == "faster" for bar in SPEEDUP_BARS),
            len(SPEEDUP_BARS) - sum(c.direction(1 / bar) == "slower" for bar in SPEEDUP_BARS))


@register("C7", chapter=2)
def three_times_faster() -> Measurement:
    t = precision.step_times.recent()  # the measurement chapter 2's cell showed (measured here if none)
    versus = {name: t.versus_fp32(name) for name in precision.PRECISIONS[1:]}
    levels = [speedup_level(c) for c in versus.values()]
    low, high = max(lo for lo, _ in levels), max(hi for _, hi in levels)  # the best step decides the verdict
    verdict = C7_VERDICTS[low] if low == high else INCONCLUSIVE
    fp32 = t.rounds["fp32"]
    why = "" if low == high else ": " + "; ".join(
        f"{precision.LABELS[name]}: {c.note() or 'its rounds straddle a bar (1.2× or 2.5×)'}"
        for (name, c), (_, hi) in zip(versus.items(), levels, strict=True) if hi > low)  # could lift it
    return Measurement(
        value={f"{precision.LABELS[name]} speed-up": 1 / c.ratio for name, c in versus.items()}, unit="× vs fp32",
        text=(f"speed-up over the fp32 step ({fp32}) of the {t.size} here (fp32 time / its time, "
              f"{len(fp32.samples)} interleaved rounds, {t.rounds.load}): "
              + ", ".join(f"{precision.LABELS[name]} {1 / c.ratio:.2f}× ±{c.spread:.0%}" for name, c in versus.items())
              + f"{why}. The gain comes from tensor cores (A100: 312 vs 19.5 TFLOP/s) and halved memory traffic; "
              "without them half precision gains little or loses"),
        device=here(), verdict=verdict)


@register("C8", chapter=2)
def loss_scaling() -> Measurement:
    c = torch.tensor(1e-4, dtype=torch.float16)
    grads = {}
    for name, scaler in (("unscaled", None), ("scaled", precision.DynamicLossScaler(init_scale=2.0**14))):
        w = torch.nn.Parameter(torch.ones(1, dtype=torch.float16))
        loss = (w * c * c).sum()  # the gradient c·c ≈ 1e-8 is below fp16's smallest subnormal, 6e-8
        (scaler.scale_loss(loss) if scaler else loss).backward()
        grads[name] = w.grad.double().item() / (scaler.scale if scaler else 1.0)
    survives = grads["unscaled"] == 0 and grads["scaled"] > 0
    return Measurement(
        value=grads, unit="gradient",
        text=(f"a gradient of {float(c.double() ** 2):.3g}: fp16 without scaling gives {grads['unscaled']:g}, "
              f"with loss scale 2^14 {grads['scaled']:.4g} after unscaling in fp32; fp32 master weights take "
              "the update (DynamicLossScaler's scale trajectory equals torch.amp.GradScaler's, tested)"),
        device=here(), verdict="holds" if survives else "wrong")
