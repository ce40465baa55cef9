"""NF4 and QLoRA (llmlab.nf4): the 16 levels against the paper's table, nearest-level blockwise quantization, exact
4-bit packing, double quantization's error bound and bits per parameter from the stored bytes, NF4 against
uniform int4 on normal weights, NF4Linear's forward and gradients, and the QLoRA fine-tune following LoRA's.

Randomized tests take a fresh seed per run (the `seed` fixture prints it, so a failure names it)."""

import math
import secrets

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from llmlab import quant
from llmlab.lora import LoRALinear
from llmlab.model import GPT, GPTConfig
from llmlab.nf4 import (
    FINETUNE_KINDS,
    PAPER_NF4,
    Blockwise4bit,
    DoubleQuantized,
    FrozenNF4Linear,
    NF4Config,
    NF4Linear,
    compare_codebooks,
    double_quantize,
    finetune_losses,
    int4_levels,
    nf4_levels,
    pack_4bit,
    qlora,
    quantize_nf4,
    unpack_4bit,
)

U = 2**-24  # fp32's unit roundoff


@pytest.fixture
def seed():
    s = secrets.randbelow(2**31)
    print(f"seed={s}")
    return s


def _shape(g: torch.Generator) -> tuple[int, int]:
    """An odd-sized matrix: its element count is rarely a multiple of 64 (the block) or of 2 (a byte)."""
    return tuple(int(v) for v in torch.randint(1, 200, (2,), generator=g))


def test_levels_are_the_papers_table():
    levels = nf4_levels()
    assert levels.shape == (16,) and levels.dtype == torch.float32
    # The table was printed from float32 arithmetic (the reference code's float32 linspace and δ written as
    # 0.9677083): it differs from our float64 quantiles by at most 1.8e-7 (measured); 1e-6 allows for that.
    torch.testing.assert_close(levels.double(), torch.tensor(PAPER_NF4, dtype=torch.float64), rtol=0, atol=1e-6)
    assert levels[0] == -1 and levels[-1] == 1 and (levels == 0).sum() == 1  # exact ends and an exact zero
    assert (levels < 0).sum() == 7 and (levels > 0).sum() == 8  # 2^(k-1) negative + 2^(k-1)+1 positive, one 0
    assert (levels[1:] > levels[:-1]).all()
    # Eq. (4)'s idea: the positive levels are N(0,1) quantiles at equally spaced probabilities from δ to ½.
    delta = torch.tensor(0.5 * ((1 - 1 / 30) + (1 - 1 / 32)), dtype=torch.float64)
    p = torch.special.ndtr(levels[levels > 0].double() * torch.special.ndtri(delta))  # (8,) ascending
    # Φ of fp32-rounded levels: each off by ≤ φ(0)·1.85·2⁻²⁴ ≈ 4e-8 in probability, ≪ 1e-6
    torch.testing.assert_close(p.diff(), ((delta - 0.5) / 8).expand(7), rtol=0, atol=1e-6)


def test_int4_levels_are_the_uniform_grid():
    assert torch.equal(int4_levels() * 7, torch.arange(-7.0, 8.0))


def test_packing_round_trips_exactly_high_nibble_first(seed):
    g = torch.Generator().manual_seed(seed)
    for n in (1, 2, 3, int(torch.randint(4, 5000, (1,), generator=g))):
        codes = torch.randint(0, 16, (n,), generator=g)
        packed = pack_4bit(codes)
        assert packed.dtype == torch.uint8 and packed.shape == (math.ceil(n / 2),)
        assert torch.equal(unpack_4bit(packed, n), codes.to(torch.uint8))
    assert pack_4bit(torch.tensor([1, 2, 3])).tolist() == [0x12, 0x30]  # first code high, odd n padded with 0


