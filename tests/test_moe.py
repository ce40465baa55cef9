"""Mixture of Experts (llmlab.moe, moe_dispatch, moe_bench): the grouped layer equals the per-token loop and every
expert on every token (with and without drops, an expert with no rows, outputs and gradients), runs under bf16
autocast, the drop rule is first come first served with first choices first, the balance loss is 1 for uniform
routing and grows with imbalance, drop rate falls with the capacity factor, expert parallelism on 2 and 4 ranks
equals the single-process layer with two all-to-alls each way, the bench's rows and sizes (smoke mode's tiny
ones), and bad arguments are refused by name."""

import copy
import json
import math
import subprocess
import sys

import pytest
import torch

from llmlab import bench, moe, moe_bench, runtime
from llmlab.dist import Grid
from llmlab.moe import Expert, MoELayer, every_expert, loop_reference, route
from llmlab.moe_dispatch import grouped_gemm_mlp, grouped_mlp
from llmlab.timing import Comparison, Timing

WORLD_SIZES = (2, 4)  # expert parallelism over ranks 0 … n-1 (group=None would mean a single-process layer)
_groups: dict = {}  # on the ranks: world size → its dist.Grid


@pytest.fixture(scope="module")
def cluster(clusters):
    return clusters(4)


@pytest.fixture
def one_thread():
    # Tiny matmuls gain nothing from a second thread, and other processes share the 2 cores (see test_model).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _layer(k, capacity_factor, seed=0, num_experts=4):
    torch.manual_seed(seed)
    return MoELayer(6, 10, num_experts, k, capacity_factor).double()


def _grads(layer, x, forward):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    y = forward(x)
    (y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).sum().backward()
    return y.detach(), {"x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("capacity_factor", [None, 2.0, 0.5])  # k=2, E=4: cf=2 gives capacity T: nothing drops
def test_grouped_layer_equals_the_per_token_loop(one_thread, k, capacity_factor):
    layer = _layer(k, capacity_factor)
    x = torch.randn(3, 7, 6, dtype=torch.float64)
    y, grads = _grads(layer, x, lambda v: layer(v)[0])
    y_ref, grads_ref = _grads(layer, x, lambda v: loop_reference(layer, v))
    assert y.shape == x.shape
    if capacity_factor == 0.5:
        assert layer.routing.drop_rate > 0.25  # at most half the assignments fit: C = ⌈k·21/4·0.5⌉
    elif capacity_factor == 2.0 and k == 2:
        assert layer.routing.capacity == 21 and layer.routing.drop_rate == 0
    # float64; the grouped matmuls and the loop's per-token ones sum in different orders: ~1e-16 relative
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("capacity_factor", [None, 0.6])
def test_grouped_dispatch_equals_every_expert_on_every_token(one_thread, k, capacity_factor):
    torch.manual_seed(k)
    layer = MoELayer(5, 11, 7, k, capacity_factor).double()  # odd sizes: C=5, H=11, E=7, T=3·31
    x = torch.randn(3, 31, 5, dtype=torch.float64)
    with torch.no_grad():  # expert 6 is never chosen (it gets no rows: an empty segment): x₀ = 4, w₆₀ = −9
        x[..., 0] = 4.0
        layer.gate.weight[6, 0] = -9.0
    y, grads = _grads(layer, x, lambda v: layer(v)[0])
    y_ref, grads_ref = _grads(layer, x, every_expert(layer))
    r = layer.routing
    assert r.counts[6] == 0 and (r.drop_rate > 0.2 if capacity_factor else r.drop_rate == 0)
    # float64; the segment matmuls and the dense ones sum the same products, in other orders: ~1e-16 relative
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], rtol=1e-12, atol=1e-12, msg=name)


