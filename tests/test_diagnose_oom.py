"""llmlab.diagnose.oom: the planner's OOM verdict and remedy savings, and the enforced CPU budget that checks them."""

import pytest
import torch

from llmlab.diagnose import oom
from llmlab.memory import planner
from llmlab.model import GPTConfig

FP32 = {"precision": "fp32", "optimizer": "adamw", "dtype_bytes": 4}
# The measured state includes AdamW's step counters (4 bytes per parameter tensor), which the planner omits.
STEP_COUNTERS = 4 * 28


def test_diagnose_predicts_oom_and_ranks_remedies():
    config = GPTConfig.preset("gpt2")
    report = oom.diagnose(config, 16, 12e9)  # 15 GB planned (mixed-precision Adam, no ZeRO): 3 GB over
    assert not report.fits and report.over_bytes > 0
    savings = [r.saving for r in report.remedies]
    assert savings == sorted(savings, reverse=True)
    assert {r.name for r in report.remedies} == {"smaller batch", "gradient accumulation", "gradient checkpointing",
                                                  "ZeRO", "smaller model"}
    best = report.remedies[0]
    assert best.saving == pytest.approx(report.plan.total - best.plan.total)
    assert "OOM" in report.summary()


def test_diagnose_quiet_when_it_fits():
    report = oom.diagnose(GPTConfig.preset("tiny"), 4, 80e9)
    assert report.fits and report.over_bytes < 0 and all(r.fits for r in report.remedies)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_measured_step_equals_plan(one_thread, checkpointing):
    config = GPTConfig.preset("tiny")
    m = oom.measure_config(config, 4, checkpointing=checkpointing)
    assert m.ok
    plan = planner.plan(config, 4, checkpointing=checkpointing, **FP32)
    assert m.total - oom.forward_bytes(plan) == STEP_COUNTERS  # exact, but for the counters


def test_enforced_budget_raises_like_cuda_oom(one_thread):
    config = GPTConfig.preset("tiny")
    need = oom.forward_bytes(planner.plan(config, 8, **FP32))
    short = oom.measure_config(config, 8, 0.9 * need)
    assert not short.ok and isinstance(short.error, oom.MemoryBudgetExceeded)
    assert "Out of memory" in str(short.error) and "Tried to allocate" in str(short.error)
    assert oom.measure_config(config, 8, 1.01 * need).ok  # 1% headroom: 2 × the step counters' 112 bytes and more
    fixed = oom.measure_config(config, 8, 0.9 * need, checkpointing=True)
    assert fixed.ok


def test_bad_arguments():
    with pytest.raises(ValueError, match="budget_bytes"):
        oom.diagnose(GPTConfig.preset("tiny"), 4, 0)
    with pytest.raises(ValueError, match="zero_ranks"):
        oom.remedies(GPTConfig.preset("tiny"), 4, 1e9, zero_ranks=1)
    with pytest.raises(ValueError, match="budget_bytes"):
        with oom.enforced_budget(-1):
            pass
    with pytest.raises(ValueError, match="model"):
        oom.measure_step(torch.nn.Linear(2, 2), None, None, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the real torch.cuda.OutOfMemoryError needs a GPU")
def test_real_cuda_oom():
    config = GPTConfig.preset("small")
    need = oom.forward_bytes(planner.plan(config, 32, **FP32))
    short = oom.measure_config(config, 32, 0.5 * need, device="cuda")
    assert isinstance(short.error, torch.cuda.OutOfMemoryError)
    assert oom.measure_config(config, 32, 0.5 * need, device="cuda", checkpointing=True).ok
