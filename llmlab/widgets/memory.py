"""Chapter 3's explorer (memory): the planner over llmlab.memory.planner, for published models and the chapter's GPT.

It imports what it needs (torch, llmlab.model) inside its functions.
"""

from __future__ import annotations

from llmlab import flops, validation
from llmlab.hardware import SPECS
from llmlab.memory import planner
from llmlab.model import GPTConfig
from llmlab.widgets.base import count, gpu_spec, result_explorer

__all__ = ["MEMORY_MODELS", "memory_model_config", "MEMORY_CATEGORIES", "memory_plan", "format_memory_plan",
           "memory_plan_figure", "memory_planner"]

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
                     "activations": "activations", "recompute": "recompute (one block or core)",
                     "logits": "logits (B·T·V)"}
# planner.CHECKPOINTING's modes, as format_memory_plan says them
_RECOMPUTE_SAYS = {"none": "no checkpointing", "selective": "the attention core recomputed (selective)",
                   "full": "every block checkpointed"}


def memory_model_config(model: str):
    """The `GPTConfig` of a MEMORY_MODELS name (also the models of chapter 5's cluster calculator)."""

    if model not in MEMORY_MODELS:
        raise ValueError(f"model={model!r} unknown; choose from {list(MEMORY_MODELS)}")
    fields = MEMORY_MODELS[model]
    return GPTConfig.preset(fields["preset"]) if "preset" in fields else GPTConfig(**fields)


def memory_plan(model: str = "GPT-3 6.7B", batch_size: int = 1, seq_len: int | None = None, stage: int = 0,
                data: int = 8, checkpointing: bool | str = False, tensor: int = 1, gpu: str = "A100 SXM") -> dict:
    """The memory per GPU of training `model` (a MEMORY_MODELS name) in mixed precision with Adam:
    micro-batches of `batch_size` sequences of `seq_len` tokens (default: the model's block_size), ZeRO `stage`
    over `data` data-parallel GPUs, `tensor`-way tensor parallelism, `checkpointing` one of the planner's
    CHECKPOINTING ("none", "selective": the attention core recomputed, "full": every block; or False / True)
    (`llmlab.memory.planner.plan`, 16-bit activations, 1-byte dropout masks as on CUDA), against `gpu`'s memory
    from the spec sheet (llmlab.hardware.SPECS[gpu].memory_bytes: an "80 GB" card holds 80 GiB = 85.9e9 bytes; figures
    here in GB = 1e9 bytes; the CUDA context's ≈0.5 GB is not counted).

    Returns a dict: plan (the planner.Plan), breakdown (its bytes by category), total, memory (the GPU's bytes),
    fits, by_stage (the Plan of every ZeRO stage 0–3 with the rest unchanged), num_params, config, and the inputs.
    """

    config = memory_model_config(model)
    spec = gpu_spec(gpu)
    planner.checkpointing_mode(checkpointing)  # refuses anything else, naming the argument
    T = config.block_size if seq_len is None else seq_len
    by_stage = {s: planner.plan(config, batch_size, T, stage=s, data=data, tensor=tensor,
                                checkpointing=checkpointing) for s in range(4)}
    validation.integer("stage", stage, 0, 3, hint="(the ZeRO stage; 0 is plain data parallel)")
    p, memory = by_stage[stage], spec.memory_bytes  # the capacity, GiB-based (specs.py)
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
    return (f"{r['model']} ({count(r['num_params'])} params), micro-batch {r['batch_size']} × {r['seq_len']} "
            f"tokens, ZeRO-{r['stage']} over {r['data']} GPU{'s' * (r['data'] > 1)}, tensor parallel "
            f"{r['tensor']}, {_RECOMPUTE_SAYS[planner.checkpointing_mode(r['checkpointing'])]}: "
            f"{parts} = {_gb(r['total'])} per GPU → {verdict} {r['gpu']} ({gpu_spec(r['gpu']).memory_gb:g} GB "
            f"as sold: {_gb(r['memory'])})")


