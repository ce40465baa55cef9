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
