"""Ring attention (llmlab.parallel.context) equals single-process attention: each rank's output rows and its
tokens' q, k, v gradients are F.scaled_dot_product_attention's on the whole sequence (float64) at that rank's
positions, on 1–4 gloo ranks, contiguous and zig-zag, causal and not; zig-zag balances causal work exactly; each
ring step's message is in flight while that step computes."""

import pytest
import torch
import torch.nn.functional as F

from llmlab.dist import CommLog, Grid
from llmlab.parallel import context as cp

B, H, D = 2, 3, 5  # odd head count and head size


@pytest.fixture(scope="module")
def cluster(clusters):
    return clusters(4)


def _qkv(seed: int, T: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, dtype=torch.float64, generator=g) * 2 for _ in range(4)]  # q, k, v, dO


def _on_rank(world, seed, T, causal, layout):
    grid = Grid(tp=world, ranks=range(world))  # every rank takes part in creating the groups
    if not grid.member:
        return None
    group = grid.tp_group
    q, k, v, grad = _qkv(seed, T)
    mine = [cp.shard_sequence(t, group, layout).requires_grad_() for t in (q, k, v)]  # (B, H, T/cp, D)
    spans = []
    with CommLog() as log:
        o = cp.ring_attention(*mine, group=group, causal=causal, layout=layout, spans=spans)
    o.backward(cp.shard_sequence(grad, group, layout))
    sends = [e for e in log.events if e.kind == "p2p" and e.bytes_sent]
    return {"pos": cp.positions(T, grid.tp_rank, world, layout), "o": o.detach(),
            "grads": [t.grad for t in mine], "spans": spans, "sends": [(e.start, e.end) for e in sends]}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_equals_sdpa_on_the_whole_sequence(cluster, world, layout, causal):
    seed = torch.randint(0, 2**31, ()).item()  # fresh inputs on every run
    T = 2 * world * 3 + (0 if layout == "zigzag" else world)  # chunks of 3 tokens; T odd for contiguous cp=1, 3
    results = [r for r in cluster.run(_on_rank, world, seed, T, causal, layout) if r is not None]
    q, k, v, grad = (t.requires_grad_(i < 3) for i, t in enumerate(_qkv(seed, T)))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # (B, H, T, D)
    o.backward(grad)
    seen = torch.cat([r["pos"] for r in results])
    assert sorted(seen.tolist()) == list(range(T))  # the ranks' positions cover the sequence once
    for r in results:
        # float64: the merge rescales each row by exp of lse differences, a few roundings of ~1e-16 each; the
        # gradients sum world partial products in another order than SDPA's one matmul: far inside 1e-10
        torch.testing.assert_close(r["o"], o.detach()[:, :, r["pos"]], rtol=1e-10, atol=1e-12)
        for got, want in zip(r["grads"], (q.grad, k.grad, v.grad), strict=True):
            torch.testing.assert_close(got, want[:, :, r["pos"]], rtol=1e-10, atol=1e-12)


def test_each_step_sends_while_it_computes(cluster):
    results = cluster.run(_on_rank, 4, 0, 24, True, "zigzag")
    for r in results:
        assert len(r["spans"]) == 4 and len(r["sends"]) == 3  # the log holds the forward: 3 passes for 4 ranks
        for (sent, arrived), (_, _, start, end) in zip(r["sends"], r["spans"], strict=False):
            assert sent <= start and arrived >= end  # in flight for the whole of the step's attention


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_balances_causal_work_and_contiguous_does_not(world):
    c = 5
    T = 2 * world * c
    zigzag = cp.causal_work(T, world, "zigzag")
    assert zigzag == [c * c * (2 * world - 1) + c * (c + 1)] * world  # every rank the same
    contiguous = cp.causal_work(T, world, "contiguous")
    assert sum(contiguous) == sum(zigzag) == T * (T + 1) // 2
    assert contiguous == sorted(contiguous) and contiguous[-1] > 2 * contiguous[0]  # the last rank does the most


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="layout='ring' must be one of"):
        cp.positions(8, 0, 2, "ring")
    with pytest.raises(ValueError, match="T=10 is not divisible by 4: the zigzag layout over cp=2"):
        cp.positions(10, 0, 2, "zigzag")
    with pytest.raises(ValueError, match=r"q, k, v must be \(B, H, T/cp, D\) of one shape"):
        cp.ring_attention(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 4, 4))


def _attention_module(seed: int):
    from llmlab.model import CausalSelfAttention, GPTConfig

    torch.manual_seed(seed)
    return CausalSelfAttention(GPTConfig(vocab_size=8, block_size=64, n_layer=1, n_head=H, n_embd=H * D)).double()


def _module_on_rank(world, seed, T):
    grid = Grid(tp=world, ranks=range(world))
    if not grid.member:
        return None
    attn = _attention_module(seed)
    x = torch.randn(B, T, H * D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))  # (B, T, C)
    pos = cp.positions(T, grid.tp_rank, world)
    y = cp.ContextParallelAttention(attn, grid.tp_group)(x[:, pos])  # (B, T/cp, C): this rank's tokens
    y.pow(2).sum().backward()
    return {"pos": pos, "y": y.detach(), "grads": {n: p.grad for n, p in attn.named_parameters()}}


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_attention_module_equals_the_block_attention(cluster, world):
    """A GPT block's attention on this rank's zig-zag tokens, its projections shared: the output rows equal the
    unsplit module's at those positions, and its parameter gradients summed over the ranks equal the unsplit's."""
    seed, T = torch.randint(0, 2**31, ()).item(), 4 * world
    results = [r for r in cluster.run(_module_on_rank, world, seed, T) if r is not None]
    attn = _attention_module(seed)
    x = torch.randn(B, T, H * D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    y = attn(x)  # (B, T, C)
    y.pow(2).sum().backward()
    for r in results:  # float64, partial sums in another order: far inside 1e-10 (as above)
        torch.testing.assert_close(r["y"], y.detach()[:, r["pos"]], rtol=1e-10, atol=1e-12)
    for name, p in attn.named_parameters():
        summed = sum(r["grads"][name] for r in results)
        torch.testing.assert_close(summed, p.grad, rtol=1e-10, atol=1e-12)


def test_context_parallel_attention_refuses_attention_dropout():
    attn = _attention_module(0)
    attn.attn_dropout.p = 0.1
    with pytest.raises(ValueError, match="attention dropout p=0.1: ring attention applies none"):
        cp.ContextParallelAttention(attn)
