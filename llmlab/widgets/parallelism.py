"""Chapter 2's explorers (parallelism, mixed precision): the pipeline schedule and the fp16 loss-scale explorer.

The arithmetic is llmlab.parallel.pipeline's (simulate, bubble_fraction, peak_in_flight) and llmlab.precision's
(representation), the timeline is drawn by llmlab.plots.plot_timeline; torch and matplotlib are imported only when
one of these runs.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from llmlab import precision
from llmlab.data import MarkovSource, SyntheticDataset
from llmlab.model import GPT, GPTConfig
from llmlab.parallel import pipeline
from llmlab.widgets.base import explorer, result_explorer

__all__ = ["PIPELINE_SCHEDULES", "pipeline_schedule", "format_pipeline", "pipeline_figure", "pipeline_explorer",
            "FP16_SUBNORMAL_MIN", "FP16_NORMAL_MIN", "FP16_MAX", "format_representation", "tiny_gpt_gradient",
            "gradient_underflow", "format_underflow", "gradient_figure", "precision_explorer"]

PIPELINE_SCHEDULES = {"1F1B (PipeDream-Flush)": "1f1b", "GPipe (all forward, all backward)": "gpipe"}
FP16_SUBNORMAL_MIN = 2.0**-24  # the smallest positive fp16 value: a magnitude below half of it rounds to 0
FP16_NORMAL_MIN = 2.0**-14  # below it fp16 is subnormal: fewer significant bits, down to 1 at 2^-24
FP16_MAX = 65504.0  # the largest finite fp16 value: a magnitude from 65520 on rounds to inf


def pipeline_schedule(stages: int = 4, micro_batches: int = 8, schedule: str = "1f1b",
                      backward_ratio: float = 2.0) -> dict:
    """`schedule` ('gpipe' or '1f1b') simulated on `stages` stages with `micro_batches` micro-batches, a forward
    taking 1 time unit and a backward `backward_ratio` units (`llmlab.parallel.pipeline.simulate`).

    Returns a dict: timeline (an llmlab.timeline.Timeline), bubble (the idle share measured on it), formula
    ((p−1)/(m+p−1)), makespan, ideal (m·(1 + backward_ratio): one stage's work with no bubble), peak_in_flight
    (per stage: the most micro-batches whose activations it holds at once), and the inputs.
    """

    timeline = pipeline.simulate(schedule, stages, micro_batches, t_forward=1.0, t_backward=backward_ratio)
    return {"stages": stages, "micro_batches": micro_batches, "schedule": schedule, "backward_ratio": backward_ratio,
            "timeline": timeline, "bubble": timeline.idle, "formula": pipeline.bubble_fraction(stages, micro_batches),
            "makespan": timeline.makespan, "ideal": micro_batches * (1.0 + backward_ratio),
            "peak_in_flight": pipeline.peak_in_flight(timeline)}


def format_pipeline(r: dict) -> str:
    """One line saying what `pipeline_schedule` found; it contains 'bubble' and the peak micro-batches held."""
    name = {"1f1b": "1F1B", "gpipe": "GPipe"}[r["schedule"]]
    peaks = ", ".join(map(str, r["peak_in_flight"]))
    return (f"{name}, p = {r['stages']} stages, m = {r['micro_batches']} micro-batches, backward = "
            f"{r['backward_ratio']:g}× forward: makespan {r['makespan']:.3g} vs {r['ideal']:.3g} of work per stage → "
            f"bubble {r['bubble']:.1%} (formula (p−1)/(m+p−1) = {r['formula']:.1%}); micro-batches held at peak, "
            f"stage 0 to {r['stages'] - 1}: {peaks}")


def pipeline_figure(r: dict):
    """A matplotlib Figure (not attached to pyplot) of `r`'s timeline, drawn by plots.plot_timeline."""
    from matplotlib.figure import Figure  # matplotlib loads in about a second: only when a figure is drawn

    from llmlab import plots  # pyplot loads with it: only when a figure is drawn, not on `import llmlab.widgets`

    height = 1.2 + 0.35 * r["stages"]  # inches: room for the title and the time axis, then a row per stage
    fig = Figure(figsize=(8, height))  # fixed margins: a layout engine would double the drawing time
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.5 / height, top=1 - 0.35 / height)
    ax = fig.add_subplot()
    name = {"1f1b": "1F1B", "gpipe": "GPipe"}[r["schedule"]]
    plots.plot_timeline(r["timeline"], ax=ax, xlabel="time (forward = 1)", title=f"{name}: bubble {r['bubble']:.0%} "
                        f"(formula {r['formula']:.0%}); blue forward, orange backward, numbers = micro-batch")
    ax.title.set_fontsize(9)
    return fig


