"""LoRA (llmlab.lora): exact identity at init, merge/unmerge, only A and B learn, the all-zero init never
learns, apply_lora on the tiny GPT, and bad arguments refused with the argument named."""

import pytest
import torch
import torch.nn as nn

from llmlab.data import MarkovSource, SyntheticDataset
from llmlab.lora import LoRALinear, apply_lora, lora_state_dict, trainable_parameters
from llmlab.model import GPT, GPTConfig


def tiny_gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("tiny"))


def batch(step=0):
    data = SyntheticDataset(MarkovSource(vocab_size=64, seed=0), batch_size=8, block_size=32)
    return data.get_batch(step)


def train(model, steps, lr=1e-2):
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=lr)
    losses = []
    for step in range(steps):
        loss = model(*batch(step))[1]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_at_init_the_lora_model_is_exactly_the_base_model(one_thread):
    base = tiny_gpt()
    lora = tiny_gpt()
    names = apply_lora(lora, targets=("attn.c_attn", "attn.c_proj", "mlp.c_fc"), r=4, alpha=8, dropout=0.1)
    assert len(names) == 6
    lora.eval()  # dropout off on both; B = 0 makes the LoRA path exactly 0, so no tolerance
    x, _ = batch()
    assert torch.equal(lora(x)[0], base.eval()(x)[0])


def test_shapes_scale_and_init():
    layer = LoRALinear(nn.Linear(20, 12), r=3, alpha=6)
    assert layer.lora_A.shape == (3, 20) and layer.lora_B.shape == (12, 3) and layer.scale == 2.0
    assert torch.equal(layer.lora_B, torch.zeros(12, 3)) and layer.lora_A.abs().min() > 0
    bound = 1 / 20**0.5  # Kaiming-uniform with a=√5 is U(-1/√in, 1/√in), nn.Linear's own init
    assert layer.lora_A.abs().max() <= bound
    assert not layer.base.weight.requires_grad and not layer.base.bias.requires_grad
    assert LoRALinear.from_linear(nn.Linear(20, 12), r=3, alpha=6).lora_A.shape == (3, 20)


def test_forward_is_base_plus_scaled_low_rank_update():
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(16, 10), r=2, alpha=5)
    nn.init.normal_(layer.lora_B)
    x = torch.randn(4, 7, 16)
    expected = layer.base(x) + x @ (layer.lora_B @ layer.lora_A).T * 2.5
    # Two association orders of the same fp32 products: differences of a few ulps of |h| (~1e-6 here).
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)


def test_only_a_and_b_receive_gradients(one_thread):
    model = tiny_gpt()
    apply_lora(model, r=4)
    model(*batch())[1].backward()
    for name, p in model.named_parameters():
        if name.endswith(("lora_A", "lora_B")):
            assert p.requires_grad and p.grad is not None, name
        else:
            assert not p.requires_grad and p.grad is None, name
    # B = 0 at step 0, so dL/dA = (α/r)·Bᵀ(dL/dh)xᵀ = 0 exactly, while dL/dB = (α/r)(dL/dh)(Ax)ᵀ is not.
    lora = model.transformer.h[0].attn.c_attn
    assert torch.equal(lora.lora_A.grad, torch.zeros_like(lora.lora_A)) and lora.lora_B.grad.abs().max() > 0


def test_merge_equals_unmerged_and_unmerge_restores_the_base_weight(one_thread):
    model = tiny_gpt()
    names = apply_lora(model, r=4, alpha=8)
    original = {n: model.get_submodule(n).base.weight.clone() for n in names}
    train(model, steps=5)  # so B ≠ 0 and ΔW ≠ 0
    model.eval()
    x, _ = batch(99)
    unmerged = model(x)[0]
    for n in names:
        model.get_submodule(n).merge()
    merged = model(x)[0]
    # W₀x + B(Ax) vs (W₀ + BA)x: the same sums in another order, each fp32 rounding ≤ 2⁻²⁴ relative. Through
    # 2 blocks and the LM head the logits (|logit| < 1 here) moved by at most 4e-7 for seeds 0-4; 10× that.
    torch.testing.assert_close(merged, unmerged, rtol=0, atol=5e-6)
    for n in names:
        layer = model.get_submodule(n)
        merged_weight = layer.base.weight.clone()
        layer.unmerge()
        # M = fl(W₀ + ΔW) is off by ≤ u·|M|, then fl(M − ΔW) by ≤ u·|W₀| more (u = 2⁻²⁴; ΔW is recomputed
        # bit for bit): exact up to those two roundings, element by element.
        bound = 2**-24 * (merged_weight.abs() + original[n].abs()) * (1 + 2**-22)
        assert ((layer.base.weight - original[n]).abs() <= bound).all()
    torch.testing.assert_close(model(x)[0], unmerged, rtol=0, atol=5e-6)


