"""llmlab.diagnose.oom: the planner's OOM verdict and remedy savings, and the enforced CPU budget that checks them."""

import pickle

import pytest
import torch

from llmlab.diagnose import oom
from llmlab.hardware import SPECS
from llmlab.memory import planner
from llmlab.model import GPT, GPTConfig

FP32 = {"precision": "fp32", "optimizer": "adamw", "dtype_bytes": 4}
# The measured state includes AdamW's step counters (4 bytes per parameter tensor), which the planner omits.
STEP_COUNTERS = 4 * 28


def test_diagnose_predicts_oom_and_ranks_remedies():
    config = GPTConfig.preset("gpt2")
    report = oom.diagnose(config, 16, 12e9)  # 15 GB planned (mixed-precision Adam, no ZeRO): 3 GB over
    assert not report.fits and report.over_bytes > 0
    ranks = [(oom.COSTS.index(r.cost), r.extra_flops, -r.saving) for r in report.remedies]
    assert ranks == sorted(ranks)  # cheapest first (the cost, then the FLOPs recompute adds), then the largest saving
    assert [r.name for r in report.remedies] == [
        "memory-efficient attention", "ZeRO-2", "ZeRO-1", "ZeRO-3", "CPU offload", "gradient accumulation",
        "selective recompute", "gradient checkpointing", "smaller batch", "smaller model"]
    named = {r.name: r for r in report.remedies}
    assert 0 < named["selective recompute"].extra_flops < named["gradient checkpointing"].extra_flops < 0.34
    for r in report.remedies:
        assert r.saving == pytest.approx(report.plan.total - r.plan.total) and r.price
    assert "OOM" in report.summary() and "costs nothing" in report.summary()


def test_the_chapters_1_3b_example():
    """Chapter 7's example: GPT-3 XL's shape, micro-batch 12, 8 ranks, no ZeRO, on 80 GiB A100s (NVIDIA's "80 GB" is
    81920 MiB) with 10% kept back: 96.5 GiB planned, 24.5 over; memory-efficient attention alone takes it to 60.4 GiB,
    while ZeRO-1/2/3 and CPU offload alone stay over; selective recompute's plan is one block's rebuilt attention core
    above it, less the rows' statistics the fused kernel keeps."""
    xl = GPTConfig(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=2048)
    report = oom.diagnose(xl, 12, 0.9 * SPECS["A100 SXM"].memory_bytes, data=8)
    gib = 2**30
    assert round(report.plan.total / gib, 1) == 96.5 and round(report.over_bytes / gib, 1) == 24.5
    named = {r.name: r for r in report.remedies}
    first = report.remedies[0]
    assert first.name == "memory-efficient attention" and round(first.plan.total / gib, 1) == 60.4 and first.fits
    assert not any(named[n].fits for n in ("ZeRO-1", "ZeRO-2", "ZeRO-3", "CPU offload"))
    selective = named["selective recompute"].plan
    assert selective.total - first.plan.total == pytest.approx(
        selective.recompute - (first.plan.activations - selective.activations))
    assert 0 < first.plan.activations - selective.activations < 0.05 * selective.recompute


def test_offload_and_zero_stages():
    base = planner.plan(GPTConfig.preset("gpt2"), 4)
    off = oom.offloaded(base)
    assert off.params == base.params and off.grads == off.optimizer_state == 0
    assert base.total - off.total == base.grads + base.optimizer_state
    named = {r.name: r for r in oom.remedies(GPTConfig.preset("gpt2"), 4, 1e9, stage=2, data=4)}
    assert "ZeRO-1" not in named and "ZeRO-2" not in named and named["ZeRO-3"].change == "stage 2 → 3 over 4 data ranks"
    flash = {r.name for r in oom.remedies(GPTConfig.preset("tiny", flash=True), 4, 1e9)}
    assert not flash & {"memory-efficient attention", "selective recompute"}
    selective = {r.name: r for r in oom.remedies(GPTConfig.preset("tiny"), 4, 1e9, checkpointing="selective")}
    assert "selective recompute" not in selective and selective["gradient checkpointing"].step["checkpointing"] is True
    assert selective["smaller batch"].step["config"].recompute == "selective"  # measured as planned


