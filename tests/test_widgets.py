"""llmlab.widgets: the pure functions against llmlab.flops / hardware.roofline, and the widgets built headlessly."""

import base64
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402

from llmlab import flops, widgets  # noqa: E402
from llmlab.hardware import SPECS, roofline  # noqa: E402


def test_importing_llmlab_does_not_import_ipywidgets():
    code = "import sys, llmlab, llmlab.widgets; print('ipywidgets' in sys.modules, 'IPython' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_training_estimate_is_flops_arithmetic():
    est = widgets.training_estimate(175e9, 300e9, "A100 SXM", gpus=1000, mfu=0.4)
    total = flops.training_flops(175e9, 300e9)
    days = flops.training_days(total, gpus=1000, peak_flops=SPECS["A100 SXM"].peak_flops("bf16"), mfu=0.4)
    assert est["flops"] == total and est["days"] == pytest.approx(days)
    assert est["gpu_hours"] == pytest.approx(days * 24 * 1000)
    # the GPT-3 case of the material: 3.14e23 FLOP on 1000 A100s in 34 days needs ~34% MFU (CLAIMS.md C2)
    needed = flops.implied_mfu(total, gpus=1000, days=34, peak_flops=est["peak_flops"])
    assert widgets.training_estimate(175e9, 300e9, "A100 SXM", 1000, needed)["days"] == pytest.approx(34)
    fp32 = widgets.training_estimate(175e9, 300e9, "A100 SXM", 1000, 0.4, precision="fp32")
    assert fp32["days"] / est["days"] == pytest.approx(312 / 19.5)  # SIMT FP32 is 16x slower than bf16 tensor
    text = widgets.format_estimate(est)
    assert "days" in text and "175B params" in text and "1,000 × A100 SXM" in text


@pytest.mark.parametrize("bad", [dict(gpu="A999"), dict(gpus=0), dict(gpus=2.5), dict(mfu=1.5), dict(mfu=0),
                                 dict(n_params=-1), dict(precision="fp64")])
def test_training_estimate_refuses_bad_input(bad):
    args = dict(n_params=1e9, tokens=1e10, gpu="H100 SXM", gpus=8, mfu=0.4) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        widgets.training_estimate(**args)


def test_gemm_roofline_is_roofline_arithmetic():
    peak, bw = SPECS["H100 SXM"].peak_flops(), SPECS["H100 SXM"].hbm_gbs * 1e9
    square = widgets.gemm_roofline(4096, 4096, 4096, 2, peak, bw)
    assert square["intensity"] == pytest.approx(roofline.gemm_intensity(4096, 4096, 4096, 2))
    assert square["ridge"] == pytest.approx(SPECS["H100 SXM"].ridge_point())
    assert square["bound"] == "compute" and square["attainable"] == peak
    gemv = widgets.gemm_roofline(1, 4096, 4096, 2, peak, bw)
    assert gemv["bound"] == "memory" and gemv["attainable"] == pytest.approx(gemv["intensity"] * bw)
    assert gemv["seconds"] == pytest.approx(gemv["bytes"] / bw)  # memory-bound: time = bytes / bandwidth
    assert "memory-bound" in widgets.format_roofline(gemv, "H100 SXM")
    assert "compute-bound" in widgets.format_roofline(square)
    fig = widgets.roofline_figure(gemv, "H100 SXM")
    assert len(fig.axes[0].get_lines()) >= 2  # the roof and the attainable point


def test_calculator_recomputes_when_a_slider_moves():
    calc = widgets.training_time_calculator()
    assert {"GPUs", "MFU"} <= {c.description for c in calc.controls.values()}
    before = calc.result.value
    assert "days" in before
    assert calc.estimate()["days"] == pytest.approx(widgets.training_estimate(175e9, 300e9, "A100 SXM", 1000, 0.4)
                                                    ["days"])
    calc.controls["gpus"].value = 2000
    assert calc.result.value != before and "days" in calc.result.value
    assert calc.estimate()["days"] == pytest.approx(widgets.training_estimate(175e9, 300e9, "A100 SXM", 2000, 0.4)
                                                    ["days"])
    moved = calc.result.value
    calc.controls["mfu"].value = 0.2
    calc.controls["gpu"].value = "H100 SXM"
    assert calc.result.value not in (before, moved) and "H100 SXM" in calc.result.value


