"""Tests for llmlab.memory.planner: the ZeRO paper's figures, and agreement with what measure.py measures on
the tiny GPT (model state and saved activations, with and without checkpointing)."""

from dataclasses import replace

import pytest
import torch

from llmlab.memory import measure, planner
from llmlab.memory.checkpoint import checkpointed
from llmlab.model import GPT, PRESETS, GPTConfig

# --- model state ------------------------------------------------------------------------------------------------

def test_zero_paper_figures():
    """Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N = 64, Adam in mixed precision (K = 12); the paper
    prints one decimal of (decimal) GB."""
    gb = [planner.model_state_bytes(7.5e9, stage, 64) / 1e9 for stage in range(4)]
    assert [round(g, 1) for g in gb] == [120.0, 31.4, 16.6, 1.9]
    psi, n = 7.5e9, 64
    assert gb == pytest.approx([16 * psi / 1e9, (4 * psi + 12 * psi / n) / 1e9, (2 * psi + 14 * psi / n) / 1e9,
                                16 * psi / n / 1e9], rel=1e-12)


def test_precisions_optimizers_and_one_rank():
    psi = 1000
    assert planner.model_state_bytes(psi, 0, 1, "adamw", "fp32") == 16 * psi  # 4 + 4 + 8, no master copy
    assert planner.model_state_bytes(psi, 0, 1, "sgd", "fp32") == 8 * psi
    assert planner.model_state_bytes(psi, 0, 1, "momentum", "mixed") == 2 * psi + 2 * psi + 8 * psi
    for stage in range(4):  # one rank: nothing to shard over
        assert planner.model_state_bytes(psi, stage, 1) == 16 * psi
    assert planner.state_bytes_per_param() == {"params": 2, "grads": 2, "optimizer_state": 12}


@pytest.mark.parametrize("kwargs, match", [
    (dict(stage=4), r"stage=4 must be an int in \[0, 3\] \(the ZeRO stage; 0 is plain data parallel\)"),
    (dict(stage=-1), "stage=-1"), (dict(stage=True), "stage=True"),
    (dict(stage=1.0), "stage=1.0"), (dict(world_size=0), "world_size=0 must be an int >= 1"),
    (dict(world_size=2.0), "world_size=2.0"), (dict(num_params=-1), "num_params=-1"),
    (dict(optimizer="lamb"), "optimizer='lamb' must be one of 'adam', 'adamw'"),
    (dict(precision="fp8"), "precision='fp8' must be one of 'mixed', 'fp32'"),
])
def test_model_state_errors_name_the_argument(kwargs, match):
    args = dict(num_params=1e6, stage=0, world_size=8) | kwargs
    with pytest.raises(ValueError, match=match):
        planner.model_state_bytes(**args)


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("bias", [True, False])
def test_num_params_of_every_preset(name, bias):
    config = GPTConfig.preset(name, bias=bias)
    with torch.device("meta"):  # shapes only: gpt2 builds in milliseconds
        model = GPT(config)
    assert planner.num_params(config) == model.num_params(non_embedding=False)


def test_agrees_with_measured_model_state(one_thread):
    """fp32 AdamW after one step. The formula leaves out AdamW's step counters (4 bytes per parameter tensor:
    0.06% here); the issue asks for 10%."""
    model = GPT(GPTConfig.preset("tiny"))
    opt = torch.optim.AdamW(model.parameters())
    idx = torch.randint(0, 64, (2, 8))
    model(idx, idx)[1].backward()
    opt.step()
    measured = measure.model_state_bytes(model, opt).total
    planned = planner.model_state_bytes(planner.num_params(model.config), 0, 1, "adamw", "fp32")
    assert measured - planned == 4 * len(list(model.parameters()))
    assert abs(measured / planned - 1) < 0.10


# --- activations ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [{}, {"dropout": 0.1}, {"flash": True}, {"bias": False, "dropout": 0.2},
                                       {"recompute": "selective", "dropout": 0.1},
                                       {"recompute": "selective", "flash": True}],
                         ids=["plain", "dropout", "flash", "no-bias-dropout", "selective-dropout", "selective-flash"])
