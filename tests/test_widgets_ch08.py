"""Chapter 8's widgets: the MoE routing explorer against llmlab.moe.route, the quantization explorer against
llmlab.quant and a direct computation of the grid; both built headlessly, driven, and carrying a static result."""

import base64
import math

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from llmlab import widgets  # noqa: E402
from llmlab.moe import route  # noqa: E402
from llmlab.quant import LSQQuantizer, MinMaxQuantizer  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny tensors: one thread is faster, and steadier when other processes share the cores."""


# --- the MoE routing explorer ---------------------------------------------------------------------------------

@pytest.mark.parametrize("E,k,cf,skew", [(8, 2, 1.25, 0.0), (4, 1, 0.5, 2.0), (16, 2, None, 1.0), (3, 3, 1.0, 0.5)])
def test_moe_routing_is_route(E, k, cf, skew):
    r = widgets.moe_routing(E, k, cf, skew, tokens=100, seed=3)
    logits = torch.randn(100, E, generator=torch.Generator().manual_seed(3))
    logits += skew * (1 - 2 * torch.arange(E) / max(E - 1, 1))  # expert 0 favoured, the last avoided
    ref = route(logits, k, cf)
    assert r["load"] == ref.load.tolist() and r["kept"] == ref.counts.tolist() and r["capacity"] == ref.capacity
    assert r["drop_rate"] == pytest.approx(ref.drop_rate)
    assert r["balance_loss"] == pytest.approx(ref.balance_loss.item())
    assert sum(r["load"]) == k * 100 and all(kept <= load for kept, load in zip(r["kept"], r["load"], strict=True))
    if cf is None:
        assert r["capacity"] is None and r["drop_rate"] == 0 and r["kept"] == r["load"]
    else:
        assert r["capacity"] == math.ceil(k * 100 / E * cf) and max(r["kept"]) <= r["capacity"]
    gates, dropped = np.array(r["gates"]), np.array(r["dropped"])
    assert gates.shape == dropped.shape == (24, E)
    assert ((gates > 0).sum(1) == k).all() and not (dropped & (gates == 0)).any()  # drops are among the choices
    if k > 1:
        np.testing.assert_allclose(gates.sum(1), 1, rtol=1e-6)  # renormalised top-k
    text = widgets.format_moe_routing(r)
    assert "drop rate" in text and "balance loss" in text and f"{r['drop_rate']:.1%}" in text
    fig = widgets.moe_routing_figure(r)
    assert len(fig.axes[0].patches) == 2 * E  # a kept and a dropped bar per expert


def test_balance_loss_and_drops_grow_with_skew():
    runs = [widgets.moe_routing(skew=s, tokens=1024) for s in (0.0, 1.0, 2.0, 4.0)]
    losses, drops = [r["balance_loss"] for r in runs], [r["drop_rate"] for r in runs]
    assert losses == sorted(losses) and drops == sorted(drops)
    assert losses[0] == pytest.approx(1, abs=0.05) and losses[-1] > 2.5  # uniform ≈ 1, up to N when collapsed
    tokens = [widgets.moe_routing(capacity_factor=cf, skew=1.0)["drop_rate"] for cf in (0.5, 1.0, 2.0, None)]
    assert tokens == sorted(tokens, reverse=True) and tokens[-1] == 0


def test_moe_routing_refuses_bad_input():
    with pytest.raises(ValueError, match=r"k=3 must be an int in \[1, 2\] \(experts per token"):
        widgets.moe_routing(2, 3)
    with pytest.raises(ValueError, match="capacity_factor=0"):
        widgets.moe_routing(capacity_factor=0)
    with pytest.raises(ValueError, match="tokens=0"):
        widgets.moe_routing(tokens=0)
    with pytest.raises(ValueError, match="capacity_factor=0.3"):
        widgets.moe_routing_explorer(capacity_factor=0.3)


def test_moe_routing_explorer_recomputes_and_redraws():
    explorer = widgets.moe_routing_explorer()
    text, png = explorer.result.value, bytes(explorer.plot.value)
    assert "top-2 of 8 experts" in text and png.startswith(b"\x89PNG")
    assert text == f"<b>{widgets.format_moe_routing(widgets.moe_routing())}</b>"  # the default, shown statically too
    explorer.controls["skew"].value = 3.0
    assert explorer.routing()["balance_loss"] > 2 and bytes(explorer.plot.value) != png
    explorer.controls["capacity_factor"].value = "dropless"
    assert explorer.routing()["drop_rate"] == 0 and "dropless" in explorer.result.value
    explorer.controls["num_experts"].value = 1  # k = 2 > E: the explorer takes every expert
    assert explorer.routing()["k"] == 1
    bundle, metadata = explorer._repr_mimebundle_()
    assert metadata["image/png"]["width"] == int(explorer.plot.layout.width.removesuffix("px"))  # shown at its size
    assert "application/vnd.jupyter.widget-view+json" in bundle and "top-1 of 1 experts" in bundle["text/plain"]
    assert base64.b64decode(bundle["image/png"]) == bytes(explorer.plot.value)


# --- the quantization explorer --------------------------------------------------------------------------------

@pytest.mark.parametrize("bits,signed", [(4, True), (2, True), (8, True), (3, False)])
def test_quant_grid_is_the_quantizers(bits, signed):
    w = torch.randn(40, 30) * 0.1
    r = widgets.quant_grid(bits, signed, weights=w)
    q_min, q_max = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    assert (r["q_min"], r["q_max"]) == (q_min, q_max) and len(r["levels"]) == 2**bits
    lsq = LSQQuantizer(bits, signed=signed)
    w_hat = lsq(w.flatten()).detach()  # initialises its step from w: 2·mean|w|/√Q_P
    assert r["step"] == pytest.approx(lsq.step.item()) == pytest.approx(2 * w.abs().mean().item() / math.sqrt(q_max))
    np.testing.assert_array_equal(r["w_hat"], w_hat.numpy())
    # the grid, computed directly: round(w/s) clamped to [q_min, q_max], times s
    direct = (w.flatten() / r["step"]).round().clamp(q_min, q_max) * r["step"]
    np.testing.assert_allclose(r["w_hat"], direct.numpy(), rtol=1e-6, atol=0)
    assert r["rel_error"] == pytest.approx(float(np.linalg.norm(r["w_hat"] - r["w"]) / np.linalg.norm(r["w"])))
    assert r["used"] == len(np.unique(r["w_hat"])) <= 2**bits
    minmax = MinMaxQuantizer(bits, signed=signed)
    minmax(w)
    assert r["minmax_step"] == pytest.approx(minmax.qparams()[0].item())
    assert r["bits_range"] == list(range(2, 9)) and r["lsq_error"][bits - 2] == pytest.approx(r["rel_error"])
    assert r["minmax_error"] == sorted(r["minmax_error"], reverse=True)  # more bits, less error
    text = widgets.format_quant_grid(r)
    assert "error" in text and "clipped" in text and f"{r['rel_error']:.2%}" in text
    assert len(widgets.quant_grid_figure(r).axes) == 2


def test_quant_grid_step_and_clipping():
    w = torch.linspace(-1, 1, 201)
    r = widgets.quant_grid(4, True, step=0.1, weights=w)  # grid −0.8 … 0.7: |w| beyond half a step past it clips
    assert r["clipped"] == pytest.approx(((w < -0.85) | (w > 0.75)).double().mean().item())
    assert r["w_hat"].min() == pytest.approx(-0.8) and r["w_hat"].max() == pytest.approx(0.7)
    unsigned = widgets.quant_grid(4, False, step=0.1, weights=w)
    assert unsigned["w_hat"].min() == 0 and unsigned["clipped"] > 0.45  # every negative weight becomes 0
    default = widgets.quant_grid()  # the tiny GPT's first MLP weight at initialisation
    assert len(default["w"]) == 256 * 64 and np.isclose(default["w"].std(), 0.02, rtol=0.05)


def test_quant_grid_refuses_bad_input():
    with pytest.raises(ValueError, match="bits=1"):
        widgets.quant_grid(1)
    with pytest.raises(ValueError, match="step=0"):
        widgets.quant_grid(step=0)
    with pytest.raises(ValueError, match="weights must be"):
        widgets.quant_grid(weights=torch.zeros(5))
    with pytest.raises(ValueError, match=r"bits=12 must be an int in \[2, 8\] \(for the explorer\)"):
        widgets.quant_explorer(bits=12)


def test_quant_explorer_recomputes_and_redraws():
    explorer = widgets.quant_explorer()
    text, png = explorer.result.value, bytes(explorer.plot.value)
    assert text == f"<b>{widgets.format_quant_grid(widgets.quant_grid())}</b>" and png.startswith(b"\x89PNG")
    explorer.controls["step"].value = 0.005
    r = explorer.grid()
    assert r["step"] == pytest.approx(0.005) and "0.005" in explorer.result.value
    assert bytes(explorer.plot.value) != png
    explorer.controls["bits"].value = 8  # a new grid starts at LSQ's initial step
    r = explorer.grid()
    assert r["bits"] == 8 and r["step"] == pytest.approx(r["lsq_step"])
    explorer.controls["signed"].value = False
    assert explorer.grid()["q_min"] == 0 and "unsigned" in explorer.result.value
    bundle, metadata = explorer._repr_mimebundle_()
    assert metadata["image/png"]["width"] == int(explorer.plot.layout.width.removesuffix("px"))  # shown at its size
    assert "application/vnd.jupyter.widget-view+json" in bundle and "8-bit unsigned" in bundle["text/plain"]
    assert base64.b64decode(bundle["image/png"]) == bytes(explorer.plot.value)
