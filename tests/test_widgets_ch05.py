"""Chapter 5's widget: the cluster calculator against llmlab.hardware.cluster.step_time, built headlessly, driven,
carrying a static result, and refusing the layouts the library refuses with the library's own message."""

import base64

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from llmlab import widgets  # noqa: E402
from llmlab.dist import cost  # noqa: E402
from llmlab.hardware import cluster  # noqa: E402


@pytest.mark.parametrize("name", list(cluster.PRESETS))
def test_each_preset_is_the_library_step_time(name):
    r = widgets.cluster_estimate(name)
    want = cluster.step_time(cluster.PRESETS[name])
    # the same function on the same config: equal to the last bit, no tolerance needed
    assert r["config"] == cluster.PRESETS[name] and r["step"] == want
    assert r["parts"] == want.parts() and list(r["parts"]) == list(widgets.STEP_PARTS)
    assert (r["compute"], r["comm"], r["bubble"], r["total"]) == (want.compute, want.comm, want.pp_bubble, want.total)
    assert (r["days"], r["gpu_hours"], r["mfu"], r["comm_hidden"]) == (want.days, want.gpu_hours, want.mfu,
                                                                       want.comm_hidden)
    assert r["summary"] == widgets.format_cluster_estimate(r)
    assert f"{want.gpu_hours:,.0f} GPU-hours" in r["summary"] and " days" in r["summary"]


@pytest.mark.parametrize("preset,model,changes,dp", [
    ("gpt3-175b-1024xA100", None, dict(pp=4), 32),  # dp follows: 1024 / (8·4)
    ("gpt3-175b-1024xA100", None, dict(gpu="H100 SXM", link="ib_ndr400", tp_link="nvlink4", mfu=0.5), 16),
    ("gpt3-175b-1024xA100", "GPT-3 6.7B", dict(gpus=256, tp=4, pp=2, micro_batches=8), 32),
    ("7b-64xH100", None, dict(tp=8, tokens=2e12), 8),
    ("gpt2-8xH100", None, dict(link="pcie4", gpu="H100 PCIe", batch_tokens=2**20), 8),
    ("gpt2-8xH100", None, dict(gpus=8, dp=4, tp=2), 4),  # an explicit dp is kept
])
def test_changed_configs_are_the_library_step_time(preset, model, changes, dp):
    r = widgets.cluster_estimate(preset, model, **changes)
    fields = changes | {"dp": dp} | ({"model": widgets.cluster_models()[model]} if model else {})
    config = cluster.preset(preset, **fields)
    assert r["config"] == config and r["step"] == cluster.step_time(config)
    assert r["model"] == (model or r["model"]) and r["n_params"] == config.n_params and r["steps"] == config.steps


def test_the_gpt3_example():
    """GPT-3 on 1024 A100s laid out like Megatron-LM: about a month, compute the largest part of each step."""
    r = widgets.cluster_estimate()
    assert r["model"] == "GPT-3 175B" and r["config"].gpus == 1024
    assert 20 < r["days"] < 45 and r["compute"] == max(r["parts"].values())
    assert r["gpu_hours"] == pytest.approx(r["days"] * 24 * 1024)  # only float rounding between the two routes
    text = r["summary"]
    assert "1,024 × A100 SXM, dp 16 × tp 8 × pp 8" in text and "96 micro-batches of 2,048 tokens" in text
    assert "TP all-reduce" in text and "PP bubble" in text and "end-to-end MFU" in text


def test_models_hold_chapter_3s_sizes_and_every_preset_model():
    models = widgets.cluster_models()
    assert set(widgets.MEMORY_MODELS) <= set(models)
    assert all(p.model in models.values() for p in cluster.PRESETS.values())
    assert models["7b-64xH100's model"] == cluster.PRESETS["7b-64xH100"].model
    assert widgets.cluster_estimate("7b-64xH100")["model"] == "7b-64xH100's model"


def _library_message(preset, **fields) -> str:
    with pytest.raises(ValueError) as refused:
        cluster.preset(preset, **fields)
    return str(refused.value)