def pipeline_explorer(stages: int = 4, micro_batches: int = 8, schedule: str = "1f1b", backward_ratio: float = 2.0):
    """A pipeline-schedule widget: stages p, micro-batches m, schedule and backward/forward time → the simulated
    timeline, its bubble next to (p−1)/(m+p−1), and the micro-batches each stage holds at its peak.

    `.result` (HTML) holds `format_pipeline(...)`, `.plot` (an Image widget) the timeline; `.controls` maps
    argument names to the controls; `.schedule()` returns the current `pipeline_schedule` dict.
    """
    import ipywidgets as w  # only when a widget is built: `import llmlab.widgets` loads no Jupyter

    pipeline_schedule(stages, micro_batches, schedule, backward_ratio)  # refuse bad defaults before building
    if not 1 <= stages <= 16 or not 1 <= micro_batches <= 64:
        raise ValueError(f"stages={stages} must be in [1, 16] and micro_batches={micro_batches} in [1, 64]")
    style, layout = {"description_width": "150px"}, w.Layout(width="480px")
    controls = {
        "stages": w.IntSlider(value=stages, min=1, max=16, description="stages p", style=style, layout=layout),
        "micro_batches": w.IntSlider(value=micro_batches, min=1, max=64, description="micro-batches m", style=style,
                                     layout=layout),
        "schedule": w.Dropdown(options=PIPELINE_SCHEDULES, value=schedule, description="schedule", style=style,
                               layout=layout),
        "backward_ratio": w.FloatSlider(value=backward_ratio, min=0.5, max=4.0, step=0.25, readout_format=".2f",
                                        description="t_backward / t_forward", style=style, layout=layout),
    }

    def current() -> dict:
        return pipeline_schedule(**{name: c.value for name, c in controls.items()})

    box = result_explorer(controls, current, format_pipeline, pipeline_figure, on_release=True)
    box.schedule = current
    return box


def format_representation(value: float) -> str:
    """A small table of how `value` is stored in fp32, fp16 and bf16 (`llmlab.precision.representation`)."""

    rep = precision.representation(value)
    lines = [f"value {value:.7g}", f"{'':6}{'stored':>16}{'rel. error':>12}  what happened"]
    for name, r in rep.items():
        if r["overflow"]:
            what = f"overflow: above {r['max']:.5g}, stored as inf"
        elif r["underflow"]:
            what = f"underflow: below half the smallest subnormal {r['tiny'] * r['eps']:.3g}, flushed to 0"
        elif r["subnormal"]:
            what = f"subnormal: below {r['tiny']:.3g}, fewer significant bits"
        else:
            what = "normal"
        lines.append(f"{name:<6}{r['stored']:>16.7g}{r['rel_error']:>12.2e}  {what}")
    return "\n".join(lines)


_GRADIENTS: dict = {}  # seed -> the tiny GPT's flat gradient, computed once per process


def _tiny_gpt_gradient(seed: int):
    if seed in _GRADIENTS:
        return _GRADIENTS[seed]

    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = GPT(GPTConfig.preset("tiny"))
    finally:
        torch.random.set_rng_state(generator_state)  # a widget must not move the notebook's random stream
    x, y = SyntheticDataset(MarkovSource(model.config.vocab_size), batch_size=16, block_size=64, seed=seed).get_batch(0)
    model(x, y)[1].backward()
    _GRADIENTS[seed] = torch.cat([p.grad.flatten() for p in model.parameters()])  # (n_params,) fp32
    return _GRADIENTS[seed]


def tiny_gpt_gradient(seed: int = 0):
    """The fp32 gradient of the tiny GPT at initialisation on one batch (16 × 64 tokens), flattened: (n_params,)."""
    return _tiny_gpt_gradient(seed).clone()


def gradient_underflow(log2_scale: float = 0.0, grads=None) -> dict:
    """What storing `grads` × 2^log2_scale in fp16 does to them (default: `tiny_gpt_gradient()`).

    Returns a dict: scale, n (nonzero gradient entries), underflow / subnormal / overflow (their fractions that
    fp16 flushes to 0, stores as subnormals, or turns into inf), log2_unscaled and log2_scaled (numpy arrays of
    log2 |g| and log2 |g·S| of the nonzero entries, for a histogram), and the inputs.
    """

    if not math.isfinite(log2_scale):
        raise ValueError(f"log2_scale={log2_scale!r} must be finite")
    g = tiny_gpt_gradient() if grads is None else torch.as_tensor(grads).detach().flatten()
    g = g[g != 0].double()  # exact zeros stay zeros in any format: not what scaling is about
    if not g.numel():
        raise ValueError("grads has no nonzero entry")
    scale = 2.0**log2_scale
    stored = (g * scale).to(torch.float16)  # what an fp16 backward would hold, rounded once
    magnitude = stored.abs()
    return {"log2_scale": log2_scale, "scale": scale, "n": g.numel(),
            "underflow": (stored == 0).double().mean().item(),
            "subnormal": ((magnitude > 0) & (magnitude < FP16_NORMAL_MIN)).double().mean().item(),
            "overflow": torch.isinf(stored).double().mean().item(),
            "log2_unscaled": g.abs().log2().numpy(), "log2_scaled": (g.abs() * scale).log2().numpy()}


