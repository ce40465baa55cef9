"""Chapter 5's explorer (hardware): the cluster calculator over `llmlab.hardware.cluster`, and the step over each link.

- `cluster_calculator()` — a preset, model, tokens, batch, GPU, GPU count, tensor and pipeline degrees (the data
  degree is what is left: dp = gpus / (tp·pp)), micro-batches, links, the network (a NIC per GPU or one per node),
  GPUs per node and MFU → one step's compute and communication by kind, the run's days, GPU-hours and end-to-end MFU,
  as a stacked bar per network side by side (the pure function is `cluster_estimate`);
- `link_step_figure(...)` — the same step with its cross-node link swapped for each of `cost.LINKS`
  (`cluster.link_step_times`): the chapter's C15 comparison, a stacked bar per link.

The arithmetic is llmlab's own (`llmlab.hardware.cluster`, `llmlab.dist.cost`); torch (behind `llmlab.model`) is
imported only when one of these runs.
"""

from __future__ import annotations

from llmlab.dist import cost
from llmlab.hardware import SPECS, cluster
from llmlab.widgets.base import choices, count, result_explorer, si
from llmlab.widgets.memory import MEMORY_MODELS, memory_model_config

__all__ = ["STEP_PARTS", "CALCULATOR_FIELDS", "cluster_models", "cluster_estimate", "format_cluster_estimate",
           "cluster_step_figure", "link_step_figure", "cluster_calculator"]

# StepTime.parts()'s keys, in the order the bars stack them, with their colours
STEP_PARTS = {"compute": "C0", "DP all-reduce": "C1", "TP all-reduce": "C2", "PP send": "C3", "PP bubble": "C7"}
# the ClusterConfig fields the calculator has a control for, besides the preset and the model (dp is derived)
CALCULATOR_FIELDS = ("tokens", "batch_tokens", "gpu", "gpus", "tp", "pp", "micro_batches", "link", "tp_link",
                     "network", "gpus_per_node", "mfu")


def cluster_models() -> dict:
    """The models the calculator offers, name → `GPTConfig`: chapter 3's published sizes (`MEMORY_MODELS`), then
    each preset's model that is not among them, named after its preset ("7b-64xH100's model")."""

    models = {name: memory_model_config(name) for name in MEMORY_MODELS}
    for name, config in cluster.PRESETS.items():
        if config.model not in models.values():
            models[f"{name}'s model"] = config.model
    return models


def _model_name(config) -> str:
    return next(name for name, model in cluster_models().items() if model == config.model)