def _trained(layer, x):
    """One step of `layer` on x: output, aux_loss and every gradient (x's too), the aux_loss in the loss."""
    x = x.detach().requires_grad_(True)
    y, aux = layer(x)
    ((y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).sum() + aux).backward()
    return y.detach(), aux.detach(), {"x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}


# every router and expert option the grouped GEMM must carry: (capacity_factor, balance, scores, granularity, shared)
GROUPED_GEMM_CASES = {"dropless": (None, "aux-loss", "softmax", 1, 0),
                      "drops, bias, sigmoid": (0.6, "bias", "sigmoid", 1, 0),
                      "fine, shared, no balance": (None, "none", "sigmoid", 2, 1),
                      "fine, shared, drops, bias": (0.6, "bias", "softmax", 3, 2)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", GROUPED_GEMM_CASES.values(), ids=GROUPED_GEMM_CASES.keys())
def test_grouped_gemm_layer_equals_the_torch_path(one_thread, dtype, case):
    seed = _fresh_seed()
    torch.manual_seed(seed)
    capacity_factor, balance, scores, m, s = case
    layer = MoELayer(5, 12, 4, 2, capacity_factor, balance=balance, scores=scores, granularity=m,
                     shared=s).to(dtype)  # odd sizes: C=5, T=2·29, m·4 − s routed experts of hidden 12/m
    x = torch.randn(2, 29, 5, dtype=dtype)
    last = layer.routed_experts - 1
    with torch.no_grad():  # the last expert is never chosen (an empty group for the kernel): x₀ = 4, w₀ = −9
        x[..., 0] = 4.0
        layer.gate.weight[last, 0] = -9.0
        if layer.expert_bias is not None:  # a bias that moves choices, as after some training; the last's −1
            layer.expert_bias.normal_().mul_(0.05)[last] = -1.0  # keeps it out (the scores lie in [0, 1])
    kernel = copy.deepcopy(layer)
    kernel.grouped_gemm = True
    (y, aux, grads), (y_k, aux_k, grads_k) = (_trained(m, x) for m in (layer, kernel))
    assert kernel.routing.counts[last] == 0 and torch.equal(kernel.routing.kept, layer.routing.kept), seed
    assert capacity_factor is None or kernel.routing.drop_rate > 0, seed
    # Both paths do the same products and differ only in the order of the sums (the kernel's tiles against one
    # matmul per expert). The longest sum is a weight gradient's, over one expert's rows (≤ T = 58); two orders
    # of a sum of n terms differ by at most 2·n·u·Σ|terms| (u = eps/2: 2⁻²⁴ float32, 2⁻⁵³ float64), so
    # n = 64 and each tensor's largest value as the scale: 2·64·u relative to it (float32 7.6e-6, float64 1.4e-14).
    # Over 300 fresh seeds a case, the largest difference was 0.12 of it (float32), 0.08 (float64)
    tol = 2 * 64 * torch.finfo(dtype).eps / 2
    for name, got, want in (("y", y_k, y), ("aux", aux_k, aux), *((n, grads_k[n], g) for n, g in grads.items())):
        torch.testing.assert_close(got, want, rtol=0, atol=tol * want.abs().max().item(),
                                   msg=lambda msg, n=name: f"{n}, seed {seed}: {msg}")


def test_import_llmlab_moe_does_not_load_triton():
    # triton (half a second to import) comes with the first grouped_gemm=True forward, not with llmlab.moe
    code = ("import sys, torch, llmlab.moe; loaded = lambda: 'triton' in sys.modules; before = loaded(); "
            "llmlab.moe.MoELayer(4, 8, 2, grouped_gemm=True)(torch.randn(3, 4)); print(before, loaded())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True"]


@pytest.mark.parametrize("grouped_gemm", [False, True])
def test_layer_runs_under_bf16_autocast(one_thread, grouped_gemm):
    torch.manual_seed(0)
    layer = MoELayer(16, 32, 4, 2, None, grouped_gemm=grouped_gemm)
    x = torch.randn(40, 16)
    y32 = layer(x)[0].detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, aux = layer(x)
    (y.float().square().sum() + aux).backward()
    assert y.dtype == torch.bfloat16 and layer.experts[0].c_fc.weight.grad.dtype == torch.float32
    # bf16 keeps 8 significant bits (relative rounding 2⁻⁹ ≈ 0.2%) on the inputs, weights and each product's
    # output; through two projections of 16 and 32 terms a few roundings add up to about 1%: 3% leaves a margin
    assert (y.float() - y32).abs().max() <= 0.03 * y32.abs().max()


def test_slots_go_first_come_first_served_first_choices_first():
    # 4 tokens, E=2, k=1: all want expert 0; capacity ⌈1·4/2·1⌉ = 2 -> tokens 0 and 1 keep their slot
    r = route(torch.tensor([[2.0, 0.0]] * 4), k=1, capacity_factor=1.0)
    assert r.capacity == 2 and r.dropped.flatten().tolist() == [False, False, True, True] and r.drop_rate == 0.5
    # 2 tokens, E=2, k=2, capacity 1: token 0 prefers expert 0, token 1 expert 1. First choices come first, so
    # both keep their first choice and both second choices drop (token order alone would let token 0's
    # second choice take expert 1's only slot before token 1's first choice).
    r = route(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), k=2, capacity_factor=0.5)
    assert r.capacity == 1 and r.expert.tolist() == [[0, 1], [1, 0]]
    assert r.dropped.tolist() == [[False, True], [False, True]]
    assert r.counts.tolist() == [1, 1] and r.load.tolist() == [2, 2]


def _cyclic_tokens(E, k, T):
    """T tokens in dim E routed by an identity gate: token t prefers expert t mod E, then t+1, ... (k of them),
    so every expert gets T·k/E assignments and, by the cyclic symmetry, the same mean probability."""
    x = torch.zeros(T, E, dtype=torch.float64)
    for j in range(k):
        x[torch.arange(T), (torch.arange(T) + j) % E] = 3.0 - j
    return x


@pytest.mark.parametrize("k", [1, 2])
def test_balance_loss_is_alpha_for_uniform_routing_and_grows_with_imbalance(one_thread, k):
    E = 4
    layer = MoELayer(E, 8, E, k, None, balance_coef=0.01, z_coef=0.0).double()
    with torch.no_grad():
        layer.gate.weight.copy_(torch.eye(E))
    _, aux = layer(_cyclic_tokens(E, k, 4 * E))
    assert layer.routing.load.tolist() == [4 * k] * E
    assert math.isclose(layer.routing.balance_loss.item(), 1.0, rel_tol=1e-12)  # N·Σ (1/N)(1/N), float64
    assert math.isclose(aux.item(), 0.01, rel_tol=1e-12)
    with torch.no_grad():
        layer.gate.weight.zero_()  # every probability 1/E: P uniform makes N·Σ f·P = Σ f = 1 whatever f is
    assert math.isclose(layer(torch.randn(9, E, dtype=torch.float64))[1].item(), 0.01, rel_tol=1e-12)
    # more and more tokens prefer expert 0: f and P pile up on it and the loss rises towards N
    with torch.no_grad():
        layer.gate.weight.copy_(torch.eye(E))
    losses = []
    for skew in range(5):
        x = _cyclic_tokens(E, k, 16)
        x[: 3 * skew] = x[0]  # the first 3·skew tokens route like token 0
        losses.append(route(layer.gate(x), k, None).balance_loss.item())
    assert losses[0] == pytest.approx(1.0) and all(b > a for a, b in zip(losses, losses[1:], strict=False))
    assert losses[-1] < E


def test_z_loss_is_the_mean_squared_logsumexp(one_thread):
    logits = torch.randn(11, 5, dtype=torch.float64)
    expected = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 11
    assert math.isclose(route(logits, 2, None).z_loss.item(), expected, rel_tol=1e-12)


def test_drop_rate_falls_with_capacity_factor_and_is_zero_when_dropless(one_thread):
    torch.manual_seed(0)
    logits = torch.randn(512, 8) * 2  # a confident random router: the loads differ by tens of tokens
    factors = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 4.0]
    rates = [route(logits, 2, cf).drop_rate for cf in factors]
    assert all(b <= a for a, b in zip(rates, rates[1:], strict=False)) and rates[0] > rates[-2]
    assert rates[0] >= 0.75 and rates[-1] == 0 and route(logits, 2, None).drop_rate == 0
    for cf, rate in zip(factors, rates, strict=True):  # exactly the assignments over each expert's capacity
        r = route(logits, 2, cf)
        assert rate * 1024 == (r.load - r.capacity).clamp(min=0).sum().item()


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match=r"k=5 must be an int in \[1, 4\] \(experts per token, at most num_experts\)"):
        MoELayer(6, 10, 4, k=5)
    with pytest.raises(ValueError, match="k=0"):
        MoELayer(6, 10, 4, k=0)
    for cf in (0, -1.0, True):
        with pytest.raises(ValueError, match="capacity_factor="):
            MoELayer(6, 10, 4, capacity_factor=cf)
    with pytest.raises(ValueError, match="num_experts=0"):
        MoELayer(6, 10, 0)
    with pytest.raises(ValueError, match="x has last dimension 6, the layer expects dim=4"):
        MoELayer(4, 10, 4)(torch.randn(2, 6))
    with pytest.raises(ValueError, match="balance_coef=-1"):
        MoELayer(6, 10, 4, balance_coef=-1)
    with pytest.raises(ValueError, match=r"counts=\[3, 0, 3\] must give one count per expert \(3\) summing to the 7 "):
        grouped_mlp([Expert(3, 5)] * 3, torch.randn(7, 3), [3, 0, 3])
    with pytest.raises(ValueError, match=r"counts=\[3, 0, 3\] must give one count per expert \(3\) summing to the 7 "):
        grouped_gemm_mlp([Expert(3, 5)] * 3, torch.randn(7, 3), [3, 0, 3])
    with pytest.raises(ValueError, match=r"counts=\[7\] must give one count per expert \(3\)"):
        grouped_gemm_mlp([Expert(3, 5)] * 3, torch.randn(7, 3), [7])
    with pytest.raises(ValueError, match="grouped_gemm=1 must be True or False"):
        MoELayer(6, 10, 4, grouped_gemm=1)