def test_calculator_display_carries_a_static_result():
    calc = widgets.training_time_calculator(gpus=512)
    bundle = calc._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle  # the live widget, for JupyterLab
    assert "days" in bundle["text/plain"] and "512 ×" in bundle["text/plain"]  # the fallback, for a static page


def test_roofline_explorer_recomputes_and_redraws():
    explorer = widgets.roofline_explorer(devices={"this machine": (50e9, 10e9)})
    text, png = explorer.result.value, bytes(explorer.plot.value)
    assert "compute-bound" in text and png.startswith(b"\x89PNG")
    explorer.controls["m"].value = 1  # a matrix-vector product
    assert "memory-bound" in explorer.result.value and bytes(explorer.plot.value) != png
    r = explorer.roofline()
    assert (r["m"], r["n"], r["k"]) == (1, 2304, 768)
    assert r["intensity"] == pytest.approx(roofline.gemm_intensity(1, 2304, 768, 2))
    explorer.controls["dtype"].value = "fp32 (4 B)"
    assert explorer.roofline()["peak_flops"] == SPECS["A100 SXM"].peak_flops("fp32")
    explorer.controls["gpu"].value = "this machine"
    assert explorer.roofline()["peak_flops"] == 50e9 and "this machine" in explorer.result.value
    bundle, metadata = explorer._repr_mimebundle_()
    assert metadata["image/png"]["width"] == int(explorer.plot.layout.width.removesuffix("px"))  # shown at its size
    assert "memory-bound" in bundle["text/plain"]
    assert base64.b64decode(bundle["image/png"]) == bytes(explorer.plot.value)


def test_roofline_explorer_refuses_unknown_choices():
    with pytest.raises(ValueError, match="gpu"):
        widgets.roofline_explorer(gpu="TPU v9")
    with pytest.raises(ValueError, match="dtype"):
        widgets.roofline_explorer(dtype="int3")


def test_slider_stops_hold_the_defaults_exactly():
    # a browser renders a slider at one of its stops and syncs that value back: the defaults must be stops
    calc = widgets.training_time_calculator(n_params=175e9, tokens=300e9, mfu=0.34)
    assert calc.controls["n_params"].value == 175e9 and calc.controls["tokens"].value == 300e9
    assert "175B params × 300B tokens" in calc.result.value
    explorer = widgets.roofline_explorer(m=4096, n=2304, k=768)
    assert [explorer.controls[d].value for d in "mnk"] == [4096, 2304, 768]
    stops = [v for _, v in explorer.controls["n"].options]
    assert stops == sorted(stops) and {1, 3, 768, 2304, 65536} <= set(stops)
    with pytest.raises(ValueError, match="m=0"):
        widgets.roofline_explorer(m=0)


def test_the_roofline_is_drawn_at_twice_its_shown_size_and_its_title_fits():
    explorer = widgets.roofline_explorer()
    drawn = bytes(explorer.plot.value)
    width = int.from_bytes(drawn[16:20], "big")  # the PNG's IHDR: its width in pixels
    assert explorer.plot.layout.width == f"{width // 2}px" and width == 2 * round(6.4 * 80)  # never stretched
    fig = widgets.compute.roofline_figure(explorer.roofline(), "A100 SXM")
    canvas = FigureCanvasAgg(fig)  # the canvas png() draws on
    canvas.draw()  # lays the texts out, so their extents are known
    renderer, box = canvas.get_renderer(), fig.bbox
    for ax in fig.axes:
        for text in (ax.title, ax.xaxis.label, ax.yaxis.label):
            extent = text.get_window_extent(renderer)
            assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and extent.y1 <= box.y1, text.get_text()
