"""Tensor parallel layers equal the unsplit ones (outputs and every gradient), with two all-reduces each way
per block; each rank's shard is compared with the full layer's weights and gradients sliced by rank."""

import pytest
import torch

from llmlab.dist import Grid
from llmlab.parallel import tensor as tp


@pytest.fixture(scope="module")
def cluster(clusters):
    return clusters(4)


def _group(world):
    grid = Grid(tp=world, ranks=range(world))  # every rank takes part in creating the groups
    return (grid.tp_group, grid.tp_rank) if grid.member else (None, None)


def _linears(world):
    group, rank = _group(world)
    if group is None:
        return None
    torch.manual_seed(0)
    full = torch.nn.Linear(12, 8).double()
    x = torch.randn(3, 5, 12, dtype=torch.float64, requires_grad=True)
    col = tp.ColumnParallelLinear.from_linear(full, group, gather_output=True)
    y = col(x)
    (y * torch.arange(8.0, dtype=torch.float64)).sum().backward()
    full_row = torch.nn.Linear(8, 12).double()
    row = tp.RowParallelLinear.from_linear(full_row, group, input_is_parallel=False)
    u = torch.randn(2, 8, dtype=torch.float64)
    return {"y": y.detach(), "x_grad": x.grad, "w_grad": col.weight.grad, "b_grad": col.bias.grad,
            "z": row(u).detach(), "z_ref": full_row(u).detach(), "rank": rank}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_column_and_row_parallel_linear_equal_the_full_layer(cluster, world):
    results = [r for r in cluster.run(_linears, world) if r is not None]
    torch.manual_seed(0)
    full = torch.nn.Linear(12, 8).double()
    x = torch.randn(3, 5, 12, dtype=torch.float64, requires_grad=True)
    y = full(x)
    (y * torch.arange(8.0, dtype=torch.float64)).sum().backward()
    n = 8 // world
    for r in results:
        rows = slice(r["rank"] * n, (r["rank"] + 1) * n)
        # float64 throughout; the only difference is the order of the all-reduce's sums: ~1e-15 relative
        torch.testing.assert_close(r["y"], y.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r["x_grad"], x.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r["w_grad"], full.weight.grad[rows], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r["b_grad"], full.bias.grad[rows], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r["z"], r["z_ref"], rtol=1e-12, atol=1e-12)


def _blocks(world, recompute):
    from llmlab.dist import CommLog
    from llmlab.model import Block, GPTConfig

    group, rank = _group(world)
    if group is None:
        return None
    torch.manual_seed(0)
    block = Block(GPTConfig.preset("tiny", n_embd=32, n_head=4, recompute=recompute)).double()
    x = torch.randn(2, 7, 32, dtype=torch.float64, requires_grad=True)
    par = tp.ParallelBlock(block, group)
    with CommLog() as forward:
        y = par(x)
    with CommLog() as backward:
        y.pow(2).sum().backward()
    count = lambda log: log.by_op()["torch.all_reduce"].calls if "torch.all_reduce" in log.by_op() else 0  # noqa: E731
    grads = {name: p.grad for name, p in par.named_parameters()}
    return {"rank": rank, "y": y.detach(), "x_grad": x.grad, "grads": grads,
            "all_reduces": (count(forward), count(backward))}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("recompute", ["none", "selective"])  # selective: each rank recomputes its heads' core
def test_parallel_block_equals_block_with_two_all_reduces_each_way(cluster, world, recompute):
    from llmlab.model import Block, GPTConfig

    results = [r for r in cluster.run(_blocks, world, recompute) if r is not None]
    torch.manual_seed(0)
    block = Block(GPTConfig.preset("tiny", n_embd=32, n_head=4)).double()
    x = torch.randn(2, 7, 32, dtype=torch.float64, requires_grad=True)
    y = block(x)
    y.pow(2).sum().backward()
    C, c = 32, 32 // world
    for r in results:
        mine = torch.arange(r["rank"] * c, (r["rank"] + 1) * c)
        qkv = torch.cat([mine, C + mine, 2 * C + mine])
        hidden = torch.arange(r["rank"] * 4 * c, (r["rank"] + 1) * 4 * c)
        expected = {
            "ln_1.weight": block.ln_1.weight.grad, "ln_1.bias": block.ln_1.bias.grad,
            "ln_2.weight": block.ln_2.weight.grad, "ln_2.bias": block.ln_2.bias.grad,
            "attn.c_attn.weight": block.attn.c_attn.weight.grad[qkv],
            "attn.c_attn.bias": block.attn.c_attn.bias.grad[qkv],
            "attn.c_proj.weight": block.attn.c_proj.weight.grad[:, mine],
            "attn.c_proj.bias": block.attn.c_proj.bias.grad,
            "mlp.c_fc.weight": block.mlp.c_fc.weight.grad[hidden], "mlp.c_fc.bias": block.mlp.c_fc.bias.grad[hidden],
            "mlp.c_proj.weight": block.mlp.c_proj.weight.grad[:, hidden], "mlp.c_proj.bias": block.mlp.c_proj.bias.grad,
        }
        assert set(r["grads"]) == set(expected)
        torch.testing.assert_close(r["y"], y.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r["x_grad"], x.grad, rtol=1e-12, atol=1e-12)
        for name, ref in expected.items():
            torch.testing.assert_close(r["grads"][name], ref, rtol=1e-11, atol=1e-12, msg=name)
        assert r["all_reduces"] == (2, 2)


def test_sizes_not_divisible_are_refused(cluster):
    def build():
        import torch.distributed as td

        errors = []
        for make in (lambda: tp.ColumnParallelLinear(4, 6), lambda: tp.RowParallelLinear(6, 4)):
            try:
                make()
            except ValueError as e:
                errors.append(str(e))
        return errors, td.get_world_size()

    errors, n = cluster.run(build)[0]
    assert errors == [f"out_features=6 is not divisible by the tensor-parallel world size {n}",
                      f"in_features=6 is not divisible by the tensor-parallel world size {n}"]