@pytest.mark.parametrize("preset,changes,library", [
    ("gpt3-175b-1024xA100", dict(gpus=1000), dict(gpus=1000, dp=15)),  # 1000 // 64 = 15: 960 != 1000
    ("gpt3-175b-1024xA100", dict(pp=128), dict(pp=128, dp=1)),  # 128 stages for 96 layers
    ("gpt3-175b-1024xA100", dict(micro_batches=7), dict(micro_batches=7)),  # 3·2^20 tokens over 16·7
    ("gpt2-8xH100", dict(tp=8), dict(tp=8, dp=1)),  # 12 heads
    ("gpt2-8xH100", dict(tp=16), dict(tp=16, dp=1)),  # more GPUs than there are: dp would be 0
    ("gpt2-8xH100", dict(gpu="TPU v5"), dict(gpu="TPU v5")),
    ("gpt2-8xH100", dict(link="carrier pigeon"), dict(link="carrier pigeon")),
    ("gpt2-8xH100", dict(mfu=1.5), dict(mfu=1.5)),
    ("gpt2-8xH100", dict(gpus=2.5), dict(gpus=2.5)),
    ("gpt2-8xH100", dict(overlap=True), dict(overlap=True)),
])
def test_invalid_layouts_are_refused_with_the_librarys_message(preset, changes, library):
    with pytest.raises(ValueError) as refused:
        widgets.cluster_estimate(preset, **changes)
    assert str(refused.value) == _library_message(preset, **library)


def test_unknown_preset_and_model_are_refused():
    with pytest.raises(ValueError, match="name='gpt5' is not a preset"):
        widgets.cluster_estimate("gpt5")
    with pytest.raises(ValueError, match="model='GPT-5' unknown"):
        widgets.cluster_estimate(model="GPT-5")


def test_step_figure_stacks_the_parts_under_each_network():
    r = widgets.cluster_estimate("7b-64xH100")
    ax = widgets.cluster_step_figure(r).axes[0]
    assert len(ax.patches) == len(widgets.STEP_PARTS) * len(cluster.NETWORKS)
    ends = {}
    for p in ax.patches:  # a bar's end: the right edge of its last part
        ends[p.get_y()] = max(ends.get(p.get_y(), 0.0), p.get_x() + p.get_width())
    want = [t.total for t in r["by_network"].values()]  # the config's own network first, drawn at the top
    assert [ends[y] for y in sorted(ends)] == pytest.approx(want)  # float sums in another order
    assert [t.get_text() for t in ax.get_yticklabels()] == [cluster.NETWORKS[k] for k in r["by_network"]]
    assert any(line.get_xdata()[0] == pytest.approx(r["total"] - r["comm_hidden"]) for line in ax.lines)
    assert "seconds" in ax.get_xlabel()


@pytest.mark.parametrize("network", list(cluster.NETWORKS))
def test_the_estimate_puts_both_networks_side_by_side(network):
    r = widgets.cluster_estimate("7b-64xH100", network=network)
    assert list(r["by_network"]) == [network, *(k for k in cluster.NETWORKS if k != network)]
    assert r["by_network"] == cluster.network_step_times(r["config"]) and r["by_network"][network] == r["step"]
    other = next(k for k in cluster.NETWORKS if k != network)
    assert cluster.NETWORKS[network] + ": step" in r["summary"]
    assert f"with {cluster.NETWORKS[other]}: step" in r["summary"]
    flat, hierarchical = (r["by_network"][k].dp_allreduce for k in ("nic-per-node", "nic-per-gpu"))
    assert hierarchical < flat / 5  # 64 H100s, 8 per node, 100 Gb/s: S/8 per NIC against S through one


def test_link_figure_has_a_stacked_bar_per_link():
    times = cluster.link_step_times(cluster.PRESETS["7b-64xH100"])
    ax = widgets.link_step_figure(times).axes[0]
    assert len(ax.patches) == len(cost.LINKS) * len(widgets.STEP_PARTS)
    ends = {}
    for p in ax.patches:  # a bar's end: the right edge of its last part
        ends[p.get_y()] = max(ends.get(p.get_y(), 0.0), p.get_x() + p.get_width())
    assert sorted(ends.values()) == pytest.approx(sorted(t.total for t in times.values()))
    assert [t.get_text().split(",")[0] for t in ax.get_yticklabels()] == [lk.name for lk in cost.LINKS.values()]
    assert ax.get_title().endswith("by the link across nodes, " + cluster.NETWORKS["nic-per-gpu"])  # the preset's
    with pytest.raises(ValueError, match="times is empty"):
        widgets.link_step_figure({})


