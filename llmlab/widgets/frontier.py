"""Chapter 8's explorers (emerging techniques): MoE routing and the quantization grid.

The arithmetic is llmlab.moe's (route) and llmlab.quant's (LSQQuantizer, MinMaxQuantizer); torch is imported only
when one of these runs.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from llmlab import validation
from llmlab.model import GPT, GPTConfig
from llmlab.moe import route
from llmlab.quant import LSQQuantizer, MinMaxQuantizer
from llmlab.widgets.base import result_explorer

__all__ = ["MOE_CAPACITY_FACTORS", "moe_routing", "format_moe_routing", "moe_routing_figure", "moe_routing_explorer",
            "tiny_gpt_weight", "quant_grid", "format_quant_grid", "quant_grid_figure", "quant_explorer"]

MOE_CAPACITY_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, None)  # the explorer's stops; None = dropless


def moe_routing(num_experts: int = 8, k: int = 2, capacity_factor: float | None = 1.25, skew: float = 0.0,
                tokens: int = 256, seed: int = 0, shown: int = 24) -> dict:
    """Route `tokens` tokens with `llmlab.moe.route`: router logits are standard normal plus a preference of
    `skew`·(1 − 2e/(E−1)) for expert e (0: a random, balanced router; larger: expert 0 is favoured, the last one
    avoided, as a router does on its way to collapse).

    Returns a dict: load (E,) assignments per expert before capacity, kept (E,) after it, capacity (slots per
    expert; None when dropless), drop_rate (of the k·T assignments), tokens_lost (fraction of tokens all of whose
    choices were dropped: only the residual carries them), balance_loss (N·Σ fᵢ·Pᵢ, 1 when uniform), z_loss,
    gates (shown × E: each of the first `shown` tokens' gate per expert, 0 where not chosen), dropped (shown × E
    bool: a choice that lost its slot), and the inputs. Lists and floats, so a test or a plot reads it directly.
    """

    validation.integer("num_experts", num_experts, low=1)
    validation.integer("k", k, 1, num_experts, hint="(experts per token, at most num_experts)")
    validation.integer("tokens", tokens, low=1)
    validation.integer("shown", shown, low=0)
    if capacity_factor is not None:
        validation.positive("capacity_factor", capacity_factor, hint="(or None: dropless)")
    if not math.isfinite(skew):
        raise ValueError(f"skew={skew!r} must be finite")
    g = torch.Generator().manual_seed(seed)  # its own generator: the notebook's random stream is left alone
    preference = 1 - 2 * torch.arange(num_experts) / max(num_experts - 1, 1)  # (E,) from +1 down to −1
    logits = torch.randn(tokens, num_experts, generator=g) + skew * preference  # (T, E)
    r = route(logits, k, capacity_factor)
    shown = min(shown, tokens)
    gates = torch.zeros(tokens, num_experts).scatter(1, r.expert, r.gate)  # (T, E)
    dropped = torch.zeros(tokens, num_experts, dtype=torch.bool).scatter(1, r.expert, r.dropped)  # (T, E)
    return {"num_experts": num_experts, "k": k, "capacity_factor": capacity_factor, "skew": skew, "tokens": tokens,
            "seed": seed, "load": r.load.tolist(), "kept": r.counts.tolist(), "capacity": r.capacity,
            "drop_rate": r.drop_rate, "tokens_lost": r.dropped.all(-1).double().mean().item(),
            "balance_loss": r.balance_loss.item(), "z_loss": r.z_loss.item(),
            "gates": gates[:shown].tolist(), "dropped": dropped[:shown].tolist()}


def format_moe_routing(r: dict) -> str:
    """One line saying what `moe_routing` found; it contains 'drop rate' and 'balance loss'."""
    cap = "dropless (no capacity)" if r["capacity"] is None else (
        f"capacity ⌈{r['k']}·{r['tokens']}/{r['num_experts']} × {r['capacity_factor']:g}⌉ = {r['capacity']} slots")
    return (f"top-{r['k']} of {r['num_experts']} experts, {r['tokens']} tokens, router skew {r['skew']:g}: {cap}; "
            f"busiest expert {max(r['load'])} assignments, idlest {min(r['load'])} (even: "
            f"{r['k'] * r['tokens'] / r['num_experts']:.3g}); drop rate {r['drop_rate']:.1%} of assignments, "
            f"{r['tokens_lost']:.1%} of tokens lose every choice; balance loss N·Σf·P = {r['balance_loss']:.3f} "
            "(1 = uniform)")


def moe_routing_figure(r: dict):
    """A matplotlib Figure (not attached to pyplot): assignments per expert, kept and dropped, with the capacity
    line; and the first tokens' gates as a tokens × experts heat map, dropped choices crossed out."""
    from matplotlib.figure import Figure  # matplotlib loads in about a second: only when a figure is drawn

    fig = Figure(figsize=(9, 3.4))  # fixed margins: a layout engine would double the drawing time
    fig.subplots_adjust(left=0.07, right=0.93, bottom=0.16, top=0.86, wspace=0.3)
    bars, heat = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    experts = np.arange(r["num_experts"])
    kept, load = np.array(r["kept"]), np.array(r["load"])
    bars.bar(experts, kept, color="C0", label="kept")
    bars.bar(experts, load - kept, bottom=kept, color="C3", alpha=0.6, label="dropped")
    bars.axhline(r["k"] * r["tokens"] / r["num_experts"], color="grey", ls=":", lw=1, label="even load")
    if r["capacity"] is not None:
        bars.axhline(r["capacity"], color="k", ls="--", lw=1, label=f"capacity {r['capacity']}")
    bars.set(xlabel="expert", ylabel="assignments", title=f"drop rate {r['drop_rate']:.1%}, balance loss "
             f"{r['balance_loss']:.2f}")
    bars.title.set_fontsize(9)
    bars.legend(fontsize=7)
    gates, dropped = np.array(r["gates"]), np.array(r["dropped"], dtype=bool)
    image = heat.imshow(gates.T, aspect="auto", cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    t, e = np.nonzero(dropped)
    heat.plot(t, e, "x", color="C3", ms=6, mew=1.5)
    heat.set(xlabel=f"token (the first {gates.shape[0]})", ylabel="expert",
             title="gate of each chosen expert (× = dropped: over capacity)")
    heat.title.set_fontsize(9)
    fig.colorbar(image, ax=heat, fraction=0.05, pad=0.02)
    return fig


def moe_routing_explorer(num_experts: int = 8, k: int = 2, capacity_factor: float | None = 1.25, skew: float = 0.0,
                         tokens: int = 256):
    """A MoE routing widget: experts E, top-k, capacity factor (or dropless) and router skew → load per expert with
    the capacity line, the tokens × experts gates, the drop rate and the balance loss (`moe_routing`).

    `.result` (HTML) holds `format_moe_routing(...)`, `.plot` (an Image widget) the figure; `.controls` maps
    argument names to the controls (the capacity factor's holds a label: '1.25', 'dropless'); `.routing()`
    returns the current `moe_routing` dict.
    """
    import ipywidgets as w  # only when a widget is built: `import llmlab.widgets` loads no Jupyter

    moe_routing(num_experts, k, capacity_factor, skew, tokens)  # refuse bad defaults before building
    validation.one_of("capacity_factor", capacity_factor, MOE_CAPACITY_FACTORS, hint="(the explorer's stops)")
    validation.integer("num_experts", num_experts, 1, 64, hint="(for the explorer)")
    validation.number("skew", skew, 0, 4, hint="(for the explorer)")
    style, layout = {"description_width": "130px"}, w.Layout(width="460px")
    label = lambda cf: "dropless" if cf is None else f"{cf:g}"  # noqa: E731
    labels = {label(cf): cf for cf in MOE_CAPACITY_FACTORS}  # the slider holds the label ('1.25', 'dropless')
    controls = {
        "num_experts": w.IntSlider(value=num_experts, min=1, max=64, description="experts E", style=style,
                                   layout=layout),
        "k": w.IntSlider(value=k, min=1, max=4, description="top-k", style=style, layout=layout),
        "capacity_factor": w.SelectionSlider(options=list(labels), value=label(capacity_factor),  # None is no value
                                             description="capacity factor", style=style, layout=layout),
        "skew": w.FloatSlider(value=skew, min=0.0, max=4.0, step=0.25, description="router skew", style=style,
                              layout=layout),
    }

    def current() -> dict:
        v = {name: c.value for name, c in controls.items()}
        v["k"] = min(v["k"], v["num_experts"])  # k > E is no routing at all: take every expert
        v["capacity_factor"] = labels[v["capacity_factor"]]
        return moe_routing(**v, tokens=tokens)

    box = result_explorer(controls, current, format_moe_routing, moe_routing_figure, on_release=True)
    box.routing = current
    return box


_WEIGHTS: dict = {}  # (seed, name) -> a weight of the tiny GPT at initialisation, made once per process


def tiny_gpt_weight(name: str = "transformer.h.0.mlp.c_fc.weight", seed: int = 0):
    """A copy of one weight of the tiny GPT at initialisation (N(0, 0.02²), as GPT-2's): by default the first MLP's
    c_fc weight, (256, 64)."""

    if (seed, name) not in _WEIGHTS:
        generator_state = torch.random.get_rng_state()
        try:
            torch.manual_seed(seed)
            params = dict(GPT(GPTConfig.preset("tiny")).named_parameters())
        finally:
            torch.random.set_rng_state(generator_state)  # a widget must not move the notebook's random stream
        if name not in params:
            raise ValueError(f"name={name!r} is not a parameter of the tiny GPT; choose from {list(params)}")
        _WEIGHTS[seed, name] = params[name].detach().clone()
    return _WEIGHTS[seed, name].clone()


def _fake_quantize(w, bits: int, signed: bool, step: float):
    """w fake-quantized by an LSQQuantizer with its step set to `step` (llmlab.quant; the zero point is 0)."""

    q = LSQQuantizer(bits, signed=signed)
    with torch.no_grad():
        q.step.fill_(step)
        q.initialized.fill_(True)
        return q(w), q.q_min, q.q_max


def _minmax(w, bits: int, signed: bool):
    """(ŵ, step) of a MinMaxQuantizer that has seen w: the grid spread over w's [min, max] (with a zero point when
    unsigned)."""

    quantizer = MinMaxQuantizer(bits, signed=signed)
    with torch.no_grad():
        w_hat = quantizer(w)  # training mode: observes w first
    return w_hat, quantizer.qparams()[0].item()


def _lsq_step(w, bits: int, signed: bool) -> float:
    """LSQ's initial step for w, 2·mean|w|/√Q_P, as LSQQuantizer.init_step computes it."""

    quantizer = LSQQuantizer(bits, signed=signed)
    quantizer.init_step(w)
    return quantizer.step.item()


def _relative_error(w, w_hat) -> float:
    return ((w_hat - w).norm() / w.norm()).item()


def quant_grid(bits: int = 4, signed: bool = True, step: float | None = None, weights=None) -> dict:
    """`weights` (default: `tiny_gpt_weight()`) fake-quantized on a b-bit grid of step `step` (default: LSQ's
    initial step 2·mean|w|/√Q_P), zero point 0, with llmlab.quant's quantizers.

    Returns a dict: levels (the grid's values q·s), q_min, q_max, w and w_hat (numpy arrays, flattened),
    rel_error (‖ŵ − w‖/‖w‖), clipped (fraction of w beyond the grid's ends), used (how many levels some weight
    lands on), minmax_step and lsq_step (the two quantizers' steps for these weights: MinMax spreads the grid over
    [min, max], with a zero point when unsigned), bits_range with minmax_error and lsq_error (the relative error
    of a MinMaxQuantizer and of LSQ at its initial step, per bit width), and the inputs.
    """

    validation.integer("bits", bits, 2, 16)
    validation.boolean("signed", signed)
    w = (tiny_gpt_weight() if weights is None else torch.as_tensor(weights).detach().float()).flatten()  # (N,)
    if not w.numel() or not torch.isfinite(w).all() or not w.abs().max() > 0:
        raise ValueError("weights must be a non-empty, finite, not all-zero tensor")
    minmax_step, lsq_step = _minmax(w, bits, signed)[1], _lsq_step(w, bits, signed)
    step = lsq_step if step is None else step
    if not math.isfinite(validation.positive("step", step)):
        raise ValueError(f"step={step!r} must be a finite positive number")
    w_hat, q_min, q_max = _fake_quantize(w, bits, signed, float(step))
    levels = torch.arange(q_min, q_max + 1) * step  # (2^b,)
    bits_range = list(range(2, 9))
    errors = {"minmax": [], "lsq": []}
    for b in bits_range:
        errors["minmax"].append(_relative_error(w, _minmax(w, b, signed)[0]))
        errors["lsq"].append(_relative_error(w, _fake_quantize(w, b, signed, _lsq_step(w, b, signed))[0]))
    return {"bits": bits, "signed": signed, "step": float(step), "q_min": q_min, "q_max": q_max,
            "levels": levels.numpy(), "w": w.numpy(), "w_hat": w_hat.numpy(),
            "rel_error": _relative_error(w, w_hat),
            "clipped": ((w < (q_min - 0.5) * step) | (w > (q_max + 0.5) * step)).double().mean().item(),
            "used": int(torch.unique(w_hat).numel()), "minmax_step": minmax_step, "lsq_step": lsq_step,
            "bits_range": bits_range, "minmax_error": errors["minmax"], "lsq_error": errors["lsq"]}


def format_quant_grid(r: dict) -> str:
    """One line saying what `quant_grid` found; it contains 'error' and 'clipped'."""
    kind = "signed" if r["signed"] else "unsigned"
    return (f"{r['bits']}-bit {kind} grid [{r['q_min']}, {r['q_max']}] × step {r['step']:.3g} (MinMax's "
            f"{r['minmax_step']:.3g}, LSQ's initial {r['lsq_step']:.3g}): {r['used']} of {len(r['levels'])} levels "
            f"used, {r['clipped']:.2%} of {len(r['w']):,} weights clipped, relative error ‖ŵ−w‖/‖w‖ = "
            f"{r['rel_error']:.2%}")


def quant_grid_figure(r: dict):
    """A matplotlib Figure (not attached to pyplot): the weights' histogram with the grid's levels and how many
    weights land on each; and the relative error against bits for MinMax's and LSQ's step, this grid marked."""
    from matplotlib.figure import Figure  # matplotlib loads in about a second: only when a figure is drawn

    fig = Figure(figsize=(9, 3.4))
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.16, top=0.86, wspace=0.28)
    hist, err = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    w, levels = r["w"], r["levels"]
    lo, hi = min(w.min(), levels[0]) * 1.05, max(w.max(), levels[-1]) * 1.05
    hist.hist(w, bins=120, range=(lo, hi), color="grey", alpha=0.6, label="weights w")
    values, counts = np.unique(r["w_hat"], return_counts=True)
    if len(levels) <= 64:
        for level in levels:
            hist.axvline(level, color="C0", lw=0.5, alpha=0.5)
    hist.vlines(values, 0, counts / max(counts.max(), 1) * hist.get_ylim()[1], color="C0", lw=2,
                label="ŵ: weights per level (scaled)")
    hist.axvspan(lo, (r["q_min"] - 0.5) * r["step"], color="C3", alpha=0.1, label="clipped")
    hist.axvspan((r["q_max"] + 0.5) * r["step"], hi, color="C3", alpha=0.1)
    hist.set(xlim=(lo, hi), xlabel="value", ylabel="weights", title=f"{r['bits']}-bit grid, step {r['step']:.3g}: "
             f"error {r['rel_error']:.1%}, {r['clipped']:.1%} clipped")
    hist.title.set_fontsize(9)
    hist.legend(fontsize=7, loc="upper left")
    err.plot(r["bits_range"], r["minmax_error"], "o-", label="MinMax step (grid over [min, max])")
    err.plot(r["bits_range"], r["lsq_error"], "s-", label="LSQ's initial step 2·mean|w|/√Q_P")
    err.plot(r["bits"], r["rel_error"], "*", color="C3", ms=12, label="this grid")
    err.set(yscale="log", xlabel="bits", ylabel="‖ŵ − w‖ / ‖w‖", title="quantization error vs bits")
    err.title.set_fontsize(9)
    err.legend(fontsize=7)
    return fig