def _fresh_seed() -> int:
    return torch.randint(0, 2**31, ()).item()  # fresh inputs and weights on every run; failures print it


@pytest.mark.parametrize("scores", ["softmax", "sigmoid"])
def test_the_bias_changes_which_experts_are_chosen_but_not_their_gates(scores):
    seed = _fresh_seed()
    torch.manual_seed(seed)
    T, E, k = 37, 7, 3
    logits = torch.randn(T, E, dtype=torch.float64)
    bias = torch.randn(E, dtype=torch.float64) * 0.3  # the scores' scale: probabilities in [0, 1]
    plain, biased = route(logits, k, None, scores=scores), route(logits, k, None, bias=bias, scores=scores)
    score = plain.probs if scores == "softmax" else logits.sigmoid()  # (T, E) the unbiased scores
    assert torch.equal(biased.expert, (score + bias).topk(k, dim=-1).indices), seed
    assert (biased.expert != plain.expert).any(1).float().mean() > 0.3, seed  # the bias did move choices
    top = score.gather(1, biased.expert)  # (T, k) the chosen experts' unbiased scores
    assert torch.equal(biased.gate, top / top.sum(-1, keepdim=True)), seed  # the same operations: bit for bit
    assert torch.equal(biased.probs, plain.probs) and torch.equal(biased.z_loss, plain.z_loss), seed
    assert torch.equal(biased.load, torch.bincount(biased.expert.flatten(), minlength=E)), seed