def test_diagnose_quiet_when_it_fits():
    report = oom.diagnose(GPTConfig.preset("tiny"), 4, 80e9)
    assert report.fits and report.over_bytes < 0 and all(r.fits for r in report.remedies)


@pytest.mark.parametrize("checkpointing", [False, "none", "selective", True, "full"])
def test_measured_step_equals_plan(one_thread, checkpointing):
    """Each of the planner's checkpointing modes, measured as the planner counts it: "selective" runs the model's
    own recompute of the attention core (GPTConfig(recompute="selective")), "full" checkpoints every block."""
    config = GPTConfig.preset("tiny")
    m = oom.measure_config(config, 4, checkpointing=checkpointing)
    assert m.ok
    plan = planner.plan(config, 4, checkpointing=checkpointing, **FP32)
    assert m.total - oom.forward_bytes(plan) == STEP_COUNTERS  # exact, but for the counters
    snap, _ = oom.snapshot_step(config, 4, checkpointing=checkpointing)
    assert snap.total == m.total


def test_the_modes_differ_and_bad_modes_are_refused(one_thread):
    config = GPTConfig.preset("tiny")
    held = {mode: oom.measure_config(config, 4, checkpointing=mode).activation_bytes
            for mode in ("none", "selective", "full")}
    assert held["full"] < held["selective"] < held["none"]
    for bad in (1, "bogus", None):
        with pytest.raises(ValueError, match="checkpointing"):
            oom.measure_config(config, 4, checkpointing=bad)
    model = GPT(config)  # built without recompute="selective": measure_step cannot switch it on
    x = torch.zeros(2, config.block_size, dtype=torch.long)  # (B, T)
    with pytest.raises(ValueError, match="checkpointing.*recompute"):
        oom.measure_step(model, torch.optim.AdamW(model.parameters()), x, x, checkpointing="selective")


def test_flash_step_equals_plan(one_thread):
    config = GPTConfig.preset("tiny", flash=True)  # torch's scaled_dot_product_attention: no T² tensor saved
    plan = planner.plan(config, 4, **FP32)
    assert oom.measure_config(config, 4).total - oom.forward_bytes(plan) == STEP_COUNTERS
    assert not oom.measure_config(config, 4, 0.99 * oom.forward_bytes(plan)).ok


def test_zero_steps_on_ranks_equal_plan_under_the_budget():
    """ZeRO on 2 gloo ranks, each step under the enforced budget: the bytes are the plan's exactly (ZeRO keeps no
    step counters), and a budget between ZeRO-3's need and ZeRO-2's lets only ZeRO-3 fit."""
    config, B = GPTConfig.preset("tiny"), 4
    need = {s: oom.forward_bytes(planner.plan(config, B, stage=s, data=2, **FP32)) for s in (2, 3)}
    budget = (need[2] + need[3]) / 2
    measured = oom.measure_zero_config(config, B, budget, stages=(2, 3))
    for s, (held, under) in measured.items():
        assert held.ok and held.total == need[s]
        assert under.ok == (s == 3)
    assert isinstance(measured[2][1].error, oom.MemoryBudgetExceeded)


def test_measure_remedies_agrees_with_every_prediction(one_thread):
    """Every remedy that runs on a CPU, run under a budget 20% short: each fits exactly when the planner says so,
    and holds what it planned, but for AdamW's step counters (4 bytes per parameter tensor; ZeRO keeps none)."""
    config, B = GPTConfig.preset("tiny"), 16
    base = planner.plan(config, B, **FP32)
    budget = 0.8 * oom.forward_bytes(base)
    ranked = oom.remedies(config, B, budget, zero_ranks=2, **FP32)
    measured = oom.measure_remedies(ranked, budget)
    assert set(measured) == {r.name for r in ranked} - {"CPU offload"}
    for r in ranked:
        if r.name in measured:
            held, under = measured[r.name]
            counters = 0 if r.step["stage"] else 4 * len(list(GPT(r.step["config"]).parameters()))
            assert held.total - oom.forward_bytes(r.plan) == counters, r.name
            assert under.ok == r.fits, r.name
    with pytest.raises(ValueError, match="data ranks without ZeRO"):
        oom.measure_remedies(oom.remedies(config, B, budget, data=2, **FP32), budget)