@pytest.mark.parametrize("B, T", [(2, 16), (3, 64)])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["stored", "checkpointed"])
def test_activations_equal_measured(one_thread, overrides, B, T, checkpointing):
    """Every term is counted, so the planner equals SavedActivations to the byte in fp32 on CPU (where a
    dropout mask is a float tensor: mask_bytes=4). The issue asks for 10%; exact is what the count gives.
    (flash with dropout is left out: on the CPU it runs the math path, see planner.attention_core_terms.)"""
    config = GPTConfig.preset("tiny", **overrides)
    torch.manual_seed(0)
    model = GPT(config)
    idx, targets = torch.randint(0, 64, (B, T)), torch.randint(0, 64, (B, T))
    with checkpointed(model.transformer.h) if checkpointing else measure.SavedActivations() as _, \
            measure.SavedActivations() as saved:
        model(idx, targets)
    planned = planner.activation_bytes(config, B, T, checkpointing=checkpointing, dtype_bytes=4, mask_bytes=4)
    assert planned == saved.bytes


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_selective_terms_equal_measured_per_block(one_thread, dropout):
    """The planner's checkpointing="selective" on a plain config is the model with recompute="selective", term
    for term: one block's saved bytes measured equal the block's terms without the attention core, and what
    the recompute drops, measured as the difference from the stored block, equals attention_core_terms. Exact:
    every saved storage is counted (fp32, float dropout masks on the CPU)."""
    config = GPTConfig.preset("tiny", dropout=dropout)
    x = torch.randn(3, 48, config.n_embd, requires_grad=True)  # (B, T, C), a fresh random block input
    saved = {}
    for mode in ("none", "selective"):
        torch.manual_seed(0)
        block = GPT(replace(config, recompute=mode)).transformer.h[0]
        saved[mode] = measure.saved_activation_bytes(block, x)[1]
    kept, rebuilt = planner.layer_activation_bytes(config, 3, 48, "selective", dtype_bytes=4, mask_bytes=4)
    core = planner.attention_core_terms(config, 3, 48, dtype_bytes=4, mask_bytes=4)
    assert saved["selective"] == kept
    assert saved["none"] - saved["selective"] == sum(core.values()) == rebuilt
    assert set(core) == {"causal mask (bool)", "softmax output"} | (
        {"attention dropout mask + dropped weights"} if dropout else set())


def test_activations_in_bf16_equal_measured(one_thread):
    config = GPTConfig.preset("tiny", dropout=0.1)
    model = GPT(config).to(torch.bfloat16)
    idx, targets = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))
    with measure.SavedActivations() as saved:
        model(idx, targets)
    assert planner.activation_bytes(config, 2, 32, dtype_bytes=2, mask_bytes=2) == saved.bytes


