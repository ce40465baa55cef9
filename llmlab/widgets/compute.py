"""Chapter 1's explorers (compute): the training-time calculator and the roofline of a GEMM.

- `training_time_calculator()` — model size, tokens, GPU, GPU count, MFU → FLOPs, days, GPU-hours
  (the pure function is `training_estimate`);
- `roofline_explorer()` — a GEMM's shape and element size on a GPU → intensity, ridge point, attainable
  FLOP/s and whether it is memory- or compute-bound, with the roofline drawn (`gemm_roofline`).

The arithmetic is llmlab's own (`llmlab.flops`, `llmlab.hardware.roofline`).
"""

from __future__ import annotations

from llmlab import flops, validation
from llmlab.hardware import SPECS, roofline
from llmlab.widgets.base import choices, count, gpu_spec, result_explorer, si

__all__ = ["training_estimate", "format_estimate", "gemm_roofline", "format_roofline", "roofline_figure",
           "training_time_calculator", "roofline_explorer", "PRECISIONS", "DTYPES"]

SECONDS_PER_HOUR = 3600.0

# the peak a GPU's spec sheet gives for each precision (llmlab.hardware.Spec.peak_flops)
PRECISIONS = {"bf16 tensor cores (dense)": "bf16", "fp32 SIMT cores": "fp32"}
# GEMM element types of the roofline explorer: name → (bytes per element, the spec-sheet peak it runs at)
DTYPES = {"bf16 / fp16 (2 B)": (2, "bf16"), "fp32 (4 B)": (4, "fp32")}


# --- the pure functions ----------------------------------------------------------------------------------------

def training_estimate(n_params: float, tokens: float, gpu: str, gpus: int, mfu: float,
                      precision: str = "bf16") -> dict:
    """Training `n_params` parameters on `tokens` tokens with `gpus` × `gpu` at `mfu` of its `precision` peak.

    Returns a dict: flops (6·N·D), peak_flops (one GPU's), days, gpu_hours, and the inputs.
    """
    validation.positive_int("gpus", gpus)
    peak = gpu_spec(gpu).peak_flops(precision)
    total = flops.training_flops(n_params, tokens)
    days = flops.training_days(total, gpus=gpus, peak_flops=peak, mfu=mfu)
    return {"n_params": n_params, "tokens": tokens, "gpu": gpu, "gpus": gpus, "mfu": mfu, "precision": precision,
            "flops": total, "peak_flops": peak, "days": days, "gpu_hours": days * flops.SECONDS_PER_DAY
            / SECONDS_PER_HOUR * gpus}


def format_estimate(est: dict) -> str:
    """One line saying what `training_estimate` found; it always contains the word 'days'."""
    years = f" ≈ {est['days'] / 365.25:.1f} years" if est["days"] >= 365.25 else ""
    return (f"{count(est['n_params'])} params × {count(est['tokens'])} tokens: 6·N·D = {est['flops']:.3g} FLOP → "
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
            f"{si(r['flops'], 'FLOP')} over {si(r['bytes'], 'B')} → intensity {r['intensity']:.3g} FLOP/B; "
            f"ridge {r['ridge']:.3g} FLOP/B{on} → {r['bound']}-bound, attainable "
            f"{si(r['attainable'], 'FLOP/s')} of {si(r['peak_flops'], 'FLOP/s')} peak, "
            f"at least {si(r['seconds'], 's')}")


def roofline_figure(r: dict, device: str):
    """A matplotlib Figure (not attached to pyplot) of `device`'s roof with the GEMM `r` placed on it."""
    from matplotlib.figure import Figure  # matplotlib loads in about a second: only when a figure is drawn

    from llmlab import plots  # pyplot loads with it: only when a figure is drawn

    fig = Figure(figsize=(6.4, 3.8))  # fixed margins: a layout engine would double the drawing time
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.14, top=0.9)
    ax = fig.add_subplot()
    point = roofline.Point(f"{r['m']}×{r['k']} @ {r['k']}×{r['n']}", r["m"], r["n"], r["k"], r["bytes_per_element"])
    lo = min(0.1, r["intensity"] / 3)
    hi = max(1e4, r["intensity"] * 3, r["ridge"] * 10)
    plots.roofline({device: (r["peak_flops"], r["bandwidth"])}, [point], ax=ax, i_range=(lo, hi))
    ax.plot(r["intensity"], r["attainable"], "o", ms=8, color="C3", label=f"attainable: {r['bound']}-bound")
    ax.legend(fontsize=7, loc="upper left")
    return fig