def quant_explorer(bits: int = 4, signed: bool = True, step: float | None = None, weights=None):
    """A quantization widget: bits, signed or unsigned, and the step size (log slider; default LSQ's initial step)
    → the grid over the weights' histogram, the clipped share and the error, next to the error vs bits of
    MinMax's and LSQ's step rules (`quant_grid`).

    `.result` (HTML) holds `format_quant_grid(...)`, `.plot` (an Image widget) the figure; `.controls` maps
    'bits', 'signed' and 'step' to the controls (moving bits or signed resets the step to LSQ's initial one);
    `.grid()` returns the current `quant_grid` dict.
    """
    import ipywidgets as w  # only when a widget is built: `import llmlab.widgets` loads no Jupyter

    first = quant_grid(bits, signed, step, weights)  # refuse bad defaults before building
    validation.integer("bits", bits, 2, 8, hint="(for the explorer)")
    style, layout = {"description_width": "130px"}, w.Layout(width="460px")

    def step_slider(r: dict):
        low, high = math.log10(r["minmax_step"] / 64), math.log10(r["minmax_step"] * 4)
        return dict(min=min(low, math.log10(r["step"])), max=max(high, math.log10(r["step"])), value=r["step"])

    controls = {
        "bits": w.IntSlider(value=bits, min=2, max=8, description="bits", style=style, layout=layout),
        "signed": w.ToggleButtons(options=[("signed", True), ("unsigned", False)], value=signed, description="grid",
                                  style=style),
        "step": w.FloatLogSlider(**step_slider(first), base=10, step=0.01, readout_format=".3g",
                                 description="step s", style=style, layout=layout),
    }

    def current() -> dict:
        return quant_grid(controls["bits"].value, controls["signed"].value, float(controls["step"].value), weights)

    def regrid(change, update) -> None:  # a new grid starts at LSQ's step
        fresh = quant_grid(controls["bits"].value, controls["signed"].value, None, weights)
        slider, bounds = controls["step"], step_slider(fresh)
        slider.min, slider.max = min(slider.min, bounds["min"]), max(slider.max, bounds["max"])  # only widens
        if slider.value == fresh["step"]:
            update()
        else:
            slider.value = fresh["step"]  # its observer redraws

    box = result_explorer(controls, current, format_quant_grid, quant_grid_figure, on_release=True,
                          handlers={"bits": regrid, "signed": regrid})
    box.grid = current
    return box
