"""Widgets for the chapters: sliders in front of pure functions, so exploring is one drag away.

Each widget wraps a pure function that computes everything it shows (tests call those directly), and the
arithmetic is llmlab's own (`llmlab.flops`, `llmlab.hardware.roofline`); this module only arranges it:

- `training_time_calculator()` — model size, tokens, GPU, GPU count, MFU → FLOPs, days, GPU-hours
  (the pure function is `training_estimate`);
- `roofline_explorer()` — a GEMM's shape and element size on a GPU → intensity, ridge point, attainable
  FLOP/s and whether it is memory- or compute-bound, with the roofline drawn (`gemm_roofline`).

    from llmlab import widgets
    widgets.training_time_calculator()       # the last line of a cell: the live widget
    widgets.training_estimate(175e9, 300e9, "A100 SXM", gpus=1000, mfu=0.4)["days"]

A widget is an `ipywidgets.VBox` whose display also carries its default result as static output: a plain-text
line (and, for the roofline, a PNG of the plot) next to the widget view in the same output. JupyterLab shows the
live widget; a headless run, nbconvert or a rendered page without widget state shows the static result instead.
ipywidgets and IPython are imported only when a widget is built, never by `import llmlab`.
"""

from __future__ import annotations

import base64
import io
import math

from llmlab import flops
from llmlab.hardware import SPECS, roofline

__all__ = ["training_estimate", "format_estimate", "gemm_roofline", "format_roofline", "roofline_figure",
           "training_time_calculator", "roofline_explorer", "PRECISIONS", "DTYPES"]

SECONDS_PER_HOUR = 3600.0

# the peak a GPU's spec sheet gives for each precision (llmlab.hardware.Spec.peak_flops)
PRECISIONS = {"bf16 tensor cores (dense)": "bf16", "fp32 SIMT cores": "fp32"}
# GEMM element types of the roofline explorer: name → (bytes per element, the spec-sheet peak it runs at)
DTYPES = {"bf16 / fp16 (2 B)": (2, "bf16"), "fp32 (4 B)": (4, "fp32")}


# --- the pure functions ----------------------------------------------------------------------------------------

def _spec(gpu: str):
    if gpu not in SPECS:
        raise ValueError(f"gpu={gpu!r} is not on the spec sheet; choose from {', '.join(SPECS)}")
    return SPECS[gpu]


def training_estimate(n_params: float, tokens: float, gpu: str, gpus: int, mfu: float,
                      precision: str = "bf16") -> dict:
    """Training `n_params` parameters on `tokens` tokens with `gpus` × `gpu` at `mfu` of its `precision` peak.

    Returns a dict: flops (6·N·D), peak_flops (one GPU's), days, gpu_hours, and the inputs.
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus={gpus!r} must be a positive int")
    peak = _spec(gpu).peak_flops(precision)
    total = flops.training_flops(n_params, tokens)
    days = flops.training_days(total, gpus=gpus, peak_flops=peak, mfu=mfu)
    return {"n_params": n_params, "tokens": tokens, "gpu": gpu, "gpus": gpus, "mfu": mfu, "precision": precision,
            "flops": total, "peak_flops": peak, "days": days, "gpu_hours": days * flops.SECONDS_PER_DAY
            / SECONDS_PER_HOUR * gpus}


def _si(x: float, unit: str = "") -> str:
    """3 significant digits with an SI prefix: 1.75e11 → '175 G'."""
    if x == 0:
        return f"0 {unit}".rstrip()
    exp = max(-4, min(8, int(math.floor(math.log10(abs(x)) / 3))))
    prefix = {-4: "p", -3: "n", -2: "µ", -1: "m", 0: "", 1: "k", 2: "M", 3: "G", 4: "T", 5: "P", 6: "E", 7: "Z",
              8: "Y"}[exp]
    return f"{x / 10 ** (3 * exp):.3g} {prefix}{unit}".rstrip()


def _count(x: float) -> str:
    """A large count the way model cards write it: 175e9 → '175B', 1.4e12 → '1.4T'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


def format_estimate(est: dict) -> str:
    """One line saying what `training_estimate` found; it always contains the word 'days'."""
    years = f" ≈ {est['days'] / 365.25:.1f} years" if est["days"] >= 365.25 else ""
    return (f"{_count(est['n_params'])} params × {_count(est['tokens'])} tokens: 6·N·D = {est['flops']:.3g} FLOP → "
            f"{est['days']:,.1f} days{years} on {est['gpus']:,} × {est['gpu']} at {est['mfu']:.0%} MFU of "
            f"{est['peak_flops'] / 1e12:,.0f} TFLOP/s {est['precision']} = {est['gpu_hours']:,.0f} GPU-hours")


def gemm_roofline(m: int, n: int, k: int, bytes_per_element: int, peak_flops: float, bandwidth: float) -> dict:
    """Where the GEMM (m, k) @ (k, n) sits on the roofline of a device with `peak_flops` and `bandwidth` (B/s).

    Returns a dict: flops, bytes (the least traffic: A and B read once, C written once), intensity (FLOP/B),
    ridge (FLOP/B), attainable (FLOP/s), bound ('memory' or 'compute'), seconds (the least time: FLOPs at the
    attainable rate), and the inputs.
    """
    intensity = roofline.gemm_intensity(m, n, k, bytes_per_element)
    attainable = roofline.attainable(intensity, peak_flops, bandwidth)
    work = roofline.gemm_flops(m, n, k)
    return {"m": m, "n": n, "k": k, "bytes_per_element": bytes_per_element, "peak_flops": peak_flops,
            "bandwidth": bandwidth, "flops": work, "bytes": roofline.gemm_bytes(m, n, k, bytes_per_element),
            "intensity": intensity, "ridge": roofline.ridge_point(peak_flops, bandwidth), "attainable": attainable,
            "bound": roofline.bound(intensity, peak_flops, bandwidth), "seconds": work / attainable}