def test_block_terms_are_korthikanti_et_al_formula():
    """Korthikanti et al. 2022, eq. (1)-(2): per layer sbh·(10 + 24/t) + 5·a·s²·b/t bytes in 16 bits with
    1-byte dropout masks (s = T, b = B, h = C, a = heads). Their count leaves out LayerNorm's mean and 1/std
    and the causal mask, which this model also saves."""
    config = GPTConfig.preset("small", dropout=0.1)
    B, T, C, a = 4, 256, config.n_embd, config.n_head
    for t in (1, 2, 3, 6):
        terms = planner.block_terms(config, B, T, dtype_bytes=2, tensor=t, mask_bytes=1)
        extra = 2 * (2 * B * T * 2) + T * T  # two LayerNorms' statistics, the causal mask
        assert sum(terms.values()) - extra == T * B * C * (10 + 24 // t) + 5 * a * T * T * B // t, t


@pytest.mark.parametrize("t", [1, 2, 3, 6])
def test_recompute_modes_are_korthikanti_et_al_formulas(t):
    """Korthikanti et al. 2022 in 16 bits with 1-byte dropout masks, per layer (s = T, b = B, h = C, a = heads,
    t tensor ranks): none sbh·(10 + 24/t) + 5·a·s²·b/t (§4, eq. 2); selective recompute sbh·(10 + 24/t), the
    5as²b/t term gone (§5); full recompute 2·sbh, the layer's input (§5). The count here adds what this model
    also keeps: the LayerNorms' mean and 1/std (2·sb each, 16-bit here) and, without selective recompute, the
    s² causal mask. What the recompute rebuilds: the core's terms (selective), the whole layer's (full)."""
    config = GPTConfig.preset("small", dropout=0.1)
    s, b, h, a = 256, 4, config.n_embd, config.n_head
    layer_norms, mask = 2 * (2 * s * b * 2), s * s
    linear, quadratic = s * b * h * (10 + 24 // t), 5 * a * s * s * b // t
    modes = {m: planner.layer_activation_bytes(config, b, s, m, dtype_bytes=2, tensor=t, mask_bytes=1)
             for m in planner.CHECKPOINTING}
    assert modes["none"] == (linear + quadratic + layer_norms + mask, 0)
    assert modes["selective"] == (linear + layer_norms, quadratic + mask)
    assert modes["full"] == (2 * s * b * h, linear + quadratic + layer_norms + mask)
    assert planner.layer_activation_bytes(config, b, s, False, 2, t, 1) == modes["none"]
    assert planner.layer_activation_bytes(config, b, s, True, 2, t, 1) == modes["full"]
    # A config that recomputes its core itself is the same plan; checkpointed whole, its block rebuilds the core
    # too when its backward runs
    own = replace(config, recompute="selective")
    assert planner.layer_activation_bytes(own, b, s, "none", 2, t, 1) == modes["selective"]
    assert planner.layer_activation_bytes(own, b, s, "full", 2, t, 1) == modes["full"]


def test_flash_and_selective_drop_the_s2_terms():
    """The fused kernel keeps its logsumexp (fp32, B·h·T) in place of the core's s² terms; selective recompute on
    top of it drops that too."""
    config = GPTConfig.preset("gpt2", dropout=0.1, flash=True)
    B, T, h = 2, 1024, config.n_head
    assert planner.attention_core_terms(config, B, T, dtype_bytes=2) == {"logsumexp (fp32)": B * h * T * 4}
    plain = planner.layer_activation_bytes(replace(config, flash=False), B, T, dtype_bytes=2)[0]
    flash = planner.layer_activation_bytes(config, B, T, dtype_bytes=2)[0]
    selective = planner.layer_activation_bytes(config, B, T, "selective", dtype_bytes=2)[0]
    core = planner.attention_core_terms(replace(config, flash=False), B, T, dtype_bytes=2)
    assert plain - flash == sum(core.values()) - B * h * T * 4
    assert flash - selective == B * h * T * 4


def test_recompute_flops():
    """Selective recompute runs every layer's q·kᵀ and p·v again: 2 × 2·B·T²·C per layer; full recompute the
    whole layer's forward, 24·B·T·C² + 4·B·T²·C (as Narayanan et al. 2021, "Efficient Large-Scale Language Model
    Training on GPU Clusters Using Megatron-LM", count it: their 96·B·s·l·h²·(1 + s/6h + V/16lh) FLOPs per step with
    full recompute are four such forwards per layer and three of the head)."""
    config = GPTConfig.preset("gpt2")
    B, T, C, L = 2, 1024, config.n_embd, config.n_layer
    assert planner.recompute_flops(config, B, T, "none") == planner.recompute_flops(config, B, T, False) == 0
    assert planner.recompute_flops(config, B, T, "selective") == L * 4 * B * T * T * C
    assert planner.recompute_flops(config, B, T, True) == L * (24 * B * T * C * C + 4 * B * T * T * C)
    # a model built with recompute="selective" recomputes its core whatever the planner is told, as plan() counts it;
    # under full checkpointing the rebuilt forward's checkpointed core runs once more in its own backward
    selective = replace(config, recompute="selective")
    assert planner.recompute_flops(selective, B, T) == planner.recompute_flops(selective, B, T, "selective") \
        == L * 4 * B * T * T * C
    assert planner.recompute_flops(selective, B, T, "full") == L * (24 * B * T * C * C + 8 * B * T * T * C)


def test_checkpointing_keeps_one_input_per_block():
    config = GPTConfig.preset("mini")
    B, T = 4, 128
    outside = sum(v for part in planner.model_terms(config, B, T).values() for v in part.values())
    assert planner.activation_bytes(config, B, T, checkpointing=True) == config.n_layer * B * T * 128 * 4 + outside
    assert planner.activation_bytes(config, B, T) == (
        config.n_layer * sum(planner.block_terms(config, B, T).values()) + outside)


# --- plans ------------------------------------------------------------------------------------------------------

def test_plan_breakdown_and_fits():
    config = GPTConfig.preset("gpt2")
    p = planner.plan(config, batch_size=8, stage=2, data=8)
    psi = planner.num_params(config)
    assert (p.params, p.grads, p.optimizer_state) == (2 * psi, 2 * psi / 8, 12 * psi / 8)
    assert p.activations == planner.activation_bytes(config, 8, dtype_bytes=2)
    assert (p.recompute, p.logits) == (0, 8 * 1024 * 50304 * 2)
    assert p.total == sum(p.breakdown().values())
    assert p.fits(p.total) and not p.fits(p.total - 1)
    ckpt = planner.plan(config, batch_size=8, stage=2, data=8, checkpointing=True)
    assert ckpt.recompute == sum(planner.block_terms(config, 8, dtype_bytes=2).values())
    assert ckpt.total < p.total / 2
    selective = planner.plan(config, batch_size=8, stage=2, data=8, checkpointing="selective")
    core = sum(planner.attention_core_terms(config, 8, dtype_bytes=2).values())
    assert (selective.activations, selective.recompute) == (p.activations - config.n_layer * core, core)
    assert ckpt.total < selective.total < p.total


def test_plan_tensor_and_pipeline_degrees():
    config = GPTConfig.preset("gpt2")
    base = planner.plan(config, batch_size=4)
    tp = planner.plan(config, batch_size=4, tensor=4)
    assert tp.params == pytest.approx(base.params / 4)
    assert tp.activations < base.activations
    # 1F1B with p = 4: stage 0 holds 4 micro-batches of its 3 blocks, as many blocks' worth as the whole model.
    pp = planner.plan(config, batch_size=4, pipeline=4, micro_batches=8)
    outside = planner.model_terms(config, 4, dtype_bytes=2)
    per_block = sum(planner.block_terms(config, 4, dtype_bytes=2).values())
    first = 4 * (3 * per_block + sum(outside["embedding"].values()))
    last = 3 * per_block + sum(outside["head"].values())
    assert pp.activations == max(first, last) == first
    assert pp.params == pytest.approx(base.params / 4)
    # With only 2 micro-batches in flight stage 0 holds less than the last stage with its head and logits.
    few = planner.plan(config, batch_size=4, pipeline=4, micro_batches=2)
    logits = 4 * 1024 * 50304 * 2  # (B, T, V) in 16 bits
    assert 2 * (3 * per_block + sum(outside["embedding"].values())) < last + logits
    assert (pp.logits, few.activations, few.logits) == (0, last, logits)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tensor=5), "tensor=5 does not divide n_head=4"), (dict(pipeline=5), "pipeline=5 > n_layer=4"),
    (dict(pipeline=0), "pipeline=0"), (dict(micro_batches=0), "micro_batches=0"), (dict(batch_size=0), "batch_size=0"),
    (dict(seq_len=200), "seq_len=200 > block_size=128"), (dict(stage=5), "stage=5"), (dict(data=0), "data=0"),
    (dict(config="mini"), "config='mini' must be a GPTConfig"),
    (dict(checkpointing="attention"),
     r"checkpointing='attention' must be one of 'none', 'selective', 'full' \(or False / True\)"),
    (dict(checkpointing=1), "checkpointing=1 must be one of"),
])
def test_plan_errors_name_the_argument(kwargs, match):
    args = dict(config=GPTConfig.preset("mini"), batch_size=2) | kwargs
    with pytest.raises(ValueError, match=match):
        planner.plan(**args)
    with pytest.raises(ValueError, match="budget_bytes=0"):
        planner.plan(GPTConfig.preset("mini"), 2).fits(0)
