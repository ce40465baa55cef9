"""Post-training quantization (PTQ) of the trained tiny GPT, against quantization-aware training (QAT).

PTQ takes a model trained in float and rounds it afterwards, with no further training:

- **weights** to int8 or int4, symmetric, with one scale for the whole tensor (*per-tensor*) or one per output
  row (*per-channel*): s = max|W| / ((q_max − q_min)/2) over what shares the scale (`llmlab.quant`'s
  `MinMaxQuantizer`, PyTorch's observer formula). One large row no longer coarsens every other row's grid;
- **activations** (each Linear's input) to int8, per tensor, with the range observed on a few calibration
  batches and then frozen.

Activations are where LLM.int8() (Dettmers et al. 2022, §3) found the trouble: a few feature dimensions of the
hidden states grow far larger than the rest, so a per-tensor int8 range set by them leaves the others a handful
of levels. The tiny GPT has no such channel of its own, so `add_outlier_channel` makes one *without changing the
model's function*: it multiplies channel j of a LayerNorm's output (its γ_j and β_j) by s and divides column j
of the Linear that reads it by s — SmoothQuant's migration (Xiao et al. 2023, eq. 3-4) run backwards. In float
the model computes the same losses (up to rounding); quantized, its int8 activations lose the other channels.

QAT (`llmlab.quant.train_tiny` with a `QConfig`) trains with the rounding in every forward pass instead, so the
weights learn to sit where the grid is. `ptq_table` puts them side by side: the held-out loss of the fp32 model
and of each PTQ variant of it, and of QAT runs with the same steps, seed and batches (`quant.BENCH_CONFIGS`).

    from llmlab.ptq import ptq_table
    rows = ptq_table()             # [{"model": "PTQ W4 per-channel", ..., "loss": ..., "gap": ...}, ...]
    rows = ptq_rows(trained, held_out, calibration, {"QAT W4A8": (config, qat_model)})  # a model of your own
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from llmlab import validation
from llmlab.data import MarkovSource, SyntheticDataset
from llmlab.model import GPT
from llmlab.quant import BENCH_CONFIGS, MinMaxQuantizer, QConfig, QuantLinear, quantize_model, train_tiny

__all__ = ["eval_loss", "post_training_quantize", "add_outlier_channel", "weight_error", "PTQ_CONFIGS",
           "ptq_rows", "ptq_table"]


@torch.no_grad()
def eval_loss(model: nn.Module, data: SyntheticDataset, batches: int = 4, device: str | torch.device = "cpu"
              ) -> float:
    """The mean loss of `model` (put in eval mode) on `data`'s batches 0 … batches−1: a fixed held-out set."""
    validation.positive_int("batches", batches)
    model.eval()
    losses = [model(*(t.to(device) for t in data.get_batch(step)))[1].item() for step in range(batches)]
    return sum(losses) / batches


@torch.no_grad()
def post_training_quantize(model: nn.Module, config: QConfig, calibration: SyntheticDataset, batches: int = 4,
                           device: str | torch.device = "cpu") -> nn.Module:
    """A quantized copy of `model` (which is left as it was): `quantize_model` on a deep copy (each weight's
    range is observed at once), activation ranges observed over `calibration`'s first `batches` batches, then
    eval mode, in which every range is frozen."""
    validation.positive_int("batches", batches)
    quantized = quantize_model(copy.deepcopy(model), config).train()  # train mode: the observers watch
    for step in range(batches):
        quantized(*(t.to(device) for t in calibration.get_batch(step)))
    return quantized.eval()


@torch.no_grad()
def add_outlier_channel(model: GPT, channel: int = 0, scale: float = 30.0) -> GPT:
    """A copy of the GPT `model` in which feature `channel` of every block's two LayerNorm outputs is `scale`
    times larger and the Linear reading it (attn.c_attn, mlp.c_fc) divides that input column by `scale`: the
    same function in float, an outlier channel for activation quantization (see the module docstring)."""
    if not isinstance(model, GPT):
        raise ValueError(f"model must be an llmlab GPT, got {type(model).__name__}")
    validation.integer("channel", channel, 0, model.config.n_embd - 1, hint="(a feature of the residual stream)")
    validation.positive("scale", scale)
    changed = copy.deepcopy(model)
    for block in changed.transformer.h:
        for norm, linear in ((block.ln_1, block.attn.c_attn), (block.ln_2, block.mlp.c_fc)):
            norm.weight[channel] *= scale  # γ_j: the LayerNorm's output j is s times larger
            if norm.bias is not None:
                norm.bias[channel] *= scale  # β_j too
            linear.weight[:, channel] /= scale  # (out, in): column j reads it s times smaller
    return changed


# The PTQ variants: (weights, activations) quantizers, as QConfig makers, and whether the outlier channel is added
PTQ_CONFIGS = {
    "PTQ W8 per-tensor": (lambda: QConfig(weight=MinMaxQuantizer(bits=8)), False),
    "PTQ W8 per-channel": (lambda: QConfig(weight=MinMaxQuantizer(bits=8, per_channel=True)), False),
    "PTQ W4 per-tensor": (lambda: QConfig(weight=MinMaxQuantizer(bits=4)), False),
    "PTQ W4 per-channel": (lambda: QConfig(weight=MinMaxQuantizer(bits=4, per_channel=True)), False),
    "PTQ A8": (lambda: QConfig(activation=MinMaxQuantizer(bits=8)), False),
    "PTQ A8, outlier channel": (lambda: QConfig(activation=MinMaxQuantizer(bits=8)), True),
    "PTQ W8A8": (lambda: QConfig(activation=MinMaxQuantizer(bits=8), weight=MinMaxQuantizer(bits=8)), False),
    "PTQ W4A8": (lambda: QConfig(activation=MinMaxQuantizer(bits=8), weight=MinMaxQuantizer(bits=4)), False),
}


