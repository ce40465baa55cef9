"""Sequence parallelism (llmlab.parallel.sequence) equals the unsplit block: each rank's tokens of the output and
of the input gradient, and each rank's parameter shards' gradients, are the unsplit block's sliced by rank; it
sends what plain tensor parallelism sends forward, and keeps about 1/t of the unsplit block's activations."""

import pytest
import torch

from llmlab.dist import CommLog, Grid
from llmlab.memory.measure import SavedActivations
from llmlab.model import Block, GPTConfig
from llmlab.parallel import sequence as sp
from llmlab.parallel import tensor as tp

B, T, C, NH = 2, 12, 24, 4  # T, C and NH divisible by every world size in WORLDS
WORLDS = [1, 2, 4]


@pytest.fixture(scope="module")
def cluster(clusters):
    return clusters(4)


def _block(seed: int, recompute: str = "none"):
    torch.manual_seed(seed)
    return Block(GPTConfig.preset("tiny", n_embd=C, n_head=NH, recompute=recompute)).double()


def _input(seed: int):
    torch.manual_seed(seed + 1)
    return torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)  # (B, T, C)


def _on_rank(world, seed, sequence_parallel, recompute):
    grid = Grid(tp=world, ranks=range(world))  # every rank takes part in creating the groups
    if not grid.member:
        return None
    group = grid.tp_group
    par = tp.ParallelBlock(_block(seed, recompute), group, sequence_parallel=sequence_parallel)
    x = _input(seed)
    with CommLog() as forward, SavedActivations(exclude=list(par.parameters())) as saved:
        y = par(sp.scatter_sequence(x, group) if sequence_parallel else x)  # (B, T/t, C) or (B, T, C)
    with CommLog() as backward:
        y.pow(2).sum().backward()
        par.all_reduce_replicated_grads()
    sent = lambda log: sum(s.bytes_sent for name, s in log.by_op().items() if not name.endswith(".check"))  # noqa: E731
    return {"rank": grid.tp_rank, "y": y.detach(), "x_grad": x.grad,
            "grads": {name: p.grad for name, p in par.named_parameters()},
            "sent": (sent(forward), sent(backward)), "saved": saved.bytes}


def _expected_grads(block, rank, world):
    c = C // world
    mine = torch.arange(rank * c, (rank + 1) * c)
    qkv = torch.cat([mine, C + mine, 2 * C + mine])
    hidden = torch.arange(rank * 4 * c, (rank + 1) * 4 * c)
    return {
        "ln_1.weight": block.ln_1.weight.grad, "ln_1.bias": block.ln_1.bias.grad,
        "ln_2.weight": block.ln_2.weight.grad, "ln_2.bias": block.ln_2.bias.grad,
        "attn.c_attn.weight": block.attn.c_attn.weight.grad[qkv], "attn.c_attn.bias": block.attn.c_attn.bias.grad[qkv],
        "attn.c_proj.weight": block.attn.c_proj.weight.grad[:, mine], "attn.c_proj.bias": block.attn.c_proj.bias.grad,
        "mlp.c_fc.weight": block.mlp.c_fc.weight.grad[hidden], "mlp.c_fc.bias": block.mlp.c_fc.bias.grad[hidden],
        "mlp.c_proj.weight": block.mlp.c_proj.weight.grad[:, hidden], "mlp.c_proj.bias": block.mlp.c_proj.bias.grad,
    }


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_sequence_parallel_block_equals_the_unsplit_block_sliced_by_rank(cluster, world, recompute):
    seed = torch.randint(0, 2**31, ()).item()  # fresh inputs and weights on every run
    results = [r for r in cluster.run(_on_rank, world, seed, True, recompute) if r is not None]
    block, x = _block(seed), _input(seed)
    with SavedActivations(exclude=list(block.parameters())) as unsplit:
        y = block(x)  # (B, T, C)
    y.pow(2).sum().backward()
    n = T // world
    assert len(results) == world
    for r in results:
        tokens = slice(r["rank"] * n, (r["rank"] + 1) * n)
        expected = _expected_grads(block, r["rank"], world)
        assert set(r["grads"]) == set(expected)
        # float64 throughout; only the order of the collectives' additions differs from the unsplit block: ~1e-15
        # relative per addition, a few dozen of them, far inside 1e-11
        torch.testing.assert_close(r["y"], y.detach()[:, tokens], rtol=1e-11, atol=1e-12)
        torch.testing.assert_close(r["x_grad"], x.grad, rtol=1e-11, atol=1e-12)
        for name, ref in expected.items():
            torch.testing.assert_close(r["grads"][name], ref, rtol=1e-11, atol=1e-12, msg=name)
    if world > 1 and recompute == "none":
        # what autograd keeps on a rank is the unsplit block's divided by t, but for the (T, T) causal mask that
        # every rank builds whole: the norms, residuals and matmul inputs are all T/t tokens or 1/t of the heads
        mask = T * T  # bytes of a bool (T, T)
        assert results[0]["saved"] == pytest.approx((unsplit.bytes - mask) / world + mask, abs=0)


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_sends_what_tensor_parallel_sends_forward_and_keeps_less(cluster, world):
    plain = [r for r in cluster.run(_on_rank, world, 0, False, "none") if r is not None]
    seq = [r for r in cluster.run(_on_rank, world, 0, True, "none") if r is not None]
    full = B * T * C * 8  # bytes of one (B, T, C) float64 activation
    ring = (world - 1) * full // world  # a reduce-scatter or an all-gather of it on one rank; an all-reduce is 2×
    replicated = 6 * 2 * (world - 1) * C * 8 // world  # all-reducing 4 norm parameters and 2 biases of C each
    for p, s in zip(plain, seq, strict=True):
        assert p["sent"] == (2 * 2 * ring, 2 * 2 * ring)  # plain TP: two all-reduces each way
        # forward: two all-gathers and two reduce-scatters, the same bytes as the two all-reduces
        assert s["sent"][0] == p["sent"][0]
        # backward: two reduce-scatters (the column-parallel inputs' gradients) and two all-gathers (ḡ's), the same
        # again; plus two all-gathers that rebuild the column-parallel inputs it did not keep, one that gathers the
        # input's gradient whole for this test's scatter_sequence, and the replicated gradients' sums (torch
        # all-reduces, counted as llmlab's ring would send them)
        assert s["sent"][1] == p["sent"][1] + 2 * ring + ring + replicated
        assert s["saved"] < p["saved"]


