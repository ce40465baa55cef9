"""Chapter 2's widgets: the pipeline schedule explorer against llmlab.parallel.pipeline, the precision explorer
against llmlab.precision and a direct fp16 cast; both built headlessly, driven, and carrying a static result."""

import base64

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from llmlab import precision, widgets  # noqa: E402
from llmlab.parallel import pipeline  # noqa: E402

# --- the pipeline schedule explorer ----------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m,ratio", [(4, 8, 2.0), (1, 3, 1.0), (5, 2, 0.5), (3, 16, 3.5)])
def test_pipeline_schedule_is_the_simulator(schedule, p, m, ratio):
    r = widgets.pipeline_schedule(p, m, schedule, ratio)
    timeline = pipeline.simulate(schedule, p, m, t_forward=1.0, t_backward=ratio)
    assert r["timeline"] == timeline and r["bubble"] == pytest.approx(timeline.idle)
    # equal stages: the simulated bubble is the formula, whatever the backward/forward ratio
    assert r["bubble"] == pytest.approx(pipeline.bubble_fraction(p, m)) == pytest.approx(r["formula"])
    assert r["ideal"] == pytest.approx(m * (1 + ratio))
    assert r["makespan"] == pytest.approx(r["ideal"] / (1 - r["bubble"]))
    # GPipe holds every micro-batch on every stage; 1F1B at most p - s on stage s
    assert r["peak_in_flight"] == ([m] * p if schedule == "gpipe" else [min(p - s, m) for s in range(p)])
    text = widgets.format_pipeline(r)
    assert "bubble" in text and f"p = {p} stages" in text and f"{r['formula']:.1%}" in text
    ax = widgets.pipeline_figure(r).axes[0]
    assert len(ax.patches) == 2 * p * m  # one bar per forward and per backward


def test_pipeline_schedule_refuses_bad_input():
    with pytest.raises(ValueError, match="kind='zero-bubble'"):
        widgets.pipeline_schedule(4, 8, "zero-bubble")
    with pytest.raises(ValueError, match="stages=0"):
        widgets.pipeline_schedule(0, 8)
    with pytest.raises(ValueError, match="t_backward=0"):
        widgets.pipeline_schedule(2, 2, "gpipe", 0)
    with pytest.raises(ValueError, match="stages=17"):
        widgets.pipeline_explorer(stages=17)


def test_pipeline_explorer_recomputes_and_redraws():
    explorer = widgets.pipeline_explorer()
    text, png = explorer.result.value, bytes(explorer.plot.value)
    assert "1F1B" in text and "4, 3, 2, 1" in text and png.startswith(b"\x89PNG")
    explorer.controls["schedule"].value = "gpipe"
    assert "GPipe" in explorer.result.value and "8, 8, 8, 8" in explorer.result.value
    assert bytes(explorer.plot.value) != png
    explorer.controls["micro_batches"].value = 24
    r = explorer.schedule()
    assert (r["stages"], r["micro_batches"], r["schedule"]) == (4, 24, "gpipe")
    assert r["bubble"] == pytest.approx(3 / 27)
    explorer.controls["stages"].value = 2
    explorer.controls["backward_ratio"].value = 1.0
    assert explorer.schedule()["ideal"] == pytest.approx(48.0)
    bundle, metadata = explorer._repr_mimebundle_()
    assert metadata["image/png"]["width"] == int(explorer.plot.layout.width.removesuffix("px"))  # shown at its size
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "p = 2 stages" in bundle["text/plain"]
    assert base64.b64decode(bundle["image/png"]) == bytes(explorer.plot.value)


# --- the precision explorer ------------------------------------------------------------------------------------

def test_fp16_constants_are_torch_finfo():
    info = torch.finfo(torch.float16)
    assert widgets.FP16_MAX == info.max and widgets.FP16_NORMAL_MIN == info.tiny
    assert widgets.FP16_SUBNORMAL_MIN == info.tiny * info.eps  # 2^-14 · 2^-10
    assert torch.tensor(widgets.FP16_SUBNORMAL_MIN, dtype=torch.float16).item() == widgets.FP16_SUBNORMAL_MIN
    assert torch.tensor(widgets.FP16_SUBNORMAL_MIN / 2, dtype=torch.float16).item() == 0  # ties to even: 0