def test_codes_are_the_nearest_level_and_the_error_is_half_a_gap(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(_shape(g), generator=g) * 0.02
    for config in (NF4Config(double_quant=False), NF4Config(block_size=16, double_quant=False)):
        q = quantize_nf4(w, config)
        n, B = w.numel(), config.block_size
        flat = F.pad(w.reshape(-1).double(), (0, -n % B)).view(-1, B)  # (blocks, B), float64 reference
        absmax = flat.abs().amax(dim=1)  # (blocks,)
        assert torch.equal(q.absmax.double(), absmax)  # an fp32 max is exact
        x = (flat / absmax[:, None]).view(-1)[:n]  # (n,) w / c
        levels = nf4_levels().double()
        distance = (x[:, None] - levels).abs()  # (n, 16)
        chosen = distance.gather(1, unpack_4bit(q.codes, n).long()[:, None])[:, 0]  # (n,)
        # w/c is computed in fp32 (≤ 1 rounding, |x| ≤ 1) and compared with fp32 midpoints (≤ 1 rounding each):
        # the level taken is the nearest up to 2 roundings of size ≤ 2⁻²⁴.
        assert (chosen <= distance.min(dim=1).values + 2 * U).all()
        # ŵ = level · c rounded once: |w − ŵ| ≤ c·(half the gap around w/c) + that rounding + the 2 above
        upper = torch.bucketize(x.clamp(max=1), levels).clamp(1, 15)  # (n,) the level at or above x
        half_gap = (levels[upper] - levels[upper - 1]) / 2  # (n,)
        c = absmax.repeat_interleave(B)[:n]  # (n,) each element's block constant
        err = (q.dequantize().reshape(-1).double() - w.reshape(-1).double()).abs()
        assert (err <= c * (half_gap + 3 * U)).all()


def test_nf4_beats_uniform_int4_on_normal_weights_and_loses_on_uniform_ones(seed):
    """NF4's point: on N(0, σ²) weights its round-trip RMSE is 0.853× uniform int4's with the same blocks and
    block absmax (measured on 1e6 weights: 0.0920σ vs 0.1078σ). On 20,000 weights the ratio spread over 40 seeds
    with σ = 0.008 (0.840-0.875): 0.9 is 6σ away. On uniform weights the uniform grid wins (measured 0.76×)."""
    g = torch.Generator().manual_seed(seed)
    shape = (int(torch.randint(100, 200, (1,), generator=g)), 201)
    normal = {r["codebook"]: r for r in compare_codebooks(torch.randn(shape, generator=g) * 0.02)}
    assert normal["NF4"]["rmse"] < 0.9 * normal["int4 (uniform)"]["rmse"]
    assert normal["NF4"]["bits_per_parameter"] == normal["int4 (uniform)"]["bits_per_parameter"]
    flat = {r["codebook"]: r for r in compare_codebooks(torch.rand(shape, generator=g) * 2 - 1)}
    assert flat["int4 (uniform)"]["rmse"] < 0.85 * flat["NF4"]["rmse"]


def test_bits_per_parameter_come_from_the_bytes_stored():
    w = torch.randn(1024, 1024)  # 2¹⁴ blocks of 64, 64 groups of 256 constants
    single, double = quantize_nf4(w, NF4Config(double_quant=False)), quantize_nf4(w)
    assert single.bits_per_parameter == 4 + 32 / 64  # 4.5
    assert isinstance(double.absmax, DoubleQuantized) and double.absmax.codes.dtype == torch.float8_e4m3fn
    assert double.bits_per_parameter == 4 + 8 / 64 + 32 / (64 * 256) + 32 / w.numel()  # + one fp32 mean
    assert round(double.bits_per_parameter, 3) == 4.127
    odd = quantize_nf4(torch.randn(37, 23))  # 851 weights: 426 bytes of codes, 14 blocks, 1 group
    assert odd.nbytes == 426 + 14 + 4 + 4 and odd.bits_per_parameter == 8 * 448 / 851


def test_double_quantization_error_is_fp8s_rounding(seed):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(int(torch.randint(1, 2000, (1,), generator=g)), generator=g).abs() * 0.05 + 0.01  # (n,) > 0
    dq = double_quantize(c)
    mean = c.double().mean()
    assert abs(dq.mean.item() - mean.item()) <= 2 * U * mean.item() * math.log2(c.numel() + 1)  # a float sum
    s = dq.scale.double().repeat_interleave(256)[:c.numel()]  # (n,)
    y = (c.double() - dq.mean.double()) / s  # (n,) what was rounded to FP8, |y| ≤ 448
    # E4M3 rounds to nearest: ≤ 2⁻⁴·|y| where normal (3 mantissa bits), ≤ 2⁻¹⁰ below 2⁻⁶ (subnormal spacing
    # 2⁻⁹); the fp32 steps around it (c − mean, ÷ s, · s, + mean) add a few roundings of |c| and |mean|.
    bound = s * torch.maximum(2**-4 * y.abs(), torch.full_like(y, 2**-10)) + 6 * U * (c.double() + mean)
    assert ((dq.dequantize().double() - c.double()).abs() <= bound).all()


def test_double_quantization_barely_changes_the_weights_error(seed):
    """The constants' 8-bit error (≤ 1/16 of c − mean) reaches each weight as level · Δc: measured 0.07-0.14%
    more round-trip RMSE on 90,000 normal weights (20 seeds); 1% is 7× the largest."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(300, 301, generator=g)
    rmse = {dq: (quantize_nf4(w, NF4Config(double_quant=dq)).dequantize() - w).pow(2).mean().sqrt().item()
            for dq in (False, True)}
    assert rmse[True] < 1.01 * rmse[False]


def test_dequantize_rounds_once_to_the_dtype_and_keeps_the_shape(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(_shape(g), generator=g)
    q = quantize_nf4(w)
    assert isinstance(q, Blockwise4bit) and q.dequantize().shape == w.shape
    assert torch.equal(q.dequantize(torch.bfloat16), q.dequantize().to(torch.bfloat16))
    assert torch.equal(quantize_nf4(torch.zeros(5, 3)).dequantize(), torch.zeros(5, 3))  # absmax 0: no NaN


def test_nf4_linear_forward_is_the_dequantized_linear_plus_lora(seed):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    linear = nn.Linear(37, 23)
    reference_q = quantize_nf4(linear.weight)
    original = linear.weight.detach().clone()
    layer = NF4Linear(linear, r=3, alpha=6)
    assert isinstance(layer, LoRALinear) and isinstance(layer.base, FrozenNF4Linear)
    assert not any(isinstance(m, nn.Linear) for m in layer.modules())  # the float weight is not kept
    w_hat = layer.base.quantized().dequantize()
    assert torch.equal(w_hat, reference_q.dequantize())  # the buffers hold the quantized state bit for bit
    nn.init.normal_(layer.lora_B)
    x = torch.randn(4, 5, 37, generator=g)
    expected = F.linear(x, w_hat, linear.bias) + ((x @ layer.lora_A.T) @ layer.lora_B.T) * 2.0
    assert torch.equal(layer(x), expected)  # the same operations in the same order: no tolerance
    # Against the unquantized layer: |Δy| ≤ Σₖ |x_k|·|ΔW_jk|, plus each fp32 sum's rounding (≤ 38 terms: ≤ 38·2⁻²⁴
    # of Σ|x||W| + |b| for either side; 64 covers the bound's own sum too)
    base_err = (layer.base(x) - F.linear(x, original, linear.bias)).abs()
    bound = x.abs() @ (w_hat - original).abs().T + 64 * U * (x.abs() @ (original.abs() + w_hat.abs()).T
                                                             + 2 * linear.bias.abs())
    assert (base_err <= bound).all() and base_err.max() > 0


def test_nf4_linear_computes_in_bf16_and_keeps_its_bits_through_to_dtype(seed):
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(40, 24).to(torch.bfloat16)
    layer = NF4Linear(linear, r=2, alpha=2)
    assert layer.lora_A.dtype == layer.lora_B.dtype == torch.bfloat16
    before = layer.base.quantized()
    x = torch.randn(3, 40, generator=g).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(layer.base(x), F.linear(x, before.dequantize(torch.bfloat16), linear.bias))
    layer.to(torch.float32).to(torch.bfloat16)  # casts float buffers; the NF4 state is raw bytes and stays
    after = layer.base.quantized()
    assert torch.equal(after.dequantize(), before.dequantize())
    fresh = NF4Linear(nn.Linear(40, 24).to(torch.bfloat16), r=2, alpha=2)
    fresh.load_state_dict(layer.state_dict())  # a QLoRA checkpoint: codes, constants, bias, A, B
    assert torch.equal(fresh(x), layer(x))


def test_qlora_on_the_tiny_gpt_trains_only_the_adapters(one_thread, seed):
    torch.manual_seed(seed)
    model = GPT(GPTConfig.preset("tiny"))
    names = qlora(model, r=4, alpha=8)
    assert names == [f"transformer.h.{i}.{m}" for i in range(2)
                     for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert all(isinstance(model.get_submodule(n), NF4Linear) for n in names)
    assert not any(k.endswith("base.weight") for k in model.state_dict())  # no float copy of the 8 weights
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (2, 16), generator=g)
    model(x, x)[1].backward()
    for name, p in model.named_parameters():
        if name.endswith(("lora_A", "lora_B")):
            assert p.requires_grad and p.grad is not None, name
        else:
            assert not p.requires_grad and p.grad is None, name
    # B = 0 at step 0: dL/dA = 0 exactly, dL/dB ≠ 0 (as plain LoRA), in the first block too, so the gradient
    # reached it through every NF4 matmul's backward
    first = model.transformer.h[0].mlp.c_fc
    assert torch.equal(first.lora_A.grad, torch.zeros_like(first.lora_A)) and first.lora_B.grad.abs().max() > 0
    with pytest.raises(RuntimeError, match="an NF4 base cannot absorb"):
        first.merge()


def test_nf4_backward_equals_the_dequantized_linears(seed):
    """_NF4Matmul dequantizes again in backward; dX must be what autograd gives through F.linear with Ŵ."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    base = FrozenNF4Linear(nn.Linear(33, 17))
    x = torch.randn(6, 33, generator=g, requires_grad=True)
    grad = torch.randn(6, 17, generator=g)
    base(x).backward(grad)
    x2 = x.detach().clone().requires_grad_(True)
    F.linear(x2, base.quantized().dequantize(), base.bias).backward(grad)
    # The same product grad @ Ŵ; F.linear's backward may call another matmul kernel: a few roundings of |dX|
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-6)


