"""llmlab.train.sweep: the warmup × peak-LR sweep — its judgements on constructed runs (no training), a small real
sweep, and bad arguments refused."""

import math

import pytest

from llmlab.train.sweep import RISE, Run, WarmupSweep, warmup_sweep


def made(finals: dict, rises: dict | None = None) -> WarmupSweep:
    """A sweep from {(warmup, lr): [final per seed]} (and the rises, default 0), without training."""
    warmups, lrs = sorted({w for w, _ in finals}), sorted({lr for _, lr in finals})
    seeds = range(len(next(iter(finals.values()))))
    runs = {(w, lr, s): Run(finals[w, lr][s], (rises or {}).get((w, lr), 0.0)) for w, lr in finals for s in seeds}
    return WarmupSweep(tuple(warmups), tuple(lrs), tuple(seeds), 100, 10, runs)


def test_direction_needs_every_seed_to_agree():
    assert WarmupSweep.direction([-0.2, -0.01, -0.3]) == "lower"
    assert WarmupSweep.direction([0.1, 0.2]) == "higher"
    assert WarmupSweep.direction([-0.2, 0.01, -0.3]) == "not conclusive"
    assert WarmupSweep.direction([math.nan, -1.0]) == "not conclusive"


def test_warmup_that_helps_at_high_lr_only():
    sweep = made({(0, 1e-3): [2.0, 2.1], (10, 1e-3): [2.01, 2.08],  # the seeds disagree at the low LR
                  (0, 1e-2): [3.0, 3.2], (10, 1e-2): [1.5, 1.6]},
                 rises={(0, 1e-2): RISE + 0.5})  # no warmup at 1e-2: thrown above its start
    assert sweep.effect(10, 1e-3) == pytest.approx([0.01, -0.02])
    assert sweep.highest_stable_lr(0) == 1e-3 and sweep.highest_stable_lr(10) == 1e-2
    assert sweep.compare_best()[:2] == ((0, 1e-3), (10, 1e-2))
    assert sweep.compare_best()[2] == pytest.approx([-0.5, -0.5]) and sweep.compare_best()[3] == "lower"
    assert sweep.helps() is True
    rows = sweep.rows()
    assert rows[0] == {"peak LR": "1e-03", "warmup 0": "2.050 ±0.050", "warmup 10": "2.045 ±0.035",
                       "warmup 10 vs none": "not conclusive"}
    assert rows[1]["warmup 0"] == "3.100 ±0.100 †" and rows[1]["warmup 10 vs none"] == "lower"
    text = sweep.findings()
    assert "by warmup — none: 1e-03, 10: 1e-02" in text and "lower with warmup on every seed" in text
    assert "at 1e-03 warmup 10 not conclusive" in text


def test_a_sweep_that_does_not_decide_says_so():
    sweep = made({(0, 1e-3): [2.0, 2.1], (10, 1e-3): [1.9, 2.2]})
    assert sweep.compare_best()[3] == "not conclusive" and sweep.helps() is None
    assert "not conclusive: the seeds disagree" in sweep.findings()
    worse = made({(0, 1e-3): [2.0, 2.1], (10, 1e-3): [2.2, 2.3]})
    assert worse.helps() is False


def test_a_sweep_where_runs_diverged_says_so():
    inf = math.inf
    every = made({(0, 1e3): [inf, inf], (10, 1e3): [inf, inf], (0, 1e8): [inf, inf], (10, 1e8): [inf, inf]},
                 rises={cell: inf for cell in [(0, 1e3), (10, 1e3), (0, 1e8), (10, 1e8)]})
    text = every.findings()
    assert text.startswith("All 8 runs of 100 updates") and "diverged" in text and "nan" not in text
    assert every.rows()[0]["warmup 0"] == "diverged (2/2 seeds)"
    some = made({(0, 1e-2): [inf, inf], (10, 1e-2): [1.5, 1.6]})
    assert "Lowest loss without warmup: diverged (2/2 seeds)" in some.findings()


def test_a_small_real_sweep(one_thread):
    sweep = warmup_sweep(warmups=[0, 4], lrs=[3e-2, 1e-3], seeds=[0, 1], steps=12, tail=3)  # lists: as tuples
    assert sweep.lrs == (1e-3, 3e-2) and len(sweep.runs) == 8
    assert all(math.isfinite(r.final) and r.final > 0 for r in sweep.runs.values())
    assert warmup_sweep.recent(warmups=(0, 4), lrs=(3e-2, 1e-3), seeds=(0, 1), steps=12, tail=3) is sweep
    assert warmup_sweep.recent((0, 4), [1e-3, 3e-2], (0, 1), 12, 3) is sweep


@pytest.mark.parametrize("kwargs, match", [
    (dict(warmups=(5, 10)), "must start with 0"), (dict(warmups=(0,)), "must start with 0"),
    (dict(warmups=(0, 200)), "warmups="), (dict(lrs=(-1.0,)), "lrs="), (dict(seeds=()), "seeds="),
    (dict(steps=1), "steps="), (dict(tail=0), "tail="), (dict(lrs=(math.inf,)), "finite"),
    (dict(lrs=(math.nan,)), "lrs=nan"), (dict(lrs=(1e-3, "x")), "lrs='x'"), (dict(lrs=1e-3), "must be a sequence"),
    (dict(lrs=(1e-3, 1e-3)), "twice"), (dict(seeds=(0, 0)), "twice"), (dict(seeds=(1.5,)), "seeds=1.5"),
    (dict(batch_size=0), "batch_size="), (dict(warmups=[0, 10, 10]), "twice")])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        warmup_sweep(**kwargs)


def test_progress_is_not_part_of_what_recent_matches(one_thread, capsys):
    sweep = warmup_sweep(warmups=(0, 2), lrs=(1e-3,), seeds=(0,), steps=4, tail=2, progress=False)
    assert "warmup × peak LR" not in capsys.readouterr().err  # no bar drawn
    assert warmup_sweep.recent(warmups=(0, 2), lrs=(1e-3,), seeds=(0,), steps=4, tail=2) is sweep
    with pytest.raises(ValueError, match="progress="):
        warmup_sweep(progress="no")


def test_a_sweep_where_no_run_trained_says_so():
    thrown = made({(0, 1e3): [2e10], (10, 1e3): [3e10]}, rises={(0, 1e3): 1e10, (10, 1e3): 2e10})
    text = thrown.findings()
    assert text.startswith("All 2 runs of 100 updates") and "no run trained" in text and "higher" not in text
