"""The collapse experiment (llmlab.moe_balance): without balancing the router piles its tokens onto a few experts,
on every seed; the balance loss and the aux-loss-free bias keep the loads near even; the runs differ only in the
balancing (the same first routing); the load measures on hand-made loads; bad arguments refused by name."""

import pytest
import torch

from llmlab.moe_balance import BalanceRun, BalanceSetup, balance_run

# The collapse is not a lucky seed: seeds 0–299 all pass these assertions (the extremes over them are in
# llmlab.moe_balance's docstring); the test runs the first five, deterministic on one thread.
SEEDS = range(5)


def test_without_balancing_the_router_collapses_and_both_cures_keep_it_even(one_thread):
    for seed in SEEDS:
        runs = {b: balance_run(b, steps=100, seed=seed) for b in ("none", "aux-loss", "bias")}
        # the two busiest experts' share of the 2·128 assignments over the last 10 steps: 2/8 = 0.25 if uniform
        top = {b: r.top_share()[-10:].mean().item() for b, r in runs.items()}
        assert top["none"] > 0.6, (seed, top)  # collapsed: most tokens choose among the same two experts
        assert top["aux-loss"] < 0.4 and top["bias"] < 0.4, (seed, top)
        for b in ("aux-loss", "bias"):
            assert runs[b].max_violation()[-10:].mean() < 0.8, (seed, b)  # the busiest within 80% of the mean
        for b, r in runs.items():  # every run learns the teacher (the loss falls ~30×), balanced or not
            assert sum(r.losses[-10:]) / 10 < r.losses[0] / 10, (seed, b, r.losses[0], r.losses[-10:])


def test_the_runs_differ_only_in_the_balancing():
    runs = [balance_run(b, steps=3, seed=7) for b in ("none", "aux-loss", "bias")]
    # the same layer, teacher and tokens: the first routing (before any update) is the same in all three
    assert all(torch.equal(r.loads[0], runs[0].loads[0]) for r in runs)
    assert runs[0].losses[0] == runs[1].losses[0] == runs[2].losses[0]
    again = balance_run("bias", steps=3, seed=7)
    assert torch.equal(again.loads, runs[2].loads) and again.losses == runs[2].losses  # a seed is a run
    assert runs[0].loads.shape == (3, 8) and runs[0].loads.sum(-1).tolist() == [256] * 3  # k·T assignments


def test_load_measures_on_hand_made_loads():
    run = BalanceRun("none", BalanceSetup(experts=4), torch.tensor([[4, 4, 4, 4], [8, 0, 0, 8], [6, 1, 1, 0]]), [])
    assert run.share().tolist() == [[0.25] * 4, [0.5, 0, 0, 0.5], [0.75, 0.125, 0.125, 0]]
    assert run.top_share(1).tolist() == [0.25, 0.5, 0.75] and run.top_share().tolist() == [0.5, 1.0, 0.875]
    assert run.max_violation().tolist() == [0.0, 1.0, 2.0]  # 8 / 4 − 1 and 6 / 2 − 1


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="balance='loss' must be one of 'aux-loss', 'bias', 'none'"):
        balance_run("loss")
    with pytest.raises(ValueError, match="steps=0 must be a positive int"):
        balance_run("none", steps=0)
    with pytest.raises(ValueError, match="seed=-1 must be an int >= 0"):
        balance_run("none", seed=-1)
    with pytest.raises(ValueError, match="setup={'k': 2} must be a BalanceSetup"):
        balance_run("none", setup={"k": 2})
    with pytest.raises(ValueError, match=r"k=9 must be an int in \[1, 8\]"):
        BalanceSetup(k=9)
    with pytest.raises(ValueError, match="lr=0 must be a positive number"):
        BalanceSetup(lr=0)
    with pytest.raises(ValueError, match="scores='relu' must be one of 'softmax', 'sigmoid'"):
        BalanceSetup(scores="relu")
    with pytest.raises(ValueError, match=r"n=0 must be an int in \[1, 4\]"):
        BalanceRun("none", BalanceSetup(experts=4), torch.ones(1, 4, dtype=torch.long), []).top_share(0)
