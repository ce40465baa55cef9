"""Loss scaling against torch.amp.GradScaler, fp16 underflow with and without it, mixed-precision training."""

import pytest
import torch

from llmlab import precision
from llmlab.data import MarkovSource, SyntheticDataset
from llmlab.model import GPT, GPTConfig
from llmlab.timing import Load, Rounds, Timing


@pytest.mark.parametrize("pattern", ["cccccccc", "cciccciccc", "iiiccccccccc", "cicicicccccc"])
def test_scale_trajectory_equals_torch_grad_scaler(pattern):
    """On a scripted sequence of clean (c) and overflowing (i) steps both scalers take the same scale."""
    kwargs = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ours = precision.DynamicLossScaler(**kwargs)
    theirs = torch.amp.GradScaler("cpu", **kwargs)
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.0)
    for step in pattern:
        theirs.scale(w.sum()).backward()  # GradScaler needs a scale() call before step()
        w.grad.fill_(float("inf") if step == "i" else 1.0)
        theirs.step(opt)
        theirs.update()
        grad = torch.full((4,), float("inf") if step == "i" else 1.0)
        ours.update(ours.unscale_([grad]))
        assert ours.scale == theirs.get_scale(), f"after {step!r} in {pattern}"


def test_small_gradients_underflow_in_fp16_without_scaling():
    """A gradient of 1e-8 is below fp16's smallest subnormal (6e-8): it flushes to 0 unless scaled."""
    c = torch.tensor(1e-4, dtype=torch.float16)  # two small factors, each fine in fp16 on its own
    true_grad = c.double() ** 2  # ≈ 1e-8

    def grad_of(scaler):
        w = torch.nn.Parameter(torch.ones(8, dtype=torch.float16))
        loss = (w * c * c).sum()  # every op in fp16; dloss/dw = c·c
        (scaler.scale_loss(loss) if scaler else loss).backward()
        g = w.grad.double()
        return g / scaler.scale if scaler else g

    assert torch.all(grad_of(None) == 0), "1e-8 should flush to zero in fp16"
    scaled = grad_of(precision.DynamicLossScaler(init_scale=2.0**14))
    # scaled by 2^14 every intermediate gradient is an fp16 normal (11 significant bits); two roundings on
    # the way back: relative error <= 2 * 2^-11
    assert torch.allclose(scaled, true_grad.expand(8), rtol=2 * 2.0**-11, atol=0)


def _train(mp_dtype, steps=40, seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig.preset("tiny"))
    data = SyntheticDataset(MarkovSource(64), batch_size=8, block_size=32, seed=seed)
    mp = precision.MixedPrecision(model, lambda ps: torch.optim.AdamW(ps, lr=3e-3), dtype=mp_dtype)
    losses = []
    for step in range(steps):
        x, y = data.get_batch(step)
        _, loss = model(x, y)
        mp.backward(loss)
        mp.step()
        losses.append(loss.item())
    return model, mp, losses


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_mixed_precision_trains_with_fp32_masters(dtype):
    model, mp, losses = _train(dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    assert all(m.dtype == torch.float32 for m in mp.masters)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5  # it learns (ln 64 = 4.16 at the start)
    for p, m in zip(mp.params, mp.masters, strict=True):
        assert torch.equal(p, m.to(dtype))  # the model holds the masters rounded to half precision
    if dtype == torch.float16:
        assert mp.scaler is not None and mp.skipped <= 2  # an overflow early on is normal: scale starts at 2^16
    else:
        assert mp.scaler is None


def test_overflow_skips_the_step():
    model = torch.nn.Linear(4, 1)
    mp = precision.MixedPrecision(model, lambda ps: torch.optim.SGD(ps, lr=0.1))
    before = [m.clone() for m in mp.masters]
    mp.backward(model(torch.full((1, 4), 60000.0, dtype=torch.float16)).sum() * 1e4)  # inf in fp16
    assert mp.step() is False and mp.skipped == 1 and mp.scaler.scale == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, mp.masters, strict=True))


def test_autocast_runs_matmuls_in_bf16():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with precision.autocast("bf16"):
        assert (a @ b).dtype == torch.bfloat16
    with precision.autocast("fp32"):
        assert (a @ b).dtype == torch.float32


def test_representation():
    r = precision.representation(1e-8)
    assert r["fp16"]["underflow"] and not r["bf16"]["underflow"] and not r["fp32"]["underflow"]
    assert precision.representation(70000.0)["fp16"]["overflow"]
    assert precision.representation(1.0 + 2**-9)["bf16"]["stored"] == 1.0  # bf16 keeps 8 significant bits


@pytest.mark.parametrize("call,match", [
    (lambda: precision.DynamicLossScaler(init_scale=0), "init_scale=0"),
    (lambda: precision.DynamicLossScaler(backoff_factor=2), "backoff_factor=2"),
    (lambda: precision.DynamicLossScaler(growth_interval=0), "growth_interval=0"),
    (lambda: precision.autocast("fp8"), "precision='fp8'"),
    (lambda: precision.MixedPrecision(torch.nn.Linear(2, 2), torch.optim.SGD, dtype=torch.float64), "dtype="),
    (lambda: precision.representation(float("inf")), "value=inf"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def step_times_of(bf16, fp16):
    """A StepTimes whose bf16 and fp16 steps take `bf16` and `fp16` × the fp32 step's 20 ms, round by round (also
    used by tests/test_claims_ch02.py)."""
    load = Load(1.0, 2)
    samples = {"fp32": [0.02] * len(bf16), "bf16": [0.02 * r for r in bf16], "fp16": [0.02 * r for r in fp16]}
    return precision.StepTimes("tiny GPT, B=16", Rounds({k: Timing(tuple(v), 1, load) for k, v in samples.items()},
                                                        load))


def test_bench_rows_share_one_fp32_figure(monkeypatch):
    t = step_times_of((4.0, 4.2, 4.4), (0.9, 1.1, 1.2))
    monkeypatch.setattr(precision.step_times, "recent", lambda preset=None, batch_size=None: t)
    rows = precision.bench()
    assert [r["impl"] for r in rows] == ["bf16 autocast step", "fp16 + loss scaler step"]
    assert all(r["peer_ms"] == pytest.approx(20.0) for r in rows)  # the same fp32 rounds for both
    assert rows[0]["ratio"] == pytest.approx(4.2) and rows[0]["speed-up"] == pytest.approx(1 / 4.2)
    assert rows[1]["ratio"] == pytest.approx(1.1) and rows[1]["size"] == "tiny GPT, B=16"
    assert t.versus_fp32("bf16").direction() == "slower" and t.versus_fp32("fp16").direction() == "not conclusive"


@pytest.mark.parametrize("call,match", [
    (lambda: step_times_of((1.0,), (1.0,)).versus_fp32("fp32"), "precision='fp32'"),
    (lambda: precision.step_times(batch_size=0), "batch_size=0"),
])
def test_step_times_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