def test_sigmoid_scores_are_normalised_over_the_chosen_k():
    logits = torch.tensor([[2.0, 0.0, -1.0, 1.0]], dtype=torch.float64)
    r = route(logits, 2, None, scores="sigmoid")
    s = [1 / (1 + math.exp(-v)) for v in (2.0, 1.0)]  # experts 0 and 3, the two largest
    assert r.expert.tolist() == [[0, 3]] and r.gate[0].tolist() == pytest.approx([s[0] / sum(s), s[1] / sum(s)])
    assert r.probs.sum().item() == pytest.approx(1.0)  # the balance loss's P: the scores normalised over E
    assert route(logits, 1, None, scores="sigmoid").gate.item() == pytest.approx(s[0])  # k = 1: the raw score


def _one_hot_tokens(experts, E):
    return torch.eye(E, dtype=torch.float64)[experts] * 4.0  # with an identity router: token t picks experts[t]


def test_update_bias_moves_each_expert_by_gamma_times_the_sign_of_mean_minus_load():
    E = 4
    layer = MoELayer(E, 8, E, k=1, capacity_factor=None, balance="bias", bias_rate=0.1).double()
    with torch.no_grad():
        layer.gate.weight.copy_(torch.eye(E))
    layer(_one_hot_tokens([0, 0, 0, 1, 1, 2], E))  # two forwards of one step (accumulation) add their loads
    layer(_one_hot_tokens([0, 3], E))
    layer.eval()
    layer(_one_hot_tokens([3, 3, 3], E))  # an evaluation forward does not count
    layer.train()
    assert layer.update_bias().tolist() == [4, 2, 1, 1]  # mean 2: expert 0 over, 1 even, 2 and 3 under
    assert layer.expert_bias.tolist() == pytest.approx([-0.1, 0.0, 0.1, 0.1], abs=1e-15)
    assert layer.step_load.tolist() == [0] * E  # emptied for the next step
    # loads 3, 1, 1, 0: the mean 1.25 is no load, so every expert moves (compared in integers: 5 vs 4·loadᵢ)
    layer(_one_hot_tokens([0, 0, 0, 1, 2], E))
    assert layer.update_bias().tolist() == [3, 1, 1, 0]
    assert layer.expert_bias.tolist() == pytest.approx([-0.2, 0.1, 0.2, 0.2], abs=1e-15)
    assert layer.update_bias().tolist() == [0] * E and layer.expert_bias.tolist() == pytest.approx(
        [-0.2, 0.1, 0.2, 0.2], abs=1e-15)  # no forward since: no move
    # the bias travels in the state_dict (the loads of a step in progress do not)
    state = layer.state_dict()
    assert "expert_bias" in state and "step_load" not in state
    fresh = MoELayer(E, 8, E, k=1, capacity_factor=None, balance="bias").double()
    fresh.load_state_dict(state)
    assert torch.equal(fresh.expert_bias, layer.expert_bias)
    assert "expert_bias" not in MoELayer(E, 8, E).state_dict()  # the default layer's state is as it was


