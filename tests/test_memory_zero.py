"""ZeRO-1/2/3 from scratch: the same training as single-process AdamW, with the model state really sharded.

All multi-rank runs share one 4-rank cluster; world sizes 2 and 3 use a subgroup of its first ranks. Each
(stage, world size, bucket) configuration is trained once (`runs`) and its results are checked by several
tests: equality with AdamW, bytes per rank vs the planner, CommLog bytes vs 2Ψ/3Ψ.
"""

import pytest
import torch

from llmlab.dist import Grid
from llmlab.dist.collectives import chunk_sizes
from llmlab.memory import planner
from llmlab.memory.zero import ZeRO, measure_zero
from llmlab.parallel.ddp import buckets

STEPS, BATCH, LR, WD = 3, 12, 1e-2, 0.1  # 12 rows split evenly over 2, 3 and 4 ranks


def _config():
    from llmlab.model import GPTConfig

    # 4 blocks of 12·32² + 13·32 = 12704 parameters and a root unit of wte 64·32 (tied with lm_head) + wpe 16·32
    # + ln_f 2·32 = 2624: Ψ = 53440, divisible by 2 and 4 but not by 3 (padding), and several layers so that
    # stage 3's one-layer-at-a-time is far below the whole model.
    return GPTConfig.preset("tiny", n_layer=4, n_embd=32, block_size=16)


def _model():
    from llmlab.model import GPT

    torch.manual_seed(0)
    return GPT(_config()).double()  # float64: see test_training_equals_single_process_adamw


def _batches():
    from llmlab.data import MarkovSource, SyntheticDataset

    data = SyntheticDataset(MarkovSource(64), batch_size=BATCH, block_size=16, seed=3)
    return [data.get_batch(s) for s in range(STEPS)]


def _train(world, stage, bucket_mb=25.0):
    """STEPS of ZeRO `stage` on the first `world` ranks, each on its rows; what the tests check, per rank."""
    from llmlab.dist import CommLog
    from llmlab.memory import measure

    grid = Grid(dp=world, ranks=range(world))  # every rank takes part in creating the groups
    if not grid.member:
        return None
    group, rank = grid.dp_group, grid.dp_rank
    model = _model()
    if rank > 0:  # a different start elsewhere: ZeRO must broadcast rank 0's parameters
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    zero = ZeRO(model, stage, lr=LR, weight_decay=WD, group=group, bucket_mb=bucket_mb)
    alive = []  # stage 3: parameter storage alive (full layers + every shard) as each block's forward starts
    for block in model.transformer.h if stage == 3 else ():
        block.register_forward_pre_hook(  # after ZeRO's own pre-hook: the block is gathered
            lambda *_: alive.append(measure.tensor_bytes(zero.params + [u.shard for u in zero.units])))
    losses, sent, full_after_backward = [], [], []
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for x, y in _batches():
        zero.zero_grad()
        with CommLog() as log:
            loss = zero(x[rows], y[rows])[1]
            loss.backward()
            full_after_backward.append(measure.tensor_bytes(zero.params))
            zero.step()
        losses.append(loss.item())
        sent.append(log.bytes_sent)
    return {"losses": losses, "params": zero.full_parameters(), "state": zero.state_bytes(), "sent": sent,
            "padding": zero.padding, "units": [(u.numel, u.shard_numel) for u in zero.units],
            "buckets": [sum(p.numel() for p in b) for b in zero.module.buckets] if stage == 0 else None,
            "alive": alive, "full_after_backward": full_after_backward}


@pytest.fixture(scope="module")
def cluster(clusters):
    return clusters(4)


@pytest.fixture(scope="module")
def runs(cluster):
    cache = {}

    def run(world, stage, bucket_mb=25.0):
        key = (world, stage, bucket_mb)
        if key not in cache:
            cache[key] = cluster.run(_train, world, stage, bucket_mb, timeout=120)[:world]
        return cache[key]

    return run