def format_roofline(r: dict, device: str = "") -> str:
    """One line saying what `gemm_roofline` found; it contains 'memory-bound' or 'compute-bound'."""
    on = f" on {device}" if device else ""
    return (f"({r['m']}×{r['k']}) @ ({r['k']}×{r['n']}), {r['bytes_per_element']} B/element: "
            f"{_si(r['flops'], 'FLOP')} over {_si(r['bytes'], 'B')} → intensity {r['intensity']:.3g} FLOP/B; "
            f"ridge {r['ridge']:.3g} FLOP/B{on} → {r['bound']}-bound, attainable "
            f"{_si(r['attainable'], 'FLOP/s')} of {_si(r['peak_flops'], 'FLOP/s')} peak, "
            f"at least {_si(r['seconds'], 's')}")


def roofline_figure(r: dict, device: str):
    """A matplotlib Figure (not attached to pyplot) of `device`'s roof with the GEMM `r` placed on it."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.8))  # fixed margins: a layout engine would double the drawing time
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.14, top=0.9)
    ax = fig.add_subplot()
    point = roofline.Point(f"{r['m']}×{r['k']} @ {r['k']}×{r['n']}", r["m"], r["n"], r["k"], r["bytes_per_element"])
    lo = min(0.1, r["intensity"] / 3)
    hi = max(1e4, r["intensity"] * 3, r["ridge"] * 10)
    roofline.plot({device: (r["peak_flops"], r["bandwidth"])}, [point], ax=ax, i_range=(lo, hi))
    ax.plot(r["intensity"], r["attainable"], "o", ms=8, color="C3", label=f"attainable: {r['bound']}-bound")
    ax.legend(fontsize=7, loc="upper left")
    return fig


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


# --- the widgets --------------------------------------------------------------------------------------------

def _box_class():
    """A VBox whose display carries a static fallback (plain text, optionally a PNG) next to the widget view."""
    import ipywidgets

    class Explorer(ipywidgets.VBox):
        def _static(self) -> dict:  # set by the builder: mimetype -> data of the current result
            return {}

        def _repr_mimebundle_(self, **kwargs):
            data = super()._repr_mimebundle_(**kwargs)
            data.update(self._static())
            return data

    return Explorer


def training_time_calculator(n_params: float = 175e9, tokens: float = 300e9, gpu: str = "A100 SXM",
                             gpus: int = 1000, mfu: float = 0.4, precision: str = "bf16"):
    """A calculator widget: sliders for model size, tokens, GPU count and MFU, dropdowns for GPU and precision.

    Its result (`.result`, an HTML widget) is `format_estimate(training_estimate(...))` of the controls'
    values, recomputed whenever one moves. `.controls` maps argument names to the control widgets.
    """
    import ipywidgets as w

    training_estimate(n_params, tokens, gpu, gpus, mfu, precision)  # refuse bad defaults before building
    style, layout = {"description_width": "150px"}, w.Layout(width="560px")
    controls = {
        "n_params": w.SelectionSlider(options=_choices(n_params, range(7, 13), _count), value=n_params,
                                      description="model size (params)", style=style, layout=layout),
        "tokens": w.SelectionSlider(options=_choices(tokens, range(8, 14), _count), value=tokens,
                                    description="tokens", style=style, layout=layout),
        "gpu": w.Dropdown(options=list(SPECS), value=gpu, description="GPU", style=style, layout=layout),
        "precision": w.Dropdown(options=PRECISIONS, value=precision, description="peak", style=style,
                                layout=layout),
        "gpus": w.IntSlider(value=gpus, min=1, max=16384, step=1, description="GPUs", style=style, layout=layout),
        "mfu": w.FloatSlider(value=mfu, min=0.01, max=1.0, step=0.01, readout_format=".2f", description="MFU",
                             style=style, layout=layout),
    }
    result = w.HTML()

    def values() -> dict:
        return {name: c.value for name, c in controls.items()}

    def text() -> str:
        try:
            return format_estimate(training_estimate(**values()))
        except ValueError as e:  # e.g. fp32 on a spec without that figure: say so instead of raising
            return f"cannot estimate: {e} (days unknown)"

    def update(change=None) -> None:
        result.value = f"<b>{text()}</b>"

    for c in controls.values():
        c.observe(update, names="value")
    update()
    box = _box_class()([*controls.values(), result])
    box.controls, box.result, box.estimate = controls, result, lambda: training_estimate(**values())
    box._static = lambda: {"text/plain": text()}
    return box


def _choices(default, exponents, label, mantissas=(1, 2, 5), base=10) -> list[tuple[str, float]]:
    """Slider stops m·base^e (a log scale of round numbers) with `default` among them, as (label, value) pairs.

    A selection slider holds exactly these values: a log slider would snap 175e9 to its own grid as soon as the
    browser renders it, and the result shown would no longer be the default's.
    """
    values = {m * base**e for e in exponents for m in mantissas} | {default}
    return [(label(v), v) for v in sorted(values)]


def _size_slider(value: int, description: str):
    """m, n or k: 1, 1.5, 2, 3, 4, 6, 8, … 65536 (powers of 2 and 1.5× them), plus `value`."""
    import ipywidgets as w

    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{description.split()[0]}={value!r} must be a positive int")
    options = [(label, int(v)) for label, v in _choices(value, range(0, 17), lambda v: str(int(v)), (1, 1.5), 2)
               if v == int(v)]
    return w.SelectionSlider(options=options, value=value, description=description, continuous_update=False,
                             style={"description_width": "110px"}, layout=w.Layout(width="420px"))


def roofline_explorer(m: int = 512, n: int = 2304, k: int = 768, dtype: str = "bf16 / fp16 (2 B)",
                      gpu: str = "A100 SXM", devices: dict[str, tuple[float, float]] | None = None):
    """A roofline widget: m, n, k sliders (1, 1.5, 2, 3, 4, 6, … 65536), element type and GPU → the GEMM on that roof.

    The GPUs are the spec sheet's (peak of the element type's precision, HBM bandwidth); `devices` adds more
    roofs by name → (peak FLOP/s, bandwidth B/s), e.g. this machine measured by `llmlab.hardware.measure()`,
    used for every element type. `.result` (HTML) holds `format_roofline(...)`, `.plot` (an Image widget) the
    figure; `.controls` maps argument names to the controls.
    """
    import ipywidgets as w

    extra = dict(devices or {})
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose from {list(DTYPES)}")
    names = list(SPECS) + [name for name in extra if name not in SPECS]
    if gpu not in names:
        raise ValueError(f"gpu={gpu!r}; choose from {names}")

    def roof(device: str, precision: str) -> tuple[float, float]:
        if device in extra:
            return extra[device]
        spec = SPECS[device]
        return spec.peak_flops(precision), spec.hbm_gbs * 1e9

    controls = {"m": _size_slider(m, "m (rows of A)"), "n": _size_slider(n, "n (cols of B)"),
                "k": _size_slider(k, "k (inner)"),
                "dtype": w.Dropdown(options=list(DTYPES), value=dtype, description="dtype"),
                "gpu": w.Dropdown(options=names, value=gpu, description="GPU")}
    result, plot = w.HTML(), w.Image(format="png")

    def current() -> tuple[dict, str]:
        v = {name: c.value for name, c in controls.items()}
        nbytes, precision = DTYPES[v["dtype"]]
        peak, bandwidth = roof(v["gpu"], precision)
        return gemm_roofline(v["m"], v["n"], v["k"], nbytes, peak, bandwidth), v["gpu"]

    state = {}

    def update(change=None) -> None:
        r, device = current()
        state["text"] = format_roofline(r, device)
        state["png"] = _png(roofline_figure(r, device))
        result.value = f"<b>{state['text']}</b>"
        plot.value = state["png"]

    for c in controls.values():
        c.observe(update, names="value")
    update()
    box = _box_class()([w.HBox([w.VBox([controls[d] for d in "mnk"]), w.VBox([controls["dtype"], controls["gpu"]])]),
                        result, plot])
    box.controls, box.result, box.plot, box.roofline = controls, result, plot, lambda: current()[0]
    box._static = lambda: {"text/plain": state["text"], "image/png": base64.b64encode(state["png"]).decode()}
    return box


# === chapter 4: the all-reduce cost explorer (llmlab.dist.cost) ================================================
# This section belongs to chapter 4 (communication); the functions above it are left as they are.

__all__ += ["allreduce_cost", "format_allreduce_cost", "allreduce_cost_figure", "allreduce_cost_explorer"]


def _ibytes(x: float) -> str:
    """Bytes with a binary prefix, 3 significant digits: 1024 → '1 KiB', 14e9 → '13 GiB'."""
    for power, prefix in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if abs(x) >= 1024**power:
            return f"{x / 1024**power:.3g} {prefix}"
    return f"{x:.3g} B"


def _links(links: dict | None) -> dict:
    from llmlab.dist import cost

    return {**cost.LINKS, **(links or {})}


def allreduce_cost(n: int, nbytes: float, link: str = "nvlink4", alpha: float | None = None,
                   links: dict | None = None) -> dict:
    """The α-β model's ring and tree all-reduce of `nbytes` on `n` ranks over `link`.

    `link` is a key of `llmlab.dist.cost.LINKS` or of `links` (more `cost.Link`s, e.g. this machine's fitted one,
    `llmlab.dist.bench.AllReduceRun.link()`); `alpha` (seconds per message) replaces the link's α when given.
    Returns a dict: ring_s and tree_s (`cost.ring_allreduce_time`, `cost.tree_allreduce_time`), their bus
    bandwidths (nccl-tests' definition, bytes/s), crossover_bytes (below it the tree is faster), faster
    ('ring' or 'tree'), and the inputs with the link's name, α and β.
    """
    from llmlab.dist import cost

    table = _links(links)
    if link not in table:
        raise ValueError(f"link={link!r}; choose from {', '.join(table)}")
    chosen = table[link]
    a = chosen.alpha if alpha is None else alpha
    ring = cost.ring_allreduce_time(nbytes, n, a, chosen.beta)
    tree = cost.tree_allreduce_time(nbytes, n, a, chosen.beta)
    busbw = lambda t: cost.bus_bandwidth(nbytes, t, n) if t > 0 else math.inf
    return {"n": n, "nbytes": nbytes, "link": link, "link_name": chosen.name, "alpha": a, "beta": chosen.beta,
            "ring_s": ring, "tree_s": tree, "ring_busbw": busbw(ring), "tree_busbw": busbw(tree),
            "crossover_bytes": cost.crossover_bytes(n, a, chosen.beta), "faster": "ring" if ring < tree else "tree"}


def format_allreduce_cost(r: dict) -> str:
    """One line saying what `allreduce_cost` found; it names the faster algorithm and the crossover."""
    cross = r["crossover_bytes"]
    where = ("the ring is never slower on so few ranks" if cross == 0 else
             f"they cross at {_ibytes(cross)}: the tree is faster below, the ring above")
    return (f"all-reduce of {_ibytes(r['nbytes'])} on {r['n']} ranks over {r['link_name']} "
            f"(α = {_si(r['alpha'], 's')}, 1/β = {_si(1 / r['beta'], 'B/s')}): ring {_si(r['ring_s'], 's')} "
            f"(busbw {_si(r['ring_busbw'], 'B/s')}), tree {_si(r['tree_s'], 's')} (busbw "
            f"{_si(r['tree_busbw'], 'B/s')}) → the {r['faster']} is faster; {where}")


def allreduce_cost_figure(r: dict, measured: dict | None = None):
    """Ring and tree time vs message size on `r`'s link and ranks (the model), `r`'s size marked, and
    `measured` points ({label: [(bytes, seconds), ...]}) overlaid. A matplotlib Figure, not attached to pyplot."""
    import numpy as np
    from matplotlib.figure import Figure

    from llmlab.dist import cost

    measured = measured or {}
    lo = min([1024.0, r["nbytes"] / 4] + [s for pts in measured.values() for s, _ in pts])
    hi = max([16.0 * 2**30, r["nbytes"] * 4] + [s for pts in measured.values() for s, _ in pts])
    sizes = np.geomspace(lo, hi, 200)
    fig = Figure(figsize=(6.4, 3.8))
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.14, top=0.9)
    ax = fig.add_subplot()
    for name, fn, color in (("ring", cost.ring_allreduce_time, "C0"), ("tree", cost.tree_allreduce_time, "C1")):
        ax.plot(sizes, [fn(s, r["n"], r["alpha"], r["beta"]) for s in sizes], color=color,
                label=f"{name}, α-β model")
    ax.axvline(r["nbytes"], color="grey", ls="--", lw=0.8)
    ax.plot([r["nbytes"]] * 2, [r["ring_s"], r["tree_s"]], "ko", ms=4)
    if 0 < r["crossover_bytes"] < math.inf:
        ax.axvline(r["crossover_bytes"], color="C3", ls=":", lw=1, label=f"crossover {_ibytes(r['crossover_bytes'])}")
    markers = iter("sD^vo")
    for label, pts in measured.items():
        ax.plot(*zip(*pts, strict=True), next(markers, "o"), ms=4, mfc="none", label=label)
    ax.set(xscale="log", yscale="log", xlabel="message size (bytes per rank)", ylabel="seconds per all-reduce",
           title=f"{r['n']} ranks over {r['link_name']}")
    ax.legend(fontsize=7, loc="upper left")
    return fig


def allreduce_cost_explorer(n: int = 8, nbytes: float = 256 * 2**20, link: str = "nvlink4",
                            alpha: float | None = None, measured: dict | None = None, links: dict | None = None):
    """An all-reduce cost widget: ranks N, message size, link (`cost.LINKS`, plus `links`) and α → the predicted
    ring and tree times, bus bandwidths and crossover (`allreduce_cost`), drawn with `measured` points overlaid
    (e.g. `llmlab.dist.bench.AllReduceRun.measured()`). Choosing a link sets α to the link's own; the α slider
    then explores other latencies. `.result` (HTML) holds `format_allreduce_cost(...)`, `.plot` (an Image) the
    figure, `.controls` the controls.
    """
    import ipywidgets as w

    table = _links(links)
    first = allreduce_cost(n, nbytes, link, alpha, links)  # refuse bad defaults before building
    style, layout = {"description_width": "110px"}, w.Layout(width="480px")
    alphas = _choices(first["alpha"], range(-8, -1), lambda v: _si(v, "s"))
    alphas = sorted(set(alphas) | {(_si(lk.alpha, "s"), lk.alpha) for lk in table.values()}, key=lambda o: o[1])
    controls = {
        "n": w.SelectionSlider(options=_choices(n, range(1, 13), str, mantissas=(1,), base=2), value=n,
                               description="ranks N", style=style, layout=layout),
        "nbytes": w.SelectionSlider(options=_choices(nbytes, range(5, 18), _ibytes, mantissas=(1,),
                                                     base=4), value=nbytes, description="message size",
                                    style=style, layout=layout),
        "link": w.Dropdown(options=[(lk.name, key) for key, lk in table.items()], value=link, description="link",
                           style=style, layout=layout),
        "alpha": w.SelectionSlider(options=alphas, value=first["alpha"], description="α (latency)", style=style,
                                   layout=layout),
    }
    result, plot = w.HTML(), w.Image(format="png")
    state = {}

    def current() -> dict:
        v = {name: c.value for name, c in controls.items()}
        return allreduce_cost(v["n"], v["nbytes"], v["link"], v["alpha"], links)

    def update(change=None) -> None:
        r = current()
        state["text"] = format_allreduce_cost(r)
        state["png"] = _png(allreduce_cost_figure(r, measured))
        result.value = f"<b>{state['text']}</b>"
        plot.value = state["png"]

    def link_changed(change) -> None:
        own = table[change["new"]].alpha
        if controls["alpha"].value == own:
            update()
        else:
            controls["alpha"].value = own  # the new link's own α; moving the slider updates the result

    for name, c in controls.items():
        c.observe(link_changed if name == "link" else update, names="value")
    update()
    box = _box_class()([*controls.values(), result, plot])
    box.controls, box.result, box.plot, box.cost = controls, result, plot, current
    box._static = lambda: {"text/plain": state["text"], "image/png": base64.b64encode(state["png"]).decode()}
    return box


# === chapter 2: the pipeline schedule explorer and the precision explorer ====================================
# This section belongs to chapter 2 (parallelism, mixed precision); the functions above it are left as they are.
# The arithmetic is llmlab.parallel.pipeline's (simulate, bubble_fraction, plot_timeline) and llmlab.precision's
# (representation); torch is imported only when one of these runs.

__all__ += ["PIPELINE_SCHEDULES", "pipeline_schedule", "format_pipeline", "pipeline_figure", "pipeline_explorer",
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

    Returns a dict: timeline (a pipeline.Timeline), bubble (the idle share measured on it), formula
    ((p−1)/(m+p−1)), makespan, ideal (m·(1 + backward_ratio): one stage's work with no bubble), peak_in_flight
    (per stage: the most micro-batches whose activations it holds at once), and the inputs.
    """
    from llmlab.parallel import pipeline

    timeline = pipeline.simulate(schedule, stages, micro_batches, t_forward=1.0, t_backward=backward_ratio)
    return {"stages": stages, "micro_batches": micro_batches, "schedule": schedule, "backward_ratio": backward_ratio,
            "timeline": timeline, "bubble": timeline.bubble, "formula": pipeline.bubble_fraction(stages, micro_batches),
            "makespan": timeline.makespan, "ideal": micro_batches * (1.0 + backward_ratio),
            "peak_in_flight": [timeline.peak_in_flight(s) for s in range(stages)]}


def format_pipeline(r: dict) -> str:
    """One line saying what `pipeline_schedule` found; it contains 'bubble' and the peak micro-batches held."""
    name = {"1f1b": "1F1B", "gpipe": "GPipe"}[r["schedule"]]
    peaks = ", ".join(map(str, r["peak_in_flight"]))
    return (f"{name}, p = {r['stages']} stages, m = {r['micro_batches']} micro-batches, backward = "
            f"{r['backward_ratio']:g}× forward: makespan {r['makespan']:.3g} vs {r['ideal']:.3g} of work per stage → "
            f"bubble {r['bubble']:.1%} (formula (p−1)/(m+p−1) = {r['formula']:.1%}); micro-batches held at peak, "
            f"stage 0 to {r['stages'] - 1}: {peaks}")


def pipeline_figure(r: dict):
    """A matplotlib Figure (not attached to pyplot) of `r`'s timeline, drawn by pipeline.plot_timeline."""
    from matplotlib.figure import Figure

    from llmlab.parallel import pipeline

    height = 1.2 + 0.35 * r["stages"]  # inches: room for the title and the time axis, then a row per stage
    fig = Figure(figsize=(8, height))  # fixed margins: a layout engine would double the drawing time
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.5 / height, top=1 - 0.35 / height)
    ax = fig.add_subplot()
    name = {"1f1b": "1F1B", "gpipe": "GPipe"}[r["schedule"]]
    pipeline.plot_timeline(r["timeline"], ax=ax, title=f"{name}: bubble {r['bubble']:.0%} (formula "
                           f"{r['formula']:.0%}); blue forward, orange backward, numbers = micro-batch")
    ax.title.set_fontsize(9)
    ax.set_xlabel("time (forward = 1)")
    return fig


