"""The workbook's drawing helpers: each takes data already computed (a timeline, bytes per parameter, measured
times) and draws it, so that a chapter cell keeps the technique and one call.

- `plot_timeline`: spans on lanes (`llmlab.timeline.Timeline`): a pipeline's forwards and backwards per stage,
  a rank's compute and communication.
- `stacked_bars`: one bar per label, stacked from parts (memory by category, a step's time by phase).
- Diagrams of chapter 2 and 3: `data_parallel_diagram`, `weight_split`, `flow_chart`, `sharded_state`.
- Figures of measurements and models: `roofline` (chapters 1 and 5), `tile_orders` (chapter 1's GEMM tile order),
  `ring_steps`, `traffic` and `allreduce_sweep` (chapter 4).

A helper draws onto `ax` when given one (a widget's own `Figure`, a panel of a larger figure) and otherwise makes
a pyplot figure, which a notebook shows with `plt.show()`. Only matplotlib and numpy: no other llmlab module above
the base layer.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from llmlab import validation
from llmlab.timeline import Timeline

__all__ = ["plot_timeline", "stacked_bars", "data_parallel_diagram", "weight_split", "flow_chart", "sharded_state",
           "roofline", "tile_orders", "ring_steps", "traffic", "allreduce_sweep"]

_NUMBERED = 1 / 80  # a span is numbered when it is at least this share of the timeline's makespan: readable


def plot_timeline(timeline: Timeline, ax=None, *, title: str | None = None, xlabel: str = "time", scale: float = 1.0,
                  split_kinds: bool = False, legend: bool = False):
    """One row per lane of `timeline`, a bar per span coloured by kind (C0, C1, … in the order the kinds first start)
    and numbered by its item (micro-batch, layer) where it is wide enough; returns the Axes.

    Time runs from the timeline's first start, multiplied by `scale` (1e3: milliseconds). `split_kinds` gives each
    kind its own band of the row, for kinds that run at the same time (compute and communication); `legend` names
    the kinds. The default title is the idle share (a pipeline's bubble).
    """
    if not isinstance(timeline, Timeline):
        raise ValueError(f"timeline must be an llmlab.timeline.Timeline, got {type(timeline).__name__}")
    validation.positive("scale", scale)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 + (0.7 if split_kinds else 0.45) * len(timeline.lanes)))
    t0, kinds = timeline.start, timeline.kinds
    band = 0.8 / len(kinds) if split_kinds else 0.8
    for i, kind in enumerate(kinds):
        spans = [s for s in timeline.spans if s.kind == kind]
        offset = -0.4 + (i + 0.5) * band if split_kinds else 0.0  # the row's y grows downwards (inverted below)
        ys = [s.lane + offset for s in spans]
        ax.barh(ys, [s.duration * scale for s in spans], left=[(s.start - t0) * scale for s in spans],
                height=band * (0.85 if split_kinds else 1.0), color=f"C{i}", edgecolor="white", label=kind)
        for s, y in zip(spans, ys, strict=True):
            if s.duration >= _NUMBERED * timeline.makespan:
                ax.text((s.start - t0 + s.duration / 2) * scale, y, str(s.item), ha="center", va="center",
                        fontsize=7, color="white")
    ax.set_yticks(timeline.lanes, [f"{timeline.lane_name} {lane}" for lane in timeline.lanes])
    ax.set(xlabel=xlabel, title=f"idle {timeline.idle:.0%}" if title is None else title)
    ax.invert_yaxis()
    if legend:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    return ax


def stacked_bars(ax, labels: Sequence[str], parts: Mapping[str, Sequence[float]], *, horizontal: bool = False,
                 colors: Sequence[str] | None = None) -> dict:
    """One bar per label, stacked from `parts` (a part's name → one value per label) in their order, each part
    labelled for a legend; horizontal bars grow rightwards from the left. Returns part → its BarContainer."""
    labels = list(labels)
    if not parts:
        raise ValueError("parts must name at least one part")
    for name, values in parts.items():
        if len(values) != len(labels):
            raise ValueError(f"parts[{name!r}] has {len(values)} values for {len(labels)} labels")
    if colors is not None and len(colors) != len(parts):
        raise ValueError(f"colors has {len(colors)} colours for {len(parts)} parts")
    base, bars = np.zeros(len(labels)), {}
    for i, (name, values) in enumerate(parts.items()):
        color = None if colors is None else colors[i]
        values = np.asarray(values, dtype=float)
        if horizontal:
            bars[name] = ax.barh(labels, values, left=base, color=color, label=name)
        else:
            bars[name] = ax.bar(labels, values, bottom=base, color=color, label=name)
        base = base + values
    return bars


def data_parallel_diagram(ranks: int = 4, ax=None, title: str = "data parallelism: split the batch, average the "
                                                                   "gradients"):
    """Data parallelism as boxes: each of `ranks` ranks runs the whole model on its slice of the batch, then one
    all-reduce averages the gradients. Returns the Axes."""
    validation.integer("ranks", ranks, low=1, high=8, hint="(the boxes must fit side by side)")
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 2.6))
    for r in range(ranks):
        x0 = r * 2.4
        ax.add_patch(Rectangle((x0, 1.6), 2.0, 0.7, color=f"C{r}", alpha=0.25))
        ax.text(x0 + 1.0, 1.95, f"batch rows {r}/{ranks} … {r + 1}/{ranks}", ha="center", va="center", fontsize=8)
        ax.add_patch(Rectangle((x0, 0.7), 2.0, 0.7, fc="white", ec="k"))
        ax.text(x0 + 1.0, 1.05, f"rank {r}: whole model\nforward + backward", ha="center", va="center", fontsize=8)
        ax.annotate("", (x0 + 1.0, 0.35), (x0 + 1.0, 0.7), arrowprops=dict(arrowstyle="->"))
        ax.text(x0 + 1.05, 0.5, f"∇L{r}", fontsize=8)
    width = 2.4 * ranks - 0.4
    ax.add_patch(Rectangle((0, -0.2), width, 0.55, color="grey", alpha=0.3))
    total = " + ".join(f"∇L{r}" for r in range(ranks))
    ax.text(width / 2, 0.07, f"all-reduce, then ÷ N:  every rank gets ({total}) / {ranks}  →  the same optimizer "
            "step everywhere", ha="center", va="center", fontsize=8)
    ax.set(xlim=(-0.2, 2.4 * ranks), ylim=(-0.3, 2.4))
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    return ax


def weight_split(ax, ranks: int, by: str, title: str = ""):
    """A (out × in) weight as nn.Linear stores it, split over `ranks` ranks by output rows (`by="out"`, column
    parallel) or input columns (`by="in"`, row parallel), each shard named A_r."""
    validation.integer("ranks", ranks, low=1, high=8, hint="(the shards must stay readable)")
    validation.one_of("by", by, ("out", "in"))
    out_f, in_f = 4.0, 2.0
    for r in range(ranks):
        if by == "out":
            ax.add_patch(Rectangle((0, out_f - (r + 1) * out_f / ranks), in_f, out_f / ranks, color=f"C{r}",
                                   alpha=0.6))
            ax.text(in_f / 2, out_f - (r + 0.5) * out_f / ranks, f"A_{r}: rank {r}", ha="center", va="center",
                    fontsize=8)
        else:
            ax.add_patch(Rectangle((r * in_f / ranks, 0), in_f / ranks, out_f, color=f"C{r}", alpha=0.6))
            ax.text((r + 0.5) * in_f / ranks, out_f / 2, f"A_{r}\nrank {r}", ha="center", va="center", fontsize=8)
    ax.add_patch(Rectangle((0, 0), in_f, out_f, fill=False, ec="k"))
    ax.set(xlim=(-0.3, in_f + 0.3), ylim=(-0.3, out_f + 0.3), title=title, xlabel="in features",
           ylabel="out features")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.title.set_fontsize(9)
    return ax


def flow_chart(ax, steps: Sequence[tuple[str, bool]], title: str = ""):
    """`steps` (label, highlighted) as boxes from top to bottom joined by arrows; highlighted ones (a
    communication) shaded red."""
    if not steps:
        raise ValueError("steps must hold at least one (label, highlighted) pair")
    top = len(steps) - 1
    for i, (label, highlighted) in enumerate(steps):
        y = top - i
        ax.add_patch(Rectangle((0.05, y - 0.3), 2.7, 0.6, fc="C3" if highlighted else "white",
                               alpha=0.3 if highlighted else 1, ec="k"))
        ax.text(1.4, y, label, ha="center", va="center", fontsize=7.5)
        if i:
            ax.annotate("", (1.4, y + 0.3), (1.4, y + 0.7), arrowprops=dict(arrowstyle="->"))
    ax.set(xlim=(0, 2.8), ylim=(-0.5, top + 0.5), title=title)
    ax.title.set_fontsize(9)
    ax.axis("off")
    return ax


def sharded_state(bytes_per_param: Mapping[str, float], sharded: Mapping[str, Collection[str]], ranks: int, *,
                  totals: Mapping[str, float] | None = None, labels: Mapping[str, str] | None = None,
                  title: str = "", ax=None):
    """Model state per GPU as bars: one row per configuration (`sharded`: row label → the parts it shards, e.g.
    "ZeRO-1" → {"optimizer_state"}), one dotted box per rank holding a bar per part of `bytes_per_param` (part →
    bytes per parameter, in drawing order), divided by `ranks` where the row shards it; a shard wide enough is
    numbered by its owner. A row of `totals` (row → bytes per parameter on one GPU) ends with that number (as
    "…Ψ per GPU", Ψ the parameter count); `labels` names the parts in the legend. Returns the Axes."""
    validation.integer("ranks", ranks, low=1, high=8, hint="(the boxes must fit side by side)")
    if not bytes_per_param or not sharded:
        raise ValueError("bytes_per_param and sharded must each name at least one part and row")
    for row, parts in sharded.items():
        unknown = set(parts) - set(bytes_per_param)
        if unknown:
            raise ValueError(f"sharded[{row!r}] names {sorted(unknown)}, not parts of bytes_per_param "
                             f"{list(bytes_per_param)}")
    labels = labels or {}
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.7 * len(sharded)))
    full = sum(bytes_per_param.values())  # a rank's box: everything unsharded
    step = full * 1.1
    for i, (row, parts) in enumerate(sharded.items()):
        y0 = len(sharded) - 1 - i
        for rank in range(ranks):
            x0, col = rank * step, 0.0
            for j, (key, per) in enumerate(bytes_per_param.items()):
                width = per / (ranks if key in parts else 1)
                ax.add_patch(Rectangle((x0 + col, y0), width, 0.6, color=f"C{j}", alpha=0.85,
                                       label=labels.get(key, key) if i == 0 and rank == 0 else None))
                if key in parts and width >= full / 16:  # wide enough to name its owner
                    ax.text(x0 + col + width / 2, y0 + 0.3, f"{rank}", ha="center", va="center", fontsize=6,
                            color="w")
                col += width
            ax.add_patch(Rectangle((x0, y0), full, 0.6, fill=False, ec="grey", lw=0.5, ls=":"))
        ax.text(-full / 32, y0 + 0.3, row, ha="right", va="center", fontsize=9)
        if row in (totals or {}):
            ax.text(ranks * step - full / 16, y0 + 0.3, f"{totals[row]:g}Ψ per GPU", va="center", fontsize=8)
    for rank in range(ranks):
        ax.text(rank * step + full / 2, len(sharded) - 0.2, f"GPU {rank}", ha="center", fontsize=9)
    ax.set(xlim=(-full / 3.2, ranks * step + full / 2), ylim=(-0.2, len(sharded) + 0.1))
    ax.axis("off")
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.45, -0.18), ncol=len(bytes_per_param))
    ax.set_title(title, fontsize=9)
    return ax


def tile_orders(orders: Mapping[str, Sequence[tuple[int, int]]], wave: int,
                panels: Mapping[str, Mapping[int, float]]):
    """The order in which programs compute the tiles of C, one panel per order of `orders` (name → the (row, column)
    of the tile that program id 0, 1, … computes), the first `wave` programs shaded; and, last, `panels` (name →
    {programs running at once: the A + B panels a wave of them reads}) as lines. Returns the Figure."""
    if not orders:
        raise ValueError("orders must hold at least one tile order")
    validation.positive_int("wave", wave)
    if set(panels) != set(orders):
        raise ValueError(f"panels must have the orders' names {list(orders)}, got {list(panels)}")
    fig, axes = plt.subplots(1, len(orders) + 1, figsize=(4 * (len(orders) + 1), 3.8))
    for ax, (name, order) in zip(axes, orders.items(), strict=False):
        grid = np.zeros((max(m for m, _ in order) + 1, max(n for _, n in order) + 1), dtype=int)
        for pid, (pm, pn) in enumerate(order):
            grid[pm, pn] = pid
        ax.imshow(grid < wave, cmap="Blues", vmin=0, vmax=1.6)
        for (pm, pn), pid in np.ndenumerate(grid):
            ax.text(pn, pm, pid, ha="center", va="center", fontsize=7)
        ax.set(title=name, xlabel="pid_n (column of tiles)", ylabel="pid_m (row of tiles)")
    ax = axes[-1]
    for name, per_size in panels.items():
        ax.plot(list(per_size), list(per_size.values()), marker="o", label=name)
    sizes = sorted({size for per_size in panels.values() for size in per_size})
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    ax.set(xticks=sizes, xticklabels=sizes, xlabel="programs running at once", ylabel="A + B panels a wave reads",
           title="less to fetch for the same work")
    ax.legend(fontsize=8)
    fig.suptitle(f"program id of each tile of C; shaded: the first wave of {wave} programs", fontsize=10)
    fig.tight_layout()
    return fig


def allreduce_sweep(sizes: Sequence[float], seconds: Mapping[str, Sequence[float]],
                    busbw: Mapping[str, Sequence[float]], *, model: Mapping[str, Sequence[float]] | None = None,
                    model_sizes: Sequence[float] = (), crossovers: Mapping[str, float | None] | None = None,
                    title: str = ""):
    """Two panels over message size: the seconds per all-reduce of each implementation (`seconds`: name → one per
    size) with a model's prediction for some of them (`model`: name → seconds at each of `model_sizes`, drawn as a
    line in that implementation's colour) and vertical lines at `crossovers` (label → size; None is not drawn);
    and the bus bandwidth (`busbw`: name → bytes/s per size). Returns the Figure."""
    colours = {impl: f"C{i}" for i, impl in enumerate(seconds)}
    for name, values in (*seconds.items(), *busbw.items()):
        if len(values) != len(sizes):
            raise ValueError(f"{name} has {len(values)} values for {len(sizes)} sizes")
    model = model or {}
    for name, values in model.items():
        if name not in colours:
            raise ValueError(f"model[{name!r}] is not an implementation of seconds: {list(seconds)}")
        if len(values) != len(model_sizes):
            raise ValueError(f"model[{name!r}] has {len(values)} values for {len(model_sizes)} model_sizes")
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for impl, colour in colours.items():
        ax_t.plot(sizes, seconds[impl], "o", color=colour, label=f"{impl}, measured")
        if impl in busbw:
            ax_b.plot(sizes, np.array(busbw[impl]) / 1e9, "o-", color=colour, label=impl)
    for impl, values in model.items():
        ax_t.plot(model_sizes, values, "-", color=colours[impl], lw=1, label=f"{impl}, α-β fit")
    for (label, size), style in zip((crossovers or {}).items(), (":", "--", "-."), strict=False):
        if size is not None:
            ax_t.axvline(size, color="C3", ls=style, label=label)
    ax_t.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="seconds per all-reduce",
             title=f"{title}: time" if title else "time")
    ax_b.set(xscale="log", xlabel="message size (bytes)", ylabel="busbw (GB/s)", title="bus bandwidth (nccl-tests)")
    ax_t.legend(fontsize=7)
    ax_b.legend(fontsize=7)
    fig.tight_layout()
    return fig


def roofline(devices: Mapping[str, tuple[float, float]], points: Sequence = (), ax=None, i_range=(0.1, 1e4)):
    """Draw each device's roof (name → (peak FLOP/s, bandwidth B/s)) on log-log axes, with GEMM points
    (`llmlab.hardware.roofline.Point`s: `label`, `intensity`, `measured_flops` and `spread` are read); returns the
    Axes.

    A point with `measured_flops` is drawn at that height, its spread as an error bar; one without is a dotted
    line at its intensity, labelled at the bottom (the roofs above it say what it could reach). The axes' limits
    hold `i_range`, every roof and every measured point with its error bar.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    intensities = [p.intensity for p in points]
    lo, hi = min([i_range[0], *intensities]) / 1.5, max([i_range[1], *intensities]) * 1.5
    xs = np.logspace(np.log10(lo), np.log10(hi), 200)
    heights = []
    for name, (peak, bw) in devices.items():
        roof = np.minimum(peak, xs * bw)
        heights += [roof.min(), roof.max()]
        ax.plot(xs, roof, label=f"{name} (ridge {peak / bw:.0f} FLOP/B)")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte)", ylabel="FLOP/s",
           title="roofline: attainable = min(peak FLOP/s, intensity × bandwidth)")
    for p in points:
        ax.axvline(p.intensity, color="grey", lw=0.6, ls=":")
        if p.measured_flops is not None:
            spread = getattr(p, "spread", 0.0)
            ax.errorbar(p.intensity, p.measured_flops, yerr=[[p.measured_flops * min(spread, 0.9)],
                                                              [p.measured_flops * spread]],
                        fmt="o", ms=7, capsize=3, label=f"{p.label}: measured")
            heights += [p.measured_flops * (1 - min(spread, 0.9)), p.measured_flops * (1 + spread)]
    ax.set(xlim=(lo, hi), ylim=(min(heights) / 2, max(heights) * 2) if heights else None)
    bottom = ax.get_ylim()[0]  # read once the axes are logarithmic and every roof and point is drawn
    for p in points:
        if p.measured_flops is None:
            ax.annotate(p.label, (p.intensity, bottom), rotation=90, fontsize=7, va="bottom")
    ax.legend(fontsize=7)
    return ax