def test_the_bias_balances_a_skewed_router_step_by_step(one_thread):
    seed = _fresh_seed()
    torch.manual_seed(seed)
    E, C = 8, 6
    layer = MoELayer(C, 4, E, k=2, capacity_factor=None, balance="bias", scores="sigmoid", bias_rate=0.005)
    with torch.no_grad():  # a fixed router that prefers experts 0 and 1 for most tokens
        layer.gate.weight.normal_().mul_(0.1)
        layer.gate.weight[:2] += 1.0 / C
    offset = torch.ones(C)  # every token shares this direction, as a transformer's hidden states do
    spread = []  # max load / mean load − 1 (Wang et al. 2024's MaxVio) per step, on fresh tokens
    with torch.no_grad():
        for _ in range(150):
            layer(torch.randn(512, C) + offset)
            load = layer.update_bias().double()
            spread.append((load.max() / load.mean() - 1).item())
    last = sum(spread[-20:]) / 20
    # 1,024 assignments: at first experts 0 and 1 take most of them (MaxVio 1.65–3 over 300 seeds); at the end the
    # loads are even up to the bias's ±γ oscillation (a sign rule never stops moving) and the sampling noise of
    # fresh tokens (last 20 steps: 0.19 median, 0.29 the worst of 300 seeds). The softmax settles slower (0.55).
    assert spread[0] > 1.5 and last < 0.4 and last < spread[0] / 4, (seed, spread[0], last)


@pytest.mark.parametrize("scores,capacity_factor", [("softmax", None), ("sigmoid", None), ("softmax", 0.7),
                                                    ("sigmoid", 0.7)])
def test_shared_and_fine_grained_experts_equal_the_per_token_loop(one_thread, scores, capacity_factor):
    seed = _fresh_seed()
    torch.manual_seed(seed)
    # odd sizes: C=5, 3 coarse experts of hidden 12 split in 3 (hidden 4), top-2 → 6 slots: 2 shared, 4 routed of 7
    layer = MoELayer(5, 12, 3, k=2, capacity_factor=capacity_factor, balance="bias", scores=scores, granularity=3,
                     shared=2).double()
    assert (layer.routed_experts, layer.routed_k, layer.expert_hidden) == (7, 4, 4)
    assert layer.shared_experts.c_fc.out_features == 8  # the two shared experts side by side
    with torch.no_grad():
        layer.expert_bias.normal_().mul_(0.2)  # a bias that changes choices, as after some training
    x = torch.randn(2, 13, 5, dtype=torch.float64)
    y, grads = _grads(layer, x, lambda v: layer(v)[0])
    for reference in (lambda v: loop_reference(layer, v), every_expert(layer)):
        y_ref, grads_ref = _grads(layer, x, reference)
        # float64; the grouped matmuls and the references' sum in different orders: ~1e-16 relative
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12, msg=f"seed {seed}")
        for name, g in grads.items():  # an expert no token chose: zeros here, no gradient (None) in the loop
            ref = torch.zeros_like(g) if grads_ref[name] is None else grads_ref[name]
            torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}, seed {seed}: {m}")
    assert capacity_factor is None or layer.routing.drop_rate > 0, seed


def test_fine_grained_experts_cost_the_coarse_layers_flops_and_parameters():
    from torch.utils.flop_counter import FlopCounterMode

    C, H, E, k, T, m, s = 16, 64, 4, 2, 50, 4, 1
    coarse = MoELayer(C, H, E, k, capacity_factor=None)
    fine = MoELayer(C, H, E, k, capacity_factor=None, granularity=m, shared=s)
    assert (fine.routed_experts, fine.routed_k, fine.expert_hidden) == (m * E - s, m * k - s, H // m)
    x = torch.randn(T, C)
    counted = {}
    for name, layer in (("coarse", coarse), ("fine", fine)):
        with FlopCounterMode(display=False) as counter:
            layer(x)
        counted[name] = counter.get_total_flops()  # every matmul of the forward, PyTorch's count
    router = {"coarse": 2 * T * C * E, "fine": 2 * T * C * (m * E - s)}  # (T, C) @ (C, E): 2·T·C·E
    experts = 2 * 2 * T * k * C * H  # per chosen coarse expert: C→H and H→C, 2·C·H each, per token
    assert counted["coarse"] == router["coarse"] + experts
    assert counted["fine"] == router["fine"] + experts  # s shared + (m·k − s) routed experts of H/m: k·H
    weights = {name: sum(p.numel() for n, p in layer.named_parameters() if "experts" in n and n.endswith("weight"))
               for name, layer in (("coarse", coarse), ("fine", fine))}
    assert weights["coarse"] == weights["fine"] == E * 2 * C * H  # the same expert weights, cut finer


def test_new_router_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match=r"balance='loss' must be one of 'aux-loss', 'bias', 'none'"):
        MoELayer(6, 10, 4, balance="loss")
    with pytest.raises(ValueError, match=r"scores='tanh' must be one of 'softmax', 'sigmoid'"):
        MoELayer(6, 10, 4, scores="tanh")
    with pytest.raises(ValueError, match="scores='tanh'"):
        route(torch.randn(3, 4), 2, None, scores="tanh")
    with pytest.raises(ValueError, match=r"bias has shape \(3,\), expected \(4,\): one per expert"):
        route(torch.randn(3, 4), 2, None, bias=torch.zeros(3))
    with pytest.raises(ValueError, match="bias_rate=-0.1"):
        MoELayer(6, 10, 4, bias_rate=-0.1)
    with pytest.raises(ValueError, match="granularity=0 must be a positive int"):
        MoELayer(6, 10, 4, granularity=0)
    with pytest.raises(ValueError, match="hidden=10 is not divisible by granularity=4"):
        MoELayer(6, 10, 4, granularity=4)
    with pytest.raises(ValueError, match=r"shared=4 must be an int in \[0, 3\] \(shared experts take"):
        MoELayer(6, 10, 4, k=2, granularity=2, shared=4)
    with pytest.raises(ValueError, match="update_bias\\(\\) needs balance='bias'; this layer has balance='none'"):
        MoELayer(6, 10, 4, balance="none").update_bias()