def memory_plan_figure(r: dict):
    """A matplotlib Figure (not attached to pyplot): one stacked bar per ZeRO stage of `r`'s configuration (the
    chosen stage solid), by category, with the GPU's memory as a dashed line."""
    from matplotlib.figure import Figure  # matplotlib loads in about a second: only when a figure is drawn
    from matplotlib.lines import Line2D  # matplotlib loads in about a second: only when a figure is drawn
    from matplotlib.patches import Patch  # matplotlib loads in about a second: only when a figure is drawn

    from llmlab import plots  # pyplot loads with it: only when a figure is drawn, not on `import llmlab.widgets`

    fig = Figure(figsize=(7.5, 3.2))  # fixed margins: a layout engine would double the drawing time
    fig.subplots_adjust(left=0.14, right=0.98, bottom=0.33, top=0.88)
    ax = fig.add_subplot()
    plans = r["by_stage"]
    bars = plots.stacked_bars(ax, [f"ZeRO-{s}" if s else "ZeRO-0 (DP)" for s in plans],
                              {key: [p.breakdown()[key] / 1e9 for p in plans.values()] for key in MEMORY_CATEGORIES},
                              horizontal=True, colors=[f"C{i}" for i in range(len(MEMORY_CATEGORIES))])
    for part in bars.values():
        for s, bar in zip(plans, part, strict=True):
            bar.set_alpha(1.0 if s == r["stage"] else 0.3)
    ax.axvline(r["memory"] / 1e9, color="k", ls="--", lw=1)
    ax.invert_yaxis()
    ax.set_xlim(0, max(max(p.total for p in plans.values()) / 1e9, r["memory"] / 1e9) * 1.08)
    ax.set_xlabel("GB per GPU (1 GB = 1e9 bytes)")
    verdict = "fits" if r["fits"] else "does not fit"
    ax.set_title(f"{r['model']}, ZeRO-{r['stage']} × {r['data']}, t = {r['tensor']}: {_gb(r['total'])} per GPU, "
                 f"{verdict}", fontsize=9)
    handles = [Patch(color=f"C{i}", label=label) for i, label in enumerate(MEMORY_CATEGORIES.values())]
    handles.append(Line2D([], [], color="k", ls="--", lw=1, label=f"{r['gpu']}: {r['memory'] / 1e9:.1f} GB"))
    ax.legend(handles=handles, fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    return fig


_MEMORY_SEQ = (None, 64, 128, 256, 512, 1024, 2048)  # None: the model's block_size (the slider's 0)


def memory_planner(model: str = "GPT-3 6.7B", batch_size: int = 1, seq_len: int | None = None, stage: int = 0,
                   data: int = 8, checkpointing: bool | str = False, tensor: int = 1, gpu: str = "A100 SXM"):
    """A memory-planner widget: model, micro-batch, sequence length, ZeRO stage, data-parallel GPUs N,
    recompute (none, the attention core, every block) and tensor degree → the bytes per GPU by category as
    stacked bars (every stage, the chosen one solid) and whether they fit the chosen GPU (`memory_plan`).

    `.result` (HTML) holds `format_memory_plan(...)`, `.plot` (an Image widget) the figure; `.controls` maps
    argument names to the controls; `.plan()` returns the current `memory_plan` dict. A combination the planner
    refuses (a tensor degree not dividing the heads, a sequence longer than the model's context) says why
    instead of raising.
    """
    import ipywidgets as w  # only when a widget is built: `import llmlab.widgets` loads no Jupyter

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
        "checkpointing": w.ToggleButtons(options=[("none", False), ("attention core", "selective"),
                                                  ("every block", True)],
                                         value={"none": False, "selective": "selective", "full": True}[
                                             planner.checkpointing_mode(checkpointing)],
                                         description="recompute", style={**style, "button_width": "100px"}),
        "gpu": w.Dropdown(options=list(SPECS), value=gpu, description="GPU", style=style, layout=layout),
    }

    def current() -> dict:
        values = {name: c.value for name, c in controls.items()}
        return memory_plan(**{**values, "seq_len": values["seq_len"] or None})

    # e.g. tensor=2 with 25 heads is refused: say so, keep the last figure
    box = result_explorer(controls, current, format_memory_plan, memory_plan_figure, on_release=True,
                          refused="cannot plan this configuration")
    box.plan = current
    return box