def test_tokens_not_divisible_are_refused(cluster):
    def build():
        grid = Grid(tp=2, ranks=range(2))
        if not grid.member:
            return None
        try:
            sp.scatter_sequence(torch.zeros(1, 5, 4), grid.tp_group)
        except ValueError as e:
            return str(e)

    assert cluster.run(build)[0] == ("sequence length T=5 is not divisible by the tensor-parallel world size 2: "
                                     "sequence parallelism gives every rank T/2 tokens")


def test_gather_output_and_sequence_parallel_are_refused(cluster):
    def build():
        try:
            tp.ColumnParallelLinear(4, 8, gather_output=True, sequence_parallel=True)
        except ValueError as e:
            return str(e)

    assert "gather_output=True with sequence_parallel=True" in cluster.run(build)[0]


@pytest.mark.parametrize("t", [1, 2, 8])
def test_activation_bytes_are_korthikanti_table_2(t):
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B's layer, the paper's Table 3 model
    none = s * b * h * (34 + 5 * a * s / h)
    assert sp.activation_bytes(s, b, h, a) == none
    assert sp.activation_bytes(s, b, h, a, t) == s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert sp.activation_bytes(s, b, h, a, t, sequence_parallel=True) == pytest.approx(none / t, rel=1e-15)
    assert sp.activation_bytes(s, b, h, a, t, sequence_parallel=True, selective=True) == pytest.approx(
        34 * s * b * h / t, rel=1e-15)
    with pytest.raises(ValueError, match="t=0 must be a positive integer"):
        sp.activation_bytes(s, b, h, a, 0)


def _ends(world, seed):
    """scatter → block → gather → a loss every rank computes whole: the input's gradient is the unsplit one."""
    group = Grid(tp=world, ranks=range(world)).tp_group
    par = tp.ParallelBlock(_block(seed), group, sequence_parallel=True)
    x = _input(seed)
    y = sp.gather_sequence(par(sp.scatter_sequence(x, group)), group)  # (B, T, C) on every rank
    y.pow(2).sum().backward()
    par.all_reduce_replicated_grads()
    return y.detach(), x.grad, par.ln_1.weight.grad


def test_gathered_output_feeding_replicated_work_has_the_unsplit_gradients(cluster):
    block, x = _block(1), _input(1)
    y = block(x)
    y.pow(2).sum().backward()
    for got, x_grad, ln_grad in cluster.run(_ends, 4, 1):
        # float64; the collectives' summation order only (see above)
        torch.testing.assert_close(got, y.detach(), rtol=1e-11, atol=1e-12)
        torch.testing.assert_close(x_grad, x.grad, rtol=1e-11, atol=1e-12)
        torch.testing.assert_close(ln_grad, block.ln_1.weight.grad, rtol=1e-11, atol=1e-12)