def test_budget_error_survives_pickling():  # a rank's error travels to the caller
    e = pickle.loads(pickle.dumps(oom.MemoryBudgetExceeded(1 << 20, 3 << 20, 4 << 20)))
    assert (e.requested, e.in_use, e.budget) == (1 << 20, 3 << 20, 4 << 20) and "Out of memory" in str(e)


def test_snapshot_step_on_a_cpu(one_thread, tmp_path):
    """The step's allocation timeline (runtime.memory_history's CPU stand-in): it rises past the planner's
    activations + logits (+ one recomputed block) only by backward's transients, and ends where it began."""
    config, B = GPTConfig.preset("tiny"), 8
    for checkpointing in (False, True):
        step, history = oom.snapshot_step(config, B, checkpointing=checkpointing, path=tmp_path / "s.pickle")
        plan = planner.plan(config, B, checkpointing=checkpointing, **FP32)
        planned = plan.activations + plan.logits + plan.recompute
        assert step.ok and planned <= history.peak < 1.2 * planned and history.timeline()[-1] == 0
        assert pickle.loads(history.path.read_bytes())["device_traces"][0] == history.trace
    full = planner.plan(config, B, **FP32)
    short, cut = oom.snapshot_step(config, B, 0.8 * oom.forward_bytes(full))
    assert not short.ok and 0 < cut.peak < full.activations + full.logits  # the forward stopped part way


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
    tiny = GPTConfig.preset("tiny")
    for kwargs, name in ((dict(batch_size=0), "batch_size"), (dict(batch_size=True), "batch_size"),
                         (dict(seed=-1), "seed"), (dict(seed=1.5), "seed"), (dict(device="meta"), "device")):
        with pytest.raises(ValueError, match=name):
            oom.measure_config(**{"config": tiny, "batch_size": 2, **kwargs})
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda'"):
            oom.measure_config(tiny, 2, device="cuda")
    for stages in ((), 3, "12"):
        with pytest.raises(ValueError, match="stages"):
            oom.measure_zero_config(tiny, 2, stages=stages)


def test_remedies_that_save_nothing_are_left_out():
    """Checkpointing one block keeps its input and rebuilds it: it saves nothing, so it is no remedy."""
    one = GPTConfig.preset("tiny", n_layer=1)
    ranked = oom.remedies(one, 4, 1e6, **FP32)
    assert ranked and all(r.saving > 0 for r in ranked) and "gradient checkpointing" not in {r.name for r in ranked}


def test_budget_messages_in_readable_units():
    with pytest.raises(oom.MemoryBudgetExceeded, match="Tried to allocate 1.95 KiB; 0 bytes already in use of a "
                                                       "budget of 1000 bytes"):
        with oom.enforced_budget(1e3, 2000):
            pass
    assert oom.binary_size(80 * 2**30) == "80.00 GiB" and oom.binary_size(10.17 * 2**20) == "10.17 MiB"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the real torch.cuda.OutOfMemoryError needs a GPU")
def test_real_cuda_oom():
    config = GPTConfig.preset("small")
    need = oom.forward_bytes(planner.plan(config, 32, **FP32))
    short = oom.measure_config(config, 32, 0.5 * need, device="cuda")
    assert isinstance(short.error, torch.cuda.OutOfMemoryError)
    assert oom.measure_config(config, 32, 0.5 * need, device="cuda", checkpointing=True).ok


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's memory snapshot needs a GPU")
def test_cuda_snapshot_of_a_step(tmp_path):
    config = GPTConfig.preset("small")
    step, history = oom.snapshot_step(config, 8, device="cuda", path=tmp_path / "step.pickle")
    plan = planner.plan(config, 8, **FP32)
    assert step.ok and "CUDA" in history.source and history.path.stat().st_size > 0
    assert history.peak >= plan.activations + plan.logits  # the allocator's blocks: the planner's terms and more
