"""Chapter 4's explorer (communication): the α-β model's ring and tree all-reduce over a link (`llmlab.dist.cost`).
"""

from __future__ import annotations

import math

import numpy as np

from llmlab.dist import cost
from llmlab.widgets.base import choices, ibytes, result_explorer, si

__all__ = ["allreduce_cost", "format_allreduce_cost", "allreduce_cost_figure", "allreduce_cost_explorer"]


def _links(links: dict | None) -> dict:
    return {**cost.LINKS, **(links or {})}


def allreduce_cost(n: int, nbytes: float, link: str = "nvlink4", alpha: float | None = None,
                   links: dict | None = None) -> dict:
    """The α-β model's ring and tree all-reduce of `nbytes` on `n` ranks over `link`.

    `link` is a key of `llmlab.dist.cost.LINKS` or of `links` (more `cost.Link`s, e.g. this machine's fitted one,
    `llmlab.dist.allreduce_bench.AllReduceRun.link()`); `alpha` (seconds per message) replaces the link's α when given.
    Returns a dict: ring_s and tree_s (`cost.ring_allreduce_time`, `cost.tree_allreduce_time`), their bus
    bandwidths (nccl-tests' definition, bytes/s), crossover_bytes (below it the tree is faster), faster
    ('ring' or 'tree'), and the inputs with the link's name, α and β.
    """

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
             f"they cross at {ibytes(cross)}: the tree is faster below, the ring above")
    return (f"all-reduce of {ibytes(r['nbytes'])} on {r['n']} ranks over {r['link_name']} "
            f"(α = {si(r['alpha'], 's')}, 1/β = {si(1 / r['beta'], 'B/s')}): ring {si(r['ring_s'], 's')} "
            f"(busbw {si(r['ring_busbw'], 'B/s')}), tree {si(r['tree_s'], 's')} (busbw "
            f"{si(r['tree_busbw'], 'B/s')}) → the {r['faster']} is faster; {where}")


def allreduce_cost_figure(r: dict, measured: dict | None = None):
    """Ring and tree time vs message size on `r`'s link and ranks (the model), `r`'s size marked, and
    `measured` points ({label: [(bytes, seconds), ...]}) overlaid. A matplotlib Figure, not attached to pyplot."""
    from matplotlib.figure import Figure  # matplotlib loads in about a second: only when a figure is drawn

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
        ax.axvline(r["crossover_bytes"], color="C3", ls=":", lw=1, label=f"crossover {ibytes(r['crossover_bytes'])}")
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
    (e.g. `llmlab.dist.allreduce_bench.AllReduceRun.measured()`). Choosing a link sets α to the link's own; the α slider
    then explores other latencies. `.result` (HTML) holds `format_allreduce_cost(...)`, `.plot` (an Image) the
    figure, `.controls` the controls.
    """
    import ipywidgets as w  # only when a widget is built: `import llmlab.widgets` loads no Jupyter

    table = _links(links)
    first = allreduce_cost(n, nbytes, link, alpha, links)  # refuse bad defaults before building
    style, layout = {"description_width": "110px"}, w.Layout(width="480px")
    alphas = choices(first["alpha"], range(-8, -1), lambda v: si(v, "s"))
    alphas = sorted(set(alphas) | {(si(lk.alpha, "s"), lk.alpha) for lk in table.values()}, key=lambda o: o[1])
    controls = {
        "n": w.SelectionSlider(options=choices(n, range(1, 13), str, mantissas=(1,), base=2), value=n,
                               description="ranks N", style=style, layout=layout),
        "nbytes": w.SelectionSlider(options=choices(nbytes, range(5, 18), ibytes, mantissas=(1,),
                                                     base=4), value=nbytes, description="message size",
                                    style=style, layout=layout),
        "link": w.Dropdown(options=[(lk.name, key) for key, lk in table.items()], value=link, description="link",
                           style=style, layout=layout),
        "alpha": w.SelectionSlider(options=alphas, value=first["alpha"], description="α (latency)", style=style,
                                   layout=layout),
    }

    def current() -> dict:
        v = {name: c.value for name, c in controls.items()}
        return allreduce_cost(v["n"], v["nbytes"], v["link"], v["alpha"], links)

    def link_changed(change, update) -> None:
        own = table[change["new"]].alpha
        if controls["alpha"].value == own:
            update()
        else:
            controls["alpha"].value = own  # the new link's own α; moving the slider updates the result

    box = result_explorer(controls, current, format_allreduce_cost, lambda r: allreduce_cost_figure(r, measured),
                          handlers={"link": link_changed})
    box.cost = current
    return box