@pytest.mark.parametrize("value,fp16,bf16", [(1e-8, "underflow", "normal"), (70000.0, "overflow", "normal"),
                                             (1e-6, "subnormal", "normal"), (0.1, "normal", "normal"),
                                             (1e39, "overflow", "overflow")])
def test_format_representation_says_what_precision_representation_found(value, fp16, bf16):
    rep = precision.representation(value)
    rows = {line.split()[0]: line.split(None, 3) for line in widgets.format_representation(value).splitlines()[2:]}
    assert set(rows) == {"fp32", "fp16", "bf16"}
    for name, kind in (("fp16", fp16), ("bf16", bf16)):
        _, stored, rel_error, what = rows[name]
        assert what.split(":")[0] == kind, what
        assert float(stored) == pytest.approx(rep[name]["stored"], rel=1e-6)
        assert rel_error == f"{rep[name]['rel_error']:.2e}"


def test_gradient_underflow_is_an_fp16_cast():
    torch.manual_seed(0)
    g = torch.randn(10_000).double() * torch.logspace(-12, 3, 10_000, dtype=torch.float64)  # 1e-12 … 1e3
    g[::100] = 0.0  # exact zeros are left out
    for log2_scale in (0, 8, 24):
        r = widgets.gradient_underflow(log2_scale, g)
        nonzero = g[g != 0]
        stored = (nonzero * 2.0**log2_scale).half()
        assert r["n"] == nonzero.numel() and r["scale"] == 2.0**log2_scale
        assert r["underflow"] == pytest.approx((stored == 0).double().mean().item())
        assert r["overflow"] == pytest.approx(stored.isinf().double().mean().item())
        subnormal = (stored != 0) & (stored.abs() < torch.finfo(torch.float16).tiny)
        assert r["subnormal"] == pytest.approx(subnormal.double().mean().item())
        np.testing.assert_allclose(r["log2_scaled"], r["log2_unscaled"] + log2_scale)
    lifted, unscaled = widgets.gradient_underflow(8, g), widgets.gradient_underflow(0, g)
    assert lifted["underflow"] < unscaled["underflow"] and widgets.gradient_underflow(24, g)["overflow"] > 0
    assert "underflow" in widgets.format_underflow(lifted)
    with pytest.raises(ValueError, match="no nonzero"):
        widgets.gradient_underflow(0, torch.zeros(3))


def test_tiny_gpt_gradient_is_real_and_leaves_the_random_stream_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    g = widgets.tiny_gpt_gradient()
    assert torch.equal(torch.rand(1), expected_next)
    from llmlab.model import GPT, GPTConfig

    assert g.dtype == torch.float32 and g.numel() == sum(p.numel() for p in GPT(GPTConfig.preset("tiny")).parameters())
    assert g.abs().max() > 1e-3  # a real gradient, not zeros
    r = widgets.gradient_underflow(0)
    assert 0 < r["underflow"] < 0.01 and r["subnormal"] > 0.05  # fp16 loses a sixth of it to subnormals unscaled
    assert widgets.gradient_underflow(12)["subnormal"] < r["subnormal"] / 10


def test_precision_explorer_recomputes_and_redraws():
    explorer = widgets.precision_explorer()
    text, png = explorer.result.value, bytes(explorer.plot.value)
    assert "underflow" in text and "loss scale 2^0" in text and png.startswith(b"\x89PNG")
    explorer.controls["value"].value = 70000.0
    assert "overflow" in explorer.result.value and bytes(explorer.plot.value) == png  # the histogram is unchanged
    explorer.controls["log2_scale"].value = 30
    assert "loss scale 2^30" in explorer.result.value and bytes(explorer.plot.value) != png
    assert explorer.underflow()["overflow"] > 0.5
    bundle, metadata = explorer._repr_mimebundle_()
    assert metadata["image/png"]["width"] == int(explorer.plot.layout.width.removesuffix("px"))  # shown at its size
    assert "application/vnd.jupyter.widget-view+json" in bundle and "loss scale 2^30" in bundle["text/plain"]
    assert base64.b64decode(bundle["image/png"]) == bytes(explorer.plot.value)


def test_precision_explorer_refuses_bad_input():
    with pytest.raises(ValueError, match="must be finite"):
        widgets.precision_explorer(value=float("inf"))
    with pytest.raises(ValueError, match="log2_scale=41"):
        widgets.precision_explorer(log2_scale=41)