def test_qlora_follows_lora_in_bf16_on_a_shifted_task(one_thread):
    """40 steps on the shifted chain from the same pretrained tiny GPT (60 steps): the loss falls from 2.41 to a
    mean of 1.46 over the last 10 (the chain's best is 0.80). NF4's base error moved that mean by < 0.001 for
    seed 0 and ≤ 0.004 for seeds 0-4, any single step by ≤ 0.031; bf16 itself rounds a loss near 1.5 to steps
    of 0.008. 0.03 and 0.1 leave room for other machines' rounding and fail a base that is broken."""
    lora, qlora_ = (finetune_losses(kind) for kind in FINETUNE_KINDS)
    print(f"LoRA-bf16 {quant.held_out_loss(lora):.4f}, QLoRA {quant.held_out_loss(qlora_):.4f}")
    for curve in (lora, qlora_):
        assert quant.held_out_loss(curve) < curve[0] - 0.5  # both learn the new odds
    assert abs(quant.held_out_loss(qlora_) - quant.held_out_loss(lora)) < 0.03
    assert max(abs(a - b) for a, b in zip(lora, qlora_, strict=True)) < 0.1  # step by step too


def test_a_given_base_is_the_start_the_default_pretrains_and_is_left_as_it_was(one_thread):
    """`base=` the very model `finetune_losses` would pretrain gives the same curve, bit for bit (the same weights,
    adapters and batches: no rounding differs), and the caller's model keeps its fp32 weights."""
    pretrained = quant.train_tiny(None, 60, 0, 3e-3, 8, 32)[0]
    before = {k: v.clone() for k, v in pretrained.state_dict().items()}
    assert finetune_losses("qlora", steps=5, base=pretrained) == finetune_losses("qlora", steps=5)
    after = pretrained.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].dtype == before[k].dtype for k in before)