def test_merge_twice_or_unmerge_unmerged_is_refused():
    layer = LoRALinear(nn.Linear(4, 4), r=1, alpha=1)
    with pytest.raises(RuntimeError, match="not merged"):
        layer.unmerge()
    layer.merge()
    with pytest.raises(RuntimeError, match="already merged"):
        layer.merge()


def test_paper_init_learns_but_both_zero_never_does(one_thread):
    """The course's snippet initialises A and B to zeros: Ax = 0 and Bᵀg = 0, so both gradients are exactly 0,
    AdamW's moments stay 0, its update m/(√v + ε) is 0, and weight decay of 0 is 0: nothing ever moves."""
    learner = tiny_gpt()
    apply_lora(learner, r=4)
    paper_losses = train(learner, steps=8)

    frozen = tiny_gpt()
    layers = [frozen.get_submodule(n) for n in apply_lora(frozen, r=4)]
    for layer in layers:
        nn.init.zeros_(layer.lora_A)
    optimizer = torch.optim.AdamW(trainable_parameters(frozen), lr=1e-2)
    x, y = batch()
    losses = []
    for _ in range(8):
        loss = frozen(x, y)[1]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.equal(p, torch.zeros_like(p)) for layer in layers for p in (layer.lora_A, layer.lora_B))
    assert len(set(losses)) == 1, f"the loss changed: {losses}"
    assert paper_losses[-1] < paper_losses[0] - 0.1  # the same 8 steps with A random do learn


def test_apply_lora_on_the_tiny_gpt():
    model = tiny_gpt()
    names = apply_lora(model, targets=("attn.c_attn", "attn.c_proj"), r=8)
    assert names == [f"transformer.h.{i}.attn.{m}" for i in range(2) for m in ("c_attn", "c_proj")]
    assert all(isinstance(model.get_submodule(n), LoRALinear) for n in names)
    assert isinstance(model.transformer.h[0].mlp.c_proj, nn.Linear)  # "attn.c_proj" does not match the MLP's
    C = model.config.n_embd
    expected = 2 * (8 * C + 8 * 3 * C) + 2 * (8 * C + 8 * C)  # per layer: A (r, in) + B (out, r)
    assert sum(p.numel() for p in trainable_parameters(model)) == expected
    state = lora_state_dict(model)
    assert len(state) == 8 and all(k.endswith(("lora_A", "lora_B")) for k in state)
    assert model.lm_head.weight is model.transformer.wte.weight  # weight tying survives


def test_bare_suffix_matches_every_layer_of_that_name():
    assert len(apply_lora(tiny_gpt(), targets="c_proj", r=2)) == 4  # attn.c_proj and mlp.c_proj, 2 blocks


@pytest.mark.parametrize("kwargs,match", [
    (dict(r=0), r"r=0 must be an int in \[1, 64\] \(min\(in, out\) for a 64 -> \d+ Linear\)"),
    (dict(r=65), r"r=65 must be an int in \[1, 64\] \(min\(in, out\)"),
    (dict(r=2.0), r"r=2.0 must be an int"),
    (dict(alpha=0), r"alpha=0 must be a positive number"),
    (dict(dropout=1.0), r"dropout=1.0 must be in \[0, 1\)"),
    (dict(targets=("q_proj",)), r"targets entry 'q_proj' matches no module; the Linear layers are \["),
    (dict(targets=("attn",)), r"targets entry 'attn' matches 'transformer.h.0.attn', a CausalSelfAttention"),
    (dict(targets=()), r"targets=\(\) must be one or more"),
])
def test_bad_arguments_are_refused_and_nothing_changes(kwargs, match):
    model = tiny_gpt()
    with pytest.raises(ValueError, match=match):
        apply_lora(model, **kwargs)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())


def test_a_layer_already_wrapped_is_not_a_linear():
    model = tiny_gpt()
    apply_lora(model, r=2)
    with pytest.raises(ValueError, match="a LoRALinear, not an nn.Linear"):
        apply_lora(model, r=2)
    with pytest.raises(ValueError, match="base must be an nn.Linear, got Embedding"):
        LoRALinear(nn.Embedding(4, 4), r=1, alpha=1)