def ring_steps(per_rank: Sequence[Sequence], states: np.ndarray, fig=None):
    """The ring all-reduce step by step: a panel per step, rows are ranks, columns chunks, colour = how many ranks'
    shares the copy sums; the outlined cell is the chunk the rank sends at the next step. `per_rank`: each rank's
    steps (`llmlab.dist.trace.ring_steps`, their `sent_chunk` is read), `states`: `trace.ring_states(per_rank)`.
    Returns the Figure."""
    n = len(per_rank)
    counts = np.vectorize(lambda m: bin(int(m)).count("1"))(states)  # (steps+1, n, n)
    panels = len(states)
    if fig is None:
        fig = plt.figure(figsize=(1.9 * panels, 2.6))
    axes = fig.subplots(1, panels)
    for s, ax in enumerate(axes):
        ax.imshow(counts[s], cmap="Blues", vmin=0, vmax=n + 0.5)
        for rank in range(n):
            for c in range(n):
                ranks = "".join(str(r) for r in range(n) if states[s, rank, c] >> r & 1)
                ax.text(c, rank, ranks, ha="center", va="center", fontsize=7,
                        color="white" if counts[s, rank, c] > n / 2 else "black")
            if s < panels - 1:
                step = per_rank[rank][s]
                ax.add_patch(Rectangle((step.sent_chunk - 0.5, rank - 0.5), 1, 1, fill=False, ec="C3", lw=2))
        phase = "start" if s == 0 else ("reduce-scatter" if s <= n - 1 else "all-gather")
        ax.set_title(f"{phase}\nafter step {s}" if s else phase, fontsize=8)
        ax.set_xticks(range(n), [f"c{c}" for c in range(n)], fontsize=7)
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)] if s == 0 else [], fontsize=7)
    fig.suptitle(f"ring all-reduce on {n} ranks: digits = the ranks whose shares a copy sums; red = sent next",
                 fontsize=9)
    return fig


