"""Mixture of Experts (llmlab.moe, moe_dispatch, moe_bench): the grouped layer equals the per-token loop and every
expert on every token (with and without drops, an expert with no rows, outputs and gradients), runs under bf16
autocast, the drop rule is first come first served with first choices first, the balance loss is 1 for uniform
routing and grows with imbalance, drop rate falls with the capacity factor, expert parallelism on 2 and 4 ranks
equals the single-process layer with two all-to-alls each way, the bench's rows and sizes (smoke mode's tiny
ones), and bad arguments are refused by name."""

import json
import math

import pytest
import torch

from llmlab import bench, moe_bench, runtime
from llmlab.dist import Grid
from llmlab.moe import Expert, MoELayer, every_expert, loop_reference, route
from llmlab.moe_dispatch import grouped_gemm_mlp, grouped_mlp

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


def _grouped_gemm_twin(layer):
    twin = MoELayer(layer.dim, layer.hidden, layer.num_experts, layer.k, layer.capacity_factor, grouped_gemm=True)
    twin.load_state_dict(layer.state_dict())
    return twin.to(next(layer.parameters()).dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("capacity_factor", [None, 0.6])
def test_grouped_gemm_layer_equals_the_per_expert_loop(one_thread, dtype, capacity_factor, seed=3):
    torch.manual_seed(seed)
    layer = MoELayer(5, 11, 7, 2, capacity_factor).to(dtype)  # odd sizes: C=5, H=11, E=7, T=2·29
    x = torch.randn(2, 29, 5, dtype=dtype)
    with torch.no_grad():  # expert 6 is never chosen (an empty group for the kernel): x₀ = 4, w₆₀ = −9
        x[..., 0] = 4.0
        layer.gate.weight[6, 0] = -9.0
    kernel = _grouped_gemm_twin(layer)
    y, grads = _grads(layer, x, lambda v: layer(v)[0])
    y_k, grads_k = _grads(kernel, x, lambda v: kernel(v)[0])
    assert kernel.routing.counts[6] == 0 and torch.equal(kernel.routing.kept, layer.routing.kept)
    # the same products summed in other orders (the kernel's tiles against one matmul per expert): float64 ~1e-16
    # relative; float32 ~2^-24 per addition over sums of ≤ T·k = 116 terms of size O(1): 1e-4 absolute leaves
    # room, and a row through the wrong expert or a missing bias is O(1)
    tol = {torch.float64: 1e-12, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(y_k, y, rtol=tol, atol=tol)
    for name, g in grads.items():
        torch.testing.assert_close(grads_k[name], g, rtol=tol, atol=tol, msg=name)


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


def test_bench_sizes_follow_the_tier_and_smoke_mode(monkeypatch):
    # LLMLAB_GPU_SMOKE's tier runs the GPU branch on the CPU: tiny sizes everywhere, the gloo ranks included
    monkeypatch.setattr(runtime, "tier", lambda: runtime.Tier("gpu-smoke", 1, runtime.SMOKE_GPU_NAME, smoke=True))
    assert moe_bench.sizes(None) == moe_bench.sizes(None, ranks=True) == moe_bench.SIZES["smoke"]
    monkeypatch.setattr(runtime, "tier", lambda: runtime.Tier("gpu", 1, "H200"))  # the ranks compute on the CPU
    assert moe_bench.sizes(None) == moe_bench.SIZES["gpu"] and moe_bench.sizes(None, True) == moe_bench.SIZES["cpu"]
    assert moe_bench.sizes(dict(tokens=8))["tokens"] == 8
