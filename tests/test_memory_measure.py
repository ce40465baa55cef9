"""Tests for llmlab.memory.measure: model-state and saved-activation bytes against sizes computed by hand."""

import pytest
import torch
import torch.nn as nn

from llmlab.memory import measure
from llmlab.model import GPT, GPTConfig
from llmlab.precision import MixedPrecision

F32 = 4  # bytes per fp32 element


# --- saved activations ----------------------------------------------------------------------------------------

def test_a_linear_saves_its_input_not_its_weight():
    lin = nn.Linear(16, 8)
    x = torch.randn(5, 16, requires_grad=True)
    with measure.SavedActivations() as saved:
        lin(x)
    assert saved.bytes == 5 * 16 * F32  # x; weight.t() is a view of a Parameter: model state
    x3 = torch.randn(2, 5, 16)
    _, nbytes = measure.saved_activation_bytes(lin, x3)  # saved as a (10, 16) view of x3's storage
    assert nbytes == 2 * 5 * 16 * F32


def test_each_storage_counted_once_and_excluded_weights_left_out():
    x = torch.randn(7, 3, requires_grad=True)
    with measure.SavedActivations() as saved:
        x * x  # mul saves both operands: the same storage twice
    assert (saved.tensors, saved.bytes) == (2, 7 * 3 * F32)
    lin = nn.Linear(3, 3)
    x3 = torch.randn(2, 7, 3, requires_grad=True)
    with measure.SavedActivations() as saved:
        lin(x3)  # saves a temporary (14, 3) view of x3, gone as soon as the Linear returns
        x3 * x3  # saves x3 itself: the same storage, still alive
    assert (saved.tensors, saved.bytes) == (3, 2 * 7 * 3 * F32)

    w = torch.randn(3, 4, requires_grad=True)  # a weight that is not an nn.Parameter (a ZeRO flat shard, say)
    with measure.SavedActivations(exclude=[w]) as saved:
        x @ w  # saves x and w
    assert saved.bytes == 7 * 3 * F32


def test_a_freed_storage_whose_address_is_reused_counts_again():
    lin = nn.Linear(64, 64)
    with measure.SavedActivations() as saved:
        for _ in range(4):
            x = torch.randn(32, 64, requires_grad=True)
            lin(x)  # output dropped: the graph and x are freed, and the allocator may hand x's address on
            del x
    assert saved.bytes == 4 * 32 * 64 * F32


def test_gpt_saved_bytes_counted_by_hand():
    """One block of a dropout-free GPT at B=2, T=4, C=8, h=2 saves, in fp32 elements: ln_1 input BTC + its
    mean and 1/std 2BT, c_attn input BTC, q and k BTC each, the causal mask T² bools, softmax hBT², v BTC,
    c_proj input BTC, ln_2 input BTC + 2BT, c_fc input BTC, GELU input 4BTC, c_proj input 4BTC."""
    B, T, C, h = 2, 4, 8, 2
    block = GPT(GPTConfig(vocab_size=16, block_size=T, n_layer=1, n_head=h, n_embd=C)).transformer.h[0]
    x = torch.randn(B, T, C, requires_grad=True)
    _, nbytes = measure.saved_activation_bytes(block, x)
    BTC = B * T * C
    assert nbytes == F32 * (16 * BTC + 4 * B * T + h * B * T * T) + T * T


def test_inner_saved_tensor_hooks_hide_what_they_save():
    from torch.utils.checkpoint import checkpoint

    mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(4, 8, requires_grad=True)
    _, plain = measure.saved_activation_bytes(mlp, x)
    _, ckpt = measure.saved_activation_bytes(checkpoint, mlp, x, use_reentrant=False)
    assert plain == F32 * (4 * 8 + 2 * 4 * 32)  # x, the c_fc output (GELU input), the GELU output
    assert ckpt == 4 * 8 * F32  # only the input torch's checkpoint keeps: the inside is under its own hooks


# --- model state ------------------------------------------------------------------------------------------------

def test_tied_weights_count_once():
    model = GPT(GPTConfig.preset("tiny"))
    state = measure.model_state_bytes(model)
    assert state == measure.StateBytes(params=model.num_params(non_embedding=False) * F32, grads=0,
                                       optimizer_state=0)
    naive = sum(t.numel() for t in model.state_dict().values()) * F32  # lists wte and lm_head both
    assert naive - state.params == model.config.vocab_size * model.config.n_embd * F32


