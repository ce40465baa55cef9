"""Chapter 6's explorer (tuning): the learning rate per update of a warmup schedule (`llmlab.train.schedule`).

The LRs are `LRSchedule.lrs()`, the very schedule `llmlab.train.Trainer` uses; this module only arranges them,
next to the other warmup formula, so that the material's LR of 0 at update 0 is in view.
"""

from __future__ import annotations

from llmlab.train.schedule import DECAYS, WARMUP_FORMULAS, LRSchedule
from llmlab.widgets.base import choices, count, result_explorer

__all__ = ["WARMUP_FORMULA_TEXT", "warmup_schedule", "format_warmup_schedule", "warmup_schedule_figure",
           "warmup_schedule_explorer"]

# how each of llmlab.train.schedule.WARMUP_FORMULAS ramps the LR over update `step` < warmup
WARMUP_FORMULA_TEXT = {"shifted": "base_lr·(step+1)/warmup",
                       "material": "base_lr·step/warmup (the material's, Hugging Face's)"}
ZOOM_STEPS = 10  # the right panel: the first updates, one marker each


def warmup_schedule(warmup: int = 20, base_lr: float = 1e-3, min_lr: float = 1e-4, total_steps: int = 200,
                    decay: str = "cosine", warmup_formula: str = "shifted") -> dict:
    """The LR of every update of `LRSchedule(base_lr, total_steps, warmup, decay, min_lr, warmup_formula)`, and of
    the same schedule with the other warmup formula (`compare_formula`) for comparison.

    Returns a dict: lrs and compare_lrs (one LR per update 0..total_steps-1), lr0 and compare_lr0 (update 0's),
    peak_lr and peak_step (the first update at the peak), final_lr, the schedule, and its parameters. A setting
    the schedule refuses (warmup > total_steps, an LR <= 0, min_lr > base_lr, an unknown decay) raises its
    ValueError unchanged.
    """

    schedule = LRSchedule(base_lr, total_steps, warmup, decay, min_lr, warmup_formula)
    other = next(f for f in WARMUP_FORMULAS if f != warmup_formula)
    compare = LRSchedule(base_lr, total_steps, warmup, decay, min_lr, other)
    lrs = schedule.lrs()
    peak = max(lrs)
    # the ramp's last LR, base_lr·w/w, and the cosine's first, min + (base − min)·1, may differ in the last bit
    peak_step = next(s for s, lr in enumerate(lrs) if lr >= peak * (1 - 1e-12))
    return {**schedule.state_dict(), "schedule": schedule, "lrs": lrs, "compare_formula": other,
            "compare_lrs": compare.lrs(), "lr0": lrs[0], "compare_lr0": compare.lr(0), "peak_lr": peak,
            "peak_step": peak_step, "final_lr": lrs[-1]}


def _first(lr: float) -> str:
    return f"{lr:.3g}" + (" (no weight moves)" if lr == 0 else "")


def format_warmup_schedule(r: dict) -> str:
    """One line saying what `warmup_schedule` found: update 0's LR under both formulas, the peak, the last LR."""
    ramp = (f"warmup over {r['warmup']} updates, {WARMUP_FORMULA_TEXT[r['warmup_formula']]}" if r["warmup"]
            else "no warmup")
    decay = f"cosine to {r['min_lr']:.3g}" if r["decay"] == "cosine" else "constant"
    return (f"{ramp}, then {decay}, {count(r['total_steps'])} updates: update 0 at LR {_first(r['lr0'])} "
            f"({r['compare_formula']} formula: {_first(r['compare_lr0'])}); peak {r['peak_lr']:.3g} first at "
            f"update {r['peak_step']}; last update at {r['final_lr']:.3g}")