def pipeline_explorer(stages: int = 4, micro_batches: int = 8, schedule: str = "1f1b", backward_ratio: float = 2.0):
    """A pipeline-schedule widget: stages p, micro-batches m, schedule and backward/forward time → the simulated
    timeline, its bubble next to (p−1)/(m+p−1), and the micro-batches each stage holds at its peak.

    `.result` (HTML) holds `format_pipeline(...)`, `.plot` (an Image widget) the timeline; `.controls` maps
    argument names to the controls; `.schedule()` returns the current `pipeline_schedule` dict.
    """
    import ipywidgets as w

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
    for c in controls.values():
        c.continuous_update = False  # one redraw when the slider is released
    result, plot = w.HTML(), w.Image(format="png")
    state = {}

    def current() -> dict:
        return pipeline_schedule(**{name: c.value for name, c in controls.items()})

    def update(change=None) -> None:
        r = current()
        state["text"], state["png"] = format_pipeline(r), _png(pipeline_figure(r))
        result.value = f"<b>{state['text']}</b>"
        plot.value = state["png"]

    for c in controls.values():
        c.observe(update, names="value")
    update()
    box = _box_class()([*controls.values(), result, plot])
    box.controls, box.result, box.plot, box.schedule = controls, result, plot, current
    box._static = lambda: {"text/plain": state["text"], "image/png": base64.b64encode(state["png"]).decode()}
    return box