@torch.no_grad()
def weight_error(model: nn.Module) -> float:
    """‖q(W) − W‖ / ‖W‖ over every `QuantLinear` weight of `model` together, q its weight quantizer as the
    forward pass applies it (eval mode): how far the rounding moved the weights (0 for a float model). For a
    QAT model W is the latent float weight, which training never asked to lie near its rounded value (weights
    past the clipping range get no gradient from the loss and stay there): a large error there is not a loss."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    was_training = model.training
    model.eval()
    error = sum((m.weight_quant(m.weight) - m.weight).pow(2).sum().item() for m in layers)
    norm = sum(m.weight.pow(2).sum().item() for m in layers)
    model.train(was_training)
    return (error / norm) ** 0.5 if norm else 0.0


def _describe(config: QConfig | None) -> tuple[str, str]:
    """("int4 per-channel", "int8 per-tensor")-style names of a config's weight and activation quantizers."""
    def name(q):
        return "fp32" if q is None else f"int{q.bits} {'per-channel' if q.per_channel else 'per-tensor'}"
    return (name(None), name(None)) if config is None else (name(config.weight), name(config.activation))


def ptq_rows(fp32: GPT, held_out: SyntheticDataset, calibration: SyntheticDataset, qat: dict | None = None,
             eval_batches: int = 8, calibration_batches: int = 4, outlier_scale: float = 100.0,
             device: str | torch.device = "cpu") -> list[dict]:
    """Rows {model, method, weights, activations, outlier, weight_error, loss, gap} for a trained fp32 GPT: the
    held-out loss (`held_out`'s first `eval_batches` batches) of `fp32`, of its copy with an outlier channel
    (`add_outlier_channel`: the same function), of each `PTQ_CONFIGS` variant calibrated on `calibration`'s first
    `calibration_batches` batches, and of each QAT model in `qat`, {row name: (its QConfig, the model trained
    with it)}. `gap` is the loss minus `fp32`'s; `weight_error` is `weight_error(model)`. The outlier channel's
    values are multiplied by `outlier_scale`: SmoothQuant (Xiao et al. 2023, §1) reports activation outliers
    about 100× larger than most values. `fp32` is evaluated in place (eval mode), and otherwise left as it is."""
    if not isinstance(fp32, GPT):
        raise ValueError(f"fp32 must be an llmlab GPT, got {type(fp32).__name__}")
    for name, data in (("held_out", held_out), ("calibration", calibration)):
        if not isinstance(data, SyntheticDataset):
            raise ValueError(f"{name} must be a SyntheticDataset, got {type(data).__name__}")
    qat = {} if qat is None else qat
    if not isinstance(qat, dict) or not all(
            isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], QConfig) and isinstance(v[1], nn.Module)
            for v in qat.values()):
        raise ValueError(f"qat={qat!r} must be a dict of {{row name: (QConfig, the model trained with it)}}")
    outlier = add_outlier_channel(fp32, scale=outlier_scale)
    rows = [("fp32", "float", None, False, fp32), ("fp32, outlier channel", "float", None, True, outlier)]
    for name, (make, with_outlier) in PTQ_CONFIGS.items():
        config = make()
        rows.append((name, "PTQ", config, with_outlier, post_training_quantize(
            outlier if with_outlier else fp32, config, calibration, calibration_batches, device)))
    rows += [(name, "QAT", config, False, model) for name, (config, model) in qat.items()]
    base = eval_loss(fp32, held_out, eval_batches, device)
    table = []
    for name, method, config, with_outlier, model in rows:
        loss = eval_loss(model, held_out, eval_batches, device)
        weights, activations = _describe(config)
        table.append({"model": name, "method": method, "weights": weights, "activations": activations,
                      "outlier": with_outlier, "weight_error": weight_error(model), "loss": loss, "gap": loss - base})
    return table


def ptq_table(steps: int = 150, seed: int = 0, lr: float = 3e-3, batch_size: int = 8, block_size: int = 32,
              eval_batches: int = 8, calibration_batches: int = 4, outlier_scale: float = 100.0,
              device: str | torch.device = "cpu") -> list[dict]:
    """`ptq_rows` for the tiny GPT trained `steps` fp32 AdamW steps (`quant.train_tiny`), with QAT rows
    "QAT W8A8" and "QAT W4A8" (`quant.BENCH_CONFIGS`: LSQ weights, MinMax int8 activations) trained from the same
    start on the same batches; calibrated on batches of the training source that training never drew.

    Held out: batches of the same Markov source drawn with another seed, the same for every row."""
    validation.positive_int("steps", steps)
    fp32 = train_tiny(None, steps, seed, lr, batch_size, block_size, device)[0]
    source = MarkovSource(fp32.config.vocab_size, seed=seed)  # the training source, as train_tiny builds it
    held_out = SyntheticDataset(source, batch_size, block_size, seed=seed + 1)
    calibration = SyntheticDataset(source, batch_size, block_size, seed=seed + 2)
    qat = {}
    for name, make in BENCH_CONFIGS.items():
        config = make()
        qat[f"QAT {name}"] = (config, train_tiny(config, steps, seed, lr, batch_size, block_size, device)[0])
    return ptq_rows(fp32, held_out, calibration, qat, eval_batches, calibration_batches, outlier_scale, device)
