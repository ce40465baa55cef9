"""Quantization-aware training (QAT): train in float while every Linear sees its inputs and weights rounded
to a b-bit integer grid, so the model learns to live with the rounding.

The course text's API, made real::

    from llmlab.quant import LSQQuantizer, MinMaxQuantizer, QConfig, quantize_model
    model = quantize_model(model, quant_config=QConfig(activation=MinMaxQuantizer(bits=8),
                                                       weight=LSQQuantizer(bits=4)))   # W4A8

A quantizer maps v to v̂ = s·(clamp(round(v/s) + z, q_min, q_max) − z): the integer grid [q_min, q_max] with
step (scale) s and zero point z (Jacob et al. 2018, "Quantization and Training of Neural Networks for
Efficient Integer-Arithmetic-Only Inference", eq. 1: r = S(q − Z)). Rounding has zero gradient almost
everywhere, so training passes gradients *straight through* it (the STE, Bengio et al. 2013): 1 where the
value lands on the grid, 0 where it was clipped. The quantizers differ in how s is chosen:

- `MinMaxQuantizer` watches the running min and max of what it sees (while training) and spreads the grid
  over them — PyTorch's MinMaxObserver formulas, so `torch.fake_quantize_per_tensor_affine` agrees with it.
- `LSQQuantizer` learns s by gradient descent (LSQ, Esser et al. 2020; see `_LSQ`).

Which "inside" counts: like PyTorch, a value is inside when its *rounded* grid index is in range, so the
half step just past each end (v/s in (Q_P, Q_P + ½)) is inside; LSQ's eq. 3 draws the line at v/s = Q_P.
The forward values are the same either way; only the gradient on that half-step band differs.

This is *fake* quantization: v̂ is still a float and the matmuls run in float here. What QAT buys is a model
that keeps its accuracy when later run with real integer kernels — those are what give the speed and memory.

Claim C21 (train with 4/8-bit integers) is measured in `llmlab.claims.ch08`.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmlab import runtime, timing, validation
from llmlab.data import MarkovSource, SyntheticDataset
from llmlab.kernels import quantize
from llmlab.model import GPT, GPTConfig
from llmlab.precision import PRECISIONS, autocast

__all__ = ["MinMaxQuantizer", "LSQQuantizer", "QConfig", "QuantLinear", "quantize_model", "run_steps",
           "train_tiny", "tiny_losses", "train_losses", "step_times", "BENCH_CONFIGS", "held_out_loss", "bench"]

_EPS = torch.finfo(torch.float32).eps  # the smallest scale allowed, as PyTorch's observers do


class _FakeQuantizeSTE(torch.autograd.Function):
    """v̂ = s·(clamp(round(v/s) + z, q_min, q_max) − z) (Jacob et al. 2018, eq. 1), with the straight-through
    estimator dv̂/dv = 1 where round(v/s) + z is in [q_min, q_max], else 0 (Bengio et al. 2013)."""

    @staticmethod
    def forward(ctx, v, scale, zero_point, q_min, q_max):
        q = torch.round(v * scale.reciprocal()) + zero_point  # the integer grid index, not yet clipped
        inside = (q >= q_min) & (q <= q_max)
        ctx.save_for_backward(inside)
        return ((q.clamp(q_min, q_max) - zero_point) * scale).to(v.dtype)

    @staticmethod
    def backward(ctx, grad):
        (inside,) = ctx.saved_tensors
        return grad * inside, None, None, None, None


class _LSQ(torch.autograd.Function):
    """LSQ (Esser et al. 2020, "Learned Step Size Quantization", ICLR): v̂ = round(clip(v/s, −Q_N, Q_P))·s
    (eq. 1-2) and, per element, the step-size gradient of eq. 3 (with PyTorch's boundary, see the module):

        dv̂/ds = round(v/s) − v/s   inside,     −Q_N below,     Q_P above;    dv̂/dv = 1 inside, 0 outside

    summed over the elements sharing a step and multiplied by g = 1/√(N·Q_P) (§2.2), N = those elements'
    count: the step's gradient adds up N terms, and g keeps its updates in proportion to the step itself, as
    each weight's are to the weight. (PyTorch's op takes g as its `grad_factor` argument.)"""

    @staticmethod
    def _grid(v, step, q_min, q_max):
        inv = step.reciprocal()
        q = torch.round(v * inv)  # (same shape as v) grid index, not yet clipped
        inside = (q >= q_min) & (q <= q_max)
        return inv, q.clamp(q_min, q_max), inside

    @staticmethod
    def forward(ctx, v, step, q_min, q_max, g):
        _, q, _ = _LSQ._grid(v, step, q_min, q_max)
        ctx.save_for_backward(v, step)  # the rest is recomputed in backward: cheaper than keeping it
        ctx.q_min, ctx.q_max, ctx.g = q_min, q_max, g
        return (q * step).to(v.dtype)

    @staticmethod
    def backward(ctx, grad):
        v, step = ctx.saved_tensors
        inv, q, inside = _LSQ._grid(v, step, ctx.q_min, ctx.q_max)
        # Per element, in PyTorch's order of products; its CPU kernel fuses q·s − v into one multiply-add, so
        # a term can differ from this one by a rounding (~1e-7 relative), and the step's sums as little.
        per_element = torch.where(inside, grad * (q * step - v) * inv, grad * q) * ctx.g  # (same shape as v)
        return grad * inside, per_element.sum_to_size(step.shape), None, None, None  # step: sum its elements


class _Quantizer(nn.Module):
    """What both quantizers share: the argument checks, the integer range, and per-channel broadcasting."""

    def __init__(self, bits: int, signed: bool, per_channel: bool, ch_axis: int):
        super().__init__()
        validation.integer("bits", bits, 2, 16)
        validation.boolean("signed", signed)
        validation.boolean("per_channel", per_channel)
        validation.integer("ch_axis", ch_axis)
        self.bits, self.signed, self.per_channel, self.ch_axis = bits, signed, per_channel, ch_axis
        # Signed: [−2^(b−1), 2^(b−1) − 1] (Q_N = 2^(b−1), Q_P = 2^(b−1) − 1); unsigned: [0, 2^b − 1].
        self.q_min, self.q_max = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)

    def _axis(self, v: torch.Tensor) -> int:
        if not -v.dim() <= self.ch_axis < v.dim():
            raise ValueError(f"ch_axis={self.ch_axis} is out of range for a {v.dim()}-D input")
        return self.ch_axis % v.dim()

    def _broadcastable(self, t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A (C,) or (1,) statistic viewed with v's number of dims, to broadcast along ch_axis or everywhere."""
        shape = [1] * v.dim()
        if self.per_channel:
            shape[self._axis(v)] = -1
            if t.numel() != v.shape[self._axis(v)]:
                raise ValueError(f"v has {v.shape[self._axis(v)]} channels along ch_axis={self.ch_axis}, but "
                                 f"this quantizer holds {t.numel()}")
        return t.view(shape)

    def _reduce_dims(self, v: torch.Tensor) -> list[int]:
        """The dims a statistic is taken over: all of them, or all but the channel axis."""
        return [d for d in range(v.dim()) if not (self.per_channel and d == self._axis(v))]

    def extra_repr(self) -> str:
        kind = f"per_channel, ch_axis={self.ch_axis}" if self.per_channel else "per_tensor"
        return f"bits={self.bits}, signed={self.signed}, {kind}, range=[{self.q_min}, {self.q_max}]"