def test_calculator_recomputes_refuses_and_follows_a_preset():
    calc = widgets.cluster_calculator()
    text, png = calc.result.value, bytes(calc.plot.value)
    assert widgets.cluster_estimate()["summary"] in text and png.startswith(b"\x89PNG")
    calc.controls["pp"].value = 4
    assert calc.estimate() == widgets.cluster_estimate(pp=4) and "dp 32 × tp 8 × pp 4" in calc.result.value
    assert bytes(calc.plot.value) != png
    drawn = bytes(calc.plot.value)
    calc.controls["gpus"].value = 1000  # 1000 / (8·4) is no integer: the library's refusal, not a traceback
    library = _library_message("gpt3-175b-1024xA100", gpus=1000, pp=4, dp=31)  # dp = 1000 // 32
    assert calc.result.value == f"<b>cannot lay out this cluster: {library}</b>"
    assert bytes(calc.plot.value) == drawn  # the last plot is kept
    calc.controls["preset"].value = "gpt2-8xH100"  # every control follows the preset
    assert calc.estimate() == widgets.cluster_estimate("gpt2-8xH100")
    assert calc.controls["model"].value == "GPT-2 small (124M)" and calc.controls["gpus"].value == 8
    assert "GPT-2 small" in calc.result.value and bytes(calc.plot.value) != drawn
    calc.controls["tp"].value = 8
    assert "cannot lay out this cluster: tp=8 does not divide n_head=12" in calc.result.value
    calc.controls["tp"].value = 1
    calc.controls["network"].value = "nic-per-node"
    assert calc.estimate() == widgets.cluster_estimate("gpt2-8xH100", network="nic-per-node")
    calc.controls["network"].value = "nic-per-gpu"
    calc.controls["link"].value = "pcie4"
    calc.controls["model"].value = "GPT-2 XL (1.5B)"
    calc.controls["mfu"].value = 0.3
    assert calc.estimate() == widgets.cluster_estimate("gpt2-8xH100", "GPT-2 XL (1.5B)", link="pcie4", mfu=0.3)
    bundle, metadata = calc._repr_mimebundle_()
    assert metadata["image/png"]["width"] == int(calc.plot.layout.width.removesuffix("px"))  # shown at its size
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"] == calc.estimate()["summary"] and "PCIe 4.0" in bundle["text/plain"]
    assert base64.b64decode(bundle["image/png"]) == bytes(calc.plot.value)


def test_a_preset_redraws_once():
    calc = widgets.cluster_calculator("gpt2-8xH100")
    drawn = []
    calc.plot.observe(lambda change: drawn.append(change), names="value")
    calc.controls["preset"].value = "gpt3-175b-1024xA100"  # a dozen controls move, one figure is drawn
    assert len(drawn) == 1 and calc.estimate() == widgets.cluster_estimate()


def test_every_preset_is_a_stop_of_every_slider():
    calc = widgets.cluster_calculator()
    for name in cluster.PRESETS:
        calc.controls["preset"].value = name
        assert calc.estimate() == widgets.cluster_estimate(name)


def test_calculator_refuses_bad_starts():
    with pytest.raises(ValueError, match=r"\['dp'\] have no control"):
        widgets.cluster_calculator(dp=4)
    with pytest.raises(ValueError, match="tp=8 does not divide n_head=12"):
        widgets.cluster_calculator("gpt2-8xH100", tp=8)
    start = widgets.cluster_calculator("7b-64xH100", "GPT-3 6.7B", gpus=64, tokens=2e12)
    assert start.estimate() == widgets.cluster_estimate("7b-64xH100", "GPT-3 6.7B", tokens=2e12)