def warmup_schedule_figure(r: dict):
    """LR against update for `r`'s schedule (solid) and the other warmup formula (dashed): the whole run on the
    left, the first updates on the right, where the material's LR of 0 at update 0 shows. A matplotlib Figure,
    not attached to pyplot."""
    from matplotlib.figure import Figure  # matplotlib loads in about a second: only when a figure is drawn

    fig = Figure(figsize=(9.6, 3.6))
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.15, top=0.88, wspace=0.25)
    whole, first = fig.subplots(1, 2, gridspec_kw={"width_ratios": (2, 1)})
    zoom = min(r["total_steps"], ZOOM_STEPS)
    curves = ((r["warmup_formula"], r["lrs"], "C0", "-"), (r["compare_formula"], r["compare_lrs"], "C1", "--"))
    for formula, lrs, color, ls in curves:
        label = f"{formula}: {WARMUP_FORMULA_TEXT[formula]}"
        whole.plot(range(r["total_steps"]), lrs, color=color, ls=ls, label=label)
        whole.plot([0], [lrs[0]], "o", color=color, ms=4)
        first.plot(range(zoom), lrs[:zoom], "o", color=color, ls=ls, mfc="none" if ls == "--" else color, label=label)
    for ax, shown in ((whole, r["total_steps"]), (first, zoom)):
        if r["peak_step"] < shown:
            ax.axvline(r["peak_step"], color="grey", ls=":", lw=1, label=f"peak at update {r['peak_step']}")
        ax.set(xlabel="update (optimizer step)", ylabel="learning rate")
    whole.set_title(f"warmup {r['warmup']}, then {r['decay']}: the whole run", fontsize=10)
    first.set_title(f"the first {zoom} updates", fontsize=10)
    whole.legend(fontsize=7)
    return fig


def warmup_schedule_explorer(warmup: int = 20, base_lr: float = 1e-3, min_lr: float = 1e-4, total_steps: int = 200,
                             decay: str = "cosine", warmup_formula: str = "shifted"):
    """A warmup schedule widget: warmup steps, peak LR, min LR, total steps, decay (`schedule.DECAYS`) and warmup
    formula (`schedule.WARMUP_FORMULAS`) → the LR per update (`warmup_schedule`), drawn against the other formula.
    `.result` (HTML) holds `format_warmup_schedule(...)`, `.plot` (an Image) the figure, `.controls` the
    controls, `.schedule()` the current result; a setting the schedule refuses is shown with its message.
    """
    import ipywidgets as w  # only when a widget is built: `import llmlab.widgets` loads no Jupyter

    warmup_schedule(warmup, base_lr, min_lr, total_steps, decay, warmup_formula)  # refuse bad defaults first
    style, layout = {"description_width": "110px"}, w.Layout(width="480px")
    lr_label = lambda v: f"{v:g}"
    with_zero = lambda stops: stops if stops[0][1] == 0 else [("0", 0), *stops]  # no warmup / no floor
    controls = {
        "warmup": w.SelectionSlider(options=with_zero(choices(warmup, range(0, 4), count)), value=warmup,
                                    description="warmup steps", style=style, layout=layout),
        "base_lr": w.SelectionSlider(options=choices(base_lr, range(-5, 0), lr_label), value=base_lr,
                                     description="peak LR", style=style, layout=layout),
        "min_lr": w.SelectionSlider(options=with_zero(choices(min_lr, range(-6, -1), lr_label)), value=min_lr,
                                    description="min LR", style=style, layout=layout),
        "total_steps": w.SelectionSlider(options=choices(total_steps, range(1, 5), count), value=total_steps,
                                         description="total steps", style=style, layout=layout),
        "decay": w.ToggleButtons(options=DECAYS, value=decay, description="decay", style=style),
        "warmup_formula": w.ToggleButtons(options=WARMUP_FORMULAS, value=warmup_formula, description="warmup",
                                          tooltips=[WARMUP_FORMULA_TEXT[f] for f in WARMUP_FORMULAS], style=style),
    }

    def current() -> dict:
        return warmup_schedule(**{name: c.value for name, c in controls.items()})

    box = result_explorer(controls, current, format_warmup_schedule, warmup_schedule_figure,
                          refused="cannot schedule this")
    box.schedule = current
    return box