def format_representation(value: float) -> str:
    """A small table of how `value` is stored in fp32, fp16 and bf16 (`llmlab.precision.representation`)."""
    from llmlab import precision

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
    import torch

    if seed in _GRADIENTS:
        return _GRADIENTS[seed]

    from llmlab.data import MarkovSource, SyntheticDataset
    from llmlab.model import GPT, GPTConfig

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
    import torch

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
    import numpy as np
    from matplotlib.figure import Figure

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
    import html

    import ipywidgets as w

    format_representation(value)  # refuse a bad default before building
    if isinstance(log2_scale, bool) or not isinstance(log2_scale, int) or not 0 <= log2_scale <= 40:
        raise ValueError(f"log2_scale={log2_scale!r} must be an int in [0, 40]")
    if grads is not None:
        gradient_underflow(0, grads)
    style = {"description_width": "130px"}
    controls = {"value": w.FloatText(value=value, description="value", style=style),
                "log2_scale": w.IntSlider(value=log2_scale, min=0, max=40, description="loss scale log2 S",
                                          continuous_update=False, style=style, layout=w.Layout(width="480px"))}
    result, plot = w.HTML(), w.Image(format="png")
    state = {}

    def current() -> dict:
        return gradient_underflow(controls["log2_scale"].value, grads)

    def update(change=None) -> None:
        try:
            rep = format_representation(float(controls["value"].value))
        except ValueError as e:  # inf or nan typed in: say so instead of raising
            rep = f"cannot represent: {e}"
        r = current()
        state["text"] = f"{rep}\n{format_underflow(r)}"
        if change is None or change["owner"] is controls["log2_scale"] or "png" not in state:
            state["png"] = _png(gradient_figure(r))
            plot.value = state["png"]
        result.value = f"<pre>{html.escape(state['text'])}</pre>"

    for c in controls.values():
        c.observe(update, names="value")
    update()
    box = _box_class()([*controls.values(), result, plot])
    box.controls, box.result, box.plot, box.underflow = controls, result, plot, current
    box._static = lambda: {"text/plain": state["text"], "image/png": base64.b64encode(state["png"]).decode()}
    return box