@pytest.mark.parametrize("make,match", [
    (lambda: quantize_nf4(torch.arange(4)), r"w must be a non-empty floating-point tensor, got torch.int64"),
    (lambda: quantize_nf4(torch.tensor([1.0, math.nan])), r"w holds an inf or NaN"),
    (lambda: quantize_nf4(torch.ones(4), {"block_size": 64}), r"config must be an NF4Config, got dict"),
    (lambda: quantize_nf4(torch.ones(4), levels=torch.linspace(-2, 2, 16)), r"levels must be .* within \[-1, 1\]"),
    (lambda: quantize_nf4(torch.ones(4), levels=torch.zeros(17)), r"levels must be a 1-D float tensor of 2 to 16"),
    (lambda: NF4Config(block_size=0), r"block_size=0 must be a positive int"),
    (lambda: NF4Config(double_quant=1), r"double_quant=1 must be True or False"),
    (lambda: NF4Config(absmax_block_size=2.5), r"absmax_block_size=2.5 must be a positive int"),
    (lambda: pack_4bit(torch.tensor([3, 16])), r"codes must be in \[0, 15\] \(4 bits\), got \[3, 16\]"),
    (lambda: pack_4bit(torch.ones(2, 2, dtype=torch.uint8)), r"codes must be a 1-D integer tensor"),
    (lambda: unpack_4bit(torch.zeros(3, dtype=torch.uint8), 7), r"n=7 must be an int in \[5, 6\]"),
    (lambda: unpack_4bit(torch.zeros(3), 5), r"packed must be a 1-D uint8 tensor, got torch.float32"),
    (lambda: double_quantize(torch.ones(4, dtype=torch.float64)), r"c must be a non-empty 1-D fp32 tensor"),
    (lambda: double_quantize(torch.ones(4), block_size=0), r"block_size=0 must be a positive int"),
    (lambda: FrozenNF4Linear(nn.Embedding(4, 4)), r"linear must be an nn.Linear, got Embedding"),
    (lambda: NF4Linear(nn.Linear(8, 8), r=0, alpha=1), r"r=0 must be an int in \[1, 8\]"),
    (lambda: NF4Linear(nn.Linear(8, 8), r=2, alpha=2, config=None), r"config must be an NF4Config, got NoneType"),
    (lambda: qlora(nn.Linear(8, 8), config=64), r"config must be an NF4Config, got int"),
    (lambda: qlora(GPT(GPTConfig.preset("tiny")), targets=("q_proj",)), r"targets entry 'q_proj' matches no module"),
    (lambda: finetune_losses("int8"), r"kind='int8' must be one of 'lora-bf16', 'qlora'"),
    (lambda: finetune_losses("qlora", steps=0), r"steps=0 must be a positive int"),
    (lambda: finetune_losses("qlora", pretrain_steps=0), r"pretrain_steps=0 must be a positive int"),
    (lambda: finetune_losses("qlora", base=nn.Linear(4, 4)), r"base must be an llmlab GPT or None, got Linear"),
    (lambda: finetune_losses("qlora", base=GPT(GPTConfig.preset("tiny", block_size=16))),
     r"block_size=32 must be an int in \[1, 16\] \(the base's context length\)"),
])
def test_bad_arguments_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()
