"""Chapter 6's widget: the warmup schedule explorer against llmlab.train.schedule, built headlessly, driven, and
carrying a static result."""

import base64

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from llmlab import widgets  # noqa: E402
from llmlab.train.schedule import DECAYS, LRSchedule, material_warmup_lr, warmup_cosine_lr  # noqa: E402

SETTINGS = [dict(warmup=20, base_lr=1e-3, min_lr=1e-4, total_steps=200),
            dict(warmup=0, base_lr=3e-2, min_lr=0.0, total_steps=60),
            dict(warmup=7, base_lr=5e-4, min_lr=5e-4, total_steps=7),  # all warmup, no decay left
            dict(warmup=1, base_lr=1.0, min_lr=0.5, total_steps=2),
            dict(warmup=500, base_lr=6e-4, min_lr=6e-5, total_steps=5000)]


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("formula", ["shifted", "material"])
def test_the_lrs_are_the_library_schedule(setting, decay, formula):
    r = widgets.warmup_schedule(**setting, decay=decay, warmup_formula=formula)
    other = "material" if formula == "shifted" else "shifted"
    args = (setting["base_lr"], setting["total_steps"], setting["warmup"], decay, setting["min_lr"])
    # the same function of the same numbers: equal, not approximately equal
    assert r["lrs"] == LRSchedule(*args, warmup_formula=formula).lrs()
    assert r["compare_lrs"] == LRSchedule(*args, warmup_formula=other).lrs() and r["compare_formula"] == other
    assert r["schedule"].state_dict() == {k: r[k] for k in r["schedule"].state_dict()}
    assert (r["lr0"], r["compare_lr0"], r["final_lr"]) == (r["lrs"][0], r["compare_lrs"][0], r["lrs"][-1])
    # the ramp's last LR and the cosine's first are both the peak, up to the last bit of a float64 (rel 1e-12)
    assert r["peak_lr"] == max(r["lrs"]) and r["lrs"][r["peak_step"]] == pytest.approx(r["peak_lr"], rel=1e-12)
    assert all(lr < r["peak_lr"] * (1 - 1e-12) for lr in r["lrs"][:r["peak_step"]])  # the *first* update at it


def test_against_the_formulas_and_the_materials_step_zero():
    r = widgets.warmup_schedule(warmup=20, base_lr=1e-3, min_lr=1e-4, total_steps=200)
    assert r["lrs"] == [warmup_cosine_lr(s, 1e-3, 20, 200, 1e-4) for s in range(200)]
    assert r["compare_lrs"][:20] == [material_warmup_lr(s, 1e-3, 20) for s in range(20)]
    assert r["compare_lr0"] == 0.0 and r["lr0"] == pytest.approx(1e-3 / 20)
    assert r["peak_step"] == 19  # the shifted ramp reaches the peak one update before the material's
    assert widgets.warmup_schedule(warmup=20, warmup_formula="material")["peak_step"] == 20
    assert widgets.warmup_schedule(warmup=0)["peak_step"] == 0
    text = widgets.format_warmup_schedule(r)
    assert "warmup over 20 updates" in text and "update 0 at LR 5e-05" in text
    assert "material formula: 0 (no weight moves)" in text and "first at update 19" in text
    assert "no warmup" in widgets.format_warmup_schedule(widgets.warmup_schedule(warmup=0))


def test_bad_settings_are_refused_with_the_librarys_message():
    for bad, args in ((dict(warmup=300, total_steps=200), (1e-3, 200, 300)),
                      (dict(base_lr=-1e-3), (-1e-3, 200, 20)),
                      (dict(min_lr=-1e-4), (1e-3, 200, 20, "cosine", -1e-4)),
                      (dict(min_lr=1e-2), (1e-3, 200, 20, "cosine", 1e-2)),
                      (dict(decay="linear"), (1e-3, 200, 20, "linear", 1e-4)),
                      (dict(warmup_formula="step"), (1e-3, 200, 20, "cosine", 1e-4, "step"))):
        with pytest.raises(ValueError) as ours:
            widgets.warmup_schedule(**bad)
        with pytest.raises(ValueError) as library:
            LRSchedule(*args)
        assert str(ours.value) == str(library.value)
    with pytest.raises(ValueError, match="warmup=300 must be <= total_steps=200"):
        widgets.warmup_schedule_explorer(warmup=300)