def _group(world):
    if not _groups:  # every rank builds every grid, in the same order
        _groups.update({k: Grid(dp=k, ranks=range(k)) for k in WORLD_SIZES})
    grid = _groups[world]
    return grid.dp_group if grid.member else False  # 4: the default group


def _expert_parallel(world, capacity_factor, grouped_gemm):
    import torch.distributed as td

    from llmlab.dist import CommLog

    group = _group(world)
    if group is False:
        return None
    rank = td.get_rank(group)
    full = _layer(2, capacity_factor)  # the same weights on every rank
    full.grouped_gemm = grouped_gemm  # from_layer carries it to this rank's share
    layer = MoELayer.from_layer(full, group)
    assert layer.grouped_gemm == grouped_gemm
    torch.manual_seed(100 + rank)
    x = torch.randn(13 + 3 * rank, 6, dtype=torch.float64, requires_grad=True)  # ranks hold different T
    with CommLog() as forward:
        y, aux = layer(x)
    with CommLog() as backward:
        ((y * torch.linspace(-1, 1, 6, dtype=y.dtype)).sum() + aux).backward()
    calls = lambda log: {name: s.calls for name, s in log.by_op().items()}  # noqa: E731
    return {"rank": rank, "x": x.detach(), "y": y.detach(), "aux": aux.detach(), "x_grad": x.grad,
            "grads": {name: p.grad for name, p in layer.named_parameters()}, "first": layer.first_expert,
            "drop_rate": layer.routing.drop_rate, "calls": (calls(forward), calls(backward))}


@pytest.mark.parametrize("world,capacity_factor,grouped_gemm", [(2, None, False), (2, 0.75, False), (4, None, False),
                                                                 (4, 0.75, False), (2, 0.75, True)])
def test_expert_parallel_equals_the_single_process_layer(cluster, world, capacity_factor, grouped_gemm):
    # grouped_gemm: each rank's experts through the Triton kernel, against the single-process per-expert loop
    results = [r for r in cluster.run(_expert_parallel, world, capacity_factor, grouped_gemm) if r is not None]
    assert [r["rank"] for r in results] == list(range(world))
    full = _layer(2, capacity_factor)
    expert_grads = {}
    for r in results:  # rank r's layer computes what the single-process layer computes on rank r's tokens
        full.zero_grad(set_to_none=True)
        x = r["x"].clone().requires_grad_(True)
        y, aux = full(x)
        ((y * torch.linspace(-1, 1, 6, dtype=y.dtype)).sum() + aux).backward()
        assert math.isclose(r["drop_rate"], full.routing.drop_rate)
        # float64; only the order of the sums differs (an expert's rows arrive grouped by rank): ~1e-16 relative
        torch.testing.assert_close(r["y"], y.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r["aux"], aux.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r["x_grad"], x.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r["grads"]["gate.weight"], full.gate.weight.grad, rtol=1e-12, atol=1e-12)
        for name, p in full.experts.named_parameters():
            expert_grads[name] = expert_grads.get(name, 0) + p.grad  # summed over every rank's tokens
    assert capacity_factor is None or max(r["drop_rate"] for r in results) > 0
    per_rank = 4 // world
    for r in results:
        assert r["first"] == r["rank"] * per_rank
        for i in range(per_rank):
            for name in ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias"):
                torch.testing.assert_close(r["grads"][f"experts.{i}.{name}"],
                                           expert_grads[f"{r['first'] + i}.{name}"], rtol=1e-12, atol=1e-12)
        forward, backward = r["calls"]  # two all-to-alls of rows each way, and one of the per-expert counts
        assert forward == {"moe.counts": 1, "all_to_all.check": 2, "all_to_all": 2}
        assert backward == {"all_to_all.check": 2, "all_to_all": 2}