class MinMaxQuantizer(_Quantizer):
    """Fake-quantize with a grid spread over the running [min, max] seen so far (updated while training,
    or on the first call). Signed (the default, the API issue 7 fixes): symmetric around 0 (z = 0),
    s = max|v| / ((q_max − q_min)/2), as PyTorch's qint8 observers; unsigned: affine, with a zero point, as
    its quint8 observers (e.g. for post-ReLU activations)."""

    def __init__(self, bits: int = 8, signed: bool = True, per_channel: bool = False, ch_axis: int = 0):
        super().__init__(bits, signed, per_channel, ch_axis)
        # (C,) per channel once observed; until then empty. Per tensor: (1,), +inf/−inf until observed.
        start = torch.empty(0) if per_channel else torch.tensor([math.inf])
        self.register_buffer("min_val", start.clone())
        self.register_buffer("max_val", -start.clone())

    @property
    def observed(self) -> bool:
        return bool(self.min_val.numel()) and bool(torch.isfinite(self.min_val).all())

    @torch.no_grad()
    def observe(self, v: torch.Tensor) -> None:
        """Widen the running range to include v (per channel: each channel's own range)."""
        dims = self._reduce_dims(v)
        v_min = v.detach().float().amin(dim=dims).reshape(-1)  # (C,) per channel, (1,) per tensor
        v_max = v.detach().float().amax(dim=dims).reshape(-1)
        if self.min_val.numel() == 0:  # the first input a per-channel quantizer sees sets its channel count
            self.min_val, self.max_val = v_min, v_max
        self._broadcastable(self.min_val, v)  # refuses a different channel count
        self.min_val = torch.minimum(self.min_val, v_min)
        self.max_val = torch.maximum(self.max_val, v_max)

    def qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero_point) from the observed range, with PyTorch's observer formulas: the range is widened
        to include 0 (so 0 is exactly representable), and the scale kept ≥ fp32 eps (a constant input)."""
        if not self.observed:
            raise RuntimeError("qparams(): this MinMaxQuantizer has not observed any input yet")
        lo = torch.minimum(self.min_val, torch.zeros_like(self.min_val))
        hi = torch.maximum(self.max_val, torch.zeros_like(self.max_val))
        if self.signed:
            scale = (torch.maximum(-lo, hi) / ((self.q_max - self.q_min) / 2)).clamp(min=_EPS)
            return scale, torch.zeros_like(scale)
        scale = ((hi - lo) / float(self.q_max - self.q_min)).clamp(min=_EPS)
        return scale, (self.q_min - torch.round(lo / scale)).clamp(self.q_min, self.q_max)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        if self.training or not self.observed:
            self.observe(v)
        scale, zero_point = self.qparams()
        return _FakeQuantizeSTE.apply(v, self._broadcastable(scale, v), self._broadcastable(zero_point, v),
                                      self.q_min, self.q_max)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("min_val", "max_val"):  # an unobserved per-channel quantizer takes the saved shape
            if prefix + name in state_dict and getattr(self, name).numel() == 0:
                setattr(self, name, torch.empty_like(state_dict[prefix + name]))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class LSQQuantizer(_Quantizer):
    """Fake-quantize with a learned step size (LSQ, see `_LSQ`); the step is the parameter `step`.

    Signed (the default, for weights): [−Q_N, Q_P] = [−2^(b−1), 2^(b−1) − 1]; unsigned (for non-negative
    activations): [0, 2^b − 1]. The zero point is 0. On the first call `step` is initialised from the data as
    the paper does, s = 2·mean|v|/√Q_P (per channel: each channel's mean; a per-channel `step` takes its shape
    then, so build the optimizer after that first call — `QuantLinear` makes it on the layer's weight).
    """

    def __init__(self, bits: int = 4, signed: bool = True, per_channel: bool = False, ch_axis: int = 0):
        super().__init__(bits, signed, per_channel, ch_axis)
        self.step = nn.UninitializedParameter() if per_channel else nn.Parameter(torch.ones(1))  # (C,) or (1,)
        self.register_buffer("initialized", torch.tensor(False))

    @torch.no_grad()
    def init_step(self, v: torch.Tensor) -> None:
        """s = 2·mean|v|/√Q_P (the paper's initialisation), kept ≥ fp32 eps: an all-zero v gets no zero step."""
        s = (2 * v.detach().float().abs().mean(dim=self._reduce_dims(v)) / math.sqrt(self.q_max)).reshape(-1)
        if nn.parameter.is_lazy(self.step):
            self.step.materialize(s.shape)
        elif self.step.shape != s.shape:
            raise ValueError(f"v needs a step of shape {tuple(s.shape)}, but step is {tuple(self.step.shape)}")
        self.step.copy_(s.clamp(min=_EPS))
        self.initialized.fill_(True)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        if not self.initialized:
            self.init_step(v)
        with torch.no_grad():  # a step pushed to ≤ 0 by an update is put back to eps, as PyTorch does
            self.step.clamp_(min=_EPS)
        g = 1.0 / math.sqrt(v.numel() / self.step.numel() * self.q_max)  # N = elements sharing one step
        return _LSQ.apply(v, self._broadcastable(self.step, v), self.q_min, self.q_max, g)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "step" in state_dict and nn.parameter.is_lazy(self.step):  # take the saved shape
            self.step.materialize(state_dict[prefix + "step"].shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


@dataclass(frozen=True)
class QConfig:
    """Which quantizer each Linear gets for its input activations and for its weight (None: left in float).

    Each is a *prototype*: `quantize_model` gives every Linear its own deep copy (its own running range or
    learned step), so `QConfig(activation=MinMaxQuantizer(bits=8), weight=LSQQuantizer(bits=4))` reads as in
    the course text and no two layers share state.
    """

    activation: _Quantizer | None = None
    weight: _Quantizer | None = None

    def __post_init__(self):
        for name in ("activation", "weight"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, _Quantizer):
                raise ValueError(f"{name}={value!r} must be a MinMaxQuantizer, an LSQQuantizer or None")
        if self.activation is not None and self.activation.per_channel:
            # x·Wᵀ sums over x's features: one scale per feature cannot be pulled out of that integer sum.
            raise ValueError("activation must be per-tensor: a scale per input feature does not factor out of "
                             "the sum over features in x @ W.T, so no integer matmul could use it")
        if self.weight is not None and self.weight.per_channel and self.weight.ch_axis != 0:
            raise ValueError(f"weight.ch_axis={self.weight.ch_axis}: a Linear's weight is (out, in) and only one "
                             "scale per output row (ch_axis=0) factors out of the sum over inputs")


class QuantLinear(nn.Module):
    """A Linear whose input activations and weight pass through fake quantizers: F.linear(qa(x), qw(W), b).

    It keeps the original Linear's weight and bias Parameters (so weight tying and names survive) and
    initialises the weight quantizer on the weight at once, so every parameter exists before the optimizer.
    """

    def __init__(self, linear: nn.Linear, activation: _Quantizer | None, weight: _Quantizer | None):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.activation_quant = copy.deepcopy(activation) if activation is not None else nn.Identity()
        self.weight_quant = copy.deepcopy(weight) if weight is not None else nn.Identity()
        with torch.no_grad():
            self.weight_quant(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.activation_quant(x), self.weight_quant(self.weight), self.bias)  # (..., out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_model(model: nn.Module, quant_config: QConfig) -> nn.Module:
    """Replace every nn.Linear of `model`, in place, by a QuantLinear with copies of `quant_config`'s
    quantizers; return the model. Build the optimizer afterwards: the learned steps are new parameters."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(quant_config, QConfig):
        raise ValueError(f"quant_config must be a QConfig, got {type(quant_config).__name__}")
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears or linears == [""]:
        raise ValueError(f"model ({type(model).__name__}) has no nn.Linear inside it to quantize (a bare Linear: "
                         "use QuantLinear(linear, activation, weight))")
    for name in linears:
        quantized = QuantLinear(model.get_submodule(name), quant_config.activation, quant_config.weight)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, quantized)
    return model


def _prepare(quant_config: QConfig | None):
    """What `tiny_losses` applies to the fresh GPT for `quant_config`: quantize_model with it, or nothing (None)."""
    return None if quant_config is None else functools.partial(quantize_model, quant_config=quant_config)


def _tiny_run(prepare, seed: int, lr: float, batch_size: int, block_size: int, device):
    """The tiny GPT (`prepare(model)` applied to it first: a quantizer, an FP8 conversion; None: plain fp32) on
    `device`, its AdamW, and the order-1 Markov source's batches, all from `seed`: the same seed gives every
    configuration the same start."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig.preset("tiny", block_size=block_size))
    if prepare is not None:
        prepare(model)
    model.to(device)
    data = SyntheticDataset(MarkovSource(vocab_size=64, seed=seed), batch_size=batch_size, block_size=block_size,
                            seed=seed)
    return model, torch.optim.AdamW(model.parameters(), lr=lr), data


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                precision: str = "fp32") -> torch.Tensor:
    with autocast(precision, x.device):  # 'fp32': no autocast; 'bf16': matmuls in bf16 on the fp32 weights
        loss = model(x, y)[1]
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


def run_steps(model: nn.Module, optimizer: torch.optim.Optimizer, data: SyntheticDataset, steps: int,
              device: str | torch.device = "cpu", precision: str = "fp32") -> list[float]:
    """`steps` training steps of `model` on `data`'s next batches (moved to `device`, forwards under `precision`'s
    autocast); the loss of each. The one training loop of the tiny runs here, in `llmlab.nf4` (QLoRA's fine-tunes)
    and in `llmlab.fp8`."""
    validation.positive_int("steps", steps)
    return [_train_step(model, optimizer, *(t.to(device) for t in data.next_batch()), precision).item()
            for _ in range(steps)]


def _fresh_spec(quantizer: _Quantizer | None):
    """A quantizer prototype as the arguments that rebuild it, (class, bits, signed, per_channel, ch_axis), when
    those say all there is: a MinMaxQuantizer that has observed nothing, an LSQQuantizer whose step is not
    initialised. None for no quantizer; `_USED` for one whose state (a range seen, a step) would also matter."""
    if quantizer is None:
        return None
    fresh = ((type(quantizer) is MinMaxQuantizer and not quantizer.observed)
             or (type(quantizer) is LSQQuantizer and not quantizer.initialized))
    return ((type(quantizer), quantizer.bits, quantizer.signed, quantizer.per_channel, quantizer.ch_axis)
            if fresh else _USED)


_USED = object()  # `_fresh_spec` of a prototype that carries state: such a run is trained afresh, not cached


@functools.lru_cache(maxsize=32)  # a tiny GPT is ~0.5 MB: 32 runs stay far below any memory concern
def _trained(specs: tuple, steps: int, seed: int, lr: float, batch_size: int, block_size: int, device: str
             ) -> tuple[GPT, tuple[float, ...]]:
    """`train_tiny`'s run for the quantizers rebuilt from `specs` (`_fresh_spec`'s, activation then weight; None
    for fp32), remembered: a second call with the same arguments returns the first one's model and losses."""
    config = None if specs is None else QConfig(*(None if s is None else s[0](*s[1:]) for s in specs))
    model, losses = _train(config, steps, seed, lr, batch_size, block_size, device)
    return model, tuple(losses)


def _train(quant_config: QConfig | None, steps: int, seed: int, lr: float, batch_size: int, block_size: int,
           device) -> tuple[GPT, list[float]]:
    model, optimizer, data = _tiny_run(_prepare(quant_config), seed, lr, batch_size, block_size, device)
    return model, run_steps(model, optimizer, data, steps, device)


def train_tiny(quant_config: QConfig | None, steps: int = 100, seed: int = 0, lr: float = 3e-3,
               batch_size: int = 16, block_size: int = 64, device: str | torch.device = "cpu"
               ) -> tuple[GPT, list[float]]:
    """Train the tiny GPT (quantized with `quant_config`, or in plain fp32 for None) on the order-1 Markov
    source with AdamW for `steps` steps on `device`: (the trained model, the loss of every step). Deterministic:
    the same arguments give the same model, so it serves as a pretrained start (`llmlab.ptq`, `llmlab.nf4`).

    Computed once per process: with fresh quantizer prototypes (the usual `QConfig(...)`), a second call with the
    same arguments returns a copy of the first call's model and its losses without training again, so chapter 8's
    QAT cell and claim C21 share their runs. A call after a cached one leaves the global RNG as it finds it (a
    run seeds it with `seed` when it trains). Prototypes that carry state (a range already observed, a step
    already set) are trained afresh every time."""
    validation.positive_int("steps", steps)
    if quant_config is not None and not isinstance(quant_config, QConfig):
        raise ValueError(f"quant_config must be a QConfig or None, got {type(quant_config).__name__}")
    specs = None if quant_config is None else tuple(_fresh_spec(q) for q in (quant_config.activation,
                                                                             quant_config.weight))
    if specs is not None and _USED in specs:
        return _train(quant_config, steps, seed, lr, batch_size, block_size, device)
    model, losses = _trained(specs, steps, seed, lr, batch_size, block_size, str(torch.device(device)))
    return copy.deepcopy(model), list(losses)


def tiny_losses(prepare, steps: int = 100, seed: int = 0, lr: float = 3e-3, batch_size: int = 16,
                block_size: int = 64, device: str | torch.device = "cpu", precision: str = "fp32") -> list[float]:
    """Train the tiny GPT on the order-1 Markov source with AdamW for `steps` steps on `device`; the loss of every
    step. `prepare(model)` changes the fresh model first (None: left as it is; `quantize_model` for QAT,
    `llmlab.fp8.convert_to_fp8` for FP8), and `precision` is the autocast of every forward ('fp32': none, 'bf16'
    or 'fp16', `llmlab.precision.autocast`). The same seed gives every run the same initial weights and batches,
    so their curves differ only by what `prepare` and `precision` change."""
    validation.positive_int("steps", steps)
    if prepare is not None and not callable(prepare):
        raise ValueError(f"prepare={prepare!r} must be a function of the model, or None")
    validation.one_of("precision", precision, PRECISIONS)
    model, optimizer, data = _tiny_run(prepare, seed, lr, batch_size, block_size, device)
    return run_steps(model, optimizer, data, steps, device, precision)


def train_losses(quant_config: QConfig | None, steps: int = 100, seed: int = 0, lr: float = 3e-3,
                 batch_size: int = 16, block_size: int = 64, device: str | torch.device = "cpu") -> list[float]:
    """Train the tiny GPT (quantized with `quant_config`, or in plain fp32 for None) on the order-1 Markov
    source with AdamW for `steps` steps on `device`; the loss of every step. The same seed gives both runs the
    same initial weights and batches, so the curves differ only by quantization."""
    return train_tiny(quant_config, steps, seed, lr, batch_size, block_size, device)[1]


def step_times(configs: dict, batch_size: int = 8, block_size: int = 64, device: str | torch.device = "cpu",
               budget_s: float = 2.0) -> timing.Rounds:
    """One AdamW training step of the tiny GPT for each of `configs` ({name: QConfig, or None for fp32}), all
    from the same start on the same batch, timed in interleaved rounds (`llmlab.timing.interleave`): a busy
    spell of the machine hits every configuration, so `rounds.ratio(name, peer)` compares steps run side by
    side. Each round runs at least 50 ms of steps per configuration."""
    if not isinstance(configs, dict) or not configs or not all(
            c is None or isinstance(c, QConfig) for c in configs.values()):
        raise ValueError(f"configs={configs!r} must be a non-empty dict of {{name: QConfig or None (fp32)}}")
    validation.positive_int("batch_size", batch_size)
    validation.positive_int("block_size", block_size)
    steps = {}
    for name, config in configs.items():
        model, optimizer, data = _tiny_run(_prepare(config), 0, 3e-3, batch_size, block_size, device)
        x, y = (t.to(device) for t in data.get_batch(0))  # (B, T) each
        steps[name] = functools.partial(_train_step, model, optimizer, x, y)
    return timing.interleave(steps, device=device, warmup=2, min_rounds=7, budget_s=budget_s, min_round_s=0.05)


# the bench's quantized configurations: weights 8 or 4 bits (LSQ, learned step), activations 8 bits (MinMax)
BENCH_CONFIGS = {"W8A8": lambda: QConfig(activation=MinMaxQuantizer(bits=8), weight=LSQQuantizer(bits=8)),
                 "W4A8": lambda: QConfig(activation=MinMaxQuantizer(bits=8), weight=LSQQuantizer(bits=4))}


def held_out_loss(losses: list[float]) -> float:
    """The mean loss of the last 10 steps of `train_losses`: every step draws fresh batches, so this is a
    held-out loss."""
    if len(losses) < 10:
        raise ValueError(f"losses has {len(losses)} values; a held-out loss averages the last 10")
    return sum(losses[-10:]) / 10


def bench(steps: int | None = None, batch_size: int = 8, block_size: int = 64, kernel_sizes=None) -> list[dict]:
    """`llmlab bench quant`: the Triton int8 kernels' rows (`llmlab.kernels.quantize.bench`), then one row per
    `BENCH_CONFIGS` entry against fp32: the step time of each (`step_times`: fp32 and every configuration in the
    same interleaved rounds; ratio, spread and load), and the loss gap after `steps` AdamW steps from the same
    weights and batches, each run's mean loss over its last 10 steps (fresh batches: a held-out loss).
    `steps` defaults to 100, and to 10 under the GPU smoke mode (`runtime`), which runs the code, not the study."""

    if steps is None:
        steps = 10 if runtime.tier().smoke else 100
    validation.integer("steps", steps, low=10, hint="(the last 10 averaged)")
    device = runtime.device()
    rows = quantize.bench(kernel_sizes)
    configs = {"fp32": None, **{name: make() for name, make in BENCH_CONFIGS.items()}}
    rounds = step_times(configs, batch_size, block_size, device)
    losses = {name: held_out_loss(train_losses(config, steps, 0, 3e-3, batch_size, block_size, device))
              for name, config in configs.items()}  # quantize_model copies the prototypes: each run starts fresh
    for name in BENCH_CONFIGS:
        rows.append({"impl": f"{name} QAT step (fake-quantized)", "peer": "fp32 step",
                     "size": f"tiny GPT B={batch_size} T={block_size}", **rounds.ratio(name, "fp32").row(),
                     "loss": losses[name], "peer_loss": losses["fp32"], "loss_gap": losses[name] - losses["fp32"]})
    return rows