def test_figure_draws_both_formulas_and_the_peak():
    r = widgets.warmup_schedule(warmup=20, total_steps=200)
    whole, first = widgets.warmup_schedule_figure(r).axes
    lines = {line.get_label(): line for line in whole.lines}
    shifted = lines[f"shifted: {widgets.WARMUP_FORMULA_TEXT['shifted']}"]
    material = lines[f"material: {widgets.WARMUP_FORMULA_TEXT['material']}"]
    assert list(shifted.get_ydata()) == r["lrs"] and list(material.get_ydata()) == r["compare_lrs"]
    assert lines["peak at update 19"].get_xdata()[0] == 19
    assert len(first.lines[0].get_xdata()) == widgets.tuning.ZOOM_STEPS
    assert first.lines[1].get_ydata()[0] == 0.0  # the material's update 0, in the zoomed panel
    assert all(ax.get_xlabel() and ax.get_ylabel() for ax in (whole, first))


def test_explorer_recomputes_redraws_and_refuses():
    explorer = widgets.warmup_schedule_explorer(warmup=20, base_lr=3e-2, min_lr=3e-3, total_steps=60)
    text, png = explorer.result.value, bytes(explorer.plot.value)
    assert "warmup over 20 updates" in text and "60 updates" in text and png.startswith(b"\x89PNG")
    assert explorer.schedule()["lrs"] == LRSchedule(3e-2, 60, 20, "cosine", 3e-3).lrs()
    explorer.controls["warmup_formula"].value = "material"
    assert "update 0 at LR 0 (no weight moves)" in explorer.result.value and bytes(explorer.plot.value) != png
    explorer.controls["warmup"].value = 100  # more warmup than updates: the schedule refuses, the widget says why
    assert "cannot schedule this: warmup=100 must be &lt;= total_steps=60" in explorer.result.value
    explorer.controls["total_steps"].value = 1000
    explorer.controls["decay"].value = "constant"
    explorer.controls["base_lr"].value = 1e-3
    explorer.controls["min_lr"].value = 0
    r = explorer.schedule()
    assert (r["warmup"], r["total_steps"], r["decay"], r["base_lr"], r["min_lr"], r["warmup_formula"]) == (
        100, 1000, "constant", 1e-3, 0, "material")
    assert r["lrs"] == LRSchedule(1e-3, 1000, 100, "constant", 0, "material").lrs()
    bundle, metadata = explorer._repr_mimebundle_()
    assert metadata["image/png"]["width"] == int(explorer.plot.layout.width.removesuffix("px"))  # shown at its size
    assert "application/vnd.jupyter.widget-view+json" in bundle  # the live widget, for JupyterLab
    assert "warmup over 100 updates" in bundle["text/plain"] and "1k updates" in bundle["text/plain"]
    assert base64.b64decode(bundle["image/png"]) == bytes(explorer.plot.value)  # the static fallback


def test_slider_stops_hold_the_defaults_exactly():
    explorer = widgets.warmup_schedule_explorer(warmup=37, base_lr=3e-2, min_lr=0.0, total_steps=60)
    values = {name: c.value for name, c in explorer.controls.items()}
    assert values == dict(warmup=37, base_lr=3e-2, min_lr=0.0, total_steps=60, decay="cosine",
                          warmup_formula="shifted")
    assert [v for _, v in explorer.controls["warmup"].options][:3] == [0, 1, 2]  # "no warmup" is a stop
    assert [v for _, v in explorer.controls["min_lr"].options].count(0) == 1
