"""LR schedules: warmup endpoints, cosine to min_lr, the material's step-0 LR, LambdaLR compatibility."""

import math

import pytest
import torch

from llmlab.train.schedule import LRSchedule, material_warmup_lr, warmup_cosine_lr


def test_warmup_then_cosine_endpoints():
    s = LRSchedule(base_lr=1e-3, total_steps=100, warmup=10, min_lr=1e-4)
    assert s.lr(0) == pytest.approx(1e-4)  # (0+1)/10 of the peak: update 0 learns
    assert s.lr(9) == pytest.approx(1e-3) and s.lr(10) == pytest.approx(1e-3)
    assert s.lr(99) == pytest.approx(1e-4) and s.lr(500) == pytest.approx(1e-4)
    mid = 10 + (99 - 10) / 2  # halfway through the decay the cosine is at the mean of peak and floor
    assert warmup_cosine_lr(int(mid), 1e-3, 10, 100, 1e-4) == pytest.approx(
        1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * int(mid - 10) / 89)))
    lrs = s.lrs()
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10], strict=False))  # rising warmup
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))  # falling decay


def test_material_formula_starts_at_lr_zero_and_constant_decay():
    assert material_warmup_lr(0, 1e-3, 10) == 0.0
    assert material_warmup_lr(5, 1e-3, 10) == pytest.approx(5e-4)
    assert LRSchedule(1e-3, 50, 10, warmup_formula="material").lr(0) == 0.0
    const = LRSchedule(1e-3, 50, 4, decay="constant")
    assert [const.lr(s) for s in (0, 3, 49)] == pytest.approx([2.5e-4, 1e-3, 1e-3])
    assert LRSchedule(1e-3, 5).lr(0) == pytest.approx(1e-3)  # no warmup: the peak at once


def test_lambda_lr_compatible():
    s = LRSchedule(0.1, 20, 5, min_lr=0.01)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, s)
    for step in range(20):
        assert opt.param_groups[0]["lr"] == pytest.approx(s.lr(step))
        opt.step()
        sched.step()


@pytest.mark.parametrize("kwargs, name", [(dict(warmup=200), "warmup"), (dict(base_lr=0), "base_lr"),
                                          (dict(min_lr=1.0), "min_lr"), (dict(decay="linear"), "decay"),
                                          (dict(total_steps=0), "total_steps"),
                                          (dict(warmup_formula="x"), "warmup_formula")])
def test_bad_arguments_named(kwargs, name):
    args = dict(base_lr=1e-3, total_steps=100, warmup=10) | kwargs
    with pytest.raises(ValueError, match=name):
        LRSchedule(**args)