def test_adamw_state_after_one_step(one_thread):
    """AdamW keeps exp_avg and exp_avg_sq (fp32, one per parameter element) and a 0-dim fp32 step counter
    per parameter tensor."""
    model = GPT(GPTConfig.preset("tiny"))
    opt = torch.optim.AdamW(model.parameters())
    assert measure.model_state_bytes(model, opt).optimizer_state == 0  # state is created lazily
    idx = torch.randint(0, 64, (2, 8))
    model(idx, idx)[1].backward()
    opt.step()
    n, tensors = model.num_params(non_embedding=False), len(list(model.parameters()))
    state = measure.model_state_bytes(model, opt)
    assert (state.params, state.grads) == (n * F32, n * F32)
    assert state.optimizer_state == 2 * n * F32 + tensors * F32
    assert state.total == state.params + state.grads + state.optimizer_state


def test_mixed_precision_masters_are_optimizer_state(one_thread):
    """llmlab.precision.MixedPrecision: bf16 weights (2Ψ) and fp32 masters + two moments in the optimizer:
    the ZeRO paper's K = 12 bytes per parameter of optimizer state (plus the step counters)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    mp = MixedPrecision(model, lambda ps: torch.optim.AdamW(ps), dtype=torch.bfloat16)
    idx = torch.randint(0, 64, (2, 8))
    mp.backward(model(idx, idx)[1])
    n, tensors = model.num_params(non_embedding=False), len(mp.masters)
    state = measure.model_state_bytes(model, mp.optimizer)
    assert (state.params, state.grads) == (2 * n, 2 * n)  # bf16 weights and their bf16 gradients
    assert state.optimizer_state == 4 * n  # the masters; the moments are created by the first step
    mp.step()  # moves the gradients into the masters, steps, and drops all gradients
    state = measure.model_state_bytes(model, mp.optimizer)
    assert (state.params, state.grads) == (2 * n, 0)
    assert state.optimizer_state == 12 * n + tensors * F32


def test_a_meta_model_is_counted_without_memory():
    """On the meta device (shapes, no data) every storage has address 0; they are still told apart."""
    config = GPTConfig.preset("gpt2")
    with torch.device("meta"):
        model = GPT(config)
    assert measure.model_state_bytes(model).params == model.num_params(non_embedding=False) * F32


def test_tensor_bytes_of_views_and_shards():
    flat = torch.zeros(1000)  # one buffer, as a ZeRO rank keeps its shard
    views = [flat[:300], flat[300:], flat.view(10, 100)]
    assert measure.tensor_bytes(views) == 1000 * F32
    assert measure.tensor_bytes(flat[:10].clone()) == 10 * F32
    assert measure.tensor_bytes(views, exclude=[flat]) == 0


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="optimizer must have .state"):
        measure.model_state_bytes(nn.Linear(2, 2), optimizer=object())
    with pytest.raises(ValueError, match="tensors must be tensors"):
        measure.tensor_bytes([1, 2])
    with pytest.raises(ValueError, match="exclude must be tensors"):
        measure.SavedActivations(exclude=["w"])
    with pytest.raises(ValueError, match="device='cpu'"):
        with measure.peak_allocated("cpu"):
            pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_saved_bytes_same_on_gpu_and_the_allocator_peak_sees_them():
    """Without dropout the count is the same on CUDA as on CPU (the same ops save the same shapes); with
    dropout CUDA's masks are 1-byte bools where CPU's are fp32 (3 bytes less per masked element)."""
    idx = torch.randint(0, 64, (4, 32))
    counts = {}
    for dropout in (0.0, 0.1):
        for device in ("cpu", "cuda"):
            torch.manual_seed(0)
            model = GPT(GPTConfig.preset("tiny", dropout=dropout)).to(device)
            x = idx.to(device)  # one tensor as input and target, on both devices (two copies would count twice)
            with measure.SavedActivations() as saved:
                model(x, x)
            counts[dropout, device] = saved.bytes
    assert counts[0.0, "cpu"] == counts[0.0, "cuda"]
    assert counts[0.1, "cuda"] < counts[0.1, "cpu"]
    model = GPT(GPTConfig.preset("tiny")).cuda()
    with measure.peak_allocated() as peak:
        loss = model(idx.cuda(), idx.cuda())[1]
    assert peak.bytes >= counts[0.0, "cuda"]  # the saved tensors are all alive at the end of the forward
    del loss