# --- chapter 8: MoE routing / quantization ---
# This section belongs to chapter 8 (emerging techniques); the functions above it are left as they are. The
# arithmetic is llmlab.moe's (route) and llmlab.quant's (LSQQuantizer, MinMaxQuantizer); torch is imported only
# when one of these runs.

__all__ += ["MOE_CAPACITY_FACTORS", "moe_routing", "format_moe_routing", "moe_routing_figure", "moe_routing_explorer",
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
    import torch

    from llmlab.moe import route

    for name, value, low in (("num_experts", num_experts, 1), ("k", k, 1), ("tokens", tokens, 1), ("shown", shown, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} must be an int >= {low}")
    if k > num_experts:
        raise ValueError(f"k={k} must be <= num_experts={num_experts}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor!r} must be > 0, or None (dropless)")
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
    import numpy as np
    from matplotlib.figure import Figure

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
    import ipywidgets as w

    moe_routing(num_experts, k, capacity_factor, skew, tokens)  # refuse bad defaults before building
    if capacity_factor not in MOE_CAPACITY_FACTORS:
        raise ValueError(f"capacity_factor={capacity_factor!r}; the explorer's stops are {MOE_CAPACITY_FACTORS}")
    if not 1 <= num_experts <= 64 or not 0 <= skew <= 4:
        raise ValueError(f"num_experts={num_experts} must be in [1, 64] and skew={skew} in [0, 4]")
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
    for c in controls.values():
        c.continuous_update = False  # one redraw when the slider is released
    result, plot = w.HTML(), w.Image(format="png")
    state = {}

    def current() -> dict:
        v = {name: c.value for name, c in controls.items()}
        v["k"] = min(v["k"], v["num_experts"])  # k > E is no routing at all: take every expert
        v["capacity_factor"] = labels[v["capacity_factor"]]
        return moe_routing(**v, tokens=tokens)

    def update(change=None) -> None:
        r = current()
        state["text"], state["png"] = format_moe_routing(r), _png(moe_routing_figure(r))
        result.value = f"<b>{state['text']}</b>"
        plot.value = state["png"]

    for c in controls.values():
        c.observe(update, names="value")
    update()
    box = _box_class()([*controls.values(), result, plot])
    box.controls, box.result, box.plot, box.routing = controls, result, plot, current
    box._static = lambda: {"text/plain": state["text"], "image/png": base64.b64encode(state["png"]).decode()}
    return box


_WEIGHTS: dict = {}  # (seed, name) -> a weight of the tiny GPT at initialisation, made once per process


def tiny_gpt_weight(name: str = "transformer.h.0.mlp.c_fc.weight", seed: int = 0):
    """A copy of one weight of the tiny GPT at initialisation (N(0, 0.02²), as GPT-2's): by default the first MLP's
    c_fc weight, (256, 64)."""
    import torch

    if (seed, name) not in _WEIGHTS:
        from llmlab.model import GPT, GPTConfig

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
    import torch

    from llmlab.quant import LSQQuantizer

    q = LSQQuantizer(bits, signed=signed)
    with torch.no_grad():
        q.step.fill_(step)
        q.initialized.fill_(True)
        return q(w), q.q_min, q.q_max


def _minmax(w, bits: int, signed: bool):
    """(ŵ, step) of a MinMaxQuantizer that has seen w: the grid spread over w's [min, max] (with a zero point when
    unsigned)."""
    import torch

    from llmlab.quant import MinMaxQuantizer

    quantizer = MinMaxQuantizer(bits, signed=signed)
    with torch.no_grad():
        w_hat = quantizer(w)  # training mode: observes w first
    return w_hat, quantizer.qparams()[0].item()


def _lsq_step(w, bits: int, signed: bool) -> float:
    """LSQ's initial step for w, 2·mean|w|/√Q_P, as LSQQuantizer.init_step computes it."""
    from llmlab.quant import LSQQuantizer

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
    import torch

    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 16:
        raise ValueError(f"bits={bits!r} must be an int in [2, 16]")
    if not isinstance(signed, bool):
        raise ValueError(f"signed={signed!r} must be a bool")
    w = (tiny_gpt_weight() if weights is None else torch.as_tensor(weights).detach().float()).flatten()  # (N,)
    if not w.numel() or not torch.isfinite(w).all() or not w.abs().max() > 0:
        raise ValueError("weights must be a non-empty, finite, not all-zero tensor")
    minmax_step, lsq_step = _minmax(w, bits, signed)[1], _lsq_step(w, bits, signed)
    step = lsq_step if step is None else step
    if isinstance(step, bool) or not isinstance(step, int | float) or not math.isfinite(step) or not step > 0:
        raise ValueError(f"step={step!r} must be a positive number")
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
    import numpy as np
    from matplotlib.figure import Figure

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
    import ipywidgets as w

    first = quant_grid(bits, signed, step, weights)  # refuse bad defaults before building
    if bits > 8:
        raise ValueError(f"bits={bits} must be in [2, 8] for the explorer")
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
    for c in (controls["bits"], controls["step"]):
        c.continuous_update = False  # one redraw when the slider is released
    result, plot = w.HTML(), w.Image(format="png")
    state = {"busy": False}

    def current() -> dict:
        return quant_grid(controls["bits"].value, controls["signed"].value, float(controls["step"].value), weights)

    def update(change=None) -> None:
        if state["busy"]:
            return
        if change is not None and change["owner"] is not controls["step"]:  # a new grid: start at LSQ's step
            state["busy"] = True
            try:
                fresh = quant_grid(controls["bits"].value, controls["signed"].value, None, weights)
                slider = controls["step"]
                bounds = step_slider(fresh)
                slider.min, slider.max = min(slider.min, bounds["min"]), max(slider.max, bounds["max"])
                slider.value = fresh["step"]
            finally:
                state["busy"] = False
        r = current()
        state["text"], state["png"] = format_quant_grid(r), _png(quant_grid_figure(r))
        result.value = f"<b>{state['text']}</b>"
        plot.value = state["png"]

    for c in controls.values():
        c.observe(update, names="value")
    update()
    box = _box_class()([*controls.values(), result, plot])
    box.controls, box.result, box.plot, box.grid = controls, result, plot, current
    box._static = lambda: {"text/plain": state["text"], "image/png": base64.b64encode(state["png"]).decode()}
    return box


# --- chapter 3: memory planner ---
# This section belongs to chapter 3 (memory): the planner explorer over llmlab.memory.planner. The functions
# above it are left as they are; this one imports what it needs (torch, llmlab.model) inside its functions.

__all__ += ["MEMORY_MODELS", "MEMORY_CATEGORIES", "memory_plan", "format_memory_plan", "memory_plan_figure",
            "memory_planner"]

# Models the planner explorer offers: a llmlab.model preset by name, or GPTConfig fields of a published model
# (GPT-2 XL: Radford et al. 2019; GPT-3 sizes: Brown et al. 2020, Table 2.1). No dropout: large runs train without.
MEMORY_MODELS: dict[str, dict] = {
    "tiny (the chapter's GPT)": {"preset": "tiny"},
    "small": {"preset": "small"},
    "GPT-2 small (124M)": {"preset": "gpt2"},
    "GPT-2 XL (1.5B)": dict(vocab_size=50257, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
    "GPT-3 2.7B": dict(vocab_size=50257, block_size=2048, n_layer=32, n_head=32, n_embd=2560),
    "GPT-3 6.7B": dict(vocab_size=50257, block_size=2048, n_layer=32, n_head=32, n_embd=4096),
    "GPT-3 175B": dict(flops.GPT3_CONFIG),
}
# planner.Plan's fields, in the order the bars stack them, with their legend labels
MEMORY_CATEGORIES = {"params": "parameters", "grads": "gradients", "optimizer_state": "optimizer state",
                     "activations": "activations", "recompute": "recompute (one block)",
                     "logits": "logits (B·T·V)"}


def _memory_config(model: str):
    from llmlab.model import GPTConfig

    if model not in MEMORY_MODELS:
        raise ValueError(f"model={model!r} unknown; choose from {list(MEMORY_MODELS)}")
    fields = MEMORY_MODELS[model]
    return GPTConfig.preset(fields["preset"]) if "preset" in fields else GPTConfig(**fields)


def memory_plan(model: str = "GPT-3 6.7B", batch_size: int = 1, seq_len: int | None = None, stage: int = 0,
                data: int = 8, checkpointing: bool = False, tensor: int = 1, gpu: str = "A100 SXM") -> dict:
    """The memory per GPU of training `model` (a MEMORY_MODELS name) in mixed precision with Adam:
    micro-batches of `batch_size` sequences of `seq_len` tokens (default: the model's block_size), ZeRO `stage`
    over `data` data-parallel GPUs, `tensor`-way tensor parallelism, every block checkpointed or not
    (`llmlab.memory.planner.plan`, 16-bit activations, 1-byte dropout masks as on CUDA), against `gpu`'s memory
    from the spec sheet (llmlab.hardware.SPECS, GB = 1e9 bytes; the CUDA context's ≈0.5 GB is not counted).

    Returns a dict: plan (the planner.Plan), breakdown (its bytes by category), total, memory (the GPU's bytes),
    fits, by_stage (the Plan of every ZeRO stage 0–3 with the rest unchanged), num_params, config, and the inputs.
    """
    from llmlab.memory import planner

    config = _memory_config(model)
    spec = _spec(gpu)
    if not isinstance(checkpointing, bool):
        raise ValueError(f"checkpointing={checkpointing!r} must be True or False")
    T = config.block_size if seq_len is None else seq_len
    by_stage = {s: planner.plan(config, batch_size, T, stage=s, data=data, tensor=tensor,
                                checkpointing=checkpointing) for s in range(4)}
    if isinstance(stage, bool) or stage not in by_stage:
        raise ValueError(f"stage={stage!r} must be a ZeRO stage: 0 (plain data parallel), 1, 2 or 3")
    p, memory = by_stage[stage], spec.memory_gb * 1e9
    return {"model": model, "config": config, "num_params": planner.num_params(config), "batch_size": batch_size,
            "seq_len": T, "stage": stage, "data": data, "checkpointing": checkpointing, "tensor": tensor,
            "gpu": gpu, "plan": p, "breakdown": p.breakdown(), "total": p.total, "memory": memory,
            "fits": p.fits(memory), "by_stage": by_stage}


def _gb(x: float) -> str:
    return f"{x / 1e9:.3g} GB"


def format_memory_plan(r: dict) -> str:
    """One line saying what `memory_plan` found; it says 'fits on' or 'does not fit on'."""
    b = r["breakdown"]
    parts = " + ".join(f"{MEMORY_CATEGORIES[k]} {_gb(v)}" for k, v in b.items() if v)
    verdict = "fits on" if r["fits"] else "does not fit on"
    return (f"{r['model']} ({_count(r['num_params'])} params), micro-batch {r['batch_size']} × {r['seq_len']} "
            f"tokens, ZeRO-{r['stage']} over {r['data']} GPU{'s' * (r['data'] > 1)}, tensor parallel "
            f"{r['tensor']}, {'every block checkpointed' if r['checkpointing'] else 'no checkpointing'}: "
            f"{parts} = {_gb(r['total'])} per GPU → {verdict} {r['gpu']} ({_gb(r['memory'])})")


def memory_plan_figure(r: dict):
    """A matplotlib Figure (not attached to pyplot): one stacked bar per ZeRO stage of `r`'s configuration (the
    chosen stage solid), by category, with the GPU's memory as a dashed line."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig = Figure(figsize=(7.5, 3.2))  # fixed margins: a layout engine would double the drawing time
    fig.subplots_adjust(left=0.14, right=0.98, bottom=0.33, top=0.88)
    ax = fig.add_subplot()
    stages = list(r["by_stage"])
    left = [0.0] * len(stages)
    for i, key in enumerate(MEMORY_CATEGORIES):
        widths = [r["by_stage"][s].breakdown()[key] / 1e9 for s in stages]
        bars = ax.barh([f"ZeRO-{s}" if s else "ZeRO-0 (DP)" for s in stages], widths, left=left, color=f"C{i}")
        for s, bar in zip(stages, bars, strict=True):
            bar.set_alpha(1.0 if s == r["stage"] else 0.3)
        left = [a + w for a, w in zip(left, widths, strict=True)]
    ax.axvline(r["memory"] / 1e9, color="k", ls="--", lw=1)
    ax.invert_yaxis()
    ax.set_xlim(0, max(max(left), r["memory"] / 1e9) * 1.08)
    ax.set_xlabel("GB per GPU (1 GB = 1e9 bytes)")
    verdict = "fits" if r["fits"] else "does not fit"
    ax.set_title(f"{r['model']}, ZeRO-{r['stage']} × {r['data']}, t = {r['tensor']}: {_gb(r['total'])} per GPU, "
                 f"{verdict}", fontsize=9)
    handles = [Patch(color=f"C{i}", label=label) for i, label in enumerate(MEMORY_CATEGORIES.values())]
    handles.append(Line2D([], [], color="k", ls="--", lw=1, label=f"{r['gpu']}: {r['memory'] / 1e9:g} GB"))
    ax.legend(handles=handles, fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    return fig


_MEMORY_SEQ = (None, 64, 128, 256, 512, 1024, 2048)  # None: the model's block_size (the slider's 0)


def memory_planner(model: str = "GPT-3 6.7B", batch_size: int = 1, seq_len: int | None = None, stage: int = 0,
                   data: int = 8, checkpointing: bool = False, tensor: int = 1, gpu: str = "A100 SXM"):
    """A memory-planner widget: model, micro-batch, sequence length, ZeRO stage, data-parallel GPUs N,
    checkpointing and tensor degree → the bytes per GPU by category as stacked bars (every stage, the chosen one
    solid) and whether they fit the chosen GPU (`memory_plan`).

    `.result` (HTML) holds `format_memory_plan(...)`, `.plot` (an Image widget) the figure; `.controls` maps
    argument names to the controls; `.plan()` returns the current `memory_plan` dict. A combination the planner
    refuses (a tensor degree not dividing the heads, a sequence longer than the model's context) says why
    instead of raising.
    """
    import ipywidgets as w

    memory_plan(model, batch_size, seq_len, stage, data, checkpointing, tensor, gpu)  # refuse bad defaults
    style, layout = {"description_width": "150px"}, w.Layout(width="480px")
    powers = lambda top: [2**i for i in range(top + 1)]  # noqa: E731
    if batch_size not in powers(9) or data not in powers(12) or tensor not in powers(4) or seq_len not in _MEMORY_SEQ:
        raise ValueError(f"batch_size={batch_size}, data={data}, tensor={tensor} must be powers of 2 (≤ 512, 4096, "
                         f"16) and seq_len={seq_len} one of {_MEMORY_SEQ}")
    controls = {
        "model": w.Dropdown(options=list(MEMORY_MODELS), value=model, description="model", style=style,
                            layout=layout),
        "batch_size": w.SelectionSlider(options=powers(9), value=batch_size, description="micro-batch (sequences)",
                                        style=style, layout=layout),
        "seq_len": w.SelectionSlider(options=[("context", 0)] + [(str(t), t) for t in _MEMORY_SEQ[1:]],
                                     value=seq_len or 0, description="sequence length", style=style,
                                     layout=layout),
        "stage": w.ToggleButtons(options=[("0 (DP)", 0), ("1", 1), ("2", 2), ("3", 3)], value=stage,
                                 description="ZeRO stage", style={**style, "button_width": "70px"}),
        "data": w.SelectionSlider(options=powers(12), value=data, description="data-parallel GPUs N", style=style,
                                  layout=layout),
        "tensor": w.SelectionSlider(options=powers(4), value=tensor, description="tensor parallel t", style=style,
                                    layout=layout),
        "checkpointing": w.Checkbox(value=checkpointing, description="checkpoint every block", style=style),
        "gpu": w.Dropdown(options=list(SPECS), value=gpu, description="GPU", style=style, layout=layout),
    }
    for c in controls.values():
        c.continuous_update = False  # one redraw when a slider is released
    result, plot = w.HTML(), w.Image(format="png")
    state = {}

    def current() -> dict:
        values = {name: c.value for name, c in controls.items()}
        return memory_plan(**{**values, "seq_len": values["seq_len"] or None})

    def update(change=None) -> None:
        try:
            r = current()
        except ValueError as e:  # e.g. tensor=2 with 25 heads: say so, keep the last figure
            state["text"] = f"cannot plan this configuration: {e}"
        else:
            state["text"], state["png"] = format_memory_plan(r), _png(memory_plan_figure(r))
            plot.value = state["png"]
        result.value = f"<b>{state['text']}</b>"

    for c in controls.values():
        c.observe(update, names="value")
    update()
    box = _box_class()([*controls.values(), result, plot])
    box.controls, box.result, box.plot, box.plan = controls, result, plot, current
    box._static = lambda: {"text/plain": state["text"], "image/png": base64.b64encode(state["png"]).decode()}
    return box
