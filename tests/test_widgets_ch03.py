"""Chapter 3's widget: the memory planner explorer against llmlab.memory.planner and the spec sheet, built
headlessly, driven, and carrying a static result."""

import base64

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from llmlab import flops, widgets  # noqa: E402
from llmlab.hardware import SPECS  # noqa: E402
from llmlab.memory import planner  # noqa: E402
from llmlab.model import GPTConfig  # noqa: E402


@pytest.mark.parametrize("model", list(widgets.MEMORY_MODELS))
def test_every_model_builds_and_counts_its_parameters(model):
    r = widgets.memory_plan(model, batch_size=1, seq_len=64, data=1)
    assert r["num_params"] == planner.num_params(r["config"])
    assert r["seq_len"] == 64 and r["config"].dropout == 0


def test_published_sizes():
    n = {name: widgets.memory_plan(name)["num_params"] for name in ("GPT-2 XL (1.5B)", "GPT-3 6.7B", "GPT-3 175B")}
    assert n["GPT-2 XL (1.5B)"] == pytest.approx(1.56e9, rel=0.01)  # GPT-2 XL: 1.5B (1558M with position embeddings)
    assert n["GPT-3 6.7B"] == pytest.approx(6.7e9, rel=0.02)
    assert n["GPT-3 175B"] == pytest.approx(175e9, rel=0.01)
    assert widgets.memory_plan("GPT-3 175B")["config"] == GPTConfig(**flops.GPT3_CONFIG)
    assert widgets.memory_plan("GPT-2 small (124M)")["config"] == GPTConfig.preset("gpt2")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("checkpointing", [False, "selective", True])
@pytest.mark.parametrize("tensor", [1, 4])
def test_memory_plan_is_the_planner(stage, checkpointing, tensor):
    r = widgets.memory_plan("GPT-3 6.7B", batch_size=2, seq_len=1024, stage=stage, data=16,
                            checkpointing=checkpointing, tensor=tensor, gpu="H100 SXM")
    config = GPTConfig(**widgets.MEMORY_MODELS["GPT-3 6.7B"])
    want = planner.plan(config, 2, 1024, stage=stage, data=16, tensor=tensor, checkpointing=checkpointing)
    assert r["plan"] == want and r["breakdown"] == want.breakdown() and r["total"] == want.total
    assert r["memory"] == SPECS["H100 SXM"].memory_bytes and r["fits"] == (want.total <= r["memory"])
    assert [r["by_stage"][s].total for s in range(4)] == sorted((r["by_stage"][s].total for s in range(4)),
                                                                 reverse=True)  # each stage shards more
    # model state alone is the ZeRO paper's formula for Ψ/t parameters
    b = r["breakdown"]
    assert b["params"] + b["grads"] + b["optimizer_state"] == pytest.approx(
        planner.model_state_bytes(planner.num_params(config) / tensor, stage, 16))


def test_the_default_is_the_chapter_example():
    """GPT-3 6.7B on 8 A100s: plain data parallelism needs 16Ψ > 80 GB; ZeRO-1 fits."""
    r = widgets.memory_plan()
    assert not r["fits"] and r["breakdown"]["optimizer_state"] == pytest.approx(12 * r["num_params"])
    assert widgets.memory_plan(stage=1)["fits"]
    text = widgets.format_memory_plan(r)
    assert "does not fit on A100 SXM (80 GB as sold: 85.9 GB)" in text and "ZeRO-0 over 8 GPUs" in text
    assert "fits on A100 SXM" in widgets.format_memory_plan(widgets.memory_plan(stage=3))
    assert "every block checkpointed" in widgets.format_memory_plan(widgets.memory_plan(checkpointing=True))
    assert "the attention core recomputed" in widgets.format_memory_plan(widgets.memory_plan(checkpointing="selective"))


def test_memory_plan_refuses_bad_input():
    with pytest.raises(ValueError, match="model='GPT-5'"):
        widgets.memory_plan("GPT-5")
    with pytest.raises(ValueError, match="gpu='TPU'"):
        widgets.memory_plan(gpu="TPU")
    with pytest.raises(ValueError, match="stage=4"):
        widgets.memory_plan(stage=4)
    with pytest.raises(ValueError, match="tensor=2 does not divide n_head=25"):
        widgets.memory_plan("GPT-2 XL (1.5B)", tensor=2)
    with pytest.raises(ValueError, match="seq_len=4096 > block_size=2048"):
        widgets.memory_plan(seq_len=4096)
    with pytest.raises(ValueError, match="checkpointing='yes' must be one of 'none', 'selective', 'full'"):
        widgets.memory_plan(checkpointing="yes")
    with pytest.raises(ValueError, match="powers of 2"):
        widgets.memory_planner(batch_size=3)


def test_figure_has_a_bar_per_stage_and_category_and_the_memory_line():
    r = widgets.memory_plan(stage=2)
    ax = widgets.memory_plan_figure(r).axes[0]
    assert len(ax.patches) == 4 * len(widgets.MEMORY_CATEGORIES)
    solid = [p for p in ax.patches if p.get_alpha() == 1.0]
    assert len(solid) == len(widgets.MEMORY_CATEGORIES)  # the chosen stage's bars
    assert sum(p.get_width() for p in solid) == pytest.approx(r["total"] / 1e9)
    assert any(line.get_xdata()[0] == pytest.approx(80 * 2**30 / 1e9) for line in ax.lines)  # the A100's 80 GiB


def test_memory_planner_recomputes_and_redraws():
    explorer = widgets.memory_planner()
    text, png = explorer.result.value, bytes(explorer.plot.value)
    assert "does not fit" in text and png.startswith(b"\x89PNG")
    explorer.controls["stage"].value = 3
    assert "ZeRO-3" in explorer.result.value and "fits on" in explorer.result.value
    assert bytes(explorer.plot.value) != png
    explorer.controls["model"].value = "GPT-2 XL (1.5B)"
    explorer.controls["tensor"].value = 2  # 25 heads: the planner refuses, the widget says why
    assert "cannot plan" in explorer.result.value and "n_head=25" in explorer.result.value
    explorer.controls["tensor"].value = 1
    explorer.controls["seq_len"].value = 512
    explorer.controls["checkpointing"].value = True
    explorer.controls["gpu"].value = "H100 SXM"
    r = explorer.plan()
    assert (r["model"], r["seq_len"], r["stage"], r["checkpointing"], r["gpu"]) == ("GPT-2 XL (1.5B)", 512, 3, True,
                                                                                    "H100 SXM")
    assert r["plan"].recompute > 0
    explorer.controls["checkpointing"].value = "selective"
    assert "the attention core recomputed" in explorer.result.value
    assert 0 < explorer.plan()["plan"].recompute < r["plan"].recompute
    explorer.controls["seq_len"].value = 0  # "context": the model's block_size
    assert explorer.plan()["seq_len"] == 1024
    bundle, metadata = explorer._repr_mimebundle_()
    assert metadata["image/png"]["width"] == int(explorer.plot.layout.width.removesuffix("px"))  # shown at its size
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "GPT-2 XL" in bundle["text/plain"] and "1024 tokens" in bundle["text/plain"]
    assert base64.b64decode(bundle["image/png"]) == bytes(explorer.plot.value)