def traffic(matrices: Mapping[str, np.ndarray], nbytes: int, fig=None):
    """A heat map of bytes sent, src × dst, per algorithm (`llmlab.dist.trace.traffic_matrix`), and each rank's
    bytes sent + received, in units of the buffer size S = `nbytes`. Returns the Figure."""
    if fig is None:
        fig = plt.figure(figsize=(3.0 * len(matrices) + 3.6, 2.9))
    axes = fig.subplots(1, len(matrices) + 1, gridspec_kw={"width_ratios": [1] * len(matrices) + [1.4]})
    top = max(m.max() for m in matrices.values()) / nbytes
    for ax, (name, m) in zip(axes, matrices.items(), strict=False):
        ax.imshow(m / nbytes, cmap="Oranges", vmin=0, vmax=top)
        n = len(m)
        for i in range(n):
            for j in range(n):
                if m[i, j]:
                    ax.text(j, i, f"{m[i, j] / nbytes:.2g}", ha="center", va="center", fontsize=7,
                            color="white" if m[i, j] / nbytes > top / 2 else "black")
        ax.set(title=f"{name}: {m.sum() / nbytes:.3g}·S in all", xlabel="to rank", ylabel="from rank",
               xticks=range(n), yticks=range(n))
    ax = axes[-1]
    width = 0.8 / len(matrices)
    for k, (name, m) in enumerate(matrices.items()):
        per_rank = (m.sum(1) + m.sum(0)) / nbytes  # sent + received, per rank
        ax.bar(np.arange(len(m)) + (k - (len(matrices) - 1) / 2) * width, per_rank, width, label=name)
    ax.set(title="per rank: sent + received", xlabel="rank", ylabel="× S", xticks=range(len(m)))
    ax.legend(fontsize=7)
    fig.suptitle(f"bytes sent by one all-reduce of S = {nbytes / 2**20:g} MiB, in units of S (CommLog)", fontsize=9)
    fig.subplots_adjust(left=0.05, right=0.98, bottom=0.18, top=0.8, wspace=0.35)
    return fig