def _config(preset: str, model: str | None, changes: dict):
    """`cluster.preset(preset, **changes)` with the model chosen by name and, unless `changes` sets it, the data
    degree dp = gpus // (tp·pp) (a layout whose degrees do not multiply to gpus is then refused by ClusterConfig)."""

    base = cluster.preset(preset)  # refuses an unknown preset by name
    if model is not None:
        models = cluster_models()
        if model not in models:
            raise ValueError(f"model={model!r} unknown; choose from {list(models)}")
        changes = {**changes, "model": models[model]}
    if "dp" not in changes:
        gpus, tp, pp = (changes.get(k, getattr(base, k)) for k in ("gpus", "tp", "pp"))
        if all(type(v) is int and v >= 1 for v in (gpus, tp, pp)):  # else ClusterConfig names the bad one
            changes = {**changes, "dp": max(1, gpus // (tp * pp))}
    return cluster.preset(preset, **changes)


def cluster_estimate(preset: str = "gpt3-175b-1024xA100", model: str | None = None, **changes) -> dict:
    """One step of the cluster `preset` (a key of `cluster.PRESETS`) with `model` (a `cluster_models()` name) and
    any other `ClusterConfig` fields changed (tokens, batch_tokens, gpu, gpus, link, tp, pp, micro_batches, tp_link,
    mfu, …), priced by `cluster.step_time`. Unless given, dp = gpus / (tp·pp).

    Returns a dict: config, step (the StepTime), parts (its seconds by kind, `STEP_PARTS` order), compute, comm
    (the three kinds of communication together), bubble, total, comm_hidden (what a perfect overlap could save),
    days, gpu_hours, mfu (end to end), steps, n_params, model (its name), preset, by_network (the same step under
    every network of `cluster.NETWORKS`, config.network first: {key: StepTime}), and summary (the one-line
    `format_cluster_estimate`). A layout the library refuses raises its ValueError.
    """

    config = _config(preset, model, changes)
    t = cluster.step_time(config)
    others = {key: s for key, s in cluster.network_step_times(config).items() if key != config.network}
    r = {"preset": preset, "model": _model_name(config), "config": config, "step": t, "parts": t.parts(),
         "compute": t.compute, "comm": t.comm, "bubble": t.pp_bubble, "total": t.total, "comm_hidden": t.comm_hidden,
         "days": t.days, "gpu_hours": t.gpu_hours, "mfu": t.mfu, "steps": config.steps, "n_params": config.n_params,
         "by_network": {config.network: t, **others}}
    r["summary"] = format_cluster_estimate(r)
    return r


def format_cluster_estimate(r: dict) -> str:
    """One line saying what `cluster_estimate` found: the layout, the step part by part, days and GPU-hours, then
    the step under each other network."""

    c = r["config"]
    days = f"{r['days']:,.1f}" if r["days"] >= 1 else f"{r['days']:.2g}"
    parts = " + ".join(f"{name} {si(s, 's')}" for name, s in r["parts"].items() if s)
    return (f"{r['model']} ({count(r['n_params'])} params) on {c.gpus:,} × {c.gpu}, dp {c.dp} × tp {c.tp} × pp "
            f"{c.pp}, {c.micro_batches} micro-batch{'es' * (c.micro_batches > 1)} of {c.micro_tokens:,} tokens, "
            f"{cost.LINKS[c.link].name} across nodes, {cluster.NETWORKS[c.network]}: step {si(r['total'], 's')} = "
            f"{parts} → {count(c.tokens)} tokens in {r['steps']:,.0f} steps = {days} days, {r['gpu_hours']:,.0f} "
            f"GPU-hours, end-to-end MFU {r['mfu']:.1%} (arithmetic at {c.mfu:.1%})"
            + "".join(f"; with {cluster.NETWORKS[key]}: step {si(t.total, 's')}, DP all-reduce "
                      f"{si(t.dp_allreduce, 's')}, end-to-end MFU {t.mfu:.1%}"
                      for key, t in r["by_network"].items() if key != c.network))


def _stacked(labels: list[str], steps: list, height: float, left: float):
    """A Figure `height` inches tall of horizontal bars, one per StepTime of `steps`, its parts stacked in
    STEP_PARTS order, the legend under the axis; `left` is the margin for the bar labels (a fraction)."""
    from matplotlib.figure import Figure  # matplotlib loads in about a second: only when a figure is drawn

    from llmlab import plots  # pyplot loads with it: only when a figure is drawn, not on `import llmlab.widgets`

    fig = Figure(figsize=(8, height))  # fixed margins: a layout engine would double the drawing time
    fig.subplots_adjust(left=left, right=0.97, bottom=0.85 / height, top=1 - 0.35 / height)
    ax = fig.add_subplot()
    plots.stacked_bars(ax, labels, {name: [t.parts()[name] for t in steps] for name in STEP_PARTS}, horizontal=True,
                       colors=list(STEP_PARTS.values()))
    ax.invert_yaxis()
    ax.set_xlabel("seconds per optimizer step (nothing overlapped)")
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, ncol=len(STEP_PARTS), loc="lower center")
    return fig, ax


def cluster_step_figure(r: dict):
    """A matplotlib Figure (not attached to pyplot): `r`'s step under each network of `r["by_network"]` (its own
    first) as stacked bars of its parts, with the best a perfect overlap of communication and compute could do for
    its own network as a dashed line."""
    steps = r["by_network"]
    fig, ax = _stacked([cluster.NETWORKS[key] for key in steps], list(steps.values()), height=1.5 + 0.35 * len(steps),
                       left=0.27)
    ax.tick_params(axis="y", labelsize=7)
    ax.axvline(r["total"] - r["comm_hidden"], color="k", ls="--", lw=1)
    ax.set_title(f"{r['model']} on {r['config'].gpus:,} × {r['config'].gpu}: {si(r['total'], 's')} per step "
                 f"(dashed: {si(r['total'] - r['comm_hidden'], 's')} with communication fully overlapped)",
                 fontsize=9)
    return fig


def link_step_figure(times: dict):
    """A matplotlib Figure (not attached to pyplot): one stacked bar per link of `times` (link key → StepTime,
    as `cluster.link_step_times` returns), labelled with the link's name and per-direction bandwidth."""

    if not times:
        raise ValueError("times is empty: give {link key: StepTime}, e.g. cluster.link_step_times(config)")
    labels = [f"{cost.LINKS[k].name}, {si(1 / cost.LINKS[k].beta, 'B/s')} per direction" for k in times]
    height = 1.2 + 0.35 * len(times)  # inches: the title, the axis and the legend, then a bar per link
    fig, ax = _stacked(labels, list(times.values()), height=height, left=0.36)
    ax.tick_params(axis="y", labelsize=7)
    c = next(iter(times.values())).config
    ax.set_title(f"one step of {count(c.n_params)} params on {c.gpus} × {c.gpu} (dp {c.dp} × tp {c.tp} × pp {c.pp}) "
                 f"by the link across nodes, {cluster.NETWORKS[c.network]}", fontsize=9)
    return fig


def _options(values, stops, label) -> list[tuple[str, float]]:
    """Slider stops: `stops` with every value of `values` among them, as (label, value) pairs."""
    return [(label(v), v) for v in sorted(set(stops) | set(values))]


def cluster_calculator(preset: str = "gpt3-175b-1024xA100", model: str | None = None, **changes):
    """A cluster-calculator widget over `cluster_estimate`, starting from `preset` with `model` and `changes`
    (fields of CALCULATOR_FIELDS): choosing a preset sets every control to it; the other controls change one field
    at a time. A layout the library refuses (degrees not dividing the GPUs, a tensor degree not dividing the heads
    or the GPUs of a node, nodes not all full, more stages than layers, a batch not split evenly) says why instead of
    raising.

    `.result` (HTML) holds the summary line, `.plot` (an Image widget) the stacked bar, `.controls` maps argument
    names to the controls, `.estimate()` returns the current `cluster_estimate` dict.
    """
    import ipywidgets as w  # only when a widget is built: `import llmlab.widgets` loads no Jupyter

    unknown = sorted(set(changes) - set(CALCULATOR_FIELDS))
    if unknown:
        raise ValueError(f"{unknown} have no control; the calculator sets {', '.join(CALCULATOR_FIELDS)}")
    first = cluster_estimate(preset, model, **changes)  # refuse bad defaults before building
    start, presets = first["config"], cluster.PRESETS.values()
    style, layout = {"description_width": "130px"}, w.Layout(width="420px")

    def slider(field: str, stops, description: str, label=lambda v: f"{v:,}"):
        options = _options([getattr(start, field), *(getattr(p, field) for p in presets)], stops, label)
        return w.SelectionSlider(options=options, value=getattr(start, field), description=description, style=style,
                                 layout=layout, continuous_update=False)

    links = [(link.name, key) for key, link in cost.LINKS.items()]
    networks = [(name, key) for key, name in cluster.NETWORKS.items()]
    controls = {
        "preset": w.Dropdown(options=list(cluster.PRESETS), value=preset, description="preset", style=style,
                             layout=layout),
        "model": w.Dropdown(options=list(cluster_models()), value=first["model"], description="model", style=style,
                            layout=layout),
        "tokens": slider("tokens", [v for _, v in choices(start.tokens, range(9, 14), count)], "training tokens",
                         count),
        "batch_tokens": slider("batch_tokens", [2**e for e in range(16, 25)], "batch (tokens/step)"),
        "gpu": w.Dropdown(options=list(SPECS), value=start.gpu, description="GPU", style=style, layout=layout),
        "gpus": w.BoundedIntText(value=start.gpus, min=1, max=1 << 20, description="GPUs", style=style,
                                 layout=layout),
        "tp": slider("tp", [2**e for e in range(5)], "tensor parallel tp"),
        "pp": slider("pp", [2**e for e in range(7)], "pipeline stages pp"),
        "micro_batches": slider("micro_batches", [2**e for e in range(10)], "micro-batches"),
        "link": w.Dropdown(options=links, value=start.link, description="link across nodes", style=style,
                           layout=layout),
        "tp_link": w.Dropdown(options=links, value=start.tp_link, description="link inside a node", style=style,
                              layout=layout),
        "network": w.Dropdown(options=networks, value=start.network, description="network", style=style,
                              layout=layout),
        "gpus_per_node": slider("gpus_per_node", [1, 2, 4, 8, 16], "GPUs per node"),
        "mfu": w.FloatSlider(value=start.mfu, min=0.01, max=1.0, step=0.01, readout_format=".2f",
                             description="MFU of the arithmetic", style=style, layout=layout, continuous_update=False),
    }
    loading = [False]  # while a preset sets every control: one redraw at the end, not one per control

    def current() -> dict:
        v = {name: c.value for name, c in controls.items()}
        return cluster_estimate(v.pop("preset"), **v)

    def follow(change, update) -> None:
        if not loading[0]:
            update()

    def preset_chosen(change, update) -> None:
        loading[0] = True
        try:
            r = cluster_estimate(change["new"])
            controls["model"].value = r["model"]
            for name in CALCULATOR_FIELDS:
                controls[name].value = getattr(r["config"], name)
        finally:
            loading[0] = False
        update()

    handlers = {name: follow for name in controls} | {"preset": preset_chosen}
    columns = list(controls.values())
    box = result_explorer(controls, current, lambda r: r["summary"], cluster_step_figure, handlers=handlers,
                          refused="cannot lay out this cluster",
                          layout=[w.HBox([w.VBox(columns[:7]), w.VBox(columns[7:])])])
    box.estimate = current
    return box