def format_underflow(r: dict) -> str:
    """One line saying what `gradient_underflow` found; it contains 'underflow'."""
    return (f"loss scale 2^{r['log2_scale']:g}: of {r['n']:,} nonzero gradient entries stored in fp16, "
            f"{r['underflow']:.2%} underflow to 0, {r['subnormal']:.2%} are subnormal (lose bits), "
            f"{r['overflow']:.2%} overflow to inf")


def gradient_figure(r: dict):
    """A matplotlib Figure (not attached to pyplot): the histogram of log2 |g| unscaled and × the loss scale,
    with fp16's ranges shaded (flushed to 0, subnormal, overflow)."""
    from matplotlib.figure import Figure  # matplotlib loads in about a second: only when a figure is drawn

    fig = Figure(figsize=(7.5, 3.4))
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.15, top=0.84)
    ax = fig.add_subplot()
    both = np.concatenate([r["log2_unscaled"], r["log2_scaled"]])
    lo, hi = min(-40.0, float(np.floor(both.min()))), max(20.0, float(np.ceil(both.max())) + 1)
    bins = np.arange(lo, hi + 0.5, 0.5)
    zero, normal, top = math.log2(FP16_SUBNORMAL_MIN) - 1, math.log2(FP16_NORMAL_MIN), math.log2(FP16_MAX)
    ax.axvspan(lo, zero, color="C3", alpha=0.15, label="fp16 flushes to 0")
    ax.axvspan(zero, normal, color="C1", alpha=0.15, label="fp16 subnormal")
    ax.axvspan(top, hi, color="C4", alpha=0.15, label="fp16 overflows (inf)")
    ax.hist(r["log2_unscaled"], bins=bins, histtype="step", color="grey", label="gradient, unscaled")
    if r["log2_scale"]:
        ax.hist(r["log2_scaled"], bins=bins, color="C0", alpha=0.7, label=f"× loss scale 2^{r['log2_scale']:g}")
    ax.set(yscale="log", xlim=(lo, hi), xlabel="log2 |gradient entry|", ylabel="entries")
    ax.set_title(f"{r['underflow']:.2%} flushed to 0, {r['subnormal']:.2%} subnormal, {r['overflow']:.2%} inf in fp16",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    return fig


def precision_explorer(value: float = 1e-8, log2_scale: int = 0, grads=None):
    """A precision widget: a value → how fp32, fp16 and bf16 store it; a loss-scale slider (log2) → what fp16
    does to a real gradient (`grads`, default the tiny GPT's) scaled by it, as a histogram.

    `.result` (HTML) holds `format_representation(value)` and `format_underflow(...)`, `.plot` (an Image) the
    histogram; `.controls` maps 'value' and 'log2_scale' to their controls; `.underflow()` returns the current
    `gradient_underflow` dict.
    """
    import ipywidgets as w  # only when a widget is built: `import llmlab.widgets` loads no Jupyter

    format_representation(value)  # refuse a bad default before building
    if isinstance(log2_scale, bool) or not isinstance(log2_scale, int) or not 0 <= log2_scale <= 40:
        raise ValueError(f"log2_scale={log2_scale!r} must be an int in [0, 40]")
    if grads is not None:
        gradient_underflow(0, grads)
    style = {"description_width": "130px"}
    controls = {"value": w.FloatText(value=value, description="value", style=style),
                "log2_scale": w.IntSlider(value=log2_scale, min=0, max=40, description="loss scale log2 S",
                                          continuous_update=False, style=style, layout=w.Layout(width="480px"))}

    def current() -> dict:
        return gradient_underflow(controls["log2_scale"].value, grads)

    def render(change):
        try:
            rep = format_representation(float(controls["value"].value))
        except ValueError as e:  # inf or nan typed in: say so instead of raising
            rep = f"cannot represent: {e}"
        r = current()
        redraw = change is None or change["owner"] is controls["log2_scale"]  # a new value keeps the histogram
        return f"{rep}\n{format_underflow(r)}", gradient_figure(r) if redraw else None

    box = explorer(controls, render, preformatted=True)
    box.underflow = current
    return box