def _indivisible():
    try:
        MoELayer(6, 10, 6, group=_group(4))
    except ValueError as e:
        return str(e)


def test_experts_not_divisible_by_the_world_size_is_refused(cluster):
    for message in cluster.run(_indivisible):
        assert message.startswith("num_experts=6 is not divisible by the expert-parallel world size 4")


def test_moe_bench_rows_follow_the_table_convention(one_thread, cluster):
    assert bench.BENCHES["moe"] == "llmlab.moe:bench"
    rows = bench.get("moe")(sizes=dict(dim=16, hidden=32, experts=4, tokens=64), cluster=cluster)
    assert len(rows) == 10
    floor = rows[2]  # the experts' segment matmuls alone, against the one-expert MLP
    assert floor["impl"] == "experts alone (rows pre-grouped)" and floor["ideal"] == 2
    ep = rows[-2]  # expert parallel on the 4 ranks: 16 tokens each
    assert ep["impl"] == "MoE expert-parallel, 4 gloo ranks" and ep["ideal"] == 1 and ep["comm_ms"] > 0
    for row in rows:
        assert {"impl", "peer", "size", "impl_ms", "peer_ms", "ratio", "spread", "load", "direction",
                "note"} <= set(row)
        assert row["ratio"] > 0 and row["direction"] in ("faster", "slower", "not conclusive")
    json.dumps(bench.record("moe", rows))  # the record is serialisable
    drops = [row["drop_rate"] for row in rows if "drop_rate" in row]
    assert len(drops) == 4 and drops == sorted(drops, reverse=True)
    equal = rows[1]  # on the CPU: the experts one matmul each, and a ratio reported against no target
    assert equal["peer"] == "dense MLP hidden=64 (equal active FLOPs)" and equal["experts"] == "one matmul per expert"
    assert equal["target"] == "none on the CPU (reported only)" and "meets" not in equal
    assert all("target" not in row for row in rows if row is not equal)


def test_moe_bench_names_its_gpu_target_under_smoke_mode(one_thread, cluster, monkeypatch):
    # the GPU tier's bench on the CPU standing in (LLMLAB_GPU_SMOKE): the target named, not judged on a stand-in;
    # the experts stay on one matmul each (the interpreter would run the grouped GEMM at seconds a step)
    monkeypatch.setattr(runtime, "tier", lambda: runtime.Tier("gpu-smoke", 1, runtime.SMOKE_GPU_NAME, smoke=True))
    rows = bench.get("moe")(sizes=dict(dim=16, hidden=32, experts=4, tokens=64), cluster=cluster)
    assert len(rows) == 10 and all(row["experts"] == "one matmul per expert" for row in rows[:3])
    assert rows[1]["target"] == "≤ 1.15× on a GPU" and rows[1]["meets"].startswith("not judged: a CPU stands in")
    json.dumps(bench.record("moe", rows))


def _comparison(ratios):
    """A Comparison whose rounds had these ratios (the peer 1 ms every round)."""
    return Comparison(Timing.from_samples([1e-3 * r for r in ratios]), Timing.from_samples([1e-3] * len(ratios)),
                      tuple(ratios))


def test_the_speed_target_is_judged_on_a_gpu_by_the_rounds_quartiles():
    gpu, cuda = runtime.Tier("gpu", 1, "H100"), torch.device("cuda")
    met = {name: moe.speed_target(_comparison(ratios), gpu, cuda)["meets"] for name, ratios in (
        ("below", [1.02, 1.05, 1.08, 1.1, 1.12]), ("above", [1.17, 1.2, 1.22, 1.3, 1.4]),
        ("across", [1.05, 1.1, 1.14, 1.18, 1.25]), ("one slow round", [1.0, 1.01, 1.02, 1.03, 2.0]))}
    assert moe.GPU_TARGET == 1.15
    assert met == {"below": "yes", "above": "no", "across": "not conclusive", "one slow round": "yes"}
    on_cpu = moe.speed_target(_comparison([0.5] * 5), runtime.Tier("cpu", 0, None), torch.device("cpu"))
    assert on_cpu == {"target": "none on the CPU (reported only)"}  # not judged, however fast
    stand_in = moe.speed_target(_comparison([0.5] * 5), runtime.Tier("gpu-smoke", 1, runtime.SMOKE_GPU_NAME,
                                                                     smoke=True), torch.device("cpu"))
    assert stand_in["meets"].startswith("not judged")