def training_time_calculator(n_params: float = 175e9, tokens: float = 300e9, gpu: str = "A100 SXM",
                             gpus: int = 1000, mfu: float = 0.4, precision: str = "bf16"):
    """A calculator widget: sliders for model size, tokens, GPU count and MFU, dropdowns for GPU and precision.

    Its result (`.result`, an HTML widget) is `format_estimate(training_estimate(...))` of the controls'
    values, recomputed whenever one moves. `.controls` maps argument names to the control widgets.
    """
    import ipywidgets as w  # only when a widget is built: `import llmlab.widgets` loads no Jupyter

    training_estimate(n_params, tokens, gpu, gpus, mfu, precision)  # refuse bad defaults before building
    style, layout = {"description_width": "150px"}, w.Layout(width="560px")
    controls = {
        "n_params": w.SelectionSlider(options=choices(n_params, range(7, 13), count), value=n_params,
                                      description="model size (params)", style=style, layout=layout),
        "tokens": w.SelectionSlider(options=choices(tokens, range(8, 14), count), value=tokens,
                                    description="tokens", style=style, layout=layout),
        "gpu": w.Dropdown(options=list(SPECS), value=gpu, description="GPU", style=style, layout=layout),
        "precision": w.Dropdown(options=PRECISIONS, value=precision, description="peak", style=style,
                                layout=layout),
        "gpus": w.IntSlider(value=gpus, min=1, max=16384, step=1, description="GPUs", style=style, layout=layout),
        "mfu": w.FloatSlider(value=mfu, min=0.01, max=1.0, step=0.01, readout_format=".2f", description="MFU",
                             style=style, layout=layout),
    }

    def current() -> dict:
        return training_estimate(**{name: c.value for name, c in controls.items()})

    # e.g. fp32 on a spec without that figure: say so instead of raising
    box = result_explorer(controls, current, format_estimate, refused="cannot estimate (days unknown)")
    box.estimate = current
    return box


def _size_slider(value: int, description: str):
    """m, n or k: 1, 1.5, 2, 3, 4, 6, 8, … 65536 (powers of 2 and 1.5× them), plus `value`."""
    import ipywidgets as w  # only when a widget is built: `import llmlab.widgets` loads no Jupyter

    validation.positive_int(description.split()[0], value)
    options = [(label, int(v)) for label, v in choices(value, range(0, 17), lambda v: str(int(v)), (1, 1.5), 2)
               if v == int(v)]
    return w.SelectionSlider(options=options, value=value, description=description, continuous_update=False,
                             style={"description_width": "110px"}, layout=w.Layout(width="420px"))


def roofline_explorer(m: int = 512, n: int = 2304, k: int = 768, dtype: str = "bf16 / fp16 (2 B)",
                      gpu: str = "A100 SXM", devices: dict[str, tuple[float, float]] | None = None):
    """A roofline widget: m, n, k sliders (1, 1.5, 2, 3, 4, 6, … 65536), element type and GPU → the GEMM on that roof.

    The GPUs are the spec sheet's (peak of the element type's precision, HBM bandwidth); `devices` adds more
    roofs by name → (peak FLOP/s, bandwidth B/s), e.g. this machine measured by `llmlab.hardware.machine()`,
    used for every element type. `.result` (HTML) holds `format_roofline(...)`, `.plot` (an Image widget) the
    figure; `.controls` maps argument names to the controls.
    """
    import ipywidgets as w  # only when a widget is built: `import llmlab.widgets` loads no Jupyter

    extra = dict(devices or {})
    validation.one_of("dtype", dtype, DTYPES)
    names = list(SPECS) + [name for name in extra if name not in SPECS]
    validation.one_of("gpu", gpu, names)

    def roof(device: str, precision: str) -> tuple[float, float]:
        if device in extra:
            return extra[device]
        spec = SPECS[device]
        return spec.peak_flops(precision), spec.hbm_gbs * 1e9

    controls = {"m": _size_slider(m, "m (rows of A)"), "n": _size_slider(n, "n (cols of B)"),
                "k": _size_slider(k, "k (inner)"),
                "dtype": w.Dropdown(options=list(DTYPES), value=dtype, description="dtype"),
                "gpu": w.Dropdown(options=names, value=gpu, description="GPU")}

    def current() -> tuple[dict, str]:
        v = {name: c.value for name, c in controls.items()}
        nbytes, precision = DTYPES[v["dtype"]]
        peak, bandwidth = roof(v["gpu"], precision)
        return gemm_roofline(v["m"], v["n"], v["k"], nbytes, peak, bandwidth), v["gpu"]

    layout = [w.HBox([w.VBox([controls[d] for d in "mnk"]), w.VBox([controls["dtype"], controls["gpu"]])])]
    box = result_explorer(controls, current, lambda r: format_roofline(*r), lambda r: roofline_figure(*r),
                          layout=layout)
    box.roofline = lambda: current()[0]
    return box