@pytest.fixture(scope="module")
def reference():
    """Single-process torch.optim.AdamW on the full batch: losses and final parameters."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for x, y in _batches():
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach() for p in model.parameters()]


NUM_PARAMS = 4 * 12704 + 2624  # Ψ, see _config
CONFIGS = [(world, stage) for world in (2, 4) for stage in range(4)] + [(3, stage) for stage in range(1, 4)]


def _close(got, want):
    # float64, so that the only difference is the order of summation: the full-batch gradient summed at once vs
    # per-rank sums averaged, a relative ~1e-16 per term. AdamW divides each coordinate by √v + eps, so where a
    # gradient is a sum that nearly cancels its relative error (and so that of its update, ≤ lr) grows: the
    # largest difference seen after 3 steps is 1.7e-13 (N = 3), while the parameters move by up to 3e-2. 1e-11
    # leaves a 60× margin and is still 9 orders of magnitude below what training changes (float32 would put
    # the rounding itself near 1e-6 and hide a real error of that size).
    torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


@pytest.mark.parametrize("world,stage", CONFIGS)
def test_training_equals_single_process_adamw(runs, reference, world, stage):
    ranks = runs(world, stage)
    ref_losses, ref_params = reference
    for step in range(STEPS):  # equal rows per rank: the mean of the ranks' mean losses is the full-batch mean
        assert sum(r["losses"][step] for r in ranks) / world == pytest.approx(ref_losses[step], abs=1e-12)
    for r in ranks:
        assert len(r["params"]) == len(ref_params)  # the tied wte/lm_head matrix is one parameter
        for got, want in zip(r["params"], ref_params, strict=True):
            _close(got, want)


def _expected_state(stage, world, padding, units, itemsize=8):
    """Exact bytes per rank: Ψ elements unsharded, P = Ψ + padding in flat buffers, S = P/N per shard."""
    psi, e = NUM_PARAMS, itemsize
    if stage == 0:  # torch's AdamW also keeps one float32 step counter per parameter tensor
        return (e * psi, e * psi, 2 * e * psi + 4 * len(list(_model().parameters())))
    full, shard = psi + padding, sum(s for _, s in units)
    assert shard * world == full
    return {1: (e * full, e * psi, 2 * e * shard), 2: (e * full, e * shard, 2 * e * shard),
            3: (e * shard, e * shard, 2 * e * shard)}[stage]


@pytest.mark.parametrize("world,stage", CONFIGS)
def test_state_bytes_per_rank_match_the_planner(runs, world, stage):
    for r in runs(world, stage):
        got = r["state"]
        assert (got.params, got.grads, got.optimizer_state) == _expected_state(stage, world, r["padding"],
                                                                               r["units"])
        # The planner's fp32 column (4 + 4 + 8 bytes per parameter, sharded by stage) in float64: ×8/4.
        formula = planner.model_state_bytes(NUM_PARAMS, stage, world, "adamw", "fp32") * 8 / 4
        assert got.total == pytest.approx(formula, rel=0.05)
        # What is left is padding (< N elements per unit) and, at stage 0, torch's step counters: 1e-3 here.
        assert got.total == pytest.approx(formula, rel=1e-3)


@pytest.mark.parametrize("world,stage", CONFIGS)
def test_comm_bytes_per_step_are_2_psi_or_3_psi(runs, world, stage):
    e, psi = 8, NUM_PARAMS
    for rank, r in enumerate(runs(world, stage)):
        if stage == 0:  # DataParallel all-reduces each bucket B: the ring sends 2B − c[r] − c[r+1] elements
            want = sum(e * (2 * b - chunk_sizes(b, world)[rank] - chunk_sizes(b, world)[(rank + 1) % world])
                       for b in r["buckets"])
        else:  # per unit: reduce-scatter and all-gather (stage 3: two all-gathers) send (N−1)·S_u elements each
            want = (3 if stage == 3 else 2) * sum(e * (world - 1) * s for _, s in r["units"])
        assert r["sent"] == [want] * STEPS
        paper = (3 if stage == 3 else 2) * psi * e * (world - 1) / world  # 2Ψ or 3Ψ data volume, by a ring
        # ... sent for P = Ψ + padding elements instead of Ψ (at stage 0 the ring's chunks of a bucket whose size
        # N does not divide differ by one element: none here, 53440 is even and a multiple of 4).
        assert want == pytest.approx(paper * (psi + r["padding"]) / psi, rel=1e-12)


def test_padding_is_exact_when_n_does_not_divide_the_units(runs):
    # Ψ = 53440 ≡ 1 (mod 3): one flat buffer (stages 1–2) needs 2 elements of padding; stage 3's units are 4
    # blocks of 12704 ≡ 2 and a root of 2624 ≡ 2 (mod 3), one element each.
    assert [r["padding"] for r in runs(3, 1)] == [2] * 3
    assert [r["padding"] for r in runs(3, 3)] == [5] * 3
    assert runs(3, 3)[0]["units"] == [(12704, 4235)] * 4 + [(2624, 875)]
    # Stage 2 with small buckets: every bucket is padded on its own, and training is still exact.
    sizes = [sum(p.numel() for p in b) for b in buckets([p for p in _model().parameters()], 0.05)]
    ranks = runs(3, 2, 0.05)
    assert [n for n, _ in ranks[0]["units"]] == sizes and len(sizes) > 1
    assert ranks[0]["padding"] == sum(-n % 3 for n in sizes) > 0


def test_small_buckets_train_like_adamw(runs, reference):
    for r in runs(3, 2, 0.05):
        for got, want in zip(r["params"], reference[1], strict=True):
            _close(got, want)


@pytest.mark.parametrize("world", [2, 4])
def test_stage_3_holds_one_layer_at_a_time(runs, world):
    e, block, root = 8, 12704, 2624
    shards = e * NUM_PARAMS // world  # no padding at N = 2, 4
    for r in runs(world, 3):
        # At each block's forward: every shard, the root unit (open for the whole forward) and that block.
        assert r["alive"] == [shards + e * (root + block)] * (4 * STEPS)
        assert max(r["alive"]) - shards < 0.3 * e * NUM_PARAMS  # full parameters: 29% of the model's
        assert r["full_after_backward"] == [0] * STEPS  # every full parameter freed after backward


def test_stage_1_equals_torch_zero_redundancy_optimizer(cluster, runs):
    ours = runs(2, 1)
    theirs = cluster.run(_torch_zero, 2, timeout=120)[:2]
    for mine, torch_zero in zip(ours, theirs, strict=True):
        for a, b in zip(mine["params"], torch_zero, strict=True):
            _close(a, b)


def _torch_zero(world):
    """torch.distributed.optim.ZeroRedundancyOptimizer over AdamW, gradients averaged by our DataParallel."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from llmlab.parallel.ddp import DataParallel

    grid = Grid(dp=world, ranks=range(world))
    if not grid.member:
        return None
    group, rank = grid.dp_group, grid.dp_rank
    model = DataParallel(_model(), group=group)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, process_group=group,
                                  lr=LR, weight_decay=WD)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for x, y in _batches():
        model(x[rows], y[rows])[1].backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def _resume(world, stage, states, steps, own=False):
    """ZeRO `stage` on the first `world` ranks: load `states` (every saved rank's state_dict; `own`: only this
    rank's, same world size) unless None, then train on steps[0] … steps[1]-1 of _batches(); this rank's
    state_dict() right after loading, at the end, and the full parameters."""
    grid = Grid(dp=world, ranks=range(world))
    if not grid.member:
        return None
    zero = ZeRO(_model(), stage, lr=LR, weight_decay=WD, group=grid.dp_group)
    if states is not None:
        zero.load_state_dict(states[grid.dp_rank] if own else states)
    loaded = zero.state_dict()
    rows = slice(grid.dp_rank * BATCH // world, (grid.dp_rank + 1) * BATCH // world)
    for x, y in _batches()[steps[0]:steps[1]]:
        zero.zero_grad()
        zero(x[rows], y[rows])[1].backward()
        zero.step()
    return {"loaded": loaded, "state": zero.state_dict(), "params": zero.full_parameters()}


@pytest.fixture(scope="module")
def saved(cluster):
    """Every rank's state_dict after the first 2 of the STEPS updates, per (world, stage)."""
    cache = {}

    def save(world, stage):
        if (world, stage) not in cache:
            cache[world, stage] = [r["state"] for r in cluster.run(_resume, world, stage, None, (0, 2))[:world]]
        return cache[world, stage]

    return save


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("before, after", [(2, 4), (4, 2), (2, 3), (3, 2)])
def test_state_dict_reshards_onto_another_data_parallel_size(cluster, saved, reference, stage, before, after):
    """Saved after 2 updates on `before` ranks, the last update on `after` ranks: the same parameters as AdamW
    on the full batch (so the shards, moments and step count were re-cut right, padding included)."""
    states = saved(before, stage)
    assert [s["world_size"] for s in states] == [before] * before and [s["step"] for s in states] == [2] * before
    for r in cluster.run(_resume, after, stage, states, (2, STEPS))[:after]:
        assert r["state"]["world_size"] == after and r["state"]["step"] == STEPS
        for got, want in zip(r["params"], reference[1], strict=True):
            _close(got, want)


@pytest.mark.parametrize("stage", [1, 3])
def test_own_state_dict_resumes_bit_exactly(cluster, saved, stage):
    states = saved(2, stage)
    own = cluster.run(_resume, 2, stage, states, (2, STEPS), True)[:2]
    joined = cluster.run(_resume, 2, stage, states, (2, STEPS))[:2]  # re-cut for the same world: the same slices
    for rank, (mine, theirs) in enumerate(zip(own, joined, strict=True)):
        for unit, saved_unit in zip(mine["loaded"]["units"], states[rank]["units"], strict=True):
            assert all(torch.equal(unit[k], saved_unit[k]) for k in ("shard", "exp_avg", "exp_avg_sq"))
        assert all(torch.equal(a, b) for a, b in zip(mine["params"], theirs["params"], strict=True))


def _refused_states(two, four):
    grid = Grid(dp=2, ranks=range(2))
    if not grid.member:
        return None
    errors = []
    for stage, state in ((1, two[::-1]), (1, four[grid.dp_rank]), (3, two), (1, [{"step": 2}, {"step": 2}])):
        try:  # each refused before any collective
            ZeRO(_model(), stage, group=grid.dp_group).load_state_dict(state)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_state_dicts_that_do_not_fit_are_refused(cluster, saved):
    errors = cluster.run(_refused_states, saved(2, 1), saved(4, 1))[0]
    assert len(errors) == 4
    assert errors[0] == ("state must list every saved rank's state_dict in rank order: saved on 2 ranks, given "
                         "ranks [1, 0]")
    assert errors[1].startswith("state was saved by rank 0 of 4, this is rank 0 of 2")
    assert errors[2] == "state[0] was saved at ZeRO stage 1, this ZeRO is stage 3"
    assert errors[3] == "state[0] is not a ZeRO state_dict() (it has ['step'])"


def test_measure_zero_against_the_papers_formulas(cluster):
    r = measure_zero(3, 4, cluster=cluster)  # the tiny preset in fp32: Ψ = 108288, divisible by 4
    assert r["padding"] == 0 and r["num_params"] == 108288
    assert r["bytes"].total == r["formula_bytes"] == 16 * 108288 / 4
    assert r["comm_bytes"] == r["comm_formula"] == 3 * 108288 * 4 * 3 / 4


def test_stage_3_holds_the_shards_and_one_unit_at_a_time(cluster):
    """At the start of a unit's forward a rank holds every unit's shard (Ψ/N), the model's own unit (embeddings
    and final LayerNorm, gathered for the whole forward) and the unit about to run: 4 bytes × (Ψ/N + own +
    block). With more blocks that tends to Ψ/N: the per-layer gather pays off."""
    fractions = []
    for n_layer in (2, 6):
        r = measure_zero(3, 4, n_layer=n_layer, cluster=cluster)  # Ψ divisible by 4: no padding
        *blocks, own = r["unit_param_bytes"]
        assert len(blocks) == n_layer and sum(r["unit_param_bytes"]) == r["full_param_bytes"] == 4 * r["num_params"]
        assert r["peak_param_bytes"] == r["full_param_bytes"] / 4 + own + blocks[0]
        fractions.append(r["peak_param_bytes"] / r["full_param_bytes"])
    assert fractions[1] < fractions[0]
    with pytest.raises(ValueError, match="n_layer=0 must be an int >= 1"):
        measure_zero(3, 4, n_layer=0, cluster=cluster)


@pytest.mark.parametrize("stage", [4, -1, 1.5, True, "1", None])
def test_a_stage_other_than_0_to_3_is_refused(stage):
    with pytest.raises(ValueError, match=r"stage=.* must be an int in \[0, 3\] \(the ZeRO stage; 0 is plain data"):
        ZeRO(torch.nn.Linear(2, 2), stage)


def _bad_arguments():
    model = _model()
    errors = []
    for kwargs in ({"units": [model.transformer.h[0], model.transformer.h[0].mlp]}, {"units": [torch.nn.ReLU()]},
                   {"lr": -1.0}, {"betas": (0.9, 1.0)}, {"eps": 0}):
        try:
            ZeRO(model, 3, **kwargs)  # refused before any collective
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_bad_arguments_are_named(cluster):
    errors = cluster.run(_bad_arguments)[0]
    assert len(errors) == 5
    assert "units[1] shares parameters with units[0]" in errors[0]
    assert "units[0] must be a submodule of model" in errors[1]
    assert [e.split("=")[0] for e in errors[2:]] == ["lr", "betas", "eps"]


def test_bench_is_registered():
    from llmlab import bench
    from llmlab.memory import zero

    assert bench.get("zero") is zero.bench