def test_bench_sizes_follow_the_tier_and_smoke_mode(monkeypatch):
    # LLMLAB_GPU_SMOKE's tier runs the GPU branch on the CPU: tiny sizes everywhere, the gloo ranks included
    monkeypatch.setattr(runtime, "tier", lambda: runtime.Tier("gpu-smoke", 1, runtime.SMOKE_GPU_NAME, smoke=True))
    assert moe_bench.sizes(None) == moe_bench.sizes(None, ranks=True) == moe_bench.SIZES["smoke"]
    monkeypatch.setattr(runtime, "tier", lambda: runtime.Tier("gpu", 1, "H200"))  # the ranks compute on the CPU
    assert moe_bench.sizes(None) == moe_bench.SIZES["gpu"] and moe_bench.sizes(None, True) == moe_bench.SIZES["cpu"]
    assert moe_bench.sizes(dict(tokens=8))["tokens"] == 8


def _balanced_layer(seed):
    torch.manual_seed(seed)  # 3 experts split in 3, one shared: 8 routed experts (2 or 4 per rank), top 5
    layer = MoELayer(5, 12, 3, k=2, capacity_factor=None, balance="bias", granularity=3, shared=1).double()
    with torch.no_grad():
        layer.expert_bias.normal_().mul_(0.2)
    return layer


def _balanced_tokens(seed, rank):
    torch.manual_seed(seed + 1 + rank)
    return torch.randn(11 + 2 * rank, 5, dtype=torch.float64)  # ranks hold different T


def _expert_parallel_balanced(world, seed, grouped_gemm):
    import torch.distributed as td

    group = _group(world)
    if group is False:
        return None
    rank = td.get_rank(group)
    full = _balanced_layer(seed)
    full.grouped_gemm = grouped_gemm  # from_layer carries it to this rank's share
    layer = MoELayer.from_layer(full, group)
    assert layer.grouped_gemm == grouped_gemm
    x = _balanced_tokens(seed, rank).requires_grad_(True)
    y, aux = layer(x)
    ((y * torch.linspace(-1, 1, 5, dtype=y.dtype)).sum() + aux).backward()
    load = layer.update_bias()  # summed over the group: every rank moves its bias alike
    return {"rank": rank, "y": y.detach(), "x_grad": x.grad, "load": load, "bias": layer.expert_bias,
            "grads": {name: p.grad for name, p in layer.named_parameters() if not name.startswith("experts.")}}


@pytest.mark.parametrize("world,grouped_gemm", [(2, False), (4, False), (4, True)])
def test_expert_parallel_with_shared_experts_and_the_bias_equals_one_process(cluster, world, grouped_gemm):
    # grouped_gemm: each rank's routed experts through the Triton kernel, against one process's per-expert loop
    seed = _fresh_seed()
    results = [r for r in cluster.run(_expert_parallel_balanced, world, seed, grouped_gemm) if r is not None]
    assert [r["rank"] for r in results] == list(range(world))
    whole = _balanced_layer(seed)  # one process sees every rank's tokens of the step
    for r in results:
        x = _balanced_tokens(seed, r["rank"]).requires_grad_(True)
        full = _balanced_layer(seed)  # rank r computes what the single-process layer computes on its tokens
        y, aux = full(x)
        ((y * torch.linspace(-1, 1, 5, dtype=y.dtype)).sum() + aux).backward()
        # float64; only the order of the sums differs (an expert's rows arrive grouped by rank): ~1e-16 relative
        torch.testing.assert_close(r["y"], y.detach(), rtol=1e-12, atol=1e-12, msg=lambda m: f"seed {seed}: {m}")
        torch.testing.assert_close(r["x_grad"], x.grad, rtol=1e-12, atol=1e-12, msg=lambda m: f"seed {seed}: {m}")
        for name, g in r["grads"].items():  # the router and the shared experts: this rank's tokens only
            torch.testing.assert_close(g, dict(full.named_parameters())[name].grad, rtol=1e-12, atol=1e-12,
                                       msg=lambda m, n=name: f"{n}, seed {seed}: {m}")
        whole(x.detach())
    load = whole.update_bias()
    for r in results:  # integer loads, and the same ±γ steps: exact
        assert torch.equal(r["load"], load) and torch.equal(r["bias"], whole.expert_bias), seed
